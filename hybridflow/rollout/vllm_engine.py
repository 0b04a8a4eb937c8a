"""`rollout.engine: vllm`: vLLM's offline engine behind GenerationEngine, in-process in the rollout rank.

As verl's hybrid worker does, each actor rank holds one `vllm.LLM` in its own process (no vLLM worker
processes, `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Weights never touch disk: the engine is built from the
model's config alone (`load_format="dummy"`), and before every `generate` the actor's current weights go
to vLLM as an iterator of (HF name, tensor) through vLLM's in-place `reload_weights`, then the prefix
cache is reset so no KV computed from old weights is reused. See docs/rollout.md. A LoRA actor's
generation weights come from the 3D-HybridEngine with the adapters merged under their HF names, so vLLM
is streamed the merged weights, every one whole (`sent_bytes` counts them; docs/lora.md).

Output: the same Batch as the built-in engine (`build_rollout_batch`), so nothing downstream knows which
engine ran. `rollout_log_probs` come from vLLM's "processed_logprobs" mode: log_softmax(logits / T)
over the full vocabulary, the built-in engine's convention (rollout/sampling.py), when top-k/top-p do
not truncate. When they do, vLLM's values are of the truncated distribution; the batch then says so in
meta.rollout_log_probs_exact = False and the trainer recomputes old_log_probs with the actor.

The rollout pool of trainer.rollout_ahead=1 (`own_weights`): vLLM holds the weights itself; each weight
sync streams the received buckets straight into `load_weights` (workers/weight_sync.py), and generate
loads nothing.

GPU path (written, not yet run on a GPU): `gpu_memory_utilization` is passed to vLLM; between
generate calls the engine sleeps (level 2: KV cache and weights freed) and wakes weights first, loads
the actor's weights, then the KV cache (verl's order, lowest peak memory), returning torch's cached
blocks to the device before each wake (`release_cached_blocks`; docs/rollout.md, "GPU memory").

rollout.tg > 1 (CPU and GPU): vLLM's own tensor parallel over the actor's ranks (its external launcher,
TP groups of consecutive ranks in the actor's process group), each rank loading its 3D-HybridEngine
generation shard (`shard_as_full`); on the rollout pool, over the pool's ranks, each loading the whole
synced model (vLLM's loaders cut their block).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.batch import Batch
from hybridflow.models.lora import hf_name
from hybridflow.rollout import base, vllm_pad
from hybridflow.rollout.base import GenerationEngine, SamplingParams, build_rollout_batch, check_prompt_batch
from hybridflow.rollout.tp_group import TPGroup
from hybridflow.rollout.vllm_memory import kv_cache_bytes, memory_settings  # noqa: F401  (kv_cache_bytes re-exported)

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class VLLMEngineConfig:
    """How the vLLM engine is built (sampling itself is per call, in SamplingParams)."""

    max_model_len: int = 2048
    """Longest prompt + response (data.max_prompt_length + rollout.response_length)."""
    max_num_seqs: int = 256
    """Most sequences (prompts x n) vLLM schedules at once; the KV cache is sized for them."""
    gpu_memory_utilization: float = 0.0
    """Fraction of device memory (on CPU: of RAM, as vLLM's CPU build reads it) for weights + KV
    cache. 0: a KV cache sized exactly for max_num_seqs x max_model_len (vLLM's
    kv_cache_memory_bytes), which leaves the rest of the device to the colocated training."""
    tensor_parallel_size: int = 1
    """rollout.tg: vLLM tensor parallel over groups of consecutive actor ranks (CPU and GPU)."""
    seed: int = 0
    cpu_threads: int = 0
    """Torch intra-op threads while generating on CPU (0 = the process's setting)."""
    pad_token_id: int | None = None
    dtype: torch.dtype | None = None
    """The dtype vLLM computes and holds its weights in (the actor's compute dtype); None = the model's."""
    own_weights: bool = False
    """False: the actor's model is streamed into vLLM before every generate (colocated). True: vLLM
    holds the weights itself, loaded from `model` once when built and afterwards only by load_weights
    (the rollout pool of trainer.rollout_ahead=1, fed by workers/weight_sync.py); it never sleeps,
    since that pool trains nothing."""


def available() -> str | None:
    """None when vLLM can be imported here, else the one-line reason."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or vLLM's own import-time failures
        return (
            f"vLLM is not installed in this environment ({type(e).__name__}: {e}); "
            "`make vllm` builds .venv-vllm with it"
        )
    return None


class VLLMEngine(GenerationEngine):
    """`generate(batch, params) -> Batch` with vLLM, on `model`'s current weights (see module docstring).

    model: the HF causal LM whose parameters are full tensors whenever `generate` runs (the actor's
    model inside the worker's generation-weights context, or a plain model). Its config builds vLLM's
    model; its weights are streamed into vLLM at every call. With own_weights it may be on the meta
    device (built by models/meta.py): the weights are then read from its directory (`stored_weights`).
    device: where vLLM runs; None: where the model's parameters are.
    """

    def __init__(self, model: torch.nn.Module, config: VLLMEngineConfig | None = None, device=None):
        reason = available()
        if reason is not None:
            raise RuntimeError(f"rollout.engine=vllm: {reason}")
        self.model = model
        self.config = config or VLLMEngineConfig()
        cfg = model.config
        pad = self.config.pad_token_id
        if pad is None:
            pad = cfg.pad_token_id if cfg.pad_token_id is not None else _first(cfg.eos_token_id)
        self.pad_token_id = 0 if pad is None else int(pad)
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.gpu = self.device.type == "cuda"
        self.last_stats: dict[str, float] = {}
        self.sent_bytes = 0  # every tensor load_weights has streamed into vLLM, in the dtype vLLM holds
        self.llm = self._build(cfg, self.config.dtype or param.dtype)
        self._asleep = False
        if self.config.own_weights:
            self.load_weights(stored_weights(model))
        elif self.gpu:
            self.sleep()

    # ---- construction ------------------------------------------------------------------------------
    def _build(self, hf_config, dtype: torch.dtype):
        c = self.config
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine: model dtype {dtype} is not one of {list(_DTYPES)}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU-build warnings are not ours to act on
        self.pad_head_dim = None  # CPU: heads zero-padded to a size vLLM has a kernel for (vllm_pad.py)
        if not self.gpu:
            reason = vllm_pad.unsupported_reason(hf_config)
            if reason is not None:
                raise ValueError(f"VLLMEngine: {reason}")
            self.pad_head_dim = vllm_pad.padded_head_dim(vllm_pad.head_dim_of(hf_config))
        kw = dict(
            skip_tokenizer_init=True,  # prompts and outputs are token ids
            load_format="dummy",  # weights come from the actor at every generate, never from disk
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            dtype=_DTYPES[dtype],
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=max(c.max_model_len, 2048),
            logprobs_mode="processed_logprobs",
            seed=c.seed,
            enable_prefix_caching=True,
        )
        # auto on a CUDA device: what is free now, before vLLM allocates (the colocated actor's share taken)
        device_memory = (
            torch.cuda.mem_get_info(self.device) if self.gpu and not c.gpu_memory_utilization else None
        )
        kw.update(
            memory_settings(hf_config, dtype, c, self.pad_head_dim, device_memory, self._weight_bytes(dtype))
        )
        if self.gpu:
            kw.update(enable_sleep_mode=not c.own_weights, enforce_eager=False)
        else:
            kw.update(enforce_eager=True)
        if c.tensor_parallel_size > 1:
            # vLLM's TP over the actor's own ranks (its external launcher; the CPU build too, over gloo):
            # TP groups of consecutive ranks in the existing process group. The launcher reads the
            # torchrun variables; Ray workers have the process group but not these (each worker sees its
            # own GPU as device 0).
            rank = torch.distributed.get_rank()
            if not self.gpu:
                clear_stale_cpu_shm(rank)
            os.environ.setdefault("RANK", str(rank))
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if self.gpu else rank))
            kw.update(
                tensor_parallel_size=c.tensor_parallel_size,
                distributed_executor_backend="external_launcher",
            )
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; the
        # training engine in this same process still needs it.
        set_threads = torch.set_num_threads
        from vllm import LLM

        with tempfile.TemporaryDirectory(prefix="hybridflow-vllm-") as tmp:
            hf_config.save_pretrained(tmp)  # config only: vLLM builds the model from it
            if self.pad_head_dim:
                vllm_pad.write_padded_config(hf_config, tmp, self.pad_head_dim)
            try:
                return LLM(model=tmp, **kw)
            finally:
                torch.set_num_threads = set_threads

    def _weight_bytes(self, dtype: torch.dtype) -> int:
        """This rank's share of vLLM's weights in `dtype` (a tg-way rank holds about 1/tg of them)."""
        numel = sum(p.numel() for p in self.model.parameters())
        return numel * dtype.itemsize // self.config.tensor_parallel_size

    # ---- GenerationEngine --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, full tensor) pairs into vLLM's model in place, then drop the stale prefix cache."""
        if self.config.dtype is not None:  # the actor's fp32 master weights, in the dtype vLLM holds
            weights = ((name, t.to(self.config.dtype)) for name, t in weights)
        weights = self._counted(weights)
        if self.pad_head_dim:
            weights = vllm_pad.pad_weights(weights, self.model.config, self.pad_head_dim)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def _counted(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, t in weights:
            self.sent_bytes += t.numel() * t.element_size()
            yield name, t

    def set_shard(self, weights, tp=None) -> None:
        """The 3D-HybridEngine's generation weights for the next calls (hybrid_engine/resharder.py): HF
        name -> tensor, or None for the model's own parameters. With rollout.tg > 1, `tp` is this rank's
        generation TP group and the tensors are its tg-way shards, which vLLM's TP rank of the same
        index holds (see `shard_as_full`)."""
        if tp is not None and tp.size > 1:
            if tp.size != self.config.tensor_parallel_size:
                raise ValueError(
                    f"VLLMEngine: built with tensor_parallel_size={self.config.tensor_parallel_size}, "
                    f"given a tg={tp.size} shard"
                )
            from vllm.distributed import get_tensor_model_parallel_rank

            ours, theirs = torch.distributed.get_rank(tp.group), get_tensor_model_parallel_rank()
            if ours != theirs:
                raise ValueError(
                    f"VLLMEngine: this rank holds generation TP shard {ours} but is vLLM's TP rank {theirs} "
                    "(vLLM groups consecutive ranks; the resharder's groups must too)"
                )
        self.shard, self.shard_tp = weights, (tp if tp is not None and tp.size > 1 else None)

    def sync_weights(self) -> float:
        """Stream the current generation weights into vLLM; returns the seconds it took."""
        start = time.perf_counter()
        shard, tp = getattr(self, "shard", None), getattr(self, "shard_tp", None)
        if shard is None:
            named = ((n, _full(p.detach())) for n, p in self.model.named_parameters())
        else:
            # DTensor: the global shape. A LoRA actor's shard holds merged weights under their HF names
            # (hybrid_engine/resharder.py), the shapes of the adapted layers' base weights
            shapes = {hf_name(n): tuple(p.shape) for n, p in self.model.named_parameters()}
            rank = torch.distributed.get_rank(tp.group) if tp is not None else 0
            named = ((n, shard_as_full(n, _full(p.detach()), shapes[n], rank, tp)) for n, p in shard.items())
        self.load_weights(named)
        return time.perf_counter() - start

    def sleep(self) -> None:
        """GPU: free vLLM's KV cache and weights while training runs (level 2: the weights are
        reloaded from the actor at the next generate anyway). CPU: nothing to free."""
        if self.gpu and not self._asleep and not self.config.own_weights:
            self.llm.sleep(level=2)
            self._asleep = True

    def _wake_and_sync(self) -> float:
        if self.config.own_weights:
            return 0.0  # loaded by load_weights when they changed
        if not self._asleep:
            return self.sync_weights()
        # vLLM's sleep mode maps its weights and KV cache in a memory pool of its own: blocks that torch's
        # caching allocator keeps for the training side (activations, gradients, the full tensors streamed
        # below) are not available to it until they are returned to the device.
        release_cached_blocks(self.device)
        self.llm.wake_up(tags=["weights"])
        seconds = self.sync_weights()
        release_cached_blocks(self.device)
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False
        return seconds

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        ids, mask = check_prompt_batch(batch)
        start = time.perf_counter()
        threads = torch.get_num_threads()
        if not self.gpu and self.config.cpu_threads > 0:
            torch.set_num_threads(self.config.cpu_threads)
        try:
            sync_s = self._wake_and_sync()
            outputs = self.llm.generate(
                prompts_as_vllm(ids, mask),
                vllm_sampling_params(params, base.prompt_ids(batch).tolist(), self.eos_ids),
                use_tqdm=False,
            )
        finally:
            torch.set_num_threads(threads)
            self.sleep()
        responses, lengths, logps = outputs_to_tensors(outputs, params, self.pad_token_id)
        self.last_stats = {
            "rollout/seconds": time.perf_counter() - start,
            "rollout/weight_sync_seconds": sync_s,
            "rollout/response_tokens": float(lengths.sum()),
            "rollout/prompt_tokens": float(mask.sum()) * params.n,
        }
        out = build_rollout_batch(batch, responses, lengths, logps, params, self.pad_token_id)
        out.meta.rollout_log_probs_exact = params.greedy or not truncates(params)
        return out

    @contextlib.contextmanager
    def continuous(
        self, params: SamplingParams, rows: int, max_len: int, prompts: torch.Tensor | None = None
    ):
        """The agent loop's continuous batch on vLLM's scheduler (rollout/vllm_continuous.py), on the
        weights `generate` would load. Under vLLM tensor parallel (rollout.tg > 1) every rank of the
        group runs it in lockstep, the first rank deciding (`vllm_tp_group`)."""
        from hybridflow.rollout.vllm_continuous import VLLMContinuous

        threads = torch.get_num_threads()
        if not self.gpu and self.config.cpu_threads > 0:
            torch.set_num_threads(self.config.cpu_threads)
        batch = None
        try:
            self._wake_and_sync()
            stop = params.stop_ids(self.eos_ids)
            tp = vllm_tp_group() if self.config.tensor_parallel_size > 1 else None
            batch = VLLMContinuous(
                self.llm.llm_engine, params, rows, max_len, stop, self.eos_ids, tp, self.device, prompts
            )
            yield batch
        finally:
            if batch is not None:
                batch.close()
            torch.set_num_threads(threads)
            self.sleep()

    @property
    def eos_ids(self):
        return self.model.config.eos_token_id

    def close(self) -> None:
        """Drop the engine and vLLM's parallel groups, so another engine can be built in this process."""
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import destroy_model_parallel

            del self.llm
            destroy_model_parallel()


def vllm_tp_group() -> TPGroup:
    """vLLM's tensor-parallel group (built by its external launcher inside the actor's process group)
    as a TPGroup: its device group (NCCL on GPU, gloo on CPU) and its first rank deciding."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return TPGroup(group.device_group, group.world_size, group.first_rank)


def release_cached_blocks(device: torch.device) -> None:
    """Return torch's cached, unused CUDA blocks to the device (before a vLLM wake_up maps memory). On
    any other device nothing: no CUDA call is made, so a CPU-only torch never initialises CUDA here."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- pure translation between hybridflow and vLLM ----------------------------------------------------
def truncates(params: SamplingParams) -> bool:
    """True when top-k or top-p can drop tokens (vLLM's processed log-probs then differ from ours)."""
    return params.top_k > 0 or params.top_p < 1.0


def prompts_as_vllm(ids: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Left-padded (B, Lp) prompts -> vLLM TokensPrompt dicts without the padding."""
    return [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]


def vllm_sampling_params(params: SamplingParams, prompts: list[int], default_eos) -> list:
    """One vLLM SamplingParams per prompt id in `prompts` (base.prompt_ids). Stop ids are passed explicitly
    (ignore_eos: vLLM has no tokenizer here), and prompt p gets seed + p * n (mod 2^31): vLLM seeds its n
    samples seed, seed + 1, ..., so a prompt's seeds are the same whichever rank or batch it is in."""
    from vllm import SamplingParams as VSP

    common = dict(
        n=params.n,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k if params.top_k > 0 and not params.greedy else 0,
        top_p=params.top_p if not params.greedy else 1.0,
        stop_token_ids=list(params.stop_ids(default_eos)),
        ignore_eos=True,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )
    seed = params.seed
    return [VSP(seed=None if seed is None else (seed + p * params.n) % 2**31, **common) for p in prompts]


def outputs_to_tensors(outputs, params: SamplingParams, pad_token_id: int):
    """vLLM RequestOutputs (one per prompt, n completions each) -> responses (B*n, Lr), lengths (B*n,),
    log-probs (B*n, Lr), rows ordered prompt-major (a, a, b, b) as build_rollout_batch expects."""
    rows = len(outputs) * params.n
    lr = params.max_new_tokens
    responses = torch.full((rows, lr), pad_token_id, dtype=torch.long)
    logps = torch.zeros(rows, lr, dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != params.n:
            raise RuntimeError(
                f"vLLM returned {len(completions)} completions for a prompt, expected {params.n}"
            )
        for j, c in enumerate(completions):
            r, toks = i * params.n + j, list(c.token_ids)[:lr]
            responses[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            lengths[r] = len(toks)
            logps[r, : len(toks)] = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
    return responses, lengths, logps


# Megatron-style generation shards (hybrid_engine/resharder.py): split on the output features
# (column-parallel) or the input features (row-parallel), rank r holding the r-th contiguous block, as
# vLLM's QKV/merged-column/row-parallel linears hold theirs.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def shard_as_full(name: str, t: torch.Tensor, full_shape: tuple, rank: int, tp) -> torch.Tensor:
    """A generation shard as the full-shaped tensor vLLM's weight loaders take: they cut this TP rank's
    block out of a full tensor themselves (narrow), and no vLLM API loads a pre-cut one through the
    in-place reload. For a Megatron-split linear the shard goes into a zero tensor at its block's offset
    (no communication: the loader reads exactly that block); any other split (e.g. a vocab-parallel
    embedding, whose blocks vLLM pads differently) is all-gathered over the TP group."""
    if tuple(t.shape) == tuple(full_shape):
        return t
    diff = [d for d, (a, b) in enumerate(zip(t.shape, full_shape)) if a != b]
    if tp is None or len(diff) != 1 or full_shape[diff[0]] != t.shape[diff[0]] * tp.size:
        raise ValueError(f"VLLMEngine: {name} has shape {tuple(t.shape)}, not a tg-way block of {full_shape}")
    dim, module = diff[0], name.split(".")[-2]
    if (module in _COLUMN and dim == 0) or (module in _ROW and dim == t.dim() - 1):
        full = t.new_zeros(full_shape)
        full.narrow(dim, rank * t.shape[dim], t.shape[dim]).copy_(t)
        return full
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, t.contiguous(), group=tp.group)
    return torch.cat(parts, dim)


def stored_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of each parameter, one at a time: the model's own tensor, or for one on the
    meta device (models/meta.py: a rollout pool's, whose weights vLLM alone holds) the tensor read from
    its directory's safetensors, so they never sit on the device beside vLLM's copy."""
    from safetensors import safe_open

    from hybridflow.models.meta import WEIGHTS_ATTR, weight_files

    files = None
    with contextlib.ExitStack() as stack:
        handles: dict = {}
        for name, p in model.named_parameters():
            if not p.is_meta:
                yield name, _full(p.detach())
                continue
            if files is None:
                files = weight_files(getattr(model, WEIGHTS_ATTR))
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(safe_open(str(files[name]), framework="pt"))
            yield name, handles[files[name]].get_tensor(name)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (tensor-parallel actor) gathered to the full tensor vLLM's loaders shard themselves."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _first(x):
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x


def clear_stale_cpu_shm(rank: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove this rank's leftover vLLM CPU all-reduce segments; -> the paths removed.

    vLLM's CPU tensor parallelism keeps a shared-memory file per rank, `<ident>-tp:...-cpushm_<rank>`,
    whose name is the same for every engine started by the external launcher (its ident comes from
    the "env://" init method). A process that is killed rather than shut down (a worker restart, the end
    of a Ray job) leaves it behind, and the next engine's create then fails with EEXIST. A file no live
    process has mapped is such a leftover."""
    import glob

    stale = [
        path
        for path in glob.glob(os.path.join(shm_dir, f"*-cpushm_{rank}"))
        if not _mapped_by_a_live_process(path)
    ]
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return stale


def _mapped_by_a_live_process(path: str) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if path in maps.read_text():
                return True
        except OSError:  # the process exited, or is not ours to read
            continue
    return False
