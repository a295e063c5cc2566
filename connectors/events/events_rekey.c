/* SPDX-License-Identifier: Apache-2.0 */
/* The re-key map of one source: engine block hash -> kvplane key and the
 * tiers the engine holds the block in.  Open addressing with linear probing
 * and tombstones; the engine hashes are already uniform (SHA-256 / XXH3
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
  m->cap = m->used = m->tombs = 0;
}

void kvp__rk_clear(const kvp_allocator *a, rk_map *m) {
  size_t limit = m->limit;
  kvp__rk_free(a, m);
  kvp__rk_init(m, limit);
}

static rk_slot *probe(const rk_map *m, uint64_t h, bool for_insert) {
  size_t mask = m->cap - 1, i = (size_t)mix(h) & mask;
  rk_slot *tomb = NULL;
  for (size_t n = 0; n < m->cap; n++, i = (i + 1) & mask) {
    rk_slot *s = &m->slots[i];
    if (s->state == 0)
      return for_insert && tomb ? tomb : (for_insert ? s : NULL);
    if (s->state == 2) {
      if (tomb == NULL)
        tomb = s;
    } else if (s->ehash == h) {
      return s;
    }
  }
  return for_insert ? tomb : NULL;
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
      rk_slot *d = probe(&nm, m->slots[i].ehash, true);
      *d = m->slots[i];
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
  /* keep used + tombstones under 3/4 (a tombstone-heavy table is rebuilt
   * at the same size) */
  if (m->cap == 0 || (m->used + m->tombs + 1) * 4 > m->cap * 3) {
    size_t cap = m->cap ? m->cap : RK_MIN_CAP;
    while ((m->used + 1) * 2 > cap)
      cap *= 2;
    if ((*err = rehash(a, m, cap)) < 0)
      return NULL;
  }
  s = probe(m, ehash, true);
  if (s->state == 2)
    m->tombs--;
  memset(s, 0, sizeof *s);
  s->ehash = ehash;
  s->state = 1;
  m->used++;
  return s;
}

void kvp__rk_erase(rk_map *m, rk_slot *s) {
  s->state = 2;
  s->tiers = 0;
  m->used--;
  m->tombs++;
}

size_t kvp__rk_bytes(const rk_map *m) { return m->cap * sizeof(rk_slot); }
