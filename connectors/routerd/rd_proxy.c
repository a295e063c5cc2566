/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd front door: an OpenAI request is parsed (rd_req.c), its
 * token ids found (as sent, the worker's render endpoint, or approximate
 * character chunks), hashed into block keys, routed (kvp_router_route over
 * the index the KV events feed) and relayed to the chosen worker with its
 * body unchanged (a tenant's cache_salt aside).  Connect errors and 5xx
 * before the first byte go to the next-best worker; after it, the stream
 * ends with an error event.  P/D (workers.roles): a prefill leg first, its
 * answer read whole, then the decode leg relayed (docs/routerd.md#pd). */
#include "rd.h"
#include "rd_idx_req.h"
#include "kvplane/text.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

typedef struct rd_call {
  rd_server *s;
  rd_loop *l; /* the front door it came through: its thread runs it all */
  struct evhttp_request *hr; /* the client's; NULL once it is gone */
  rd_req q;
  char *body; /* forwarded */
  size_t body_len;
  char path[64];
  char tenant[RD_REQ_ID_MAX], session[RD_REQ_ID_MAX], salt[RD_SALT_MAX];
  char client_rid[RD_REQ_ID_MAX]; /* the client's X-Request-Id, "" if none
                                   * or longer than RD_ID_MAX (not cut) */
  char *auth; /* the client's Authorization (any length), or NULL */
  bool text_mode, completed, started, paused, done;
  bool rendering;    /* the upstream request is the render call */
  struct event *ct;  /* connect_timeout while c->uc connects, or NULL */
  int lora; /* the adapter it names (index in s->lora), -1 none */
  kvp_key *keys;
  size_t n_keys;
  kvp_decision d;
  char d_url[RD_URL_MAX]; /* d.worker's url, copied under s->mu (replicas) */
  uint32_t tried[RD_WORKERS_MAX / 32];
  uint32_t attempts;
  rd_worker *w; /* current upstream */
  struct evhttp_connection *uc;
  struct evhttp_request *ur;
  int code;
  enum evhttp_request_error uerr;
  bool uerr_set;
  struct evbuffer *held; /* a 5xx body kept while a retry is possible */
  bool held_over;        /* ... it went over max_upstream_body: dropped */
  char tail[256];        /* last relayed bytes: usage.cached_tokens */
  size_t tail_len;
  double t0, t_first, t_render;
  /* P/D (docs/routerd.md#pd): the leg being served (BOTH: no split) and
   * what the prefill leg left for the decode leg */
  rd_role leg;
  struct {
    char *body; /* the client's body (salted) */
    size_t body_len;
    uint64_t prompt; /* the prompt's tokens (route's) */
    kvp_decision pre; /* the prefill choice */
    char pre_url[RD_URL_MAX];
    uint32_t pre_attempts;
    double t_prefill; /* its answer came, s after t0 */
    rd_pd_params params; /* its kv_transfer_params */
    uint32_t out_tokens; /* the client's max_tokens (16 when not given) */
    bool kv_held; /* prompt counted in c->w's pd_decode_tokens */
    /* X-Request-Id on both legs: the client's, else one made up; vLLM takes
     * it as the request's id, which older NIXL connectors match between
     * the prefill and the decode instance (toy_proxy_server.py sends one) */
    char xrid[RD_REQ_ID_MAX];
  } pd;
} rd_call;

static void try_next(rd_call *c);
static void decode_leg(rd_call *c, const char *params);

void rd_reply_json(struct evhttp_request *hr, int code, const char *j) {
  struct evbuffer *b = evbuffer_new();
  if (b && j)
    evbuffer_add(b, j, strlen(j));
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type",
                    "application/json");
  evhttp_send_reply(hr, j ? code : 500, NULL, b); /* NULL: code's phrase */
  if (b)
    evbuffer_free(b);
}

void rd_reply_obj(struct evhttp_request *hr, int code, json_t *o) {
  char *j = o ? json_dumps(o, JSON_COMPACT) : NULL;
  json_decref(o);
  rd_reply_json(hr, code, j);
  free(j);
}

/* RFC 9112 section 6.3: a request with two Content-Length headers, or one
 * with Transfer-Encoding, is framed ambiguously (a proxy in front may have
 * read another body than libevent, which takes the first length or the
 * chunks): 400 and the connection closed, so the rest is never read as a
 * request of its own (smuggling). */
bool rd_framing_ok(struct evhttp_request *hr) {
  struct evkeyvalq *h = evhttp_request_get_input_headers(hr);
  int n_cl = 0;
  bool te = false;
  for (struct evkeyval *kv = h->tqh_first; kv; kv = kv->next.tqe_next) {
    n_cl += strcasecmp(kv->key, "Content-Length") == 0;
    te = te || strcasecmp(kv->key, "Transfer-Encoding") == 0;
  }
  if (n_cl <= 1 && !(te && n_cl))
    return true;
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Connection",
                    "close");
  rd_reply_error(hr, 400, "", n_cl > 1 ? "more than one Content-Length header"
                 : "Content-Length together with Transfer-Encoding (RFC 9112 "
                   "section 6.3)");
  return false;
}

void rd_reply_error(struct evhttp_request *hr, int status, const char *param,
                    const char *msg) {
  char *j = rd_error_json(status, param, msg);
  rd_reply_json(hr, status, j);
  free(j);
}

/* ---- lifetime ---------------------------------------------------------------- */
static void call_free(rd_call *c);
static void upstream_end(rd_call *c);

/* The client hung up while its request waited on a worker (render or the
 * request itself): cancelling resets that connection, so the worker sees
 * the disconnect and aborts the request, as vLLM does. */
static void on_client_gone(struct evhttp_connection *cn, void *arg) {
  (void)cn;
  rd_call *c = arg;
  /* libevent detaches a request whose reply was not finished from its dead
   * connection and leaves it to us (evhttp_connection_incoming_fail):
   * freed here, or it leaks (LeakSanitizer saw it) */
  if (c->hr && evhttp_request_get_connection(c->hr) == NULL)
    evhttp_request_free(c->hr);
  c->hr = NULL;
  RD_COUNT(c->l, client_cancels, 1);
  if (c->ur == NULL)
    return;
  evhttp_cancel_request(c->ur);
  upstream_end(c);
  call_free(c);
}

static void complete_once(rd_call *c);

static void call_free(rd_call *c) {
  complete_once(c);
  if (c->held)
    evbuffer_free(c->held);
  if (c->ct)
    event_free(c->ct);
  rd_req_free(&c->q);
  atomic_fetch_sub_explicit(&c->s->calls, 1, memory_order_relaxed);
  free(c->auth);
  free(c->body);
  free(c->pd.body);
  free(c->keys);
  free(c);
}

static void finish_client(rd_call *c, int status, const char *msg) {
  if (c->hr && !c->started)
    rd_reply_error(c->hr, status, "", msg);
  else if (c->hr && c->started) {
    if (c->q.stream) { /* the stream ends with an error event */
      struct evbuffer *b = evbuffer_new();
      char *j = rd_error_json(status, "", msg);
      if (b && j) {
        evbuffer_add_printf(b, "data: %s\n\n", j);
        evhttp_send_reply_chunk(c->hr, b);
      }
      free(j);
      if (b)
        evbuffer_free(b);
    }
    evhttp_send_reply_end(c->hr);
  }
  c->hr = NULL;
}

/* ---- receipts and the ledger ---------------------------------------------------- */
static uint64_t scan_cached(const char *t, size_t n, bool *found) {
  static const char key[] = "\"cached_tokens\":";
  const char *last = NULL;
  for (const char *p = t; (p = memmem(p, (size_t)(t + n - p), key,
                                      sizeof key - 1)) != NULL;
       p++)
    last = p;
  if (last == NULL)
    return 0;
  const char *v = last + sizeof key - 1;
  while (v < t + n && *v == ' ')
    v++;
  uint64_t x = 0;
  bool digit = false;
  for (; v < t + n && *v >= '0' && *v <= '9'; v++, digit = true)
    x = x * 10 + (uint64_t)(*v - '0');
  *found = digit;
  return x;
}

