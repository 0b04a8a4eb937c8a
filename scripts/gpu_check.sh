#!/usr/bin/env bash
# The GPU check (docs/bench/gpu.md): one command for a GPU machine with no package index, under 8 minutes
# on one H100 including the install. Every stage must prove it computed on the GPU.
#   CHECK_WHEELS=gpu-kit scripts/gpu_check.sh       # from the repository root; gpu-kit from `make gpu-kit`
#   scripts/gpu_check.sh --rehearse                 # the CPU rehearsal (= CHECK_DEVICE=cpu)
# Uses the machine's own Python (CHECK_PY, default python3) with its preinstalled torch and transformers.
# Stages, each a JSON under CHECK_DIR/stages, then ONE result file (CHECK_RESULT) and its markdown table
# (CHECK_TABLE, default beside it; the table of docs/bench/gpu.md):
#   env, install   the kit's wheels with pip --no-index into a fresh --prefix (scripts/kit_install.py;
#                  torch's version and path checked unchanged); without CHECK_WHEELS the interpreter
#                  must have everything already (PYTHONPATH=the repository)
#   preflight      scripts/gpu_preflight.py, Ray-free: generate, log-prob gaps, a bf16 step, and where
#                  it all computed (parameters' device, torch.cuda.max_memory_allocated() > 0)
#   model          a random model of Qwen2.5-0.5B's shape (CHECK_SIZE), saved once for every stage below
#   decode         built-in engine vs `transformers` generate, bf16, same model (scripts/gpu_stages.py)
#   grpo           `hybridflow train` GRPO, bf16, 1 device, a checkpoint at the end; then plan_memory:
#                  its peak device memory against the planner's prediction (scripts/gpu_stages.py)
#   ppo            PPO with a critic (+ its plan_memory), lora (model.lora.rank), offload (actor.offload)
#   tp2, pp2, ahead  with 2+ GPUs: actor tp=2, actor pp=2, trainer.rollout_ahead=1 (the weight sync)
#   vllm           GRPO with rollout.engine=vllm, when `import vllm` works (skipped otherwise)
# A run passes only with proof of the GPU (scripts/smoke_report.py run_device_problems: every role's
# max_memory_allocated above 0, resources.device cuda) and its stage's own evidence (a critic's memory
# figures, offload bytes, sync bytes, tp in placement.json). The rehearsal runs every stage on CPU
# (tiny model, 2 CPU "devices" for the multi-GPU stages) and passes only where those GPU proofs refuse
# it: what makes sure a CPU computation cannot pass as a GPU one.
# Knobs: CHECK_ONLY="preflight grpo ..." (stage names; env, install, model always run), CHECK_STEPS,
# CHECK_SIZE, CHECK_NGPU (rehearsal: 2), CHECK_BUDGET_S (cuda: 450), CHECK_RUN_TIMEOUT (cuda: 180 s a run).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=${CHECK_DEVICE:-cuda}
if [ "${1:-}" = --rehearse ]; then DEVICE=cpu; elif [ -n "${1:-}" ]; then
  echo "usage: scripts/gpu_check.sh [--rehearse]" >&2; exit 2; fi
case $DEVICE in cuda) REHEARSE="" ;; cpu) REHEARSE=--rehearse ;; *)
  echo "gpu_check: CHECK_DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
