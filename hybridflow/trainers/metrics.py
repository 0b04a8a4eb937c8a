"""Per-step metrics computed on the controller from the finished batch (names as verl's), and timers.

reward/{mean,max,min}             sequence scores before any KL shaping
response_length/{mean,max,min,clip_ratio}   clip_ratio: share of responses cut at the length limit
prompt_length/{mean,max}
advantages/{mean,max,min}, returns/mean
critic/{vf_explained_var,values_mean}       when the batch carries values
timing_s/<phase>                  seconds per named phase (see Timers)
perf/throughput                   (prompt + response tokens) / step seconds, also per device
"""

from __future__ import annotations

import contextlib
import time

import torch

from hybridflow.algorithms import explained_variance, masked_mean
from hybridflow.batch import Batch


class Timers:
    """`with timers("gen"): ...` adds the elapsed seconds to timing_s/gen for this step."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def data_metrics(batch: Batch, scores_key: str = "scores") -> dict[str, float]:
    """Metrics of a finished RL batch (fields per the project conventions)."""
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    limit = batch["responses"].shape[1]
    out = _stats("response_length", lengths)
    out["response_length/clip_ratio"] = float((lengths >= limit).float().mean())
    prompt_lengths = batch["attention_mask"][:, : batch["attention_mask"].shape[1] - limit].sum(-1).float()
    out["prompt_length/mean"], out["prompt_length/max"] = (
        float(prompt_lengths.mean()),
        float(prompt_lengths.max()),
    )
    if scores_key in batch:
        out.update(_stats("reward", batch[scores_key]))
    if "advantages" in batch:
        valid = batch["advantages"][mask.bool()]
        out.update(_stats("advantages", valid if valid.numel() else torch.zeros(1)))
    if "returns" in batch:
        out["returns/mean"] = float(masked_mean(batch["returns"].float(), mask))
    if "values" in batch and "returns" in batch:
        out["critic/vf_explained_var"] = float(explained_variance(batch["values"], batch["returns"], mask))
        out["critic/values_mean"] = float(masked_mean(batch["values"].float(), mask))
    return out


def throughput_metrics(batch: Batch, step_seconds: float, num_devices: int) -> dict[str, float]:
    """perf/throughput: attended prompt + response tokens per second of the step, and per device."""
    tokens = float(batch["attention_mask"].sum())
    tps = tokens / max(step_seconds, 1e-9)
    return {
        "perf/total_tokens": tokens,
        "perf/throughput": tps,
        "perf/throughput_per_device": tps / num_devices,
    }
