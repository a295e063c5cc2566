#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd under worker kill/restart with traffic (issue 38, failure
behaviour): three emulated vLLM workers (kvplane-bench engine, one process
each, fixed ports so a restarted one comes back where it was), two front-door
threads, stdlib clients on keep-alive connections.  For KVP_SOAK_S seconds (default 20) clients send
streamed and non-streamed completions while one worker at a time is killed
(SIGKILL, requests in flight) and restarted a moment later; probes time
/health on the front door (new connections: both loops) and the admin API.

  test_routerd_soak.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR

Checks: no request fails before its first byte (a failure mid-stream is the
only one allowed); no request hangs (each ends within its timeout); every
loop answers within a bound throughout (no stalled loop); afterwards the
counters agree with what the clients saw (requests_total = requests sent,
nothing in flight on any worker, client connections back down) and every
worker is back up; no libevent warning ("Epoll MOD ... Bad file
descriptor") in the router's log."""
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rd_testlib import check, failures, free_port, metric, wait_http  # noqa: E402

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
BS = 16
SOAK_S = float(os.environ.get("KVP_SOAK_S", "20"))
STALL_S = 2.0  # an answer from every loop within this, always
MODEL = "kvplane-emulated"
procs = []


def free_run(n):
    """a base port with n free ports above it (the engine binds P..P+n-1)"""
    while True:
        p = free_port()
        if p + n < 65000:
            return p


class Worker:
    def __init__(self, i):
        self.i = i
        self.port, self.kv = free_run(1), free_run(2)
        self.url = "http://127.0.0.1:%d" % self.port
        self.p = None
        self.start()

    def start(self):
        ready = os.path.join(W, "w%d.json" % self.i)
        if os.path.exists(ready):
            os.unlink(ready)
        log = open(os.path.join(W, "w%d.log" % self.i), "a")
        self.p = subprocess.Popen(
            [B, "engine", "--workers", "1", "--port", str(self.port), "--kv-port",
             str(self.kv), "--block-size", str(BS), "--time-scale", "20",
             "--ready-file", ready], stdout=log, stderr=subprocess.STDOUT)
        procs.append(self.p)
        for _ in range(200):
            if os.path.exists(ready) and os.path.getsize(ready) > 0:
                return True
            time.sleep(0.05)
        return False

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()


ws = [Worker(i) for i in range(3)]
port, admin = free_port(), free_port()
front = "http://127.0.0.1:%d" % port
cfg = os.path.join(W, "soak.yaml")
with open(cfg, "w") as f:
    f.write("""routerd:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  threads: 2
  render: false
  scrape_interval: 50ms
  breaker_failures: 2
  breaker_cooldown: 500ms
  retries: 2
  connect_timeout: 500ms
  request_timeout: 20s
  client_timeout: 1s
workers:
  urls: [%s]
  kv_events: [%s]
  kv_replay: [%s]
model:
  block_size: %d
""" % (port, admin, ", ".join(w.url for w in ws),
       ", ".join("tcp://127.0.0.1:%d" % w.kv for w in ws),
       ", ".join("tcp://127.0.0.1:%d" % (w.kv + 1) for w in ws), BS))
log_path = os.path.join(W, "routerd.log")
rlog = open(log_path, "w")
rd = subprocess.Popen([RD, "--config", cfg], stdout=rlog, stderr=subprocess.STDOUT)
procs.append(rd)


def get(url, timeout):
    """(status, seconds) of one GET on a new connection; status 0: failed"""
    t0 = time.time()
    host, p = url.split("//")[1].split("/")[0].split(":")
    c = http.client.HTTPConnection(host, int(p), timeout=timeout)
    try:
        c.request("GET", "/" + url.split("/", 3)[3])
        r = c.getresponse()
        r.read()
        return r.status, time.time() - t0
    except OSError:
        return 0, time.time() - t0
    finally:
        c.close()


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


ok_up = wait_http(front + "/health")
for _ in range(100):  # every worker scraped up
    st, _ = get(front + "/health", 2)
    if st == 200:
        break
    time.sleep(0.1)
if not ok_up:
    stop_all()
    raise SystemExit("FAIL: routerd did not come up")

lock = threading.Lock()
stop = threading.Event()
sent = [0]
outcomes = {"ok": 0, "midstream": 0}
early = []  # failures before the first byte: (what, detail)
hung = []


def one(c, rng, stream):
    """one completion on keep-alive connection c (as the SDKs pool them) ->
    'ok', 'midstream' or ('early', detail); the connection is closed after
    any failure"""
    body = json.dumps({"model": MODEL, "prompt": [rng.randrange(1, 255) for _ in range(48)],
                       "max_tokens": 40, "stream": stream}).encode()
    first = False
    t0 = time.time()
    try:
        try:
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        except OSError:  # the router closed the idle connection: a new one
            c.close()
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        with lock:
            sent[0] += 1
        r = c.getresponse()
        if r.status != 200:
            c.close()
            return ("early", "%d %s" % (r.status, r.read()[:200]))
        first = True
        data = r.read()
        if stream and b"data: [DONE]" not in data:
            c.close()
            return "midstream"
        if not stream and b'"choices"' not in data:
            return ("early", "200 without choices: %r" % data[:200])
        return "ok"
    except (OSError, http.client.HTTPException) as e:
        c.close()
        if time.time() - t0 >= 29:
            hung.append(repr(e))
        return "midstream" if first and stream else ("early", repr(e))


def client(k):
    rng = random.Random(k)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    i = 0
    while not stop.is_set():
        res = one(c, rng, stream=(i % 2 == 1))
        i += 1
        if rng.random() < 0.02:  # idle past client_timeout: the router
            time.sleep(1.2)      # frees the keep-alive connection; the
            c.close()            # client starts a new one (as a pool's expiry)
        with lock:
            if isinstance(res, tuple):
                early.append(res[1])
            else:
                outcomes[res] += 1
    c.close()


stalls = []


def probe():
    urls = [front + "/health", "http://127.0.0.1:%d/admin/workers" % admin]
    while not stop.is_set():
        for u in urls:
            st, took = get(u, STALL_S + 3)
            if st == 0 or took > STALL_S:
                stalls.append((u, st, round(took, 2)))
        time.sleep(0.1)


kills = [0]


def chaos():
    rng = random.Random(7)
    while not stop.is_set():
        time.sleep(rng.uniform(0.8, 1.6))
        w = ws[rng.randrange(len(ws))]
        w.kill()
        kills[0] += 1
        time.sleep(rng.uniform(0.3, 1.0))
        if not w.start():
            early.append("worker %d did not restart" % w.i)


ths = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
ths += [threading.Thread(target=probe, daemon=True), threading.Thread(target=chaos, daemon=True)]
for t in ths:
    t.start()
time.sleep(SOAK_S)
stop.set()
for t in ths:
    t.join(40)
check(not any(t.is_alive() for t in ths), "every client returned (none hung)")
check(not hung, "no request ran into its 30 s client timeout: %s" % hung[:3])
check(kills[0] >= 5, "workers killed and restarted %d times in %.0f s" % (kills[0], SOAK_S))
check(not early, "no request failed before its first byte: %d of %d (%s)"
      % (len(early), sent[0], early[:5]))
check(outcomes["ok"] > 50, "requests served: %s" % outcomes)
check(not stalls, "every loop answered within %.0f s throughout: %s" % (STALL_S, stalls[:5]))

# after the load: counters agree, every worker back
time.sleep(1.5)
for _ in range(50):
    st, _ = get(front + "/health", 2)
    conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
    conn.request("GET", "/admin/workers")
    states = [w["state"] for w in json.loads(conn.getresponse().read())["workers"]]
    conn.close()
    if states.count("up") == 3:
        break
    time.sleep(0.2)
check(states.count("up") == 3, "every worker back up: %s" % states)
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
conn.request("GET", "/metrics")
m = conn.getresponse().read().decode()
conn.close()
req = metric(m, "kvplane_routerd_requests_total")
check(req == sent[0], "requests_total %s = requests the clients sent %d" % (req, sent[0]))
infl = [l for l in m.splitlines() if l.startswith("kvplane_routerd_worker_inflight{")]
check(infl and all(float(l.split()[-1]) == 0 for l in infl),
      "nothing left in flight on any worker: %s" % infl)
conns = metric(m, "kvplane_routerd_client_connections")
check(conns is not None and conns <= 2, "client connections back down: %s" % conns)
cancels = metric(m, "kvplane_routerd_client_cancels_total")
check(cancels == 0, "no client cancel counted (no client gave up): %s" % cancels)

rd.send_signal(signal.SIGTERM)
try:
    rc = rd.wait(15)
except subprocess.TimeoutExpired:
    rc = None
check(rc == 0, "SIGTERM: drained and exited 0 (%s)" % rc)
stop_all()
rlog.flush()
text = open(log_path).read()
bad = [l for l in text.splitlines() if "Epoll" in l or "Bad file descriptor" in l]
check(not bad, "no libevent epoll warning in the router's log: %d lines (%s)" % (len(bad), bad[:2]))
san = [l for l in text.splitlines() if "Sanitizer" in l or "runtime error" in l]
check(not san, "no sanitizer report in the router's log: %s" % san[:2])
if failures:
    print("test_routerd_soak: %d failed" % len(failures))
    print(text[-3000:])
    sys.exit(1)
print("test_routerd_soak: ok")
