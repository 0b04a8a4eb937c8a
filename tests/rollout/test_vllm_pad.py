"""Zero-padding of attention heads for vLLM's CPU kernels (rollout/vllm_pad.py), as pure tensors: the
padded projections give the same attention scores under vLLM's 1/sqrt(P) scaling and the same
output. vLLM itself on the padded model is checked in tests/rollout_vllm/test_vllm_engine.py."""

from __future__ import annotations

import json

import torch

from hybridflow.models.tiny import build_tiny_model
from hybridflow.rollout.vllm_pad import pad_weights, write_padded_config


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:  # [T, n * d] -> [n, T, d]
    return x.reshape(x.shape[0], n, -1).transpose(0, 1)


def test_padded_projections_compute_the_same_attention(tmp_path):
    m = build_tiny_model("tiny", "qwen2", seed=0)  # 4 heads, 2 kv heads, head_dim 16, q/k/v biases
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_()
    cfg, d, P = m.config, 16, 32
    named = dict(m.named_parameters())
    padded = dict(pad_weights(((n, p.detach()) for n, p in named.items()), cfg, P))
    assert padded.keys() == named.keys()
    pre = "model.layers.0.self_attn."
    assert padded[pre + "q_proj.weight"].shape == (4 * P, 64) and padded[pre + "k_proj.bias"].shape == (
        2 * P,
    )
    assert padded[pre + "o_proj.weight"].shape == (64, 4 * P)
    for name in named:  # everything outside attention is untouched
        if "self_attn" not in name:
            assert torch.equal(padded[name], named[name]), name
    x = torch.randn(5, 64)
    with torch.no_grad():
        proj = {k: x @ named[pre + f"{k}_proj.weight"].t() + named[pre + f"{k}_proj.bias"] for k in "qkv"}
    pproj = {k: x @ padded[pre + f"{k}_proj.weight"].t() + padded[pre + f"{k}_proj.bias"] for k in "qkv"}

    def attend(q, k, v, o_w, dim):
        q, k, v = _heads(q, 4), _heads(k, 2).repeat_interleave(2, 0), _heads(v, 2).repeat_interleave(2, 0)
        probs = (q @ k.transpose(1, 2) * dim**-0.5).softmax(-1)
        return (probs @ v).transpose(0, 1).reshape(5, -1) @ o_w.t()

    with torch.no_grad():
        ref = attend(proj["q"], proj["k"], proj["v"], named[pre + "o_proj.weight"], d)
        out = attend(pproj["q"], pproj["k"], pproj["v"], padded[pre + "o_proj.weight"], P)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the padded dims of q, k and v are exactly zero (RoPE leaves them so: vLLM rotates the first d only)
    for k in "qkv":
        assert _heads(pproj[k], 4 if k == "q" else 2)[..., d:].abs().max() == 0

    write_padded_config(cfg, str(tmp_path), P)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["head_dim"] == P and c["rope_parameters"]["partial_rotary_factor"] == d / P
    # vLLM's Qwen2 ignores config.head_dim: served as its Llama with q/k/v biases and no o_proj bias
    assert c["architectures"] == ["LlamaForCausalLM"] and c["qkv_bias"] and not c["attention_bias"]
