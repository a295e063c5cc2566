# SPDX-License-Identifier: Apache-2.0
"""What the kvplane-routerd end-to-end tests share (stdlib only): the
ok/FAIL checks and their failures, a free loopback port, waiting for an
HTTP endpoint, one Prometheus sample, emulated workers started."""
import json
import os
import subprocess
import time
import urllib.request
from testports import free_port  # noqa: F401 (re-exported; see there)

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def wait_http(url, timeout=10):
    """True once url answers (any status), False after timeout seconds."""
    t = time.time() + timeout
    while time.time() < t:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except Exception:  # noqa: BLE001 -- not up yet
            time.sleep(0.05)
    return False


def workers_yaml(workers, block_size):
    """The config's workers: section (each worker's URL and KV-event
    endpoints, as start_engine returns them) and model.block_size."""
    return ("workers:\n  urls: [%s]\n  kv_events: [%s]\n  kv_replay: [%s]\n"
            "model:\n  block_size: %d\n" % (
                ", ".join(w["url"] for w in workers),
                ", ".join(w["kv_events"] for w in workers),
                ", ".join(w["kv_replay"] for w in workers), block_size))


def metric(text, name):
    """The value of the unlabelled sample `name` in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def metric_sum(text, name):
    """The sum of every sample of `name`, whatever its labels (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(None, 1)[1])
    return total


def start_engine(bench, work, name, n, block_size, procs, loras=(),
                 time_scale=20, extra=()):
    """`kvplane-bench engine` with n emulated vLLM workers (and LoRA adapters
    `loras`, more arguments `extra`: --prefill N --decode M sets n itself),
    its log in work/name.log; the process goes into procs.
    Returns (process, its ready file's "workers" list)."""
    ready = os.path.join(work, name + ".json")
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(os.path.join(work, name + ".log"), "w")
    p = subprocess.Popen([bench, "engine", "--workers", str(n), "--block-size",
                          str(block_size), "--time-scale", str(time_scale),
                          "--ready-file", ready]
                         + [a for lo in loras for a in ("--lora", lo)]
                         + list(extra),
                         stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    for _ in range(200):
        if os.path.exists(ready) and os.path.getsize(ready) > 0:
            return p, json.load(open(ready))["workers"]
        time.sleep(0.05)
    raise SystemExit("engine %s did not start" % name)
