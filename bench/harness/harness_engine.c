/* SPDX-License-Identifier: Apache-2.0 */
/* `kvplane-bench engine`: N emulated vLLM 0.33 workers in one process, each
 * on its own loopback HTTP port (libevent evhttp) with its own KV-event
 * publisher (harness_kvpub.c).  Behind the API: the simulator's block cache
 * and timing model (harness_cache.c) -- a FIFO queue, one prefill at a time,
 * decode under continuous batching up to --max-num-seqs, TTFT = queue +
 * prefill of the uncached tokens + tier load time, all divided by
 * --time-scale.  One thread and one event loop per worker (its own HTTP
 * server, ZeroMQ sockets, cache and timers) and a parser thread beside it
 * (POST bodies parsed and hashed in arrival order, handed back to the
 * loop), so no request's JSON parsing and hashing delays a timer, on its
 * worker or another; the main thread binds nothing, waits for every worker
 * to be bound, announces them and waits for SIGINT / SIGTERM
 * (docs/live.md, "Threads"). */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <zmq.h>

#include "harness_api.h"
#include "harness_api_ids.h"
#include "harness_cache.h"
#include "harness_kvpub.h"
#include "harness_live.h"

#define STREAM_CHUNKS 8 /* decode is streamed in at most this many chunks */

typedef struct eng_opts {
  uint32_t workers;
  const char *host;
  uint32_t port, kv_port; /* first port of each range; 0 = ephemeral */
  const char *model;
  uint32_t block_size;
  double time_scale;
  uint32_t max_num_seqs;
  uint32_t vocab, max_model_len;
  const char *hash_seed; /* PYTHONHASHSEED; NULL = unset */
  const char *kv_topic;
  const char *ready_file;
  const char *req_log; /* --req-log: one JSON line per request */
  /* --lora NAME[=PATH] (vLLM's --lora-modules): adapters beside the base
   * model; PATH (default /loras/NAME) is /v1/models' root and, with the
   * name, in every block's hash (vLLM 0.33's ("lora", name, path)) */
  const char *lora[BH_API_LORA_MAX], *lora_path[BH_API_LORA_MAX];
  size_t n_lora;
  char lora_buf[BH_API_LORA_MAX][2][128];
  bh_cluster cl;
  /* --prefill N --decode M: P/D roles (workers = N + M; 0 0 = no roles) and
   * the modelled KV link between workers (docs/live.md, "P/D") */
  uint32_t n_prefill, n_decode;
  double link_gbps, link_latency_us;
} eng_opts;

struct engine;

typedef struct ereq {
  struct ereq *next; /* queue */
  struct engine *e;
  uint32_t w;
  struct evhttp_request *hr; /* NULL once the client went away */
  bh_api_req a;
  kvp_key *keys;
  uint32_t n_blocks, cut;
  uint64_t cached;     /* prompt tokens served from cache */
  uint32_t sent;       /* completion tokens sent */
  struct event *tm;      /* one timer, re-armed for each phase */
  event_callback_fn phase;
  double decode_s;     /* real seconds */
  /* the schedule, real monotonic seconds: when the request reached the
   * worker (before its body was parsed), and when its prefill ends / its
   * decode began on the emulated GPU -- timers aim at these, so the
   * emulator's own CPU work (JSON, hashing, events) overlaps the GPU time
   * as vLLM's API server process does, instead of adding to it */
  double t_arrive, t_prefill_end, t_decode_start;
  double t_start;      /* the prefill's scheduled start (--req-log) */
  int64_t rid;         /* X-Request-Id when numeric, else -1 (--req-log) */
  uint32_t q_seen;     /* requests ahead of it on arrival (--req-log) */
  uint32_t chunk_no;
  uint32_t chunks_left;
  uint64_t id;
  long created;
  bool started_reply;
  /* the POST on its way through the worker's parser thread (parse_main):
   * the loop hands over kind and body; the parser fills a, keys and
   * n_blocks (a completion to admit) or status and reply (any other
   * answer: render, tokenize, an error) */
  bh_api_kind kind;
  struct evbuffer *body;
  int status;  /* 0: a completion to admit */
  char *reply; /* the body of that answer (NULL: out of memory) */
  bool bad;    /* the request was refused (counted in `failed`) */
  /* P/D: a prefill leg's block ids for the decode leg (its full blocks'
   * cache nodes, as vLLM hands out its block table) */
  uint32_t *kv_ids;
  uint32_t n_kv_ids;
  uint32_t pull_from, pull_to; /* a decode leg's blocks crossing the link */
  double t_pulled; /* ... and when they are in (real s; 0: no pull) */
} ereq;

/* A worker: everything below is touched only by its own thread (setup,
 * loop and teardown); the main thread reads url/kv_ep/replay_ep/port once
 * the worker said it is bound (engine.mu), and joins it. */
typedef struct eworker {
  struct engine *e;
  uint32_t id;
  pthread_t th;
  bool th_started;
  struct event_base *base;
  kvp_hasher *hasher; /* the parser thread's alone */
  struct event *svc, *stop, *parsed;
  /* the parser thread: POST bodies in arrival order (todo, under pmu),
   * parsed and hashed off the loop, handed back in the same order (done,
   * under pmu; the eventfd wakes the loop) */
  pthread_t pth;
  bool pth_started, p_quit;
  pthread_mutex_t pmu;
  pthread_cond_t pcv;
  ereq *todo_head, *todo_tail, *done_head, *done_tail;
  int efd;
  bool stopped; /* the loop ended because the engine stops */
  int rc;       /* setup's, then the loop's */
  struct evhttp *http;
  uint32_t port;
  char url[96], kv_ep[128], replay_ep[128];
  bh_cache c;
  uint32_t *ntok; /* tokens of cached node x: ntok[x * bs ..] */
  uint32_t ntok_cap;
  bh_kvpub *pub;
  ereq *q_head, *q_tail;
  uint32_t q_len;
  ereq *cur; /* in prefill */
  double gpu_free; /* real time the last prefill ended (the schedule) */
  uint32_t decoding;
  uint64_t decode_tokens;
  /* run of new blocks being published as one BlockStored: blocks
   * run_first.. of one request, whose salt (NULL: none) the run borrows;
   * added last block first, [0, run_n) pending (run_flush) */
  uint64_t *run;
  uint32_t *run_node; /* run[i]'s node */
  uint32_t run_n, run_cap, run_first;
  const char *run_salt, *run_lora;
  uint64_t run_parent;
  bool run_has_parent;
  uint32_t *run_tok;
  /* P/D: the engine id its prefill legs name (kv_transfer_params'
   * remote_engine_id; set before the threads start, read-only after) */
  char engine_id[64];
  const char *role; /* "prefill", "decode", "both" */
  /* counters (GET /metrics) */
  uint64_t queries, hits, prompt_tokens, gen_tokens, done, failed;
  uint64_t pd_prefill_legs, pd_decode_legs, kv_pull_blocks, kv_pull_bytes,
      kv_pull_failed;
  uint64_t client_gone; /* requests whose client hung up before the end */
} eworker;

/* Shared by the workers' threads: read-only once they start (options,
 * timing model, API config, the ZeroMQ context, which is thread-safe), the
 * request log (one fprintf a line: stdio locks the FILE), and the few
 * fields under mu. */
typedef struct engine {
  eng_opts o;
  void *zctx;
  eworker *w;
  kvp_router *rt; /* only for the resolved GPU spec (bh_timing_setup) */
  bh_timing tm;
  bh_api_cfg api;
  FILE *req_log;
  int stop_fd[2]; /* the workers watch [0]; closing [1] stops them all */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* a worker finished its setup */
  /* under mu */
  uint32_t n_up;   /* workers whose setup ended (bound or failed) */
  int setup_rc;    /* the first setup failure */
  uint64_t next_id;
  double t_first; /* the first request's arrival (--req-log's zero); set
                   * once under mu by the first admission, read after the
                   * reader's own admission took mu */
} engine;

/* ---- residency events ---------------------------------------------------- */
static const char *medium_of(int tier) {
  return tier == KVP_TIER_HBM ? "GPU" : tier == KVP_TIER_DRAM ? "CPU"
                                                              : "STORAGE";
}

static int ntok_fit(eworker *x) {
  if (x->c.cap_nodes <= x->ntok_cap)
    return 0;
  size_t bs = x->e->o.block_size;
  uint32_t *n = realloc(x->ntok, (size_t)x->c.cap_nodes * bs * sizeof *n);
  if (n == NULL)
    return KVP_ENOMEM;
  x->ntok = n;
  x->ntok_cap = x->c.cap_nodes;
  return 0;
}

