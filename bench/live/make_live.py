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

--pd: the P/D A/B (issue 41) instead: a P/D cluster (`engine --prefill 2
--decode 2`) behind vllm-router's PD mode (cache_aware, and kv_aware fed the
prefill workers' KV events with --pd-kv-events; power_of_two decode) and
kvplane-routerd P/D (workers.roles), then the same routers without
disaggregation on 4 workers; TTFT, time per output token (TPOT), the KV bytes
the decode workers pulled, and the share of requests within the SLOs; beside
them the offline prediction for the P/D cluster (`kvplane-bench run --prefill
N --decode M`, the same replay).
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
     "limit": 200, "closed_loop": 8,
     # real vLLM: 64-token blocks at 1/32 (an engine block = 16 trace
     # blocks), prompts <= 4096 tokens, 2 requests in flight a worker
     "vllm": {"limit": 150, "closed_loop": 6, "shrink": 32, "max_prompt": 4096,
              "max_output": 32}},
    {"name": "mooncake_conversation",
     "path": os.path.join(SHARED, "traces", "mooncake_conversation.jsonl.zst"),
     "limit": 1000, "closed_loop": 0,
     # real vLLM: 512-token blocks at 1/16 (one engine block each), the
     # arrival rate from the calibrated prefill speed (--utilisation)
     "vllm": {"limit": 200, "closed_loop": 0, "shrink": 16, "max_prompt": 4096,
              "max_output": 32}},
]


def log(msg):
    print(msg, flush=True)


from loopports import free_port  # noqa: E402 (below the ephemeral range)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "vllm"))
import fleet as vf  # noqa: E402 (the real-vLLM cluster; standard library only)


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


# Real engines: the router and the client run at a higher priority than the
# host's other tasks (as the workers' cgroup does; fleet.py), where allowed.
NICE = [0]


def _renice():
    if NICE[0]:
        try:
            os.nice(NICE[0])
        except OSError:
            pass


class Proc:
    """A child in its own process group, stopped by its own id."""

    def __init__(self, argv, logpath):
        self.log = open(logpath, "w")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=_renice)

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


def vllm_router_pd(prefill_policy, decode_policy="power_of_two"):
    """vllm-router 0.1.17's PD mode (--vllm-pd-disaggregation): its prefill
    policy over the prefill workers (kv_aware: fed their KV events with
    --pd-kv-events), its decode policy over the decode workers."""
    def argv(ctx):
        ws = ctx["workers"]
        a = [os.path.join(ctx["venv"], "bin", "vllm-router"), "--host", "127.0.0.1",
             "--port", str(ctx["port"]), "--vllm-pd-disaggregation"]
        for w in ws:
            a += ["--prefill" if w["role"] == "prefill" else "--decode", w["url"]]
        a += ["--prefill-policy", prefill_policy, "--decode-policy", decode_policy,
              "--prometheus-port", str(ctx["prom_port"]), "--log-level", "warning"]
        if prefill_policy == "kv_aware":
            for w in ws:
                if w["role"] == "prefill":
                    a += ["--pd-kv-events", w["url"] + "=" + w["kv_events"]]
            a += ["--kv-event-block-size", str(ctx["block_size"]),
                  "--kv-event-model", ctx["model"]]
        return a
    return argv


def pd_rows(peers_ok, routerd):
    """The P/D rows (a P/D cluster), then the same routers on 4 workers."""
    pd, flat = [], []
    if peers_ok is not True:
        pd += [{"name": n, "label": l, "skipped": peers_ok} for n, l in (
            ("vllm_pd_cache_aware", "vllm-router PD cache_aware"),
            ("vllm_pd_kv_aware", "vllm-router PD kv_aware"))]
        flat += [{"name": n, "label": l, "skipped": peers_ok} for n, l in (
            ("vllm_kv_aware", "vllm-router kv_aware"),
            ("vllm_cache_aware", "vllm-router cache_aware"))]
    else:
        pd += [{"name": "vllm_pd_cache_aware", "label": "vllm-router PD cache_aware",
                "router": vllm_router_pd("cache_aware"), "peer": True},
               {"name": "vllm_pd_kv_aware", "label": "vllm-router PD kv_aware",
                "router": vllm_router_pd("kv_aware"), "peer": True}]
        flat += [{"name": "vllm_kv_aware", "label": "vllm-router kv_aware",
                  "router": vllm_router("kv_aware"), "peer": True},
                 {"name": "vllm_cache_aware", "label": "vllm-router cache_aware",
                  "router": vllm_router("cache_aware"), "peer": True}]
    if routerd:
        pd.append(dict(routerd_row(routerd, True), name="routerd_pd",
                       label="kvplane-routerd P/D"))
        flat.append(dict(routerd_row(routerd, True), reference=False))
    return pd, flat


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


