/* SPDX-License-Identifier: Apache-2.0 */
/* The re-key map of one source: engine block hash -> kvplane key and the
 * tiers the engine holds the block in.  Open addressing with linear probing
 * and backward-shift deletion; the engine hashes are already uniform (SHA-256 / XXH3
 * output), mixed once more so int hashes from a weak engine hash spread. */
#include <string.h>

#include "events_internal.h"

#define RK_MIN_CAP 1024u

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void kvp__rk_init(rk_map *m, size_t limit) {
  memset(m, 0, sizeof *m);
  m->limit = limit;
}

void kvp__rk_free(const kvp_allocator *a, rk_map *m) {
  kvp__ev_free(a, m->slots, m->cap * sizeof *m->slots);
  m->slots = NULL;
  m->cap = m->used = 0;
}

void kvp__rk_clear(const kvp_allocator *a, rk_map *m) {
  size_t limit = m->limit;
  kvp__rk_free(a, m);
  kvp__rk_init(m, limit);
}

/* The slot holding h, or (for_insert) the empty slot where it goes. */
static rk_slot *probe(const rk_map *m, uint64_t h, bool for_insert) {
  size_t mask = m->cap - 1;
  for (size_t i = (size_t)mix(h) & mask;; i = (i + 1) & mask) {
    rk_slot *s = &m->slots[i];
    if (s->state == 0)
      return for_insert ? s : NULL;
    if (s->ehash == h)
      return s;
  }
}

rk_slot *kvp__rk_find(const rk_map *m, uint64_t ehash) {
  return m->cap ? probe(m, ehash, false) : NULL;
}

static int rehash(const kvp_allocator *a, rk_map *m, size_t cap) {
  rk_slot *ns = kvp__ev_calloc(a, cap, sizeof *ns);
  if (ns == NULL)
    return KVP_ENOMEM;
  rk_map nm = {.slots = ns, .cap = cap, .limit = m->limit};
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].state == 1) {
      *probe(&nm, m->slots[i].ehash, true) = m->slots[i];
      nm.used++;
    }
  kvp__ev_free(a, m->slots, m->cap * sizeof *m->slots);
  *m = nm;
  return 0;
}

rk_slot *kvp__rk_upsert(const kvp_allocator *a, rk_map *m, uint64_t ehash,
                        int *err) {
  rk_slot *s = kvp__rk_find(m, ehash);
  if (s != NULL)
    return s;
  if (m->used >= m->limit) {
    *err = KVP_ERANGE;
    return NULL;
  }
  if (m->cap == 0 || (m->used + 1) * 4 > m->cap * 3) { /* load <= 3/4 */
    if ((*err = rehash(a, m, m->cap ? 2 * m->cap : RK_MIN_CAP)) < 0)
      return NULL;
  }
  s = probe(m, ehash, true);
  memset(s, 0, sizeof *s);
  s->ehash = ehash;
  s->state = 1;
  m->used++;
  return s;
}

/* Backward-shift deletion (no tombstones, so probe runs stay as short as
 * the load allows while blocks come and go): entries after the hole move
 * back when the hole lies on their probe path. */
void kvp__rk_erase(rk_map *m, rk_slot *s) {
  size_t mask = m->cap - 1, hole = (size_t)(s - m->slots);
  for (size_t i = (hole + 1) & mask; m->slots[i].state != 0;
       i = (i + 1) & mask) {
    size_t home = (size_t)mix(m->slots[i].ehash) & mask;
    /* does the hole lie cyclically in [home, i)? then i may move there */
    if (((i - home) & mask) >= ((i - hole) & mask)) {
      m->slots[hole] = m->slots[i];
      hole = i;
    }
  }
  memset(&m->slots[hole], 0, sizeof m->slots[hole]);
  m->used--;
}

void kvp__rk_prefetch(const rk_map *m, const kvp_ehash *h, size_t n) {
  if (m->cap == 0)
    return;
  for (size_t i = 0; i < n; i++)
    __builtin_prefetch(&m->slots[(size_t)mix(h[i].u64) & (m->cap - 1)], 1);
}

size_t kvp__rk_bytes(const rk_map *m) { return m->cap * sizeof(rk_slot); }
