/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd /metrics: Prometheus text 0.0.4.  The router's own
 * counters, per-worker load and errors, the KV-event subscribers' counters
 * and the ledger's per-tenant reuse and avoided prefill. */
#include "rd.h"

#include "kvplane/events_nats.h"

#include <event2/buffer.h>
#include <jansson.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static const char *const state_names[] = {"free", "up", "down", "draining"};
static const char *const err_names[] = {"connect", "5xx", "midstream",
                                        "timeout"};

static void counter(struct evbuffer *b, const char *name, const char *help,
                    uint64_t v) {
  evbuffer_add_printf(b, "# HELP kvplane_routerd_%s %s\n# TYPE kvplane_routerd_%s "
                      "counter\nkvplane_routerd_%s %llu\n", name, help, name,
                      name, (unsigned long long)v);
}

static void hist(struct evbuffer *b, const char *name, const char *help,
                 const kvp_hist *h) {
  kvp_hist_summary m;
  kvp_hist_summarize(h, &m);
  evbuffer_add_printf(b, "# HELP kvplane_routerd_%s %s\n# TYPE kvplane_routerd_%s "
                      "summary\n", name, help, name);
  const double q[] = {0.5, 0.99};
  const uint64_t v[] = {m.p50, m.p99};
  for (int i = 0; i < 2; i++)
    evbuffer_add_printf(b, "kvplane_routerd_%s{quantile=\"%g\"} %.9f\n", name,
                        q[i], (double)v[i] * 1e-9);
  evbuffer_add_printf(b, "kvplane_routerd_%s_sum %.9f\nkvplane_routerd_%s_count "
                      "%llu\n", name, m.mean * (double)m.count * 1e-9, name,
                      (unsigned long long)m.count);
}

/* s->mu held: the loops change these */
static void workers(rd_server *s, struct evbuffer *b) {
  evbuffer_add_printf(b,
      "# HELP kvplane_routerd_worker_requests_total requests per worker: sent, "
      "ok (answered under 400)\n"
      "# TYPE kvplane_routerd_worker_requests_total counter\n"
      "# HELP kvplane_routerd_worker_errors_total failed requests per worker, "
      "by reason (connect, 5xx, midstream, timeout)\n"
      "# TYPE kvplane_routerd_worker_errors_total counter\n"
      "# HELP kvplane_routerd_worker_inflight requests relaying now\n"
      "# TYPE kvplane_routerd_worker_inflight gauge\n"
      "# HELP kvplane_routerd_worker_up routable (1) or not, with its state\n"
      "# TYPE kvplane_routerd_worker_up gauge\n"
      "# HELP kvplane_routerd_worker_load its scraped load and the router's "
      "prefill tokens in flight\n"
      "# TYPE kvplane_routerd_worker_load gauge\n"
      "# HELP kvplane_routerd_worker_scrape_seconds its last /metrics scrape's "
      "duration and the interval scrapes are paced at (routerd.scrape_budget)\n"
      "# TYPE kvplane_routerd_worker_scrape_seconds gauge\n");
  for (uint32_t i = 0; i < s->n_w; i++) {
    const rd_worker *w = &s->w[i];
    if (w->state == RD_W_FREE)
      continue;
    const char *u = w->url;
    uint64_t rq = 0, tok = 0;
    kvp_router_inflight(s->router, w->id, &rq, &tok, NULL);
    evbuffer_add_printf(b,
        "kvplane_routerd_worker_requests_total{worker=\"%s\",result=\"ok\"} %llu\n"
        "kvplane_routerd_worker_requests_total{worker=\"%s\",result=\"sent\"} %llu\n"
        "kvplane_routerd_worker_up{worker=\"%s\",state=\"%s\"} %d\n"
        "kvplane_routerd_worker_inflight{worker=\"%s\"} %llu\n"
        "kvplane_routerd_worker_load{worker=\"%s\",what=\"running\"} %u\n"
        "kvplane_routerd_worker_load{worker=\"%s\",what=\"waiting\"} %u\n"
        "kvplane_routerd_worker_load{worker=\"%s\",what=\"kv_usage\"} %g\n"
        "kvplane_routerd_worker_load{worker=\"%s\",what=\"prefill_tokens_in_flight\"} %llu\n",
        u, (unsigned long long)w->ok, u, (unsigned long long)w->requests, u,
        state_names[w->state], rd_worker_routable(w), u,
        (unsigned long long)w->inflight, u, w->load.running_requests, u,
        w->load.queued_requests, u, w->load.kv_util, u,
        (unsigned long long)tok);
    evbuffer_add_printf(b,
        "kvplane_routerd_worker_scrape_seconds{worker=\"%s\",what=\"duration\"} %g\n"
        "kvplane_routerd_worker_scrape_seconds{worker=\"%s\",what=\"interval\"} %g\n",
        u, w->scrape_s, u, w->scrape_next > w->scrape_sent
                               ? w->scrape_next - w->scrape_sent
                               : s->cfg.scrape_interval_s);
    for (int e = 0; e < 4; e++)
      evbuffer_add_printf(b, "kvplane_routerd_worker_errors_total{worker=\"%s\","
                          "reason=\"%s\"} %llu\n", u, err_names[e],
                          (unsigned long long)w->errors[e]);
  }
}

