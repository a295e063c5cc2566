/* SPDX-License-Identifier: Apache-2.0 */
/* The ledger: per request/session/tenant reuse accounting in bounded memory,
 * validated (kvp_ledger_check / kvp_ledger_explain).  Its export (Prometheus
 * text, JSON lines, receipts) is core_ledger_export.c.
 *
 * Invariants: every accepted record obeys ledger.h's sum rules, so every
 * totals struct does too; `global` includes every accepted record, so a
 * tenant or session dropped by its LRU cap has already been folded into it;
 * after an add returns no table holds more than its cap.
 * Lock: one mutex `mu` (no other lock exists, so no order).  It is held for
 * table bookkeeping and snapshot copies, which may call the caller's
 * allocator, but never while a caller's writer runs. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "core_internal.h"
#include "core_ledger_internal.h"
#include "kvplane/text.h"

#define DEFAULT_SESSIONS 65536u
#define DEFAULT_TENANTS 4096u
#define LIMIT_SESSIONS (1u << 24)
#define LIMIT_TENANTS 65536u

/* ---- names of label values ----------------------------------------------- */
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

static void hist_add(hist *h, const double *le, size_t n_le, double v) {
  size_t i = 0;
  while (i < n_le && !(v <= le[i]))
    i++;
  h->counts[i]++;
  h->count++;
  h->sum += v;
}

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
bool kvp__ledger_name_ok(const char *s) {
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
int kvp__ledger_check_reason(const kvp_ledger_record *r) {
  uint64_t total;
  if (!kvp__ledger_name_ok(r->tenant) || !kvp__ledger_name_ok(r->session) ||
      !kvp__ledger_name_ok(r->request_id))
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
  int reason = kvp__ledger_check_reason(r);
  if (reason >= 0 && why != NULL)
    *why = (kvp_ledger_reject)reason;
  return reason >= 0 ? KVP_EINVAL : 0;
}

/* ---- explanations: the rule kvp_ledger_check saw broken, with the values */
static void explain_sum(kvp_text *t, const char *field, const uint64_t *v,
                        size_t n, const char *(*name)(int), const char *want_f,
                        uint64_t want) {
  uint64_t sum = 0;
  bool over = false;
  for (size_t i = 0; i < n; i++)
    over |= __builtin_add_overflow(sum, v[i], &sum);
  kvp_text_printf(t, "%s sums to ", field);
  if (over)
    kvp_text_puts(t, "more than 2^64");
  else
    kvp_text_u64(t, sum);
  for (size_t i = 0; i < n; i++) {
    kvp_text_puts(t, i ? " + " : " (");
    kvp_text_printf(t, "%s ", name((int)i)), kvp_text_u64(t, v[i]);
  }
  kvp_text_printf(t, "), not %s ", want_f), kvp_text_u64(t, want);
}

static const char *tier_n(int i) { return kvp_tier_name((kvp_tier)i); }
static const char *class_n(int i) { return kvp_class_name((kvp_class)i); }
static const char *cause_n(int i) {
  return kvp_miss_cause_name((kvp_miss_cause)i);
}

static void explain_name(kvp_text *t, const kvp_ledger_record *r) {
  const char *f = !kvp__ledger_name_ok(r->tenant)    ? "tenant"
                  : !kvp__ledger_name_ok(r->session) ? "session"
                                                     : "request_id";
  kvp_text_printf(t, "%s: not UTF-8 or longer than %u bytes", f,
                  KVP_LEDGER_NAME_MAX);
}

static void explain_field(kvp_text *t, const kvp_ledger_record *r) {
  if (r->worker < -1 || r->worker >= (int32_t)KVP_WORKERS_MAX) {
    kvp_text_printf(t, "worker = %d: not in -1 .. %u", (int)r->worker,
                    KVP_WORKERS_MAX - 1);
    return;
  }
  size_t i = 0;
  while (i < 8 && r->reserved[i] == 0)
    i++;
  if (r->reserved0 != 0 || i == 8)
    kvp_text_printf(t, "reserved0 = %u: must be 0", (unsigned)r->reserved0);
  else
    kvp_text_printf(t, "reserved[%zu] is not 0", i);
}

static void explain_class(kvp_text *t, const kvp_ledger_record *r) {
  for (int c = 0; c < KVP_CLASS_COUNT_; c++)
    if (r->reused_by_class[c] > r->prompt_by_class[c]) {
      kvp_text_printf(t, "reused_by_class[%s] ", class_n(c));
      kvp_text_u64(t, r->reused_by_class[c]);
      kvp_text_printf(t, " > prompt_by_class[%s] ", class_n(c));
      kvp_text_u64(t, r->prompt_by_class[c]);
      return;
    }
  if (!sum_is(r->prompt_by_class, KVP_CLASS_COUNT_, r->prompt_tokens))
    explain_sum(t, "prompt_by_class", r->prompt_by_class, KVP_CLASS_COUNT_,
                class_n, "prompt_tokens", r->prompt_tokens);
  else
    explain_sum(t, "reused_by_class", r->reused_by_class, KVP_CLASS_COUNT_,
                class_n, "reused_tokens", r->reused_tokens);
}

static void explain_estimate(kvp_text *t, const kvp_ledger_record *r) {
  bool flops = !estimate_ok(r->avoided_flops, r->reused_tokens);
  kvp_text_printf(t, "%s = ", flops ? "avoided_flops" : "avoided_gpu_seconds");
  kvp_text_prom_num(t, flops ? r->avoided_flops : r->avoided_gpu_seconds);
  kvp_text_puts(t, ": must be finite and >= 0, and 0 when reused_tokens "
                   "is 0");
}

static void explain_bytes(kvp_text *t, const kvp_ledger_record *r) {
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    if (r->load_bytes[k] != 0 && r->reused_by_tier[k] == 0) {
      kvp_text_printf(t, "load_bytes[%s] = ", tier_n(k));
      kvp_text_u64(t, r->load_bytes[k]);
      kvp_text_printf(t, " with reused_by_tier[%s] = 0", tier_n(k));
      return;
    }
}

static void explain_reason(kvp_text *t, const kvp_ledger_record *r, int why) {
  kvp_text_printf(t, "%s: ", reject_names[why]);
  switch (why) {
  case KVP_LEDGER_REJECT_NAME: explain_name(t, r); break;
  case KVP_LEDGER_REJECT_FIELD: explain_field(t, r); break;
  case KVP_LEDGER_REJECT_TOKENS:
    kvp_text_puts(t, "reused_tokens "), kvp_text_u64(t, r->reused_tokens);
    kvp_text_puts(t, " + recomputed_tokens ");
    kvp_text_u64(t, r->recomputed_tokens);
    kvp_text_puts(t, " != prompt_tokens "), kvp_text_u64(t, r->prompt_tokens);
    break;
  case KVP_LEDGER_REJECT_TIER:
    explain_sum(t, "reused_by_tier", r->reused_by_tier, KVP_TIER_COUNT_,
                tier_n, "reused_tokens", r->reused_tokens);
    break;
  case KVP_LEDGER_REJECT_CLASS: explain_class(t, r); break;
  case KVP_LEDGER_REJECT_MISS:
    explain_sum(t, "miss_tokens", r->miss_tokens, KVP_MISS_COUNT_, cause_n,
                "recomputed_tokens", r->recomputed_tokens);
    break;
  case KVP_LEDGER_REJECT_ESTIMATE: explain_estimate(t, r); break;
  default: explain_bytes(t, r);
  }
}

int kvp_ledger_explain(const kvp_ledger_record *r, char *buf, size_t cap) {
  if (buf == NULL && cap > 0)
    return KVP_EINVAL;
  kvp_text t;
  kvp_text_init(&t, buf, cap);
  int why = r != NULL ? kvp__ledger_check_reason(r) : -2;
  if (why == -2)
    kvp_text_puts(&t, "record is NULL");
  else if (why < 0)
    kvp_text_puts(&t, "ok");
  else
    explain_reason(&t, r, why);
  return why == -1 ? 0 : KVP_EINVAL;
}

void kvp__ledger_totals_add(kvp_ledger_totals *t, const kvp_ledger_record *r) {
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
  kvp__ledger_totals_add(&l->global, r);
  if (te != NULL)
    kvp__ledger_totals_add(&te->t, r);
  if (se != NULL)
    kvp__ledger_totals_add(&se->t, r);
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
  int why = kvp__ledger_check_reason(r);
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
  if (why >= 0 && kvp_log_get_level() >= KVP_LOG_DEBUG) {
    char msg[512];
    kvp_ledger_explain(r, msg, sizeof msg);
    KVP_LOGD("ledger", "record rejected: %s", msg);
  }
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
      !kvp__ledger_name_ok(tenant))
    return KVP_EINVAL;
  key k;
  key_make(l->sip, &k, tenant, NULL);
  return lookup(l, &l->tenants, &k, out);
}

