"""`hybridflow train examples/configs/grpo_tiny.yaml rollout.engine=vllm` from the demo's SFT warm start
(examples/demo.py: sft_tiny.yaml, then export), on the demo's own tiny Llama (4 heads, 2 kv heads,
head_dim 16: vLLM serves it with heads zero-padded to 32, rollout/vllm_pad.py; tg=2 splits the kv
heads). The short runs (tg=1 and tg=2) check each step; the full 100-step run holds vLLM to the issue's >= +15
held-out points (77 s for the 100 steps on a quiet machine; it runs in `make test-vllm` and CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.rollout.vllm_engine import available

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"{REASON}")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
ACC = "val/synthetic:arithmetic/acc@1"
# the demo's model (examples/demo.py), served to vLLM padded; its 2 kv heads let rollout.tg=2 split them
SHAPE: dict = {}


def hybridflow(*argv: str) -> None:
    from hybridflow.cli import main

    assert main(list(argv)) == 0, f"hybridflow {' '.join(argv)} failed"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    import ray

    from hybridflow.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("vllm_train")
    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    base = save_tiny_model(out / "tiny", "tiny", "llama", seed=0, **SHAPE)
    hybridflow(
        "train",
        str(CONFIGS / "sft_tiny.yaml"),
        f"model.path={base}",
        f"trainer.output_dir={out}",
        "trainer.loggers=[]",
    )
    hybridflow("export", str(out / "sft_tiny"), "--output", str(out / "sft"))
    yield out
    ray.shutdown()


def grpo(out: Path, name: str, *overrides: str, engine: str = "vllm") -> list[dict]:
    hybridflow(
        "train",
        str(CONFIGS / "grpo_tiny.yaml"),
        f"model.path={out / 'sft'}",
        f"trainer.output_dir={out}",
        f"trainer.experiment_name={name}",
        "trainer.loggers=[jsonl]",
        f"rollout.engine={engine}",
        *overrides,
    )
    return metrics(out / name)


@pytest.fixture(scope="module")
def short_run(warm_start) -> list[dict]:
    return grpo(warm_start, "grpo_vllm_short", "trainer.total_steps=6", "trainer.save_every=0")


def test_grpo_tiny_with_vllm_trains(warm_start, short_run):
    rows = short_run
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 6 and all(r["timing_s/gen"] > 0 for r in steps)
    assert all(1 <= r["response_length/mean"] <= 4 for r in steps)
    # on-policy, old_log_probs are vLLM's rollout_log_probs: the first update's KL to the actor's own
    # log-probs is their mismatch
    assert all(abs(r["actor/ppo_kl"]) < 1e-4 for r in steps)
    # the rollout-correction gap is measured under vLLM too (workers/losses.py), and fp32 vLLM agrees with
    # the training forward: k3 ~ diff^2 / 2 with |diff| ~1e-5, perplexities equal to ~1e-4
    assert all(0 <= r["rollout_corr/k3_kl"] < 1e-4 for r in steps)
    assert all(abs(r["rollout_corr/ppl_ratio"] - 1) < 1e-3 for r in steps)
    assert sum(r["reward/mean"] for r in steps) > 0, "the warm start answers some sums: reward must be > 0"
    vals = [r for r in rows if ACC in r]
    assert vals[0]["step"] == 0 and vals[-1]["step"] == 6
    # the actor moved, and what vLLM generated after the updates came from the new weights: the
    # exported policy differs from the warm start
    hybridflow("export", str(warm_start / "grpo_vllm_short"), "--output", str(warm_start / "grpo_short"))
    from safetensors.torch import load_file

    before = load_file(str(warm_start / "sft" / "model.safetensors"))
    after = load_file(str(warm_start / "grpo_short" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_grpo_with_vllm_tensor_parallel_on_the_resharded_shards(warm_start, short_run):
    """actor.parallel.tp=2 rollout.tg=2: vLLM's own TP over the two actor ranks, each loading its
    3D-HybridEngine generation shard (half of every layer's linear weights)."""
    tp2 = ["actor.parallel.tp=2", "rollout.tg=2", "resources.n_gpus_per_node=2"]
    rows = grpo(warm_start, "grpo_vllm_tg2", "trainer.total_steps=2", "trainer.save_every=0", *tp2)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and sum(r["reward/mean"] for r in steps) > 0
    # the shards loaded are the actor's weights: vLLM's log-probs of its samples equal the TP-sharded
    # actor's own (a wrong or misplaced block would put this KL orders of magnitude higher)
    assert all(abs(r["actor/ppo_kl"]) < 1e-4 for r in steps), [r["actor/ppo_kl"] for r in steps]
    assert all(
        r["reshard/gen_weight_bytes_per_rank"] == r["reshard/formula_gen_weight_bytes_per_rank"]
        for r in steps
    )
    # greedy validation of the warm start: the same answers as vLLM without TP (one near-tie may flip)
    first = next(r[ACC] for r in rows if ACC in r and r["step"] == 0)
    assert abs(first - next(r[ACC] for r in short_run if ACC in r and r["step"] == 0)) <= 0.02


@pytest.mark.timeout(3600)
def test_grpo_tiny_with_vllm_gains_15_points(warm_start):
    """The demo's full grpo_tiny run with vLLM (heads padded 16 -> 32): held-out accuracy +15 points or
    more (measured +21, the built-in engine +26 on this warm start; docs/rollout.md)."""
    rows = grpo(warm_start, "grpo_vllm_full")
    vals = [(r["step"], round(r[ACC], 2)) for r in rows if ACC in r]
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    print(f"vllm held-out acc by step: {vals}; train reward {reward[:10]} .. {reward[-10:]}")
    assert vals[0][0] == 0 and vals[-1][0] == 100 and len(reward) == 100
    assert vals[-1][1] - vals[0][1] >= 0.15, vals
    assert sum(reward[-10:]) / 10 - sum(reward[:10]) / 10 >= 0.1, reward
    # vLLM's log-probs are the actor's (padding is exact) in every step
    assert max(abs(r["actor/ppo_kl"]) for r in rows if "actor/ppo_kl" in r) < 1e-4


def test_grpo_lora_with_vllm_generates_from_the_merged_adapters(warm_start):
    """model.lora with rollout.engine=vllm: before each generate vLLM is streamed the actor's weights with
    the adapters merged (W + scale * B @ A, hybrid_engine/resharder.py), every weight whole."""
    pytest.importorskip("peft", reason="model.lora needs peft (the vllm-cpu extra; `make vllm`)")
    lora = ("model.lora.rank=8", "model.lora.alpha=64", "actor.optim.lr=5e-3", "algorithm.use_kl_loss=true")
    rows = grpo(warm_start, "grpo_vllm_lora", "trainer.total_steps=3", "trainer.save_every=0", *lora)
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3 and sum(r["reward/mean"] for r in steps) > 0
    # vLLM's log-probs of its samples are the adapted actor's after every update (measured |ppo_kl| ~3e-9),
    # while the adapters moved the policy from the base weights that an unmerged load would generate from
    # (KL to them 0.07, 0.15 after steps 1, 2)
    assert all(abs(r["actor/ppo_kl"]) < 1e-4 for r in steps), [r["actor/ppo_kl"] for r in steps]
    assert steps[-1]["actor/kl_loss"] > 0.01
    from safetensors.torch import load_file

    # what vLLM was actually sent per step: every weight, merged, fp32 (the built-in engine is sent nothing;
    # its figure is the adapters' bytes, tests/trainers/test_learning.py)
    whole = sum(t.numel() * 4 for t in load_file(str(warm_start / "sft" / "model.safetensors")).values())
    assert all(r["rollout/weight_update_bytes"] == whole for r in steps)
