#!/usr/bin/env bash
# The paper's Table 6 (a separate drafter composed with a target, section 4.6) on the toy demo:
# `marslm bench` with the drafter contender groups, once per drafter.
#
#   scripts/table6.sh [DEMO] [OUT] [K] [N] [REPEATS] [MAX_NEW_TOKENS]
#
# DEMO holds the demo's ar/ and mars/ (marslm demo --out DEMO) and the drafters of
# scripts/toy_drafters.py (drafter-ar/, drafter-mars/). Reports: OUT/table6-{drafter-ar,drafter-mars}.{json,log}.
# Rows, per drafter: HF generate on ar/ (the baseline); "draft K -> AR" (plain speculative
# decoding, the AR->AR row); "draft K -> MARS tau=T" (verification, then the masks under tau;
# tau 1: plain verification); HF assisted generation with the same drafter and K (batch 1).
# An AR drafter drafts one token per forward; drafter-mars, a MARS checkpoint, also drafts its
# masks' confident predictions under its own tau (DRAFT_TAU, default 0.9): the MARS->MARS rows.
# A timing: run it alone on a quiet machine.
set -eu
DEMO=${1:-runs/demo}
OUT=${2:-$DEMO}
K=${3:-4}
N=${4:-32}
REPEATS=${5:-3}
MAX_NEW_TOKENS=${6:-128}
DRAFT_TAU=${DRAFT_TAU:-0.9}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$OUT"
for drafter in drafter-ar drafter-mars; do
  tau=()
  [ "$drafter" = drafter-mars ] && tau=(--draft-tau "$DRAFT_TAU")
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" -m marslm.cli bench \
    --model "$DEMO/mars" --ar-model "$DEMO/ar" --draft-model "$DEMO/$drafter" --num-draft-tokens "$K" "${tau[@]}" \
    --contenders hf-mars,cursor,draft,draft-ar,assisted --taus 1,0.95 --batch-sizes 1 \
    --n "$N" --repeats "$REPEATS" --max-new-tokens "$MAX_NEW_TOKENS" --quiet \
    --json "$OUT/table6-$drafter.json" | tee "$OUT/table6-$drafter.log"
done
