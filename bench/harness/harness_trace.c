/* SPDX-License-Identifier: Apache-2.0 */
/* Traces in memory and their readers: Mooncake JSONL, cc_agentic session
 * files, Qwen-Bailian JSONL and kvplane's own JSONL, all parsed with jansson
 * from a streaming source (harness_src.c).  Anonymised block ids become
 * chained 128-bit keys: key_i = XXH3-128(key_{i-1} || id_i), so two requests
 * share key i exactly when they share ids 0..i (the prefix property). */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <jansson.h>
#include <xxhash.h>

#include "harness.h"

#define MAX_TOKENS (1ull << 32)   /* prompt tokens per request */
#define MAX_OUT (1u << 24)
#define MAX_IDS (1u << 22)
#define LOCAL_ID_BITS 40
#define SHARED_TAG (1ull << 63)

static const char *const format_names[BH_FMT_COUNT_] = {
    "auto", "mooncake", "agentic", "bailian", "kvplane"};

const char *bh_format_name(bh_format f) {
  return (unsigned)f < BH_FMT_COUNT_ ? format_names[f] : "unknown";
}

int bh_format_parse(const char *s, bh_format *out) {
  for (int i = 0; i < BH_FMT_COUNT_; i++)
    if (strcmp(s, format_names[i]) == 0) {
      *out = (bh_format)i;
      return 0;
    }
  if (strcmp(s, "cc_agentic") == 0) {
    *out = BH_FMT_AGENTIC;
    return 0;
  }
  return KVP_EINVAL;
}

/* ---- trace storage ------------------------------------------------------- */
static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return 0;
  size_t nc = *cap ? *cap : 64;
  while (nc < need)
    nc *= 2;
  void *np = realloc(*p, nc * elem);
  if (np == NULL)
    return KVP_ENOMEM;
  *p = np;
  *cap = nc;
  return 0;
}

/* The keys, a trace's one big array (1.7 GB at 20x the bundled agentic
 * sessions), grow by doubling like the rest; past KEYS_MAP_MIN bytes in a
 * mapping of their own that mremap moves: the kernel moves the page
 * tables, so no byte is copied and no page is faulted in (zeroed) twice.
 * realloc's copy into a fresh block did both for every doubling: a third of
 * the time that read took, in the kernel zeroing pages. */
#define KEYS_MAP_MIN ((size_t)64 << 20)

static int grow_keys(bh_trace *t, size_t need) {
  if (need <= t->cap_keys)
    return 0;
  size_t nc = t->cap_keys ? t->cap_keys : 64;
  while (nc < need)
    nc *= 2;
  if (nc > SIZE_MAX / sizeof *t->keys)
    return KVP_ENOMEM;
  size_t bytes = nc * sizeof *t->keys;
  void *np;
  if (bytes < KEYS_MAP_MIN) {
    if ((np = realloc(t->keys, bytes)) == NULL)
      return KVP_ENOMEM;
  } else if (t->keys_mapped) {
    np = mremap(t->keys, t->cap_keys * sizeof *t->keys, bytes, MREMAP_MAYMOVE);
    if (np == MAP_FAILED)
      return KVP_ENOMEM;
  } else {
    np = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
              -1, 0);
    if (np == MAP_FAILED)
      return KVP_ENOMEM;
#ifdef MADV_HUGEPAGE
    (void)madvise(np, bytes, MADV_HUGEPAGE); /* read at random: fewer TLB misses */
#endif
    if (t->n_keys > 0)
      memcpy(np, t->keys, t->n_keys * sizeof *t->keys);
    free(t->keys);
    t->keys_mapped = true;
  }
  t->keys = np;
  t->cap_keys = nc;
  return 0;
}

static void free_keys(bh_trace *t) {
  if (t->keys_mapped)
    munmap(t->keys, t->cap_keys * sizeof *t->keys);
  else
    free(t->keys);
}

void bh_trace_init(bh_trace *t) {
  memset(t, 0, sizeof *t);
}

void bh_trace_free(bh_trace *t) {
  for (size_t i = 0; i < t->n_names; i++)
    free(t->names[i]);
  free(t->names);
  free(t->reqs);
  free_keys(t);
  free(t->last_ids);
  free(t->kid);
  free(t->marks);
  memset(t, 0, sizeof *t);
}

int bh_trace_name(bh_trace *t, const char *s, uint32_t *out) {
  if (s == NULL || s[0] == '\0') {
    *out = 0;
    return 0;
  }
  if (t->n_names == 0) {
    if (grow((void **)&t->names, &t->cap_names, 1, sizeof(char *)) < 0 ||
        (t->names[0] = strdup("")) == NULL)
      return KVP_ENOMEM;
    t->n_names = 1;
  }
  /* the last few names are the likely ones (sessions arrive together) */
  size_t lo = t->n_names > 64 ? t->n_names - 64 : 1;
  for (size_t i = t->n_names; i-- > lo;)
    if (strcmp(t->names[i], s) == 0) {
      *out = (uint32_t)i;
      return 0;
    }
  if (t->n_names >= UINT32_MAX ||
      grow((void **)&t->names, &t->cap_names, t->n_names + 1,
           sizeof(char *)) < 0)
    return KVP_ENOMEM;
  if ((t->names[t->n_names] = strdup(s)) == NULL)
    return KVP_ENOMEM;
  *out = (uint32_t)t->n_names++;
  return 0;
}

static kvp_key chain_seed(uint32_t block_size) {
  uint64_t in[2] = {0x6b76706c616e6521ull, block_size};
  XXH128_hash_t h = XXH3_128bits(in, sizeof in);
  return (kvp_key){h.high64, h.low64};
}

/* A request that starts with every block of the last one added (a
 * session's next turn, as agentic traces list a session's turns one after
 * another) shares that one's keys: they end where the array does, so only
 * its new blocks are hashed and appended, and its key_off is the last
 * one's.  Requests' key ranges are then either disjoint or start at the
 * same offset; nothing writes keys after they are added.  At 20x the
 * bundled agentic sessions: 107M keys stored before, each a turn's copy of
 * the last turn's prefix, 1.7 GB zeroed and written while reading. */
