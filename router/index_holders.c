/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: holder words and holder sets.  A key's holder word keeps up
 * to INLINE_MAX (worker id:12, tier mask:4) slots inline; a 5th holder spills
 * the set to a wset (per-tier bitmaps per group of 64 workers), which goes
 * back inline at SHRINK_AT holders or fewer.  Writers hold the key's shard
 * lock; a replaced wset is retired by the caller (slot_replace). */
#include "index_impl.h"

static wset *wset_new(kvp_index *ix, uint32_t cap) {
  wset *ws = ix_alloc(ix, wset_size(cap));
  if (ws == NULL)
    return NULL;
  memset(ws, 0, wset_size(cap));
  ws->cap = cap;
  return ws;
}

static int wset_find(wset *ws, uint32_t ng, uint64_t gid) {
  for (uint32_t i = 0; i < ng; i++)
    if (ws->g[i].gid == gid)
      return (int)i;
  return -1;
}

/* Sets worker w's bits in group g to `mask`.  Relaxed: each word stands
 * alone (readers take a block's words one by one). */
static void group_set(wgroup *g, uint32_t w, uint32_t mask) {
  uint64_t bit = 1ull << (w & 63);
  for (unsigned t = 0; t < NTIERS; t++) {
    uint64_t v = atomic_load_explicit(&g->tier[t], memory_order_relaxed);
    uint64_t nv = (mask >> t) & 1 ? v | bit : v & ~bit;
    if (nv != v)
      atomic_store_explicit(&g->tier[t], nv, memory_order_relaxed);
  }
}

/* Adds (w, mask) to a set not yet published (room guaranteed). */
static void wset_put(wset *ws, uint32_t w, uint32_t mask) {
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  int gi = wset_find(ws, ng, w >> 6);
  if (gi < 0) {
    gi = (int)ng;
    ws->g[ng].gid = w >> 6;
    atomic_store_explicit(&ws->ngroups, ng + 1, memory_order_relaxed);
  }
  group_set(&ws->g[gi], w, mask);
  ws->nworkers++;
}

static uint64_t in_pack(const uint16_t *sl, unsigned n) {
  uint64_t p = 0;
  for (unsigned k = 0; k < n; k++)
    p |= (uint64_t)sl[k] << (16u * k);
  return p;
}

/* Five holders: the inline four and the newcomer, into a wset. */
static int spill(kvp_index *ix, const uint16_t *sl, const upd *u,
                 uint64_t *out) {
  uint64_t gids[INLINE_MAX + 1];
  uint32_t ng = 0;
  for (unsigned k = 0; k <= INLINE_MAX; k++) {
    uint64_t gid = (k < INLINE_MAX ? (uint32_t)(sl[k] >> 4) : u->worker) >> 6;
    bool seen = false;
    for (uint32_t j = 0; j < ng; j++)
      seen |= gids[j] == gid;
    if (!seen)
      gids[ng++] = gid;
  }
  wset *ws = wset_new(ix, ng);
  if (ws == NULL)
    return KVP_ENOMEM;
  for (unsigned k = 0; k < INLINE_MAX; k++)
    wset_put(ws, sl[k] >> 4, sl[k] & 0xFu);
  wset_put(ws, u->worker, u->new_mask);
  *out = (uint64_t)(uintptr_t)ws;
  return 0;
}

int kvp__inl_update(kvp_index *ix, uint64_t p, upd *u, uint64_t *out) {
  if (p == 0) { /* a new key: the common case of ingest */
    u->old_mask = 0;
    u->new_mask = u->add & ~u->del & 0xFu;
    *out = u->new_mask ? (uint64_t)(u->worker << 4 | u->new_mask) : 0;
    return 0;
  }
  uint16_t sl[INLINE_MAX];
  unsigned n = 0, at = INLINE_MAX;
  for (; n < INLINE_MAX && (in_slot(p, n) & 0xFu); n++) {
    sl[n] = in_slot(p, n);
    if ((uint32_t)(sl[n] >> 4) == u->worker)
      at = n;
  }
  u->old_mask = at < n ? sl[at] & 0xFu : 0;
  u->new_mask = (u->old_mask | u->add) & ~u->del & 0xFu;
  *out = p;
  if (u->new_mask == u->old_mask)
    return 0;
  uint16_t s = (uint16_t)(u->worker << 4 | u->new_mask);
  if (at < n && u->new_mask != 0) {
    sl[at] = s;
  } else if (at < n) { /* drop slot `at`, keep the rest packed */
    memmove(&sl[at], &sl[at + 1], (n - at - 1) * sizeof sl[0]);
    n--;
  } else if (n < INLINE_MAX) {
    sl[n++] = s;
  } else {
    return spill(ix, sl, u, out);
  }
  *out = in_pack(sl, n);
  return 0;
}

