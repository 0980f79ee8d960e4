#!/usr/bin/env bash
# MARS inside vLLM on an NVIDIA GPU: the plugin's correctness tests and the vLLM benchmark, with
# CUDA graphs on (vLLM's default off the CPU), in about 10 minutes.
#
#   bash scripts/vllm-gpu-check.sh
#
# Environment:
#   OUT            where results go (default runs/gpu-check): gpu-check.log, tests.xml, bench.json, bench.md
#   MODEL          checkpoint to benchmark (default: the tests' toy-trained tiny checkpoint, built here);
#                  e.g. runs/demo/mars, or the SmolLM2 MARS checkpoint
#   VLLM_PACKAGE   the CUDA vLLM to install (default vllm==0.32.0, the release the plugin was built on)
#   WHEELHOUSE     a folder of wheels to install from instead of the package index (machines offline)
#   BENCH_ARGS     extra `marslm loadtest` options (default: --concurrency 1,8,32 --requests 32 --repeats 2)
#
# Two environments, as on the CPU: .venv-gpu (marslm; the machine's torch when it has one) builds
# the checkpoint and computes the oracles; .venv-vllm-cuda holds vLLM and marslm without its
# dependencies (the plugin needs only what vLLM brings).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
VLLM_PACKAGE=${VLLM_PACKAGE:-vllm==0.32.0}
BENCH_ARGS=${BENCH_ARGS:---concurrency 1,8,32 --requests 32 --repeats 2 --max-tokens 128}
PIP=(-q)
[ -n "${WHEELHOUSE:-}" ] && PIP+=(--no-index --find-links "$WHEELHOUSE")
started=$(date +%s)
stamp() { echo "== $(( $(date +%s) - started )) s: $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 --version

stamp "marslm's environment"
[ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
.venv-gpu/bin/pip install "${PIP[@]}" -e ".[dev]"

stamp "vLLM's environment ($VLLM_PACKAGE)"
[ -x .venv-vllm-cuda/bin/python ] || python3 -m venv .venv-vllm-cuda
.venv-vllm-cuda/bin/pip install "${PIP[@]}" "$VLLM_PACKAGE"
.venv-vllm-cuda/bin/pip install "${PIP[@]}" --no-deps -e .
.venv-vllm-cuda/bin/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'cuda', torch.cuda.is_available())"

export MARSLM_VLLM_VENV=$PWD/.venv-vllm-cuda
# Engines start one after another and servers run side by side: none may take the whole GPU.
export MARSLM_VLLM_EXTRA_ARGS="--gpu-memory-utilization 0.25"

stamp "correctness tests (tests/vllm)"
tests_rc=0
MARSLM_REQUIRE_VLLM=1 .venv-gpu/bin/python -m pytest tests/vllm -q --junitxml "$OUT/tests.xml" || tests_rc=$?

stamp "benchmark"
if [ -z "${MODEL:-}" ]; then
    MODEL=runs/gpu-check-model/mars
    [ -d "$MODEL" ] || .venv-gpu/bin/python -c "
from pathlib import Path
from tests.trained import build_trained_checkpoints
build_trained_checkpoints(Path('runs/gpu-check-model'))"
fi
# shellcheck disable=SC2086
.venv-gpu/bin/marslm loadtest --engine vllm --checkpoint "$MODEL" $BENCH_ARGS --json "$OUT/bench.json" \
    -- $MARSLM_VLLM_EXTRA_ARGS | tee "$OUT/bench.md"

stamp "done (tests exit status $tests_rc)"
exit "$tests_rc"