int bh_trace_add(bh_trace *t, const bh_req *r, const uint64_t *ids,
                 size_t n_ids, const kvp_segment_mark *marks, size_t n_marks) {
  size_t share = 0; /* leading blocks whose keys are the last request's */
  if (t->n_reqs > 0 && t->last_bs == t->block_size &&
      t->n_last_ids <= n_ids && t->n_last_ids > 0 &&
      t->reqs[t->n_reqs - 1].key_off + t->n_last_ids == t->n_keys &&
      memcmp(ids, t->last_ids, t->n_last_ids * sizeof *ids) == 0)
    share = t->n_last_ids;
  if (grow((void **)&t->reqs, &t->cap_reqs, t->n_reqs + 1, sizeof *t->reqs) <
          0 ||
      /* + 1: keys is never NULL once a request exists (keys + off) */
      grow_keys(t, t->n_keys + (n_ids - share) + 1) < 0 ||
      grow((void **)&t->marks, &t->cap_marks, t->n_marks + n_marks,
           sizeof *t->marks) < 0 ||
      grow((void **)&t->last_ids, &t->cap_last_ids, n_ids,
           sizeof *t->last_ids) < 0)
    return KVP_ENOMEM;
  bh_req *q = &t->reqs[t->n_reqs];
  *q = *r;
  q->seq = (uint32_t)t->n_reqs;
  q->n_blocks = (uint32_t)n_ids;
  q->key_off = t->n_keys - share;
  q->mark_off = (uint32_t)t->n_marks;
  q->n_marks = (uint32_t)n_marks;
  kvp_key prev = share > 0 ? t->keys[t->n_keys - 1] : chain_seed(t->block_size);
  for (size_t i = share; i < n_ids; i++) {
    uint64_t in[3] = {prev.hi, prev.lo, ids[i]};
    XXH128_hash_t h = XXH3_128bits(in, sizeof in);
    prev = (kvp_key){h.high64, h.low64};
    t->keys[q->key_off + i] = prev;
  }
  if (n_marks > 0)
    memcpy(t->marks + t->n_marks, marks, n_marks * sizeof *marks);
  if (n_ids > share)
    memcpy(t->last_ids + share, ids + share, (n_ids - share) * sizeof *ids);
  t->n_last_ids = n_ids;
  t->last_bs = t->block_size;
  t->n_keys += n_ids - share;
  t->n_marks += n_marks;
  t->n_reqs++;
  return 0;
}

uint64_t bh_trace_prompt_tokens(const bh_trace *t) {
  uint64_t s = 0;
  for (size_t i = 0; i < t->n_reqs; i++)
    s += t->reqs[i].in_tokens;
  return s;
}

/* ---- record errors --------------------------------------------------------- */
typedef struct rd {
  bh_src *src;
  const bh_read_opts *o;
  bh_trace *t;
  char *err;
  size_t cap;
  uint32_t printed;
  char where[96];   /* "line 12" or "requests[3]" */
  uint64_t *ids;    /* scratch */
  size_t ids_cap;
} rd;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
static int bad(rd *r, const char *fmt, ...) {
  char msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char full[512];
  snprintf(full, sizeof full, "%s:%s: %s", bh_src_name(r->src), r->where, msg);
  r->t->records_bad++;
  if (r->t->first_error[0] == '\0')
    snprintf(r->t->first_error, sizeof r->t->first_error, "%s", full);
  uint32_t maxm = r->o->max_messages ? r->o->max_messages : 10;
  if (!r->o->quiet && r->printed < maxm) {
    fprintf(stderr, "kvplane-bench: %s%s\n", full,
            r->o->on_error == BH_ERR_SKIP ? " (record skipped)" : "");
    if (++r->printed == maxm && r->o->on_error == BH_ERR_SKIP)
      fprintf(stderr, "kvplane-bench: %s: further bad records not shown\n",
              bh_src_name(r->src));
  }
  if (r->o->on_error == BH_ERR_STOP) {
    snprintf(r->err, r->cap, "%s", full);
    return KVP_ECORRUPT;
  }
  return 0;
}

