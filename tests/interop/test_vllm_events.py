#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A vLLM KV-event subscriber against vLLM 0.33.0's REAL publisher: every
scenario of vllm_publisher.py over ipc:// and tcp://127.0.0.1 (free ports),
with int and bytes hashes, for several seeds.

usage: test_vllm_events.py [--subscriber oracle|CMD] [--scenarios LIST]
           [--transports LIST] [--hashes LIST] [--seeds LIST] [-j N]
           [--keep DIR]
       test_vllm_events.py --mutants [-j N] [--keep DIR]

--subscriber: `oracle` (default) = tests/interop/oracle_tail.py, the Python
reference; anything else is a command line to which vllm_publisher.py appends
`--index --json --replay R [--max-batches N] --idle-ms MS ENDPOINT`, e.g.
"build/connectors/cli/kvplane events tail".

Each run passes when the subscriber exits 0 in time and its stdout is:
  * event lines {"seq","type","medium","block_hashes","parent_block_hash",
    "token_count"} (more keys allowed; objects with neither seq nor type are
    ignored), equal to what the publisher sent at
    that seq; consecutive lines of one seq are one batch; the batches form
    runs of strictly increasing seq, a new run only where seq goes back (a
    restart); the runs' seqs are exactly the scenario's expect_runs;
  * then {"resident": {...}}, equal to the expected residency (lists in
    order; a medium missing = empty);
  * then, last, {"stats": {...}}.
--mutants checks the checker: each known-wrong subscriber of
oracle_mutants.py must FAIL every run of the scenarios it breaks (ipc and
tcp, int hashes, seed 1).
Exit 0 all pass, 1 any failure (77 comes from run.sh when setup skips).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("normal", "late", "loss", "small_buffer", "restart", "restart_fast")
EVENT_KEYS = ("type", "medium", "block_hashes", "parent_block_hash", "token_count")


def is_hash(h) -> bool:
    return (isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64) or \
        (isinstance(h, str) and len(h) % 2 == 0 and len(h) > 0 and
         all(c in "0123456789abcdef" for c in h))


def event_errors(e: dict) -> list[str]:
    errs = [f"missing {k!r}" for k in ("seq",) + EVENT_KEYS if k not in e]
    if errs:
        return errs
    if not isinstance(e["seq"], int) or e["seq"] < 0:
        errs.append("seq not a non-negative int")
    if e["type"] not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        errs.append(f"type {e['type']!r}")
    if e["medium"] is not None and not isinstance(e["medium"], str):
        errs.append("medium not a string or null")
    if not isinstance(e["block_hashes"], list) or not all(map(is_hash, e["block_hashes"])):
        errs.append("block_hashes not a list of u64 ints / lowercase hex")
    if e["parent_block_hash"] is not None and not is_hash(e["parent_block_hash"]):
        errs.append("parent_block_hash not a hash or null")
    if not isinstance(e["token_count"], int) or e["token_count"] < 0:
        errs.append("token_count not a non-negative int")
    return errs


def check(log: dict, lines: list[str]) -> list[str]:
    """What is wrong with one run (empty: it passed)."""
    errs = []
    if log["timed_out"]:
        errs.append(f"subscriber killed after the time limit")
    elif log["subscriber_rc"] != 0:
        errs.append(f"subscriber exited {log['subscriber_rc']}")
    errs += [f"harness: {n}" for n in log["notes"]]
    objs = []
    for i, line in enumerate(lines):
        try:
            o = json.loads(line)
        except ValueError:
            errs.append(f"stdout line {i + 1} is not JSON: {line[:200]!r}")
            return errs
        if not isinstance(o, dict):
            errs.append(f"stdout line {i + 1} is not a JSON object")
            return errs
        objs.append(o)
    if len(objs) < 2 or "stats" not in objs[-1] or "resident" not in objs[-2]:
        errs.append("stdout does not end with the residency line, then the stats line")
        return errs
    if not isinstance(objs[-1]["stats"], dict):
        errs.append("stats is not an object")
    # residency
    want, got = log["expected"]["resident"], objs[-2]["resident"]
    if not isinstance(got, dict):
        return errs + ["resident is not an object"]
    for m in sorted(set(want) | set(got)):
        w, g = want.get(m, []), got.get(m, [])
        if w != g:
            missing = [h for h in w if h not in g]
            extra = [h for h in g if h not in w]
            errs.append(f"resident[{m}]: {len(g)} hashes, expected {len(w)}; "
                        f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
                        f"extra {extra[:4]}{'...' if len(extra) > 4 else ''}"
                        f"{'; same sets, wrong order' if not missing and not extra else ''}")
    # events, batches, runs (objects with neither seq nor type: diagnostics)
    events = [o for o in objs[:-2] if "seq" in o or "type" in o]
    for i, e in enumerate(events):
        bad = event_errors(e)
        if bad:
            return errs + [f"event line {i + 1}: {', '.join(bad)}: {json.dumps(e)[:200]}"]
    batches = []  # [seq, [events]]
    for e in events:
        if batches and batches[-1][0] == e["seq"]:
            batches[-1][1].append(e)
        else:
            batches.append([e["seq"], [e]])
    runs = []
    for seq, evs in batches:
        if not runs or seq < runs[-1][-1][0]:
            runs.append([])
        runs[-1].append((seq, evs))
    want_runs = log["expect_runs"]
    got_seqs = [[s for s, _ in r] for r in runs]
    if got_seqs != [r["seqs"] for r in want_runs]:
        errs.append(f"printed batches {got_seqs}, expected {[r['seqs'] for r in want_runs]}")
        return errs
    for r, want in zip(runs, want_runs):
        sent = log["publishers"][want["publisher"]]
        for seq, evs in r:
            got_evs = [{k: e[k] for k in EVENT_KEYS} for e in evs]
            if got_evs != sent[seq]["events"]:
                errs.append(f"publisher {want['publisher']} seq {seq}: printed "
                            f"{json.dumps(got_evs)[:300]}, sent "
                            f"{json.dumps(sent[seq]['events'])[:300]}")
                return errs
    return errs


