#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd replicas sharing state through NATS, on loopback.

  test_routerd_replicas.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR [KVPLANE_CLI]

A burst of sessions sharing a long prefix is sent round robin across 3
replicas (each turn to the next replica, as a load balancer would) in front
of 4 emulated vLLM workers.  With NATS sync the fleet must route like one
router: hit rate and load imbalance within 1 point of a single replica's on
the same burst.  Without sync (3 replicas, no NATS) is printed as the control.
Then replicas and NATS itself are killed and restarted mid-run: no request
fails because of the sync layer (the client fails over between replicas on a
connect error, as a load balancer does), the restarted replica rejoins and
every replica reconnects.  Last, with `kvplane events relay` storing the
workers' KV events in JetStream, a replica started after the traffic reads
them back (kv_events: js:NAME) into an index equal to the live one's (the
per-worker digests of /admin/index).  Exit 77 when nats-server is missing."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from rd_testlib import check, failures, free_port, metric, wait_http

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
CLI = sys.argv[4] if len(sys.argv) > 4 else None
os.makedirs(W, exist_ok=True)
NATS = shutil.which("nats-server") or "/usr/sbin/nats-server"
if not os.access(NATS, os.X_OK):
    print("SKIP: nats-server not installed (Debian package nats-server)")
    sys.exit(77)
BS, WORKERS, SESSIONS, TURNS = 16, 4, 32, 4
# one replica and the synced fleet replay the same bursts, interleaved burst
# by burst (blind replicas the first BLIND of them); KVP_REPLICAS_BURSTS=N
# for a measurement (docs/routerd.md#replicas: 200)
SEEDS = tuple(range(1, 1 + int(os.environ.get("KVP_REPLICAS_BURSTS", "30"))))
BLIND = 5
procs = []


def spawn(args, log):
    p = subprocess.Popen(args, stdout=open(os.path.join(W, log), "a"),
                         stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def engine(tag):
    ready = os.path.join(W, "eng-%s.json" % tag)
    if os.path.exists(ready):
        os.unlink(ready)
    p = spawn([B, "engine", "--workers", str(WORKERS), "--block-size", str(BS),
               "--time-scale", "2", "--ready-file", ready], "engine-%s.log" % tag)
    for _ in range(200):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return p, json.load(open(ready))["workers"]
        time.sleep(0.05)
    raise SystemExit("engine did not start")


def nats(port, store):
    return spawn([NATS, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                 "nats.log")


def router(tag, rid, workers, nats_port, events=None, admin=None, threads=1):
    port = free_port()
    cfg = os.path.join(W, "rd-%s-%d.yaml" % (tag, rid))
    rep = ""
    if nats_port:
        rep = ("replicas:\n  nats_url: nats://127.0.0.1:%d\n  replica_id: %d\n"
               "  snapshot_interval: 50ms\n  peer_timeout: 500ms\n" % (nats_port, rid))
    ev = events or [w["kv_events"] for w in workers]
    rp = [w["kv_replay"] for w in workers] if events is None else ["-"] * len(workers)
    # scrape_budget 0: the emulated workers (time scale 2) answer /metrics
    # from C; a gap paced by the answer time (the router's own loop, slow
    # under ASan) would stretch in trace time and blur the load view
    # whose balance this test measures (make live does the same)
    with open(cfg, "w") as f:
        f.write("routerd:\n  listen: 127.0.0.1:%d\n  scrape_interval: 50ms\n"
                "  scrape_budget: 0\n"
                "  threads: %d\n%s"
                "workers:\n  urls: [%s]\n  kv_events: [%s]\n  kv_replay: [%s]\n"
                "model:\n  block_size: %d\n%s" % (
                    port, threads, "  admin_listen: 127.0.0.1:%d\n" % admin if admin else "",
                    ", ".join(w["url"] for w in workers), ", ".join(ev),
                    ", ".join(rp), BS, rep))
    p = spawn([RD, "--config", cfg], "rd-%s-%d.log" % (tag, rid))
    if not wait_http("http://127.0.0.1:%d/health" % port):
        raise SystemExit("router %s/%d did not start" % (tag, rid))
    return p, port, cfg


class Fleet:
    """Round robin over the replicas; a connect error moves on (an LB)."""
    def __init__(self, ports):
        self.ports, self.i, self.lock = list(ports), 0, threading.Lock()

    def post(self, body, session):
        data = json.dumps(body).encode()
        for attempt in range(len(self.ports) * 2):
            with self.lock:
                port = self.ports[self.i % len(self.ports)]
                self.i += 1
            req = urllib.request.Request(
                "http://127.0.0.1:%d/v1/completions" % port, data=data,
                headers={"Content-Type": "application/json", "x-session-id": session})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return json.loads(r.read()), r.headers["x-kvplane-worker"]
            except (urllib.error.URLError, ConnectionError) as e:
                if isinstance(e, urllib.error.HTTPError):
                    raise
                time.sleep(0.02)
        raise RuntimeError("no replica answered")


def burst(fleet, seed, stats, during=None):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 255) for _ in range(512)]
    lock = threading.Lock()

    def session(k):
        r = random.Random(seed * 1000 + k)
        hist = prefix + [r.randrange(1, 255) for _ in range(32)]
        prev = None
        for t in range(TURNS):
            try:
                out, w = fleet.post({"prompt": hist, "max_tokens": 16}, "s%d-%d" % (seed, k))
                u = out["usage"]
                with lock:
                    stats["prompt"] += u["prompt_tokens"]
                    stats["cached"] += u["prompt_tokens_details"]["cached_tokens"]
                    stats["per_worker"][w] = stats["per_worker"].get(w, 0) + 1
                    stats["moves"] += prev is not None and w != prev
                prev = w
            except Exception as e:  # noqa: BLE001 -- every failure counts
                with lock:
                    stats["errors"].append(repr(e))
            hist = hist + [r.randrange(1, 255) for _ in range(64)]
    ths = [threading.Thread(target=session, args=(k,)) for k in range(SESSIONS)]
    for t in ths:
        t.start()
        time.sleep(0.005)  # a burst, not one instant
    if during:
        during()
    for t in ths:
        t.join()