static int fatal(rd *r, int code, const char *fmt, ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static int fatal(rd *r, int code, const char *fmt, ...) {
  char msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  snprintf(r->err, r->cap, "%s:%s: %s", bh_src_name(r->src), r->where, msg);
  return code;
}

/* ---- typed fields: 1 ok, 0 absent, -1 wrong (message in why) ------------- */
static int get_uint(json_t *o, const char *k, uint64_t max, uint64_t *v,
                    char *why, size_t cap) {
  json_t *x = json_object_get(o, k);
  if (x == NULL)
    return 0;
  if (!json_is_integer(x) || json_integer_value(x) < 0 ||
      (uint64_t)json_integer_value(x) > max) {
    snprintf(why, cap, "field '%s': expected an integer in [0, %llu]", k,
             (unsigned long long)max);
    return -1;
  }
  *v = (uint64_t)json_integer_value(x);
  return 1;
}

/* Times: seconds up to MAX_TIME_S (31.7 years of trace; the simulator keeps
 * nanoseconds in 64 bits), Mooncake's milliseconds up to 1000x that. */
#define MAX_TIME_S 1e9
#define MAX_TIME_MS 1e12

static int get_num(json_t *o, const char *k, double max, double *v, char *why,
                   size_t cap) {
  json_t *x = json_object_get(o, k);
  if (x == NULL)
    return 0;
  if (!json_is_number(x) || !isfinite(json_number_value(x)) ||
      json_number_value(x) < 0 || json_number_value(x) > max) {
    snprintf(why, cap, "field '%s': expected a number in [0, %g]", k, max);
    return -1;
  }
  *v = json_number_value(x);
  return 1;
}

/* Required unsigned field; on failure the message names it. */
static bool need_uint(json_t *o, const char *k, uint64_t max, uint64_t *v,
                      char *why, size_t cap) {
  int rc = get_uint(o, k, max, v, why, cap);
  if (rc == 0)
    snprintf(why, cap, "missing field '%s'", k);
  return rc == 1;
}

static bool need_num(json_t *o, const char *k, double max, double *v,
                     char *why, size_t cap) {
  int rc = get_num(o, k, max, v, why, cap);
  if (rc == 0)
    snprintf(why, cap, "missing field '%s'", k);
  return rc == 1;
}

/* hash_ids -> r->ids (transformed by tag/shared below).  Returns the count
 * or -1 with why. */
static long get_ids(rd *r, json_t *o, char *why, size_t cap) {
  json_t *a = json_object_get(o, "hash_ids");
  if (a == NULL) {
    snprintf(why, cap, "missing field 'hash_ids'");
    return -1;
  }
  if (!json_is_array(a)) {
    snprintf(why, cap, "field 'hash_ids': expected an array of integers");
    return -1;
  }
  size_t n = json_array_size(a);
  if (n > MAX_IDS) {
    snprintf(why, cap, "field 'hash_ids': %zu ids, at most %u", n, MAX_IDS);
    return -1;
  }
  if (grow((void **)&r->ids, &r->ids_cap, n ? n : 1, sizeof *r->ids) < 0) {
    snprintf(why, cap, "out of memory");
    return -1;
  }
  for (size_t i = 0; i < n; i++) {
    json_t *x = json_array_get(a, i);
    if (!json_is_integer(x) || json_integer_value(x) < 0) {
      snprintf(why, cap, "hash_ids[%zu]: expected an integer >= 0", i);
      return -1;
    }
    r->ids[i] = (uint64_t)json_integer_value(x);
  }
  return (long)n;
}

static int set_block_size(rd *r, uint64_t bs) {
  if (bs == 0 || bs > KVP_BLOCK_SIZE_MAX)
    return fatal(r, KVP_EINVAL, "block size %llu out of range [1, %u]",
                 (unsigned long long)bs, KVP_BLOCK_SIZE_MAX);
  if (r->t->block_size != 0 && r->t->block_size != bs)
    return fatal(r, KVP_EINVAL,
                 "block size %llu differs from the %u of traces read before "
                 "(one run replays one block size)",
                 (unsigned long long)bs, r->t->block_size);
  r->t->block_size = (uint32_t)bs;
  return 0;
}

/* Number of full blocks to key: ids beyond ceil(in/bs) are an error; with
 * `cover` (Mooncake, Bailian: one id per block of the whole prompt) so are
 * fewer ids than the prompt's full blocks, which would replay tokens no id
 * describes as never-cached prefill (2 ids for 10M tokens: TTFTs in hours). */
static long key_blocks(rd *r, uint64_t in, long n_ids, bool cover, char *why,
                       size_t cap) {
  uint64_t bs = r->t->block_size;
  uint64_t full = in / bs;
  if ((uint64_t)n_ids > (in + bs - 1) / bs) {
    snprintf(why, cap,
             "%ld hash_ids for %llu tokens: more than ceil(tokens / %llu)",
             n_ids, (unsigned long long)in, (unsigned long long)bs);
    return -1;
  }
  if (cover && (uint64_t)n_ids < full) {
    snprintf(why, cap,
             "%ld hash_ids for %llu tokens: fewer than floor(tokens / %llu) "
             "= %llu (the ids must cover the prompt)",
             n_ids, (unsigned long long)in, (unsigned long long)bs,
             (unsigned long long)full);
    return -1;
  }
  return (long)((uint64_t)n_ids < full ? (uint64_t)n_ids : full);
}

static json_t *parse_line(rd *r, const char *line, size_t len, char *why,
                          size_t cap) {
  json_error_t je;
  json_t *o = json_loadb(line, len, JSON_REJECT_DUPLICATES, &je);
  if (o == NULL) {
    snprintf(why, cap, "invalid JSON at column %d: %s", je.column, je.text);
    return NULL;
  }
  if (!json_is_object(o)) {
    snprintf(why, cap, "expected a JSON object");
    json_decref(o);
    return NULL;
  }
  (void)r;
  return o;
}

static bool blank(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] != ' ' && s[i] != '\t')
      return false;
  return true;
}

static bool limit_reached(const rd *r) {
  return r->o->max_requests != 0 && r->t->n_reqs >= r->o->max_requests;
}

/* ---- Mooncake ------------------------------------------------------------ */
static int mooncake_record(rd *r, json_t *o, char *why, size_t cap) {
  double ts;
  uint64_t in, out;
  if (!need_num(o, "timestamp", MAX_TIME_MS, &ts, why, cap) ||
      !need_uint(o, "input_length", MAX_TOKENS, &in, why, cap) ||
      !need_uint(o, "output_length", MAX_OUT, &out, why, cap))
    return -1;
  long n = get_ids(r, o, why, cap);
  if (n < 0 || (n = key_blocks(r, in, n, true, why, cap)) < 0)
    return -1;
  bh_req q = {.t = ts / 1000.0, .in_tokens = in, .out_tokens = (uint32_t)out};
  return bh_trace_add(r->t, &q, r->ids, (size_t)n, NULL, 0) < 0 ? -2 : 0;
}

/* ---- Qwen-Bailian -----------------------------------------------------------
 * Sessions follow parent_chat_id back to the root chat (-1 = none). */
typedef struct chat_map {
  uint64_t *k;
  uint32_t *v;
  size_t cap, n;
} chat_map;

static uint32_t *chat_slot(chat_map *m, uint64_t k, bool insert) {
  if (insert && (m->n + 1) * 2 > m->cap) {
    chat_map nm = {0};
    nm.cap = m->cap ? m->cap * 2 : 1024;
    nm.k = calloc(nm.cap, sizeof *nm.k);
    nm.v = calloc(nm.cap, sizeof *nm.v);
    if (nm.k == NULL || nm.v == NULL) {
      free(nm.k);
      free(nm.v);
      return NULL;
    }
    for (size_t i = 0; i < m->cap; i++)
      if (m->k[i] != 0) {
        size_t j = XXH3_64bits(&m->k[i], 8) & (nm.cap - 1);
        while (nm.k[j] != 0)
          j = (j + 1) & (nm.cap - 1);
        nm.k[j] = m->k[i];
        nm.v[j] = m->v[i];
      }
    nm.n = m->n;
    free(m->k);
    free(m->v);
    *m = nm;
  }
  if (m->cap == 0)
    return NULL;
  uint64_t kk = k + 1; /* 0 marks empty */
  size_t j = XXH3_64bits(&kk, 8) & (m->cap - 1);
  while (m->k[j] != 0 && m->k[j] != kk)
    j = (j + 1) & (m->cap - 1);
  if (m->k[j] == 0) {
    if (!insert)
      return NULL;
    m->k[j] = kk;
    m->n++;
  }
  return &m->v[j];
}

