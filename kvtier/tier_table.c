/* SPDX-License-Identifier: Apache-2.0 */
/* The store's index: (namespace, key) -> entry (kvtier_table.h). */
#include "core_internal.h"
#include "kvtier_table.h"

#define TAB_TOMB UINT32_MAX

void kvp__tier_table_init(tier_table *tb, const kvp_allocator *a) {
  *tb = (tier_table){.a = kvp__allocator(a), .free_head = TIER_NIL};
}

void kvp__tier_table_fini(tier_table *tb) {
  kvp__free(&tb->a, tb->ents, tb->cap * sizeof *tb->ents);
  kvp__free(&tb->a, tb->tab, tb->tab ? ((size_t)tb->mask + 1) * sizeof *tb->tab : 0);
  tb->ents = NULL;
  tb->tab = NULL;
}

/* Bucket from the 64-bit fingerprints only (key.lo ^ ns.lo), as an index
 * would keep them: keys that share a fingerprint share a probe sequence and
 * are told apart by the full comparison below. */
static uint32_t bucket(const tier_table *tb, kvp_key ns, kvp_key key) {
  uint64_t h = (key.lo ^ ns.lo) * 0x9E3779B97F4A7C15ull;
  return (uint32_t)(h >> 32) & tb->mask;
}

uint32_t kvp__tier_table_find(const tier_table *tb, kvp_key ns, kvp_key key) {
  if (tb->tab == NULL)
    return TIER_NIL;
  for (uint32_t i = bucket(tb, ns, key);; i = (i + 1) & tb->mask) {
    uint32_t v = tb->tab[i];
    if (v == 0)
      return TIER_NIL;
    if (v == TAB_TOMB)
      continue;
    const tier_entry *e = &tb->ents[v - 1];
    if (kvp_key_eq(e->key, key) && kvp_key_eq(e->ns, ns))
      return v - 1;
  }
}

static void tab_put(tier_table *tb, uint32_t id) {
  tier_entry *e = &tb->ents[id];
  uint32_t i = bucket(tb, e->ns, e->key);
  while (tb->tab[i] != 0 && tb->tab[i] != TAB_TOMB)
    i = (i + 1) & tb->mask;
  if (tb->tab[i] == 0)
    tb->fill++;
  tb->tab[i] = id + 1;
}

static int tab_grow(tier_table *tb) {
  uint32_t old = tb->tab ? tb->mask + 1 : 0, n = old ? old * 2 : 1024;
  uint32_t live = 0;
  for (uint32_t i = 0; i < tb->n; i++)
    live += tb->ents[i].live;
  if (old && (uint64_t)live * 4 < old) /* mostly tombstones: rebuild in place */
    n = old;
  uint32_t *nt = kvp__calloc(&tb->a, n, sizeof *nt);
  if (nt == NULL)
    return KVP_ENOMEM;
  kvp__free(&tb->a, tb->tab, (size_t)old * sizeof *nt);
  tb->tab = nt;
  tb->mask = n - 1;
  tb->fill = 0;
  for (uint32_t i = 0; i < tb->n; i++)
    if (tb->ents[i].live)
      tab_put(tb, i);
  return 0;
}

uint32_t kvp__tier_table_new(tier_table *tb, kvp_key ns, kvp_key key) {
  if (tb->tab == NULL || (uint64_t)(tb->fill + 1) * 2 > tb->mask + 1u)
    if (tab_grow(tb) < 0)
      return TIER_NIL;
  uint32_t id = tb->free_head;
  if (id != TIER_NIL) {
    tb->free_head = tb->ents[id].next_free;
  } else {
    if (tb->n == tb->cap) {
      uint32_t nc = tb->cap ? tb->cap * 2 : 1024;
      tier_entry *ne = kvp__realloc(&tb->a, tb->ents, tb->cap * sizeof *ne,
                                    (size_t)nc * sizeof *ne);
      if (ne == NULL)
        return TIER_NIL;
      tb->ents = ne;
      tb->cap = nc;
    }
    id = tb->n++;
  }
  tb->ents[id] = (tier_entry){.ns = ns, .key = key, .nclass = -1, .live = 1,
                             .pool = TIER_POOL_RUN, .next_free = TIER_NIL};
  tab_put(tb, id);
  return id;
}

void kvp__tier_table_gc(tier_table *tb, uint32_t id) {
  tier_entry *e = &tb->ents[id];
  if (!e->live || e->dram != NULL || e->nclass >= 0)
    return;
  for (uint32_t i = bucket(tb, e->ns, e->key);; i = (i + 1) & tb->mask)
    if (tb->tab[i] == id + 1) {
      tb->tab[i] = TAB_TOMB;
      break;
    }
  e->live = 0;
  e->next_free = tb->free_head;
  tb->free_head = id;
}
