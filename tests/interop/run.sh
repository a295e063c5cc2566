#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Runs a tests/interop script with the interop venv, after setup.sh (quiet,
# idempotent).  usage: tests/interop/run.sh SCRIPT.py [ARGS...]
# exit: the script's, or 77 when setup.sh skips (PyPI cannot be reached).
here=$(cd "$(dirname "$0")" && pwd)
"$here/setup.sh" --quiet
rc=$?
[ $rc -eq 0 ] || exit $rc
script=$1
shift
exec "$here/../../.venv-interop/bin/python" "$here/$script" "$@"
