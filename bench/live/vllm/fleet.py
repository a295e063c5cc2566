#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A cluster of REAL vLLM workers (vLLM's CPU build) on loopback.

Each worker is `python -m vllm.entrypoints.openai.api_server` serving the
tiny model (tiny_model.py) with prefix caching, 32-token blocks, KV events
(ZMQ PUB + replay ROUTER), the render endpoints (--enable-scale-out),
`cached_tokens` in usage (--enable-prompt-tokens-details) and
/reset_prefix_cache (VLLM_SERVER_DEV_MODE=1, so one cluster serves every row
of a comparison from a cold cache).

Independent servers, as GPUs are: every worker runs in its own CPU cgroup
with a fixed quota (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us; default
(CPUs - 0.5) / N, so 0.5 CPU each for 3 workers on 2 cores, the other half
core left to the router and the client) and its OpenMP thread bound to core
i mod CPUs (VLLM_CPU_OMP_THREADS_BIND; unbound, every instance binds core
0).  Where no cgroup can be written, pinning alone is used and said.
`isolation` measures it: one worker's TTFT with its neighbours idle and
saturated.

The cluster is described as kvplane-bench engine's ready file is
(workers[].url / kv_events / kv_replay, model, block_size, ...), so every
script that drives emulated workers drives these.

usage (the venv's python; bench/live/vllm/setup.sh prints it):
  fleet.py up --workers N --ready-file F [--dir D] [--cpus X]   (until SIGTERM)
  fleet.py calibrate --ready-file F [--out calib.json]
  fleet.py isolation --ready-file F
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))
from loopports import free_port  # noqa: E402

MODEL_NAME = "kvplane-tiny"
BLOCK = 32                       # CPU attention needs a multiple of 32
VOCAB = 32767                    # prompt ids below the EOS id (tiny_model.py)
KV_BYTES_PER_TOKEN = 2 * 2 * 4 * 64 * 2   # layers x (K,V) x kv heads x dim x bf16


def log(msg):
    print("fleet: " + msg, file=sys.stderr, flush=True)


# ---- HTTP ------------------------------------------------------------------
def post(url, body, timeout=600):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def healthy(url):
    try:
        return get(url + "/health", 2) is not None
    except (OSError, urllib.error.URLError):
        return False


def metrics(url):
    """vllm:* samples of one worker, summed over label sets, by name."""
    val = {}
    for line in get(url + "/metrics").splitlines():
        if line.startswith("vllm:") and " " in line:
            name, v = line.rsplit(" ", 1)
            k = name.split("{")[0]
            try:
                val[k] = val.get(k, 0.0) + float(v)
            except ValueError:
                pass
    return val


