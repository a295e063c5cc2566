#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Emulated P/D workers (kvplane-bench engine --prefill N --decode M, issue
41) speak vLLM's disaggregated two-step flow as the NIXL connector does: a
prefill leg (kv_transfer_params do_remote_decode, max_tokens 1) answers
with do_remote_prefill, remote_engine_id, remote_host, remote_port and one
block id per full prompt block; the decode leg given those parameters
pulls the blocks it lacks over the modelled link (counted, its time
bandwidth-bound), publishes them as its own (GET /kvplane/cache) and
decodes; a decode worker that already holds the prefix pulls only the
rest; an unknown remote engine is a failed pull (recomputed, counted);
malformed parameters are a 400 naming kv_transfer_params.

usage: test_engine_pd.py BENCH WORKDIR
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rd_testlib import check, failures, start_engine  # noqa: E402

BS = 16
FIRST_LEG = {"do_remote_decode": True, "do_remote_prefill": False,
             "remote_engine_id": None, "remote_block_ids": None,
             "remote_host": None, "remote_port": None}


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def emul(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("kvplane_engine_%s_total{" % name):
            return float(line.split()[-1])
    return None


def resident(url):
    o = json.load(urllib.request.urlopen(url + "/kvplane/cache", timeout=5))
    return set(o["resident"]["GPU"])


def prefill(url, prompt):
    return post(url, {"prompt": prompt, "max_tokens": 1, "stream": False,
                      "kv_transfer_params": FIRST_LEG})


def decode(url, prompt, kv, n=4):
    t = time.time()
    code, o = post(url, {"prompt": prompt, "max_tokens": n,
                         "kv_transfer_params": kv})
    return code, o, time.time() - t


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    procs = []
    try:
        # a slow link (0.05 GB/s): 64 blocks of 128 KiB/token x 16 tokens
        # take ~2.7 s of model time, ~0.27 s at time scale 10
        _, ws = start_engine(bench, work, "pd", 0, BS, procs, time_scale=10,
                             extra=("--prefill", "1", "--decode", "2",
                                    "--link-gbps", "0.05"))
        check([w["role"] for w in ws] == ["prefill", "decode", "decode"],
              "roles announced: prefill, decode, decode")
        P, D1, D2 = (w["url"] for w in ws)
        prompt = [1000 + i for i in range(64 * BS + 5)]  # 64 full blocks
        code, o = prefill(P, prompt)
        kv = o.get("kv_transfer_params") or {}
        check(code == 200 and o["usage"]["completion_tokens"] == 1,
              "prefill leg: 200, one token")
        check(kv.get("do_remote_prefill") is True and
              kv.get("do_remote_decode") is False and
              kv.get("remote_engine_id") == ws[0]["engine_id"] and
              kv.get("remote_port") == int(P.rsplit(":", 1)[1]) and
              isinstance(kv.get("remote_host"), str),
              "prefill leg: kv_transfer_params name the engine, host, port")
        check(len(kv.get("remote_block_ids", [])) == 64 and
              len(set(kv["remote_block_ids"])) == 64,
              "prefill leg: one distinct block id per full block (64)")
        code, o, slow = decode(D1, prompt, kv)
        check(code == 200 and o["usage"]["completion_tokens"] == 4,
              "decode leg: 200, the tokens asked for")
        check(emul(D1, "kv_pull_blocks") == 64 and
              emul(D1, "kv_pull_bytes") > 0, "decode leg pulled 64 blocks")
        check(len(resident(D1) & resident(P)) == 64,
              "the pulled blocks are the decode worker's now (its cache)")
        # the same prefix again on D1: held already, nothing crosses
        code, o = prefill(P, prompt)
        code, o, fast = decode(D1, prompt, o["kv_transfer_params"])
        check(code == 200 and emul(D1, "kv_pull_blocks") == 64,
              "a decode worker holding the prefix pulls nothing more")
        check(slow > fast + 0.1, "pulling 64 blocks over the slow link "
              "took longer (%.3f s vs %.3f s)" % (slow, fast))
        # a longer turn on D1: only the new blocks cross
        longer = prompt + [7] * (8 * BS)
        code, o = prefill(P, longer)
        decode(D1, longer, o["kv_transfer_params"])
        check(emul(D1, "kv_pull_blocks") == 64 + 8,
              "the next turn pulls only its 8 new blocks")
        grouped = dict(kv, remote_block_ids=[kv["remote_block_ids"]])
        code, o, _ = decode(D2, prompt, grouped)
        check(code == 200 and emul(D2, "kv_pull_blocks") == 64,
              "block ids per KV cache group (a list of lists) accepted")
        # an engine this cluster does not have: recomputed, counted
        other = [5000 + i for i in range(4 * BS)]
        code, o = prefill(P, other)
        bad = dict(o["kv_transfer_params"], remote_engine_id="no-such-engine")
        code, o, _ = decode(D2, other, bad)
        check(code == 200 and emul(D2, "kv_pull_failed") == 1 and
              emul(D2, "kv_pull_blocks") == 64,
              "unknown remote engine: served by recompute, a counted failure")
        for name, params in [
                ("block ids not a list", dict(kv, remote_block_ids="x")),
                ("negative block id", dict(kv, remote_block_ids=[1, -2])),
                ("no engine id", {k: v for k, v in kv.items()
                                  if k != "remote_engine_id"}),
                ("port out of range", dict(kv, remote_port=70000)),
                ("both legs", dict(kv, do_remote_decode=True)),
                ("not an object", [1, 2])]:
            code, o = post(D2, {"prompt": prompt, "max_tokens": 2,
                                "kv_transfer_params": params})
            check(code == 400 and o["error"]["param"] == "kv_transfer_params",
                  "malformed kv_transfer_params (%s): 400" % name)
        check(emul(P, "pd_prefill_legs") == 4, "prefill legs counted (4)")
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