/* vLLM numbers adapters from 1 (lora_int_id); 0 = the base model */
static int64_t lora_id(const engine *e, const char *name) {
  for (size_t i = 0; name != NULL && i < e->o.n_lora; i++)
    if (e->o.lora[i] == name)
      return (int64_t)i + 1;
  return 0;
}

static const char *lora_path(const engine *e, const char *name) {
  int64_t id = lora_id(e, name);
  return id > 0 ? e->o.lora_path[id - 1] : NULL;
}

/* The pending run (the simulator's flush_run): a request's new blocks
 * enter HBM last block first and are announced in chain order when a
 * resident block (their parent) or the loop's end closes the run.  A
 * pending block that leaves HBM first is never announced, nor its removal
 * from HBM (the cache knows it unannounced); its demotion is.  So the run
 * goes out as the pieces of it still pending, one BlockStored each, whose
 * parent is the chain block before it (under LRU: one piece). */
static int run_flush(eworker *x) {
  uint32_t n = x->run_n, bs = x->e->o.block_size;
  x->run_n = 0;
  if (n == 0)
    return 0;
  for (uint32_t i = 0, j = n - 1; i < j; i++, j--) { /* chain order */
    uint64_t t = x->run[i];
    x->run[i] = x->run[j];
    x->run[j] = t;
    uint32_t u = x->run_node[i];
    x->run_node[i] = x->run_node[j];
    x->run_node[j] = u;
    for (uint32_t k = 0; k < bs; k++) {
      u = x->run_tok[(size_t)i * bs + k];
      x->run_tok[(size_t)i * bs + k] = x->run_tok[(size_t)j * bs + k];
      x->run_tok[(size_t)j * bs + k] = u;
    }
  }
  for (uint32_t i = 0; i < n;) {
    if (!bh_cache_unannounced(&x->c, x->run_node[i], x->run[i])) {
      i++;
      continue;
    }
    uint32_t a = i;
    for (; i < n && bh_cache_unannounced(&x->c, x->run_node[i], x->run[i]);
         i++)
      bh_cache_announce(&x->c, x->run_node[i]);
    bh_kvpub_extras ex = {x->run_salt, x->run_first + a, x->run_lora,
                          lora_id(x->e, x->run_lora)};
    const uint64_t *parent = a > 0             ? &x->run[a - 1]
                             : x->run_has_parent ? &x->run_parent
                                                 : NULL;
    int rc = bh_kvpub_stored(x->pub, x->run + a, i - a, parent,
                             x->run_tok + (size_t)a * bs, bs, "GPU", &ex);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* The cache's hook: demotions, promotions, evictions (one block each). */
static int on_residency(void *ctx, uint32_t id, int tier, bool stored,
                        const kvp_key *key) {
  engine *e = ctx;
  eworker *x = &e->w[id];
  if (!stored)
    return bh_kvpub_removed(x->pub, &key->lo, 1, medium_of(tier));
  uint32_t v = bh_cache_find(&x->c, *key);
  if (v == BH_NONE || v >= x->ntok_cap)
    return 0;
  return bh_kvpub_stored(x->pub, &key->lo, 1, NULL,
                         x->ntok + (size_t)v * e->o.block_size,
                         e->o.block_size, medium_of(tier), NULL);
}

static int run_add(eworker *x, const ereq *r, uint32_t j, uint32_t v) {
  uint32_t bs = x->e->o.block_size;
  if (x->run_n == x->run_cap) {
    uint32_t nc = x->run_cap ? x->run_cap * 2 : 64;
    uint64_t *nr = realloc(x->run, nc * sizeof *nr);
    if (nr == NULL)
      return KVP_ENOMEM;
    x->run = nr;
    uint32_t *nn = realloc(x->run_node, nc * sizeof *nn);
    if (nn == NULL)
      return KVP_ENOMEM;
    x->run_node = nn;
    uint32_t *nt = realloc(x->run_tok, (size_t)nc * bs * sizeof *nt);
    if (nt == NULL)
      return KVP_ENOMEM;
    x->run_tok = nt;
    x->run_cap = nc;
  }
  x->run_first = j; /* the run's first block so far: the last added */
  x->run_salt = r->a.cache_salt;
  x->run_lora = r->a.lora_name;
  x->run_has_parent = j > 0;
  x->run_parent = j > 0 ? r->keys[j - 1].lo : 0;
  memcpy(x->run_tok + (size_t)x->run_n * bs, r->a.tokens + (size_t)j * bs,
         bs * sizeof(uint32_t));
  x->run_node[x->run_n] = v;
  x->run[x->run_n++] = r->keys[j].lo;
  return 0;
}

/* Block j of r into HBM; a new block joins the pending stored run. */
static int block_to_hbm(eworker *x, const ereq *r, uint32_t j) {
  bool fresh;
  uint32_t v;
  int rc = bh_cache_to_hbm_at(&x->c, BH_NONE, r->keys[j], KVP_CLASS_VOLATILE,
                              &fresh, &v);
  if (rc < 0)
    return rc;
  if (!fresh) /* the run's parent: resident */
    return run_flush(x);
  if ((rc = ntok_fit(x)) < 0)
    return rc;
  uint32_t bs = x->e->o.block_size;
  memcpy(x->ntok + (size_t)v * bs, r->a.tokens + (size_t)j * bs,
         bs * sizeof(uint32_t));
  return run_add(x, r, j, v);
}

/* ---- HTTP replies ---------------------------------------------------------- */
static void reply_json(struct evhttp_request *hr, int code, const char *body) {
  struct evbuffer *b = evbuffer_new();
  if (b == NULL)
    return;
  evbuffer_add(b, body, strlen(body));
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type",
                    "application/json");
  evhttp_send_reply(hr, code, code == 200 ? "OK" : "Error", b);
  evbuffer_free(b);
}

static void reply_obj(struct evhttp_request *hr, int code, json_t *o) {
  char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
  if (s == NULL)
    reply_json(hr, 500, "{\"error\":{\"message\":\"out of memory\","
               "\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}");
  else
    reply_json(hr, code, s);
  free(s);
  json_decref(o);
}

static json_t *usage_json(const ereq *r) {
  uint64_t p = r->a.n_tokens, c = r->a.max_tokens;
  return json_pack("{s:I, s:I, s:I, s:{s:I}}", "prompt_tokens", (json_int_t)p,
                   "total_tokens", (json_int_t)(p + c), "completion_tokens",
                   (json_int_t)c, "prompt_tokens_details", "cached_tokens",
                   (json_int_t)r->cached);
}

static bool is_chat(const ereq *r) { return r->a.kind == BH_API_CHAT; }

static char *gen_text(const ereq *r, uint32_t from, uint32_t to) {
  uint32_t ids[256], n = 0;
  char *out = calloc(1, 1);
  for (uint32_t i = from; i < to && out; i++) {
    ids[n++] = bh_api_gen_token(r->id, i);
    if (n == 256 || i + 1 == to) {
      char *piece = bh_api_detok(ids, n), *cat = NULL;
      if (piece && asprintf(&cat, "%s%s", out, piece) < 0)
        cat = NULL;
      free(piece);
      free(out);
      out = cat;
      n = 0;
    }
  }
  return out;
}

static json_t *envelope(const ereq *r, const char *object) {
  char id[48];
  snprintf(id, sizeof id, "%s-%016llx", is_chat(r) ? "chatcmpl" : "cmpl",
           (unsigned long long)r->id);
  return json_pack("{s:s, s:s, s:I, s:s}", "id", id, "object", object,
                   "created", (json_int_t)r->created, "model",
                   r->a.lora_name ? r->a.lora_name : r->e->o.model);
}

/* One choice of a stream chunk or of the whole response. */
static json_t *choice(const ereq *r, const char *text, bool last, bool whole,
                      bool first) {
  json_t *fin = last ? json_string("length") : json_null();
  if (!is_chat(r))
    return json_pack("{s:i, s:s, s:n, s:o, s:n}", "index", 0, "text", text,
                     "logprobs", "finish_reason", fin, "stop_reason");
  json_t *msg = first ? json_pack("{s:s, s:s}", "role", "assistant",
                                  "content", text)
                      : json_pack("{s:s}", "content", text);
  return json_pack("{s:i, s:o, s:n, s:o, s:n}", "index", 0,
                   whole ? "message" : "delta", msg, "logprobs",
                   "finish_reason", fin, "stop_reason");
}

/* What the NIXL connector's request_finished returns for a prefill leg
 * (do_remote_decode): the decode leg pulls these blocks from this engine. */
static json_t *kvx_reply(const ereq *r) {
  const eworker *x = &r->e->w[r->w];
  json_t *ids = json_array();
  for (uint32_t i = 0; ids && i < r->n_kv_ids; i++)
    json_array_append_new(ids, json_integer(r->kv_ids[i]));
  return json_pack("{s:b, s:b, s:o, s:s, s:s, s:I, s:i}", "do_remote_prefill",
                   1, "do_remote_decode", 0, "remote_block_ids",
                   ids ? ids : json_array(), "remote_engine_id", x->engine_id,
                   "remote_host", r->e->o.host, "remote_port",
                   (json_int_t)x->port, "tp_size", 1);
}

static void send_whole(ereq *r) {
  char *text = gen_text(r, 0, r->a.max_tokens);
  json_t *o = envelope(r, is_chat(r) ? "chat.completion" : "text_completion");
  json_object_set_new(o, "choices",
                      json_pack("[o]", choice(r, text ? text : "", true,
                                              true, true)));
  json_object_set_new(o, "usage", usage_json(r));
  if (r->a.kvx.mode == BH_KVX_REMOTE_DECODE)
    json_object_set_new(o, "kv_transfer_params", kvx_reply(r));
  reply_obj(r->hr, 200, o);
  free(text);
}

static void sse(struct evhttp_request *hr, json_t *o) {
  char *s = json_dumps(o, JSON_COMPACT);
  struct evbuffer *b = evbuffer_new();
  if (s && b) {
    evbuffer_add_printf(b, "data: %s\n\n", s);
    evhttp_send_reply_chunk(hr, b);
  }
  free(s);
  if (b)
    evbuffer_free(b);
  json_decref(o);
}

/* The SSE response's status and headers: sent on admission, as vLLM's
 * server starts a StreamingResponse once the request is accepted -- the
 * moment `live --direct` may send the next request to this worker. */
static void start_reply(ereq *r) {
  if (r->started_reply)
    return;
  struct evkeyvalq *h = evhttp_request_get_output_headers(r->hr);
  evhttp_add_header(h, "Content-Type", "text/event-stream; charset=utf-8");
  evhttp_add_header(h, "Cache-Control", "no-cache");
  evhttp_send_reply_start(r->hr, 200, "OK");
  r->started_reply = true;
}

/* Stream tokens [r->sent, upto) as one chunk. */
static void send_chunk(ereq *r, uint32_t upto) {
  start_reply(r);
  char *text = gen_text(r, r->sent, upto);
  bool first = r->sent == 0, last = upto == r->a.max_tokens;
  json_t *o = envelope(r, is_chat(r) ? "chat.completion.chunk"
                                     : "text_completion");
  json_object_set_new(o, "choices",
                      json_pack("[o]", choice(r, text ? text : "", last,
                                              false, first)));
  sse(r->hr, o);
  free(text);
  r->sent = upto;
}

static void stream_end(ereq *r) {
  if (r->a.include_usage) {
    json_t *o = envelope(r, is_chat(r) ? "chat.completion.chunk"
                                       : "text_completion");
    json_object_set_new(o, "choices", json_array());
    json_object_set_new(o, "usage", usage_json(r));
    sse(r->hr, o);
  }
  struct evbuffer *b = evbuffer_new();
  if (b) {
    evbuffer_add_printf(b, "data: [DONE]\n\n");
    evhttp_send_reply_chunk(r->hr, b);
    evbuffer_free(b);
  }
  evhttp_send_reply_end(r->hr);
}

/* ---- the scheduler ------------------------------------------------------------ */
static void try_start(eworker *x);

static void ereq_free(ereq *r) {
  if (r == NULL)
    return;
  if (r->tm)
    event_free(r->tm);
  free(r->keys);
  bh_api_req_free(&r->a);
  if (r->body)
    evbuffer_free(r->body);
  free(r->reply);
  free(r->kv_ids);
  free(r);
}

static void on_client_gone(struct evhttp_connection *c, void *arg) {
  (void)c;
  ereq *r = arg;
  /* libevent detaches an unfinished request from its dead connection and
   * leaves it to us: free it, then finish the work and send nothing (the
   * simulator models no aborts); counted, so a test sees the hang-up */
  if (r->hr && evhttp_request_get_connection(r->hr) == NULL)
    evhttp_request_free(r->hr);
  r->hr = NULL;
  r->e->w[r->w].client_gone++;
}

static void detach(ereq *r) {
  if (r->hr)
    evhttp_connection_set_closecb(evhttp_request_get_connection(r->hr), NULL,
                                  NULL);
}

static void on_timer(evutil_socket_t fd, short ev, void *arg) {
  ereq *r = arg;
  r->phase(fd, ev, arg);
}

static double mono_s(void) { return (double)kvp_now_ns() / 1e9; }

/* Runs fn(r) at real time `at` (now if past; the request's one timer). */
static void arm(ereq *r, double at, event_callback_fn fn) {
  struct timeval tv;
  double real_s = at - mono_s();
  if (!(real_s > 0))
    real_s = 0;
  tv.tv_sec = (time_t)real_s;
  tv.tv_usec = (suseconds_t)((real_s - (double)tv.tv_sec) * 1e6);
  r->phase = fn;
  /* libevent times a timer from the loop's cached clock, read before this
   * callback began its work (JSON, hashing): refresh it, or the timer
   * fires that much early */
  struct event_base *base = r->e->w[r->w].base;
  event_base_update_cache_time(base);
  if (r->tm == NULL)
    r->tm = evtimer_new(base, on_timer, r);
  if (r->tm)
    evtimer_add(r->tm, &tv);
}

static void on_decode_tick(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  ereq *r = arg;
  eworker *x = &r->e->w[r->w];
  uint32_t left = r->a.max_tokens - r->sent;
  uint32_t step = r->chunks_left ? (left + r->chunks_left - 1) / r->chunks_left
                                 : left;
  if (r->hr && r->a.stream && step > 0)
    send_chunk(r, r->sent + step);
  else
    r->sent += step;
  if (r->chunks_left > 1) {
    r->chunks_left--;
    r->chunk_no++;
    arm(r, r->t_decode_start + r->chunk_no * r->decode_s / STREAM_CHUNKS,
        on_decode_tick);
    return;
  }
  if (r->hr && r->a.stream)
    stream_end(r);
  else if (r->hr)
    send_whole(r);
  detach(r);
  x->decoding--;
  x->decode_tokens -= r->a.n_tokens;
  x->gen_tokens += r->a.max_tokens;
  x->done++;
  ereq_free(r);
  try_start(x);
}

/* --req-log: the request's schedule in trace seconds since the first
 * arrival, the fields of the simulator's (bh_sim_opts.req_log), and how
 * late the prefill's timer fired (the emulator's own delay). */
static void log_req(const eworker *x, const ereq *r) {
  const engine *e = x->e;
  double k = e->o.time_scale;
  if (e->req_log == NULL)
    return;
  fprintf(e->req_log,
          "{\"i\":%lld,\"w\":%u,\"arrive\":%.6f,\"start\":%.6f,"
          "\"end\":%.6f,\"tokens\":%u,\"cached\":%llu,\"queue\":%u,"
          "\"decoding\":%u,\"late\":%.6f}\n",
          (long long)r->rid, x->id, (r->t_arrive - e->t_first) * k,
          (r->t_start - e->t_first) * k, (r->t_prefill_end - e->t_first) * k,
          (unsigned)r->a.n_tokens, (unsigned long long)r->cached, r->q_seen,
          x->decoding, (mono_s() - r->t_prefill_end) * k);
}

/* A prefill leg's full blocks, as this worker holds them now: their cache
 * nodes are the block ids handed to the decode leg (the run still resident;
 * none when out of memory: the decode leg then pulls nothing). */
static void keep_kv_ids(eworker *x, ereq *r) {
  x->pd_prefill_legs++;
  r->kv_ids = malloc((r->n_blocks ? r->n_blocks : 1) * sizeof *r->kv_ids);
  for (uint32_t j = 0; r->kv_ids && j < r->n_blocks; j++) {
    uint32_t v = bh_cache_find(&x->c, r->keys[j]);
    if (v == BH_NONE)
      break;
    r->kv_ids[r->n_kv_ids++] = v;
  }
}

static void on_prefill_done(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  ereq *r = arg;
  eworker *x = &r->e->w[r->w];
  int rc = 0;
  log_req(x, r);
  /* the simulator's prefill_done: new blocks last first, then the chain
   * released tail first */
  for (uint32_t j = r->n_blocks; j-- > r->cut && rc == 0;)
    rc = block_to_hbm(x, r, j);
  if (rc == 0)
    rc = run_flush(x);
  bh_cache_release(&x->c, r->keys, NULL, r->cut);
  bh_kvpub_flush(x->pub);
  x->cur = NULL;
  if (r->a.kvx.mode == BH_KVX_REMOTE_DECODE)
    keep_kv_ids(x, r);
  double d = bh_timing_decode_s(&r->e->tm, x->decoding, x->decode_tokens,
                                r->a.n_tokens, r->a.max_tokens);
  x->decoding++;
  x->decode_tokens += r->a.n_tokens;
  r->decode_s = d / r->e->o.time_scale;
  if (r->hr && r->a.stream)
    send_chunk(r, 1); /* the first token comes with the prefill */
  else
    r->sent = 1;
  r->chunks_left = r->a.max_tokens > 1 ? STREAM_CHUNKS : 1;
  r->t_decode_start = r->t_prefill_end;
  r->chunk_no = 1;
  arm(r, r->t_decode_start +
             (r->a.max_tokens > 1 ? r->decode_s / STREAM_CHUNKS : 0),
      on_decode_tick);
  try_start(x);
}

/* Prefill start: what this worker holds decides the reuse (the simulator's
 * start_prefill, without its index and ledger). */
static void start_prefill(eworker *x, ereq *r) {
  engine *e = x->e;
  uint8_t *tiers = calloc(r->n_blocks ? r->n_blocks : 1, 1);
  uint32_t m = 0;
  for (; tiers && m < r->n_blocks; m++) { /* no memory: a miss */
    uint32_t v = bh_cache_find(&x->c, r->keys[m]);
    if (v == BH_NONE)
      break;
    tiers[m] = x->c.nodes[v].tier;
  }
  r->cut = tiers ? (uint32_t)bh_timing_cut(&e->tm, tiers, m, r->a.n_tokens)
                : 0;
  uint64_t cnt[3] = {0, 0, 0};
  for (uint32_t j = 0; j < r->cut; j++)
    cnt[tiers[j]]++;
  free(tiers);
  r->cached = (uint64_t)r->cut * e->o.block_size;
  x->queries += r->a.n_tokens;
  x->hits += r->cached;
  x->prompt_tokens += r->a.n_tokens;
  int rc = 0;
  for (uint32_t j = r->cut; j-- > 0 && rc == 0;) /* head last */
    rc = block_to_hbm(x, r, j);
  if (rc == 0)
    run_flush(x);
  bh_kvpub_flush(x->pub);
  double dur = bh_timing_load_s(&e->tm, cnt) +
               bh_timing_prefill_s(&e->tm, r->cached, r->a.n_tokens);
  x->cur = r;
  double ready = r->t_pulled > r->t_arrive ? r->t_pulled : r->t_arrive;
  double start = ready > x->gpu_free ? ready : x->gpu_free;
  r->t_start = start;
  r->t_prefill_end = x->gpu_free = start + dur / e->o.time_scale;
  arm(r, r->t_prefill_end, on_prefill_done);
}

static void try_start(eworker *x) {
  while (x->cur == NULL && x->q_head != NULL &&
         x->decoding < x->e->o.max_num_seqs) {
    ereq *r = x->q_head;
    x->q_head = r->next;
    if (x->q_head == NULL)
      x->q_tail = NULL;
    x->q_len--;
    start_prefill(x, r);
  }
}

/* The client's X-Request-Id when it is a number (`live` sends the trace
 * index), else -1. */
static int64_t request_index(struct evhttp_request *hr) {
  const char *v =
      evhttp_find_header(evhttp_request_get_input_headers(hr), "X-Request-Id");
  char *end;
  errno = 0;
  long long n = v ? strtoll(v, &end, 10) : -1;
  return v && (errno || end == v || *end || n < 0) ? -1 : n;
}

static void enqueue(eworker *x, ereq *r) {
  r->q_seen = x->q_len + (x->cur != NULL);
  if (x->q_tail)
    x->q_tail->next = r;
  else
    x->q_head = r;
  x->q_tail = r;
  x->q_len++;
  try_start(x);
}

/* ---- P/D: the decode leg pulls the prompt's KV over the modelled link ------ */
static const eworker *engine_by_id(const engine *e, const char *id) {
  for (uint32_t v = 0; v < e->o.workers; v++)
    if (strcmp(e->w[v].engine_id, id) == 0)
      return &e->w[v];
  return NULL;
}

/* The pulled blocks [from, to) are in HBM now (new ones announced, as vLLM
 * publishes blocks a connector loaded); the request joins the queue, where
 * its prefill finds them cached and computes the rest. */
static void on_pulled(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  ereq *r = arg;
  eworker *x = &r->e->w[r->w];
  uint32_t from = r->pull_from, to = r->pull_to;
  int rc = 0;
  for (uint32_t j = to; j-- > from && rc == 0;) /* last first, as a prefill */
    rc = block_to_hbm(x, r, j);
  if (rc == 0)
    run_flush(x);
  bh_kvpub_flush(x->pub);
  enqueue(x, r);
}

/* A decode leg (do_remote_prefill): of the remote_block_ids, the blocks
 * past this worker's own cached prefix cross the link (latency + bytes /
 * bandwidth) before the request is queued.  A remote engine this cluster
 * does not have, or more blocks than the prompt has, is a failed pull: the
 * worker computes the prompt itself (vLLM's recompute on a KV load
 * failure), counted. */
static void pull_kv(eworker *x, ereq *r) {
  engine *e = x->e;
  const bh_api_kvx *k = &r->a.kvx;
  x->pd_decode_legs++;
  if (engine_by_id(e, k->engine_id) == NULL || k->n_blocks > r->n_blocks) {
    x->kv_pull_failed++;
    enqueue(x, r);
    return;
  }
  uint32_t m = 0;
  while (m < k->n_blocks && bh_cache_find(&x->c, r->keys[m]) != BH_NONE)
    m++;
  uint32_t n = k->n_blocks - m;
  double bytes = bh_timing_link_bytes(&e->tm, n);
  double s = bh_timing_link_s(&e->tm, e->o.link_gbps, e->o.link_latency_us, n);
  x->kv_pull_blocks += n;
  x->kv_pull_bytes += (uint64_t)bytes;
  r->pull_from = m;
  r->pull_to = k->n_blocks;
  r->t_pulled = r->t_arrive + s / e->o.time_scale;
  arm(r, r->t_pulled, on_pulled);
}

/* On the loop, a parsed completion (its keys hashed): into the queue, a
 * decode leg after its KV pull. */
static void admit(eworker *x, ereq *r) {
  engine *e = x->e;
  pthread_mutex_lock(&e->mu);
  uint64_t nth = ++e->next_id;
  if (nth == 1)
    e->t_first = r->t_arrive;
  pthread_mutex_unlock(&e->mu);
  r->id = nth ^ ((uint64_t)x->id << 48);
  r->created = (long)time(NULL);
  if (r->a.stream && r->hr)
    start_reply(r);
  if (r->a.kvx.mode == BH_KVX_REMOTE_PREFILL)
    pull_kv(x, r);
  else
    enqueue(x, r);
}

/* ---- endpoints -------------------------------------------------------------- */
static json_t *ids_json(const uint32_t *t, size_t n) {
  json_t *a = json_array();
  for (size_t i = 0; i < n && a; i++)
    json_array_append_new(a, json_integer(t[i]));
  return a;
}

static json_t *render_one(const engine *e, const bh_api_req *a) {
  char rid[sizeof a->request_id];
  snprintf(rid, sizeof rid, "%s", a->request_id[0] ? a->request_id : "render");
  json_t *o = json_pack("{s:s, s:o, s:{s:I}, s:s, s:b}", "request_id", rid,
                        "token_ids", ids_json(a->tokens, a->n_tokens),
                        "sampling_params", "max_tokens",
                        (json_int_t)a->max_tokens, "model",
                        a->lora_name ? a->lora_name : e->o.model, "stream",
                        a->stream);
  if (o && a->cache_salt) /* vLLM's render passes it on to the generate */
    json_object_set_new(o, "cache_salt", json_string(a->cache_salt));
  return o;
}

static char *oom_json(void) {
  bh_api_err oom = {500, "InternalServerError", "", "out of memory"};
  return bh_api_error_json(&oom);
}

/* In the parser thread: r's body parsed (and a completion's prompt hashed
 * into its block keys), or the answer to send instead.  Touches r, the
 * worker's hasher and read-only engine state only. */
static void parse_one(eworker *x, ereq *r) {
  const engine *e = x->e;
  size_t len = evbuffer_get_length(r->body);
  const char *body = len ? (const char *)evbuffer_pullup(r->body, -1) : "";
  bh_api_err er;
  /* token-id prompts without a JSON value per id (the same result) */
  int rc = bh_api_parse_fast(&e->api, r->kind, body ? body : "",
                             body ? len : 0, &r->a, &er);
  evbuffer_free(r->body);
  r->body = NULL;
  if (rc < 0) {
    memset(&r->a, 0, sizeof r->a);
    r->bad = true;
    r->status = er.status;
    r->reply = bh_api_error_json(&er);
    return;
  }
  if (r->kind == BH_API_COMPLETIONS || r->kind == BH_API_CHAT) {
    size_t nb = r->a.n_tokens / e->o.block_size;
    r->keys = malloc((nb ? nb : 1) * sizeof *r->keys);
    kvp_extras ex = {.cache_salt = r->a.cache_salt, /* block 0, as vLLM */
                     .lora_name = r->a.lora_name, /* every block */
                     .lora_path = lora_path(e, r->a.lora_name)};
    int n = r->keys ? kvp_hasher_hash(x->hasher, r->a.tokens, r->a.n_tokens,
                                      &ex, r->keys, nb, NULL)
                    : KVP_ENOMEM;
    if (n < 0) {
      r->status = 500;
      r->reply = oom_json();
      return;
    }
    r->n_blocks = (uint32_t)n;
    return;
  }
  json_t *o;
  if (r->kind == BH_API_TOKENIZE)
    o = json_pack("{s:I, s:I, s:o, s:n}", "count", (json_int_t)r->a.n_tokens,
                  "max_model_len", (json_int_t)e->o.max_model_len,
                  "tokens", ids_json(r->a.tokens, r->a.n_tokens), "token_strs");
  else if (r->kind == BH_API_COMPLETIONS_RENDER)
    o = json_pack("[o]", render_one(e, &r->a));
  else
    o = render_one(e, &r->a);
  r->reply = o ? json_dumps(o, JSON_COMPACT) : NULL;
  json_decref(o);
  r->status = r->reply ? 200 : 500;
  if (r->reply == NULL)
    r->reply = oom_json();
}

static void *parse_main(void *arg) {
  eworker *x = arg;
  pthread_mutex_lock(&x->pmu);
  for (;;) {
    while (x->todo_head == NULL && !x->p_quit)
      pthread_cond_wait(&x->pcv, &x->pmu);
    ereq *r = x->todo_head;
    if (r == NULL)
      break; /* quit, nothing left */
    x->todo_head = r->next;
    if (x->todo_head == NULL)
      x->todo_tail = NULL;
    r->next = NULL;
    pthread_mutex_unlock(&x->pmu);
    parse_one(x, r);
    pthread_mutex_lock(&x->pmu);
    if (x->done_tail)
      x->done_tail->next = r;
    else
      x->done_head = r;
    x->done_tail = r;
    uint64_t one = 1;
    if (write(x->efd, &one, sizeof one) < 0) { /* EAGAIN: already readable */
    }
  }
  pthread_mutex_unlock(&x->pmu);
  return NULL;
}

/* On the loop: the parser's results, in arrival order. */
static void on_parsed(evutil_socket_t fd, short ev, void *arg) {
  (void)ev;
  eworker *x = arg;
  uint64_t n;
  if (read(fd, &n, sizeof n) < 0) { /* EAGAIN: drained already */
  }
  pthread_mutex_lock(&x->pmu);
  ereq *r = x->done_head;
  x->done_head = x->done_tail = NULL;
  pthread_mutex_unlock(&x->pmu);
  while (r != NULL) {
    ereq *next = r->next;
    r->next = NULL;
    if (r->status == 0) {
      admit(x, r);
    } else {
      x->failed += r->bad;
      detach(r);
      if (r->hr)
        reply_json(r->hr, r->status, r->reply ? r->reply : "{}");
      ereq_free(r);
    }
    r = next;
  }
}

/* A POST: its body (moved out of libevent's buffer) goes to the parser
 * thread; the request is watched for its client leaving from now on. */
static void do_post(eworker *x, struct evhttp_request *hr, bh_api_kind k,
                    double t_arrive) {
  ereq *r = calloc(1, sizeof *r);
  if (r == NULL || (r->body = evbuffer_new()) == NULL ||
      evbuffer_add_buffer(r->body, evhttp_request_get_input_buffer(hr)) < 0) {
    char *s = oom_json();
    reply_json(hr, 500, s ? s : "{}");
    free(s);
    ereq_free(r);
    return;
  }
  r->e = x->e;
  r->w = x->id;
  r->hr = hr;
  r->kind = k;
  r->t_arrive = t_arrive;
  r->rid = request_index(hr);
  evhttp_connection_set_closecb(evhttp_request_get_connection(hr),
                                on_client_gone, r);
  pthread_mutex_lock(&x->pmu);
  if (x->todo_tail)
    x->todo_tail->next = r;
  else
    x->todo_head = r;
  x->todo_tail = r;
  pthread_cond_signal(&x->pcv);
  pthread_mutex_unlock(&x->pmu);
}

static void metric(struct evbuffer *b, const char *name, const char *type,
                   const char *model, double v) {
  const char *suffix = strcmp(type, "counter") == 0 ? "_total" : "";
  evbuffer_add_printf(b, "# TYPE %s%s %s\n%s%s{model_name=\"%s\"} %.17g\n",
                      name, suffix, type, name, suffix, model, v);
}

static void do_metrics(eworker *x, struct evhttp_request *hr) {
  struct evbuffer *b = evbuffer_new();
  if (b == NULL)
    return;
  const char *m = x->e->o.model;
  double use = x->c.cap[0] ? (double)x->c.count[0] / (double)x->c.cap[0] : 0;
  metric(b, "vllm:num_requests_running", "gauge", m,
         x->decoding + (x->cur != NULL));
  metric(b, "vllm:num_requests_waiting", "gauge", m, x->q_len);
  metric(b, "vllm:kv_cache_usage_perc", "gauge", m, use);
  metric(b, "vllm:prefix_cache_queries", "counter", m, (double)x->queries);
  metric(b, "vllm:prefix_cache_hits", "counter", m, (double)x->hits);
  metric(b, "vllm:prompt_tokens", "counter", m, (double)x->prompt_tokens);
  metric(b, "vllm:generation_tokens", "counter", m, (double)x->gen_tokens);
  metric(b, "vllm:request_success", "counter", m, (double)x->done);
  /* the emulator's own (P/D): legs served, KV pulled over the link */
  metric(b, "kvplane_engine_pd_prefill_legs", "counter", m,
         (double)x->pd_prefill_legs);
  metric(b, "kvplane_engine_pd_decode_legs", "counter", m,
         (double)x->pd_decode_legs);
  metric(b, "kvplane_engine_kv_pull_blocks", "counter", m,
         (double)x->kv_pull_blocks);
  metric(b, "kvplane_engine_kv_pull_bytes", "counter", m,
         (double)x->kv_pull_bytes);
  metric(b, "kvplane_engine_kv_pull_failed", "counter", m,
         (double)x->kv_pull_failed);
  /* the emulator's own: requests whose client (the router) hung up */
  metric(b, "kvplane_engine_client_disconnects", "counter", m,
         (double)x->client_gone);
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type",
                    "text/plain; version=0.0.4; charset=utf-8");
  evhttp_send_reply(hr, 200, "OK", b);
  evbuffer_free(b);
}

