#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares, on a Debian 12 build host with network access, what
# bench/micro/device_py_run.sh needs on the GPU machine (PyTorch + CUDA, no
# package registry, no kvplane build dependencies):
#   bench/micro/device_py_prep.sh [OUT_DIR]      (default build-dev, git-ignored)
# OUT_DIR/cuda     a Release build with the CUDA kernels (-DKVP_WITH_CUDA=ON)
# OUT_DIR/pyrun    the kvplane wheel built over it (cp39-abi3: the cffi
#                  extension uses the limited API, so any CPython >= 3.9
#                  takes it) and lib/, the Debian .so files it links (not
#                  glibc's, libstdc++ or libgcc_s)
# OUT_DIR/wheels   transformers 4.46.3 and its dependencies, numpy excepted,
#                  for CPython 3.10-3.13 manylinux x86_64 (~33 MiB)
# OUT_DIR/wheels-np/cp3XX numpy for 3.10-3.13 (~16 MiB each): carry only the
#                  one of the device's Python, and only when it has no numpy
# TFW: transformers' wheel (default /tmp/tfw/transformers-4.46.3-py3-none-any.whl;
# else it is downloaded).  PY: a python with setuptools, wheel, build and cffi
# (default: the venv test_python made in build/py/venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$PWD O=$(mkdir -p "${1:-build-dev}" && cd "${1:-build-dev}" && pwd)
PY=${PY:-$src/build/py/venv/bin/python}
TFW=${TFW:-/tmp/tfw/transformers-4.46.3-py3-none-any.whl}
[ -f "$TFW" ] || TFW=transformers==4.46.3

PATH=/usr/local/cuda/bin:$PATH cmake -S . -B "$O/cuda" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_COMPILER=gcc -DCMAKE_C_COMPILER_LAUNCHER=ccache -DKVP_WERROR=ON \
  -DKVP_WITH_CUDA=ON -DKVP_BUILD_TESTS=OFF -DKVP_BUILD_BENCH=OFF >/dev/null
CCACHE_BASEDIR=/work PATH=/usr/local/cuda/bin:$PATH cmake --build "$O/cuda" -j1 \
  --target kvplane_static kvplane_events_static

rm -rf "$O/pkgsrc" "$O/pyrun" && mkdir -p "$O/pkgsrc" "$O/pyrun/lib"
(cd connectors/python && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' \
   --exclude=__pycache__ -cf - .) | tar -C "$O/pkgsrc" -xf -
KVPLANE_BUILD_DIR=$O/cuda KVPLANE_SOURCE_DIR=$src "$PY" -m build --wheel --no-isolation \
  -C--build-option=--py-limited-api=cp39 --outdir "$O/pyrun" "$O/pkgsrc" >"$O/wheel.log" 2>&1 ||
  { cat "$O/wheel.log"; exit 1; }
whl=$(ls "$O"/pyrun/kvplane-*.whl)
rm -rf "$O/whlx" && "$PY" -m zipfile -e "$whl" "$O/whlx"
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.'
ldd "$O"/whlx/kvplane/_kvplane*.so | awk '/=> \//{print $1, $3}' |
  while read -r name path; do
    [[ $name =~ $skip ]] || cp -L "$path" "$O/pyrun/lib/$name"
  done
rm -rf "$O/whlx"

mkdir -p "$O/wheels" "$O/wheels-np"
for v in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download -q --only-binary=:all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$O/wheels" \
    "$TFW" huggingface_hub==0.26.5 cffi==1.17.1 pycparser==2.22
done
for f in "$O"/wheels/numpy-*.whl; do  # wheels-np/cp310, cp311, cp312
  t=$(basename "$f" | grep -o 'cp3[0-9]*' | head -1); mkdir -p "$O/wheels-np/$t"; mv "$f" "$O/wheels-np/$t/"
done
du -sh "$O/pyrun" "$O/wheels" "$O/wheels-np"