def one(a, sub_cmd, scenario, transport, form, seed, work) -> tuple[bool, str]:
    name = f"{scenario}/{transport}/{form}/seed={seed}"
    d = os.path.join(work, name.replace("/", "_").replace("=", ""))
    os.makedirs(d, exist_ok=True)
    p = lambda f: os.path.join(d, f)  # noqa: E731
    cmd = [sys.executable, os.path.join(HERE, "vllm_publisher.py"),
           "--scenario", scenario, "--transport", transport, "--hashes", form,
           "--seed", str(seed), "--expected", p("expected.json"), "--log", p("log.json"),
           "--subscriber", sub_cmd, "--sub-out", p("stdout.txt"),
           "--sub-err", p("stderr.txt"), "--idle-ms", str(a.idle_ms),
           "--timeout", str(a.timeout)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 120)
    secs = time.monotonic() - t0
    if r.returncode != 0:
        return False, f"FAIL {name}: vllm_publisher.py exited {r.returncode}\n{r.stderr[-3000:]}"
    with open(p("log.json")) as f:
        log = json.load(f)
    with open(p("stdout.txt")) as f:
        lines = [l for l in f.read().splitlines() if l.strip()]
    errs = check(log, lines)
    try:
        stats = json.loads(lines[-1])["stats"]
        st = " ".join(f"{k}={v}" for k, v in stats.items() if v and k != "events")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        st = ""
    if not errs:
        return True, f"ok   {name} ({secs:.1f} s) {st}"
    with open(p("stderr.txt")) as f:
        err_tail = f.read()[-1500:]
    msg = [f"FAIL {name} ({secs:.1f} s) {st}", *[f"     {e}" for e in errs],
           f"     run dir: {d}", f"     subscriber: {shlex.join(log['subscriber'] or [])}"]
    if err_tail:
        msg.append("     subscriber stderr (tail):\n" + err_tail)
    return False, "\n".join(msg)


def mutants(a) -> int:
    sys.path.insert(0, HERE)
    from oracle_mutants import MUTANTS
    work = a.keep or tempfile.mkdtemp(prefix="kvp-interop-mutants-")
    jobs = [(m, s, t) for m, (_, scen) in MUTANTS.items() for s in scen for t in ("ipc", "tcp")]
    print(f"test_vllm_events --mutants: {len(jobs)} runs of known-wrong subscribers, "
          "each must fail", flush=True)
    bad = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        futs = [(m, s, t, ex.submit(one, a, shlex.join(
                    [sys.executable, os.path.join(HERE, "oracle_mutants.py"), m]),
                    s, t, "int", 1, os.path.join(work, m))) for m, s, t in jobs]
        for m, s, t, f in futs:
            ok, msg = f.result()
            bad += ok
            why = msg.splitlines()[1].strip() if not ok and len(msg.splitlines()) > 1 else ""
            print(f"{'ok  ' if not ok else 'FAIL'} mutant {m} on {s}/{t}: "
                  f"{'rejected: ' + why if not ok else 'PASSED (the test misses this bug)'}",
                  flush=True)
    print(f"test_vllm_events --mutants: {len(jobs) - bad} rejected, {bad} not")
    if not a.keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--subscriber", default="oracle")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--transports", default="ipc,tcp")
    ap.add_argument("--hashes", default="int,bytes")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--idle-ms", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--keep", help="keep every run's files here (default: only failures)")
    ap.add_argument("--mutants", action="store_true",
                    help="known-wrong subscribers must fail (oracle_mutants.py)")
    a = ap.parse_args()
    if a.mutants:
        return mutants(a)
    sub_cmd = a.subscriber
    if sub_cmd == "oracle":
        sub_cmd = shlex.join([sys.executable, os.path.join(HERE, "oracle_tail.py")])
    combos = [(s, t, h, int(n)) for s in a.scenarios.split(",") for t in a.transports.split(",")
              for h in a.hashes.split(",") for n in a.seeds.split(",")]
    for s, t, h, _ in combos:
        if s not in SCENARIOS or t not in ("ipc", "tcp") or h not in ("int", "bytes"):
            ap.error(f"unknown scenario/transport/hashes {s}/{t}/{h}")
    work = a.keep or tempfile.mkdtemp(prefix="kvp-interop-events-")
    print(f"test_vllm_events: {len(combos)} runs against vLLM 0.33.0's ZmqEventPublisher; "
          f"subscriber: {sub_cmd}", flush=True)
    t0 = time.monotonic()
    fails = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        futs = [ex.submit(one, a, sub_cmd, *c, work) for c in combos]
        for f in futs:
            ok, msg = f.result()
            fails += not ok
            print(msg, flush=True)
    print(f"test_vllm_events: {len(combos) - fails} passed, {fails} failed "
          f"({time.monotonic() - t0:.0f} s)" + (f"; runs in {work}" if fails or a.keep else ""))
    if not fails and not a.keep:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
