#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TEST ORACLE -- not kvplane.  A reference vLLM KV-event subscriber in Python
(pyzmq + msgspec) with the command line and output of the future
`kvplane events tail`, so tests/interop/test_vllm_events.py can be proven now
and pointed at the C tool later by changing one argument.  It decodes the
wire format on its own (generic msgpack, no vLLM classes): it is a second
reading of vLLM's format, not a copy of the publisher.

usage: oracle_tail.py [--index] [--json] [--replay ENDPOINT] [--max-batches N]
                      [--idle-ms MS] [--replay-timeout-ms MS] ENDPOINT

It connects a SUB to ENDPOINT (all topics) and, with --replay, a DEALER to the
publisher's ROUTER.  Output on stdout, flushed after every batch:
  --json   one object per event, in the order applied:
           {"seq", "type", "medium", "block_hashes", "parent_block_hash",
            "token_count"}   (ints as JSON ints, digests as lowercase hex)
  --index  then one line {"resident": {"GPU": [...], "CPU": [...]}}: the
           hashes resident per medium, ints ascending then hex ascending
  always   last line {"stats": {...}}
Exit 0 after N batches were applied (--max-batches) or after MS ms without
news (--idle-ms, default 2000), 2 bad usage, 1 a socket error.

Sequence rules (the contract tests/interop/README.md states for the C tool):
  * a batch is identified by (seq, payload bytes); batches are applied in seq
    order, each once; seq L is the last applied, H remembers what was applied
  * live seq L+1: apply.  seq <= L with the payload applied at that seq: a
    duplicate (replay and live overlap), dropped.  Anything else -- a gap,
    a different batch at an old seq, any message after the SUB's connection
    dropped (ZMQ monitor: the publisher may have restarted) -- resyncs
  * resync = replay from L (from 0 when nothing is applied): the first batch
    back must be (L, the payload applied at L); then what follows is applied.
    First seq > L: the buffer no longer holds what was missed -> drop this
    worker's residency and apply what came back, from empty.  Nothing at L
    or another payload at L: the publisher restarted -> drop, replay from 0,
    apply from empty.  A live batch that the resync did not cover is stale
    (an older publisher's) and dropped.
  * idle for MS ms: with --replay, one resync as a probe (it catches a lost
    tail and a restart that published nothing live); exit when it brought
    nothing new.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIA_ALWAYS = ("GPU", "CPU")
HISTORY = 1 << 16  # payload digests kept for the duplicate check


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def hjson(h):
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


def sort_key(h):
    return (1, h.hex(), 0) if isinstance(h, (bytes, bytearray)) else (0, "", h)


class Tail:
    def __init__(self, a):
        self.a = a
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.mon = self.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sub.connect(a.endpoint)
        self.dealer = None
        if a.replay:
            self._new_dealer()
        self.L = None               # last applied seq
        self.hist: dict[int, bytes] = {}
        self.resident: dict[str, set] = {m: set() for m in MEDIA_ALWAYS}
        self.need_verify = False
        self.applied = 0
        self.stats = dict(batches=0, events=0, batches_replayed=0, replays=0,
                          replay_failures=0, gaps=0, restarts=0,
                          residency_drops=0, duplicates=0, stale=0,
                          disconnects=0, decode_errors=0, unknown_events=0)

    def _new_dealer(self):
        if self.dealer is not None:
            self.dealer.close(linger=0)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(self.a.replay)

    def done(self) -> bool:
        return self.a.max_batches is not None and self.applied >= self.a.max_batches

    # ---- applying ----------------------------------------------------------
    def apply(self, seq: int, payload: bytes, replayed: bool):
        lines = []
        try:
            batch = msgspec.msgpack.decode(payload)
            if not isinstance(batch, list) or len(batch) not in (2, 3) or \
               not isinstance(batch[1], list):
                raise ValueError("not [ts, events, dp_rank?]")
            for ev in batch[1]:
                lines.append(self.apply_event(seq, ev))
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as e:
            # counted; the batch still advances the sequence (a resync would
            # only fetch the same bytes again)
            print(f"oracle_tail: seq {seq}: undecodable batch: {e}", file=sys.stderr)
            self.stats["decode_errors"] += 1
        self.L = seq
        self.hist[seq] = digest(payload)
        if len(self.hist) > HISTORY:
            del self.hist[next(iter(self.hist))]
        self.applied += 1
        self.stats["batches"] += 1
        self.stats["batches_replayed"] += replayed
        if self.a.json:
            for line in lines:
                if line is not None:
                    sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()

    def apply_event(self, seq: int, ev: dict):
        t = ev["type"]
        self.stats["events"] += 1
        medium = ev.get("medium")
        out = {"seq": seq, "type": t, "medium": medium, "block_hashes": [],
               "parent_block_hash": None, "token_count": 0}
        if t == "BlockStored":
            hashes = ev["block_hashes"]
            self.resident.setdefault(medium or "GPU", set()).update(hashes)
            out.update(block_hashes=[hjson(h) for h in hashes],
                       parent_block_hash=hjson(ev.get("parent_block_hash")),
                       token_count=len(ev.get("token_ids") or ()))
        elif t == "BlockRemoved":
            hashes = ev["block_hashes"]
            self.resident.setdefault(medium or "GPU", set()).difference_update(hashes)
            out.update(block_hashes=[hjson(h) for h in hashes])
        elif t == "AllBlocksCleared":
            for s in self.resident.values():
                s.clear()
        else:
            self.stats["unknown_events"] += 1
            return None
        return out

    def drop(self):
        """Forget this worker: residency, sequence, history."""
        if any(self.resident.values()) or self.L is not None:
            self.stats["residency_drops"] += 1
        for s in self.resident.values():
            s.clear()
        self.L = None
        self.hist.clear()

    # ---- replay ------------------------------------------------------------
    def replay(self, start: int):
        """[(seq, payload)] for seq >= start, or None (no answer, 3 tries)."""
        timeout = self.a.replay_timeout_ms / 1000
        for _ in range(3):
            self.stats["replays"] += 1
            self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out, deadline = [], time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.dealer.poll(int(left * 1000) + 1):
                    break
                f = self.dealer.recv_multipart()
                if len(f) != 4:
                    self.stats["decode_errors"] += 1
                    continue
                if f[2] == END_SEQ:
                    return out
                out.append((int.from_bytes(f[2], "big"), f[3]))
            # no end marker in time: a fresh socket, so a late answer to this
            # request cannot be taken for the answer to the next one
            self._new_dealer()
        self.stats["replay_failures"] += 1
        return None

    def apply_run(self, got, after=None) -> int:
        """Applies got's batches with seq > after, in order, contiguous."""
        n = 0
        for seq, payload in got:
            if self.done():
                break
            if after is not None and seq <= after:
                continue
            if self.L is not None and seq != self.L + 1:
                break  # cannot happen with one publisher's buffer
            self.apply(seq, payload, replayed=True)
            n += 1
        return n

    def resync(self) -> int:
        """Returns how many batches it applied plus 1 if it dropped state."""
        if self.L is None:
            got = self.replay(0)
            return 0 if got is None else self.apply_run(got)
        L = self.L
        got = self.replay(L)
        if got is None:
            return 0
        if got and got[0][0] == L and digest(got[0][1]) == self.hist.get(L):
            return self.apply_run(got, after=L)
        if got and got[0][0] > L:
            # the publisher no longer holds L+1 .. got[0]-1: whatever they
            # removed may still be in our sets; forget and rebuild from here
            self.stats["gaps"] += 1
            self.drop()
            return 1 + self.apply_run(got)
        self.stats["restarts"] += 1
        self.drop()
        got = self.replay(0)
        return 1 + (0 if got is None else self.apply_run(got))

    # ---- live --------------------------------------------------------------
    def check_monitor(self):
        while self.mon.poll(0):
            ev = recv_monitor_message(self.mon)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self.stats["disconnects"] += 1
                self.need_verify = True

    def on_live(self, seq: int, payload: bytes):
        if self.need_verify and self.dealer is not None:
            self.need_verify = False
            self.resync()
        if self.L is None and (seq == 0 or self.dealer is None):
            self.apply(seq, payload, replayed=False)
            return
        if self.L is not None and seq == self.L + 1:
            self.apply(seq, payload, replayed=False)
            return
        if self.L is not None and seq <= self.L and self.hist.get(seq) == digest(payload):
            self.stats["duplicates"] += 1
            return
        if self.dealer is None:
            # no replay: a regression is a restart, a jump a loss; both leave
            # only what follows trustworthy
            self.stats["restarts" if self.L is not None and seq <= self.L else "gaps"] += 1
            self.drop()
            self.apply(seq, payload, replayed=False)
            return
        if self.L is not None and seq > self.L + 1:
            self.stats["gaps"] += 1
        self.resync()
        if self.L is None or seq > self.L or self.hist.get(seq) != digest(payload):
            self.stats["stale"] += 1

    def run(self) -> int:
        idle = self.a.idle_ms / 1000
        if self.dealer is not None:
            self.resync()
        last = time.monotonic()
        while not self.done():
            self.check_monitor()
            left = last + idle - time.monotonic()
            if left <= 0:
                if self.dealer is not None and self.resync() > 0:
                    last = time.monotonic()
                    continue
                break
            if not self.sub.poll(min(int(left * 1000) + 1, 100)):
                continue
            frames = self.sub.recv_multipart()
            self.check_monitor()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["decode_errors"] += 1
            else:
                self.on_live(int.from_bytes(frames[1], "big"), frames[2])
            last = time.monotonic()
        if self.a.index:
            res = {m: [hjson(h) for h in sorted(s, key=sort_key)]
                   for m, s in self.resident.items() if s or m in MEDIA_ALWAYS}
            sys.stdout.write(json.dumps({"resident": res}) + "\n")
        sys.stdout.write(json.dumps({"stats": self.stats}) + "\n")
        sys.stdout.flush()
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="TEST ORACLE: reference vLLM "
                                 "KV-event subscriber (the CLI of `kvplane events tail`)")
    ap.add_argument("endpoint")
    ap.add_argument("--index", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--replay")
    ap.add_argument("--max-batches", type=int)
    ap.add_argument("--idle-ms", type=int, default=2000)
    ap.add_argument("--replay-timeout-ms", type=int, default=2000)
    a = ap.parse_args()  # exits 2 on bad usage
    if (a.max_batches is not None and a.max_batches < 1) or a.idle_ms < 1:
        ap.error("--max-batches and --idle-ms must be positive")
    try:
        t = Tail(a)
        return t.run()
    except zmq.ZMQError as e:
        print(f"oracle_tail: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
