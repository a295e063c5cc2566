/* SPDX-License-Identifier: Apache-2.0 */
/* The ledger: per request/session/tenant reuse accounting in bounded memory,
 * exported as Prometheus text 0.0.4 and JSON lines.
 *
 * Invariants: every accepted record obeys ledger.h's sum rules, so every
 * totals struct does too; `global` includes every accepted record, so a
 * tenant or session dropped by its LRU cap has already been folded into it;
 * after an add returns no table holds more than its cap.
 * Lock: one mutex `mu` (no other lock exists, so no order).  It is held for
 * table bookkeeping and snapshot copies, which may call the caller's
 * allocator, but never while a caller's writer runs. */
#include <assert.h>
#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "core_internal.h"
#include "kvplane/ledger.h"

#define DEFAULT_SESSIONS 65536u
#define DEFAULT_TENANTS 4096u
#define LIMIT_SESSIONS (1u << 24)
#define LIMIT_TENANTS 65536u
#define MIN_BITS 6u    /* 64 buckets: also the number of dump slices */
#define OUT_CHUNK 4096 /* bytes handed to a writer at a time */

/* ---- names of label values ----------------------------------------------- */
static const char *const tier_names[KVP_TIER_COUNT_] = {"hbm", "dram", "nvme",
                                                        "remote"};
/* Own table rather than kvp_class_name(): that lives in router, which core
 * may not use. */
static const char *const class_names[KVP_CLASS_COUNT_] = {"volatile", "semi",
                                                          "stable"};
static const char *const cause_names[KVP_MISS_COUNT_] = {
    "never_seen",   "evicted",      "on_other_worker",   "partial_block",
    "namespace",    "prompt_drift", "not_worth_loading", "unknown"};
static const char *const reject_names[KVP_LEDGER_REJECT_COUNT_] = {
    "name", "tokens", "tier", "class", "miss", "estimate", "bytes", "field"};

const char *kvp_miss_cause_name(kvp_miss_cause c) {
  return (unsigned)c < KVP_MISS_COUNT_ ? cause_names[c] : "invalid";
}

const char *kvp_ledger_reject_name(kvp_ledger_reject r) {
  return (unsigned)r < KVP_LEDGER_REJECT_COUNT_ ? reject_names[r] : "invalid";
}

/* ---- per-request histograms ----------------------------------------------
 * Fixed Prometheus buckets; counts are per bucket (not cumulative), the last
 * slot is +Inf. */
#define HIST_SLOTS 16
static const double tokens_le[] = {0,    16,    64,    256,    1024,
                                   4096, 16384, 65536, 262144, 1048576};
static const double ratio_le[] = {0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1};
#define N_TOKENS_LE (sizeof tokens_le / sizeof tokens_le[0])
#define N_RATIO_LE (sizeof ratio_le / sizeof ratio_le[0])
_Static_assert(N_TOKENS_LE < HIST_SLOTS && N_RATIO_LE < HIST_SLOTS,
               "histogram slots");

typedef struct hist {
  uint64_t counts[HIST_SLOTS];
  uint64_t count;
  double sum;
} hist;

static void hist_add(hist *h, const double *le, size_t n_le, double v) {
  size_t i = 0;
  while (i < n_le && !(v <= le[i]))
    i++;
  h->counts[i]++;
  h->count++;
  h->sum += v;
}

/* ---- tables: hash chains + LRU list -------------------------------------- */
typedef struct entry {
  struct entry *hnext;       /* hash chain */
  struct entry *prev, *next; /* LRU list, most recently recorded first */
  uint64_t hash;
  kvp_ledger_totals t;
  uint16_t tlen, slen;
  char names[]; /* tenant NUL session NUL */
} entry;

/* Buckets are indexed by the hash's top bits, so bucket ranges are hash
 * ranges at every size and the 64 dump slices stay fixed while it grows. */
typedef struct table {
  entry **buckets;
  unsigned bits, max_bits; /* doubles up to the first 2^bits >= cap */
  size_t count, cap;
  entry *head, *tail;
  uint64_t evictions;
} table;

/* A caller's names with their table hash; strings never NULL (memcmp). */
typedef struct key {
  const char *t, *s;
  size_t tlen, slen;
  uint64_t hash;
} key;

static size_t bucket_of(unsigned bits, uint64_t hash) {
  return (size_t)(hash >> (64u - bits));
}

static int table_init(table *tb, const kvp_allocator *a, size_t cap) {
  memset(tb, 0, sizeof *tb);
  tb->cap = cap;
  tb->bits = tb->max_bits = MIN_BITS;
  while (((size_t)1 << tb->max_bits) < cap)
    tb->max_bits++;
  tb->buckets = kvp__calloc(a, (size_t)1 << MIN_BITS, sizeof *tb->buckets);
  return tb->buckets ? 0 : KVP_ENOMEM;
}

static size_t entry_size(size_t tlen, size_t slen) {
  return offsetof(entry, names) + tlen + slen + 2;
}

static void entry_free(const kvp_allocator *a, entry *e) {
  if (e != NULL)
    kvp__free(a, e, entry_size(e->tlen, e->slen));
}

static entry *entry_new(const kvp_allocator *a, const key *k) {
  entry *e = kvp__calloc(a, 1, entry_size(k->tlen, k->slen));
  if (e == NULL)
    return NULL;
  e->hash = k->hash;
  e->tlen = (uint16_t)k->tlen;
  e->slen = (uint16_t)k->slen;
  memcpy(e->names, k->t, k->tlen);
  memcpy(e->names + k->tlen + 1, k->s, k->slen);
  return e;
}

static void table_destroy(table *tb, const kvp_allocator *a) {
  for (entry *e = tb->head, *next; e != NULL; e = next) {
    next = e->next;
    entry_free(a, e);
  }
  if (tb->buckets != NULL)
    kvp__free(a, tb->buckets, ((size_t)1 << tb->bits) * sizeof *tb->buckets);
  tb->buckets = NULL;
}

