#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One call on the GPU machine: the CUDA tests, compute-sanitizer memcheck,
# the SASS check with that machine's cuobjdump, and bench_kernels.
#   bench/micro/device_run.sh BIN_DIR OUT_DIR
# BIN_DIR holds test_kernels, bench_kernels and the cubins built here, and
# lib/ with the Debian .so files they link beyond libc and libstdc++
# (libjemalloc.so.2 and libxxhash.so.0, which the GPU image lacks:
# `ldd BIN_DIR/test_kernels` lists them).
set -u
bin=$1 out=$2
mkdir -p "$out"
export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
src=$(cd "$(dirname "$0")/../.." && pwd)
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  for t in nvcc cmake cuobjdump nvdisasm compute-sanitizer; do echo "$t: $(command -v $t)"; done
} 2>&1 | tee "$out/env.log"
export KVP_LOG=info
echo "== test_kernels (cuda)"
KVP_TEST_BACKEND=cuda "$bin/test_kernels" 2>&1 | tee "$out/test_cuda.log"
echo "test_kernels cuda rc=${PIPESTATUS[0]}" | tee -a "$out/test_cuda.log"
echo "== test_kernels (cpu)"
KVP_TEST_BACKEND=cpu KVP_LOG=error "$bin/test_kernels" > "$out/test_cpu.log" 2>&1
echo "test_kernels cpu rc=$?" | tee -a "$out/test_cpu.log"
echo "== SASS"
KVP_SRC=$src "$src/tests/check_device_code.sh" sass "$bin"/*.cubin 2>&1 | tee "$out/sass.log"
echo "== bench_kernels"
KVP_LOG=warn "$bin/bench_kernels" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$out/bench.log"
if [ "${MEMCHECK:-1}" = 1 ]; then
  echo "== compute-sanitizer memcheck"
  KVP_LOG=error KVP_TEST_BACKEND=cuda KVP_TEST_NO_CALIBRATE=1 KVP_TEST_UNDER_SANITIZER=1 timeout 300 \
    compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/test_kernels" > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?" | tee -a "$out/memcheck.log"
  tail -5 "$out/memcheck.log"
fi
