/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd: the KV-aware router daemon (docs/routerd.md).
 *   kvplane-routerd --config FILE [--check-config] [--log LEVEL]
 * SIGHUP re-reads the config and applies what can change live (rd_reload.c);
 * SIGTERM / SIGINT drain in-flight requests (up to routerd.drain_timeout)
 * and exit. */
#include "rd.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <getopt.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int make_hashers(rd_server *s) {
  const rd_cfg *c = &s->cfg;
  kvp_hash_algo a;
  kvp_hash_algo_parse(c->hash_algo, &a);
  kvp_namespace_desc d = {.model_id = c->model_id,
                          .block_size = c->ropts.block_size};
  char text_model[RD_URL_MAX + 8];
  snprintf(text_model, sizeof text_model, "%s#text", c->model_id);
  kvp_namespace_desc t = {.model_id = text_model,
                          .block_size = 4 * c->ropts.block_size};
  kvp_hasher_opts ho = {.algo = a};
  if (kvp_namespace_init(&d, &s->ns) < 0 ||
      kvp_namespace_init(&t, &s->text_ns) < 0 ||
      kvp_hasher_create(&s->ns, &ho, NULL, &s->hasher) < 0 ||
      kvp_hasher_create(&s->text_ns, &ho, NULL, &s->text_hasher) < 0)
    return -1;
  return 0;
}

/* routerd.salt_secret hashed to the HMAC key, or a random key */
static int make_salt_key(rd_server *s) {
  const char *sec = s->cfg.salt_secret;
  if (*sec)
    return SHA256((const unsigned char *)sec, strlen(sec), s->salt_key)
               ? 0 : -1;
  if (RAND_bytes(s->salt_key, sizeof s->salt_key) != 1)
    return -1;
  kvp_log(KVP_LOG_INFO, "routerd", "tenant cache salts: a random key (no "
          "routerd.salt_secret): they change at each start");
  return 0;
}

static int make_core(rd_server *s) {
  kvp_index_opts io = {.max_workers = (uint32_t)s->cfg.max_workers,
                       .approx_ttl_ns = (uint64_t)(s->cfg.approx_ttl_s * 1e9)};
  if (make_salt_key(s) < 0 || make_hashers(s) < 0 || kvp_index_create(&io, NULL, &s->ix) < 0 ||
      kvp_router_create(&s->cfg.ropts, NULL, &s->router) < 0 ||
      kvp_ledger_create(NULL, NULL, &s->ledger) < 0 || rd_workers_init(s) < 0)
    return -1;
  return 0;
}

void rd_http_limits(const rd_cfg *c, struct evhttp *h) {
  evhttp_set_max_body_size(h, (ev_ssize_t)c->max_body);
  evhttp_set_max_headers_size(h, (ev_ssize_t)c->max_headers);
  struct timeval tv = rd_tv(c->client_timeout_s);
  evhttp_set_timeout_tv(h, &tv);
}

struct evhttp *rd_http_new(struct event_base *base, const rd_cfg *c,
                           void (*cb)(struct evhttp_request *, void *),
                           void *arg) {
  struct evhttp *h = evhttp_new(base);
  if (h == NULL)
    return NULL;
  rd_http_limits(c, h);
  evhttp_set_allowed_methods(h, EVHTTP_REQ_GET | EVHTTP_REQ_POST |
                                    EVHTTP_REQ_DELETE);
  evhttp_set_gencb(h, cb, arg);
  evhttp_set_bevcb(h, rd_errpage_bevcb, NULL); /* the guard's replaces it */
  return h;
}

struct evhttp *rd_listen(rd_server *s, const char *hp,
                         void (*cb)(struct evhttp_request *, void *),
                         struct evhttp_bound_socket **sock) {
  char host[RD_URL_MAX];
  uint16_t port;
  struct evhttp *h = rd_http_new(s->base, &s->cfg, cb, s);
  if (h == NULL || rd_split_hostport(hp, host, sizeof host, &port) < 0)
    goto fail;
  struct evhttp_bound_socket *b = evhttp_bind_socket_with_handle(h, host, port);
  if (b == NULL) {
    fprintf(stderr, "kvplane-routerd: cannot listen on %s: %s\n", hp,
            strerror(errno));
    goto fail;
  }
  if (sock)
    *sock = b;
  return h;
fail:
  if (h)
    evhttp_free(h);
  return NULL;
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_server *s = arg;
  rd_workers_tick(s);
  kvp_index_expire(s->ix, kvp_now_ns());
  uint64_t n = atomic_load_explicit(&s->inflight, memory_order_relaxed);
  if (s->draining && (n == 0 || rd_now() >= s->drain_deadline)) {
    if (n)
      kvp_log(KVP_LOG_WARN, "routerd", "drain timeout: %llu requests cut",
              (unsigned long long)n);
    event_base_loopbreak(s->base); /* main stops the other loops */
  }
}

