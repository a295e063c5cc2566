/* SPDX-License-Identifier: Apache-2.0 */
/* `kvplane-bench live`: a trace as real traffic against any
 * OpenAI-compatible endpoint (libevent evhttp client, keep-alive pool per
 * target).  Token-id prompts are synthesised from the trace's block keys
 * (equal keys, equal token blocks; the keys chain, so equal prefixes too),
 * sent at trace time / --speed or --closed-loop N, streamed; TTFT is taken
 * at the first byte of the SSE body, cached tokens from the final usage
 * chunk.  --direct spreads requests round robin over several targets (the
 * no-router baseline).  Results go through the production ledger into the
 * same table / CSV / JSON / HTML as `run`; --compare-offline adds the
 * simulator's row for the same trace and cluster. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>

#include "harness.h"
#include "harness_live.h"

#define MAX_TARGETS 256
#define BUCKETS 48 /* time-series points, as the simulator's default */

typedef struct live_opts {
  const char *targets[MAX_TARGETS];
  uint32_t n_targets;
  bool direct, text, quiet, progress, compare;
  const char *model; /* NULL: the field is omitted (the server's default) */
  double speed, timeout_s;
  double time_scale; /* the engines': arrivals / X, TTFT x X */
  uint32_t closed_loop, retries, vocab;
  const char *out_dir;
  bh_read_opts ro;
  bh_format format;
  uint64_t hbm_blocks; /* --compare-offline: the engines' HBM blocks */
  const char *req_log; /* --req-log PREFIX: per-request JSON lines */
} live_opts;

typedef struct target {
  char host[256];
  uint16_t port;
  char path_prefix[128];
  struct evhttp_connection **idle;
  uint32_t n_idle, cap_idle;
  uint64_t assigned; /* uncached prompt tokens sent here */
  /* --direct: one request at a time between sending and admission (its
   * response headers), later ones held here in order (docs/live.md) */
  bool admitting;
  struct held { uint32_t i, attempt; double due; } *held;
  uint32_t h_head, h_n, h_cap;
} target;

struct live;

typedef struct lreq {
  struct live *L;
  uint32_t i, tgt, attempt;
  struct evhttp_connection *conn;
  double t_send, ttft; /* t_send: when it was due (held or not), plus the
                          time its body took to build */
  struct evbuffer *body; /* SSE bytes received */
  bool got_byte, failed;
  bool gate; /* holds its target's admitting gate */
} lreq;

typedef struct live {
  live_opts o;
  const bh_trace *t;
  struct event_base *base;
  target *tg;
  struct event *tick;
  double t0;
  size_t next, done, inflight;
  uint32_t rr;
  kvp_ledger *led;
  kvp_hist *ttft;
  uint64_t errors, retries, ok;
  uint64_t cached_tokens;
  double lag_sum, lag_max; /* open loop: send time past the trace's, real s */
  char *model_json; /* "\"model\":\"NAME\"" (escaped) or NULL */
  FILE *req_log;    /* --req-log: PREFIX.live.jsonl */
  /* hit rate over time, bucketed as the simulator buckets (by arrival in
   * trace time, or by order in a closed loop) */
  double s_prompt[BUCKETS], s_reused[BUCKETS];
} live;

/* The simulator's bucket_of: trace arrival / the last arrival, or the
 * request's rank when the loop is closed. */
static uint32_t bucket_of(const live *L, uint32_t i) {
  const bh_trace *t = L->t;
  double span = t->n_reqs ? t->reqs[t->n_reqs - 1].t : 0;
  double f = !L->o.closed_loop && span > 0 ? t->reqs[i].t / span
                                           : (double)i / (double)t->n_reqs;
  uint32_t b = (uint32_t)(f * BUCKETS);
  return b < BUCKETS ? b : BUCKETS - 1;
}

static double now_s(void) { return (double)kvp_now_ns() / 1e9; }

/* ---- prompts ---------------------------------------------------------------- */
static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Token j of block key k; tail tokens draw from the request's own seed. */
static uint32_t synth(uint64_t seed, uint64_t j, uint32_t vocab) {
  return 256 + (uint32_t)(mix(seed + j * 0x9E3779B97F4A7C15ull) % (vocab - 256));
}

/* Decimal digits of v at p; returns the end. */
static char *put_u32(char *p, uint32_t v) {
  char tmp[10];
  int n = 0;
  do
    tmp[n++] = (char)('0' + v % 10);
  while ((v /= 10) != 0);
  while (n > 0)
    *p++ = tmp[--n];
  return p;
}

/* Text mode: token t as one printable ASCII byte (the emulated workers'
 * tokenizer is byte-level, so the worker sees exactly these ids), skipping
 * '"' and '\\' so the string needs no escapes. */
