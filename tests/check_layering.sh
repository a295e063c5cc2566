#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# docs/architecture.md's module table, checked on the sources: a module may
# include its own headers, the public include/ headers and the private headers of the
# modules it may use -- never another module's folder by relative path.
# Connectors are clients of the library: the public headers only.
# (The build enforces the same through PRIVATE include paths.)
set -u
root=${1:-.}
cd "$root" || exit 1
declare -A allowed=(
  [core]="core"
  [router]="router core"
  [kernels]="kernels core"
  [kvtier]="kvtier core kernels"
  [connectors]="connectors"
)
fail=0
for mod in "${!allowed[@]}"; do
  [ -d "$mod" ] || continue
  while IFS= read -r -d '' f; do
    while IFS= read -r line; do
      inc=$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$line")
      case "$inc" in
        kvplane.h|kvplane/*) continue ;;
        ../*|*/../*)
          echo "$f: relative include escapes the module: $inc"; fail=1; continue ;;
      esac
      # private headers are named <module>_*.h (plus cli_*.h under connectors)
      owner=${inc%%_*}
      [ "$owner" = cli ] && owner=connectors
      [ "$owner" = prefix ] && owner=router
      ok=0
      for a in ${allowed[$mod]}; do [ "$owner" = "$a" ] && ok=1; done
      if [ "$ok" = 0 ] && [ -f "$(dirname "$f")/$inc" ]; then ok=1; fi
      if [ "$ok" = 0 ]; then
        echo "$f: includes \"$inc\" (module '$owner'), not allowed for '$mod'"; fail=1
      fi
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f")
  done < <(find "$mod" -name '*.[ch]' -print0 -o -name '*.cu' -print0)
done
# core sits below every other module: neither its sources nor its public
# headers may include another module's public header (kvp_class and
# kvp_tier, which several modules share, live in kvplane/common.h).
core_public="common.h core.h text.h ledger.h config.h version.h"
while IFS= read -r -d '' f; do
  while IFS= read -r inc; do
    case "$inc" in
      kvplane/*) h=${inc#kvplane/} ;;
      kvplane.h) h=kvplane.h ;;
      *) continue ;;
    esac
    case " $core_public " in
      *" $h "*) ;;
      *) echo "$f: includes \"$inc\", a header of a module above core"; fail=1 ;;
    esac
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/p' "$f")
done < <(find core -name '*.[ch]' -print0
         for h in $core_public; do
           [ -f "include/kvplane/$h" ] && printf 'include/kvplane/%s\0' "$h"
         done)
# The harness (kvplane-bench: bench/harness*) is a client too, except that its
# simulator links the module internals its CMake target names
# (bench/CMakeLists.txt, kvp_harness): kvtier's placement header and core's
# helpers.
harness_internals="kvtier_place.h core_internal.h"
while IFS= read -r -d '' f; do
  while IFS= read -r inc; do
    case "$inc" in
      kvplane.h|kvplane/*|harness*.h) continue ;;  # the harness's own headers
    esac
    ok=0
    for a in $harness_internals; do [ "$inc" = "$a" ] && ok=1; done
    if [ "$ok" = 0 ]; then
      echo "$f: includes \"$inc\", not a public header nor one kvp_harness declares"; fail=1
    fi
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/p' "$f")
done < <(find bench -name 'harness*.[ch]' -print0 2>/dev/null)
[ "$fail" = 0 ] && echo "layering ok"
exit $fail
