"""Pure tensor functions from next-token logits to (token, log-prob): temperature, top-k, top-p.

Log-prob convention (documented because training must match it): the returned log-prob of a token is
`log_softmax(logits / T)` over the FULL vocabulary, where T is the sampling temperature (1.0 when
greedy). Top-k / top-p truncation is NOT reflected in it. This is what verl computes for
`old_log_probs` (logits divided by the rollout temperature), so `rollout_log_probs` and a training
recompute agree up to numerics, and the PPO ratio is not biased by the truncation mask.
"""

from __future__ import annotations

import torch

from hybridflow.rollout.base import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: (B, V). Keep the k largest per row (ties with the k-th kept, as HF); others -> -inf.
    k <= 0 or k >= V is a no-op."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    # Unsorted top-k plus a min is ~3x cheaper on CPU than the sorted top-k HF uses.
    kth = torch.topk(logits, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits: (B, V). Nucleus filter: keep the smallest top set with mass >= p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # Mass strictly before each token; a token is dropped if that alone already reaches p.
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_from_logits(
    logits: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """logits: (B, V), -inf where excluded -> tokens (B,) drawn from softmax(logits); uniforms: (B,) in
    [0, 1), one per row, instead of drawing them from `generator`.

    Inverse-CDF sampling (one uniform per row, cumsum, searchsorted) instead of `torch.multinomial`,
    which on CPU costs ~15x more for small vocabularies. `right=True` never lands on a zero-mass token.
    """
    probs = (logits - logits.amax(-1, keepdim=True)).exp()  # unnormalised, 0 where -inf
    cdf = probs.cumsum(-1)
    if uniforms is None:
        u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device, dtype=cdf.dtype)
    else:
        u = uniforms[:, None].to(cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> a 32-bit hash of each (xor-shift-multiply rounds). The multipliers
    are below 2^31, so no product leaves int64 (no overflow to rely on)."""
    x = (x + 0x9E3779B9) & _M32  # so that 0 does not hash to 0
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def row_keys(seed: int, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows,) int64 keys, one per row, for `counter_uniforms`: a hash of (seed, row)."""
    base = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=device))
    return _mix32(base ^ torch.arange(rows, dtype=torch.int64, device=device))


def sample_keys(seed: int, prompts: torch.Tensor, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """prompts: (B,) int64 prompt ids in [0, 2^32) (base.prompt_ids) -> (B*n,) keys for `counter_uniforms`,
    sample j of prompt i at row i*n+j (the rollout batch's order): a hash of (seed, prompt id, j), so a
    sample's draws are the same whichever rank, replica or chunk generates it."""
    base = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=device))
    per_prompt = _mix32(base ^ prompts.to(device))  # (B,)
    return _mix32(per_prompt[:, None] ^ torch.arange(n, dtype=torch.int64, device=device)).reshape(-1)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys: (B,) int64 from row_keys or sample_keys, counters: (B,) or () int64 in [0, 2^32) -> (B,)
    float32 uniforms in [0, 1), a pure function of each (key, counter) pair: a row's draws depend on neither the other rows in the batch nor the order of calls
    (counter-based, as Philox is; this 32-bit hash has 24 bits of resolution, float32's own)."""
    h = _mix32((_mix32(keys ^ (counters & _M32)) + keys) & _M32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (B, V) raw model logits; uniforms: (B,) the draws to use (see sample_from_logits).
    Returns tokens (B,) int64 and their log-probs (B,) float32 under log_softmax(logits / T) (see
    module docstring)."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        logp = logits.log_softmax(-1)
    else:
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        logp = scaled.log_softmax(-1)
        filtered = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p)
        tokens = sample_from_logits(filtered, generator, uniforms)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
