#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The ledger's exports through real parsers: Prometheus text through
# python3-prometheus-client's parser (exact sample values, label values with
# quotes/backslashes/newlines/UTF-8 round-tripped, histogram shape), and every
# JSON line through json.loads (strict), cross-checked against each other.
#   test_ledger_prom.sh <ledger_dump>
set -euo pipefail
dump=${1:?usage: test_ledger_prom.sh <ledger_dump>}
py=${KVP_PYTHON:-/usr/bin/python3}
if [ ! -x "$py" ]; then
  echo "SKIP: $py not found (set KVP_PYTHON)"; exit 77
fi
if ! "$py" -c 'from prometheus_client.parser import text_string_to_metric_families' 2>/dev/null; then
  echo "SKIP: python3-prometheus-client is not installed (apt-get install python3-prometheus-client)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$dump" prom >"$tmp/metrics.txt"
"$dump" json >"$tmp/lines.jsonl"

exec "$py" - "$tmp/metrics.txt" "$tmp/lines.jsonl" <<'PY'
import json, math, re, sys
from prometheus_client.parser import text_string_to_metric_families

text = open(sys.argv[1], encoding="utf-8", newline="").read()
lines = open(sys.argv[2], encoding="utf-8", newline="").read()
fails = []
def check(cond, what):
    if not cond:
        fails.append(what)

W = 'we"ird\\back\\slash,x="}{'
M = "multi\nline"
U = "ünïcødé-テナント"
TENANTS = {"acme", W, M, U}

# ---- shape of the text, line by line (the python parser is lax) ----------
check(text.endswith("\n") and "\n\n" not in text, "no blank lines, final newline")
fam, ftype, seen = None, None, set()
for ln in text.split("\n")[:-1]:
    if ln.startswith("# HELP "):
        fam = ln.split(" ")[2]
        check(re.fullmatch(r"kvplane_[a-z0-9_]+", fam) is not None, "name " + fam)
        check(fam not in seen, "family once: " + fam)
        seen.add(fam)
    elif ln.startswith("# TYPE "):
        _, _, name, ftype = ln.split(" ")
        check(name == fam, "TYPE follows HELP for " + fam)
        check(ftype in ("counter", "gauge", "histogram"), "type " + ftype)
        check((ftype == "counter") == fam.endswith("_total"), "_total iff counter: " + fam)
    else:
        name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", ln).group(0)
        ok = [fam] if ftype != "histogram" else [fam + s for s in ("_bucket", "_sum", "_count")]
        check(name in ok, "sample %s in family %s" % (name, fam))

# ---- parse ------------------------------------------------------------------
S = {}
types = {}
for f in text_string_to_metric_families(text):
    types[f.name] = f.type
    for s in f.samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        check(key not in S, "duplicate sample %r" % (key,))
        S[key] = s.value
def v(name, **labels):
    key = (name, tuple(sorted(labels.items())))
    if key not in S:
        fails.append("missing sample %r" % (key,))
        return float("nan")
    return S[key]
def eq(name, want, **labels):
    got = v(name, **labels)
    check(got == want, "%s%r = %r, want %r" % (name, labels, got, want))

check(types.get("kvplane_request_reuse_ratio") == "histogram", "histogram type")
check(types.get("kvplane_requests") == "counter", "counter type")

# ---- exact global values (worked out by hand from ledger_dump.c) -------------
g = "kvplane_"
eq(g + "requests_total", 6)
eq(g + "prompt_tokens_total", 4912)
eq(g + "recomputed_tokens_total", 784)
eq(g + "prefill_avoided_tokens_total", 4128)
for tier, n in (("hbm", 1536), ("dram", 544), ("nvme", 1024), ("remote", 1024)):
    eq(g + "reused_tokens_total", n, tier=tier)
for tier, n in (("hbm", 0), ("dram", 8912896), ("nvme", 16777216), ("remote", 16777216)):
    eq(g + "load_bytes_total", n, tier=tier)
for cls, p, r in (("stable", 3328, 3328), ("semi", 812, 800), ("volatile", 772, 0)):
    eq(g + "class_prompt_tokens_total", p, **{"class": cls})
    eq(g + "class_reused_tokens_total", r, **{"class": cls})
eq(g + "class_hit_ratio", 1.0, **{"class": "stable"})
eq(g + "class_hit_ratio", 800 / 812, **{"class": "semi"})
eq(g + "class_hit_ratio", 0.0, **{"class": "volatile"})
miss = {"never_seen": 232, "evicted": 128, "on_other_worker": 100, "partial_block": 48,
        "namespace": 16, "prompt_drift": 160, "not_worth_loading": 50, "unknown": 50}