static entry *table_find(const table *tb, const key *k) {
  for (entry *e = tb->buckets[bucket_of(tb->bits, k->hash)]; e; e = e->hnext)
    if (e->hash == k->hash && e->tlen == k->tlen && e->slen == k->slen &&
        memcmp(e->names, k->t, k->tlen) == 0 &&
        memcmp(e->names + e->tlen + 1, k->s, k->slen) == 0)
      return e;
  return NULL;
}

static void lru_unlink(table *tb, entry *e) {
  *(e->prev ? &e->prev->next : &tb->head) = e->next;
  *(e->next ? &e->next->prev : &tb->tail) = e->prev;
  e->prev = e->next = NULL;
}

static void lru_push_front(table *tb, entry *e) {
  e->prev = NULL;
  e->next = tb->head;
  *(tb->head ? &tb->head->prev : &tb->tail) = e;
  tb->head = e;
}

static void lru_touch(table *tb, entry *e) {
  if (tb->head != e) {
    lru_unlink(tb, e);
    lru_push_front(tb, e);
  }
}

/* Doubles the bucket array while the load factor is above 1.  Failing to grow
 * only lengthens chains, so it is not an error. */
static void table_maybe_grow(table *tb, const kvp_allocator *a) {
  size_t n = (size_t)1 << tb->bits;
  if (tb->count < n || tb->bits >= tb->max_bits)
    return;
  entry **nb = kvp__calloc(a, 2 * n, sizeof *nb);
  if (nb == NULL)
    return;
  for (size_t i = 0; i < n; i++)
    for (entry *e = tb->buckets[i], *next; e != NULL; e = next) {
      next = e->hnext;
      size_t b = bucket_of(tb->bits + 1, e->hash);
      e->hnext = nb[b];
      nb[b] = e;
    }
  kvp__free(a, tb->buckets, n * sizeof *nb);
  tb->buckets = nb;
  tb->bits++;
}

static void table_evict_tail(table *tb, const kvp_allocator *a) {
  entry *e = tb->tail;
  entry **pp = &tb->buckets[bucket_of(tb->bits, e->hash)];
  while (*pp != e)
    pp = &(*pp)->hnext;
  *pp = e->hnext;
  lru_unlink(tb, e);
  tb->count--;
  tb->evictions++;
  entry_free(a, e);
}

/* Inserts `e` as most recent and drops the least recent beyond the cap; the
 * cap is >= 1, so `e` itself is never dropped. */
static void table_insert(table *tb, const kvp_allocator *a, entry *e) {
  table_maybe_grow(tb, a);
  size_t b = bucket_of(tb->bits, e->hash);
  e->hnext = tb->buckets[b];
  tb->buckets[b] = e;
  lru_push_front(tb, e);
  tb->count++;
  while (tb->count > tb->cap)
    table_evict_tail(tb, a);
}

/* ---- keyed hash (SipHash-1-3) ---------------------------------------------
 * Session names may come from end users; a per-ledger random key keeps them
 * from choosing colliding names that turn chains into lists. */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

static void sip_round(uint64_t v[4]) {
  v[0] += v[1], v[1] = ROTL(v[1], 13), v[1] ^= v[0], v[0] = ROTL(v[0], 32);
  v[2] += v[3], v[3] = ROTL(v[3], 16), v[3] ^= v[2];
  v[0] += v[3], v[3] = ROTL(v[3], 21), v[3] ^= v[0];
  v[2] += v[1], v[1] = ROTL(v[1], 17), v[1] ^= v[2], v[2] = ROTL(v[2], 32);
}

static uint64_t siphash13(const uint64_t k[2], const unsigned char *p,
                          size_t n) {
  uint64_t v[4] = {k[0] ^ 0x736f6d6570736575ull, k[1] ^ 0x646f72616e646f6dull,
                   k[0] ^ 0x6c7967656e657261ull, k[1] ^ 0x7465646279746573ull};
  uint64_t m, last = (uint64_t)n << 56;
  for (; n >= 8; n -= 8, p += 8) {
    memcpy(&m, p, 8);
    v[3] ^= m, sip_round(v), v[0] ^= m;
  }
  for (size_t i = 0; i < n; i++)
    last |= (uint64_t)p[i] << (8 * i);
  v[3] ^= last, sip_round(v), v[0] ^= last;
  v[2] ^= 0xff;
  sip_round(v), sip_round(v), sip_round(v);
  return v[0] ^ v[1] ^ v[2] ^ v[3];
}

static void hash_key_init(uint64_t k[2], const void *salt) {
  if (getrandom(k, 2 * sizeof k[0], GRND_NONBLOCK) == 2 * sizeof k[0])
    return;
  /* No entropy yet (early boot): still differs per process and ledger. */
  k[0] = kvp_now_ns() ^ 0x9E3779B97F4A7C15ull;
  k[1] = (uint64_t)(uintptr_t)salt * 0xBF58476D1CE4E5B9ull;
}

/* Length-prefixed, so ("ab","c") and ("a","bc") differ. */
static void key_make(const uint64_t sip[2], key *k, const char *t,
                     const char *s) {
  unsigned char buf[2 * (KVP_LEDGER_NAME_MAX + 2)];
  k->t = t ? t : "";
  k->s = s ? s : "";
  k->tlen = strlen(k->t); /* bounded: validated before */
  k->slen = strlen(k->s);
  buf[0] = (unsigned char)(k->tlen >> 8), buf[1] = (unsigned char)k->tlen;
  memcpy(buf + 2, k->t, k->tlen);
  unsigned char *q = buf + 2 + k->tlen;
  q[0] = (unsigned char)(k->slen >> 8), q[1] = (unsigned char)k->slen;
  memcpy(q + 2, k->s, k->slen);
  k->hash = siphash13(sip, buf, 4 + k->tlen + k->slen);
}

/* ---- record validation --------------------------------------------------- */
static bool name_ok(const char *s) {
  if (s == NULL)
    return true;
  size_t n = strnlen(s, KVP_LEDGER_NAME_MAX + 1);
  return n <= KVP_LEDGER_NAME_MAX && kvp__utf8_valid(s, n);
}

