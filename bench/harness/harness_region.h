/* SPDX-License-Identifier: Apache-2.0 */
/* Regions: memory a batch simulation carves its workers' arrays from, kept
 * by the process between simulations so the next one reuses the same pages
 * (already in memory) instead of faulting in new ones.
 *
 * Why: a 20x agentic replay builds 165 workers, each with a block table,
 * its nodes and kvtier's policy entries (~4 MB).  Allocated one by one,
 * each simulation of `kvplane-bench run` touched ~180 MB that the one
 * before it had not (jemalloc split and reused its freed extents in another
 * order), and on this class of VM a page touched for the first time costs
 * ~2 s per GB (docs/methodology.md, "Machines").  A region is one
 * reservation in 2 MiB pages handed out by bumping: the same cluster carves
 * the same offsets every time, and the arrays lie packed (no 2 MiB page per
 * array, which a worker's 1 MB table half filled). */
#ifndef KVP_HARNESS_REGION_H
#define KVP_HARNESS_REGION_H

#include <stdbool.h>
#include <stddef.h>

#include "kvplane/common.h"

typedef struct bh_region bh_region;

/* Allocations below this come from malloc, not the region. */
#define BH_REGION_MIN ((size_t)64 << 10)

/* A region of at least `bytes` of address space (nothing is touched until
 * used): a kept one when one is that big, else a new mapping.  Returns 0,
 * KVP_EINVAL (bytes 0 or out NULL) or KVP_ENOMEM. */
int bh_region_take(size_t bytes, bh_region **out);

/* Everything carved from r is given back at once and r is kept for the
 * next bh_region_take (its pages stay in memory).  NULL: nothing. */
void bh_region_give(bh_region *r);

/* Unmaps every kept region (a process about to exit need not). */
void bh_region_drain(void);

/* The allocator over r (kvp_allocator: r must outlive what it allocated).
 * alloc: BH_REGION_MIN bytes or more, 64-byte aligned, from the region
 * while it has room, else malloc's; not zeroed (kvp__calloc clears).  Not
 * thread-safe: one simulation carves a region at a time.  free:
 * nothing for the region's memory (bh_region_give frees it all), free()
 * for malloc's. */
kvp_allocator bh_region_allocator(bh_region *r);

/* Bytes carved so far; the reservation's size; the most ever carved at
 * once (kept across bh_region_give: the pages the next user finds in
 * memory); where the reservation starts. */
size_t bh_region_used(const bh_region *r);
size_t bh_region_size(const bh_region *r);
size_t bh_region_peak(const bh_region *r);
void *bh_region_base(const bh_region *r);

/* Whether p lies in r's reservation. */
bool bh_region_has(const bh_region *r, const void *p);

#endif
