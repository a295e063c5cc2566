#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The emulated vLLM workers' KV events (kvplane-bench engine, issue 15)
read with vLLM 0.33.0's REAL consumer types: every batch published (PUB and
replay alike) decodes with msgspec into vllm.distributed.kv_events.
KVEventBatch and re-encodes to the same bytes (the wire format is vLLM's to
the byte); every stored block hash is vLLM's own sha256_cbor chain of the
tokens sent (NONE_HASH from vLLM's default seed, int form), with its parent
and its token ids -- a request's cache_salt included, on block 0, as vLLM
0.33 hashes it -- and carries extra_keys as vLLM 0.33's cache_full_blocks
publishes them (one entry per block: (salt,) on a salted prompt's block 0,
None elsewhere); a LoRA adapter's blocks (--lora, vLLM's --lora-modules)
hash ("lora", name, path) into every block, as vLLM 0.33 does, and carry
lora_name, lora_id and the name first in each block's extra_keys; the
residency the events describe is the worker's.

usage: run.sh test_live_engine.py BENCH
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec
import zmq

import capture_corpus
import vllm_hashes
import vllm_tree

BS = 16
LORA = ("sql-adapter", "/loras/sql")
END = (-1).to_bytes(8, "big", signed=True)


def fail(msg):
    raise SystemExit("FAIL: " + msg)


def start(bench, tmp):
    ready = os.path.join(tmp, "ready.json")
    p = subprocess.Popen([bench, "engine", "--workers", "1", "--block-size",
                          str(BS), "--hbm-blocks", "16", "--time-scale",
                          "1000", "--ready-file", ready,
                          "--lora", "%s=%s" % LORA],
                         stdout=subprocess.DEVNULL)
    for _ in range(300):
        if os.path.exists(ready):
            with open(ready) as f:
                return p, json.load(f)["workers"][0]
        time.sleep(0.02)
    p.kill()
    fail("engine not ready")


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def prompts():
    """(tokens, cache salt, LoRA): a shared system prefix, a few sessions
    growing turn by turn, two of them salted (tenants), one on the adapter
    (salted too: the name comes before the salt on block 0)."""
    system = list(range(500, 500 + 3 * BS))
    out = []
    for turn in range(4):
        for s in range(4):
            hist = [1000 + 100 * s + t for t in range((turn + 1) * 2 * BS)]
            out.append((system + hist + [7] * 5, [None, "tenant-a", "tenant-b", "tenant-a"][s],
                        LORA if s == 3 else None))
    return out


def replay_all(ctx, ep):
    d = ctx.socket(zmq.DEALER)
    d.connect(ep)
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    got = {}
    while d.poll(5000):
        f = d.recv_multipart()
        if f[2] == END:
            break
        got[int.from_bytes(f[2], "big")] = f[3]
    d.close(linger=0)
    return got


def expected_blocks(sent):
    """u64 -> (tokens, parent u64 or None), from vLLM's own hash chain."""
    exp = {}
    for toks, salt, lora in sent:
        ch = vllm_hashes.chain("sha256_cbor", None, toks, BS, lora=lora, salt=salt)
        prev = None
        for i, b in enumerate(ch["blocks"]):
            exp[b["external_u64"]] = (toks[i * BS:(i + 1) * BS], prev,
                                      b["event_extra_keys"], lora)
            prev = b["external_u64"]
    return exp


