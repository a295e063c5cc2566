#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd in front of a fleet several teams share (issue 38, access
and tenants), stdlib only.  The workers are recording fakes in this process
(vLLM's /v1/completions, /metrics, /v1/models), so the test sees the exact
bytes the router forwards.

  test_routerd_access.py KVPLANE_ROUTERD WORK_DIR

Checks:
  1. --check-config refuses an admin or indexer listener off loopback
     without a token, warns about a front door off loopback;
  2. the indexer's /register and /unregister need the token (any case of
     "Bearer"; 401 with WWW-Authenticate, logged); a /register with a url is
     refused (403) unless routerd.indexer_routes; /unregister cannot remove
     a configured worker; reads stay open;
  3. admin: state changes only by POST/DELETE (GET drain -> 405, nothing
     drained), each change and each refused token logged;
  4. tenant salts: a request without a tenant naming "kvplane-tenant:acme"
     (the old salt) or acme's derived salt does not hit acme's blocks;
     tenant "a|b" and tenant "a" + cache_salt "b" do not share blocks; the
     salt the worker sees is [A-Za-z0-9_-], <= 128 characters, for tenants
     with '@', '/', '\\' and 127 bytes; 128 bytes -> 400 naming the header;
     the body is spliced (floats and token ids byte for byte) and the
     Authorization header passed whole (2,000 bytes);
  5. response_headers: auto leaves x-kvplane-* off a tenant's reply, on an
     untenanted one; false: off for all.
"""
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from testports import free_port  # noqa: E402
from rd_fakeworker import Fake, fake_worker  # noqa: E402
from rd_testlib import check, failures  # noqa: E402 (shared ok/FAIL checks)

RD, W = sys.argv[1], sys.argv[2]
os.makedirs(W, exist_ok=True)
BS = 16
procs = []


def http(method, url, body=None, headers=None, raw=None):
    data = raw if raw is not None else (
        json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def write_cfg(name, text):
    path = os.path.join(W, name + ".yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def check_config(name, text):
    p = subprocess.run([RD, "--config", write_cfg(name, text), "--check-config"],
                       capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def start(name, text, ready_url):
    cfg = write_cfg(name, text)
    log = open(os.path.join(W, name + ".log"), "w")
    p = subprocess.Popen([RD, "--config", cfg, "--log", "info"], stdout=log,
                         stderr=subprocess.STDOUT)
    procs.append(p)
    end = time.time() + 10
    while time.time() < end:
        try:
            if http("GET", ready_url)[0] == 200:
                return p
        except OSError:
            pass
        time.sleep(0.05)
    print(open(os.path.join(W, name + ".log")).read())
    raise SystemExit("FAIL: %s did not come up" % name)


def log_of(name):
    return open(os.path.join(W, name + ".log")).read()


# ---- 1. --check-config ------------------------------------------------------------
base = "routerd:\n  listen: 127.0.0.1:%d\n" % free_port()
rc, out = check_config("c1", base + "  admin_listen: 0.0.0.0:%d\n" % free_port())
check(rc == 2 and "admin_token" in out, "admin off loopback without a token "
      "refused: rc %d %s" % (rc, out))
rc, out = check_config("c2", base + "  indexer_listen: 0.0.0.0:%d\n" % free_port())
check(rc == 2 and "indexer_token" in out, "indexer off loopback without a "
      "token refused: rc %d %s" % (rc, out))
rc, out = check_config("c3", base + "  indexer_listen: 0.0.0.0:%d\n  "
                       "indexer_token: s3cret\n  admin_listen: 0.0.0.0:%d\n"
                       "  admin_token: adm\n" % (free_port(), free_port()))
check(rc == 0, "listeners off loopback with tokens pass: rc %d %s" % (rc, out))
rc, out = check_config("c4", "routerd:\n  listen: 0.0.0.0:%d\n" % free_port())
check(rc == 0 and "WARNING" in out and "off loopback" in out,
      "front door off loopback: a warning: rc %d %s" % (rc, out))
rc, out = check_config("c5", base + "  response_headers: maybe\n")
check(rc == 2 and "response_headers" in out, "response_headers checked: %s" % out)

# ---- 2, 3. indexer and admin tokens ---------------------------------------------------
wa, wb = fake_worker(), fake_worker()
port, admin, ix = free_port(), free_port(), free_port()
front = "http://127.0.0.1:%d" % port
A = "http://127.0.0.1:%d" % admin
IX = "http://127.0.0.1:%d" % ix
start("rd_a", """routerd:
  listen: 127.0.0.1:%d
  admin_listen: 127.0.0.1:%d
  admin_token: adm-tok
  indexer_listen: 127.0.0.1:%d
  indexer_token: ix-tok
  render: false
  scrape_interval: 100ms
  response_headers: true
