"""Memory model and simulators: hand-computed numbers and the invariants the search relies on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.planner import ClusterSpec, ModelSpec, WorkloadSpec, auto_parallel, build_dataflow, get_device
from hybridflow.planner import memory as mem
from hybridflow.planner import simulate as sim
from hybridflow.planner.profile import PATH_FIELDS
from hybridflow.planner.specs import KNOWN_SHAPES

# the by-hand figures below leave out the path's fixed costs (worker calls, per-pass overheads): priced
# and tested on their own (test_path_overheads_by_hand)
A100 = replace(get_device("a100-80"), **{f: 0.0 for f in PATH_FIELDS})
B13 = KNOWN_SHAPES["13B"]


def test_shapes_match_the_paper_models():
    for name, billions in (("7B", 6.74), ("13B", 13.0), ("34B", 33.7), ("70B", 69.0)):
        assert KNOWN_SHAPES[name].num_params / 1e9 == pytest.approx(billions, abs=0.05)
    assert ModelSpec.from_param_count("13B") is KNOWN_SHAPES["13B"]
    other = ModelSpec.from_param_count("350M")
    assert other.num_params == pytest.approx(350e6, rel=0.15)
    with pytest.raises(ValueError, match="13B"):
        ModelSpec.from_param_count("thirteen billion")


def test_shape_from_hf_config_dir(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    spec = ModelSpec.from_hf_config(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert spec.num_params == sum(p.numel() for p in model.parameters()) - norms
    assert (spec.num_layers, spec.hidden, spec.num_kv_heads) == (2, 64, 2)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelSpec.from_hf_config(tiny_model_dir / "missing")


def test_memory_numbers_by_hand():
    phi = B13.num_params
    # d = 1: bf16 weights 2 + fp32 grads 4 + fp32 master and Adam moments 12 = 18 bytes/param
    assert mem.train_state_bytes(B13, 2, 1, 1, 1) == pytest.approx(18 * phi)
    # optimizer split over d, weights and grads over p*t
    assert mem.train_state_bytes(B13, 2, 2, 4, 8) == pytest.approx(6 * phi / 8 + 12 * phi / 64)
    # KV per token: 2 (K, V) * 40 layers * 5120 * 2 bytes; GQA 34B has 8 KV heads of 128
    assert B13.kv_bytes_per_token(2) == 2 * 40 * 5120 * 2
    assert KNOWN_SHAPES["34B"].kv_bytes_per_token(2) == 2 * 48 * 8 * 128 * 2
    # TP beyond the KV heads replicates them instead of splitting further
    b34 = KNOWN_SHAPES["34B"]
    assert mem.kv_cache_bytes(b34, 2, 4, 100, 1, 8) == mem.kv_cache_bytes(b34, 2, 4, 100, 1, 16)
    # 3D-HybridEngine: gathering for generation adds exactly the missing part of the shard
    assert mem.generation_extra_weight_bytes(B13, 2, 2, 4, 1, 2) == pytest.approx(2 * phi * (1 / 2 - 1 / 8))
    ckpt = mem.train_activation_bytes(B13, 2, 2048, 1, 1, 1, 4, True, False)
    full = mem.train_activation_bytes(B13, 2, 2048, 1, 1, 1, 4, False, False)
    assert full == pytest.approx(40 * 34 * 2048 * 5120) and ckpt < full / 10


def test_switch_bytes_follow_table_2():
    """docs/design.md §4 example: training 1-4-2 (p, t, d) to generation pg = 1, tg = 2 (micro-DP dg = 2)."""
    M = 1000.0
    assert sim.switch_bytes("hybridflow", M, 1, 4, 2, 1, 2) == pytest.approx(M / 4)  # (dg-1)/(tp)
    assert sim.switch_bytes("vanilla", M, 1, 4, 2, 1, 2) == pytest.approx(3 * M / 4)  # (tp-1)/tp
    assert sim.switch_bytes("allgather", M, 1, 4, 2, 1, 2) == pytest.approx(7 * M / 8)  # (tpd-1)/tpd
    assert sim.switch_bytes("two_copy", M, 1, 4, 2, 1, 2) == M
    assert sim.switch_bytes("hybridflow", M, 2, 4, 2, 2, 4) == 0  # same layout: nothing to move
    with pytest.raises(ValueError, match="hybridflow"):
        sim.switch_bytes("magic", M, 1, 4, 2, 1, 2)


def test_switch_bytes_of_pipeline_stages_as_the_engines_run_them():
    """p = 2, t = 2, d = 2 to pg = tg = 1 under FSDP (cost.pipeline_switch_cost): each stage holds half the
    split weights (400) and one of embeddings / lm_head (100); it receives (d-1)/d (S/t + W) = 150 over
    dp, S - S/t = 200 over its TP group, and the other stage whole, 500."""
    assert sim.switch_bytes("hybridflow", 1000.0, 2, 2, 2, 1, 1, whole_bytes=200.0) == 850


def test_decode_is_memory_bound_by_hand():
    """One replica, one sequence: each step reads the weights and the KV cache once."""
    dev = A100
    wl = WorkloadSpec(prompts=1, prompt_len=1, response_len=1000)
    t = sim.generation_time(B13, dev, wl, 8, 1, 1, 1)
    bytes_per_step = B13.num_params * 2 + (1 + 500) * B13.kv_bytes_per_token(2)
    step = bytes_per_step / (dev.hbm_bandwidth * dev.memory_efficiency)
    assert t == pytest.approx(1000 * step, rel=0.01)  # prefill of one token is negligible


def test_training_is_compute_bound_and_pays_for_communication():
    wl = WorkloadSpec()
    t1 = sim.training_time(B13, A100, wl, 8, 1, 8, 1, False)  # one node, no DP sync
    flops = wl.sequences * wl.seq_len * B13.forward_flops_per_token(wl.seq_len / 2) * 3
    skinny = (5120 / 8) / (5120 / 8 + A100.gemm_half_width)  # t = 8 makes the GEMMs 640 wide
    compute = flops / 8 / (A100.peak_flops * A100.compute_efficiency * skinny)
    assert compute < t1 < 1.4 * compute  # plus TP collectives
    # the same work on 16 nodes also pays a gradient all-reduce per mini-batch whose 6.5 GB per device
    # (fp32 grads / t) cross each node's 200 Gbps NIC once per GPU of the node
    t16 = sim.training_time(B13, A100, wl, 8, 1, 8, 16, False)
    grads = B13.num_params * 4 / 8
    ring = (
        2 * 15 / 16 * grads / (A100.inter_node_bandwidth / 8 * A100.comm_efficiency) + 4 * A100.comm_latency_s
    )
    optimizer = [
        2 * 16 * B13.num_params / (8 * d) / (A100.hbm_bandwidth * A100.memory_efficiency) for d in (1, 16)
    ]
    expected = t1 / 16 + wl.mini_batches * (ring + optimizer[1] - optimizer[0] / 16)
    assert t16 == pytest.approx(expected, rel=1e-9)
    assert t16 > 1.5 * t1 / 16  # far from linear scaling
    # activation checkpointing recomputes a forward: 4/3 of the matmul time
    assert sim.training_time(B13, A100, wl, 8, 1, 8, 1, True) > t1 + compute / 3


def test_more_generation_replicas_never_slower_per_step_bytes():
    wl = WorkloadSpec()
    times = [sim.generation_time(B13, A100, wl, 8, n, 1, 2) for n in (16, 32, 64, 128)]
    assert times == sorted(times, reverse=True)
    # but far from linear: every replica rereads the whole weight shard each step
    assert times[0] / times[-1] < 8


def test_70b_actor_never_fits_on_one_80gb_device():
    actor = build_dataflow("ppo", ModelSpec.from_param_count("70B")).model("actor")
    cluster = ClusterSpec.build("a100-80", 128)
    assert mem.weight_bytes(actor.spec, 2, 1, 1) > A100.memory_bytes  # even bf16 weights alone
    assert auto_parallel(actor, cluster, WorkloadSpec(), 1) == ()
    for n in (2, 4, 8, 16):
        for o in auto_parallel(actor, cluster, WorkloadSpec(), n):
            assert o.p * o.t > 1 and o.pg * o.tg > 1


def test_kv_cache_check_raises_generation_tp():
    """Only ~20 GB per device is left for the KV cache next to a 13B actor's training state when
    generating with tg = 1 (it gathers the whole model); raising tg frees weight memory for it."""
    actor = build_dataflow("ppo", ModelSpec.from_param_count("13B")).model("actor")
    cluster = ClusterSpec.build("a100-80", 8)
    wl = WorkloadSpec(prompts=128, prompt_len=1024, response_len=1024)  # ~27 GB of KV per device
    front = auto_parallel(actor, cluster, wl, 8)
    one_wave = [o for o in front if o.waves == 1]
    assert one_wave and min(o.pg * o.tg for o in one_wave) >= 2
    assert all(o.waves > 1 for o in front if o.pg * o.tg == 1)
    assert front[0].waves == 1 and front[0].pg * front[0].tg >= 2  # the fastest option raised tg
    budget = A100.memory_bytes * A100.usable_memory_fraction
    assert all(o.persistent_bytes + o.transient_bytes <= budget for o in front)


def test_path_overheads_by_hand():
    """A device whose FLOPs, bytes and links cost nothing leaves only the path's fixed costs (simulate.py
    path_overhead, call_time): the tiny "small" Llama (4 layers), 512 sequences of 20 tokens, micro-batches
    of 256. transfer_bandwidth is set so that the batch's 2 x 512 x 20 x 32 bytes take 1 s."""
    small = ModelSpec("small", 4, 128, 4, 2, 384, vocab_size=64)
    wl = WorkloadSpec(prompts=64, samples_per_prompt=8, prompt_len=16, response_len=4, mini_batches=1,
                      micro_batch_size=256, inference_micro_batch_size=256)  # fmt: skip
    inf = float("inf")
    dev = replace(
        A100, peak_flops=inf, hbm_bandwidth=inf, intra_node_bandwidth=inf, comm_latency_s=0.0,
        call_overhead_s=1.0, transfer_bandwidth=2 * 512 * 20 * 32, micro_batch_overhead_s=1e-3,
        tp_layer_overhead_s=1e-2, fsdp_layer_overhead_s=1e-1, optimizer_layer_overhead_s=1e-4,
        optimizer_step_overhead_s=1e-5,
    )  # fmt: skip
    # t2 d2: one micro-batch of 256 per replica, 3 passes of (1 ms + 4 layers x 10 ms + 5 FSDP units x 100 ms),
    # one optimizer step (10 us + 4 x 100 us); the stage's call is the step's rest's, not the stage's
    assert sim.training_time(small, dev, wl, 4, 1, 2, 2, False) == pytest.approx(3 * 0.541 + 0.00041)
    # t1 d1: two micro-batches of 1 ms each, no TP or FSDP term
    assert sim.inference_time(small, dev, wl, 4, 1, 1, 1) == pytest.approx(0.002)
    # tg2 on 2 devices (one replica): prefill 1 ms + 4 x 10 ms, 4 decode steps of 4 x 10 ms
    assert sim.generation_time(small, dev, wl, 4, 2, 1, 2) == pytest.approx(0.041 + 4 * 0.04)
    # the calls: 1 s + 1 s of transfer each, the generation's over prompt + response as well
    assert sim.stage_call_time(dev, wl, "training") == sim.stage_call_time(dev, wl, "generation") == 2.0
