#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane-routerd replicas behind a load balancer, as one process for
`make live` (bench/live/make_live.py): nats-server (with --sync), N
kvplane-routerd replicas in front of the engine's workers, and nginx round
robin over them on --port.  On SIGTERM it reads each replica's sync figures
(/metrics: lag p50/p99, messages) and CPU (/proc), writes them to
DIR/fleet.json, then stops everything.

  routerd_fleet.py --routerd BIN --engine-file F --port P --dir D
                   [--replicas 3] [--sync | --no-sync]"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request


from loopports import free_port  # noqa: E402 (below the ephemeral range)


def wait_http(url, timeout=20):
    t = time.time() + timeout
    while time.time() < t:
        try:
            urllib.request.urlopen(url, timeout=1)
            return True
        except Exception:
            time.sleep(0.05)
    return False


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--routerd", required=True)
    ap.add_argument("--engine-file", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sync", dest="sync", action="store_true", default=True)
    ap.add_argument("--no-sync", dest="sync", action="store_false")
    ap.add_argument("--scrape-interval", type=float, default=0.25)
    ap.add_argument("--snapshot-interval", type=float, default=0.1)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    eng = json.load(open(a.engine_file))
    ws = eng["workers"]
    kids = []

    def spawn(argv, log):
        p = subprocess.Popen(argv, stdout=open(os.path.join(a.dir, log), "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        kids.append(p)
        return p

    nats_port = free_port() if a.sync else 0
    if a.sync:
        spawn([shutil.which("nats-server") or "/usr/sbin/nats-server", "-a", "127.0.0.1",
               "-p", str(nats_port)], "nats.log")
    reps = []
    for i in range(a.replicas):
        port = free_port()
        cfg = os.path.join(a.dir, "replica%d.yaml" % (i + 1))
        with open(cfg, "w") as f:
            f.write("routerd:\n  listen: 127.0.0.1:%d\n  policy: kvplane_cost\n"
                    "  scrape_interval: %.4fs\n"
                    "workers:\n  urls: [%s]\n  kv_events: [%s]\n  kv_replay: [%s]\n"
                    "namespace:\n  model_id: %s\nmodel:\n  block_size: %d\n" % (
                        port, a.scrape_interval, ", ".join(w["url"] for w in ws),
                        ", ".join(w["kv_events"] for w in ws),
                        ", ".join(w["kv_replay"] for w in ws), eng["model"],
                        eng["block_size"]))
            if a.sync:
                f.write("replicas:\n  nats_url: nats://127.0.0.1:%d\n  replica_id: %d\n"
                        "  snapshot_interval: %.4fs\n" % (nats_port, i + 1,
                                                          a.snapshot_interval))
        reps.append((spawn([a.routerd, "--config", cfg], "replica%d.log" % (i + 1)), port))
    for _, port in reps:
        if not wait_http("http://127.0.0.1:%d/health" % port):
            sys.exit("a replica did not start; see %s" % a.dir)
    ngx = os.path.join(a.dir, "nginx")
    os.makedirs(ngx, exist_ok=True)
    with open(os.path.join(ngx, "nginx.conf"), "w") as f:
        f.write("""daemon off; worker_processes 1; pid %s/nginx.pid;
error_log %s/error.log warn;
events { worker_connections 4096; }
http { access_log off;
  client_body_temp_path %s; proxy_temp_path %s;
  upstream replicas { %s keepalive 64; }
  server { listen 127.0.0.1:%d;
    client_max_body_size 0;
    location / { proxy_pass http://replicas; proxy_http_version 1.1;
      proxy_set_header Connection ""; proxy_buffering off;
      proxy_request_buffering off; proxy_read_timeout 600s; } } }
""" % (ngx, ngx, ngx, ngx, " ".join("server 127.0.0.1:%d;" % p for _, p in reps), a.port))
    spawn([shutil.which("nginx") or "/usr/sbin/nginx", "-p", ngx, "-c",
           os.path.join(ngx, "nginx.conf")], "nginx.log")
    t0 = {p.pid: cpu_s(p.pid) for p, _ in reps}
    w0 = time.time()
    done = []
    signal.signal(signal.SIGTERM, lambda *_: done.append(1))
    signal.signal(signal.SIGINT, lambda *_: done.append(1))
    while not done:
        time.sleep(0.2)
    wall = time.time() - w0
    out = {"replicas": [], "sync": a.sync}
    for p, port in reps:
        try:
            m = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2).read().decode()
        except Exception:
            m = ""
        msgs = sum(metric(m, 'kvplane_routerd_sync_received_total{type="%s"}' % t)
                   for t in ("decision", "complete", "snapshot"))
        out["replicas"].append({
            "requests": metric(m, "kvplane_routerd_requests_total"),
            "cpu_s": cpu_s(p.pid) - t0[p.pid], "wall_s": wall,
            "sync_received": msgs, "sync_msgs_per_s": msgs / wall if wall else 0,
            "lag_p50_s": metric(m, 'kvplane_routerd_sync_lag_seconds{quantile="0.5"}'),
            "lag_p99_s": metric(m, 'kvplane_routerd_sync_lag_seconds{quantile="0.99"}')})
    with open(os.path.join(a.dir, "fleet.json"), "w") as f:
        json.dump(out, f, indent=1)
    for p in kids:
        p.terminate()
    for p in kids:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    main()
