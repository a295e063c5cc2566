#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/interop setup, idempotent: the venv .venv-interop/ with the pinned
# packages of requirements.txt, vLLM 0.33.0's wheel cached in .cache/pypi/,
# and the torch-free vllm tree in .cache/interop/vllm033/ (vllm_tree.py: two
# real files from the wheel + stand-ins).  All three are git-ignored.
#
# usage: tests/interop/setup.sh [--quiet]
#   KVP_PYTHON=/path/python3   interpreter for the venv (default: python3 on
#                              PATH, else /usr/bin/python3; needs venv+ensurepip)
#   KVP_VLLM_WHEEL=/path/vllm-0.33.0-...whl   take this wheel (sha256 checked)
#                              instead of `pip download vllm==0.33.0 --no-deps`
# exit: 0 ready, 77 PyPI cannot be reached and something must be fetched,
#       1 any other failure
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=$root/.venv-interop
pypi=$root/.cache/pypi
tree=$root/.cache/interop/vllm033
req=$here/requirements.txt
wheel_name=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
wheel_sha=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa

quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
say() { [ "$quiet" = 1 ] || echo "interop setup: $*"; }
die() { echo "interop setup: FAILED: $*" >&2; exit 1; }

mkdir -p "$pypi" "$root/.cache/interop"
# CTest may start several interop tests at once: one setup at a time.
exec 9>"$root/.cache/interop/setup.lock"
command -v flock >/dev/null && flock 9

# 0 when the package index answers (PIP_INDEX_URL if set, else PyPI).
pypi_reachable() {
  "$1" - <<'PY'
import os, sys, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/pyzmq/"
try:
    urllib.request.urlopen(url, timeout=15).read(1)
except Exception as e:  # any failure to talk to the index
    print(f"interop setup: {url}: {e}", file=sys.stderr)
    sys.exit(1)
PY
}
# Called before anything is fetched: exit 77 when the index cannot be
# reached (checked first, with a short timeout: pip's own retries can take
# minutes where the network is black-holed).
need_index() {
  if ! pypi_reachable "$py"; then
    echo "interop setup: SKIP: PyPI cannot be reached, and $1 is not cached here" \
         "(run tests/interop/setup.sh once where PyPI is reachable)" >&2
    exit 77
  fi
}
pip_net=(--disable-pip-version-check --timeout 60 --retries 2)

# ---- 1. the interpreter: CPython >= 3.10 with venv + ensurepip -------------
py=
for c in ${KVP_PYTHON:-} python3 /usr/bin/python3; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if "$p" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' \
       2>/dev/null; then
    py=$p
    break
  fi
done
[ -n "$py" ] || die "no python3 >= 3.10 with the venv module (Debian: apt-get install python3-venv; .ci/deps does)"

# ---- 2. the venv -------------------------------------------------------------
want="$(sha256sum "$req" | cut -c1-64) $("$py" -c 'import sys; print(sys.version.split()[0])')"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c '' 2>/dev/null &&
   [ "$(cat "$venv/.kvp-stamp" 2>/dev/null)" = "$want" ]; then
  say "venv $venv is up to date ($("$venv/bin/python" -V))"
else
  need_index "a venv with the packages of $req"
  say "creating venv $venv with $py ($("$py" -V))"
  rm -rf "$venv"
  "$py" -m venv "$venv" || die "$py -m venv $venv"
  say "installing $(grep -v '^#' "$req" | tr '\n' ' ')"
  "$venv/bin/pip" install -q "${pip_net[@]}" --only-binary=:all: -r "$req" ||
    die "pip install -r $req (the index is reachable: not a network problem)"
  "$venv/bin/python" - "$req" <<'PY' || die "the venv does not hold the pinned versions"
import sys
from importlib.metadata import version
pins = [l.split("==") for l in open(sys.argv[1]) if "==" in l and not l.startswith("#")]
bad = [f"{n}=={v.strip()} (got {version(n)})" for n, v in pins if version(n) != v.strip()]
import msgspec, zmq, cbor2, xxhash  # noqa: E401,F401  all four import
sys.exit(f"interop setup: wrong versions: {bad}" if bad else 0)
PY
  echo "$want" >"$venv/.kvp-stamp"
fi

# ---- 3. the vLLM wheel (only two files of it are used) -----------------------
whl=$pypi/$wheel_name
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -c1-64)" = "$wheel_sha" ]; }
if sha_ok "$whl"; then
  say "wheel cached: $whl"
elif [ -n "${KVP_VLLM_WHEEL:-}" ]; then
  sha_ok "$KVP_VLLM_WHEEL" || die "KVP_VLLM_WHEEL=$KVP_VLLM_WHEEL is not $wheel_name (sha256 $wheel_sha)"
  cp "$KVP_VLLM_WHEEL" "$whl.tmp" && mv "$whl.tmp" "$whl"
  say "wheel copied from $KVP_VLLM_WHEEL to $whl"
else
  need_index "$wheel_name"
  say "downloading vllm==0.33.0 (--no-deps, 336 MB) into $pypi"
  hreq=$root/.cache/interop/vllm-wheel.req
  echo "vllm==0.33.0 --hash=sha256:$wheel_sha" >"$hreq"
  # --platform: the same wheel on any host (only its .py files are used).
  "$venv/bin/pip" download -q "${pip_net[@]}" --no-deps \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
    --require-hashes -r "$hreq" -d "$pypi" ||
    die "pip download vllm==0.33.0 (the index is reachable: not a network problem)"
  sha_ok "$whl" || die "pip download did not leave $whl"
  say "wheel downloaded: $whl"
fi

# ---- 4. the vllm tree ----------------------------------------------------------
if "$venv/bin/python" "$here/vllm_tree.py" check --out "$tree"; then
  say "vllm tree up to date: $tree"
else
  say "building the vllm tree $tree"
  if [ "$quiet" = 1 ]; then
    "$venv/bin/python" "$here/vllm_tree.py" build --wheel "$whl" --out "$tree" >/dev/null
  else
    "$venv/bin/python" "$here/vllm_tree.py" build --wheel "$whl" --out "$tree"
  fi || die "building $tree"
fi
say "ready: $venv/bin/python, tree $tree"