def with_keys(lines, spec):
    """lines (a YAML config of top-level sections, two-space keys) with the
    keys of spec ("key: v; sec.key: v"; no section = routing) set: replaced
    where the section has the key, added to the section, or a new section."""
    out = list(lines)
    for kv in (x.strip() for x in spec.split(";") if x.strip()):
        key, _, val = kv.partition(":")
        sec, _, key = key.strip().rpartition(".")
        sec = sec or "routing"
        item = "  %s: %s" % (key, val.strip())
        if sec + ":" not in out:
            out += [sec + ":", item]
            continue
        at = out.index(sec + ":") + 1
        end = at
        while end < len(out) and out[end].startswith("  "):
            end += 1
        same = [j for j in range(at, end) if out[j].split(":")[0].strip() == key]
        if same:
            out[same[0]] = item
        else:
            out.insert(end, item)
    return out


def routerd_config(ctx, path, routing=None):
    ws = ctx["workers"]
    lines = ["# written by bench/live/make_live.py for kvplane-routerd",
             "routerd:",
             "  listen: 127.0.0.1:%d" % ctx["port"],
             "  policy: kvplane_cost",
             # one line a request (its X-Request-Id is the trace index):
             # bench/live/breakdown.py joins them to the client's req.live.jsonl
             "  receipts: %s" % os.path.join(ctx["dir"], "receipts.jsonl"),
             # the emulation runs time_scale x faster: so must the router's
             # view of the workers' load (/metrics every 250 ms of trace time)
             "  scrape_interval: %.4fs" % scaled(ctx, 0.25),
             # emulated workers answer /metrics from C in microseconds; at
             # time scale X a paced gap would stretch X-fold in trace time:
             # pace only real engines (routerd.scrape_budget, docs/routerd.md)
             "  scrape_budget: %g" % (0.02 if (ctx.get("time_scale") or 1) <= 1 else 0),
             "workers:",
             "  urls: [%s]" % ", ".join(w["url"] for w in ws),
             "  kv_events: [%s]" % ", ".join(w["kv_events"] for w in ws),
             "  kv_replay: [%s]" % ", ".join(w["kv_replay"] for w in ws),
             ]
    if any(w.get("role", "both") != "both" for w in ws):  # a P/D cluster
        lines += ["  roles: [%s]" % ", ".join(w["role"] for w in ws),
                  "pd:", "  link_gbps: %g" % ctx.get("link_gbps", 25)]
    lines += ["namespace:",
             "  model_id: %s" % ctx["model"]]
    # real engines: the calibrated model: and gpu: (the cost model's prefill
    # speed is the CPU workers', not an H100's); else the block size alone
    lines += ctx.get("routerd_model_yaml") or ["model:",
                                               "  block_size: %d" % ctx["block_size"]]
    if routing:  # a --routerd-variant row: its keys, "sec.key: v" or routing's
        lines = with_keys(lines, routing)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def variant_arg(v):
    """--routerd-variant NAME='key: v; sec.key: v' -> (NAME, keys)"""
    name, eq, keys = v.partition("=")
    if not eq or not name or not keys or not all(c.isalnum() or c == "_" for c in name):
        raise argparse.ArgumentTypeError("expected NAME='key: value; sec.key: value', "
                                         "NAME of letters, digits and _ (got %r)" % v)
    return name, keys


def routerd_row(binary, token_ids, variant=None):
    """token_ids: the client sends token ids (the router hashes them as
    sent); else text, which the router renders through a worker first --
    a loopback round trip and the worker's tokenization that the time scale
    multiplies (x20 by default), where peers tokenize in process.
    variant: (name, "key: value; key: value") -- routing: keys of an extra
    row (--routerd-variant), token ids, never the reference."""
    def argv(ctx):
        cfg = os.path.join(ctx["dir"], "routerd.yaml")
        routerd_config(ctx, cfg, variant[1] if variant else None)
        return [binary, "--config", cfg]
    if variant:
        return {"name": "routerd_" + variant[0],
                "label": "kvplane-routerd (%s)" % variant[0],
                "router": argv, "peer": False, "reference": False, "token_ids": True}
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


def live_rows(peers_ok, routerd, fleets=True, variants=(), only=None):
    rows = all_rows(peers_ok, routerd, fleets, variants)
    unknown = sorted((only or set()) - {r["name"] for r in rows})
    if unknown:
        sys.exit("make_live: --rows %s: no such row here (rows: %s)" % (
            ",".join(unknown), ", ".join(r["name"] for r in rows)))
    return [r for r in rows if only is None or r["name"] in only]


def all_rows(peers_ok, routerd, fleets, variants):
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
        rows += [routerd_row(routerd, True, v) for v in variants]
        rows.append(routerd_row(routerd, False))
        if fleets and find_bin("nats-server") and find_bin("nginx"):
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