/* Overflow-checked, so values that wrap around to `want` do not pass. */
static bool sum_is(const uint64_t *v, size_t n, uint64_t want) {
  uint64_t s = 0;
  for (size_t i = 0; i < n; i++)
    if (__builtin_add_overflow(s, v[i], &s))
      return false;
  return s == want;
}

static bool fields_ok(const kvp_ledger_record *r) {
  if (r->worker < -1 || r->worker >= (int32_t)KVP_WORKERS_MAX ||
      r->reserved0 != 0)
    return false;
  for (size_t i = 0; i < sizeof r->reserved / sizeof r->reserved[0]; i++)
    if (r->reserved[i] != 0)
      return false;
  return true;
}

static bool classes_ok(const kvp_ledger_record *r) {
  for (int c = 0; c < KVP_CLASS_COUNT_; c++)
    if (r->reused_by_class[c] > r->prompt_by_class[c])
      return false;
  return sum_is(r->prompt_by_class, KVP_CLASS_COUNT_, r->prompt_tokens) &&
         sum_is(r->reused_by_class, KVP_CLASS_COUNT_, r->reused_tokens);
}

/* An estimate of avoided work: a finite amount, none when nothing was
 * reused. */
static bool estimate_ok(double v, uint64_t reused) {
  return isfinite(v) && v >= 0 && (reused != 0 || v == 0);
}

static bool bytes_ok(const kvp_ledger_record *r) {
  for (int t = 0; t < KVP_TIER_COUNT_; t++)
    if (r->load_bytes[t] != 0 && r->reused_by_tier[t] == 0)
      return false;
  return true;
}

/* The first broken rule, or -1. */
static int check_reason(const kvp_ledger_record *r) {
  uint64_t total;
  if (!name_ok(r->tenant) || !name_ok(r->session) || !name_ok(r->request_id))
    return KVP_LEDGER_REJECT_NAME;
  if (!fields_ok(r))
    return KVP_LEDGER_REJECT_FIELD;
  if (__builtin_add_overflow(r->reused_tokens, r->recomputed_tokens, &total) ||
      total != r->prompt_tokens)
    return KVP_LEDGER_REJECT_TOKENS;
  if (!sum_is(r->reused_by_tier, KVP_TIER_COUNT_, r->reused_tokens))
    return KVP_LEDGER_REJECT_TIER;
  if (!classes_ok(r))
    return KVP_LEDGER_REJECT_CLASS;
  if (!sum_is(r->miss_tokens, KVP_MISS_COUNT_, r->recomputed_tokens))
    return KVP_LEDGER_REJECT_MISS;
  if (!estimate_ok(r->avoided_flops, r->reused_tokens) ||
      !estimate_ok(r->avoided_gpu_seconds, r->reused_tokens))
    return KVP_LEDGER_REJECT_ESTIMATE;
  if (!bytes_ok(r))
    return KVP_LEDGER_REJECT_BYTES;
  return -1;
}

int kvp_ledger_check(const kvp_ledger_record *r, kvp_ledger_reject *why) {
  if (r == NULL)
    return KVP_EINVAL;
  int reason = check_reason(r);
  if (reason >= 0 && why != NULL)
    *why = (kvp_ledger_reject)reason;
  return reason >= 0 ? KVP_EINVAL : 0;
}

static void totals_add(kvp_ledger_totals *t, const kvp_ledger_record *r) {
  t->requests++;
  t->prompt_tokens += r->prompt_tokens;
  t->reused_tokens += r->reused_tokens;
  t->recomputed_tokens += r->recomputed_tokens;
  for (int i = 0; i < KVP_TIER_COUNT_; i++) {
    t->reused_by_tier[i] += r->reused_by_tier[i];
    t->load_bytes[i] += r->load_bytes[i];
  }
  for (int i = 0; i < KVP_CLASS_COUNT_; i++) {
    t->prompt_by_class[i] += r->prompt_by_class[i];
    t->reused_by_class[i] += r->reused_by_class[i];
  }
  for (int i = 0; i < KVP_MISS_COUNT_; i++)
    t->miss_tokens[i] += r->miss_tokens[i];
  t->avoided_flops += r->avoided_flops;
  t->avoided_gpu_seconds += r->avoided_gpu_seconds;
}

/* ---- the ledger ---------------------------------------------------------- */
struct kvp_ledger {
  kvp_allocator alloc;
  pthread_mutex_t mu;
  uint64_t sip[2]; /* hash key; constant after create, read without mu */
  /* everything below is guarded by mu */
  table tenants, sessions;
  kvp_ledger_totals global;
  hist avoided_tokens, reuse_ratio;
  uint64_t rejected[KVP_LEDGER_REJECT_COUNT_];
  uint64_t alloc_failures;
};

static int opts_resolve(const kvp_ledger_opts *in, kvp_ledger_opts *o) {
  *o = in ? *in : (kvp_ledger_opts){0};
  for (size_t i = 0; i < sizeof o->reserved / sizeof o->reserved[0]; i++)
    if (o->reserved[i] != 0)
      return KVP_EINVAL;
  if (o->max_sessions == 0)
    o->max_sessions = DEFAULT_SESSIONS;
  if (o->max_tenants == 0)
    o->max_tenants = DEFAULT_TENANTS;
  if (o->max_sessions > LIMIT_SESSIONS || o->max_tenants > LIMIT_TENANTS)
    return KVP_ERANGE;
  return 0;
}

int kvp_ledger_create(const kvp_ledger_opts *opts, const kvp_allocator *alloc,
                      kvp_ledger **out) {
  kvp_ledger_opts o;
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  int rc = opts_resolve(opts, &o);
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_ledger *l = kvp__calloc(&a, 1, sizeof *l);
  if (l == NULL)
    return KVP_ENOMEM;
  l->alloc = a;
  if ((rc = table_init(&l->tenants, &a, o.max_tenants)) < 0)
    goto fail_tenants;
  if ((rc = table_init(&l->sessions, &a, o.max_sessions)) < 0)
    goto fail_sessions;
  if ((rc = pthread_mutex_init(&l->mu, NULL)) != 0) {
    rc = -rc;
    goto fail_mutex;
  }
  hash_key_init(l->sip, l);
  *out = l;
  return 0;
fail_mutex:
  table_destroy(&l->sessions, &a);
fail_sessions:
  table_destroy(&l->tenants, &a);
fail_tenants:
  kvp__free(&a, l, sizeof *l);
  return rc;
}

