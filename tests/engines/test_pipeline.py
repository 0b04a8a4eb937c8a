"""Pipeline parallelism (engines/pipeline.py): stages cut from an HF model's decoder layers compute what
the whole model computes.

In one process: every cut's stages chained equal the unsplit forward, with the whole model's parameter
names. On two gloo ranks (one group shared by every case): GPipe, 1F1B and interleaved 1F1B (two stages a
rank) for the actor's clipped policy loss, 1F1B for the critic's clipped value loss and GRPO's loss
(group-normalised advantages, seq-mean-token-mean); on four, p = 2 with
FSDP2 over d = 2 and with t = 2: forward-only outputs, loss, every gradient and the global grad norm
(clipped across the stages) and the weights after one SGD step equal one process's; those weights,
gathered by name, load in transformers and into three other stages. TrainEngine at p = 2 (against
p = 1, d = 2) and, on the four ranks, at p = 2 x t = 2 (against p = 1, d = 4): the reference's, critic's
and reward model's outputs, the critic's update, and checkpoints across p. fp32 and
reductions of at most 64 terms: the only differences are summation order, ~1e-7 relative; 1e-5 / 1e-4
bound them with room.
"""

from __future__ import annotations

import pytest
import torch
from dist_workers import run_group
from pipeline_ranks import (
    BATCH,
    SGD_LR,
    loss_inputs,
    normaliser,
    rl_loss,
    run_engine_case,
    run_mesh_case,
    run_pipeline_case,
)
from rl_data import make_rl_batch

from hybridflow.engines.forward import RLForward
from hybridflow.engines.optim import clip_grad_norm_
from hybridflow.engines.pipeline import (
    StageForward,
    hf_name,
    load_stage_state_dict,
    rank_stages,
    split_stage,
    stage_layer_ranges,
)
from hybridflow.models import load_causal_lm, load_critic, load_reward_model, save_hf_model
from hybridflow.models.tiny import build_tiny_model, save_tiny_model

MICRO = 4  # micro-batches of 2 rows


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A 4-layer tiny Llama and a critic on it with a seeded random value head (a zero head, as
    init_critic_from_causal_lm makes, would leave the backbone without gradients)."""
    root = tmp_path_factory.mktemp("pipeline_models")
    actor = str(save_tiny_model(root / "actor", "tiny", "llama", seed=2, num_hidden_layers=4))
    torch.manual_seed(3)
    save_hf_model(load_critic(actor), root / "critic")
    save_hf_model(load_reward_model(actor), root / "reward")  # its score head seeded as well
    return {"actor": actor, "critic": str(root / "critic"), "reward": str(root / "reward")}


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs["actor"]


def test_layers_split_evenly_in_stage_order():
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="1 <= stages <= the model's 2 layers"):
        stage_layer_ranges(2, 3)
    assert rank_stages(1, 2, 2) == [1, 3] and rank_stages(0, 4) == [0]
    with pytest.raises(ValueError, match="pipeline parallelism runs .* not 'gpt2'; use pp=1"):
        split_stage(build_tiny_model("tiny", "gpt2"), 0, 2)
    with pytest.raises(ValueError, match="tied input and output embeddings .* use pp=1"):
        split_stage(build_tiny_model("tiny", "llama", tie_word_embeddings=True), 0, 2)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_chained_stages_equal_the_whole_model(model_dir, num_stages):
    whole = load_causal_lm(model_dir)
    batch = make_rl_batch(whole.config.vocab_size, **BATCH)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    lr = batch["responses"].shape[1]
    with torch.no_grad():
        want = RLForward(whole, logits_chunk_size=4)(*args, lr)["log_probs"]
        names = set()
        x = args  # each stage's outputs are the next one's inputs; the last returns the log-probs
        for s in range(num_stages):
            stage = StageForward(split_stage(load_causal_lm(model_dir), s, num_stages), s, num_stages)
            stage.configure(lr, logits_chunk_size=4)
            x = stage(*x)
            names |= {hf_name(stage.model, n) for n, _ in stage.model.named_parameters()}
    torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)
    assert names == {n for n, _ in whole.named_parameters()}


def test_interleaved_ranks_chained_equal_the_whole_model(model_dir):
    """Two ranks of two stages each (interleaved: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3),
    each one model cut to its layers: their chunks in stage order equal the whole model, and their
    parameters are the whole model's by name."""
    whole = load_causal_lm(model_dir)
    batch = make_rl_batch(whole.config.vocab_size, **BATCH)
    x = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    lr = batch["responses"].shape[1]
    with torch.no_grad():
        want = RLForward(whole, logits_chunk_size=4)(*x, lr)["log_probs"]
        ranks = [StageForward(split_stage(load_causal_lm(model_dir), rank_stages(r, 2, 2), 4), rank_stages(r, 2, 2), 4)
                 for r in (0, 1)]  # fmt: skip
        for r in ranks:
            r.configure(lr, logits_chunk_size=4)
        for s in range(4):  # stage s is rank s % 2's chunk s // 2
            x = ranks[s % 2](*x, chunk=s // 2)
    torch.testing.assert_close(x, want, atol=1e-6, rtol=1e-6)
    names = [hf_name(r.model, n) for r in ranks for n, _ in r.model.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())
    assert [n for n in names if ".layers." in n and n.endswith("q_proj.weight")] == [
        f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 2, 1, 3)
    ]


