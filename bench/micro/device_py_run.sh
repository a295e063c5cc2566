#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package's GPU end-to-end tests (tests/e2e/llama_reuse.py, then
# tests/e2e/reuse_e2e.py) on the GPU machine, which has PyTorch + CUDA but neither a package registry nor
# kvplane's build dependencies.  Prepare on a build host with
# bench/micro/device_py_prep.sh, carry its pyrun/ and wheels/ (and, only
# when the device's Python lacks numpy, wheels-np/cp3XX), then:
#   bench/micro/device_py_run.sh [PREP_DIR]        (default build-dev)
# transformers' wheels and the kvplane wheel are installed offline with
# pip --target (the device's torch and numpy stay); the wheel's Debian
# libraries come from PREP_DIR/pyrun/lib (those the machine has are used
# instead).  reuse_e2e.py's kvtier NVMe tier goes into NVME_DIR (default: the
# first of /var/tmp, $HOME, PREP_DIR, /tmp that is not tmpfs and takes
# O_DIRECT); REUSE_ARGS adds its options (e.g. --tokens 4096,16384),
# REUSE_TIMEOUT bounds it (default 400 s).  Logs under $OUT (env.txt,
# pip.txt, llama_reuse.txt, reuse_e2e.txt).
# Exit: 0 both pass; else the first failure's code (1 fail, 124 timeout),
# else 77 when one skipped; 2 set-up failed.
set -u
cd "$(dirname "$0")/../.." || exit 2
P=$(cd "${1:-build-dev}" && pwd) O=${OUT:-/tmp/out} V=${VENV:-/tmp/kvp-pyrun-venv}
mkdir -p "$O"
py=$(command -v python3) || { echo "no python3"; exit 2; }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$py" -c 'import sys, platform; print(sys.version); print(platform.libc_ver())'
  "$py" -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
  "$py" -c 'import numpy; print("numpy", numpy.__version__)'
  echo "carried: $(ls "$P/pyrun" "$P/pyrun/lib" | tr '\n' ' ')"
  git log -1 --oneline 2>/dev/null; } > "$O/env.txt" 2>&1
cat "$O/env.txt"

L=$(mktemp -d)  # the carried libraries the machine lacks
for l in "$P"/pyrun/lib/*; do
  n=$(basename "$l"); ldconfig -p | grep -q "^[[:space:]]$n " || cp "$l" "$L/"
done
echo "libraries from the carry: $(ls "$L" | tr '\n' ' ')"

find_links=(--find-links "$P/wheels")
for d in "$P"/wheels-np/cp3*; do [ -d "$d" ] && find_links+=(--find-links "$d"); done
# Installed with --target beside the system site-packages, not into a venv:
# the machine's torch may live where a venv does not look (a user site, a
# PYTHONPATH); its numpy stays the one torch was built with.
setup() {
  rm -rf "$V"
  "$py" -m pip install --disable-pip-version-check --no-index "${find_links[@]}" \
    --target "$V" transformers==4.46.3 "$P"/pyrun/kvplane-*.whl || return 1
  if "$py" -c 'import numpy' 2>/dev/null; then rm -rf "$V"/numpy "$V"/numpy-* "$V"/numpy.libs; fi
}
setup > "$O/pip.txt" 2>&1 || { tail -20 "$O/pip.txt"; echo "set-up failed (pip.txt)"; exit 2; }
tail -2 "$O/pip.txt"

export LD_LIBRARY_PATH=$L${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} KVP_LOG=warn
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$V${PYTHONPATH:+:$PYTHONPATH}
timeout 300 "$py" tests/e2e/llama_reuse.py > "$O/llama_reuse.txt" 2>&1
rc_llama=$?
cat "$O/llama_reuse.txt"
echo "llama_reuse rc=$rc_llama"

# kvtier's slab files need O_DIRECT, and a real disk rather than tmpfs
odirect_dir() {
  local d c=(/var/tmp "${HOME:-/nonexistent}" "$P" /tmp)
  [ -z "${NVME_DIR:-}" ] || c=("$NVME_DIR")  # only the one asked for
  for d in "${c[@]}"; do
    if [ ! -d "$d" ] || [ ! -w "$d" ]; then continue; fi
    [ -n "${NVME_DIR:-}" ] || [ "$(findmnt -no FSTYPE -T "$d" 2>/dev/null)" != tmpfs ] || continue
    dd if=/dev/zero of="$d/.kvp-odirect-$$" bs=4096 count=1 oflag=direct 2>/dev/null &&
      { rm -f "$d/.kvp-odirect-$$"; echo "$d"; return 0; }
    rm -f "$d/.kvp-odirect-$$"
  done
  return 1
}
if N=$(odirect_dir); then
  echo "reuse_e2e: NVMe directory $N ($(findmnt -no FSTYPE,SOURCE -T "$N" 2>/dev/null))"
  # shellcheck disable=SC2086  # REUSE_ARGS: options, split on purpose
  timeout "${REUSE_TIMEOUT:-400}" "$py" tests/e2e/reuse_e2e.py --nvme-dir "$N" ${REUSE_ARGS:-} \
    > "$O/reuse_e2e.txt" 2>&1
  rc_reuse=$?
else
  echo "FAIL: no directory takes O_DIRECT (set NVME_DIR)" > "$O/reuse_e2e.txt"
  rc_reuse=1
fi
cat "$O/reuse_e2e.txt"
echo "reuse_e2e rc=$rc_reuse"
rm -rf "$L"
rc=0
for r in $rc_llama $rc_reuse; do  # a failure first, then a skip
  if [ "$r" -ne 0 ] && [ "$r" -ne 77 ]; then rc=$r; break; fi
  [ "$r" -eq 77 ] && rc=77
done
echo "device_py_run rc=$rc (llama_reuse $rc_llama, reuse_e2e $rc_reuse)"
exit "$rc"
