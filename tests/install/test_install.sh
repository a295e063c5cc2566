#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cmake --install into a scratch prefix, then build consumers against the
# installed tree: pkg-config (C11, C++ -std=c++17, static), find_package.
set -eu
build=$1 src=$2 cc=$3
command -v c++ >/dev/null || { echo "SKIP: no C++ compiler (apt-get install g++)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
libdir=$(dirname "$(find "$prefix" -name kvplane.pc | head -n1)")/..
export PKG_CONFIG_PATH=$libdir/pkgconfig
test -f "$prefix/include/kvplane.h"
test -f "$prefix/include/kvplane/version.h"
# every public header compiles alone, as C11 and as C++
for h in "$prefix"/include/kvplane/*.h; do
  echo "#include <kvplane/$(basename "$h")>" > "$tmp/one.c"
  "$cc" -std=c11 -Wall -Wextra -Werror -fsyntax-only -I"$prefix/include" "$tmp/one.c"
  c++ -x c++ -std=c++17 -Wall -Wextra -Werror -fsyntax-only -I"$prefix/include" "$tmp/one.c"
done
"$cc" -std=c11 -Wall -Wextra -Werror "$src/consumer.c" -o "$tmp/c_pc" $(pkg-config --cflags --libs kvplane)
LD_LIBRARY_PATH=$libdir "$tmp/c_pc"
c++ -std=c++17 -Wall -Werror "$src/consumer.cpp" -I"$src" -o "$tmp/cxx_pc" $(pkg-config --cflags --libs kvplane)
LD_LIBRARY_PATH=$libdir "$tmp/cxx_pc"
"$cc" -std=c11 "$src/consumer.c" -o "$tmp/c_static" $(pkg-config --cflags kvplane) \
  "$libdir/libkvplane.a" $(pkg-config --libs --static kvplane | sed 's/-lkvplane//')
"$tmp/c_static"
test "$(pkg-config --modversion kvplane)" = "$(sed -n 's/.*KVP_VERSION_STR "\(.*\)"/\1/p' "$prefix/include/kvplane/version.h")"
cmake -S "$src" -B "$tmp/cm" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$tmp/cm" >/dev/null
LD_LIBRARY_PATH=$libdir "$tmp/cm/consumer_shared"
"$tmp/cm/consumer_static"
LD_LIBRARY_PATH=$libdir "$tmp/cm/consumer_cxx"
echo "install ok"
