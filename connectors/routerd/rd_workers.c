/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd workers: slots shared with the index and the router, the
 * KV-event subscribers (ZeroMQ fds on thread 0's loop), the /metrics scrape
 * that is also the health check, and the circuit breaker.  Slots are taken
 * and freed by thread 0 only; what the front-door loops change or read
 * goes under s->mu (rd.h's top). */
#include "rd.h"
#include "rd_prom.h"

#include "kvplane/events_nats.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

double rd_now(void) { return (double)kvp_now_ns() * 1e-9; }

bool rd_worker_routable(const rd_worker *w) {
  return w->state == RD_W_UP && !w->index_only;
}

void rd_worker_sync(rd_worker *w) {
  kvp_worker_load l = w->load;
  l.flags = rd_worker_routable(w) ? 0 : KVP_WORKER_OFFLINE;
  if (w->s->peer_req) { /* the other replicas' in flight counts as queued */
    uint64_t q = l.queued_requests + w->s->peer_req[w->id];
    l.queued_requests = q > UINT32_MAX ? UINT32_MAX : (uint32_t)q;
    l.prefill_tokens += w->s->peer_tok[w->id];
    if (l.prefill_tokens > KVP_ROUTE_COUNT_MAX)
      l.prefill_tokens = KVP_ROUTE_COUNT_MAX;
  }
  kvp_router_set_load(w->s->router, w->id, &l);
}

int rd_workers_init(rd_server *s) {
  s->n_w = (uint32_t)s->cfg.max_workers;
  s->w = calloc(s->n_w, sizeof *s->w);
  if (s->w == NULL)
    return -1;
  rd_lock(s);
  for (uint32_t i = 0; i < s->n_w; i++) {
    s->w[i].s = s;
    s->w[i].id = i;
    rd_worker_sync(&s->w[i]);
  }
  rd_unlock(s);
  return 0;
}

bool rd_worker_claim(rd_worker *w, bool request) {
  if (!rd_worker_routable(w))
    return false;
  w->inflight++;
  w->requests += request;
  atomic_fetch_add_explicit(&w->s->inflight, 1, memory_order_relaxed);
  return true;
}

/* The last touch of w: once unlocked, thread 0 may free its slot
 * (rd_worker_reap), w->s included. */
void rd_worker_release(rd_worker *w) {
  rd_server *s = w->s;
  rd_lock(s);
  w->inflight--;
  atomic_fetch_sub_explicit(&s->inflight, 1, memory_order_relaxed);
  rd_unlock(s);
}

rd_worker *rd_worker_find(rd_server *s, const char *url) {
  for (uint32_t i = 0; i < s->n_w; i++)
    if (s->w[i].state != RD_W_FREE && strcmp(s->w[i].url, url) == 0)
      return &s->w[i];
  return NULL;
}

static void on_events(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_worker *w = arg;
  while (kvp_events_poll(w->ev, 0) > 0) {
  }
}

static int parse_url(rd_worker *w, const char *url, char *err, size_t cap) {
  struct evhttp_uri *u = evhttp_uri_parse(url);
  const char *scheme = u ? evhttp_uri_get_scheme(u) : NULL;
  const char *host = u ? evhttp_uri_get_host(u) : NULL;
  int port = u ? evhttp_uri_get_port(u) : -1;
  int rc = -1;
  if (scheme == NULL || strcmp(scheme, "http") != 0 || host == NULL ||
      *host == '\0' || strlen(host) >= sizeof w->host)
    snprintf(err, cap, "worker url '%s': expected http://host[:port]", url);
  else {
    snprintf(w->host, sizeof w->host, "%s", host);
    w->port = (uint16_t)(port < 0 ? 80 : port);
    rc = 0;
  }
  if (u)
    evhttp_uri_free(u);
  return rc;
}

/* kv_events "js:NAME": the worker's batches as `kvplane events relay`
 * stored them in JetStream (subject <events_prefix>.NAME): a replica that
 * starts late rebuilds its index from the stream. */
static int open_js(rd_worker *w, char *err, size_t cap) {
  rd_server *s = w->s;
  const char *name = w->kv_events + 3;
  kvp_events_js_opts o = {.url = s->cfg.nats_url,
                          .stream = s->cfg.events_stream,
                          .subject_prefix = s->cfg.events_prefix};
  if (*s->cfg.nats_url == '\0' ||
      kvp_events_js_create(w->ev, &o, &name, 1, &w->js) < 0) {
    snprintf(err, cap, "worker %s: KV events from JetStream (%s) refused: "
             "needs replicas.nats_url and a relay worker name", w->url,
             w->kv_events);
    return -1;
  }
  rd_js_tick_arm(s);
  return 0;
}

static int open_events(rd_worker *w, char *err, size_t cap) {
  rd_server *s = w->s;
  bool js = strncmp(w->kv_events, "js:", 3) == 0;
  kvp_events_source src = {
      .endpoint = js ? NULL : w->kv_events,
      .replay_endpoint = !js && *w->kv_replay ? w->kv_replay : NULL,
      .worker = w->id,
      .keying = s->cfg.engine_hash ? KVP_EVENTS_ENGINE_HASH : KVP_EVENTS_REKEY,
      .ns = &s->ns,
      .hasher = {.algo = kvp_hasher_algo(s->hasher)}};
  kvp_events *ev;
  if (kvp_events_create(s->ix, &src, 1, NULL, NULL, &ev) < 0) {
    snprintf(err, cap, "worker %s: KV events %s refused (see the log)", w->url,
             w->kv_events);
    return -1;
  }
  rd_lock(s); /* /metrics on another loop reads it */
  w->ev = ev;
  rd_unlock(s);
  if (js)
    return open_js(w, err, cap);
  int fds[RD_EV_FDS];
  int n = kvp_events_fds(w->ev, fds, RD_EV_FDS);
  for (int i = 0; i < n && i < RD_EV_FDS; i++) {
    w->ev_fd[i] = event_new(s->base, fds[i], EV_READ | EV_PERSIST, on_events, w);
    if (w->ev_fd[i] == NULL || event_add(w->ev_fd[i], NULL) < 0) {
      snprintf(err, cap, "worker %s: cannot watch its event fds", w->url);
      return -1;
    }
    w->n_ev_fd = i + 1;
  }
  on_events(-1, 0, w); /* starts the initial replay */
  return 0;
}

/* Thread 0, no claim on w (inflight 0, not routable): no other loop reads
 * its fields but under s->mu.  `indexed`: its index slot was added.  The
 * loops' pooled connections go when they next see the new generation. */
static void worker_free(rd_worker *w, bool indexed) {
  rd_server *s = w->s;
  uint32_t id = w->id;
  for (int i = 0; i < w->n_ev_fd; i++)
    event_free(w->ev_fd[i]);
  kvp_events_js_destroy(w->js);
  if (w->probe)
    evhttp_connection_free(w->probe);
  if (indexed) /* a scan of the index: outside the lock */
    kvp_index_worker_remove(s->ix, id);
  rd_lock(s);
  kvp_events *ev = w->ev;
  char *models = w->models;
  uint64_t gen = atomic_load_explicit(&w->gen, memory_order_relaxed);
  memset(w, 0, sizeof *w);
  w->s = s;
  w->id = id;
  atomic_store_explicit(&w->gen, gen + 1, memory_order_relaxed);
  rd_worker_sync(w);
  rd_unlock(s);
  kvp_events_destroy(ev);
  free(models);
}

static const char *opt(const char *v) {
  return v && *v && strcmp(v, "-") != 0 ? v : "";
}

static int add(rd_server *s, const char *url, const char *kv_events,
               const char *kv_replay, bool index_only, char *err, size_t cap) {
  if (rd_worker_find(s, url)) {
    snprintf(err, cap, "worker %s is already registered", url);
    return -1;
  }
  rd_worker *w = NULL;
  for (uint32_t i = 0; i < s->n_w && w == NULL; i++)
    w = s->w[i].state == RD_W_FREE ? &s->w[i] : NULL;
  if (w == NULL) {
    snprintf(err, cap, "no free worker slot (routerd.max_workers = %u)", s->n_w);
    return -1;
  }
  if (strlen(url) >= sizeof w->url || strlen(opt(kv_events)) >= RD_URL_MAX ||
      strlen(opt(kv_replay)) >= RD_URL_MAX) {
    snprintf(err, cap, "worker %.64s...: url or endpoint too long", url);
    return -1;
  }
  if (!index_only && parse_url(w, url, err, cap) < 0)
    return -1;
  w->index_only = index_only;
  snprintf(w->url, sizeof w->url, "%s", url);
  snprintf(w->kv_events, sizeof w->kv_events, "%s", opt(kv_events));
  snprintf(w->kv_replay, sizeof w->kv_replay, "%s", opt(kv_replay));
  if (kvp_index_worker_add(s->ix, w->id) < 0) {
    snprintf(err, cap, "index refused worker slot %u", w->id);
    return -1;
  }
  /* its events first: the loops may route to it once it is up */
  if (*w->kv_events && open_events(w, err, cap) < 0) {
    worker_free(w, true);
    return -1;
  }
  rd_lock(s);
  w->state = RD_W_UP;
  rd_worker_sync(w);
  rd_unlock(s);
  kvp_log(KVP_LOG_INFO, "routerd", "worker %u: %s (events: %s)", w->id, url,
          *w->kv_events ? w->kv_events : "none, approximate residency");
  return (int)w->id;
}

int rd_worker_add(rd_server *s, const char *url, const char *kv_events,
                  const char *kv_replay, char *err, size_t cap) {
  return add(s, url, kv_events, kv_replay, false, err, cap);
}

int rd_worker_add_indexed(rd_server *s, const char *name, const char *kv_events,
                          const char *kv_replay, char *err, size_t cap) {
  return add(s, name, kv_events, kv_replay, true, err, cap);
}

/* A worker being removed stays draining (undrain and the breaker leave it
 * so): once idle, no loop can claim it again. */
bool rd_worker_reap(rd_worker *w) {
  rd_lock(w->s);
  bool idle = w->state != RD_W_FREE && w->removing && w->inflight == 0 &&
              !w->probe_busy;
  rd_unlock(w->s);
  if (!idle)
    return false;
  kvp_log(KVP_LOG_WARN, "routerd", "worker %s removed", w->url);
  worker_free(w, true);
  return true;
}

void rd_worker_drain(rd_worker *w, bool remove) {
  rd_lock(w->s);
  if (w->state != RD_W_FREE) {
    w->state = RD_W_DRAINING;
    w->removing = w->removing || remove;
    rd_worker_sync(w);
  }
  rd_unlock(w->s);
}

void rd_worker_undrain(rd_worker *w) {
  rd_lock(w->s);
  if (w->state == RD_W_DRAINING && !w->removing) {
    w->state = RD_W_UP;
    w->fails = 0;
    rd_worker_sync(w);
  }
  rd_unlock(w->s);
}

/* Without it a request body's last partial segment waits for the worker's
 * delayed ACK: 40 ms on a 32K-token prompt (bench_routerd).  The socket
 * exists once a request is made (numeric hosts connect at once), and a
 * reconnect makes a new one, so this runs after every evhttp_make_request. */
void rd_conn_nodelay(struct evhttp_connection *c) {
  struct bufferevent *bev = evhttp_connection_get_bufferevent(c);
  int fd = bev ? bufferevent_getfd(bev) : -1, one = 1;
  if (fd >= 0)
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void rd_conn_flush(struct evhttp_connection *c) {
  struct bufferevent *bev = c ? evhttp_connection_get_bufferevent(c) : NULL;
  evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
  struct evbuffer *out = bev ? bufferevent_get_output(bev) : NULL;
  if (fd < 0 || evbuffer_get_length(out) == 0)
    return; /* not connected yet: evhttp writes once it is */
  /* a socket bufferevent keeps its output's front frozen except while it
   * writes (bufferevent_writecb); unfrozen, the written bytes are drained */
  evbuffer_unfreeze(out, 1);
  int n = evbuffer_write(out, fd);
  evbuffer_freeze(out, 1);
  if (n <= 0 || evbuffer_get_length(out) > 0)
    return; /* EAGAIN, an error or a short write: the loop goes on */
  bufferevent_trigger(bev, EV_WRITE, BEV_TRIG_IGNORE_WATERMARKS);
}

/* s->cfg's breaker settings are read under s->mu: thread 0 writes them
 * under it (a reload). */
void rd_worker_failed(rd_worker *w, rd_err_reason why) {
  rd_lock(w->s);
  w->errors[why]++;
  bool open = ++w->fails >= w->s->cfg.breaker_failures && w->state == RD_W_UP;
  if (open) {
    w->state = RD_W_DOWN;
    w->open_until = rd_now() + w->s->cfg.breaker_cooldown_s;
    /* every loop's pooled connections point at a dead peer */
    atomic_fetch_add_explicit(&w->gen, 1, memory_order_relaxed);
    rd_worker_sync(w);
    kvp_log(KVP_LOG_WARN, "routerd", "worker %s: circuit open after %u "
            "failures", w->url, w->fails);
  }
  rd_unlock(w->s);
}

void rd_worker_ok(rd_worker *w, bool request) {
  rd_lock(w->s);
  w->ok += request;
  w->fails = 0;
  if (w->state == RD_W_DOWN && rd_now() >= w->open_until) {
    w->state = RD_W_UP;
    rd_worker_sync(w);
    kvp_log(KVP_LOG_WARN, "routerd", "worker %s: back up", w->url);
  }
  rd_unlock(w->s);
}

/* The loops are stopped: nothing else runs. */
void rd_workers_fini(rd_server *s) {
  for (uint32_t i = 0; s->w && i < s->n_w; i++)
    if (s->w[i].state != RD_W_FREE || s->w[i].probe)
      worker_free(&s->w[i], s->w[i].state != RD_W_FREE);
  free(s->w);
  s->w = NULL;
}

/* ---- scrape: vLLM's /metrics (load) and /v1/models ------------------------ */

static uint32_t clamp_u32(double v) {
  return v <= 0 ? 0 : v >= 4e9 ? 4000000000u : (uint32_t)v;
}

static void apply_metrics(rd_worker *w, const char *t, size_t n) {
  rd_scrape m;
  rd_scrape_parse(t, n, &m);
  rd_lock(w->s);
  w->kv_cap_tokens = m.kv_cap_tokens;
  w->load.running_requests = m.has_running ? clamp_u32(m.running) : 0;
  w->load.queued_requests = m.has_waiting ? clamp_u32(m.waiting) : 0;
  w->load.kv_util = !m.has_kv_use || m.kv_use < 0 ? 0
                    : m.kv_use > 1 ? 1 : m.kv_use;
  rd_worker_sync(w);
  rd_unlock(w->s);
}

const rd_lora *rd_lora_find(const rd_server *s, const char *model) {
  /* pairs with learn_adapters' release store: entries below n are written */
  uint32_t n = atomic_load_explicit(&s->n_lora, memory_order_acquire);
  for (uint32_t i = 0; model != NULL && *model && i < n; i++)
    if (strcmp(s->lora[i].name, model) == 0)
      return &s->lora[i];
  return NULL;
}

/* vLLM lists an adapter as a card whose parent is the base model (its root
 * the adapter's path); adapters stay known once seen (one unloaded later
 * only keys requests that the worker refuses anyway). */
static void learn_adapters(rd_server *s, json_t *d) {
  size_t i;
  json_t *m;
  json_array_foreach(d, i, m) {
    /* thread 0 is the only writer: its own relaxed read */
    uint32_t n = atomic_load_explicit(&s->n_lora, memory_order_relaxed);
    const char *id = json_string_value(json_object_get(m, "id"));
    const char *root = json_string_value(json_object_get(m, "root"));
    if (id == NULL || !json_is_string(json_object_get(m, "parent")) ||
        rd_lora_find(s, id))
      continue;
    if (strlen(id) >= sizeof s->lora[0].name ||
        (root && strlen(root) >= sizeof s->lora[0].path) ||
        n == RD_LORA_MAX) { /* a cut name or path keys other blocks */
      if (!s->lora_warned) /* once: the models are read every 10 s */
        kvp_log(KVP_LOG_WARN, "routerd", "LoRA adapter %.64s not used for "
                "routing: %s (logged once)", id,
                n == RD_LORA_MAX ? "more than 64 adapters"
                                 : "name or path too long");
      s->lora_warned = 1;
      continue;
    }
    rd_lora *l = &s->lora[n];
    snprintf(l->name, sizeof l->name, "%s", id);
    snprintf(l->path, sizeof l->path, "%s", root ? root : "");
    /* pairs with rd_lora_find's acquire load (the loops hash with it) */
    atomic_store_explicit(&s->n_lora, n + 1, memory_order_release);
    kvp_log(KVP_LOG_INFO, "routerd", "LoRA adapter %s (%s): its requests "
            "hash with it", l->name, l->path);
  }
}

bool rd_worker_serves(const rd_worker *w, int lora) {
  return lora < 0 || !w->lora_known || ((w->lora_mask >> lora) & 1);
}

/* The adapters (known to s, after learn_adapters) that d lists. */
static uint64_t adapters_of(const rd_server *s, json_t *d) {
  uint64_t m = 0;
  size_t i;
  json_t *card;
  json_array_foreach(d, i, card) {
    const rd_lora *l =
        json_is_string(json_object_get(card, "parent"))
            ? rd_lora_find(s, json_string_value(json_object_get(card, "id")))
            : NULL;
    m |= l ? 1ull << (l - s->lora) : 0;
  }
  return m;
}

static void on_models(struct evhttp_request *hr, void *arg) {
  rd_worker *w = arg;
  w->probe_busy = false;
  if (hr == NULL || evhttp_request_get_response_code(hr) != 200)
    return;
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  json_t *o = json_loadb((const char *)evbuffer_pullup(in, -1),
                         evbuffer_get_length(in), 0, NULL);
  json_t *d = json_object_get(o, "data");
  if (json_is_array(d)) {
    char *was, *now = json_dumps(d, JSON_COMPACT);
    learn_adapters(w->s, d);
    uint64_t mask = adapters_of(w->s, d);
    rd_lock(w->s); /* the front door's /v1/models and routing read them */
    was = w->models;
    w->models = now;
    w->lora_mask = mask;
    w->lora_known = true;
    rd_unlock(w->s);
    free(was);
    w->models_at = rd_now();
  }
  json_decref(o);
}

static void on_probe_error(enum evhttp_request_error e, void *arg) {
  rd_worker *w = arg;
  if (e == EVREQ_HTTP_DATA_TOO_LONG) /* over max_upstream_body */
    atomic_fetch_add_explicit(&w->s->upstream_over[2], 1, memory_order_relaxed);
}

static bool probe_get(rd_worker *w, const char *path,
                      void (*cb)(struct evhttp_request *, void *)) {
  if (w->probe == NULL) {
    w->probe = evhttp_connection_base_new(w->s->base, w->s->loops[0].dns,
                                          w->host, w->port);
    if (w->probe == NULL)
      return false;
    struct timeval tv = rd_tv(w->s->cfg.connect_timeout_s);
    evhttp_connection_set_timeout_tv(w->probe, &tv);
    /* a scrape is read whole: capped (a failed scrape, counted) */
    evhttp_connection_set_max_body_size(w->probe,
                                        (ev_ssize_t)w->s->cfg.max_upstream_body);
  }
  struct evhttp_request *r = evhttp_request_new(cb, w);
  if (r == NULL)
    return false;
  evhttp_request_set_error_cb(r, on_probe_error);
  evhttp_add_header(evhttp_request_get_output_headers(r), "Host", w->host);
  if (evhttp_make_request(w->probe, r, EVHTTP_REQ_GET, path) < 0)
    return false; /* r was freed by libevent */
  w->probe_busy = true;
  return true;
}

/* The next scrape of w is due after the configured interval or, when its
 * /metrics is slow to answer, after long enough that scrapes take at most
 * scrape_budget of its time.  vLLM renders ~57 KB of Prometheus text in
 * Python on its API server, ~20-25 ms idle on a CPU worker of half a core:
 * every 250 ms that was a fifth of the worker's CPU, and its decode and
 * prefill slowed by as much (docs/live.md, real vLLM). */
static void scrape_pace(rd_worker *w) {
  const rd_cfg *c = &w->s->cfg;
  double gap = c->scrape_interval_s;
  if (c->scrape_budget > 0) {
    double paced = w->scrape_s / c->scrape_budget;
    if (paced > RD_SCRAPE_MAX_S)
      paced = RD_SCRAPE_MAX_S;
    if (paced > gap)
      gap = paced;
  }
  w->scrape_next = w->scrape_sent + gap;
}

static void on_scrape(struct evhttp_request *hr, void *arg) {
  rd_worker *w = arg;
  w->probe_busy = false;
  if (w->state == RD_W_FREE)
    return;
  w->scrapes++;
  rd_lock(w->s); /* /metrics on other loops reads them under it */
  w->scrape_s = rd_now() - w->scrape_sent;
  scrape_pace(w);
  rd_unlock(w->s);
  if (hr == NULL || evhttp_request_get_response_code(hr) != 200) {
    w->scrape_fail++;
    rd_worker_failed(w, RD_ERR_CONNECT);
    return;
  }
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  apply_metrics(w, (const char *)evbuffer_pullup(in, -1),
                evbuffer_get_length(in));
  rd_worker_ok(w, false);
  /* models (and adapters: vLLM loads them at run time) every 10 s */
  if (w->models == NULL || rd_now() - w->models_at > 10.0)
    probe_get(w, "/v1/models", on_models);
}

void rd_workers_js_poll(rd_server *s) {
  for (uint32_t i = 0; i < s->n_w; i++)
    if (s->w[i].js)
      kvp_events_js_poll(s->w[i].js, 0);
}

void rd_workers_tick(rd_server *s) {
  for (uint32_t i = 0; i < s->n_w; i++) {
    rd_worker *w = &s->w[i];
    if (w->state == RD_W_FREE)
      continue;
    if (w->ev && w->js == NULL)
      on_events(-1, 0, w);
    if (rd_worker_reap(w) || w->index_only)
      continue;
    if (w->probe_busy || rd_now() < w->scrape_next)
      continue;
    rd_lock(s);
    w->scrape_sent = rd_now();
    rd_unlock(s);
    if (!probe_get(w, "/metrics", on_scrape)) {
      w->scrape_fail++;
      rd_worker_failed(w, RD_ERR_CONNECT);
    }
  }
}