static int bailian_record(rd *r, json_t *o, chat_map *m, char *why,
                          size_t cap) {
  uint64_t chat, in, out, turn = 0;
  double ts;
  json_t *pj = json_object_get(o, "parent_chat_id");
  if (!need_uint(o, "chat_id", INT64_MAX - 1, &chat, why, cap) ||
      !need_num(o, "timestamp", MAX_TIME_S, &ts, why, cap) ||
      !need_uint(o, "input_length", MAX_TOKENS, &in, why, cap) ||
      !need_uint(o, "output_length", MAX_OUT, &out, why, cap) ||
      get_uint(o, "turn", UINT32_MAX, &turn, why, cap) < 0)
    return -1;
  if (pj == NULL || !json_is_integer(pj) || json_integer_value(pj) < -1) {
    snprintf(why, cap, "field 'parent_chat_id': expected an integer >= -1");
    return -1;
  }
  json_t *ty = json_object_get(o, "type");
  if (ty != NULL && !json_is_string(ty) && !json_is_integer(ty)) {
    snprintf(why, cap, "field 'type': expected a string or an integer");
    return -1;
  }
  long n = get_ids(r, o, why, cap);
  if (n < 0 || (n = key_blocks(r, in, n, true, why, cap)) < 0)
    return -1;
  uint32_t session = 0;
  json_int_t parent = json_integer_value(pj);
  uint32_t *ps = parent >= 0 ? chat_slot(m, (uint64_t)parent, false) : NULL;
  if (ps != NULL) {
    session = *ps;
  } else {
    char name[32];
    snprintf(name, sizeof name, "chat-%llu", (unsigned long long)chat);
    if (bh_trace_name(r->t, name, &session) < 0)
      return -2;
  }
  uint32_t *cs = chat_slot(m, chat, true);
  if (cs == NULL)
    return -2;
  *cs = session;
  bh_req q = {.t = ts, .in_tokens = in, .out_tokens = (uint32_t)out,
              .session = session};
  return bh_trace_add(r->t, &q, r->ids, (size_t)n, NULL, 0) < 0 ? -2 : 0;
}

/* ---- kvplane's own format -------------------------------------------------
 * Line 1: {"format":"kvplane-trace","version":1,"block_size":N}; then one
 * request a line: {"t": s, "in": tokens, "out": tokens, "hash_ids": [...],
 * "tenant": str?, "session": str?, "segments": [{"offset","length","role",
 * "class"?}]?}.  Ids are global: equal ids at equal positions after equal
 * ids = one reusable prefix. */
static int kvplane_header(rd *r, json_t *o, char *why, size_t cap) {
  json_t *f = json_object_get(o, "format");
  uint64_t ver, bs;
  if (!json_is_string(f) || strcmp(json_string_value(f), "kvplane-trace")) {
    snprintf(why, cap, "first line must be the header "
             "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":N}");
    return -1;
  }
  if (!need_uint(o, "version", 1000, &ver, why, cap) ||
      !need_uint(o, "block_size", KVP_BLOCK_SIZE_MAX, &bs, why, cap))
    return -1;
  if (ver != 1) {
    snprintf(why, cap, "unsupported version %llu (this reader: 1)",
             (unsigned long long)ver);
    return -1;
  }
  return set_block_size(r, bs) < 0 ? -3 : 0;
}

static int get_name(rd *r, json_t *o, const char *k, uint32_t *out, char *why,
                    size_t cap) {
  json_t *x = json_object_get(o, k);
  *out = 0;
  if (x == NULL)
    return 0;
  if (!json_is_string(x) || json_string_length(x) > KVP_LEDGER_NAME_MAX ||
      strlen(json_string_value(x)) != json_string_length(x)) {
    snprintf(why, cap, "field '%s': expected a string of at most %u bytes", k,
             KVP_LEDGER_NAME_MAX);
    return -1;
  }
  return bh_trace_name(r->t, json_string_value(x), out) < 0 ? -2 : 0;
}

static int get_marks(json_t *o, uint64_t in, kvp_segment_mark *mk,
                     size_t *n_out, char *why, size_t cap) {
  json_t *a = json_object_get(o, "segments");
  *n_out = 0;
  if (a == NULL)
    return 0;
  if (!json_is_array(a) || json_array_size(a) > 64) {
    snprintf(why, cap, "field 'segments': expected an array of at most 64");
    return -1;
  }
  for (size_t i = 0; i < json_array_size(a); i++) {
    json_t *s = json_array_get(a, i);
    uint64_t off, len;
    kvp_role role;
    json_t *rj = json_is_object(s) ? json_object_get(s, "role") : NULL;
    json_t *cj = json_is_object(s) ? json_object_get(s, "class") : NULL;
    if (!json_is_object(s) ||
        !need_uint(s, "offset", UINT32_MAX, &off, why, cap) ||
        !need_uint(s, "length", UINT32_MAX, &len, why, cap)) {
      if (!json_is_object(s))
        snprintf(why, cap, "segments[%zu]: expected an object", i);
      return -1;
    }
    if (off + len > in || !json_is_string(rj) ||
        kvp_role_parse(json_string_value(rj), &role) < 0) {
      snprintf(why, cap,
               "segments[%zu]: needs offset + length <= in and a role "
               "(system, tools, documents, history, user, tool_output, other)",
               i);
      return -1;
    }
    uint8_t cls = KVP_CLASS_AUTO;
    if (cj != NULL) {
      const char *c = json_is_string(cj) ? json_string_value(cj) : "";
      kvp_class k;
      if (kvp_class_parse(c, &k) == 0)
        cls = (uint8_t)k;
      else if (strcmp(c, "auto") != 0) {
        snprintf(why, cap, "segments[%zu].class: stable, semi, volatile or auto",
                 i);
        return -1;
      }
    }
    mk[i] = (kvp_segment_mark){.offset = (uint32_t)off,
                               .length = (uint32_t)len,
                               .role = (uint8_t)role,
                               .class_hint = cls};
  }
  *n_out = json_array_size(a);
  return 0;
}

