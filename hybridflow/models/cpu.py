"""This host's CPU as Linux describes it (/proc/cpuinfo): vendor, model name and feature flags, read once a
process, empty where the file is missing (not Linux). The GEMM library is chosen by it (models/cpu_gemm.py),
the start-up hint reads its bf16 support (trainers/speed_hint.py) and a device profile records its name
(planner/calibrate.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CpuInfo:
    vendor: str = ""  # vendor_id: "GenuineIntel", "AuthenticAMD", ...
    model: str = ""  # model name
    flags: frozenset[str] = field(default_factory=frozenset)


def parse(text: str) -> CpuInfo:
    """The first processor's fields of a /proc/cpuinfo text (every core of a host lists the same ones)."""
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return CpuInfo(
        fields.get("vendor_id", ""), fields.get("model name", ""), frozenset(fields.get("flags", "").split())
    )


@functools.cache
def this_cpu() -> CpuInfo:
    try:
        with open("/proc/cpuinfo") as f:
            return parse(f.read(1 << 16))  # the first processor's block is a few KB
    except OSError:
        return CpuInfo()