/* What a router needs to hash requests as this worker does (vLLM 0.33's
 * GET /server_info, --config-format json; vllm-router's kv_aware reads
 * block size, hash algorithm and PYTHONHASHSEED). */
static json_t *server_info(const eworker *x) {
  const eng_opts *o = &x->e->o;
  json_t *cfg = json_pack(
      "{s:{s:s, s:I}, s:{s:I, s:b, s:s}, s:{s:b, s:s, s:s, s:s, s:s}}",
      "model_config", "model", o->model, "max_model_len",
      (json_int_t)o->max_model_len, "cache_config", "block_size",
      (json_int_t)o->block_size, "enable_prefix_caching", 1,
      "prefix_caching_hash_algo", "sha256_cbor", "kv_events_config",
      "enable_kv_cache_events", 1, "publisher", "zmq", "endpoint", x->kv_ep,
      "replay_endpoint", x->replay_ep, "topic", o->kv_topic);
  json_t *env = json_pack("{s:s, s:o}", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES",
                          "1", "PYTHONHASHSEED",
                          o->hash_seed ? json_string(o->hash_seed)
                                       : json_null());
  return json_pack("{s:o, s:o, s:{s:s}}", "vllm_config", cfg, "vllm_env", env,
                   "system_env", "emulator", "kvplane-bench engine");
}