static void keep_tail(rd_call *c, struct evbuffer *b) {
  size_t n = evbuffer_get_length(b), keep = sizeof c->tail;
  if (n >= keep) {
    struct evbuffer_ptr p;
    evbuffer_ptr_set(b, &p, n - keep, EVBUFFER_PTR_SET);
    evbuffer_copyout_from(b, &p, c->tail, keep);
    c->tail_len = keep;
    return;
  }
  size_t drop = c->tail_len + n > keep ? c->tail_len + n - keep : 0;
  memmove(c->tail, c->tail + drop, c->tail_len - drop);
  c->tail_len -= drop;
  evbuffer_copyout(b, c->tail + c->tail_len, n);
  c->tail_len += n;
}

static bool receipts_on(rd_server *s) {
  pthread_mutex_lock(&s->rc_mu);
  bool on = s->receipts != NULL;
  pthread_mutex_unlock(&s->rc_mu);
  return on;
}

/* P/D: the receipt's "pd" member (both choices, the transfer predicted
 * and offered), "" outside P/D.  The main receipt is the leg's that
 * answered the client (the decode leg's, or a prefill leg's refusal). */
static void pd_receipt(const rd_call *c, char *out, size_t cap) {
  const kvp_decision *pre = c->leg == RD_ROLE_DECODE ? &c->pd.pre : &c->d;
  if (c->leg == RD_ROLE_BOTH)
    return;
  int n = snprintf(
      out, cap,
      "\"pd\":{\"leg\":\"%s\",\"prefill_worker\":\"%s\",\"prefill_attempts\":%u,"
      "\"prefill_s\":%.6f,\"prefill_reason\":\"%s\",\"prefill_cached_tokens\":"
      "%llu,\"prefill_uncached_tokens\":%llu,\"offered_blocks\":%u,"
      "\"transfer_predicted_tokens\":%llu,\"transfer_predicted_bytes\":%llu,"
      "\"transfer_predicted_s\":%.6f,\"decode_local_tokens\":%llu},",
      c->leg == RD_ROLE_DECODE ? "decode" : "prefill",
      c->leg == RD_ROLE_DECODE ? c->pd.pre_url : c->w ? c->w->url : "",
      c->leg == RD_ROLE_DECODE ? c->pd.pre_attempts : c->attempts,
      c->pd.t_prefill, kvp_reason_name((kvp_reason)pre->reason),
      (unsigned long long)pre->avoided_tokens,
      (unsigned long long)pre->uncached_tokens, c->pd.params.n_blocks,
      (unsigned long long)(c->leg == RD_ROLE_DECODE
                               ? c->d.reused_tier_tokens[KVP_TIER_REMOTE] : 0),
      (unsigned long long)(c->leg == RD_ROLE_DECODE
                               ? c->d.load_bytes[KVP_TIER_REMOTE] : 0),
      c->leg == RD_ROLE_DECODE ? c->d.load_s : 0,
      (unsigned long long)(c->leg == RD_ROLE_DECODE
                               ? c->d.reused_tier_tokens[KVP_TIER_HBM] : 0));
  if (n < 0 || (size_t)n >= cap) /* urls are bounded: never; but not cut */
    *out = '\0';
}

/* One line per receipt, whole: fprintf under rc_mu, which a reload's
 * reopen (rd_reload.c) takes to swap the stream. */
static void receipt(rd_call *c, const kvp_route_names *nm, bool found,
                    uint64_t rep) {
  rd_server *s = c->s;
  char rec[8192];
  int n = receipts_on(s) ? kvp_router_receipt_json(&c->d, nm, rec, sizeof rec)
                         : -1;
  if (n < 0 || (size_t)n >= sizeof rec)
    return;
  char repd[24] = "null", pd[1024] = "", rid[6 * RD_REQ_ID_MAX + 8] = "null";
  if (found)
    snprintf(repd, sizeof repd, "%llu", (unsigned long long)rep);
  pd_receipt(c, pd, sizeof pd);
  if (*c->client_rid) { /* JSON-escaped: any bytes a header may carry */
    kvp_text t;
    kvp_text_init(&t, rid, sizeof rid);
    kvp_text_json_str(&t, c->client_rid);
    if (kvp_text_len(&t) >= sizeof rid) /* \u00XX escapes: 6x; not cut */
      snprintf(rid, sizeof rid, "null");
  }
  pthread_mutex_lock(&s->rc_mu);
  if (s->receipts)
    fprintf(s->receipts,
            "{\"worker\":\"%s\",\"status\":%d,\"attempts\":%u,\"mode\":"
            "\"%s\",\"client_request_id\":%s,\"reported_cached_tokens\":%s,"
            "\"first_byte_s\":%.6f,%s\"receipt\":%s}\n",
            c->w ? c->w->url : "", c->code, c->attempts,
            c->text_mode ? "text" : "tokens", rid, repd,
            c->t_first > 0 ? c->t_first - c->t0 : 0, pd, rec);
  pthread_mutex_unlock(&s->rc_mu);
}

static void account(rd_call *c) {
  bool found = false;
  uint64_t rep = scan_cached(c->tail, c->tail_len, &found);
  RD_COUNT(c->l, predicted_cached, c->leg == RD_ROLE_DECODE
                                        ? c->pd.pre.avoided_tokens
                                        : c->d.avoided_tokens);
  RD_COUNT(c->l, reported_cached, found ? rep : 0);
  RD_COUNT(c->l, reported_n, found);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  kvp_route_names nm = {.tenant = *c->tenant ? c->tenant : NULL,
                        .session = *c->session ? c->session : NULL,
                        .unix_time_ns = (uint64_t)ts.tv_sec * 1000000000u +
                                        (uint64_t)ts.tv_nsec};
  /* P/D: the prefill choice is the one that reused (or computed) */
  const kvp_decision *ld = c->leg == RD_ROLE_DECODE ? &c->pd.pre : &c->d;
  if (c->code < 400) /* served: a refused request reused nothing */
    kvp_ledger_add_decision(c->s->ledger, ld, &nm); /* its own mutex */
  receipt(c, &nm, found, rep);
}

/* ---- the upstream request ------------------------------------------------------- */
static void detach(rd_call *c) {
  if (c->hr)
    rd_guard_on_gone(c->l->guard, c->hr, NULL, NULL);
}

static void complete_once(rd_call *c) {
  if (!c->completed && c->attempts > 0 && c->d.worker != KVP_WORKER_NONE) {
    rd_lock(c->s);
    kvp_router_complete(c->s->router, c->d.worker, c->d.request_id);
    rd_unlock(c->s);
    rd_sync_complete(c->s, c->d_url, c->d.request_id, c->d.uncached_tokens,
                     c->d.session_id);
  }
  c->completed = true;
}

/* The claim on c->w goes last: the slot may be freed right after. */
static void upstream_end(rd_call *c) {
  if (c->ct)
    evtimer_del(c->ct);
  if (c->w && c->pd.kv_held) { /* claim_next's */
    rd_lock(c->s);
    c->w->pd_decode_tokens -= c->pd.prompt;
    rd_unlock(c->s);
    c->pd.kv_held = false;
  }
  if (c->w) {
    if (c->uc) /* back in the pool: no cap on what it relays (render's) */
      evhttp_connection_set_max_body_size(c->uc, -1);
    if (c->uc)
      rd_conn_put(c->l, c->w, c->uc);
    rd_worker_release(c->w);
  }
  c->uc = NULL;
  c->ur = NULL;
}

