/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd KV-indexer service (docs/routerd-indexer.md): the HTTP API
 * of NVIDIA Dynamo's standalone indexer and Mooncake's conductor indexer on
 * a listener of its own, over the daemon's index and its workers' event
 * subscribers -- other routers use kvplane's index without its routing.
 *   POST /register /unregister /query /query_by_hash, GET /workers /dump
 *   /health.  Bodies are parsed by rd_idx_req.c (pure, fuzzed). */
#include "rd.h"
#include "rd_idx_req.h"

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct rd_indexer {
  uint64_t requests, bad_requests, dumps;
};

/* ---- replies -------------------------------------------------------------- */

/* Dynamo's error body: {"error": "message"} */
static void reply_error(rd_server *s, struct evhttp_request *hr, int code,
                        const char *msg) {
  s->indexer->bad_requests += code >= 400 && code < 500;
  rd_reply_obj(hr, code, json_pack("{s:s}", "error", msg));
}

/* ---- instances: a worker as the API names it ------------------------------ */
static bool listed(const rd_worker *w) {
  return w->state != RD_W_FREE && !w->removing;
}

static const char *inst_name(const rd_worker *w) {
  return *w->instance ? w->instance : w->url;
}

static json_t *inst_json(const rd_worker *w) {
  return w->instance_int ? json_integer(strtoll(w->instance, NULL, 10))
                         : json_string(inst_name(w));
}

static json_t *rank_map(uint32_t rank, json_t *v) {
  char k[16];
  snprintf(k, sizeof k, "%u", rank);
  json_t *o = json_object();
  json_object_set_new(o, k, v);
  return o;
}

/* the instance's entry in `map` (created by make(w) and appended to order
 * on first sight) */
static json_t *entry(json_t *map, json_t *order, const rd_worker *w,
                     json_t *(*make)(const rd_worker *)) {
  json_t *e = json_object_get(map, inst_name(w));
  if (e == NULL && (e = make(w)) != NULL) {
    json_object_set_new(map, inst_name(w), e);
    if (order)
      json_array_append(order, e);
  }
  return e;
}

/* body model / block size / routing group against what this daemon
 * indexes; 0 or -1 (replied) */
static int check_scope(rd_server *s, struct evhttp_request *hr,
                       const rd_ix_req *r, int model_code) {
  char m[1024];
  const char *group = *r->group ? r->group : "default";
  if ((*r->model && strcmp(r->model, s->cfg.model_id) != 0) ||
      strcmp(group, "default") != 0) {
    snprintf(m, sizeof m, "no indexer for model=%s routing_group=%s (this "
             "kvplane-routerd indexes namespace.model_id=%s, one routing "
             "group: default)", r->model, group, s->cfg.model_id);
    reply_error(s, hr, model_code, m);
    return -1;
  }
  if (r->block_size && r->block_size != s->cfg.ropts.block_size) {
    snprintf(m, sizeof m, "block_size %u: this indexer's block size is %u "
             "(model.block_size)", r->block_size, s->cfg.ropts.block_size);
    reply_error(s, hr, 400, m);
    return -1;
  }
  return 0;
}

static int parse(rd_server *s, struct evhttp_request *hr, rd_ix_op op,
                 rd_ix_req *r) {
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  size_t len = evbuffer_get_length(in);
  const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
  rd_req_err er;
  if (rd_ix_parse(op, body, len, r, &er) == 0)
    return 0;
  reply_error(s, hr, er.status, er.message);
  return -1;
}

/* ---- POST /register ---------------------------------------------------------- */
static rd_worker *find_instance(rd_server *s, const char *inst, int64_t dp,
                                uint32_t from) {
  for (uint32_t i = from; i < s->n_w; i++)
    if (listed(&s->w[i]) && strcmp(inst_name(&s->w[i]), inst) == 0 &&
        (dp < 0 || s->w[i].dp_rank == (uint32_t)dp))
      return &s->w[i];
  return NULL;
}

static int add_worker(rd_server *s, const rd_ix_req *r, uint32_t dp,
                      char *err, size_t cap) {
  if (*r->url)
    return rd_worker_add(s, r->url, r->endpoint, r->replay, err, cap);
  char name[RD_URL_MAX];
  snprintf(name, sizeof name, "indexer:%s#dp%u", r->instance, dp);
  rd_worker *old = rd_worker_find(s, name);
  if (old) /* unregistered, not yet reaped */
    rd_worker_reap(old);
  return rd_worker_add_indexed(s, name, r->endpoint, r->replay, err, cap);
}