class EmulatedCluster:
    """A fresh emulated cluster (kvplane-bench engine) for every row."""

    def __init__(self, a, extra=()):
        self.a = a
        self.eng = None
        self.extra = list(extra)  # --prefill N --decode M (P/D)

    def start(self, d, bs):
        a = self.a
        ready = os.path.join(d, "engine.json")
        self.eng = Proc([a.bench, "engine", "--workers", str(a.workers), "--block-size",
                         str(bs), "--time-scale", str(a.time_scale), "--max-model-len",
                         "1048576", "--ready-file", ready,
                         "--req-log", os.path.join(d, "engine-req.jsonl")] + self.extra,
                        os.path.join(d, "engine.log"))
        wait_for(lambda: os.path.exists(ready), 20, "the engine's ready file")
        with open(ready) as f:
            ctx = json.load(f)
        return ctx, ready

    def check(self, d):
        if self.eng.p.poll() is not None:  # ours: nothing else may end it
            raise RuntimeError("the engine exited (%d) during the replay; see %s"
                               % (self.eng.p.returncode, d))

    def before(self, ctx):
        return [scrape(w["url"]) for w in ctx["workers"]]

    def stop(self):
        if self.eng:
            self.eng.stop()
            self.eng = None


class VllmCluster:
    """One cluster of real vLLM workers for every row: each row starts from
    empty prefix caches (/reset_prefix_cache) and reads the engines' own
    counters as differences."""

    def __init__(self, a, fleet):
        self.a, self.fleet = a, fleet

    def start(self, d, bs):
        ctx = self.fleet.ctx()
        ctx["routerd_model_yaml"] = self.a.calib["routerd_yaml"]
        vf.reset(ctx)
        ready = os.path.join(d, "engine.json")
        with open(ready, "w") as f:
            json.dump(ctx, f, indent=1)
        return ctx, ready

    def check(self, d):
        for i, p in enumerate(self.fleet.procs):
            if p.poll() is not None:
                raise RuntimeError("vLLM worker %d exited (%d) during the replay; see %s"
                                   % (i, p.returncode, self.fleet.dir))

    def before(self, ctx):
        return [scrape(w["url"]) for w in ctx["workers"]]

    def stop(self):
        pass


def live_row(a, tr, bs, row, d, cluster):
    os.makedirs(d, exist_ok=True)
    rt = None
    try:
        ctx, ready = cluster.start(d, bs)
        ctx.update(port=free_port(), prom_port=free_port(), venv=a.venv, dir=d,
                   link_gbps=a.link_gbps)
        target = ["--direct", "--engine-file", ready]
        if row["router"]:
            rt = Proc(row["router"](ctx), os.path.join(d, "router.log"))
            url = "http://127.0.0.1:%d" % ctx["port"]
            wait_for(lambda: rt.p.poll() is None and http_ok(url + "/health"), 60,
                     row["label"] + " /health")
            if row.get("peer"):
                # /health answers before the peers have registered their
                # workers (sglang-router probes each worker's model info
                # first, slowly on real vLLM): requests sent then fail and
                # open its circuit breakers.  /v1/models through the router
                # answers once a worker is behind it.
                wait_for(lambda: http_ok(url + "/v1/models", 5), 120,
                         row["label"] + " /v1/models (its workers registered)")
            target = ["--target", url]
        base = cluster.before(ctx)
        argv = [a.bench, "live"] + target + [
            "--time-scale", str(ctx.get("time_scale") or a.time_scale), "--model",
            ctx["model"], "--limit", str(tr["limit"]), "--no-progress",
            "--out", os.path.join(d, "out"), "--req-log", os.path.join(d, "req")]
        if ctx.get("vocab"):
            argv += ["--vocab", str(ctx["vocab"])]
        if tr.get("speed"):
            argv += ["--speed", "%g" % tr["speed"]]
        if tr["closed_loop"]:
            argv += ["--closed-loop", str(tr["closed_loop"])]
        if not row.get("token_ids"):
            argv += ["--text-prompts"]
        with open(os.path.join(d, "live.log"), "w") as f:
            rc = subprocess.call(argv + [tr.get("scaled") or tr["path"]], stdout=f,
                                 stderr=subprocess.STDOUT, preexec_fn=_renice)
        cluster.check(d)
        after = [scrape(w["url"]) for w in ctx["workers"]]
        per = [(x[0] - b[0], x[1] - b[1]) for x, b in zip(after, base)]
        pulled = sum(scrape_emul(w["url"], "kv_pull_bytes") for w in ctx["workers"])
    finally:
        if rt:
            rt.stop()
        cluster.stop()
    res = result_of(os.path.join(d, "out", "results.json"), rc, per,
                    os.path.join(d, "live.log"))
    res.update(e2e_of(os.path.join(d, "req.live.jsonl")))
    res.update(decode_of(os.path.join(d, "req.live.jsonl"), a))
    res["xfer_bytes"] = pulled
    # where prompts are prefilled (P/D: the prefill workers; else all): the
    # workers' own prefix-cache hit rate (a decode worker counts what it
    # pulled as cached)
    pf = [x for x, w in zip(per, ctx["workers"]) if w.get("role", "both") != "decode"]
    res["prefill_hit_rate"] = sum(h for _, h in pf) / max(1, sum(pt for pt, _ in pf))
    fj = os.path.join(d, "fleet", "fleet.json")
    if row.get("fleet") and os.path.exists(fj):
        with open(fj) as f:
            res["fleet"] = json.load(f)
    return res