static void on_js_tick(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_workers_js_poll(arg);
}

void rd_js_tick_arm(rd_server *s) {
  struct timeval tv = {0, 2000}; /* JetStream-fed workers: every 2 ms */
  if (s->js_tick && !event_pending(s->js_tick, EV_TIMEOUT, NULL))
    event_add(s->js_tick, &tv);
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
  (void)what;
  rd_server *s = arg;
  if (sig == SIGHUP) {
    rd_reload(s);
    return;
  }
  if (s->draining) /* a second signal: now */
    event_base_loopbreak(s->base);
  s->drain_deadline = rd_now() + s->cfg.drain_timeout_s;
  rd_loops_drain(s);
  kvp_log(KVP_LOG_WARN, "routerd", "draining %llu in-flight requests",
          (unsigned long long)atomic_load_explicit(&s->inflight,
                                                   memory_order_relaxed));
}

static int open_receipts(rd_server *s) {
  if (rd_receipts_open(s->cfg.receipts, &s->receipts) < 0) {
    fprintf(stderr, "kvplane-routerd: receipts %s: %s\n", s->cfg.receipts,
            strerror(errno));
    return -1;
  }
  if (s->receipts == stdout) /* whole lines, as a file's (rd_receipts_open) */
    setvbuf(stdout, NULL, _IOLBF, 1 << 16);
  return 0;
}

int rd_tick_arm(rd_server *s) {
  struct timeval tv = rd_tv(s->cfg.scrape_interval_s);
  return event_add(s->tick, &tv); /* pending: rescheduled */
}

/* epoll's change list: an fd's changes within one loop pass are applied
 * together before epoll_wait, so the write interest a reply adds and the
 * read that follows it removes cost no epoll_ctl at all (libevent applies
 * each change at once otherwise: ~10 epoll_ctl per proxied request). */
struct event_base *rd_base_new(void) {
  struct event_config *cfg = event_config_new();
  if (cfg == NULL)
    return NULL;
  event_config_set_flag(cfg, EVENT_BASE_FLAG_EPOLL_USE_CHANGELIST);
  struct event_base *b = event_base_new_with_config(cfg);
  event_config_free(cfg);
  return b;
}

static int start(rd_server *s) {
  struct event *ev[4];
  int sigs[3] = {SIGTERM, SIGINT, SIGHUP};
  if ((*s->cfg.nats_url && rd_sync_thread_safe() < 0) ||
      (s->base = rd_base_new()) == NULL || make_core(s) < 0 ||
      open_receipts(s) < 0 || rd_loops_create(s) < 0)
    return -1;
  if (*s->cfg.admin_listen &&
      (s->admin = rd_listen(s, s->cfg.admin_listen, rd_on_admin, NULL)) == NULL)
    return -1;
  char err[512];
  if (*s->cfg.indexer_listen &&
      rd_indexer_start(s, s->cfg.indexer_listen, err, sizeof err) < 0) {
    fprintf(stderr, "kvplane-routerd: indexer: %s\n", err);
    return -1;
  }
  if (*s->cfg.nats_url && rd_sync_start(s, err, sizeof err) < 0) {
    fprintf(stderr, "kvplane-routerd: replicas: %s\n", err);
    return -1;
  }
  for (int i = 0; i < 3; i++)
    if ((ev[i] = evsignal_new(s->base, sigs[i], on_signal, s)) == NULL ||
        event_add(ev[i], NULL) < 0)
      return -1;
  s->sig_term = ev[0], s->sig_int = ev[1], s->sig_hup = ev[2];
  s->tick = event_new(s->base, -1, EV_PERSIST, on_tick, s);
  if (s->tick == NULL || rd_tick_arm(s) < 0)
    return -1;
  /* armed by the first JetStream-fed worker (rd_js_tick_arm) */
  s->js_tick = event_new(s->base, -1, EV_PERSIST, on_js_tick, s);
  if (s->js_tick == NULL)
    return -1;
  rd_config_applied(s);
  if (rd_apply_workers(s, &s->cfg) < 0)
    return -1;
  return rd_loops_start(s);
}

static void stop(rd_server *s) {
  rd_loops_stop(s);
  rd_sync_stop(s);
  rd_indexer_stop(s);
  rd_workers_fini(s);
  struct event *evs[] = {s->sig_term, s->sig_int, s->sig_hup, s->tick,
                         s->js_tick};
  for (size_t i = 0; i < 5; i++)
    if (evs[i])
      event_free(evs[i]);
  rd_loops_free(s);
  if (s->admin)
    evhttp_free(s->admin);
  if (s->base)
    event_base_free(s->base);
  if (s->receipts && s->receipts != stdout)
    fclose(s->receipts);
  kvp_router_destroy(s->router);
  kvp_index_destroy(s->ix);
  kvp_ledger_destroy(s->ledger);
  kvp_hasher_destroy(s->hasher);
  kvp_hasher_destroy(s->text_hasher);
  pthread_mutex_destroy(&s->mu);
  pthread_mutex_destroy(&s->rc_mu);
}

