#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""vllm_hashes.py against vLLM 0.33.0's own vectors: every case of
vectors/vllm033_block_hashes.json must reproduce (the real hashing.py plus
the mirrored chain), and the check must notice a changed digest, a changed
extra key and a changed NONE_HASH seed.

usage: test_vllm_hashes.py VECTOR_FILE     exit 0 pass, 1 fail, 77 no file
"""
import contextlib
import copy
import io
import json
import os
import sys
import tempfile

import vllm_hashes


def check_doc(doc) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(doc, f)
    try:
        with contextlib.redirect_stdout(io.StringIO()), \
             contextlib.redirect_stderr(io.StringIO()):
            return vllm_hashes.check(f.name)
    finally:
        os.unlink(f.name)


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    if not os.path.isfile(path):
        print(f"SKIP: {path} is missing (CI has it at ../shared)", file=sys.stderr)
        return 77
    if vllm_hashes.check(path) != 0:
        return 1
    with open(path) as f:
        doc = json.load(f)
    fails = 0
    # each mutation must be caught
    def mutated(what, fn):
        nonlocal fails
        d = copy.deepcopy(doc)
        fn(d)
        if check_doc(d) == 0:
            print(f"FAIL: the check accepts {what}")
            fails += 1
        else:
            print(f"ok: the check rejects {what}")
    def flip_hash(d):
        b = d["cases"][0]["blocks"][-1]
        b["hash_hex"] = ("0" if b["hash_hex"][0] != "0" else "1") + b["hash_hex"][1:]
    mutated("a changed digest", flip_hash)
    def bump_u64(d):
        d["cases"][1]["blocks"][0]["external_u64"] ^= 1
    mutated("a changed external_u64", bump_u64)
    def salt(d):
        c = next(c for c in d["cases"] if c.get("cache_salt"))
        c["cache_salt"] += "x"
    mutated("a changed cache salt", salt)
    def mm_off(d):
        c = next(c for c in d["cases"] if c.get("mm_placeholders"))
        c["mm_placeholders"][0]["offset"] += 1
    mutated("a moved multimodal placeholder", mm_off)
    def seed(d):
        c = next(c for c in d["cases"] if c.get("pythonhashseed"))
        c["pythonhashseed"] = str(int(c["pythonhashseed"]) + 1)
    mutated("another PYTHONHASHSEED", seed)
    # what `random` prints must check too (it is kvplane hash --check's input)
    class A:
        seed, cases, blocks, block_size = 7, 2, 3, 16
        algo, pythonhashseed, lora, salt = None, "123", "ad:/p/ad", "s"
        mm = ["img:5:30"]
    if check_doc(vllm_hashes.random_cases(A)) != 0:
        print("FAIL: vllm_hashes.py random output does not check")
        fails += 1
    else:
        print("ok: vllm_hashes.py random output checks (8 cases)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