static void named(rd_worker *w, const rd_ix_req *r, uint32_t dp) {
  snprintf(w->instance, sizeof w->instance, "%s", r->instance);
  w->registered = true;
  w->instance_int = r->instance_int;
  w->dp_rank = dp;
}

static void log_change(struct evhttp_request *hr, const char *what,
                       const rd_worker *w) {
  char peer[80];
  rd_peer(hr, peer, sizeof peer);
  kvp_log(KVP_LOG_WARN, "routerd", "indexer: %s instance %s dp_rank %u "
          "(%s) from %s", what, inst_name(w), w->dp_rank,
          w->index_only ? "index only" : w->url, peer);
}

static void on_register(rd_server *s, struct evhttp_request *hr) {
  rd_ix_req r;
  char err[512];
  if (parse(s, hr, RD_IX_REGISTER, &r) < 0)
    return;
  uint32_t dp = r.dp_rank < 0 ? 0 : (uint32_t)r.dp_rank;
  int id = -1;
  if (check_scope(s, hr, &r, 400) < 0)
    goto out;
  if (*r.url && !s->cfg.indexer_routes) {
    reply_error(s, hr, 403, "registering a worker with a url would route "
                "user requests to it: this router takes routing targets from "
                "its config and admin API only (routerd.indexer_routes: "
                "false); register without a url to index its events");
    goto out;
  }
  if (find_instance(s, r.instance, dp, 0)) {
    snprintf(err, sizeof err, "instance %s dp_rank %u is already registered",
             r.instance, dp);
    reply_error(s, hr, 409, err);
    goto out;
  }
  if ((id = add_worker(s, &r, dp, err, sizeof err)) < 0) {
    reply_error(s, hr, strstr(err, "already") ? 409 : 400, err);
    goto out;
  }
  named(&s->w[id], &r, dp);
  log_change(hr, "registered", &s->w[id]);
  if (r.dialect == RD_IX_MOONCAKE)
    rd_reply_obj(hr, 201, json_pack("{s:s, s:o}", "status", "registered successfully",
                             "instance_id", inst_json(&s->w[id])));
  else
    rd_reply_obj(hr, 201, json_pack("{s:s}", "status", "ok"));
out:
  rd_ix_free(&r);
}

/* ---- POST /unregister: drained, removed when idle ------------------------------ */
static void on_unregister(rd_server *s, struct evhttp_request *hr) {
  rd_ix_req r;
  if (parse(s, hr, RD_IX_UNREGISTER, &r) < 0)
    return;
  json_t *gone = json_array();
  const char *tenant = *r.tenant ? r.tenant : "default";
  if (check_scope(s, hr, &r, 404) < 0)
    goto out;
  int foreign = 0;
  for (rd_worker *w = find_instance(s, r.instance, r.dp_rank, 0); w;
       w = find_instance(s, r.instance, r.dp_rank, w->id + 1)) {
    if (!w->registered) { /* config's or admin's: removed there */
      foreign++;
      continue;
    }
    char k[RD_URL_MAX + 160];
    snprintf(k, sizeof k, "%s|%s|%u", r.instance, tenant, w->dp_rank);
    json_array_append_new(gone, json_string(k));
    log_change(hr, "unregistered", w);
    rd_worker_drain(w, true);
    rd_worker_reap(w);
  }
  if (json_array_size(gone) == 0 && foreign)
    reply_error(s, hr, 403, "that worker comes from the config or the admin "
                "API: remove it there, not through the indexer");
  else if (json_array_size(gone) == 0) {
    char m[300];
    snprintf(m, sizeof m, "instance %s is not registered", r.instance);
    reply_error(s, hr, 404, m);
  } else if (r.dialect == RD_IX_MOONCAKE)
    rd_reply_obj(hr, 200, json_pack("{s:s, s:O}", "status", "unregistered successfully",
                             "removed_instances", gone));
  else
    rd_reply_obj(hr, 200, json_pack("{s:s}", "status", "ok"));
out:
  json_decref(gone);
  rd_ix_free(&r);
}