for cause, n in miss.items():
    eq(g + "miss_tokens_total", n, cause=cause)
check(sum(miss.values()) == 784, "miss causes sum to recomputed")
eq(g + "prefill_avoided_flops_total", 8.244e12)
check(math.isclose(v(g + "prefill_avoided_gpu_seconds_total"), 0.02025, rel_tol=1e-12), "gpu seconds")
eq(g + "ledger_rejected_records_total", 1, reason="tokens")
eq(g + "ledger_rejected_records_total", 1, reason="name")
eq(g + "ledger_rejected_records_total", 0, reason="class")
eq(g + "ledger_tenants", 4)
eq(g + "ledger_sessions", 3)
eq(g + "ledger_session_evictions_total", 1)
eq(g + "ledger_tenant_evictions_total", 0)

# histograms: exact cumulative buckets, +Inf == _count
def hist(name, les, counts, total, count):
    prev = 0
    for le, c in zip(les + ["+Inf"], counts + [count]):
        got = v(name + "_bucket", le=le)
        check(got == c, "%s le=%s: %r want %r" % (name, le, got, c))
        check(got >= prev, name + " cumulative")
        prev = got
    check(math.isclose(v(name + "_sum"), total, rel_tol=1e-12), name + "_sum")
    eq(name + "_count", count)
hist(g + "request_prefill_avoided_tokens",
     ["0", "16", "64", "256", "1024", "4096", "16384", "65536", "262144", "1048576"],
     [2, 2, 2, 3, 5, 6, 6, 6, 6, 6], 4128, 6)
hist(g + "request_reuse_ratio",
     ["0", "0.1", "0.25", "0.5", "0.75", "0.9", "0.95", "0.99", "1"],
     [2, 2, 2, 2, 3, 5, 5, 5, 6], 0.8 + 1024 / 1200 + 1.0 + 0.512, 6)

# ---- tenant label values round-trip; exact per-tenant values -----------------
t = "kvplane_tenant_"
got_tenants = {dict(k[1])["tenant"] for k in S if k[0] == t + "requests_total"}
check(got_tenants == TENANTS, "tenant labels %r" % (got_tenants,))
eq(t + "requests_total", 2, tenant="acme")
eq(t + "prompt_tokens_total", 2200, tenant="acme")
eq(t + "reused_tokens_total", 1536, tenant="acme", tier="hbm")
eq(t + "reused_tokens_total", 288, tenant="acme", tier="dram")
eq(t + "miss_tokens_total", 160, tenant="acme", cause="prompt_drift")
eq(t + "class_reused_tokens_total", 800, tenant="acme", **{"class": "semi"})
eq(t + "prefill_avoided_flops_total", 3.648e12, tenant="acme")
eq(t + "recomputed_tokens_total", 64, tenant=W)
eq(t + "miss_tokens_total", 48, tenant=W, cause="never_seen")
eq(t + "load_bytes_total", 16777216, tenant=M, tier="remote")
eq(t + "reused_tokens_total", 1024, tenant=M, tier="nvme")
eq(t + "miss_tokens_total", 100, tenant=U, cause="on_other_worker")
eq(t + "load_bytes_total", 4194304, tenant=U, tier="dram")

# ---- JSON lines: strict parse, names round-trip, sums agree with the text ----
def strict(s):
    return json.loads(s, parse_constant=lambda c: fails.append("non-JSON constant " + c))
check(lines.endswith("\n"), "JSON ends with newline")
docs = [strict(s) for s in lines.split("\n")[:-1]]
receipts = [d for d in docs if d["kind"] == "receipt"]
totals = [d for d in docs if d["kind"] == "totals"]
check(len(receipts) == 6 and len(totals) == 1 + 4 + 3, "line counts")
want_names = [("acme", "s1", "r1"), ("acme", "s1", "r2"), (W, 's"2', "r\\3"),
              (M, "s\n4", "r4"), (U, "émoji-😀\t", "r5"), (None, None, "r6")]
check([(d["tenant"], d["session"], d["request_id"]) for d in receipts] == want_names,
      "receipt names round-trip")
check([d["worker"] for d in receipts] == [0, 0, 1, 2, 3, None], "workers")