/* s->mu held: thread 0 destroys a freed slot's subscriber under it */
static void events(rd_server *s, struct evbuffer *b) {
  for (uint32_t i = 0; i < s->n_w; i++) {
    if (s->w[i].state == RD_W_FREE || s->w[i].ev == NULL)
      continue;
    int n = kvp_events_prometheus(s->w[i].ev, NULL, 0);
    char *t = n > 0 ? malloc((size_t)n + 1) : NULL;
    if (t && kvp_events_prometheus(s->w[i].ev, t, (size_t)n + 1) == n)
      evbuffer_add(b, t, (size_t)n);
    free(t);
  }
}

static void js_metrics(rd_server *s, struct evbuffer *b) {
  for (uint32_t i = 0; i < s->n_w; i++) {
    if (s->w[i].state == RD_W_FREE || s->w[i].js == NULL)
      continue;
    int n = kvp_events_js_prometheus(s->w[i].js, NULL, 0);
    char *t = n > 0 ? malloc((size_t)n + 1) : NULL;
    if (t && kvp_events_js_prometheus(s->w[i].js, t, (size_t)n + 1) == n)
      evbuffer_add(b, t, (size_t)n);
    free(t);
  }
}

/* SIGHUP reloads, by the names Prometheus and nginx exporters use (s->mu
 * held: thread 0 writes them under it) */
static void reloads(rd_server *s, struct evbuffer *b) {
  evbuffer_add_printf(b,
      "# HELP kvplane_routerd_config_reloads_total SIGHUP reloads: ok "
      "(applied), refused (the file did not validate: running config kept)\n"
      "# TYPE kvplane_routerd_config_reloads_total counter\n"
      "kvplane_routerd_config_reloads_total{result=\"ok\"} %llu\n"
      "kvplane_routerd_config_reloads_total{result=\"refused\"} %llu\n"
      "# HELP kvplane_routerd_config_last_reload_successful whether the last "
      "reload was applied (1; 1 before any)\n"
      "# TYPE kvplane_routerd_config_last_reload_successful gauge\n"
      "kvplane_routerd_config_last_reload_successful %d\n"
      "# HELP kvplane_routerd_config_last_reload_success_timestamp_seconds "
      "when the running config was applied (start or reload), unix time\n"
      "# TYPE kvplane_routerd_config_last_reload_success_timestamp_seconds "
      "gauge\n"
      "kvplane_routerd_config_last_reload_success_timestamp_seconds %.3f\n"
      "# HELP kvplane_routerd_config_restart_pending whether the applied "
      "config file changed keys that take a restart (running values kept)\n"
      "# TYPE kvplane_routerd_config_restart_pending gauge\n"
      "kvplane_routerd_config_restart_pending %d\n",
      (unsigned long long)s->reloads_ok, (unsigned long long)s->reloads_refused,
      !s->reload_failed, s->config_ok_unix, s->restart_pending);
}

