#!/usr/bin/env bash
# The offline GPU kit (docs/bench/gpu.md): every wheel hybridflow needs on a GPU machine that has torch
# and transformers preinstalled but no package index, built here for the target's Python and platform.
#   scripts/offline_wheels.sh DIR [--python-version 3.12] [--platform manylinux2014_x86_64 ...]
# DIR gets: the wheels of scripts/kit_requirements.txt and their dependencies (pins from
# constraints.txt; binary wheels only, except the pure-Python sdists in SDIST_ONLY, built into wheels
# here; sympy and mpmath left out: every torch requires them, so the image has them), Ray trimmed by
# scripts/trim_wheel.py (no Java jar, RLlib, Tune, Serve, Data, Train, AIR, LLM, dashboard web
# client), pip itself (for an image whose Python has none),
# the project's own wheel, and kit.json (what it was built for). Prints the sizes: the bundle plus the
# repository must stay under 60 MB so both fit the 64 MiB a device machine receives.
# Then, there: CHECK_WHEELS=DIR scripts/gpu_check.sh (installs with --no-index, never touching torch).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage() { echo "usage: scripts/offline_wheels.sh DIR [--python-version X.Y] [--platform TAG ...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
DIR=$1
shift
PYV=3.12
PLATFORMS=()
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) [ $# -ge 2 ] || usage; PYV=$2; shift 2 ;;
    --platform) [ $# -ge 2 ] || usage; PLATFORMS+=("$2"); shift 2 ;;
    *) usage ;;
  esac
done
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux2014_x86_64)
PY=${KIT_PY:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
# Folders of Ray's wheel that hybridflow never imports (it uses ray.init/remote/get/wait, actors,
# placement groups and scheduling strategies; tests/test_gpu_kit.py runs them on the trimmed wheel).
RAY_DROP=(ray/jars ray/rllib ray/tune ray/serve ray/data ray/train ray/air ray/llm ray/dashboard/client)
# Pinned dependencies PyPI has no wheel of (pure Python): built into a wheel here, at constraints.txt's pin.
SDIST_ONLY=(antlr4-python3-runtime)

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
rm -f "$DIR"/*.whl "$DIR"/kit.json
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
PLAT_ARGS=()
for p in "${PLATFORMS[@]}"; do PLAT_ARGS+=(--platform "$p"); done

echo "== building wheels of ${SDIST_ONLY[*]}"
for name in "${SDIST_ONLY[@]}"; do
  pin=$(grep -i "^$name==" "$ROOT/constraints.txt") || {
    echo "offline_wheels: no pin of $name in constraints.txt"; exit 1; }
  "$PY" -m pip wheel -q --no-deps "$pin" -w "$RAW/local"
done

echo "== downloading for Python $PYV, ${PLATFORMS[*]}"
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYV" --implementation cp "${PLAT_ARGS[@]}" \
  --find-links "$RAW/local" -c "$ROOT/constraints.txt" -r "$ROOT/scripts/kit_requirements.txt" pip \
  -d "$RAW/dl"
for whl in "$RAW"/dl/*.whl; do
  case $(basename "$whl") in
    ray-*) "$PY" "$ROOT/scripts/trim_wheel.py" "$whl" "$DIR" --drop "${RAY_DROP[@]}" ;;
    sympy-*|mpmath-*) ;;  # torch's own requirements: the image has them (7 MB)
    *) cp "$whl" "$DIR/" ;;
  esac
done

echo "== the project's wheel"
# Built from a copy of its inputs, so the repository gets no build/ or egg-info folders.
mkdir -p "$RAW/src"
cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$RAW/src/"
(cd "$ROOT" && tar cf - --exclude=__pycache__ hybridflow) | tar xf - -C "$RAW/src"
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$RAW/src"

COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
"$PY" - "$DIR" "$PYV" "$COMMIT" "$ROOT" "${PLATFORMS[@]}" <<'PY'
import json, pathlib, subprocess, sys
kit, pyv, commit, root, platforms = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
wheels = sorted(kit.glob("*.whl"))
(kit / "kit.json").write_text(json.dumps(
    {"python_version": pyv, "platforms": platforms, "commit": commit,
     "wheels": {w.name: w.stat().st_size for w in wheels}}, indent=1) + "\n")
bundle = sum(f.stat().st_size for f in kit.iterdir() if f.is_file())
# the working tree a device machine receives: tracked and untracked-but-not-ignored files
files = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
                       capture_output=True, check=True).stdout.decode().split("\0")
repo = sum((pathlib.Path(root) / f).stat().st_size for f in files if f and (pathlib.Path(root) / f).is_file()
           and not (pathlib.Path(root) / f).resolve().is_relative_to(kit))
mb, mib = 1e6, 2**20
for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:5]:
    print(f"  {w.stat().st_size / mib:6.1f} MiB  {w.name}")
print(f"  ... {len(wheels)} wheels in {kit}")
total = bundle + repo
verdict = "OK" if total < 60 * mb else "OVER the 60 MB target"
print(f"offline_wheels: bundle {bundle / mib:.1f} MiB + repository {repo / mib:.1f} MiB = {total / mib:.1f} MiB "
      f"({total / mb:.1f} MB): {verdict}")
sys.exit(0 if total < 60 * mb else 1)
PY