def check_batches(kv, payloads, exp):
    dec = msgspec.msgpack.Decoder(kv.KVEventBatch)
    resident, stored, removed, salted, adapted = set(), 0, 0, 0, 0
    for seq in sorted(payloads):
        p = payloads[seq]
        batch = dec.decode(p)  # vLLM's own consumer type
        if msgspec.msgpack.encode(batch) != p:
            fail("seq %d: vLLM re-encodes the batch to other bytes:\n%s\n%s"
                 % (seq, p.hex(), msgspec.msgpack.encode(batch).hex()))
        for e in batch.events:
            if isinstance(e, kv.BlockStored):
                if e.medium != "GPU" or e.block_size != BS:
                    fail("medium/block_size %r" % e)
                parent = e.parent_block_hash
                if e.extra_keys is None or \
                        len(e.extra_keys) != len(e.block_hashes):
                    fail("seq %d: extra_keys %r, want one entry per block" %
                         (seq, e.extra_keys))
                for i, h in enumerate(e.block_hashes):
                    toks, want_parent, want_x, lora = exp.get(h, (None,) * 4)
                    if toks is None:
                        fail("seq %d: %d is no sha256_cbor hash of a prompt "
                             "sent" % (seq, h))
                    if list(e.token_ids[i * BS:(i + 1) * BS]) != toks:
                        fail("seq %d: tokens of %d" % (seq, h))
                    if parent != want_parent:
                        fail("seq %d: parent of %d is %r, want %r" %
                             (seq, h, parent, want_parent))
                    if e.extra_keys[i] != want_x:
                        fail("seq %d: extra_keys of %d are %r, want %r" %
                             (seq, h, e.extra_keys[i], want_x))
                    if (e.lora_name, e.lora_id) != ((lora[0], 1) if lora else (None, None)):
                        fail("seq %d: lora_name/lora_id of %d are %r/%r, want %r" %
                             (seq, h, e.lora_name, e.lora_id, lora))
                    salted += want_x is not None and lora is None
                    adapted += lora is not None
                    parent = h
                    resident.add(h)
                    stored += 1
            elif isinstance(e, kv.BlockRemoved):
                resident.difference_update(e.block_hashes)
                removed += len(e.block_hashes)
            else:
                fail("unexpected event %r" % e)
    if salted == 0:
        fail("no salted block 0 published")
    if adapted == 0:
        fail("no LoRA adapter's block published")
    return resident, stored, removed


def main():
    bench = sys.argv[1]
    kv, _ = vllm_tree.load()
    tmp = tempfile.mkdtemp(prefix="kvp-live-vllm-")
    eng, w = start(bench, tmp)
    try:
        ctx = zmq.Context()
        # ZeroMQ's slow joiner: send only once the handshake with the PUB
        # is done (the subscription follows it on the same connection)
        sub = capture_corpus.connect_sub(ctx, w["kv_events"])
        sent = prompts()
        for toks, salt, lora in sent:
            body = {"prompt": toks, "max_tokens": 2}
            if salt:
                body["cache_salt"] = salt
            if lora:
                body["model"] = lora[0]
            post(w["url"] + "/v1/completions", body)
        live = {}
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            if topic != b"":
                fail("topic %r" % topic)
            live[int.from_bytes(seq, "big")] = payload
        replayed = replay_all(ctx, w["kv_replay"])
        if sorted(live) != list(range(len(live))) or not live:
            fail("PUB seqs not 0..n-1: %r" % sorted(live)[:10])
        if replayed != live:
            fail("replay differs from the PUB stream (%d vs %d batches)" %
                 (len(replayed), len(live)))
        resident, stored, removed = check_batches(kv, live, expected_blocks(sent))
        with urllib.request.urlopen(w["url"] + "/kvplane/cache") as r:
            cache = {h & (2 ** 64 - 1)
                     for h in json.loads(r.read())["resident"]["GPU"]}
        if resident != cache:
            fail("events say %d blocks, the worker holds %d" %
                 (len(resident), len(cache)))
        if removed == 0:
            fail("no eviction exercised")
        print("PASS: %d batches, %d blocks stored, %d removed, all vLLM "
              "sha256_cbor chains; vLLM's KVEventBatch re-encodes every "
              "payload byte for byte" % (len(live), stored, removed))
        sub.close(linger=0)
        ctx.term()
    finally:
        eng.terminate()
        eng.wait(10)


if __name__ == "__main__":
    main()
