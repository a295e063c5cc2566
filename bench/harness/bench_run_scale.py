#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench_run_scale: `kvplane-bench run` end to end as an agentic trace grows.

Issue 15 part 4 asks that `kvplane-bench run` keep its requests/s within
1.5x from 1x to 20x the bundled agentic sessions.  bench_harness_scale
measures the simulations alone, in process; this measures the command a
user runs, as a separate process, on trace files on disk: reading and
parsing the JSON, `--workers auto`, the nine policies' simulations, the
terminal table and the CSV/JSON/HTML reports.

Factor k is the bundled sessions concatenated k times: each session file
copied k times, copy c's session id "ID#c" (the agentic files' hash ids
are local to a file, so every copy is its own session, its shared
system+tools prefix still shared), written .json.zst as the bundled files
are.  The 1x trace is written the same way (copy 0 only), so both scales
are read alike.  The runs alternate: the 1x run before and after each run
of a larger factor, and "paired" is the median over those runs of the
larger run's seconds per request against the mean of its two neighbours'
(this machine's speed drifts over minutes).  Rates are per CPU second of
the child (user + system) by default, per wall second with --wall.  The
table also gives the read's share of the time (the "read ... in S s" that
kvplane-bench prints; it is the same per request at every scale) and the
kernel's (system CPU: page faults, mostly).

  bench_run_scale.py [--factors 1,20] [--runs N] [--jobs N] [--wall]
                     [--bin build/bench/kvplane-bench] [--config FILE]
                     [--policies LIST] [--check X] [--keep DIR] [TRACE_DIR]

