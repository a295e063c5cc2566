/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-bench's wire side (library kvp_harness_live, libevent): the
 * emulated vLLM workers (harness_engine.c) and the live load generator
 * (harness_live.c).  Kept out of kvp_harness so the offline simulator and
 * libkvplane never depend on an HTTP library. */
#ifndef KVP_BENCH_HARNESS_LIVE_H
#define KVP_BENCH_HARNESS_LIVE_H

/* `kvplane-bench engine [options]`: runs until SIGINT / SIGTERM.  Returns
 * the process exit status. */
int bh_engine_main(int argc, char **argv);
/* `kvplane-bench live --target URL [options] TRACE...`. */
int bh_live_main(int argc, char **argv);

struct event_base;
/* An event base whose timers fire to the microsecond: libevent's epoll
 * backend otherwise rounds every timeout up to the next millisecond, which
 * --time-scale X multiplies into up to X ms of trace time per timer (the
 * engine's prefill ends, the load generator's arrivals).  Falls back to a
 * default base.  NULL on ENOMEM. */
struct event_base *bh_live_event_base(void);

#endif /* KVP_BENCH_HARNESS_LIVE_H */
