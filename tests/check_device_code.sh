#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the device code the build embedded, without a GPU:
#   sass   CUDA cubins (sm_80, sm_90): cuobjdump/nvdisasm SASS has 16-byte
#          global loads and stores (LDG.E.128 / STG.E.128) in kvp_copy_w16, no
#          local-memory traffic (LDL/STL) anywhere, STACK:0 LOCAL:0 per kernel.
#   ptxas  nvcc's own resource report for both arches: 0 bytes stack frame,
#          0 spill stores / loads for every kernel.
#   hip    AMDGPU code objects: no VGPR/SGPR spills, no scratch
#          (private_segment_fixed_size 0); global_load/store_dwordx4 present
#          where llvm-objdump knows the target.
# Exit 0 pass, 1 fail, 77 skip (tool or device code absent, saying which).
set -u
mode=$1
shift
fail() { echo "FAIL: $*"; exit 1; }
skip() { echo "SKIP: $*"; exit 77; }

find_tool() { # name -> path on PATH, in CUDA, or in .ci/tools (pip wheels)
  local t
  for t in "$(command -v "$1" 2>/dev/null)" /usr/local/cuda/bin/$1 \
           "$KVP_SRC"/.ci/tools/nvidia/cu13/bin/$1 "$KVP_SRC"/.ci/tools/nvidia/cuda_*/bin/$1; do
    [ -n "$t" ] && [ -x "$t" ] && { echo "$t"; return 0; }
  done
  return 1
}

case $mode in
sass)
  [ $# -gt 0 ] || skip "no cubins: this build had no nvcc (KVP_WITH_CUDA)"
  cuobjdump=$(find_tool cuobjdump) || skip "cuobjdump not found (CUDA toolkit or .ci/deps' nvidia-cuda-cuobjdump wheel)"
  nvdisasm=$(find_tool nvdisasm) || skip "nvdisasm not found (cuobjdump needs it for SASS)"
  export PATH=$(dirname "$nvdisasm"):$PATH
  for cubin in "$@"; do
    sass=$("$cuobjdump" -sass "$cubin") || fail "cuobjdump -sass $cubin"
    w16=$("$cuobjdump" -sass -fun kvp_copy_w16 "$cubin") || fail "no kvp_copy_w16 in $cubin"
    grep -q 'LDG\.E\.128' <<<"$w16" || fail "$cubin: kvp_copy_w16 has no LDG.E.128"
    grep -q 'STG\.E\.128' <<<"$w16" || fail "$cubin: kvp_copy_w16 has no STG.E.128"
    if grep -qE '\b(LDL|STL)\b' <<<"$sass"; then fail "$cubin: local memory (LDL/STL) in SASS"; fi
    if grep -qE '\b(LD|ST)\.E' <<<"$w16"; then fail "$cubin: generic LD/ST in kvp_copy_w16"; fi
    res=$("$cuobjdump" -res-usage "$cubin") || fail "cuobjdump -res-usage $cubin"
    n=$(grep -c 'Function kvp_copy_w' <<<"$res")
    [ "$n" = 5 ] || fail "$cubin: expected 5 copy kernels, found $n"
    grep -q 'Function kvp_repeat_check' <<<"$res" || fail "$cubin: no kvp_repeat_check"
    bad=$(grep -A1 'Function kvp_' <<<"$res" | grep 'REG:' | grep -vE 'STACK:0 .*LOCAL:0' || true)
    [ -z "$bad" ] || fail "$cubin: stack or local memory: $bad"
    echo "$(basename "$cubin"): LDG.E.128 $(grep -c 'LDG\.E\.128' <<<"$w16"), STG.E.128 $(grep -c 'STG\.E\.128' <<<"$w16") in kvp_copy_w16; no LDL/STL; STACK:0 LOCAL:0 (5 copy kernels + kvp_repeat_check)"
  done
  ;;
ptxas)
  nvcc=$1 src=$2 inc1=$3 inc2=$4
  [ -x "$nvcc" ] || skip "no nvcc in this build"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  for arch in sm_80 sm_90; do
    out=$("$nvcc" -O3 -std=c++17 -I"$inc1" -I"$inc2" -cubin -arch=$arch -Xptxas -v \
          -o "$tmp/k.cubin" "$src" 2>&1) || fail "nvcc $arch: $out"
    n=$(grep -c 'Compiling entry function' <<<"$out")
    ok=$(grep -c '0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads' <<<"$out")
    [ "$n" = 6 ] && [ "$ok" = 6 ] || fail "$arch: $ok of $n kernels free of stack/spills:
$out"
    echo "$arch: 6 kernels (5 copy + kvp_repeat_check), 0 bytes stack, 0 spills; $(grep -o 'Used [0-9]* registers' <<<"$out" | tr '\n' ' ')"
  done
  ;;
hip)
  [ $# -gt 0 ] || skip "no HIP code objects: $KVP_HIP_NOTE"
  readelf=$(command -v llvm-readelf-19 || command -v llvm-readelf || command -v llvm-readelf-14) ||
    skip "llvm-readelf not found"
  for co in "$@"; do
    arch=$(basename "$co" .co); arch=${arch##*_}
    notes=$("$readelf" --notes "$co") || fail "readelf $co"
    n=$(grep -c '\.name: *kvp_copy_w' <<<"$notes")
    [ "$n" = 5 ] || fail "$co: expected 5 kernels, found $n"
    for key in .vgpr_spill_count .sgpr_spill_count .private_segment_fixed_size; do
      bad=$(grep -E "^ *$key:" <<<"$notes" | grep -vE ":[[:space:]]+0$" || true)
      [ -z "$bad" ] || fail "$co: $key not 0: $bad"
    done
    msg="$arch: 5 kernels, no VGPR/SGPR spills, no scratch"
    objdump=""
    for t in llvm-objdump-19 llvm-objdump llvm-objdump-14; do
      p=$(command -v $t) || continue
      if "$p" -d --mcpu="$arch" "$co" >"$co.dis" 2>/dev/null && grep -q global_ "$co.dis"; then
        objdump=$p; break
      fi
    done
    if [ -n "$objdump" ]; then
      grep -q 'global_load_dwordx4' "$co.dis" || fail "$co: no global_load_dwordx4"
      grep -q 'global_store_dwordx4' "$co.dis" || fail "$co: no global_store_dwordx4"
      if grep -qE 'scratch_|buffer_(load|store)' "$co.dis"; then fail "$co: scratch accesses"; fi
      msg="$msg; global_load/store_dwordx4 present"
    else
      msg="$msg; (no llvm-objdump that knows $arch: disassembly not checked)"
    fi
    echo "$msg"
  done
  ;;
*) fail "unknown mode $mode" ;;
esac
exit 0
