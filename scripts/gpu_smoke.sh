#!/usr/bin/env bash
# GPU smoke test (docs/checkpoints.md): one command on a machine with an NVIDIA GPU, under 8 minutes.
#   scripts/gpu_smoke.sh            # from the repository root
# 1. a fresh venv in $SMOKE_DIR (reuses the machine's torch/CUDA when it has one: --system-site-packages;
#    otherwise installs the pinned dependencies, which needs a package index),
# 2. a tiny random Qwen2 built locally (no hub),
# 3. GRPO for a few steps: NCCL, model.dtype=bfloat16, the built-in engine; then vLLM if it imports,
# 4. prints tokens/s, peak GPU memory and actor/ppo_kl at step 1 (0 = on-policy ratio exactly 1).
# SMOKE_DEVICE=cpu runs the same steps on CPU (checks the script itself; no GPU figures); SMOKE_PY=PYTHON
# uses an interpreter that already has the dependencies instead of a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE_DIR=${SMOKE_DIR:-/tmp/hybridflow-gpu-smoke}
DEVICE=${SMOKE_DEVICE:-cuda}
STEPS=${SMOKE_STEPS:-3}
START=$(date +%s)
mkdir -p "$SMOKE_DIR"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONPATH=$ROOT

if [ -n "${SMOKE_PY:-}" ]; then  # an existing interpreter with the dependencies (the script's own check)
  PY=$SMOKE_PY
else
  echo "== venv ($SMOKE_DIR/venv)"
  if [ ! -x "$SMOKE_DIR/venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$SMOKE_DIR/venv"
  fi
  PY=$SMOKE_DIR/venv/bin/python
  if ! "$PY" -c "import torch, transformers, ray, safetensors" 2>/dev/null; then
    "$PY" -m pip install -q -c constraints.txt -e . || { echo "gpu_smoke: cannot install dependencies"; exit 1; }
  fi
fi
"$PY" - <<PY
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
assert "$DEVICE" == "cpu" or torch.cuda.is_available(), "no CUDA device visible"
PY
NGPU=1
if [ "$DEVICE" = cuda ]; then NGPU=$("$PY" -c "import torch; print(min(torch.cuda.device_count(), 2))"); fi

echo "== tiny random Qwen2"
"$PY" -c "from hybridflow.models.tiny import save_tiny_model; save_tiny_model('$SMOKE_DIR/qwen2', size='small', arch='qwen2', seed=0)"

MEMLOG=$SMOKE_DIR/gpu_mem.csv
FAILED=0
run_grpo() {  # $1 = rollout engine
  local out=$SMOKE_DIR/run_$1
  rm -rf "$out"
  if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$MEMLOG.$1" &
    local smi=$!
  fi
  timeout 300 "$PY" -m hybridflow.cli train examples/configs/grpo_tiny.yaml \
    model.path="$SMOKE_DIR/qwen2" model.dtype=bfloat16 rollout.engine="$1" \
    resources.device="$DEVICE" resources.n_gpus_per_node="$NGPU" \
    data.train_batch_size=16 actor.ppo_mini_batch_size=16 actor.micro_batch_size_per_device=64 \
    rollout.n=4 rollout.response_length=8 trainer.total_steps="$STEPS" trainer.val_every=0 \
    trainer.save_every="$STEPS" trainer.output_dir="$out" trainer.loggers=[console,jsonl] \
    > "$out.log" 2>&1 || { echo "gpu_smoke: $1 run failed; last lines:"; tail -20 "$out.log"; FAILED=1; }
  if [ -n "${smi:-}" ]; then kill "$smi" 2>/dev/null || true; fi
  "$PY" - "$out" "$MEMLOG.$1" "$1" <<'PY'
import json, pathlib, sys
out, memlog, engine = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for f in out.glob("*/metrics.jsonl") for l in f.read_text().splitlines()]
train = [r for r in rows if "actor/ppo_kl" in r]
if not train:
    print(f"{engine}: no training steps recorded"); sys.exit(0)
mem = [int(x) for x in memlog.read_text().split()] if memlog.is_file() else []
tps = [r.get("perf/throughput", float("nan")) for r in train]
print(f"{engine}: steps {len(train)} | tokens/s (after step 1) {sum(tps[1:]) / max(len(tps) - 1, 1):.0f} "
      f"| peak GPU memory {max(mem) if mem else float('nan'):.0f} MiB (nvidia-smi, whole device) "
      f"| step 1 actor/ppo_kl {train[0]['actor/ppo_kl']:.3g} (0 = ratio exactly 1)")
PY
}

echo "== GRPO, built-in engine, bf16, $NGPU rank(s)"
run_grpo builtin
if "$PY" -c "import vllm" 2>/dev/null; then
  echo "== GRPO, vLLM"
  run_grpo vllm
else
  echo "== vLLM: not importable in this venv, skipped"
fi
echo "gpu_smoke: done in $(( $(date +%s) - START )) s"
exit "$FAILED"