/* GET /kvplane/cache (the emulator's own, for tests): the block hashes each
 * tier holds, by vLLM medium name, as the KV events describe them. */
static json_t *cache_json(const eworker *x) {
  json_t *o = json_object();
  for (int k = 0; k < 3 && o; k++)
    json_object_set_new(o, medium_of(k), json_array());
  for (uint32_t v = 0; o && v < x->c.n_nodes; v++) {
    const bh_cache_node *n = &x->c.nodes[v];
    if (bh_cache_find(&x->c, n->key) != v)
      continue; /* a free slot */
    json_array_append_new(json_object_get(o, medium_of(n->tier)),
                          json_integer((json_int_t)n->key.lo));
  }
  return json_pack("{s:o, s:I}", "resident", o, "batches",
                   (json_int_t)bh_kvpub_batches(x->pub));
}

/* vLLM's model cards: the base model, then each adapter with its path as
 * root and the base model as parent (a router tells adapters by parent). */
static json_t *card(const char *id, const char *root, const char *parent,
                    uint32_t max_len) {
  return json_pack("{s:s, s:s, s:I, s:s, s:s, s:o, s:o, s:[]}", "id", id,
                   "object", "model", "created", (json_int_t)time(NULL),
                   "owned_by", "vllm", "root", root, "parent",
                   parent ? json_string(parent) : json_null(), "max_model_len",
                   max_len ? json_integer(max_len) : json_null(), "permission");
}

