/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: queries.  A query walks its chain through a software pipeline
 * (see qctx): the bucket pair of block i+24 is prefetched (its home bucket
 * alone while the table is at most half full), the holder word of block i+8
 * read from there and its spilled set prefetched (a key further on: the next
 * pair prefetched, the read finished at block i), then
 * block i is folded into
 * per-tier bit-sliced counters of the workers still matching; the walk stops
 * when none is left.  With opts.prefix_closed (block 0 held in at most 4
 * worker groups of 64) a query bisects the chain instead, per (cumulative
 * tier, worker) boundary
 * (see "bisection" below): ~22 probes instead of ~1,000 blocks in
 * bench_index.  Probes compare a bucket's four fingerprints without
 * branching on them: a branch on a line still in flight would mispredict and
 * throw the pipeline's later loads away.  A query pins one epoch slot for its
 * whole walk and takes no lock. */
#include "index_impl.h"

#define PF_FAR 24u /* prefetch a block's bucket this far ahead, */
#define PF_NEAR 8u /* ... read its holder word and prefetch its set here */
#define PIPE 32u   /* pipeline ring (power of two > PF_FAR) */
#define STACK_GROUPS 4u

typedef struct qgroup { /* per 64-worker group: who is still matching */
  uint64_t alive, seen;
  uint32_t gid, pad_;
  uint32_t prefix[64];       /* set when the worker drops out */
  uint64_t vc[NCLS][PLANES]; /* vertical counters: blocks per class */
} qgroup;

typedef struct qblk { /* one block's holders by group (wide path) */
  uint64_t m[GROUPS_MAX][NCLS];
  uint8_t touched[GROUPS_MAX];
  uint8_t mark[GROUPS_MAX];
  unsigned nt;
} qblk;

/* A query reads its chain through a software pipeline: PF_FAR blocks ahead
 * it prefetches the bucket, PF_NEAR blocks ahead it reads the holder word
 * (the block's one read) and prefetches a spilled set, so the walk itself
 * finds everything in cache. */
typedef struct qctx {
  kvp_index *ix;
  ktab *atab; /* NULL when no routing record exists */
  uint64_t now, ttl;
  size_t nread; /* blocks looked up */
  const kvp_key *keys;
  size_t n;
  uint64_t fp[PIPE], h[PIPE], p[PIPE];
  uint64_t more[PIPE]; /* 1 + the bucket where block's probe goes on, or 0 */
  ktab *t[PIPE];       /* ... in this table */
} qctx;

/* counts[w] += 1 for every bit w of x, on bit-sliced counters. */
static inline void vc_add(uint64_t *planes, uint64_t x) {
  for (unsigned k = 0; x != 0; k++) {
    uint64_t carry = planes[k] & x;
    planes[k] ^= x;
    x = carry;
  }
}

/* Block i: m[c] = workers of the group holding it in class c. */
static inline void q_step(qgroup *q, const uint64_t *m, uint32_t i) {
  uint64_t any = m[0] | m[1] | m[2] | m[3] | m[4];
  for (uint64_t d = q->alive & ~any; d != 0; d &= d - 1)
    q->prefix[ctz64(d)] = i;
  uint64_t a = q->alive & any;
  q->alive = a;
  for (unsigned c = 0; c < NCLS && a != 0; c++) { /* fastest class first */
    uint64_t x = a & m[c];
    if (x != 0) {
      vc_add(q->vc[c], x);
      a &= ~x;
    }
  }
}

/* fp's holder word from its home bucket or its pair, as probe_prefetch
 * loaded them (shard.pf_one). */
static uint64_t get_near(qctx *c, uint64_t fp, uint64_t h, ktab **tp,
                         uint64_t *more) {
  shard *sh = shard_of(c->ix, h);
  /* acquire: pairs with the release in tab_rebuild */
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_acquire);
  *tp = t;
  return tab_get_near(
      t, fp, h, !atomic_load_explicit(&sh->pf_one, memory_order_relaxed), more);
}