/* ---- GET /workers ------------------------------------------------------------- */
static json_t *make_worker(const rd_worker *w) {
  const rd_server *s = w->s;
  return json_pack("{s:o, s:s, s:s, s:s, s:s, s:i, s:{}, s:{}, s:o, s:b}",
                   "instance_id", inst_json(w), "source",
                   *w->kv_events ? "zmq" : "approximate", "status", "active",
                   "model_name", s->cfg.model_id, "routing_group", "default",
                   "block_size", (int)s->cfg.ropts.block_size, "endpoints",
                   "listeners", "url",
                   w->index_only ? json_null() : json_string(w->url), "routed",
                   !w->index_only);
}

static bool query_filter_ok(rd_server *s, struct evhttp_request *hr) {
  struct evkeyvalq q;
  const char *uri = evhttp_request_get_uri(hr), *qs = strchr(uri, '?');
  bool ok = true;
  if (qs && evhttp_parse_query_str(qs + 1, &q) == 0) {
    const char *m = evhttp_find_header(&q, "model_name");
    const char *g = evhttp_find_header(&q, "routing_group");
    ok = (!m || strcmp(m, s->cfg.model_id) == 0) &&
         (!g || strcmp(g, "default") == 0);
    evhttp_clear_headers(&q);
  }
  return ok;
}

static void on_workers(rd_server *s, struct evhttp_request *hr) {
  json_t *map = json_object(), *order = json_array();
  for (uint32_t i = 0; i < s->n_w && query_filter_ok(s, hr); i++) {
    const rd_worker *w = &s->w[i];
    json_t *e = listed(w) ? entry(map, order, w, make_worker) : NULL;
    if (e == NULL || *w->kv_events == '\0')
      continue;
    char k[16];
    snprintf(k, sizeof k, "%u", w->dp_rank);
    json_object_set_new(json_object_get(e, "endpoints"), k,
                        json_string(w->kv_events));
    json_object_set_new(json_object_get(e, "listeners"), k,
                        json_pack("{s:s, s:s}", "endpoint", w->kv_events,
                                  "status", w->ev ? "active" : "failed"));
  }
  json_decref(map);
  rd_reply_obj(hr, 200, order);
}

/* ---- POST /query, /query_by_hash ------------------------------------------------- */
typedef struct ix_reach {
  uint64_t longest, gpu, cpu, disk, routed; /* tokens */
  bool uncertain;
} ix_reach;

/* Reach in tokens, cumulative through the tiers as Dynamo reports it: gpu
 * (HBM, plus routed records: approximate residency is the engine's cache)
 * <= cpu (+ DRAM) <= disk (+ NVMe, remote). */
static ix_reach reach_of(const kvp_index_match *m, uint32_t bs) {
  ix_reach r = {0};
  if (m == NULL)
    return r;
  r.gpu = ((uint64_t)m->tier_blocks[KVP_TIER_HBM] + m->routed_blocks) * bs;
  r.cpu = r.gpu + (uint64_t)m->tier_blocks[KVP_TIER_DRAM] * bs;
  r.disk = r.cpu + ((uint64_t)m->tier_blocks[KVP_TIER_NVME] +
                    m->tier_blocks[KVP_TIER_REMOTE]) * bs;
  r.longest = (uint64_t)m->prefix_blocks * bs;
  r.routed = (uint64_t)m->routed_blocks * bs;
  r.uncertain = m->uncertain;
  return r;
}

static json_t *make_dynamo_inst(const rd_worker *w) {
  (void)w;
  return json_pack("{s:I, s:I, s:{}, s:I, s:I, s:I, s:b}", "longest_matched",
                   (json_int_t)0, "gpu", (json_int_t)0, "dp", "cpu",
                   (json_int_t)0, "disk", (json_int_t)0, "approximate",
                   (json_int_t)0, "uncertain", 0);
}

static json_t *make_mooncake_inst(const rd_worker *w) {
  (void)w;
  return json_pack("{s:I, s:I, s:{}, s:I, s:I}", "longest_matched",
                   (json_int_t)0, "GPU", (json_int_t)0, "DP", "CPU",
                   (json_int_t)0, "DISK", (json_int_t)0);
}

static void raise_to(json_t *o, const char *k, uint64_t v) {
  if ((uint64_t)json_integer_value(json_object_get(o, k)) < v)
    json_object_set_new(o, k, json_integer((json_int_t)v));
}