def scrape_emul(url, name):
    """An emulated worker's own counter (kvplane_engine_NAME_total), 0 if none."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvplane_engine_%s_total{" % name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def pct(v, q):
    return v[min(len(v) - 1, int(q * len(v)))] if v else None


def decode_of(path, a):
    """Time per output token, (e2e - ttft) / (out - 1), p50 / p99 over the
    requests with more than one token, and the share of requests within
    the SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot, trace seconds): the
    replay's --req-log."""
    try:
        with open(path) as f:
            rs = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return {}
    tp = sorted((r["e2e"] - r["ttft"]) / (r["out"] - 1) for r in rs
                if r.get("out", 0) > 1)
    good = sum(1 for r in rs if r["ttft"] <= a.slo_ttft and
               (r.get("out", 0) <= 1 or
                (r["e2e"] - r["ttft"]) / (r["out"] - 1) <= a.slo_tpot))
    return {"tpot_p50": pct(tp, 0.5), "tpot_p99": pct(tp, 0.99),
            "slo_share": good / len(rs) if rs else None}


def e2e_of(path):
    """Request completion time (send to last byte) p50 / mean, from the
    replay's --req-log."""
    try:
        with open(path) as f:
            v = sorted(json.loads(x)["e2e"] for x in f if x.strip())
    except (OSError, ValueError, KeyError):
        return {}
    if not v:
        return {}
    return {"e2e_p50": v[len(v) // 2], "e2e_mean": sum(v) / len(v)}


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
def offline(a, tr, d, pd=False):
    """kvplane-bench run on tr's replay: kvplane_cost and round_robin on the
    flat cluster, or (pd) kvplane_cost on the P/D one -- the same --prefill
    / --decode / --link-gbps as the emulated workers, the simulator's P/D
    model (docs/harness.md, "P/D")."""
    os.makedirs(d, exist_ok=True)
    argv = [a.bench, "run"]
    if tr.get("config"):  # the real engines' calibrated cluster
        argv += ["--config", tr["config"]]
    if pd:
        argv += ["--prefill", str(a.prefill), "--decode", str(a.decode),
                 "--link-gbps", "%g" % a.link_gbps, "--policies", "kvplane_cost"]
    else:
        argv += ["--workers", str(a.workers), "--policies", "kvplane_cost,round_robin"]
    argv += ["--dram-gb", "0", "--nvme-gb", "0", "--no-tier-classes",
             "--limit", str(tr["limit"]), "--no-progress",
             "--quiet", "--out", os.path.join(d, "out")]
    if tr["closed_loop"]:
        argv += ["--closed-loop", str(tr["closed_loop"])]
    if tr.get("speed"):
        argv += ["--speed", "%g" % tr["speed"]]
    with open(os.path.join(d, "run.log"), "w") as f:
        rc = subprocess.call(argv + [tr.get("scaled") or tr["path"]], stdout=f,
                             stderr=subprocess.STDOUT)
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
        if "pd" in p:  # the columns of a live P/D row, under their names
            x = p["pd"]
            rows[p["policy"]].update(
                prefill_hit_rate=x["prefill_hit_rate"], xfer_bytes=x["xfer_bytes"],
                tpot_p50=x["tpot_s"]["p50"], tpot_p99=x["tpot_s"]["p99"],
                roles=x["roles"])
    return run["block_size"], rows


# ---- the table ------------------------------------------------------------------------
def ms(v):
    if v is None:
        return "-"
    return "%.0fms" % (v * 1e3) if v < 10 else "%.1fs" % v


def ratio(v, ref):
    return "%.2f" % (v / ref) if v is not None and ref else "-"


COLS = ("%-32s %6s %4s %6s %7s %8s %8s %8s %8s %8s %6s  %6s %6s %6s %6s")


def table(sections):
    out = [COLS % ("row", "reqs", "err", "hit%", "eng%", "p50", "p95", "p99", "mean",
                   "e2e p50", "imbal", "hit/kv", "p50/kv", "p95/kv", "p99/kv")]
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
                "%.1f" % (100 * r["hit_rate"]),
                "-" if r.get("engine_hit_rate") is None else "%.1f" % (100 * r["engine_hit_rate"]),
                ms(r["ttft_p50"]), ms(r["ttft_p95"]), ms(r["ttft_p99"]), ms(r["ttft_mean"]),
                ms(r.get("e2e_p50")),
                "-" if r["imbalance"] is None else "%.2f" % r["imbalance"],
                ratio(r["hit_rate"], ref["hit_rate"]), ratio(r["ttft_p50"], ref["ttft_p50"]),
                ratio(r["ttft_p95"], ref["ttft_p95"]), ratio(r["ttft_p99"], ref["ttft_p99"])))
    out.append("")
    out.append("* the reference row (x/kv = this row / it): kvplane-routerd live when it "
               "ran, else kvplane's offline kvplane_cost.\nhit%: cached prompt tokens "
               "by the responses' usage; eng%: by the workers' own /metrics "
               "(prefix_cache_hits / prompt_tokens).\nTTFT and e2e (send to last "
               "byte) in trace seconds (live: x the time scale); imbal = max / mean "
               "uncached prompt tokens per worker (offline: prefill per worker).")
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
            "e2e_p50", "e2e_mean", "imbalance", "wall_s", "tpot_p50", "tpot_p99",
            "xfer_bytes", "slo_share", "prefill_hit_rate")


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
def one_trace(a, tr, peers_ok, k, n, cluster):
    d = os.path.join(a.out, tr["name"])
    if a.engine == "vllm":
        prepare_scaled(a, tr, d)
    log("[%d/%d] %s: offline prediction (kvplane-bench run)" % (k, n, tr["name"]))
    bs, off = offline(a, tr, os.path.join(d, "offline"))
    rows = [dict(off["kvplane_cost"], name="offline_kvplane_cost",
                 label="kvplane (offline kvplane_cost)", reference=True),
            dict(off["round_robin"], name="offline_round_robin",
                 label="offline round_robin", reference=False)]
    lrows = live_rows(peers_ok, a.routerd, fleets=a.engine != "vllm",
                      variants=a.routerd_variant, only=a.rows)
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
            r = dict(live_row(a, tr, bs, row, os.path.join(d, row["name"]), cluster),
                     **base)
            log("      %d requests, hit %.1f%%, TTFT p50 %s, %.0f s" % (
                r["requests"], 100 * r["hit_rate"], ms(r["ttft_p50"]),
                time.monotonic() - t0))
        except (RuntimeError, OSError) as e:
            r = dict(base, failed=str(e))
            log("      FAILED: %s" % e)
        rows.append(r)
    if a.engine == "vllm":
        what = ("first %d requests scaled 1/%d (block %d, prompts <= %d tokens), %s, "
                "%d real vLLM workers (%s)" % (
                    tr["limit"], tr["shrink"], bs, tr["max_prompt"],
                    "closed loop %d" % tr["closed_loop"] if tr["closed_loop"]
                    else "arrivals at trace time / %.3g (utilisation %.2f)" % (
                        tr["speed"], a.utilisation), a.workers, cluster.fleet.isolation_mode()))
    else:
        what = "first %d requests, %s, %d workers, block %d, time scale %g" % (
            tr["limit"], "closed loop %d" % tr["closed_loop"] if tr["closed_loop"]
            else "at trace time", a.workers, bs, a.time_scale)
    return {"trace": tr["name"], "what": what, "block_size": bs, "rows": rows}