static uint64_t event_holders(qctx *c, uint64_t fp, uint64_t h) {
  ktab *t;
  uint64_t more, p = get_near(c, fp, h, &t, &more);
  return more ? kvp__tab_get_from(t, fp, h, more - 1) : p;
}

/* Prefetches the bucket pair of fingerprint fp (hash h), or its home
 * bucket alone (shard.pf_one), and its routing records' bucket when there
 * are any. */
static void probe_prefetch(const qctx *c, uint64_t h) {
  shard *sh = shard_of(c->ix, h);
  kslot *s = atomic_load_explicit(&sh->pf_slots, memory_order_relaxed);
  uint64_t nb = atomic_load_explicit(&sh->pf_nbuckets, memory_order_relaxed);
  kslot *b = s + bucket_of(h, nb) * BUCKET_SLOTS;
  __builtin_prefetch(b, 0, 3);
  if (!atomic_load_explicit(&sh->pf_one, memory_order_relaxed))
    __builtin_prefetch(b + BUCKET_SLOTS, 0, 3); /* the pair's second */
  if (c->atab != NULL)
    __builtin_prefetch(
        &c->atab->slots[bucket_of(h, c->atab->nbuckets) * BUCKET_SLOTS], 0, 3);
}

static void set_prefetch(uint64_t p) {
  if (is_wset(p)) { /* the header and group 0 may straddle two lines */
    __builtin_prefetch((const char *)(uintptr_t)p, 0, 3);
    __builtin_prefetch(
        (const char *)(uintptr_t)p + sizeof(wset) + sizeof(wgroup) - 1, 0, 3);
  }
}

/* Reads fp's holder word and prefetches its spilled set, if any. */
static uint64_t probe_read(qctx *c, uint64_t fp, uint64_t h) {
  uint64_t p = event_holders(c, fp, h);
  set_prefetch(p);
  return p;
}

static void pipe_far(qctx *c, size_t j) {
  uint64_t fp = fp_of(c->keys[j]), h = mix64(fp);
  c->fp[j % PIPE] = fp;
  c->h[j % PIPE] = h;
  probe_prefetch(c, h);
}

/* Reads block j's holder word from its bucket pair (its home bucket alone
 * in a table at most half full: shard.pf_one).  A key not there (2-11
 * times in 100, as the table's load goes from 5/8 to 7/8) has its next pair
 * prefetched here and read in pipe_take, PF_NEAR blocks later: a probe run
 * on then would wait for two more memory reads in turn. */
static void pipe_near(qctx *c, size_t j) {
  size_t k = j % PIPE;
  ktab *t;
  uint64_t more, p = get_near(c, c->fp[k], c->h[k], &t, &more);
  c->more[k] = more;
  if (KVP_UNLIKELY(more != 0)) {
    kslot *b = &t->slots[(more - 1) * BUCKET_SLOTS];
    __builtin_prefetch(b, 0, 3);
    __builtin_prefetch(&t->slots[bucket_next(more - 1, t->nbuckets) *
                                 BUCKET_SLOTS],
                       0, 3);
    c->t[k] = t;
  }
  set_prefetch(p);
  c->p[k] = p;
}

/* Block i's holder word, its probe finished if pipe_near left it open. */
static inline void pipe_take(qctx *c, size_t i) {
  size_t k = i % PIPE;
  if (KVP_UNLIKELY(c->more[k] != 0)) {
    c->p[k] = kvp__tab_get_from(c->t[k], c->fp[k], c->h[k], c->more[k] - 1);
    c->more[k] = 0;
  }
}

static void pipe_start(qctx *c, const kvp_key *keys, size_t n) {
  c->keys = keys;
  c->n = n;
  for (size_t j = 0; j < n && j < PF_FAR; j++)
    pipe_far(c, j);
  for (size_t j = 0; j < n && j < PF_NEAR; j++)
    pipe_near(c, j);
  pipe_take(c, 0);
}

