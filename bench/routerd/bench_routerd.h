/* SPDX-License-Identifier: Apache-2.0 */
/* bench_routerd: the latency a router adds in front of an OpenAI worker.
 * The network half (bench_routerd_net.c): a stub worker that answers at
 * once (a forked process, several ports) and an open-loop HTTP load
 * generator that measures each request from its scheduled send time. */
#ifndef KVP_BENCH_ROUTERD_H
#define KVP_BENCH_ROUTERD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define BR_PORTS_MAX 16

/* ---- the stub worker ------------------------------------------------------ */
typedef struct br_stub {
  pid_t pid;
  uint32_t n;
  uint16_t port[BR_PORTS_MAX];
} br_stub;

/* Binds n loopback ports (ephemeral) and forks a process serving them:
 * POST /v1/completions and /v1/chat/completions get a fixed one-token
 * completion (the body is read, not parsed); GET /v1/models, /metrics (vLLM
 * names), /health and anything else answer 200.  0 or -errno. */
int br_stub_start(uint32_t n, br_stub *out);
void br_stub_stop(br_stub *s);

/* ---- the load generator --------------------------------------------------- */
typedef struct br_load_opts {
  uint16_t port[BR_PORTS_MAX]; /* loopback; several: round robin (direct) */
  uint32_t n_ports;
  const char *path;
  const char *const *bodies; /* cycled */
  const size_t *body_len;
  uint32_t n_bodies;
  double rate;        /* requests/s, open loop; 0: closed loop */
  uint32_t closed;    /* closed loop: requests outstanding */
  uint64_t count;     /* closed loop: stop after this many (0: by time) */
  double warmup_s;    /* sent, not measured */
  double duration_s;  /* measured */
  double timeout_s;   /* per request */
  double grace_s;     /* open loop: after the last send, then cut */
  uint32_t max_conns; /* beyond: requests wait (still timed from schedule) */
  const char *want_header; /* counted on 200 replies; NULL: none */
} br_load_opts;

typedef struct br_load_result {
  uint64_t measured;   /* scheduled in the measured window */
  uint64_t ok;         /* of those: 200 */
  uint64_t errors;     /* of those: HTTP != 200, connection, timeout */
  uint64_t unfinished; /* of those: not done at the cut */
  uint64_t with_header;
  uint64_t done_all;   /* warm-up included: what the CPU is divided by */
  double achieved;     /* measured ok / the measured span, req/s */
  double p50_us, p99_us, max_us; /* unfinished count at their age */
  double late_us_max;  /* the generator's own lag behind the schedule */
  char first_error[160];
} br_load_result;

/* Runs one load; 0, or -1 when nothing could be set up. */
int br_load_run(const br_load_opts *o, br_load_result *r);

/* GET path from 127.0.0.1:port (HTTP/1.0, blocking, 2 s receive timeout):
 * the body of a 200 reply, malloc'd and NUL-terminated (the caller frees),
 * or NULL. */
char *br_http_get(uint16_t port, const char *path);

#endif