static char text_char(uint32_t t) {
  static const char *const abc =
      " !#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[]^_`"
      "abcdefghijklmnopqrstuvwxyz{|}~";
  return abc[t % 93];
}

/* Token k of request q (block tokens from the block key, the tail from the
 * request's own seed). */
static uint32_t prompt_token(const live *L, const bh_req *q, uint64_t k) {
  const kvp_key *keys = L->t->keys + q->key_off;
  uint32_t bs = L->t->block_size;
  uint64_t b = k / bs;
  return b < q->n_blocks
             ? synth(keys[b].lo ^ mix(keys[b].hi), k % bs, L->o.vocab)
             : synth(mix(0x7461696cull + q->seq), k, L->o.vocab);
}

/* The request body, written directly (a JSON tree of ~100k ids costs the
 * open loop more than the send; arrivals must leave on time): the prompt
 * as token ids, or with --text-prompts as a string of one byte a token
 * (for routers that take text only, as sglang-router's /v1/completions). */
static char *prompt_body(const live *L, uint32_t i) {
  const bh_req *q = &L->t->reqs[i];
  const char *model = L->model_json ? L->model_json : "";
  size_t cap = 256 + strlen(model) + (size_t)q->in_tokens * 11;
  char *s = malloc(cap), *p = s;
  if (s == NULL)
    return NULL;
  p += sprintf(p, "{%s%s\"prompt\":%s", model, model[0] ? "," : "",
               L->o.text ? "\"" : "[");
  for (uint64_t k = 0; k < q->in_tokens; k++) {
    uint32_t tok = prompt_token(L, q, k);
    if (L->o.text) {
      *p++ = text_char(tok);
      continue;
    }
    if (k > 0)
      *p++ = ',';
    p = put_u32(p, tok);
  }
  sprintf(p, "%s,\"max_tokens\":%u,\"stream\":true,\"stream_options\":"
          "{\"include_usage\":true},\"ignore_eos\":true,\"temperature\":0}",
          L->o.text ? "\"" : "]", q->out_tokens ? q->out_tokens : 1);
  return s;
}

/* ---- results ------------------------------------------------------------------ */
/* The usage object of the last SSE event that carries one. */
static json_t *find_usage(struct evbuffer *b) {
  size_t len = evbuffer_get_length(b);
  char *s = malloc(len + 1);
  if (s == NULL)
    return NULL;
  evbuffer_copyout(b, s, len);
  s[len] = '\0';
  json_t *usage = NULL;
  for (char *p = s; (p = strstr(p, "data: {")) != NULL; p++) {
    char *end = strstr(p, "\n\n");
    json_t *o = json_loadb(p + 6, end ? (size_t)(end - p - 6) : strlen(p + 6),
                           0, NULL);
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
      json_decref(usage);
      usage = json_incref(u);
    }
    json_decref(o);
  }
  free(s);
  return usage;
}

/* --req-log: what the client saw, in trace seconds since the first
 * arrival (the engine's and the simulator's lines carry the same i). */
static void log_req(const live *L, const lreq *r, uint64_t prompt,
                    uint64_t cached, uint64_t out) {
  if (L->req_log == NULL)
    return;
  double k = L->o.time_scale, first = L->o.closed_loop || L->t->n_reqs == 0
                                          ? 0
                                          : L->t->reqs[0].t / L->o.speed;
  fprintf(L->req_log,
          "{\"i\":%u,\"w\":%u,\"send\":%.6f,\"ttft\":%.6f,\"e2e\":%.6f,"
          "\"tokens\":%llu,\"cached\":%llu,\"out\":%llu}\n",
          r->i, r->tgt, (r->t_send - L->t0) * k - first, r->ttft * k,
          (now_s() - r->t_send) * k,
          (unsigned long long)prompt, (unsigned long long)cached,
          (unsigned long long)out);
}

static void record(live *L, lreq *r, json_t *usage) {
  const bh_req *q = &L->t->reqs[r->i];
  json_t *pt = json_object_get(usage, "prompt_tokens");
  json_t *ct = json_object_get(json_object_get(usage, "prompt_tokens_details"),
                               "cached_tokens");
  uint64_t prompt = json_is_integer(pt) ? (uint64_t)json_integer_value(pt)
                                        : q->in_tokens;
  uint64_t cached = json_is_integer(ct) ? (uint64_t)json_integer_value(ct) : 0;
  if (cached > prompt)
    cached = prompt;
  kvp_ledger_record rec = {.worker = L->o.direct ? (int32_t)r->tgt : -1,
                           .prompt_tokens = prompt,
                           .reused_tokens = cached,
                           .recomputed_tokens = prompt - cached};
  rec.reused_by_tier[KVP_TIER_HBM] = cached;
  rec.prompt_by_class[KVP_CLASS_VOLATILE] = prompt;
  rec.reused_by_class[KVP_CLASS_VOLATILE] = cached;
  rec.miss_tokens[KVP_MISS_UNKNOWN] = prompt - cached;
  kvp_ledger_add(L->led, &rec);
  kvp_hist_record(L->ttft, (uint64_t)(r->ttft * L->o.time_scale * 1e6 + 0.5));
  L->tg[r->tgt].assigned += prompt - cached;
  L->s_prompt[bucket_of(L, r->i)] += (double)prompt;
  L->s_reused[bucket_of(L, r->i)] += (double)cached;
  L->cached_tokens += cached;
  L->ok++;
  /* the completion tokens (TPOT = (e2e - ttft) / (out - 1), make_live) */
  json_t *co = json_object_get(usage, "completion_tokens");
  log_req(L, r, prompt, cached,
          json_is_integer(co) && json_integer_value(co) >= 0
              ? (uint64_t)json_integer_value(co)
              : 0);
}

