"""TrainEngine: one model (actor, critic, reference or reward) on one worker-group rank.

Role workers call a small API (docs/design.md §7: learning stays apart from sampling):
  compute_log_probs(batch)  -> (log_probs (B, Lr), entropy (B, Lr) | None)   causal LMs
  compute_values(batch)     -> values (B, Lr)                                  critics
  compute_scores(batch)     -> scores (B,)                                     reward / cost models
  train_step(batch, loss_fn) -> metrics dict (one optimizer step over the whole batch)
  full_state_dict() / iter_full_state_dict() / save_hf(path)
  save_checkpoint(dir) / load_checkpoint(dir)   (each rank its shards as safetensors + JSON; no pickle)
  offload() / reload() / phase()   (engines/offload.py: each piece of state moved once per phase)

Batch fields (preamble): input_ids = cat(prompts, responses) (B, Lp + Lr), attention_mask,
optional position_ids, responses (B, Lr), response_mask (B, Lr).

Loss scaling under gradient accumulation: loss_fn returns the *mean* loss of its micro-batch
(token-mean over response_mask, or sequence-mean); the engine weights micro-batch i by
n_i * dp / N, where n_i is its token (or sequence) count and N the count over the whole global
batch (all dp ranks). FSDP averages gradients over dp, so the result is the global mean whatever the
micro-batch split or the dp size: 1x8 == 8x1 == 2 ranks x 4. loss_weighting "token-sum" weights by
n_i * dp instead: the global sum over tokens of a token-mean loss (loss_agg_mode token-sum).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.controller import strict_device
from hybridflow.engines import full_weights, varlen
from hybridflow.engines.config import EngineConfig, compute_dtype
from hybridflow.engines.forward import RLForward
from hybridflow.engines.mesh import build_mesh
from hybridflow.engines.micro_batch import (
    pad_response_aligned,
    plan_micro_batches,
    response_length,
    restore_order,
    split_micro_batches,
)
from hybridflow.engines.offload import Offloader
from hybridflow.engines.optim import build_optimizer, build_scheduler, clip_grad_norm_, params_finite
from hybridflow.engines.packing import resolve_remove_padding, resolve_share_prompt
from hybridflow.engines.parallelize import hf_layout_transforms, parallelize, uses_fsdp
from hybridflow.engines.pipeline import hf_name
from hybridflow.engines.pipeline_engine import PipelinedModel, micro_batch_rows
from hybridflow.engines.precision import ComputeCopies, cast_parameters, one_rank_precision
from hybridflow.engines.sharded_init import materialize
from hybridflow.models import cpu_gemm, lora
from hybridflow.models.hf import model_kind, scalar_head

LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine:
    """Wraps a plain HF model: applies TP/AC/FSDP2 per `config.parallel`, owns optimizer + schedule.

    model: a plain HF model on CPU (`load_causal_lm` / `load_critic` / `load_reward_model`), or one
    built on the meta device (`device="meta"`): then each rank reads only its shards from disk.
    trainable: False for reference / reward models (no optimizer state is allocated).
    device: where it computes, the worker's assigned device (Worker.device; "cpu" by default): never
    guessed from torch.cuda, so `resources.device=cpu` on a GPU host computes on CPU.
    The default process group (if any) must span exactly config.parallel.world_size ranks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        trainable: bool = True,
        device: str | torch.device = "cpu",
    ):
        self.config = config or EngineConfig()
        self.kind = model_kind(model)
        self.device = torch.device(device)
        self.mesh = build_mesh(self.config.parallel, self.device.type)
        self.compute_dtype = compute_dtype(self.config.mixed_precision, self.device.type == "cuda")
        fsdp = uses_fsdp(self.mesh)
        param_dtype = None
        # adapters first, on the plain model: one more function applied before TP and FSDP2 (lora.py)
        self.lora_layers = self._apply_lora(model) if trainable and self.config.lora.enabled else {}
        if self.compute_dtype is not None and not trainable:
            cast_parameters(model, self.compute_dtype)  # frozen: stored in it (half the bytes for bf16)
        elif self.compute_dtype is not None and self.lora_layers:
            cast_parameters(model, self.compute_dtype, frozen_only=True)  # the base; adapters stay fp32
            param_dtype = self.compute_dtype
        elif self.compute_dtype is not None:
            param_dtype = self.compute_dtype  # fp32 master weights, low-precision compute
        # Without FSDP (one dp rank) mixed precision as FSDP computes it, or autocast (precision.py).
        # Rollout log-probs recomputed by this engine use the same path as training, so the first
        # mini-batch's ratio is exactly 1 (docs/checkpoints.md, "Dtypes").
        self._autocast, copies_dtype = one_rank_precision(
            param_dtype if not fsdp else None, bool(self.lora_layers), self.config.parallel
        )
        # A meta-built model (load_*(..., device="meta")) is sharded first and then each rank reads
        # only its own shards from disk (sharded_init.py); a loaded one is moved, then sharded.
        on_meta = any(p.is_meta for p in model.parameters())
        self.hf_model = model if on_meta else model.to(self.device)
        # pipeline stages run padded rows (a PipelineStage has one micro-batch shape): nothing is packed
        pipelined = self.config.parallel.pp > 1
        self.remove_padding = not pipelined and resolve_remove_padding(
            self.config.remove_padding, model.config.model_type
        )
        self.share_prompt = resolve_share_prompt(self.config.share_prompt, self.remove_padding)
        self.pipeline = None
        if pipelined:  # this rank's stage of the model (engines/pipeline_engine.py)
            parallel = self.config.parallel
            self.pipeline = PipelinedModel(
                model, self.mesh, self.device, parallel.pp_schedule, parallel.pp_virtual_stages
            )
            self.pipeline.hidden_dtype = param_dtype if fsdp else None
            self.module = self.pipeline.stage
        else:
            self.module = RLForward(model, self.config.logits_chunk_size, self.share_prompt)
        if self.remove_padding:  # packed micro-batches: one row, attention per sequence (engines/varlen.py)
            varlen.install(model)
        if cpu_gemm.resolve(self.config.cpu_gemm, self.device):  # fp32 linear layers through oneDNN
            cpu_gemm.use_onednn(model)
        parallelize(
            self.module,
            model,
            self.mesh["dp", "tp"] if self.pipeline is not None else self.mesh,
            gradient_checkpointing=self.config.gradient_checkpointing,
            param_dtype=param_dtype if fsdp else None,
            reduce_dtype=torch.float32 if param_dtype is not None and fsdp else None,
        )
        self.init_stats = None
        if on_meta:
            transforms = hf_layout_transforms(model)
            names = (lambda n: hf_name(model, n)) if self.pipeline is not None else None
            self.init_stats = materialize(
                self.module, model, self.device, transforms, self.config.seed, names
            )
        strict_device.mark_device(self.module)  # device-strict mode (CPU tests of the GPU path)
        self._copies = ComputeCopies(self.module, copies_dtype) if copies_dtype else None
        self.optimizer = self.scheduler = None
        if trainable:
            self.optimizer = build_optimizer(self.module.parameters(), self.config.optim)
            self.scheduler = build_scheduler(self.optimizer, self.config.optim)
        self.global_step = 0
        # Without offload the state never leaves the device, so no phase needs to enter the Offloader.
        self._offload = Offloader(self) if self.config.offload else None
        if self._offload is not None:
            self.offload()

    def _apply_lora(self, model: torch.nn.Module) -> dict[str, tuple[float, bool]]:
        """Adapters on the plain model (a critic's value head stays trainable); their initial values."""
        heads = ()
        if self.kind == "critic":
            head = scalar_head(model)
            heads = tuple(n for n, m in model.named_modules() if m is head)
        c = self.config.lora
        lora.apply_lora(model, c.rank, c.alpha, c.target_modules, c.dropout, keep_trainable=heads)
        lora.init_adapters(model, self.config.seed)
        return lora.lora_layers(model)

    def adapters_disabled(self):
        """Context: the model computes as its base (the reference model of a LoRA actor)."""
        if not self.lora_layers:
            raise RuntimeError("adapters_disabled: this engine has no LoRA adapters (model.lora.rank = 0)")
        return lora.adapters_disabled(self.hf_model)

    # ---- process-group helpers -------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    def _all_reduce(self, value: float, op, group=None) -> float:
        # One rank (a 1-device worker group): the reduction is the value itself, so no collective and
        # no host sync (docs/bench/overhead.md).
        if self.mesh is None or dist.get_world_size(group) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=group)
        return float(t.item())

    def _plan(self, batch: Batch, micro_batch_size: int | None, max_tokens: int | None) -> list[list[int]]:
        """Micro-batch row groups, with the same count on every rank (FSDP collectives run per pass)."""
        if micro_batch_size is None and max_tokens is None:
            max_tokens = self.config.max_tokens_per_micro_batch or None
            micro_batch_size = None if max_tokens else self.config.micro_batch_size_per_device
        real = self.remove_padding  # packed micro-batches cost their real tokens, not the padded ones
        groups = plan_micro_batches(batch, micro_batch_size, max_tokens, real_tokens=real)
        count = int(self._all_reduce(len(groups), dist.ReduceOp.MAX))
        if count != len(groups):
            groups = plan_micro_batches(batch, micro_batch_size, max_tokens, count, real_tokens=real)
        return groups

    def phase(self, optimizer: bool = False):
        """Context: parameters (and optimizer state if asked) on the device for its duration; with
        offload, moved out once when the outermost phase ends (engines/offload.py)."""
        return self._offload.phase(optimizer) if self._offload is not None else contextlib.nullcontext()

    # ---- forward passes --------------------------------------------------------------------------
    def _forward(self, mb: Batch, temperature: float = 1.0, with_entropy: bool | str = False) -> dict:
        ids = mb["input_ids"].to(self.device)
        attn = mb["attention_mask"].to(self.device)
        pos = (
            mb["position_ids"].to(self.device)
            if "position_ids" in mb.tensors
            else position_ids_from_mask(attn)
        )
        with self._autocast_ctx():
            return self.module(ids, attn, pos, response_length(mb), temperature, with_entropy,
                               0 if self.remove_padding else None)  # fmt: skip

    def _autocast_ctx(self):
        """Autocast to the compute dtype where neither FSDP nor compute copies cast (one dp rank with
        tensor parallelism, pipeline stages or LoRA)."""
        if self._autocast:
            return torch.autocast(self.device.type, dtype=self._autocast)
        return contextlib.nullcontext()

    def _compute_copies(self):
        """Context: the parameters in the compute dtype for the forwards and backwards inside it, where
        one rank computes in low precision without FSDP (engines/precision.py)."""
        return self._copies.active() if self._copies is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _infer(self, batch, keys, micro_batch_size, max_tokens, **forward_kwargs) -> dict[str, torch.Tensor]:
        with self.phase():
            self.module.eval()
            if self.pipeline is not None:
                rows = micro_batch_rows(batch, self.config, micro_batch_size, max_tokens)
                kw = {"temperature": 1.0, "with_entropy": False, **forward_kwargs}
                with self._autocast_ctx():
                    return self.pipeline.infer(batch, rows, **kw)
            lr = response_length(batch)
            groups = self._plan(batch, micro_batch_size, max_tokens)
            chunks = defaultdict(list)
            with self._compute_copies():
                for mb in split_micro_batches(batch, groups):
                    out = self._forward(mb, **forward_kwargs)
                    for k in keys:
                        v = out[k].float().cpu()
                        chunks[k].append(pad_response_aligned(v, lr) if v.dim() == 2 else v)
            return {k: restore_order(chunks[k], groups) for k in keys}

    def compute_log_probs(
        self,
        batch: Batch,
        with_entropy: bool = False,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (B, Lr) of `responses` (and entropy (B, Lr)); 0 on padded positions
        beyond each micro-batch's longest response. Micro-batching defaults to the engine config."""
        self._require("causal_lm", "compute_log_probs")
        keys = ["log_probs", "entropy"] if with_entropy else ["log_probs"]
        out = self._infer(
            batch, keys, micro_batch_size, max_tokens, temperature=temperature, with_entropy=with_entropy
        )
        return out["log_probs"], out.get("entropy")

    def compute_values(
        self, batch: Batch, micro_batch_size: int | None = None, max_tokens: int | None = None
    ):
        """Critic values (B, Lr): the value of the state before each response token."""
        self._require("critic", "compute_values")
        return self._infer(batch, ["values"], micro_batch_size, max_tokens)["values"]

    def compute_scores(
        self, batch: Batch, micro_batch_size: int | None = None, max_tokens: int | None = None
    ):
        """Reward / cost model scores (B,), read at each sequence's last attended token."""
        self._require("reward", "compute_scores")
        return self._infer(batch, ["scores"], micro_batch_size, max_tokens)["scores"]

    def _require(self, kind: str, what: str) -> None:
        if self.kind != kind:
            raise TypeError(f"{what} needs a {kind} model, but this engine holds a {self.kind} model")

    # ---- training ----------------------------------------------------------------------------------
    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        with_entropy: bool | str = False,
        temperature: float = 1.0,
        loss_weighting: str = "tokens",
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
        global_metrics: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share of a global mini-batch):
        forward_backward + optimizer_step. Returns loss/metrics, grad_norm, lr, step_skipped."""
        with self.phase(optimizer=True):
            metrics = self.forward_backward(
                batch, loss_fn, with_entropy, temperature, loss_weighting, micro_batch_size, max_tokens,
                global_metrics,
            )  # fmt: skip
            metrics.update(self.optimizer_step(metrics.get("loss", 0.0)))
        return metrics

    def forward_backward(
        self,
        batch: Batch,
        loss_fn: LossFn,
        with_entropy: bool | str = False,
        temperature: float = 1.0,
        loss_weighting: str = "tokens",
        micro_batch_size: int | None = None,
        max_tokens: int | None = None,
        global_metrics: bool = False,
    ) -> dict[str, float]:
        """Accumulate gradients of the global-mean loss over `batch`'s micro-batches (grads are reset first).

        loss_fn(outputs, micro_batch) -> (loss, metrics): outputs holds "log_probs" (b, lr) [+ "entropy"]
        for a causal LM or "values" (b, lr) for a critic, aligned with micro_batch's (trimmed) response
        fields; loss is the micro-batch mean (per token if loss_weighting is "tokens" or "token-sum", per
        sequence if "sequences"). Returns the token/sequence-weighted local mean of loss and of each metric; with
        global_metrics, each rank's share of the global mean times dp instead, so the mean over the dp
        ranks (what DP_METRICS reports) is the global token/sequence mean however unevenly the
        counted tokens fall on the ranks (e.g. masked padding rows).
        with_entropy="detached" gives "entropy" without grad, for when it is only logged.
        """
        if self.optimizer is None:
            raise RuntimeError(
                "training call on an engine built with trainable=False (reference / reward model)"
            )
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}")
        if self.pipeline is not None:
            return self._pipeline_forward_backward(
                batch, loss_fn, with_entropy, temperature, loss_weighting, micro_batch_size, max_tokens,
                global_metrics,
            )  # fmt: skip
        with self.phase():
            self.module.train()
            groups = self._plan(batch, micro_batch_size, max_tokens)
            mbs = split_micro_batches(batch, groups)
            counts = [self._count(mb, loss_weighting) for mb in mbs]
            local_total = sum(counts)
            global_total = self._all_reduce(local_total, dist.ReduceOp.SUM, self.dp_group())
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, torch.Tensor] = {}
            with self._compute_copies():
                for mb, n in zip(mbs, counts):
                    # the whole micro-batch to the device once: the loss reads its fields (advantages, old / ref
                    # log-probs, returns, masks) beside the device outputs
                    mb = mb.to(self.device)
                    out = self._forward(mb, temperature, with_entropy)
                    loss, metrics = loss_fn(out, mb)
                    # token-sum: the global sum, the token-mean times the global token count
                    normaliser = 1.0 if loss_weighting == "token-sum" else max(global_total, 1e-8)
                    (loss * (n * self.dp_size / normaliser)).backward()
                    share = n * (
                        self.dp_size / max(global_total, 1e-8)
                        if global_metrics
                        else 1 / max(local_total, 1e-8)
                    )
                    for k, v in {"loss": loss, **metrics}.items():
                        sums[k] = _weighted(v, share, self.device) + sums.get(k, 0.0)
            return _to_floats(sums)

    def _pipeline_forward_backward(
        self, batch, loss_fn, with_entropy, temperature, loss_weighting, micro_batch_size, max_tokens,
        global_metrics,
    ) -> dict[str, float]:  # fmt: skip
        """forward_backward through the pipeline stages, with the same loss weights (engines/pipeline_engine.py)."""
        with self.phase():
            self.module.train()
            rows = micro_batch_rows(batch, self.config, micro_batch_size, max_tokens)
            mbs = self.pipeline.micro_batches(batch, rows)
            counts = [self._count(mb, loss_weighting) for mb in mbs]
            local_total = sum(counts)
            global_total = max(self._all_reduce(local_total, dist.ReduceOp.SUM, self.dp_group()), 1e-8)
            normaliser = 1.0 if loss_weighting == "token-sum" else global_total
            per = self.dp_size / global_total if global_metrics else 1 / max(local_total, 1e-8)
            self.optimizer.zero_grad(set_to_none=True)

            def weigh(i, mb):
                return counts[i] * self.dp_size / normaliser, counts[i] * per

            with self._autocast_ctx():
                return self.pipeline.forward_backward(batch, rows, loss_fn, with_entropy, temperature, weigh)

    def optimizer_step(self, loss: float = 0.0) -> dict[str, float]:
        """Clip by the global grad norm, step AdamW and the LR schedule. The update is skipped (grads dropped,
        the schedule moved on) when the grad norm, the lr or `loss` is not finite on any rank. params_nonfinite
        1: the update made a weight of this rank non-finite even so (an overflow): the trainer stops."""
        with self.phase(optimizer=True):
            pp_group = self.pipeline.group if self.pipeline is not None else None
            grad_norm = clip_grad_norm_(self.module.parameters(), self.config.optim.grad_clip, pp_group)
            lr = self.scheduler.get_last_lr()[0]
            lrs_finite = all(math.isfinite(g["lr"]) for g in self.optimizer.param_groups)
            # the loss is per rank: every rank must take the same decision (the grad norm already is global)
            loss_bad = self._all_reduce(float(not math.isfinite(loss)), dist.ReduceOp.MAX)
            finite = bool(torch.isfinite(grad_norm)) and lrs_finite and not loss_bad
            if finite:
                self.optimizer.step()
            trained = [p for g in self.optimizer.param_groups for p in g["params"]]
            poisoned = finite and not params_finite(trained)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
        return {"grad_norm": float(grad_norm), "lr": lr, "step_skipped": float(not finite),
                "params_nonfinite": float(poisoned)}  # fmt: skip

    def dp_group(self):
        """The process group of this engine's dp ranks (None without a process group)."""
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @staticmethod
    def _count(mb: Batch, loss_weighting: str) -> float:
        if loss_weighting == "sequences":  # sequences with no response token (masked padding) weigh 0
            if "response_mask" in mb.tensors:
                return float((mb["response_mask"].sum(-1) > 0).sum())
            return float(len(mb))
        if "response_mask" in mb.tensors:
            return float(mb["response_mask"].sum())
        return float(mb["attention_mask"][:, -response_length(mb) :].sum())

    # ---- weights (engines/full_weights.py) ----------------------------------------------------------
    def iter_full_state_dict(self, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) pairs, gathered from the shards one tensor at a time (all ranks must
        iterate: each gather is a collective). Names and layouts are those of the HF checkpoint."""
        return full_weights.iter_full_state_dict(self, device)

    def full_state_dict(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        return dict(self.iter_full_state_dict(device))

    def iter_full_grads(self, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, full gradient) after forward_backward; collective like iter_full_state_dict."""
        return full_weights.iter_full_grads(self, device)

    def save_hf(self, path, tokenizer=None) -> None:
        """Write the full model as an HF directory from rank 0, streaming: each tensor is gathered
        (a collective: every rank calls this), written and dropped, so no rank holds the model."""
        full_weights.save_hf(self, path, tokenizer)

    # ---- resume ------------------------------------------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Sharded model + optimizer tensors (each rank its own shards, safetensors) + JSON state under
        `path` (collective; layout in engines/checkpoint_io.py)."""
        from hybridflow.engines import checkpoint_io

        checkpoint_io.save(self, path)

    def load_checkpoint(self, path) -> None:
        """Restore what save_checkpoint wrote, onto this engine's layout (any dp/tp); nothing unpickled."""
        from hybridflow.engines import checkpoint_io

        checkpoint_io.load(self, path)

    # ---- offload -----------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move params and optimizer state to CPU so a colocated model can use the device (no-op on CPU
        or without offload)."""
        if self._offload is not None:
            self._offload.send_out()

    def reload(self, optimizer: bool = False) -> None:
        """Bring offloaded params (and optimizer state if asked) back to the device."""
        if self._offload is not None:
            self._offload.bring(optimizer)

    def offload_stats(self) -> dict[str, float]:
        """offload_s / offload_bytes / offload_moves since the last call (then reset)."""
        if self._offload is None:
            return {"offload_s": 0.0, "offload_bytes": 0.0, "offload_moves": 0.0}
        return self._offload.take_stats()

    def take_shared_prompt_tokens(self) -> int:
        """Prompt tokens this engine's forwards did not compute (shared within a micro-batch, model.share_prompt)
        since the last call (then reset)."""
        if self.pipeline is not None:  # pipeline stages share no prompts (nothing is packed)
            return 0
        n, self.module.shared_prompt_tokens = self.module.shared_prompt_tokens, 0
        return n

    def num_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.hf_model.parameters())


LOSS_WEIGHTINGS = ("tokens", "sequences", "token-sum")


def _weighted(v, share: float, device) -> torch.Tensor:
    """float64(v) * share as a tensor on the device: metrics stay there until one host sync per step
    (_to_floats) instead of one per metric per micro-batch; float64 keeps the sums what the Python
    floats gave."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(device=device, dtype=torch.float64).reshape(()) * share
    return torch.tensor(float(v), dtype=torch.float64, device=device) * share


def _to_floats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The metric sums as Python floats, read from the device in one transfer."""
    if not sums:
        return {}
    return dict(zip(sums, torch.stack(list(sums.values())).tolist()))