/* one worker's reach into its instance's entry (max over dp ranks) */
static void merge(json_t *e, const rd_worker *w, const ix_reach *r,
                  rd_ix_dialect d) {
  bool mc = d == RD_IX_MOONCAKE;
  raise_to(e, "longest_matched", r->longest);
  raise_to(e, mc ? "GPU" : "gpu", r->gpu);
  raise_to(e, mc ? "CPU" : "cpu", r->cpu);
  raise_to(e, mc ? "DISK" : "disk", r->disk);
  char k[16];
  snprintf(k, sizeof k, "%u", w->dp_rank);
  json_object_set_new(json_object_get(e, mc ? "DP" : "dp"), k,
                      json_integer((json_int_t)(mc ? r->longest : r->gpu)));
  if (!mc) {
    raise_to(e, "approximate", r->routed);
    if (r->uncertain)
      json_object_set_new(e, "uncertain", json_true());
  }
}

typedef struct ix_answer {
  json_t *inst;   /* instance -> reach entry */
  json_t *scores; /* Dynamo: instance -> {dp: gpu tokens}, matches only */
  json_t *sizes;  /* Dynamo: instance -> {dp: resident blocks} */
  uint32_t *prefix; /* per listed worker, for frequencies */
  size_t n_prefix;
} ix_answer;

static void add_worker_answer(rd_server *s, ix_answer *a, const rd_worker *w,
                              const kvp_index_match *m, rd_ix_dialect d) {
  ix_reach r = reach_of(m, s->cfg.ropts.block_size);
  json_t *e = entry(a->inst, NULL, w, d == RD_IX_MOONCAKE ? make_mooncake_inst
                                                          : make_dynamo_inst);
  if (e)
    merge(e, w, &r, d);
  a->prefix[a->n_prefix++] = m ? m->prefix_blocks : 0;
  if (d == RD_IX_MOONCAKE)
    return;
  char k[16];
  snprintf(k, sizeof k, "%u", w->dp_rank);
  kvp_index_worker_info wi = {0};
  kvp_index_worker_get(s->ix, w->id, &wi);
  json_t *z = json_object_get(a->sizes, inst_name(w));
  if (z)
    json_object_set_new(z, k, json_integer((json_int_t)wi.residencies));
  else
    json_object_set_new(a->sizes, inst_name(w),
                        rank_map(w->dp_rank, json_integer((json_int_t)wi.residencies)));
  if (m == NULL || r.gpu == 0)
    return;
  json_t *sc = json_object_get(a->scores, inst_name(w));
  if (sc)
    json_object_set_new(sc, k, json_integer((json_int_t)r.gpu));
  else
    json_object_set_new(a->scores, inst_name(w),
                        rank_map(w->dp_rank, json_integer((json_int_t)r.gpu)));
}

/* Dynamo's frequencies: at each depth, how many workers hold the block
 * (zeros omitted: the list ends at the longest match) */
static json_t *frequencies(const ix_answer *a) {
  uint32_t top = 0;
  for (size_t i = 0; i < a->n_prefix; i++)
    top = a->prefix[i] > top ? a->prefix[i] : top;
  json_t *f = json_array();
  for (uint32_t d = 0; d < top; d++) {
    json_int_t c = 0;
    for (size_t i = 0; i < a->n_prefix; i++)
      c += a->prefix[i] > d;
    json_array_append_new(f, json_integer(c));
  }
  return f;
}

static json_t *answer_json(const ix_answer *a, const rd_ix_req *r) {
  if (r->dialect == RD_IX_MOONCAKE)
    return json_pack("{s:O}", *r->tenant ? r->tenant : "default", a->inst);
  return json_pack("{s:O, s:o, s:O, s:O}", "scores", a->scores, "frequencies",
                   frequencies(a), "tree_sizes", a->sizes, "instances",
                   a->inst);
}