def summary(stats):
    n = [stats["per_worker"].get(w, 0) for w in stats["workers"]]
    mean = sum(n) / len(n)
    return {"hit": 100.0 * stats["cached"] / max(1, stats["prompt"]),
            "imbalance": 100.0 * (max(n) / mean - 1) if mean else 0.0,
            "per_worker": n, "errors": len(stats["errors"]), "moves": stats["moves"]}


def run(tag, replicas, sync, seed=1, during_fn=None):
    ep, workers = engine(tag)
    np = free_port() if sync else 0
    npp = nats(np, os.path.join(W, "js-" + tag)) if sync else None
    time.sleep(0.3 if sync else 0)
    # a synced fleet mixes one- and two-loop replicas (routerd.threads): the
    # second replica's loops publish their own decisions
    rs = [router(tag, i + 1, workers, np, threads=2 if sync and i == 1 else 1)
          for i in range(replicas)]
    stats = {"prompt": 0, "cached": 0, "per_worker": {}, "errors": [], "moves": 0,
             "workers": [w["url"] for w in workers]}
    ctx = {"rs": rs, "nats": npp, "nats_port": np, "workers": workers, "tag": tag}
    burst(Fleet([r[1] for r in rs]), seed, stats,
          (lambda: during_fn(ctx)) if during_fn else None)
    res = summary(stats)
    res["ctx"] = ctx
    res["stats"] = stats
    return res


def metrics(port):
    try:
        return urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2).read().decode()
    except Exception:
        return ""


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    procs.clear()


# ---- decision quality: one replica vs three with sync vs three without -------
def summarize(rs):
    out = {k: sum(r[k] for r in rs) / len(rs) for k in ("hit", "imbalance", "moves")}
    out["imb_each"] = [round(r["imbalance"], 1) for r in rs]
    out["errors"] = sum(r["errors"] for r in rs)
    out["per_worker"] = [r["per_worker"] for r in rs]
    return out


