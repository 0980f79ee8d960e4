#!/usr/bin/env bash
# Decoding and serving speed of an earlier commit against the working tree, alternating, on one
# quiet machine: `marslm bench` and `marslm loadtest` (a `marslm serve` started for each) per round;
# first, recorded decoding cases (`marslm generate` at tau 1, 0.9 and lossless on a few prompts)
# must give the same text, step by step, under both.
#
#   scripts/ab_speed.sh BASE_COMMIT [MARS_CHECKPOINT] [AR_CHECKPOINT] [OUT] [ROUNDS]
#
# The base commit is checked out in a worktree beside the repository and run with this
# repository's venv. Reports: OUT/cases-{base,head}.txt, OUT/{bench,load}-{base,head}-ROUND.{json,log}.
set -u
BASE=${1:?base commit}
MODEL=${2:-runs/smollm2-demo/mars}
AR=${3:-runs/smollm2-demo/original}
OUT=${4:-runs/ab}
ROUNDS=${5:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OLD=$ROOT/../marslm-ab-$BASE
PY=$ROOT/.venv/bin/python
cd "$ROOT"
mkdir -p "$OUT"
[ -d "$OLD" ] || git worktree add -q "$OLD" "$BASE"
bench() {  # tree name round
  PYTHONPATH=$1 $PY -m marslm.cli bench --model "$MODEL" --ar-model "$AR" --data toy \
    --contenders cursor,lossless --taus 0.95 --batch-sizes 1,8 --n 8 --repeats 2 --max-new-tokens 32 \
    --json "$OUT/bench-$2-$3.json" > "$OUT/bench-$2-$3.log" 2>&1
}
loadtest() {  # tree name round
  PYTHONPATH=$1 $PY -m marslm.cli serve --model "$MODEL" --port 8765 > "$OUT/serve-$2-$3.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -s localhost:8765/v1/models > /dev/null && break; sleep 2; done
  PYTHONPATH=$1 $PY -m marslm.cli loadtest --url http://127.0.0.1:8765 --concurrency 1,8 --requests 16 \
    --policies fixed-1.0,fixed-0.95 --repeats 1 --max-tokens 32 --json "$OUT/load-$2-$3.json" > "$OUT/load-$2-$3.log" 2>&1
  kill -TERM $pid; wait $pid
}
cases() {  # tree name: each case's text and tokens accepted per step, one line per case
  for opts in "--tau 1" "--tau 0.9" "--mode lossless"; do
    for prompt in "Name three colours." "What is 12 plus 30?" "Write one sentence about the sea."; do
      # shellcheck disable=SC2086
      PYTHONPATH=$1 $PY -m marslm.cli generate --model "$MODEL" --prompt "$prompt" $opts --max-new-tokens 48 --json \
        | $PY -c 'import json, sys; d = json.load(sys.stdin); print(json.dumps([d["text"], d["accepted_per_step"]]))'
    done
  done > "$OUT/cases-$2.txt"
}
cases "$OLD" base; cases "$ROOT" head
if cmp -s "$OUT/cases-base.txt" "$OUT/cases-head.txt"; then
  echo "decoding cases: the same text, step by step ($(wc -l < "$OUT/cases-head.txt") cases)"
else
  echo "decoding cases: DIFFER (diff $OUT/cases-base.txt $OUT/cases-head.txt)"
fi
for round in $(seq "$ROUNDS"); do
  bench "$OLD" base "$round"; bench "$ROOT" head "$round"
  loadtest "$OLD" base "$round"; loadtest "$ROOT" head "$round"
done
git worktree remove --force "$OLD"
