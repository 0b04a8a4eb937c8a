#!/usr/bin/env bash
# GPU smoke test (docs/bench/gpu.md): one command on a GPU machine with no package index, under 8 minutes.
#   SMOKE_WHEELS=gpu-kit scripts/gpu_smoke.sh     # from the repository root; gpu-kit from scripts/offline_wheels.sh
# Uses the machine's own Python (SMOKE_PY, default python3) with its preinstalled torch and transformers:
#  1. install: the kit's wheels with pip --no-index into a fresh --prefix under SMOKE_DIR, added to
#     PYTHONPATH (the system site-packages are never written; torch's version and path are checked
#     unchanged): scripts/kit_requirements.txt (what the image has already counts), then the project's
#     wheel with --no-deps (its torch/transformers pins must not replace the image's). Without
#     SMOKE_WHEELS the interpreter must have everything already (PYTHONPATH=the repository).
#  2. preflight, Ray-free, one process (scripts/gpu_preflight.py): tiny Qwen2, bf16 built-in generate,
#     the train-vs-rollout log-prob gap (fp32 and bf16), one bf16 training step;
#  3. GRPO for SMOKE_STEPS steps through `hybridflow train` on 1 GPU (NCCL, bf16, built-in engine), and
#     on all GPUs when more than one is visible; then with vLLM if it imports;
#  4. ONE result file (SMOKE_RESULT, default SMOKE_DIR/result.json): every figure (tokens/s, peak memory,
#     log-prob gaps, per-step rollout/log_prob_diff_* where the trainer logs them) and pass/fail per stage.
# SMOKE_DEVICE=cpu runs the same stages on CPU (gloo, bf16 as engines/precision.py computes it): the
# rehearsal of docs/bench/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${SMOKE_PY:-python3}
DEVICE=${SMOKE_DEVICE:-cuda}
STEPS=${SMOKE_STEPS:-3}
WHEELS=${SMOKE_WHEELS:-}
SMOKE_DIR=${SMOKE_DIR:-${TMPDIR:-/tmp}/hybridflow-gpu-smoke}
RUN_TIMEOUT=${SMOKE_RUN_TIMEOUT:-180}  # seconds per `hybridflow train` run at most
BUDGET=${SMOKE_BUDGET_S:-450}          # the whole script: each run gets what is left of it (under 8 minutes)
START=$(date +%s)
STAGES=$SMOKE_DIR/stages
RESULT=${SMOKE_RESULT:-$SMOKE_DIR/result.json}
rm -rf "$STAGES"
mkdir -p "$STAGES" "$(dirname "$RESULT")"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
if [ "$DEVICE" = cpu ]; then export CUDA_VISIBLE_DEVICES=""; fi
report() { "$PY" "$ROOT/scripts/smoke_report.py" "$@"; }  # standard library only
finish() {
  report collect "$STAGES" "$RESULT"
  local rc=$?
  echo "gpu_smoke: done in $(( $(date +%s) - START )) s; result file: $RESULT"
  exit $rc
}

echo "== install"
if [ -n "$WHEELS" ]; then
  WHEELS=$(cd "$WHEELS" && pwd)
  SITE=$SMOKE_DIR/site
  rm -rf "$SITE"
  TORCH_BEFORE=$("$PY" -c "import torch; print(torch.__version__, torch.__file__)") || {
    report stage install "$STAGES/1_install.json" 0 error="$PY cannot import torch"; finish; }
  # scripts/kit_install.py: resolves against the interpreter's own packages, then installs exactly
  # those wheels under $SITE without uninstalling anything (pip --prefix alone would)
  if ! PYTHONPATH=$("$PY" scripts/kit_install.py "$WHEELS" "$SITE" --out "$SMOKE_DIR/install.json" \
                    --log "$SMOKE_DIR/pip.log"); then
    tail -15 "$SMOKE_DIR/pip.log"
    report stage install "$STAGES/1_install.json" 0 error="offline install failed (see $SMOKE_DIR/pip.log)"
    finish
  fi
  export PYTHONPATH
  TORCH_AFTER=$("$PY" -c "import torch; print(torch.__version__, torch.__file__)")
  ok=1; [ "$TORCH_BEFORE" = "$TORCH_AFTER" ] || ok=0
  cd "$SMOKE_DIR"  # from here on, not the repository root: `python -m/-c` would import its hybridflow/ first
  "$PY" -c "import hybridflow, ray, sys; sys.exit(0 if hybridflow.__file__.startswith('$SITE') else 1)" || ok=0
  report stage install "$STAGES/1_install.json" $ok torch="$TORCH_AFTER" torch_before="$TORCH_BEFORE" \
    kit_bytes="$(du -sb "$WHEELS" | cut -f1)" --merge "$SMOKE_DIR/install.json"
  echo "installed into $SITE: $("$PY" -c "import json; print(' '.join(json.load(open('$SMOKE_DIR/install.json'))['installed']))")"
