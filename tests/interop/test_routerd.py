#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd end to end, as a user runs it: emulated vLLM workers
(kvplane-bench engine, two processes so one can be killed), the daemon with
their KV-event endpoints, and the `openai` SDK (PyPI, pinned) as the client.

  test_routerd.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR

Checks: stream and non-stream completions and chat; multi-turn sessions land
where their KV is (the workers' own cached_tokens); a tenant's prompt never
matches another tenant's blocks; x-kvplane-* headers and receipts; 400s with
OpenAI error bodies; admin drain/undrain/add; a worker killed mid-run fails
no request that had not started streaming; SIGTERM drains, then exits 0."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai

from rd_testlib import (check, failures, free_port, metric, metric_sum, start_engine,
                        wait_http, workers_yaml)

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
MODEL = "kvplane-emulated"
LORA = "sql-adapter"  # served beside MODEL, as vLLM's --lora-modules
BS = 16
procs = []


def engine(name, n, loras=(LORA,)):
    return start_engine(B, W, name, n, BS, procs, loras)


def http(method, url, body=None, headers=None):
    req = urllib.request.Request(url, method=method, headers=headers or {},
                                 data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


LORA_B = "math-adapter"  # loaded on engine_b's worker only
ea, wa = engine("engine_a", 2)
eb, wb = engine("engine_b", 1, (LORA, LORA_B))
workers = wa + wb
port, admin = free_port(), free_port()
receipts = os.path.join(W, "receipts.jsonl")
if os.path.exists(receipts):
    os.unlink(receipts)
cfg = os.path.join(W, "routerd.yaml")
with open(cfg, "w") as f:
    f.write(f"""routerd:
  listen: 127.0.0.1:{port}
  admin_listen: 127.0.0.1:{admin}
  receipts: {receipts}
  response_headers: true
  scrape_interval: 50ms
  breaker_failures: 2
  breaker_cooldown: 60s
  retries: 2
  client_timeout: 1s
  max_body: 1M
  max_headers: 8K
{workers_yaml(workers, BS)}""")
chk = subprocess.run([RD, "--config", cfg, "--check-config"], capture_output=True, text=True)
check(chk.returncode == 0, "--check-config accepts the config: " + chk.stdout.strip())
rlog = open(os.path.join(W, "routerd.log"), "w")
rd = subprocess.Popen([RD, "--config", cfg, "--log", "info"], stdout=rlog,
                      stderr=subprocess.STDOUT)
procs.append(rd)
base = f"http://127.0.0.1:{port}"
check(wait_http(base + "/health"), "the router answers /health")
client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

# ---- the API, through the SDK -------------------------------------------------
models = client.models.list()
check([m.id for m in models.data] == [MODEL, LORA, LORA_B], "/v1/models merged: %s" % [m.id for m in models.data])
prompt = [random.Random(1).randrange(1, 255) for _ in range(100)]
r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
check(r.usage.prompt_tokens == 100 and len(r.choices[0].text) > 0, "completion (token ids)")
chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                        stream_options={"include_usage": True}))
check(len(chunks) >= 2 and chunks[-1].usage is not None and
      chunks[-1].usage.prompt_tokens_details.cached_tokens >= 96,
      "streamed completion lands on the worker holding its prefix (cached %s)" %
      (chunks[-1].usage.prompt_tokens_details.cached_tokens if chunks[-1].usage else None))
msgs = [{"role": "system", "content": "You are terse. " * 8},
        {"role": "user", "content": "hello"}]
c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
check(c.choices[0].message.content is not None and c.usage.prompt_tokens > 0, "chat (render endpoint)")
sc = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}))
check(sc[-1].usage is not None and sc[-1].usage.prompt_tokens_details.cached_tokens > 0,
      "streamed chat reuses the rendered prefix")
try:
    client.completions.create(model=MODEL, prompt=[1, -5], max_tokens=1)
    check(False, "negative token id rejected")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "token ids" in str(e), "negative token id -> 400 (%s)" % e.body)
code, body = http("POST", base + "/v1/completions", None)
check(code == 400 and json.loads(body)["error"]["code"] == 400, "empty body -> 400 OpenAI error")
code, _ = http("GET", base + "/v1/nothing")
check(code == 404, "unknown path -> 404")

# ---- hardening: limits and slow clients ------------------------------------------
big = socket.create_connection(("127.0.0.1", port))
big.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 << 20))
big.settimeout(5)
status = big.recv(200).split(b"\r\n")[0]
big.close()
check(b" 413 " in status, "a body over max_body is refused before it is read: %s" % status)
code, body = http("GET", base + "/health", headers={"X-Big": "y" * 20000})
check(code in (400, 413, 431), "headers over max_headers -> %d" % code)
sl = socket.create_connection(("127.0.0.1", port))
sl.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
t0 = time.time()
sl.settimeout(5)
try:
    gone = sl.recv(100) == b""
