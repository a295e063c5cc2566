#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.33.0 prefix-cache block hashes, computed with vLLM's own hash
functions (the real vllm/utils/hashing.py, loaded by vllm_tree.py).

The chain is built the way vllm/v1/core/kv_cache_utils.py builds it; that file
needs torch, so its four small pieces are mirrored here line for line (each
function below names the one it mirrors): NONE_HASH = hash_fn(seed string),
hash_block_tokens, generate_block_hash_extra_keys (LoRA, multimodal, cache
salt; prompt embeddings are not covered) and to_event_extra_keys.  The mirror
is proven by `check`: every case of vectors/vllm033_block_hashes.json (made by
vLLM 0.33.0's own functions) must reproduce.

  vllm_hashes.py check FILE
      recompute every case of a vllm033 vector file; exit 1 on any mismatch
  vllm_hashes.py random [--algo A ...] [--pythonhashseed S] [--blocks N]
                        [--block-size B] [--seed R] [--lora NAME:PATH]
                        [--salt S] [--mm ID:OFFSET:LENGTH ...] [--cases K]
      K random token prompts, printed as a vector file of the same format
      (cases[].token_ids, blocks[].extra_keys/event_extra_keys/hash_hex/
      external_u64): the input `kvplane hash --check` reads

external_u64 is the int form of KV events: the low 64 bits of the big-endian
digest (kv_cache_utils.maybe_convert_block_hash).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import vllm_tree

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # kv_cache_utils.DEFAULT_NONE_HASH_SEED
NON_CRYPTO = ("xxhash", "xxhash_cbor")     # kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    _, hashing = vllm_tree.load()
    return hashing.get_hash_fn_by_name(algo)  # real: vllm/utils/hashing.py


def none_hash_seed(algo: str, pythonhashseed: str | None) -> str:
    """Mirrors kv_cache_utils.resolve_none_hash_seed, minus the random seed:
    vLLM draws os.urandom for xxhash* without PYTHONHASHSEED, which no one can
    reproduce, so a seed is required there."""
    if pythonhashseed is not None:
        return pythonhashseed
    if algo in NON_CRYPTO:
        raise ValueError(f"{algo}: vLLM uses a random NONE_HASH seed without "
                         "PYTHONHASHSEED; pass --pythonhashseed")
    return DEFAULT_NONE_HASH_SEED


@dataclass
class MM:
    identifier: str
    offset: int
    length: int


def block_extra_keys(start: int, end: int, mm: Sequence[MM], mm_idx: int,
                     lora: tuple[str, str] | None, salt: str | None):
    """Mirrors kv_cache_utils.generate_block_hash_extra_keys with
    _gen_mm_extra_hash_keys and _gen_lora_extra_hash_keys: returns
    (tagged extra keys or None, next mm index)."""
    mm_keys: list = []
    if mm and not mm[-1].offset + mm[-1].length <= start:
        if mm_idx < 0:
            mm_idx = len(mm) + mm_idx
        while mm_idx < len(mm):
            f = mm[mm_idx]
            if end > f.offset:
                if start >= f.offset + f.length:
                    mm_idx += 1
                    continue
                mm_keys.append(("mm", f.identifier, f.offset - start))
                if end >= f.offset + f.length:
                    mm_idx += 1
                else:
                    break
            else:
                break
    lora_keys = [("lora", lora[0], lora[1])] if lora else []
    salt_keys = [("cache_salt", salt)] if start == 0 and salt else []
    keys = lora_keys + mm_keys + salt_keys
    return (tuple(keys) if keys else None), mm_idx


def to_event_extra_keys(keys):
    """Mirrors kv_cache_utils.to_event_extra_keys for one block: the untagged
    form KV events carry (bare LoRA name and salt, (mm id, offset) pairs)."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def hash_block_tokens(fn, none_hash: bytes, parent: bytes | None,
                      tokens: Sequence[int], extra_keys) -> bytes:
    """Mirrors kv_cache_utils.hash_block_tokens."""
    if not parent:
        parent = none_hash
    return fn((parent, tuple(tokens), extra_keys))


def external_u64(digest: bytes) -> int:
    """kv_cache_utils.maybe_convert_block_hash with int hashes on."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def chain(algo: str, pythonhashseed: str | None, token_ids: Sequence[int],
          block_size: int, lora: tuple[str, str] | None = None,
          salt: str | None = None, mm: Sequence[MM] = ()) -> dict:
    """One prompt's full blocks, as kv_cache_utils.get_request_block_hasher
    hashes them from block 0 (no lookahead tokens)."""
    fn = hash_fn(algo)
    seed = none_hash_seed(algo, pythonhashseed)
    nh = fn(seed)
    blocks, parent, mm_idx = [], None, 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        keys, mm_idx = block_extra_keys(start, end, mm, mm_idx, lora, salt)
        h = hash_block_tokens(fn, nh, parent, token_ids[start:end], keys)
        blocks.append({"extra_keys": keys, "event_extra_keys": to_event_extra_keys(keys),
                       "hash_hex": h.hex(), "external_u64": external_u64(h)})
        parent = h
    return {"algo": algo, "vllm_version": vllm_tree.VLLM_VERSION,
            "pythonhashseed": pythonhashseed, "none_hash_seed": seed,
            "none_hash_hex": nh.hex(), "block_size": block_size,
            "lora_name": lora[0] if lora else None,
            "lora_path": lora[1] if lora else None, "cache_salt": salt,
            "mm_placeholders": [vars(m) for m in mm],
            "token_ids": list(token_ids), "blocks": blocks}