static int run_query(rd_server *s, const rd_ix_req *r, const kvp_key *keys,
                     size_t n, kvp_index_match *m, ix_answer *a) {
  int rc = kvp_index_query(s->ix, keys, n, kvp_now_ns(), m, s->n_w);
  if (rc < 0)
    return rc;
  const kvp_index_match *by_w[RD_WORKERS_MAX] = {0};
  for (int i = 0; i < rc && i < (int)s->n_w; i++)
    if (m[i].worker < RD_WORKERS_MAX)
      by_w[m[i].worker] = &m[i];
  for (uint32_t i = 0; i < s->n_w; i++)
    if (listed(&s->w[i]) &&
        (!*r->instance || strcmp(inst_name(&s->w[i]), r->instance) == 0))
      add_worker_answer(s, a, &s->w[i], by_w[i], r->dialect);
  return 0;
}

static void answer(rd_server *s, struct evhttp_request *hr, const rd_ix_req *r,
                   const kvp_key *keys, size_t n) {
  if (*r->instance && !find_instance(s, r->instance, -1, 0)) {
    char m[300];
    snprintf(m, sizeof m, "instance %s is not registered", r->instance);
    reply_error(s, hr, 404, m);
    return;
  }
  ix_answer a = {.inst = json_object(), .scores = json_object(),
                 .sizes = json_object(),
                 .prefix = calloc(s->n_w, sizeof *a.prefix)};
  kvp_index_match *m = calloc(s->n_w, sizeof *m);
  int rc = m && a.prefix ? run_query(s, r, keys, n, m, &a) : KVP_ENOMEM;
  if (rc == 0)
    rd_reply_obj(hr, 200, answer_json(&a, r));
  else
    reply_error(s, hr, rc == KVP_ERANGE ? 400 : 500,
                rc == KVP_ERANGE ? "the chain is longer than the index takes"
                                 : kvp_strerror(rc));
  free(m);
  free(a.prefix);
  json_decref(a.inst);
  json_decref(a.scores);
  json_decref(a.sizes);
}

/* Tokens hashed as the front door hashes a prompt (rd_proxy.c hash_into):
 * the daemon's hasher, the tenant's salt (rd_salt_for; tenant_id "default"
 * or absent = no tenant) and the request's cache_salt. */
static void on_query(rd_server *s, struct evhttp_request *hr) {
  rd_ix_req r;
  if (parse(s, hr, RD_IX_QUERY, &r) < 0)
    return;
  if (check_scope(s, hr, &r, 404) < 0) {
    rd_ix_free(&r);
    return;
  }
  char salt[RD_SALT_MAX];
  const char *tenant = strcmp(r.tenant, "default") == 0 ? "" : r.tenant;
  if (rd_salt_for(s->salt_key, tenant, r.cache_salt, salt, sizeof salt) < 0) {
    reply_error(s, hr, 500, "could not derive the cache salt");
    rd_ix_free(&r);
    return;
  }
  size_t nb = r.n_tokens / kvp_hasher_block_size(s->hasher);
  kvp_key *keys = malloc((nb ? nb : 1) * sizeof *keys);
  kvp_extras ex = {.cache_salt = *salt ? salt : NULL,
                   .lora_name = *r.lora_name ? r.lora_name : NULL};
  int rc = keys ? kvp_hasher_hash(s->hasher, r.tokens, r.n_tokens, &ex, keys,
                                  nb, NULL)
                : KVP_ENOMEM;
  if (rc < 0)
    reply_error(s, hr, rc == KVP_ENOMEM ? 500 : 400,
                "token_ids could not be hashed (lora_name / cache_salt must "
                "be UTF-8)");
  else
    answer(s, hr, &r, keys, (size_t)rc);
  free(keys);
  rd_ix_free(&r);
}

/* Engine hashes are index keys only with namespace.engine_hash; re-keyed
 * events keep engine hash -> key maps private to each subscriber. */
static void on_query_hash(rd_server *s, struct evhttp_request *hr) {
  rd_ix_req r;
  if (parse(s, hr, RD_IX_QUERY_HASH, &r) < 0)
    return;
  if (check_scope(s, hr, &r, 404) == 0) {
    kvp_key *keys = malloc((r.n_hashes ? r.n_hashes : 1) * sizeof *keys);
    for (size_t i = 0; keys && i < r.n_hashes; i++)
      keys[i] = (kvp_key){0, r.hashes[i]};
    if (!s->cfg.engine_hash)
      reply_error(s, hr, 400, "query_by_hash needs namespace.engine_hash: "
                  "true -- this indexer re-keys the engines' block hashes "
                  "from their token ids, so engine hashes are not its keys; "
                  "use /query with token_ids");
    else if (keys == NULL)
      reply_error(s, hr, 500, "out of memory");
    else
      answer(s, hr, &r, keys, r.n_hashes);
    free(keys);
  }
  rd_ix_free(&r);
}

