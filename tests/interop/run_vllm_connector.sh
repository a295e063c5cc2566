#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs tests/interop/test_vllm_connector.py (kvplane.vllm inside a real vLLM)
# with the real-vLLM venv of bench/live/vllm/setup.sh (as run_real_vllm.sh).
# kvplane is built for that venv's python into WORK_DIR/pkg (setup.py build
# over this build's libkvplane archives) and reaches the engine through
# PYTHONPATH: the shared venv is not modified.
# usage: tests/interop/run_vllm_connector.sh BUILD_DIR SRC_DIR WORK_DIR [TEST ARGS...]
#   TEST: the script to run (default test_vllm_connector.py; test_vllm_pd.py
#   takes kvplane-routerd's path as ARGS), run as TEST WORK_DIR PKG_DIR ARGS...
# exit: the test's, or 77 when the venv cannot be set up (setup.sh says why)
set -e
build=$(cd "$1" && pwd) src=$(cd "$2" && pwd) work=$3
shift 3
test=test_vllm_connector.py
[ $# -eq 0 ] || { test=$1; shift; }
here=$(cd "$(dirname "$0")" && pwd)
rc=0
out=$("$here/../../bench/live/vllm/setup.sh" --quiet) || rc=$?
[ $rc -eq 0 ] || exit $rc   # setup.sh said why (77: skip, no PyPI here)
py=$(printf '%s\n' "$out" | tail -n 1)
"$py" -c 'import cffi, setuptools' 2>/dev/null ||
  { echo "SKIP: $py has no cffi/setuptools to build kvplane's extension"; exit 77; }
mkdir -p "$work" && work=$(cd "$work" && pwd)
rm -rf "$work/pkg" "$work/pkg-src" "$work/pkg-tmp"
mkdir -p "$work/pkg-src"
(cd "$src/connectors/python" && tar --exclude=./build --exclude=./dist \
   --exclude='*.egg-info' --exclude=__pycache__ -cf - .) | tar -C "$work/pkg-src" -xf -
(cd "$work/pkg-src" && KVPLANE_BUILD_DIR=$build KVPLANE_SOURCE_DIR=$src \
   "$py" setup.py -q build --build-lib "$work/pkg" --build-temp "$work/pkg-tmp" \
   >"$work/pkg-build.log" 2>&1) || { cat "$work/pkg-build.log"; exit 1; }
exec "$py" "$here/$test" "$work" "$work/pkg" "$@"
