#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd paces its /metrics scrapes by what they cost the worker
(routerd.scrape_budget): a worker whose /metrics takes 100 ms to answer is
scraped at most every 5 s (100 ms / 0.02, capped at RD_SCRAPE_MAX_S), one
whose /metrics is instant every scrape_interval; with scrape_budget 0, every
scrape_interval whatever it costs.  vLLM's /metrics (57 KB of text rendered
in Python) took a fifth of a half-core CPU worker at the old fixed 250 ms,
and slowed its prefill and decode by as much (docs/live.md).

  test_routerd_scrape.py KVPLANE_ROUTERD WORK_DIR"""
import os
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rd_fakeworker import Fake, fake_worker  # noqa: E402
from rd_testlib import check, failures, free_port, wait_http  # noqa: E402

RD, W = sys.argv[1], sys.argv[2]
os.makedirs(W, exist_ok=True)
count = {}


def handler(delay):
    class H(Fake):
        def do_GET(self):
            if self.path == "/metrics":
                count[delay] = count.get(delay, 0) + 1
                time.sleep(delay)
            Fake.do_GET(self)
    return H


def run(budget, seconds=3.0):
    count.clear()
    slow, fast = fake_worker(handler(0.1)), fake_worker(handler(0.0))
    port = free_port()
    cfg = os.path.join(W, "rd-%s.yaml" % budget)
    with open(cfg, "w") as f:
        f.write("routerd:\n  listen: 127.0.0.1:%d\n  scrape_interval: 100ms\n"
                "%sworkers:\n  urls: [%s, %s]\nnamespace:\n  model_id: m\n"
                "model:\n  block_size: 16\n" % (
                    port, "" if budget is None else "  scrape_budget: %s\n" % budget,
                    slow, fast))
    p = subprocess.Popen([RD, "--config", cfg], stdout=open(cfg + ".log", "w"),
                         stderr=subprocess.STDOUT)
    try:
        ok = wait_http("http://127.0.0.1:%d/health" % port, 10)
        count.clear()
        time.sleep(seconds)
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
            m = r.read().decode()
        got = dict(count)
    finally:
        p.terminate()
        p.wait(10)
    return ok, got, m, slow


ok, got, m, slow = run(None)
check(ok, "routerd up with two fake workers")
check(got.get(0.1, 0) <= 2 and got.get(0.0, 0) >= 10,
      "default budget (0.02): the 100 ms /metrics scraped %d times in 3 s (<= 2), "
      "the instant one %d times (>= 10)" % (got.get(0.1, 0), got.get(0.0, 0)))
line = [x for x in m.splitlines() if x.startswith(
    'kvplane_routerd_worker_scrape_seconds{worker="%s",what="interval"}' % slow)]
check(line and float(line[0].split()[-1]) >= 4.0,
      "its paced interval is exported: %s" % line)
ok, got, m, slow = run(0)
check(got.get(0.1, 0) >= 10,
      "scrape_budget 0: every scrape_interval whatever it costs (%d in 3 s)" % got.get(0.1, 0))
sys.exit(1 if failures else 0)