static int kvplane_record(rd *r, json_t *o, char *why, size_t cap) {
  double ts, think = 0;
  uint64_t in, out;
  kvp_segment_mark mk[64];
  size_t nm;
  bh_req q = {0};
  int rc;
  if (!need_num(o, "t", MAX_TIME_S, &ts, why, cap) ||
      !need_uint(o, "in", MAX_TOKENS, &in, why, cap) ||
      !need_uint(o, "out", MAX_OUT, &out, why, cap) ||
      get_num(o, "think", MAX_TIME_S, &think, why, cap) < 0)
    return -1;
  if ((rc = get_name(r, o, "tenant", &q.tenant, why, cap)) < 0 ||
      (rc = get_name(r, o, "session", &q.session, why, cap)) < 0)
    return rc;
  if (get_marks(o, in, mk, &nm, why, cap) < 0)
    return -1;
  long n = get_ids(r, o, why, cap);
  if (n < 0 || (n = key_blocks(r, in, n, false, why, cap)) < 0)
    return -1;
  q.t = ts;
  q.think_s = think;
  q.in_tokens = in;
  q.out_tokens = (uint32_t)out;
  return bh_trace_add(r->t, &q, r->ids, (size_t)n, mk, nm) < 0 ? -2 : 0;
}

/* ---- line-oriented formats ------------------------------------------------ */
static int read_lines(rd *r, bh_format f) {
  char *line;
  size_t len;
  int rc;
  chat_map m = {0};
  bool header = f != BH_FMT_KVPLANE;
  if (f == BH_FMT_MOONCAKE && (rc = set_block_size(r, 512)) < 0)
    return rc;
  if (f == BH_FMT_BAILIAN && (rc = set_block_size(r, 16)) < 0)
    return rc;
  while (!limit_reached(r) && (rc = bh_src_getline(r->src, &line, &len)) > 0) {
    if (blank(line, len))
      continue;
    char why[320] = "";
    snprintf(r->where, sizeof r->where, "%llu",
             (unsigned long long)bh_src_lineno(r->src));
    json_t *o = parse_line(r, line, len, why, sizeof why);
    int res = -1;
    if (o != NULL) {
      if (!header) {
        res = kvplane_header(r, o, why, sizeof why);
        header = true;
        if (res == -3) {
          json_decref(o);
          free(m.k);
          free(m.v);
          return KVP_EINVAL;
        }
        if (res < 0) {
          json_decref(o);
          free(m.k);
          free(m.v);
          return fatal(r, KVP_ECORRUPT, "%s", why);
        }
        json_decref(o);
        continue;
      }
      res = f == BH_FMT_MOONCAKE  ? mooncake_record(r, o, why, sizeof why)
            : f == BH_FMT_BAILIAN ? bailian_record(r, o, &m, why, sizeof why)
                                  : kvplane_record(r, o, why, sizeof why);
      json_decref(o);
    }
    if (res == -2) {
      free(m.k);
      free(m.v);
      return fatal(r, KVP_ENOMEM, "out of memory");
    }
    if (res < 0) {
      if ((rc = bad(r, "%s", why)) < 0) {
        free(m.k);
        free(m.v);
        return rc;
      }
    } else {
      r->t->records_ok++;
    }
  }
  free(m.k);
  free(m.v);
  if (rc < 0) {
    snprintf(r->where, sizeof r->where, "%llu",
             (unsigned long long)bh_src_lineno(r->src) + 1);
    return fatal(r, rc, "%s", bh_src_error(r->src)[0] ? bh_src_error(r->src)
                                                      : kvp_strerror(rc));
  }
  if (!header)
    return fatal(r, KVP_ECORRUPT, "empty kvplane trace (no header line)");
  return 0;
}

/* ---- cc_agentic sessions ---------------------------------------------------
 * One JSON object per file; requests[] holds turns and sub-agents (nested
 * sessions whose t restarts at 0 at their spawn time).  Ids are local to the
 * file: tagged with a per-file namespace.  With the shared prefix on, the
 * leading (system_tokens + tool_tokens) / block_size blocks map to ids shared
 * by every session of that agent kind. */
typedef struct ag_ctx {
  uint64_t ns;          /* per-file id namespace */
  char file_id[64];
} ag_ctx;

static size_t json_cb(void *buf, size_t len, void *data) {
  long n = bh_src_read(data, buf, len);
  return n < 0 ? (size_t)-1 : (size_t)n;
}

static int ag_session(rd *r, const ag_ctx *c, json_t *reqs, double t0,
                      uint64_t sys, uint64_t tools, const char *kind,
                      const char *session, int depth, const char *path);

static int ag_turn(rd *r, const ag_ctx *c, json_t *o, double t0,
                   uint64_t sys, uint64_t tools, const char *kind,
                   uint32_t session, uint64_t *prev_in, char *why, size_t cap) {
  double t, think = 0;
  uint64_t in, out;
  if (!need_num(o, "t", MAX_TIME_S, &t, why, cap) ||
      !need_uint(o, "in", MAX_TOKENS, &in, why, cap) ||
      !need_uint(o, "out", MAX_OUT, &out, why, cap) ||
      get_num(o, "think_time", MAX_TIME_S, &think, why, cap) < 0)
    return -1;
  long n = get_ids(r, o, why, cap);
  if (n < 0 || (n = key_blocks(r, in, n, false, why, cap)) < 0)
    return -1;
  uint64_t bs = r->t->block_size, shared = (sys + tools) / bs;
  uint64_t kind_tag = (XXH3_64bits(kind, strlen(kind)) & 0x3fffff) << 40;
  for (long i = 0; i < n; i++) {
    if (r->ids[i] >> LOCAL_ID_BITS) {
      snprintf(why, cap, "hash_ids[%ld]: local id above 2^40", i);
      return -1;
    }
    if (!r->o->no_shared_prefix && (uint64_t)i < shared)
      r->ids[i] = SHARED_TAG | kind_tag | (uint64_t)i;
    else
      r->ids[i] |= c->ns << LOCAL_ID_BITS;
  }
  /* marks: system, tools, history (what the last turn sent), new input */
  kvp_segment_mark mk[4];
  size_t nm = 0;
  uint64_t a = sys < in ? sys : in, b = sys + tools < in ? sys + tools : in;
  uint64_t h = *prev_in > b && *prev_in < in ? *prev_in : b;
  json_t *it = json_object_get(o, "input_types");
  bool tool = false;
  for (size_t i = 0; json_is_array(it) && i < json_array_size(it); i++) {
    json_t *s = json_array_get(it, i);
    tool |= json_is_string(s) && strcmp(json_string_value(s), "tool_result") == 0;
  }
  mk[nm++] = (kvp_segment_mark){0, (uint32_t)a, KVP_ROLE_SYSTEM, KVP_CLASS_AUTO, {0}};
  mk[nm++] = (kvp_segment_mark){(uint32_t)a, (uint32_t)(b - a), KVP_ROLE_TOOLS,
                                KVP_CLASS_AUTO, {0}};
  mk[nm++] = (kvp_segment_mark){(uint32_t)b, (uint32_t)(h - b), KVP_ROLE_HISTORY,
                                KVP_CLASS_AUTO, {0}};
  mk[nm++] = (kvp_segment_mark){(uint32_t)h, (uint32_t)(in - h),
                                tool ? KVP_ROLE_TOOL_OUTPUT : KVP_ROLE_USER,
                                KVP_CLASS_AUTO, {0}};
  if (in > UINT32_MAX)
    nm = 0;
  *prev_in = in;
  bh_req q = {.t = t0 + t, .think_s = think, .in_tokens = in,
              .out_tokens = (uint32_t)out, .session = session};
  return bh_trace_add(r->t, &q, r->ids, (size_t)n, mk, nm) < 0 ? -2 : 0;
}

