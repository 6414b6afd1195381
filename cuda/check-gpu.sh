#!/bin/sh
# `make check-gpu`: the GPU half of the tests, on a machine with a GPU.
#
#   ZC_BUILD_DIR=build sh cuda/check-gpu.sh
#
# 1. tests/gpu/cuda_test: bit identity against the CPU codec for the codec
#    tests' configs, incremental loads equal to full ones, the transfer
#    paths (bounce buffer, registered host memory, device payloads).
# 2. The same suite under compute-sanitizer's memcheck (skipped, saying
#    so, where the tool is missing).
# 3. The Python torch tests (tests/python/test_torch*.py): the GPU ones
#    (CUDA library from torch; session fetches, zc_cuda_fetch_layer, against
#    the client's reconstruction for views none and full, incremental =
#    full after decode steps and trims, pins of reused extents made again;
#    the cache on the GPU; transformers' generate() against its own
#    DynamicCache, views full and none) and the CPU ones, which here meet
#    whatever transformers this machine has.
# A machine without a GPU fails here: skipping is what `make check` does.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
: "${ZC_BUILD_DIR:=$root/build}"
export ZC_BUILD_DIR
suite=$ZC_BUILD_DIR/tests/gpu/cuda_test
PYTHON=${PYTHON:-python3}
fail=0
if [ ! -x "$suite" ]; then
	echo "check-gpu: $suite is missing: nvcc was not found when building"
	exit 1
fi
if ! "$suite" --probe --require; then
	exit 1
fi
echo "== $suite"
"$suite" || fail=$((fail + 1))
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$sanitizer" ]; then
	echo "== compute-sanitizer --tool memcheck $suite"
	# The quick subset keeps the run short under the tool's slowdown (the
	# suite runs in one process, so the tool sees every kernel).
	ZC_CUDA_TEST_QUICK=1 "$sanitizer" --tool memcheck --error-exitcode 1 "$suite" ||
		fail=$((fail + 1))
else
	echo "== memcheck: skipped: compute-sanitizer not found"
fi
echo "== python torch tests (GPU, and the CPU ones with this machine's transformers)"
PYTHON=$PYTHON sh "$root/python/run_tests.sh" -k torch -rs || fail=$((fail + 1))
echo "check-gpu: $fail failed"
[ "$fail" -eq 0 ]
