"""Per-step metrics computed on the controller from the finished batch (names as verl's); the timings come
from controller/timers.py.

reward/{mean,max,min}             sequence scores before any KL shaping
response_length/{mean,max,min,clip_ratio}   clip_ratio: share of responses cut at the length limit
prompt_length/{mean,max}
advantages/{mean,max,min}, returns/mean
critic/{vf_explained_var,values_mean}       when the batch carries values
timing_s/<phase>                  seconds per named phase: the workers' busy time (controller/timers.py)
timing_s/overlap/<section>        wall seconds of a section of phases issued together
timing_s/timeline/<phase>/{start,end}    the phase's busy interval, seconds after the step's first phase began
perf/throughput                   (prompt + response tokens) / step seconds, also per device
"""

from __future__ import annotations

import torch

from hybridflow.algorithms import explained_variance, masked_mean
from hybridflow.batch import Batch
from hybridflow.rollout.base import response_lengths


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
    limit = batch["responses"].shape[1]
    # every response token, tool outputs of a multi-turn response included (response_mask: the model's)
    lengths = response_lengths(batch).float()
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
    if "agent_turns" in batch:
        out.update(agent_metrics(batch, lengths, mask.sum(-1)))
    return out


def agent_metrics(batch: Batch, lengths: torch.Tensor, model_tokens: torch.Tensor) -> dict[str, float]:
    """agent/*: a multi-turn batch's turns, tool calls, errors, timeouts and seconds per trajectory (means;
    tool seconds also summed), and its model vs tool tokens (agent/trajectory.py's STAT_FIELDS)."""
    out = {f"agent/{k.removeprefix('agent_')}/mean": float(batch[k].float().mean())
           for k in ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_tool_timeouts", "agent_tool_time_s")}  # fmt: skip
    out["agent/turns/max"] = float(batch["agent_turns"].max())
    out["agent/tool_time_s/sum"] = float(batch["agent_tool_time_s"].sum())
    if "agent_finish_s" in batch:  # seconds into its rank's rollout call when each trajectory finished
        out["agent/finish_s/mean"] = float(batch["agent_finish_s"].mean())
        out["agent/finish_s/max"] = float(batch["agent_finish_s"].max())
    out["agent/model_tokens/mean"] = float(model_tokens.mean())
    out["agent/tool_tokens/mean"] = float((lengths - model_tokens).mean())
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
