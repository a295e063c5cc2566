#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM v1's own prefix-block hashing, in Python, for bench_prefix.

Mirrors vllm/v1/core/kv_cache_utils.py (hash_block_tokens, init_none_hash,
the per-request block hasher) and vllm/utils/hashing.py (sha256_cbor,
xxhash_cbor): the reference kvplane's C implementation is timed against and
cross-checked with.  Needs Debian's python3-cbor2 and python3-xxhash (run
with /usr/bin/python3).

usage: vllm_hash_ref.py ALGO BLOCK_SIZE PYTHONHASHSEED TOKENS_FILE REPS
prints: ns_per_block=<median> last_external_u64=<int> blocks=<n>
"""
import hashlib
import statistics
import sys
import time

import cbor2

try:
    import xxhash
except ImportError:  # only sha256_cbor then
    xxhash = None


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj):
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids,
                      extra_keys=None):
    # vLLM: NONE_HASH stands in for the missing parent of block 0.
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    curr_block_token_ids_tuple = tuple(curr_block_token_ids)
    return hash_function((parent_block_hash, curr_block_token_ids_tuple,
                          extra_keys))


def request_block_hashes(hash_function, token_ids, block_size):
    # vLLM's request block hasher: full blocks only, chained.
    hashes = []
    prev = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block_tokens(hash_function, prev,
                                 token_ids[start:start + block_size], None)
        hashes.append(prev)
    return hashes


def main():
    algo, block_size, seed, path, reps = sys.argv[1:6]
    block_size, reps = int(block_size), int(reps)
    fn = {"sha256_cbor": sha256_cbor, "xxhash_cbor": xxhash_cbor}[algo]
    if fn is xxhash_cbor and xxhash is None:
        print("skip: python3-xxhash missing")
        return 0
    global NONE_HASH
    NONE_HASH = fn(seed)  # vLLM init_none_hash with PYTHONHASHSEED set
    with open(path) as f:
        tokens = [int(t) for t in f.read().split()]
    times = []
    hashes = None
    for _ in range(reps + 1):
        t0 = time.perf_counter_ns()
        hashes = request_block_hashes(fn, tokens, block_size)
        times.append(time.perf_counter_ns() - t0)
    times = times[1:]  # first run is warm-up
    n = len(hashes)
    ext = int.from_bytes(hashes[-1][-8:], "big") if n else 0
    print(f"ns_per_block={statistics.median(times) / max(n, 1):.1f} "
          f"last_external_u64={ext} blocks={n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