/* Before block i is walked. */
static inline void pipe_step(qctx *c, size_t i) {
  if (i + PF_FAR < c->n)
    pipe_far(c, i + PF_FAR);
  if (i + PF_NEAR < c->n)
    pipe_near(c, i + PF_NEAR);
  pipe_take(c, i);
}

/* Walks a key's routing records from *idx (its list head): the worker of
 * the next one not expired, or UINT32_MAX at the end. */
static uint32_t routed_next(qctx *c, uint32_t *idx) {
  while (*idx != 0) {
    arec *r = arec_at(c->ix, *idx);
    uint32_t w = r->worker;
    bool live =
        routed_live(atomic_load_explicit(&r->touch, memory_order_relaxed),
                    atomic_load_explicit(&r->life_us, memory_order_relaxed),
                    c->now, c->ttl);
    /* acquire: pairs with the releases of next in arec_evict and of the head
     * in approx_record */
    *idx = atomic_load_explicit(&r->next, memory_order_acquire);
    if (live)
      return w;
  }
  return UINT32_MAX;
}

/* m[c] = the workers holding fp (holder word p) in class c. */
static void gather_fast_at(qctx *c, uint64_t fp, uint64_t h, uint64_t p,
                           uint64_t m[NCLS]) {
  uint64_t m0 = 0, m1 = 0, m2 = 0, m3 = 0; /* in registers, stored once */
  if (p & 0xFu) {
    for (uint64_t q = p; q & 0xFu; q >>= 16) { /* the occupied slots */
      uint64_t bit = 1ull << ((q >> 4) & 63);
      m0 |= q & 1 ? bit : 0;
      m1 |= q & 2 ? bit : 0;
      m2 |= q & 4 ? bit : 0;
      m3 |= q & 8 ? bit : 0;
    }
  } else if (p != 0) {
    wset *ws = (wset *)(uintptr_t)p;
    /* acquire: pairs with the release in wset_add_group */
    if (atomic_load_explicit(&ws->ngroups, memory_order_acquire) != 0) {
      m0 = atomic_load_explicit(&ws->g[0].tier[0], memory_order_relaxed);
      m1 = atomic_load_explicit(&ws->g[0].tier[1], memory_order_relaxed);
      m2 = atomic_load_explicit(&ws->g[0].tier[2], memory_order_relaxed);
      m3 = atomic_load_explicit(&ws->g[0].tier[3], memory_order_relaxed);
    }
  }
  m[0] = m0, m[1] = m1, m[2] = m2, m[3] = m3, m[CLS_ROUTED] = 0;
  if (c->atab == NULL)
    return;
  uint32_t idx = (uint32_t)tab_get(c->atab, fp, h);
  for (uint32_t w; (w = routed_next(c, &idx)) != UINT32_MAX;)
    m[CLS_ROUTED] |= 1ull << (w & 63);
}

static void gather_fast(qctx *c, size_t i, uint64_t m[NCLS]) {
  gather_fast_at(c, c->fp[i % PIPE], c->h[i % PIPE], c->p[i % PIPE], m);
}

static inline uint64_t *blk_group(qblk *b, uint32_t gid) {
  if (!b->mark[gid]) {
    b->mark[gid] = 1;
    b->touched[b->nt++] = (uint8_t)gid;
  }
  return b->m[gid];
}

static void blk_clear(qblk *b) {
  for (unsigned k = 0; k < b->nt; k++) {
    memset(b->m[b->touched[k]], 0, sizeof b->m[0]);
    b->mark[b->touched[k]] = 0;
  }
  b->nt = 0;
}

/* b = the holders by group of the block whose key is fp (hash h, holder
 * word p). */
