#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd's /metrics is valid Prometheus exposition text (issue
38): checked by Prometheus's own `promtool check metrics` (Debian package
`prometheus`, .ci/deps) and by a strict reading here -- one HELP and one
TYPE per family, before its samples, a family's samples together -- with
several workers (each with a KV-event subscriber: their families repeated
per worker before), a tenant in the ledger, and the prometheus_client
parser where installed.

  test_routerd_metrics.py KVPLANE_ROUTERD WORK_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testports import free_port  # noqa: E402
from rd_fakeworker import fake_worker  # noqa: E402

RD, W = sys.argv[1], sys.argv[2]
os.makedirs(W, exist_ok=True)
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg, flush=True)


ws = [fake_worker() for _ in range(3)]
port = free_port()
front = "http://127.0.0.1:%d" % port
cfg = os.path.join(W, "rd.yaml")
with open(cfg, "w") as f:
    f.write("""routerd:
  listen: 127.0.0.1:%d
  render: false
  scrape_interval: 50ms
workers:
  urls: [%s]
  kv_events: [%s]
model:
  block_size: 16
""" % (port, ", ".join(ws), ", ".join("tcp://127.0.0.1:%d" % free_port() for _ in ws)))
log = open(os.path.join(W, "rd.log"), "w")
rd = subprocess.Popen([RD, "--config", cfg], stdout=log, stderr=subprocess.STDOUT)
end = time.time() + 10
text = None
while time.time() < end and text is None:
    try:
        with urllib.request.urlopen(front + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        time.sleep(0.05)
for t in ("acme", "globex", ""):
    req = urllib.request.Request(front + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": list(range(1, 40)),
                                                  "max_tokens": 1}).encode(),
                                 headers={"x-tenant-id": t} if t else {})
    urllib.request.urlopen(req, timeout=10).read()
with urllib.request.urlopen(front + "/metrics", timeout=5) as r:
    text = r.read().decode()
rd.terminate()
rd.wait(10)
path = os.path.join(W, "metrics.txt")
open(path, "w").write(text)

# ---- a strict reading ---------------------------------------------------------------
helps, types, seen_fam, closed = {}, {}, [], set()
cur = None


def family(name):
    for sfx in ("_sum", "_count", "_bucket"):
        if name.endswith(sfx) and types.get(name[:-len(sfx)]) in ("summary", "histogram"):
            return name[:-len(sfx)]
    return name


for line in text.splitlines():
    m = re.match(r"# (HELP|TYPE) (\S+) ?(.*)", line)
    if m:
        kind, name, rest = m.groups()
        d = helps if kind == "HELP" else types
        check(name not in d, "second %s for %s" % (kind, name))
        d[name] = rest
        check(name not in closed and (cur is None or cur == name or name not in seen_fam),
              "%s of %s after its samples or another family's" % (kind, name))
        if cur != name:
            if cur is not None:
                closed.add(cur)
            cur = name
        continue
    if not line or line.startswith("#"):
        continue
    name = family(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    check(name not in closed, "family %s interleaved with another (line %r)" % (name, line))
    if cur != name:
        if cur is not None:
            closed.add(cur)
        cur = name
    if name not in seen_fam:
        seen_fam.append(name)
for name in seen_fam:
    check(name in helps and name in types, "%s has HELP and TYPE" % name)
check(len([n for n in seen_fam if n.startswith("kvplane_events_")]) > 10,
      "the subscribers' families are there (%d)" % len(seen_fam))
check(any(n.startswith("kvplane_tenant_") for n in seen_fam), "the ledger's tenants are there")
check('kvplane_events_batches_total{source="0",worker="2"' in text,
      "the third worker's subscriber is in the merged family")

# ---- prometheus_client's parser, promtool -----------------------------------------
try:
    from prometheus_client.parser import text_string_to_metric_families
    n = sum(1 for _ in text_string_to_metric_families(text))
    check(n >= len(seen_fam) - 5, "prometheus_client parses %d families" % n)
except ImportError:
    print("note: prometheus_client is not installed: its parser skipped")
promtool = shutil.which("promtool")
if promtool:
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True)
    check(p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(),
          "promtool check metrics: rc %d %s %s" % (p.returncode, p.stdout[:2000],
                                                   p.stderr[:2000]))
else:
    print("note: promtool is not installed (Debian package prometheus): skipped")

if failures:
    print("test_routerd_metrics: %d failed (the text: %s)" % (len(failures), path))
    sys.exit(1)
print("test_routerd_metrics: ok")
