"""TrainEngine's passes when its model is cut into pipeline stages (parallel.pp > 1; engines/pipeline.py).

Each rank holds one stage, or v of them under interleaved 1F1B (their decoder layers, FSDP2 over the mesh's
dp axis), and runs the configured schedule (parallel.pp_schedule) over micro-batches of equal rows and the
batch's full length: a PipelineStage is built for one micro-batch shape, so neither the token budget nor
the padding trim of the unpipelined engine applies. Rows are padded up to whole micro-batches by repeating
leading rows with a zero response mask, so they weigh nothing. Two fallbacks keep any micro-batch count
runnable (`run_schedule`): 1F1B with fewer micro-batches m than stages p runs GPipe (1F1B cannot schedule
it; with m <= p the two idle alike), and interleaved 1F1B, which runs m in rounds of m // p, pads m up to a
multiple of p with zero-weight micro-batches where the rounds would not divide it.

Every rank of a pp group holds the same rows (the transfer protocols split over dp only). The RL loss (the
actor's policy loss, the critic's value loss) runs on the last stage, as the schedule's loss_fn; its
outputs (log-probs and entropy, values, or a reward model's scores) and the step's metrics are then
broadcast from the last stage, so every rank returns what an unpipelined rank returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.engines.micro_batch import response_length
from hybridflow.engines.pipeline import build_pipeline_stages, build_schedule, build_stages


def run_schedule(name: str, m: int, pp: int) -> str:
    """The schedule that runs m micro-batches over pp ranks when `name` is configured (module docstring)."""
    return "gpipe" if name == "1f1b" and m < pp else name


def microbatch_multiple(name: str, m: int, pp: int) -> int:
    """What the micro-batch count is padded to a multiple of: pp where interleaved 1F1B's rounds of
    m // pp micro-batches would not divide m (torch's condition), else 1."""
    return pp if name == "interleaved_1f1b" and m % max(1, m // pp) else 1


class PipelinedModel:
    """This rank's stage of `model` (cut in place) on the (pp, dp, tp) `mesh`, and its passes.

    stage: the StageForward (the FSDP root, what TrainEngine.module is); group: the pp process group."""

    def __init__(
        self,
        model: torch.nn.Module,
        mesh,
        device: torch.device,
        schedule: str = "1f1b",
        virtual_stages: int = 2,
    ):
        self.mesh, self.device, self.schedule = mesh, device, schedule
        self.pp, self.pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self.group = mesh["pp"].get_group()
        self.stages_per_rank = virtual_stages if schedule == "interleaved_1f1b" else 1
        self.stage = build_stages(model, self.pp_rank, self.pp, self.stages_per_rank)
        self.last = self.pp_rank == self.pp - 1
        self.last_rank = dist.get_global_rank(self.group, self.pp - 1)
        self.hidden_dtype: torch.dtype | None = None  # the compute dtype, when FSDP casts to it

    def _schedule(self, batch: Batch, rows: int, loss_fn=None):
        m = len(batch) // rows
        pipe = build_pipeline_stages(
            self.stage, self.pp * self.stages_per_rank, rows, batch["input_ids"].shape[1], self.device,
            self.group, self.hidden_dtype,
        )  # fmt: skip
        return build_schedule(run_schedule(self.schedule, m, self.pp), pipe, m, loss_fn)

    def _padded(self, batch: Batch, rows: int) -> Batch:
        """`batch` padded to whole micro-batches of `rows`, as many as the schedule runs."""
        m = -(-len(batch) // rows)
        return batch.pad_to_divisor(rows * microbatch_multiple(self.schedule, m, self.pp))

    def _inputs(self, batch: Batch) -> tuple:
        if not self.stage.first:
            return ()
        ids, attn = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        pos = batch["position_ids"] if "position_ids" in batch.tensors else position_ids_from_mask(attn)
        return ids, attn, pos.to(self.device)

    def _broadcast(self, out: torch.Tensor | None, rows: int) -> torch.Tensor:
        """The last stage's merged outputs for `rows` rows on every rank of the pp group."""
        if out is None:
            out = torch.empty(self.stage.output_shape(rows), dtype=torch.float32, device=self.device)
        out = out.float().contiguous()
        dist.broadcast(out, src=self.last_rank, group=self.group)
        return out

    def _named(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """The last stage's output under TrainEngine's keys (RLForward's)."""
        if self.stage.kind == "critic":
            return {"values": out}
        if self.stage.kind == "reward":
            return {"scores": out}
        return (
            {"log_probs": out[:, 0], "entropy": out[:, 1]} if self.stage.with_entropy else {"log_probs": out}
        )

    @torch.no_grad()
    def infer(self, batch: Batch, rows: int, temperature: float, with_entropy: bool) -> dict:
        """What RLForward returns for `batch` ({"log_probs" (B, Lr) [, "entropy"]}, {"values" (B, Lr)} or
        {"scores" (B,)}) on the CPU, for every rank of the pp group."""
        n = len(batch)
        padded = self._padded(batch, rows)
        self.stage.configure(response_length(batch), temperature, self.stage.logits_chunk_size, with_entropy)
        out = self._schedule(padded, rows).eval(*self._inputs(padded))
        return self._named(self._broadcast(out, len(padded))[:n].cpu())

    def forward_backward(self, batch: Batch, rows: int, loss_fn, with_entropy, temperature: float, weigh):
        """Gradients of every micro-batch's loss_fn(outputs, micro-batch) * weigh(i, micro-batch) (TrainEngine's
        global-mean weights); returns the metric sums (float64 tensors) loss_fn reported, from the last stage.
        weigh(i, mb) -> (loss weight, metric share)."""
        padded = _masked_padding(self._padded(batch, rows))
        mbs = padded.split(rows)
        self.stage.configure(response_length(batch), temperature, self.stage.logits_chunk_size, with_entropy)
        sums: dict[str, torch.Tensor] = {}

        def pipe_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            i = int(target[0, 0])  # the micro-batch's index (a CPU tensor: no device sync)
            loss, metrics = loss_fn(self._named(output), mbs[i].to(self.device))
            weight, share = weigh(i, mbs[i])
            for k, v in {"loss": loss, **metrics}.items():
                v = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                sums[k] = v.to(self.device, torch.float64).reshape(()) * share + sums.get(k, 0.0)
            return loss * weight

        target = torch.arange(len(mbs)).repeat_interleave(rows)[:, None] if self.last else None
        self._schedule(padded, rows, pipe_loss).step(*self._inputs(padded), target=target, losses=[])
        return self._broadcast_metrics(sums)

    def _broadcast_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        floats = [dict(zip(sums, torch.stack(list(sums.values())).tolist())) if sums else {}]
        dist.broadcast_object_list(floats, group_src=self.pp - 1, group=self.group, device=self.device)
        return floats[0]

    def micro_batches(self, batch: Batch, rows: int) -> list[Batch]:
        """The micro-batches forward_backward runs (padding rows masked), for the engine's counts."""
        return _masked_padding(self._padded(batch, rows)).split(rows)


def micro_batch_rows(batch: Batch, config, micro_batch_size: int | None, max_tokens: int | None) -> int:
    """Rows per pipeline micro-batch: the fixed size, or as many full-length rows as the token budget
    holds (pipeline micro-batches are not trimmed); config: the EngineConfig's defaults for both."""
    if micro_batch_size is None and max_tokens is None:
        max_tokens = config.max_tokens_per_micro_batch or None
        micro_batch_size = None if max_tokens else config.micro_batch_size_per_device
    if micro_batch_size is None:
        micro_batch_size = max(1, max_tokens // batch["input_ids"].shape[1])
    return max(1, min(micro_batch_size, len(batch)))


def _masked_padding(batch: Batch) -> Batch:
    """A zero response mask on the rows pad_to_divisor repeated, so they weigh nothing."""
    pad = batch.meta.pad_rows
    if pad and "response_mask" in batch.tensors:
        mask = batch["response_mask"].clone()
        mask[len(batch) - pad :] = 0
        batch["response_mask"] = mask
    return batch
