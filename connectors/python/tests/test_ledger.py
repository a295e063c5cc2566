# SPDX-License-Identifier: Apache-2.0
"""The ledger through the package: records, decisions, totals, Prometheus
text and JSON lines."""
import math

import pytest

import kvplane
from kvplane import MissCause, StabilityClass as C, Tier


def record(**kw):
    base = dict(prompt_tokens=100, reused_tokens=64, recomputed_tokens=36,
                tenant="acme", session="s1", request_id="r1", worker=0,
                reused_by_tier={Tier.DRAM: 64}, prompt_by_class={C.STABLE: 64, C.VOLATILE: 36},
                reused_by_class={C.STABLE: 64},
                miss_tokens={MissCause.PARTIAL_BLOCK: 4, MissCause.NEVER_SEEN: 32})
    base.update(kw)
    return kvplane.Record(**base)


def test_totals_prometheus_and_json():
    with kvplane.Ledger() as led:
        led.add(record())
        led.add(record(session="s2", request_id="r2"))
        g = led.totals()
        assert g.requests == 2 and g.reused_tokens == 128 and g.recomputed_tokens == 72
        assert g.hit_rate(C.STABLE) == 1.0 and math.isnan(g.hit_rate(C.SEMI))
        assert led.totals("acme", "s2").requests == 1
        prom = led.prometheus()
        assert "kvplane_requests_total 2" in prom
        assert 'tenant="acme"' in prom
        rows = led.json()
        assert [r["scope"] for r in rows] == ["global", "tenant", "session", "session"]
        assert rows[0]["reused_tokens"] == 128
        with pytest.raises(kvplane.NotFoundError):
            led.totals("nobody")
        assert led.stats()["sessions"] == 2


def test_inconsistent_record_is_refused_with_the_reason():
    led = kvplane.Ledger()
    bad = record(miss_tokens={MissCause.NEVER_SEEN: 30})
    assert kvplane.explain(bad).startswith("miss")
    with pytest.raises(kvplane.InvalidArgumentError, match="miss_tokens"):
        led.add(bad)
    assert led.stats()["rejected_total"] == 1 and kvplane.explain(record()) == "ok"
    assert '"request_id":"r1"' in kvplane.receipt_json(record())


def test_decision_into_the_ledger(hasher):
    r = kvplane.Router(2, 16)
    keys = hasher.hash(range(100))
    d = r.route(keys, matches=[kvplane.WorkerMatch(0, {"hbm": 4})], prompt_tokens=100,
                tenant="acme", session="chat", request="q1")
    led = kvplane.Ledger()
    led.add_decision(d)
    t = led.totals("acme", "chat")
    assert t.requests == 1 and t.reused_tokens == d.avoided_tokens == 64
    assert t.miss_tokens[MissCause.PARTIAL_BLOCK] == 100 - 96
    assert d.receipt()["reused_tokens"] == 64
