#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Step 2 of 2 of every GPU figure (docs/bench.md#gpu), on the GPU machine,
# over what bench/micro/gpu_prep.sh built (carried as DIR, default
# build-gpu/run):
#   bench/micro/gpu_run.sh [DIR]        logs under $OUT (at most 8 files)
# In order: test_kernels on the CUDA and CPU backends (CUDA checked against
# the CPU reference on random inputs with poisoned outputs), the SASS check
# with that machine's cuobjdump, compute-sanitizer memcheck, bench_kernels
# (defaults), bench_tier_link --backend cuda (twice), then the kvplane wheel
# installed with pip --target beside the machine's torch and transformers
# and tests/e2e/llama_reuse.py and tests/e2e/reuse_e2e.py on it, and
# tests/e2e/vllm_layouts_cuda.py (kvplane.vllm's layouts over CUDA, part vllm).
# PARTS selects (default "tests memcheck bench link py vllm"); NCU=1 adds an ncu profile
# of the 2 KiB device-to-device gather and the D2D memcpy (ncu.txt).
# Exit: 0 all ran and passed, else the number of failed steps.
set -u
cd "$(dirname "$0")/../.." || exit 2
R=$(cd "${1:-build-gpu/run}" && pwd) || exit 2
O=${OUT:-/tmp/out}; mkdir -p "$O"
PARTS=${PARTS:-tests memcheck bench link py vllm}
fails=0
step() { # name rc
  echo "== $1 rc=$2 (${SECONDS}s)" | tee -a "$O/summary.txt"
  [ "$2" -eq 0 ] || [ "$2" -eq 77 ] || fails=$((fails + 1))
}
on() { [[ " $PARTS " == *" $1 "* ]]; }

L=$(mktemp -d)  # the carried libraries this machine lacks
for l in "$R"/lib/*; do
  n=$(basename "$l"); ldconfig -p | grep -q "^[[:space:]]$n " || cp "$l" "$L/"
done
export LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVP_LOG=warn
export PATH=$PATH:/usr/local/cuda/bin PYTHONDONTWRITEBYTECODE=1
{ date -u; echo "kvplane: $(tr '\n' ' ' < "$R/commit.txt")"
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm,clocks.max.mem --format=csv
  echo "cpus $(nproc): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' 2>&1
  for t in nvcc cuobjdump nvdisasm compute-sanitizer ncu; do echo "$t: $(command -v $t)"; done
  echo "libraries from the carry: $(ls "$L" | tr '\n' ' ')"; } > "$O/env.txt" 2>&1
cat "$O/env.txt"

if on tests; then
  { KVP_TEST_BACKEND=cuda KVP_LOG=info "$R/bin/test_kernels"; step test_kernels_cuda $?
    KVP_TEST_BACKEND=cpu KVP_LOG=error "$R/bin/test_kernels" > /dev/null; step test_kernels_cpu $?
    KVP_SRC=$PWD tests/check_device_code.sh sass "$R"/bin/*.cubin; step sass $?
  } > "$O/tests.txt" 2>&1
fi
if on memcheck; then
  { KVP_LOG=error KVP_TEST_BACKEND=cuda KVP_TEST_NO_CALIBRATE=1 KVP_TEST_UNDER_SANITIZER=1 \
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$R/bin/test_kernels" | tail -4
    step memcheck "${PIPESTATUS[0]}"; } >> "$O/tests.txt" 2>&1
fi
[ -f "$O/tests.txt" ] && grep -E '^(==|FAIL)' "$O/tests.txt" | tail -20
if on bench; then
  timeout 400 "$R/bin/bench_kernels" ${BENCH_ARGS:-} > "$O/bench_kernels.txt" 2>&1
  step bench_kernels $?
  grep -E '^\|' "$O/bench_kernels.txt" | cut -c1-160 | tail -14
fi
if [ "${NCU:-0}" = 1 ]; then  # every kvp_copy_w16 launch at 2 and 4 KiB pages, a few counters each
  m=launch__grid_size,launch__block_size,gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
  m=$m,lts__t_bytes.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
  m=$m,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
  m=$m,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  timeout 300 ncu --csv --kernel-name kvp_copy_w16 --launch-count 3000 --metrics "$m" \
    "$R/bin/bench_kernels" --sizes 2,4 --reps 3 --warmup 1 > "$O/ncu.txt" 2>&1
  step ncu $?
fi
if on link; then
  for i in 1 2; do timeout 150 "$R/bin/bench_tier_link" --backend cuda --mb 256 --reps 5 --cpu 2; done \
    > "$O/tier_link.txt" 2>&1
  step bench_tier_link $?
  grep -E '^\|' "$O/tier_link.txt" | cut -c1-160
fi
S=
if on py || on vllm; then
  S=$(mktemp -d)
  python3 -m pip install -q --disable-pip-version-check --no-index --find-links "$R/wheel/deps" \
    --target "$S" "$R"/wheel/kvplane-*.whl > "$O/py.txt" 2>&1; step pip_install_wheel $?
fi
if on py; then
  N=
  for d in /var/tmp "${HOME:-/nonexistent}" /tmp; do  # kvtier's slab files: O_DIRECT, not tmpfs
    [ -d "$d" ] && [ -w "$d" ] || continue
    [ "$(findmnt -no FSTYPE -T "$d" 2>/dev/null)" = tmpfs ] && continue
    dd if=/dev/zero of="$d/.kvp-odirect" bs=4096 count=1 oflag=direct 2>/dev/null &&
      { rm -f "$d/.kvp-odirect"; N=$d/kvp-reuse-$$; break; }
  done
  { export PYTHONPATH=$S HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    env -u LD_LIBRARY_PATH timeout 300 python3 tests/e2e/llama_reuse.py; step llama_reuse $?
    if [ -n "$N" ]; then
      echo "NVMe tier directory $N ($(findmnt -no FSTYPE,SOURCE -T "${N%/*}"))"; mkdir -p "$N"
      env -u LD_LIBRARY_PATH timeout 400 python3 tests/e2e/reuse_e2e.py --nvme-dir "$N" ${REUSE_ARGS:-}
      step reuse_e2e $?; rm -rf "$N"
    else echo "no directory takes O_DIRECT"; step reuse_e2e 1; fi; } >> "$O/py.txt" 2>&1
  tail -25 "$O/py.txt"
fi
if on vllm; then
  { PYTHONPATH=$S env -u LD_LIBRARY_PATH timeout 300 python3 tests/e2e/vllm_layouts_cuda.py
    step vllm_layouts_cuda $?; } > "$O/vllm_layouts.txt" 2>&1
  cat "$O/vllm_layouts.txt"
fi
rm -rf "$L"
echo "gpu_run: $fails failed step(s)" | tee -a "$O/summary.txt"
exit "$fails"