static void end_call(rd_call *c, int status, const char *msg) {
  detach(c);
  finish_client(c, status, msg);
  call_free(c);
}

static void on_client_drained(struct evhttp_connection *cn, void *arg) {
  (void)cn;
  rd_call *c = arg;
  if (c->paused && c->uc)
    bufferevent_enable(evhttp_connection_get_bufferevent(c->uc), EV_READ);
  c->paused = false;
}

static void relay(rd_call *c, struct evbuffer *in) {
  if (evbuffer_get_length(in) == 0)
    return;
  if (c->t_first == 0) {
    c->t_first = rd_now();
    complete_once(c); /* the first byte: its prefill is over */
  }
  keep_tail(c, in);
  struct bufferevent *cb =
      evhttp_connection_get_bufferevent(evhttp_request_get_connection(c->hr));
  if (evbuffer_get_length(bufferevent_get_output(cb)) > c->l->cfg.stream_buffer &&
      c->uc) { /* backpressure: stop reading the worker until it drains */
    bufferevent_disable(evhttp_connection_get_bufferevent(c->uc), EV_READ);
    RD_COUNT(c->l, stream_pauses, !c->paused);
    c->paused = true;
    evhttp_send_reply_chunk_with_cb(c->hr, in, on_client_drained, c);
  } else
    evhttp_send_reply_chunk(c->hr, in);
  if (c->q.stream) /* a token reaches the client now, not a loop pass later */
    rd_conn_flush(evhttp_request_get_connection(c->hr));
}

static bool can_retry(const rd_call *c) {
  return c->attempts <= c->l->cfg.retries;
}

/* The reply to the client starts with the worker's first body byte, not
 * its headers: a worker that dies after sending headers but before any
 * token (vLLM's streaming replies send them at once) is still retried. */
static int on_up_header(struct evhttp_request *ur, void *arg) {
  rd_call *c = arg;
  c->code = evhttp_request_get_response_code(ur);
  /* a prefill leg's answer is read whole (its kv_transfer_params) */
  if ((c->code >= 500 && can_retry(c)) || c->leg == RD_ROLE_PREFILL)
    c->held = c->held ? c->held : evbuffer_new();
  return c->hr ? 0 : -1;
}

/* P/D: the prefill worker, the transfer predicted (tokens the decode
 * worker lacked) and offered (the prefill's remote_block_ids) */
static void pd_headers(const rd_call *c, struct evkeyvalq *oh) {
  char num[32];
  evhttp_add_header(oh, "x-kvplane-prefill-worker", c->pd.pre_url);
  evhttp_add_header(oh, "x-kvplane-prefill-reason",
                    c->pd.pre_attempts > 1
                        ? "retry"
                        : kvp_reason_name((kvp_reason)c->pd.pre.reason));
  snprintf(num, sizeof num, "%llu",
           (unsigned long long)c->d.reused_tier_tokens[KVP_TIER_REMOTE]);
  evhttp_add_header(oh, "x-kvplane-transfer-predicted-tokens", num);
  snprintf(num, sizeof num, "%u", c->pd.params.n_blocks);
  evhttp_add_header(oh, "x-kvplane-transfer-offered-blocks", num);
}

/* routerd.response_headers: auto sends them except on a tenant's request
 * (they tell what the shared cache holds) */
static bool headers_on(const rd_call *c) {
  int h = c->l->cfg.response_headers;
  return h == RD_HDRS_ON || (h == RD_HDRS_AUTO && *c->tenant == '\0');
}

static void start_reply(rd_call *c, struct evhttp_request *ur) {
  struct evkeyvalq *oh = evhttp_request_get_output_headers(c->hr);
  const char *ct = evhttp_find_header(evhttp_request_get_input_headers(ur),
                                      "Content-Type");
  char num[32];
  evhttp_add_header(oh, "Content-Type", ct ? ct : "application/json");
  if (!headers_on(c)) {
    evhttp_send_reply_start(c->hr, c->code,
                            evhttp_request_get_response_code_line(ur));
    c->started = true;
    return;
  }
  evhttp_add_header(oh, "x-kvplane-worker", c->w->url);
  snprintf(num, sizeof num, "%llu",
           (unsigned long long)(c->leg == RD_ROLE_DECODE
                                    ? c->pd.pre.avoided_tokens
                                    : c->d.avoided_tokens));
  evhttp_add_header(oh, "x-kvplane-cached-tokens", num);
  if (c->leg == RD_ROLE_DECODE)
    pd_headers(c, oh);
  evhttp_add_header(oh, "x-kvplane-reason",
                    c->attempts > 1 ? "retry"
                                    : kvp_reason_name((kvp_reason)c->d.reason));
  evhttp_send_reply_start(c->hr, c->code,
                          evhttp_request_get_response_code_line(ur));
  c->started = true;
}

/* A 5xx body kept for a retry, up to max_upstream_body: past it, dropped
 * (once counted) and the client gets the router's own error instead. */
static void hold(rd_call *c, struct evbuffer *in) {
  size_t n = evbuffer_get_length(in);
  if (!c->held_over &&
      evbuffer_get_length(c->held) + n <= c->l->cfg.max_upstream_body) {
    evbuffer_add_buffer(c->held, in);
    return;
  }
  if (!c->held_over)
    atomic_fetch_add_explicit(&c->s->upstream_over[0], 1, memory_order_relaxed);
  c->held_over = true;
  evbuffer_drain(c->held, evbuffer_get_length(c->held));
  evbuffer_drain(in, n);
}

static void on_up_chunk(struct evhttp_request *ur, void *arg) {
  rd_call *c = arg;
  struct evbuffer *in = evhttp_request_get_input_buffer(ur);
  if (c->held)
    hold(c, in);
  else if (c->hr && evbuffer_get_length(in) > 0) {
    if (!c->started)
      start_reply(c, ur);
    relay(c, in);
  } else
    evbuffer_drain(in, evbuffer_get_length(in));
}

static void on_up_error(enum evhttp_request_error e, void *arg) {
  rd_call *c = arg;
  c->uerr = e;
  c->uerr_set = true;
}

/* After the reply began (midstream) the client's stream ends with an error
 * and the request is accounted (receipt status 502); before it, the next
 * worker is tried. */
static void up_failed(rd_call *c, rd_err_reason why) {
  rd_worker *w = c->w;
  rd_worker_failed(w, c->started ? RD_ERR_MIDSTREAM : why);
  rd_lock(c->s);
  w->retried_away += !c->started;
  rd_unlock(c->s);
  if (c->started) {
    c->code = 502;
    account(c);
  }
  upstream_end(c);
  if (c->started)
    end_call(c, 502, "the worker failed after the reply began");
  else
    try_next(c);
}

static void relay_held(rd_call *c) {
  struct evbuffer *b = c->held;
  c->held = NULL;
  detach(c);
  evhttp_add_header(evhttp_request_get_output_headers(c->hr), "Content-Type",
                    "application/json");
  if (headers_on(c))
    evhttp_add_header(evhttp_request_get_output_headers(c->hr),
                      "x-kvplane-worker", c->w->url);
  evhttp_send_reply(c->hr, c->code, NULL, b);
  evbuffer_free(b);
  c->hr = NULL;
}

/* the client's reply (not started) is the router's error; the call goes on */
static void end_client(rd_call *c, int status, const char *msg) {
  detach(c);
  finish_client(c, status, msg);
}

/* P/D: the prefill worker refused (4xx, or 5xx with no retry left): the
 * client gets its answer, as outside P/D. */
