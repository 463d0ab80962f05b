#!/bin/bash
# Runs round six as registered: one run at a time, seed by seed (its arms in order; GRPO-skip on seeds 1-16 only,
# by the budget rule), from a worktree pinned at the registering commit (23c1417), whose code every run records.
# Each run that finishes is archived without its checkpoints and TensorBoard files in experiments/round-six-records
# (to be committed), and that archive is copied back into the worktree's runs directory when this starts, so that a
# new machine loses only the run in progress.
#   nohup setsid experiments/round-six-run.sh >> round-six.log 2>&1 < /dev/null &
# To stop: kill this script (SIGKILL), then SIGTERM the `exgrpo experiment run` process, which checkpoints first.
# A file named like the worktree plus .stop (../round-six.stop) makes it start no further run.
MAIN=$(cd "$(dirname "$0")/.." && pwd)
WORKTREE=${ROUND_SIX_WORKTREE:-$(dirname "$MAIN")/round-six}
RUNS=$WORKTREE/runs/round-six
RECORDS=$MAIN/experiments/round-six-records
[ -d "$WORKTREE" ] || git -C "$MAIN" worktree add --detach "$WORKTREE" 23c1417 || exit 1
cd "$WORKTREE" || exit 1
[ -e .venv-vllm/.installed ] || make --no-print-directory .venv-vllm/.installed || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS" "$RECORDS"
cp -rn "$RECORDS"/. "$RUNS"/
finished() {  # the run's last recorded session ended by itself at step 60
  .venv-vllm/bin/python - "$1" <<'PY'
import json, sys
try:
    last = json.load(open(sys.argv[1] + "/provenance.json"))["sessions"][-1]
except (OSError, ValueError, KeyError, IndexError):
    sys.exit(1)
sys.exit(0 if last["ended"] and last["stopped_by"] is None and last["to_step"] == 60 else 1)
PY
}
archive() {  # $1 = ARM/seed-S
  rm -rf "$RECORDS/.partial" && mkdir -p "$RECORDS/.partial" "$(dirname "$RECORDS/$1")" &&
  tar -C "$RUNS/$1" --exclude=./checkpoints --exclude=./tensorboard --exclude=./.lock -cf - . |
    tar -C "$RECORDS/.partial" -xf - &&
  mv "$RECORDS/.partial" "$RECORDS/$1" &&
  mkdir -p "$RECORDS/initial" && cp -n "$RUNS"/initial/*.json "$RECORDS/initial/"
}
archive_if_finished() {  # $1 = ARM, $2 = seed
  finished "$RUNS/$1/seed-$2" && archive "$1/seed-$2" && echo "=== archived $1 seed $2"
}
for s in $(seq 1 24); do
  if [ "$s" -le 16 ]; then arms="grpo exgrpo grpo-skip"; else arms="grpo exgrpo"; fi
  for a in $arms; do
    [ -e "$RECORDS/$a/seed-$s/provenance.json" ] && continue
    while pgrep -f "exgrpo experiment run experiments/round-six" > /dev/null; do sleep 20; done
    # finished by a run this script did not start (an earlier runner's)
    archive_if_finished "$a" "$s" && continue
    [ -e "$WORKTREE.stop" ] && { echo "=== $(date -u +%FT%TZ) $WORKTREE.stop: no further run"; exit 0; }
    echo "=== $(date -u +%FT%TZ) $a seed $s"
    .venv-vllm/bin/exgrpo experiment run experiments/round-six.yaml --seeds "$s" --arms "$a"
    rc=$?
    archive_if_finished "$a" "$s"
    [ $rc -eq 0 ] || { echo "=== $a seed $s rc=$rc: stopping"; exit 1; }
  done
done
echo "=== $(date -u +%FT%TZ) done"