static json_t *models_json(const engine *e) {
  json_t *d = json_array();
  json_array_append_new(d, card(e->o.model, e->o.model, NULL, e->o.max_model_len));
  for (size_t i = 0; i < e->o.n_lora; i++)
    json_array_append_new(d, card(e->o.lora[i], e->o.lora_path[i], e->o.model, 0));
  return json_pack("{s:s, s:o}", "object", "list", "data", d);
}

static const struct {
  const char *path;
  bh_api_kind kind;
} posts[] = {
    {"/v1/completions", BH_API_COMPLETIONS},
    {"/v1/chat/completions", BH_API_CHAT},
    {"/v1/completions/render", BH_API_COMPLETIONS_RENDER},
    {"/v1/chat/completions/render", BH_API_CHAT_RENDER},
    {"/tokenize", BH_API_TOKENIZE},
};

static void do_get(eworker *x, struct evhttp_request *hr, const char *path) {
  if (strcmp(path, "/health") == 0) {
    evhttp_send_reply(hr, 200, "OK", NULL);
  } else if (strcmp(path, "/v1/models") == 0) {
    reply_obj(hr, 200, models_json(x->e));
  } else if (strcmp(path, "/metrics") == 0) {
    do_metrics(x, hr);
  } else if (strcmp(path, "/kvplane/cache") == 0) {
    reply_obj(hr, 200, cache_json(x));
  } else if (strcmp(path, "/server_info") == 0) {
    reply_obj(hr, 200, server_info(x));
  } else {
    reply_json(hr, 404, "{\"detail\":\"Not Found\"}");
  }
}

