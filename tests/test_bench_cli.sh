#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# kvplane-bench end to end: every policy on slices of both bundled traces;
# the HTML report is well-formed XML with one section per trace, the setup,
# a verdict, a glossary and four SVG plots per section (no line across a
# gap); the compact table fits 120 columns, --wide has every column; JSON and CSV parse; the shipped config reproduces
# the embedded defaults; bad configs fail with file:line; convert keeps the
# results; gen and sweep run.  Usage: test_bench_cli.sh BENCH SHARED SRC
set -euo pipefail
bench=$1 shared=$2 src=$3
moon=$shared/traces/mooncake_conversation.jsonl.zst
agent=$shared/traces/cc_agentic
[ -r "$moon" ] && [ -d "$agent" ] || { echo "SKIP: traces not in $shared"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 missing"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$bench" run --no-progress --limit 1500 --out "$tmp/r1" "$moon" "$agent" > "$tmp/out1"
grep -q "HTML report: .*report.html" "$tmp/out1" || fail "no report path printed"
awk '!/^(HTML report|CSV):/ && length($0) > 120 { print; exit 1 }' "$tmp/out1" || fail "the default table is wider than 120 columns"
"$bench" run --wide --no-progress --limit 300 --policies kvplane_cost --out "$tmp/w" "$moon" > "$tmp/outw"
grep -q "avoidedM  avoid_s" "$tmp/outw" || fail "--wide lacks the full columns"
# --workers auto sizes the cluster to the offered load and says so
"$bench" run --no-progress --limit 1500 --workers auto --policies kvplane_cost \
  --out "$tmp/wa" "$moon" > "$tmp/owa" 2>&1
grep -q "GPUs busy where the work is (per 10 s); --workers auto at 70%: [0-9]" "$tmp/owa" ||
  fail "--workers auto: $(cat "$tmp/owa")"
refuse_auto=$("$bench" run --workers auto:2 "$moon" 2>&1 || true)
echo "$refuse_auto" | grep -q "auto or auto:U" || fail "--workers auto:2 accepted"
for p in round_robin least_loaded prefix_greedy sglang_cache_aware \
         llmd_weighted dynamo_cost kvplane_cost random infinite; do
  [ "$(grep -c "^$p " "$tmp/out1")" = 2 ] || fail "policy $p not in both tables"
done
python3 - "$tmp/r1" <<'PY'
import csv, json, sys, xml.etree.ElementTree as ET
d = sys.argv[1]
root = ET.parse(d + "/report.html").getroot()   # well-formed or raises
ns = "{http://www.w3.org/2000/svg}"
secs = root.findall(".//section")
assert len(secs) == 2, len(secs)
for s in secs:
    svgs = s.findall(ns + "svg")
    assert len(svgs) == 4, len(svgs)
    titles = [v.find(ns + "title").text for v in svgs]
    assert titles[0].startswith("Where the prompt tokens went"), titles
    assert titles[1].startswith("Prefix hit rate over the replay"), titles
    assert titles[2].startswith("TTFT tail"), titles
    assert titles[3].startswith("Tier occupancy, kvplane_cost"), titles
    assert len(svgs[0].findall(ns + "rect[@class='bar']")) >= 9
    for v in svgs[1:]:
        paths = v.findall(ns + "path[@class='series']")
        assert len(paths) >= 3, len(paths)
        for pth in paths:   # every segment starts with M: gaps are not bridged
            segs = pth.get("d").split()
            assert not segs or segs[0].startswith("M"), segs[:2]
    text = "".join(s.itertext())
    for w in ("Model", "GPU", "Cluster", "Best peer by TTFT p95",
              "What the columns mean", "avoid_s", "stable %"):
        assert w in text, w
html = open(d + "/report.html").read()
assert "http" not in html.replace("http://www.w3.org/2000/svg", ""), "external link"
assert "<script" not in html
j = json.load(open(d + "/results.json"))
assert len(j["runs"]) == 2
for run in j["runs"]:
    assert run["placement"] == {"hbm": "lru", "dram": "lru", "nvme": "lru",
                                "stability_aware": True}, run["placement"]
    pol = {p["policy"]: p for p in run["policies"]}
    assert len(pol) == 9
    up = pol["infinite"]["reused_tokens"]
    for p in pol.values():
        assert p["reused_tokens"] <= up, p["policy"]
        assert sum(p["miss_tokens"].values()) + p["reused_tokens"] == p["prompt_tokens"]
rows = list(csv.DictReader(open(d + "/results.csv")))
assert len(rows) == 18, len(rows)
print("report ok")
PY

# the shipped config = the embedded defaults (same numbers)
"$bench" run --quiet --no-progress --limit 1000 --policies kvplane_cost,dynamo_cost \
  --out "$tmp/a" "$moon" >/dev/null
"$bench" run --quiet --no-progress --limit 1000 --config "$src/bench/configs/default.yaml" \
  --policies kvplane_cost,dynamo_cost --out "$tmp/b" "$moon" >/dev/null
cmp <(cut -d, -f1-32 "$tmp/a/results.csv") <(cut -d, -f1-32 "$tmp/b/results.csv") ||
  fail "default.yaml differs from the embedded defaults"

# bad configs: file:line messages, exit status 2
printf 'cluster:\n  workers: 8\n  wrokers: 3\n' > "$tmp/bad1.yaml"
printf 'routing:\n  policies: [kvplane_cost, bogus]\n' > "$tmp/bad2.yaml"
printf 'clutser:\n  workers: 3\n' > "$tmp/bad3.yaml"
for i in 1 2 3; do
  if "$bench" run --config "$tmp/bad$i.yaml" "$moon" > "$tmp/o" 2> "$tmp/e"; then
    fail "bad$i.yaml accepted"
  fi
done
for i in 1 2 3; do
  "$bench" run --config "$tmp/bad$i.yaml" "$moon" > "$tmp/e$i" 2>&1 || true
done
grep -q "bad1.yaml:3: unknown key 'wrokers' in section 'cluster'" "$tmp/e1" ||
  fail "no file:line for an unknown key"
grep -q "bad3.yaml:1: unknown section 'clutser'" "$tmp/e3" ||
  fail "no file:line for an unknown section"
grep -q "unknown policy 'bogus'" "$tmp/e2" || fail "bad policy accepted"

# each bad input names its field or path (exit status 2, nothing else said)
refuse() { # refuse NAME EXPECTED-TEXT ARGS...: fails with EXPECTED-TEXT in stderr
  local name=$1 want=$2; shift 2
  if "$bench" "$@" > "$tmp/o" 2> "$tmp/e"; then fail "$name accepted"; fi
  grep -qF -- "$want" "$tmp/e" || fail "$name: want '$want', got: $(cat "$tmp/e")"
}
refuse "--config DIR" "$tmp: is a directory, not a YAML file" run --config "$tmp" "$moon"
refuse "--policies ," "--policies: no policy named in ','" run --policies , "$moon"
printf 'routing:\n  policies: []\n' > "$tmp/b4.yaml"
refuse "policies: []" "b4.yaml:2: routing.policies: expected a list of 1 to 64" \
  run --config "$tmp/b4.yaml" "$moon"
printf 'tiers:\n  nvme_dir: [a, b]\n' > "$tmp/b5.yaml"
refuse "nvme_dir list" "b5.yaml:2: tiers.nvme_dir: expected one value, got a list" \
  run --config "$tmp/b5.yaml" "$moon"
printf 'tiers:\n  queue_depth: 0\ncluster:\n  workers: 2\n' > "$tmp/b6.yaml"
refuse "failed tiers bind" "b6.yaml:2: tiers.queue_depth" run --config "$tmp/b6.yaml" "$moon"
grep -q "unknown section" "$tmp/e" && fail "a failed bind also reported as an unknown section"
printf 'model:\n  block_size: 16\n' > "$tmp/b7.yaml"
refuse "block size" "blocks of 512 tokens, but the config's model.block_size is 16" \
  run --config "$tmp/b7.yaml" --policies kvplane_cost "$moon"
refuse "gen --sessions 0" "gen --sessions: a count in 1..1048576, got '0'" \
  gen --sessions 0 "$tmp/g0.jsonl"
refuse "gen --subagents 0" "gen --subagents: a probability in (0, 1]" \
  gen --subagents 0 "$tmp/g0.jsonl"
# sizes take units (1T, 1e12); the block size that matches binds
printf 'tiers:\n  dram_bytes: 1T\n  nvme_bytes: 1e12\n  max_block_bytes: 2MiB\nmodel:\n  block_size: 512\n' \
  > "$tmp/u1.yaml"
"$bench" run --quiet --no-progress --limit 200 --policies kvplane_cost \
  --config "$tmp/u1.yaml" --out "$tmp/u1" "$moon" > /dev/null || fail "u1.yaml refused"
# --help tells gen's options and why the NVMe admission default is all
"$bench" --help > "$tmp/help"
for w in "--turns N" "--subagents P" "Default all: the simulator's behaviour before"; do
  grep -qF -- "$w" "$tmp/help" || fail "--help lacks '$w'"
done

# placement policies (kvtier's): config, tiers: section and CLI agree; bad
# names and tiers: keys fail with file:line
printf 'tiers:\n  policy: s3fifo\n  queue_depth: 64\n' > "$tmp/t1.yaml"
printf 'cluster:\n  dram_policy: s3fifo\n  nvme_policy: s3fifo\n' > "$tmp/t2.yaml"
"$bench" run --quiet --no-progress --limit 1000 --policies kvplane_cost --dram-gb 8 \
  --nvme-gb 0 --tier-policy s3fifo --out "$tmp/p0" "$moon" >/dev/null
"$bench" run --quiet --no-progress --limit 1000 --policies kvplane_cost --dram-gb 8 \
  --nvme-gb 0 --out "$tmp/p1" "$moon" >/dev/null
for i in 1 2; do
  "$bench" run --quiet --no-progress --limit 1000 --policies kvplane_cost --dram-gb 8 \
    --nvme-gb 0 --config "$tmp/t$i.yaml" --out "$tmp/pt$i" "$moon" >/dev/null ||
    fail "t$i.yaml refused"
  cmp <(cut -d, -f1-32 "$tmp/p0/results.csv") <(cut -d, -f1-32 "$tmp/pt$i/results.csv") ||
    fail "t$i.yaml: not the --tier-policy s3fifo numbers"
done
if cmp -s <(cut -d, -f1-32 "$tmp/p0/results.csv") <(cut -d, -f1-32 "$tmp/p1/results.csv"); then
  fail "the DRAM policy changed nothing at 8 GB"
fi
# the commented tiers: example of default.yaml binds as written
sed 's/^# tiers:$/tiers:/; s/^#   \([a-z_]*:\)/  \1/' "$src/bench/configs/default.yaml" > "$tmp/full.yaml"
grep -q '^  promote: true' "$tmp/full.yaml" || fail "no tiers: example in default.yaml"
"$bench" run --quiet --no-progress --limit 1000 --config "$tmp/full.yaml" \
  --policies kvplane_cost,dynamo_cost --out "$tmp/bt" "$moon" >/dev/null || fail "tiers: example refused"
cmp <(cut -d, -f1-32 "$tmp/a/results.csv") <(cut -d, -f1-32 "$tmp/bt/results.csv") ||
  fail "the tiers: example changed the defaults"
printf 'tiers:\n  queue_depth: 64\n  polcy: lru\n' > "$tmp/t3.yaml"
printf 'cluster:\n  workers: 2\n  dram_policy: arc\n' > "$tmp/t4.yaml"
printf 'tiers:\n  queue_depth: 5000\n' > "$tmp/t5.yaml"
for i in 3 4 5; do
  if "$bench" run --config "$tmp/t$i.yaml" "$moon" > "$tmp/e$i" 2>&1; then
    fail "t$i.yaml accepted"
  fi
done
grep -q "t3.yaml:3: unknown key 'polcy' in section 'tiers'" "$tmp/e3" || fail "t3: $(cat "$tmp/e3")"
grep -q "t4.yaml:3: cluster.dram_policy: expected lru or s3fifo, got 'arc'" "$tmp/e4" ||
  fail "t4: $(cat "$tmp/e4")"
grep -q "t5.yaml:2: tiers.queue_depth: expected an integer in \[1, 1024\]" "$tmp/e5" ||
  fail "t5: $(cat "$tmp/e5")"
if "$bench" run --tier-policy arc "$moon" >/dev/null 2>&1; then
  fail "--tier-policy arc accepted"
fi
"$bench" sweep --no-progress --limit 500 --param dram_gb=4,64 --param tier_policy=lru,s3fifo \
  --out "$tmp/swp" "$moon" > "$tmp/swp.txt"
[ "$(grep -c '^[0-9]' "$tmp/swp.txt")" = 4 ] || fail "policy sweep is not 2 x 2"
grep -q '^4  *s3fifo ' "$tmp/swp.txt" || fail "policy sweep rows: $(cat "$tmp/swp.txt")"

# convert: the kvplane format replays to the very same numbers
"$bench" convert --limit 800 "$agent" "$tmp/agentic.kvp.jsonl.zst" 2>/dev/null
"$bench" run --quiet --no-progress --limit 800 --policies kvplane_cost,round_robin \
  --out "$tmp/c1" "$agent" >/dev/null
"$bench" run --quiet --no-progress --policies kvplane_cost,round_robin \
  --out "$tmp/c2" "$tmp/agentic.kvp.jsonl.zst" >/dev/null
cmp <(cut -d, -f2-32 "$tmp/c1/results.csv") <(cut -d, -f2-32 "$tmp/c2/results.csv") ||
  fail "converted trace replays differently"

# malformed records: skipped and counted, or stop with file:line
(zstd -dc "$moon" 2>/dev/null || true) | head -20 > "$tmp/m.jsonl"
echo '{"timestamp": 5, "input_length": "x"}' >> "$tmp/m.jsonl"
"$bench" run --no-progress --policies kvplane_cost --out "$tmp/m" "$tmp/m.jsonl" > "$tmp/mo" 2>&1
grep -q "m.jsonl:21: field 'input_length'" "$tmp/mo" || fail "no file:line for a bad record"
grep -q "1 malformed records skipped" "$tmp/mo" || fail "skipped record not counted"
if "$bench" run --on-error stop --policies kvplane_cost --out "$tmp/m" "$tmp/m.jsonl" >/dev/null 2>&1; then
  fail "--on-error stop went on"
fi

# gen (with drift) and sweep
"$bench" gen --seed 3 --sessions 8 --drift 0.05 "$tmp/gen.jsonl"
"$bench" run --quiet --no-progress --policies kvplane_cost --out "$tmp/g" "$tmp/gen.jsonl" >/dev/null
"$bench" sweep --no-progress --limit 500 --param dram_gb=0,64 --param workers=4,8 \
  --ttft-p95-max 30 --out "$tmp/swo" "$moon" > "$tmp/sw"
grep -q "^recommendation: " "$tmp/sw" || fail "sweep gave no recommendation"
[ "$(grep -c '^[0-9]' "$tmp/sw")" = 4 ] || fail "sweep table is not 2 x 2"
python3 - "$tmp/swo/sweep.html" <<'PY'
import sys, xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
svgs = ET.parse(sys.argv[1]).getroot().findall(".//" + ns + "svg")
assert len(svgs) == 2, len(svgs)
assert len(svgs[0].findall(ns + "path[@class='series']")) == 2   # one line per workers value
assert len(svgs[1].findall(ns + "path[@class='series']")) == 3   # ... and the p95 bound
PY
# NVMe admission (kvtier's gate): the class + reuse rule writes less to NVMe
# than writing every demotion; bad modes fail with file:line
for m in all hits gate; do
  "$bench" run --no-progress --limit 1000 --policies kvplane_cost --dram-gb 8 \
    --nvme-admission $m --out "$tmp/na_$m" "$moon" > "$tmp/na_$m.txt" ||
    fail "--nvme-admission $m refused"
  grep -q "^NVMe admission $m" "$tmp/na_$m.txt" || fail "no NVMe admission lines ($m)"
done
python3 - "$tmp/na_all/results.csv" "$tmp/na_hits/results.csv" <<'PY' || fail "hits wrote no less than all"
import csv, sys
w = [int(next(csv.DictReader(open(f)))["demoted_bytes_nvme"]) for f in sys.argv[1:]]
assert 0 < w[1] < w[0], w
PY
printf 'cluster:\n  nvme_admission: sometimes\n' > "$tmp/na.yaml"
if "$bench" run --quiet --no-progress --limit 10 --config "$tmp/na.yaml" \
     --out "$tmp/na_bad" "$moon" 2> "$tmp/na.err"; then
  fail "nvme_admission: sometimes accepted"
fi
grep -q "na.yaml:2: cluster.nvme_admission: expected all, hits or gate" "$tmp/na.err" ||
  fail "no file:line for a bad nvme_admission"
# --jobs: runs on threads give the runs' results one after another gives
# (only the wall-clock fields differ); the sweep's table likewise
"$bench" run --quiet --no-progress --jobs 1 --limit 300 --out "$tmp/j1" "$moon" "$agent"
"$bench" run --quiet --no-progress --jobs 3 --limit 300 --out "$tmp/j3" "$moon" "$agent"
python3 - "$tmp/j1/results.csv" "$tmp/j3/results.csv" <<'PY' || fail "--jobs 3 results differ from --jobs 1"
import csv, sys
def rows(p):
    out = []
    for r in csv.DictReader(open(p)):
        out.append({k: v for k, v in r.items() if k not in ("wall_seconds", "simulated_requests_per_s")})
    return out
a, b = rows(sys.argv[1]), rows(sys.argv[2])
assert len(a) == 18 and a == b, (len(a), len(b))
PY
for j in 1 2; do
  "$bench" sweep --no-progress --jobs $j --limit 200 --param dram_gb=0,16,64 --param workers=2,4 \
    --out "$tmp/sj$j" "$moon" | grep -v '^plot: ' > "$tmp/sj$j.txt"
done
cmp -s "$tmp/sj1.txt" "$tmp/sj2.txt" || fail "sweep --jobs 2 differs: $(diff "$tmp/sj1.txt" "$tmp/sj2.txt")"
[ "$(grep -c '^[0-9]' "$tmp/sj2.txt")" = 6 ] || fail "sweep --jobs 2 is not 3 x 2"
for bad in 0 x -1 1025; do
  if "$bench" run --jobs "$bad" "$moon" > /dev/null 2> "$tmp/jbad"; then
    fail "--jobs $bad accepted"
  fi
  grep -q -- "--jobs: 1..1024 or auto" "$tmp/jbad" || fail "--jobs $bad: $(cat "$tmp/jbad")"
done
KVP_BENCH_JOBS=x "$bench" run --quiet --no-progress --limit 50 --policies kvplane_cost \
  --out "$tmp/jenv" "$moon" 2> "$tmp/jenv.err" || fail "a bad KVP_BENCH_JOBS stopped the run"
grep -q "KVP_BENCH_JOBS=x: not 1..1024 or auto; using auto" "$tmp/jenv.err" ||
  fail "a bad KVP_BENCH_JOBS went unsaid: $(cat "$tmp/jenv.err")"
# P/D (issue 41): bad values are refused naming the option; a config's pd:
# section runs the split, reported in the table and JSON
refuse "--prefill 0" "--prefill: prefill workers, 1..4096" run --prefill 0 --decode 2 "$moon"
refuse "--decode x" "--decode: decode workers, 1..4096" run --prefill 2 --decode x "$moon"
refuse "--prefill alone" "--prefill and --decode go together" run --prefill 2 "$moon"
refuse "--link-gbps 0" "--link-gbps: GB/s, 0.001..1e6" run --prefill 2 --decode 2 --link-gbps 0 "$moon"
refuse "--link-latency-us -1" "--link-latency-us: microseconds, 0.001..6e7" \
  run --prefill 2 --decode 2 --link-latency-us -1 "$moon"
refuse "--workers vs P/D" "--workers 3 but --prefill 2 + --decode 2 = 4" \
  run --workers 3 --prefill 2 --decode 2 "$moon"
refuse "--workers auto with P/D" "--workers auto does not size a P/D cluster" \
  run --workers auto --prefill 2 --decode 2 "$moon"
printf 'pd:\n  prefill: 2\n  link_gbps: 0\n' > "$tmp/pd1.yaml"
refuse "pd.link_gbps 0" "pd1.yaml:3: pd.link_gbps" run --config "$tmp/pd1.yaml" "$moon"
printf 'pd:\n  prefill: 1\n  decode: 2\n  link_gbps: 10\n  link_latency_us: 20\n' > "$tmp/pd2.yaml"
"$bench" run --no-progress --limit 300 --config "$tmp/pd2.yaml" --policies kvplane_cost,infinite \
  --out "$tmp/pd" "$moon" > "$tmp/pd.out" 2> "$tmp/pd.err" || fail "P/D run: $(cat "$tmp/pd.err")"
grep -q "P/D: 1 prefill + 2 decode workers, link 10 GB/s + 20 us" "$tmp/pd.out" ||
  fail "no P/D line in the table: $(cat "$tmp/pd.out")"
grep -q "infinite bound is not modelled; left out" "$tmp/pd.err" || fail "infinite left out silently"
python3 - "$tmp/pd/results.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
assert run["workers"] == 3 and run["pd"] == {"prefill": 1, "decode": 2, "link_gbps": 10.0,
                                              "link_latency_us": 20.0}, run["pd"]
[p] = run["policies"]
pd = p["pd"]
assert p["policy"] == "kvplane_cost" and p["requests"] == 300, p["policy"]
assert pd["xfer_bytes"] > 0 and pd["tpot_s"]["p99"] >= pd["tpot_s"]["p50"] > 0, pd
assert pd["roles"]["prefill"]["legs"] == pd["roles"]["decode"]["legs"] == 300, pd["roles"]
assert pd["roles"]["prefill"]["out_tokens"] == 0 < pd["roles"]["decode"]["out_tokens"]
PY
echo "kvplane-bench cli ok"
