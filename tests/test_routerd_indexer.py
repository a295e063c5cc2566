#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd's KV-indexer service, driven as a client written from the
documentation of NVIDIA Dynamo's standalone indexer
(docs/components/router/standalone-indexer.md) and Mooncake's conductor
indexer (docs/source/design/conductor/indexer-api-design.md) would drive it
(stdlib only; docs/routerd-indexer.md says what is implemented):

  1. four emulated vLLM workers (kvplane-bench engine); a routerd with
     indexer_listen and no configured worker; two workers registered through
     /register in Dynamo's shape (with a url: routed), one in Mooncake's
     (no url: index-only);
  2. prompts sent through the router land on worker X (x-kvplane-worker);
     /query (both dialects) reports X with the prompt's full blocks, and
     nothing for an unseen prompt; the index-only worker's events (a
     request sent to it directly) are indexed too; on a second daemon whose
     one configured worker has no events, a tenant's and a cache_salt's
     prompts match only when the query names the same tenant / salt;
  3. /workers, /dump (streamed; its keys agree with tree_sizes), malformed
     and out-of-scope bodies -> 400 / 404 / 409 / 405, the daemon still up;
  4. /query_by_hash: 400 naming namespace.engine_hash on a re-keying
     daemon; on a second daemon with engine_hash: true the engine's own
     block hashes (GET /kvplane/cache) match their worker, as ints and as
     Mooncake seq_hashes hex strings;
  5. /unregister: gone from /workers and /query; twice -> 404.

usage: test_routerd_indexer.py KVPLANE_BENCH KVPLANE_ROUTERD
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "interop"))
from testports import free_port  # noqa: E402 (below the ephemeral range)

BENCH, ROUTERD = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="kvp-rd-indexer-")
BS = 16
MODEL = "kvplane-emulated"
procs = []


