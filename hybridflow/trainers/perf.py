"""Per-step resource metrics: peak device and host memory per role, and achieved FLOP/s (and MFU on a
known accelerator) per phase. docs/metrics.md lists the names and their verl counterparts.

FLOPs are the usual dense-transformer estimate: 2 N per token for a forward pass, 6 N for forward +
backward, N the model's parameter count read from its safetensors headers; attention's L^2 term is left
out (small next to 2 N at the sequence lengths of RL post-training). A phase's figure is its FLOPs over
its busy seconds (timing_s/<phase>: the workers' own time in the phase's methods, docs/metrics.md) and
the devices of the group that ran it, so idle time inside a method (Python, communication) lowers it.
"""

from __future__ import annotations

import json
import os
import resource
import struct
from pathlib import Path

GiB = 1024**3
# torch.cuda.get_device_name() substring -> planner device catalogue key (planner/specs.py DEVICES)
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100-SXM4-80GB", "a100-80"), ("A100 80GB", "a100-80"), ("A100", "a100-40"))  # fmt: skip


def count_params(model_dir: str | os.PathLike) -> int:
    """Parameters of an HF directory, from its *.safetensors headers (no weights read); 0 if none."""
    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                total += count
    return total


def peak_flops(device_name: str | None) -> float | None:
    """Dense peak FLOP/s of a named accelerator from the planner's catalogue; None when unknown or CPU."""
    if not device_name:
        return None
    from hybridflow.planner.specs import DEVICES

    key = next((k for sub, k in _DEVICE_NAMES if sub in device_name), None)
    return DEVICES[key].peak_flops if key else None


def phase_flops(n_actor: int, n_critic: int, tokens: float, actor_epochs: int, critic_epochs: int,
                recompute_old: bool) -> dict[str, float]:  # fmt: skip
    """FLOPs of each phase of one RL step over `tokens` attended tokens (prompt + response)."""
    out = {
        "gen": 2.0 * n_actor * tokens,  # prefill + decode: one forward per token
        "ref": 2.0 * n_actor * tokens,
        "update_actor": 6.0 * n_actor * tokens * actor_epochs,
    }
    if recompute_old:
        out["old_log_prob"] = 2.0 * n_actor * tokens
    if n_critic:
        out["values"] = 2.0 * n_critic * tokens
        out["update_critic"] = 6.0 * n_critic * tokens * critic_epochs
    return out


MIN_RATE_SECONDS = 1e-3
"""A phase's time below which no rate is logged: the timers' own resolution in practice. A phase that
issued no call reads the driver's bookkeeping (~10 us: timers.phase), and a rate over it is no
measurement (2 N x tokens over 10 us reads 10^5 TFLOP/s for a 0.5B model); any real forward of a
model in a step takes longer."""


def flops_metrics(flops: dict[str, float], times: dict[str, float], devices: dict[str, int],
                  peak: float | None) -> dict[str, float]:  # fmt: skip
    """perf/tflops_per_device/<phase> (and perf/mfu/<phase> when the device's peak is known), for the
    phases timed for at least MIN_RATE_SECONDS."""
    out = {}
    for phase, f in flops.items():
        seconds = times.get(f"timing_s/{phase}")
        if not seconds or seconds < MIN_RATE_SECONDS or not f:
            continue
        per_device = f / seconds / max(devices.get(phase, 1), 1)
        out[f"perf/tflops_per_device/{phase}"] = per_device / 1e12
        if peak:
            out[f"perf/mfu/{phase}"] = per_device / peak
    return out


def request_memory_stats(groups: dict) -> dict:
    """Each distinct group's memory_stats call, issued without waiting (id(group) -> Future). Issued
    before the driver waits for a step's last calls, it queues behind them on each worker and comes back
    with them: the step pays no round trip of its own for its memory figures."""
    distinct = {id(group): group for group in groups.values()}  # colocated roles: one call for their group
    return {key: group.memory_stats.future() for key, group in distinct.items()}


def memory_metrics(
    groups: dict, driver: bool = True, pending: dict | None = None
) -> tuple[dict[str, float], str | None]:
    """perf/memory/<role>/{host_peak_rss_gb, max_memory_allocated_gb, max_memory_reserved_gb}: the max
    over the role's ranks (colocated roles share processes, so their figures coincide), plus the
    driver's host RSS; -> (metrics, the accelerator's name or None). `pending`: request_memory_stats's
    futures, read instead of calling the groups now."""
    out, name, seen = {}, None, {}
    pending = pending or {}
    for role, group in groups.items():
        key = id(group)
        if key not in seen:
            seen[key] = pending[key].get() if key in pending else group.memory_stats()
        for stats in seen[key]:
            name = stats.get("device_name", name)
            for k, v in stats.items():
                if k != "device_name":
                    m = f"perf/memory/{role}/{k}"
                    out[m] = max(out.get(m, 0.0), float(v))
    if driver:
        out["perf/memory/driver/host_peak_rss_gb"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
        )
    return out, name


def step_resource_metrics(trainer, batch) -> dict[str, float]:
    """memory_metrics + flops_metrics of one step of `trainer` (a Trainer) on its finished `batch`, read
    before the step's timers are popped. Parameter counts are read once and kept on the trainer."""
    if not hasattr(trainer, "_n_params"):
        m, critic = trainer.cfg.model, "critic" in trainer.groups
        trainer._n_params = (count_params(m.path), count_params(m.critic_path or m.path) if critic else 0)
    pending, trainer.memory_pending = getattr(trainer, "memory_pending", None), None
    out, device_name = memory_metrics(trainer.groups, pending=pending)
    a, c = trainer.cfg.actor, trainer.cfg.critic
    tokens = float(batch["attention_mask"].sum())
    # old log-probs cost a forward only when the actor ran one for them (trainers/sources/base.py old_log_prob_source)
    recompute = batch.meta.old_log_probs_source == "actor"
    flops = phase_flops(*trainer._n_params, tokens, a.ppo_epochs, c.ppo_epochs, recompute_old=recompute)
    # timing_s/gen is the generation's own time only where the rollout source generates in the step
    # (offline trainers have no source)
    source = getattr(trainer, "source", None)
    if source is not None and not source.times_generation:
        flops.pop("gen")
    if not getattr(trainer, "uses_ref", True):  # its phase timer ran, around no forward
        flops.pop("ref")
    role = {"values": "critic", "update_critic": "critic", "ref": "ref"}
    devices = {p: trainer.groups.get(role.get(p, "actor_rollout"), trainer.actor).world_size for p in flops}
    out.update(flops_metrics(flops, trainer.timers.times, devices, peak_flops(device_name)))
    return out
