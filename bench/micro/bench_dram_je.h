/* SPDX-License-Identifier: Apache-2.0 */
/* The previous DRAM region (jemalloc arena), bench_dram_alloc's baseline;
 * same contract as kvp__tier_dram_* in kvtier_internal.h. */
#ifndef KVP_BENCH_DRAM_JE_H
#define KVP_BENCH_DRAM_JE_H
#include <stddef.h>
#include <stdint.h>

#include "kvplane/tier.h"

#define JE_POOL_ARENA UINT32_MAX

typedef struct je_dram je_dram;
int je_dram_create(uint64_t bytes, kvp_tier_huge huge, const kvp_allocator *a,
                   je_dram **out);
void je_dram_destroy(je_dram *d);
void *je_dram_alloc(je_dram *d, size_t len, uint64_t fixed, uint32_t *pool,
                    uint64_t *charged);
void je_dram_free(je_dram *d, void *p, uint32_t pool);
#endif