void kvp_ledger_destroy(kvp_ledger *l) {
  if (l == NULL)
    return;
  kvp_allocator a = l->alloc;
  pthread_mutex_destroy(&l->mu);
  table_destroy(&l->sessions, &a);
  table_destroy(&l->tenants, &a);
  kvp__free(&a, l, sizeof *l);
}

/* Finds or allocates every entry first, so an allocation failure leaves all
 * totals untouched; only then inserts (which may evict) and adds. */
static int add_locked(kvp_ledger *l, const kvp_ledger_record *r,
                      const key *tk, const key *sk) {
  entry *te = NULL, *se = NULL, *tnew = NULL, *snew = NULL;
  if (tk->tlen > 0 && (te = table_find(&l->tenants, tk)) == NULL &&
      (te = tnew = entry_new(&l->alloc, tk)) == NULL)
    goto fail;
  if (sk->slen > 0 && (se = table_find(&l->sessions, sk)) == NULL &&
      (se = snew = entry_new(&l->alloc, sk)) == NULL)
    goto fail;
  if (tnew != NULL)
    table_insert(&l->tenants, &l->alloc, tnew);
  else if (te != NULL)
    lru_touch(&l->tenants, te);
  if (snew != NULL)
    table_insert(&l->sessions, &l->alloc, snew);
  else if (se != NULL)
    lru_touch(&l->sessions, se);
  totals_add(&l->global, r);
  if (te != NULL)
    totals_add(&te->t, r);
  if (se != NULL)
    totals_add(&se->t, r);
  hist_add(&l->avoided_tokens, tokens_le, N_TOKENS_LE,
           (double)r->reused_tokens);
  if (r->prompt_tokens > 0) /* no ratio for an empty prompt */
    hist_add(&l->reuse_ratio, ratio_le, N_RATIO_LE,
             (double)r->reused_tokens / (double)r->prompt_tokens);
  return 0;
fail:
  entry_free(&l->alloc, tnew);
  l->alloc_failures++;
  return KVP_ENOMEM;
}

int kvp_ledger_add(kvp_ledger *l, const kvp_ledger_record *r) {
  if (l == NULL || r == NULL)
    return KVP_EINVAL;
  key tk, sk;
  int why = check_reason(r);
  if (why < 0) { /* hash outside the lock; names are valid now */
    key_make(l->sip, &tk, r->tenant, NULL);
    key_make(l->sip, &sk, r->tenant, r->session);
  }
  pthread_mutex_lock(&l->mu);
  int rc = KVP_EINVAL;
  if (why >= 0)
    l->rejected[why]++;
  else
    rc = add_locked(l, r, &tk, &sk);
  pthread_mutex_unlock(&l->mu);
  if (why >= 0)
    KVP_LOGD("ledger", "record rejected: %s", reject_names[why]);
  return rc;
}

