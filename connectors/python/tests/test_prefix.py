# SPDX-License-Identifier: Apache-2.0
"""Namespace, Hasher, Chain, Stability and drift through the package, checked
against the `kvplane hash` CLI and against each other."""
import array
import subprocess
import threading

import numpy as np
import pytest

import kvplane
from conftest import program

TOKENS = [(i * 7919 + 13) % 128256 for i in range(1000)]


def cli_hash(tokens, *args):
    out = subprocess.run([program("KVPLANE_CLI"), "hash", *args],
                         input=" ".join(map(str, tokens)), capture_output=True,
                         text=True, check=True).stdout.split("\n")
    blocks = [ln.split() for ln in out if ln and ln[0].isdigit()]
    chunks = [ln.split()[1:] for ln in out if ln.startswith("chunk ")]
    tail = [int(ln.split()[1]) for ln in out if ln.startswith("tail ")]
    return blocks, chunks, tail[0]


def test_keys_equal_the_cli(ns, hasher):
    keys = hasher.hash(TOKENS)
    blocks, _, tail = cli_hash(TOKENS, "--model", ns.model_id, "--tokenizer",
                               ns.tokenizer_id, "--layout", ns.kv_layout, "-b", "16")
    assert len(keys) == len(blocks) == 1000 // 16
    assert keys.tail == tail == 1000 % 16
    assert keys.hex() == [b[1] for b in blocks]
    assert keys.lo == [int(b[2]) for b in blocks]


def test_chunk_keys_and_vllm_mode_equal_the_cli(ns):
    h = kvplane.Hasher(ns)
    c = kvplane.Chain(h, chunk_tokens=[64, 256])
    c.extend(TOKENS)
    _, chunks, _ = cli_hash(TOKENS, "--model", ns.model_id, "--tokenizer",
                            ns.tokenizer_id, "--layout", ns.kv_layout,
                            "--chunks", "64,256")
    for g in (64, 256):
        want = [ch[2] for ch in chunks if int(ch[0]) == g]
        assert c.chunk_keys(g).hex() == want and len(want) == 1000 // g
    vh = kvplane.Hasher(ns, "vllm_sha256", python_hash_seed="7")
    blocks, _, _ = cli_hash(TOKENS, "-a", "vllm_sha256", "--seed", "7", "-b", "16")
    assert vh.hash(TOKENS).lo == [int(b[2]) for b in blocks]


def test_token_containers_give_the_same_keys(hasher):
    want = hasher.hash(TOKENS)
    for tokens in (tuple(TOKENS), array.array("i", TOKENS), array.array("I", TOKENS),
                   np.array(TOKENS, dtype=np.int32), np.array(TOKENS, dtype=np.uint32),
                   np.array(TOKENS, dtype=np.int64), memoryview(array.array("i", TOKENS)),
                   np.array(TOKENS + [0], dtype=np.int32)[:-1], range(0)):
        got = hasher.hash(tokens)
        assert got == (want if len(tokens) else kvplane.Keys.from_keys([]))
    # a strided view cannot be passed zero-copy: it is copied, same keys
    both = np.repeat(np.array(TOKENS, dtype=np.int32), 2)[::2]
    assert hasher.hash(both) == want


def test_bad_tokens_raise(hasher):
    with pytest.raises(ValueError):
        hasher.hash([1, -2, 3])
    with pytest.raises(ValueError):
        hasher.hash(np.array([2**33], dtype=np.int64))


def test_numpy_view_of_keys_is_zero_copy(hasher):
    keys = hasher.hash(TOKENS)
    view = keys.numpy()
    assert [int(x) for x in view["lo"]] == keys.lo
    assert [int(x) for x in view["hi"]] == [k.hi for k in keys]
    assert np.shares_memory(view, keys.numpy())


