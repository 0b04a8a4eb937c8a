"""Install the offline GPU kit (scripts/offline_wheels.sh) for this interpreter, leaving its packages alone.

    PYTHON scripts/kit_install.py KIT_DIR PREFIX --out install.json    (prints PYTHONPATH for PREFIX)

Why not a plain `pip install --prefix`: when a package the interpreter has is older than a requirement
allows, pip uninstalls it from the system site-packages before installing the new one under the prefix
(tried here: msgpack 1.0.0 was removed from the interpreter's own environment). So:
1. `pip install --dry-run --report` resolves scripts/kit_requirements.txt against what the interpreter
   already has (a version it has that fits counts, so torch, transformers, numpy are never in play);
2. exactly the wheels it chose, plus the project's own wheel, go into PREFIX with --no-deps
   --ignore-installed: nothing is uninstalled; a newer version shadows an older one only for processes
   given PYTHONPATH (listed as "shadowed" in the figures).
The project's wheel is never resolved: its pins (torch==2.13.0, transformers>=5.19) must not make pip
replace the machine's CUDA torch. pip itself runs from the kit's pip wheel, with no index and none of this
machine's pip configuration: only the kit's files can be installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]


def offline_pip(kit: Path) -> tuple[list[str], dict]:
    pip_wheel = sorted(kit.glob("pip-*.whl"))
    if not pip_wheel:
        raise SystemExit(f"kit_install: no pip wheel in {kit}; rebuild it with scripts/offline_wheels.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return [sys.executable, str(pip_wheel[-1] / "pip")], env


def site_dirs(prefix: Path) -> list[str]:
    """The folders under the prefix holding the packages (purelib and platlib differ on some distros)."""
    found = {
        p.parent.parent
        for pat in ("*/hybridflow/__init__.py", "*/ray/__init__.py")
        for p in prefix.rglob(pat)
    }
    # not ray/core/src (it holds a ray/ of its own) nor Ray's vendored thirdparty_files
    return sorted(str(d) for d in found if d.name in ("site-packages", "dist-packages"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kit", type=Path)
    p.add_argument("prefix", type=Path)
    p.add_argument("--requirements", type=Path, default=ROOT / "scripts/kit_requirements.txt")
    p.add_argument("--out", type=Path, required=True, help="JSON figures of the install")
    p.add_argument("--log", type=Path, default=None, help="pip's output (default: beside --out)")
    args = p.parse_args(argv)
    kit = args.kit.resolve()
    log = open(args.log or args.out.with_suffix(".pip.log"), "w")
    pip, env = offline_pip(kit)
    common = ["install", "--no-index", "--find-links", str(kit), "--prefix", str(args.prefix)]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pip + common + ["--dry-run", "--report", str(report), "-r", str(args.requirements)]
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        chosen = json.loads(report.read_text())["install"]
    wheels = [unquote(urlparse(item["download_info"]["url"]).path) for item in chosen]
    project = sorted(kit.glob("hybridflow-*.whl"))
    if not project:
        raise SystemExit(
            f"kit_install: no hybridflow wheel in {kit}; rebuild it with scripts/offline_wheels.sh"
        )
    cmd = (
        pip
        + common
        + ["--no-deps", "--ignore-installed", "--no-warn-script-location"]
        + wheels
        + [str(project[-1])]
    )
    subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    shadowed = {}
    for item in chosen:
        name = item["metadata"]["name"]
        try:
            shadowed[name] = f"{md.version(name)} -> {item['metadata']['version']}"
        except md.PackageNotFoundError:
            pass
    figures = {
        "seconds": round(time.time() - t0, 1),
        "installed": sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in chosen),
        "project_wheel": project[-1].name,
        "shadowed": shadowed,
        "pythonpath": site_dirs(args.prefix),
    }
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(":".join(figures["pythonpath"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
