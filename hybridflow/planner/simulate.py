"""Latency of one model's work per iteration, from FLOPs, bytes and link speeds (seconds).

- Training and inference are compute-bound: matmul FLOPs at the device's reached efficiency, plus
  tensor-parallel collectives per layer (intra-node), the 1F1B pipeline bubble (m + p - 1 slots for m
  micro-batches), and for training one gradient all-reduce per mini-batch over the data-parallel
  group. That all-reduce is not overlapped with compute here; across nodes all of a node's devices
  share its NICs, which is what stops training from scaling strongly on the paper's 200 Gbps network.
- Generation is memory-bound per decode step: each step reads the replica's weight shard and the KV
  cache of its sequences, and pays two TP all-reduces per layer, mostly latency; prefill is
  compute-bound. Pipeline stages run one after another for a single batch, so pg saves memory only.
- The actor's train -> generate switch costs what docs/design.md §4 Table 2 says each method moves.
- Fixed costs of the path (`path_overhead`, `call_time`): a stage's work is started by worker-group calls
  from the driver (a Ray round trip and the batch's transfer), priced in the step's rest (`step_rest_time`),
  not in the stage: a stage is measured from its workers' start to their end; each micro-batch pass pays a fixed cost
  beyond its layers, and each layer pass one for tensor parallelism (t > 1, fixed and per token) and one for FSDP2 (d > 1);
  each optimizer step a per-layer and a fixed cost, the fixed one higher on DTensors (t > 1, d > 1).
  They are what a small model's stage mostly is.
- Non-matmul work per token (`activation_time`): the activation values a pass's norms, rotary, SiLU and
  softmaxes write, at the profile's measured cost per value; memory-bound, it grows with tokens as the GEMMs
  do but does not shrink with the GEMM rate. Beyond it, what the engine's passes cost per token (packing,
  shared-prompt attention, the log-prob chunks, the loss), measured on the engine itself.
"""

from __future__ import annotations

import math

from hybridflow.hybrid_engine.cost import METHODS, fsdp_switch_cost, pipeline_switch_cost, switch_cost
from hybridflow.planner.memory import GRAD_BYTES_PER_PARAM
from hybridflow.planner.specs import DeviceSpec, ModelSpec, WorkloadSpec


def collective_time(dev: DeviceSpec, nbytes: float, ranks: int, bandwidth: float, kind: str = "all_reduce"):
    """Bandwidth term of a ring (all-reduce moves 2(n-1)/n of the buffer per rank, all-gather (n-1)/n)
    plus a latency term of a tree (log2 n hops), which is what NCCL's small-message algorithms pay."""
    if ranks <= 1:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    moved = factor * (ranks - 1) / ranks * nbytes
    return moved / (bandwidth * dev.comm_efficiency) + math.ceil(math.log2(ranks)) * dev.comm_latency_s


