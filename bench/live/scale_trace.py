#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Scale a trace to what a small real engine serves: kvplane-format JSONL in
(`kvplane-bench convert [--limit N] TRACE OUT.jsonl`), kvplane-format JSONL
out, read alike by `kvplane-bench run` and `kvplane-bench live` -- so the
offline prediction and the live replay get the same work.

The mapping (docs/live.md, "Traces scaled to a real engine"):
  - every S trace tokens become one engine token (--shrink S): a prompt of
    `in` tokens becomes ceil(in / S) tokens, at most --max-prompt;
  - the engine block j (--block-size B tokens) covers trace tokens
    [j B S, (j+1) B S).  A kvplane-format hash id names the whole prefix up
    to its block (convert writes the chained key), so engine block j gets
    the id of the last trace block it covers when B S is a multiple of the
    trace's block size T (Mooncake's 512-token blocks at S = 16, B = 32: one
    trace block an engine block; the agentic traces' 64-token blocks at
    S = 32: 16 of them), or, when T is a multiple of B S, the trace block's
    id mixed with the engine block's place in it.  Two scaled prompts share
    engine block j exactly when the originals share every trace block up to
    its end: reuse keeps its shape, at the engine's granularity;
  - only engine blocks wholly inside the trace's keyed blocks are keyed (the
    rest is the request's own tail, as in the original);
  - outputs: ceil(out / S) tokens, at least 1, at most --max-output;
    arrival times, sessions, tenants kept; segment marks scaled by S.

usage: scale_trace.py --shrink S [--block-size 32] [--max-prompt 4096]
                      [--max-output 32] IN.jsonl OUT.jsonl
"""
import argparse
import json
import sys

M64 = (1 << 64) - 1


def mix(z):
    """splitmix64's finaliser: a sub-block's id from its block's."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def scale_ids(ids, tb, eb_tokens, n_blocks):
    """The engine blocks' ids: n_blocks of them, eb_tokens trace tokens each,
    over trace blocks of tb tokens with chained ids."""
    out = []
    if eb_tokens % tb == 0:
        r = eb_tokens // tb
        for j in range(n_blocks):
            out.append(ids[(j + 1) * r - 1])
    else:
        k = tb // eb_tokens
        for j in range(n_blocks):
            out.append(mix(ids[j // k] ^ (j % k) * 0x100000001B3))
    return out


def scale(header, reqs, shrink, bs, max_prompt, max_output):
    tb = header["block_size"]
    g = bs * shrink
    if g % tb and tb % g:
        raise ValueError("block-size x shrink = %d trace tokens must be a multiple or a "
                         "divisor of the trace's block size %d" % (g, tb))
    out = []
    for q in reqs:
        n_in = min(-(-q["in"] // shrink), max_prompt)
        keyed = len(q["hash_ids"]) * tb       # trace tokens the ids cover
        n_blocks = min(n_in // bs, keyed // g)
        r = {"t": q["t"], "in": n_in,
             "out": max(1, min(-(-q["out"] // shrink), max_output))}
        for k in ("think", "tenant", "session"):
            if k in q:
                r[k] = q[k]
        segs = []
        for s in q.get("segments", []):
            off, ln = s["offset"] // shrink, -(-s["length"] // shrink)
            if off >= n_in:
                continue
            segs.append(dict(s, offset=off, length=min(ln, n_in - off)))
        if segs:
            r["segments"] = segs
        r["hash_ids"] = scale_ids(q["hash_ids"], tb, g, n_blocks)
        out.append(r)
    return {"format": "kvplane-trace", "version": 1, "block_size": bs}, out


def read(path):
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if not lines:
        raise ValueError("%s: empty" % path)
    h = json.loads(lines[0])
    if h.get("format") != "kvplane-trace" or not isinstance(h.get("block_size"), int):
        raise ValueError("%s: not a kvplane-format trace (kvplane-bench convert)" % path)
    return h, [json.loads(x) for x in lines[1:]]


def write(path, header, reqs):
    with open(path, "w") as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for r in reqs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shrink", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("inp")
    ap.add_argument("out")
    a = ap.parse_args()
    if a.shrink < 1 or a.block_size < 1 or a.max_prompt < a.block_size or a.max_output < 1:
        sys.exit("scale_trace: --shrink >= 1, --block-size >= 1, --max-prompt >= "
                 "--block-size, --max-output >= 1")
    try:
        h, reqs = read(a.inp)
        h2, out = scale(h, reqs, a.shrink, a.block_size, a.max_prompt, a.max_output)
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit("scale_trace: %s" % e)
    write(a.out, h2, out)
    tin = sum(r["in"] for r in out)
    print("scale_trace: %d requests, block %d -> %d, 1/%d of the tokens: %.0f tokens a "
          "prompt (max %d), %.1f keyed blocks" % (
              len(out), h["block_size"], a.block_size, a.shrink, tin / max(1, len(out)),
              max((r["in"] for r in out), default=0),
              sum(len(r["hash_ids"]) for r in out) / max(1, len(out))), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