# ---- CPU shares --------------------------------------------------------------
class CpuShare:
    """One cgroup per worker with a CPU quota: v2 (cpu.max) or v1
    (cpu.cfs_quota_us).  `kind` says which, or None (pinning only)."""

    # 10 ms: a worker that spent its quota waits at most the rest of the
    # period (with the kernel's 100 ms default a cached prompt's TTFT went
    # from 0.05 to 0.19 s at a 0.5 CPU quota)
    PERIOD = 10000

    def __init__(self, tag):
        self.kind, self.dirs, self.why = None, [], ""
        v2 = "/sys/fs/cgroup"
        v1 = "/sys/fs/cgroup/cpu"
        try:
            with open(os.path.join(v2, "cgroup.controllers")) as f:
                if "cpu" in f.read().split():
                    self.kind, self.base = "v2", os.path.join(v2, tag)
        except OSError:
            if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
                self.kind, self.base = "v1", os.path.join(v1, tag)
        if self.kind is None:
            self.why = "no cgroup cpu controller"
            return
        try:
            os.makedirs(self.base, exist_ok=True)
            # the workers' group outweighs the host's other tasks (a build
            # beside the run): each worker gets its quota, as a server its
            # cores, whatever else the machine does
            if self.kind == "v2":
                with open(os.path.join(self.base, "cgroup.subtree_control"), "w") as f:
                    f.write("+cpu")
                with open(os.path.join(self.base, "cpu.weight"), "w") as f:
                    f.write("1000")
            else:
                with open(os.path.join(self.base, "cpu.shares"), "w") as f:
                    f.write("10240")
        except OSError as e:
            self.why = "cannot write %s: %s" % (self.base, e)
            self.kind = None

    def make(self, i):
        if self.kind is None:
            return None
        d = os.path.join(self.base, "w%d" % i)
        os.makedirs(d, exist_ok=True)
        self.dirs.append(d)
        return d

    def limit(self, d, cpus):
        """cpus: the quota in CPUs (None: unlimited)."""
        if d is None:
            return
        if self.kind == "v2":
            with open(os.path.join(d, "cpu.max"), "w") as f:
                f.write("max %d" % self.PERIOD if cpus is None
                        else "%d %d" % (int(cpus * self.PERIOD), self.PERIOD))
        else:
            with open(os.path.join(d, "cpu.cfs_period_us"), "w") as f:
                f.write(str(self.PERIOD))
            with open(os.path.join(d, "cpu.cfs_quota_us"), "w") as f:
                f.write("-1" if cpus is None else str(int(cpus * self.PERIOD)))

    def remove(self):
        for d in self.dirs + [getattr(self, "base", None)]:
            if d:
                try:
                    os.rmdir(d)
                except OSError:
                    pass


# ---- test mode: one process less ----------------------------------------------
def uni_executor(argv, env, core):
    """argv and env (a server's, changed in place) for single_process=True,
    the tests' mode (Server, Fleet; make live keeps the default).

    By default a server is three processes started one after the other, each
    importing torch and vLLM (~15 s each here): the API server, its
    EngineCore, and the multiproc executor's VllmWorker, which vLLM's CPU
    platform forces (platforms/cpu.py turns --distributed-executor-backend
    uni into mp unless VLLM_ENABLE_V1_MULTIPROCESSING=0).  With that
    variable at 0 and the uni executor the worker runs inside EngineCore:
    two servers at once healthy in 40-46 s instead of 59-80 s on 2 cores.  The variable changes nothing else in
    the API server (AsyncLLM always runs EngineCore as a process of its own;
    only the offline LLM class and a seed warning read it); it is set in the
    server's env only, never in this process's.

    The mp executor is also what pins the worker's OpenMP thread: it gives
    the worker OMP_NUM_THREADS=1, OMP_PLACES={core}, OMP_PROC_BIND=true
    (utils/ompmultiprocessing.py, from VLLM_CPU_OMP_THREADS_BIND).  Without
    it the same three variables go to the whole server, so its API server
    and EngineCore run on that core too, and there is no core kept back for
    the scheduler: fine for the tests' short prompts, not for measuring
    prefill speed (vLLM's CPU docs want the mp executor for the OMP
    binding): make live / make_live.py stays on the default."""
    argv += ["--distributed-executor-backend", "uni"]
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
               OMP_PLACES="{%d}" % core, OMP_PROC_BIND="true")