def one_trace_pd(a, tr, peers_ok, k, n):
    """--pd: the P/D rows on a 2 + 2 P/D cluster, then the flat rows on 4."""
    d = os.path.join(a.out, tr["name"])
    log("[%d/%d] %s: offline P/D prediction (kvplane-bench run --prefill %d --decode %d)"
        % (k, n, tr["name"], a.prefill, a.decode))
    bs, off = offline(a, tr, os.path.join(d, "offline-pd"), pd=True)
    pd, flat = pd_rows(peers_ok, a.routerd)
    flat = [] if a.pd_only else flat
    # the simulator's prediction for the P/D cluster: beside the live P/D
    # rows, not one of them (the "best of" line compares the live ones)
    rows = [dict(off["kvplane_cost"], name="offline_pd_kvplane_cost",
                 label="offline P/D kvplane_cost", pd=False, offline=True,
                 reference=False)]
    pd_cluster = EmulatedCluster(a, ["--prefill", str(a.prefill), "--decode",
                                     str(a.decode), "--link-gbps", "%g" % a.link_gbps])
    for group, cluster, tag in ((pd, pd_cluster, "P/D"),
                                (flat, EmulatedCluster(a), "flat")):
        for row in group:
            base = {"name": row["name"], "label": row["label"], "pd": tag == "P/D",
                    "reference": row["name"] == "routerd_pd"}
            if row.get("skipped"):
                rows.append(dict(base, skipped=row["skipped"]))
                continue
            log("[%d/%d] %s: %s %s ..." % (k, n, tr["name"], tag, row["label"]))
            t0 = time.monotonic()
            try:
                r = dict(live_row(a, tr, bs, row, os.path.join(d, row["name"]),
                                  cluster), **base)
                log("      %d requests, TTFT p95 %s, TPOT p99 %s, %.0f s" % (
                    r["requests"], ms(r["ttft_p95"]), ms(r.get("tpot_p99")),
                    time.monotonic() - t0))
            except (RuntimeError, OSError) as e:
                r = dict(base, failed=str(e))
                log("      FAILED: %s" % e)
            rows.append(r)
    what = "first %d requests, %s, P/D %d prefill + %d decode (link %g GB/s) / flat %d " \
        "workers, block %d, time scale %g" % (
            tr["limit"], "closed loop %d" % tr["closed_loop"] if tr["closed_loop"]
            else "at trace time", a.prefill, a.decode, a.link_gbps,
            a.prefill + a.decode, bs, a.time_scale)
    return {"trace": tr["name"], "what": what, "block_size": bs, "rows": rows}


