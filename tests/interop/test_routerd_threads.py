#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd with routerd.threads: 3 (several front-door loops on one
SO_REUSEPORT address) in front of emulated vLLM workers (kvplane-bench
engine); stdlib client, no SDK.

  test_routerd_threads.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR

Checks: a second router on the same address is refused (SO_REUSEPORT
joins no other process's group); many concurrent clients on fresh
connections are all answered and
land on at least 2 loops (kvplane_routerd_thread_requests_total{thread}),
whose counts sum to requests_total; multi-turn sessions whose turns come
through different loops still land where their KV is (the workers' own
cached_tokens); a drained worker gets no new request and a removed one
goes, while the loops are busy, with no request failed, and a worker added
and removed 6 times under load fails none either; one whole JSON
receipt per request; SIGTERM with requests in flight on several loops:
each finishes, then exit 0; a 3-loop replica synced with a 1-loop one
through nats-server (when installed): every loop's decisions reach the
peer, which routes each session's next turn to the worker the first
replica chose.  Under a ThreadSanitizer build
(TSAN_OPTIONS=halt_on_error=1) a race report fails the exit code and the
log check."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from rd_testlib import (check, failures, free_port, metric, start_engine, wait_http,
                        workers_yaml)

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
MODEL = "kvplane-emulated"
BS = 16
THREADS = 3
procs = []


def http(method, url, body=None, timeout=30):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers
    except Exception as e:  # noqa: BLE001 -- a reset, a refusal: status 0
        return 0, str(e), {}


def engine(name, n):
    return start_engine(B, W, name, n, BS, procs)[1]


workers = engine("engine_threads", 4)
port, admin = free_port(), free_port()
receipts = os.path.join(W, "receipts.jsonl")
if os.path.exists(receipts):
    os.unlink(receipts)
cfg = os.path.join(W, "routerd.yaml")


def write_cfg(max_body):
    with open(cfg, "w") as f:
        f.write(f"""routerd:
  listen: 127.0.0.1:{port}
  admin_listen: 127.0.0.1:{admin}
  threads: {THREADS}
  receipts: {receipts}
  scrape_interval: 50ms
  retries: 2
  max_body: {max_body}
{workers_yaml(workers, BS)}""")


write_cfg("1M")
rlog_path = os.path.join(W, "routerd.log")
rd = subprocess.Popen([RD, "--config", cfg, "--log", "info"],
                      stdout=open(rlog_path, "w"), stderr=subprocess.STDOUT)
procs.append(rd)
base = f"http://127.0.0.1:{port}"
abase = f"http://127.0.0.1:{admin}"
check(wait_http(base + "/health"), "the router answers /health")
# SO_REUSEPORT must not let a second router join the first one's port
dup = subprocess.run([RD, "--config", cfg], capture_output=True, text=True, timeout=20)
check(dup.returncode == 1 and "cannot listen" in dup.stderr,
      "a second router on the same address is refused: rc %d, %s"
      % (dup.returncode, dup.stderr.strip()[-120:]))


