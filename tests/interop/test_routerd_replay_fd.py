#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd when a worker's KV-event replay endpoint never answers
(issue 38's "Epoll MOD ... Bad file descriptor" and the stalled client of
the real-vLLM CI run, 2026-11-29): every replay then times out and the
subscriber reopens its DEALER socket.  It used to hand the loop each socket's
own ZMQ_FD, so a reopen closed an fd that libevent still watched; the next
accepted client connection took that number and was never read (libevent
thought it already watched the fd) until the request deadline cut it.  Now
the loop watches one epoll fd that outlives the sockets (kvp_events_fds).

  test_routerd_replay_fd.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR

One emulated worker, its replay endpoint a port nobody listens on; for
KVP_REPLAY_FD_S seconds (default 12, two or more replay timeouts) a client
opens a new connection for every request.  Checks: every request answered
200 within its timeout; the replays did fail and were counted
(kvplane_events_replay_failures_total > 0: the reopen happened); no libevent
message in the router's log."""
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rd_testlib import check, failures, free_port, metric_sum, start_engine, wait_http  # noqa: E402

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
BS = 16
RUN_S = float(os.environ.get("KVP_REPLAY_FD_S", "12"))
procs = []


def post(port, body, timeout=5.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status
    except OSError as e:
        return "%s: %s" % (type(e).__name__, e)
    finally:
        c.close()


try:
    _, ws = start_engine(B, W, "engine", 1, BS, procs)
    dead = free_port()  # nothing listens here: every replay times out
    port = free_port()
    cfg = os.path.join(W, "routerd.yaml")
    with open(cfg, "w") as f:
        f.write("routerd:\n  listen: 127.0.0.1:%d\n  render: false\n  client_timeout: 2s\n"
                "workers:\n  urls: [%s]\n  kv_events: [%s]\n  kv_replay: [tcp://127.0.0.1:%d]\n"
                "model:\n  block_size: %d\n" % (port, ws[0]["url"], ws[0]["kv_events"], dead, BS))
    log_path = os.path.join(W, "routerd.log")
    with open(log_path, "w") as rlog:
        rd = subprocess.Popen([RD, "--config", cfg], stdout=rlog, stderr=subprocess.STDOUT)
    procs.append(rd)
    check(wait_http("http://127.0.0.1:%d/health" % port), "routerd up")
    bad, n, end = [], 0, time.time() + RUN_S
    while time.time() < end:
        st = post(port, {"model": "kvplane-emulated", "prompt": [7 + n % 50] * 48,
                         "max_tokens": 1})
        n += 1
        if st != 200:
            bad.append(st)
        time.sleep(0.01)
    check(n > 100 and not bad, "%d requests, each on a new connection, all 200 (failed: %s)"
          % (n, bad[:3]))
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
            m = r.read().decode()
    except OSError as e:  # a stalled connection: the bug this test is for
        m = ""
        check(False, "/metrics answers: %s" % e)
    fails = metric_sum(m, "kvplane_events_replay_failures_total")
    check(fails >= 2, "the replays failed and were counted: %d (the socket was reopened)" % fails)
    rd.terminate()
    rd.wait(30)
    with open(log_path) as f:
        lines = [x for x in f.read().splitlines() if "] libevent: " in x or "Epoll" in x]
    check(not lines, "no libevent complaint in the router's log (%d%s)"
          % (len(lines), (": " + lines[0]) if lines else ""))
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()

if failures:
    print("FAILED: %d check(s)" % len(failures))
    sys.exit(1)
print("test_routerd_replay_fd: ok")
