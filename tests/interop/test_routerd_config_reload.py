#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd SIGHUP (systemctl reload), as an SRE uses it: emulated vLLM
workers (kvplane-bench engine), the daemon, plain HTTP (no SDK: stdlib only).

  test_routerd_config_reload.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR

Checks: max_body, the routing policy, tenant_header and retries change on
SIGHUP and take effect (413 at the new size, x-kvplane-reason round_robin,
the tenant read from the new header); the receipts file is reopened after a
logrotate-style rename; a restart-only change (listen, model.block_size) is
named in one WARN line and not applied; the reload counters and timestamp
move; a config that does not validate, or routing options the router
refuses, is refused whole and the running one kept."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from rd_testlib import check, failures, free_port, metric, start_engine, wait_http

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
MODEL = "kvplane-emulated"
BS = 16
procs = []


def http(method, url, body=None, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body else None
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers


def engine(name, n):
    return start_engine(B, W, name, n, BS, procs)[1]


workers = engine("engine_reload", 2)
port, port_new = free_port(), free_port()
receipts = os.path.join(W, "receipts.jsonl")
for f in (receipts, receipts + ".1"):
    if os.path.exists(f):
        os.unlink(f)
cfg = os.path.join(W, "routerd.yaml")


def write_cfg(listen_port, max_body, policy, tenant_header, block_size=BS, routing=""):
    with open(cfg, "w") as f:
        f.write(f"""routerd:
  listen: 127.0.0.1:{listen_port}
  receipts: {receipts}
  scrape_interval: 50ms
  max_body: {max_body}
  policy: {policy}
  tenant_header: {tenant_header}
  response_headers: true
  retries: 2
  client_timeout: 1s
workers:
  urls: [{", ".join(w["url"] for w in workers)}]
  kv_events: [{", ".join(w["kv_events"] for w in workers)}]
model:
  block_size: {block_size}
{routing}""")


def body_413(size):
    """Status line of a request declaring `size` body bytes (none sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
    s.settimeout(5)
    try:
        line = s.recv(200).split(b"\r\n")[0]
    except socket.timeout:
        line = b"(no answer)"
    s.close()
    return line


def complete(i, headers=None):
    code, body, h = http("POST", base + "/v1/completions",
                         {"model": MODEL, "prompt": [i % 200 + 1] * 48, "max_tokens": 1},
                         headers=dict({"Content-Type": "application/json"}, **(headers or {})))
    return code, h.get("x-kvplane-reason"), h.get("x-kvplane-worker")


def reload_and_wait(rd, before_ok, before_refused):
    rd.send_signal(signal.SIGHUP)
    t_end = time.time() + 5
    while time.time() < t_end:
        _, m, _ = http("GET", base + "/metrics")
        ok = metric(m, 'kvplane_routerd_config_reloads_total{result="ok"}')
        bad = metric(m, 'kvplane_routerd_config_reloads_total{result="refused"}')
        if ok != before_ok or bad != before_refused:
            return m
        time.sleep(0.05)
    return m


write_cfg(port, "256K", "kvplane_cost", "x-tenant-id")
logf = os.path.join(W, "routerd.log")
rlog = open(logf, "w")
t_start = time.time()
rd = subprocess.Popen([RD, "--config", cfg, "--log", "info"], stdout=rlog,
                      stderr=subprocess.STDOUT)
procs.append(rd)
base = f"http://127.0.0.1:{port}"
check(wait_http(base + "/health"), "the router answers /health")

# ---- before: kvplane_cost, max_body 256K, tenant from x-tenant-id ------------------
code, reason, _ = complete(1)
check(code == 200 and reason in ("cost", "tie", "only", "affinity"),
      "before the reload: kvplane_cost decides (%d, reason %s)" % (code, reason))
st = body_413(192 << 10)
check(b" 413 " not in st, "before: a 192K body is within max_body 256K (%s)" % st)
st = body_413(300 << 10)
check(b" 413 " in st, "before: a 300K body is over max_body 256K: %s" % st)
_, m, _ = http("GET", base + "/metrics")
ts0 = metric(m, "kvplane_routerd_config_last_reload_success_timestamp_seconds")
check(metric(m, 'kvplane_routerd_config_reloads_total{result="ok"}') == 0 and
      ts0 is not None and abs(ts0 - t_start) < 30,
      "reload counter 0, last success = the start (%s vs %.0f)" % (ts0, t_start))
n_before = len(open(receipts).read().splitlines())
check(n_before >= 1, "receipts written before the rotation (%d)" % n_before)

# ---- logrotate renames the file; the config changes; SIGHUP -------------------------
os.rename(receipts, receipts + ".1")
write_cfg(port_new, "128K", "round_robin", "x-org", block_size=2 * BS)
time.sleep(1.1)  # the timestamp must move
m = reload_and_wait(rd, 0, 0)
check(metric(m, 'kvplane_routerd_config_reloads_total{result="ok"}') == 1,
      "reloads_total{result=\"ok\"} moved to 1")
ts1 = metric(m, "kvplane_routerd_config_last_reload_success_timestamp_seconds")
check(ts1 is not None and ts1 > ts0 + 1,
      "last_reload_success_timestamp_seconds moved (%s -> %s)" % (ts0, ts1))
check(metric(m, "kvplane_routerd_config_last_reload_successful") == 1,
      "last_reload_successful 1")

st = body_413(192 << 10)
check(b" 413 " in st, "after: a 192K body is over the new max_body 128K: %s" % st)
reasons, seen = [], set()
for i in range(4):
    code, reason, w = complete(10 + i, {"x-org": "acme"})
    reasons.append(reason)
    seen.add(w)
check(reasons == ["round_robin"] * 4 and len(seen) == 2,
      "after: x-kvplane-reason shows the new policy: %s over %d workers" % (reasons, len(seen)))
time.sleep(0.2)  # the last receipt is written as its reply ends
check(os.path.exists(receipts), "receipts reopened at the configured path after the rename")
new = [json.loads(l) for l in open(receipts).read().splitlines()]
old = open(receipts + ".1").read().splitlines()
check(len(new) == 4 and len(old) == n_before,
      "new receipts go to the new file (%d), none to the renamed one (%d, was %d)" %
      (len(new), len(old), n_before))
tenants = [r["receipt"].get("tenant") for r in new]
check(tenants == ["acme"] * 4, "tenant_header x-org is read: receipts' tenants %s" % tenants)
code, _, _ = complete(20, {"x-tenant-id": "globex"})
time.sleep(0.2)
last = json.loads(open(receipts).read().splitlines()[-1])
check(code == 200 and last["receipt"].get("tenant") in (None, ""),
      "the old tenant header no longer names a tenant (%s)" % last["receipt"].get("tenant"))

log = open(logf).read()
want = "reload: listen, model.block_size changed: they take a restart (running values kept)"
check(metric(m, "kvplane_routerd_config_restart_pending") == 1,
      "restart-only keys changed: config_restart_pending 1")
check(want in log, "restart-only changes named in one WARN line: %s" %
      [l for l in log.splitlines() if "take" in l and "restart" in l])
check(wait_http(base + "/health", 2) and not wait_http(f"http://127.0.0.1:{port_new}/health", 0.5),
      "listen not applied: still on the running port, not on the new one")

# ---- a config that does not validate: refused, nothing changes -------------------
write_cfg(port, "1M", "fastest", "x-org")
m = reload_and_wait(rd, 1, 0)
check(metric(m, 'kvplane_routerd_config_reloads_total{result="refused"}') == 1 and
      metric(m, "kvplane_routerd_config_last_reload_successful") == 0 and
      metric(m, "kvplane_routerd_config_last_reload_success_timestamp_seconds") == ts1,
      "a broken config: refused counted, last_reload_successful 0, timestamp kept")
st = body_413(192 << 10)
code, reason, _ = complete(30)
check(b" 413 " in st and reason == "round_robin" and rd.poll() is None,
      "... and the running config kept (max_body 128K, round_robin: %s, %s)" % (st, reason))
check("reload refused, keeping the running config" in open(logf).read(), "the refusal is logged")

# ---- routing options in range for the binding but refused by the router: the
# config load already asks the router (as --check-config does), so the whole
# reload is refused with the option named; kvp_router_set_opts' own refusal
# is test_route's set_opts_live ------------------------------------------------
write_cfg(port, "1M", "least_loaded", "x-org", routing="routing:\n  tie_rel: 5\n")
m = reload_and_wait(rd, 1, 1)
code, reason, _ = complete(31)
st = body_413(192 << 10)
log = open(logf).read()
check(metric(m, 'kvplane_routerd_config_reloads_total{result="refused"}') == 2 and
      "opts.tie_rel = 5: must be finite" in log and "reload refused" in log and
      reason == "round_robin" and b" 413 " in st,
      "routing.tie_rel 5 (the router's bound is 1): refused, named, nothing applied (%s, %s)" %
      (reason, st))

rd.terminate()
rc = rd.wait(timeout=30)
check(rc == 0, "SIGTERM: exit %d" % rc)
for p in procs:
    if p.poll() is None:
        p.kill()
        p.wait()
print("test_routerd_config_reload: %s (%d failed)" % ("FAIL" if failures else "ok", len(failures)))
sys.exit(1 if failures else 0)