def jsonable(x):
    """Tuples as lists (the vector files' convention), bytes as hex."""
    if isinstance(x, (tuple, list)):
        return [jsonable(v) for v in x]
    if isinstance(x, bytes):
        return x.hex()
    return x


def check(path: str) -> int:
    with open(path) as f:
        doc = json.load(f)
    cases, nblocks, bad = doc["cases"], 0, 0
    for i, c in enumerate(cases):
        lora = (c["lora_name"], c["lora_path"]) if c.get("lora_name") else None
        mm = [MM(m["identifier"], m["offset"], m["length"])
              for m in c.get("mm_placeholders") or []]
        got = chain(c["algo"], c["pythonhashseed"], c["token_ids"], c["block_size"],
                    lora, c.get("cache_salt"), mm)
        if got["none_hash_seed"] != c["none_hash_seed"] or \
           got["none_hash_hex"] != c["none_hash_hex"]:
            print(f"case {i} ({c['algo']}): NONE_HASH differs", file=sys.stderr)
            bad += 1
            continue
        if len(got["blocks"]) != len(c["blocks"]):
            print(f"case {i}: {len(got['blocks'])} blocks, file has "
                  f"{len(c['blocks'])}", file=sys.stderr)
            bad += 1
            continue
        for j, (g, w) in enumerate(zip(got["blocks"], c["blocks"])):
            nblocks += 1
            for k in ("extra_keys", "event_extra_keys", "hash_hex", "external_u64"):
                if jsonable(g[k]) != w[k]:
                    print(f"case {i} ({c['algo']}) block {j}: {k} = "
                          f"{jsonable(g[k])!r}, file has {w[k]!r}", file=sys.stderr)
                    bad += 1
    algos = sorted({c["algo"] for c in cases})
    print(f"{path}: {len(cases)} cases, {nblocks} blocks, algos {algos}: "
          f"{'all reproduce' if not bad else f'{bad} MISMATCHES'}")
    return 1 if bad or not cases else 0


def parse_mm(s: str) -> MM:
    ident, off, length = s.rsplit(":", 2)
    return MM(ident, int(off), int(length))


def random_cases(a) -> dict:
    rng = random.Random(a.seed)
    lora = tuple(a.lora.split(":", 1)) if a.lora else None
    mm = [parse_mm(s) for s in a.mm or []]
    cases = []
    for _ in range(a.cases):
        toks = [rng.randrange(0, 152064) for _ in range(a.blocks * a.block_size
                                                        + rng.randrange(a.block_size))]
        for algo in a.algo or ALGOS:
            cases.append(jsonable(chain(algo, a.pythonhashseed, toks, a.block_size,
                                        lora, a.salt, mm)))
    return {"about": "vLLM 0.33.0 block hashes from tests/interop/vllm_hashes.py "
                     f"random --seed {a.seed} (the real vllm/utils/hashing.py)",
            "vllm_version": vllm_tree.VLLM_VERSION, "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("file")
    r = sub.add_parser("random")
    r.add_argument("--algo", action="append", choices=ALGOS,
                   help="repeatable; default: all four")
    r.add_argument("--pythonhashseed", help="the engine's PYTHONHASHSEED "
                   "(default: unset: 'vllm-none-hash'; xxhash* need one)")
    r.add_argument("--blocks", type=int, default=4)
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--seed", type=int, default=1, help="random token seed")
    r.add_argument("--cases", type=int, default=1, help="prompts (each in every algo)")
    r.add_argument("--lora", metavar="NAME:PATH")
    r.add_argument("--salt")
    r.add_argument("--mm", action="append", metavar="ID:OFFSET:LENGTH")
    a = ap.parse_args()
    if a.cmd == "check":
        return check(a.file)
    try:
        json.dump(random_cases(a), sys.stdout, indent=1)
    except ValueError as e:
        print(f"vllm_hashes: {e}", file=sys.stderr)
        return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