/* ---- GET /dump: streamed, one worker's keys in memory at a time --------------- */
#define DUMP_CHUNK 512 /* keys per chunk written */

typedef struct ix_dump {
  rd_server *s;
  struct evhttp_request *hr;
  uint32_t next_w, dp;
  char inst[2 * RD_URL_MAX + 8]; /* the worker_id, as JSON */
  uint64_t *fp;
  uint32_t *mask;
  size_t n, cap, pos;
  uint64_t event_id;
  bool any;
} ix_dump;

static const char *const medium_names[KVP_TIER_COUNT_] = {"gpu", "cpu", "disk",
                                                          "remote"};

static int collect(void *opaque, uint64_t fp, uint32_t mask) {
  ix_dump *d = opaque;
  if (d->n == d->cap) {
    size_t nc = d->cap ? 2 * d->cap : 4096;
    uint64_t *f = realloc(d->fp, nc * sizeof *f);
    if (f)
      d->fp = f;
    uint32_t *m = f ? realloc(d->mask, nc * sizeof *m) : NULL;
    if (m == NULL)
      return KVP_ENOMEM;
    d->mask = m;
    d->cap = nc;
  }
  d->fp[d->n] = fp;
  d->mask[d->n++] = mask;
  return 0;
}

/* the next listed worker's keys into d; false when none is left */
static bool load_next(ix_dump *d) {
  rd_server *s = d->s;
  for (; d->next_w < s->n_w; d->next_w++) {
    const rd_worker *w = &s->w[d->next_w];
    if (!listed(w))
      continue;
    d->n = d->pos = 0;
    json_t *id = inst_json(w);
    char *j = id ? json_dumps(id, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    snprintf(d->inst, sizeof d->inst, "%s", j ? j : "null");
    free(j);
    json_decref(id);
    d->dp = w->dp_rank;
    int rc = kvp_index_worker_keys(s->ix, d->next_w++, collect, d);
    if (rc < 0)
      kvp_log(KVP_LOG_WARN, "routerd", "indexer /dump: worker %s: %s", w->url,
              kvp_strerror(rc));
    return true;
  }
  return false;
}

/* A Dynamo RouterEvent per (key, tier): a root "stored" of one block (the
 * index keeps no parent links); tokens_hash repeats the key. */
static void write_key(ix_dump *d, struct evbuffer *b, size_t i) {
  for (uint32_t t = 0; t < KVP_TIER_COUNT_; t++) {
    if (!(d->mask[i] & (1u << t)))
      continue;
    evbuffer_add_printf(b, "%s{\"worker_id\":%s,\"event\":{\"event_id\":%llu,"
                        "\"data\":{\"stored\":{\"parent_hash\":null,\"blocks\":"
                        "[{\"block_hash\":%llu,\"tokens_hash\":%llu,"
                        "\"mm_extra_info\":null}]}},\"dp_rank\":%u},"
                        "\"medium\":\"%s\"}", d->any ? "," : "", d->inst,
                        (unsigned long long)d->event_id++,
                        (unsigned long long)d->fp[i],
                        (unsigned long long)d->fp[i], d->dp, medium_names[t]);
    d->any = true;
  }
}

static void dump_free(ix_dump *d) {
  free(d->fp);
  free(d->mask);
  free(d);
}

static void on_dump_gone(struct evhttp_connection *c, void *arg) {
  (void)c;
  dump_free(arg); /* the request goes with the connection */
}

static void dump_pump(struct evhttp_connection *c, void *arg) {
  (void)c;
  ix_dump *d = arg;
  struct evbuffer *b = evbuffer_new();
  size_t k = 0;
  while (b && k < DUMP_CHUNK && (d->pos < d->n || load_next(d)))
    for (; d->pos < d->n && k < DUMP_CHUNK; k++)
      write_key(d, b, d->pos++);
  if (b && k > 0) {
    evhttp_send_reply_chunk_with_cb(d->hr, b, dump_pump, d);
    evbuffer_free(b);
    return;
  }
  if (b) { /* done (or out of memory: the JSON ends where it got) */
    evbuffer_add_printf(b, "]}}");
    evhttp_send_reply_chunk(d->hr, b);
    evbuffer_free(b);
  }
  evhttp_connection_set_closecb(evhttp_request_get_connection(d->hr), NULL,
                                NULL);
  evhttp_send_reply_end(d->hr);
  dump_free(d);
}

static void on_dump(rd_server *s, struct evhttp_request *hr) {
  ix_dump *d = calloc(1, sizeof *d);
  struct evbuffer *b = evbuffer_new();
  if (d == NULL || b == NULL) {
    free(d);
    if (b)
      evbuffer_free(b);
    reply_error(s, hr, 500, "out of memory");
    return;
  }
  d->s = s;
  d->hr = hr;
  s->indexer->dumps++;
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type",
                    "application/json");
  evhttp_send_reply_start(hr, 200, "OK");
  json_t *key = json_string(s->cfg.model_id); /* "<model>:default", escaped */
  char *k = key ? json_dumps(key, JSON_ENCODE_ANY) : NULL;
  size_t kl = k ? strlen(k) : 0;
  evbuffer_add_printf(b, "{%.*s:default\":{\"block_size\":%u,\"events\":[",
                      (int)(kl ? kl - 1 : 0), k ? k : "", s->cfg.ropts.block_size);
  free(k);
  json_decref(key);
  evhttp_connection_set_closecb(evhttp_request_get_connection(hr),
                                on_dump_gone, d);
  evhttp_send_reply_chunk_with_cb(hr, b, dump_pump, d);
  evbuffer_free(b);
}

