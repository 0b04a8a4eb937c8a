"""Repack a wheel without some of its folders, for the offline GPU kit (scripts/offline_wheels.sh).

    python scripts/trim_wheel.py WHEEL OUT_DIR --drop ray/jars ray/rllib ... [--level 9]

Why: the working tree carried to an air-gapped GPU machine is capped at 64 MiB and Ray's wheel alone is
~76 MiB, most of it parts hybridflow never imports (the Java jar, RLlib, Tune, Serve, Data, Train, the
dashboard's web client). The trimmed wheel keeps its file name and version, so `ray==2.60.0` still
resolves to it. pip does not check RECORD's hashes on install, but the RECORD written here is exact
anyway (a dropped file listed there would be "uninstalled" by pip later): dropped files leave it, and a
rewritten entry_points.txt (console scripts into dropped packages: `serve`, `tune`) gets its new hash.
File modes (the executable bit of Ray's gcs_server / raylet) are kept.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def record_hash(data: bytes) -> str:
    """RECORD's hash field: sha256, urlsafe base64 without padding (the wheel spec)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dropped(name: str, drop: list[str]) -> bool:
    return any(name == d or name.startswith(d.rstrip("/") + "/") for d in drop)


def trim_entry_points(text: str, drop: list[str]) -> str:
    """Remove console scripts whose target module lives in a dropped folder (`serve = ray.serve...`)."""
    modules = [d.rstrip("/").replace("/", ".") for d in drop]
    keep = []
    for line in text.splitlines():
        m = re.match(r"\s*[^=\[]+=\s*([\w.]+)", line)
        if m and any(m.group(1) == mod or m.group(1).startswith(mod + ".") for mod in modules):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def trim_wheel(wheel: Path, out_dir: Path, drop: list[str], level: int = 9) -> Path:
    """Write `out_dir/<same name>` without the files under `drop`; returns its path."""
    out = out_dir / wheel.name
    if out.resolve() == wheel.resolve():
        raise ValueError(f"trim_wheel: output {out} would overwrite its input")
    with zipfile.ZipFile(wheel) as src:
        infos = [i for i in src.infolist() if not dropped(i.filename, drop)]
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as dst:
            for info in infos:
                if info.filename == record_name or info.is_dir():
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/entry_points.txt"):
                    data = trim_entry_points(data.decode(), drop).encode()
                new = zipfile.ZipInfo(info.filename, info.date_time)
                new.external_attr = info.external_attr  # keeps the executable bits
                new.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(new, data, compresslevel=level)
                lines.append(f"{info.filename},{record_hash(data)},{len(data)}")
            lines.append(f"{record_name},,")
            record = zipfile.ZipInfo(record_name, src.getinfo(record_name).date_time)
            record.external_attr = src.getinfo(record_name).external_attr
            dst.writestr(record, "\n".join(lines) + "\n", zipfile.ZIP_DEFLATED, compresslevel=level)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", nargs="+", required=True, help="folders inside the wheel, e.g. ray/jars")
    parser.add_argument("--level", type=int, default=9, help="deflate level (9: smallest)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = trim_wheel(args.wheel, args.out_dir, args.drop, args.level)
    mib = 2**20
    print(
        f"trim_wheel: {args.wheel.name}: {args.wheel.stat().st_size / mib:.1f} MiB -> {out.stat().st_size / mib:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
