"""Pipeline parallelism (pp) over a plain HF model's decoder layers, with torch.distributed.pipelining.

Stages are cut as torchtitan's pipeline_module_split cuts them: a stage is the model with only a
contiguous run of its decoder layers; the first stage keeps the token embeddings, the last the final
norm and the head (lm_head, or the critic's value head). Elsewhere the embeddings are dropped (the stage
takes hidden states as `inputs_embeds`) and the norm is an identity, so each stage still runs the HF
backbone's own forward: its causal mask, rotary positions and layer loop, model code untouched.

What travels between stages, per micro-batch: the hidden states (B, L, H) and the int tensors a later
stage needs (input_ids: the last stage's labels; attention_mask and position_ids: every stage's mask and
rotary positions). They are L ints a row against the hidden states' L * H floats, and sending them keeps
every stage a function of its inputs alone, which the schedules require.

Interleaved schedules give a rank several stages (r, r + p, ...; torch's loop order). The rank still holds
one model, cut to the union of its stages' layers, and one StageForward, which runs stage k of its own by
lending the backbone that stage's layers for the call (`chunk`); so a rank keeps one FSDP root, one set of
parameters and one HF-named state dict whatever its number of stages, and the engine, checkpoints and the
generation switch see one stage model per rank.

The last stage returns what the RL losses read: response log-probs (B, Lr) of a causal LM, the critic's
per-token values (B, Lr) or a reward model's sequence scores (B,); its loss_fn is the RL loss, with
per-token tensors as the schedule's `target`. Llama-family models only (parallelize.LLAMA_LIKE): GPT-2 adds position embeddings to
`inputs_embeds`, so every later stage would add them again.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

import torch
from torch import nn

from hybridflow.engines.forward import chunked_log_probs, last_token_index
from hybridflow.engines.parallelize import LLAMA_LIKE, decoder_layers, parallelize
from hybridflow.models.hf import model_kind, scalar_head

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# set on a stage's model: the whole model's index of each of its decoder layers (`hf_name` renumbers by it)
_LAYERS_ATTR = "_hybridflow_layers"
_LAYER = re.compile(r"(.*\blayers\.)(\d+)(\..*)")


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous runs of decoder layers, one per stage, sizes differing by at most one (the earlier
    stages take the extra layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} pipeline stages need 1 <= stages <= the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int = 1) -> list[int]:
    """The stage indices one pipeline rank runs: the interleaved schedules' loop order (rank r holds r,
    r + pp, r + 2 pp, ...), which for one stage per rank is just [r]."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_stage(model: nn.Module, stages: int | Sequence[int], num_stages: int) -> nn.Module:
    """`model` cut down, in place, to pipeline stage(s) `stages` of `num_stages` (module docstring): their
    decoder layers in stage order, the embeddings if it holds the first, norm and head if the last."""
    stages = [stages] if isinstance(stages, int) else list(stages)
    if model.config.model_type not in LLAMA_LIKE:
        raise ValueError(
            f"pipeline parallelism runs {LLAMA_LIKE} models, not {model.config.model_type!r}; use pp=1"
        )
    # a critic's or reward model's scalar head shares nothing with the embeddings
    tied = model_kind(model) == "causal_lm" and getattr(model.config, "tie_word_embeddings", False)
    if num_stages > 1 and tied:
        raise ValueError(
            "pipeline parallelism with tied input and output embeddings (tie_word_embeddings) would train "
            "two copies on the first and last stages; use pp=1"
        )
    layers = decoder_layers(model)
    ranges = stage_layer_ranges(len(layers), num_stages)
    keep = [i for s in stages for i in ranges[s]]
    base = model.base_model
    base.layers = nn.ModuleList(layers[i] for i in keep)
    setattr(model, _LAYERS_ATTR, tuple(keep))
    if 0 not in stages:
        base.embed_tokens = None
    if num_stages - 1 not in stages:
        base.norm = nn.Identity()
        for head in ("lm_head", "score"):
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def hf_name(stage_model: nn.Module, name: str) -> str:
    """The whole model's name of a stage model's parameter: its decoder layers renumbered from the
    stage's first (HF checkpoints, full state dicts and gradients keep the whole model's names)."""
    m = _LAYER.fullmatch(name)
    return name if m is None else f"{m[1]}{getattr(stage_model, _LAYERS_ATTR)[int(m[2])]}{m[3]}"


