"""The generation-engine interface, its sampling parameters, and the pure functions that shape its input and output batches.

The interface is deliberately as small as vLLM's offline API (`generate(prompts, sampling_params)`,
`load_weights(iter)`), so an engine backed by vLLM or SGLang can stand in for the built-in one: it
only has to turn its token lists into the same verl-named Batch with `build_rollout_batch`.

Input batch:  `input_ids`, `attention_mask` (B, Lp), left-padded prompts; any other fields ride along.
Output batch (B * n rows, samples of one prompt adjacent: a, a, b, b):
  prompts (B*n, Lp)            the input_ids, left-padded
  responses (B*n, Lr)          generated ids, right-padded with pad id, Lr = max_new_tokens
  input_ids (B*n, Lp + Lr)     cat(prompts, responses)
  attention_mask (B*n, Lp+Lr)  cat(prompt mask, 1 up to the response's length)
  position_ids (B*n, Lp + Lr)  cumsum of the prompt mask - 1, then +1 per response slot (verl)
  response_mask (B*n, Lr)      1 up to and including the stop token, 0 after; in a multi-turn response
                               (agent/) also 0 on the tool outputs inserted between turns
  rollout_log_probs (B*n, Lr)  float32 log-prob of each sampled token (see sampling.py), 0 on padding
plus every other input field repeated n times, and meta.temperature = the log-prob temperature;
an engine may add meta.rollout_metrics, {name: float} that the trainer logs with the step's metrics.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hybridflow.batch import Batch, position_ids_from_mask

PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids")


# Field names follow vLLM's `SamplingParams` where they exist (temperature, top_k, top_p, n, seed,
# stop_token_ids), so a vLLM engine translates one dataclass.
@dataclass(frozen=True)
class SamplingParams:
    """How to turn next-token logits into tokens.

    Order of the logit transforms is temperature -> top-k -> top-p (HF and vLLM use the same order).
    """

    max_new_tokens: int = 64
    """Response budget per sample. `responses` is always right-padded to exactly this length so that
    batches from different data-parallel ranks concatenate."""
    temperature: float = 1.0
    """Logits are divided by this before sampling. 0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p; 1.0 disables."""
    n: int = 1
    """Samples per prompt. Output rows are interleaved: a, a, b, b (GRPO groups stay contiguous)."""
    do_sample: bool = True
    """False means greedy decoding (argmax), whatever the temperature."""
    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end a sequence. None: the model config's eos_token_id."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Extra tokens that end a sequence (kept in the response, like EOS)."""
    seed: int | None = None
    """Seed of the sampling draws; None draws a seed from torch's global RNG. The built-in engine keys
    each draw by (seed, prompt id, sample index, position) (`prompt_ids`, sampling.counter_uniforms), so a
    row's samples do not depend on the batch it shares or on how the batch was split across ranks."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (or -1 to disable), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature the returned log-probs are computed at: the sampling one (1.0 when greedy).

        This is what the training side must divide its logits by to compute matching `old_log_probs`
        (verl convention), so it is also written to the output batch's meta.temperature.
        """
        return 1.0 if self.greedy else self.temperature

    def stop_ids(self, default_eos) -> tuple[int, ...]:
        """All token ids that end a sequence: eos (explicit or the model's) plus stop tokens."""
        eos = self.eos_token_ids
        if eos is None:
            eos = () if default_eos is None else default_eos
        if isinstance(eos, int):
            eos = (eos,)
        return tuple(sorted(set(eos) | set(self.stop_token_ids)))


class GenerationEngine(ABC):
    """Turns a batch of prompts into a batch of rollouts."""

    @abstractmethod
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """See the module docstring for the input and output fields."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the engine's weights from (HF parameter name, full tensor) pairs."""


