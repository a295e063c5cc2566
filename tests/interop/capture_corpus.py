#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Captures real KV-event payloads from vLLM 0.33.0's ZmqEventPublisher (the
msgpack bytes of frame 3 of each PUB message) into tests/fuzz/corpus/events/,
one small file per case: the seed corpus of the C decoder's fuzz target.

usage: capture_corpus.py [--out DIR]      (default tests/fuzz/corpus/events)

Each batch goes through the real publisher (publish() -> its thread ->
msgspec encode -> PUB); the file holds the bytes a plain SUB received, and
they must equal what the ROUTER replays for that seq and decode with vLLM's
own KVEventBatch type.  ts is fixed, so the files are reproducible.
Two files are not published, since publish() always sets data_parallel_rank:
dp_rank_nil, a KVEventBatch with rank None through the publisher's encoder
([ts, events, nil]: msgspec writes every field of an array_like struct,
omit_defaults or not), and dp_rank_absent, those bytes with the array header
made 2 and the nil cut ([ts, events]: the pre-DP wire form).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

import vllm_hashes
import vllm_tree

ROOT = vllm_tree.ROOT
TS = 1767225600.125  # fixed: reproducible files


def cases(kv):
    """[(name, KVEventBatch)]: hashes are real chains (vllm_hashes)."""
    S, R, C = kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared
    toks = list(range(1000, 1000 + 64))
    sha = vllm_hashes.chain("sha256", None, toks, 16)  # 0.33's default algo
    d = [bytes.fromhex(b["hash_hex"]) for b in sha["blocks"]]
    u = [b["external_u64"] for b in sha["blocks"]]
    xx = vllm_hashes.chain("xxhash_cbor", "0", toks[:32], 16)
    x16 = [bytes.fromhex(b["hash_hex"]) for b in xx["blocks"]]
    lora = vllm_hashes.chain("sha256", None, toks[:32], 16, ("adapter3", "/loras/a3"))
    mm = vllm_hashes.chain("sha256_cbor", None, toks[:48], 16, ("adapter1", "/l/a1"),
                           "tenant-salt", [vllm_hashes.MM("9f86d081884c7d65", 5, 30)])
    ek = lambda c: [b["event_extra_keys"] for b in c["blocks"]]  # noqa: E731
    ints = lambda c: [b["external_u64"] for b in c["blocks"]]  # noqa: E731

    def stored(hashes, parent, ntok, **kw):
        base = dict(block_hashes=hashes, parent_block_hash=parent,
                    token_ids=toks[:ntok], block_size=16, lora_id=None,
                    medium="GPU", lora_name=None, extra_keys=[None] * len(hashes),
                    group_idx=0)
        base.update(kw)
        return S(**base)

    def b(*evs, dp=None):
        return kv.KVEventBatch(ts=TS, events=list(evs), data_parallel_rank=dp)

    return [
        ("stored_int_gpu", b(stored(u[:2], None, 32))),
        ("stored_int_parent_cpu", b(stored(u[2:4], u[1], 32, medium="CPU"))),
        ("stored_int_u64_edges", b(stored([(1 << 64) - 1, 1 << 63, 0, 1, 2], (1 << 63) - 1, 80))),
        ("stored_bytes_sha256", b(stored(d[:3], None, 48))),
        ("stored_bytes_parent", b(stored(d[3:4], d[2], 16))),
        ("stored_bytes_xxhash16", b(stored(x16, None, 32))),
        ("stored_lora", b(stored(ints(lora), None, 32, lora_id=3, lora_name="adapter3",
                                 extra_keys=ek(lora)))),
        ("stored_mm_salt_lora", b(stored(ints(mm), None, 48, lora_id=1, lora_name="adapter1",
                                         extra_keys=ek(mm)))),
        ("stored_extra_keys_none", b(stored(u[:1], None, 16, extra_keys=None))),
        ("stored_spec_fields", b(stored(u[:2], None, 32, group_idx=1,
                                        kv_cache_spec_kind="sliding_window",
                                        kv_cache_spec_sliding_window=4096,
                                        locality="LOCAL", ownership="tier-a",
                                        session_id="session-42",
                                        lookahead_token_ids=[[7, 8], [9, 10]]))),
        ("stored_medium_nil", b(stored(u[:1], None, 16, medium=None))),
        ("stored_block_size_64", b(stored(u[3:4], None, 64, block_size=64))),
        ("removed_int", b(R(block_hashes=[u[1]], medium="GPU", group_idx=0))),
        ("removed_bytes_cpu", b(R(block_hashes=d[:2], medium="CPU", group_idx=2,
                                  locality="REMOTE", ownership="tier-b"))),
        ("removed_medium_nil", b(R(block_hashes=[u[0]], medium=None))),
        ("cleared", b(C())),
        ("empty_batch", b()),
        ("mixed_dp3", b(stored(u[:2], None, 32), R(block_hashes=[u[1]], medium="GPU",
                                                   group_idx=0),
                        C(), stored(d[:1], None, 16, medium="CPU"), dp=3)),
        ("batch_16_stored", b(*[stored(u[i % 4:i % 4 + 1], u[i % 4 - 1] if i % 4 else None,
                                       16, medium=("GPU", "CPU")[i % 2]) for i in range(16)])),
    ]