/* ---- the client ---------------------------------------------------------------- */
static void send_req(live *L, uint32_t i, uint32_t attempt);
static void send_to(live *L, uint32_t k, uint32_t i, uint32_t attempt,
                    double due);
static void pump(live *L);

static int hold(target *t, uint32_t i, uint32_t attempt, double due) {
  if (t->h_n == t->h_cap) {
    uint32_t nc = t->h_cap ? t->h_cap * 2 : 16;
    struct held *nh = malloc(nc * sizeof *nh);
    if (nh == NULL)
      return KVP_ENOMEM;
    for (uint32_t j = 0; j < t->h_n; j++)
      nh[j] = t->held[(t->h_head + j) % t->h_cap];
    free(t->held);
    t->held = nh;
    t->h_head = 0;
    t->h_cap = nc;
  }
  t->held[(t->h_head + t->h_n++) % t->h_cap] =
      (struct held){.i = i, .attempt = attempt, .due = due};
  return 0;
}

/* r's target admitted it (or it failed): the next held request goes (and
 * the one after it, while a send fails at once). */
static void release(live *L, lreq *r) {
  if (!r->gate)
    return;
  r->gate = false;
  target *t = &L->tg[r->tgt];
  t->admitting = false;
  while (!t->admitting && t->h_n > 0) {
    struct held h = t->held[t->h_head];
    t->h_head = (t->h_head + 1) % t->h_cap;
    t->h_n--;
    L->inflight--; /* counted when held; send_to counts it again */
    send_to(L, r->tgt, h.i, h.attempt, h.due);
  }
}

static int on_headers(struct evhttp_request *hr, void *arg) {
  (void)hr;
  lreq *r = arg;
  release(r->L, r);
  return 0;
}

static struct evhttp_connection *conn_get(live *L, target *t) {
  if (t->n_idle > 0)
    return t->idle[--t->n_idle];
  struct evhttp_connection *c =
      evhttp_connection_base_new(L->base, NULL, t->host, t->port);
  if (c && L->o.timeout_s > 0)
    evhttp_connection_set_timeout(c, (int)ceil(L->o.timeout_s));
  return c;
}

static void conn_put(target *t, struct evhttp_connection *c) {
  if (t->n_idle == t->cap_idle) {
    uint32_t nc = t->cap_idle ? t->cap_idle * 2 : 16;
    struct evhttp_connection **ni = realloc(t->idle, nc * sizeof *ni);
    if (ni == NULL) {
      evhttp_connection_free(c);
      return;
    }
    t->idle = ni;
    t->cap_idle = nc;
  }
  t->idle[t->n_idle++] = c;
}

static void free_conn_later(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  evhttp_connection_free(arg);
}

static void retry_later(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  lreq *r = arg;
  live *L = r->L;
  uint32_t i = r->i, a = r->attempt + 1;
  free(r);
  L->inflight--; /* held since on_done; send_req counts it again */
  send_req(L, i, a);
}

static void finish(live *L, lreq *r, bool keep_conn) {
  if (keep_conn)
    conn_put(&L->tg[r->tgt], r->conn);
  else
    event_base_once(L->base, -1, EV_TIMEOUT, free_conn_later, r->conn, NULL);
  evbuffer_free(r->body);
  r->body = NULL;
}

static void on_chunk(struct evhttp_request *hr, void *arg) {
  lreq *r = arg;
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  if (!r->got_byte && evbuffer_get_length(in) > 0) {
    r->got_byte = true;
    r->ttft = now_s() - r->t_send;
  }
  evbuffer_add_buffer(r->body, in);
}

/* Counted; the first few are printed with what the server said. */
static void report_error(live *L, const lreq *r, int code) {
  if (L->errors++ >= 3)
    return;
  char msg[240] = "";
  size_t n = r->body ? evbuffer_copyout(r->body, msg, sizeof msg - 1) : 0;
  msg[n > 0 ? n : 0] = '\0';
  for (char *c = msg; *c; c++)
    if (*c == '\n')
      *c = ' ';
  fprintf(stderr, "kvplane-bench live: request %u: %s %d%s%s\n", r->i,
          code ? "HTTP" : "connection failed", code, msg[0] ? ": " : "", msg);
}