static int ev_write(void *opaque, const char *d, size_t n) {
  return evbuffer_add(opaque, d, n) == 0 ? 0 : -1;
}

/* The loops' counter at offset `off` of rd_counters, summed (each read
 * atomically, not all at one instant, as a scrape of several processes). */
static uint64_t sum_at(rd_server *s, size_t off) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < s->n_loops; i++) {
    atomic_uint_fast64_t *v =
        (atomic_uint_fast64_t *)((char *)&s->loops[i].cnt + off);
    sum += atomic_load_explicit(v, memory_order_relaxed);
  }
  return sum;
}
#define SUM(s, f) sum_at((s), offsetof(rd_counters, f))

/* worker replies read whole (held 5xx, render, scrapes) over
 * routerd.max_upstream_body */
static void upstream_over(rd_server *s, struct evbuffer *b) {
  static const char *const what[] = {"held_5xx", "render", "scrape"};
  evbuffer_add_printf(b, "# HELP kvplane_routerd_upstream_body_over_limit_total "
                      "worker replies over routerd.max_upstream_body (not read "
                      "whole), by what was read\n# TYPE kvplane_routerd_upstream_"
                      "body_over_limit_total counter\n");
  for (int i = 0; i < 3; i++)
    evbuffer_add_printf(b, "kvplane_routerd_upstream_body_over_limit_total{"
                        "what=\"%s\"} %llu\n", what[i], (unsigned long long)
                        atomic_load_explicit(&s->upstream_over[i],
                                             memory_order_relaxed));
}

static void counters(rd_server *s, struct evbuffer *b) {
  counter(b, "requests_total", "generation requests received",
          SUM(s, requests));
  counter(b, "bad_requests_total", "requests rejected as malformed (400)",
          SUM(s, bad_requests));
  counter(b, "no_worker_total", "requests failed: no worker could take them",
          SUM(s, no_worker));
  counter(b, "retries_total", "attempts on a next-best worker",
          SUM(s, retries));
  counter(b, "client_connections_cut_total", "client connections closed: "
          "their request did not arrive whole within client_request_timeout",
          SUM(s, conns_cut));
  counter(b, "client_connections_refused_total", "client connections "
          "answered 503 and closed: over routerd.max_connections",
          SUM(s, conns_refused));
  evbuffer_add_printf(b, "# HELP kvplane_routerd_client_connections open "
                      "client connections (front doors)\n# TYPE kvplane_"
                      "routerd_client_connections gauge\nkvplane_routerd_"
                      "client_connections %llu\n",
                      (unsigned long long)SUM(s, conns_open));
  counter(b, "overloaded_total", "requests answered 503: over "
          "routerd.max_inflight", SUM(s, overloaded));
  counter(b, "client_cancels_total", "clients gone before the end",
          SUM(s, client_cancels));
  counter(b, "stream_pauses_total", "times a reply's worker was not read "
          "while the client had more than routerd.stream_buffer unsent",
          SUM(s, stream_pauses));
  counter(b, "render_calls_total", "render calls to a worker",
          SUM(s, render_calls));
  counter(b, "render_failures_total", "render calls that gave no token ids "
          "(approximate text mode)", SUM(s, render_fail));
  counter(b, "token_mode_total", "requests routed on token ids",
          SUM(s, token_mode));
  counter(b, "text_mode_total", "requests routed on approximate text chunks",
          SUM(s, text_mode));
  counter(b, "tenant_salted_total", "requests given their tenant's salt",
          SUM(s, tenant_salted));
  counter(b, "predicted_cached_tokens_total", "prefix tokens the router "
          "expected the worker to reuse", SUM(s, predicted_cached));
  counter(b, "reported_cached_tokens_total", "cached tokens the workers "
          "reported (usage.prompt_tokens_details)", SUM(s, reported_cached));
  counter(b, "reported_responses_total", "responses that reported cached "
          "tokens", SUM(s, reported_n));
  evbuffer_add_printf(b, "# HELP kvplane_routerd_decisions_total routing "
                      "decisions by reason\n# TYPE kvplane_routerd_decisions_"
                      "total counter\n");
  for (int r = 0; r < KVP_REASON_COUNT_; r++)
    evbuffer_add_printf(b, "kvplane_routerd_decisions_total{reason=\"%s\"} %llu\n",
                        kvp_reason_name((kvp_reason)r),
                        (unsigned long long)sum_at(s, offsetof(rd_counters, reasons) +
                                                  (size_t)r * sizeof(atomic_uint_fast64_t)));
}