def _reference(model_dirs: dict, kind: str) -> dict:
    """The case in one process: the unsplit model, the whole batch, the same loss and clipping."""
    model = load_critic(model_dirs["critic"]) if kind == "critic" else load_causal_lm(model_dirs["actor"])
    batch = make_rl_batch(model.config.vocab_size, **BATCH)
    forward = RLForward(model, logits_chunk_size=4)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"].shape[1])
    key = "values" if kind == "critic" else "log_probs"
    with torch.no_grad():
        outputs = forward(*args)[key]
    loss = rl_loss(kind, normaliser(kind, batch, 1))(forward(*args)[key], loss_inputs(kind, outputs, batch))
    loss.backward()
    norm = clip_grad_norm_(list(model.parameters()), 1e-3)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(SGD_LR * p.grad)
    state = {n: p.detach() for n, p in model.named_parameters()}
    return {"outputs": outputs, "loss": float(loss), "grads": grads, "norm": float(norm), "state": state}


CASES = [
    dict(name="actor_gpipe", kind="actor", schedule="gpipe"),
    dict(name="actor_1f1b", kind="actor", schedule="1f1b"),
    dict(name="actor_interleaved", kind="actor", schedule="interleaved_1f1b", stages_per_rank=2),
    dict(name="critic_1f1b", kind="critic", schedule="1f1b"),
    dict(name="grpo_1f1b", kind="grpo", schedule="1f1b"),
]


def _role(case: dict) -> str:
    return "critic" if case["kind"] == "critic" else "actor"


@pytest.fixture(scope="module")
def two_stage_results(model_dirs, tmp_path_factory):
    cases = [dict(c, model_dir=model_dirs[_role(c)], microbatches=MICRO) for c in CASES]
    return run_group(2, cases, tmp_path_factory.mktemp("pipeline_run"), runner=run_pipeline_case)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_two_stage_pipeline_equals_one_process(model_dirs, two_stage_results, case):
    _assert_equal(two_stage_results[case["name"]], _reference(model_dirs, case["kind"]))


MESH_CASES = [
    dict(name="actor_pp2_dp2", kind="actor", schedule="1f1b", dp=2),
    dict(name="actor_pp2_tp2", kind="actor", schedule="1f1b", tp=2),
    dict(
        name="actor_pp2_dp2_interleaved", kind="actor", schedule="interleaved_1f1b", stages_per_rank=2, dp=2
    ),
]


FORWARD_ONLY = {"ref": "actor", "critic": "critic", "reward": "reward"}  # role -> its model


@pytest.fixture(scope="module")
def mesh_results(model_dirs, tmp_path_factory):
    """Four ranks: p = 2 with FSDP2 over d = 2, and with t = 2, on one (pp, dp, tp) mesh; and TrainEngine's
    reference, critic (values, then one update) and reward model at p = 2 x t = 2 and at p = 1, d = 4."""
    cases = [dict(c, model_dir=model_dirs[_role(c)], microbatches=2) for c in MESH_CASES]
    cases += [
        dict(name=f"{role}_{name}", role=role, model_dir=model_dirs[model], train=role == "critic", **layout)
        for role, model in FORWARD_ONLY.items()
        for name, layout in (("p2t2", dict(pp=2, tp=2)), ("p1d4", dict(pp=1)))
    ]
    return run_group(4, cases, tmp_path_factory.mktemp("pipeline_mesh"), runner=run_mesh_case)


