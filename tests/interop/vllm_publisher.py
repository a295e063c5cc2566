#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Drives vLLM 0.33.0's REAL ZmqEventPublisher (vllm/distributed/kv_events.py
from the wheel, loaded by vllm_tree.py) through one seeded scenario, runs a
subscriber against it, and writes what the subscriber must end up with.

usage: vllm_publisher.py --scenario S --transport {ipc,tcp} --hashes {int,bytes}
           --seed N --expected FILE [--log FILE] [--subscriber CMD]
           [--sub-out FILE] [--idle-ms MS] [--timeout S]

The events are what a vLLM block pool publishes: BlockStored runs of prompt
chains (parent hashes, token_ids of n_blocks*16, medium GPU or CPU, LoRA,
multimodal and cache-salt extra keys in the untagged event form, group_idx 0;
the hashes computed by the real vllm/utils/hashing.py with a random one of
sha256, sha256_cbor, xxhash, xxhash_cbor), BlockRemoved of resident blocks and
sometimes of never-stored hashes, and AllBlocksCleared.  --hashes int publishes
the low 64 bits (vLLM's default), bytes the raw digests.

Scenarios (expected residency = sets of hashes per medium; a store of a
resident hash is a no-op, a removal removes it whatever came before,
AllBlocksCleared empties every medium):
  normal        subscriber first, then n batches; expected: all n
  late          n/2 batches sent (and drained) before the subscriber starts,
                2 more as it starts, the rest once it printed the first half:
                it must recover the first half by replay
  loss          PUB goes through a proxy here that drops a seq range (and,
                for odd seeds, the last batch: only an idle probe finds that);
                the subscriber replays from the real ROUTER; expected: all n
  small_buffer  buffer_steps B=4; a <= B batches pass, then the proxy drops
                seqs a .. n-2 and passes n-1 (n-B > a).  When the subscriber
                asks for a, the publisher holds only n-B .. n-1: expected =
                those B batches applied to an EMPTY worker (the subscriber
                must forget what it had: a block stored before the gap may
                have been removed in it); printed: 0 .. a-1, then n-B .. n-1
  restart       k batches, then shutdown() and a NEW ZmqEventPublisher on the
                same endpoints (seq from 0 again) that sends m batches after
                0.4 s; expected: only the new publisher's m batches
  restart_fast  as restart, the new one sends m > k batches at once (the
                subscriber may see seq k.. of the new publisher first)
Scenarios are generated so that both media end with blocks and each wrong
answer named above (no replay, no drop, no restart detection) gives a
residency other than the expected one.

With --subscriber CMD the subscriber is started as
    CMD --index --json --replay REPLAY [--max-batches N] --idle-ms MS ENDPOINT
(--max-batches for normal/late/loss: n; the others end on --idle-ms); its
stdout is read live (the harness waits for given seqs to be printed before
the next phase: lines must be flushed per batch) and saved to --sub-out; the
publishers stay up, serving replay, until it exits (or --timeout: killed).
Without --subscriber, the endpoints and that command are printed, phases are
--pause seconds apart and the publisher stays up until --stop-file appears
or SIGINT/SIGTERM.

--expected gets one line, the exact output of `events tail --index`:
    {"resident": {"GPU": [...], "CPU": [...]}}  ints ascending, else hex
--log gets the whole run as JSON: endpoints, every published batch (as the
--json event lines), the seqs the subscriber must print (expect_runs), what
the proxy dropped, the subscriber's exit status.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

import vllm_hashes
from testports import free_port  # below the ephemeral range (see there)
import vllm_tree

BS = 16
SCENARIOS = ("normal", "late", "loss", "small_buffer", "restart", "restart_fast")
SMALL_B = 4
RESTART_PAUSE = 0.4


# ---- hashes and residency ---------------------------------------------------
def hjson(h):
    return h.hex() if isinstance(h, (bytes, bytearray)) else h


def sort_key(h):
    return (1, h.hex(), 0) if isinstance(h, (bytes, bytearray)) else (0, "", h)


def summary(ev) -> dict:
    """An event as `events tail --json` prints it (without seq)."""
    t = type(ev).__name__
    out = {"type": t, "medium": getattr(ev, "medium", None), "block_hashes": [],
           "parent_block_hash": None, "token_count": 0}
    if t in ("BlockStored", "BlockRemoved"):
        out["block_hashes"] = [hjson(h) for h in ev.block_hashes]
    if t == "BlockStored":
        out["parent_block_hash"] = hjson(ev.parent_block_hash)
        out["token_count"] = len(ev.token_ids)
    return out


def residency(batches) -> dict:
    """Applies batches (lists of events) to an empty worker."""
    res = {"GPU": set(), "CPU": set()}
    for evs in batches:
        for ev in evs:
            t = type(ev).__name__
            if t == "BlockStored":
                res.setdefault(ev.medium or "GPU", set()).update(ev.block_hashes)
            elif t == "BlockRemoved":
                res.setdefault(ev.medium or "GPU", set()).difference_update(ev.block_hashes)
            elif t == "AllBlocksCleared":
                for s in res.values():
                    s.clear()
    return res


def residency_json(res: dict) -> dict:
    return {"resident": {m: [hjson(h) for h in sorted(s, key=sort_key)]
                         for m, s in res.items() if s or m in ("GPU", "CPU")}}


# ---- the scenario's events --------------------------------------------------
class Prompt:
    def __init__(self, tokens, hashes, keys, lora, salt, mm):
        self.tokens, self.hashes, self.keys, self.lora = tokens, hashes, keys, lora
        self.salt, self.mm = salt, mm


class Gen:
    """Seeded events as a vLLM block pool emits them; keeps the truth."""

    def __init__(self, kv, rng: random.Random, form: str):
        self.kv, self.rng, self.form = kv, rng, form
        self.algo = rng.choice(vllm_hashes.ALGOS)
        self.pyseed = str(rng.randrange(1 << 31)) if rng.random() < 0.5 or \
            self.algo in vllm_hashes.NON_CRYPTO else None
        self.prompts: list[Prompt] = []
        self.res = {"GPU": set(), "CPU": set()}
        self.allow_clear = True

    def new_prompt(self) -> Prompt:
        rng = self.rng
        base = rng.choice(self.prompts) if self.prompts and rng.random() < 0.5 else None
        if base is not None:  # shares a prefix with an earlier prompt
            share = rng.randint(1, len(base.hashes))
            tokens, lora = base.tokens[:share * BS], base.lora
            salt, mm = base.salt, base.mm
        else:
            tokens = []
            lora = None
            if rng.random() < 0.25:
                n = rng.randint(1, 3)
                lora = (f"adapter{n}", f"/loras/adapter{n}", n)
            salt = f"salt-{rng.randrange(100)}" if rng.random() < 0.15 else None
            mm = []
        nblocks = len(tokens) // BS + rng.randint(1, 6)
        if base is None and rng.random() < 0.25:
            off = rng.randrange(nblocks * BS)
            for _ in range(rng.randint(1, 2)):
                length = rng.randint(4, 40)
                mm.append(vllm_hashes.MM(f"{rng.getrandbits(64):016x}", off, length))
                off += length + rng.randint(0, 20)
            nblocks = max(nblocks, -(-off // BS))
        tokens = tokens + [rng.randrange(152064) for _ in range(nblocks * BS - len(tokens))]
        c = vllm_hashes.chain(self.algo, self.pyseed, tokens, BS,
                              lora[:2] if lora else None, salt, mm)
        digests = [bytes.fromhex(b["hash_hex"]) for b in c["blocks"]]
        hashes = [vllm_hashes.external_u64(d) if self.form == "int" else d for d in digests]
        p = Prompt(tokens, hashes, [b["event_extra_keys"] for b in c["blocks"]], lora,
                   salt, mm)
        self.prompts.append(p)
        return p

    def random_hash(self):
        return self.rng.getrandbits(64) if self.form == "int" else self.rng.randbytes(
            len(self.prompts[0].hashes[0]) if self.prompts else 32)

    def stored(self):
        rng = self.rng
        p = self.new_prompt() if not self.prompts or rng.random() < 0.35 else \
            rng.choice(self.prompts)
        medium = "GPU" if rng.random() < 0.75 else "CPU"
        nb = len(p.hashes)
        i = rng.randrange(nb)
        j = rng.randint(i + 1, min(nb, i + 6))
        hashes = p.hashes[i:j]
        self.res[medium].update(hashes)
        return self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=p.hashes[i - 1] if i else None,
            token_ids=p.tokens[i * BS:j * BS], block_size=BS,
            lora_id=p.lora[2] if p.lora else None, medium=medium,
            lora_name=p.lora[0] if p.lora else None,
            extra_keys=p.keys[i:j], group_idx=0)

    def removed(self):
        rng = self.rng
        medium = "GPU" if rng.random() < 0.7 else "CPU"
        held = sorted(self.res[medium], key=sort_key)
        pick = rng.sample(held, min(len(held), 1 if rng.random() < 0.6 else rng.randint(2, 4)))
        if not pick or rng.random() < 0.25:
            pick.append(self.random_hash())  # never stored: a no-op
        self.res[medium].difference_update(pick)
        return self.kv.BlockRemoved(block_hashes=pick, medium=medium, group_idx=0)

    def batch(self) -> list:
        evs = []
        for _ in range(self.rng.randint(1, 4)):
            r = self.rng.random()
            if r < 0.012 and self.allow_clear:
                for s in self.res.values():
                    s.clear()
                evs.append(self.kv.AllBlocksCleared())
            elif r < 0.62:
                evs.append(self.stored())
            else:
                evs.append(self.removed())
        return evs

    def restart(self):
        """A new engine process: empty cache, same prompts."""
        for s in self.res.values():
            s.clear()


class Plan:
    """One scenario's batches, expected results and the wrong answers that
    must differ from them."""

    def __init__(self, kv, scenario: str, form: str, seed: int):
        for sub in range(64):
            rng = random.Random(f"{scenario}/{form}/{seed}/{sub}")
            self.build(kv, scenario, form, seed, rng)
            # a test of something: both media hold blocks at the end, and
            # every wrong answer named in build() gives another residency
            if all(self.expected["resident"][m] for m in ("GPU", "CPU")) and \
               all(residency_json(residency(w)) != self.expected for w in self.wrong):
                self.subseed = sub
                return
        raise SystemExit(f"vllm_publisher: no discriminating {scenario} scenario for seed {seed}")

    def build(self, kv, scenario, form, seed, rng):
        g = Gen(kv, rng, form)
        self.algo, self.pyseed = g.algo, g.pyseed
        self.buffer_steps, self.drop, self.max_batches = 10_000, [], None
        self.half = self.a = None
        if scenario in ("normal", "late", "loss"):
            n = rng.randint(12, 24)
            b0 = [g.batch() for _ in range(n)]
            self.epochs = [b0]
            self.runs = [(0, list(range(n)))]
            self.resident = residency(b0)
            self.max_batches = n
            self.wrong = []
            if scenario == "late":
                self.half = n // 2
                self.wrong = [b0[self.half:]]
            if scenario == "loss":
                a = rng.randint(2, n // 2)
                self.drop = list(range(a, min(a + rng.randint(2, 5), n - 3)))
                if seed % 2:
                    self.drop.append(n - 1)  # a lost tail: no later batch shows the gap
                self.wrong = [[b for i, b in enumerate(b0) if i not in self.drop]]
        elif scenario == "small_buffer":
            B = self.buffer_steps = SMALL_B
            a = self.a = rng.randint(2, B)
            n = a + B + rng.randint(2, 6)
            b0 = [g.batch() for _ in range(n - B)]
            g.allow_clear = False  # a clear in the last B would hide a missing drop
            b0 += [g.batch() for _ in range(B)]
            self.epochs = [b0]
            self.drop = list(range(a, n - 1))
            self.runs = [(0, list(range(a)) + list(range(n - B, n)))]
            self.resident = residency(b0[n - B:])
            self.wrong = [b0[:a] + b0[n - B:]]  # kept what it had before the gap
        else:  # restart, restart_fast
            k = rng.randint(5, 10)
            old = [g.batch() for _ in range(k)]
            g.restart()
            m = rng.randint(3, 14) if scenario == "restart" else k + rng.randint(3, 8)
            new = [g.batch() for _ in range(m)]
            self.epochs = [old, new]
            self.runs = [(0, list(range(k))), (1, list(range(m)))]
            self.resident = residency(new)
            self.wrong = [old + new, old + new[k:]] if m > k else [old + new]
        self.expected = residency_json(self.resident)


# ---- sockets ------------------------------------------------------------------
class Endpoints:
    """Where the publisher binds and where a subscriber connects."""

    def __init__(self, transport: str, tmp: str, rank: int):
        self.transport, self.rank = transport, rank
        if transport == "ipc":
            self.pub_bind = f"ipc://{tmp}/pub"
            self.replay_bind = f"ipc://{tmp}/replay"
            self.proxy = f"ipc://{tmp}/proxy"
        else:
            self.pick()

    def pick(self):
        # '*' makes the real publisher bind (without it, PUB connects);
        # the port is offset by the data-parallel rank, as vLLM does
        p, r = free_port(), free_port()
        self.pub_bind = f"tcp://*:{p - self.rank}"
        self.replay_bind = f"tcp://127.0.0.1:{r - self.rank}"
        # the proxy binds a port the kernel picks (DropProxy.endpoint): a
        # port found free here may be taken by another test before the bind
        self.proxy = "tcp://127.0.0.1:*"

    def set_resolved(self, cfg):
        self.pub = cfg.endpoint.replace("*", "127.0.0.1")
        self.replay = cfg.replay_endpoint


def make_publisher(kv, eps: Endpoints, buffer_steps: int, fixed: bool):
    """The real ZmqEventPublisher; EADDRINUSE: new ports (or, on a restart,
    the same ones again for 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        pub = kv.ZmqEventPublisher.__new__(kv.ZmqEventPublisher)
        pub._pub = pub._replay = None
        try:
            pub.__init__(data_parallel_rank=eps.rank, endpoint=eps.pub_bind,
                         replay_endpoint=eps.replay_bind, buffer_steps=buffer_steps)
        except zmq.ZMQError as e:
            # the constructor binds PUB, then ROUTER: a failed ROUTER bind
            # leaves the bound PUB behind unless closed here
            for s in (pub._pub, pub._replay):
                if s is not None:
                    s.close(linger=0)
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            if fixed:
                time.sleep(0.05)
            else:
                eps.pick()
            continue
        eps.set_resolved(pub.get_publisher_config())
        return pub


class DropProxy(threading.Thread):
    """SUB from the real PUB -> XPUB for the subscriber, dropping given seqs.
    Holds batches until the subscriber's subscription arrives, so only the
    drops are losses on this hop."""

    def __init__(self, ctx, upstream: str, downstream: str, drop):
        super().__init__(daemon=True, name="drop-proxy")
        self.drop, self.dropped, self.upstream_lost = set(drop), [], []
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        mon = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(upstream)
        self.xpub = ctx.socket(zmq.XPUB)
        self.xpub.bind(downstream)
        # where it bound ("tcp://127.0.0.1:*" resolves to a port)
        self.endpoint = self.xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        # the upstream hop is a slow joiner too: publish only once it is up
        if not mon.poll(5000):
            raise SystemExit(f"vllm_publisher: proxy could not connect to {upstream}")
        recv_monitor_message(mon)
        self.sub.disable_monitor()
        mon.close(linger=0)
        time.sleep(0.1)  # the subscription follows the handshake
        self.stop = threading.Event()

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        held, subscribed, nxt = [], False, 0
        while not self.stop.is_set():
            ready = dict(poller.poll(50))
            if self.xpub in ready:
                if self.xpub.recv()[:1] == b"\x01" and not subscribed:
                    subscribed = True
                    for f in held:
                        self.xpub.send_multipart(f)
                    held = []
            if self.sub in ready:
                f = self.sub.recv_multipart()
                seq = int.from_bytes(f[1], "big")
                self.upstream_lost += range(nxt, seq)
                nxt = seq + 1
                if seq in self.drop:
                    self.dropped.append(seq)
                elif subscribed:
                    self.xpub.send_multipart(f)
                else:
                    held.append(f)
        self.sub.close(linger=0)
        self.xpub.close(linger=0)


# ---- the subscriber process ---------------------------------------------------
class Subscriber:
    def __init__(self, argv, out_path, err_path):
        self.argv = argv
        self.err = open(err_path, "w") if err_path else subprocess.DEVNULL
        self.out = open(out_path, "w") if out_path else None
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err,
                                  stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self.lines: list[str] = []
        self.cv = threading.Condition()
        self.t = threading.Thread(target=self.read, daemon=True)
        self.t.start()

    def read(self):
        for line in self.p.stdout:
            if self.out:
                self.out.write(line)
                self.out.flush()
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def printed(self, seq: int, since: int) -> bool:
        for line in self.lines[since:]:
            try:
                if json.loads(line).get("seq") == seq:
                    return True
            except (ValueError, AttributeError):
                pass
        return False

    def wait_seq(self, seq: int, since: int, timeout: float) -> bool:
        """Until the subscriber printed an event of seq (lines from `since`)."""
        end = time.monotonic() + timeout
        with self.cv:
            while not self.printed(seq, since):
                left = end - time.monotonic()
                if left <= 0 or self.p.poll() is not None and not self.t.is_alive():
                    return False
                self.cv.wait(min(left, 0.2))
        return True

    def mark(self) -> int:
        with self.cv:
            return len(self.lines)

    def wait_exit(self, timeout: float):
        try:
            rc = self.p.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc, timed_out = self.p.wait(), True
        self.t.join(5)
        for f in (self.out, self.err):
            if f not in (None, subprocess.DEVNULL):
                f.close()
        return rc, timed_out


# ---- one run ----------------------------------------------------------------------
class Run:
    def __init__(self, a):
        self.a = a
        self.kv, _ = vllm_tree.load()
        self.plan = Plan(self.kv, a.scenario, a.hashes, a.seed)
        self.notes: list[str] = []
        self.tmp = tempfile.mkdtemp(prefix="kvpi-", dir="/tmp")
        rank = 1 if a.transport == "tcp" and a.seed % 2 else 0
        self.eps = Endpoints(a.transport, self.tmp, rank)
        self.sub = None
        self.proxy = None
        self.stop_flag = threading.Event()

    def say(self, msg):
        if self.a.verbose:
            print(f"vllm_publisher: {msg}", file=sys.stderr, flush=True)

    def publish(self, pub, batches, pace=True):
        rng = random.Random(self.a.seed)
        for evs in batches:
            pub.publish(self.kv.KVEventBatch(ts=time.time(), events=evs))
            if pace:
                time.sleep(rng.choice((0, 0, 0.001, 0.003, 0.02)))
        # every batch sent, so in the replay buffer (the real queue's count)
        end = time.monotonic() + 30
        while pub._event_queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)
        if pub._event_queue.unfinished_tasks:
            raise SystemExit("vllm_publisher: the publisher did not send its queue in 30 s")

    def sync(self, seq, since, what):
        """Next phase once the subscriber printed seq; manual: a pause."""
        if self.sub is None:
            time.sleep(self.a.pause)
            return
        if not self.sub.wait_seq(seq, since, self.a.sync_timeout):
            self.notes.append(f"subscriber never printed seq {seq} ({what}) within "
                              f"{self.a.sync_timeout} s: is stdout flushed per batch?")
            self.say(self.notes[-1])

    def start_subscriber(self):
        p = self.plan
        endpoint = self.eps.proxy if p.drop else self.eps.pub
        args = ["--index", "--json", "--replay", self.eps.replay]
        if p.max_batches:
            args += ["--max-batches", str(p.max_batches)]
        args += ["--idle-ms", str(self.a.idle_ms), endpoint]
        self.sub_argv = args
        if self.a.subscriber:
            cmd = shlex.split(self.a.subscriber)
            self.say(f"subscriber: {shlex.join(cmd + args)}")
            self.sub = Subscriber(cmd + args, self.a.sub_out, self.a.sub_err)
        else:
            print(f"run the subscriber now:\n  SUBSCRIBER {shlex.join(args)}", flush=True)

    def scenario(self):
        a, p, kv = self.a, self.plan, self.kv
        pubs = [make_publisher(kv, self.eps, p.buffer_steps, fixed=False)]
        self.pubs_alive = pubs
        ctx = zmq.Context.instance()
        if p.drop:
            self.proxy = DropProxy(ctx, self.eps.pub, self.eps.proxy, p.drop)
            self.eps.proxy = self.proxy.endpoint
            self.proxy.start()
        b0 = p.epochs[0]
        if a.scenario == "late":
            self.publish(pubs[0], b0[:p.half])
            self.start_subscriber()
            mark = self.sub.mark() if self.sub else 0
            # two batches race the subscriber's start, the rest go live once
            # it printed the first half (replayed)
            self.publish(pubs[0], b0[p.half:p.half + 2])
            self.sync(p.half - 1, mark, "the replayed first half")
            self.publish(pubs[0], b0[p.half + 2:])
        elif a.scenario == "small_buffer":
            self.start_subscriber()
            mark = self.sub.mark() if self.sub else 0
            self.publish(pubs[0], b0[:p.a])
            self.sync(p.a - 1, mark, "the batches before the gap")
            self.publish(pubs[0], b0[p.a:], pace=False)
        elif a.scenario in ("restart", "restart_fast"):
            self.start_subscriber()
            mark = self.sub.mark() if self.sub else 0
            time.sleep(0.3)
            self.publish(pubs[0], b0)
            self.sync(len(b0) - 1, mark, "the old publisher's last batch")
            # shutdown() leaves an ipc socket file behind (libzmq does not
            # unlink on close); the new bind replaces it
            pubs[0].shutdown()
            t0 = time.monotonic()
            pubs.append(make_publisher(kv, self.eps, p.buffer_steps, fixed=True))
            self.restart_bind_s = time.monotonic() - t0
            self.pubs_alive = pubs[1:]
            if a.scenario == "restart":
                time.sleep(RESTART_PAUSE)
            self.publish(pubs[1], p.epochs[1], pace=a.scenario == "restart")
        else:  # normal, loss
            self.start_subscriber()
            time.sleep(0.3)  # mostly live: the subscriber is connected by now
            self.publish(pubs[0], b0)
        self.say("all batches published; serving replay until the subscriber exits")

    def wait_stop(self):
        if self.sub is not None:
            return self.sub.wait_exit(self.a.timeout)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop_flag.set())
        while not self.stop_flag.is_set() and not (
                self.a.stop_file and os.path.exists(self.a.stop_file)):
            time.sleep(0.1)
        return None, False

    def go(self) -> int:
        a, p = self.a, self.plan
        with open(a.expected, "w") as f:  # known before anything runs
            f.write(json.dumps(p.expected) + "\n")
        t0 = time.monotonic()
        rc, timed_out = None, False
        try:
            self.scenario()
            rc, timed_out = self.wait_stop()
        finally:
            if self.sub is not None and self.sub.p.poll() is None:
                self.sub.p.kill()
            for pub in getattr(self, "pubs_alive", []):
                pub.shutdown()
            if self.proxy is not None:
                self.proxy.stop.set()
                self.proxy.join(2)
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.proxy is not None and self.proxy.upstream_lost:
            self.notes.append(f"proxy missed seqs {self.proxy.upstream_lost} upstream")
        log = {
            "scenario": a.scenario, "transport": a.transport, "hashes": a.hashes,
            "seed": a.seed, "subseed": p.subseed, "hash_algo": p.algo,
            "pythonhashseed": p.pyseed, "buffer_steps": p.buffer_steps,
            "data_parallel_rank": self.eps.rank, "endpoint": self.eps.pub,
            "replay": self.eps.replay, "proxy": self.eps.proxy if p.drop else None,
            "subscriber_args": self.sub_argv,
            "subscriber": self.sub.argv if self.sub else None,
            "subscriber_rc": rc, "timed_out": timed_out,
            "seconds": round(time.monotonic() - t0, 3),
            "restart_bind_s": round(getattr(self, "restart_bind_s", 0), 4),
            "drop": p.drop, "dropped": self.proxy.dropped if self.proxy else [],
            "expect_runs": [{"publisher": e, "seqs": s} for e, s in p.runs],
            "expected": p.expected, "notes": self.notes,
            "publishers": [[{"seq": i, "events": [summary(ev) for ev in evs]}
                            for i, evs in enumerate(b)] for b in p.epochs],
        }
        if a.log:
            with open(a.log, "w") as f:
                json.dump(log, f, indent=1)
        self.say(f"done in {log['seconds']} s, subscriber rc={rc}"
                 f"{' (killed: timeout)' if timed_out else ''}")
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--scenario", choices=SCENARIOS, required=True)
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--hashes", choices=("int", "bytes"), default="int")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--expected", required=True, help="residency JSON out")
    ap.add_argument("--log", help="the run as JSON")
    ap.add_argument("--subscriber", help="command (shell words); args are appended")
    ap.add_argument("--sub-out", help="the subscriber's stdout, saved")
    ap.add_argument("--sub-err", help="the subscriber's stderr, saved")
    ap.add_argument("--idle-ms", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=60, help="subscriber wall limit")
    ap.add_argument("--sync-timeout", type=float, default=15)
    ap.add_argument("--pause", type=float, default=3, help="manual mode: between phases")
    ap.add_argument("--stop-file", help="manual mode: stop when this file exists")
    ap.add_argument("-v", "--verbose", action="store_true")
    return Run(ap.parse_args()).go()


if __name__ == "__main__":
    sys.exit(main())