def complete(prompt, max_tokens=2, session=None):
    """(status, json body or None, x-kvplane-worker); a fresh connection
    each call, so the kernel picks a loop each time."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if session:
        body["user"] = session
    code, text, h = http("POST", base + "/v1/completions", body)
    try:
        j = json.loads(text) if code == 200 else None
    except ValueError:
        j = None
    return code, j, h.get("x-kvplane-worker") if h else None


def run_clients(n_clients, per_client, make_prompt, out):
    def one(k):
        for i in range(per_client):
            out.append(complete(make_prompt(k, i)))
    ts = [threading.Thread(target=one, args=(k,), daemon=True)
          for k in range(n_clients)]
    for t in ts:
        t.start()
    return ts


# ---- many concurrent clients: spread over the loops ------------------------------
res = []
for t in run_clients(16, 12, lambda k, i: [k * 7 + 1] * 64 + [i + 1] * 32, res):
    t.join()
ok = [r for r in res if r[0] == 200 and r[2] and r[2].startswith("http://")]
check(len(ok) == len(res) == 16 * 12,
      "%d concurrent requests over 16 clients answered through the router (%d ok)"
      % (len(res), len(ok)))
_, m, _ = http("GET", base + "/metrics")
per = [metric(m, 'kvplane_routerd_thread_requests_total{thread="%d"}' % i) or 0
       for i in range(THREADS)]
check(sum(1 for v in per if v > 0) >= 2,
      "at least 2 front-door loops served requests (per thread %s)" % per)
check(sum(per) == metric(m, "kvplane_routerd_requests_total") and sum(per) >= len(res),
      "the loops' counts sum to requests_total (%s vs %s)"
      % (sum(per), metric(m, "kvplane_routerd_requests_total")))

# ---- sessions: each turn through any loop lands where the session's KV is -------
ideal, got, lock = [0], [0], threading.Lock()
_, m, _ = http("GET", base + "/metrics")
per0 = [metric(m, 'kvplane_routerd_thread_requests_total{thread="%d"}' % i) or 0
        for i in range(THREADS)]


def session(s):
    rng = random.Random(100 + s)
    hist = [rng.randrange(1, 255) for _ in range(64 + 16 * s)]
    prev_blocks = 0
    for turn in range(4):
        code, j, _ = complete(hist, session="s%d" % s)
        cached = ((j or {}).get("usage") or {}).get("prompt_tokens_details") or {}
        cached = cached.get("cached_tokens") or 0
        with lock:
            if turn > 0:
                ideal[0] += prev_blocks * BS
                got[0] += min(cached, prev_blocks * BS)
        check(code == 200, "session s%d turn %d answered (cached %d)" % (s, turn, cached))
        prev_blocks = len(hist) // BS
        hist = hist + [rng.randrange(1, 255) for _ in range(40)]


for s in range(8):  # one after the other: each turn on a fresh connection
    session(s)
_, m, _ = http("GET", base + "/metrics")
per1 = [(metric(m, 'kvplane_routerd_thread_requests_total{thread="%d"}' % i) or 0) - per0[i]
        for i in range(THREADS)]
check(ideal[0] > 0 and got[0] >= 0.95 * ideal[0] and sum(1 for v in per1 if v > 0) >= 2,
      "sessions reuse %d of %d prefix tokens on the workers, their turns "
      "through several loops (per thread %s)" % (got[0], ideal[0], per1))

# ---- admin drain and remove while the loops are busy ------------------------------
busy, stop_busy = [], threading.Event()


def busy_client(k, out=busy, fresh=False):
    i, rng = 0, random.Random(k)
    while not stop_busy.is_set():
        t0 = time.time()
        prompt = ([rng.randrange(1, 30000) for _ in range(64)] if fresh
                  else [k + 1] * 48 + [i % 50 + 1] * 16)
        code, _, w = complete(prompt)
        out.append((t0, code, w))
        i += 1


# daemon threads: a router that died (a sanitizer report) fails the checks,
# it does not hang the test
bt = [threading.Thread(target=busy_client, args=(k,), daemon=True) for k in range(8)]
for t in bt:
    t.start()
time.sleep(0.5)
drained, removed = workers[0]["url"], workers[1]["url"]
code, _, _ = http("POST", abase + "/admin/workers/drain?url=" + drained)
t_drain = time.time()
check(code == 202, "drain answered 202 while busy")
code, _, _ = http("DELETE", abase + "/admin/workers?url=" + removed)
t_remove = time.time()
check(code == 202, "remove answered 202 while busy")
# SIGHUP while busy: every loop takes the new config (the file keeps the
# removed worker out, so the reload does not add it back)
workers_cfg = [w for w in workers if w["url"] != removed]
workers_all, workers = workers, workers_cfg
write_cfg("64K")
workers = workers_all
rd.send_signal(signal.SIGHUP)
gone = False
t_end = time.time() + 10
while time.time() < t_end and not gone:
    _, body, _ = http("GET", abase + "/admin/workers")
    gone = removed not in [w["url"] for w in json.loads(body)["workers"]]
    time.sleep(0.1)
time.sleep(0.5)
stop_busy.set()
for t in bt:
    t.join()
check(gone, "the removed worker left /admin/workers once idle")
after = [b for b in busy if b[0] > t_remove + 0.05]
check(len(after) > 0 and all(b[2] not in (drained, removed) for b in after),
      "no request sent after drain/remove went to either worker (%d after, to %s)"
      % (len(after), sorted(set(b[2] or "" for b in after))))
check(len(busy) > 0 and all(b[1] == 200 for b in busy),
      "no request failed around drain and remove (%d, statuses %s)"
      % (len(busy), sorted(set(b[1] for b in busy))))
code, _, _ = http("POST", abase + "/admin/workers/undrain?url=" + drained)
check(code == 202, "undrain")

# ---- churn: the removed worker added back and removed again, 6 times, while
# busy on prompts no worker holds (so load spreads onto it each time): its
# slot is freed while the loops release their claims on it
churn, cycles, CHURN = [], 0, 6
stop_busy.clear()
bt = [threading.Thread(target=busy_client, args=(k, churn, True), daemon=True)
      for k in range(8)]
for t in bt:
    t.start()
w1 = workers[1]
for _ in range(CHURN):
    code, _, _ = http("POST", abase + "/admin/workers", {
        "url": removed, "kv_events": w1["kv_events"], "kv_replay": w1["kv_replay"]})
    time.sleep(0.3)
    code2, _, _ = http("DELETE", abase + "/admin/workers?url=" + removed)
    gone, t_end = False, time.time() + 5
    while code == 201 and code2 == 202 and time.time() < t_end and not gone:
        _, body, _ = http("GET", abase + "/admin/workers")
        gone = removed not in [w["url"] for w in json.loads(body)["workers"]]
        time.sleep(0.05)
    cycles += gone
stop_busy.set()
for t in bt:
    t.join()
check(cycles == CHURN and any(c[2] == removed for c in churn),
      "%d add/remove cycles under load, the worker served in between (%d done, "
      "%d of %d requests to it)" % (CHURN, cycles, sum(c[2] == removed for c in churn), len(churn)))
check(len(churn) > 0 and all(c[1] == 200 for c in churn),
      "no request failed through the churn (statuses %s)" % sorted(set(c[1] for c in churn)))
_, m, _ = http("GET", base + "/metrics")
check(metric(m, 'kvplane_routerd_config_reloads_total{result="ok"}') == 1,
      "the SIGHUP under load was applied")
big = [complete([7] * 40000)[0] for _ in range(12)]  # ~120 KB bodies
check(big == [413] * 12, "every loop enforces the reloaded max_body (%s)" % big)

# ---- receipts: one whole line per request ------------------------------------------
_, m, _ = http("GET", base + "/metrics")
lines = open(receipts).read().splitlines()
try:
    recs = [json.loads(x) for x in lines]
except ValueError:
    recs = []
n_ok = (sum(1 for r in res if r[0] == 200) + sum(1 for b in busy + churn if b[1] == 200)
        + 8 * 4)
check(len(recs) == len(lines) == n_ok and all("receipt" in r for r in recs),
      "one whole JSON receipt per request (%d lines, %d parsed, %d requests)"
      % (len(lines), len(recs), n_ok))
check(metric(m, "kvplane_routerd_inflight") == 0,
      "nothing in flight when idle (%s)" % metric(m, "kvplane_routerd_inflight"))

# ---- SIGTERM with requests in flight on several loops ------------------------------
slow = []


def slow_call(k):
    slow.append(complete([k + 3] * 32, max_tokens=SLOW))


SLOW = 3000
st = [threading.Thread(target=slow_call, args=(k,), daemon=True) for k in range(6)]
for t in st:
    t.start()
inflight, t_end = 0, time.time() + 5
while time.time() < t_end and inflight < 6:
    _, m, _ = http("GET", base + "/metrics")
    inflight = metric(m, "kvplane_routerd_inflight") or 0
rd.send_signal(signal.SIGTERM)
for t in st:
    t.join()
try:
    rc = rd.wait(timeout=30)
except subprocess.TimeoutExpired:
    rc = None
fin = [r for r in slow if r[0] == 200 and r[1]["usage"]["completion_tokens"] == SLOW]
check(inflight >= 2 and len(fin) == 6 and rc == 0,
      "SIGTERM: %s in flight, %d of 6 finished whole, then exit %s"
      % (inflight, len(fin), rc))
log = open(rlog_path).read()
check("ThreadSanitizer" not in log and "AddressSanitizer" not in log,
      "no sanitizer report in the router's log")

# ---- replicas with threads: every loop publishes its own decisions ----------------
# A 3-loop replica and a 1-loop one synced through nats-server (skipped when
# Debian's nats-server is missing): sessions started on the first continue
# on the second where the first put them, and every decision of every loop
# reaches the peer.
NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"
if os.access(NATS, os.X_OK):
    np_ = free_port()
    procs.append(subprocess.Popen([NATS, "-a", "127.0.0.1", "-p", str(np_)],
                                  stdout=open(os.path.join(W, "nats.log"), "w"),
                                  stderr=subprocess.STDOUT))
    time.sleep(0.3)
    reps, rlogs = [], []
    for rid, th in ((1, THREADS), (2, 1)):
        rp = free_port()
        rc_path = os.path.join(W, "replica-%d.yaml" % rid)
        with open(rc_path, "w") as f:
            f.write(f"""routerd:
  listen: 127.0.0.1:{rp}
  threads: {th}
  scrape_interval: 50ms
{workers_yaml(workers, BS)}replicas:
  nats_url: nats://127.0.0.1:{np_}
  replica_id: {rid}
  snapshot_interval: 50ms