workers:
  urls: [%s]
namespace:
  model_id: m
model:
  block_size: %d
""" % (port, admin, ix, wa, BS), IX + "/health")
reg = {"instance_id": 7, "endpoint": "tcp://127.0.0.1:1",
       "model_name": "m", "block_size": BS}
st, h, _ = http("POST", IX + "/register", dict(reg, url=wb))
check(st == 401 and "Bearer" in (h.get("WWW-Authenticate") or ""),
      "indexer /register without a token: 401 + WWW-Authenticate (%d)" % st)
st, _, _ = http("POST", IX + "/register", dict(reg, url=wb),
                {"Authorization": "Bearer wrong"})
check(st == 401, "indexer /register with a wrong token: 401 (%d)" % st)
st, _, b = http("POST", IX + "/register", dict(reg, url=wb),
                {"Authorization": "bearer ix-tok"})
check(st == 403 and b"indexer_routes" in b, "a url through /register is a "
      "routing target: 403 without indexer_routes (%d %s)" % (st, b))
st, _, b = http("POST", IX + "/register", reg, {"Authorization": "BEARER adm-tok"})
check(st == 201, "index-only /register with the admin token, any case: %d %s"
      % (st, b))
st, _, b = http("POST", IX + "/unregister", {"instance_id": wa, "model_name": "m"})
check(st == 401, "/unregister without a token: 401 (%d)" % st)
st, _, b = http("POST", IX + "/unregister", {"instance_id": wa, "model_name": "m"},
                {"Authorization": "Bearer ix-tok"})
check(st == 403, "/unregister of a configured worker: 403 (%d %s)" % (st, b))
st, _, b = http("GET", IX + "/workers")
check(st == 200 and wa.encode() in b, "reads stay open; the configured worker "
      "is still listed (%d)" % st)
st, h, b = http("POST", front + "/v1/completions",
                {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
check(st == 200 and h.get("x-kvplane-worker") == wa,
      "requests still go to the configured worker (%d %s)" % (st, b))
check("refused POST /register" in log_of("rd_a"), "refused tokens are logged")
check("indexer: registered instance 7" in log_of("rd_a"), "registrations logged")

st, _, _ = http("GET", A + "/admin/workers")
check(st == 401, "admin without a token: 401 (%d)" % st)
st, _, _ = http("GET", A + "/admin/workers/drain?url=" + wa,
                headers={"Authorization": "Bearer adm-tok"})
check(st == 405, "GET /admin/workers/drain: 405 (%d)" % st)
st, _, b = http("GET", A + "/admin/workers", headers={"Authorization": "Bearer adm-tok"})
state = [w["state"] for w in json.loads(b)["workers"] if w["url"] == wa]
check(state == ["up"], "a GET drained nothing: %s" % state)
st, _, _ = http("POST", A + "/admin/workers/drain?url=" + wa,
                headers={"Authorization": "bearer adm-tok"})
st2, _, _ = http("POST", A + "/admin/workers/undrain?url=" + wa,
                 headers={"Authorization": "Bearer adm-tok"})
check(st == 202 and st2 == 202, "POST drain / undrain: %d %d" % (st, st2))
check(re.search(r"admin: POST /admin/workers/drain\S* \(url %s\) from 127\.0\.0\.1"
                % re.escape(wa), log_of("rd_a")) is not None, "admin actions logged")
stamp = re.search(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.\d{3}Z kvplane\[warn\] routerd: admin:",
                  log_of("rd_a"), re.M)
check(stamp is not None and abs(time.mktime(time.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%S"))
                                - time.timezone - time.time()) < 300,
      "log lines carry a UTC wall-clock timestamp: %r" % log_of("rd_a")[:200])

# ---- 4, 5. tenants --------------------------------------------------------------------
def prompt(seed, n=6 * BS):
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


def complete(toks, headers=None, extra=None, url=front):
    body = {"model": "m", "prompt": toks, "max_tokens": 1}
    body.update(extra or {})
    st, h, b = http("POST", url + "/v1/completions", body, headers)
    return st, h, b


def cached(h):
    return int(h.get("x-kvplane-cached-tokens") or -1)


SALT = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def last_salt():
    return json.loads(Fake.seen[-1][2]).get("cache_salt")


p = prompt(1)
st, h, _ = complete(p, {"x-tenant-id": "acme"})
check(st == 200, "acme's first request: %d" % st)
acme_salt = last_salt()
check(acme_salt and SALT.match(acme_salt), "acme's salt as vLLM takes it: %r" % acme_salt)
st, h, _ = complete(p, {"x-tenant-id": "acme"})
check(cached(h) >= 5 * BS, "acme's second request hits (%d)" % cached(h))
for extra, what in (({"cache_salt": "kvplane-tenant:acme"}, "the old salt"),
                    ({"cache_salt": acme_salt}, "acme's derived salt")):
    st, h, _ = complete(p, None, extra)
    check(st == 200 and cached(h) == 0, "no tenant + %s matches none of acme's "
          "blocks (%d, %d)" % (what, st, cached(h)))
    check(last_salt() != acme_salt, "the worker never sees acme's salt for it")
q = prompt(2)
complete(q, {"x-tenant-id": "a|b"})
ab_salt = last_salt()
st, h, _ = complete(q, {"x-tenant-id": "a"}, {"cache_salt": "b"})
check(cached(h) == 0 and last_salt() != ab_salt,
      "tenant a|b and tenant a + cache_salt b share nothing (%d)" % cached(h))
for t in ("t@corp/x\\y", "u" * 127, "n\u00e4me"):
    st, h, b = complete(prompt(3), {"x-tenant-id": t.encode().decode("latin-1")})
    check(st == 200 and SALT.match(last_salt() or ""),
          "tenant %r..: %d, salt %r" % (t[:12], st, last_salt()))
st, h, b = complete(prompt(3), {"x-tenant-id": "v" * 128})
check(st == 400 and b"x-tenant-id" in b and b"127" in b,
      "a 128-byte tenant: 400 naming the header (%d %s)" % (st, b[:200]))
st, h, b = complete(prompt(3), {"x-session-id": "s" * 300})
check(st == 400 and b"x-session-id" in b, "a 300-byte session id: 400 (%d)" % st)
raw = (b'{"model":"m","temperature":0.10000000000000001,"top_p":1e-7,'
       b'"prompt":[5,6,7],"cache_salt":"mine","max_tokens":1}')
auth = "Bearer " + "k" * 2000
st, h, b = http("POST", front + "/v1/completions", raw=raw,
                headers={"x-tenant-id": "acme", "Authorization": auth})
sent = Fake.seen[-1]
spliced = re.sub(rb'"cache_salt":"[^"]*"', b'"cache_salt":"mine"', sent[2])
check(st == 200 and spliced == raw, "the body spliced, every other byte kept: %s" % sent[2])
check(sent[1].get("Authorization") == auth, "Authorization passed whole (%d bytes)"
      % len(sent[1].get("Authorization") or ""))
raw2 = b'{"model":"m","prompt":[5,6,7],"x":1.50}'
st, h, b = http("POST", front + "/v1/completions", raw=raw2, headers={"x-tenant-id": "z"})
check(st == 200 and Fake.seen[-1][2].startswith(raw2[:-1] + b',"cache_salt":"kvp1-'),
      "no cache_salt: appended last: %s" % Fake.seen[-1][2])

port2 = free_port()
front2 = "http://127.0.0.1:%d" % port2
start("rd_b", """routerd:
  listen: 127.0.0.1:%d
  render: false
  scrape_interval: 100ms
workers:
  urls: [%s]
model:
  block_size: %d
""" % (port2, wa, BS), front2 + "/v1/models")
st, h, _ = complete(prompt(4), {"x-tenant-id": "acme"}, url=front2)
check(st == 200 and not any(k.lower().startswith("x-kvplane") for k in h.keys()),
      "auto: no x-kvplane-* on a tenant's reply: %s" % list(h.keys()))
st, h, _ = complete(prompt(4), url=front2)
check(st == 200 and h.get("x-kvplane-worker") == wa,
      "auto: x-kvplane-* on an untenanted reply")

for p in procs:
    p.terminate()
for p in procs:
    p.wait(10)
if failures:
    print("test_routerd_access: %d failed" % len(failures))
    sys.exit(1)
print("test_routerd_access: ok")