int kvp_ledger_session_totals(kvp_ledger *l, const char *tenant,
                              const char *session, kvp_ledger_totals *out) {
  if (l == NULL || out == NULL || session == NULL || session[0] == '\0' ||
      !kvp__ledger_name_ok(session) || !kvp__ledger_name_ok(tenant))
    return KVP_EINVAL;
  key k;
  key_make(l->sip, &k, tenant, session);
  return lookup(l, &l->sessions, &k, out);
}

void kvp__ledger_stats_locked(const kvp_ledger *l, kvp_ledger_stats *s) {
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

int kvp_ledger_stats_get(kvp_ledger *l, kvp_ledger_stats *out) {
  if (l == NULL || out == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  kvp__ledger_stats_locked(l, out);
  pthread_mutex_unlock(&l->mu);
  return 0;
}

double kvp_ledger_hit_rate(const kvp_ledger_totals *t, kvp_class c) {
  if (t == NULL || (unsigned)c >= KVP_CLASS_COUNT_ ||
      t->prompt_by_class[c] == 0)
    return NAN;
  return (double)t->reused_by_class[c] / (double)t->prompt_by_class[c];
}

/* ---- snapshots (types in core_ledger_internal.h) ------------------------- */
void kvp__ledger_snap_free(const kvp_allocator *a, snap *s) {
  if (s->rows != NULL)
    kvp__free(a, s->rows, s->size);
  s->rows = NULL;
}

int kvp__ledger_snap_take(const table *tb, const kvp_allocator *a, int slice,
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

int kvp__ledger_row_cmp(const void *a, const void *b) {
  const row *x = a, *y = b;
  int c = strcmp(x->tenant, y->tenant);
  return c != 0 ? c : strcmp(x->session, y->session);
}