PD_COLS = "%-30s %5s %4s %7s %8s %8s %8s %8s %8s %9s %6s"


def pd_table(a, sections):
    out = [PD_COLS % ("row", "reqs", "err", "pf hit%", "TTFT p50", "p95", "p99",
                      "TPOT p50", "p99", "xfer GB", "slo%")]
    for s in sections:
        out += ["", "%s: %s" % (s["trace"], s["what"])]
        for r in s["rows"]:
            if r.get("failed") or r.get("skipped"):
                out.append("%-30s  %s: %s" % (r["label"], "failed" if r.get("failed")
                                              else "skipped", r.get("failed") or r["skipped"]))
                continue
            out.append(PD_COLS % (
                r["label"] + (" *" if r["reference"] else ""), r["requests"],
                "-" if r["errors"] is None else r["errors"],
                "%.1f" % (100 * r.get("prefill_hit_rate", r["hit_rate"])),
                ms(r["ttft_p50"]), ms(r["ttft_p95"]), ms(r["ttft_p99"]),
                ms(r.get("tpot_p50")), ms(r.get("tpot_p99")),
                "%.2f" % (r.get("xfer_bytes", 0) / 1e9),
                "-" if r.get("slo_share") is None else "%.1f" % (100 * r["slo_share"])))
        best = {}
        for key in ("ttft_p95", "tpot_p99"):
            ok = [r for r in s["rows"] if r.get("pd") and r.get(key) is not None
                  and not r.get("failed")]
            if ok:
                best[key] = min(ok, key=lambda r: r[key])["label"]
        out.append("best of the P/D rows: TTFT p95 %s; TPOT p99 %s" % (
            best.get("ttft_p95", "-"), best.get("tpot_p99", "-")))
    out += ["", "pf hit%: the prefix-cache hit rate where prompts are prefilled (the "
            "prefill workers' /metrics; flat rows: every worker's).",
            "TTFT, TPOT in trace seconds (live: x the time scale); TPOT = (e2e - "
            "TTFT) / (completion tokens - 1); xfer: KV bytes the decode workers pulled "
            "(their kvplane_engine_kv_pull_bytes); slo%%: requests with TTFT <= %gs and "
            "TPOT <= %gms" % (a.slo_ttft, a.slo_tpot * 1e3),
            "offline P/D: kvplane-bench run --prefill %d --decode %d --link-gbps %g on the same "
            "replay (the simulator's P/D model, docs/harness.md; pf hit%% = its prefill legs'; "
            "no slo%%)" % (a.prefill, a.decode, a.link_gbps)]
    return "\n".join(out)


# ---- real vLLM ---------------------------------------------------------------------
def prepare_scaled(a, tr, d):
    """tr's first LIMIT requests in kvplane format, scaled for the real
    engines (scale_trace.py), and the arrival speed that loads the cluster
    to --utilisation (open-loop traces)."""
    os.makedirs(d, exist_ok=True)
    raw = os.path.join(d, "trace.jsonl")
    tr["scaled"] = os.path.join(d, "trace.scaled.jsonl")
    with open(os.path.join(d, "scale.log"), "w") as f:
        if subprocess.call([a.bench, "convert", "--limit", str(tr["limit"]), tr["path"],
                            raw], stdout=f, stderr=f) != 0:
            raise RuntimeError("kvplane-bench convert failed; see %s/scale.log" % d)
        if subprocess.call([sys.executable, os.path.join(HERE, "scale_trace.py"),
                            "--shrink", str(tr["shrink"]), "--block-size",
                            str(vf.BLOCK), "--max-prompt", str(tr["max_prompt"]),
                            "--max-output", str(tr["max_output"]), raw, tr["scaled"]],
                           stdout=f, stderr=f) != 0:
            raise RuntimeError("scale_trace.py failed; see %s/scale.log" % d)
    tr["config"] = a.calib_yaml
    if not tr["closed_loop"]:
        tr["speed"] = arrival_speed(tr["scaled"], a.calib, a.workers, a.utilisation)
        log("      %s: arrivals at trace time / %.3g load the %d workers to %.2f "
            "(ideal reuse, calibrated prefill)" % (tr["name"], tr["speed"], a.workers,
                                                   a.utilisation))