/* ---- queries ------------------------------------------------------------- */
int kvp_ledger_global_totals(kvp_ledger *l, kvp_ledger_totals *out) {
  if (l == NULL || out == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  *out = l->global;
  pthread_mutex_unlock(&l->mu);
  return 0;
}

static int lookup(kvp_ledger *l, table *tb, const key *k,
                  kvp_ledger_totals *out) {
  pthread_mutex_lock(&l->mu);
  const entry *e = table_find(tb, k);
  if (e != NULL)
    *out = e->t;
  pthread_mutex_unlock(&l->mu);
  return e != NULL ? 0 : KVP_ENOENT;
}

int kvp_ledger_tenant_totals(kvp_ledger *l, const char *tenant,
                             kvp_ledger_totals *out) {
  if (l == NULL || out == NULL || tenant == NULL || tenant[0] == '\0' ||
      !name_ok(tenant))
    return KVP_EINVAL;
  key k;
  key_make(l->sip, &k, tenant, NULL);
  return lookup(l, &l->tenants, &k, out);
}

int kvp_ledger_session_totals(kvp_ledger *l, const char *tenant,
                              const char *session, kvp_ledger_totals *out) {
  if (l == NULL || out == NULL || session == NULL || session[0] == '\0' ||
      !name_ok(session) || !name_ok(tenant))
    return KVP_EINVAL;
  key k;
  key_make(l->sip, &k, tenant, session);
  return lookup(l, &l->sessions, &k, out);
}

static void stats_locked(const kvp_ledger *l, kvp_ledger_stats *s) {
  memset(s, 0, sizeof *s);
  for (int i = 0; i < KVP_LEDGER_REJECT_COUNT_; i++) {
    s->rejected[i] = l->rejected[i];
    s->rejected_total += l->rejected[i];
  }
  s->alloc_failures = l->alloc_failures;
  s->sessions = l->sessions.count;
  s->tenants = l->tenants.count;
  s->max_sessions = l->sessions.cap;
  s->max_tenants = l->tenants.cap;
  s->session_evictions = l->sessions.evictions;
  s->tenant_evictions = l->tenants.evictions;
}

int kvp_ledger_get_stats(kvp_ledger *l, kvp_ledger_stats *out) {
  if (l == NULL || out == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  stats_locked(l, out);
  pthread_mutex_unlock(&l->mu);
  return 0;
}

double kvp_ledger_hit_rate(const kvp_ledger_totals *t, kvp_class c) {
  if (t == NULL || (unsigned)c >= KVP_CLASS_COUNT_ ||
      t->prompt_by_class[c] == 0)
    return NAN;
  return (double)t->reused_by_class[c] / (double)t->prompt_by_class[c];
}

/* ---- snapshots ------------------------------------------------------------
 * Rows copied out under the lock (one allocation: rows, then names), written
 * without it. */
typedef struct row {
  kvp_ledger_totals t;
  const char *tenant, *session;
} row;

typedef struct snap {
  row *rows;
  size_t n, size;
} snap;

static void snap_free(const kvp_allocator *a, snap *s) {
  if (s->rows != NULL)
    kvp__free(a, s->rows, s->size);
  s->rows = NULL;
}

/* Rows of slice `slice` (0..63: 1/64 of the hash space) or, for -1, all. */
static int snap_take(const table *tb, const kvp_allocator *a, int slice,
                     snap *s) {
  size_t shift = tb->bits - MIN_BITS, names = 0, n = 0;
  size_t b0 = slice < 0 ? 0 : (size_t)slice << shift;
  size_t b1 = slice < 0 ? (size_t)1 << tb->bits : (size_t)(slice + 1) << shift;
  for (size_t b = b0; b < b1; b++)
    for (const entry *e = tb->buckets[b]; e != NULL; e = e->hnext, n++)
      names += e->tlen + e->slen + 2u;
  s->n = n;
  /* bounded by the caps: no overflow; +1 so an empty slice is not a
   * zero-byte request (kvp__malloc would round it up, then free would be
   * told 0) */
  s->size = n * sizeof(row) + names + 1;
  s->rows = kvp__malloc(a, s->size);
  if (s->rows == NULL)
    return KVP_ENOMEM;
  char *p = (char *)(s->rows + n);
  row *r = s->rows;
  for (size_t b = b0; b < b1; b++)
    for (const entry *e = tb->buckets[b]; e != NULL; e = e->hnext, r++) {
      r->t = e->t;
      r->tenant = memcpy(p, e->names, e->tlen + 1u);
      p += e->tlen + 1u;
      r->session = memcpy(p, e->names + e->tlen + 1, e->slen + 1u);
      p += e->slen + 1u;
    }
  return 0;
}

static int row_cmp(const void *a, const void *b) {
  const row *x = a, *y = b;
  int c = strcmp(x->tenant, y->tenant);
  return c != 0 ? c : strcmp(x->session, y->session);
}

/* ---- output: buffered writer, escaping, numbers ------------------------- */
typedef struct out {
  kvp_ledger_write_fn fn;
  void *opaque;
  int err; /* first writer error; later output is dropped */
  size_t len;
  char buf[OUT_CHUNK];
} out;

static void out_init(out *o, kvp_ledger_write_fn fn, void *opaque) {
  o->fn = fn, o->opaque = opaque, o->err = 0, o->len = 0;
}

static int out_flush(out *o) {
  if (o->len > 0 && o->err == 0) {
    int rc = o->fn(o->opaque, o->buf, o->len);
    if (rc < 0)
      o->err = rc;
  }
  o->len = 0;
  return o->err;
}

static void out_mem(out *o, const char *s, size_t n) {
  while (n > 0 && o->err == 0) {
    if (o->len == OUT_CHUNK)
      out_flush(o);
    size_t k = OUT_CHUNK - o->len < n ? OUT_CHUNK - o->len : n;
    memcpy(o->buf + o->len, s, k);
    o->len += k, s += k, n -= k;
  }
}

static void out_str(out *o, const char *s) { out_mem(o, s, strlen(s)); }

static void out_u64(out *o, uint64_t v) {
  char tmp[24];
  int n = snprintf(tmp, sizeof tmp, "%" PRIu64, v);
  out_mem(o, tmp, (size_t)n);
}

/* printf's decimal point follows LC_NUMERIC, which a host program may have
 * set to "de_DE"; both formats need '.', so format in the C locale. */
static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static void c_locale_init(void) {
  c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
}

/* Shortest of %.15g / %.17g that reads back as v. */
static void fmt_double(char *buf, size_t cap, double v) {
  pthread_once(&c_locale_once, c_locale_init);
  locale_t old = c_locale ? uselocale(c_locale) : (locale_t)0;
  snprintf(buf, cap, "%.15g", v);
  if (strtod(buf, NULL) != v)
    snprintf(buf, cap, "%.17g", v);
  if (old)
    uselocale(old);
}

/* Prometheus spells non-finite values NaN, +Inf, -Inf; JSON has only null. */
static void out_f64(out *o, double v, bool json) {
  char tmp[40];
  if (isfinite(v))
    fmt_double(tmp, sizeof tmp, v);
  else
    snprintf(tmp, sizeof tmp, "%s",
             json ? "null" : isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf");
  out_str(o, tmp);
}

/* Prometheus label value: escape backslash, double quote and newline;
 * everything else (valid UTF-8) as is. */
static void out_label(out *o, const char *s) {
  for (const char *run = s;; s++) {
    const char *esc = *s == '\\' ? "\\\\" : *s == '"' ? "\\\"" :
                      *s == '\n' ? "\\n" : NULL;
    if (esc == NULL && *s != '\0')
      continue;
    out_mem(o, run, (size_t)(s - run));
    if (*s == '\0')
      return;
    out_str(o, esc);
    run = s + 1;
  }
}

/* JSON string (RFC 8259): quote, backslash and every control character
 * escaped; NULL or "" is null ("none").  Input is valid UTF-8 (checked). */
static void out_json_str(out *o, const char *s) {
  if (s == NULL || *s == '\0') {
    out_str(o, "null");
    return;
  }
  out_mem(o, "\"", 1);
  for (const char *run = s;; s++) {
    unsigned char c = (unsigned char)*s;
    if (c >= 0x20 && c != '"' && c != '\\' && c != 0x7f)
      continue;
    out_mem(o, run, (size_t)(s - run));
    if (c == '\0')
      break;
    char esc[8];
    const char *sh = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n"
                   : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
    if (sh == NULL)
      snprintf(esc, sizeof esc, "\\u%04x", c);
    out_str(o, sh ? sh : esc);
    run = s + 1;
  }
  out_mem(o, "\"", 1);
}

/* snprintf-like target for the buffer forms. */
typedef struct membuf {
  char *buf; /* NULL when the caller's cap is 0: nothing may be written */
  size_t cap, len; /* cap excludes the NUL; len is the full length */
} membuf;

static int membuf_write(void *opaque, const char *d, size_t n) {
  membuf *m = opaque;
  if (m->len < m->cap)
    memcpy(m->buf + m->len, d, m->cap - m->len < n ? m->cap - m->len : n);
  m->len += n;
  return 0;
}

static membuf membuf_make(char *buf, size_t cap) {
  return (membuf){cap > 0 ? buf : NULL, cap > 0 ? cap - 1 : 0, 0};
}

static void membuf_finish(membuf *m) {
  if (m->buf != NULL)
    m->buf[m->len < m->cap ? m->len : m->cap] = '\0';
}

/* ---- Prometheus -------------------------------------------------------------
 * Every totals field, once as a global family (kvplane_<name>) and once per
 * tenant (kvplane_tenant_<name>{tenant=...}). */
enum { DIM_NONE, DIM_TIER, DIM_CLASS, DIM_CAUSE };

static const struct dim {
  const char *label;
  const char *const *values;
  size_t n;
} dims[] = {
    [DIM_NONE] = {NULL, NULL, 1},
    [DIM_TIER] = {"tier", tier_names, KVP_TIER_COUNT_},
    [DIM_CLASS] = {"class", class_names, KVP_CLASS_COUNT_},
    [DIM_CAUSE] = {"cause", cause_names, KVP_MISS_COUNT_},
};

typedef struct field {
  const char *name, *help;
  uint8_t dim, is_double;
  uint16_t off; /* into kvp_ledger_totals */
} field;

#define FIELD_(n, h, d, dbl, m) {n, h, d, dbl, offsetof(kvp_ledger_totals, m)}
static const field fields[] = {
    FIELD_("requests_total", "Requests recorded in the ledger.", DIM_NONE, 0,
           requests),
    FIELD_("prompt_tokens_total", "Prompt tokens of recorded requests.",
           DIM_NONE, 0, prompt_tokens),
    FIELD_("reused_tokens_total",
           "Prompt tokens served from cached KV, by the tier that held them.",
           DIM_TIER, 0, reused_by_tier),
    FIELD_("recomputed_tokens_total", "Prompt tokens prefilled (not reused).",
           DIM_NONE, 0, recomputed_tokens),
    FIELD_("class_prompt_tokens_total", "Prompt tokens by segment class.",
           DIM_CLASS, 0, prompt_by_class),
    FIELD_("class_reused_tokens_total",
           "Reused prompt tokens by segment class.", DIM_CLASS, 0,
           reused_by_class),
    FIELD_("miss_tokens_total", "Recomputed prompt tokens by miss cause.",
           DIM_CAUSE, 0, miss_tokens),
    FIELD_("prefill_avoided_tokens_total",
           "Prefill avoided, in tokens (equals reused tokens).", DIM_NONE, 0,
           reused_tokens),
    FIELD_("prefill_avoided_flops_total", "Prefill avoided, estimated FLOPs.",
           DIM_NONE, 1, avoided_flops),
    FIELD_("prefill_avoided_gpu_seconds_total",
           "Prefill avoided, estimated GPU-seconds.", DIM_NONE, 1,
           avoided_gpu_seconds),
    FIELD_("load_bytes_total",
           "KV bytes moved from each tier to serve reused tokens.", DIM_TIER, 0,
           load_bytes),
};

static void prom_head(out *o, const char *prefix, const char *name,
                      const char *type, const char *help) {
  out_str(o, "# HELP "), out_str(o, prefix), out_str(o, name);
  out_str(o, " "), out_str(o, help);
  out_str(o, "\n# TYPE "), out_str(o, prefix), out_str(o, name);
  out_str(o, " "), out_str(o, type), out_str(o, "\n");
}

/* name{tenant="...",label="value"} ; either part optional. */
static void prom_name(out *o, const char *prefix, const char *name,
                      const char *tenant, const char *label,
                      const char *value) {
  out_str(o, prefix), out_str(o, name);
  if (tenant == NULL && label == NULL)
    return;
  out_str(o, "{");
  if (tenant != NULL)
    out_str(o, "tenant=\""), out_label(o, tenant), out_str(o, "\"");
  if (tenant != NULL && label != NULL)
    out_str(o, ",");
  if (label != NULL)
    out_str(o, label), out_str(o, "=\""), out_label(o, value), out_str(o, "\"");
  out_str(o, "}");
}

static void prom_field(out *o, const char *prefix, const field *f,
                       const char *tenant, const kvp_ledger_totals *t) {
  const struct dim *d = &dims[f->dim];
  const char *base = (const char *)t + f->off;
  for (size_t i = 0; i < d->n; i++) {
    prom_name(o, prefix, f->name, tenant, d->label,
              d->values ? d->values[i] : NULL);
    out_str(o, " ");
    if (f->is_double) {
      double v;
      memcpy(&v, base + i * sizeof v, sizeof v);
      out_f64(o, v, false);
    } else {
      uint64_t v;
      memcpy(&v, base + i * sizeof v, sizeof v);
      out_u64(o, v);
    }
    out_str(o, "\n");
  }
}

static void prom_hist(out *o, const char *name, const char *help,
                      const hist *h, const double *le, size_t n_le) {
  char tmp[40], bucket[64];
  uint64_t cum = 0;
  prom_head(o, "kvplane_", name, "histogram", help);
  snprintf(bucket, sizeof bucket, "%s_bucket", name);
  for (size_t i = 0; i <= n_le; i++) {
    cum += h->counts[i];
    if (i < n_le)
      fmt_double(tmp, sizeof tmp, le[i]);
    prom_name(o, "kvplane_", bucket, NULL, "le", i < n_le ? tmp : "+Inf");
    out_str(o, " "), out_u64(o, cum), out_str(o, "\n");
  }
  assert(cum == h->count);
  out_str(o, "kvplane_"), out_str(o, name), out_str(o, "_sum ");
  out_f64(o, h->sum, false), out_str(o, "\n");
  out_str(o, "kvplane_"), out_str(o, name), out_str(o, "_count ");
  out_u64(o, h->count), out_str(o, "\n");
}

static void prom_simple(out *o, const char *name, const char *type,
                        const char *help, uint64_t v) {
  prom_head(o, "kvplane_", name, type, help);
  out_str(o, "kvplane_"), out_str(o, name), out_str(o, " ");
  out_u64(o, v), out_str(o, "\n");
}

typedef struct prom_snap {
  kvp_ledger_totals global;
  kvp_ledger_stats stats;
  hist avoided_tokens, reuse_ratio;
  snap tenants; /* sorted by tenant */
} prom_snap;

static int prom_snapshot(kvp_ledger *l, prom_snap *ps) {
  pthread_mutex_lock(&l->mu);
  ps->global = l->global;
  stats_locked(l, &ps->stats);
  ps->avoided_tokens = l->avoided_tokens;
  ps->reuse_ratio = l->reuse_ratio;
  int rc = snap_take(&l->tenants, &l->alloc, -1, &ps->tenants);
  pthread_mutex_unlock(&l->mu);
  if (rc == 0)
    qsort(ps->tenants.rows, ps->tenants.n, sizeof(row), row_cmp);
  return rc;
}

static void prom_globals(out *o, const prom_snap *ps) {
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    prom_head(o, "kvplane_", fields[i].name, "counter", fields[i].help);
    prom_field(o, "kvplane_", &fields[i], NULL, &ps->global);
  }
  prom_head(o, "kvplane_", "class_hit_ratio", "gauge",
            "Reused / prompt tokens per segment class since start "
            "(NaN before the first token of the class).");
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    prom_name(o, "kvplane_", "class_hit_ratio", NULL, "class", class_names[c]);
    out_str(o, " ");
    out_f64(o, kvp_ledger_hit_rate(&ps->global, (kvp_class)c), false);
    out_str(o, "\n");
  }
  prom_hist(o, "request_prefill_avoided_tokens",
            "Prefill avoided per request, in tokens.", &ps->avoided_tokens,
            tokens_le, N_TOKENS_LE);
  prom_hist(o, "request_reuse_ratio",
            "Reused / prompt tokens per request (requests with a non-empty "
            "prompt).",
            &ps->reuse_ratio, ratio_le, N_RATIO_LE);
}

static void prom_health(out *o, const kvp_ledger_stats *s) {
  prom_head(o, "kvplane_", "ledger_rejected_records_total", "counter",
            "Ledger records rejected with KVP_EINVAL, by the rule broken.");
  for (int r = 0; r < KVP_LEDGER_REJECT_COUNT_; r++) {
    prom_name(o, "kvplane_", "ledger_rejected_records_total", NULL, "reason",
              reject_names[r]);
    out_str(o, " "), out_u64(o, s->rejected[r]), out_str(o, "\n");
  }
  prom_simple(o, "ledger_alloc_failures_total", "counter",
              "Ledger records refused for lack of memory (not counted).",
              s->alloc_failures);
  prom_simple(o, "ledger_tenants", "gauge", "Tenants tracked now.", s->tenants);
  prom_simple(o, "ledger_sessions", "gauge", "Sessions tracked now.",
              s->sessions);
  prom_simple(o, "ledger_tenant_evictions_total", "counter",
              "Tenants dropped by the LRU cap (still in the global families).",
              s->tenant_evictions);
  prom_simple(o, "ledger_session_evictions_total", "counter",
              "Sessions dropped by the LRU cap (still in the global families).",
              s->session_evictions);
}

static void prom_tenants(out *o, const snap *s) {
  char help[128];
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    snprintf(help, sizeof help, "Per tenant: %s", fields[i].help);
    prom_head(o, "kvplane_tenant_", fields[i].name, "counter", help);
    for (size_t r = 0; r < s->n; r++)
      prom_field(o, "kvplane_tenant_", &fields[i], s->rows[r].tenant,
                 &s->rows[r].t);
  }
}

