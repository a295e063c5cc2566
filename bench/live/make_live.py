#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`make live`: the bundled traces through real peer routers in front of
kvplane's emulated vLLM workers, side by side with kvplane's own prediction.

For each trace, one row at a time, each live row on a fresh emulated cluster
(`kvplane-bench engine`) and the same replay (`kvplane-bench live`):
  direct round robin      no router (`live --direct`)
  vllm-router kv_aware    vllm-router 0.1.17 fed each worker's KV events
  vllm-router cache_aware vllm-router 0.1.17, its own radix tree
  sglang-router cache_aware  sglang-router 0.3.2
  (kvplane-routerd)       kvplane's router daemon (--routerd / KVPLANE_ROUTERD)
and the offline simulator (`kvplane-bench run`, same workers, block size,
time model; kvplane_cost and round_robin).  Prints one table (hit rate,
TTFT p50/p95/p99, imbalance, each row's ratio to kvplane's row) and writes
it with CSV and JSON to the results directory.  Standard library only.

Prompts are text, one ASCII byte a token (`live --text-prompts`: the
workers' tokenizer is byte-level; sglang-router's /v1/completions takes no
token ids), on every row alike.  Imbalance is max / mean uncached prompt
tokens per worker, read from the workers' /metrics after the replay (the
offline rows: the simulator's max / mean prefill per worker).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