def arrival_speed(path, cal, workers, util):
    """The speed (trace time / X) at which the trace's prefill work, with
    every repeated prefix reused (the best any router does), keeps `util`
    of the workers busy, by the calibrated model."""
    with open(path) as f:
        lines = f.read().splitlines()
    bs = json.loads(lines[0])["block_size"]
    seen, work, t = set(), 0.0, []
    for line in lines[1:]:
        q = json.loads(line)
        t.append(q["t"])
        hit = 0
        for h in q["hash_ids"]:
            if h not in seen:
                break
            hit += 1
        seen.update(q["hash_ids"])
        c, n = min(hit * bs, q["in"]), q["in"]
        work += (cal["base_s"] + cal["cached_token_s"] * c + cal["a_s_per_token"] * (n - c)
                 + cal["c_s_per_token2"] * (n * n - c * c))
    span = max(t) - min(t) if t else 0
    if span <= 0 or work <= 0:
        return 1.0
    return min(1000.0, max(0.01, util * workers * span / work))


def start_vllm(a):
    """The real cluster (bench/live/vllm/setup.sh, fleet.py), calibrated;
    None with the reason printed when it cannot run here."""
    setup = os.path.join(HERE, "vllm", "setup.sh")
    p = subprocess.run([setup], stdout=subprocess.PIPE, stderr=None, text=True)
    if p.returncode == 77:
        log("SKIP ENGINE=vllm: PyPI cannot be reached and the real-vLLM venv is not "
            "installed (bench/live/vllm/setup.sh says why above)")
        return None
    if p.returncode != 0:
        raise RuntimeError("bench/live/vllm/setup.sh failed (%d)" % p.returncode)
    python = p.stdout.strip().splitlines()[-1]
    model = os.path.join(ROOT, ".cache", "vllm-tiny")
    fl = vf.Fleet(python, model, a.workers, os.path.join(a.out, "vllm-fleet"),
                  a.worker_cpus or None, a.kv_cache_mib << 20)
    try:
        fl.start()
        ctx = fl.ctx()
        log("calibrating the timing model on the workers (cold and cached prefills) ...")
        a.calib = vf.calibrate(ctx)
        a.calib_yaml = os.path.join(a.out, "vllm-calibrated.yaml")
        with open(a.calib_yaml, "w") as f:
            f.write(a.calib["yaml"])
        with open(os.path.join(a.out, "vllm-calibration.json"), "w") as f:
            json.dump(a.calib, f, indent=1)
        log("      cold prefill %.3g s + %.3g s/token + %.3g s/token^2; cached %.3g "
            "s/token: %s" % (a.calib["base_s"], a.calib["a_s_per_token"],
                             a.calib["c_s_per_token2"], a.calib["cached_token_s"],
                             a.calib_yaml))
        if a.isolation:
            idle, busy, r = vf.isolation(ctx)
            a.isolation_result = {"idle_s": idle, "busy_s": busy, "ratio": r}
            log("      isolation: worker 0's cold TTFT p50 %.3f s with its neighbours "
                "idle, %.3f s with them saturated (%.2fx)" % (
                    idle[len(idle) // 2], busy[len(busy) // 2], r))
    except BaseException:
        fl.stop()
        raise
    return fl


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=os.path.join(ROOT, "build-run", "bench",
                                                    "kvplane-bench"))
    ap.add_argument("--venv", default=os.path.join(ROOT, ".venv-peers"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build-run", "live-report"))
    ap.add_argument("--engine", choices=("emulated", "vllm"), default="emulated",
                    help="emulated: kvplane-bench engine (a fresh cluster a row); "
                    "vllm: real vLLM workers (CPU build, bench/live/vllm/), one "
                    "cluster reset between rows")
    ap.add_argument("--workers", type=int, default=0,
                    help="workers (default 4 emulated, 3 vllm)")
    ap.add_argument("--time-scale", type=float, default=20,
                    help="emulated workers only (real ones run at 1)")
    ap.add_argument("--traces", default=",".join(t["name"] for t in TRACES),
                    help="comma-separated subset of: %(default)s")
    ap.add_argument("--limit", type=int, default=0,
                    help="requests per trace (default: each trace's own cap)")
    ap.add_argument("--utilisation", type=float, default=0.6,
                    help="vllm: open-loop arrival rate chosen so the prefill work, "
                    "ideally reused, keeps this share of the workers busy")
    ap.add_argument("--worker-cpus", type=float, default=0,
                    help="vllm: CPU quota per worker (default (CPUs - 0.5) / workers)")
    ap.add_argument("--kv-cache-mib", type=int, default=256,
                    help="vllm: KV cache per worker (MiB)")
    ap.add_argument("--no-isolation-check", dest="isolation", action="store_false",
                    help="vllm: skip the measurement of one worker's TTFT beside busy ones")
    ap.add_argument("--no-peers", action="store_true", help="direct and offline only")
    ap.add_argument("--rows", type=lambda v: set(v.split(",")), default=None,
                    help="live rows to run (names as in live.csv: direct, direct_ids, "
                    "vllm_kv_aware, vllm_cache_aware, sglang_cache_aware, routerd, "
                    "routerd_text, routerd_x3_nats, routerd_x3_nosync, routerd_NAME); "
                    "the offline rows always run")
    ap.add_argument("--routerd-variant", action="append", default=[],
                    type=variant_arg,
                    help="an extra kvplane-routerd row (routerd_NAME) with these config keys "
                    "(routing: unless named sec.key), e.g. noguard='guard: 1000' or "
                    "nooh='gpu.prefill_overhead_s: 0' (repeatable; docs/config.md lists the keys)")
    ap.add_argument("--routerd", default=os.environ.get("KVPLANE_ROUTERD"),
                    help="kvplane-routerd binary: adds its row (default $KVPLANE_ROUTERD)")
    ap.add_argument("--pd", action="store_true",
                    help="the P/D A/B (emulated): P/D rows on --prefill + --decode "
                    "workers, then the flat rows on as many")
    ap.add_argument("--pd-only", action="store_true",
                    help="--pd: the P/D rows alone (repeat runs)")
    ap.add_argument("--prefill", type=int, default=2, help="--pd: prefill workers")
    ap.add_argument("--decode", type=int, default=2, help="--pd: decode workers")
    ap.add_argument("--link-gbps", type=float, default=25,
                    help="--pd: the emulated KV link (GB/s), and kvplane-routerd's price")
    ap.add_argument("--slo-ttft", type=float, default=2.0,
                    help="--pd: TTFT SLO, trace seconds (slo%%)")
    ap.add_argument("--slo-tpot", type=float, default=0.05,
                    help="--pd: TPOT SLO, trace seconds (slo%%)")
    a = ap.parse_args()
    if a.pd:
        return main_pd(a)
    a.workers = a.workers or (3 if a.engine == "vllm" else 4)
    if not os.access(a.bench, os.X_OK):
        sys.exit("make_live: %s is not built (make build-run)" % a.bench)
    os.makedirs(a.out, exist_ok=True)
    peers_ok = "--no-peers" if a.no_peers else ensure_peers(a.venv, a.out)
    want = a.traces.split(",")
    trs = [dict(t, **(t.get("vllm", {}) if a.engine == "vllm" else {}))
           for t in TRACES if t["name"] in want]
    for t in trs:
        t["limit"] = a.limit or t["limit"]
    t0 = time.monotonic()
    a.isolation_result = None
    if a.engine == "vllm":
        NICE[0] = -10
        fl = start_vllm(a)
        if fl is None:
            return 0
        cluster = VllmCluster(a, fl)
    else:
        fl, cluster = None, EmulatedCluster(a)
    try:
        sections = [one_trace(a, t, peers_ok, k, len(trs), cluster)
                    for k, t in enumerate(trs, 1)]
    finally:
        if fl:
            fl.stop()
    text = table(sections)
    if a.isolation_result:
        r = a.isolation_result
        text += ("\nworker isolation (%s): worker 0's cold 1024-token TTFT p50 %.3f s, "
                 "neighbours idle; %.3f s, neighbours saturated (%.2fx)" % (
                     fl.isolation_mode(), r["idle_s"][len(r["idle_s"]) // 2],
                     r["busy_s"][len(r["busy_s"]) // 2], r["ratio"]))
    write_results(a, sections, text)
    log("\n" + text)
    log("\nresults: %s/{table.txt,live.csv,live.json} and per row %s/TRACE/ROW/ "
        "(%.0f s)" % (a.out, a.out, time.monotonic() - t0))
    failed = [r["label"] for s in sections for r in s["rows"] if r.get("failed")]
    return 1 if failed else 0


def main_pd(a):
    if a.engine != "emulated":
        sys.exit("make_live: --pd runs on the emulated workers only (docs/routerd.md#pd)")
    a.workers = a.prefill + a.decode
    if not os.access(a.bench, os.X_OK):
        sys.exit("make_live: %s is not built (make build-run)" % a.bench)
    os.makedirs(a.out, exist_ok=True)
    peers_ok = "--no-peers" if a.no_peers else ensure_peers(a.venv, a.out)
    trs = [dict(t) for t in TRACES if t["name"] in a.traces.split(",")]
    for t in trs:
        t["limit"] = a.limit or t["limit"]
    t0 = time.monotonic()
    sections = [one_trace_pd(a, t, peers_ok, k, len(trs)) for k, t in enumerate(trs, 1)]
    text = pd_table(a, sections)
    write_results(a, sections, text)
    log("\n" + text)
    log("\nresults: %s/{table.txt,live.csv,live.json} (%.0f s)" % (
        a.out, time.monotonic() - t0))
    return 1 if any(r.get("failed") for s in sections for r in s["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