def dp_bandwidth(dev: DeviceSpec, devices_per_node: int, p: int, t: int, d: int) -> float:
    """Per-rank bandwidth of a data-parallel ring laid out with TP innermost, then DP, then PP.

    If the DP group spans nodes, each node's NIC carries one ring hop for every DP group that has
    ranks on the node (devices_per_node / ranks_of_one_group_per_node of them).
    """
    group_stride = t  # consecutive DP ranks are t devices apart
    if group_stride * d <= devices_per_node:
        return dev.intra_node_bandwidth
    ranks_per_node = max(1, devices_per_node // group_stride)
    groups_sharing_nic = devices_per_node / ranks_per_node
    return min(dev.intra_node_bandwidth, dev.inter_node_bandwidth / groups_sharing_nic)


def _tp_bandwidth(dev: DeviceSpec, devices_per_node: int, t: int) -> float:
    return dev.intra_node_bandwidth if t <= devices_per_node else dev.inter_node_bandwidth / devices_per_node


# Bytes per token of the batch a stage's call moves each way: token ids, attention mask and position ids
# (int64) and a per-token float (log-probs, values or advantages).
BATCH_BYTES_PER_TOKEN = 32


def call_time(dev: DeviceSpec, tokens: float, ranks: int = 1) -> float:
    """One worker-group call from the driver carrying `tokens` tokens' batch to the workers and back, to a
    group of `ranks` ranks (each one more task to issue, one more result to wait for and join)."""
    transfer = 2 * tokens * BATCH_BYTES_PER_TOKEN / dev.transfer_bandwidth if dev.transfer_bandwidth else 0.0
    return dev.call_overhead_s + (max(ranks, 1) - 1) * dev.call_rank_overhead_s + transfer


def stage_call_time(
    dev: DeviceSpec, wl: WorkloadSpec, stage: str, generation_factor: float = 1.0, ranks: int = 1
) -> float:
    """The driver's call that starts and ends a stage's work: generation moves every sequence (prompt and
    response), preparation and training every row padded. A stage's calls are issued together and their
    round trips overlap, so a stage costs one (its largest) however many models it runs."""
    if stage == "generation":
        return call_time(dev, wl.sequences * generation_factor * wl.padded_seq_len, ranks)
    return call_time(dev, wl.sequences * wl.padded_seq_len, ranks)


def step_rest_time(
    dev: DeviceSpec,
    wl: WorkloadSpec,
    stages: tuple[str, ...] = (),
    generation_factor: float = 1.0,
    ranks: int = 1,
) -> float:
    """What a step costs beyond its stages' busy intervals (trainers/plan_metrics.py: a stage is timed from
    its workers' first start to their last end): the calls of the `stages` that run (stage_call_time: each
    stage's round trip lies between its workers' intervals and the driver's), the advantages' call on the
    actor's rank 0 (trainers/experience.py make_experience, carrying every row there and back; its ~0.2 ms
    of arithmetic left out) and the driver's own per-step work (`driver_step_overhead_s`: issuing and
    collecting the futures, the phases' timers, the batch's assembly). A rule reward runs in the driver
    while the preparation's workers run (trainers/plan_metrics.py): not here. `ranks`: the largest group
    called (a pool's models each span its devices), whose round trips each call waits for."""
    calls = sum(stage_call_time(dev, wl, s, generation_factor, ranks) for s in stages)
    return calls + call_time(dev, wl.sequences * wl.padded_seq_len, ranks) + dev.driver_step_overhead_s


def layer_pass_overhead(dev: DeviceSpec, t: int) -> float:
    """Fixed seconds one layer adds to one pass at tensor size t, beyond its FLOPs."""
    return dev.layer_overhead_s + (dev.tp_layer_overhead_s if t > 1 else 0.0)


def token_width_scale(spec: ModelSpec, dev: DeviceSpec) -> float:
    """The model's hidden size over the width the profile's per-token terms were measured at (their work is
    over hidden-sized vectors); 1 for a profile that did not record it (before version 5)."""
    return spec.hidden / dev.token_overhead_width if dev.token_overhead_width else 1.0


def tp_token_time(spec: ModelSpec, dev: DeviceSpec, tokens: float, t: int) -> float:
    """Seconds one layer's pass over `tokens` tokens adds at t > 1 beyond the fixed tp_layer_overhead_s:
    DTensor's redistributions and the row-wise layers' reductions grow with the tokens (measured at 32 and
    512 tokens, microbench_path.fit_tp_layer), and with the hidden size they move, scaled from the width
    the profile measured at as the engine's per-token terms are."""
    if t <= 1 or not dev.tp_token_overhead_s:
        return 0.0
    return tokens * dev.tp_token_overhead_s * token_width_scale(spec, dev)


def fsdp_token_time(spec: ModelSpec, dev: DeviceSpec, tokens: float, d: int, per_token: float) -> float:
    """Seconds one layer's pass over `tokens` tokens adds at d > 1 beyond FSDP2's fixed cost per unit
    (fsdp_layer_overhead_s): `per_token` is the profile's training or inference figure, measured on the
    engine's own passes at dp = 2 and scaled by width as its other per-token terms are."""
    if d <= 1 or not per_token:
        return 0.0
    return tokens * per_token * token_width_scale(spec, dev)


def thread_speedup(fraction: float, threads: int) -> float:
    """How much faster a CPU rank's pass runs on `threads` intra-op threads than on one, by Amdahl's law
    with the pass's measured parallel `fraction` (DeviceSpec.thread_fraction_train / _infer)."""
    return 1.0 / ((1.0 - fraction) + fraction / max(threads, 1))


def spare_core_threads(dev: DeviceSpec, devices_per_node: int, n: int) -> int:
    """Intra-op threads each rank of a pool of `n` CPU devices running alone gets: the node's cores
    shared among its ranks there (controller/process.cpu_threads), 1 where the profile measured no gain."""
    if not (dev.thread_fraction_train or dev.thread_fraction_infer):
        return 1
    return max(1, devices_per_node // min(n, devices_per_node))


def path_overhead(dev: DeviceSpec, layers: float, t: int, d: int) -> float:
    """Fixed seconds of one micro-batch pass on a rank holding `layers` layers at tensor size t, data size
    d. FSDP2 wraps each layer and the rest (embeddings, norm, head) as one more unit (engines/parallelize.py)."""
    fsdp = (layers + 1) * dev.fsdp_layer_overhead_s if d > 1 else 0.0
    return dev.micro_batch_overhead_s + layers * layer_pass_overhead(dev, t) + fsdp


def optimizer_overhead(dev: DeviceSpec, layers: float, t: int, d: int) -> float:
    """Fixed seconds of one optimizer step (clipping, AdamW) on a rank holding `layers` layers at tensor
    size t, data size d: on DTensors (t > 1 or d > 1) the step pays their reductions and dispatch too."""
    fixed = dev.optimizer_step_overhead_s
    fixed += dev.fsdp_optimizer_step_overhead_s if d > 1 else 0.0
    fixed += dev.tp_optimizer_step_overhead_s if t > 1 else 0.0
    return fixed + layers * dev.optimizer_layer_overhead_s


def activation_time(
    spec: ModelSpec, dev: DeviceSpec, tokens: float, context: float, layers: float, t: int
) -> float:
    """Seconds of one forward pass's non-matmul ops over `tokens` tokens on a rank holding `layers` layers and
    the LM head, at tensor size t, which splits the heads and the MLP (not the head's log-softmax)."""
    elements = layers * spec.layer_activation_elements(context) / t + spec.head_activation_elements()
    return tokens * elements * dev.activation_s_per_element


def _matmul_time(dev: DeviceSpec, flops: float, width: float = math.inf) -> float:
    """`width` is the narrowest GEMM dimension a device sees (hidden / t): tensor parallelism makes
    GEMMs skinny, and skinny GEMMs reach less of the peak (half of it at width = gemm_half_width)."""
    efficiency = dev.compute_efficiency
    if math.isfinite(width):
        efficiency *= width / (width + dev.gemm_half_width)
    return flops / (dev.peak_flops * efficiency)


def pass_tokens(wl: WorkloadSpec, rows: int, p: int) -> tuple[float, float]:
    """(tokens, sequence length) a micro-batch pass of `rows` rows computes. Unpipelined, the engines pack
    real tokens (padding removed, a prompt once for its samples where shared); pipeline stages are built for
    one micro-batch shape, so at p > 1 every row runs at the batch's full, padded length
    (engines/pipeline_engine.py), prompts unshared."""
    if p > 1:
        return rows * wl.padded_seq_len, float(wl.padded_seq_len)
    return rows * wl.tokens_per_sequence(rows), wl.packed_seq_len


def engine_overhead(spec: ModelSpec, dev: DeviceSpec, tokens: float, training: bool, p: int) -> float:
    """The engine's own terms for a micro-batch of `tokens` (microbench_path.engine_passes), per token scaled
    from the width they were measured at to the model's: unpipelined, packing, the shared-prompt attention
    and the loss, per token and per micro-batch; a pipeline stage's pass its own per token."""
    scaled = tokens * token_width_scale(spec, dev)
    if p > 1:
        return scaled * (
            dev.pipeline_train_token_overhead_s if training else dev.pipeline_infer_token_overhead_s
        )
    if training:
        return scaled * dev.train_token_overhead_s + dev.train_batch_overhead_s
    return scaled * dev.infer_token_overhead_s + dev.infer_batch_overhead_s


def training_time(
    spec: ModelSpec,
    dev: DeviceSpec,
    wl: WorkloadSpec,
    devices_per_node: int,
    p: int,
    t: int,
    d: int,
    checkpoint: bool,
) -> float:
    """Training stage of one model: epochs * mini-batches * (pipelined micro-batches + grad sync)."""
    seqs_per_replica = math.ceil(wl.sequences / wl.mini_batches / d)
    mbs = min(wl.micro_batch_size, seqs_per_replica)  # a replica holding fewer rows runs one smaller one
    m = math.ceil(seqs_per_replica / mbs)
    passes = 4 if checkpoint else 3  # forward + backward (2x) [+ recomputed forward]
    tokens, s = pass_tokens(wl, mbs, p)  # attention still sees the whole sequence (context s / 2)
    flops = tokens * spec.forward_flops_per_token(s / 2) * passes / (p * t)
    layers = spec.num_layers / p
    act_bytes = tokens * spec.hidden * dev.bytes_per_param
    tp_comm = (
        layers * (2 * passes) * collective_time(dev, act_bytes, t, _tp_bandwidth(dev, devices_per_node, t))
    )
    pp_comm = 2 * act_bytes / t / dev.intra_node_bandwidth if p > 1 else 0.0
    slot = (
        _matmul_time(dev, flops, spec.hidden / t)
        + tp_comm
        + pp_comm
        + passes * (path_overhead(dev, layers, t, d) + activation_time(spec, dev, tokens, s / 2, layers, t))
        + passes * layers * tp_token_time(spec, dev, tokens, t)
        + passes * layers * fsdp_token_time(spec, dev, tokens, d, dev.fsdp_train_token_overhead_s)
        + engine_overhead(spec, dev, tokens, True, p)
    )
    pipeline = (m + p - 1) * slot
    grads = spec.num_params * GRAD_BYTES_PER_PARAM / (p * t)
    sync = collective_time(dev, grads, d, dp_bandwidth(dev, devices_per_node, p, t, d))
    optimizer_step = 2 * (16 * spec.num_params / (p * t * d)) / (dev.hbm_bandwidth * dev.memory_efficiency)
    optimizer_step += optimizer_overhead(dev, layers, t, d)
    steps = wl.ppo_epochs * wl.mini_batches
    return steps * (pipeline + sync + optimizer_step)


def inference_time(
    spec: ModelSpec, dev: DeviceSpec, wl: WorkloadSpec, devices_per_node: int, p: int, t: int, d: int
) -> float:
    """One forward pass over every (prompt, response) sequence of the iteration."""
    seqs_per_replica = math.ceil(wl.sequences / d)
    mbs = min(wl.inference_micro_batch_size, seqs_per_replica)
    m = math.ceil(seqs_per_replica / mbs)
    tokens, s = pass_tokens(wl, mbs, p)
    flops = tokens * spec.forward_flops_per_token(s / 2) / (p * t)
    layers = spec.num_layers / p
    act_bytes = tokens * spec.hidden * dev.bytes_per_param
    tp_comm = layers * 2 * collective_time(dev, act_bytes, t, _tp_bandwidth(dev, devices_per_node, t))
    pp_comm = act_bytes / t / dev.intra_node_bandwidth if p > 1 else 0.0
    slot = _matmul_time(dev, flops, spec.hidden / t) + tp_comm + pp_comm + path_overhead(dev, layers, t, d)
    slot += layers * tp_token_time(spec, dev, tokens, t)
    slot += layers * fsdp_token_time(spec, dev, tokens, d, dev.fsdp_infer_token_overhead_s)
    slot += activation_time(spec, dev, tokens, s / 2, layers, t)
    slot += engine_overhead(spec, dev, tokens, False, p)
    return (m + p - 1) * slot


def generation_time(
    spec: ModelSpec,
    dev: DeviceSpec,
    wl: WorkloadSpec,
    devices_per_node: int,
    n_devices: int,
    pg: int,
    tg: int,
    generation_factor: float = 1.0,
    waves: int = 1,
) -> float:
    """Prefill plus `response_len` decode steps on n_devices / (pg*tg) replicas (all in parallel).

    A replica whose KV cache cannot hold all its sequences at once runs them in `waves` rounds
    (what a paged-KV engine degrades to), rereading the weights for every round's steps.
    """
    replicas = n_devices // (pg * tg)
    b = math.ceil(math.ceil(wl.sequences * generation_factor / replicas) / waves)
    lp, lr = wl.padded_prompt_len, wl.response_len  # the prefill runs the left-padded prompts
    bw_tp = _tp_bandwidth(dev, devices_per_node, tg)
    L = spec.num_layers
    # prefill: compute-bound over the prompts, each once for its samples (the engines cache n copies of its
    # k/v); the pg stages run in turn, so only tg divides the work
    bp = math.ceil(b / wl.samples_per_prompt)
    prefill_flops = bp * lp * spec.forward_flops_per_token(lp / 2) / tg
    prefill = _matmul_time(dev, prefill_flops, spec.hidden / tg) + 2 * L * collective_time(
        dev, bp * lp * spec.hidden * dev.bytes_per_param, tg, bw_tp
    )
    prefill += path_overhead(dev, L, tg, 1) + activation_time(spec, dev, bp * lp, lp / 2, L, tg)
    prefill += L * tp_token_time(spec, dev, bp * lp, tg)
    # decode: per step, read weights + KV cache (at the average context) once
    context = lp + lr / 2
    weights = spec.num_params * dev.bytes_per_param / tg
    kv = b * context * spec.kv_bytes_per_token(dev.bytes_per_param) / min(tg, spec.num_kv_heads)
    memory = (weights + kv) / (dev.hbm_bandwidth * dev.memory_efficiency)
    compute = _matmul_time(dev, b * spec.forward_flops_per_token(context) / tg, spec.hidden / tg)
    comm = 2 * L * collective_time(dev, b * spec.hidden * dev.bytes_per_param, tg, bw_tp)
    comm += (pg - 1) * dev.comm_latency_s
    step = (
        (memory**2 + compute**2) ** 0.5
        + comm
        + L * (layer_pass_overhead(dev, tg) + tp_token_time(spec, dev, b, tg))
    )
    step += activation_time(spec, dev, b, context, L, tg)
    step += dev.decode_step_overhead_s + b * dev.decode_row_overhead_s  # sampling, stop test, bookkeeping
    text = b * (dev.detokenize_row_s + lr * dev.detokenize_token_s)  # the responses decoded to text
    replica = waves * (prefill + lr * step + text)
    # the replicas then meet in a collective (workers/actor.py: the switch's counters, max over ranks)
    return replica + rank_wait(dev, replica, n_devices)


def rank_wait(dev: DeviceSpec, work_s: float, ranks: int) -> float:
    """The wait of `ranks` ranks at a collective each reaches after `work_s` seconds of its own work
    (DeviceSpec.sync_wait_s / sync_wait_fraction); none for one rank."""
    return 0.0 if ranks <= 1 else dev.sync_wait_s + dev.sync_wait_fraction * work_s


SWITCH_METHODS = METHODS  # one vocabulary with rollout.reshard and the worker's counters


def switch_bytes(
    method: str,
    actor_bytes: float,
    p: int,
    t: int,
    d: int,
    pg: int,
    tg: int,
    whole_bytes: float | None = None,
) -> float:
    """Bytes one device receives to go from training (p, t, d) to generation (pg, tg), from
    hybrid_engine/cost.py (the one module that writes the switch's cost down; docs/hybrid_engine.md):
    the paper's Table 2 (Megatron training), or, given `whole_bytes` (weights not TP-split: embeddings,
    lm_head) and p = pg = 1, the formula of the layout the engines run (FSDP2 over dp), which the actor
    worker's counters equal; for p > 1, pg = 1 and hybridflow, that layout's pipeline_switch_cost.

    hybridflow: all-gather inside the micro-DP group (dg = p*t/(pg*tg)) of the missing shards;
    vanilla: HybridFlow-V, gather the whole model over the model-parallel group; allgather:
    DeepSpeed-Chat, gather everything from every rank; two_copy: OpenRLHF, a full weight transfer into a
    second actor copy.
    """
    if whole_bytes is not None and p == pg == 1:
        split = round(actor_bytes - whole_bytes)
        return float(fsdp_switch_cost(method, split, round(whole_bytes), t, d, tg, t * d)[0])
    if whole_bytes is not None and pg == 1 and method == "hybridflow":
        # pipeline stages (pipeline_switch.py): an even cut of the layers, the embeddings on the first
        # stage and lm_head on the last; the slowest rank's bytes
        split, half = (actor_bytes - whole_bytes) / p, whole_bytes / 2
        stages = [(round(split), round(half) * (s in (0, p - 1)), 0) for s in range(p)]
        return float(max(pipeline_switch_cost(stages, s, t, d, tg)[0] for s in range(p)))
    return switch_cost(method, actor_bytes, p, t, d, pg, tg).comm_bytes


def switch_time(
    spec: ModelSpec,
    dev: DeviceSpec,
    devices_per_node: int,
    p: int,
    t: int,
    d: int,
    pg: int,
    tg: int,
    method: str = "hybridflow",
) -> float:
    """Train -> generate -> train round of the actor (generate -> train drops the extra shards): the bytes
    over the link and, for the engines' method, the round's fixed costs (switch_overhead). With p = pg = 1
    it prices what the engines run: FSDP2's all-gather over dp, then the method's gather (embeddings and
    lm_head stay whole over tp: engines/parallelize.py)."""
    bpp = dev.bytes_per_param
    whole = 2 * spec.vocab_size * spec.hidden * bpp
    nbytes = switch_bytes(method, spec.num_params * bpp, p, t, d, pg, tg, whole)
    if nbytes <= 0:
        return 0.0
    return _switch_transfer(dev, devices_per_node, nbytes, p, t, d, pg, tg, method) + switch_overhead(
        spec, dev, p, t, d, pg, tg, method
    )


def switch_overhead(
    spec: ModelSpec, dev: DeviceSpec, p: int, t: int, d: int, pg: int, tg: int, method: str
) -> float:
    """What the engines' switch (hybrid_engine/resharder.py, pipeline_switch.py) costs beyond its bytes, per
    unit it gathers, as microbench_path.switch_rounds measures it: FSDP2 unshards each of a stage's units (its
    layers and the root) at d > 1, the TP pieces of each layer are gathered at t > tg (the root's embeddings
    and lm_head are whole over tp), each of p > pg stages is exchanged; then one all-reduce of the round's
    counters. On small models most of the switch."""
    if method != "hybridflow":
        return 0.0
    layers = spec.num_layers / p
    fsdp = (layers + 1) * dev.switch_fsdp_unit_s if d > 1 else 0.0
    tp = layers * dev.switch_tp_unit_s if t > tg else 0.0
    stages = p * dev.switch_stage_s if p > pg else 0.0
    return fsdp + tp + stages + dev.comm_latency_s


def _switch_transfer(
    dev: DeviceSpec,
    devices_per_node: int,
    nbytes: float,
    p: int,
    t: int,
    d: int,
    pg: int,
    tg: int,
    method: str,
) -> float:
    # Ranks are laid out TP innermost, then DP, then PP; the gather stays inside a node only if every
    # shard it needs does: TP neighbours are adjacent, pipeline neighbours t*d ranks apart.
    if method == "hybridflow":
        group = (p * t) // (pg * tg)
        span = (t * d * (p // pg - 1) + t) if p > pg else t
    elif method == "vanilla":
        group = p * t
        span = t * d * (p - 1) + t
    else:
        group = span = p * t * d
    if pg == 1 and d > 1:  # FSDP's all-gather runs over the dp group: ranks t apart
        span = max(span, t * d)
    if span <= devices_per_node:
        bw = dev.intra_node_bandwidth
    else:
        bw = dev.inter_node_bandwidth / devices_per_node
    return nbytes / (bw * dev.comm_efficiency) + math.log2(max(group, 2)) * dev.comm_latency_s