static int ag_subagent(rd *r, const ag_ctx *c, json_t *o, double t0,
                       const char *parent, int depth, const char *path) {
  char why[320] = "";
  double t;
  uint64_t sys = 0, tools = 0;
  json_t *id = json_object_get(o, "agent_id");
  json_t *ty = json_object_get(o, "subagent_type");
  json_t *rq = json_object_get(o, "requests");
  if (!need_num(o, "t", MAX_TIME_S, &t, why, sizeof why) ||
      get_uint(o, "system_tokens", MAX_TOKENS, &sys, why, sizeof why) < 0 ||
      get_uint(o, "tool_tokens", MAX_TOKENS, &tools, why, sizeof why) < 0)
    return bad(r, "%s", why);
  if (!json_is_string(id) || (ty != NULL && !json_is_string(ty)) ||
      !json_is_array(rq))
    return bad(r, "sub-agent needs agent_id (string), requests (array) and "
                  "an optional subagent_type (string)");
  if (depth >= 4)
    return bad(r, "sub-agents nested deeper than 4");
  char session[KVP_LEDGER_NAME_MAX];
  snprintf(session, sizeof session, "%.100s/%.100s", parent,
           json_string_value(id));
  char kind[80];
  snprintf(kind, sizeof kind, "sub:%.64s",
           ty != NULL ? json_string_value(ty) : "agent");
  return ag_session(r, c, rq, t0 + t, sys, tools, kind, session, depth + 1,
                    path);
}

static int ag_session(rd *r, const ag_ctx *c, json_t *reqs, double t0,
                      uint64_t sys, uint64_t tools, const char *kind,
                      const char *session, int depth, const char *path) {
  uint32_t sid;
  uint64_t prev_in = 0;
  int rc;
  if (bh_trace_name(r->t, session, &sid) < 0)
    return fatal(r, KVP_ENOMEM, "out of memory");
  for (size_t i = 0; i < json_array_size(reqs) && !limit_reached(r); i++) {
    json_t *o = json_array_get(reqs, i);
    char here[96], why[320] = "";
    snprintf(here, sizeof here, "%s[%zu]", path, i);
    snprintf(r->where, sizeof r->where, "%s", here);
    json_t *ty = json_is_object(o) ? json_object_get(o, "type") : NULL;
    if (!json_is_object(o) || !json_is_string(ty)) {
      if ((rc = bad(r, "expected an object with a string 'type'")) < 0)
        return rc;
      continue;
    }
    if (strcmp(json_string_value(ty), "subagent") == 0) {
      char sub[96];
      snprintf(sub, sizeof sub, "%.80s.requests", here);
      if ((rc = ag_subagent(r, c, o, t0, session, depth, sub)) < 0)
        return rc;
      continue;
    }
    int res = ag_turn(r, c, o, t0, sys, tools, kind, sid, &prev_in, why,
                      sizeof why);
    if (res == -2)
      return fatal(r, KVP_ENOMEM, "out of memory");
    if (res < 0) {
      snprintf(r->where, sizeof r->where, "%s", here);
      if ((rc = bad(r, "%s", why)) < 0)
        return rc;
    } else {
      r->t->records_ok++;
    }
  }
  return 0;
}

static int read_agentic(rd *r) {
  json_error_t je;
  snprintf(r->where, sizeof r->where, "1");
  json_t *root = json_load_callback(json_cb, r->src,
                                    JSON_REJECT_DUPLICATES,
                                    &je);
  if (root == NULL) {
    snprintf(r->where, sizeof r->where, "%d", je.line);
    if (bh_src_error(r->src)[0])
      return fatal(r, KVP_ECORRUPT, "%s", bh_src_error(r->src));
    return fatal(r, KVP_ECORRUPT, "invalid JSON at column %d: %s", je.column,
                 je.text);
  }
  char why[320] = "";
  uint64_t bs, sys = 0, tools = 0;
  json_t *scope = json_object_get(root, "hash_id_scope");
  json_t *reqs = json_object_get(root, "requests");
  json_t *id = json_object_get(root, "id");
  int rc = 0;
  if (!json_is_object(root)) {
    rc = fatal(r, KVP_ECORRUPT, "expected one JSON object (a session)");
  } else if (!need_uint(root, "block_size", KVP_BLOCK_SIZE_MAX, &bs, why,
                        sizeof why) ||
             get_uint(root, "system_tokens", MAX_TOKENS, &sys, why,
                      sizeof why) < 0 ||
             get_uint(root, "tool_tokens", MAX_TOKENS, &tools, why,
                      sizeof why) < 0) {
    rc = fatal(r, KVP_ECORRUPT, "%s", why);
  } else if (scope != NULL && (!json_is_string(scope) ||
                               (strcmp(json_string_value(scope), "local") &&
                                strcmp(json_string_value(scope), "global")))) {
    rc = fatal(r, KVP_ECORRUPT, "field 'hash_id_scope': \"local\" or \"global\"");
  } else if (!json_is_array(reqs)) {
    rc = fatal(r, KVP_ECORRUPT, "field 'requests': expected an array");
  } else if (id != NULL && !json_is_string(id)) {
    rc = fatal(r, KVP_ECORRUPT, "field 'id': expected a string");
  } else if ((rc = set_block_size(r, bs)) == 0) {
    ag_ctx c = {0};
    bool global = scope != NULL && !strcmp(json_string_value(scope), "global");
    c.ns = global ? 0 : ++r->t->next_session_ns;
    snprintf(c.file_id, sizeof c.file_id, "%.60s",
             id != NULL ? json_string_value(id) : bh_src_name(r->src));
    rc = ag_session(r, &c, reqs, 0.0, sys, tools, "main", c.file_id, 0,
                    "requests");
  }
  json_decref(root);
  return rc;
}

