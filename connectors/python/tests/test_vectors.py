# SPDX-License-Identifier: Apache-2.0
"""The vLLM vector files (../shared/vectors, schema in ../shared/README.md)
recomputed through the package: every block's full digest (Chain with
keep_digests) and its 64-bit event form (Keys.lo)."""
import json

import pytest

import kvplane
from conftest import shared_dir

FILES = {"vllm_block_hashes.json": kvplane.VllmCompat.PRE_0_33,
         "vllm033_block_hashes.json": kvplane.VllmCompat.V0_33}


def cases(name):
    path = shared_dir() / "vectors" / name
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return json.loads(path.read_text())["cases"]


def extras(case):
    mm = [kvplane.MMSpan(p["identifier"], p["offset"], p["length"])
          for p in case.get("mm_placeholders") or []]
    return kvplane.Extras(lora_name=case.get("lora_name"), cache_salt=case.get("cache_salt"),
                          lora_path=case.get("lora_path"), mm=mm)


@pytest.mark.parametrize("name", sorted(FILES))
def test_vector_file(name):
    checked = blocks = 0
    for i, case in enumerate(cases(name)):
        if case.get("prompt_embeds") or any("prompt_embeds" in str(b.get("extra_keys"))
                                            for b in case["blocks"]):
            continue  # the package does not take prompt embeddings yet
        ns = kvplane.Namespace("vectors", case["block_size"])
        algo = kvplane.HashAlgo.from_vllm(case["algo"])
        seed = case.get("pythonhashseed")
        if seed is None:
            seed = case.get("none_hash_seed")
        h = kvplane.Hasher(ns, algo, python_hash_seed=seed, vllm_compat=FILES[name])
        x = extras(case)
        chain = kvplane.Chain(h, extras=x, keep_digests=True)
        chain.extend(case["token_ids"])
        keys = h.hash(case["token_ids"], x)
        want = case["blocks"]
        assert len(chain) == len(keys) == len(want), f"case {i}"
        for b, blk in enumerate(want):
            assert chain.digest(b).hex() == blk["hash_hex"], f"case {i} block {b}"
            assert keys[b].lo == blk["external_u64"], f"case {i} block {b}"
        checked += 1
        blocks += len(want)
    assert checked == 48 and blocks > 0, (checked, blocks)