except (ConnectionResetError, socket.timeout):
    gone = True
check(gone and time.time() - t0 < 4, "a slowloris client is cut after client_timeout (%.1fs)" % (time.time() - t0))
sl.close()
check(wait_http(base + "/health"), "still serving after the abuse")

# ---- sessions: each turn lands where the session's KV is ------------------------
rng = random.Random(7)
ideal = got = 0
for s in range(6):
    hist = [rng.randrange(1, 255) for _ in range(64 + 16 * s)]
    for turn in range(4):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=hist, max_tokens=2, extra_headers={"x-session-id": "s%d" % s})
        resp = raw.parse()
        cached = resp.usage.prompt_tokens_details.cached_tokens
        if turn > 0:
            ideal += prev_blocks * BS
            got += min(cached, prev_blocks * BS)
        check(raw.headers.get("x-kvplane-worker", "").startswith("http://"),
              "session s%d turn %d: routed to %s, cached %d (router predicted %s)" % (
                  s, turn, raw.headers.get("x-kvplane-worker"), cached,
                  raw.headers.get("x-kvplane-cached-tokens")))
        prev_blocks = len(hist) // BS
        hist = hist + [rng.randrange(1, 255) for _ in range(40)]
check(got >= 0.95 * ideal, "sessions reuse %d of %d prefix tokens on the workers" % (got, ideal))

# ---- tenants: one tenant's prompt never matches another's blocks ---------------
tp = [rng.randrange(1, 255) for _ in range(96)]
def tenant_call(t):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=tp, max_tokens=1, extra_headers={"x-tenant-id": t})
    return raw.parse().usage.prompt_tokens_details.cached_tokens, int(raw.headers["x-kvplane-cached-tokens"])
a1 = tenant_call("acme")
time.sleep(0.1)  # the events reach the router
a2 = tenant_call("acme")
b1 = tenant_call("globex")
check(a2[0] >= 80 and a2[1] >= 80, "tenant acme's second call hits (worker %d, router %d)" % a2)
check(b1 == (0, 0), "tenant globex matches none of acme's blocks (worker %d, router %d)" % b1)

# ---- LoRA: an adapter's blocks are its own (vLLM hashes it into every block) ----
lp = [rng.randrange(1, 255) for _ in range(96)]
def model_call(model):
    raw = client.completions.with_raw_response.create(model=model, prompt=lp, max_tokens=1)
    r = raw.parse()
    return (r.usage.prompt_tokens_details.cached_tokens,
            int(raw.headers["x-kvplane-cached-tokens"]), r.model)
model_call(MODEL)
time.sleep(0.1)  # the events reach the router
m2 = model_call(MODEL)
l1 = model_call(LORA)
time.sleep(0.1)
l2 = model_call(LORA)
check(m2[0] >= 80 and m2[1] == m2[0], "base model's second call hits (worker %d, router %d)" % m2[:2])
check(l1[:2] == (0, 0) and l1[2] == LORA,
      "the adapter %s reuses none of the base model's blocks (worker %d, router %d)" % (l1[2], l1[0], l1[1]))
check(l2[0] >= 80 and l2[1] == l2[0],
      "the adapter's second call hits its own blocks (worker %d, router %d)" % l2[:2])

# an adapter loaded on one worker only: its requests go there, whatever
# the other workers hold (they would answer 404: no such model)
got = set()
for i in range(8):
    raw = client.completions.with_raw_response.create(model=LORA_B, prompt=[i + 2] * 48, max_tokens=1)
    got.add(raw.headers["x-kvplane-worker"])
check(got == {wb[0]["url"]}, "adapter %s, loaded on one worker, routes only there (%s)" % (LORA_B, sorted(got)))

# ---- admin: drain, undrain ------------------------------------------------------
abase = f"http://127.0.0.1:{admin}"
code, body = http("GET", abase + "/admin/workers")
check(code == 200 and len(json.loads(body)["workers"]) == 3, "admin lists 3 workers")
target = workers[0]["url"]
code, _ = http("POST", abase + "/admin/workers/drain?url=" + target)
seen = set()
for i in range(12):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=[i + 1] * 40, max_tokens=1)
    seen.add(raw.headers["x-kvplane-worker"])
check(code == 202 and target not in seen, "a drained worker gets no new requests (%s)" % sorted(seen))
code, _ = http("POST", abase + "/admin/workers/undrain?url=" + target)
check(code == 202, "undrain")
code, _ = http("POST", abase + "/admin/workers", {"url": "ftp://x"})
check(code == 400, "admin refuses a bad worker url")