static void gather_wide_at(qctx *c, uint64_t fp, uint64_t h, uint64_t p,
                           qblk *b) {
  if (p & 0xFu) {
    for (unsigned k = 0; k < INLINE_MAX && (in_slot(p, k) & 0xFu); k++) {
      uint32_t s = in_slot(p, k), w = s >> 4;
      uint64_t *m = blk_group(b, w >> 6);
      for (unsigned t = 0; t < NTIERS; t++)
        if ((s >> t) & 1)
          m[t] |= 1ull << (w & 63);
    }
  } else if (p != 0) {
    wset *ws = (wset *)(uintptr_t)p;
    /* acquire: pairs with the release in wset_add_group */
    uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_acquire);
    for (uint32_t g = 0; g < ng; g++) {
      uint64_t v[NTIERS], any = 0;
      for (unsigned t = 0; t < NTIERS; t++)
        any |= v[t] =
            atomic_load_explicit(&ws->g[g].tier[t], memory_order_relaxed);
      if (any == 0)
        continue;
      uint64_t *m = blk_group(b, (uint32_t)ws->g[g].gid);
      for (unsigned t = 0; t < NTIERS; t++)
        m[t] |= v[t];
    }
  }
  if (c->atab == NULL)
    return;
  uint32_t idx = (uint32_t)tab_get(c->atab, fp, h);
  for (uint32_t w; (w = routed_next(c, &idx)) != UINT32_MAX;)
    blk_group(b, w >> 6)[CLS_ROUTED] |= 1ull << (w & 63);
}

static void gather_wide(qctx *c, size_t i, qblk *b) {
  gather_wide_at(c, c->fp[i % PIPE], c->h[i % PIPE], c->p[i % PIPE], b);
}

/* Appends group q's matches (workers still added) to out. */
static size_t emit_group(qctx *c, const qgroup *q, kvp_index_match *out,
                         size_t cap, size_t k) {
  uint32_t cnt[64][NCLS];
  memset(cnt, 0, sizeof cnt);
  for (unsigned cl = 0; cl < NCLS; cl++)
    for (unsigned b = 0; b < PLANES; b++)
      for (uint64_t x = q->vc[cl][b]; x != 0; x &= x - 1)
        cnt[ctz64(x)][cl] += 1u << b;
  for (uint64_t s = q->seen; s != 0; s &= s - 1) {
    uint32_t bit = ctz64(s), w = q->gid * 64 + bit;
    worker *wk = &c->ix->workers[w];
    /* acquire: pairs with the release in kvp_index_worker_remove */
    if (atomic_load_explicit(&wk->state, memory_order_acquire) != W_ACTIVE)
      continue;
    if (k < cap) {
      kvp_index_match *o = &out[k];
      memset(o, 0, sizeof *o);
      o->worker = w;
      o->prefix_blocks = q->prefix[bit];
      memcpy(o->tier_blocks, cnt[bit], sizeof o->tier_blocks);
      o->routed_blocks = cnt[bit][CLS_ROUTED];
      o->uncertain =
          atomic_load_explicit(&wk->uncertain, memory_order_relaxed) != 0;
    }
    k++;
  }
  return k;
}

static void q_finish(qgroup *q, uint32_t nproc) {
  for (uint64_t a = q->alive; a != 0; a &= a - 1)
    q->prefix[ctz64(a)] = nproc;
}

static int query_fast(qctx *c, const kvp_key *keys, size_t n,
                      kvp_index_match *out, size_t cap) {
  qgroup q;
  uint64_t m[NCLS];
  size_t i;
  memset(&q, 0, sizeof q);
  pipe_start(c, keys, n);
  for (i = 0; i < n; i++) {
    pipe_step(c, i);
    gather_fast(c, i, m);
    if (i == 0)
      q.alive = q.seen = m[0] | m[1] | m[2] | m[3] | m[4];
    q_step(&q, m, (uint32_t)i);
    if (q.alive == 0)
      break;
  }
  c->nread = i < n ? i + 1 : n;
  q_finish(&q, (uint32_t)i);
  return (int)emit_group(c, &q, out, cap, 0);
}