static void prefill_refused(rd_call *c) {
  rd_worker *w = c->w;
  atomic_fetch_add_explicit(&c->s->pd.prefill_refused, 1,
                            memory_order_relaxed);
  if (c->hr && c->held_over) {
    char m[160];
    snprintf(m, sizeof m, "the prefill worker answered %d with a body over "
             "routerd.max_upstream_body", c->code);
    end_client(c, c->code, m);
  } else if (c->hr)
    relay_held(c);
  if (c->code >= 500) {
    rd_lock(c->s);
    w->errors[RD_ERR_5XX]++;
    rd_unlock(c->s);
  } else
    rd_worker_ok(w, false);
  account(c);
  upstream_end(c);
  call_free(c);
}

/* P/D: the prefill worker answered 200 with kv_transfer_params the decode
 * leg cannot use (err): a worker fault -- the next prefill worker, or a 502
 * that says why. */
static void prefill_bad(rd_call *c, const char *err) {
  atomic_fetch_add_explicit(&c->s->pd.bad_params, 1, memory_order_relaxed);
  kvp_log(KVP_LOG_WARN, "routerd", "P/D: prefill worker %s: %s", c->w->url,
          err);
  if (can_retry(c)) {
    up_failed(c, RD_ERR_5XX);
    return;
  }
  char m[512];
  snprintf(m, sizeof m, "the prefill worker %s answered kv_transfer_params "
           "the decode leg cannot use: %s", c->w->url, err);
  rd_worker_failed(c->w, RD_ERR_5XX);
  c->code = 502;
  account(c);
  upstream_end(c);
  end_call(c, 502, m);
}

/* P/D: the prefill leg's whole answer is in c->held. */
static void prefill_done(rd_call *c) {
  if (c->code >= 500 && can_retry(c)) { /* the next prefill worker */
    evbuffer_free(c->held);
    c->held = NULL;
    up_failed(c, RD_ERR_5XX);
    return;
  }
  if (c->code != 200) {
    prefill_refused(c);
    return;
  }
  char err[300] = "the answer is over routerd.max_upstream_body", *params;
  size_t n = evbuffer_get_length(c->held);
  const char *b = n ? (const char *)evbuffer_pullup(c->held, -1) : "";
  int rc = c->held_over || b == NULL
               ? -1
               : rd_pd_take_params(b, n, &c->pd.params, &params, err,
                                   sizeof err);
  evbuffer_free(c->held);
  c->held = NULL;
  c->held_over = false;
  if (rc < 0) {
    prefill_bad(c, err);
    return;
  }
  rd_worker_ok(c->w, true);
  c->pd.pre = c->d;
  snprintf(c->pd.pre_url, sizeof c->pd.pre_url, "%s", c->w->url);
  c->pd.pre_attempts = c->attempts;
  c->pd.t_prefill = rd_now() - c->t0;
  atomic_fetch_add_explicit(&c->s->pd.prefill_ok, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&c->s->pd.offered_blocks, c->pd.params.n_blocks,
                            memory_order_relaxed);
  complete_once(c); /* its prefill is over */
  upstream_end(c);
  decode_leg(c, params);
  free(params);
}

static void on_up_done(struct evhttp_request *ur, void *arg) {
  rd_call *c = arg;
  rd_worker *w = c->w;
  bool ok = ur != NULL && c->code > 0 && !c->uerr_set;
  if (!ok) {
    up_failed(c, c->uerr_set && c->uerr == EVREQ_HTTP_TIMEOUT ? RD_ERR_TIMEOUT
                                                             : RD_ERR_CONNECT);
    return;
  }
  if (c->leg == RD_ROLE_PREFILL) {
    prefill_done(c);
    return;
  }
  if (c->held && can_retry(c)) { /* 5xx before the first byte */
    evbuffer_free(c->held);
    c->held = NULL;
    up_failed(c, RD_ERR_5XX);
    return;
  }
  if (c->held) {
    if (c->hr && c->held_over) {
      char m[160];
      snprintf(m, sizeof m, "the worker answered %d with a body over "
               "routerd.max_upstream_body", c->code);
      end_client(c, c->code, m);
    } else if (c->hr)
      relay_held(c);
    rd_lock(c->s);
    w->errors[RD_ERR_5XX]++;
    rd_unlock(c->s);
  } else if (c->hr) {
    if (!c->started)
      start_reply(c, ur);
    relay(c, evhttp_request_get_input_buffer(ur));
    detach(c);
    struct evhttp_connection *cc = evhttp_request_get_connection(c->hr);
    evhttp_send_reply_end(c->hr);
    c->hr = NULL;
    rd_conn_flush(cc); /* may free the client's request and connection */
  }
  if (c->code < 500) /* up; served only if it did not refuse it */
    rd_worker_ok(w, c->code < 400);
  account(c);
  upstream_end(c);
  call_free(c);
}

/* No request went out: the breaker counts it, before the claim goes. */
static int up_refused(rd_call *c) {
  rd_worker_failed(c->w, RD_ERR_CONNECT);
  upstream_end(c);
  return -1;
}

/* ---- connect_timeout: libevent 2.1 connects under the request's timeout
 * (request_timeout, 600 s), so the router times the connect itself: a timer
 * armed after evhttp_make_request while the socket is not connected yet. */
static bool connected(struct evhttp_connection *cn) {
  evutil_socket_t fd =
      bufferevent_getfd(evhttp_connection_get_bufferevent(cn));
  struct sockaddr_storage a;
  socklen_t n = sizeof a;
  return fd >= 0 && getpeername(fd, (struct sockaddr *)&a, &n) == 0;
}

static void render_failed(rd_call *c);

static void on_connect_timeout(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_call *c = arg;
  if (c->ur == NULL || c->uc == NULL || connected(c->uc))
    return;
  evhttp_cancel_request(c->ur); /* no callback; the connection reset */
  c->ur = NULL;
  evhttp_connection_free(c->uc); /* not back to the pool */
  c->uc = NULL;
  if (c->rendering)
    render_failed(c);
  else
    up_failed(c, RD_ERR_TIMEOUT);
}

static void arm_connect(rd_call *c) {
  if (connected(c->uc))
    return;
  if (c->ct == NULL)
    c->ct = evtimer_new(c->l->base, on_connect_timeout, c);
  struct timeval tv = rd_tv(c->l->cfg.connect_timeout_s);
  if (c->ct)
    evtimer_add(c->ct, &tv);
}

/* w: claimed (claim_next) */
static int start_upstream(rd_call *c, rd_worker *w) {
  c->w = w;
  c->attempts++;
  c->tried[w->id / 32] |= 1u << (w->id % 32);
  c->code = 0;
  c->uerr_set = false;
  c->uc = rd_conn_get(c->l, w);
  c->ur = c->uc ? evhttp_request_new(on_up_done, c) : NULL;
  if (c->ur == NULL)
    return up_refused(c);
  evhttp_request_set_header_cb(c->ur, on_up_header);
  evhttp_request_set_chunked_cb(c->ur, on_up_chunk);
  evhttp_request_set_error_cb(c->ur, on_up_error);
  struct evkeyvalq *h = evhttp_request_get_output_headers(c->ur);
  evhttp_add_header(h, "Host", w->host);
  evhttp_add_header(h, "Content-Type", "application/json");
  if (c->auth)
    evhttp_add_header(h, "Authorization", c->auth);
  if (c->leg != RD_ROLE_BOTH) /* P/D: the same id on both legs */
    evhttp_add_header(h, "X-Request-Id", c->pd.xrid);
  evbuffer_add(evhttp_request_get_output_buffer(c->ur), c->body, c->body_len);
  if (evhttp_make_request(c->uc, c->ur, EVHTTP_REQ_POST, c->path) < 0) {
    c->ur = NULL; /* freed by libevent */
    return up_refused(c);
  }
  rd_conn_nodelay(c->uc);
  rd_conn_flush(c->uc);
  arm_connect(c);
  return 0;
}

static bool untried(const rd_call *c, uint32_t id) {
  return !(c->tried[id / 32] & (1u << (id % 32)));
}