int kvp_ledger_prometheus_write(kvp_ledger *l, kvp_ledger_write_fn fn,
                                void *opaque) {
  if (l == NULL || fn == NULL)
    return KVP_EINVAL;
  prom_snap ps;
  int rc = prom_snapshot(l, &ps);
  if (rc < 0)
    return rc;
  out o;
  out_init(&o, fn, opaque);
  prom_globals(&o, &ps);
  prom_health(&o, &ps.stats);
  prom_tenants(&o, &ps.tenants);
  rc = out_flush(&o);
  snap_free(&l->alloc, &ps.tenants);
  return rc;
}

int kvp_ledger_prometheus(kvp_ledger *l, char *buf, size_t cap,
                          size_t *needed) {
  if (buf == NULL && cap > 0)
    return KVP_EINVAL;
  membuf m = membuf_make(buf, cap);
  int rc = kvp_ledger_prometheus_write(l, membuf_write, &m);
  membuf_finish(&m);
  if (needed != NULL)
    *needed = m.len;
  if (rc < 0)
    return rc;
  return m.len < cap ? 0 : KVP_ENOSPC;
}

/* ---- JSON lines --------------------------------------------------------- */
static void json_u64(out *o, const char *k, uint64_t v) {
  out_str(o, ",\""), out_str(o, k), out_str(o, "\":"), out_u64(o, v);
}

