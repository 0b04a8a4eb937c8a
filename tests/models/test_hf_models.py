"""HF loading/saving of policy, critic and reward models on the tiny local models (nothing downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.models import (
    init_critic_from_causal_lm,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    save_hf_model,
)
from hybridflow.models.tiny import build_tiny_config, save_tiny_model

sys.path.insert(0, str(Path(__file__).parents[1] / "engines"))
from rl_data import make_rl_batch  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_causal_lm_save_load_round_trip(tmp_path, arch):
    src = save_tiny_model(tmp_path / "src", "tiny", arch, seed=3)
    model, tok = load_causal_lm(src), load_tokenizer(src)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    # RL recomputes log-probs and compares them: no dropout noise (GPT-2's default is 0.1).
    assert all(m.p == 0.0 for m in dropouts)
    assert getattr(model.config, "attention_dropout", 0.0) == getattr(model.config, "attn_pdrop", 0.0) == 0.0
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2=?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>1+2=?<|assistant|>"
    ids = tok([text, "hi"], return_tensors="pt", padding=True)
    assert ids["input_ids"][1, 0] == tok.pad_token_id  # left padding for prompts
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)  # a change that must survive the round trip
        want = model(**ids).logits
    dst = save_hf_model(model, tmp_path / "dst", tokenizer=tok)
    assert (dst / "model.safetensors").is_file()
    again = AutoModelForCausalLM.from_pretrained(dst)  # plain transformers, no hybridflow code
    with torch.no_grad():
        torch.testing.assert_close(again(**ids).logits, want)
    assert load_tokenizer(dst).chat_template == tok.chat_template


def test_critic_from_causal_lm_shares_backbone_and_starts_at_zero(tmp_path):
    src = save_tiny_model(tmp_path / "actor", "tiny", "qwen2", seed=4)
    init_critic_from_causal_lm(src, tmp_path / "critic")
    critic, actor = load_critic(tmp_path / "critic"), load_causal_lm(src)
    assert type(critic).__name__ == "Qwen2ForTokenClassification" and critic.config.num_labels == 1
    for name, value in actor.model.state_dict().items():
        torch.testing.assert_close(critic.model.state_dict()[name], value)
    engine = TrainEngine(critic, EngineConfig(optim=OptimConfig(lr=3e-2)))
    batch = make_rl_batch(critic.config.vocab_size, batch_size=6, seed=1)
    values = engine.compute_values(batch, micro_batch_size=4)
    assert values.shape == batch["responses"].shape and float(values.abs().max()) == 0.0
    returns = torch.ones_like(values)

    def value_loss(out, mb):
        m = mb["response_mask"].float()
        return (((out["values"] - 1.0) ** 2) * m).sum() / m.sum(), {}

    losses = [engine.train_step(batch, value_loss)["loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(1.0) and losses[-1] < 0.5
    # Values are the critic head on the state before each response token (verl's alignment).
    with torch.no_grad():
        hidden = critic.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).last_hidden_state
        want = critic.score(hidden[:, -returns.shape[1] - 1 : -1]).squeeze(-1)
    got = engine.compute_values(batch, max_tokens=40)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_reward_model_from_hf_sequence_classification_checkpoint(tmp_path, arch):
    torch.manual_seed(5)
    hf = AutoModelForSequenceClassification.from_config(build_tiny_config("tiny", arch, num_labels=1))
    hf.save_pretrained(tmp_path / "rm")
    reward = load_reward_model(tmp_path / "rm")
    batch = make_rl_batch(reward.config.vocab_size, batch_size=5, seed=2)
    scores = TrainEngine(reward, trainable=False).compute_scores(batch, micro_batch_size=2)
    assert scores.shape == (5,)
    # HF's own pooling reads the rightmost non-pad token: the same token here (pad id 0, no eos=pad).
    hf.eval()
    with torch.no_grad():
        want = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.squeeze(-1)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)


def test_missing_directory_error_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(TypeError, match="needs a causal_lm model"):
        TrainEngine(
            load_critic(save_tiny_model(tmp_path / "m", "tiny", "llama")), trainable=False
        ).compute_log_probs(make_rl_batch(40, batch_size=2))


def test_a_weights_only_directory_has_no_tokenizer_in_one_line(tmp_path):
    """model.save_pretrained without the tokenizer: named as such where the driver loads the tokenizer
    (before Ray), not as a missing chat template later."""
    from hybridflow.errors import ModelFileError

    model_dir = save_tiny_model(tmp_path / "m", "tiny", "llama")
    assert load_tokenizer(model_dir).chat_template  # the full directory loads
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (Path(model_dir) / name).unlink(missing_ok=True)
    with pytest.raises(
        ModelFileError, match=f"{model_dir} has no tokenizer files .* set model.tokenizer_path"
    ):
        load_tokenizer(model_dir)


_REMOTE_CONFIG = """from transformers import LlamaConfig


class RemoteLlamaConfig(LlamaConfig):
    model_type = "remote-llama"
"""
_REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteLlamaConfig


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    config_class = RemoteLlamaConfig
"""


def test_trust_remote_code_is_passed_to_from_pretrained(tmp_path, monkeypatch):
    """model.trust_remote_code: a directory whose config.json maps to modelling code shipped next to
    it loads only when the flag is set (transformers refuses it otherwise)."""
    import json

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model_dir = save_tiny_model(tmp_path / "remote", size="tiny", arch="llama", seed=0)
    (model_dir / "configuration_remote.py").write_text(_REMOTE_CONFIG)
    (model_dir / "modeling_remote.py").write_text(_REMOTE_MODEL)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "remote-llama"
    cfg["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteLlamaConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteLlamaForCausalLM",
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(model_dir)
    model = load_causal_lm(model_dir, trust_remote_code=True)
    assert type(model).__name__ == "RemoteLlamaForCausalLM"
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_causal_lm(model_dir, device="meta")  # the workers' path: sharded init from the files
    meta = load_causal_lm(model_dir, device="meta", trust_remote_code=True)
    assert type(meta).__name__ == "RemoteLlamaForCausalLM" and all(p.is_meta for p in meta.parameters())
