#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench_tier on another machine (e.g. the GPU machine, which has more cores
# than the 2-core CI VM; its disk is virtio too, not NVMe: the script prints
# which block device backs the directory), from binaries built here:
#   bench/micro/device_tier_run.sh BIN_DIR OUT_DIR [bench_tier args...]
# BIN_DIR holds bench_tier, fio (Debian's fio 3.33 source package, built
# without optional engines so it needs only libc + zlib) and lib/ with the
# Debian .so files bench_tier links.  Picks the first directory among
# $KVB_DIRS (default: /var/tmp /tmp $HOME .) whose file system takes
# O_DIRECT and is not tmpfs, says which block device backs it, and runs.
set -u
bin=$1 out=$2
shift 2
mkdir -p "$out"
export PATH=$bin:$PATH LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
  date -u; nproc; grep -m1 'model name' /proc/cpuinfo
  lsblk -d -o NAME,ROTA,SIZE,MODEL,TRAN 2>/dev/null
  fio --version
} 2>&1 | tee "$out/tier_env.log"
dir=
for d in ${KVB_DIRS:-/var/tmp /tmp $HOME .}; do
  [ -d "$d" ] && [ -w "$d" ] || continue
  fs=$(stat -f -c %T "$d")
  [ "$fs" = tmpfs ] && continue
  t="$d/kvb-probe.$$"
  if dd if=/dev/zero of="$t" bs=4096 count=1 oflag=direct status=none 2>/dev/null; then
    rm -f "$t"; dir=$d/kvb; break
  fi
  rm -f "$t"
done
[ -n "$dir" ] || { echo "no directory takes O_DIRECT here" | tee -a "$out/tier_env.log"; exit 77; }
mkdir -p "$dir"
{ echo "dir: $dir ($(stat -f -c %T "$dir"))"; df -h "$dir"; findmnt -T "$dir" 2>/dev/null; } 2>&1 | tee -a "$out/tier_env.log"
"$bin/bench_tier" --dir "$dir" "$@" 2>&1 | tee "$out/bench_tier.log"
rc=${PIPESTATUS[0]}
echo "bench_tier rc=$rc" | tee -a "$out/bench_tier.log"
rm -rf "$dir"
exit "$rc"