def compare():
    """The three configurations seed by seed, so the machine's drift falls
    on all three alike."""
    res, lags = {"one": [], "sync": [], "blind": []}, []
    global LOOPS
    for seed in SEEDS:
        for tag, replicas, sync in (("one", 1, False), ("sync", 3, True), ("blind", 3, False)):
            if tag == "blind" and seed > BLIND:
                continue
            r = run("%s%d" % (tag, seed), replicas, sync, seed=seed)
            if sync:
                ms = [metrics(x[1]) for x in r["ctx"]["rs"]]
                lags += [metric(m, 'kvplane_routerd_sync_lag_seconds{quantile="0.99"}')
                         for m in ms]
                for m in ms:
                    RETIRED[0] += metric(m, 'kvplane_routerd_sync_turns_retired_total{state="retired"}') or 0
                    RETIRED[1] += metric(m, 'kvplane_routerd_sync_turns_retired_total{state="done"}') or 0
                m2 = metrics(r["ctx"]["rs"][1][1])
                for i in range(2):
                    LOOPS[i] += metric(m2, 'kvplane_routerd_thread_requests_total{thread="%d"}' % i) or 0
            stop_all()
            res[tag].append(r)
        if seed % 10 == 0:
            print("  ... %d of %d bursts" % (seed, len(SEEDS)), flush=True)
    return res, lags


def paired(a, b):
    """mean of b - a per burst and its 95 % half-width (normal approximation)"""
    d = [y["imbalance"] - x["imbalance"] for x, y in zip(a, b)]
    m = sum(d) / len(d)
    sd = (sum((v - m) ** 2 for v in d) / (len(d) - 1)) ** 0.5 if len(d) > 1 else 0.0
    return m, 1.96 * sd / len(d) ** 0.5

LOOPS = [0, 0]  # requests the two-loop replica served on each loop
RETIRED = [0, 0]  # peers' turns counted over early, and their completions seen
raw, lags = compare()
one, three, blind = summarize(raw["one"]), summarize(raw["sync"]), summarize(raw["blind"])
print("  (averages over %d bursts, blind over %d; %d sessions x %d turns each)" % (
    len(SEEDS), min(BLIND, len(SEEDS)), SESSIONS, TURNS))
for name, r in (("1 replica", one), ("3 replicas + NATS", three), ("3 replicas, no sync", blind)):
    print("  %-20s hit %.1f %%  imbalance %.1f %%  session moves %.2f per burst  "
          "requests per worker %s  errors %d" % (
              name, r["hit"], r["imbalance"], r["moves"], r["per_worker"], r["errors"]))
print("  sync lag p99 per replica and burst: max %.4f s" % max(l or 0 for l in lags))
print("  peers' turns retired by the session's next turn: %d (their late completions seen: %d)"
      % tuple(RETIRED))
check(one["errors"] == 0 and three["errors"] == 0, "no request failed")
check(min(LOOPS) > 0, "the synced fleet's two-loop replica served on both loops: %s" % LOOPS)
check(abs(three["hit"] - one["hit"]) <= 1.0,
      "3 synced replicas' hit rate within 1 point of one replica's (%.1f vs %.1f)" % (three["hit"], one["hit"]))
# Imbalance: a session's turns stay together, so a burst's imbalance moves
# in steps of four requests (12.5 points here) when a session lands
# elsewhere, and one replica replaying the bursts moves by those steps from
# burst to burst by itself (imb_each).  The "within 1 point" is a
# statement about the mean: the bursts are paired (same seed, run back to
# back), and the check fails when the fleet is worse than one replica by
# more than 1 point with 95 % confidence -- the paired difference minus its
# 95 % half-width above 1 point.  At 30 bursts that half-width is ~2.6
# points; 200 bursts measured +0.6 +- 1.0 (docs/routerd.md#replicas).
# Blind replicas (no sync) are shown, not asserted: on a loaded machine
# they may not herd.
STEP = 100.0 * WORKERS / (SESSIONS * TURNS)
print("  imbalance per burst: 1 replica %s, 3 synced %s, 3 blind %s (one request = %.1f points)" % (
    one["imb_each"], three["imb_each"], blind["imb_each"], STEP))
dm, dh = paired(raw["one"], raw["sync"])
bm, bh = paired(raw["one"][:len(raw["blind"])], raw["blind"])
print("  imbalance, 3 synced minus 1 replica, paired by burst: %+.2f +- %.2f points (95 %%); "
      "3 blind minus 1 replica: %+.2f +- %.2f" % (dm, dh, bm, bh))