/* ---- entry points ---------------------------------------------------------- */
int bh_read(bh_src *s, bh_format f, const bh_read_opts *o, bh_trace *t,
            char *err, size_t cap) {
  bh_read_opts def = {0};
  rd r = {.src = s, .o = o != NULL ? o : &def, .t = t, .err = err, .cap = cap};
  if (cap > 0)
    err[0] = '\0';
  snprintf(r.where, sizeof r.where, "0");
  if (f == BH_FMT_AUTO || f >= BH_FMT_COUNT_)
    return fatal(&r, KVP_EINVAL, "no format given");
  t->sources++;
  int rc = f == BH_FMT_AGENTIC ? read_agentic(&r) : read_lines(&r, f);
  free(r.ids);
  return rc;
}

/* Format from the name, else from the first bytes. */
static bh_format detect(const char *path) {
  const char *b = strrchr(path, '/');
  b = b ? b + 1 : path;
  if (strstr(b, "mooncake"))
    return BH_FMT_MOONCAKE;
  if (strstr(b, "bailian") || strstr(b, "qwen"))
    return BH_FMT_BAILIAN;
  char err[256];
  bh_src *s;
  if (bh_src_open_file(path, &s, err, sizeof err) < 0)
    return BH_FMT_AUTO;
  char buf[4096];
  long n = bh_src_read(s, buf, sizeof buf - 1);
  bh_src_close(s);
  if (n <= 0)
    return BH_FMT_AUTO;
  buf[n] = '\0';
  if (strstr(buf, "\"kvplane-trace\""))
    return BH_FMT_KVPLANE;
  if (strstr(buf, "\"hash_id_scope\"") || strstr(buf, "\"requests\""))
    return BH_FMT_AGENTIC;
  if (strstr(buf, "\"chat_id\""))
    return BH_FMT_BAILIAN;
  if (strstr(buf, "\"input_length\""))
    return BH_FMT_MOONCAKE;
  return BH_FMT_AUTO;
}

static int read_file(const char *path, bh_format f, const bh_read_opts *o,
                     bh_trace *t, char *err, size_t cap) {
  if (f == BH_FMT_AUTO && (f = detect(path)) == BH_FMT_AUTO) {
    snprintf(err, cap, "%s: cannot tell the trace format (use --format)",
             path);
    return KVP_EINVAL;
  }
  bh_src *s;
  int rc = bh_src_open_file(path, &s, err, cap);
  if (rc < 0)
    return rc;
  rc = bh_read(s, f, o, t, err, cap);
  bh_src_close(s);
  return rc;
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool trace_name(const char *n) {
  size_t l = strlen(n);
  static const char *const ext[] = {".json", ".json.zst", ".jsonl",
                                    ".jsonl.zst"};
  for (size_t i = 0; i < 4; i++) {
    size_t e = strlen(ext[i]);
    if (l > e && strcmp(n + l - e, ext[i]) == 0)
      return true;
  }
  return false;
}

int bh_read_path(const char *path, bh_format f, const bh_read_opts *o,
                 bh_trace *t, char *err, size_t cap) {
  struct stat st;
  if (stat(path, &st) != 0) {
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    return -errno;
  }
  if (!S_ISDIR(st.st_mode))
    return read_file(path, f, o, t, err, cap);
  DIR *d = opendir(path);
  if (d == NULL) {
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    return -errno;
  }
  char **names = NULL;
  size_t n = 0, ncap = 0;
  int rc = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.' || !trace_name(e->d_name))
      continue;
    if (grow((void **)&names, &ncap, n + 1, sizeof *names) < 0 ||
        (names[n] = strdup(e->d_name)) == NULL) {
      rc = KVP_ENOMEM;
      break;
    }
    n++;
  }
  closedir(d);
  if (rc == 0 && n == 0) {
    snprintf(err, cap, "%s: no *.json[l][.zst] trace files", path);
    rc = KVP_ENOENT;
  }
  if (n > 0)
    qsort(names, n, sizeof *names, name_cmp);
  for (size_t i = 0; i < n && rc == 0; i++) {
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", path, names[i]);
    rc = read_file(p, f, o, t, err, cap);
  }
  for (size_t i = 0; i < n; i++)
    free(names[i]);
  free(names);
  return rc;
}