/* ---- bisection (kvp_index_opts.prefix_closed) ----------------------------
 * Cumulative class c of a worker = held in one of classes 0..c (HBM first,
 * routed last).  Under the contract each (cumulative class, worker) bit is
 * set on a prefix of the chain, so it has one boundary: the first block where
 * it is clear, and tier c's count is boundary(c) - boundary(c-1).  A span
 * (a, b) carries bits known set at block a and clear at block b (b = n: past
 * the end) and the masks probed at both ends; probing its midpoint splits it
 * in two, and a span one block wide resolves its bits.  A round probes every
 * open span: all midpoints' buckets prefetched, then all holder words read
 * (their sets prefetched), then all gathered, so a round costs about one
 * memory latency however many spans it has.  Each probe checks the contract
 * against both ends of its span, for workers still alive there: a bit clear
 * at a and set at the midpoint, or clear at the midpoint and set at b, is a
 * violation; the query then walks.  (A worker that no longer holds any class
 * at a point has its answer fixed before it, so what it holds later does not
 * matter.) */
#define BSPANS 128u /* open spans per round, one group (fewer with more:
                       one stack buffer holds them); more -> walk (no
                       violation) */
#define BGROUPS 4u  /* worker groups holding block 0; more -> walk (ditto) */

/* The spans of a round live in one array of words, stride words each: word
 * 0 = a | b << 32, then bits, ma and mb, ng * NCLS words each (indexed
 * group * NCLS + class): bits = those whose boundary lies in (a, b], ma and
 * mb = the cumulative masks at blocks a and b (all 0 at b = n). */
#define SP_BITS(sp) ((sp) + 1)
#define SP_MA(sp, st) ((sp) + 1 + (st)->nw)
#define SP_MB(sp, st) ((sp) + 1 + 2 * (st)->nw)

typedef enum { BIS_OK, BIS_VIOLATION, BIS_WIDE } bis_rc;

typedef struct bstate {
  uint32_t L[NCLS][BGROUPS * 64]; /* boundary per cumulative class, worker */
  unsigned ng;                    /* groups (1 on the fast path) */
  uint8_t gid[BGROUPS];           /* ... their ids, increasing */
  size_t nw, stride;              /* mask words per span field; span words */
  size_t cap;                     /* spans a round may open */
  size_t nspans, nnext;
  uint64_t *cur, *next;
  qblk *b; /* the wide path's gather scratch, NULL on the fast path */
} bstate;

static uint64_t *span_at(const bstate *st, uint64_t *base, size_t j) {
  return base + j * st->stride;
}

static void cumulate(const bstate *st, uint64_t *m) {
  for (unsigned g = 0; g < st->ng; g++)
    for (unsigned k = 1; k < NCLS; k++)
      m[g * NCLS + k] |= m[g * NCLS + k - 1];
}

static void bits_resolve(bstate *st, const uint64_t *bits, uint32_t at) {
  for (unsigned g = 0; g < st->ng; g++)
    for (unsigned k = 0; k < NCLS; k++)
      for (uint64_t x = bits[g * NCLS + k]; x != 0; x &= x - 1)
        st->L[k][g * 64 + ctz64(x)] = at;
}

/* Opens span (a, b) over bits, or resolves them when it is one block wide. */
static bis_rc span_push(bstate *st, uint32_t a, uint32_t b,
                        const uint64_t *bits, const uint64_t *ma,
                        const uint64_t *mb) {
  uint64_t any = 0;
  for (size_t k = 0; k < st->nw; k++)
    any |= bits[k];
  if (any == 0)
    return BIS_OK;
  if (b - a == 1) {
    bits_resolve(st, bits, b);
    return BIS_OK;
  }
  if (st->nnext == st->cap)
    return BIS_WIDE;
  uint64_t *sp = span_at(st, st->next, st->nnext++);
  sp[0] = a | (uint64_t)b << 32;
  memcpy(SP_BITS(sp), bits, st->nw * sizeof *bits);
  memcpy(SP_MA(sp, st), ma, st->nw * sizeof *ma);
  memcpy(SP_MB(sp, st), mb, st->nw * sizeof *mb);
  return BIS_OK;
}