/* Every connection: TCP_NODELAY, or the SSE headers and the first chunk
 * (two small writes) wait out the client's delayed ACK (~40 ms) -- a TTFT
 * no engine has. */
static void no_delay(struct evhttp_request *hr) {
  struct evhttp_connection *c = evhttp_request_get_connection(hr);
  struct bufferevent *bev = c ? evhttp_connection_get_bufferevent(c) : NULL;
  int one = 1;
  if (bev)
    setsockopt(bufferevent_getfd(bev), IPPROTO_TCP, TCP_NODELAY, &one,
               sizeof one);
}

static void on_http(struct evhttp_request *hr, void *arg) {
  double t0 = mono_s(); /* the body is in: the request has arrived */
  eworker *x = arg;
  const struct evhttp_uri *u = evhttp_request_get_evhttp_uri(hr);
  const char *path = u ? evhttp_uri_get_path(u) : NULL;
  enum evhttp_cmd_type cmd = evhttp_request_get_command(hr);
  no_delay(hr);
  if (path == NULL) {
    reply_json(hr, 404, "{\"detail\":\"Not Found\"}");
    return;
  }
  for (size_t i = 0; i < sizeof posts / sizeof *posts; i++) {
    if (strcmp(path, posts[i].path) != 0)
      continue;
    if (cmd == EVHTTP_REQ_POST)
      do_post(x, hr, posts[i].kind, t0);
    else
      reply_json(hr, 405, "{\"detail\":\"Method Not Allowed\"}");
    return;
  }
  if (cmd == EVHTTP_REQ_GET)
    do_get(x, hr, path);
  else
    reply_json(hr, strcmp(path, "/health") && strcmp(path, "/v1/models") &&
                           strcmp(path, "/metrics")
                       ? 404
                       : 405,
               "{\"detail\":\"Not Found\"}");
}

/* ---- setup: a thread per worker ------------------------------------------------- */
static void on_service(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  bh_kvpub_service(((eworker *)arg)->pub);
}

/* The stop pipe's write end was closed (engine_stop): leave the loop. */
static void on_stop(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  eworker *x = arg;
  x->stopped = true;
  event_base_loopexit(x->base, NULL);
}

static int bind_http(engine *e, eworker *x) {
  x->http = evhttp_new(x->base);
  if (x->http == NULL)
    return KVP_ENOMEM;
  evhttp_set_max_body_size(x->http, 64 << 20);
  evhttp_set_allowed_methods(x->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST |
                                          EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                          EVHTTP_REQ_HEAD);
  evhttp_set_gencb(x->http, on_http, x);
  uint32_t port = e->o.port ? e->o.port + x->id : 0;
  struct evhttp_bound_socket *bs =
      evhttp_bind_socket_with_handle(x->http, e->o.host, (uint16_t)port);
  if (bs == NULL) {
    fprintf(stderr, "kvplane-bench engine: cannot bind %s:%u\n", e->o.host,
            port);
    return KVP_EIO;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl);
  x->port = ntohs(ss.ss_family == AF_INET6
                      ? ((struct sockaddr_in6 *)&ss)->sin6_port
                      : ((struct sockaddr_in *)&ss)->sin_port);
  snprintf(x->url, sizeof x->url, "http://%s:%u", e->o.host, x->port);
  return 0;
}

/* The publisher's sockets are created, bound, used and closed by the
 * worker's thread alone (ZeroMQ sockets are not thread-safe). */
static int bind_events(engine *e, eworker *x) {
  char ep[160], rep[160];
  uint32_t p = e->o.kv_port ? e->o.kv_port + 2 * x->id : 0;
  snprintf(ep, sizeof ep, "tcp://%s:%u", e->o.host, p);
  snprintf(rep, sizeof rep, "tcp://%s:%u", e->o.host, p ? p + 1 : 0);
  int rc = bh_kvpub_create(e->zctx, ep, rep, e->o.kv_topic, 0, &x->pub,
                           x->kv_ep, x->replay_ep, sizeof x->kv_ep);
  if (rc < 0)
    fprintf(stderr, "kvplane-bench engine: KV events: %s\n", x->kv_ep);
  return rc;
}

static int make_hasher(const engine *e, kvp_hasher **out) {
  kvp_namespace_desc d = {.model_id = e->o.model,
                         .block_size = e->o.block_size};
  kvp_namespace ns;
  kvp_hasher_opts ho = {.algo = KVP_HASH_SHA256_CBOR,
                        .python_hash_seed = e->o.hash_seed,
                        .vllm_compat = KVP_VLLM_COMPAT_0_33};
  int rc = kvp_namespace_init(&d, &ns);
  return rc < 0 ? rc : kvp_hasher_create(&ns, &ho, NULL, out);
}

/* In the worker's thread: its loop, hasher, cache, HTTP server and
 * publisher, the replay service timer and the stop watch. */
