# SPDX-License-Identifier: Apache-2.0
"""What the kvplane-routerd end-to-end tests share (stdlib only): the
ok/FAIL checks and their failures, a free loopback port, waiting for an
HTTP endpoint, one Prometheus sample."""
import socket
import time
import urllib.request

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


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


def metric(text, name):
    """The value of the unlabelled sample `name` in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
