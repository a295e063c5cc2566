# SPDX-License-Identifier: Apache-2.0
"""Router decisions and receipts through the package equal the C API's for
the same scenario (tests/python/route_ref prints the C receipts); the
index's query and the decision dataclass agree with the receipt."""
import json
import random
import subprocess

import pytest

import kvplane
from conftest import program

POLICIES = ["kvplane_cost", "round_robin", "least_loaded", "prefix_greedy",
            "sglang_cache_aware", "llmd_weighted", "dynamo_cost"]


def scenario(seed, hasher):
    """A random scenario: loads, residency on 4 workers, 12 routed turns of
    3 sessions that share a system prompt."""
    rnd = random.Random(seed)
    system = [rnd.randrange(128000) for _ in range(160)]
    lines, routes = [], []
    for w in range(4):
        lines.append(("load", w, rnd.randrange(4), rnd.randrange(4),
                      rnd.randrange(5000), rnd.randrange(500), round(rnd.random(), 3)))
    for w in range(4):
        toks = system + [rnd.randrange(128000) for _ in range(rnd.randrange(200))]
        keys = hasher.hash(toks)
        n = rnd.randrange(len(keys) + 1)
        if n:
            lines.append(("stored", w, 1, rnd.choice(["hbm", "dram", "nvme"]), keys[:n]))
    hist = {s: list(system) for s in range(3)}
    for t in range(12):
        s = rnd.randrange(3)
        hist[s] += [rnd.randrange(128000) for _ in range(rnd.randrange(10, 120))]
        keys = hasher.hash(hist[s])
        lines.append(("route", 1_000_000 * t, len(hist[s]), "acme", f"s{s}", f"r{t}", keys))
        if t % 3 == 2:
            lines.append(("complete",))
    return lines


def as_text(line):
    out = []
    for x in line:
        out += x.hex() if isinstance(x, kvplane.Keys) else [str(x)]
    return " ".join(out)


def run_python(lines, policy, n=4, bs=16):
    r, ix = kvplane.Router(n, bs, policy), kvplane.Index(max_workers=n)
    for w in range(n):
        ix.add_worker(w)
    receipts, last = [], None
    for line in lines:
        if line[0] == "load":
            r.set_load(line[1], kvplane.WorkerLoad(*line[2:]))
        elif line[0] == "stored":
            ix.stored(line[1], line[2], line[4], tier=line[3])
        elif line[0] == "route":
            _, now, prompt, tenant, session, req, keys = line
            last = r.route(keys, index=ix, prompt_tokens=prompt, tenant=tenant,
                           session=session, request=req, now_ns=now)
            rec = last.receipt()
            assert rec["worker"] == last.worker and rec["route"]["reason"] == last.reason
            assert rec["prompt_tokens"] == last.prompt_tokens == prompt
            assert rec["session"] == session and rec["request_id"] == req
            receipts.append(last.receipt_json())
        elif line[0] == "complete":
            r.complete(last)
    return receipts


@pytest.mark.parametrize("policy", POLICIES)
def test_receipts_equal_the_c_api(policy, hasher):
    ref = program("KVPLANE_ROUTE_REF")
    for seed in (1, 2, 3):
        lines = scenario(seed * 31 + POLICIES.index(policy), hasher)
        text = "\n".join([f"router 4 16 {policy}"] + [as_text(x) for x in lines]) + "\n"
        c = subprocess.run([ref], input=text, capture_output=True, text=True)
        assert c.returncode == 0, c.stderr
        assert run_python(lines, policy) == c.stdout.splitlines()


def test_decision_fields_and_matches(hasher):
    r = kvplane.Router(2, 16)
    keys = hasher.hash(range(200))
    d = r.route(keys, matches=[kvplane.WorkerMatch(1, {"dram": 8})], prompt_tokens=200,
                session="s", request="q")
    assert d.worker == 1 and d.policy == kvplane.Policy.KVPLANE_COST
    assert d.matched_tokens[kvplane.Tier.DRAM] == 128 and d.block_size == 16
    assert d.reused_tier_tokens[kvplane.Tier.DRAM] + d.uncached_tokens == 200
    assert d.request_id == kvplane.id64("q") and d.top[0].worker == 1
    assert json.loads(d.receipt_json(unix_time_ns=5))["unix_time_ns"] == 5
    assert r.inflight(1)["requests"] == 1
    r.complete(d)
    assert r.inflight(1)["requests"] == 0


