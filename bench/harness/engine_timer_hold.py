#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""How late a worker's prefill timer fires while a large token-id body is
read on the same worker (docs/live.md, "A thread per worker").

One emulated worker (`kvplane-bench engine --workers 1 --req-log`): request A
(8,000 ids, ~68 KB) arrives, 3 ms later request B (80,000 ids, ~570 KB);
A's prefill is scheduled to end ~29 ms (real) after its arrival at
--time-scale 10, while B's body is parsed and hashed.  Prints A's `late`
(the engine's own log: its timer's delay, in real ms) for each binary, the
binaries alternating round by round.  Standard library only.

  python3 bench/harness/engine_timer_hold.py [--time-scale 10] [--rounds 3] BIN...
"""
import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time


def post(host, port, body, rid):
    c = http.client.HTTPConnection(host, port, timeout=60)
    c.request("POST", "/v1/completions", body,
              {"Content-Type": "application/json", "X-Request-Id": str(rid)})
    c.getresponse().read()
    c.close()


def one_engine(binary, scale, bigs, reps):
    d = tempfile.mkdtemp(prefix="kvp-hold-")
    ready, log = os.path.join(d, "e.json"), os.path.join(d, "req.jsonl")
    p = subprocess.Popen([binary, "engine", "--workers", "1", "--block-size", "64",
                          "--time-scale", str(scale), "--max-model-len", "1048576",
                          "--ready-file", ready, "--req-log", log],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(ready):
                break
            time.sleep(0.05)
        url = json.load(open(ready))["workers"][0]["url"]
        host, port = url[len("http://"):].rsplit(":", 1)
        for k in range(reps):
            small = json.dumps({"prompt": [k * 1000 + i for i in range(8000)],
                                "max_tokens": 1}).encode()
            ta = threading.Thread(target=post, args=(host, int(port), small, 2 * k))
            tb = threading.Thread(target=post, args=(host, int(port), bigs[k], 2 * k + 1))
            ta.start()
            time.sleep(0.003)
            tb.start()
            ta.join()
            tb.join()
            time.sleep(0.05)
    finally:
        p.terminate()
        p.wait()
    lines = [json.loads(x) for x in open(log)]
    return [x["late"] / scale * 1e3 for x in lines if x["i"] % 2 == 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-scale", type=float, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10, help="A/B pairs per engine run")
    ap.add_argument("bins", nargs="+")
    a = ap.parse_args()
    rnd = random.Random(1)
    base = [rnd.randrange(128000) for _ in range(80000)]
    bigs = []
    for k in range(a.reps):
        base[0] = k
        bigs.append(json.dumps({"prompt": base, "max_tokens": 1}).encode())
    late = {b: [] for b in a.bins}
    for _ in range(a.rounds):
        for b in a.bins:
            late[b] += one_engine(b, a.time_scale, bigs, a.reps)
    for b, v in late.items():
        v.sort()
        print("%s: A's prefill timer late (real ms) n=%d p50 %.1f p90 %.1f mean %.1f"
              % (b, len(v), v[len(v) // 2], v[int(len(v) * 0.9)], statistics.mean(v)))


if __name__ == "__main__":
    main()
