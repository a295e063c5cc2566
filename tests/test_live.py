#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-bench engine + live, end to end on loopback (issue 15), stdlib only.

  1. every endpoint of an emulated worker answers as vLLM 0.33 does: models,
     health, completions and chat (stream and not: SSE framing, [DONE], usage
     with cached_tokens), tokenize, both render endpoints, metrics,
     server_info; bad input gets 400 (404 for an unknown model) with an OpenAI
     error body and the worker keeps serving;
  2. its KV events, read by kvplane's own subscriber (`kvplane events tail`,
     live from the start and by replay afterwards), give an index equal to
     what the worker's cache holds, HBM and DRAM, evictions and demotions
     included;
  2b. tenant isolation: `cache_salt` as vLLM 0.33 takes it (a non-empty
     string, else 400); the prefix cache never matches across salts (salt A
     then B: 0 cached tokens; A again: the hit); the worker's block hashes
     are vLLM's sha256_cbor chain with the salt on block 0 (`kvplane hash
     --salt`), and kvplane's subscriber, re-keying from the events'
     extra_keys (`kvplane events tail --rekey`), holds exactly the keys
     kvp_hasher_hash gives with extras.cache_salt set;
  3. `kvplane-bench live --direct` on a generated agentic trace against two
     workers: no errors, cached tokens > 0, hit rate within HIT_TOL of the
     offline simulator's for the same cluster (the gap is printed); TTFT
     p50 and p95 within 2x of the simulator's (the engine runs its model).

usage: test_live.py BENCH KVPLANE_CLI
"""
import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HIT_TOL = 0.02  # live vs offline hit rate, absolute (2 points)
BENCH, CLI = sys.argv[1], sys.argv[2]
TMP = tempfile.mkdtemp(prefix="kvp-live-")
procs = []


def fail(msg):
    print("FAIL:", msg)
    for p in procs:
        p.kill()
    sys.exit(1)


def kill_all():  # an exception, not a fail(): no engine outlives the test
    for p in procs:
        if p.poll() is None:
            p.kill()


atexit.register(kill_all)


def check(cond, msg):
    if not cond:
        fail(msg)


def start_engine(name, *args):
    ready = os.path.join(TMP, name + ".json")
    p = subprocess.Popen([BENCH, "engine", "--ready-file", ready, *args],
                         stdout=subprocess.DEVNULL)
    procs.append(p)
    for _ in range(200):
        if os.path.exists(ready):
            with open(ready) as f:
                return p, json.load(f)
        check(p.poll() is None, "engine exited: %s" % (args,))
        time.sleep(0.02)
    fail("engine never became ready")


def stop(p):
    p.terminate()
    check(p.wait(10) == 0, "engine did not exit cleanly on SIGTERM")


def http(url, body=None, method=None):
    data = None if body is None else (
        body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def post(url, body):
    code, _, raw = http(url, body)
    return code, json.loads(raw)


def sse_events(raw):
    text = raw.decode()
    check(text.endswith("data: [DONE]\n\n"), "stream must end with [DONE]")
    frames = text.split("\n\n")[:-1]
    check(all(f.startswith("data: ") for f in frames), "SSE framing")
    return [json.loads(f[6:]) for f in frames[:-1]]


def check_error(code, body, want, what):
    check(code == want, "%s: HTTP %d, want %d" % (what, code, want))
    e = body.get("error", {})
    check(isinstance(e.get("message"), str) and e["message"], what + ": message")
    check(e.get("code") == want and "type" in e and "param" in e,
          what + ": error body %r" % body)


# ---- 1. endpoints -------------------------------------------------------------
def test_endpoints(u, model, bs):
    code, _, raw = http(u + "/health")
    check(code == 200, "health")
    code, _, raw = http(u + "/v1/models")
    models = json.loads(raw)
    check(code == 200 and models["data"][0]["id"] == model, "models")
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # 180 bytes
    n_full = len(prompt) // bs * bs
    code, r1 = post(u + "/v1/completions", {"prompt": prompt, "max_tokens": 7})
    check(code == 200 and r1["object"] == "text_completion", "completion")
    check(len(r1["choices"][0]["text"]) == 7, "7 byte tokens of text")
    use = r1["usage"]
    check(use["prompt_tokens"] == len(prompt) and use["completion_tokens"] == 7
          and use["total_tokens"] == len(prompt) + 7, "usage %r" % use)
    check(use["prompt_tokens_details"]["cached_tokens"] == 0, "cold cache")
    code, r2 = post(u + "/v1/completions", {"prompt": prompt, "max_tokens": 3,
                                             "model": model})
    check(r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full,
          "warm cache: %r, want %d" % (r2["usage"], n_full))
    # streaming, token-id prompt
    ids = list(range(1000, 1000 + 3 * bs + 5))
    code, ctype, raw = http(u + "/v1/completions", {
        "prompt": ids, "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}})
    check(code == 200 and ctype.startswith("text/event-stream"), "stream type")
    ev = sse_events(raw)
    text = "".join(e["choices"][0]["text"] for e in ev if e["choices"])
    check(len(text) == 20, "streamed 20 tokens, got %r" % text)
    check(ev[-1]["choices"] == [] and ev[-1]["usage"]["prompt_tokens"] ==
          len(ids), "usage chunk last")
    check([e["choices"][0]["finish_reason"] for e in ev if e["choices"]][-1]
          == "length", "finish_reason")
    # chat
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    code, c1 = post(u + "/v1/chat/completions", {"messages": msgs,
                                                  "max_tokens": 4})
    check(code == 200 and c1["object"] == "chat.completion" and
          c1["choices"][0]["message"]["role"] == "assistant", "chat")
    code, _, raw = http(u + "/v1/chat/completions", {
        "messages": msgs, "max_tokens": 4, "stream": True})
    ev = sse_events(raw)
    check(ev[0]["object"] == "chat.completion.chunk" and
          ev[0]["choices"][0]["delta"]["role"] == "assistant", "chat stream")
    check(all("usage" not in e for e in ev), "no usage without include_usage")
    # tokenize and render agree with the usage counts
    code, t = post(u + "/tokenize", {"prompt": prompt})
    check(code == 200 and t["count"] == len(prompt) and
          t["tokens"][:3] == [84, 104, 101], "tokenize")
    code, t2 = post(u + "/tokenize", {"messages": msgs})
    check(t2["count"] == c1["usage"]["prompt_tokens"], "chat template count")
    code, rc = post(u + "/v1/completions/render", {"prompt": prompt,
                                                    "max_tokens": 9})
    check(code == 200 and isinstance(rc, list) and
          rc[0]["token_ids"] == t["tokens"] and
          rc[0]["sampling_params"]["max_tokens"] == 9, "completions render")
    code, rch = post(u + "/v1/chat/completions/render", {"messages": msgs})
    check(code == 200 and rch["token_ids"] == t2["tokens"], "chat render")
    # metrics and server info
    code, _, raw = http(u + "/metrics")
    m = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            m[k.split("{")[0]] = float(v)
    for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total"):
        check(k in m, "metric " + k)
    check(m["vllm:prefix_cache_hits_total"] >= n_full and
          0 < m["vllm:kv_cache_usage_perc"] <= 1, "metric values %r" % m)
    code, _, raw = http(u + "/server_info")
    cc = json.loads(raw)["vllm_config"]["cache_config"]
    check(cc["block_size"] == bs and
          cc["prefix_caching_hash_algo"] == "sha256_cbor", "server_info")


BAD = [  # (body, status, what)
    (b"{\"prompt\": [1, 2,", 400, "truncated JSON"),
    (b"[1, 2, 3]", 400, "not an object"),
    (b"\xff\xfe", 400, "not UTF-8"),
    ({"prompt": ""}, 400, "empty prompt"),
    ({"prompt": [1, -2]}, 400, "negative token id"),
    ({"prompt": [10 ** 9]}, 400, "token id out of vocabulary"),
    ({"prompt": [1.5]}, 400, "float token id"),
    ({"prompt": {"a": 1}}, 400, "prompt of the wrong type"),
    ({"prompt": ["a", "b"]}, 400, "batched prompts"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0"),
    ({"prompt": "x", "max_tokens": "9"}, 400, "max_tokens a string"),
    ({"prompt": "x", "max_tokens": 10 ** 7}, 400, "past the context length"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options without stream"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream not a boolean"),
    ({"prompt": "x", "n": 2}, 400, "n > 1"),
    ({"prompt": "x", "model": "nope"}, 404, "unknown model"),
]


def test_bad_input(u):
    for body, want, what in BAD:
        code, _, raw = http(u + "/v1/completions", body)
        check_error(code, json.loads(raw), want, what)
    for body, what in (({"messages": []}, "no messages"),
                       ({"messages": [{"content": "x"}]}, "no role"),
                       ({"messages": [{"role": "user", "content": 5}]},
                        "content a number"),
                       ({"prompt": "x"}, "chat without messages")):
        code, _, raw = http(u + "/v1/chat/completions", body)
        check_error(code, json.loads(raw), 400, what)
    code, _, _ = http(u + "/v1/nothing-here")
    check(code == 404, "unknown path")
    code, _, _ = http(u + "/v1/completions", method="GET")
    check(code == 405, "GET on a POST endpoint")
    code, _, _ = http(u + "/health")
    check(code == 200, "still serving after bad input")


# ---- 2. KV events --------------------------------------------------------------
def tail(worker, replay, idle_ms=1500):
    args = [CLI, "events", "tail", "--index", "--json", "--idle-ms",
            str(idle_ms)]
    if replay:
        args += ["--replay", worker["kv_replay"]]
    return subprocess.Popen(args + [worker["kv_events"]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_connected(p, timeout=30):
    """Until the tail says its SUB socket finished the handshake with the
    PUB: from then on the publisher sends to it (a fixed sleep for ZeroMQ's
    slow joiner lost every live event once, under ASan).  Reads the raw fd:
    a buffered readline could hold the line select() is waiting for."""
    end, fd, seen = time.time() + timeout, p.stderr.fileno(), b""
    while b"connected to" not in seen:
        left = end - time.time()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            fail("events tail did not connect within %d s: %r" % (timeout, seen))
        chunk = os.read(fd, 4096)
        if not chunk:
            fail("events tail exited before connecting (rc %r): %r"
                 % (p.wait(), seen))
        seen += chunk
    time.sleep(0.1)  # its subscription follows the handshake


def tail_result(p):
    out, err = p.communicate(timeout=30)
    check(p.returncode == 0, "events tail failed: %s" % err)
    lines = [json.loads(x) for x in out.splitlines() if x.strip()]
    res = [x for x in lines if "resident" in x][-1]["resident"]
    evs = [x for x in lines if "type" in x]
    stats = lines[-1]["stats"]
    return res, evs, stats


def test_events(w, u):
    live = tail(w, replay=False)  # before any traffic: the PUB path
    wait_connected(live)
    for i in range(40):           # 64-block HBM: evictions
        ids = [7] * 48 + [100 + i % 13] * 16 + list(range(i * 50, i * 50 + 40))
        code, _ = post(u + "/v1/completions", {"prompt": ids, "max_tokens": 2})
        check(code == 200, "traffic")
    # afterwards: everything by replay.  Its SUB socket's handshake is
    # counted too (one connection, kept); the replay is over in a moment, so
    # it gets a longer idle exit and is waited for like the live one (under
    # ASan beside two fuzzers the handshake once came after 1.5 s of idle)
    replayed = tail(w, replay=True, idle_ms=5000)
    wait_connected(replayed)
    code, _, raw = http(u + "/kvplane/cache")
    cache = json.loads(raw)["resident"]
    want = {m: sorted(h & (2 ** 64 - 1) for h in cache[m])
            for m in ("GPU", "CPU")}
    check(len(want["GPU"]) == 64 and len(want["CPU"]) > 0,
          "the worker's HBM is full and DRAM used: %r" %
          {m: len(v) for m, v in want.items()})
    for name, p in (("live", live), ("replay", replayed)):
        res, evs, stats = tail_result(p)
        for m in ("GPU", "CPU"):
            got = sorted(res.get(m, []))
            check(got == want[m], "%s index != worker cache, %s (%d vs %d "
                  "blocks)" % (name, m, len(got), len(want[m])))
        check(any(e["type"] == "BlockRemoved" for e in evs),
              name + ": no eviction seen")
        check(stats["connects"] >= 1 and stats["disconnects"] == 0,
              name + ": one connection, kept: %r" % stats)
        check(stats["decode_errors"] == 0 and stats["unknown_fields"] == 0,
              name + ": %r" % stats)
        print("events %s: %d events, %d + %d blocks resident, stats ok" %
              (name, len(evs), len(want["GPU"]), len(want["CPU"])))


# ---- 2b. cache_salt: tenant isolation -----------------------------------------
SALT_BAD = [(5, "a number"), ("", "empty"), ("a/b", "a '/'"), ("a@b", "an '@'"),
            ("a\\b", "a backslash"), ("x" * 129, "129 characters"),
            (["a"], "a list")]


def cli_keys(toks, bs, *args):
    """EXTERNAL_U64 of each full block, by `kvplane hash ARGS -f u64`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    r = subprocess.run([CLI, "hash", "-b", str(bs), "-f", "u64", *args],
                       input=json.dumps(toks), capture_output=True,
                       text=True, check=True, env=env)
    return [int(x.split()[1]) for x in r.stdout.splitlines()
            if x and x[0].isdigit()]


def cached(u, body):
    code, r = post(u + "/v1/completions", dict(body, max_tokens=2))
    check(code == 200, "salted completion: %d %r" % (code, r))
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salt_api(u, bs):
    toks = list(range(2000, 2000 + 3 * bs + 5))
    full = 3 * bs
    a, b = {"prompt": toks, "cache_salt": "tenant-a"}, \
        {"prompt": toks, "cache_salt": "tenant-b"}
    check(cached(u, a) == 0, "salt A, cold")
    check(cached(u, a) == full, "salt A again: the hit")
    check(cached(u, b) == 0, "salt B after A: no hit across salts")
    check(cached(u, {"prompt": toks}) == 0, "no salt after A, B: no hit")
    check(cached(u, b) == full, "salt B again: its own hit")
    check(cached(u, {"prompt": toks, "cache_salt": None}) == full,
          "null salt = no salt")
    uni = {"prompt": toks, "cache_salt": "\u00e9" * 128}  # 128 chars, 256 B
    check(cached(u, uni) == 0, "a 128-character salt is accepted")
    for salt, what in SALT_BAD:
        for path, body in (("/v1/completions", {"prompt": toks}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}]})):
            code, r = post(u + path, dict(body, cache_salt=salt))
            check_error(code, r, 400, "cache_salt " + what)
            check(r["error"]["param"] == "cache_salt", "param of " + what)
    code, r = post(u + "/v1/completions/render", a)
    check(code == 200 and r[0]["cache_salt"] == "tenant-a", "render salt")
    return toks, [None, "tenant-a", "tenant-b", "\u00e9" * 128]


def test_salt_keys(w, bs, toks, salts):
    code, _, raw = http(w["url"] + "/kvplane/cache")
    gpu = {h & (2 ** 64 - 1) for h in json.loads(raw)["resident"]["GPU"]}
    vllm = {s: cli_keys(toks, bs, "-a", "sha256_cbor",
                        *(["--salt", s] if s else [])) for s in salts}
    flat = [k for ks in vllm.values() for k in ks]
    check(len(set(flat)) == len(flat), "salts give disjoint chains")
    check(gpu == set(flat), "worker blocks != vLLM's salted sha256_cbor "
          "chains (%d vs %d)" % (len(gpu), len(flat)))
    p = subprocess.Popen([CLI, "events", "tail", "--rekey", str(bs), "--index", "--json",
                          "--idle-ms", "1500", "--replay", w["kv_replay"],
                          w["kv_events"]], stdout=subprocess.PIPE, text=True)
    res, _, stats = tail_result(p)
    ns = ["--model", "kvplane-events-tail", "--tokenizer", "-", "--layout", "-"]
    want = {k for s in salts
            for k in cli_keys(toks, bs, *ns, *(["--salt", s] if s else []))}
    check(sorted(res.get("GPU", [])) == sorted(want),
          "re-keyed index != kvp_hasher_hash keys with cache_salt: %r vs %r"
          % (sorted(res.get("GPU", [])), sorted(want)))
    check(stats["rekey_orphans"] == 0 and stats["decode_errors"] == 0 and
          stats["unknown_fields"] == 0, "re-key stats %r" % stats)
    print("cache_salt: isolation, 400s, %d salted blocks re-keyed as "
          "kvp_hasher_hash keys them" % len(want))


# ---- 3. live --direct against the offline simulator --------------------------
def test_live():
    trace = os.path.join(TMP, "gen.jsonl")
    subprocess.run([BENCH, "gen", "--seed", "3", "--sessions", "6",
                    "--tenants", "2", "--turns", "6", trace], check=True,
                   stdout=subprocess.DEVNULL)
    eng, info = start_engine("live", "--workers", "2", "--block-size", "64",
                             "--time-scale", "10")
    out = os.path.join(TMP, "rep")
    r = subprocess.run([BENCH, "live", "--direct", "--engine-file",
                        os.path.join(TMP, "live.json"), "--time-scale", "10",
                        "--compare-offline", "--no-progress", "--out", out,
                        trace], capture_output=True, text=True, timeout=120)
    print(r.stdout)
    check(r.returncode == 0, "live failed (%d): %s" % (r.returncode, r.stderr))
    stop(eng)
    with open(os.path.join(out, "results.json")) as f:
        pol = json.load(f)["runs"][0]["policies"]
    live, off = pol[0], pol[1]
    check(live["policy"] == "live_direct" and off["policy"] == "offline_rr",
          "rows")
    check(live["requests"] == off["requests"] > 0, "every request answered")
    check(live["reused_tokens"] > 0, "cached tokens on a trace with reuse")
    gap = live["hit_rate"] - off["hit_rate"]
    print("hit rate live %.4f offline %.4f gap %+.4f (tolerance %.2f); "
          "TTFT p50 live %.3f s offline %.3f s, p95 %.3f / %.3f s" %
          (live["hit_rate"], off["hit_rate"], gap, HIT_TOL,
           live["ttft_s"]["p50"], off["ttft_s"]["p50"],
           live["ttft_s"]["p95"], off["ttft_s"]["p95"]))
    check(abs(gap) <= HIT_TOL, "hit rate gap %.4f" % gap)
    # TTFT: the engine runs the simulator's model on a real clock (timer
    # jitter and HTTP multiplied by the time scale, on a shared host): a
    # bound of 2x either way here; the gap is printed (docs/live.md has
    # measurements within 15%).
    # (under TSan the engine runs 5-15x slower, multiplied by the time
    # scale: there only a sanity bound; its point is the threads' races)
    hi = 20 if os.environ.get("KVP_TEST_TSAN") else 2
    for q in ("p50", "p95"):
        ratio = live["ttft_s"][q] / off["ttft_s"][q]
        check(0.5 <= ratio <= hi, "TTFT %s live/offline %.2f" % (q, ratio))
    for name in ("report.html", "results.csv"):
        check(os.path.getsize(os.path.join(out, name)) > 0, name)


# ---- 4. one instant's requests: trace order on the wire and in the model -----
def read_log(path):
    with open(path) as f:
        return {d["i"]: d for d in map(json.loads, f)}


def test_live_order():
    """Eight requests at one instant, round robin over 2 workers, long and
    short prompts alternating per worker: the simulator queues them in trace
    order; live --direct must deliver them in that order too (a short body
    sent just after a long one used to land, and run, first)."""
    trace = os.path.join(TMP, "burst.jsonl")
    with open(trace, "w") as f:
        for i in range(8):
            n = 60000 if i % 4 < 2 else 600  # worker i % 2: long, short, ...
            ids = list(range(1000 * i, 1000 * i + n // 512))
            f.write(json.dumps({"timestamp": 0, "input_length": n,
                                "output_length": 4, "hash_ids": ids}) + "\n")
    log = os.path.join(TMP, "burst")
    eng, info = start_engine("order", "--workers", "2", "--block-size", "512",
                             "--time-scale", "10", "--max-model-len", "200000",
                             "--req-log", log + ".engine.jsonl")
    r = subprocess.run([BENCH, "live", "--direct", "--engine-file",
                        os.path.join(TMP, "order.json"), "--time-scale", "10",
                        "--compare-offline", "--no-progress", "--quiet",
                        "--out", os.path.join(TMP, "rep-order"),
                        "--req-log", log, trace],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, "live failed (%d): %s" % (r.returncode, r.stderr))
    stop(eng)
    e, o, c = (read_log(log + s) for s in (".engine.jsonl", ".offline.jsonl",
                                           ".live.jsonl"))
    check(sorted(e) == sorted(o) == sorted(c) == list(range(8)),
          "one line per request on each side: %r %r %r"
          % (sorted(e), sorted(o), sorted(c)))
    for w in range(2):
        order = [i for i in sorted(e, key=lambda i: e[i]["start"])
                 if e[i]["w"] == w]
        check(order == [i for i in range(8) if i % 2 == w],
              "worker %d ran %r, not in trace order" % (w, order))
    for i in range(8):
        pe = e[i]["end"] - e[i]["start"]
        po = o[i]["end"] - o[i]["start"]
        check(abs(pe - po) <= 1e-3 * po + 1e-6,
              "request %d prefill %.4f s engine, %.4f s offline" % (i, pe, po))
        # prefill ends since the first arrival: the same schedule (a held
        # request reaches its worker late by the admission before it, which
        # the queue ahead absorbs)
        # (a sanitizer build runs the engine's parsing and hashing several
        # times slower, which lands in trace time x 10: there the schedule is
        # held to 50 %; the order above and the prefill lengths stay exact)
        tol = 0.5 if os.environ.get("KVP_TEST_SLOW") else 0.05
        check(abs(e[i]["end"] - o[i]["end"]) <= tol * o[i]["end"] + 0.1,
              "request %d prefill ends at %.3f s engine, %.3f s offline"
              % (i, e[i]["end"], o[i]["end"]))
    print("burst: both workers ran one instant's requests in trace order, "
          "on the simulator's schedule")


def main():
    # 64 HBM blocks, ~23 DRAM blocks (2 MiB each): evictions and demotions
    eng, info = start_engine("api", "--workers", "2", "--block-size", "16",
                             "--hbm-blocks", "64", "--dram-gb", "0.05",
                             "--time-scale", "1000")
    w0 = info["workers"][0]
    test_endpoints(w0["url"], info["model"], info["block_size"])
    test_bad_input(w0["url"])
    w1 = info["workers"][1]  # a fresh cache: every event since seq 0
    test_events(w1, w1["url"])
    stop(eng)
    eng, info = start_engine("salt", "--workers", "1", "--block-size", "16",
                             "--time-scale", "1000")
    w = info["workers"][0]
    toks, salts = test_salt_api(w["url"], info["block_size"])
    test_salt_keys(w, info["block_size"], toks, salts)
    stop(eng)
    test_live()
    test_live_order()
    print("PASS")


if __name__ == "__main__":
    main()