def check_prompt_batch(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (input_ids, attention_mask) after checking shapes and left padding."""
    for key in ("input_ids", "attention_mask"):
        if key not in batch.tensors:
            raise KeyError(f"generate: the prompt batch needs tensor field {key!r}; it has {batch.keys()}")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"generate: input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must be (B, L)"
        )
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"generate: empty prompt batch {tuple(ids.shape)}")
    if not bool(mask[:, -1].all()):
        raise ValueError(
            "generate: prompts must be left-padded (the last column of attention_mask must be all 1); "
            "tokenize with padding_side='left'"
        )
    return ids, mask


def prompt_ids(batch: Batch) -> torch.Tensor:
    """(B,) int64 ids in [0, 2^32) that name each prompt whatever rank or chunk it lands in: a CRC-32 of
    its `uid` (the data loader's "<epoch>-<dataset index>"), else its row in this batch (then the ids, and
    a seeded run's samples, follow the batch's split)."""
    uids = batch.non_tensors.get("uid")
    if uids is None:
        return torch.arange(len(batch), dtype=torch.int64)
    return torch.tensor([zlib.crc32(str(u).encode()) for u in uids], dtype=torch.int64)


def build_rollout_batch(
    batch: Batch,
    responses: torch.Tensor,
    response_lengths: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    params: SamplingParams,
    pad_token_id: int,
    loss_mask: torch.Tensor | None = None,
) -> Batch:
    """Assemble the verl-named output batch.

    batch:             the input prompt batch (B rows)
    responses:         (B*n, Lr) int64, row i*n+j is sample j of prompt i; anything past the length is
                       overwritten with pad_token_id here
    response_lengths:  (B*n,) number of valid tokens per row (stop token included)
    rollout_log_probs: (B*n, Lr) float; zeroed past the length here
    loss_mask:         (B*n, Lr) 1 on the model's own tokens, 0 on tokens inserted between turns (a tool's
                       output, agent/): `response_mask` is then 1 on model tokens only, while attention
                       covers every token up to the length. None: every token up to the length is the model's.
    """
    n = params.n
    prompts = batch["input_ids"].repeat_interleave(n, 0)
    prompt_mask = batch["attention_mask"].repeat_interleave(n, 0)
    bn, lr = responses.shape
    if bn != prompts.shape[0]:
        raise ValueError(
            f"build_rollout_batch: {bn} response rows for {prompts.shape[0]} prompt rows (n={n})"
        )
    valid = torch.arange(lr, device=responses.device)[None, :] < response_lengths[:, None]
    responses = responses.masked_fill(~valid, pad_token_id)
    response_mask = valid if loss_mask is None else valid & loss_mask.bool()
    rollout_log_probs = rollout_log_probs.float().masked_fill(~response_mask, 0.0)
    response_mask, valid = response_mask.to(prompt_mask.dtype), valid.to(prompt_mask.dtype)
    prompt_pos = position_ids_from_mask(prompt_mask)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, lr + 1, device=prompt_pos.device)[None, :]

    rest = Batch(
        {k: v for k, v in batch.tensors.items() if k not in PROMPT_FIELDS},
        dict(batch.non_tensors),
        batch.meta,
    ).repeat(n, interleave=True)
    tensors = dict(rest.tensors)
    tensors.update(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, valid], dim=1),
        position_ids=torch.cat([prompt_pos, response_pos], dim=1),
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
    )
    rest.meta.temperature = params.logprob_temperature
    return Batch(tensors, rest.non_tensors, rest.meta)


def response_lengths(batch: Batch) -> torch.Tensor:
    """(B,) tokens in each response: the model's and, in a multi-turn response, the tool outputs between
    its turns (attention covers both; `response_mask` only the model's)."""
    return batch["attention_mask"][:, -batch["responses"].shape[1] :].sum(-1)


def load_named_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy (name, tensor) pairs into the model's parameters/buffers in place; returns how many.

    In place, so every view of the model (the training actor, a generation engine on it) sees them.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    count = 0
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                close = [k for k in params if k.split(".")[-2:] == name.split(".")[-2:]][:3]
                raise KeyError(f"load_weights: model has no parameter {name!r}; similar names: {close}")
            target = params[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
                )
            target.copy_(tensor)
            count += 1
    return count


def decode_responses(tokenizer, responses: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """Each row's first `lengths` tokens as text, special tokens skipped (a rollout's response_text)."""
    rows = [
        r[:n] for r, n in zip(responses.tolist(), lengths.long().tolist())
    ]  # 2 conversions, not 2 per row
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