def test_chosen_match_only(hasher):
    """least_loaded asked for the chosen worker's match alone decides as a
    twin given every worker's (kvp_router_route_chosen)."""
    keys = hasher.hash(range(200))
    full = kvplane.Router(3, 16, "least_loaded")
    lazy = kvplane.Router(3, 16, "least_loaded")
    assert not kvplane.Policy.LEAST_LOADED.compares_matches
    assert kvplane.Policy.KVPLANE_COST.compares_matches
    ms = [kvplane.WorkerMatch(0, {"hbm": 4}),
          kvplane.WorkerMatch(1, {"hbm": 2, "dram": 8}),
          kvplane.WorkerMatch(2, {"nvme": 5}, uncertain=True)]
    by = {m.worker: m for m in ms}
    asked = []

    def one(w):
        asked.append(w)
        return by.get(w)

    for i in range(12):
        for r in (full, lazy):
            r.set_load(i % 3, kvplane.WorkerLoad(prefill_tokens=97 * i))
        a = full.route(keys, matches=ms, prompt_tokens=200, request=f"q{i}")
        b = lazy.route(keys, chosen_match=one, prompt_tokens=200, request=f"q{i}")
        assert asked[-1] == a.worker == b.worker
        assert b.uncached_tokens == a.uncached_tokens
        assert b.matched_tokens == a.matched_tokens
        assert b.flags == a.flags | 0x20  # KVP_DECISION_CHOSEN_ONLY
        assert "chosen_only" in b.receipt()["route"]["flags"]
        assert lazy.inflight(b.worker) == full.inflight(a.worker)
    assert len(asked) == 12 and set(asked) == {0, 1, 2}
    before = [lazy.inflight(w) for w in range(3)]
    with pytest.raises(ZeroDivisionError):  # nothing routed
        lazy.route(keys, chosen_match=lambda w: 1 // 0, prompt_tokens=200)
    assert [lazy.inflight(w) for w in range(3)] == before
    with pytest.raises(kvplane.InvalidArgumentError):  # longer than the chain
        lazy.route(keys, prompt_tokens=200,
                   chosen_match=lambda w: kvplane.WorkerMatch(w, {"hbm": 13}))
    with pytest.raises(kvplane.KvplaneError) as e:
        kvplane.Router(2, 16).route(keys, chosen_match=lambda w: None)
    assert e.value.name == "KVP_ENOTSUP"
    with pytest.raises(TypeError):
        lazy.route(keys, matches=ms, chosen_match=one)


def test_router_errors():
    with pytest.raises(kvplane.InvalidArgumentError):
        kvplane.Router(2, 0)  # block_size is required
    with pytest.raises(TypeError):
        kvplane.Router(2, 16, no_such_knob=1)
    r = kvplane.Router(1, 16, "round-robin")
    r.set_load(0, kvplane.WorkerLoad(offline=True))
    with pytest.raises(kvplane.StateError) as e:
        r.route([])
    assert e.value.name == "KVP_ESTATE"


def test_index_query_and_stats(hasher):
    with kvplane.Index(max_workers=8, prefix_closed=True) as ix:
        keys = hasher.hash(range(320))
        for w in (2, 5):
            ix.add_worker(w)
        assert ix.stored(2, 1, keys[:10], "hbm") == 10
        assert ix.stored(2, 2, keys[10:15], kvplane.Tier.NVME, parent=keys[9]) == 5
        assert ix.stored(5, 1, keys[:3], "dram") == 3
        m = ix.query(keys)
        assert [(x.worker, x.prefix_blocks) for x in m] == [(2, 15), (5, 3)]
        assert m[0].tier_blocks[kvplane.Tier.NVME] == 5 and not m[0].uncertain
        with pytest.raises(kvplane.StateError):
            ix.stored(2, 2, keys[:1])  # stale sequence number
        assert ix.removed(2, 3, keys[12:15], "nvme") == 3
        assert ix.query(keys)[0].prefix_blocks == 12
        st = ix.stats()
        assert st.workers == 2 and st.events_stale == 1 and st.queries == 2
        with pytest.raises(kvplane.NotFoundError):
            ix.stored(3, 1, keys[:1])


def test_library_log_lines_reach_logging(caplog):
    kvplane.log_to_python()
    level = kvplane.get_log_level()
    kvplane.set_log_level(2)
    try:
        with caplog.at_level("WARNING", logger="kvplane"):
            with pytest.raises(kvplane.InvalidArgumentError):
                kvplane.Router(2, 0)
        assert any("block_size" in r.getMessage() and r.name.startswith("kvplane.")
                   for r in caplog.records), caplog.records
    finally:
        kvplane.log_to_python(False)
        kvplane.set_log_level(level)