PY=${CHECK_PY:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the stages run elsewhere
WHEELS=${CHECK_WHEELS:-}
ONLY=${CHECK_ONLY:-}
CHECK_DIR=${CHECK_DIR:-${TMPDIR:-/tmp}/hybridflow-gpu-check}
RESULT=${CHECK_RESULT:-$CHECK_DIR/result.json}
TABLE=${CHECK_TABLE:-${RESULT%.json}.md}
if [ "$DEVICE" = cuda ]; then
  # sized for one H100 in 8 minutes with the install: 0.5B shape, 16 prompts x 4 samples x 64 tokens
  SIZE=${CHECK_SIZE:-qwen2.5-0.5b} STEPS=${CHECK_STEPS:-2} PROMPTS=16 LENGTH=64
  BUDGET=${CHECK_BUDGET_S:-450} RUN_TIMEOUT=${CHECK_RUN_TIMEOUT:-180}
  DECODE_ARGS="--prompts 64 --response-length 128 --repeats 3" PREFLIGHT_ARGS=""
else  # a loaded 2-core machine can take minutes to start Ray
  SIZE=${CHECK_SIZE:-tiny} STEPS=${CHECK_STEPS:-2} PROMPTS=4 LENGTH=8
  BUDGET=${CHECK_BUDGET_S:-3600} RUN_TIMEOUT=${CHECK_RUN_TIMEOUT:-600}
  DECODE_ARGS="--prompts 8 --response-length 16 --repeats 2"
  PREFLIGHT_ARGS="--size tiny --prompts 8 --response-length 16"
  export CUDA_VISIBLE_DEVICES=""
fi
START=$(date +%s)
STAGES=$CHECK_DIR/stages
rm -rf "$STAGES"
mkdir -p "$STAGES" "$(dirname "$RESULT")"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
report() { "$PY" "$ROOT/scripts/smoke_report.py" "$@"; }  # standard library only
finish() {
  report collect "$STAGES" "$RESULT" --table "$TABLE"
  local rc=$?
  echo "gpu_check: done in $(( $(date +%s) - START )) s; result file: $RESULT; table: $TABLE"
  exit $rc
}
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

echo "== install"
if [ -n "$WHEELS" ]; then
  WHEELS=$(cd "$WHEELS" && pwd)
  SITE=$CHECK_DIR/site
  rm -rf "$SITE"
  TORCH_BEFORE=$("$PY" -c "import torch; print(torch.__version__, torch.__file__)") || {
    report stage install "$STAGES/01_install.json" 0 error="$PY cannot import torch"; finish; }
  # scripts/kit_install.py: resolves against the interpreter's own packages, then installs exactly
  # those wheels under $SITE without uninstalling anything (pip --prefix alone would)
  if ! PYTHONPATH=$("$PY" scripts/kit_install.py "$WHEELS" "$SITE" --out "$CHECK_DIR/install.json" \
                    --log "$CHECK_DIR/pip.log"); then
    tail -15 "$CHECK_DIR/pip.log"
    report stage install "$STAGES/01_install.json" 0 error="offline install failed (see $CHECK_DIR/pip.log)"
    finish
  fi
  export PYTHONPATH
  TORCH_AFTER=$("$PY" -c "import torch; print(torch.__version__, torch.__file__)")
  ok=1; [ "$TORCH_BEFORE" = "$TORCH_AFTER" ] || ok=0
  cd "$CHECK_DIR"  # from here on, not the repository root: `python -m/-c` would import its hybridflow/ first
  "$PY" -c "import hybridflow, ray, sys; sys.exit(0 if hybridflow.__file__.startswith('$SITE') else 1)" \
    || ok=0
  report stage install "$STAGES/01_install.json" $ok torch="$TORCH_AFTER" torch_before="$TORCH_BEFORE" \
    kit_bytes="$(du -sb "$WHEELS" | cut -f1)" --merge "$CHECK_DIR/install.json"
  INSTALLED="import json; print(' '.join(json.load(open('$CHECK_DIR/install.json'))['installed']))"
  echo "installed into $SITE: $("$PY" -c "$INSTALLED")"
else
  export PYTHONPATH=$ROOT
  cd "$CHECK_DIR"
  report stage install "$STAGES/01_install.json" 1 skipped="CHECK_WHEELS not set: $PY's own packages"
fi

"$PY" - "$STAGES/00_env.json" "$DEVICE" <<'PY' \
  || { report stage env "$STAGES/00_env.json" 0 error="imports failed"; finish; }
import importlib.metadata, json, os, platform, sys
import torch, transformers, ray, hybridflow
cuda = torch.cuda.is_available()
env = {"name": "env", "python": sys.version.split()[0], "platform": platform.platform(),
       "torch": torch.__version__, "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
       "ray": ray.__version__, "ray_path": ray.__file__, "hybridflow": hybridflow.__file__,
       "cpu_count": os.cpu_count(),
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}
kit = {"cloudpickle": "cloudpickle", "omegaconf": "omegaconf", "math-verify": "math_verify"}
for dist, mod in kit.items():  # the kit's extras: Python-API rewards and tools, verl configs, MATH answers
    try:
        __import__(mod)
        env[dist] = importlib.metadata.version(dist)
    except Exception as e:  # a missing one fails the stage; the error says which
        env[dist] = f"missing ({type(e).__name__}: {e})"
env["pass"] = (sys.argv[2] == "cpu" or cuda) and not any(str(env[d]).startswith("missing") for d in kit)
print(" | ".join(f"{k} {v}" for k, v in env.items() if k not in ("name", "pass")))
json.dump(env, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if env["pass"] else 1)
PY
[ $? -eq 0 ] || { echo "gpu_check: CHECK_DEVICE=$DEVICE but no CUDA device, or a kit module is missing"
                  finish; }
NGPU=${CHECK_NGPU:-2}  # the rehearsal's CPU stands in for 2 devices
if [ "$DEVICE" = cuda ]; then NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())"); fi

if wanted preflight; then
  echo "== preflight (Ray-free, one process)"
  "$PY" "$ROOT/scripts/gpu_preflight.py" --device "$DEVICE" $REHEARSE $PREFLIGHT_ARGS \
    --out "$STAGES/02_preflight.json" 2>&1 | tail -20
  [ -f "$STAGES/02_preflight.json" ] || report stage preflight "$STAGES/02_preflight.json" 0 error="crashed"
fi

echo "== random model of $SIZE's shape"
MODEL=$CHECK_DIR/model_$SIZE
SAVE="from hybridflow.models.tiny import save_tiny_model; save_tiny_model('$MODEL', '$SIZE', 'qwen2', seed=0)"
if ! "$PY" -c "$SAVE" > "$CHECK_DIR/model.log" 2>&1; then
  report stage model "$STAGES/03_model.json" 0 error="$(tail -1 "$CHECK_DIR/model.log")"
  finish
fi

