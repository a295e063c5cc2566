#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""KNOWN-WRONG subscribers, for test_vllm_events.py --mutant: each is the
oracle (oracle_tail.py) with one rule broken, and the harness must fail it
on the scenarios named.  They prove the scenarios are not vacuous.

usage: oracle_mutants.py MUTANT [oracle_tail.py arguments]
  no_replay    ignores --replay: no startup replay, no gap repair
               (must fail: late, loss)
  no_drop      an unrecoverable gap keeps the old residency and applies what
               the replay returned on top (must fail: small_buffer)
  seq_restart  restart = seq going back only: no ZMQ disconnect monitor, no
               payload check at L; a gap replays from L+1 (must fail:
               restart_fast)
"""
import sys

import oracle_tail as o


class NoReplay(o.Tail):
    def __init__(self, a):
        a.replay = None
        super().__init__(a)


class NoDrop(o.Tail):
    def drop(self):
        self.L = None
        self.hist.clear()


class SeqRestart(o.Tail):
    def check_monitor(self):
        while self.mon.poll(0):
            o.recv_monitor_message(self.mon)

    def resync(self):
        if self.L is None:
            got = self.replay(0)
            return 0 if got is None else self.apply_run(got)
        got = self.replay(self.L + 1)
        if not got:
            return 0
        if got[0][0] > self.L + 1:
            self.drop()
        return self.apply_run(got)

    def on_live(self, seq, payload):
        if self.L is not None and seq <= self.L and self.hist.get(seq) != o.digest(payload):
            self.stats["restarts"] += 1
            self.drop()
        super().on_live(seq, payload)


MUTANTS = {"no_replay": (NoReplay, ("late", "loss")),
           "no_drop": (NoDrop, ("small_buffer",)),
           "seq_restart": (SeqRestart, ("restart_fast",))}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MUTANTS:
        sys.exit(f"usage: oracle_mutants.py {{{','.join(MUTANTS)}}} ARGS...")
    o.Tail = MUTANTS[sys.argv.pop(1)][0]
    sys.exit(o.main())
