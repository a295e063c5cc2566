/* SPDX-License-Identifier: Apache-2.0 */
/* The store's index: (namespace, key) -> entry, one entry per block, with
 * where the block lives (DRAM slot, NVMe class + slot).  Open addressing on
 * the 64-bit fingerprints only (key.lo ^ ns.lo), as an index would keep
 * them: keys that share a fingerprint share a probe sequence and are told
 * apart by the full comparison.  Entry ids are stable while the entry lives
 * (the policies and NVMe slots name entries by id); a deleted entry's id is
 * reused.  Not thread-safe: the store's lock guards it.  Not installed. */
#ifndef KVP_KVTIER_TABLE_H
#define KVP_KVTIER_TABLE_H

#include <stdbool.h>
#include <stdint.h>

#include "kvplane/common.h"
#include "kvtier_place.h"

#define TIER_NIL UINT32_MAX
#define TIER_POOL_RUN UINT32_MAX /* tier_entry.pool: a run of its own pages */

typedef struct tier_entry {
  kvp_key ns, key;
  uint64_t len;
  void *dram;           /* NULL: not in DRAM */
  uint64_t dram_charge; /* bytes charged to the DRAM capacity */
  uint32_t pool;        /* the DRAM region's slot pool or TIER_POOL_RUN */
  int32_t nclass;       /* NVMe slab class, -1: not on NVMe */
  uint64_t nslot;
  uint64_t nsum;        /* XXH3-64 of the NVMe payload (its header's) */
  uint32_t hits;
  uint8_t cls, live;
  uint8_t nenc;         /* the NVMe slot is AES-256-GCM */
  uint16_t dpin;        /* in-place loads reading the DRAM slot (the slot
                           outlives a release until they are done) */
  tier_cell adm;        /* admission cell at its NVMe write, until its
                           outcome is noted; 0: none (recovered, noted) */
  uint32_t next_free;
} tier_entry;

typedef struct tier_table {
  kvp_allocator a;
  tier_entry *ents;
  uint32_t n, cap, free_head; /* ents[0, n) used or on the free list */
  uint32_t *tab;              /* entry id + 1; 0 empty, UINT32_MAX deleted */
  uint32_t mask, fill;
} tier_table;

void kvp__tier_table_init(tier_table *tb, const kvp_allocator *a);
void kvp__tier_table_fini(tier_table *tb);
/* The entry's id, or TIER_NIL. */
uint32_t kvp__tier_table_find(const tier_table *tb, kvp_key ns, kvp_key key);
/* A new live entry (in no tier yet) for a key not in the table; TIER_NIL
 * when out of memory.  May move ents (not ids). */
uint32_t kvp__tier_table_new(tier_table *tb, kvp_key ns, kvp_key key);
/* Deletes the entry when it is in no tier any more. */
void kvp__tier_table_gc(tier_table *tb, uint32_t id);

#endif /* KVP_KVTIER_TABLE_H */