def stage_state_dict(stage_model: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's parameters as whole tensors under the whole model's names: the stages' dicts together
    are the model's state dict, whatever p was (export, or a resume onto another p)."""
    from torch.distributed.tensor import DTensor

    return {
        hf_name(stage_model, n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for n, p in stage_model.named_parameters()
    }


def load_stage_state_dict(stage_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the stage's parameters out of a whole model's state dict (by the whole model's names), before
    parallelize_stages shards them; every parameter of the stage must be there."""
    with torch.no_grad():
        for n, p in stage_model.named_parameters():
            p.copy_(state[hf_name(stage_model, n)])


class StageForward(nn.Module):
    """This rank's pipeline stage(s) as torch.distributed.pipelining runs them; `chunk` k is its k-th stage
    (`stages[k]`: one unless the schedule is interleaved).

    first stage: (input_ids, attention_mask, position_ids) (B, L) each
    later stages: (hidden (B, L, H), input_ids, attention_mask, position_ids)
    -> not last: the same four, hidden after the stage's layers
    -> last: log-probs (B, Lr) (causal LM; with_entropy: log-probs and entropy stacked, (B, 2, Lr)),
       values (B, Lr) (critic) or scores (B,) at each row's last attended token (reward model), fp32
    `response_length`, `temperature`, `logits_chunk_size` and `with_entropy` are set per call (`configure`).
    first / last: whether this rank holds the pipeline's first / last stage.
    """

    def __init__(self, model: nn.Module, stages: int | Sequence[int], num_stages: int):
        super().__init__()
        self.model = model
        self.kind = model_kind(model)
        self.stages = [stages] if isinstance(stages, int) else list(stages)
        self.first, self.last = self.stages[0] == 0, self.stages[-1] == num_stages - 1
        sizes = [len(r) for r in (stage_layer_ranges(_num_layers(model), num_stages)[s] for s in self.stages)]
        starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
        # chunk k's decoder layers: model.base_model.layers[bounds[k]]
        self.bounds = [slice(starts[k], starts[k + 1]) for k in range(len(sizes))]
        self.response_length, self.temperature, self.logits_chunk_size = 1, 1.0, 256
        self.with_entropy: bool | str = False

    def configure(
        self,
        response_length: int,
        temperature: float = 1.0,
        logits_chunk_size: int = 256,
        with_entropy: bool | str = False,
    ) -> None:
        self.response_length, self.temperature = response_length, temperature
        self.logits_chunk_size, self.with_entropy = logits_chunk_size, with_entropy

    def is_first(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.last and chunk == len(self.stages) - 1

    def forward(self, *inputs: torch.Tensor, chunk: int = 0):
        with self._lend(chunk):
            if self.is_first(chunk):
                input_ids, attention_mask, position_ids = inputs
                hidden = self.model.base_model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False,
                ).last_hidden_state  # fmt: skip
            else:
                embeds, input_ids, attention_mask, position_ids = inputs
                hidden = self.model.base_model(
                    inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False,
                ).last_hidden_state  # fmt: skip
        if not self.is_last(chunk):
            return hidden, input_ids, attention_mask, position_ids
        return self._head(hidden, input_ids, attention_mask)

    @contextlib.contextmanager
    def _lend(self, chunk: int):
        """The backbone with only chunk `chunk`'s layers, and no final norm unless it is the last stage,
        for one call (the HF forward loops over `layers` and ends with `norm`); restored after."""
        if len(self.stages) == 1:
            yield
            return
        base = self.model.base_model
        layers, norm = base.layers, base.norm
        base.layers = nn.ModuleList(list(layers)[self.bounds[chunk]])
        if not self.is_last(chunk):
            base.norm = nn.Identity()
        try:
            yield
        finally:
            base.layers, base.norm = layers, norm

    def _head(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        if self.kind == "reward":
            h_last = hidden[
                torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)
            ]
            return scalar_head(self.model)(h_last).squeeze(-1).float()
        lr = self.response_length
        h_resp = hidden[:, -lr - 1 : -1]  # (B, Lr, H): states before each response token (forward.py)
        if self.kind == "critic":
            return scalar_head(self.model)(h_resp).squeeze(-1).float()
        lm_head = self.model.get_output_embeddings()
        log_probs, entropy = chunked_log_probs(
            h_resp, lm_head, input_ids[:, -lr:], self.logits_chunk_size, self.temperature, self.with_entropy
        )
        return log_probs if entropy is None else torch.stack([log_probs, entropy], 1)

    def output_shape(self, rows: int) -> tuple[int, ...]:
        """The last stage's output for `rows` rows (forward's docstring)."""
        if self.kind == "reward":
            return (rows,)
        return (rows, 2, self.response_length) if self.with_entropy else (rows, self.response_length)


class StageChunk(nn.Module):
    """Stage `chunk` of a StageForward holding several, as the module one PipelineStage runs: it calls
    the StageForward itself, so FSDP's root hooks run as for a single stage."""

    def __init__(self, stage: StageForward, chunk: int):
        super().__init__()
        self.stage, self.chunk = stage, chunk

    def forward(self, *inputs: torch.Tensor):
        return self.stage(*inputs, chunk=self.chunk)


def _num_layers(stage_model: nn.Module) -> int:
    """The whole model's decoder layers (a cut model's config still counts them all)."""
    return stage_model.config.num_hidden_layers


def build_stages(model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int = 1) -> StageForward:
    """This rank's StageForward: `model` cut, in place, to the stages rank_stages gives it."""
    stages = rank_stages(pp_rank, pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    return StageForward(split_stage(model, stages, num_stages), stages, num_stages)


def stage_io(
    stage: StageForward, chunk: int, rows: int, seq_len: int, dtype: torch.dtype
) -> tuple[tuple, tuple]:
    """(inputs, outputs) of one micro-batch through `stage`'s chunk, as meta tensors: the shapes
    PipelineStage is given up front, so no stage infers them by exchanging metadata at the first step
    (torch 2.13's inference exchange, on gloo, delivered the int tensors' metadata in their place)."""
    ints = tuple(torch.empty(rows, seq_len, dtype=torch.long, device="meta") for _ in range(3))
    # requires_grad marks what carries a gradient back (the hidden states, the last stage's output)
    hidden = torch.empty(rows, seq_len, stage.model.config.hidden_size, dtype=dtype, device="meta")
    hidden.requires_grad_(True)
    inputs = ints if stage.is_first(chunk) else (hidden, *ints)
    last = (torch.empty(stage.output_shape(rows), device="meta", requires_grad=True),)
    return inputs, last if stage.is_last(chunk) else (hidden, *ints)


def build_pipeline_stages(
    stage: StageForward, num_stages: int, rows: int, seq_len: int, device, group=None, dtype=None
) -> list:
    """One PipelineStage per stage `stage` holds, micro-batches of `rows` x `seq_len`; dtype: the hidden
    states' (None: the parameters'). A single stage is run as the StageForward itself (the FSDP root,
    whose gradient reduction torch's pipelining defers to the last micro-batch)."""
    from torch.distributed.pipelining import PipelineStage

    dtype = dtype or next(stage.parameters()).dtype
    out = []
    for chunk, index in enumerate(stage.stages):
        inputs, outputs = stage_io(stage, chunk, rows, seq_len, dtype)
        module = stage if len(stage.stages) == 1 else StageChunk(stage, chunk)
        out.append(
            PipelineStage(module, index, num_stages, torch.device(device), inputs, outputs, group=group)
        )
    return out


def build_pipeline_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu"):
    """The (pp, dp, tp) DeviceMesh, tp fastest-varying as controller/worker.py lays it out: the first
    dp * tp ranks run stage 0, each stage's (dp, tp) plane is an ordinary FSDP2 x TP mesh; the process's
    one mesh of that shape (controller/device.py process_mesh)."""
    from hybridflow.controller.device import process_mesh

    return process_mesh(device_type, (pp, dp, tp), ("pp", "dp", "tp"))


def parallelize_stages(stage: StageForward, mesh, **kwargs) -> None:
    """Tensor parallel, activation checkpointing and FSDP2 (parallelize.py, torchtitan's order) on this
    rank's stage(s) over the mesh's (dp, tp) plane; the StageForward is the FSDP root, as the RLForward
    is without a pipeline. kwargs: parallelize's."""
    parallelize(stage, stage.model, mesh["dp", "tp"], **kwargs)


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn=None):
    """The pipelining schedule `name` (SCHEDULES) over this rank's PipelineStage objects.

    scale_grads=False: the loss_fn carries the global normaliser (a token-mean divides by the whole
    mini-batch's tokens), so the micro-batch gradients are summed, not averaged."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: choose one of {SCHEDULES}")
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank, got {len(stages)}; use interleaved_1f1b"
        )
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
