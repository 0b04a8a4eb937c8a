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

The last stage returns what the RL losses read: response log-probs (B, Lr) of a causal LM, the critic's
per-token values (B, Lr) or a reward model's sequence scores (B,); its loss_fn is the RL loss, with
per-token tensors as the schedule's `target`. Llama-family models only (parallelize.LLAMA_LIKE): GPT-2 adds position embeddings to
`inputs_embeds`, so every later stage would add them again.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from hybridflow.engines.forward import chunked_log_probs, last_token_index
from hybridflow.engines.parallelize import LLAMA_LIKE, decoder_layers, parallelize
from hybridflow.models.hf import model_kind, scalar_head

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# set on a stage's model: the model's index of its first decoder layer (`hf_name` renumbers from it)
_FIRST_LAYER_ATTR = "_hybridflow_first_layer"
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


def split_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """`model` cut down, in place, to pipeline stage `stage` of `num_stages` (module docstring)."""
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
    keep = stage_layer_ranges(len(layers), num_stages)[stage]
    base = model.base_model
    base.layers = nn.ModuleList(layers[i] for i in keep)
    setattr(model, _FIRST_LAYER_ATTR, keep.start)
    if stage > 0:
        base.embed_tokens = None
    if stage < num_stages - 1:
        base.norm = nn.Identity()
        for head in ("lm_head", "score"):
            if hasattr(model, head):
                setattr(model, head, None)
    return model


def hf_name(stage_model: nn.Module, name: str) -> str:
    """The whole model's name of a stage model's parameter: its decoder layers renumbered from the
    stage's first (HF checkpoints, full state dicts and gradients keep the whole model's names)."""
    m = _LAYER.fullmatch(name)
    return name if m is None else f"{m[1]}{int(m[2]) + getattr(stage_model, _FIRST_LAYER_ATTR)}{m[3]}"


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
    """One pipeline stage as torch.distributed.pipelining runs it.

    first stage: (input_ids, attention_mask, position_ids) (B, L) each
    later stages: (hidden (B, L, H), input_ids, attention_mask, position_ids)
    -> not last: the same four, hidden after this stage's layers
    -> last: log-probs (B, Lr) (causal LM; with_entropy: log-probs and entropy stacked, (B, 2, Lr)),
       values (B, Lr) (critic) or scores (B,) at each row's last attended token (reward model), fp32
    `response_length`, `temperature`, `logits_chunk_size` and `with_entropy` are set per call (`configure`).
    """

    def __init__(self, model: nn.Module, stage: int, num_stages: int):
        super().__init__()
        self.model = model
        self.kind = model_kind(model)
        self.first, self.last = stage == 0, stage == num_stages - 1
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

    def forward(self, *inputs: torch.Tensor):
        if self.first:
            input_ids, attention_mask, position_ids = inputs
            hidden = self.model.base_model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        else:
            embeds, input_ids, attention_mask, position_ids = inputs
            hidden = self.model.base_model(
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        if not self.last:
            return hidden, input_ids, attention_mask, position_ids
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


def build_stages(
    model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int = 1
) -> list[tuple[int, StageForward]]:
    """(stage index, StageForward) for each stage this rank runs; with several, each cut from a copy."""
    ids = rank_stages(pp_rank, pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    out = []
    for k, stage in enumerate(ids):
        source = model if k == len(ids) - 1 else copy.deepcopy(model)
        out.append((stage, StageForward(split_stage(source, stage, num_stages), stage, num_stages)))
    return out


def stage_io(stage: StageForward, rows: int, seq_len: int, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """(inputs, outputs) of one micro-batch through `stage`, as meta tensors: the shapes PipelineStage is
    given up front, so no stage infers them by exchanging metadata at the first step (torch 2.13's
    inference exchange, on gloo, delivered the int tensors' metadata in their place)."""
    ints = tuple(torch.empty(rows, seq_len, dtype=torch.long, device="meta") for _ in range(3))
    # requires_grad marks what carries a gradient back (the hidden states, the last stage's output)
    hidden = torch.empty(rows, seq_len, stage.model.config.hidden_size, dtype=dtype, device="meta")
    hidden.requires_grad_(True)
    inputs = ints if stage.first else (hidden, *ints)
    last = (torch.empty(stage.output_shape(rows), device="meta", requires_grad=True),)
    return inputs, last if stage.last else (hidden, *ints)


def build_pipeline_stages(
    stages, num_stages: int, rows: int, seq_len: int, device, group=None, dtype=None
) -> list:
    """PipelineStage objects for this rank's (index, StageForward) pairs, micro-batches of `rows` x `seq_len`;
    dtype: the hidden states' (None: the parameters')."""
    from torch.distributed.pipelining import PipelineStage

    out = []
    for index, stage in stages:
        dtype = dtype or next(stage.parameters()).dtype
        inputs, outputs = stage_io(stage, rows, seq_len, dtype)
        out.append(
            PipelineStage(stage, index, num_stages, torch.device(device), inputs, outputs, group=group)
        )
    return out


def build_pipeline_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu"):
    """The (pp, dp, tp) DeviceMesh, tp fastest-varying as controller/worker.py lays it out: the first
    dp * tp ranks run stage 0, each stage's (dp, tp) plane is an ordinary FSDP2 x TP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def parallelize_stages(stages, mesh, **kwargs) -> None:
    """Tensor parallel, activation checkpointing and FSDP2 (parallelize.py, torchtitan's order) on each
    of this rank's stages over the mesh's (dp, tp) plane; the StageForward is the FSDP root, as the
    RLForward is without a pipeline. kwargs: parallelize's."""
    plane = mesh["dp", "tp"]
    for _, stage in stages:
        parallelize(stage, stage.model, plane, **kwargs)


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