/* Requests per front-door loop: how the kernel spread the connections. */
static void threads(rd_server *s, struct evbuffer *b) {
  evbuffer_add_printf(b, "# HELP kvplane_routerd_thread_requests_total "
                      "generation requests received, by front-door thread\n"
                      "# TYPE kvplane_routerd_thread_requests_total counter\n");
  for (uint32_t i = 0; i < s->n_loops; i++)
    evbuffer_add_printf(b, "kvplane_routerd_thread_requests_total{thread="
                        "\"%u\"} %llu\n", i, (unsigned long long)
                        atomic_load_explicit(&s->loops[i].cnt.requests,
                                             memory_order_relaxed));
}

/* The loops' histograms merged, each under its own lock. */
static void hists(rd_server *s, struct evbuffer *b) {
  kvp_hist *h[4] = {NULL, NULL, NULL, NULL};
  for (int k = 0; k < 4; k++)
    if (kvp_hist_create(NULL, &h[k]) < 0)
      goto out;
  for (uint32_t i = 0; i < s->n_loops; i++) {
    rd_loop *l = &s->loops[i];
    pthread_mutex_lock(&l->hmu);
    kvp_hist_merge(h[0], l->h_render);
    kvp_hist_merge(h[1], l->h_route);
    kvp_hist_merge(h[2], l->h_wait);
    kvp_hist_merge(h[3], l->h_held);
    pthread_mutex_unlock(&l->hmu);
  }
  hist(b, "render_seconds", "render call time", h[0]);
  hist(b, "route_seconds", "hash + index + decision time", h[1]);
  hist(b, "route_lock_wait_seconds", "a decision's wait for the routing "
       "lock (the front-door loops contend on it)", h[2]);
  hist(b, "route_lock_held_seconds", "the routing lock held for a decision",
       h[3]);
out:
  for (int k = 0; k < 4; k++)
    kvp_hist_destroy(h[k]);
}

/* ---- exposition text: one HELP and TYPE per family, families whole ------
 * The parts above (and the events and ledger modules' own writers) emit a
 * family per worker or per part; the text format wants each family once,
 * its samples together (promtool check metrics). */
typedef struct fam {
  const char *help, *type; /* the line's text after the name; NULL none */
  int help_len, type_len;
  struct evbuffer *samples;
} fam;

typedef struct fams {
  json_t *by_name; /* name -> index */
  fam *f;
  size_t n, cap;
  char **names;
} fams;

static fam *fam_get(fams *F, const char *name, size_t len, bool create) {
  char key[256];
  if (len >= sizeof key)
    len = sizeof key - 1;
  memcpy(key, name, len);
  key[len] = '\0';
  json_t *i = json_object_get(F->by_name, key);
  if (i || !create)
    return i ? &F->f[json_integer_value(i)] : NULL;
  if (F->n == F->cap) {
    size_t nc = F->cap ? 2 * F->cap : 64;
    fam *f = realloc(F->f, nc * sizeof *f);
    char **nm = f ? realloc(F->names, nc * sizeof *nm) : NULL;
    if (f)
      F->f = f;
    if (nm == NULL)
      return NULL;
    F->names = nm;
    F->cap = nc;
  }
  fam *f = &F->f[F->n];
  memset(f, 0, sizeof *f);
  if ((f->samples = evbuffer_new()) == NULL ||
      (F->names[F->n] = strdup(key)) == NULL) {
    if (f->samples)
      evbuffer_free(f->samples);
    return NULL;
  }
  json_object_set_new(F->by_name, key, json_integer((json_int_t)F->n));
  F->n++;
  return f;
}

