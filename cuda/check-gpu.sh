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
# 3. The Python GPU tests (tests/python, marker gpu): torch tensors from
#    the CUDA library, and transformers' generate() with the zipcache cache
#    on the GPU against its own DynamicCache.
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
	# One process (CK_FORK=no) so the tool sees every kernel; the quick
	# subset keeps the run short under the tool's slowdown.
	CK_FORK=no ZC_CUDA_TEST_QUICK=1 "$sanitizer" --tool memcheck --leak-check full \
		--error-exitcode 1 "$suite" || fail=$((fail + 1))
else
	echo "== memcheck: skipped: compute-sanitizer not found"
fi
echo "== python GPU tests"
ZIPCACHE_GPU_TESTS=1 PYTHON=$PYTHON sh "$root/python/run_tests.sh" -m gpu -rs || fail=$((fail + 1))
echo "check-gpu: $fail failed"
[ "$fail" -eq 0 ]