/* The decision's best untried worker still routable, else the next one
 * round robin: claimed (under s->mu, so it cannot go meanwhile). */
static rd_worker *claim_next(rd_call *c) {
  rd_server *s = c->s;
  rd_worker *w = NULL;
  rd_lock(s);
  for (uint32_t i = 0; i < c->d.n_top && w == NULL; i++) {
    uint32_t id = c->d.top[i].worker;
    if (id < s->n_w && untried(c, id) && rd_worker_claim(&s->w[id], true))
      w = &s->w[id];
  }
  for (uint32_t k = 0; k < s->n_w && w == NULL; k++) {
    uint32_t id = (c->l->rr + k) % s->n_w; /* one that has its adapter */
    if (untried(c, id) && rd_worker_serves(&s->w[id], c->lora) &&
        rd_role_serves(&s->w[id], c->leg) &&
        rd_worker_claim(&s->w[id], true))
      w = &s->w[id];
  }
  if (w && c->leg == RD_ROLE_DECODE) { /* its KV, until upstream_end */
    w->pd_decode_tokens += c->pd.prompt;
    c->pd.kv_held = true;
  }
  rd_unlock(s);
  return w;
}

static void try_next(rd_call *c) {
  if (c->attempts > 0)
    complete_once(c);
  while (c->attempts <= c->l->cfg.retries) {
    rd_worker *w = claim_next(c);
    if (w == NULL)
      break;
    RD_COUNT(c->l, retries, c->attempts > 0);
    if (c->attempts > 0 && c->leg != RD_ROLE_BOTH)
      atomic_fetch_add_explicit(c->leg == RD_ROLE_PREFILL
                                    ? &c->s->pd.prefill_retries
                                    : &c->s->pd.decode_retries,
                                1, memory_order_relaxed);
    if (start_upstream(c, w) == 0)
      return;
  }
  RD_COUNT(c->l, no_worker, 1);
  end_call(c, 503, c->leg == RD_ROLE_PREFILL ? "no prefill worker could "
                   "take the request (P/D's first leg)"
                   : c->leg == RD_ROLE_DECODE ? "no decode worker could take "
                   "the request (P/D's second leg)"
                   : "no worker could take the request");
}

/* ---- routing ---------------------------------------------------------------- */
static int hash_into(rd_call *c, kvp_hasher *h, const uint32_t *t, size_t n) {
  size_t bs = kvp_hasher_block_size(h), nb = n / bs;
  c->keys = malloc((nb ? nb : 1) * sizeof *c->keys);
  if (c->keys == NULL)
    return -1;
  /* an adapter's blocks are its own: vLLM hashes its name (and, in 0.33's
   * own modes, its path) into every block */
  const rd_lora *l = c->lora >= 0 ? &c->s->lora[c->lora] : NULL;
  kvp_extras ex = {.cache_salt = *c->salt ? c->salt : NULL,
                   .lora_name = l ? l->name : NULL,
                   .lora_path = l ? l->path : NULL};
  int rc = kvp_hasher_hash(h, t, n, &ex, c->keys, nb, NULL);
  c->n_keys = rc > 0 ? (size_t)rc : 0;
  return rc < 0 ? -1 : 0;
}

/* Text mode: the prompt's bytes are the "tokens" of a separate namespace
 * whose blocks hold 4 x block_size characters (~4 characters per token),
 * so a text block weighs as much as a token block in the cost model. */
#define RD_TEXT_HASH_MAX ((size_t)4 << 20)

static int hash_text(rd_call *c, uint64_t *prompt_tokens) {
  size_t n = c->q.text_len < RD_TEXT_HASH_MAX ? c->q.text_len : RD_TEXT_HASH_MAX;
  uint32_t *t = malloc((n ? n : 1) * sizeof *t);
  if (t == NULL)
    return -1;
  for (size_t i = 0; i < n; i++)
    t[i] = (unsigned char)c->q.text[i];
  int rc = hash_into(c, c->l->text_hasher, t, n);
  free(t);
  uint64_t bs = c->l->cfg.ropts.block_size, est = c->q.text_len / 4;
  *prompt_tokens = est > c->n_keys * bs ? est : c->n_keys * bs;
  return rc;
}

static void hist_record(rd_loop *l, kvp_hist *h, uint64_t ns) {
  pthread_mutex_lock(&l->hmu); /* /metrics merges it from any loop */
  kvp_hist_record(h, ns);
  pthread_mutex_unlock(&l->hmu);
}

/* Step one, outside s->mu: the index's per-worker matches
 * (kvp_router_match: the query is lock-free and most of the routing time);
 * the decision and its in-flight accounting (kvp_router_route_matches,
 * step two) are what s->mu serialises.  A query cannot fail here (<= 256
 * workers, chains cut to KVP_INDEX_CHAIN_MAX); if one did, the request
 * routes on load. */
static size_t query(rd_call *c, const kvp_key *keys, size_t nq, uint64_t now) {
  int got = kvp_router_match(c->s->ix, keys, nq, now, c->s->n_w, c->l->ixm,
                             c->l->wm, c->s->n_w);
  c->d.flags = got < 0 ? KVP_DECISION_NO_INDEX : 0;
  return got > 0 ? (size_t)got : 0;
}

/* The ledger's never_seen vs evicted: how many leading blocks were ever
 * seen (kvp_index_seen_prefix), read only past the longest match -- every
 * block a worker holds or was routed was seen, and the filter costs a
 * random memory read per block (the full walk of a returning 32K-token
 * prompt was 8.5 % of the router's CPU in bench_routerd's 32k cells). */
static void set_seen(kvp_index *ix, kvp_route_request *rq,
                     const kvp_worker_match *wm, size_t nm) {
  uint64_t m = 0;
  for (size_t i = 0; i < nm; i++) {
    uint64_t b = 0;
    for (int t = 0; t < KVP_TIER_COUNT_; t++)
      b += wm[i].blocks[t];
    m = b > m ? b : m;
  }
  m = m < rq->n_blocks ? m : rq->n_blocks;
  size_t seen;
  if (kvp_index_seen_prefix(ix, rq->keys + m, rq->n_blocks - m, &seen) == 0) {
    rq->seen_blocks = (uint32_t)(m + seen);
    rq->flags |= KVP_ROUTE_SEEN;
  }
}

/* P/D: the prompt blocks the decode leg may pull -- those the prefill
 * worker offered, of the nq queried (text mode: its blocks are the
 * router's own, not the engine's: all nq) */
static uint64_t pull_blocks(const rd_call *c, size_t nq) {
  uint64_t n = c->pd.params.n_blocks;
  return c->text_mode || n > nq ? nq : n;
}

/* The decision (under s->mu); *approx: the chosen worker publishes no KV
 * events (read under the lock: the slot is not claimed yet).  The lock's
 * wait and hold times go to /metrics: what more loops would contend on. */