/* a sample's family: its own name, or the summary / histogram it is the
 * _sum, _count or _bucket of */
static fam *sample_fam(fams *F, const char *name, size_t len) {
  static const char *const sfx[] = {"_sum", "_count", "_bucket"};
  fam *f = fam_get(F, name, len, false);
  for (int i = 0; f == NULL && i < 3; i++) {
    size_t k = strlen(sfx[i]);
    if (len > k && memcmp(name + len - k, sfx[i], k) == 0)
      f = fam_get(F, name, len - k, false);
  }
  return f ? f : fam_get(F, name, len, true);
}

static void take_line(fams *F, const char *p, size_t n) {
  bool help = n > 7 && memcmp(p, "# HELP ", 7) == 0;
  bool type = n > 7 && memcmp(p, "# TYPE ", 7) == 0;
  if (help || type) {
    const char *nm = p + 7, *sp = memchr(nm, ' ', n - 7);
    size_t nl = sp ? (size_t)(sp - nm) : n - 7;
    fam *f = fam_get(F, nm, nl, true);
    const char *t = sp ? sp + 1 : p + n;
    int tl = (int)(p + n - t);
    if (f && help && f->help == NULL)
      f->help = t, f->help_len = tl;
    else if (f && type && f->type == NULL)
      f->type = t, f->type_len = tl;
    return;
  }
  if (n == 0 || *p == '#')
    return;
  size_t nl = strcspn(p, "{ ");
  fam *f = sample_fam(F, p, nl < n ? nl : n);
  if (f) {
    evbuffer_add(f->samples, p, n);
    evbuffer_add(f->samples, "\n", 1);
  }
}

static void regroup(struct evbuffer *raw, struct evbuffer *b) {
  fams F = {.by_name = json_object()};
  size_t len = evbuffer_get_length(raw);
  const char *t = len ? (const char *)evbuffer_pullup(raw, -1) : "";
  for (size_t i = 0; F.by_name && t && i < len;) {
    const char *e = memchr(t + i, '\n', len - i);
    size_t n = e ? (size_t)(e - (t + i)) : len - i;
    take_line(&F, t + i, n);
    i += n + 1;
  }
  for (size_t i = 0; i < F.n; i++) {
    fam *f = &F.f[i];
    if (f->help)
      evbuffer_add_printf(b, "# HELP %s %.*s\n", F.names[i], f->help_len,
                          f->help);
    else /* the parts without their own: see docs/routerd.md#metrics */
      evbuffer_add_printf(b, "# HELP %s kvplane (docs/routerd.md#metrics)\n",
                          F.names[i]);
    if (f->type)
      evbuffer_add_printf(b, "# TYPE %s %.*s\n", F.names[i], f->type_len,
                          f->type);
    evbuffer_add_buffer(b, f->samples);
    evbuffer_free(f->samples);
    free(F.names[i]);
  }
  free(F.f);
  free(F.names);
  json_decref(F.by_name);
}

void rd_metrics_write(rd_server *s, struct evbuffer *out) {
  struct evbuffer *b = evbuffer_new();
  if (b == NULL)
    return;
  counters(s, b);
  threads(s, b);
  upstream_over(s, b);
  evbuffer_add_printf(b, "# HELP kvplane_routerd_inflight upstream requests "
                      "now, every loop's\n# TYPE kvplane_routerd_inflight gauge\n"
                      "kvplane_routerd_inflight %llu\n",
                      (unsigned long long)atomic_load_explicit(
                          &s->inflight, memory_order_relaxed));
  hists(s, b);
  rd_lock(s); /* the workers' state, the reload counters, the subscribers */
  reloads(s, b);
  workers(s, b);
  events(s, b);
  js_metrics(s, b);
  rd_unlock(s);
  rd_sync_metrics(s, b); /* replicas (any loop: see rd_sync_metrics) */
  if (s->cfg.pd) /* P/D's counters and roles (takes s->mu itself) */
    rd_pd_metrics(s, b);
  kvp_ledger_prometheus_write(s->ledger, ev_write, b);
  regroup(b, out);
  evbuffer_free(b);
}