# ---- a client that hangs up mid-stream cancels its upstream request ------------
def worker_gone():
    """Requests whose client (the router) hung up, as the workers saw them."""
    n = 0
    for w in workers:
        _, wm = http("GET", w["url"] + "/metrics")
        n += metric_sum(wm, "kvplane_engine_client_disconnects_total")
    return n


gone0 = worker_gone()
st = client.completions.create(model=MODEL, prompt=[9] * 40, max_tokens=3000, stream=True)
for i, ch in enumerate(st):
    if i == 2:
        break
st.close()
t_end = time.time() + 3
while time.time() < t_end:
    _, m = http("GET", base + "/metrics")
    if metric(m, "kvplane_routerd_inflight") == 0 and worker_gone() > gone0:
        break
    time.sleep(0.05)
check(metric(m, "kvplane_routerd_client_cancels_total") >= 1 and metric(m, "kvplane_routerd_inflight") == 0,
      "a client gone mid-stream cancels upstream (cancels %s, in flight %s)" % (
          metric(m, "kvplane_routerd_client_cancels_total"), metric(m, "kvplane_routerd_inflight")))
check(worker_gone() == gone0 + 1,
      "the worker saw its connection from the router close mid-stream (%s -> %s)" % (gone0, worker_gone()))

# ---- approximate mode: no events, no render: text chunks + routed records ------
port2, admin2 = free_port(), free_port()
cfg2 = os.path.join(W, "routerd-approx.yaml")
def write_cfg2(urls):
    with open(cfg2, "w") as f:
        f.write(f"""routerd:
  listen: 127.0.0.1:{port2}
  admin_listen: 127.0.0.1:{admin2}
  admin_token: s3cret
  render: false
  approx_ttl: 60s
workers:
  urls: [{", ".join(urls)}]
model:
  block_size: {BS}
""")
write_cfg2([w["url"] for w in workers])
rd2 = subprocess.Popen([RD, "--config", cfg2], stdout=rlog, stderr=subprocess.STDOUT)
procs.append(rd2)
check(wait_http(f"http://127.0.0.1:{port2}/health"), "approximate-mode router up")
c2 = openai.OpenAI(base_url=f"http://127.0.0.1:{port2}/v1", api_key="none", max_retries=0)
long_sys = {"role": "system", "content": "Answer in French. " * 30}
where, cached = [], []
for i in range(4):
    raw = c2.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1,
        messages=[long_sys, {"role": "user", "content": "question %d" % i}])
    where.append(raw.headers["x-kvplane-worker"])
    cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
check(len(set(where)) == 1 and min(cached[1:]) > 400,
      "text mode: a shared system prompt stays on one worker (%s, cached %s)" % (where, cached))
code, m2 = http("GET", f"http://127.0.0.1:{port2}/metrics")
check("kvplane_routerd_text_mode_total 4" in m2, "text-mode requests counted")
code, _ = http("GET", f"http://127.0.0.1:{admin2}/admin/workers")
check(code == 401, "admin without the bearer token -> %d" % code)
code, body = http("GET", f"http://127.0.0.1:{admin2}/admin/workers",
                  headers={"Authorization": "Bearer s3cret"})
check(code == 200 and len(json.loads(body)["workers"]) == 3, "admin with the token lists 3 workers")
# SIGHUP: the config's worker list is the truth (one worker gone -> removed)
write_cfg2([w["url"] for w in workers[:2]])
rd2.send_signal(signal.SIGHUP)
t_end, urls = time.time() + 5, None
while time.time() < t_end:
    code, body = http("GET", f"http://127.0.0.1:{admin2}/admin/workers",
                      headers={"Authorization": "Bearer s3cret"})
    urls = sorted(w["url"] for w in json.loads(body)["workers"])
    if len(urls) == 2:
        break
    time.sleep(0.1)
check(urls == sorted(w["url"] for w in workers[:2]), "SIGHUP reload removed the worker gone from the config: %s" % urls)
with open(cfg2, "a") as f:
    f.write("routerd:\n  listen: dup\n")  # a broken config is refused, the running one kept
rd2.send_signal(signal.SIGHUP)
time.sleep(0.3)
check(rd2.poll() is None and wait_http(f"http://127.0.0.1:{port2}/health"), "a broken config on SIGHUP is refused; still serving")
rd2.terminate()
rd2.wait()

# ---- kill a worker mid-run: nothing fails that had not started streaming ---------
results = []
lock = threading.Lock()
def load(k):
    r2 = random.Random(k)
    for i in range(8):
        p = [r2.randrange(1, 255) for _ in range(48)]
        try:
            resp = client.completions.create(model=MODEL, prompt=p, max_tokens=150)
            ok = resp.usage.completion_tokens == 150
        except Exception as e:  # noqa: BLE001 -- every failure counts
            ok = False
        with lock:
            results.append(ok)