check(len(SEEDS) >= 2 and dm - dh <= 1.0,
      "3 synced replicas' imbalance not worse than one replica's by more than 1 point "
      "(paired over %d bursts: %+.2f +- %.2f points, 95 %%; means %.1f vs %.1f)"
      % (len(SEEDS), dm, dh, three["imbalance"], one["imbalance"]))


# ---- failures: kill/restart a replica, then NATS, mid-run ----------------------
def chaos(ctx):
    time.sleep(0.4)
    p, port, cfg = ctx["rs"][1]
    p.kill()  # a replica dies mid-run
    p.wait()
    time.sleep(0.3)
    ctx["rs"][1] = (spawn([RD, "--config", cfg], "rd-restarted.log"), port, cfg)
    wait_http("http://127.0.0.1:%d/health" % port)
    time.sleep(0.3)
    ctx["nats"].kill()  # NATS dies mid-run
    ctx["nats"].wait()
    time.sleep(0.5)
    ctx["nats"] = nats(ctx["nats_port"], os.path.join(W, "js-" + ctx["tag"]))

chaos_run = run("chaos", 3, True, seed=4, during_fn=chaos)
time.sleep(1.5)  # reconnect (250 ms waits) + a few snapshots
ms = [metrics(r[1]) for r in chaos_run["ctx"]["rs"]]
print("  chaos run: hit %.1f %%, imbalance %.1f %%, errors %d %s" % (
    chaos_run["hit"], chaos_run["imbalance"], chaos_run["errors"], chaos_run["stats"]["errors"][:3]))
check(chaos_run["errors"] == 0, "replica and NATS killed mid-run: no request failed")
check(all(metric(m, "kvplane_routerd_sync_connected") == 1 for m in ms),
      "every replica reconnected to NATS: %s" % [metric(m, "kvplane_routerd_sync_connected") for m in ms])
check(all(metric(m, "kvplane_routerd_sync_peers") == 2 for m in ms),
      "every replica sees its 2 peers again (the restarted one too): %s" % [
          metric(m, "kvplane_routerd_sync_peers") for m in ms])
check(all((metric(m, "kvplane_routerd_sync_disconnects_total") or 0) >= 1 for m in ms),
      "the NATS outage was seen and counted by every replica")
stop_all()


# ---- JetStream: a late replica rebuilds the live index from the stream --------
def digests(admin_port):
    try:
        body = urllib.request.urlopen("http://127.0.0.1:%d/admin/index" % admin_port, timeout=2).read()
        return {w["url"]: w["digest"] for w in json.loads(body)["workers"]}
    except Exception:
        return {}

if CLI:
    ep, workers = engine("js")
    np = free_port()
    nats(np, os.path.join(W, "js-relay"))
    time.sleep(0.3)
    relay = spawn([CLI, "events", "relay", "--nats", "nats://127.0.0.1:%d" % np, "--stats-every", "0"] +
                  sum((["--worker", "w%d=%s,%s" % (i, w["kv_events"], w["kv_replay"])]
                       for i, w in enumerate(workers)), []), "relay.log")
    time.sleep(0.5)
    live_admin = free_port()
    live = router("jslive", 1, workers, 0, admin=live_admin)
    stats = {"prompt": 0, "cached": 0, "per_worker": {}, "errors": [], "moves": 0,
             "workers": [w["url"] for w in workers]}
    burst(Fleet([live[1]]), 5, stats)
    late_admin = free_port()
    late = router("jslate", 2, workers, np, events=["js:w%d" % i for i in range(WORKERS)],
                  admin=late_admin)
    want, got = digests(live_admin), {}
    t_end = time.time() + 10
    while time.time() < t_end and got != want:
        time.sleep(0.1)
        got = digests(late_admin)
    check(len(want) == WORKERS and stats["errors"] == [] and got == want,
          "a replica started after the traffic rebuilds from JetStream the live index "
          "(digests %s vs %s)" % (sorted(got.values()), sorted(want.values())))
    m = metrics(late[1])
    check("kvplane_events_js_messages_total" in m or "kvplane_events_js" in m,
          "the JetStream reader's counters are in /metrics")
    stop_all()
else:
    print("  (no KVPLANE_CLI argument: the JetStream part is skipped)")
print("test_routerd_replicas: %s (%d failed)" % ("FAIL" if failures else "ok", len(failures)))
sys.exit(1 if failures else 0)