def test_chain_any_split_equals_one_shot(hasher):
    want = hasher.hash(TOKENS)
    c = kvplane.Chain(hasher, keep_digests=True)
    added = 0
    for start, stop in ((0, 5), (5, 300), (300, 301), (301, 1000)):
        added += c.extend(np.array(TOKENS[start:stop], dtype=np.int32))
    assert added == len(c) == len(want) and c.keys == want
    assert c.tokens == 1000 and c.tail == 1000 % 16
    assert c.digest(0)[-8:] == want[0].lo.to_bytes(8, "big")
    c.reset()
    assert len(c) == 0 and c.tokens == 0


def test_errors_carry_code_name_and_message(ns):
    with pytest.raises(kvplane.InvalidArgumentError) as e:
        kvplane.Namespace("m", 0)
    assert e.value.code == -4001 and e.value.name == "KVP_EINVAL"
    assert e.value.message == kvplane.strerror(-4001) == "invalid argument"
    assert isinstance(e.value, kvplane.KvplaneError) and isinstance(e.value, ValueError)
    with pytest.raises(kvplane.KvplaneError) as e:  # xxhash needs a seed
        kvplane.Hasher(ns, kvplane.HashAlgo.VLLM_XXHASH)
    assert e.value.code == -4001
    with pytest.raises(ValueError):
        kvplane.Chain(kvplane.Hasher(ns), chunk_tokens=[64]).chunk_keys(256)
    assert kvplane.err_name(-2) == "ENOENT"


def test_algo_names(ns):
    assert kvplane.HashAlgo.from_vllm("sha256") == kvplane.HashAlgo.VLLM_SHA256
    assert kvplane.HashAlgo.parse("xxhash_cbor").digest_len == 16
    assert kvplane.HashAlgo.SHA256.label == "sha256"
    assert kvplane.Hasher(ns, "sha256").algo == kvplane.HashAlgo.SHA256


def test_stability_learns_stable_prefix(hasher):
    st = kvplane.Stability(capacity=1 << 12)
    system = TOKENS[:64]
    for s in range(4):
        keys = hasher.hash(system + [10_000 + s] * 32)
        cls = st.observe(f"session-{s}", keys, block_size=16)
    assert cls.n_blocks == 6 and cls.stable_end == 4  # 64 shared tokens
    assert cls.classes()[:4] == [kvplane.StabilityClass.STABLE] * 4
    assert cls.tokens[kvplane.StabilityClass.STABLE] == 64 and len(st) > 0
    marked = st.observe(99, keys, 16, marks=[kvplane.SegmentMark(0, 96, kvplane.Role.USER)])
    assert marked.stable_end == 0 and marked.learned_blocks == 0


def test_drift_report(hasher):
    prev = TOKENS[:160]
    cur = TOKENS[:32] + [5] * 16 + TOKENS[32:160]  # 16 tokens inserted at 32
    rep = kvplane.drift_compare(kvplane.Turn(hasher.hash(prev), prev),
                                kvplane.Turn(hasher.hash(cur), cur), 16)
    assert rep.first_diverging_block == 2 and rep.common_prefix_tokens == 32
    assert rep.lost_tokens == 128 and rep.reappearing_tokens == 128
    assert rep.shifted_tokens == 128  # all found 16 tokens later


def test_hashing_releases_the_gil(ns):
    """A Python thread keeps counting while one long C call hashes 4M
    tokens: cffi (API mode) releases the GIL around every call.  With the
    GIL held the counter could not move during the call."""
    big = np.arange(4_000_000, dtype=np.int32)
    done, ticks = threading.Event(), [0]

    def count():
        while not done.is_set():
            ticks[0] += 1
    t = threading.Thread(target=count)
    t.start()
    try:
        with kvplane.Hasher(ns, "sha256") as h:
            moved = []
            for _ in range(3):
                before = ticks[0]
                h.hash(big)
                moved.append(ticks[0] - before)
    finally:
        done.set()
        t.join()
    assert max(moved) > 1000, moved