""")
        rlogs.append(os.path.join(W, "replica-%d.log" % rid))
        procs.append(subprocess.Popen([RD, "--config", rc_path], stdout=open(rlogs[-1], "w"),
                                      stderr=subprocess.STDOUT))
        reps.append(f"http://127.0.0.1:{rp}")
        check(wait_http(reps[-1] + "/health"), "replica %d (threads: %d) answers" % (rid, th))
    t_end = time.time() + 10
    while time.time() < t_end and any(
            metric(http("GET", r + "/metrics")[1], "kvplane_routerd_sync_peers") != 1 for r in reps):
        time.sleep(0.1)

    def via(url, prompt, sess):
        code, text, h = http("POST", url + "/v1/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": 2, "user": sess})
        return code, h.get("x-kvplane-worker") if h else None

    NS = 24
    first, second = {}, {}

    def rep_session(k):
        r = random.Random(500 + k)
        hist = [r.randrange(1, 255) for _ in range(200)]
        first[k] = via(reps[0], hist, "rs%d" % k)
        hist += [r.randrange(1, 255) for _ in range(40)]
        time.sleep(0.5)  # the peer hears the decision (snapshots every 50 ms)
        second[k] = via(reps[1], hist, "rs%d" % k)

    ths = [threading.Thread(target=rep_session, args=(k,)) for k in range(NS)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    ok = [k for k in range(NS) if first[k][0] == 200 and second[k][0] == 200]
    same = sum(1 for k in ok if first[k][1] == second[k][1])
    check(len(ok) == NS, "every request through the replicas answered (%d of %d)" % (len(ok), NS))
    check(same >= NS * 0.9, "a session's next turn on the other replica lands where the "
          "3-loop replica put it (%d of %d)" % (same, NS))
    m1, m2 = (http("GET", r + "/metrics")[1] for r in reps)
    loops1 = sum(1 for i in range(THREADS)
                 if (metric(m1, 'kvplane_routerd_thread_requests_total{thread="%d"}' % i) or 0) > 0)
    pub = metric(m1, 'kvplane_routerd_sync_published_total{type="decision"}') or 0
    got = metric(m2, 'kvplane_routerd_sync_received_total{type="decision"}') or 0
    check(loops1 >= 2 and pub == NS and got >= NS,
          "the 3-loop replica's loops (%d used) published every decision (%d of %d), "
          "its peer received them (%d)" % (loops1, pub, NS, got))
    for p in procs[-2:]:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    logs = "".join(open(x).read() for x in rlogs)
    check("ThreadSanitizer" not in logs and "AddressSanitizer" not in logs,
          "no sanitizer report in the replicas' logs")
else:
    print("  (replicas with threads skipped: nats-server not installed)")

for p in procs:
    if p.poll() is None:
        p.kill()
        p.wait()
print("test_routerd_threads: %s (%d failed)" % ("FAIL" if failures else "ok", len(failures)))
sys.exit(1 if failures else 0)