else
  export PYTHONPATH=$ROOT
  cd "$SMOKE_DIR"
  report stage install "$STAGES/1_install.json" 1 skipped="SMOKE_WHEELS not set: $PY's own packages"
fi

"$PY" - "$STAGES/0_env.json" "$DEVICE" <<'PY' || { report stage env "$STAGES/0_env.json" 0 error="imports failed"; finish; }
import json, os, platform, sys
import torch, transformers, ray, hybridflow
cuda = torch.cuda.is_available()
env = {"name": "env", "python": sys.version.split()[0], "platform": platform.platform(),
       "torch": torch.__version__, "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
       "ray": ray.__version__, "ray_path": ray.__file__, "hybridflow": hybridflow.__file__, "cpu_count": os.cpu_count(),
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}
env["pass"] = sys.argv[2] == "cpu" or cuda
print(" | ".join(f"{k} {v}" for k, v in env.items() if k not in ("name", "pass")))
json.dump(env, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if env["pass"] else 1)
PY
[ $? -eq 0 ] || { echo "gpu_smoke: SMOKE_DEVICE=$DEVICE but torch sees no CUDA device"; finish; }

echo "== preflight (Ray-free, one process)"
"$PY" "$ROOT/scripts/gpu_preflight.py" --device "$DEVICE" --out "$STAGES/2_preflight.json" 2>&1 | tail -20
[ -f "$STAGES/2_preflight.json" ] || report stage preflight "$STAGES/2_preflight.json" 0 error="crashed"

echo "== tiny random Qwen2"
MODEL=$SMOKE_DIR/qwen2
"$PY" -c "from hybridflow.models.tiny import save_tiny_model; save_tiny_model('$MODEL', size='small', arch='qwen2', seed=0)"

run_grpo() {  # $1 stage file stem, $2 rollout engine, $3 devices
  local name=$1 engine=$2 ndev=$3 out=$SMOKE_DIR/run_$1 smi="" rc=0 t0 limit
  limit=$(( BUDGET - ($(date +%s) - START) ))
  [ "$limit" -lt "$RUN_TIMEOUT" ] || limit=$RUN_TIMEOUT
  if [ "$limit" -lt 30 ]; then
    report stage "${name#*_}" "$STAGES/$name.json" 1 skipped="no time left of SMOKE_BUDGET_S=$BUDGET"
    return
  fi
  rm -rf "$out" && mkdir -p "$out"
  if [ "$DEVICE" = cuda ] && command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/gpu_mem.csv" 2>/dev/null &
    smi=$!
  fi
  t0=$(date +%s)
  timeout "$limit" "$PY" -m hybridflow.cli train "$ROOT/examples/configs/grpo_tiny.yaml" \
    model.path="$MODEL" model.dtype=bfloat16 rollout.engine="$engine" \
    resources.device="$DEVICE" resources.n_gpus_per_node="$ndev" \
    data.train_batch_size=$((16 * ndev)) actor.ppo_mini_batch_size=$((16 * ndev)) \
    actor.micro_batch_size_per_device=64 rollout.n=4 rollout.response_length=16 \
    trainer.total_steps="$STEPS" trainer.val_every=0 trainer.save_every="$STEPS" \
    trainer.output_dir="$out" trainer.loggers=[console,jsonl] > "$out/train.log" 2>&1 || rc=$?
  if [ -n "$smi" ]; then kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null; fi
  report grpo "${name#*_}" "$out" "$STAGES/$name.json" --rc $rc --steps "$STEPS" \
    --seconds $(( $(date +%s) - t0 )) --engine "$engine" --devices "$ndev" --memlog "$out/gpu_mem.csv"
}

NGPU=1
if [ "$DEVICE" = cuda ]; then NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())"); fi
echo "== GRPO, built-in engine, bf16, 1 rank"
run_grpo 3_grpo_1dev builtin 1
if [ "$NGPU" -gt 1 ]; then
  echo "== GRPO, built-in engine, bf16, $NGPU ranks"
  run_grpo 4_grpo_alldev builtin "$NGPU"
fi
if "$PY" -c "import vllm" 2> /dev/null; then
  echo "== GRPO, vLLM"
  run_grpo 5_grpo_vllm vllm 1
else
  report stage grpo_vllm "$STAGES/5_grpo_vllm.json" 1 skipped="vllm not importable by $PY"
fi
finish