PEERS = ["vllm-router==0.1.17", "sglang-router==0.3.2"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")

# The bundled traces and how much of each is replayed live.  cc_agentic
# spans ~5 days of sessions: its first LIMIT requests go in a closed loop
# (CLOSED in flight, timestamps ignored, offline alike).  Mooncake's first
# LIMIT requests keep their arrival times (~300 s of trace).
TRACES = [
    {"name": "cc_agentic", "path": os.path.join(SHARED, "traces", "cc_agentic"),
     "limit": 200, "closed_loop": 8},
    {"name": "mooncake_conversation",
     "path": os.path.join(SHARED, "traces", "mooncake_conversation.jsonl.zst"),
     "limit": 1000, "closed_loop": 0},
]


def log(msg):
    print(msg, flush=True)


from loopports import free_port  # noqa: E402 (below the ephemeral range)


def http_ok(url, timeout=1.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for(pred, seconds, what):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise RuntimeError("timed out waiting for " + what)


class Proc:
    """A child in its own process group, stopped by its own id."""

    def __init__(self, argv, logpath):
        self.log = open(logpath, "w")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()


# ---- peers ---------------------------------------------------------------------
def ensure_peers(venv, logdir):
    """True when both routers are installed in venv (installing them pinned
    when missing); else the reason, printed, why not (PyPI unreachable)."""
    need = [os.path.join(venv, "bin", b) for b in ("vllm-router", "sglang-router")]
    if all(os.access(b, os.X_OK) for b in need):
        return True
    log("installing %s into %s" % (" ".join(PEERS), venv))
    pip = os.path.join(venv, "bin", "pip")
    logp = os.path.join(logdir, "pip.log")
    with open(logp, "w") as f:
        ok = os.access(pip, os.X_OK) or subprocess.call(
            [sys.executable, "-m", "venv", venv], stdout=f, stderr=f) == 0
        ok = ok and subprocess.call(
            [pip, "install", "-q", "--disable-pip-version-check", "--timeout", "20",
             "--retries", "1"] + PEERS, stdout=f, stderr=f) == 0
    if not ok:
        why = "could not install %s from PyPI (unreachable?): %s" % (
            ", ".join(PEERS), logp)
        log("SKIP peer routers: %s. The direct and offline rows still run." % why)
        return why
    return True


# ---- rows ------------------------------------------------------------------------
# A live row: name, label, and router(ctx) -> argv of the router to start in
# front of the workers (None: --direct, no router).  ctx: the engine's ready
# file as a dict ("workers": [{"url", "kv_events", "kv_replay"}], "model",
# "block_size", "hash_algo", "python_hash_seed", "kv_topic") plus "port",
# "prom_port", "venv", "dir".
def vllm_router(policy):
    def argv(ctx):
        a = [os.path.join(ctx["venv"], "bin", "vllm-router"), "--host", "127.0.0.1",
             "--port", str(ctx["port"]), "--worker-urls"]
        a += [w["url"] for w in ctx["workers"]]
        a += ["--policy", policy, "--prometheus-port", str(ctx["prom_port"]),
              "--log-level", "warning"]
        if policy == "kv_aware":
            for w in ctx["workers"]:
                a += ["--kv-event-source", w["url"] + "=" + w["kv_events"],
                      "--kv-event-replay-source", w["url"] + "=" + w["kv_replay"]]
            a += ["--kv-event-block-size", str(ctx["block_size"]),
                  "--kv-event-model", ctx["model"]]
        return a
    return argv


def sglang_router(policy):
    def argv(ctx):
        a = [os.path.join(ctx["venv"], "bin", "python"), "-m",
             "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(ctx["port"]), "--worker-urls"]
        a += [w["url"] for w in ctx["workers"]]
        return a + ["--policy", policy, "--prometheus-port", str(ctx["prom_port"]),
                    "--prometheus-host", "127.0.0.1", "--log-level", "warn"]
    return argv


# kvplane's router daemon: `kvplane-routerd --config F` in front of the same
# workers (their KV events, kvplane_cost), the reference row (ratios are taken
# to it instead of the offline kvplane_cost).  KVPLANE_ROUTERD or --routerd
# names the binary (make live passes the one it builds).
def scaled(ctx, seconds):
    """A router time constant for an emulation time_scale x faster (>= 5 ms)."""
    return max(0.005, seconds / float(ctx.get("time_scale") or 1))


def routerd_config(ctx, path):
    ws = ctx["workers"]
    lines = ["# written by bench/live/make_live.py for kvplane-routerd",
             "routerd:",
             "  listen: 127.0.0.1:%d" % ctx["port"],
             "  policy: kvplane_cost",
             # the emulation runs time_scale x faster: so must the router's
             # view of the workers' load (/metrics every 250 ms of trace time)
             "  scrape_interval: %.4fs" % scaled(ctx, 0.25),
             "workers:",
             "  urls: [%s]" % ", ".join(w["url"] for w in ws),
             "  kv_events: [%s]" % ", ".join(w["kv_events"] for w in ws),
             "  kv_replay: [%s]" % ", ".join(w["kv_replay"] for w in ws),
             "namespace:",
             "  model_id: %s" % ctx["model"],
             "model:",
             "  block_size: %d" % ctx["block_size"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def routerd_row(binary, token_ids):
    """token_ids: the client sends token ids (the router hashes them as
    sent); else text, which the router renders through a worker first --
    a loopback round trip and the worker's tokenization that the time scale
    multiplies (x20 by default), where peers tokenize in process."""
    def argv(ctx):
        cfg = os.path.join(ctx["dir"], "routerd.yaml")
        routerd_config(ctx, cfg)
        return [binary, "--config", cfg]
    return {"name": "routerd" if token_ids else "routerd_text",
            "label": "kvplane-routerd" + ("" if token_ids else ", text (render)"),
            "router": argv, "peer": False, "reference": token_ids,
            "token_ids": token_ids}


def find_bin(name):
    return shutil.which(name) or (os.access("/usr/sbin/" + name, os.X_OK) and "/usr/sbin/" + name)


def fleet_row(binary, replicas, sync):
    """kvplane-routerd replicas behind nginx (bench/live/routerd_fleet.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    def argv(ctx):
        return [sys.executable, os.path.join(here, "routerd_fleet.py"), "--routerd", binary,
                "--engine-file", os.path.join(ctx["dir"], "engine.json"),
                "--port", str(ctx["port"]), "--dir", os.path.join(ctx["dir"], "fleet"),
                "--replicas", str(replicas), "--sync" if sync else "--no-sync",
                "--scrape-interval", "%.4f" % scaled(ctx, 0.25),
                "--snapshot-interval", "%.4f" % scaled(ctx, 0.1)]
    name = "routerd_x%d_%s" % (replicas, "nats" if sync else "nosync")
    label = "kvplane-routerd x%d %s" % (replicas, "+ NATS" if sync else "no sync")
    return {"name": name, "label": label, "router": argv, "peer": False, "fleet": True,
            "token_ids": True}


def live_rows(peers_ok, routerd):
    rows = [{"name": "direct", "label": "direct round robin", "router": None,
             "peer": False},
            {"name": "direct_ids", "label": "direct round robin, token ids",
             "router": None, "peer": False, "token_ids": True}]
    if peers_ok is not True:  # the reason they are left out
        rows += [{"name": n, "label": l, "skipped": peers_ok} for n, l in (
            ("vllm_kv_aware", "vllm-router kv_aware"),
            ("vllm_cache_aware", "vllm-router cache_aware"),
            ("sglang_cache_aware", "sglang-router cache_aware"))]
    else:
        rows += [
            {"name": "vllm_kv_aware", "label": "vllm-router kv_aware",
             "router": vllm_router("kv_aware"), "peer": True},
            {"name": "vllm_cache_aware", "label": "vllm-router cache_aware",
             "router": vllm_router("cache_aware"), "peer": True},
            {"name": "sglang_cache_aware", "label": "sglang-router cache_aware",
             "router": sglang_router("cache_aware"), "peer": True},
        ]
    if routerd:
        rows.append(routerd_row(routerd, True))
        rows.append(routerd_row(routerd, False))
        if find_bin("nats-server") and find_bin("nginx"):
            rows.append(fleet_row(routerd, 3, True))
            rows.append(fleet_row(routerd, 3, False))
    return rows


# ---- one live row ----------------------------------------------------------------
def scrape(url):
    """Per worker: (prompt tokens, prefix-cache hit tokens) from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    val = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, v = line.rsplit(" ", 1)
            val[name.split("{")[0]] = float(v)
    return val.get("vllm:prompt_tokens_total", 0), val.get("vllm:prefix_cache_hits_total", 0)


def live_row(a, tr, bs, row, d):
    os.makedirs(d, exist_ok=True)
    ready = os.path.join(d, "engine.json")
    eng = Proc([a.bench, "engine", "--workers", str(a.workers), "--block-size", str(bs),
                "--time-scale", str(a.time_scale), "--max-model-len", "1048576",
                "--ready-file", ready], os.path.join(d, "engine.log"))
    rt = None
    try:
        wait_for(lambda: os.path.exists(ready), 20, "the engine's ready file")
        with open(ready) as f:
            ctx = json.load(f)
        ctx.update(port=free_port(), prom_port=free_port(), venv=a.venv, dir=d)
        target = ["--direct", "--engine-file", ready]
        if row["router"]:
            rt = Proc(row["router"](ctx), os.path.join(d, "router.log"))
            url = "http://127.0.0.1:%d" % ctx["port"]
            wait_for(lambda: rt.p.poll() is None and http_ok(url + "/health"), 60,
                     row["label"] + " /health")
            target = ["--target", url]
        argv = [a.bench, "live"] + target + [
            "--time-scale", str(a.time_scale), "--model", ctx["model"],
            "--limit", str(tr["limit"]), "--no-progress", "--out", os.path.join(d, "out")]
        if tr["closed_loop"]:
            argv += ["--closed-loop", str(tr["closed_loop"])]
        if not row.get("token_ids"):
            argv += ["--text-prompts"]
        with open(os.path.join(d, "live.log"), "w") as f:
            rc = subprocess.call(argv + [tr["path"]], stdout=f, stderr=subprocess.STDOUT)
        if eng.p.poll() is not None:  # ours: nothing else may end it
            raise RuntimeError("the engine exited (%d) during the replay; see %s"
                               % (eng.p.returncode, d))
        per = [scrape(w["url"]) for w in ctx["workers"]]
    finally:
        if rt:
            rt.stop()
        eng.stop()
    res = result_of(os.path.join(d, "out", "results.json"), rc, per,
                    os.path.join(d, "live.log"))
    fj = os.path.join(d, "fleet", "fleet.json")
    if row.get("fleet") and os.path.exists(fj):
        with open(fj) as f:
            res["fleet"] = json.load(f)
    return res


def errors_of(logpath):
    with open(logpath) as f:
        for line in f:
            if line.startswith("live: ") and " ok, " in line:
                return int(line.split(" ok, ")[1].split()[0])
    return None


def result_of(path, rc, per, logpath):
    if not os.path.exists(path):
        raise RuntimeError("no results (live exit %d); see %s" % (rc, logpath))
    with open(path) as f:
        p = json.load(f)["runs"][0]["policies"][0]
    unc = [pt - h for pt, h in per]
    mean = sum(unc) / len(unc) if unc else 0
    return {"requests": p["requests"], "errors": errors_of(logpath),
            "hit_rate": p["hit_rate"], "ttft_p50": p["ttft_s"]["p50"],
            "ttft_p95": p["ttft_s"]["p95"], "ttft_p99": p["ttft_s"]["p99"],
            "ttft_mean": p["ttft_s"]["mean"],
            "imbalance": max(unc) / mean if mean > 0 else None,
            "engine_hit_rate": sum(h for _, h in per) / max(1, sum(pt for pt, _ in per)),
            "wall_s": p["wall_seconds"]}


# ---- offline ------------------------------------------------------------------------
def offline(a, tr, d):
    os.makedirs(d, exist_ok=True)
    argv = [a.bench, "run", "--workers", str(a.workers), "--dram-gb", "0",
            "--nvme-gb", "0", "--no-tier-classes", "--policies",
            "kvplane_cost,round_robin", "--limit", str(tr["limit"]), "--no-progress",
            "--quiet", "--out", os.path.join(d, "out")]
    if tr["closed_loop"]:
        argv += ["--closed-loop", str(tr["closed_loop"])]
    with open(os.path.join(d, "run.log"), "w") as f:
        rc = subprocess.call(argv + [tr["path"]], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError("kvplane-bench run failed (%d); see %s/run.log" % (rc, d))
    with open(os.path.join(d, "out", "results.json")) as f:
        run = json.load(f)["runs"][0]
    rows = {}
    for p in run["policies"]:
        rows[p["policy"]] = {
            "requests": p["requests"], "errors": 0, "hit_rate": p["hit_rate"],
            "ttft_p50": p["ttft_s"]["p50"], "ttft_p95": p["ttft_s"]["p95"],
            "ttft_p99": p["ttft_s"]["p99"], "ttft_mean": p["ttft_s"]["mean"],
            "imbalance": p["imbalance"], "engine_hit_rate": None,
            "wall_s": p["wall_seconds"]}
    return run["block_size"], rows


# ---- the table ------------------------------------------------------------------------
def ms(v):
    if v is None:
        return "-"
    return "%.0fms" % (v * 1e3) if v < 10 else "%.1fs" % v


def ratio(v, ref):
    return "%.2f" % (v / ref) if v is not None and ref else "-"


COLS = ("%-32s %6s %4s %6s %8s %8s %8s %6s  %6s %6s %6s %6s")


def table(sections):
    out = [COLS % ("row", "reqs", "err", "hit%", "p50", "p95", "p99", "imbal",
                   "hit/kv", "p50/kv", "p95/kv", "p99/kv")]
    for s in sections:
        out.append("")
        out.append("%s: %s" % (s["trace"], s["what"]))
        ref = next(r for r in s["rows"] if r["reference"])
        for r in s["rows"]:
            if r.get("failed") or r.get("skipped"):
                out.append("%-32s  %s: %s" % (r["label"], "failed" if r.get("failed")
                                              else "skipped", r.get("failed") or r["skipped"]))
                continue
            out.append(COLS % (
                r["label"] + (" *" if r["reference"] else ""), r["requests"],
                "-" if r["errors"] is None else r["errors"],
                "%.1f" % (100 * r["hit_rate"]), ms(r["ttft_p50"]), ms(r["ttft_p95"]),
                ms(r["ttft_p99"]),
                "-" if r["imbalance"] is None else "%.2f" % r["imbalance"],
                ratio(r["hit_rate"], ref["hit_rate"]), ratio(r["ttft_p50"], ref["ttft_p50"]),
                ratio(r["ttft_p95"], ref["ttft_p95"]), ratio(r["ttft_p99"], ref["ttft_p99"])))
    out.append("")
    out.append("* the reference row (x/kv = this row / it): kvplane-routerd live when it "
               "ran, else kvplane's offline kvplane_cost.\nTTFT in trace "
               "seconds (live: x the time scale); imbal = max / mean uncached "
               "prompt tokens per worker (offline: prefill per worker).")
    fleets = [(s["trace"], r) for s in sections for r in s["rows"] if r.get("fleet")]
    if fleets:
        out.append("replicas behind nginx (sync over NATS: lag publish -> apply; msgs "
                   "received per replica; CPU per replica per request):")
    for trace, r in fleets:
        reps = r["fleet"]["replicas"]
        reqs = sum(x["requests"] for x in reps) or 1
        out.append("  %-14s %-28s lag p50 %s p99 %s, %s msgs/s, %s us CPU/request" % (
            trace, r["label"],
            "/".join("%.2fms" % (x["lag_p50_s"] * 1e3) for x in reps),
            "/".join("%.2fms" % (x["lag_p99_s"] * 1e3) for x in reps),
            "/".join("%.0f" % x["sync_msgs_per_s"] for x in reps),
            "/".join("%.0f" % (1e6 * x["cpu_s"] / max(1, x["requests"])) for x in reps)))
    return "\n".join(out)


CSV_KEYS = ("trace", "row", "label", "reference", "requests", "errors", "hit_rate",
            "engine_hit_rate", "ttft_p50", "ttft_p95", "ttft_p99", "ttft_mean",
            "imbalance", "wall_s")


def write_results(a, sections, text):
    with open(os.path.join(a.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "live.json"), "w") as f:
        json.dump({"workers": a.workers, "time_scale": a.time_scale,
                   "peers": PEERS, "traces": sections}, f, indent=1)
    with open(os.path.join(a.out, "live.csv"), "w") as f:
        f.write(",".join(CSV_KEYS) + "\n")
        for s in sections:
            for r in s["rows"]:
                row = dict(r, trace=s["trace"], row=r["name"])
                f.write(",".join("" if row.get(k) is None else str(row.get(k))
                                 for k in CSV_KEYS) + "\n")


# ---- main ---------------------------------------------------------------------------------
def one_trace(a, tr, peers_ok, k, n):
    d = os.path.join(a.out, tr["name"])
    log("[%d/%d] %s: offline prediction (kvplane-bench run)" % (k, n, tr["name"]))
    bs, off = offline(a, tr, os.path.join(d, "offline"))
    rows = [dict(off["kvplane_cost"], name="offline_kvplane_cost",
                 label="kvplane (offline kvplane_cost)", reference=True),
            dict(off["round_robin"], name="offline_round_robin",
                 label="offline round_robin", reference=False)]
    lrows = live_rows(peers_ok, a.routerd)
    if any(r.get("reference") for r in lrows):
        rows[0]["reference"] = False
    for j, row in enumerate(lrows, 1):
        base = {"name": row["name"], "label": row["label"],
                "reference": bool(row.get("reference"))}
        if row.get("skipped"):
            rows.append(dict(base, skipped=row["skipped"]))
            continue
        log("[%d/%d] %s: live %d/%d %s ..." % (k, n, tr["name"], j, len(lrows),
                                                row["label"]))
        t0 = time.monotonic()
        try:
            r = dict(live_row(a, tr, bs, row, os.path.join(d, row["name"])), **base)
            log("      %d requests, hit %.1f%%, TTFT p50 %s, %.0f s" % (
                r["requests"], 100 * r["hit_rate"], ms(r["ttft_p50"]),
                time.monotonic() - t0))
        except (RuntimeError, OSError) as e:
            r = dict(base, failed=str(e))
            log("      FAILED: %s" % e)
        rows.append(r)
    what = "first %d requests, %s, %d workers, block %d, time scale %g" % (
        tr["limit"], "closed loop %d" % tr["closed_loop"] if tr["closed_loop"]
        else "at trace time", a.workers, bs, a.time_scale)
    return {"trace": tr["name"], "what": what, "block_size": bs, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=os.path.join(ROOT, "build-run", "bench",
                                                    "kvplane-bench"))
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-peers"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build-run", "live-report"))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=20)
    ap.add_argument("--traces", default=",".join(t["name"] for t in TRACES),
                    help="comma-separated subset of: %(default)s")
    ap.add_argument("--limit", type=int, default=0,
                    help="requests per trace (default: each trace's own cap)")
    ap.add_argument("--no-peers", action="store_true", help="direct and offline only")
    ap.add_argument("--routerd", default=os.environ.get("KVPLANE_ROUTERD"),
                    help="kvplane-routerd binary: adds its row (default $KVPLANE_ROUTERD)")
    a = ap.parse_args()
    if not os.access(a.bench, os.X_OK):
        sys.exit("make_live: %s is not built (make build-run)" % a.bench)
    os.makedirs(a.out, exist_ok=True)
    peers_ok = "--no-peers" if a.no_peers else ensure_peers(a.venv, a.out)
    want = a.traces.split(",")
    trs = [dict(t) for t in TRACES if t["name"] in want]
    for t in trs:
        t["limit"] = a.limit or t["limit"]
    t0 = time.monotonic()
    sections = [one_trace(a, t, peers_ok, k, len(trs)) for k, t in enumerate(trs, 1)]
    text = table(sections)
    write_results(a, sections, text)
    log("\n" + text)
    log("\nresults: %s/{table.txt,live.csv,live.json} and per row %s/TRACE/ROW/ "
        "(%.0f s)" % (a.out, a.out, time.monotonic() - t0))
    failed = [r["label"] for s in sections for r in s["rows"] if r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