static void json_map(out *o, const char *k, const uint64_t *v,
                     const char *const *names, size_t n) {
  out_str(o, ",\""), out_str(o, k), out_str(o, "\":{");
  for (size_t i = 0; i < n; i++) {
    out_str(o, i ? ",\"" : "\""), out_str(o, names[i]), out_str(o, "\":");
    out_u64(o, v[i]);
  }
  out_str(o, "}");
}

/* Fields shared by receipts and totals (a receipt is one request's totals). */
static void json_body(out *o, const kvp_ledger_totals *t) {
  json_u64(o, "prompt_tokens", t->prompt_tokens);
  json_u64(o, "reused_tokens", t->reused_tokens);
  json_u64(o, "recomputed_tokens", t->recomputed_tokens);
  out_str(o, ",\"prefill_avoided\":{\"tokens\":");
  out_u64(o, t->reused_tokens);
  out_str(o, ",\"flops\":"), out_f64(o, t->avoided_flops, true);
  out_str(o, ",\"gpu_seconds\":"), out_f64(o, t->avoided_gpu_seconds, true);
  out_str(o, "}");
  json_map(o, "reused_by_tier", t->reused_by_tier, tier_names, KVP_TIER_COUNT_);
  json_map(o, "prompt_by_class", t->prompt_by_class, class_names,
           KVP_CLASS_COUNT_);
  json_map(o, "reused_by_class", t->reused_by_class, class_names,
           KVP_CLASS_COUNT_);
  json_map(o, "miss_tokens", t->miss_tokens, cause_names, KVP_MISS_COUNT_);
  json_map(o, "load_bytes", t->load_bytes, tier_names, KVP_TIER_COUNT_);
}

