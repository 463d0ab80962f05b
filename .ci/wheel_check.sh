#!/usr/bin/env bash
# The package as a user gets it: the wheel built from this checkout, installed into a fresh venv, run from a
# directory outside the checkout (so nothing can come from the repo: presets, data, code). `make test-wheel`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
uv=$repo/.venv/bin/uv
install=${UV_INSTALL:-$uv pip install --quiet}
work=$(mktemp -d "${TMPDIR:-/tmp}/exgrpo-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$uv" build --quiet --wheel --out-dir "$work/dist" "$repo"
wheel=$(ls "$work"/dist/exgrpo-*.whl)
"$uv" venv --quiet --python python3 "$work/venv"
$install --python "$work/venv/bin/python" -c "$repo/constraints.txt" torch==2.13.0 "$wheel[demo]"

mkdir "$work/elsewhere" && cd "$work/elsewhere"
exgrpo=$work/venv/bin/exgrpo
set -x
"$work/venv/bin/python" -c 'import exgrpo, sys; sys.exit(0 if "/venv/" in exgrpo.__file__ else exgrpo.__file__)'
"$exgrpo" --version
"$exgrpo" train --config tiny train.steps=2 logging.progress=false
test "$(wc -l < runs/tiny/metrics.jsonl)" -eq 2
"$exgrpo" buffer runs/tiny