static int worker_init(eworker *x) {
  engine *e = x->e;
  int rc = bh_cache_init(&x->c, &e->o.cl, true);
  if (rc < 0)
    return rc;
  x->c.block_bytes = (uint64_t)(e->tm.kvb * e->o.block_size);
  x->c.adm_cost.recompute_s = bh_timing_prefill_s(&e->tm, 0, e->o.block_size);
  x->c.adm_cost.read_s = x->c.block_bytes / e->tm.cl.gpu.bw[2];
  x->c.adm_cost.write_s = x->c.adm_cost.read_s;
  x->c.publish = on_residency;
  x->c.publish_ctx = e;
  x->c.publish_id = x->id;
  if ((rc = make_hasher(e, &x->hasher)) < 0)
    return rc;
  if ((x->base = bh_live_event_base()) == NULL)
    return KVP_ENOMEM;
  if ((rc = bind_http(e, x)) < 0 || (rc = bind_events(e, x)) < 0)
    return rc;
  struct timeval svc = {0, 5000};
  x->svc = event_new(x->base, -1, EV_PERSIST, on_service, x);
  x->stop = event_new(x->base, e->stop_fd[0], EV_READ, on_stop, x);
  if ((x->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
    return -errno;
  x->parsed = event_new(x->base, x->efd, EV_READ | EV_PERSIST, on_parsed, x);
  if (x->svc == NULL || x->stop == NULL || x->parsed == NULL)
    return KVP_ENOMEM;
  event_add(x->svc, &svc);
  event_add(x->stop, NULL);
  event_add(x->parsed, NULL);
  int err = pthread_create(&x->pth, NULL, parse_main, x);
  if (err != 0)
    return -err;
  x->pth_started = true;
  return 0;
}

/* The requests the parser holds or handed back, unanswered: not watched
 * any more (evhttp_free closes their connections), freed. */
static void free_list(ereq *r) {
  while (r != NULL) {
    ereq *n = r->next;
    detach(r);
    ereq_free(r);
    r = n;
  }
}

/* In the worker's thread, once its loop ended (or its setup failed). */
static void worker_teardown(eworker *x) {
  if (x->pth_started) {
    pthread_mutex_lock(&x->pmu);
    x->p_quit = true;
    pthread_cond_signal(&x->pcv);
    pthread_mutex_unlock(&x->pmu);
    pthread_join(x->pth, NULL);
    x->pth_started = false;
  }
  free_list(x->todo_head);
  free_list(x->done_head);
  x->todo_head = x->todo_tail = x->done_head = x->done_tail = NULL;
  free_list(x->q_head);
  x->q_head = x->q_tail = NULL;
  if (x->http)
    evhttp_free(x->http);
  bh_kvpub_destroy(x->pub);
  if (x->svc)
    event_free(x->svc);
  if (x->stop)
    event_free(x->stop);
  if (x->parsed)
    event_free(x->parsed);
  if (x->efd >= 0)
    close(x->efd);
  if (x->base)
    event_base_free(x->base);
  kvp_hasher_destroy(x->hasher);
  bh_cache_free(&x->c);
  free(x->ntok);
  free(x->run);
  free(x->run_node);
  free(x->run_tok);
}

static void *worker_main(void *arg) {
  eworker *x = arg;
  engine *e = x->e;
  int rc = worker_init(x);
  pthread_mutex_lock(&e->mu);
  if (rc < 0 && e->setup_rc == 0)
    e->setup_rc = rc;
  e->n_up++;
  pthread_cond_signal(&e->cv);
  pthread_mutex_unlock(&e->mu);
  if (rc == 0) {
    /* a loop that ends on its own (an error) ends the engine: the main
     * thread waits in sigwait (bh_engine_main) */
    if (event_base_dispatch(x->base) < 0 || !x->stopped) {
      rc = KVP_EIO;
      kill(getpid(), SIGTERM);
    }
  }
  x->rc = rc;
  worker_teardown(x);
  return NULL;
}

/* The shared pieces: resolved cluster, timing model, API config, request
 * log, ZeroMQ context, stop pipe, lock.  Binds nothing. */
static int engine_setup(engine *e) {
  bh_cluster *cl = &e->o.cl;
  cl->workers = e->o.workers;
  cl->tier_no_classes = true; /* no stability classifier on the wire */
  e->stop_fd[0] = e->stop_fd[1] = -1;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  int rc = bh_cluster_resolve(cl, e->o.block_size);
  if (rc < 0) {
    fprintf(stderr, "kvplane-bench engine: bad cluster (workers 1..4096, "
                    "HBM >= one block)\n");
    return rc;
  }
  bh_sim_opts so = {.cl = *cl, .policy = KVP_POLICY_ROUND_ROBIN};
  kvp_router_opts ro;
  bh_sim_router_opts(&so, e->o.block_size, &ro);
  if ((rc = kvp_router_create(&ro, NULL, &e->rt)) < 0)
    return rc;
  bh_timing_setup(&e->tm, cl, e->o.block_size, e->rt);
  e->api = (bh_api_cfg){e->o.model, e->o.vocab, e->o.max_model_len, {0}, 0};
  for (size_t i = 0; i < e->o.n_lora; i++)
    e->api.lora[e->api.n_lora++] = e->o.lora[i];
  if (e->o.req_log && (e->req_log = fopen(e->o.req_log, "w")) == NULL)
    return -errno;
  if (e->req_log)
    setvbuf(e->req_log, NULL, _IOLBF, 0); /* readable while it runs */
  if (pipe(e->stop_fd) != 0)
    return -errno;
  e->zctx = zmq_ctx_new();
  e->w = calloc(e->o.workers, sizeof *e->w);
  if (e->zctx == NULL || e->w == NULL)
    return KVP_ENOMEM;
  for (uint32_t v = 0; v < e->o.workers; v++) {
    e->w[v].e = e;
    e->w[v].id = v;
    snprintf(e->w[v].engine_id, sizeof e->w[v].engine_id,
             "kvplane-emu-%ld-%u", (long)getpid(), v);
    e->w[v].role = e->o.n_prefill + e->o.n_decode == 0 ? "both"
                   : v < e->o.n_prefill               ? "prefill"
                                                      : "decode";
    e->w[v].efd = -1;
    pthread_mutex_init(&e->w[v].pmu, NULL);
    pthread_cond_init(&e->w[v].pcv, NULL);
  }
  return 0;
}

/* Starts the workers' threads and waits until every one is bound (or one
 * failed).  SIGINT / SIGTERM are blocked here first, so the threads inherit
 * the mask and only engine_run's sigwait takes them. */
static int engine_start(engine *e) {
  uint32_t started = 0;
  int rc = 0;
  for (uint32_t v = 0; v < e->o.workers && rc == 0; v++) {
    int err = pthread_create(&e->w[v].th, NULL, worker_main, &e->w[v]);
    if (err != 0) {
      rc = -err;
      break;
    }
    e->w[v].th_started = true;
    started++;
  }
  pthread_mutex_lock(&e->mu);
  while (e->n_up < started)
    pthread_cond_wait(&e->cv, &e->mu);
  if (rc == 0)
    rc = e->setup_rc;
  pthread_mutex_unlock(&e->mu);
  return rc;
}

/* Stops and joins every started worker; the first worker error, if any. */
static int engine_stop(engine *e) {
  int rc = 0;
  if (e->stop_fd[1] >= 0) {
    close(e->stop_fd[1]); /* EOF: readable in every worker's loop */
    e->stop_fd[1] = -1;
  }
  for (uint32_t v = 0; e->w && v < e->o.workers; v++) {
    if (!e->w[v].th_started)
      continue;
    pthread_join(e->w[v].th, NULL);
    e->w[v].th_started = false;
    if (e->w[v].rc < 0 && rc == 0)
      rc = e->w[v].rc;
  }
  return rc;
}

static void engine_teardown(engine *e) {
  for (uint32_t v = 0; e->w && v < e->o.workers; v++) {
    pthread_cond_destroy(&e->w[v].pcv);
    pthread_mutex_destroy(&e->w[v].pmu);
  }
  free(e->w);
  e->w = NULL;
  if (e->zctx)
    zmq_ctx_term(e->zctx); /* every socket closed by its thread */
  for (int i = 0; i < 2; i++)
    if (e->stop_fd[i] >= 0)
      close(e->stop_fd[i]);
  kvp_router_destroy(e->rt);
  if (e->req_log)
    fclose(e->req_log);
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
}

/* One line per worker on stdout and, with --ready-file, the same as JSON
 * (written to a temporary name, then renamed: readers never see half). */
static int announce(const engine *e) {
  json_t *ws = json_array();
  for (uint32_t v = 0; v < e->o.workers; v++) {
    const eworker *x = &e->w[v];
    printf("worker %u %s kv_events %s replay %s role %s\n", v, x->url,
           x->kv_ep, x->replay_ep, x->role);
    json_array_append_new(ws, json_pack("{s:s, s:s, s:s, s:s, s:s}", "url",
                                        x->url, "kv_events", x->kv_ep,
                                        "kv_replay", x->replay_ep, "role",
                                        x->role, "engine_id", x->engine_id));
  }
  fflush(stdout);
  json_t *o = json_pack("{s:o, s:s, s:I, s:s, s:o, s:s, s:f}", "workers", ws,
                        "model", e->o.model, "block_size",
                        (json_int_t)e->o.block_size, "hash_algo",
                        "sha256_cbor", "python_hash_seed",
                        e->o.hash_seed ? json_string(e->o.hash_seed)
                                       : json_null(),
                        "kv_topic", e->o.kv_topic, "time_scale",
                        e->o.time_scale);
  int rc = 0;
  if (e->o.ready_file && o) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", e->o.ready_file);
    rc = json_dump_file(o, tmp, JSON_INDENT(1)) == 0 &&
                 rename(tmp, e->o.ready_file) == 0
             ? 0
             : -errno;
  }
  json_decref(o);
  return rc;
}

static void engine_usage(FILE *f) {
  fputs("usage: kvplane-bench engine [--workers N] [--host H] [--port P]\n"
        "         [--kv-port P] [--model NAME] [--block-size N]\n"
        "         [--time-scale X] [--max-num-seqs N] [--max-model-len N]\n"
        "         [--hbm-gb X | --hbm-blocks N] [--dram-gb X] [--nvme-gb X]\n"
        "         [--python-hash-seed S] [--kv-topic T] [--ready-file F]\n"
        "         [--req-log F] [--lora NAME[=PATH]]...\n"
        "         [--prefill N --decode M] [--link-gbps X]\n"
        "         [--link-latency-us X]\n"
        "N emulated vLLM 0.33 workers on loopback (docs/live.md).  Worker i\n"
        "serves HTTP on P+i (0: ephemeral, the default) and publishes KV\n"
        "events on tcp KV-port + 2i (replay ROUTER on + 2i + 1).\n"
        "--req-log F: one JSON line per request at its prefill's end (trace\n"
        "seconds since the first arrival; i = the X-Request-Id header).\n"
        "--lora NAME[=PATH]: a LoRA adapter served beside the base model, as\n"
        "vLLM's --lora-modules (up to 8; PATH defaults to /loras/NAME).\n"
        "--prefill N --decode M: a P/D cluster of N + M workers (the first N\n"
        "named prefill, the rest decode; every worker serves either leg by\n"
        "its kv_transfer_params, as vLLM's kv_both); a decode leg pulls the\n"
        "KV it lacks over a link of --link-gbps GB/s (default 25) and\n"
        "--link-latency-us (default 50) per pull.\n", f);
}

static int parse_u32(const char *s, uint32_t *out) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || end == s || *end || v > UINT32_MAX)
    return -1;
  *out = (uint32_t)v;
  return 0;
}