# ---- one server ---------------------------------------------------------------
class Server:
    """One vLLM api_server on the tiny model outside a fleet (the connector
    tests and benchmarks): prefix caching, 32-token blocks, cached_tokens in
    usage, /reset_prefix_cache; optionally a KV connector (`connector`: the
    --kv-transfer-config dict; `pkg`: a built kvplane package put first on
    PYTHONPATH).  Its OpenMP thread on core `core`; opt_level 0 for tests
    (eager, no torch.compile at start).  With wait=False the caller starts
    several at once and calls wait() on each; stop() ends its whole process
    group (EngineCore and the worker included).  single_process=True: the
    worker inside EngineCore, one process less at each start (tests only:
    uni_executor())."""

    def __init__(self, workdir, tag, model, kv_bytes, connector=None, pkg=None, core=0,
                 max_len=None, max_num_seqs=4, opt_level=None, wait=True,
                 single_process=False):
        self.tag, self.port = tag, free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", model, "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--enable-prefix-caching", "--block-size", str(BLOCK),
                "--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(kv_bytes),
                "--max-num-seqs", str(max_num_seqs), "--uvicorn-log-level", "warning"]
        argv += ["--max-model-len", str(max_len)] if max_len else []
        argv += ["-O%d" % opt_level] if opt_level is not None else []
        argv += ["--kv-transfer-config", json.dumps(connector)] if connector else []
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
                   PYTHONHASHSEED="0", VLLM_CPU_OMP_THREADS_BIND=str(core),
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   TOKENIZERS_PARALLELISM="false", KVP_LOG="warn")
        if pkg:
            env["PYTHONPATH"] = pkg + os.pathsep + os.environ.get("PYTHONPATH", "")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes rules
        if single_process:
            uni_executor(argv, env, core)
        self.logpath = os.path.join(workdir, "vllm-%s.log" % tag)
        self.logf = open(self.logpath, "ab")
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(argv, env=env, stdout=self.logf, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=workdir)
        self.startup_s = None
        if wait:
            self.wait()

    def wait(self, timeout=600):
        """Until /health answers; raises (with the log's tail) if it exits."""
        while not healthy(self.url):
            if self.p.poll() is not None:
                self.dump()
                raise RuntimeError("vLLM %s exited (%s) while starting; see %s"
                                   % (self.tag, self.p.returncode, self.logpath))
            if time.monotonic() - self.t0 > timeout:
                self.stop()
                raise RuntimeError("vLLM %s not healthy after %d s" % (self.tag, timeout))
            time.sleep(1)
        self.startup_s = time.monotonic() - self.t0
        print("%s: vLLM healthy after %.0f s" % (self.tag, self.startup_s), flush=True)

    def dump(self):
        with open(self.logpath, errors="replace") as f:
            print("".join(f.readlines()[-40:]), flush=True)

    def reset_prefix_cache(self):
        req = urllib.request.Request(self.url + "/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        end = time.monotonic() + 30  # EngineCore may outlive the API server
        while group_alive(self.p.pid) and time.monotonic() < end:
            time.sleep(0.2)
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self.logf.closed:
            self.logf.close()


# ---- the fleet ---------------------------------------------------------------
def group_alive(pgid):
    """A process of group pgid still exists (a zombie leader not counted:
    the caller reaps it)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = open("/proc/%s/stat" % d).read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        if int(f[2]) == pgid and f[0] != "Z":  # state, ppid, pgrp
            return True
    return False


class Fleet:
    def __init__(self, python, model, n, workdir, cpus=None,
                 kv_bytes=256 << 20, max_num_seqs=32, start_timeout=600,
                 opt_level=None, single_process=False):
        self.python, self.model, self.n, self.dir = python, model, n, workdir
        # vLLM's -O level; None: its default (torch.compile, 13-42 s of each
        # start here); 0 for tests: eager, the same KV and events, the
        # compile left out (make live keeps the default: prefill speed)
        self.opt_level = opt_level
        # True for tests: each worker's model runner inside its EngineCore
        # (uni_executor(): two workers healthy in 40 s instead of 59 on 2
        # cores, the OMP pinning on the whole server); make live keeps the
        # default (mp: prefill speed)
        self.single_process = single_process
        ncpu = os.cpu_count() or 1
        self.cpus = cpus if cpus else max(0.25, (ncpu - 0.5) / n)
        self.kv_bytes, self.max_num_seqs = kv_bytes, max_num_seqs
        self.start_timeout = start_timeout
        self.procs, self.workers, self.logs, self.cg_dirs = [], [], [], []
        self.share = CpuShare("kvplane-live-%d" % os.getpid())
        os.makedirs(workdir, exist_ok=True)

    def argv(self, w):
        # vLLM binds the PUB socket only for a wildcard (or ipc) endpoint and
        # CONNECTS to any other (kv_events.py _is_bind_endpoint): tcp://*:P
        # binds, and subscribers dial tcp://127.0.0.1:P
        ev = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://*:%d" % w["pub_port"],
              "replay_endpoint": "tcp://127.0.0.1:%d" % w["replay_port"]}
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(w["port"]),
                "--enable-prefix-caching", "--block-size", str(BLOCK),
                "--enable-prompt-tokens-details", "--enable-scale-out",
                "--kv-cache-memory-bytes", str(self.kv_bytes),
                "--max-num-seqs", str(self.max_num_seqs),
                "--kv-events-config", json.dumps(ev),
                "--uvicorn-log-level", "warning"] + (
                    [] if self.opt_level is None else ["-O%d" % self.opt_level])

    def env(self, i):
        e = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1",
                 PYTHONHASHSEED="0", VLLM_CPU_OMP_THREADS_BIND=str(self.core(i)),
                 VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
        e.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes rules
        return e

    @staticmethod
    def core(i):
        return i % (os.cpu_count() or 1)

    def spawn(self, i):
        w = self.workers[i]
        d = self.cg_dirs[i]
        logf = open(os.path.join(self.dir, "worker%d.log" % i), "ab")
        argv, env = self.argv(w), self.env(i)
        if self.single_process:
            uni_executor(argv, env, self.core(i))

        def enter():
            if d:
                with open(os.path.join(d, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))
        p = subprocess.Popen(argv, env=env, stdout=logf,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=enter, cwd=self.dir)
        return p, logf

    def start(self):
        """Starts every worker (unlimited while they compile), waits for all,
        then applies the quotas."""
        for i in range(self.n):
            self.workers.append({"port": free_port(), "pub_port": free_port(),
                                 "replay_port": free_port()})
            d = self.share.make(i)
            self.share.limit(d, None)
            self.cg_dirs.append(d)
        for i in range(self.n):
            p, f = self.spawn(i)
            self.procs.append(p)
            self.logs.append(f)
        log("starting %d vLLM workers (CPU build, %s), logs in %s" % (
            self.n, self.model, self.dir))
        self.wait_ready(range(self.n))
        for d in self.cg_dirs:
            self.share.limit(d, self.cpus)
        log("ready: %s; %s" % (", ".join(self.url(i) for i in range(self.n)),
                               self.isolation_mode()))

    def wait_ready(self, which):
        t0 = time.monotonic()
        pending = set(which)
        while pending:
            for i in list(pending):
                if self.procs[i].poll() is not None:
                    raise RuntimeError("vLLM worker %d exited (%d) while starting; "
                                       "see %s/worker%d.log" % (
                                           i, self.procs[i].returncode, self.dir, i))
                if healthy(self.url(i)):
                    pending.discard(i)
            if time.monotonic() - t0 > self.start_timeout:
                raise RuntimeError("vLLM workers %s not healthy after %d s; see %s" % (
                    sorted(pending), self.start_timeout, self.dir))
            time.sleep(1)
        log("workers %s healthy after %.0f s" % (sorted(which), time.monotonic() - t0))

    def restart(self, i):
        """Stops worker i (SIGTERM) and starts it again on the same ports:
        a new engine, its prefix cache empty, its event sequence from 0."""
        self.kill(i)
        self.share.limit(self.cg_dirs[i], None)
        self.procs[i], self.logs[i] = self.spawn(i)
        self.wait_ready([i])
        self.share.limit(self.cg_dirs[i], self.cpus)

    def kill(self, i, sig=signal.SIGTERM):
        """Worker i's whole process group gone: the API server and its
        EngineCore child, which outlives the server for seconds while it
        tears down (a test or row after this one would share the cores with
        it).  SIGKILL after 30 s."""
        p = self.procs[i]
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 30
        while group_alive(p.pid):
            if time.time() > deadline:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    break
                deadline = time.time() + 30
            p.poll()  # reaps the leader; the rest are reaped by init
            time.sleep(0.1)
        p.wait()
        self.logs[i].close()

    def isolation_mode(self):
        if self.share.kind:
            return "each worker %.2f CPU (cgroup %s quota), OMP thread pinned to core i mod %d" % (
                self.cpus, self.share.kind, os.cpu_count() or 1)
        return "no CPU quota (%s): OMP thread pinned to core i mod %d only" % (
            self.share.why, os.cpu_count() or 1)

    def url(self, i):
        return "http://127.0.0.1:%d" % self.workers[i]["port"]

    def ctx(self):
        """The engine ready file's shape (kvplane-bench engine --ready-file)."""
        return {"engine": "vllm", "vllm": "vllm-cpu 0.32.0",
                "workers": [{"url": self.url(i),
                             "kv_events": "tcp://127.0.0.1:%d" % w["pub_port"],
                             "kv_replay": "tcp://127.0.0.1:%d" % w["replay_port"]}
                            for i, w in enumerate(self.workers)],
                "model": MODEL_NAME, "model_dir": self.model, "block_size": BLOCK,
                "vocab": VOCAB, "hash_algo": "sha256", "python_hash_seed": "0",
                "kv_topic": "", "time_scale": 1, "cpus_per_worker": self.cpus,
                "isolation": self.isolation_mode(), "kv_cache_bytes": self.kv_bytes,
                "kv_cache_blocks": self.kv_bytes // (BLOCK * KV_BYTES_PER_TOKEN)}

    def stop(self):
        for i in range(len(self.procs)):
            self.kill(i)
        self.share.remove()


def reset(ctx):
    """Every worker's prefix cache emptied (vLLM publishes AllBlocksCleared),
    once nothing runs; returns each worker's metrics after."""
    out = []
    for w in ctx["workers"]:
        for _ in range(600):
            m = metrics(w["url"])
            if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
                break
            time.sleep(0.1)
        post(w["url"] + "/reset_prefix_cache", {})
        out.append(metrics(w["url"]))
    return out


# ---- measurements ----------------------------------------------------------------
def ttft(url, ids, max_tokens=1):
    """Seconds to the first streamed token of a completion of `ids`, the
    usage of the request, and seconds from the first token to the last."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    first, last, usage = None, None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices"):
                last = time.monotonic() - t0
                if first is None:
                    first = last
            if ev.get("usage"):
                usage = ev["usage"]
    return first, usage, (last - first if first is not None else None)


def rand_ids(rng, n):
    return [rng.randrange(256, VOCAB) for _ in range(n)]


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def calibrate(ctx, lengths=(256, 512, 1024, 2048), reps=3, seed=7, out_tokens=32):
    """Each worker, under its quota, while nothing else runs on it: cold
    prefill TTFT at several lengths, the same prompts fully cached, and the
    time per output token of a 32-token decode.  Fits (on the medians)
    cold(n) = base + a n + c n^2 with a, c >= 0 and cached(n) = base + h n;
    returns the fit with kvplane-bench run's timing model for it (yaml)."""
    rng = random.Random(seed)
    cold, warm, tpot = {n: [] for n in lengths}, {}, []
    for w in ctx["workers"]:
        for n in lengths:
            for _ in range(reps):
                ids = rand_ids(rng, n)
                t1, _, _ = ttft(w["url"], ids)
                t2, u, _ = ttft(w["url"], ids)
                cached = u["prompt_tokens_details"]["cached_tokens"]
                cold[n].append(t1)
                warm.setdefault(cached, []).append(t2)
        ids = rand_ids(rng, 512)
        ttft(w["url"], ids)
        for _ in range(reps):
            _, _, d = ttft(w["url"], ids, out_tokens)
            tpot.append(d / (out_tokens - 1))
    wpts = [(n, median(v)) for n, v in sorted(warm.items())]
    base, h = linfit(wpts)
    base = max(0.0, base)
    cpts = [(n, median(v) - base) for n, v in sorted(cold.items())]
    a, c = quadfit(cpts)
    res = {"lengths": list(lengths), "cold_median_s": cpts, "cached_median_s": wpts,
           "cold_s": cold, "base_s": base, "cached_token_s": max(0.0, h),
           "a_s_per_token": a, "c_s_per_token2": c, "tpot_s": median(tpot)}
    res.update(timing_model(res, ctx))
    return res


def linfit(pts):
    n = len(pts)
    sx = sum(x for x, _ in pts)
    sy = sum(y for _, y in pts)
    sxx = sum(x * x for x, _ in pts)
    sxy = sum(x * y for x, y in pts)
    d = n * sxx - sx * sx
    b = (n * sxy - sx * sy) / d if d else 0.0
    return (sy - b * sx) / n, b


def quadfit(pts):
    """y = a x + c x^2 through the origin, least squares, a and c >= 0."""
    s11 = sum(x * x for x, _ in pts)
    s12 = sum(x ** 3 for x, _ in pts)
    s22 = sum(x ** 4 for x, _ in pts)
    t1 = sum(x * y for x, y in pts)
    t2 = sum(x * x * y for x, y in pts)
    d = s11 * s22 - s12 * s12
    a = (t1 * s22 - t2 * s12) / d if d else 0.0
    c = (s11 * t2 - s12 * t1) / d if d else 0.0
    if c < 0:  # no quadratic term measurable: linear
        a, c = max(0.0, t1 / s11), 0.0
    elif a < 0:  # no linear term: quadratic
        a, c = 0.0, max(0.0, t2 / s22)
    return a, c


def timing_model(cal, ctx):
    """kvplane-bench's prefill model is flops(n) / F with flops = 2 P n +
    att n^2 / 2 (att = 4 layers heads head_dim; router/route_policy.c), so
    with the tiny model's att, P = att a / (4 c) and F = 2 P / a reproduce
    the fitted a n + c n^2 (without a measurable c: P = the model's own
    parameters); base and cached tokens go to cluster:, the time per
    output token to decode_step_overhead_s (the weights' read made free);
    base also to gpu.prefill_overhead_s, the router's view of it."""
    att = 4.0 * 2 * 4 * 64
    a, c = cal["a_s_per_token"], cal["c_s_per_token2"]
    p = att * a / (4.0 * c) if c > 0 and a > 0 else 18.5e6
    p = min(max(p, 1e5), 1e10)
    flops = 2.0 * p / a if a > 0 else att / (2.0 * c)
    blocks = ctx["kv_cache_blocks"]
    model = ["model:", "  layers: 2", "  heads: 4", "  kv_heads: 4", "  head_dim: 64",
             "  dtype_bytes: 2", "  params_billion: %.9f" % (p / 1e9),
             "  block_size: %d" % BLOCK, "gpu:", "  tflops: %.9f" % (flops / 1e12),
             "  efficiency: 1", "  hbm_bandwidth_gbps: 1000000",
             # the fixed cost of each prefill: a queue of short prompts is
             # longer than their FLOPs say (kvplane_cost's queue term)
             "  prefill_overhead_s: %.6f" % cal["base_s"],
             # a CPU prefill takes seconds and vLLM reports its blocks after
             # it: the router sees prefills in progress (their chains
             # pending, their predicted time running down; the model is
             # calibrated, which inflight_decay needs; docs/routing.md)
             "routing:", "  pending: 1s", "  inflight_decay: true"]
    return {"params": p, "flops": flops, "routerd_yaml": model, "yaml": "\n".join([
        "# written by bench/live/vllm/fleet.py calibrate: the real vLLM workers",
        "# (vllm-cpu 0.32.0, the tiny model, %.2f CPU each) as kvplane-bench's"
        % ctx["cpus_per_worker"],
        "# timing model: cold prefill %.3g s/token + %.3g s/token^2, a fixed"
        % (a, c),
        "# %.3f s a prefill, %.3g s a cached token, %.4f s an output token" % (
            cal["base_s"], cal["cached_token_s"], cal["tpot_s"]),
        "cluster:",
        "  workers: %d" % len(ctx["workers"]),
        "  hbm_gb: %.9f" % (blocks * BLOCK * KV_BYTES_PER_TOKEN / 1e9),
        "  dram_gb: 0",
        "  nvme_gb: 0",
        "  tier_classes: false",
        "  prefill_overhead_s: %.6f" % cal["base_s"],
        "  cached_token_s: %.9f" % cal["cached_token_s"],
        "  decode_step_overhead_s: %.6f" % cal["tpot_s"]] + model + [""])}


def isolation(ctx, n=1024, reps=4, seed=11):
    """TTFT of cold n-token prompts on worker 0, its neighbours idle, then
    while every other worker is kept busy with back-to-back cold prompts of
    2n tokens.  Returns (idle, busy, ratio of medians)."""
    rng = random.Random(seed)
    ws = ctx["workers"]
    idle = sorted(ttft(ws[0]["url"], rand_ids(rng, n))[0] for _ in range(reps))
    stop = threading.Event()

    def load(url, s):
        r = random.Random(s)
        while not stop.is_set():
            try:
                ttft(url, rand_ids(r, 2 * n))
            except OSError:
                time.sleep(0.1)
    th = [threading.Thread(target=load, args=(w["url"], k), daemon=True)
          for k, w in enumerate(ws[1:], 1)]
    for t in th:
        t.start()
    time.sleep(2)
    busy = sorted(ttft(ws[0]["url"], rand_ids(rng, n))[0] for _ in range(reps))
    stop.set()
    for t in th:
        t.join(600)
    med = lambda v: v[len(v) // 2]  # noqa: E731
    return idle, busy, med(busy) / med(idle)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start N workers, write the ready file, run until SIGTERM")
    up.add_argument("--workers", type=int, default=3)
    up.add_argument("--ready-file", required=True)
    up.add_argument("--dir", default=os.path.join(ROOT, "build-run", "vllm-fleet"))
    up.add_argument("--model", default=os.path.join(ROOT, ".cache", "vllm-tiny"))
    up.add_argument("--cpus", type=float, default=0, help="CPU quota per worker "
                    "(default (CPUs - 0.5) / N)")
    up.add_argument("--kv-cache-mib", type=int, default=256)
    for name in ("calibrate", "isolation"):
        p = sub.add_parser(name)
        p.add_argument("--ready-file", required=True)
        p.add_argument("--out")
    a = ap.parse_args()
    if a.cmd == "up":
        f = Fleet(sys.executable, a.model, a.workers, a.dir, a.cpus or None,
                  a.kv_cache_mib << 20)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        try:
            f.start()
            with open(a.ready_file + ".tmp", "w") as fh:
                json.dump(f.ctx(), fh, indent=1)
            os.rename(a.ready_file + ".tmp", a.ready_file)
            while not stop.is_set():
                stop.wait(1)
        finally:
            f.stop()
        return 0
    with open(a.ready_file) as fh:
        ctx = json.load(fh)
    if a.cmd == "calibrate":
        res = calibrate(ctx)
        print(res["yaml"])
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
    idle, busy, r = isolation(ctx)
    print("worker 0 TTFT of cold 1024-token prompts: neighbours idle %s s, "
          "neighbours saturated %s s: %.2fx" % (
              " ".join("%.3f" % x for x in idle), " ".join("%.3f" % x for x in busy), r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
