#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Compiles every ```c block of README.md and docs/*.md as its own translation
# unit (C11, -Wall -Wextra -Werror, the public headers only) and links it
# into a shared object with --no-undefined against libkvplane and
# libkvplane-events, so an example that names a function, field or type the
# library does not have fails the build of the docs.  Examples are written as
# whole functions (a reader can paste them).
#   tests/check_doc_examples.sh SRC_DIR BUILD_INCLUDE_DIR CC LIBKVPLANE LIBKVPLANE_EVENTS
# (BUILD_INCLUDE_DIR holds the generated kvplane/version.h)
set -euo pipefail
src=${1:?usage: check_doc_examples.sh SRC_DIR BUILD_INCLUDE_DIR CC LIBKVPLANE LIBKVPLANE_EVENTS}
gen=${2:?} cc=${3:?} lib=${4:?} evlib=${5:?}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0 bad=0
for md in "$src"/README.md "$src"/docs/*.md; do
  # block k of file F -> $tmp/<F>_<k>.c, with a #line so errors name the .md
  python3 - "$md" "$tmp" <<'PY'
import os, sys
md, out = sys.argv[1], sys.argv[2]
lines = open(md, encoding="utf-8").read().split("\n")
k, i = 0, 0
while i < len(lines):
    if lines[i].strip() == "```c":
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            sys.exit(f"{md}:{i + 1}: unterminated ```c block")
        k += 1
        name = os.path.basename(md).replace(".", "_") + f"_{k}.c"
        with open(os.path.join(out, name), "w") as f:
            f.write(f'#line {i + 2} "{md}"\n' + "\n".join(lines[i + 1:j]) + "\n")
        i = j
    i += 1
PY
done
for c in "$tmp"/*.c; do
  [ -e "$c" ] || continue
  n=$((n + 1))
  if ! "$cc" -std=c11 -Wall -Wextra -Werror -fPIC -shared -I"$src/include" -I"$gen" \
       -o "${c%.c}.so" "$c" -Wl,--no-undefined "$lib" "$evlib" 2>"${c%.c}.err"; then
    bad=$((bad + 1))
    echo "FAIL $(basename "$c"):"
    cat "${c%.c}.err"
  fi
done
echo "check_doc_examples: $n examples, $bad failed"
[ "$n" -gt 0 ] && [ "$bad" -eq 0 ]