TIERS = ["hbm", "dram", "nvme", "remote"]
CLASSES = ["volatile", "semi", "stable"]
def add(acc, d):
    for k in ("prompt_tokens", "reused_tokens", "recomputed_tokens"):
        acc[k] = acc.get(k, 0) + d[k]
    for k in ("reused_by_tier", "prompt_by_class", "reused_by_class", "miss_tokens", "load_bytes"):
        m = acc.setdefault(k, {})
        for kk, n in d[k].items():
            m[kk] = m.get(kk, 0) + n
    pa = acc.setdefault("prefill_avoided", {"tokens": 0, "flops": 0.0, "gpu_seconds": 0.0})
    for kk in pa:
        pa[kk] += d["prefill_avoided"][kk]
    acc["requests"] = acc.get("requests", 0) + 1

for d in receipts:  # each receipt obeys the invariants
    check(d["reused_tokens"] + d["recomputed_tokens"] == d["prompt_tokens"], "receipt sum")
    check(sum(d["reused_by_tier"].values()) == d["reused_tokens"], "receipt tiers")
    check(sum(d["miss_tokens"].values()) == d["recomputed_tokens"], "receipt misses")
by_scope = {}
for d in receipts:
    add(by_scope.setdefault(("global", None, None), {}), d)
    if d["tenant"] is not None:
        add(by_scope.setdefault(("tenant", d["tenant"], None), {}), d)
    if d["session"] is not None:
        add(by_scope.setdefault(("session", d["tenant"], d["session"]), {}), d)

def same(a, b, what):
    for k in ("requests", "prompt_tokens", "reused_tokens", "recomputed_tokens",
              "reused_by_tier", "prompt_by_class", "reused_by_class", "miss_tokens", "load_bytes"):
        check(a[k] == b[k], "%s: %s %r != %r" % (what, k, a[k], b[k]))
    for kk in ("tokens", "flops", "gpu_seconds"):
        check(math.isclose(a["prefill_avoided"][kk], b["prefill_avoided"][kk], rel_tol=1e-12),
              what + " prefill_avoided " + kk)

for d in totals:
    key = (d["scope"], d["tenant"], d["session"])
    check(key in by_scope, "unexpected totals line %r" % (key,))
    if key in by_scope:
        same(d, by_scope[key], "totals %r" % (key,))
    for c in CLASSES:
        p, r = d["prompt_by_class"][c], d["reused_by_class"][c]
        want = None if p == 0 else r / p
        check(d["hit_rate_by_class"][c] == want, "hit rate %s %r" % (c, key))
check(("session", "acme", "s1") not in [(d["scope"], d["tenant"], d["session"]) for d in totals],
      "evicted session not dumped")

# the Prometheus text says the same as the receipts, tenant by tenant
def prom_view(prefix, **lab):
    o = {"requests": v(prefix + "requests_total", **lab),
         "prompt_tokens": v(prefix + "prompt_tokens_total", **lab),
         "reused_tokens": v(prefix + "prefill_avoided_tokens_total", **lab),
         "recomputed_tokens": v(prefix + "recomputed_tokens_total", **lab),
         "reused_by_tier": {x: v(prefix + "reused_tokens_total", tier=x, **lab) for x in TIERS},
         "load_bytes": {x: v(prefix + "load_bytes_total", tier=x, **lab) for x in TIERS},
         "prompt_by_class": {x: v(prefix + "class_prompt_tokens_total", **{"class": x}, **lab) for x in CLASSES},
         "reused_by_class": {x: v(prefix + "class_reused_tokens_total", **{"class": x}, **lab) for x in CLASSES},
         "miss_tokens": {x: v(prefix + "miss_tokens_total", cause=x, **lab) for x in miss},
         "prefill_avoided": {"tokens": v(prefix + "prefill_avoided_tokens_total", **lab),
                             "flops": v(prefix + "prefill_avoided_flops_total", **lab),
                             "gpu_seconds": v(prefix + "prefill_avoided_gpu_seconds_total", **lab)}}
    return o
same(prom_view("kvplane_"), by_scope[("global", None, None)], "prometheus global")
for ten in TENANTS:
    want = by_scope.get(("tenant", ten, None))
    check(want is not None, "receipts name tenant %r" % ten)
    if want is not None:
        same(prom_view("kvplane_tenant_", tenant=ten), want, "prometheus tenant %r" % ten)

if fails:
    for f in fails:
        print("FAIL:", f)
    sys.exit(1)
print("ok - %d samples, %d JSON lines parsed and checked" % (len(S), len(docs)))
PY