static int decide(rd_call *c, kvp_route_request *rq, uint64_t now,
                  bool *approx) {
  rd_server *s = c->s;
  size_t nq = rq->n_blocks < KVP_INDEX_CHAIN_MAX ? rq->n_blocks
                                                 : KVP_INDEX_CHAIN_MAX;
  size_t nm = query(c, rq->keys, nq, now);
  set_seen(s->ix, rq, c->l->wm, nm);
  uint8_t flags = c->d.flags;
  uint64_t t0 = kvp_now_ns();
  uint64_t elig[RD_WORKERS_MAX / 64];
  rd_lock(s);
  uint64_t t1 = kvp_now_ns();
  rd_sync_turn_over(s, rq->session_id);
  rq->request_id = ++s->next_id;
  /* only the workers that have its adapter loaded (and serve its leg) */
  if (c->lora >= 0 || c->leg != RD_ROLE_BOTH) {
    memset(elig, 0, sizeof elig);
    for (uint32_t w = 0; w < s->n_w; w++)
      elig[w / 64] |= (uint64_t)(rd_worker_serves(&s->w[w], c->lora) &&
                                 rd_role_serves(&s->w[w], c->leg))
                      << (w % 64);
    rq->eligible = elig;
    rq->n_eligible_words = (s->n_w + 63) / 64;
  }
  if (c->leg == RD_ROLE_DECODE) { /* transfer + decode load; the prefix */
    uint64_t dec[RD_WORKERS_MAX / 64];
    rd_pd_decode_eligible(s, c->l->wm, nm, pull_blocks(c, nq), c->pd.prompt,
                          c->pd.out_tokens, dec);
    for (uint32_t i = 0; i < (s->n_w + 63) / 64; i++)
      elig[i] &= dec[i];
    nm = rd_pd_decode_matches(s, c->l->wm, nm, pull_blocks(c, nq));
  }
  rq->flags |= KVP_ROUTE_NOW; /* in-flight prefill runs down (under s->mu:
                                 the clock each decision sees only rises) */
  rq->now_ns = t1;
  int rc = kvp_router_route_matches(s->router, rq, c->l->wm, nm, &c->d);
  *approx = rc == 0 && (c->text_mode || *s->w[c->d.worker].kv_events == '\0');
  if (rc == 0 && s->sync) /* the slot is not claimed yet: copied here */
    snprintf(c->d_url, sizeof c->d_url, "%s", s->w[c->d.worker].url);
  uint64_t t2 = kvp_now_ns();
  rd_unlock(s);
  pthread_mutex_lock(&c->l->hmu);
  kvp_hist_record(c->l->h_wait, t1 - t0);
  kvp_hist_record(c->l->h_held, t2 - t1);
  pthread_mutex_unlock(&c->l->hmu);
  c->d.flags |= rc == 0 ? flags : 0;
  if (rc == 0 && c->l->cfg.ropts.record_routed && /* as kvp_router_route */
      kvp_index_record_routed(s->ix, c->d.worker, rq->keys, nq, now) < 0)
    c->d.flags |= KVP_DECISION_NOT_RECORDED;
  else if (rc == 0 && !*approx && !c->l->cfg.ropts.record_routed &&
           c->leg != RD_ROLE_DECODE && /* its prefill in progress, seen */
           kvp_router_record_pending(s->ix, rq, &c->d,
                                     c->l->cfg.ropts.pending_ms, t1) < 0)
    c->d.flags |= KVP_DECISION_NOT_RECORDED;
  return rc;
}

/* A prompt longer than the router takes (routing.max_blocks blocks) is the
 * client's error: a 400, not the router's refusal as a 500. */
static bool too_long(rd_call *c, uint64_t prompt) {
  uint64_t bs = c->l->cfg.ropts.block_size ? c->l->cfg.ropts.block_size : 16;
  uint64_t mb = c->l->cfg.ropts.max_blocks ? c->l->cfg.ropts.max_blocks
                                           : 1u << 20;
  if (c->n_keys <= mb && prompt <= (mb + 1) * bs)
    return false;
  char m[200];
  snprintf(m, sizeof m, "the prompt is too long: %llu tokens, this router "
           "takes at most %llu (max_blocks %llu x block size %llu)",
           (unsigned long long)prompt, (unsigned long long)(mb * bs),
           (unsigned long long)mb, (unsigned long long)bs);
  RD_COUNT(c->l, bad_requests, 1);
  end_call(c, 400, m);
  return true;
}

/* P/D: a session's prefill choices keep their own affinity, apart from
 * its decode choices (the router remembers one worker per session id) */
#define RD_PD_PREFILL_SESSION 0x9e3779b97f4a7c15ull

/* One leg's choice (the whole request outside P/D), then its first
 * attempt; t0: when routing began (kvp_now_ns). */
static void route_leg(rd_call *c, uint64_t t0) {
  rd_server *s = c->s;
  rd_loop *l = c->l;
  uint64_t sess = *c->session ? kvp_id64(c->session) : 0;
  kvp_route_request rq = {
      .keys = c->keys,
      .n_blocks = c->n_keys,
      .prompt_tokens = c->pd.prompt,
      .session_id = sess && c->leg == RD_ROLE_PREFILL
                        ? sess ^ RD_PD_PREFILL_SESSION : sess,
      .tenant = *c->tenant ? kvp_id64(c->tenant) : 0,
      .block_size = c->text_mode ? 0 : l->cfg.ropts.block_size};
  bool approx;
  int rc = decide(c, &rq, t0, &approx);
  hist_record(l, l->h_route, kvp_now_ns() - t0);
  if (rc < 0) {
    char msg[192];
    snprintf(msg, sizeof msg, "no %sworker %s%s is available",
             c->leg == RD_ROLE_BOTH ? "" : c->leg == RD_ROLE_PREFILL
                                               ? "prefill " : "decode ",
             c->lora >= 0 ? "serving adapter " : "",
             c->lora >= 0 ? s->lora[c->lora].name : "");
    RD_COUNT(l, no_worker, 1);
    end_call(c, rc == KVP_ESTATE ? 503 : 500,
             rc == KVP_ESTATE ? msg : "routing failed (see the log)");
    return;
  }
  RD_COUNT(l, reasons[c->d.reason % KVP_REASON_COUNT_], 1);
  if (c->leg == RD_ROLE_DECODE) {
    atomic_fetch_add_explicit(&s->pd.pred_transfer_tokens,
                              c->d.reused_tier_tokens[KVP_TIER_REMOTE],
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&s->pd.pred_transfer_bytes,
                              c->d.load_bytes[KVP_TIER_REMOTE],
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&s->pd.decode_local_tokens,
                              c->d.reused_tier_tokens[KVP_TIER_HBM],
                              memory_order_relaxed);
  }
  uint32_t id = c->d.worker;
  if (approx) /* approximate residency, shared with the other replicas */
    kvp_index_record_routed(s->ix, id, c->keys, c->n_keys, t0);
  rd_sync_decision(s, c->d_url, &c->d, approx ? c->keys : NULL,
                   approx ? c->n_keys : 0);
  l->rr = id + 1;
  try_next(c);
}

/* P/D: the prefill leg's body replaces the client's, kept for the decode
 * leg.  -1: answered (400: a body jansson cannot re-encode). */
static int pd_begin(rd_call *c, struct evhttp_request *hr) {
  char err[256], *b;
  size_t n;
  const char *id =
      hr ? evhttp_find_header(evhttp_request_get_input_headers(hr),
                              "X-Request-Id")
         : NULL;
  if (id && *id && strlen(id) < sizeof c->pd.xrid &&
      strcspn(id, "\r\n") == strlen(id))
    snprintf(c->pd.xrid, sizeof c->pd.xrid, "%s", id);
  else /* unique per router replica and request */
    snprintf(c->pd.xrid, sizeof c->pd.xrid, "kvplane-pd-%u-%u-%llu-%llx",
             c->l->cfg.ropts.replica_id, c->l->idx,
             (unsigned long long)atomic_load_explicit(&c->l->cnt.requests,
                                                      memory_order_relaxed),
             (unsigned long long)kvp_now_ns());
  if (rd_pd_prefill_body(c->body, c->body_len, &b, &n, err, sizeof err) < 0) {
    RD_COUNT(c->l, bad_requests, 1);
    end_call(c, 400, err);
    return -1;
  }
  c->pd.body = c->body;
  c->pd.body_len = c->body_len;
  c->pd.out_tokens = rd_pd_max_tokens(c->body, c->body_len);
  if (c->pd.out_tokens == 0) /* the OpenAI completions default */
    c->pd.out_tokens = 16;
  c->body = b;
  c->body_len = n;
  c->leg = RD_ROLE_PREFILL;
  atomic_fetch_add_explicit(&c->s->pd.calls, 1, memory_order_relaxed);
  return 0;
}