static int parse_pos(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= 0) || !isfinite(v))
    return -1;
  *out = v;
  return 0;
}

static int parse_lora(eng_opts *o, const char *v) {
  const char *eq = strchr(v, '=');
  size_t n = eq ? (size_t)(eq - v) : strlen(v);
  char (*b)[128] = o->lora_buf[o->n_lora];
  if (o->n_lora == BH_API_LORA_MAX || n == 0 || n >= sizeof b[0] ||
      (eq && (eq[1] == '\0' || strlen(eq + 1) >= sizeof b[1])))
    return -1;
  memcpy(b[0], v, n);
  b[0][n] = '\0';
  snprintf(b[1], sizeof b[1], eq ? "%s" : "/loras/%s", eq ? eq + 1 : b[0]);
  o->lora[o->n_lora] = b[0];
  o->lora_path[o->n_lora++] = b[1];
  return 0;
}

static int engine_opt(eng_opts *o, int c, const char *v) {
  uint64_t blocks = 0;
  uint32_t u = 0;
  switch (c) {
  case 'w': return parse_u32(v, &o->workers);
  case 'H': o->host = v; return 0;
  case 'p': return parse_u32(v, &o->port);
  case 'k': return parse_u32(v, &o->kv_port);
  case 'm': o->model = v; return 0;
  case 'b': return parse_u32(v, &o->block_size);
  case 't': return parse_pos(v, &o->time_scale);
  case 'n': return parse_u32(v, &o->max_num_seqs);
  case 'L': return parse_u32(v, &o->max_model_len);
  case 'g': return parse_pos(v, &o->cl.hbm_gb);
  case 'B': if (parse_u32(v, &u) < 0) return -1;
            blocks = u; o->cl.hbm_blocks = blocks; return 0;
  case 'd': return parse_pos(v, &o->cl.dram_gb);
  case 'e': return parse_pos(v, &o->cl.nvme_gb);
  case 's': o->hash_seed = v; return 0;
  case 'T': o->kv_topic = v; return 0;
  case 'r': o->ready_file = v; return 0;
  case 'l': o->req_log = v; return 0;
  case 'A': return parse_lora(o, v);
  case 'P': return parse_u32(v, &o->n_prefill);
  case 'D': return parse_u32(v, &o->n_decode);
  case 'G': return parse_pos(v, &o->link_gbps);
  case 'Y': return parse_pos(v, &o->link_latency_us);
  default: return -1;
  }
}

static int engine_args(eng_opts *o, int argc, char **argv) {
  static const struct option lo[] = {
      {"workers", 1, 0, 'w'},      {"host", 1, 0, 'H'},
      {"port", 1, 0, 'p'},         {"kv-port", 1, 0, 'k'},
      {"model", 1, 0, 'm'},        {"block-size", 1, 0, 'b'},
      {"time-scale", 1, 0, 't'},   {"max-num-seqs", 1, 0, 'n'},
      {"max-model-len", 1, 0, 'L'}, {"hbm-gb", 1, 0, 'g'},
      {"hbm-blocks", 1, 0, 'B'},   {"dram-gb", 1, 0, 'd'},
      {"nvme-gb", 1, 0, 'e'},      {"python-hash-seed", 1, 0, 's'},
      {"kv-topic", 1, 0, 'T'},     {"ready-file", 1, 0, 'r'},
      {"req-log", 1, 0, 'l'},      {"lora", 1, 0, 'A'},
      {"prefill", 1, 0, 'P'},      {"decode", 1, 0, 'D'},
      {"link-gbps", 1, 0, 'G'},    {"link-latency-us", 1, 0, 'Y'},
      {"help", 0, 0, 'h'},         {0, 0, 0, 0}};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    if (c == 'h') {
      engine_usage(stdout);
      return 1;
    }
    if (c == '?' || engine_opt(o, c, optarg) < 0) {
      if (c != '?')
        fprintf(stderr, "kvplane-bench engine: bad value '%s'\n", optarg);
      engine_usage(stderr);
      return -1;
    }
  }
  if (o->n_prefill + o->n_decode > 0) {
    if (o->n_prefill == 0 || o->n_decode == 0) {
      fprintf(stderr, "kvplane-bench engine: --prefill and --decode go "
                      "together, each at least 1\n");
      return -1;
    }
    o->workers = o->n_prefill + o->n_decode;
  }
  if (!(o->link_gbps > 0)) {
    fprintf(stderr, "kvplane-bench engine: --link-gbps must be > 0\n");
    return -1;
  }
  if (optind < argc || o->workers == 0 || o->workers > 256 ||
      o->block_size == 0 || o->block_size > KVP_BLOCK_SIZE_MAX ||
      !(o->time_scale > 0) || o->vocab < 256 || o->max_num_seqs == 0) {
    fprintf(stderr, "kvplane-bench engine: bad arguments (workers 1..256, "
                    "block size 1..%u, time scale > 0)\n", KVP_BLOCK_SIZE_MAX);
    return -1;
  }
  return 0;
}

int bh_engine_main(int argc, char **argv) {
  engine e;
  memset(&e, 0, sizeof e);
  eng_opts *o = &e.o;
  bh_cluster_defaults(&o->cl);
  o->cl.dram_gb = o->cl.nvme_gb = 0; /* vLLM alone: HBM only */
  o->workers = 2;
  o->host = "127.0.0.1";
  o->model = "kvplane-emulated";
  o->block_size = 16;
  o->time_scale = 1;
  o->max_num_seqs = 256;
  o->vocab = 128256;
  o->max_model_len = 131072;
  o->kv_topic = "";
  o->link_gbps = BH_LINK_GBPS_DEFAULT;
  o->link_latency_us = BH_LINK_LATENCY_US_DEFAULT;
  int rc = engine_args(o, argc, argv);
  if (rc != 0)
    return rc > 0 ? 0 : 2;
  signal(SIGPIPE, SIG_IGN);
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, NULL);
  rc = engine_setup(&e);
  if (rc >= 0)
    rc = engine_start(&e);
  if (rc >= 0)
    rc = announce(&e);
  if (rc >= 0) {
    int sig;
    sigwait(&stop, &sig); /* SIGINT, SIGTERM, or a worker's loop failed */
  } else {
    fprintf(stderr, "kvplane-bench engine: %s\n", kvp_strerror(rc));
  }
  int wrc = engine_stop(&e);
  if (rc >= 0)
    rc = wrc;
  engine_teardown(&e);
  return rc < 0 ? 1 : 0;
}
