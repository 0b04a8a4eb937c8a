"""What the planner plans for: model shapes, devices and clusters, the RL workload, and the layouts
the executing engines support (`EngineLimits`; `ENGINE_LIMITS`: those hybridflow's own engines run).

Everything here is a frozen dataclass so a spec can key the planner's caches and a plan can be
reproduced from its inputs. Model shapes come from a parameter count ("13B", using the Llama-2 /
CodeLlama shapes the paper measured, or a Llama-like aspect ratio for other sizes) or from an HF
`config.json`. The device catalogue holds datasheet numbers; the efficiency factors are what a
well-tuned stack reaches on them (`hybridflow calibrate` shows how far this machine is from its entry).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape; all the simulator needs to count bytes and FLOPs."""

    name: str  # label shown in plans, e.g. "13B"
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int  # < num_heads for grouped-query attention (shrinks the KV cache)
    ffn_hidden: int  # gated (SwiGLU) MLP width: 3 matrices of hidden x ffn_hidden
    vocab_size: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        kv = self.num_kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.ffn_hidden

    @property
    def num_params(self) -> int:
        """Parameters including untied input embedding and LM head."""
        return self.num_layers * self.layer_params + 2 * self.vocab_size * self.hidden

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim values per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def layer_activation_elements(self, context: float) -> float:
        """Activation values one layer's non-matmul ops write per token in a forward pass: two RMSNorms and
        the residual adds (~12 x hidden), rotary q/k, SiLU(gate) x up (~4 x ffn), attention's softmax (3 per
        head and key). A count of the right shape: the profile's activation_s_per_element is fitted to it."""
        return 12 * self.hidden + 4 * self.ffn_hidden + 3 * self.num_heads * context

    def head_activation_elements(self) -> float:
        """The same for the LM head's log-softmax over the vocabulary, per token."""
        return 4 * self.vocab_size

    def forward_flops_per_token(self, context: float) -> float:
        """Matmul FLOPs of one forward pass per token attending to `context` earlier tokens."""
        dense = 2 * (self.num_layers * self.layer_params + self.vocab_size * self.hidden)
        attention = 4 * self.num_layers * self.hidden * context  # QK^T and AV
        return dense + attention

    @classmethod
    def from_param_count(cls, size: str | float | int, vocab_size: int = 32000) -> ModelSpec:
        """`"13B"`, `"350M"`, `7e9`: the paper's shapes for 7B/13B/34B/70B, else a Llama-like shape."""
        n = parse_param_count(size)
        for known in KNOWN_SHAPES.values():
            if abs(known.num_params - n) / n < 0.08:
                return known
        # Llama keeps layers ~ hidden / 128 and 128-wide heads, so params ~ 12 h^3 / 128 (+ embeddings).
        hidden = max(128, 128 * round((n * 128 / 12) ** (1 / 3) / 128))
        layers = max(1, round((n - 2 * vocab_size * hidden) / (12 * hidden * hidden)))
        heads = hidden // 128
        ffn = 256 * math.ceil(8 * hidden / 3 / 256)
        return cls(_format_count(n), layers, hidden, heads, heads, ffn, vocab_size)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read a Hugging Face `config.json` (a file or the model directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no HF config at {path}; pass a model directory or its config.json")
        return cls.from_config_dict(json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_config_dict(cls, cfg: dict, source: str = "config") -> ModelSpec:
        """The shape fields of an HF config (Llama/Qwen2/Mistral or GPT-2 names; GPT-2's two-matrix MLP
        is counted as a gated one of the same width, overestimating it by half an MLP)."""

        def get(*keys, default=None):
            return next((cfg[k] for k in keys if cfg.get(k) is not None), default)

        hidden = get("hidden_size", "n_embd", "d_model")
        layers = get("num_hidden_layers", "n_layer", "num_layers")
        heads = get("num_attention_heads", "n_head")
        if not (hidden and layers and heads):
            raise ValueError(f"{source}: need hidden_size, num_hidden_layers and num_attention_heads")
        spec = cls(
            name="hf",
            num_layers=int(layers),
            hidden=int(hidden),
            num_heads=int(heads),
            num_kv_heads=int(get("num_key_value_heads", default=heads)),
            ffn_hidden=int(get("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
            vocab_size=int(get("vocab_size", default=32000)),
        )
        return replace(spec, name=_format_count(spec.num_params))


KNOWN_SHAPES = {  # Llama-2 7B/13B/70B and CodeLlama-34B (GQA), the models of the paper's evaluation
    "7B": ModelSpec("7B", 32, 4096, 32, 32, 11008),
    "13B": ModelSpec("13B", 40, 5120, 40, 40, 13824),
    "34B": ModelSpec("34B", 48, 8192, 64, 8, 22016),
    "70B": ModelSpec("70B", 80, 8192, 64, 8, 28672),
}

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_param_count(size: str | float | int) -> float:
    if isinstance(size, (int, float)):
        if size <= 0:
            raise ValueError(f"parameter count must be positive, got {size}")
        return float(size)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMBT]?)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read model size {size!r}; write e.g. '13B', '350M' or 7e9")
    return parse_param_count(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def _format_count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or a CPU 'device') and the links around it. Bandwidths in bytes/s."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense matmul FLOP/s in the compute dtype
    hbm_bandwidth: float  # device memory bandwidth
    intra_node_bandwidth: float  # per device, one direction (NVLink; shared memory for CPU)
    inter_node_bandwidth: float  # per NODE, one direction (all devices of a node share the NICs)
    host_bandwidth: float  # device <-> host memory (PCIe), for optimizer offload
    devices_per_node: int = 8
    bytes_per_param: int = 2  # bf16 weights/activations on GPUs; fp32 on CPU
    compute_efficiency: float = 0.5  # reached fraction of peak in big matmuls (MFU of a tuned stack)
    memory_efficiency: float = 0.7  # reached fraction of HBM bandwidth in decode
    gemm_half_width: float = 256.0  # GEMM width (hidden / t) at which matmuls reach half their efficiency
    comm_efficiency: float = 0.8  # reached fraction of link bandwidth in collectives
    comm_latency_s: float = 1e-5  # per hop of a collective (log2 n hops); dominates decode TP all-reduces
    layer_overhead_s: float = 0.0  # fixed cost per layer per forward (kernel launch, Python dispatch)
    decode_step_overhead_s: float = 0.0  # the generation engine's per decode step (sampling, scheduling)
    decode_row_overhead_s: float = 0.0  # and per row of a decode step: sampling, the stop test, the columns
    # a collective the ranks reach from work of their own (the generation's counters after each replica's decode)
    # waits beyond comm_latency_s: fixed + a fraction of that work (microbench.sync_waits; before v13: 0)
    sync_wait_s: float = 0.0
    sync_wait_fraction: float = 0.0
    detokenize_row_s: float = 0.0  # the text a rollout rank decodes, per row and token (before v11: 0)
    detokenize_token_s: float = 0.0
    # Fixed costs of the path a stage's work takes (microbench_path.py) beyond FLOPs and bytes (before v2: 0):
    # a round of worker-group calls from the driver as a run's step pays it (Ray round trip, split, gather), to
    # one rank and per rank beyond it (microbench_path.step_rests; before version 14: idle, any ranks alike)
    call_overhead_s: float = 0.0
    call_rank_overhead_s: float = 0.0
    transfer_bandwidth: float = 0.0  # driver <-> workers batch bytes/s as runs pay it (0: not priced)
    # the driver's own work per step beyond its calls' round trips: issuing and collecting the futures, the
    # phases' timers, the batch's assembly (microbench_path.empty_step; profiles before version 6: 0)
    driver_step_overhead_s: float = 0.0
    micro_batch_overhead_s: float = 0.0  # per micro-batch per pass beyond its layers: embeddings, head, loss
    tp_layer_overhead_s: float = 0.0  # per layer per pass at t > 1: DTensor dispatch, row-wise all-reduces
    # and per token of the pass beyond that (the redistributions and reductions grow with the tokens), at
    # token_overhead_width's hidden size (scaled like the engine's per-token terms; before version 7: 0)
    tp_token_overhead_s: float = 0.0
    fsdp_layer_overhead_s: float = 0.0  # per FSDP2 unit (a layer; the root) per pass at d > 1: gathers, hooks
    # and per token of a layer's pass at d > 1 beyond that, in the engine's training step and its log-prob pass,
    # at token_overhead_width (engine_passes at dp = 2; before v10: 0): each gather waits for the slower rank
    fsdp_train_token_overhead_s: float = 0.0
    fsdp_infer_token_overhead_s: float = 0.0
    optimizer_layer_overhead_s: float = 0.0  # per layer per optimizer step: clipping, AdamW on plain tensors
    optimizer_step_overhead_s: float = 0.0  # per optimizer step: the rest (embeddings, head, bookkeeping)
    # per optimizer step beyond plain tensors' on FSDP2's (d > 1) and tensor parallelism's (t > 1) DTensors:
    # the clipping norm's reductions and the fused kernel's dispatch per layout (profiles before version 4: 0)
    fsdp_optimizer_step_overhead_s: float = 0.0
    tp_optimizer_step_overhead_s: float = 0.0
    # per token of a rank's micro-batch, what the engine's passes cost beyond the FLOP, activation and fixed
    # terms (packing, shared-prompt attention, the log-prob chunks, the loss): a training micro-batch's
    # forward and backward, an inference forward (microbench_path.engine_passes; before version 4: 0)
    train_token_overhead_s: float = 0.0
    infer_token_overhead_s: float = 0.0
    # and per micro-batch, the engine's fixed cost beyond the simulator's (the loss, packing's set-up, the
    # log-prob chunks' loop): the same runs' intercept, at any width (before version 8: 0)
    train_batch_overhead_s: float = 0.0
    infer_batch_overhead_s: float = 0.0
    # the hidden size the terms above were measured at: another width pays them times its hidden / this
    token_overhead_width: float = 0.0
    # per token of a pipeline stage's pass over a micro-batch (p > 1), the same beyond the FLOP, activation and
    # fixed terms: training, inference (engine_passes on 2 stages; before version 12: 0), scaled alike
    pipeline_train_token_overhead_s: float = 0.0
    pipeline_infer_token_overhead_s: float = 0.0
    # per activation value a pass's non-matmul ops write (norms, rotary, SiLU, softmax, log-softmax; memory-
    # bound), ModelSpec.layer_activation_elements' count; what a small model's tokens cost beyond its GEMMs
    activation_s_per_element: float = 0.0
    # what the 3D-HybridEngine's switch round (train -> generate -> train) costs beyond its bytes, per unit
    # it gathers (microbench_path.switch_rounds; before version 9: the FSDP2 unit at fsdp_layer_overhead_s,
    # the others 0): per FSDP2 unit unsharded at d > 1, per layer whose TP pieces are gathered (t > tg), per
    # pipeline stage exchanged (p > pg)
    switch_fsdp_unit_s: float = 0.0
    switch_tp_unit_s: float = 0.0
    switch_stage_s: float = 0.0
    # Amdahl's parallel fraction of a CPU rank's training and inference passes over its intra-op threads
    # (engine_passes at one thread and at all cores; before version 11: 0): a plan that leaves a node's cores
    # idle gives each rank cores // ranks threads (controller/process.cpu_threads; simulate.thread_speedup)
    thread_fraction_train: float = 0.0
    thread_fraction_infer: float = 0.0
    usable_memory_fraction: float = 0.9  # the rest: framework, fragmentation, communication buffers
    measured: bool = False  # True: from a device profile measured on the machine (profile.py); else datasheet


# The path's fixed costs on GPUs, not measured here (no GPU to measure them on): a worker-group call is a
# Ray round trip (~1 ms) plus splitting, putting and gathering the batch over 8 ranks, ~5 ms; the batch moves
# through Ray's object store at ~2 GB/s (serialization). The per-pass and optimizer terms are 0: the host's
# Python (op dispatch, DTensor, FSDP2's hooks, AdamW's loop) runs ahead of the device's asynchronous kernels,
# which at the catalogue's model sizes take longer; for small models, measure a profile.
_GPU_PATH = dict(call_overhead_s=5e-3, transfer_bandwidth=2e9)
_A100 = dict(
    **_GPU_PATH,
    peak_flops=312e12,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=25e9,  # 200 Gbps per server, the paper's cluster
    host_bandwidth=25e9,
)
_H100 = dict(
    **_GPU_PATH,
    peak_flops=989e12,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=400e9,
    host_bandwidth=50e9,
)

DEVICES = {
    "a100-40": DeviceSpec("a100-40", 40 * GiB, hbm_bandwidth=1.555e12, **_A100),
    "a100-80": DeviceSpec("a100-80", 80 * GiB, hbm_bandwidth=2.039e12, **_A100),
    "h100": DeviceSpec("h100", 80 * GiB, hbm_bandwidth=3.35e12, **_H100),
    "h200": DeviceSpec("h200", 141e9, hbm_bandwidth=4.8e12, **_H100),
    # One single-threaded worker process running eager PyTorch in fp32 (~1 AVX2 core); the per-layer
    # and per-decode-step overheads are Python and op dispatch, which dominate for the tiny models.
    "cpu": DeviceSpec(
        "cpu",
        8 * GiB,
        peak_flops=100e9,
        hbm_bandwidth=20e9,
        intra_node_bandwidth=5e9,
        inter_node_bandwidth=1.25e9,
        host_bandwidth=20e9,
        devices_per_node=2,
        bytes_per_param=4,
        compute_efficiency=0.3,
        memory_efficiency=0.5,
        comm_latency_s=1e-4,
        layer_overhead_s=1e-3,
        decode_step_overhead_s=5e-3,  # HF generate's per-token Python loop, measured on the dev machine
    ),
}


# The same core computing in bf16 (model.dtype=bfloat16 on a CPU with AVX512-BF16): GEMMs at the 25M
# model's shapes ran 3.5x (32 rows) to 4.7x (1,024 rows) the fp32 rate on the dev machine (docs/rollout.md,
# "Compute dtype"); the per-layer and per-step overheads are the same Python.
DEVICES["cpu-bf16"] = replace(DEVICES["cpu"], name="cpu-bf16", peak_flops=350e9, bytes_per_param=2)


def get_device(name: str) -> DeviceSpec:
    key = name.lower().replace("_", "-")
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; the catalogue has {sorted(DEVICES)}")
    return DEVICES[key]


@dataclass(frozen=True)
class ClusterSpec:
    """`num_devices` devices of one kind, `devices_per_node` to a node."""

    device: DeviceSpec
    num_devices: int
    devices_per_node: int = 8

    def __post_init__(self):
        if self.num_devices < 1:
            raise ValueError(f"cluster needs at least one device, got num_devices={self.num_devices}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")

    @classmethod
    def build(cls, device: str | DeviceSpec, num_devices: int, devices_per_node: int | None = None):
        dev = get_device(device) if isinstance(device, str) else device
        return cls(dev, num_devices, devices_per_node or dev.devices_per_node)


@dataclass(frozen=True)
class WorkloadSpec:
    """One RL iteration's amount of work. Defaults are the paper's setting (sec. 8.1)."""

    prompts: int = 1024  # global batch of prompts per iteration
    samples_per_prompt: int = 1  # responses per prompt (GRPO's group size)
    prompt_len: int = 1024  # tokens
    response_len: int = 1024  # tokens
    ppo_epochs: int = 1  # passes over the batch in the training stage
    mini_batches: int = 8  # optimizer steps per epoch, each a gradient all-reduce (8 = 128 prompts each)
    micro_batch_size: int = 1  # sequences per device per forward/backward in training
    inference_micro_batch_size: int = 8  # sequences per device per forward in inference
    # per role (the planner's names), its own (training, inference) micro-batch rows: each worker runs
    # its passes at its section's size (the critic's values at critic's, old log-probs at the actor's); a
    # role not named takes the two above. Pairs, not a dict: frozen and hashable
    role_micro_batches: tuple[tuple[str, int, int], ...] = ()
    # the training-side forwards compute a prompt once for its samples in a micro-batch (model.share_prompt)
    shared_prompts: bool = False
    # the prompts' mean token count where the data is known and the training-side passes pack real tokens
    # (padding removal); 0: prompt_len. Their time reads it; memory reads prompt_len, the bound
    mean_prompt_len: float = 0.0
    # the longest prompt where the data is known (0: prompt_len): batches are left-padded to their longest, so
    # padded passes (generation's prefill and cache, pipeline stages) and the driver's batches run at it
    longest_prompt_len: int = 0

    def __post_init__(self):
        for field in ("prompts", "samples_per_prompt", "prompt_len", "response_len", "ppo_epochs"):
            if getattr(self, field) < 1:
                raise ValueError(f"WorkloadSpec.{field} must be >= 1, got {getattr(self, field)}")
        if self.mini_batches < 1 or self.micro_batch_size < 1 or self.inference_micro_batch_size < 1:
            raise ValueError("WorkloadSpec: mini_batches and micro batch sizes must be >= 1")
        for field in ("mean_prompt_len", "longest_prompt_len"):
            if not 0 <= getattr(self, field) <= self.prompt_len:
                raise ValueError(
                    f"WorkloadSpec.{field} must be in [0, prompt_len], got {getattr(self, field)}"
                )

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    def tokens_per_sequence(self, rows: int) -> float:
        """Tokens a training-side forward computes per sequence in micro-batches of `rows` rows: with shared
        prompts a prompt once for the samples of it a micro-batch holds (consecutive rows)."""
        if not self.shared_prompts:
            return self.packed_seq_len
        return self.packed_prompt_len / min(self.samples_per_prompt, rows) + self.response_len

    @property
    def packed_prompt_len(self) -> float:
        """Prompt tokens a training-side pass computes per sequence (the mean where known)."""
        return float(self.mean_prompt_len or self.padded_prompt_len)

    @property
    def packed_seq_len(self) -> float:
        return self.packed_prompt_len + self.response_len

    def for_role(self, role: str) -> WorkloadSpec:
        """This workload with `role`'s own micro-batch sizes (role_micro_batches)."""
        for name, train, infer in self.role_micro_batches:
            if name == role:
                return replace(
                    self, micro_batch_size=train, inference_micro_batch_size=infer, role_micro_batches=()
                )
        return self

    @property
    def seq_len(self) -> int:
        """The longest a sequence may be: what memory is sized for."""
        return self.prompt_len + self.response_len

    @property
    def padded_prompt_len(self) -> int:
        """The width a batch's prompts are padded to (longest_prompt_len where known)."""
        return self.longest_prompt_len or self.prompt_len

    @property
    def padded_seq_len(self) -> int:
        """A padded row's length: what the padded passes compute and the driver's batches carry."""
        return self.padded_prompt_len + self.response_len


@dataclass(frozen=True)
class EngineLimits:
    """Which layouts the engines that will run the plan can execute; the search considers no others.

    The default is the paper's unconstrained search: any p dividing the layers, and a t that divides
    the attention heads while the KV heads are either split (kv_heads % t == 0) or replicated
    (t % kv_heads == 0). Frozen and hashable: it is part of `auto_parallel`'s cache key.
    """

    max_pp: int | None = None  # largest training/inference pipeline size p (None: no limit)
    max_pg: int | None = None  # largest generation pipeline size pg (None: up to p)
    # t must divide the heads, the KV heads and the MLP width: the engine shards whole heads and
    # MLP columns and cannot replicate KV heads across tensor-parallel ranks
    tp_shards_whole_heads: bool = False
    # largest tg of a one-step-ahead rollout pool (ahead.py; None: any), 1 where it runs plain replicas
    max_rollout_tg: int | None = None
    # each rollout-pool rank holds and is sent the full weights and generates on its tg-slice (an engine
    # whose loader slices them itself); its memory and weight sync are priced at the whole model. False
    # (the built-in trainer, rollout/pool_tp.py): each rank holds and is sent its generation shard only
    rollout_full_weights: bool = False
    # per role (the planner's names), the largest t its pipeline stages (p > 1) run with; 0: that role
    # runs no pipeline; a role not named: any t. Pairs, not a dict: frozen and hashable
    pipeline_max_tp: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        for name in ("max_pp", "max_pg", "max_rollout_tg"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"EngineLimits.{name} must be >= 1 or None (no limit), got {value}")
        # a plan file's JSON / YAML gives lists: the same limits as tuples, in one order
        pairs = tuple(sorted((str(r), int(t)) for r, t in self.pipeline_max_tp))
        object.__setattr__(self, "pipeline_max_tp", pairs)

    def allows(self, role: str | None, p: int, t: int) -> bool:
        """Whether a model of `role` may run p pipeline stages with t-way TP (max_pp, pipeline_max_tp)."""
        if self.max_pp is not None and p > self.max_pp:
            return False
        limit = dict(self.pipeline_max_tp).get(role)
        return p == 1 or limit is None or t <= limit

    def allows_tp(self, spec: ModelSpec, t: int) -> bool:
        """Whether tensor-parallel size t can shard `spec` (t = 1 always can)."""
        if spec.num_heads % t:
            return False
        if self.tp_shards_whole_heads:
            return spec.num_kv_heads % t == 0 and spec.ffn_hidden % t == 0
        return spec.num_kv_heads % t == 0 or t % spec.num_kv_heads == 0

    def describe(self) -> str:
        """'max_pp=1, tp shards whole heads', or 'unconstrained'."""
        named = (("max_pp", self.max_pp), ("max_pg", self.max_pg), ("max_rollout_tg", self.max_rollout_tg))
        parts = [f"{k}={v}" for k, v in named if v is not None]
        if self.tp_shards_whole_heads:
            parts.append("tp shards whole heads")
        if self.rollout_full_weights:
            parts.append("rollout ranks hold full weights")
        by_t: dict[int, list[str]] = {}
        for role, t in self.pipeline_max_tp:
            by_t.setdefault(t, []).append(role)
        for t, roles in sorted(by_t.items()):
            parts.append(f"p > 1 {'only with t <= ' + str(t) if t else 'never'} for {'/'.join(roles)}")
        return ", ".join(parts) or "unconstrained"


# The planner's roles whose pipeline stages the training engine runs (engines/pipeline_engine.py, the
# reward section's engine serving both reward and cost), every one with any t (p x t x d: each stage's
# (dp, tp) plane, engines/pipeline.py; the actor's switch to generation in hybrid_engine/pipeline_switch.py).
PIPELINE_ROLES = ("actor", "critic", "reference", "reward", "cost")
# What hybridflow's own engines run, the one definition `hybridflow plan` (its default, `--engines builtin`),
# `resources.placement=auto` and the plan-file check read: pipeline stages (p > 1) for every role with any t
# (no per-role `pipeline_max_tp`: `config_limits` in trainers/auto_placement.py sets 0 for a role whose
# stages a config cannot run), generation without a pipeline (pg = 1, never planned otherwise: the switch
# gathers each rank's tg-shard of every stage, hybrid_engine/pipeline_switch.py; there is no pipelined
# decoding), DTensor TP plans that split whole heads, KV heads and MLP columns. A one-step-ahead rollout pool
# runs any tg dividing the heads, each rank holding and sent only its generation shard (rollout/pool_tp.py).
# `hybridflow plan --engines any` searches the paper's full space.
ENGINE_LIMITS = EngineLimits(max_pg=1, tp_shards_whole_heads=True)


def save_dict(data: dict, path) -> Path:
    """`data` as YAML (.yaml/.yml) or JSON (anything else): how plans and device profiles are written."""
    import json
    from pathlib import Path

    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(json.dumps(data, indent=2))
    return path


def load_dict(path, missing: str) -> dict:
    """What save_dict wrote at `path` (YAML for .yaml/.yml, JSON otherwise: PyYAML would read JSON's `1e-05`
    as a string); FileNotFoundError(`missing`) when there is no file."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(missing)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(path.read_text())
    return json.loads(path.read_text())
