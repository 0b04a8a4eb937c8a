"""A device profile: the cost model's coefficients measured on one machine (`hybridflow calibrate --out FILE`).

The catalogue's entries (specs.py DEVICES) are datasheet numbers and a guessed efficiency: good enough to
plan hardware one does not have, not to trust an iteration time. A profile replaces them with what short
micro-benchmarks measured (planner/microbench.py): GEMM rate and its fall-off on narrow matrices per
compute dtype, memory bandwidth, the fixed cost per layer and per decode step, collective latency and
bandwidth between two ranks, process start-up. It is a small versioned YAML/JSON file, one per machine
kind, that users can share; `hybridflow plan --profile FILE` and `resources.planner_profile` plan with it.

    version: 13
    name: cpu-measured           # the device name plans made with it carry
    host: {...}                  # where it was measured (CPU model, torch version, threads)
    devices: {float32: {DeviceSpec fields}, bfloat16: {...}}   # one entry per compute dtype measured
    measurements: {...}          # the raw figures the coefficients came from, for the record

Older profiles still load: the terms measured since (ADDED_FIELDS: version 2 the path's fixed costs,
version 3 the activations' cost per value, version 4 the optimizer step's on DTensors and the engine's per
token, version 5 the width those per-token terms were measured at, version 6 the driver's own work per step,
version 7 tensor parallelism's per token, version 8 the engine's per micro-batch, version 9 the switch's
per unit gathered, version 10 FSDP2's per token, version 11 the passes' gain from a node's idle cores,
the engine's decode cost per row and the responses' text, version 12 a pipeline stage's per token, version 13
the wait where ranks meet after work of their own, version 14 a call's cost per rank beyond the first) take
their DeviceSpec default, 0 (not priced, as when the profile was written), with a one-line note; the
switch's per FSDP2 unit takes the per-pass figure it was priced at before (fsdp_layer_overhead_s). A
version 10 file's decode step was measured on HF generate, not on the built-in engine.

Pure: no torch here, so the planner reads a profile without loading it.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from hybridflow.planner.specs import DeviceSpec, load_dict, save_dict

PROFILE_VERSION = 14
# the terms version 2 added (microbench_path.py): a version 1 profile has none of them
PATH_FIELDS = (
    "call_overhead_s",
    "transfer_bandwidth",
    "micro_batch_overhead_s",
    "tp_layer_overhead_s",
    "fsdp_layer_overhead_s",
    "optimizer_layer_overhead_s",
    "optimizer_step_overhead_s",
)
# version -> the terms it added (a file of an earlier version prices them at 0)
ADDED_FIELDS = {
    2: PATH_FIELDS,
    3: ("activation_s_per_element",),
    4: (
        "fsdp_optimizer_step_overhead_s",
        "tp_optimizer_step_overhead_s",
        "train_token_overhead_s",
        "infer_token_overhead_s",
    ),
    5: ("token_overhead_width",),
    6: ("driver_step_overhead_s",),
    7: ("tp_token_overhead_s",),
    8: ("train_batch_overhead_s", "infer_batch_overhead_s"),
    9: ("switch_fsdp_unit_s", "switch_tp_unit_s", "switch_stage_s"),
    10: ("fsdp_train_token_overhead_s", "fsdp_infer_token_overhead_s"),
    11: (
        "thread_fraction_train",
        "thread_fraction_infer",
        "decode_row_overhead_s",
        "detokenize_row_s",
        "detokenize_token_s",
    ),
    12: ("pipeline_train_token_overhead_s", "pipeline_infer_token_overhead_s"),
    13: ("sync_wait_s", "sync_wait_fraction"),
    14: ("call_rank_overhead_s",),
}
# a term a newer version measures that an older file had priced by another: it loads as that one
INHERITED = {"switch_fsdp_unit_s": "fsdp_layer_overhead_s"}
DTYPES = ("float32", "bfloat16")
_DEVICE_FIELDS = {f.name for f in fields(DeviceSpec)}


@dataclass(frozen=True)
class DeviceProfile:
    """Measured DeviceSpecs per compute dtype, and where and from what they were measured."""

    name: str
    devices: dict[str, DeviceSpec]  # compute dtype -> its measured spec
    host: dict = field(default_factory=dict)
    measurements: dict = field(default_factory=dict)
    version: int = PROFILE_VERSION
    notes: tuple[str, ...] = ()  # what loading it assumed (an older file's missing terms)

    def __post_init__(self):
        if not self.devices:
            raise ValueError("a device profile needs at least one dtype's device entry")
        unknown = sorted(set(self.devices) - set(DTYPES))
        if unknown:
            raise ValueError(f"device profile: dtypes {unknown} are not among {DTYPES}")

    def device(self, dtype: str = "float32") -> DeviceSpec:
        """The measured spec for `dtype` (float32 or bfloat16); a dtype it lacks is an error, not a guess."""
        if dtype not in self.devices:
            raise ValueError(
                f"device profile {self.name!r} has no {dtype} measurements (it has {sorted(self.devices)}); "
                f"re-run `hybridflow calibrate` on a machine that computes in {dtype}"
            )
        return self.devices[dtype]

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "name": self.name,
            "host": dict(self.host),
            "devices": {k: asdict(v) for k, v in self.devices.items()},
            "measurements": dict(self.measurements),
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> DeviceProfile:
        if not isinstance(data, dict) or "devices" not in data:
            raise ValueError(f"{source}: not a device profile (no `devices` section)")
        version = data.get("version")
        if version not in range(1, PROFILE_VERSION + 1):
            raise ValueError(
                f"{source}: device profile version {version!r}, this build reads version {PROFILE_VERSION}; "
                "re-run `hybridflow calibrate --out FILE`"
            )
        devices = {}
        for dtype, spec in data["devices"].items():
            unknown = sorted(set(spec) - _DEVICE_FIELDS)
            if unknown:
                raise ValueError(f"{source}: devices.{dtype} has unknown fields {unknown}")
            spec = {**{new: spec[old] for new, old in INHERITED.items() if old in spec}, **spec}
            devices[dtype] = replace(DeviceSpec(**spec), measured=True)
        return cls(
            name=str(data["name"]),
            devices=devices,
            host=dict(data.get("host") or {}),
            measurements=dict(data.get("measurements") or {}),
            version=PROFILE_VERSION,
            notes=_missing_terms(data, version, source),
        )

    @classmethod
    def median_of(cls, rounds: list[DeviceProfile]) -> DeviceProfile:
        """One profile from several measurements of the same machine: each numeric coefficient the median
        of its rounds'. A coefficient is a difference of two timings (a slope, an intercept), so a burst of
        other work on the machine during one round moves it a lot, in either direction; the median of
        three drops one such round whole. The raw figures keep every round."""
        if len(rounds) == 1:
            return rounds[0]
        first = rounds[0]
        devices = {}
        for dtype, spec in first.devices.items():
            numeric = {
                f.name: statistics.median(getattr(r.devices[dtype], f.name) for r in rounds)
                for f in fields(DeviceSpec)
                if isinstance(getattr(spec, f.name), float)
            }
            devices[dtype] = replace(spec, **numeric)
        measurements = {"rounds": [r.measurements for r in rounds]}
        return replace(
            first, devices=devices, host={**first.host, "rounds": len(rounds)}, measurements=measurements
        )

    def save(self, path: str | Path) -> Path:
        """Write YAML (.yaml/.yml) or JSON (anything else)."""
        return save_dict(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        import yaml

        hint = f"no device profile at {path}; write one with `hybridflow calibrate --out {path}`"
        try:
            profile = cls.from_dict(load_dict(path, hint), str(path))
        except (yaml.YAMLError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path}: not a device profile ({e})") from e
        for note in profile.notes:
            print(f"note: {note}", file=sys.stderr)
        return profile


def _missing_terms(data: dict, version: int, source: str) -> tuple[str, ...]:
    newer = [f for v, added in ADDED_FIELDS.items() if v > version for f in added]
    missing = sorted(
        {f for spec in data["devices"].values() for f in newer if f not in spec and f not in INHERITED}
    )
    if not missing:
        return ()
    return (
        f"{source}: a version {version} device profile without the terms measured since ({', '.join(missing)}); "
        "they are priced at 0, as it was written; `hybridflow calibrate --out FILE` measures them",
    )