if wanted decode; then
  echo "== decode: built-in engine vs transformers generate (bf16)"
  "$PY" "$ROOT/scripts/gpu_stages.py" decode "$MODEL" --device "$DEVICE" $REHEARSE $DECODE_ARGS \
    --out "$STAGES/04_decode.json" 2> "$CHECK_DIR/decode.log" || tail -5 "$CHECK_DIR/decode.log"
  [ -f "$STAGES/04_decode.json" ] || report stage decode "$STAGES/04_decode.json" 0 error="crashed"
fi

# run_train FILE_STEM CONFIG DEVICES [--steps N] [smoke_report run options] -- [overrides...]
run_train() {
  local stem=$1 config=$2 ndev=$3 name=${1#*_} out=$CHECK_DIR/run_${1#*_} smi="" rc=0 t0 limit checks=()
  local steps=$STEPS
  shift 3
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    if [ "$1" = --steps ]; then steps=$2; shift 2; else checks+=("$1"); shift; fi
  done
  [ $# -gt 0 ] && shift
  wanted "$name" || return 0
  limit=$(left); [ "$limit" -lt "$RUN_TIMEOUT" ] || limit=$RUN_TIMEOUT
  if [ "$limit" -lt 30 ]; then
    report stage "$name" "$STAGES/$stem.json" 1 skipped="no time left of CHECK_BUDGET_S=$BUDGET"
    return
  fi
  echo "== $name: $config on $ndev device(s) $*"
  rm -rf "$out" && mkdir -p "$out"
  if [ "$DEVICE" = cuda ] && command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$out/gpu_mem.csv" \
      2> /dev/null &
    smi=$!
  fi
  t0=$(date +%s)
  # SIGTERM at the limit lets the run stop at a step's end; what still runs 15 s later is killed
  timeout -k 15 "$limit" "$PY" -m hybridflow.cli train "$ROOT/examples/configs/$config" \
    model.path="$MODEL" model.dtype=bfloat16 resources.device="$DEVICE" resources.n_gpus_per_node="$ndev" \
    data.train_batch_size=$((PROMPTS * ndev)) actor.ppo_mini_batch_size=$((PROMPTS * ndev)) \
    actor.micro_batch_size_per_device=64 critic.micro_batch_size_per_device=64 \
    rollout.n=4 rollout.response_length="$LENGTH" data.dataset_kwargs.val_size=8 \
    trainer.total_steps="$steps" trainer.val_every=0 trainer.val_before_train=false trainer.save_every=0 \
    trainer.output_dir="$out" trainer.loggers=[console,jsonl] "$@" > "$out/train.log" 2>&1 \
    || rc=$?
  if [ -n "$smi" ]; then kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null; fi
  report run "$name" "$out" "$STAGES/$stem.json" --rc $rc --steps "$steps" --seconds $(( $(date +%s) - t0 )) \
    --devices "$ndev" --memlog "$out/gpu_mem.csv" --overrides "$*" $REHEARSE "${checks[@]}"
}
plan_memory() {  # $1 file stem, $2 the run's stage name: its peak memory against the planner's
  local name=${1#*_}
  wanted "$2" || return 0
  [ -d "$CHECK_DIR/run_$2" ] || return 0
  "$PY" "$ROOT/scripts/gpu_stages.py" plan-memory "$CHECK_DIR/run_$2" --device "$DEVICE" $REHEARSE \
    --out "$STAGES/$1.json" 2> "$CHECK_DIR/$name.log" || tail -5 "$CHECK_DIR/$name.log"
  [ -f "$STAGES/$1.json" ] || report stage "$name" "$STAGES/$1.json" 0 error="crashed"
}

run_train 05_grpo grpo_tiny.yaml 1 -- trainer.save_every="$STEPS"
plan_memory 06_grpo_plan_memory grpo
run_train 07_ppo ppo_tiny.yaml 1 --require perf/memory/critic/host_peak_rss_gb --
plan_memory 08_ppo_plan_memory ppo
run_train 09_lora grpo_tiny.yaml 1 -- model.lora.rank=16
run_train 10_offload grpo_tiny.yaml 1 --moved perf/actor_offload_bytes -- actor.offload=true
if [ "$NGPU" -ge 2 ]; then
  run_train 11_tp2 grpo_tiny.yaml 2 --placement roles.actor_rollout.train.tp=2 -- actor.parallel.tp=2
  run_train 12_pp2 grpo_tiny.yaml 2 --placement roles.actor_rollout.world_size=2 -- actor.parallel.pp=2
  # one step more: the first sync of updated weights goes out in step 2, for step 3
  run_train 13_ahead grpo_tiny.yaml 2 --steps $((STEPS + 1)) --require sync/bytes \
    --placement roles.rollout.world_size=1 -- trainer.rollout_ahead=1 resources.rollout_devices=1
fi
if wanted vllm; then
  if "$PY" -c "import vllm" 2> /dev/null; then
    run_train 14_vllm grpo_tiny.yaml 1 -- rollout.engine=vllm
  else
    report stage vllm "$STAGES/14_vllm.json" 1 skipped="vllm not importable by $PY"
  fi
fi
finish