/* Splits span sp (a, b) at its midpoint, whose cumulative masks are cm. */
static bis_rc span_split(bstate *st, const uint64_t *sp, uint32_t a,
                         uint32_t mid, uint32_t b, const uint64_t *cm) {
  uint64_t left[BGROUPS * NCLS], right[BGROUPS * NCLS], bad = 0;
  const uint64_t *bits = SP_BITS(sp), *ma = SP_MA(sp, st),
                 *mb = SP_MB(sp, st);
  for (unsigned g = 0; g < st->ng; g++) {
    size_t o = g * NCLS;
    uint64_t alive_a = ma[o + NCLS - 1], alive_m = cm[o + NCLS - 1];
    for (unsigned k = 0; k < NCLS; k++) {
      bad |= cm[o + k] & ~ma[o + k] & alive_a;
      bad |= mb[o + k] & ~cm[o + k] & alive_m;
      left[o + k] = bits[o + k] & ~cm[o + k];
      right[o + k] = bits[o + k] & cm[o + k];
    }
  }
  if (bad != 0)
    return BIS_VIOLATION;
  bis_rc rc = span_push(st, a, mid, left, ma, cm);
  return rc != BIS_OK ? rc : span_push(st, mid, b, right, cm, mb);
}

/* cm = the cumulative masks, per group of st, of the block whose key is fp
 * (hash h, holder word p). */
static void gather_bisect(qctx *c, const bstate *st, uint64_t fp, uint64_t h,
                          uint64_t p, uint64_t *cm) {
  if (st->b == NULL) {
    gather_fast_at(c, fp, h, p, cm);
  } else {
    gather_wide_at(c, fp, h, p, st->b);
    for (unsigned g = 0; g < st->ng; g++) {
      if (st->b->mark[st->gid[g]])
        memcpy(&cm[g * NCLS], st->b->m[st->gid[g]], NCLS * sizeof *cm);
      else
        memset(&cm[g * NCLS], 0, NCLS * sizeof *cm);
    }
    blk_clear(st->b);
  }
  cumulate(st, cm);
}

/* One round: probes every open span's midpoint and splits it. */
static bis_rc bisect_round(qctx *c, bstate *st) {
  uint64_t fp[BSPANS], h[BSPANS], p[BSPANS];
  for (size_t j = 0; j < st->nspans; j++) {
    uint64_t ab = span_at(st, st->cur, j)[0];
    uint32_t a = (uint32_t)ab, b = (uint32_t)(ab >> 32);
    fp[j] = fp_of(c->keys[a + (b - a) / 2]);
    h[j] = mix64(fp[j]);
    probe_prefetch(c, h[j]);
  }
  for (size_t j = 0; j < st->nspans; j++)
    p[j] = probe_read(c, fp[j], h[j]);
  st->nnext = 0;
  for (size_t j = 0; j < st->nspans; j++) {
    const uint64_t *sp = span_at(st, st->cur, j);
    uint32_t a = (uint32_t)sp[0], b = (uint32_t)(sp[0] >> 32);
    uint64_t cm[BGROUPS * NCLS];
    gather_bisect(c, st, fp[j], h[j], p[j], cm);
    bis_rc rc = span_split(st, sp, a, a + (b - a) / 2, b, cm);
    if (rc != BIS_OK)
      return rc;
  }
  c->nread += st->nspans;
  uint64_t *t = st->cur;
  st->cur = st->next, st->next = t;
  st->nspans = st->nnext;
  return BIS_OK;
}