/* --check-config opens what the daemon will open, as it will: the receipts
 * file to append (created if missing), else the daemon would exit at start
 * and systemd restart it in a loop */
static int check_paths(const rd_cfg *c) {
  FILE *f = NULL;
  if (rd_receipts_open(c->receipts, &f) < 0) {
    fprintf(stderr, "kvplane-routerd: %s: routerd.receipts %s: %s\n", c->path,
            c->receipts, strerror(errno));
    return -1;
  }
  if (f && f != stdout)
    fclose(f);
  return 0;
}

/* The daemon's log lines carry the wall-clock time (UTC, milliseconds):
 * "2026-11-28T21:44:11.123Z kvplane[warn] routerd: ...", one fprintf per
 * line as the default sink (any thread). */
static void log_sink(void *opaque, kvp_log_level level, const char *module,
                     const char *msg) {
  static const char *const names[] = {"off", "error", "warn", "info",
                                      "debug", "trace"};
  (void)opaque;
  struct timespec ts;
  struct tm tm;
  char when[32] = "";
  clock_gettime(CLOCK_REALTIME, &ts);
  if (gmtime_r(&ts.tv_sec, &tm))
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
  fprintf(stderr, "%s.%03ldZ kvplane[%s] %s: %s\n", when, ts.tv_nsec / 1000000,
          (unsigned)level < 6 ? names[level] : "?", module ? module : "kvplane",
          msg);
}

/* libevent's own complaints in the same log, the same format (a watched fd
 * closed under the loop is a bug: tests look for module "libevent"). */
static void libevent_log(int severity, const char *msg) {
  kvp_log_level l = severity >= EVENT_LOG_ERR    ? KVP_LOG_ERROR
                    : severity >= EVENT_LOG_WARN ? KVP_LOG_WARN
                                                 : KVP_LOG_DEBUG;
  kvp_log(l, "libevent", "%s", msg);
}

static void usage(FILE *f) {
  fprintf(f, "usage: kvplane-routerd --config FILE [--check-config] "
             "[--log off|error|warn|info|debug]\n"
             "  the KV-aware OpenAI router in front of vLLM workers "
             "(docs/routerd.md)\n");
}

int main(int argc, char **argv) {
  static const struct option lo[] = {{"config", 1, 0, 'c'},
                                     {"check-config", 0, 0, 'k'},
                                     {"log", 1, 0, 'l'},
                                     {"help", 0, 0, 'h'},
                                     {0, 0, 0, 0}};
  const char *cfg = NULL;
  bool check = false;
  int o;
  while ((o = getopt_long(argc, argv, "c:kl:h", lo, NULL)) != -1) {
    if (o == 'c')
      cfg = optarg;
    else if (o == 'k')
      check = true;
    else if (o == 'l')
      setenv("KVP_LOG", optarg, 1);
    else
      return usage(o == 'h' ? stdout : stderr), o == 'h' ? 0 : 2;
  }
  if (cfg == NULL || optind != argc)
    return usage(stderr), 2;
  signal(SIGPIPE, SIG_IGN);
  kvp_log_set_sink(log_sink, NULL);
  event_set_log_callback(libevent_log);
  rd_server *s = calloc(1, sizeof *s);
  char err[1024];
  if (s) {
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->rc_mu, NULL);
  }
  if (s == NULL || rd_cfg_load(cfg, &s->cfg, err, sizeof err) < 0) {
    fprintf(stderr, "kvplane-routerd: %s\n", s ? err : "out of memory");
    free(s); /* its mutexes: never locked, nothing to destroy */
    return 2;
  }
  rd_cfg_warn(&s->cfg, stderr);
  if (check && check_paths(&s->cfg) < 0) {
    free(s);
    return 2;
  }
  if (check) {
    printf("kvplane-routerd: %s: ok (policy %s, block size %u)\n", cfg,
           s->cfg.policy, s->cfg.ropts.block_size);
    free(s);
    return 0;
  }
  int rc = start(s) < 0 ? 1 : 0;
  if (rc == 0) {
    fprintf(stderr, "kvplane-routerd: listening on %s (policy %s, %u "
            "thread%s)\n", s->cfg.listen, s->cfg.policy, s->n_loops,
            s->n_loops > 1 ? "s" : "");
    event_base_dispatch(s->base);
  }
  stop(s);
  free(s);
  return rc;
}
