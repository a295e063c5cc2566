#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvtier save/load on the GPU machine, before and after a change, in one call:
#   bench/micro/device_save_run.sh RUN_DIR
# RUN_DIR (carried; e.g. build-dev/run, ignored by git) holds before/ and after/
# (bench_tier_link, libkvplane.so; after/ also bench_tier; before/ the
# reuse_e2e.py of its commit), and lib/ with the Debian .so files they link
# (those the machine has are dropped).  bench_tier_link --backend cuda
# alternates before/after twice; then tests/e2e/reuse_e2e.py (after, before)
# and bench_tier --contention.  Logs under $OUT.
set -u
R=$(cd "${1:?usage: device_save_run.sh RUN_DIR (before/ after/ lib/)}" && pwd); O=${OUT:-/tmp/out}; mkdir -p "$O"
cd "$(dirname "$0")/../.."
for l in "$R"/lib/*; do n=$(basename "$l"); ldconfig -p | grep -q "$n" && rm -f "$l"; done
export LD_LIBRARY_PATH=$R/lib KVP_LOG=warn
{ date -u; nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  nproc; grep -m1 'model name' /proc/cpuinfo; echo "carried libs: $(ls "$R/lib")"; git log -1 --oneline 2>/dev/null; } > "$O/env.txt" 2>&1
cat "$O/env.txt"
for i in 1 2; do for v in before after; do
  echo "## $v, set $i"; timeout 100 "$R/$v/bench_tier_link" --backend cuda --mb 256 --reps 5 --cpu 2; echo "rc=$?"
done; done > "$O/link.txt" 2>&1
grep -v '^#' "$O/link.txt" | cut -c1-150
D=
for d in /var/tmp /tmp .; do
  [ "$(stat -f -c %T $d)" = tmpfs ] && continue
  dd if=/dev/zero of=$d/kvb-probe bs=4096 count=1 oflag=direct status=none 2>/dev/null && { rm -f $d/kvb-probe; D=$d/kvsave; break; }
done
mkdir -p "$D/e2e" "$D/kvb"; echo "dir $D"
JE=$R/lib/libjemalloc.so.2; [ -f "$JE" ] || JE=$(ldconfig -p | awk '/libjemalloc.so.2/{print $NF; exit}')
LD_PRELOAD=$JE timeout 150 python3 tests/e2e/reuse_e2e.py "$R/after/libkvplane.so" --nvme-dir "$D/e2e" > "$O/reuse_after.txt" 2>&1; echo "reuse after rc=$?"
tail -8 "$O/reuse_after.txt"
timeout 60 "$R/after/bench_tier" --contention --seconds 1 --reps 2 --cpu 2 --dir "$D/kvb" > "$O/contention.txt" 2>&1; echo "contention rc=$?"
grep '^|' "$O/contention.txt"
LD_PRELOAD=$JE timeout 130 python3 "$R/before/reuse_e2e.py" "$R/before/libkvplane.so" --nvme-dir "$D/e2e" > "$O/reuse_before.txt" 2>&1; echo "reuse before rc=$?"
tail -8 "$O/reuse_before.txt"
rm -rf "$D"
