#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvplane-routerd end to end with the `openai` SDK as the client
# (tests/interop/test_routerd.py).  The SDK goes into a git-ignored venv
# (.venv-routerd, pinned); exit 77 when PyPI cannot be reached and it is not
# installed yet.
#   tests/interop/test_routerd.sh KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
V=$root/.venv-routerd
OPENAI=openai==3.57.0
mkdir -p "$3"
if ! "$V/bin/python" -c 'import openai' 2>/dev/null; then
  python3 -m venv "$V" >/dev/null 2>&1 || { echo "SKIP: python3 -m venv failed"; exit 77; }
  "$V/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 \
    "$OPENAI" > "$3/pip.log" 2>&1 ||
    { echo "SKIP: could not install $OPENAI from PyPI"; tail -3 "$3/pip.log"; exit 77; }
fi
exec "$V/bin/python" "$root/tests/interop/test_routerd.py" "$@"