def connect_sub(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    if not mon.poll(30000):  # slow under sanitizers
        raise SystemExit(f"capture_corpus: no connection to {endpoint}")
    recv_monitor_message(mon)
    sub.disable_monitor()
    mon.close(linger=0)
    time.sleep(0.2)  # the subscription follows the handshake
    return sub


def replay_all(ctx, endpoint):
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = {}
    while dealer.poll(5000):
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            dealer.close(linger=0)
            return out
        out[int.from_bytes(seq, "big")] = payload
    raise SystemExit("capture_corpus: replay did not end")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fuzz", "corpus", "events"))
    a = ap.parse_args()
    kv, _ = vllm_tree.load()
    tmp = tempfile.mkdtemp(prefix="kvpc-", dir="/tmp")
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp}/pub",
                               replay_endpoint=f"ipc://{tmp}/replay")
    ctx = zmq.Context.instance()
    sub = connect_sub(ctx, f"ipc://{tmp}/pub")
    todo = cases(kv)
    for _, batch in todo:
        pub.publish(batch)
    got = {}
    while len(got) < len(todo) and sub.poll(5000):
        topic, seq, payload = sub.recv_multipart()
        got[int.from_bytes(seq, "big")] = payload
    replayed = replay_all(ctx, f"ipc://{tmp}/replay")
    pub.shutdown()
    sub.close(linger=0)
    if len(got) != len(todo):
        raise SystemExit(f"capture_corpus: the SUB got {len(got)} of {len(todo)} batches")
    dec = msgspec.msgpack.Decoder(kv.KVEventBatch)
    os.makedirs(a.out, exist_ok=True)
    files = []
    for seq, (name, batch) in enumerate(todo):
        p = got[seq]
        if replayed.get(seq) != p:
            raise SystemExit(f"capture_corpus: {name}: replayed bytes differ from PUB's")
        back = dec.decode(p)  # vLLM's own type accepts it, and re-encodes it
        assert msgspec.msgpack.encode(back) == p, name
        assert len(back.events) == len(batch.events), name
        files.append((name, p))
    # not published (see the docstring): rank None through the publisher's
    # encoder -> [ts, events, nil]; msgspec writes every field of an
    # array_like struct, omit_defaults notwithstanding
    enc = msgspec.msgpack.Encoder().encode(
        kv.KVEventBatch(ts=TS, events=[kv.BlockRemoved(block_hashes=[7], medium="GPU")]))
    assert enc[0] == 0x93 and enc[-1] == 0xC0 and msgspec.msgpack.decode(enc)[2] is None
    files.append(("dp_rank_nil", enc))
    # the same bytes as a 2-element array, the pre-DP wire form
    files.append(("dp_rank_absent", b"\x92" + enc[1:-1]))
    assert dec.decode(files[-1][1]).data_parallel_rank is None
    for name, p in files:
        with open(os.path.join(a.out, name + ".msgpack"), "wb") as f:
            f.write(p)
        print(f"  {len(p):5d} B  {name}.msgpack")
    print(f"capture_corpus: {len(files)} files in {a.out} "
          f"({sum(len(p) for _, p in files)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