static void json_receipt(out *o, const kvp_ledger_record *r) {
  kvp_ledger_totals t = {0};
  totals_add(&t, r);
  out_str(o, "{\"kind\":\"receipt\",\"request_id\":");
  out_json_str(o, r->request_id);
  out_str(o, ",\"tenant\":"), out_json_str(o, r->tenant);
  out_str(o, ",\"session\":"), out_json_str(o, r->session);
  out_str(o, ",\"worker\":");
  if (r->worker >= 0)
    out_u64(o, (uint64_t)r->worker);
  else
    out_str(o, "null");
  out_str(o, ",\"unix_time_ns\":");
  if (r->unix_time_ns != 0)
    out_u64(o, r->unix_time_ns);
  else
    out_str(o, "null");
  out_str(o, ",\"reuse_ratio\":");
  double ratio = r->prompt_tokens ? (double)r->reused_tokens /
                                       (double)r->prompt_tokens
                                 : NAN; /* null: no prompt, no ratio */
  out_f64(o, ratio, true);
  json_body(o, &t);
  out_str(o, "}\n");
}

static void json_totals(out *o, const kvp_ledger_totals *t, const char *tenant,
                        const char *session) {
  bool has_t = tenant && *tenant, has_s = session && *session;
  out_str(o, "{\"kind\":\"totals\",\"scope\":");
  out_str(o, has_s ? "\"session\"" : has_t ? "\"tenant\"" : "\"global\"");
  out_str(o, ",\"tenant\":"), out_json_str(o, tenant);
  out_str(o, ",\"session\":"), out_json_str(o, session);
  json_u64(o, "requests", t->requests);
  json_body(o, t);
  out_str(o, ",\"hit_rate_by_class\":{");
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    out_str(o, c ? ",\"" : "\""), out_str(o, class_names[c]), out_str(o, "\":");
    out_f64(o, kvp_ledger_hit_rate(t, (kvp_class)c), true);
  }
  out_str(o, "}}\n");
}

/* Runs a formatter into a caller buffer, snprintf-like. */
static int to_buffer(char *buf, size_t cap, const kvp_ledger_record *r,
                     const kvp_ledger_totals *t, const char *tenant,
                     const char *session) {
  membuf m = membuf_make(buf, cap);
  out o;
  out_init(&o, membuf_write, &m);
  if (r != NULL)
    json_receipt(&o, r);
  else
    json_totals(&o, t, tenant, session);
  out_flush(&o);
  membuf_finish(&m);
  assert(m.len < INT32_MAX); /* three bounded names and fixed fields */
  return (int)m.len;
}

int kvp_ledger_receipt_json(const kvp_ledger_record *r, char *buf, size_t cap) {
  if (r == NULL || (buf == NULL && cap > 0) || check_reason(r) >= 0)
    return KVP_EINVAL;
  return to_buffer(buf, cap, r, NULL, NULL, NULL);
}

int kvp_ledger_totals_json(const kvp_ledger_totals *t, const char *tenant,
                           const char *session, char *buf, size_t cap) {
  if (t == NULL || (buf == NULL && cap > 0) || !name_ok(tenant) ||
      !name_ok(session))
    return KVP_EINVAL;
  return to_buffer(buf, cap, NULL, t, tenant, session);
}

/* Tenants in one sorted snapshot; sessions slice by slice, so the lock is
 * held for 1/64 of the table at a time and the copy stays small. */
static int json_table(kvp_ledger *l, table *tb, bool sessions, out *o) {
  int first = sessions ? 0 : -1;
  int last = sessions ? (1 << MIN_BITS) - 1 : -1;
  for (int s = first; s <= last && o->err == 0; s++) {
    snap sn;
    pthread_mutex_lock(&l->mu);
    int rc = snap_take(tb, &l->alloc, s, &sn);
    pthread_mutex_unlock(&l->mu);
    if (rc < 0)
      return rc;
    qsort(sn.rows, sn.n, sizeof(row), row_cmp);
    for (size_t i = 0; i < sn.n; i++)
      json_totals(o, &sn.rows[i].t, sn.rows[i].tenant,
                  sessions ? sn.rows[i].session : NULL);
    snap_free(&l->alloc, &sn);
  }
  return o->err;
}

int kvp_ledger_json_write(kvp_ledger *l, unsigned what, kvp_ledger_write_fn fn,
                          void *opaque) {
  const unsigned known = KVP_LEDGER_JSON_GLOBAL | KVP_LEDGER_JSON_TENANTS |
                         KVP_LEDGER_JSON_SESSIONS;
  if (l == NULL || fn == NULL || what == 0 || (what & ~known) != 0)
    return KVP_EINVAL;
  out o;
  out_init(&o, fn, opaque);
  int rc = 0;
  if (what & KVP_LEDGER_JSON_GLOBAL) {
    kvp_ledger_totals g;
    kvp_ledger_global_totals(l, &g);
    json_totals(&o, &g, NULL, NULL);
  }
  if (rc == 0 && (what & KVP_LEDGER_JSON_TENANTS))
    rc = json_table(l, &l->tenants, false, &o);
  if (rc == 0 && (what & KVP_LEDGER_JSON_SESSIONS))
    rc = json_table(l, &l->sessions, true, &o);
  int frc = out_flush(&o);
  return rc < 0 ? rc : frc;
}