static void route(rd_call *c) {
  rd_loop *l = c->l;
  uint64_t prompt = c->q.n_tokens, t0 = kvp_now_ns();
  int rc = c->text_mode ? hash_text(c, &prompt)
                        : hash_into(c, l->hasher, c->q.tokens, c->q.n_tokens);
  if (rc < 0) {
    end_call(c, 500, "could not hash the prompt");
    return;
  }
  if (too_long(c, prompt))
    return;
  RD_COUNT(l, text_mode, c->text_mode);
  RD_COUNT(l, token_mode, !c->text_mode);
  c->pd.prompt = prompt;
  if (l->cfg.pd && pd_begin(c, c->hr) < 0)
    return;
  route_leg(c, t0);
}

/* P/D, the prefill leg answered with usable kv_transfer_params (params):
 * the decode leg, with its own choice and its own retries. */
static void decode_leg(rd_call *c, const char *params) {
  char err[256], *b;
  size_t n;
  if (rd_pd_decode_body(c->pd.body, c->pd.body_len, params, &b, &n, err,
                        sizeof err) < 0) {
    end_call(c, 500, err);
    return;
  }
  free(c->body);
  c->body = b;
  c->body_len = n;
  c->leg = RD_ROLE_DECODE;
  c->attempts = 0;
  memset(c->tried, 0, sizeof c->tried);
  c->completed = false;
  c->code = 0;
  c->w = NULL;
  memset(&c->d, 0, sizeof c->d);
  c->d.worker = KVP_WORKER_NONE;
  route_leg(c, kvp_now_ns());
}

/* ---- render: the worker applies the chat template and tokenizes -------------- */
static int take_render_ids(rd_call *c, json_t *o) {
  json_t *r = json_is_array(o) ? json_array_get(o, 0) : o;
  json_t *ids = json_object_get(r, "token_ids");
  size_t n = json_array_size(ids);
  if (!json_is_array(ids))
    return -1;
  c->q.tokens = malloc((n ? n : 1) * sizeof *c->q.tokens);
  if (c->q.tokens == NULL)
    return -1;
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(ids, i);
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) > INT32_MAX)
      return -1;
    c->q.tokens[i] = (uint32_t)json_integer_value(v);
  }
  c->q.n_tokens = n;
  return 0;
}

static void on_render(struct evhttp_request *ur, void *arg) {
  rd_call *c = arg;
  c->rendering = false;
  int code = ur ? evhttp_request_get_response_code(ur) : 0;
  struct evbuffer *in = ur ? evhttp_request_get_input_buffer(ur) : NULL;
  hist_record(c->l, c->l->h_render,
              (uint64_t)((rd_now() - c->t_render) * 1e9));
  bool over = c->uerr_set && c->uerr == EVREQ_HTTP_DATA_TOO_LONG;
  if (over) /* the worker is fine: its reply was too large to read whole */
    atomic_fetch_add_explicit(&c->s->upstream_over[1], 1, memory_order_relaxed);
  if (code == 400 && c->hr) { /* the request itself is bad: say so */
    struct evbuffer *b = evbuffer_new();
    evbuffer_add_buffer(b, in);
    detach(c);
    evhttp_add_header(evhttp_request_get_output_headers(c->hr),
                      "Content-Type", "application/json");
    evhttp_send_reply(c->hr, 400, "Bad Request", b);
    evbuffer_free(b);
    c->hr = NULL;
    RD_COUNT(c->l, bad_requests, 1);
    upstream_end(c);
    call_free(c);
    return;
  }
  json_t *o = code == 200 ? json_loadb((const char *)evbuffer_pullup(in, -1),
                                       evbuffer_get_length(in), 0, NULL)
                          : NULL;
  c->text_mode = o == NULL || take_render_ids(c, o) < 0;
  RD_COUNT(c->l, render_fail, c->text_mode);
  json_decref(o);
  if (code == 0 && !over)
    rd_worker_failed(c->w, RD_ERR_CONNECT);
  upstream_end(c);
  c->w = NULL;
  route(c);
}

static void render(rd_call *c) {
  rd_server *s = c->s;
  rd_loop *l = c->l;
  rd_worker *w = NULL;
  rd_lock(s);
  for (uint32_t k = 0; k < s->n_w && w == NULL; k++) {
    rd_worker *x = &s->w[(l->rr + k) % s->n_w];
    w = rd_worker_serves(x, c->lora) && rd_worker_claim(x, false) ? x : NULL;
  }
  rd_unlock(s);
  l->rr++;
  char path[80];
  snprintf(path, sizeof path, "%s/render", c->path);
  c->w = w;
  c->uc = w ? rd_conn_get(l, w) : NULL;
  c->ur = c->uc ? evhttp_request_new(on_render, c) : NULL;
  if (c->ur == NULL) {
    c->text_mode = true;
    upstream_end(c); /* the connection back, the claim released */
    c->w = NULL;
    route(c);
    return;
  }
  RD_COUNT(l, render_calls, 1);
  c->t_render = rd_now();
  evhttp_request_set_error_cb(c->ur, on_up_error);
  evhttp_connection_set_max_body_size(c->uc,
                                      (ev_ssize_t)l->cfg.max_upstream_body);
  struct evkeyvalq *h = evhttp_request_get_output_headers(c->ur);
  evhttp_add_header(h, "Host", w->host);
  evhttp_add_header(h, "Content-Type", "application/json");
  evbuffer_add(evhttp_request_get_output_buffer(c->ur), c->body, c->body_len);
  if (evhttp_make_request(c->uc, c->ur, EVHTTP_REQ_POST, path) < 0) {
    c->ur = NULL;
    upstream_end(c);
    c->w = NULL;
    c->text_mode = true;
    route(c);
    return;
  }
  rd_conn_nodelay(c->uc);
  c->rendering = true;
  arm_connect(c);
}

/* the render call's worker did not connect within connect_timeout: text
 * mode (the connection already freed) */
static void render_failed(rd_call *c) {
  c->rendering = false;
  c->text_mode = true;
  RD_COUNT(c->l, render_fail, 1);
  rd_worker_failed(c->w, RD_ERR_TIMEOUT);
  upstream_end(c);
  c->w = NULL;
  route(c);
}

/* ---- the front door ------------------------------------------------------------- */
/* header `name` into dst: 0, or -1 when it is longer than RD_ID_MAX
 * bytes (a 400: it is never cut, two long names would merge) */
static int copy_header(struct evhttp_request *hr, const char *name, char *dst,
                       size_t cap) {
  const char *v = name && *name
                      ? evhttp_find_header(evhttp_request_get_input_headers(hr), name)
                      : NULL;
  if (v && strlen(v) >= cap)
    return -1;
  snprintf(dst, cap, "%s", v ? v : "");
  return 0;
}

/* The cache salt (rd_salt_for) of the tenant and the request's own
 * cache_salt goes to the engine too, spliced into the body: neither the
 * engine's cache nor the index can match one tenant's blocks for another's
 * prompt, and no client can name another tenant's salt. */
static int set_body(rd_call *c, char *body, size_t len) {
  if (rd_salt_for(c->s->salt_key, c->tenant, c->q.cache_salt, c->salt,
                  sizeof c->salt) < 0)
    return free(body), -1;
  if (*c->salt) {
    c->body = rd_req_with_salt(body, len, c->salt, &c->body_len);
    free(body);
    RD_COUNT(c->l, tenant_salted, *c->tenant != '\0');
    return c->body ? 0 : -1;
  }
  c->body = body; /* as sent: the copy taken off the socket's buffer */
  c->body_len = len;
  return 0;
}

