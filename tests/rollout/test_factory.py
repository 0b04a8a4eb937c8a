"""rollout.engine: the factory, per-engine validation (no setting accepted and ignored), the GPU example
configs, and the pure vLLM translation functions. Runs without vLLM (the engine itself: tests/rollout_vllm)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import ConfigError, load_config
from hybridflow.config.roles import worker_config
from hybridflow.models.tiny import build_tiny_model, save_tiny_model
from hybridflow.rollout import BuiltinEngine, SamplingParams
from hybridflow.rollout.factory import build_generation_engine, max_sequences_per_call, require_rollout_engine
from hybridflow.rollout.vllm_engine import kv_cache_bytes, outputs_to_tensors, prompts_as_vllm, truncates

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def errors(overrides, check_model=False) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides], check_model=check_model)
    return e.value.errors


def test_builtin_engine_from_config():
    cfg = load_config(None, [*BASE, "rollout.cpu_threads=3"], check_model=False)
    eng = build_generation_engine(worker_config(cfg, "actor_rollout"), build_tiny_model("tiny", "llama"))
    assert isinstance(eng, BuiltinEngine) and eng.config.cpu_threads == 3


def test_settings_an_engine_does_not_use_are_rejected():
    (e,) = errors(["rollout.gpu_memory_utilization=0.4"])
    assert e.startswith("rollout.gpu_memory_utilization:") and "builtin" in e and "\n" not in e
    assert any("sglang" in x and "rollout.engine" in x for x in errors(["rollout.engine=sglang"]))
    # vLLM's TP groups are consecutive ranks: tg < tp under reshard=hybridflow (strided groups) is not
    tg2 = errors(
        ["rollout.engine=vllm", "rollout.tg=2", "actor.parallel.tp=4", "resources.n_gpus_per_node=4"]
    )
    assert any(e.startswith("rollout.tg:") and "consecutive" in e and "tg=4" in e for e in tg2), tg2
    for ok in (["actor.parallel.tp=2"], ["actor.parallel.tp=4", "rollout.reshard=vanilla"]):
        load_config(
            None,
            [*BASE, "rollout.engine=vllm", "rollout.tg=2", "resources.n_gpus_per_node=4", *ok],
            check_model=False,
        )
    (e,) = errors(["rollout.engine=vllm", "rollout.gpu_memory_utilization=1.5"])
    assert e.startswith("rollout.gpu_memory_utilization:")
    # accepted: the setting is one vLLM uses
    load_config(None, [*BASE, "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.3"], check_model=False)


def test_vllm_head_dim_its_cpu_attention_lacks_is_padded_or_rejected(tmp_path):
    from hybridflow.rollout.vllm_pad import padded_head_dim

    assert [padded_head_dim(d) for d in (16, 32, 40, 64, 600)] == [32, None, 64, None, None]
    # head_dim 16: a Llama or Qwen2 is served with heads zero-padded to 32 (rollout/vllm_pad.py)
    for arch in ("llama", "qwen2"):
        path = save_tiny_model(tmp_path / arch, "tiny", arch)
        load_config(None, [*BASE, "rollout.engine=vllm", f"model.path={path}", "resources.device=cpu"])
    # an architecture the padding does not know: one line
    path = save_tiny_model(tmp_path / "m", "tiny", "mistral")  # head_dim 16
    (e,) = errors(["rollout.engine=vllm", f"model.path={path}", "resources.device=cpu"], check_model=True)
    assert e.startswith("rollout.engine:") and "head_dim" in e and "16" in e and "mistral" in e


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*qwen2.5*")))
def test_gpu_example_configs_validate_and_name_existing_engines(name, tmp_path, capsys):
    from hybridflow.cli import main

    model = save_tiny_model(tmp_path / "q", "tiny", "qwen2", max_position_embeddings=4096)
    data = [tmp_path / "train.parquet", tmp_path / "test.parquet"]  # only their existence is checked
    for f in data:
        f.touch()
    files = [f"data.train_files=[{data[0]}]", f"data.val_files=[{data[1]}]"]
    if name.startswith("ppo"):  # the critic starts from the same (here: tiny) model
        files.append(f"model.critic_path={model}")
    assert main(["config", "show", str(EXAMPLES / name), f"model.path={model}", *files]) == 0
    shown = capsys.readouterr().out
    assert "engine: vllm" in shown and "gpu_memory_utilization: 0." in shown


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_not_installed_is_one_line_at_run_start():
    cfg = load_config(None, [*BASE, "rollout.engine=vllm"], check_model=False)
    with pytest.raises(ConfigError) as e:
        require_rollout_engine(cfg)
    assert e.value.errors == [
        "rollout.engine: vllm is not installed in this Python; `make vllm` builds .venv-vllm with it"
    ]


def test_sequences_per_call_sizes_the_vllm_kv_cache():
    cfg = load_config(None, [*BASE, "data.train_batch_size=64", "rollout.n=8"], check_model=False)
    assert max_sequences_per_call(worker_config(cfg, "rollout"), world_size=2) == 32 * 8
    cfg = load_config(
        None,
        [*BASE, "rollout.micro_batch_size_per_device=4", "rollout.n=2", "rollout.val.n=5"],
        check_model=False,
    )
    assert max_sequences_per_call(worker_config(cfg, "rollout"), world_size=2) == 4 * 5
    # 2 layers x K,V x 2 kv heads x head_dim 16 x 4 bytes = 512 bytes/token; 100 tokens -> 7 blocks + 1
    config = build_tiny_model("tiny", "llama").config
    assert kv_cache_bytes(config, torch.float32, 3, 100) == 3 * 8 * 16 * 512


def test_vllm_translation_functions():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompts_as_vllm(ids, mask) == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9, 10]}]
    assert truncates(SamplingParams(top_k=5)) and truncates(SamplingParams(top_p=0.9))
    assert not truncates(SamplingParams(temperature=0.7))

    def completion(index, toks, lps):
        return SimpleNamespace(
            index=index,
            token_ids=toks,
            logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(toks, lps)],
        )

    # completions arrive in any order; rows come out prompt-major, sample-minor
    outs = [
        SimpleNamespace(outputs=[completion(1, [4], [-0.5]), completion(0, [3, 2], [-1.0, -2.0])]),
        SimpleNamespace(outputs=[completion(0, [6, 6, 6], [-0.1] * 3), completion(1, [], [])]),
    ]
    resp, lengths, lps = outputs_to_tensors(outs, SamplingParams(max_new_tokens=3, n=2), pad_token_id=0)
    assert resp.tolist() == [[3, 2, 0], [4, 0, 0], [6, 6, 6], [0, 0, 0]]
    assert lengths.tolist() == [2, 1, 3, 0]
    torch.testing.assert_close(lps[0], torch.tensor([-1.0, -2.0, 0.0]))
    torch.testing.assert_close(lps[1], torch.tensor([-0.5, 0.0, 0.0]))


def test_generation_shards_reach_vllm_as_full_shaped_tensors():
    """vLLM's loaders cut TP rank r's block out of a full tensor: a Megatron-split shard goes in at that
    block's offset, zeros elsewhere; a full tensor passes as it is; anything else is refused."""
    from hybridflow.rollout.vllm_engine import shard_as_full

    tp = SimpleNamespace(size=2, group=None)
    q = torch.arange(12.0).view(3, 4)  # rank 1's half of q_proj's 6 output features
    full = shard_as_full("model.layers.0.self_attn.q_proj.weight", q, (6, 4), rank=1, tp=tp)
    assert full.shape == (6, 4) and torch.equal(full[3:], q) and not full[:3].any()
    o = torch.ones(4, 3)  # rank 0's half of o_proj's 6 input features
    full = shard_as_full("model.layers.0.self_attn.o_proj.weight", o, (4, 6), rank=0, tp=tp)
    assert torch.equal(full[:, :3], o) and not full[:, 3:].any()
    norm = torch.ones(4)
    assert shard_as_full("model.norm.weight", norm, (4,), rank=1, tp=tp) is norm
    with pytest.raises(ValueError, match="not a tg-way block"):
        shard_as_full("model.layers.0.mlp.up_proj.weight", torch.ones(2, 4), (6, 4), rank=0, tp=tp)