/* ---- the listener ------------------------------------------------------------------ */
static void on_indexer(struct evhttp_request *hr, void *arg) {
  rd_server *s = arg;
  const char *uri = evhttp_request_get_uri(hr);
  size_t plen = strcspn(uri, "?");
  char path[32];
  snprintf(path, sizeof path, "%.*s", (int)(plen < 31 ? plen : 31), uri);
  bool post = evhttp_request_get_command(hr) == EVHTTP_REQ_POST;
  bool get = evhttp_request_get_command(hr) == EVHTTP_REQ_GET;
  static const char *const posts[] = {"/register", "/unregister", "/query",
                                      "/query_by_hash"};
  static void (*const post_fn[])(rd_server *, struct evhttp_request *) = {
      on_register, on_unregister, on_query, on_query_hash};
  static const char *const gets[] = {"/workers", "/dump"};
  static void (*const get_fn[])(rd_server *, struct evhttp_request *) = {
      on_workers, on_dump};
  s->indexer->requests++;
  if (!rd_framing_ok(hr))
    return;
  for (size_t i = 0; i < 4; i++)
    if (strcmp(path, posts[i]) == 0) {
      if (!post)
        reply_error(s, hr, 405, "use POST");
      else if (i >= 2 || rd_authorized(hr, "indexer", s->cfg.indexer_token,
                                       s->cfg.admin_token))
        post_fn[i](s, hr); /* /register, /unregister: the token's */
      return;
    }
  for (size_t i = 0; i < 2; i++)
    if (strcmp(path, gets[i]) == 0) {
      get ? get_fn[i](s, hr) : reply_error(s, hr, 405, "use GET");
      return;
    }
  if (strcmp(path, "/health") == 0)
    rd_reply_obj(hr, 200, json_pack("{s:s}", "status", "ok"));
  else
    reply_error(s, hr, 404, "no such indexer endpoint (/register, "
                "/unregister, /workers, /query, /query_by_hash, /dump)");
}

int rd_indexer_start(rd_server *s, const char *listen, char *err, size_t cap) {
  s->indexer = calloc(1, sizeof *s->indexer);
  if (s->indexer == NULL) {
    snprintf(err, cap, "out of memory");
    return -1;
  }
  s->indexer_http = rd_listen(s, listen, on_indexer, NULL);
  if (s->indexer_http == NULL) {
    snprintf(err, cap, "cannot listen on %s", listen);
    return -1;
  }
  kvp_log(KVP_LOG_INFO, "routerd", "KV-indexer service on %s", listen);
  return 0;
}

void rd_indexer_stop(rd_server *s) {
  if (s->indexer_http) /* open dumps go with their connections */
    evhttp_free(s->indexer_http);
  s->indexer_http = NULL;
  free(s->indexer);
  s->indexer = NULL;
}
