# SPDX-License-Identifier: Apache-2.0
"""The KV-event subscriber's Python face: create, poll, stats, Prometheus,
errors (a live vLLM stream is covered by the C interop tests)."""
import os

import pytest

import kvplane


def test_subscriber_lifecycle(ns, tmp_path):
    ix = kvplane.Index(max_workers=2)
    ix.add_worker(0)
    src = kvplane.EventSource(f"ipc://{tmp_path}/kv-events", worker=0, connect="bind",
                              ns=ns)
    with kvplane.EventsSubscriber(ix, [src], no_initial_replay=True) as ev:
        assert ev.poll(0) == 0
        st = ev.stats()
        assert st["batches"] == 0 and st["decode_errors"] == 0
        assert "kvplane_events_batches_total" in ev.prometheus()
        with pytest.raises(kvplane.StateError):
            ev.start()  # polled: the caller's loop owns it
    src.endpoint = f"ipc://{tmp_path}/kv-events-2"
    with kvplane.EventsSubscriber(ix, [src], no_initial_replay=True) as ev:
        ev.start()
        with pytest.raises(kvplane.StateError):
            ev.poll(0)  # the I/O thread runs
        ev.stop()


def test_subscriber_errors(ns):
    ix = kvplane.Index(max_workers=2)
    ix.add_worker(0)
    with pytest.raises(kvplane.InvalidArgumentError):  # REKEY needs a namespace
        kvplane.EventsSubscriber(ix, [kvplane.EventSource("tcp://127.0.0.1:1", 0)])
    with pytest.raises(kvplane.KvplaneError):
        kvplane.EventsSubscriber(ix, [kvplane.EventSource("nonsense://x", 0, rekey=False)])
