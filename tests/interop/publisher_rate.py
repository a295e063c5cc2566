#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How fast vLLM 0.33.0's real ZmqEventPublisher sends: batches/s and block
hashes/s for batches of 1, 16 and 256 BlockStored events of 1 and 16 blocks,
over ipc:// and tcp loopback, counted by a plain pyzmq SUB in another
process.  The reference line for a C subscriber benchmark: a subscriber that
keeps up with this keeps up with one vLLM engine's publisher thread.

usage: publisher_rate.py [--seconds S] [--repeat R] [--hashes int|bytes]
                         [--json FILE]

Each row: the same pre-built KVEventBatch published N times (publish() only
queues; the publisher's own thread msgpack-encodes and sends, as in vLLM),
N sized for about --seconds at the measured speed.  send/s = N over the time
from the first publish() to the publisher's queue drained; recv/s = frames
over the SUB's first-to-last arrival.  The publisher has a replay endpoint
(its thread polls the ROUTER between batches, as kvplane needs it).  lost =
frames the SUB never got (PUB drops at its HWM of 100k when the SUB lags).
--repeat R measures every row R times and prints the run with the median
recv batch/s (the machine may be shared: look at the load printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import zmq

import vllm_tree
from testports import free_port  # below the ephemeral range (see there)

COUNTER = r"""
import sys, time, zmq
ctx = zmq.Context.instance()
s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.set_hwm(0)
s.connect(sys.argv[1])
print("ready", flush=True)
# warm-up: report the first frame, then learn from stdin where timing starts
s.recv_multipart()
print("warm", flush=True)
start, n = (int(x) for x in sys.stdin.readline().split())
count, nbytes, t0, t1 = 0, 0, None, None
while count < n and s.poll(3000):
    f = s.recv_multipart()
    if int.from_bytes(f[1], "big") < start:
        continue
    t = time.perf_counter()
    t0 = t0 or t
    t1 = t
    count += 1
    nbytes += len(f[2])
print(count, nbytes, (t1 or 0) - (t0 or 0), flush=True)
"""


def make_batch(kv, events: int, blocks: int, form: str):
    h = (lambda i: (0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) if form == "int" \
        else (lambda i: (i + 1).to_bytes(32, "big"))
    evs = [kv.BlockStored(block_hashes=[h(e * blocks + b) for b in range(blocks)],
                          parent_block_hash=h(e * blocks - 1) if e else None,
                          token_ids=list(range(16 * blocks)), block_size=16,
                          lora_id=None, medium="GPU", lora_name=None,
                          extra_keys=[None] * blocks, group_idx=0)
           for e in range(events)]
    return kv.KVEventBatch(ts=time.time(), events=evs)


def drain(pub, timeout=120):
    end = time.monotonic() + timeout
    while pub._event_queue.unfinished_tasks and time.monotonic() < end:
        time.sleep(0.0005)


def measure(kv, transport, events, blocks, form, seconds, tmp):
    if transport == "ipc":
        bind = f"ipc://{tmp}/pub-{events}-{blocks}"
        replay = f"ipc://{tmp}/replay-{events}-{blocks}"
        connect = bind
    else:
        p = free_port()
        bind, replay = f"tcp://*:{p}", f"tcp://127.0.0.1:{free_port()}"
        connect = f"tcp://127.0.0.1:{p}"
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=bind, replay_endpoint=replay)
    ctr = subprocess.Popen([sys.executable, "-c", COUNTER, connect], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
        assert ctr.stdout.readline().strip() == "ready"
        warm = kv.KVEventBatch(ts=time.time(), events=[])
        w = 0
        os.set_blocking(ctr.stdout.fileno(), False)
        line = ""
        while "warm" not in line:  # until the SUB is surely subscribed
            pub.publish(warm)
            w += 1
            time.sleep(0.01)
            line += ctr.stdout.readline() or ""
        os.set_blocking(ctr.stdout.fileno(), True)
        drain(pub)
        batch = make_batch(kv, events, blocks, form)
        # calibrate: a short run, then N for about `seconds`
        t = time.perf_counter()
        k = 20
        for _ in range(k):
            pub.publish(batch)
        drain(pub)
        per = (time.perf_counter() - t) / k
        n = max(50, min(200_000, int(seconds / max(per, 1e-7))))
        start = w + k
        ctr.stdin.write(f"{start} {n}\n")
        ctr.stdin.flush()
        t0 = time.perf_counter()
        for _ in range(n):
            pub.publish(batch)
        drain(pub)
        send_s = time.perf_counter() - t0
        count, nbytes, recv_s = ctr.stdout.readline().split()
        count, nbytes, recv_s = int(count), int(nbytes), float(recv_s)
    finally:
        pub.shutdown()
        ctr.kill()
        ctr.wait()
    rb = (count - 1) / recv_s if recv_s > 0 and count > 1 else 0.0
    return {"transport": transport, "events": events, "blocks": blocks, "hashes": form,
            "batches": n, "send_batches_s": n / send_s, "recv_batches_s": rb,
            "recv_hashes_s": rb * events * blocks, "recv_MB_s": rb * nbytes / max(count, 1) / 1e6,
            "payload_bytes": nbytes // max(count, 1), "lost": n - count}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--seconds", type=float, default=1.5, help="per row (about)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row (median)")
    ap.add_argument("--hashes", choices=("int", "bytes"), default="int")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    kv, _ = vllm_tree.load()
    tmp = tempfile.mkdtemp(prefix="kvpr-", dir="/tmp")
    rows = []
    print(f"vLLM {vllm_tree.VLLM_VERSION} ZmqEventPublisher, {a.hashes} hashes, "
          f"pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    hdr = (f"{'transport':9} {'events':>6} {'blocks':>6} {'bytes/batch':>11} {'batches':>8} "
           f"{'send batch/s':>12} {'recv batch/s':>12} {'hashes/s':>10} {'MB/s':>6} {'lost':>5}")
    print(hdr)
    print("-" * len(hdr))
    for transport in ("ipc", "tcp"):
        for events in (1, 16, 256):
            for blocks in (1, 16):
                runs = sorted((measure(kv, transport, events, blocks, a.hashes, a.seconds, tmp)
                               for _ in range(max(1, a.repeat))),
                              key=lambda r: r["recv_batches_s"])
                r = runs[len(runs) // 2]
                rows.append(r)
                print(f"{transport:9} {events:6d} {blocks:6d} {r['payload_bytes']:11d} "
                      f"{r['batches']:8d} {r['send_batches_s']:12.0f} {r['recv_batches_s']:12.0f} "
                      f"{r['recv_hashes_s']:10.0f} {r['recv_MB_s']:6.1f} {r['lost']:5d}",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
