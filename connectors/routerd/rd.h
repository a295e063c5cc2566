/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd internals.  Thread 0 runs loop 0: the admin and indexer
 * listeners, the workers' KV-event subscribers (their ZeroMQ fds), the
 * /metrics scrapes, the tick, signals and SIGHUP, replicas sync -- and a
 * front door.  With routerd.threads = N > 1, threads 1..N-1 each run one
 * more front door (rd_loop: its own event_base, evhttp, SO_REUSEPORT
 * socket, hashers, keep-alive pools and counters) over the same index.
 *
 * Sharing (docs/routerd.md#threads):
 * - the index is thread-safe (queries lock-free, writers per shard);
 *   the ledger has its own mutex; kvp_log is thread-safe;
 * - s->mu, "the routing lock", serialises the router (decisions,
 *   completions, loads, options), every worker field another loop may
 *   change or read (state, fails, open_until, inflight, requests, ok,
 *   retried_away, errors, load, models; slots taken and freed) and the
 *   writes of s->cfg (thread 0 reads it freely: it is the only writer;
 *   the other loops read their own copy, rd_loop.cfg);
 * - a worker's identity (url, host, port, kv_events...) is written by
 *   thread 0 while its slot is free: another loop reads it only after
 *   seeing the slot taken under s->mu, or while it holds a claim on the
 *   worker (inflight), which keeps the slot from being freed;
 * - receipts under s->rc_mu; loop counters single-writer atomics;
 *   histograms per loop under its hmu; the LoRA list append-only.
 * Lock order: s->mu before the ledger's and the index's own; s->rc_mu and
 * rd_loop.hmu are leaves.  With threads = 1 nothing else changes: one
 * loop, the locks uncontended. */
#ifndef KVP_ROUTERD_H
#define KVP_ROUTERD_H

#include <event2/event.h>
#include <event2/http.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/time.h>

#include "kvplane.h"
#include "kvplane/events.h"
#include "rd_idx_req.h"
#include "rd_pd_msg.h"
#include "rd_req.h"

#define RD_URL_MAX 256
#define RD_WORKERS_MAX 256
#define RD_EV_FDS 4
#define RD_SCRAPE_MAX_S 5.0 /* the longest a paced scrape waits */
#define RD_THREADS_MAX 64  /* routerd.threads */
#define RD_THREADS_AUTO 16 /* `auto`: online CPUs, at most this many */

/* ---- configuration (rd_config.c) ---------------------------------------- */
typedef struct rd_cfg {
  char listen[RD_URL_MAX];         /* host:port of the front door */
  char admin_listen[RD_URL_MAX];   /* "" = no admin listener */
  char admin_token[RD_URL_MAX];    /* "" = no bearer token asked */
  char indexer_listen[RD_URL_MAX]; /* "" = no KV-indexer service */
  char indexer_token[RD_URL_MAX];  /* its /register, /unregister: this
                                      token or admin_token ("" both: none) */
  bool indexer_routes;             /* /register with a url adds a routing
                                      target (else 403: config/admin only) */
  char salt_secret[RD_URL_MAX];    /* the tenant salts' key; "" = random at
                                      start (restart-only) */
  char response_headers_s[8];      /* auto / true / false, as written */
  int response_headers;            /* RD_HDRS_* */
  char receipts[RD_URL_MAX];       /* "" none, "-" stdout, else a file */
  char tenant_header[64];          /* maps to the namespace salt */
  char session_header[64];
  char model_id[RD_URL_MAX];       /* the namespace */
  char hash_algo[32];              /* native: xxh3_128 / sha256 */
  uint64_t max_workers;            /* worker slots (index, router) */
  uint64_t max_body, max_headers;  /* bytes */
  uint64_t max_connections;        /* client connections, all front doors;
                                      0 = any */
  uint64_t max_inflight;           /* generation requests at once; 0 = any */
  double client_request_timeout_s; /* a request's headers + body arrive */
  uint64_t max_upstream_body;      /* what is read whole from a worker (a
                                      held 5xx, render, scrape): bytes */
  uint64_t retries;                /* other workers tried before failing */
  uint64_t breaker_failures;       /* consecutive failures that open it */
  uint64_t stream_buffer;          /* client bytes queued before upstream
                                      reads pause (backpressure) */
  char threads_s[16];              /* "auto" or a count, as written */
  uint32_t threads;                /* front-door loops (threads), >= 1 */
  bool render;                     /* ask the worker's render endpoint */
  bool engine_hash;                /* events keyed by the engine's hashes */
  double connect_timeout_s, request_timeout_s, client_timeout_s;
  double scrape_interval_s, breaker_cooldown_s, drain_timeout_s;
  /* a worker's /metrics scrapes take at most this share of its wall time:
   * the next one waits max(scrape_interval, last scrape's duration /
   * budget), at most RD_SCRAPE_MAX_S; 0 = every scrape_interval */
  double scrape_budget;
  double approx_ttl_s;             /* routed records (text mode, no events) */
  /* workers: parallel lists joined with ',' ("-" = none) */
  char urls[8192], kv_events[8192], kv_replay[8192];
  /* P/D (docs/routerd.md#pd): each worker's role, a parallel list of
   * prefill / decode / both ("" = all both); pd: some worker is not both */
  char roles[8192];
  bool pd;
  double pd_link_gbps, pd_link_latency_s; /* 0 = the cost model's remote */
  kvp_router_opts ropts;
  char policy[64];
  /* replicas: */
  char nats_url[RD_URL_MAX];       /* "" = one replica, no sync */
  char subject_prefix[128];
  uint64_t replica_id;             /* 0 = the process id */
  double snapshot_interval_s, peer_timeout_s;
  char events_stream[64];          /* kv_events "js:NAME": JetStream stream */
  char events_prefix[128];         /* ... and subject prefix (the relay's) */
  char path[RD_URL_MAX]; /* the file, for SIGHUP */
} rd_cfg;

/* routerd.response_headers: whether replies carry x-kvplane-worker,
 * -cached-tokens, -reason (what the router knows of the shared cache) */
enum { RD_HDRS_AUTO = 0, /* on, except on a request that names a tenant */
       RD_HDRS_ON, RD_HDRS_OFF };
/* the longest tenant / session id (header or "user") taken: longer -> 400 */
#define RD_ID_MAX (RD_REQ_ID_MAX - 1)

/* Loads and validates path (YAML) into *c.  Returns 0 or -1 with
 * "file:line: ..." in err. */
int rd_cfg_load(const char *path, rd_cfg *c, char *err, size_t cap);
/* Whether host:port binds loopback only (127.x, localhost, ::1). */
bool rd_loopback(const char *hostport);
/* Prints to f what is allowed but unsafe in c (the front door off
 * loopback, tenants without a salt_secret); returns how many lines. */
int rd_cfg_warn(const rd_cfg *c, FILE *f);
/* host:port -> parts; 0 or -1 */
int rd_split_hostport(const char *s, char *host, size_t cap, uint16_t *port);

/* ---- workers (rd_workers.c) --------------------------------------------- */
typedef enum rd_wstate {
  RD_W_FREE = 0, /* slot unused */
  RD_W_UP,       /* serving */
  RD_W_DOWN,     /* circuit open: not routed until a probe succeeds */
  RD_W_DRAINING  /* no new requests; removed when idle if `removing` */
} rd_wstate;

typedef struct rd_server rd_server;

/* A worker's part in P/D (workers.roles): which leg it serves.  A request
 * outside P/D is a RD_ROLE_BOTH leg (any worker). */
typedef enum rd_role {
  RD_ROLE_BOTH = 0,
  RD_ROLE_PREFILL,
  RD_ROLE_DECODE
} rd_role;

typedef struct rd_worker {
  rd_server *s;
  uint32_t id;
  /* written under s->mu (thread 0, and any loop's circuit breaker); read
   * under it, or by thread 0 without it: plain accesses are seq_cst */
  _Atomic rd_wstate state;
  bool removing;
  char url[RD_URL_MAX], host[RD_URL_MAX];
  uint16_t port;
  char kv_events[RD_URL_MAX], kv_replay[RD_URL_MAX]; /* "" = none */
  /* the indexer API's name for it (rd_indexer.c): instance_id ("" = none:
   * the url names it) and dp_rank; index_only: registered there without a
   * url -- indexed from its events, never routed nor scraped */
  char instance[RD_REQ_ID_MAX];
  bool instance_int, index_only;
  bool registered; /* added by the indexer's /register: it may remove it */
  uint32_t dp_rank;
  kvp_events *ev;
  struct kvp_events_js *js; /* kv_events "js:NAME": read from JetStream */
  struct event *ev_fd[RD_EV_FDS];
  int n_ev_fd;
  /* bumped when the slot is freed or its circuit opens: each loop drops
   * its pooled connections of an older generation (rd_pool) */
  atomic_uint_fast64_t gen;
  struct evhttp_connection *probe; /* /metrics scrape (thread 0) */
  bool probe_busy;
  /* scrape pacing (thread 0): when the last /metrics was sent, how long it
   * took to answer, when the next one is due (rd_now) */
  double scrape_sent, scrape_s, scrape_next;
  uint32_t fails;          /* consecutive */
  double open_until;       /* circuit breaker */
  uint64_t inflight;       /* requests relaying now */
  char *models;            /* its /v1/models "data" (JSON array), or NULL */
  double models_at;        /* when they were read (rd_now); refreshed */
  /* bit i: its /v1/models lists s->lora[i] (under s->mu); before the first
   * read (lora_known false) it may serve any */
  uint64_t lora_mask;
  bool lora_known;
  kvp_worker_load load;
  rd_role role; /* written under s->mu (rd_pd_set_role) */
  /* P/D, under s->mu: prompt tokens of the decode legs this router relays
   * to it now -- the KV its decode batch reads every step */
  uint64_t pd_decode_tokens;
  /* its KV cache in tokens (vLLM's cache_config_info, scraped, under
   * s->mu: num_gpu_blocks x block_size); 0: not known */
  uint64_t kv_cap_tokens;
  /* counters */
  uint64_t requests, ok, retried_away, errors[4]; /* rd_err_reason */
  uint64_t scrapes, scrape_fail;
} rd_worker;

typedef enum rd_err_reason {
  RD_ERR_CONNECT = 0, /* no connection / reset before the reply */
  RD_ERR_5XX = 1,     /* 5xx before the first byte */
  RD_ERR_MIDSTREAM = 2,
  RD_ERR_TIMEOUT = 3
} rd_err_reason;

/* ---- the server ---------------------------------------------------------- */
/* A LoRA adapter a worker serves (its /v1/models card with a parent): a
 * request naming it hashes with it, as vLLM keys the adapter's blocks. */
#define RD_LORA_MAX 64
typedef struct rd_lora {
  char name[128], path[256]; /* the card's id and root */
} rd_lora;

/* ---- front-door loops (rd_loop.c) ----------------------------------------- */
/* One loop's counters: written by its thread only (a relaxed load and store,
 * no locked add), read by /metrics on any loop. */
typedef struct rd_counters {
  atomic_uint_fast64_t conns_cut, overloaded, conns_refused;
  atomic_uint_fast64_t conns_open; /* a gauge: +1 admitted, -1 closed */
  atomic_uint_fast64_t requests, bad_requests, no_worker, retries,
      client_cancels, render_calls, render_fail, text_mode, token_mode,
      predicted_cached, reported_cached, reported_n, tenant_salted;
  atomic_uint_fast64_t stream_pauses; /* backpressure (routerd.stream_buffer) */
  atomic_uint_fast64_t reasons[KVP_REASON_COUNT_];
} rd_counters;
#define RD_COUNT(l, f, n)                                                     \
  atomic_store_explicit(&(l)->cnt.f,                                          \
                        atomic_load_explicit(&(l)->cnt.f,                     \
                                             memory_order_relaxed) + (n),     \
                        memory_order_relaxed)

/* A loop's keep-alive connections to one worker slot (evhttp connections
 * belong to one event_base). */
typedef struct rd_pool {
  struct evhttp_connection **idle;
  size_t n, cap;
  uint64_t gen; /* rd_worker.gen they were made under */
} rd_pool;

/* The front door's guard (rd_guard.c): the whole-request deadline and the
 * connection cap of one loop's evhttp. */
typedef struct rd_guard rd_guard;

typedef struct rd_loop {
  rd_server *s;
  uint32_t idx;                     /* 0: thread 0's loop */
  pthread_t th;                     /* idx > 0, once started */
  bool started;
  struct event_base *base;          /* idx 0: s->base */
  struct evhttp *http;              /* the front door */
  struct evhttp_bound_socket *sock; /* NULL once draining */
  int wake_fd;                      /* idx > 0: thread 0's posts (eventfd) */
  struct event *wake;               /* ... on this loop */
  atomic_bool stop;                 /* posted: leave the loop */
  uint64_t cfg_gen;                 /* s->cfg_gen of cfg */
  rd_cfg cfg;                       /* the running config, this loop's copy */
  kvp_hasher *hasher, *text_hasher; /* idx 0: s's (thread 0 is theirs) */
  kvp_index_match *ixm;             /* query scratch: max_workers each */
  kvp_worker_match *wm;
  rd_pool *pool;                    /* per worker slot */
  uint32_t rr;                      /* render / fallback round robin */
  pthread_mutex_t hmu;              /* the histograms: /metrics merges */
  kvp_hist *h_render, *h_route;     /* ns */
  kvp_hist *h_wait, *h_held;        /* the decision's s->mu: ns */
  rd_guard *guard;
  /* workers named by host name resolve through it, not a blocking
   * getaddrinfo on the loop (NULL: evdns could not start: blocking) */
  struct evdns_base *dns;
  rd_counters cnt;
} rd_loop;

/* On l->http (made), thread 0 before the loops run: guards the
 * connections it accepts from now on.  0 or -1. */
int rd_guard_create(rd_loop *l, rd_guard **out);
/* hr (its connection guarded) is being answered: no deadline until its
 * reply ends.  false: its connection is over routerd.max_connections (a 503
 * already sent): answer it 503 too, nothing else. */
bool rd_guard_begin(rd_guard *g, struct evhttp_request *hr);
/* cb(arg) when hr's connection closes (evhttp_connection_set_closecb,
 * which the guard holds on the connections it counts); NULL cb: none */
void rd_guard_on_gone(rd_guard *g, struct evhttp_request *hr,
                      void (*cb)(struct evhttp_connection *, void *),
                      void *arg);
void rd_guard_destroy(rd_guard *g); /* after evhttp_free; NULL ok */

/* rd_errpage.c: evhttp's own error pages (400/413/417/501) rewritten as
 * OpenAI JSON in bev's output; the bevcb for listeners without a guard */
void rd_errpage_watch(struct bufferevent *bev);
struct bufferevent *rd_errpage_bevcb(struct event_base *base, void *arg);

/* Makes s->cfg.threads loops (loop 0 on s->base) with their front doors on
 * s->cfg.listen; threads > 1: each loop has its own SO_REUSEPORT socket.
 * 0 or -1 (logged). */
int rd_loops_create(rd_server *s);
int rd_loops_start(rd_server *s);  /* threads 1..N-1 run their loops */
void rd_loops_stop(rd_server *s);  /* asks them to leave, joins them */
void rd_loops_free(rd_server *s);  /* after rd_loops_stop */
/* SIGTERM: every front door stops accepting (open connections finish) */
void rd_loops_drain(rd_server *s);
/* s->cfg changed (reload, under s->mu): each loop takes its copy and its
 * front door's limits */
void rd_loops_reconfigure(rd_server *s);
void rd_lock(rd_server *s);
void rd_unlock(rd_server *s);
/* This loop's keep-alive connection to w (the caller holds a claim on w);
 * rd_conn_put takes it back after any request, failed ones too (evhttp
 * reconnects a reset connection on its next use); one the router gave up
 * on mid-connect is freed instead (rd_proxy.c on_connect_timeout). */
struct evhttp_connection *rd_conn_get(rd_loop *l, rd_worker *w);
void rd_conn_put(rd_loop *l, rd_worker *w, struct evhttp_connection *c);

/* P/D counters (rd_pd.c): any loop adds (relaxed), /metrics reads */
typedef struct rd_pd_stats {
  atomic_uint_fast64_t calls, prefill_ok, prefill_retries, decode_retries,
      bad_params, prefill_refused, pred_transfer_tokens, pred_transfer_bytes,
      offered_blocks, decode_local_tokens, decode_kv_full;
} rd_pd_stats;

struct rd_server {
  rd_cfg cfg;      /* written by thread 0 under mu (rd_loop.cfg: copies) */
  pthread_mutex_t mu, rc_mu; /* the routing lock; receipts (rd.h's top) */
  atomic_uint_fast64_t cfg_gen; /* bumped with each cfg applied */
  rd_loop *loops;
  uint32_t n_loops;
  /* adapters seen on any worker: thread 0 fills lora[n_lora] and then
   * publishes n_lora (release; rd_lora_find's acquire load pairs) */
  rd_lora lora[RD_LORA_MAX];
  atomic_uint n_lora;
  uint32_t lora_warned;
  struct event_base *base;
  struct evhttp *admin, *indexer_http;
  struct event *sig_term, *sig_int, *sig_hup, *tick, *js_tick;
  kvp_namespace ns, text_ns;
  /* the tenant salts' HMAC key (rd_salt_for): from routerd.salt_secret or
   * random, set before the loops start and never changed */
  unsigned char salt_key[RD_SALT_KEY_LEN];
  kvp_hasher *hasher, *text_hasher;
  kvp_index *ix;
  kvp_router *router;
  kvp_ledger *ledger;
  rd_worker *w; /* cfg.max_workers slots */
  uint32_t n_w;
  FILE *receipts; /* under rc_mu */
  atomic_bool draining;
  double drain_deadline;
  atomic_uint_fast64_t inflight; /* upstream requests, every loop's */
  atomic_uint_fast64_t calls;    /* generation requests admitted, not done */
  /* worker replies over max_upstream_body, by what: held 5xx, render,
   * scrape (any loop: relaxed adds, /metrics reads) */
  atomic_uint_fast64_t upstream_over[3];
  uint64_t next_id;              /* under mu */
  /* SIGHUP (rd_reload.c), written under mu */
  uint64_t reloads_ok, reloads_refused;
  double config_ok_unix; /* last config applied (start or reload), unix s */
  bool reload_failed;    /* the last reload was refused */
  bool restart_pending;  /* the last applied file changed restart-only keys */
  struct rd_indexer *indexer;
  struct rd_sync *sync;         /* NULL: one replica */
  uint64_t *peer_req, *peer_tok; /* per slot: the peers' in-flight load */
  rd_pd_stats pd;
};

double rd_now(void); /* monotonic seconds */
/* seconds -> struct timeval (every timer and timeout of the daemon) */
static inline struct timeval rd_tv(double s) {
  struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
  return tv;
}
void rd_js_tick_arm(rd_server *s); /* a JetStream-fed worker exists */

int rd_workers_init(rd_server *s);
void rd_workers_fini(rd_server *s);
/* Adds a worker (url, optional event endpoints).  Returns its id or -1 with
 * err (duplicate url, no free slot, bad url, events refused). */
int rd_worker_add(rd_server *s, const char *url, const char *kv_events,
                  const char *kv_replay, char *err, size_t cap);
/* An index-only worker (rd_indexer.c): `name` (unique, kept as its url)
 * identifies it; its events feed the index; it is never routed nor scraped.
 * Returns its id or -1 with err. */
int rd_worker_add_indexed(rd_server *s, const char *name, const char *kv_events,
                          const char *kv_replay, char *err, size_t cap);
rd_worker *rd_worker_find(rd_server *s, const char *url);
/* Drains (no new requests) and, with remove, frees the slot once idle. */
void rd_worker_drain(rd_worker *w, bool remove);
void rd_worker_undrain(rd_worker *w);
/* A worker drained for removal is freed now if idle; returns whether it
 * was (rd_workers_tick does it for the others). */
bool rd_worker_reap(rd_worker *w);
bool rd_worker_routable(const rd_worker *w);
/* Under s->mu: a routable w takes one more request (inflight; `request`:
 * counted in requests too) and cannot be freed until rd_worker_release.
 * Returns whether it did. */
bool rd_worker_claim(rd_worker *w, bool request);
void rd_worker_release(rd_worker *w); /* takes s->mu */
/* TCP_NODELAY on c's socket; after each evhttp_make_request on c */
void rd_conn_nodelay(struct evhttp_connection *c);
/* Writes what evhttp queued on c now instead of on the loop's next pass
 * (a bufferevent writes only once epoll reports the socket writable: one
 * more loop pass, two epoll_ctl and a wakeup per message).  When all of it
 * went out, evhttp's write-done step runs here, as the loop would have run
 * it: after a reply's end that may free the request and the connection, so
 * call it last.  A partial write leaves the rest to the loop. */
void rd_conn_flush(struct evhttp_connection *c);
/* The adapter `model` names (NULL: the base model, or not known as one). */
const rd_lora *rd_lora_find(const rd_server *s, const char *model);
/* Whether w serves adapter i (index in s->lora; -1: the base model, which
 * every worker serves).  Under s->mu. */
bool rd_worker_serves(const rd_worker *w, int lora);
/* A request to w failed (reason) or succeeded (`request`: a relayed one,
 * counted ok; else a scrape): the circuit breaker.  Take s->mu. */
void rd_worker_failed(rd_worker *w, rd_err_reason why);
void rd_worker_ok(rd_worker *w, bool request);
void rd_workers_tick(rd_server *s); /* scrapes, breaker, removals */
void rd_workers_js_poll(rd_server *s); /* JetStream-fed workers' batches */
/* Router-facing state after a change (online/offline flags + load); s->mu
 * held. */
void rd_worker_sync(rd_worker *w);

/* An evhttp on base with the front door's limits (body, headers, client
 * timeout) of c and callback cb(arg); NULL on failure. */
struct evhttp *rd_http_new(struct event_base *base, const rd_cfg *c,
                           void (*cb)(struct evhttp_request *, void *),
                           void *arg);
/* The same, listening on host:port (thread 0's loop); NULL (logged) on
 * failure. */
struct evhttp *rd_listen(rd_server *s, const char *hostport,
                         void (*cb)(struct evhttp_request *, void *),
                         struct evhttp_bound_socket **sock);
/* c's limits (body, headers, client timeout) on h: its connections
 * accepted from now on take them. */
void rd_http_limits(const rd_cfg *c, struct evhttp *h);
/* A loop's event_base (each loop's: thread 0's and the front doors'). */
struct event_base *rd_base_new(void);
/* (Re)arms the scrape / breaker / drain tick at s->cfg.scrape_interval_s. */
int rd_tick_arm(rd_server *s);

/* ---- the front door (rd_proxy.c) ---------------------------------------- */
void rd_on_http(struct evhttp_request *hr, void *arg); /* arg: its rd_loop */
void rd_reply_error(struct evhttp_request *hr, int status, const char *param,
                    const char *msg);
/* false: hr's framing is ambiguous (two Content-Length, or one with
 * Transfer-Encoding): answered 400 with Connection: close (every listener
 * checks it first) */
bool rd_framing_ok(struct evhttp_request *hr);
/* A JSON reply: text j (NULL: a 500 without a body, e.g. out of memory), or
 * object o (its reference taken, NULL alike). */
void rd_reply_json(struct evhttp_request *hr, int code, const char *j);
void rd_reply_obj(struct evhttp_request *hr, int code, json_t *o);

/* ---- admin (rd_admin.c), metrics (rd_metrics.c) ------------------------- */
void rd_on_admin(struct evhttp_request *hr, void *arg);
/* Whether hr carries "Authorization: Bearer T" (scheme in any case) with T
 * tok1 or tok2 (compared in constant time; "" = not that one; both "": no
 * token asked).  Otherwise: logged (what, the peer), answered 401 with
 * WWW-Authenticate, false. */
bool rd_authorized(struct evhttp_request *hr, const char *what,
                   const char *tok1, const char *tok2);
void rd_peer(struct evhttp_request *hr, char *out, size_t cap); /* "addr:port" */
const char *rd_method_name(enum evhttp_cmd_type m);
void rd_metrics_write(rd_server *s, struct evbuffer *b); /* any loop */
/* The config's workers list applied (added / drained-removed); -1 when
 * some were refused (logged) */
int rd_apply_workers(rd_server *s, const rd_cfg *c);

/* ---- P/D (rd_pd.c) ------------------------------------------------------ */
/* "prefill" / "decode" / "both" -> *out; 0 or -1 */
int rd_role_parse(const char *name, rd_role *out);
const char *rd_role_name(rd_role r);
void rd_pd_set_role(rd_worker *w, rd_role r); /* takes s->mu */
/* Whether w serves a leg of kind `leg` (BOTH: any request).  Under s->mu. */
bool rd_role_serves(const rd_worker *w, rd_role leg);
/* The decode leg's matches (under s->mu): each routable decode worker's own
 * match wm[0..nm) (its index view of the prompt) gets the rest of the first
 * n_pull blocks on the remote tier -- what crosses the link from the
 * prefill worker, priced at routing.gpu's remote bandwidth (pd.link_gbps);
 * a worker holding the prefix already pulls less.  wm has room for every
 * worker slot.  Returns the new count. */
size_t rd_pd_decode_matches(rd_server *s, kvp_worker_match *wm, size_t nm,
                            uint64_t n_pull);
/* The decode leg's candidates (under s->mu), into the eligible bit set
 * elig (cleared first): of the routable decode workers, those whose
 * transfer (the blocks of the first n_pull they lack, from wm) plus decode
 * load (out_tokens x the KV of the decode legs relayed to them now, read
 * every step at HBM bandwidth) is within 5 % (+ 0.1 ms) of the best: the
 * cost model then chooses among them.  Returns how many. */
uint32_t rd_pd_decode_eligible(rd_server *s, const kvp_worker_match *wm,
                               size_t nm, uint64_t n_pull, uint64_t prompt,
                               uint32_t out_tokens, uint64_t *elig);
void rd_pd_metrics(rd_server *s, struct evbuffer *b); /* cfg.pd only */

/* ---- SIGHUP (rd_reload.c) ------------------------------------------------ */
/* Re-reads s->cfg.path; once it validates, applies every live setting
 * (limits, timeouts, retries, breaker, headers, render, admin token, the
 * routing policy and options, scrape interval, receipts reopened, workers)
 * and names the changed ones that take a restart in one WARN line.  A file
 * that does not validate, or routing options the router refuses, changes
 * nothing.  Returns 0 (applied) or -1 (refused); counted for /metrics. */
int rd_reload(rd_server *s);
/* Records that s->cfg is applied now (start, reload): /metrics' timestamp */
void rd_config_applied(rd_server *s);
/* The receipts stream for path: none for "", stdout for "-", else the file
 * opened to append, line-buffered.  0, or -1 with errno. */
int rd_receipts_open(const char *path, FILE **out);

/* ---- replicas (rd_sync.c) ------------------------------------------------ */
typedef struct rd_sync rd_sync;
int rd_sync_start(rd_server *s, char *err, size_t cap);
/* libevent's locks (evthread) for libnats' threads; before the loop's base
 * is made, only when replicas sync (a single router stays lock-free) */
int rd_sync_thread_safe(void);
void rd_sync_stop(rd_server *s);
/* this replica routed d to the worker at url (keys: approximate residency
 * it creates, may be NULL/0) / its request's prefill is over.  url: a copy
 * taken while the slot could not change (under s->mu): the slot itself may
 * be freed and reused by then */
void rd_sync_decision(rd_server *s, const char *url, const kvp_decision *d,
                      const kvp_key *keys, size_t n_keys);
void rd_sync_complete(rd_server *s, const char *url, uint64_t request_id,
                      uint64_t tokens, uint64_t session_id);
/* Under s->mu, before routing a turn of session_id: a peer's earlier turn
 * of that session still counted in flight is over (rd_sync.c, peer_turn). */
void rd_sync_turn_over(rd_server *s, uint64_t session_id);
void rd_sync_metrics(rd_server *s, struct evbuffer *b);

/* ---- indexer service (rd_indexer.c) ------------------------------------- */
struct rd_indexer;
int rd_indexer_start(rd_server *s, const char *listen, char *err, size_t cap);
void rd_indexer_stop(rd_server *s);

#endif