streams = []
def load_stream(k):
    r2 = random.Random(100 + k)
    for i in range(6):
        p = [r2.randrange(1, 255) for _ in range(48)]
        got = 0
        try:
            for ch in client.completions.create(model=MODEL, prompt=p, max_tokens=150, stream=True):
                got += 1
            ok = True
        except Exception:  # noqa: BLE001
            ok = False
        with lock:
            streams.append((ok, got))
ths = [threading.Thread(target=load, args=(k,)) for k in range(6)]
ths += [threading.Thread(target=load_stream, args=(k,)) for k in range(3)]
for t in ths:
    t.start()
# worker 3 dies with requests in flight: 0.3 s into the load (the other
# workers' requests under way too, some retried), and only once its own
# /metrics shows requests running -- asserted, not assumed
time.sleep(0.3)
t_end, running = time.time() + 10, 0
while time.time() < t_end and not running:
    _, wm = http("GET", wb[0]["url"] + "/metrics")
    running = metric_sum(wm, "vllm:num_requests_running")
    time.sleep(0.01)
check(running > 0, "worker 3 had %d requests running when it was killed" % running)
eb.kill()
for t in ths:
    t.join()
check(len(results) == 48 and all(results),
      "worker killed mid-run: %d of %d non-streamed requests succeeded" % (sum(results), len(results)))
check(len(streams) == 18 and all(ok or got > 0 for ok, got in streams),
      "worker killed mid-run: no stream failed before its first token (%d failed after it)" %
      sum(1 for ok, got in streams if not ok))
time.sleep(0.3)
code, body = http("GET", abase + "/admin/workers")
states = {w["url"]: w["state"] for w in json.loads(body)["workers"]}
check(states.get(wb[0]["url"]) == "down", "the dead worker's circuit is open: %s" % states.get(wb[0]["url"]))

# ---- metrics and receipts -----------------------------------------------------
code, m = http("GET", base + "/metrics")
need = ["kvplane_routerd_requests_total", "kvplane_routerd_retries_total",
        "kvplane_routerd_decisions_total{reason=\"cost\"}", "kvplane_routerd_worker_errors_total",
        "kvplane_routerd_reported_cached_tokens_total", "kvplane_events_batches_total",
        "kvplane_routerd_render_seconds"]
check(code == 200 and all(n in m for n in need), "/metrics carries " + ", ".join(need))
retries = [l for l in m.splitlines() if l.startswith("kvplane_routerd_retries_total ")]
check(retries and int(retries[0].split()[1]) > 0, "retries were counted: %s" % retries)
# the client's X-Request-Id is in its receipt, escaped (joins receipts to
# client-side logs: bench/live/breakdown.py); an over-long one is null
rid = 'rid-"q"\\ \x01-%d' % os.getpid()
for h in ({"X-Request-Id": rid}, {"X-Request-Id": "x" * 300}):
    code, _ = http("POST", base + "/v1/completions",
                   {"model": MODEL, "prompt": [7] * 40, "max_tokens": 1}, h)
    check(code == 200, "a request with X-Request-Id %r...: %d" % (h["X-Request-Id"][:12], code))
for _ in range(50):  # a receipt is written as the request is accounted
    lines = open(receipts).read().splitlines()
    if lines and json.loads(lines[-1]).get("client_request_id", "absent") is None:
        break
    time.sleep(0.1)
recs = [json.loads(l) for l in lines]
rids = [r.get("client_request_id", "absent") for r in recs]
check(rid in rids and rids[-1] is None and "absent" not in rids,
      "receipts carry the client's X-Request-Id (escaped: %r), null when over-long"
      % [x for x in rids if x not in (None, "absent")][-1:])
check(len(recs) > 40 and all("receipt" in r and "worker" in r for r in recs),
      "one JSON receipt per request (%d)" % len(recs))

# ---- SIGTERM drains ---------------------------------------------------------------
slow = {}
def slow_call():
    try:
        slow["r"] = client.completions.create(model=MODEL, prompt=[5] * 32, max_tokens=600)
    except Exception as e:  # noqa: BLE001
        slow["e"] = e
th = threading.Thread(target=slow_call)
th.start()
time.sleep(0.3)
rd.send_signal(signal.SIGTERM)
th.join()
rc = rd.wait(timeout=30)
check("r" in slow and slow["r"].usage.completion_tokens == 600 and rc == 0,
      "SIGTERM: the in-flight request finished (%s), then exit %d" % (slow.get("e", "ok"), rc))

for p in procs:
    if p.poll() is None:
        p.kill()
        p.wait()
print("test_routerd: %s (%d failed)" % ("FAIL" if failures else "ok", len(failures)))
sys.exit(1 if failures else 0)