TRACE_DIR defaults to $KVP_SHARED_DIR/traces/cc_agentic (or
../shared/traces/cc_agentic).  --runs N: runs of each larger factor
(default 2).  --jobs: kvplane-bench's --jobs (default 1: one simulation at a
time, so CPU seconds are the work's).  --check X: exit 1 when the paired
slowdown of any factor is above X.  Needs the zstd command.
"""
import argparse
import glob
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def die(msg):
    print("bench_run_scale: " + msg, file=sys.stderr)
    sys.exit(2)


def scaled_dir(src, k, out):
    """Writes factor k of the agentic session files in src into out."""
    files = sorted(glob.glob(os.path.join(src, "*.json.zst")) +
                   glob.glob(os.path.join(src, "*.json")))
    if not files:
        die("%s: no *.json[.zst] session files" % src)
    os.makedirs(out, exist_ok=True)
    for f in files:
        try:
            if f.endswith(".zst"):
                raw = subprocess.run(["zstd", "-q", "-dc", f], check=True,
                                     stdout=subprocess.PIPE).stdout
            else:
                with open(f, "rb") as fh:
                    raw = fh.read()
            d = json.loads(raw)
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            die("%s: cannot read it as a JSON session file: %s" % (f, e))
        if not isinstance(d, dict) or "id" not in d or "requests" not in d:
            die("%s: not an agentic session file (no id / requests)" % f)
        if d.get("hash_id_scope", "local") != "local":
            die("%s: hash ids are not local to the file: copies would share"
                " them" % f)
        base = os.path.basename(f).split(".json")[0]
        for c in range(k):
            e = dict(d)
            if c > 0:
                e["id"] = "%s#%d" % (d["id"], c)
            dst = os.path.join(out, "%s_%03d.json.zst" % (base, c))
            subprocess.run(["zstd", "-q", "-3", "-f", "-o", dst],
                           input=json.dumps(e).encode(), check=True)
    return len(files) * k


READ_RE = re.compile(r"read .*: (\d+) requests .* in ([0-9.]+) s")


def one_run(a, trace, out):
    """One `kvplane-bench run`: (requests, cpu s, wall s, read s, sys s)."""
    cmd = [a.bin, "run", "--workers", "auto", "--jobs", str(a.jobs),
           "--out", out]
    if a.config:
        cmd += ["--config", a.config]
    if a.policies:
        cmd += ["--policies", a.policies]
    cmd.append(trace)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.monotonic() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        die("%s failed (%d):\n%s" % (" ".join(cmd), p.returncode, err[-2000:]))
    m = READ_RE.search(err)
    if m is None:
        die("no 'read ... N requests ... in S s' line from kvplane-bench:\n" +
            err[-2000:])
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return (int(m.group(1)), cpu, wall, float(m.group(2)),
            r1.ru_stime - r0.ru_stime)


def main():
    ap = argparse.ArgumentParser(
        description="kvplane-bench run's requests/s, 1x .. kx the agentic "
                    "sessions, end to end")
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--factors", default="1,20")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--wall", action="store_true")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bench",
                                                  "kvplane-bench"))
    ap.add_argument("--config",
                    default=os.path.join(ROOT, "bench", "configs",
                                         "default.yaml"))
    ap.add_argument("--policies")
    ap.add_argument("--check", type=float)
    ap.add_argument("--keep", help="write the scaled traces here and keep "
                                   "them (reused when present)")
    a = ap.parse_args()
    try:
        factors = [int(x) for x in a.factors.split(",")]
    except ValueError:
        die("--factors: a comma-separated list of integers")
    if not factors or factors[0] != 1 or any(f < 1 for f in factors):
        die("--factors: starts with 1 (the baseline), each >= 1")
    if a.runs < 1 or a.jobs < 1:
        die("--runs and --jobs are >= 1")
    if a.trace is None:
        sh = os.environ.get("KVP_SHARED_DIR",
                            os.path.join(ROOT, "..", "shared"))
        a.trace = os.path.join(sh, "traces", "cc_agentic")
    if not os.path.isdir(a.trace):
        die("%s: not a directory of agentic session files" % a.trace)
    if not os.access(a.bin, os.X_OK):
        die("%s: not built (cmake --build build --target kvplane-bench)"
            % a.bin)
    if shutil.which("zstd") is None:
        die("needs the zstd command (apt-get install zstd)")

    work = a.keep or tempfile.mkdtemp(prefix="kvp-run-scale-")
    try:
        dirs = {}
        for k in factors:
            d = os.path.join(work, "x%d" % k)
            if not (a.keep and os.path.isdir(d) and os.listdir(d)):
                print("writing %dx the sessions of %s ..." % (k, a.trace),
                      file=sys.stderr, flush=True)
                scaled_dir(a.trace, k, d)
            dirs[k] = d
        out = os.path.join(work, "report")
        # 1x, then each larger factor's runs each followed by a 1x run
        order = [1]
        for k in factors[1:]:
            order += [k, 1] * a.runs
        res = {k: [] for k in factors}
        seq = []
        for n, k in enumerate(order):
            print("run %d/%d: %dx ..." % (n + 1, len(order), k),
                  file=sys.stderr, flush=True)
            r = one_run(a, dirs[k], out)
            res[k].append(r)
            seq.append((k, r))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    def spr(r):  # seconds per request
        return (r[2] if a.wall else r[1]) / r[0]

    unit = "wall" if a.wall else "CPU"
    print("kvplane-bench run, end to end (read, --workers auto, %s, reports),"
          " --jobs %d, %s seconds" % (a.policies or "all policies", a.jobs,
                                      unit))
    print("%7s %9s %6s %11s %7s %7s %9s %9s" %
          ("factor", "requests", "runs", "requests/s", "read", "kernel",
           "slowdown", "paired"))
    base = statistics.median(spr(r) for r in res[1])
    worst = 1.0
    for k in factors:
        rs = res[k]
        med = statistics.median(spr(r) for r in rs)
        read = statistics.median(r[3] / (r[2] if a.wall else r[1]) for r in rs)
        kern = statistics.median(r[4] / r[1] for r in rs)
        pairs = []
        for i, (kk, r) in enumerate(seq):
            if kk != k or k == 1:
                continue
            nb = [spr(seq[j][1]) for j in (i - 1, i + 1)
                  if 0 <= j < len(seq) and seq[j][0] == 1]
            pairs.append(spr(r) / statistics.mean(nb))
        paired = statistics.median(pairs) if pairs else 1.0
        worst = max(worst, paired)
        print("%6dx %9d %6d %11.0f %6.0f%% %6.0f%% %8.2fx %8.2fx%s" %
              (k, rs[0][0], len(rs), 1 / med, 100 * read, 100 * kern,
               med / base, paired,
               "  (paired runs: %s)" % " ".join("%.2f" % p for p in pairs)
               if pairs else ""))
    print("largest slowdown against 1x: %.2fx paired" % worst)
    if a.check is not None and worst > a.check:
        print("bench_run_scale: %.2fx is above --check %.2f" %
              (worst, a.check), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