/* tenant, session (header, else "user") and Authorization into c; -1:
 * replied 400 */
static int take_headers(rd_call *c, struct evhttp_request *hr) {
  const rd_cfg *cf = &c->l->cfg;
  const char *bad = copy_header(hr, cf->tenant_header, c->tenant,
                                sizeof c->tenant) < 0   ? cf->tenant_header
                    : copy_header(hr, cf->session_header, c->session,
                                  sizeof c->session) < 0 ? cf->session_header
                                                         : NULL;
  if (bad) {
    char m[200];
    snprintf(m, sizeof m, "header %s is longer than %d bytes", bad, RD_ID_MAX);
    RD_COUNT(c->l, bad_requests, 1);
    rd_reply_error(hr, 400, bad, m);
    return -1;
  }
  const char *a = evhttp_find_header(evhttp_request_get_input_headers(hr),
                                     "Authorization");
  if (a && (c->auth = strdup(a)) == NULL) {
    rd_reply_error(hr, 500, "", "out of memory");
    return -1;
  }
  if (*c->session == '\0')
    snprintf(c->session, sizeof c->session, "%s", c->q.user);
  if (copy_header(hr, "X-Request-Id", c->client_rid, sizeof c->client_rid) < 0)
    *c->client_rid = '\0'; /* receipts say null; the header still goes on */
  return 0;
}

static void on_generate(rd_loop *l, struct evhttp_request *hr, rd_kind kind,
                        const char *path) {
  rd_server *s = l->s;
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  size_t len = evbuffer_get_length(in);
  /* one copy out of the socket's chains (a pullup, then a copy to keep for
   * retries, was two: ~200 KB each on a 32K-token prompt) */
  char *body = malloc(len + 1);
  rd_call *c = body ? calloc(1, sizeof *c) : NULL;
  rd_req_err er;
  if (c == NULL || evbuffer_copyout(in, body, len) != (ev_ssize_t)len) {
    free(body), free(c);
    rd_reply_error(hr, 500, "", "out of memory");
    return;
  }
  body[len] = '\0';
  c->s = s;
  c->l = l;
  atomic_fetch_add_explicit(&s->calls, 1, memory_order_relaxed);
  c->t0 = rd_now();
  c->d.worker = KVP_WORKER_NONE;
  snprintf(c->path, sizeof c->path, "%s", path);
  RD_COUNT(l, requests, 1);
  if (rd_req_parse(kind, body, len, &c->q, &er) < 0) {
    RD_COUNT(l, bad_requests, 1);
    rd_reply_error(hr, er.status, er.param, er.message);
    free(body);
    call_free(c);
    return;
  }
  if (take_headers(c, hr) < 0) {
    free(body);
    call_free(c);
    return;
  }
  const rd_lora *lo = rd_lora_find(s, c->q.model);
  c->lora = lo ? (int)(lo - s->lora) : -1;
  if (set_body(c, body, len) < 0) {
    rd_reply_error(hr, 500, "", "out of memory");
    call_free(c);
    return;
  }
  c->hr = hr;
  /* a stream's last small writes (its [DONE], the chunked end) must not
   * wait out the client's delayed ACK behind Nagle (~40 ms each) */
  rd_conn_nodelay(evhttp_request_get_connection(hr));
  rd_guard_on_gone(l->guard, hr, on_client_gone, c);
  if (c->q.tokens)
    route(c);
  else if (l->cfg.render)
    render(c);
  else {
    c->text_mode = true;
    route(c);
  }
}

/* every serving worker's models, merged by id (s->mu: thread 0 replaces
 * them) */
static void on_models(rd_server *s, struct evhttp_request *hr) {
  json_t *all = json_array(), *seen = json_object();
  rd_lock(s);
  for (uint32_t i = 0; i < s->n_w; i++) {
    json_t *d = s->w[i].models && rd_worker_routable(&s->w[i])
                    ? json_loads(s->w[i].models, 0, NULL)
                    : NULL;
    size_t k;
    json_t *m;
    json_array_foreach(d, k, m) {
      const char *id = json_string_value(json_object_get(m, "id"));
      if (id && !json_object_get(seen, id)) {
        json_object_set_new(seen, id, json_true());
        json_array_append(all, m);
      }
    }
    json_decref(d);
  }
  rd_unlock(s);
  json_t *o = json_pack("{s:s, s:o}", "object", "list", "data", all);
  char *j = o ? json_dumps(o, JSON_COMPACT) : NULL;
  if (j)
    rd_reply_json(hr, 200, j);
  else
    rd_reply_error(hr, 500, "", "out of memory");
  free(j);
  json_decref(o);
  json_decref(seen);
}

static void on_health(rd_server *s, struct evhttp_request *hr) {
  uint32_t up = 0;
  rd_lock(s);
  for (uint32_t i = 0; i < s->n_w; i++)
    up += rd_worker_routable(&s->w[i]);
  rd_unlock(s);
  if (up > 0 && !s->draining)
    rd_reply_json(hr, 200, "{\"status\":\"ok\"}");
  else
    rd_reply_error(hr, 503, "", s->draining ? "draining" : "no worker is up");
}

static void on_metrics(rd_server *s, struct evhttp_request *hr) {
  struct evbuffer *b = evbuffer_new();
  if (b == NULL)
    return;
  rd_metrics_write(s, b);
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type",
                    "text/plain; version=0.0.4");
  evhttp_send_reply(hr, 200, "OK", b);
  evbuffer_free(b);
}

/* routerd.max_inflight generation requests at once (every loop's): past
 * it a 503 with Retry-After, as nginx's limit_conn answers */
static bool overloaded(rd_loop *l, struct evhttp_request *hr) {
  uint64_t cap = l->cfg.max_inflight;
  if (cap == 0 ||
      atomic_load_explicit(&l->s->calls, memory_order_relaxed) < cap)
    return false;
  RD_COUNT(l, overloaded, 1);
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Retry-After", "1");
  rd_reply_error(hr, 503, "", "too many requests in flight (routerd."
                 "max_inflight): retry shortly");
  return true;
}

void rd_on_http(struct evhttp_request *hr, void *arg) {
  rd_loop *l = arg;
  rd_server *s = l->s;
  if (!rd_guard_begin(l->guard, hr)) {
    evhttp_add_header(evhttp_request_get_output_headers(hr), "Retry-After",
                      "1");
    evhttp_add_header(evhttp_request_get_output_headers(hr), "Connection",
                      "close");
    rd_reply_error(hr, 503, "", "too many client connections (routerd."
                   "max_connections): retry shortly");
    return;
  }
  if (!rd_framing_ok(hr)) {
    RD_COUNT(l, bad_requests, 1);
    return;
  }
  const char *uri = evhttp_request_get_uri(hr);
  size_t plen = strcspn(uri, "?");
  enum evhttp_cmd_type m = evhttp_request_get_command(hr);
  char path[64];
  snprintf(path, sizeof path, "%.*s", (int)(plen < 63 ? plen : 63), uri);
  bool post = m == EVHTTP_REQ_POST, get = m == EVHTTP_REQ_GET;
  if (post && (!strcmp(path, "/v1/completions") ||
               !strcmp(path, "/v1/chat/completions"))) {
    if (s->draining)
      rd_reply_error(hr, 503, "", "the router is shutting down");
    else if (overloaded(l, hr))
      return;
    else
      on_generate(l, hr, path[4] == 'c' && path[5] == 'h' ? RD_CHAT
                                                          : RD_COMPLETIONS,
                  path);
  } else if (get && !strcmp(path, "/v1/models"))
    on_models(s, hr);
  else if (get && !strcmp(path, "/health"))
    on_health(s, hr);
  else if (get && !strcmp(path, "/metrics"))
    on_metrics(s, hr);
  else
    rd_reply_error(hr, 404, "", "no such endpoint");
}
