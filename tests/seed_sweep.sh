#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs a seeded test binary over many seeds; prints the seeds that fail.
#   tests/seed_sweep.sh BINARY [FIRST_SEED] [COUNT] [TEST_NAME...]
# e.g. tests/seed_sweep.sh build/tests/test_prefix_stability 1 2000 \
#        fast_path_keeps_hot_chain
# Exit 1 if any seed failed.  Not part of CTest (minutes): a tool for
# checking that a randomised test holds beyond the seeds CI happens to draw.
set -u
bin=${1:?usage: seed_sweep.sh BINARY [FIRST_SEED] [COUNT] [TEST_NAME...]}
first=${2:-1}
count=${3:-1000}
shift $(($# < 3 ? $# : 3))
fails=0
for ((s = first; s < first + count; s++)); do
  if ! KVP_TEST_SEED=$s "$bin" "$@" >/dev/null 2>&1; then
    echo "FAIL KVP_TEST_SEED=$s $bin $*"
    fails=$((fails + 1))
  fi
done
echo "seed_sweep: $fails of $count seeds failed ($bin $*)"
[ "$fails" -eq 0 ]
