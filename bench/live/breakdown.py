#!/usr/bin/env python3
"""Why a live kvplane-routerd row's TTFT is what it is: its decisions,
request by request, against what the workers then did.

    python3 bench/live/breakdown.py OUT/TRACE/routerd [OUT/TRACE/PEER ...]

OUT is `make live`'s (bench/live/make_live.py --out) directory; a row's
directory holds the client's req.live.jsonl (one line a request: trace index
i, send, ttft, e2e, tokens, cached) and, for kvplane-routerd rows,
receipts.jsonl (one line a request, joined by X-Request-Id = i).  Prints:

- the decisions by reason (cost, affinity, tie, guard, ...): requests, TTFT
  mean / p95, prompt and recomputed tokens;
- the requests sent away from the longest match ("moved"): how many tokens
  that gave up, the cost model's terms for the holder and the chosen worker,
  and their TTFT -- the locality the policy traded for balance;
- prediction against outcome: predicted cached tokens vs what vLLM reported,
  predicted TTFT (the chosen worker's total_s) vs the measured TTFT;
- per worker: requests and recomputed tokens (balance);
- against each PEER row (the same requests, by i): recomputed tokens, TTFT
  sum, and the requests where the two differ most.

Standard library only."""
import json
import os
import sys


def load_rows(d):
    path = os.path.join(d, "req.live.jsonl")
    rows = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows[r["i"]] = r
    return rows


def load_receipts(d):
    path = os.path.join(d, "receipts.jsonl")
    if not os.path.exists(path):
        return None
    out, unjoined = {}, 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            rid = r.get("client_request_id")
            if rid is None or not str(rid).isdigit():
                unjoined += 1
                continue
            out[int(rid)] = r
    if unjoined:
        print("  (%d receipts without a numeric X-Request-Id: not joined)" % unjoined)
    return out


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def decisions(rows, recs):
    """Per request: the joined facts the tables below read."""
    out = []
    for i, r in sorted(rows.items()):
        rc = recs.get(i)
        if rc is None:
            continue
        route = rc["receipt"].get("route", {})
        top = route.get("top", [])
        chosen = rc["receipt"].get("worker")
        by_w = {t["worker"]: t for t in top}
        best = max(top, key=lambda t: t["matched_tokens"]) if top else None
        c = by_w.get(chosen, {})
        out.append({
            "i": i, "ttft": r["ttft"], "tokens": r["tokens"], "cached": r["cached"],
            "uncached": r["tokens"] - r["cached"], "worker": chosen,
            "reason": route.get("reason", "?"),
            "pred_cached": rc["receipt"].get("reused_tokens", 0),
            "pred_ttft": c.get("total_s"), "chosen": c,
            "best": best, "moved": bool(best and best["worker"] != chosen and
                                        best["matched_tokens"] > c.get("matched_tokens", 0)),
        })
    return out


def report(d, peers):
    rows = load_rows(d)
    recs = load_receipts(d)
    print("%s: %d requests" % (d, len(rows)))
    if recs is None:
        print("  no receipts.jsonl: not a kvplane-routerd row (or an older run)")
        return 1
    ds = decisions(rows, recs)
    print("  %d joined to their receipts" % len(ds))

    print("\n  by reason          reqs  ttft mean   p95   prompt tok  recomputed")
    for reason in sorted({x["reason"] for x in ds}):
        g = [x for x in ds if x["reason"] == reason]
        print("  %-17s %5d  %8.2fs %6.2fs %11d %11d" % (
            reason, len(g), mean([x["ttft"] for x in g]), pct([x["ttft"] for x in g], .95),
            sum(x["tokens"] for x in g), sum(x["uncached"] for x in g)))

    mv = [x for x in ds if x["moved"]]
    gave_up = sum(x["best"]["matched_tokens"] - x["chosen"].get("matched_tokens", 0) for x in mv)
    print("\n  moved off the longest match: %d of %d requests, %d matched tokens given up "
          "(%.1f%% of all prompt tokens)" % (len(mv), len(ds), gave_up,
                                             100.0 * gave_up / max(1, sum(x["tokens"] for x in ds))))
    if mv:
        print("  TTFT of the moved: mean %.2f s, p95 %.2f s (all: mean %.2f s)" % (
            mean([x["ttft"] for x in mv]), pct([x["ttft"] for x in mv], .95),
            mean([x["ttft"] for x in ds])))
        print("    i  reason    holder: w matched queue_s rec_s total_s | chosen: w matched queue_s rec_s total_s | ttft")
        for x in sorted(mv, key=lambda x: -x["ttft"])[:12]:
            b, c = x["best"], x["chosen"]
            print("  %4d %-8s  %d %6d %7.2f %6.2f %7.2f | %d %6d %7.2f %6.2f %7.2f | %.2f%s" % (
                x["i"], x["reason"], b["worker"], b["matched_tokens"], b["queue_s"],
                b["recompute_s"], b["total_s"], x["worker"], c.get("matched_tokens", 0),
                c.get("queue_s", 0), c.get("recompute_s", 0), c.get("total_s", 0), x["ttft"],
                " guarded" if b.get("guarded") else ""))

    pc = sum(x["pred_cached"] for x in ds)
    rc = sum(x["cached"] for x in ds)
    over = [x for x in ds if x["pred_cached"] > x["cached"] + 32]
    print("\n  predicted cached %d tokens, vLLM reported %d (%+.1f%%); %d requests predicted "
          "more than they got" % (pc, rc, 100.0 * (pc - rc) / max(1, rc), len(over)))
    pt = [(x["pred_ttft"], x["ttft"]) for x in ds if x["pred_ttft"] is not None]
    if pt:
        err = [m - p for p, m in pt]
        print("  measured - predicted TTFT: mean %+.2f s, p50 %+.2f s, p95 %+.2f s "
              "(predicted from the cost model's queue + recompute + load terms)" % (
                  mean(err), pct(err, .5), pct(err, .95)))

    print("\n  per worker: requests / recomputed tokens")
    for w in sorted({x["worker"] for x in ds}):
        g = [x for x in ds if x["worker"] == w]
        print("    worker %s: %4d / %7d" % (w, len(g), sum(x["uncached"] for x in g)))

    for p in peers:
        pr = load_rows(p)
        common = [i for i in rows if i in pr]
        a = sum(rows[i]["tokens"] - rows[i]["cached"] for i in common)
        b = sum(pr[i]["tokens"] - pr[i]["cached"] for i in common)
        ta = sum(rows[i]["ttft"] for i in common)
        tb = sum(pr[i]["ttft"] for i in common)
        print("\n  vs %s (%d common requests): recomputed %d vs %d tokens, TTFT sum %.1f vs %.1f s"
              % (os.path.basename(p.rstrip("/")), len(common), a, b, ta, tb))
        worst = sorted(common, key=lambda i: pr[i]["ttft"] - rows[i]["ttft"])[:6]
        for i in worst:
            x = next((y for y in ds if y["i"] == i), None)
            print("    i=%d: ttft %.2f vs %.2f s, cached %d vs %d of %d%s" % (
                i, rows[i]["ttft"], pr[i]["ttft"], rows[i]["cached"], pr[i]["cached"],
                rows[i]["tokens"], (", reason %s%s" % (x["reason"], ", moved" if x["moved"] else ""))
                if x else ""))
    return 0


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(argv) >= 2 else 2
    for d in [argv[1]] + argv[2:]:
        if not os.path.exists(os.path.join(d, "req.live.jsonl")):
            print("breakdown.py: %s has no req.live.jsonl (a make_live.py row directory?)" % d,
                  file=sys.stderr)
            return 2
    return report(argv[1], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