@pytest.mark.parametrize("case", MESH_CASES, ids=[c["name"] for c in MESH_CASES])
def test_pipeline_with_fsdp_or_tensor_parallel_equals_one_process(model_dirs, mesh_results, case):
    _assert_equal(mesh_results[case["name"]], _reference(model_dirs, case["kind"]))


def _assert_equal(got: dict, want: dict) -> None:
    mask = make_rl_batch(64, **BATCH)["response_mask"].bool()
    torch.testing.assert_close(got["outputs"][mask], want["outputs"][mask], atol=1e-5, rtol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["norm"] == pytest.approx(want["norm"], rel=1e-5) and want["norm"] > 1e-3  # clipped
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-7, rtol=1e-4, msg=name)
    assert set(got["state"]) == set(want["state"])
    for name, weight in want["state"].items():  # moved by SGD_LR * grad: ~1e-2, exact to ~1e-6
        torch.testing.assert_close(got["state"][name], weight, atol=1e-6, rtol=1e-5, msg=name)


def test_a_p2_state_exports_to_transformers_and_resumes_on_three_stages(
    model_dirs, two_stage_results, tmp_path
):
    """The 1F1B case's updated weights, gathered from its two stages by name: saved as an HF directory
    they load in transformers (p = 1) with the logits of the one-process update; cut into three other
    stages (load_stage_state_dict) they compute the same log-probs."""
    from transformers import AutoModelForCausalLM

    state = two_stage_results["actor_1f1b"]["state"]
    model = load_causal_lm(model_dirs["actor"])
    model.load_state_dict(state, strict=True)
    save_hf_model(model, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    want = load_causal_lm(model_dirs["actor"])
    want.load_state_dict(_reference(model_dirs, "actor")["state"], strict=True)
    batch = make_rl_batch(want.config.vocab_size, **BATCH)
    args = (batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    lr = batch["responses"].shape[1]
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        logits = exported(*args[:1], attention_mask=args[1], position_ids=args[2]).logits
        torch.testing.assert_close(
            logits[mask],
            want(*args[:1], attention_mask=args[1], position_ids=args[2]).logits[mask],
            atol=1e-5,
            rtol=1e-5,
        )
        x = args
        for s in range(3):
            stage = StageForward(split_stage(load_causal_lm(model_dirs["actor"]), s, 3), s, 3)
            load_stage_state_dict(stage.model, state)
            stage.configure(lr, logits_chunk_size=4)
            x = stage(*x)
        reference = RLForward(exported, logits_chunk_size=4)(*args, lr)["log_probs"]
    torch.testing.assert_close(x, reference, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def engine_results(model_dirs, tmp_path_factory):
    """TrainEngine on two gloo ranks: two pipeline stages (pp = 2), and FSDP over dp = 2 (pp = 1); the
    actor's passes, and the other roles' forward-only ones."""
    cases = [dict(name=f"pp{pp}", pp=pp, model_dir=model_dirs["actor"]) for pp in (2, 1)]
    cases += [
        dict(name=f"{role}_pp{pp}", role=role, pp=pp, model_dir=model_dirs[model])
        for role, model in FORWARD_ONLY.items()
        for pp in (2, 1)
    ]
    cases += [
        dict(name=f"critic_{a}to{b}", saved=a, resumed=b, model_dir=model_dirs["critic"])
        for a, b in ((2, 1), (1, 2))
    ]
    return run_group(2, cases, tmp_path_factory.mktemp("pipeline_engine"), runner=run_engine_case)


@pytest.mark.parametrize("role", FORWARD_ONLY)
def test_forward_only_roles_with_two_stages_equal_fsdp(engine_results, role):
    """The reference's log-probs, the critic's values and the reward model's sequence scores (read at
    each row's last attended token, on the last stage) of TrainEngine(parallel.pp=2) equal pp = 1, dp = 2
    on the same ranks, on both stages. fp32, reductions of at most 64 terms (hidden size, vocabulary):
    1e-5 bounds summation order with room."""
    pp2, pp1 = engine_results[f"{role}_pp2"]["shards"], engine_results[f"{role}_pp1"]["shards"]
    want = torch.cat(pp1)
    mask = make_rl_batch(64, **BATCH)["response_mask"].bool()
    assert want.shape == ((8,) if role == "reward" else mask.shape)
    for got in pp2:  # both stages return the whole batch (dp = 1)
        got, want_ = (got, want) if role == "reward" else (got[mask], want[mask])
        torch.testing.assert_close(got, want_, atol=1e-5, rtol=1e-5)
    assert want.std() > 1e-3  # not a constant: a seeded head reads varied states


def test_train_engine_with_two_stages_equals_fsdp(engine_results):
    """TrainEngine(parallel.pp=2) (engines/pipeline_engine.py) against pp = 1, dp = 2 on the same ranks:
    log-probs and entropy of the responses, and two steps of GRPO's loss (the mean over ranks of each
    rank's global_metrics share, as DP_METRICS reports it) and grad norms. fp32, sums of at most 64
    terms: 1e-5 relative bounds summation order with room; 1e-4 on the second step's norm, taken after
    one AdamW update."""
    pp2, pp1 = engine_results["pp2"]["shards"], engine_results["pp1"]["shards"]
    mask = make_rl_batch(64, **BATCH)["response_mask"].bool()
    for rank in pp2:  # both stages return the whole batch (dp = 1)
        for k in (0, 1):
            torch.testing.assert_close(
                rank[k][mask], torch.cat([s[k] for s in pp1])[mask], atol=1e-5, rtol=1e-5
            )
    for step in (0, 1):
        want = {k: sum(s[2][step][k] for s in pp1) / 2 for k in ("loss", "entropy")}
        for rank in pp2:
            assert rank[2][step]["grad_norm"] == pytest.approx(pp1[0][2][step]["grad_norm"], rel=1e-4)
            for k, v in want.items():
                assert rank[2][step][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (step, k)


def test_critic_checkpoints_resume_onto_the_other_p(engine_results):
    """A critic checkpoint saved from two stages resumed on one (FSDP over dp = 2), and one saved from one
    resumed on two (each stage's tensors and AdamW moments by the whole model's names,
    engines/checkpoint_io.py): the next step's value loss and grad norm (the mean over ranks, as
    DP_METRICS reports them), and the values after it, agree. fp32, reductions of at most 64 terms, one
    AdamW step (eps 1e-6: no noise-sized gradient normalised to a whole step): 1e-5 relative."""
    got, want = (engine_results[n]["shards"] for n in ("critic_2to1", "critic_1to2"))
    assert want[0][0]["grad_norm"] > 0 and want[0][0]["loss"] > 0
    # not vf_clipfrac: it counts tokens whose clipped term exceeds the unclipped one by a rounding error
    for key in ("loss", "vpred_mean", "grad_norm"):
        mean = [sum(s[0][key] for s in shards) / len(shards) for shards in (got, want)]
        assert mean[0] == pytest.approx(mean[1], rel=1e-5, abs=1e-7), key
    mask = make_rl_batch(64, **BATCH)["response_mask"].bool()
    got_values = torch.cat([s[1] for s in got])  # dp = 2: each rank its half of the rows
    for rank in want:  # dp = 1: both stages return the whole batch
        torch.testing.assert_close(got_values[mask], rank[1][mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("role", FORWARD_ONLY)
def test_roles_at_p2_t2_equal_p1(mesh_results, role):
    """TrainEngine(parallel.pp=2, tp=2): the reference's log-probs, the critic's values and the reward
    model's scores (each head replicated over the last stage's tp group) equal p = 1, d = 4 on every rank
    of both stages; the critic's update then reports the same value loss, mean prediction and grad norm
    (clipped over both stages and the tp shards). fp32, reductions of at most 64 terms (hidden size,
    vocabulary, a tp all-reduce of 2 partial sums): 1e-5 bounds summation order with room; the step's
    means over 4 ranks' shares against 1 rank's: 1e-4 relative."""
    got, want = (mesh_results[f"{role}_{n}"]["shards"] for n in ("p2t2", "p1d4"))
    if role == "critic":
        (got, got_steps), (want, want_steps) = zip(*got), zip(*want)
        mean = {k: sum(s[k] for s in want_steps) / len(want_steps) for k in ("loss", "vpred_mean")}
        assert want_steps[0]["grad_norm"] > 1e-3 and mean["loss"] > 1e-3
        for step in got_steps:  # dp = 1: every rank's share is the whole batch's
            assert step["grad_norm"] == pytest.approx(want_steps[0]["grad_norm"], rel=1e-4)
            for k, v in mean.items():
                assert step[k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
    want = torch.cat(want)  # d = 4: each rank its quarter of the rows
    mask = slice(None) if role == "reward" else make_rl_batch(64, **BATCH)["response_mask"].bool()
    assert want.std() > 1e-3 and len(got) == 4
    for rank in got:  # d = 1: all four ranks return the whole batch
        torch.testing.assert_close(rank[mask], want[mask], atol=1e-5, rtol=1e-5)