static void on_done(struct evhttp_request *hr, void *arg) {
  lreq *r = arg;
  live *L = r->L;
  int code = hr ? evhttp_request_get_response_code(hr) : 0;
  if (hr && evbuffer_get_length(evhttp_request_get_input_buffer(hr)) > 0)
    on_chunk(hr, r);
  release(L, r); /* no headers came (a failed connection) */
  bool transient = code == 0 || code == 429 || code >= 500;
  json_t *usage = code == 200 ? find_usage(r->body) : NULL;
  L->inflight--;
  if (transient && r->attempt < L->o.retries) {
    finish(L, r, code != 0);
    L->retries++;
    struct timeval tv = {0, 100000};
    L->inflight++; /* still ours */
    event_base_once(L->base, -1, EV_TIMEOUT, retry_later, r, &tv);
    return;
  }
  if (code == 200 && usage != NULL)
    record(L, r, usage);
  else
    report_error(L, r, code);
  json_decref(usage);
  finish(L, r, code != 0);
  L->done++;
  free(r);
  pump(L);
}

/* The body's last partial segment must not wait for the server's delayed
 * ACK (Nagle): up to 40 ms of TTFT no engine causes.  The socket exists
 * once the request is made (numeric hosts connect at once). */
static void no_delay(struct evhttp_connection *c) {
  struct bufferevent *bev = evhttp_connection_get_bufferevent(c);
  int fd = bev ? bufferevent_getfd(bev) : -1, one = 1;
  if (fd >= 0)
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* With --direct, a worker's requests reach it in the order they were due:
 * each is sent once the one before it to that target was admitted, as the
 * simulator queues requests of one instant (the Mooncake trace's 3-s
 * bursts) in trace order; a body otherwise lands before a longer one sent
 * just ahead of it.  TTFT still counts from when it was due. */
static void send_req(live *L, uint32_t i, uint32_t attempt) {
  uint32_t k = L->o.direct ? L->rr++ % L->o.n_targets : 0;
  target *t = &L->tg[k];
  if (L->o.direct && t->admitting) {
    L->inflight++;
    if (hold(t, i, attempt, now_s()) < 0) {
      L->errors++;
      L->inflight--;
      L->done++;
    }
    return;
  }
  send_to(L, k, i, attempt, now_s());
}

static void send_to(live *L, uint32_t k, uint32_t i, uint32_t attempt,
                    double due) {
  target *t = &L->tg[k];
  lreq *r = calloc(1, sizeof *r);
  double t_build = now_s();
  char *body = prompt_body(L, i);
  due += now_s() - t_build; /* the client's own work is no server's TTFT */
  struct evhttp_connection *c = r && body ? conn_get(L, t) : NULL;
  struct evhttp_request *hr = c ? evhttp_request_new(on_done, r) : NULL;
  L->inflight++;
  if (hr == NULL) {
    L->errors++;
    L->inflight--;
    L->done++;
    if (c)
      conn_put(t, c);
    free(r);
    free(body);
    return;
  }
  *r = (lreq){.L = L, .i = i, .tgt = k, .attempt = attempt, .conn = c,
              .body = evbuffer_new(), .t_send = due,
              .gate = L->o.direct};
  t->admitting = r->gate;
  evhttp_request_set_chunked_cb(hr, on_chunk);
  evhttp_request_set_header_cb(hr, on_headers);
  struct evkeyvalq *h = evhttp_request_get_output_headers(hr);
  char hostport[300], path[256];
  snprintf(hostport, sizeof hostport, "%s:%u", t->host, t->port);
  evhttp_add_header(h, "Host", hostport);
  evhttp_add_header(h, "Content-Type", "application/json");
  evhttp_add_header(h, "Accept", "text/event-stream");
  char rid[16]; /* the trace index, for the engines' --req-log */
  snprintf(rid, sizeof rid, "%u", i);
  evhttp_add_header(h, "X-Request-Id", rid);
  evbuffer_add(evhttp_request_get_output_buffer(hr), body, strlen(body));
  free(body);
  snprintf(path, sizeof path, "%s/v1/completions", t->path_prefix);
  int rc = evhttp_make_request(c, hr, EVHTTP_REQ_POST, path);
  no_delay(c);
  if (rc != 0) {
    /* hr is freed by libevent on failure */
    L->errors++;
    L->inflight--;
    L->done++;
    evbuffer_free(r->body);
    release(L, r);
    free(r);
  }
}

/* ---- arrivals ---------------------------------------------------------------- */
static void progress(const live *L, bool end) {
  if (!L->o.progress)
    return;
  size_t n = L->t->n_reqs;
  int pct = n ? (int)(100.0 * (double)L->done / (double)n) : 100;
  char bar[41];
  for (int j = 0; j < 40; j++)
    bar[j] = j < pct * 40 / 100 ? '#' : '.';
  bar[40] = '\0';
  fprintf(stderr, "\r  %-12s [%s] %3d%% %zu/%zu err %llu%s",
          L->o.direct ? "direct" : "target", bar, pct, L->done, n,
          (unsigned long long)L->errors, end ? "\n" : "");
}

static void on_tick(evutil_socket_t fd, short ev, void *arg);

static void pump(live *L) {
  size_t n = L->t->n_reqs;
  if (L->done == n) {
    event_base_loopexit(L->base, NULL);
    return;
  }
  if (L->done % 16 == 0)
    progress(L, false);
  if (L->o.closed_loop) {
    while (L->next < n && L->inflight < L->o.closed_loop)
      send_req(L, (uint32_t)L->next++, 0);
    return;
  }
  double t = now_s() - L->t0, f = L->o.speed * L->o.time_scale;
  while (L->next < n && L->t->reqs[L->next].t / f <= t) {
    double lag = now_s() - L->t0 - L->t->reqs[L->next].t / f;
    L->lag_sum += lag;
    L->lag_max = fmax(L->lag_max, lag);
    send_req(L, (uint32_t)L->next++, 0);
  }
  if (L->next < n) {
    double wait = L->t->reqs[L->next].t / f - t;
    struct timeval tv = {(time_t)wait,
                         (suseconds_t)((wait - floor(wait)) * 1e6)};
    event_base_update_cache_time(L->base); /* timers start from it */
    evtimer_add(L->tick, &tv);
  }
}

static void on_tick(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  pump(arg);
}

/* ---- options ---------------------------------------------------------------- */
static int parse_url(const char *url, target *t) {
  struct evhttp_uri *u = evhttp_uri_parse(url);
  const char *host = u ? evhttp_uri_get_host(u) : NULL;
  const char *scheme = u ? evhttp_uri_get_scheme(u) : NULL;
  if (host == NULL || scheme == NULL || strcmp(scheme, "http") != 0) {
    if (u)
      evhttp_uri_free(u);
    return -1;
  }
  snprintf(t->host, sizeof t->host, "%s", host);
  int port = evhttp_uri_get_port(u);
  t->port = (uint16_t)(port > 0 ? port : 80);
  const char *p = evhttp_uri_get_path(u);
  snprintf(t->path_prefix, sizeof t->path_prefix, "%s", p ? p : "");
  size_t pl = strlen(t->path_prefix);
  if (pl > 0 && t->path_prefix[pl - 1] == '/')
    t->path_prefix[pl - 1] = '\0';
  evhttp_uri_free(u);
  return 0;
}

static void live_usage(FILE *f) {
  fputs("usage: kvplane-bench live --target URL [--target URL ...] [--direct]\n"
        "         [--engine-file F] [--model NAME] [--speed X]\n"
        "         [--closed-loop N] [--time-scale X] [--limit N] [--retries N]\n"
        "         [--timeout S] [--text-prompts] [--req-log PREFIX] [--vocab N]\n"
        "         [--format F] [--out DIR] [--quiet] [--no-progress]\n"
        "         [--compare-offline --hbm-blocks N] TRACE...\n"
        "Replays TRACE as streamed /v1/completions with token-id prompts\n"
        "(docs/live.md).  --direct: round robin over the targets (no router);\n"
        "else exactly one target (a router).  --engine-file: the targets from\n"
        "`kvplane-bench engine --ready-file`.  --compare-offline: add the\n"
        "offline simulator's round_robin row for the same cluster.\n"
        "--text-prompts: prompts as text, one ASCII byte a token (for\n"
        "byte-level tokenizers, as the emulated workers'; routers that take\n"
        "no token ids).\n"
        "--time-scale X: the engines' (arrivals at trace time / X, TTFTs\n"
        "reported x X, in trace seconds).\n"
        "--vocab N: token ids drawn from [256, N) (default 128256, the\n"
        "emulated workers'; a real engine: ids its model and tokenizer\n"
        "take, e.g. 32767 for bench/live/vllm/tiny_model.py's).\n"
        "--req-log PREFIX: PREFIX.live.jsonl (and PREFIX.offline.jsonl, the\n"
        "simulator's) with one JSON line per request, by trace index.\n", f);
}

static int add_target(live_opts *o, const char *list) {
  char *dup = strdup(list), *save = NULL;
  for (char *s = strtok_r(dup, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
    if (o->n_targets == MAX_TARGETS) {
      free(dup);
      return -1;
    }
    o->targets[o->n_targets++] = strdup(s);
  }
  free(dup);
  return 0;
}

static int engine_file(live_opts *o, const char *path) {
  json_t *j = json_load_file(path, 0, NULL);
  json_t *ws = json_object_get(j, "workers");
  size_t i;
  json_t *w;
  int rc = json_is_array(ws) ? 0 : -1;
  json_array_foreach(ws, i, w) {
    const char *u = json_string_value(json_object_get(w, "url"));
    if (u == NULL || add_target(o, u) < 0)
      rc = -1;
  }
  json_decref(j);
  if (rc < 0)
    fprintf(stderr, "kvplane-bench live: %s: not an engine ready file\n",
            path);
  return rc;
}

static int live_opt(live_opts *o, int c, const char *v) {
  char *end = NULL;
  switch (c) {
  case 'T': return add_target(o, v);
  case 'E': return engine_file(o, v);
  case 'D': o->direct = true; return 0;
  case 'm': o->model = v; return 0;
  case 's': o->speed = strtod(v, &end); return *end || !(o->speed > 0) ? -1 : 0;
  case 'c': o->closed_loop = (uint32_t)strtoul(v, &end, 10); return *end ? -1 : 0;
  case 'l': o->ro.max_requests = strtoull(v, &end, 10); return *end ? -1 : 0;
  case 'r': o->retries = (uint32_t)strtoul(v, &end, 10); return *end ? -1 : 0;
  case 't': o->timeout_s = strtod(v, &end); return *end ? -1 : 0;
  case 'f': return bh_format_parse(v, &o->format);
  case 'o': o->out_dir = v; return 0;
  case 'q': o->quiet = true; return 0;
  case 'P': o->progress = false; return 0;
  case 'C': o->compare = true; return 0;
  case 'x': o->text = true; return 0;
  case 'R': o->req_log = v; return 0;
  case 'B': o->hbm_blocks = strtoull(v, &end, 10); return *end ? -1 : 0;
  case 'V': { /* token ids drawn from [256, N): the served model's vocabulary */
    unsigned long long n = strtoull(v, &end, 10);
    if (*end || v[0] == '-' || n < 512 || n > (1ull << 31))
      return -1;
    o->vocab = (uint32_t)n;
    return 0;
  }
  case 'X': o->time_scale = strtod(v, &end);
            return *end || !(o->time_scale > 0) ? -1 : 0;
  default: return -1;
  }
}

static int live_args(live_opts *o, int argc, char **argv) {
  static const struct option lo[] = {
      {"target", 1, 0, 'T'},       {"engine-file", 1, 0, 'E'},
      {"direct", 0, 0, 'D'},       {"model", 1, 0, 'm'},
      {"speed", 1, 0, 's'},        {"closed-loop", 1, 0, 'c'},
      {"limit", 1, 0, 'l'},        {"retries", 1, 0, 'r'},
      {"timeout", 1, 0, 't'},      {"format", 1, 0, 'f'},
      {"out", 1, 0, 'o'},          {"quiet", 0, 0, 'q'},
      {"no-progress", 0, 0, 'P'},  {"compare-offline", 0, 0, 'C'},
      {"hbm-blocks", 1, 0, 'B'},   {"time-scale", 1, 0, 'X'},
      {"text-prompts", 0, 0, 'x'}, {"req-log", 1, 0, 'R'},
      {"vocab", 1, 0, 'V'},        {"help", 0, 0, 'h'},
      {0, 0, 0, 0}};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    if (c == 'h') {
      live_usage(stdout);
      return 1;
    }
    if (c == '?' || live_opt(o, c, optarg) < 0) {
      if (c != '?')
        fprintf(stderr, "kvplane-bench live: bad value '%s'\n", optarg);
      live_usage(stderr);
      return -1;
    }
  }
  if (optind >= argc || o->n_targets == 0 ||
      (!o->direct && o->n_targets != 1) || (o->compare && !o->direct)) {
    fprintf(stderr, "kvplane-bench live: need TRACE and one --target (a "
                    "router) or --direct with one or more; "
                    "--compare-offline needs --direct\n");
    live_usage(stderr);
    return -1;
  }
  return 0;
}

/* ---- the run ---------------------------------------------------------------- */
struct event_base *bh_live_event_base(void) {
  struct event_config *cfg = event_config_new();
  struct event_base *b = NULL;
  if (cfg && event_config_set_flag(cfg, EVENT_BASE_FLAG_PRECISE_TIMER) == 0)
    b = event_base_new_with_config(cfg);
  if (cfg)
    event_config_free(cfg);
  return b ? b : event_base_new();
}

/* --req-log's files: PREFIX.SIDE.jsonl. */
static FILE *open_log(const char *prefix, const char *side) {
  char p[4096];
  snprintf(p, sizeof p, "%s.%s.jsonl", prefix, side);
  FILE *f = fopen(p, "w");
  if (f == NULL)
    fprintf(stderr, "kvplane-bench live: %s: %s\n", p, strerror(errno));
  return f;
}

static int live_setup(live *L) {
  L->base = bh_live_event_base();
  L->tg = calloc(L->o.n_targets, sizeof *L->tg);
  if (L->base == NULL || L->tg == NULL)
    return KVP_ENOMEM;
  for (uint32_t k = 0; k < L->o.n_targets; k++)
    if (parse_url(L->o.targets[k], &L->tg[k]) < 0) {
      fprintf(stderr, "kvplane-bench live: bad target URL '%s' (http://HOST"
                      ":PORT)\n", L->o.targets[k]);
      return KVP_EINVAL;
    }
  if (L->o.model) {
    json_t *m = json_pack("{s:s}", "model", L->o.model);
    char *d = m ? json_dumps(m, JSON_COMPACT) : NULL; /* {"model":"..."} */
    json_decref(m);
    if (d == NULL)
      return KVP_ENOMEM;
    d[strlen(d) - 1] = '\0';
    L->model_json = strdup(d + 1);
    free(d);
    if (L->model_json == NULL)
      return KVP_ENOMEM;
  }
  L->tick = evtimer_new(L->base, on_tick, L);
  if (L->o.req_log && (L->req_log = open_log(L->o.req_log, "live")) == NULL)
    return -errno;
  int rc = kvp_ledger_create(NULL, NULL, &L->led);
  if (rc >= 0)
    rc = kvp_hist_create(NULL, &L->ttft);
  return L->tick ? rc : KVP_ENOMEM;
}

static void live_teardown(live *L) {
  for (uint32_t k = 0; L->tg && k < L->o.n_targets; k++) {
    for (uint32_t j = 0; j < L->tg[k].n_idle; j++)
      evhttp_connection_free(L->tg[k].idle[j]);
    free(L->tg[k].idle);
    free(L->tg[k].held);
  }
  free(L->tg);
  if (L->tick)
    event_free(L->tick);
  if (L->base)
    event_base_free(L->base);
  kvp_ledger_destroy(L->led);
  free(L->model_json);
  if (L->req_log)
    fclose(L->req_log);
}

/* The live outcome as a bh_result (ttft histogram handed over). */
static void to_result(live *L, bh_result *r, double wall) {
  memset(r, 0, sizeof *r);
  /* not a simulated policy: the report plots tier occupancy (unknown live)
   * of the offline row instead */
  r->policy = BH_POLICY_COUNT;
  snprintf(r->name, sizeof r->name, "%s", L->o.direct ? "live_direct"
                                                      : "live_target");
  kvp_ledger_global_totals(L->led, &r->tot);
  r->requests = r->tot.requests;
  r->ttft_us = L->ttft;
  L->ttft = NULL;
  kvp_hist_summarize(r->ttft_us, &r->ttft);
  r->ttft_p95_s = (double)kvp_hist_quantile(r->ttft_us, 0.95) / 1e6;
  double mx = 0, sum = 0;
  for (uint32_t k = 0; k < L->o.n_targets; k++) {
    sum += (double)L->tg[k].assigned;
    mx = fmax(mx, (double)L->tg[k].assigned);
  }
  r->imbalance = L->o.direct && sum > 0 ? mx / (sum / L->o.n_targets) : NAN;
  r->sim_seconds = wall;
  r->wall_seconds = wall;
  bh_series *se = &r->series; /* hit rate by bucket; occupancy unknown */
  se->n = BUCKETS;
  se->hit = calloc(BUCKETS, sizeof(double));
  for (int k = 0; k < 3; k++)
    se->occ[k] = calloc(BUCKETS, sizeof(double));
  for (uint32_t b = 0; b < BUCKETS; b++) {
    if (se->hit)
      se->hit[b] = L->s_prompt[b] > 0 ? L->s_reused[b] / L->s_prompt[b] : NAN;
    for (int k = 0; k < 3; k++)
      if (se->occ[k])
        se->occ[k][b] = NAN;
  }
  const bh_trace *t = L->t;
  se->t_end = L->o.closed_loop || t->n_reqs == 0
                  ? 0
                  : t->reqs[t->n_reqs - 1].t / L->o.speed;
}

/* The offline simulator on the same trace: round robin over as many
 * workers, HBM only, with the engines' HBM blocks. */
static int offline_row(const live *L, const bh_trace *t, bh_cluster *cl,
                       bh_result *r) {
  bh_sim_opts so = {.cl = *cl, .policy = KVP_POLICY_ROUND_ROBIN,
                    .speed = L->o.speed, .closed_loop = L->o.closed_loop,
                    .seed = 1};
  char err[256];
  if (L->o.req_log && (so.req_log = open_log(L->o.req_log, "offline")) == NULL)
    return -errno;
  int rc = bh_sim_run(t, &so, r, err, sizeof err);
  if (so.req_log)
    fclose(so.req_log);
  if (rc < 0)
    fprintf(stderr, "kvplane-bench live: offline: %s\n", err);
  snprintf(r->name, sizeof r->name, "offline_rr");
  return rc;
}

static int write_reports(const live_opts *o, const bh_run *run) {
  if (mkdir(o->out_dir, 0755) < 0 && errno != EEXIST)
    return -errno;
  char p[4096];
  int rc = 0;
  static const char *const names[] = {"results.csv", "results.json",
                                      "report.html"};
  for (int k = 0; k < 3 && rc >= 0; k++) {
    snprintf(p, sizeof p, "%s/%s", o->out_dir, names[k]);
    FILE *f = fopen(p, "w");
    if (f == NULL)
      return -errno;
    rc = k == 0 ? bh_report_csv(f, run, 1, true)
         : k == 1 ? bh_report_json(f, run, 1)
                  : bh_report_html(f, run, 1);
    if (fclose(f) != 0 && rc >= 0)
      rc = -errno;
  }
  if (!o->quiet)
    printf("HTML report: %s/report.html\nCSV: %s/results.csv  JSON: "
           "%s/results.json\n", o->out_dir, o->out_dir, o->out_dir);
  return rc;
}

static int live_report(live *L, bh_trace *t, double wall) {
  bh_result res[2];
  size_t n = 1;
  bh_cluster cl;
  bh_cluster_defaults(&cl);
  cl.workers = L->o.n_targets;
  cl.dram_gb = cl.nvme_gb = 0;
  cl.hbm_blocks = L->o.hbm_blocks;
  cl.tier_no_classes = true;
  to_result(L, &res[0], wall);
  int rc = 0;
  if (L->o.compare && (rc = offline_row(L, t, &cl, &res[1])) >= 0)
    n = 2;
  bh_cluster_resolve(&cl, t->block_size);
  bh_run run = {.label = "live", .trace = t, .cl = &cl, .res = res,
                .n_res = n};
  if (!L->o.quiet) {
    bh_report_table(stdout, &run);
    printf("live: %llu ok, %llu errors, %llu retries, %.1f s wall",
           (unsigned long long)L->ok, (unsigned long long)L->errors,
           (unsigned long long)L->retries, wall);
    if (!L->o.closed_loop) /* how late requests left, in trace seconds */
      printf("; sent late by %.1f ms mean, %.1f ms max (trace time)",
             1e3 * L->lag_sum / (double)t->n_reqs * L->o.time_scale,
             1e3 * L->lag_max * L->o.time_scale);
    printf("\n");
  }
  if (rc >= 0)
    rc = write_reports(&L->o, &run);
  for (size_t k = 0; k < n; k++)
    bh_result_free(&res[k]);
  return rc;
}

static int read_traces(live *L, bh_trace *t, int argc, char **argv) {
  char err[512];
  for (int k = optind; k < argc; k++) {
    int rc = bh_read_path(argv[k], L->o.format, &L->o.ro, t, err, sizeof err);
    if (rc < 0) {
      fprintf(stderr, "kvplane-bench live: %s\n", err);
      return rc;
    }
  }
  return bh_trace_finish(t);
}

int bh_live_main(int argc, char **argv) {
  live L;
  memset(&L, 0, sizeof L);
  L.o.speed = 1;
  L.o.time_scale = 1;
  L.o.retries = 2;
  L.o.timeout_s = 600;
  L.o.vocab = 128256;
  L.o.out_dir = "kvplane-live-report";
  L.o.progress = isatty(2);
  L.o.ro.quiet = false;
  int rc = live_args(&L.o, argc, argv);
  if (rc != 0)
    return rc > 0 ? 0 : 2;
  signal(SIGPIPE, SIG_IGN);
  bh_trace t;
  bh_trace_init(&t);
  L.t = &t;
  rc = read_traces(&L, &t, argc, argv);
  if (rc >= 0 && t.n_reqs == 0)
    rc = KVP_EINVAL;
  if (rc >= 0)
    rc = live_setup(&L);
  if (rc >= 0) {
    L.t0 = now_s();
    pump(&L);
    event_base_dispatch(L.base);
    progress(&L, true);
    rc = live_report(&L, &t, now_s() - L.t0);
  }
  if (rc < 0)
    fprintf(stderr, "kvplane-bench live: %s\n", kvp_strerror(rc));
  live_teardown(&L);
  kvp_hist_destroy(L.ttft);
  bh_trace_free(&t);
  for (uint32_t k = 0; k < L.o.n_targets; k++)
    free((char *)L.o.targets[k]);
  return rc < 0 ? 1 : (L.errors > 0 ? 3 : 0);
}