/* Appends the matches of the workers in seen[g] (still added) to out. */
static size_t emit_bisect(qctx *c, const bstate *st, const uint64_t *seen,
                          kvp_index_match *out, size_t cap) {
  size_t k = 0;
  for (unsigned g = 0; g < st->ng; g++)
    for (uint64_t s = seen[g]; s != 0; s &= s - 1) {
      uint32_t col = g * 64 + ctz64(s), w = st->gid[g] * 64u + ctz64(s);
      worker *wk = &c->ix->workers[w];
      /* acquire: pairs with the release in kvp_index_worker_remove */
      if (atomic_load_explicit(&wk->state, memory_order_acquire) != W_ACTIVE)
        continue;
      if (k < cap) {
        kvp_index_match *o = &out[k];
        uint32_t lo = 0, cnt[NCLS];
        for (unsigned cl = 0; cl < NCLS; cl++) { /* boundaries never fall */
          uint32_t hi = st->L[cl][col] > lo ? st->L[cl][col] : lo;
          cnt[cl] = hi - lo;
          lo = hi;
        }
        memset(o, 0, sizeof *o);
        o->worker = w;
        o->prefix_blocks = lo;
        memcpy(o->tier_blocks, cnt, sizeof o->tier_blocks);
        o->routed_blocks = cnt[CLS_ROUTED];
        o->uncertain =
            atomic_load_explicit(&wk->uncertain, memory_order_relaxed) != 0;
      }
      k++;
    }
  return k;
}

static void sort_gids(uint8_t *g, unsigned n);

/* The query by bisection, over the worker groups (at most BGROUPS) holding
 * block 0; KVP_EBUSY: walk instead (*violation says whether the contract was
 * seen broken). */
static int query_bisect(qctx *c, const kvp_key *keys, size_t n,
                        kvp_index_match *out, size_t cap, bool *violation) {
  static const uint64_t none[BGROUPS * NCLS];
  uint64_t stackbuf[2 * BSPANS * (1 + 3 * NCLS)];
  uint64_t cm0[BGROUPS * NCLS], seen[BGROUPS];
  qblk qb;
  bstate st = {.ng = 1};
  c->keys = keys;
  c->n = n;
  uint64_t fp = fp_of(keys[0]), h = mix64(fp), p = event_holders(c, fp, h);
  c->nread = 1;
  if (!c->ix->fast) { /* the groups holding block 0 */
    memset(&qb, 0, sizeof qb);
    gather_wide_at(c, fp, h, p, &qb);
    if (qb.nt == 0)
      return 0;
    if (qb.nt > BGROUPS)
      return KVP_EBUSY;
    st.ng = qb.nt;
    memcpy(st.gid, qb.touched, qb.nt);
    sort_gids(st.gid, st.ng);
    blk_clear(&qb);
    st.b = &qb;
  }
  st.nw = st.ng * NCLS;
  st.stride = 1 + 3 * st.nw;
  /* two rounds' spans in the stack buffer: 128 for one group, 33 for 4 */
  st.cap = sizeof stackbuf / (2 * st.stride * sizeof *stackbuf);
  st.cur = stackbuf, st.next = stackbuf + st.cap * st.stride;
  gather_bisect(c, &st, fp, h, p, cm0);
  bool any = false;
  for (unsigned g = 0; g < st.ng; g++)
    any |= (seen[g] = cm0[g * NCLS + NCLS - 1]) != 0;
  int rc = 0;
  if (any) {
    for (unsigned k = 0; k < NCLS; k++)
      memset(st.L[k], 0, st.ng * 64 * sizeof st.L[k][0]);
    bis_rc r = span_push(&st, 0, (uint32_t)n, cm0, cm0, none);
    uint64_t *t = st.cur; /* the first span is open */
    st.cur = st.next, st.next = t, st.nspans = st.nnext;
    while (r == BIS_OK && st.nspans != 0)
      r = bisect_round(c, &st);
    *violation = r == BIS_VIOLATION;
    rc = r != BIS_OK ? KVP_EBUSY : (int)emit_bisect(c, &st, seen, out, cap);
  }
  return rc;
}

static void sort_gids(uint8_t *g, unsigned n) {
  for (unsigned i = 1; i < n; i++)
    for (unsigned j = i; j > 0 && g[j - 1] > g[j]; j--) {
      uint8_t t = g[j];
      g[j] = g[j - 1];
      g[j - 1] = t;
    }
}

