#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd P/D (issue 41) on loopback: the real daemon in front of
emulated P/D workers (kvplane-bench engine --prefill 2 --decode 2) and, for
the failures, recording fake workers.

  1. the two-step flow: the prefill leg goes to a prefill worker with
     max_tokens 1 / do_remote_decode, the decode leg to a decode worker with
     the prefill's kv_transfer_params (the decode worker pulls from the
     named engine: no failed pull), the client gets the decode leg's tokens,
     streamed or whole; headers and receipts name both workers;
  2. the prefill follows the KV: a prompt sharing a prefix goes to the
     prefill worker that holds it;
  3. decode affinity: a session's next turn decodes where its prefix is,
     predicted to move only its new blocks (and the worker pulls only those);
     decode load: while one decode worker streams a long decode, new
     requests decode on the other;
  4. a failing prefill worker (500) retries the prefill leg only, a failing
     decode worker (503) the decode leg only;
  5. bad kv_transfer_params from a prefill worker: the next prefill worker,
     or a 502 naming the problem; the router stays up; --check-config
     refuses bad roles;
  6. the front door writes a stream's small pieces at once (TCP_NODELAY on
     the client's connection: no 40 ms delayed-ACK stall before the last).

usage: test_routerd_pd.py KVPLANE_BENCH KVPLANE_ROUTERD WORK_DIR
"""
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rd_fakeworker import Fake, fake_worker  # noqa: E402
from rd_testlib import (check, failures, free_port, metric,  # noqa: E402
                        start_engine, wait_http)

B, RD, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
BS = 16
procs = []


def start_router(name, urls, roles, kv_events=None, extra=""):
    port = free_port()
    cfg = os.path.join(W, name + ".yaml")
    if os.path.exists(os.path.join(W, name + ".receipts")):  # a rerun's
        os.unlink(os.path.join(W, name + ".receipts"))
    ev = ("  kv_events: [%s]\n" % ", ".join(kv_events)) if kv_events else ""
    with open(cfg, "w") as f:
        f.write("routerd:\n  listen: 127.0.0.1:%d\n  scrape_interval: 50ms\n"
                "  scrape_budget: 0\n  response_headers: true\n"
                "  receipts: %s\n  breaker_failures: 1000\n%s"
                "workers:\n  urls: [%s]\n%s  roles: [%s]\n"
                "model:\n  block_size: %d\n" % (
                    port, os.path.join(W, name + ".receipts"), extra,
                    ", ".join(urls), ev, ", ".join(roles), BS))
    p = subprocess.Popen([RD, "--config", cfg, "--log", "info"],
                         stdout=open(os.path.join(W, name + ".log"), "w"),
                         stderr=subprocess.STDOUT)
    procs.append(p)
    front = "http://127.0.0.1:%d" % port
    if not wait_http(front + "/health"):
        raise SystemExit("router %s did not start" % name)
    return p, front


def post(front, body, session=None, stream=False):
    h = {"Content-Type": "application/json"}
    if session:
        h["x-session-id"] = session
    req = urllib.request.Request(front + "/v1/completions",
                                 json.dumps(body).encode(), h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
            return r.status, dict(r.headers), raw
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def emul(url, name):
    t = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for line in t.splitlines():
        if line.startswith("kvplane_engine_%s_total{" % name):
            return float(line.split()[-1])
    return 0.0


def total(urls, name):
    return sum(emul(u, name) for u in urls)


def rd_metric(front, name):
    t = urllib.request.urlopen(front + "/metrics", timeout=5).read().decode()
    return metric(t, name)


def prompt(seed, blocks, tail=5):
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(blocks * BS + tail)]


def receipts(name):
    p = os.path.join(W, name + ".receipts")
    return [json.loads(x) for x in open(p)] if os.path.exists(p) else []


def test_flow(front, ws):
    P = [w["url"] for w in ws if w["role"] == "prefill"]
    D = [w["url"] for w in ws if w["role"] == "decode"]
    toks = prompt(1, 40)
    code, h, raw = post(front, {"prompt": toks, "max_tokens": 12})
    o = json.loads(raw) if code == 200 else {}
    check(code == 200 and o["usage"]["completion_tokens"] == 12,
          "1. P/D answer: 200 with the decode leg's 12 tokens")
    check(h.get("x-kvplane-prefill-worker") in P and
          h.get("x-kvplane-worker") in D,
          "1. headers name a prefill worker and a decode worker")
    check(total(P, "pd_prefill_legs") == 1 and total(D, "pd_decode_legs") == 1
          and total(P, "pd_decode_legs") == 0,
          "1. one prefill leg on a prefill worker, one decode leg on a decode "
          "worker")
    check(total(D, "kv_pull_blocks") == 40 and total(D, "kv_pull_failed") == 0,
          "1. the decode worker pulled the 40 blocks from the engine the "
          "prefill named (params forwarded intact)")
    check(h.get("x-kvplane-transfer-offered-blocks") == "40" and
          h.get("x-kvplane-transfer-predicted-tokens") == str(40 * BS),
          "1. offered 40 blocks, predicted 640 tokens to cross")
    code, h, raw = post(front, {"prompt": prompt(2, 8), "max_tokens": 6,
                                "stream": True,
                                "stream_options": {"include_usage": True}})
    chunks = [json.loads(x[6:]) for x in raw.split("\n")
              if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    check(code == 200 and "[DONE]" in raw and chunks and
          chunks[-1]["usage"]["completion_tokens"] == 6 and len(text) == 6,
          "1. streamed: the decode leg's stream reaches the client whole")
    end = time.time() + 5  # written once the reply has ended
    while len(receipts("pd")) < 2 and time.time() < end:
        time.sleep(0.05)
    rc = receipts("pd")
    check(len(rc) == 2 and all(r["pd"]["leg"] == "decode" and
                               r["pd"]["prefill_worker"] in P and
                               r["worker"] in D for r in rc),
          "1. receipts name both workers (pd.prefill_worker, worker)")


def test_holder(front, ws):
    P = [w["url"] for w in ws if w["role"] == "prefill"]
    follow = 0
    for k in range(6):
        base = prompt(100 + k, 32, tail=0)
        code, h, _ = post(front, {"prompt": base + [1, 2, 3], "max_tokens": 2})
        first = h.get("x-kvplane-prefill-worker")
        time.sleep(0.3)  # the KV events reach the index
        code, h, _ = post(front, {"prompt": base + [9] * 20, "max_tokens": 2})
        follow += h.get("x-kvplane-prefill-worker") == first and \
            int(h.get("x-kvplane-cached-tokens", "0")) >= 32 * BS
    check(follow == 6, "2. a shared prefix's prefill goes to the prefill "
          "worker holding it, predicted cached (%d/6)" % follow)
    check(len(set(P)) == 2, "2. (two prefill workers)")


def test_affinity(front, ws):
    D = [w["url"] for w in ws if w["role"] == "decode"]
    kept, moved_only_new = 0, 0
    for k in range(4):
        hist = prompt(200 + k, 24, tail=0)
        code, h, _ = post(front, {"prompt": hist, "max_tokens": 4},
                          session="s%d" % k)
        d1 = h.get("x-kvplane-worker")
        time.sleep(0.3)
        pulled = emul(d1, "kv_pull_blocks") if d1 in D else -1
        hist2 = hist + prompt(300 + k, 8, tail=0)
        code, h, _ = post(front, {"prompt": hist2, "max_tokens": 4},
                          session="s%d" % k)
        kept += h.get("x-kvplane-worker") == d1
        moved_only_new += (h.get("x-kvplane-transfer-predicted-tokens") ==
                           str(8 * BS) and
                           emul(d1, "kv_pull_blocks") - pulled == 8)
    check(kept == 4, "3. a session's next turn decodes where its prefix is "
          "(%d/4)" % kept)
    check(moved_only_new == 4, "3. ... predicted to move only its 8 new "
          "blocks, and only those crossed (%d/4)" % moved_only_new)


def test_decode_load(front, ws):
    import threading
    D = [w["url"] for w in ws if w["role"] == "decode"]
    seen = {}

    def long_decode():
        code, h, _ = post(front, {"prompt": prompt(800, 64), "max_tokens": 3000,
                                  "stream": True})
        seen["long"] = h.get("x-kvplane-worker")

    t = threading.Thread(target=long_decode)
    t.start()
    time.sleep(0.3)  # its prefill is over, its decode runs (~0.7 s at 20x)
    others = []
    for k in range(3):
        code, h, _ = post(front, {"prompt": prompt(900 + k, 8),
                                  "max_tokens": 200})
        others.append(h.get("x-kvplane-worker"))
    t.join()
    busy = seen.get("long")
    check(busy in D and all(o in D and o != busy for o in others),
          "3. while %s decodes 3000 tokens of 64 blocks, new requests decode on "
          "the other decode worker (%s)" % (busy, others))


class Fail500(Fake):
    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        Fake.seen.append((self.path, dict(self.headers), self.rfile.read(n)))
        self.reply(500, '{"error":{"message":"boom"}}')


class BadParams(Fake):
    params = {"do_remote_prefill": True, "remote_block_ids": "x",
              "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        Fake.seen.append((self.path, dict(self.headers), self.rfile.read(n)))
        o = {"id": "x", "object": "text_completion",
             "choices": [{"text": "a", "index": 0}]}
        if self.params is not None:
            o["kv_transfer_params"] = self.params
        self.reply(200, json.dumps(o))


class NoParams(BadParams):
    params = None


class GoodParams(BadParams):
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [[0, 1], [2, 3]], "remote_engine_id": "p0",
              "remote_host": "10.0.0.7", "remote_port": 5600,
              "remote_request_id": "abc", "tp_size": 1}


def kv_worker(blocks):
    """A fake decode worker whose /metrics give its KV cache as vLLM 0.32
    does (cache_config_info's labels): `blocks` blocks of BS tokens."""
    class KV(Fake):
        def do_GET(self):
            if self.path != "/metrics":
                return Fake.do_GET(self)
            self.reply(200, "vllm:num_requests_running 0\n"
                       "vllm:kv_cache_usage_perc 0.0\n"
                       'vllm:cache_config_info{block_size="%d",num_gpu_blocks="%d",'
                       'num_cpu_blocks="None"} 1.0\n' % (BS, blocks), "text/plain")
    return fake_worker(KV)


def test_decode_kv():
    """Free KV memory: a decode worker whose KV cache cannot hold the
    leg's prompt + output (its capacity from cache_config_info, scraped) is
    not chosen while another can; when none can, the leg still goes out,
    chosen by cost, and is counted."""
    p, small, big = fake_worker(GoodParams), kv_worker(4), kv_worker(100000)
    Fake.seen.clear()
    _, front = start_router("pd-kv", [p, small, big], ["prefill", "decode", "decode"])
    time.sleep(1)  # a few scrapes (every 50 ms)
    got = []
    for k in range(8):
        code, h, _ = post(front, {"prompt": prompt(970 + k, 8), "max_tokens": 16})
        got.append((code, h.get("x-kvplane-worker")))
    check(all(c == 200 and w == big for c, w in got),
          "3. decode legs skip the worker with 4 blocks of KV for 8-block "
          "prompts: all on %s (%s)" % (big, got))
    full = metric(urllib.request.urlopen(front + "/metrics").read().decode(),
                  "kvplane_routerd_pd_decode_kv_full_total")
    check(full == 0, "3. no leg lacked a worker with room (%s)" % full)
    p2, s1, s2 = fake_worker(GoodParams), kv_worker(4), kv_worker(4)
    _, front2 = start_router("pd-kv2", [p2, s1, s2], ["prefill", "decode", "decode"])
    time.sleep(1)
    codes = [post(front2, {"prompt": prompt(980 + k, 8), "max_tokens": 16})[0]
             for k in range(3)]
    full = metric(urllib.request.urlopen(front2 + "/metrics").read().decode(),
                  "kvplane_routerd_pd_decode_kv_full_total")
    check(codes == [200] * 3 and full == 3,
          "3. no decode worker with room: served anyway by cost, counted "
          "(%s, decode_kv_full %s)" % (codes, full))


def test_request_ids():
    """Both legs carry one X-Request-Id (vLLM's request id, which older
    NIXL connectors match between the two instances): the client's, or one
    the router makes; the decode leg gets the prefill's parameters as given
    (grouped block ids, keys the router does not read)."""
    Fake.seen.clear()
    p, d = fake_worker(GoodParams), fake_worker(Fake)
    _, front = start_router("pd-ids", [p, d], ["prefill", "decode"])
    req = urllib.request.Request(
        front + "/v1/completions",
        json.dumps({"prompt": prompt(950, 2), "max_tokens": 5}).encode(),
        {"Content-Type": "application/json", "X-Request-Id": "client-7"})
    urllib.request.urlopen(req, timeout=10).read()
    post(front, {"prompt": prompt(951, 2), "max_tokens": 5})
    ids = [s[1].get("X-Request-Id") for s in Fake.seen]
    check(len(ids) == 4 and ids[0] == ids[1] == "client-7" and
          ids[2] == ids[3] and ids[2] and ids[2] != "client-7",
          "1. both legs carry one X-Request-Id: the client's, else the "
          "router's own (%s)" % ids)
    kv = json.loads(Fake.seen[1][2]).get("kv_transfer_params")
    check(kv == GoodParams.params, "1. the decode leg's kv_transfer_params "
          "are the prefill's as given (groups, unknown keys)")


def test_retries(ws):
    P = [w["url"] for w in ws if w["role"] == "prefill"]
    D = [w["url"] for w in ws if w["role"] == "decode"]
    bad_p, bad_d = fake_worker(Fail500), fake_worker(Fail500)
    Fake.seen.clear()
    # one failing prefill worker beside a real one; real decode workers
    _, front = start_router("pd-pfail", [bad_p, P[0]] + D,
                            ["prefill", "prefill", "decode", "decode"],
                            ["-", ws[0]["kv_events"]] +
                            [w["kv_events"] for w in ws[2:]])
    legs0 = total(P + D, "pd_prefill_legs"), total(D, "pd_decode_legs")
    codes = [post(front, {"prompt": prompt(400 + k, 4), "max_tokens": 3})[0]
             for k in range(10)]
    legs1 = total(P + D, "pd_prefill_legs"), total(D, "pd_decode_legs")
    hit = len(Fake.seen)  # prefill legs the failing worker took
    check(codes == [200] * 10, "4. failing prefill worker: every request "
          "served (%s)" % codes)
    check(hit > 0 and rd_metric(front, "kvplane_routerd_pd_prefill_retries_total")
          == hit, "4. each failed prefill leg tried again on the other "
          "prefill worker (%d)" % hit)
    check(legs1[0] - legs0[0] == 10 and legs1[1] - legs0[1] == 10 and
          rd_metric(front, "kvplane_routerd_pd_decode_retries_total") == 0,
          "4. ... and the decode leg ran once per request")
    bodies = [json.loads(s[2]) for s in Fake.seen]
    check(all(b["max_tokens"] == 1 and b["stream"] is False and
              b["kv_transfer_params"]["do_remote_decode"] is True
              for b in bodies),
          "4. the prefill leg's body: max_tokens 1, stream false, "
          "do_remote_decode")
    Fake.seen.clear()
    # a failing decode worker beside a real one
    _, front = start_router("pd-dfail", P + [bad_d, D[0]],
                            ["prefill", "prefill", "decode", "decode"],
                            [w["kv_events"] for w in ws[:2]] +
                            ["-", ws[2]["kv_events"]])
    legs0 = total(P, "pd_prefill_legs"), total(D, "pd_decode_legs")
    codes = [post(front, {"prompt": prompt(500 + k, 4), "max_tokens": 3})[0]
             for k in range(10)]
    legs1 = total(P, "pd_prefill_legs"), total(D, "pd_decode_legs")
    hit = len(Fake.seen)
    check(codes == [200] * 10, "4. failing decode worker: every request "
          "served (%s)" % codes)
    check(hit > 0 and rd_metric(front, "kvplane_routerd_pd_decode_retries_total")
          == hit and rd_metric(front,
                               "kvplane_routerd_pd_prefill_retries_total") == 0,
          "4. each failed decode leg tried again on the other decode worker "
          "(%d), no prefill leg repeated" % hit)
    check(legs1[0] - legs0[0] == 10 and legs1[1] - legs0[1] == 10,
          "4. ... ten prefill legs, ten decode legs served")
    check(all(json.loads(s[2])["kv_transfer_params"]["do_remote_prefill"]
              is True and json.loads(s[2])["max_tokens"] == 3
              for s in Fake.seen),
          "4. the decode leg's body: the client's max_tokens, the prefill's "
          "kv_transfer_params")


def test_bad_params(ws):
    D = [w["url"] for w in ws if w["role"] == "decode"]
    for cls, what, needle in [(BadParams, "malformed", "remote_block_ids"),
                              (NoParams, "missing", "no kv_transfer_params")]:
        fake = fake_worker(cls)
        name = "pd-bad-" + what
        _, front = start_router(name, [fake] + D,
                                ["prefill", "decode", "decode"],
                                ["-"] + [w["kv_events"] for w in ws[2:]],
                                extra="  retries: 0\n")
        code, h, raw = post(front, {"prompt": prompt(600, 4), "max_tokens": 3})
        msg = json.loads(raw).get("error", {}).get("message", "") \
            if raw.startswith("{") else ""
        check(code == 502 and needle in msg and "kv_transfer_params" in msg,
              "5. %s kv_transfer_params: 502 saying so (%r)" % (what, msg))
        check(wait_http(front + "/health", 2) and
              rd_metric(front, "kvplane_routerd_pd_bad_params_total") == 1,
              "5. ... the router is up, the refusal counted")
    # with a good prefill worker beside the bad one: served
    fake = fake_worker(BadParams)
    P = [w["url"] for w in ws if w["role"] == "prefill"]
    _, front = start_router("pd-bad-retry", [fake, P[0]] + D,
                            ["prefill", "prefill", "decode", "decode"],
                            ["-", ws[0]["kv_events"]] +
                            [w["kv_events"] for w in ws[2:]])
    codes = [post(front, {"prompt": prompt(700 + k, 4), "max_tokens": 3})[0]
             for k in range(8)]
    check(codes == [200] * 8 and
          rd_metric(front, "kvplane_routerd_pd_bad_params_total") > 0,
          "5. a bad prefill answer moves the leg to the next prefill worker")
    for roles, why in [("[prefill, prefill]", "decode"),
                       ("[prefill, sideways]", "prefill, decode or both"),
                       ("[prefill]", "one entry per url")]:
        cfg = os.path.join(W, "bad-roles.yaml")
        with open(cfg, "w") as f:
            f.write("routerd:\n  listen: 127.0.0.1:%d\nworkers:\n  urls: "
                    "[http://127.0.0.1:1, http://127.0.0.1:2]\n  roles: %s\n"
                    % (free_port(), roles))
        p = subprocess.run([RD, "--config", cfg, "--check-config"],
                           capture_output=True, text=True)
        check(p.returncode != 0 and "workers.roles" in p.stderr + p.stdout and
              why in p.stderr + p.stdout,
              "5. --check-config refuses roles %s" % roles)


class TwoPieces(Fake):
    """A stream of two small events 2 ms apart, then its end (its own
    socket without Nagle, as vLLM's uvicorn and the emulated workers)."""
    def setup(self):
        super().setup()
        import socket
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(n)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for k, ev in enumerate((b"data: a\n\n", b"data: b\n\n")):
            if k:
                time.sleep(0.002)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def test_nodelay():
    """On a keep-alive connection (the client's ACKs delayed by then; a
    fresh one ACKs at once) the end of each stream follows its first piece
    by the worker's 2 ms, not the 40 ms of Nagle behind a delayed ACK."""
    import socket
    _, front = start_router("nodelay", [fake_worker(TwoPieces)], ["both"])
    port = int(front.rsplit(":", 1)[1])
    body = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()
    sk = socket.create_connection(("127.0.0.1", port))
    gaps = []
    for _ in range(12):
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                   % (len(body), body))
        got, ta = b"", None
        end = time.time() + 5
        while time.time() < end and not got.endswith(b"0\r\n\r\n"):
            d = sk.recv(4096)
            if not d:
                break
            got += d
            if ta is None and b"data: a" in got:
                ta = time.time()
        if ta is not None and got.endswith(b"0\r\n\r\n"):
            gaps.append(time.time() - ta)
    sk.close()
    gaps = sorted(gaps[1:])
    check(len(gaps) == 11 and gaps[5] < 0.02,
          "6. a stream's end follows its first piece at once through the "
          "router (median %.1f ms; Nagle behind a delayed ACK: ~40)" %
          (1e3 * gaps[len(gaps) // 2] if gaps else -1))


def main():
    try:
        _, ws = start_engine(B, W, "pd-engine", 0, BS, procs,
                             extra=("--prefill", "2", "--decode", "2"))
        _, front = start_router("pd", [w["url"] for w in ws],
                                [w["role"] for w in ws],
                                [w["kv_events"] for w in ws])
        test_flow(front, ws)
        test_holder(front, ws)
        test_affinity(front, ws)
        test_decode_load(front, ws)
        test_retries(ws)
        test_request_ids()
        test_decode_kv()
        test_bad_params(ws)
        test_nodelay()
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
