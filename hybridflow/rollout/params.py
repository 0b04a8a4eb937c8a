"""Sampling parameters shared by every generation engine (built-in, HF `generate`, later vLLM/SGLang).

Field names follow vLLM's `SamplingParams` where they exist (temperature, top_k, top_p, n, seed,
stop_token_ids) so that a vLLM engine can be dropped in by translating one dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """Seed for the sampling RNG; None draws from torch's global RNG. On CPU the output is then a
    pure function of (weights, prompts, params)."""

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