/* ---- finish: order and classify ---------------------------------------------- */
static int req_cmp(const void *a, const void *b) {
  const bh_req *x = a, *y = b;
  if (x->t != y->t)
    return x->t < y->t ? -1 : 1;
  return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* ---- distinct keys ----------------------------------------------------------
 * Numbered in arrival order.  A session's turn mostly repeats its last
 * one's prompt, and equal chained keys at j mean equal prefixes up to j, so
 * the prefix it shares with that turn (a binary search) copies its numbers;
 * only the rest is looked up, in a table of the distinct keys (open
 * addressing, full 128-bit compare), its slots prefetched ahead. */
typedef struct kid_slot {
  kvp_key k;
  uint32_t id; /* + 1; 0 = empty */
} kid_slot;

typedef struct kid_tab {
  kid_slot *v;
  size_t mask, n;
} kid_tab;

static size_t kid_home(kvp_key k, size_t mask) {
  return (size_t)((k.lo ^ k.hi) * 0x9E3779B97F4A7C15ull >> 17) & mask;
}

static int kid_grow(kid_tab *h) {
  size_t nm = h->mask ? h->mask * 2 + 1 : 4095;
  kid_slot *nv = calloc(nm + 1, sizeof *nv);
  if (nv == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; h->v != NULL && i <= h->mask; i++)
    if (h->v[i].id != 0) {
      size_t j = kid_home(h->v[i].k, nm);
      while (nv[j].id != 0)
        j = (j + 1) & nm;
      nv[j] = h->v[i];
    }
  free(h->v);
  h->v = nv;
  h->mask = nm;
  return 0;
}

/* keys[j]'s number: found, or the next one (*next) given. */
static int kid_of(kid_tab *h, kvp_key k, uint32_t *next, uint32_t *out) {
  if ((h->n + 1) * 4 > (h->mask + 1) * 3 && kid_grow(h) < 0)
    return KVP_ENOMEM;
  size_t i = kid_home(k, h->mask);
  for (; h->v[i].id != 0; i = (i + 1) & h->mask)
    if (kvp_key_eq(h->v[i].k, k)) {
      *out = h->v[i].id - 1;
      return 0;
    }
  if (*next == UINT32_MAX - 1)
    return KVP_ERANGE; /* ids are stored + 1 */
  h->v[i] = (kid_slot){k, *next + 1};
  h->n++;
  *out = (*next)++;
  return 0;
}

uint64_t bh_keys_common_prefix(const kvp_key *a, uint64_t na,
                               const kvp_key *b, uint64_t nb) {
  uint64_t hi = na < nb ? na : nb, lo = 0;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo + 1) / 2;
    if (kvp_key_eq(a[mid - 1], b[mid - 1]))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

static int number_keys(bh_trace *t) {
  enum { AHEAD = 8 };
  uint32_t *kid = malloc((t->n_keys ? t->n_keys : 1) * sizeof *kid);
  uint32_t *last = malloc((t->n_names ? t->n_names : 1) * sizeof *last);
  kid_tab h = {0};
  uint32_t next = 0;
  int rc = kid == NULL || last == NULL || kid_grow(&h) < 0 ? KVP_ENOMEM : 0;
  for (size_t s = 0; rc == 0 && s < t->n_names; s++)
    last[s] = UINT32_MAX;
  for (size_t i = 0; i < t->n_reqs && rc == 0; i++) {
    const bh_req *q = &t->reqs[i];
    const kvp_key *k = t->keys + q->key_off;
    uint64_t j = 0, n = q->n_blocks;
    if (q->session != 0 && last[q->session] != UINT32_MAX) {
      const bh_req *p = &t->reqs[last[q->session]];
      j = bh_keys_common_prefix(t->keys + p->key_off, p->n_blocks, k, n);
      if (p->key_off != q->key_off) /* else the same keys: numbered */
        memcpy(kid + q->key_off, kid + p->key_off, j * sizeof *kid);
    }
    if (q->session != 0)
      last[q->session] = (uint32_t)i;
    for (; j < n && rc == 0; j++) {
      if (j + AHEAD < n)
        __builtin_prefetch(&h.v[kid_home(k[j + AHEAD], h.mask)]);
      rc = kid_of(&h, k[j], &next, &kid[q->key_off + j]);
    }
  }
  free(h.v);
  free(last);
  if (rc < 0) {
    free(kid);
    return rc;
  }
  free(t->kid);
  t->kid = kid;
  t->n_kids = next;
  return 0;
}

int bh_trace_finish(bh_trace *t) {
  if (t->n_reqs == 0)
    return 0;
  if (t->n_reqs > UINT32_MAX - 1)
    return KVP_ERANGE;
  qsort(t->reqs, t->n_reqs, sizeof *t->reqs, req_cmp);
  int rc = number_keys(t);
  if (rc < 0)
    return rc;
  kvp_stability *st;
  if ((rc = kvp_stability_create(NULL, NULL, &st)) < 0)
    return rc;
  for (size_t i = 0; i < t->n_reqs && rc >= 0; i++) {
    bh_req *q = &t->reqs[i];
    /* no session: each request its own (nothing is semi-stable) */
    const char *sn = q->session ? t->names[q->session] : NULL;
    q->session_id = sn ? XXH3_64bits(sn, strlen(sn)) | 1 : 0;
    uint64_t sid = sn ? q->session_id : (1ull << 40) + q->seq;
    kvp_classification c;
    rc = kvp_stability_observe(st, sid, t->keys + q->key_off, q->n_blocks,
                               t->block_size,
                               q->in_tokens - (uint64_t)q->n_blocks *
                                                  t->block_size,
                               q->n_marks ? t->marks + q->mark_off : NULL,
                               q->n_marks, &c);
    if (rc < 0)
      break;
    q->stable_end = c.stable_end;
    q->semi_end = c.semi_end;
    memcpy(q->cls_tokens, c.tokens, sizeof q->cls_tokens);
  }
  kvp_stability_destroy(st);
  return rc;
}

/* ---- writer ------------------------------------------------------------------ */
static const char *role_str(uint8_t r) { return kvp_role_name((kvp_role)r); }

int bh_trace_write_kvplane(const bh_trace *t, FILE *f) {
  fprintf(f, "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":%u}\n",
          t->block_size);
  for (size_t i = 0; i < t->n_reqs; i++) {
    const bh_req *q = &t->reqs[i];
    fprintf(f, "{\"t\":%.6f,\"in\":%llu,\"out\":%u", q->t,
            (unsigned long long)q->in_tokens, q->out_tokens);
    if (q->think_s > 0)
      fprintf(f, ",\"think\":%.3f", q->think_s);
    if (q->tenant) {
      json_t *s = json_string(t->names[q->tenant]);
      char *e = json_dumps(s, JSON_ENCODE_ANY);
      fprintf(f, ",\"tenant\":%s", e ? e : "\"\"");
      free(e);
      json_decref(s);
    }
    if (q->session) {
      json_t *s = json_string(t->names[q->session]);
      char *e = json_dumps(s, JSON_ENCODE_ANY);
      fprintf(f, ",\"session\":%s", e ? e : "\"\"");
      free(e);
      json_decref(s);
    }
    if (q->n_marks) {
      fputs(",\"segments\":[", f);
      for (uint32_t m = 0; m < q->n_marks; m++) {
        const kvp_segment_mark *k = &t->marks[q->mark_off + m];
        fprintf(f, "%s{\"offset\":%u,\"length\":%u,\"role\":\"%s\"", m ? "," : "",
                k->offset, k->length, role_str(k->role));
        if (k->class_hint != KVP_CLASS_AUTO)
          fprintf(f, ",\"class\":\"%s\"",
                  kvp_class_name((kvp_class)k->class_hint));
        fputc('}', f);
      }
      fputc(']', f);
    }
    fputs(",\"hash_ids\":[", f);
    for (uint32_t b = 0; b < q->n_blocks; b++)
      fprintf(f, "%s%llu", b ? "," : "",
              (unsigned long long)(t->keys[q->key_off + b].lo >> 1));
    fputs("]}\n", f);
  }
  return ferror(f) ? KVP_EIO : 0;
}