/* <= SHRINK_AT holders left: back to the inline form. */
static uint64_t wset_to_inline(wset *ws) {
  uint16_t sl[INLINE_MAX];
  unsigned n = 0;
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  for (uint32_t i = 0; i < ng; i++) {
    uint64_t any = 0;
    for (unsigned t = 0; t < NTIERS; t++)
      any |= atomic_load_explicit(&ws->g[i].tier[t], memory_order_relaxed);
    for (; any != 0 && n < INLINE_MAX; any &= any - 1) {
      uint32_t w = (uint32_t)(ws->g[i].gid * 64 + ctz64(any));
      sl[n++] = (uint16_t)(w << 4 | group_mask(&ws->g[i], 1ull << (w & 63)));
    }
  }
  return in_pack(sl, n);
}

/* A new group for u->worker: in place when there is room, else a copy
 * without the empty groups. */
static int wset_add_group(kvp_index *ix, wset *ws, uint32_t ng, const upd *u,
                          uint64_t *out) {
  if (ng < ws->cap) {
    ws->g[ng].gid = u->worker >> 6;
    group_set(&ws->g[ng], u->worker, u->new_mask);
    ws->nworkers++;
    /* release: pairs with the acquire of ngroups in readers; the group's gid
     * and words are visible before it is counted */
    atomic_store_explicit(&ws->ngroups, ng + 1, memory_order_release);
    *out = (uint64_t)(uintptr_t)ws;
    return 0;
  }
  uint32_t cap = ws->cap * 2 > GROUPS_MAX ? GROUPS_MAX : ws->cap * 2;
  wset *nw = wset_new(ix, cap > ng + 1 ? cap : ng + 1);
  if (nw == NULL)
    return KVP_ENOMEM;
  for (uint32_t i = 0; i < ng; i++) {
    uint64_t any = 0;
    for (unsigned t = 0; t < NTIERS; t++)
      any |= atomic_load_explicit(&ws->g[i].tier[t], memory_order_relaxed);
    for (; any != 0; any &= any - 1) {
      uint32_t w = (uint32_t)(ws->g[i].gid * 64 + ctz64(any));
      wset_put(nw, w, group_mask(&ws->g[i], 1ull << (w & 63)));
    }
  }
  wset_put(nw, u->worker, u->new_mask);
  *out = (uint64_t)(uintptr_t)nw;
  return 0;
}

int kvp__wset_update(kvp_index *ix, wset *ws, upd *u, uint64_t *out) {
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  int gi = wset_find(ws, ng, u->worker >> 6);
  u->old_mask = gi >= 0 ? group_mask(&ws->g[gi], 1ull << (u->worker & 63)) : 0;
  u->new_mask = (u->old_mask | u->add) & ~u->del & 0xFu;
  *out = (uint64_t)(uintptr_t)ws;
  if (u->new_mask == u->old_mask)
    return 0;
  if (gi < 0)
    return wset_add_group(ix, ws, ng, u, out);
  group_set(&ws->g[gi], u->worker, u->new_mask);
  ws->nworkers += (u->new_mask != 0) - (u->old_mask != 0);
  if (ws->nworkers <= SHRINK_AT)
    *out = wset_to_inline(ws);
  return 0;
}

/* Worker w's tier mask in holder word p. */
uint32_t kvp__mask_of(uint64_t p, uint32_t w) {
  if (!is_wset(p)) {
    for (unsigned k = 0; k < INLINE_MAX && (in_slot(p, k) & 0xFu); k++)
      if ((uint32_t)(in_slot(p, k) >> 4) == w)
        return in_slot(p, k) & 0xFu;
    return 0;
  }
  wset *ws = (wset *)(uintptr_t)p;
  /* acquire: pairs with the release in wset_add_group */
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_acquire);
  int gi = wset_find(ws, ng, w >> 6);
  return gi < 0 ? 0 : group_mask(&ws->g[gi], 1ull << (w & 63));
}
