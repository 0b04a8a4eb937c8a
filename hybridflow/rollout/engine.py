"""The built-in generation engine: batched prefill + incremental decode on the actor's own model.

It holds a reference to the HF model it is given (the training actor's) and reads its parameters at
every `generate`, so there is no weight copy when training and generation share a device and layout.
Under the 3D-HybridEngine (docs/hybrid_engine.md) the actor's Resharder hands it this rank's generation
shard and tensor-parallel group instead (`set_shard`) for the duration of a call. Llama / Qwen2 / Mistral
run on a lean functional forward with a static KV cache (`llama_decoder.py`, tensor-parallel when given
a group); other architectures fall back to the HF forward on the model's own whole weights
(`hf_decoder.py`), run on a hook-free replica bound to them for the call, so no FSDP hook runs while
decoding.

Finished rows stop costing compute: when the finished rows still in the decode batch exceed
`compact_fraction` of it, they are dropped. Compaction fills each hole left by a finished row with a
live row from the end of the batch, so it copies one cache row per finished row (not the whole cache)
and is cheap enough to run as soon as any row finishes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.models import cpu_gemm
from hybridflow.rollout.base import (
    GenerationEngine,
    SamplingParams,
    build_rollout_batch,
    check_prompt_batch,
    load_named_weights,
    prompt_ids,
)
from hybridflow.rollout.continuous import ContinuousBatch
from hybridflow.rollout.hf_decoder import HFDecoder, PlainReplica
from hybridflow.rollout.llama_decoder import LlamaFamilyDecoder, unsupported_reason
from hybridflow.rollout.ragged_decoder import RaggedDecoder
from hybridflow.rollout.sampling import counter_uniforms, sample_keys, sample_next
from hybridflow.rollout.tp_group import TPGroup

SMALL_MODEL_PARAMS = 5_000_000


@dataclass
class BuiltinEngineConfig:
    """Knobs of the built-in engine (sampling itself is per call, in SamplingParams)."""

    backend: str = "auto"
    """"functional" (Llama family only), "hf" (any causal LM) or "auto" (functional when supported)."""
    compact_fraction: float = 0.0
    """Drop finished rows from the decode batch once they exceed this fraction of it (0 = at once)."""
    pack_weights: bool = True
    """Functional backend: run on a packed copy of the decoder layers' weights and lm_head (fused
    q/k/v and gate/up, in MKL's packed GEMM format on fp32 CPU, else stored transposed; see
    decoder_weights.pack_layer), rebuilt at every `generate` call and freed at its end: one extra copy
    of those weights while generating, for faster decode matmuls (docs/bench/generation.md, "Settings
    of the built-in engine"). False: views of the model's weights, no copy."""
    pad_token_id: int | None = None
    """Pad id for responses; None: the model config's pad_token_id, else its eos, else 0."""
    cpu_threads: int = 0
    """Torch intra-op threads while generating on CPU; 0 = auto: 1 thread for models under
    SMALL_MODEL_PARAMS parameters (their decode matmuls are too small to split: the threads' wake-ups
    cost more than they save; docs/bench/generation.md, "Settings of the built-in engine"), else the
    process's setting."""
    dtype: torch.dtype | None = None
    """The dtype generation computes in; None = the weights' own. Given (the actor's compute dtype:
    model.dtype bfloat16, or "auto" on GPU; workers/common.model_compute_dtype), the functional decoder
    runs on a copy of the weights cast to it at each call (none when they are stored in it: a rollout
    pool's) with its KV cache in it, and the HF fallback runs under autocast (docs/rollout.md, "Compute
    dtype", says when bf16 pays on CPU)."""
    cpu_gemm: str = "auto"
    """fp32 CPU GEMMs through "mkl", "onednn" or "auto" (oneDNN where MKL runs below the CPU's vector width:
    models/cpu_gemm.py): the functional decoder's packed weights, the HF fallback's linear layers;
    model.cpu_gemm."""
    max_num_seqs: int = 0
    """Most sequences (prompts x n) decoded at once; larger batches run in chunks (the agent loop's
    continuous batch: trajectories past it wait for a finished one's cache row). 0 = no limit.
    Bounds the KV cache: layers * 2 * max_num_seqs * kv_heads * (prompt + response len) * head_dim."""


class BuiltinEngine(GenerationEngine):
    """`generate(batch, params) -> Batch` on `model`'s own weights (see rollout/base.py for fields)."""

    def __init__(self, model: torch.nn.Module, config: BuiltinEngineConfig | None = None):
        self.model = model
        self.config = config or BuiltinEngineConfig()
        if self.config.backend not in ("auto", "functional", "hf"):
            raise ValueError(
                f"BuiltinEngineConfig.backend must be auto/functional/hf, got {self.config.backend!r}"
            )
        cfg = model.config
        pad = self.config.pad_token_id
        if pad is None:
            pad = cfg.pad_token_id if cfg.pad_token_id is not None else _first(cfg.eos_token_id)
        self.pad_token_id = 0 if pad is None else int(pad)
        self.shard: Mapping[str, torch.Tensor] | None = None
        self._num_params: int | None = None
        self.tp: TPGroup | None = None
        self._replica: PlainReplica | None = None  # the HF fallback's module tree, built at its first call

    def set_shard(self, weights: Mapping[str, torch.Tensor] | None, tp: TPGroup | None = None) -> None:
        """Generate from `weights` (HF name -> tensor; this rank's generation shard when `tp` is given)
        instead of the model's own parameters; None, None goes back to them. Set by the 3D-HybridEngine
        (hybrid_engine/resharder.py) around each generate call."""
        self.shard, self.tp = weights, tp

    def _decoder(self, max_len: int):
        backend = self.config.backend
        reason = unsupported_reason(self.model, max_len)
        if self.shard is not None and reason is not None:
            raise ValueError(
                f"BuiltinEngine: generating from resharded weights needs the functional decoder: {reason}"
            )
        if backend == "functional" and reason is not None:
            raise ValueError(
                f"BuiltinEngine: functional backend cannot run this model: {reason}; use backend='hf'"
            )
        if self.shard is None and (backend == "hf" or reason is not None):
            if self._replica is None:
                self._replica = PlainReplica(self.model)
                if cpu_gemm.resolve(self.config.cpu_gemm, self._device()):  # its fp32 layers, as the engines'
                    cpu_gemm.use_onednn(self._replica.model)
            replica = self._replica.bind(self.model)
            return HFDecoder(replica, self.config.dtype, release=self._replica.release)
        return LlamaFamilyDecoder(
            self.model, self.config.pack_weights, self.shard, self.tp, self.config.dtype, self.config.cpu_gemm
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self.model, weights)

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        ids, _ = check_prompt_batch(batch)
        threads = torch.get_num_threads()
        # One decoder (and one weight packing) for all chunks of this call.
        decoder = self._decoder(ids.shape[1] + params.max_new_tokens)
        try:
            torch.set_num_threads(self._threads(threads))
            # no_grad, not inference_mode: inference tensors in the output would break the trainer's
            # backward (embedding saves its indices). Neither decoder has dropout on: the functional one
            # has none, the HF fallback's replica is in eval mode.
            with torch.no_grad():
                # the call's one seed and its prompts' ids key every draw (sampling.sample_keys), so a
                # row samples alike in any chunk, on any rank
                seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
                keys = sample_keys(seed, prompt_ids(batch), params.n, self._device())
                limit = self.config.max_num_seqs
                if limit and len(batch) * params.n > limit:
                    per = max(1, limit // params.n)
                    chunks = zip(batch.split(per), keys.split(per * params.n))
                    return Batch.concat([self._generate_batch(c, k, params, decoder) for c, k in chunks])
                return self._generate_batch(batch, keys, params, decoder)
        finally:
            decoder.release()
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def continuous(
        self, params: SamplingParams, rows: int, max_len: int, prompts: torch.Tensor | None = None
    ) -> Iterator[ContinuousBatch | None]:
        """A continuous batch (rollout/continuous.py) of `rows` rows of at most `max_len` tokens each
        (prompt and response), their draws keyed by `prompts`' ids (base.prompt_ids) when given, on the weights `generate` would use, tensor-parallel under a generation
        TP group (its ranks agree on each step's rows: rollout/continuous.py); None on the HF fallback
        (its DynamicCache holds one length for all rows), where the caller runs waves of `generate`
        calls instead."""
        if self.config.backend == "hf" or unsupported_reason(self.model, max_len) is not None:
            yield None
            return
        decoder = RaggedDecoder(
            self.model, self.config.pack_weights, self.shard, self.tp, dtype=self.config.dtype
        )
        threads = torch.get_num_threads()
        capacity = min(rows, self.config.max_num_seqs or rows)
        stop = params.stop_ids(self.model.config.eos_token_id)
        try:
            torch.set_num_threads(self._threads(threads))
            with torch.no_grad():  # not inference_mode: see generate
                decoder.start(capacity, max_len, max_len)
                yield ContinuousBatch(decoder, params, rows, capacity, stop, prompts)
        finally:
            decoder.release()
            torch.set_num_threads(threads)

    def _threads(self, current: int) -> int:
        if self._device().type != "cpu":
            return current
        if self.config.cpu_threads > 0:
            return self.config.cpu_threads
        return 1 if self._count_params() < SMALL_MODEL_PARAMS else current

    def _device(self) -> torch.device:
        """Where generation runs: the model's device, or the shard's when the model only names the
        architecture (its parameters on meta: hybrid_engine/pipeline_switch.py). Not the shard's first
        tensor otherwise: a shard can mix the model's own tensors with gathered ones."""
        device = next(self.model.parameters()).device
        if device.type == "meta" and self.shard:
            return next(iter(self.shard.values())).device
        return device

    def _count_params(self) -> int:
        if self._num_params is None:  # fixed for the engine's life; counting walks every module
            self._num_params = sum(p.numel() for p in self.model.parameters())
        return self._num_params

    def _generate_batch(self, batch: Batch, keys: torch.Tensor, params: SamplingParams, decoder) -> Batch:
        ids, mask = check_prompt_batch(batch)
        device = self._device()
        responses, lengths, logps = self._generate(ids.to(device), mask.to(device), keys, params, decoder)
        out_device = ids.device
        return build_rollout_batch(
            batch,
            responses.to(out_device),
            lengths.to(out_device),
            logps.to(out_device),
            params,
            self.pad_token_id,
        )

    def _generate(self, ids, mask, keys, params: SamplingParams, decoder):
        """ids, mask: (B, Lp) on the model's device; keys: (B*n,) each sample's draw key. Returns responses (B*n, Lr), lengths (B*n,),
        log-probs (B*n, Lr); entries past a row's length are garbage (masked by build_rollout_batch)."""
        b0, lp = ids.shape
        n, lr = params.n, params.max_new_tokens
        total, device = b0 * n, ids.device
        stop = torch.tensor(params.stop_ids(self.model.config.eos_token_id), dtype=torch.long, device=device)
        pos = position_ids_from_mask(mask)
        next_pos = (pos[:, -1] + 1).repeat_interleave(n)  # (B*n,)

        decoder.start(total, lp + lr, int(next_pos.max()) + lr)
        logits = decoder.prefill(ids, mask, pos, repeat=n).repeat_interleave(n, 0)
        return self._decode_loop(decoder, logits, next_pos, stop, keys, params)

    def _decode_loop(self, decoder, logits, next_pos, stop, keys, params: SamplingParams):
        total, lr, device = logits.shape[0], params.max_new_tokens, logits.device

        responses = torch.full((total, lr), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros(total, lr, dtype=torch.float32, device=device)
        lengths = torch.full((total,), lr, dtype=torch.long, device=device)
        rows = torch.arange(total, device=device)  # original row of each decode-batch row
        alive = torch.ones(total, dtype=torch.bool, device=device)
        n_alive = total  # as of the last host read
        tp = getattr(decoder, "tp", None)
        is_stop = _stop_test(stop)
        every = stop_check_every(device)
        for t in range(lr):
            # response position t of each row: a pure function of its key, whatever rows share the step
            uniforms = None if params.greedy else counter_uniforms(keys, t)
            tokens, lp_t = sample_next(logits, params, uniforms=uniforms)
            if tp is not None:  # one generation TP group: the first rank's draw for all
                tokens, lp_t = tp.agree(tokens, lp_t)
            responses[:, t].index_copy_(0, rows, tokens)
            logps[:, t].index_copy_(0, rows, lp_t)
            if is_stop is not None:
                done = is_stop(tokens) & alive
                if every == 1:
                    # On the host a read costs nothing, so a step where no row stops (most of them) skips
                    # the bookkeeping, which then runs only on the steps rows stop.
                    n_done = int(done.sum())
                    if n_done:
                        lengths.index_fill_(0, rows[done], t + 1)
                        alive &= ~done
                        n_alive -= n_done
                else:
                    # On a device the bookkeeping stays there; the host reads how many rows are left only
                    # every `every` steps (a read waits for the queued kernels). Rows that stopped since
                    # decode on until then: their tokens lie past their length, masked by the rollout batch.
                    lengths.index_copy_(0, rows, torch.where(done, t + 1, lengths.index_select(0, rows)))
                    alive &= ~done
                    if (t + 1) % every == 0:
                        n_alive = int(alive.sum())
            if t == lr - 1 or n_alive == 0:
                break
            if rows.shape[0] - n_alive > self.config.compact_fraction * rows.shape[0]:
                keep = hole_filling_order(alive, n_alive)
                decoder.select(keep)
                rows, tokens, alive, next_pos = rows[keep], tokens[keep], alive[keep], next_pos[keep]
                keys = keys[keep]
            logits = decoder.decode(tokens, next_pos)
            next_pos = next_pos + 1
        return responses, lengths, logps


DEVICE_STOP_CHECK_EVERY = 16
"""Decode steps between the host's reads of how many rows are still running, on an accelerator. Each read
stalls the host until the GPU drains its queue; every 16 tokens bounds the stall to 1/16 of the steps, at
the cost of decoding rows that stopped for at most 15 more steps before they are dropped."""


def stop_check_every(device: torch.device) -> int:
    """Steps between host reads of the live-row count: 1 on the host CPU, where reading a tensor does not
    wait for anything, DEVICE_STOP_CHECK_EVERY on an accelerator. Device-strict mode's stand-in accelerator
    (an indexed "cpu:0"; controller/strict_device.py) counts as one, so its runs take the device path."""
    if device.type == "cpu" and device.index is None:
        return 1
    return DEVICE_STOP_CHECK_EVERY


def _stop_test(stop: torch.Tensor):
    """stop: (k,) token ids -> a function tokens (b,) -> (b,) bool, or None when nothing stops a row.
    One id is one comparison; torch.isin is several ops."""
    if stop.numel() == 0:
        return None
    if stop.numel() == 1:
        return lambda tokens: tokens == stop
    return lambda tokens: torch.isin(tokens, stop)


def hole_filling_order(alive: torch.Tensor, n_alive: int) -> torch.Tensor:
    """alive: (b,) bool with n_alive True -> the (n_alive,) rows to keep, in their new order: live rows
    already in [0, n_alive) stay put and each finished row there is replaced by a live row from
    [n_alive, b), so compaction moves only as many rows as finished."""
    keep = torch.arange(n_alive, device=alive.device)
    holes = (~alive[:n_alive]).nonzero().squeeze(1)
    if holes.numel():
        keep[holes] = alive[n_alive:].nonzero().squeeze(1) + n_alive
    return keep


def _first(x):
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x