def fail(msg):
    print("FAIL:", msg)
    for p in procs:
        p.kill()
    for name in ("engine.log", "rd_a.log", "rd_b.log", "rd_c.log"):
        path = os.path.join(TMP, name)
        if os.path.exists(path):
            print("----", name)
            print(open(path).read()[-2000:])
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def http(method, url, body=None, headers=None, raw=None):
    """-> (status, headers, parsed JSON or None)"""
    data = raw if raw is not None else (
        json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return r.status, r.headers, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, e.headers, json.loads(text)
        except ValueError:
            return e.code, e.headers, text


def wait_for(fn, what, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    fail("timed out waiting for " + what)


def start_engine():
    ready = os.path.join(TMP, "eng.json")
    log = open(os.path.join(TMP, "engine.log"), "w")
    procs.append(subprocess.Popen(
        [BENCH, "engine", "--workers", "4", "--block-size", str(BS),
         "--time-scale", "50", "--ready-file", ready],
        stdout=log, stderr=subprocess.STDOUT))
    wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0,
             "the engine's ready file")
    return json.load(open(ready))["workers"]


def start_routerd(name, engine_hash, workers=""):
    port, ix = free_port(), free_port()
    cfg = os.path.join(TMP, name + ".yaml")
    with open(cfg, "w") as f:
        f.write("routerd:\n  listen: 127.0.0.1:%d\n  indexer_listen: "
                "127.0.0.1:%d\n  render: false\n  scrape_interval: 100ms\n"
                "  indexer_routes: true\n  response_headers: true\n"
                "  max_body: 1048576\n"
                "namespace:\n  model_id: %s\n  engine_hash: %s\n"
                "model:\n  block_size: %d\n%s"
                % (port, ix, MODEL, "true" if engine_hash else "false", BS,
                   workers))
    log = open(os.path.join(TMP, name + ".log"), "w")
    procs.append(subprocess.Popen([ROUTERD, "--config", cfg], stdout=log,
                                  stderr=subprocess.STDOUT))
    base = "http://127.0.0.1:%d" % ix

    def up():
        try:
            return http("GET", base + "/health")[0] == 200
        except OSError:
            return False
    wait_for(up, name + "'s indexer listener")
    return "http://127.0.0.1:%d" % port, base


def prompt(seed, n_blocks, tail=5):
    return [(seed * 7919 + i * 31) % 50000 + 1
            for i in range(n_blocks * BS + tail)]


def complete(front, toks, headers=None, extra=None):
    body = {"prompt": toks, "max_tokens": 2}
    body.update(extra or {})
    st, hd, _ = http("POST", front + "/v1/completions", body, headers)
    check(st == 200, "completion through the router: %s" % st)
    return hd["x-kvplane-worker"]


def query(ix, toks, **kw):
    body = {"token_ids": toks, "model_name": MODEL}
    body.update(kw)
    st, _, o = http("POST", ix + "/query", body)
    check(st == 200, "/query -> %s %s" % (st, o))
    return o


def matched(o, inst):
    """Dynamo response: the instance's longest matched tokens"""
    return o["instances"].get(str(inst), {}).get("longest_matched", 0)


def test_register(ix, ws):
    for i in (0, 1):  # Dynamo's shape, plus kvplane's url: routed
        st, _, o = http("POST", ix + "/register", {
            "instance_id": i, "endpoint": ws[i]["kv_events"],
            "replay_endpoint": ws[i]["kv_replay"], "model_name": MODEL,
            "block_size": BS, "url": ws[i]["url"]})
        check(st == 201 and o == {"status": "ok"}, "register %d: %s %s"
              % (i, st, o))
    st, _, o = http("POST", ix + "/register", {  # Mooncake's: index-only
        "endpoint": ws[2]["kv_events"], "replay_endpoint": ws[2]["kv_replay"],
        "type": "vLLM", "modelname": MODEL, "tenant_id": "default",
        "instance_id": "w2", "block_size": BS, "dp_rank": 0})
    check(st == 201 and o["status"] == "registered successfully" and
          o["instance_id"] == "w2", "Mooncake register: %s %s" % (st, o))
    st, _, o = http("GET", ix + "/workers")
    ids = {w["instance_id"]: w for w in o}
    check(st == 200 and set(ids) == {0, 1, "w2"}, "/workers: %s" % o)
    check(ids[0]["endpoints"] == {"0": ws[0]["kv_events"]} and
          ids[0]["block_size"] == BS and ids[0]["model_name"] == MODEL,
          "/workers entry: %s" % ids[0])
    check(ids["w2"]["url"] is None and not ids["w2"]["routed"],
          "an index-only worker: %s" % ids["w2"])
    st, _, o = http("GET", ix + "/workers?model_name=other")
    check(st == 200 and o == [], "/workers filtered by model: %s" % o)


def test_query(front, ix, ws):
    url_to_inst = {ws[0]["url"]: "0", ws[1]["url"]: "1"}
    a = prompt(1, 4)
    x = url_to_inst[complete(front, a)]
    o = wait_for(lambda: (lambda r: r if matched(r, x) == 4 * BS else None)(
        query(ix, a)), "worker %s's blocks in /query" % x)
    check(o["scores"] == {x: {"0": 4 * BS}}, "scores: %s" % o["scores"])
    check(o["frequencies"] == [1, 1, 1, 1], "frequencies: %s" % o)
    other = "1" if x == "0" else "0"
    check(matched(o, other) == 0 and matched(o, "w2") == 0,
          "other instances match nothing: %s" % o)
    # a longer prompt sharing a's first 2 blocks matches 2 of them
    b = a[:2 * BS] + prompt(9, 3)
    check(matched(query(ix, b), x) == 2 * BS, "a shared prefix of 2 blocks")
    unseen = query(ix, prompt(2, 4))
    check(unseen["scores"] == {} and unseen["frequencies"] == [] and
          all(v["longest_matched"] == 0 for v in unseen["instances"].values()),
          "an unseen prompt matches nothing: %s" % unseen)
    st, _, mc = http("POST", ix + "/query", {"model": MODEL, "token_ids": a,
                                             "tenant_id": "default"})
    check(st == 200 and mc["default"][x]["GPU"] == 4 * BS and
          mc["default"][x]["longest_matched"] == 4 * BS and
          mc["default"][x]["DP"] == {"0": 4 * BS}, "Mooncake /query: %s" % mc)
    st, _, one = http("POST", ix + "/query", {"model": MODEL, "token_ids": a,
                                              "instance_id": other})
    check(st == 200 and list(one["default"]) == [other],
          "Mooncake instance_id filter: %s" % one)
    return x, a


def test_salts(ws):
    """A worker without events (configured, approximate residency): the
    front door records what it routed, hashed with the tenant's salt and
    the request's cache_salt; /query must hash the same way.  (The
    emulator ignores cache_salt, so event-fed residency cannot show it.)"""
    url = ws[3]["url"]
    front, ix = start_routerd("rd_c", False,
                              "workers:\n  urls: [%s]\n" % url)
    wait_for(lambda: http("GET", front + "/health")[0] == 200,
             "rd_c's worker up")
    t = prompt(3, 3)
    check(complete(front, t, {"x-tenant-id": "acme"}) == url, "rd_c routes")
    o = query(ix, t, tenant_id="acme")
    inst = o["instances"].get(url, {})
    check(inst.get("longest_matched") == 3 * BS and
          inst.get("approximate") == 3 * BS and o["scores"] == {
              url: {"0": 3 * BS}}, "the tenant's routed blocks: %s" % o)
    for kw in ({}, {"tenant_id": "other"}, {"cache_salt": "acme"}):
        o = query(ix, t, **kw)
        check(o["scores"] == {}, "a tenant's prompt matched %s: %s" % (kw, o))
    c = prompt(4, 2)
    complete(front, c, extra={"cache_salt": "s1"})
    check(query(ix, c, cache_salt="s1")["scores"] == {url: {"0": 2 * BS}},
          "the salted prompt under cache_salt=s1")
    check(query(ix, c)["scores"] == {}, "a salted prompt matched unsalted")
    d = prompt(6, 2)
    complete(front, d, {"x-tenant-id": "acme"}, extra={"cache_salt": "s2"})
    check(query(ix, d, tenant_id="acme", cache_salt="s2")["scores"] != {},
          "tenant + cache_salt joined as the front door joins them")
    check(query(ix, d, tenant_id="acme")["scores"] == {},
          "tenant without the request's cache_salt")
    st, _, w = http("GET", ix + "/workers")
    check(st == 200 and [x["instance_id"] for x in w] == [url] and
          w[0]["source"] == "approximate", "a configured worker: %s" % w)


def test_index_only(ix, ws):
    d = prompt(5, 3)
    st, _, _ = http("POST", ws[2]["url"] + "/v1/completions",
                    {"prompt": d, "max_tokens": 1})
    check(st == 200, "direct request to the index-only worker")
    wait_for(lambda: matched(query(ix, d), "w2") == 3 * BS,
             "the index-only worker's events in /query")


def test_dump(ix, x):
    st, hd, o = http("GET", ix + "/dump")
    check(st == 200 and list(o) == [MODEL + ":default"], "/dump: %s" % st)
    body = o[MODEL + ":default"]
    check(body["block_size"] == BS, "/dump block_size")
    per = {}
    for ev in body["events"]:
        blocks = ev["event"]["data"]["stored"]["blocks"]
        check(len(blocks) == 1 and ev["medium"] == "gpu", "dump event %s" % ev)
        per.setdefault(str(ev["worker_id"]), set()).add(blocks[0]["block_hash"])
    sizes = query(ix, prompt(1, 1))["tree_sizes"]
    for inst, ranks in sizes.items():
        check(len(per.get(inst, ())) == ranks["0"],
              "dump of %s: %d keys, tree_sizes %s" % (inst, len(per.get(inst, ())),
                                                      ranks))
    check(len(per[x]) >= 4, "the routed worker's keys in /dump")
    ids = [ev["event"]["event_id"] for ev in body["events"]]
    check(ids == list(range(len(ids))), "event ids 0, 1, ...")


def test_bad_input(ix):
    cases = [
        ("/query", b"", 400), ("/query", b"{", 400), ("/query", b"[1,2]", 400),
        ("/query", b'{"model_name": "%s"}' % MODEL.encode(), 400),
        ("/query", b'{"model_name": "%s", "token_ids": [1, -2]}'
         % MODEL.encode(), 400),
        ("/query", b'{"model_name": "%s", "token_ids": "12"}' % MODEL.encode(),
         400),
        ("/query", b'{"model_name": 5, "token_ids": [1]}', 400),
        ("/query", b'{"model_name": "x", "token_ids": [1]}', 404),
        ("/query", b'{"model_name": "%s", "token_ids": [1], "block_size": 8}'
         % MODEL.encode(), 400),
        ("/query", b'{"model_name": "%s", "token_ids": [1], "a": 1, "a": 2}'
         % MODEL.encode(), 400),
        ("/query", b'\xff\xfe{}', 400),
        ("/register", b'{"instance_id": 9, "model_name": "%s", "block_size": 16}'
         % MODEL.encode(), 400),
        ("/register", b'{"instance_id": -1, "endpoint": "tcp://127.0.0.1:9", '
         b'"model_name": "%s", "block_size": 16}' % MODEL.encode(), 400),
        ("/register", b'{"instance_id": 9, "endpoint": "tcp://127.0.0.1:9", '
         b'"model_name": "%s"}' % MODEL.encode(), 400),
        ("/register", b'{"instance_id": 9, "endpoint": "tcp://127.0.0.1:9", '
         b'"modelname": "%s", "block_size": 16, "type": "TensorRT"}'
         % MODEL.encode(), 400),
        ("/register", b'{"instance_id": 9, "endpoint": "nope://", '
         b'"model_name": "%s", "block_size": 16}' % MODEL.encode(), 400),
        ("/register", b'{"instance_id": 0, "endpoint": "tcp://127.0.0.1:9", '
         b'"model_name": "%s", "block_size": 16}' % MODEL.encode(), 409),
        ("/unregister", b'{"model_name": "%s"}' % MODEL.encode(), 400),
        ("/query_by_hash", b'{"model_name": "%s", "block_hashes": [1], '
         b'"cache_salt": ""}' % MODEL.encode(), 400),
        ("/query_by_hash", b'{"model_name": "%s", "block_hashes": ["zz"]}'
         % MODEL.encode(), 400),
    ]
    for path, raw, want in cases:
        st, _, o = http("POST", ix + path, raw=raw)
        check(st == want and isinstance(o, dict) and
              isinstance(o.get("error"), str),
              "%s %r -> %s %s (want %d with an error)" % (path, raw, st, o, want))
    check(http("GET", ix + "/query")[0] == 405, "GET /query -> 405")
    check(http("POST", ix + "/dump", {})[0] == 405, "POST /dump -> 405")
    check(http("GET", ix + "/nope")[0] == 404, "unknown path -> 404")
    big = b'{"model_name":"%s","token_ids":[%s]}' % (
        MODEL.encode(), b",".join([b"1"] * (1 << 20)))
    try:
        st = http("POST", ix + "/query", raw=big)[0]
        check(st in (400, 413), "a body over routerd.max_body (1 MiB) -> %s" % st)
    except OSError:
        pass  # the listener may close the connection while we still send
    check(http("GET", ix + "/health")[0] == 200, "the daemon survived")


def test_query_by_hash(ix_a, ws):
    st, _, o = http("POST", ix_a + "/query_by_hash",
                    {"block_hashes": [1, 2], "model_name": MODEL})
    check(st == 400 and "engine_hash" in o["error"],
          "query_by_hash on a re-keying daemon: %s %s" % (st, o))
    _, ix_b = start_routerd("rd_b", engine_hash=True)
    st, _, o = http("POST", ix_b + "/register", {
        "instance_id": 2, "endpoint": ws[2]["kv_events"],
        "replay_endpoint": ws[2]["kv_replay"], "model_name": MODEL,
        "block_size": BS})
    check(st == 201, "register on the engine_hash daemon: %s %s" % (st, o))
    hashes = http("GET", ws[2]["url"] + "/kvplane/cache")[2]["resident"]["GPU"]
    check(len(hashes) >= 3, "the engine's resident hashes: %s" % hashes)

    def q(body):
        body.update({"model_name": MODEL})
        st, _, o = http("POST", ix_b + "/query_by_hash", body)
        check(st == 200, "/query_by_hash: %s %s" % (st, o))
        return o
    o = wait_for(lambda: (lambda r: r if matched(r, 2) == len(hashes) * BS
                          else None)(q({"block_hashes": hashes})),
                 "the engine's hashes in /query_by_hash")
    check(o["scores"] == {"2": {"0": len(hashes) * BS}}, "scores: %s" % o)
    hexes = ["0x%016x" % (h & (2 ** 64 - 1)) for h in hashes]
    st, _, mc = http("POST", ix_b + "/query_by_hash",
                     {"model": MODEL, "seq_hashes": hexes})
    check(st == 200 and mc["default"]["2"]["longest_matched"] ==
          len(hashes) * BS, "Mooncake seq_hashes: %s %s" % (st, mc))
    o = q({"block_hashes": [12345, hashes[0]]})
    check(o["scores"] == {}, "an unknown first hash matches nothing: %s" % o)


def test_unregister(ix, x, a):
    st, _, o = http("POST", ix + "/unregister",
                    {"instance_id": int(x), "model_name": MODEL})
    check(st == 200 and o == {"status": "ok"}, "unregister: %s %s" % (st, o))
    ids = [w["instance_id"] for w in http("GET", ix + "/workers")[2]]
    check(int(x) not in ids and len(ids) == 2, "/workers after: %s" % ids)
    o = query(ix, a)
    check(x not in o["instances"] and o["scores"] == {},
          "/query after unregister: %s" % o)
    st, _, o = http("POST", ix + "/unregister",
                    {"instance_id": int(x), "model_name": MODEL})
    check(st == 404, "unregister twice: %s %s" % (st, o))
    st, _, o = http("POST", ix + "/unregister", {
        "instance_id": "w2", "modelname": MODEL, "type": "vLLM",
        "tenant_id": "default", "block_size": BS, "dp_rank": 0})
    check(st == 200 and o["removed_instances"] == ["w2|default|0"],
          "Mooncake unregister: %s %s" % (st, o))


def main():
    for b in (BENCH, ROUTERD):
        if not os.access(b, os.X_OK):
            print("SKIP: %s is not built" % b)
            sys.exit(77)
    ws = start_engine()
    front, ix = start_routerd("rd_a", engine_hash=False)
    test_register(ix, ws)
    x, a = test_query(front, ix, ws)
    test_salts(ws)
    test_index_only(ix, ws)
    test_dump(ix, x)
    test_bad_input(ix)
    test_query_by_hash(ix, ws)
    test_unregister(ix, x, a)
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)
    print("test_routerd_indexer: ok")


if __name__ == "__main__":
    main()