/* Runs the chain over the groups that hold block 0 (gathered in b). */
static void wide_walk(qctx *c, qblk *b, qgroup *qs, unsigned ng) {
  uint8_t live[GROUPS_MAX];
  unsigned nlive = ng;
  for (unsigned j = 0; j < ng; j++)
    live[j] = (uint8_t)j;
  size_t i;
  for (i = 0; i < c->n && nlive != 0; i++) {
    pipe_step(c, i);
    if (i > 0)
      gather_wide(c, i, b);
    unsigned k = 0;
    for (unsigned j = 0; j < nlive; j++) {
      qgroup *q = &qs[live[j]];
      q_step(q, b->mark[q->gid] ? b->m[q->gid] : (const uint64_t[NCLS]){0},
             (uint32_t)i);
      if (q->alive != 0)
        live[k++] = live[j];
    }
    nlive = k;
    blk_clear(b);
  }
  c->nread = i != 0 ? i : 1; /* block 0 was read before the walk */
  for (unsigned j = 0; j < ng; j++)
    q_finish(&qs[j], (uint32_t)i);
}

static int query_wide(qctx *c, const kvp_key *keys, size_t n,
                      kvp_index_match *out, size_t cap) {
  qblk b;
  qgroup stackq[STACK_GROUPS], *qs = stackq;
  memset(&b, 0, sizeof b);
  pipe_start(c, keys, n);
  gather_wide(c, 0, &b);
  unsigned ng = b.nt;
  c->nread = 1;
  uint8_t gids[GROUPS_MAX];
  memcpy(gids, b.touched, ng);
  sort_gids(gids, ng);
  size_t qbytes = (size_t)ng * sizeof(qgroup);
  if (ng > STACK_GROUPS && (qs = kvp__malloc(&c->ix->alloc, qbytes)) == NULL)
    return KVP_ENOMEM;
  memset(qs, 0, qbytes);
  for (unsigned j = 0; j < ng; j++) {
    const uint64_t *m = b.m[gids[j]];
    qs[j].gid = gids[j];
    qs[j].alive = qs[j].seen = m[0] | m[1] | m[2] | m[3] | m[4];
  }
  wide_walk(c, &b, qs, ng);
  size_t k = 0;
  for (unsigned j = 0; j < ng; j++)
    k = emit_group(c, &qs[j], out, cap, k);
  if (qs != stackq)
    kvp__free(&c->ix->alloc, qs, qbytes);
  return (int)k;
}

int kvp_index_query(kvp_index *ix, const kvp_key *keys, size_t n,
                    uint64_t now_ns, kvp_index_match *out, size_t cap) {
  if (ix == NULL || (keys == NULL && n > 0) || (out == NULL && cap > 0))
    return KVP_EINVAL;
  if (n > KVP_INDEX_CHAIN_MAX)
    return KVP_ERANGE;
  if (n == 0)
    return 0;
  unsigned slot = kvp__ebr_pin(&ix->ebr);
  qctx c = {.ix = ix, .now = now_ns,
            .ttl = atomic_load_explicit(&ix->attl, memory_order_relaxed)};
  if (atomic_load_explicit(&ix->acount, memory_order_relaxed) != 0)
    /* acquire: pairs with the release in tab_rebuild */
    c.atab = atomic_load_explicit(&ix->atab, memory_order_acquire);
  int rc = KVP_EBUSY;
  bool violation = false;
  if (ix->closed)
    rc = query_bisect(&c, keys, n, out, cap, &violation);
  if (violation)
    ctr_inc(&ix->c.closure);
  if (rc == KVP_EBUSY) /* no bisection, or it gave up: walk */
    rc = ix->fast ? query_fast(&c, keys, n, out, cap)
                  : query_wide(&c, keys, n, out, cap);
  kvp__ebr_slot *es = &ix->ebr.slots[slot];
  atomic_fetch_add_explicit(&es->queries, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&es->blocks, c.nread, memory_order_relaxed);
  kvp__ebr_unpin(&ix->ebr, slot);
  return rc;
}

void kvp__index_set_prefix_closed(kvp_index *ix, bool on) { ix->closed = on; }
