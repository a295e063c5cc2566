/* SPDX-License-Identifier: Apache-2.0 */
/* The store's stats as Prometheus text (exposition format 0.0.4), through
 * core's text writer (include/kvplane/text.h) as the ledger's are: one
 * table of families over kvp_tier_stats, a `tier` (dram, nvme) or `class`
 * label where the field is an array. */
#include <stddef.h>
#include <string.h>

#include "core_internal.h"
#include "kvplane/text.h"
#include "kvtier_internal.h"

#define OUT_CHUNK 4096 /* bytes handed to a writer at a time */

enum { DIM_NONE, DIM_TIER, DIM_CLASS };
enum { COUNTER, GAUGE };

typedef struct family {
  const char *name, *help;
  uint8_t type, dim;
  size_t off; /* of a uint64_t (or its array) in kvp_tier_stats */
} family;

#define C_(n, f, h) {n, h, COUNTER, DIM_NONE, offsetof(kvp_tier_stats, f)}
#define CT_(n, f, h) {n, h, COUNTER, DIM_TIER, offsetof(kvp_tier_stats, f)}
#define CC_(n, f, h) {n, h, COUNTER, DIM_CLASS, offsetof(kvp_tier_stats, f)}
#define G_(n, f, h) {n, h, GAUGE, DIM_NONE, offsetof(kvp_tier_stats, f)}

static const family fams[] = {
    C_("puts_total", puts, "Blocks put (duplicates included)."),
    C_("puts_dup_total", puts_dup, "Puts of a block already stored."),
    C_("puts_rejected_total", puts_rejected, "Puts refused: no room."),
    CT_("hits_total", hits, "Blocks served, by tier served from."),
    C_("misses_total", misses, "Blocks asked for and not served."),
    C_("demotions_total", demotions, "DRAM blocks written to NVMe on eviction."),
    C_("promotions_total", promotions, "NVMe hits copied back into DRAM."),
    C_("drops_volatile_total", drops_volatile,
       "Volatile blocks dropped from DRAM without an NVMe copy."),
    CT_("evictions_total", evictions, "Blocks evicted, by tier."),
    C_("nvme_writes_total", nvme_writes, "NVMe slot writes."),
    C_("nvme_reads_total", nvme_reads, "NVMe slot reads."),
    C_("nvme_reads_registered_total", nvme_reads_registered,
       "NVMe reads into registered caller buffers."),
    C_("nvme_written_bytes_total", nvme_bytes_written, "Bytes written to NVMe."),
    C_("nvme_read_bytes_total", nvme_bytes_read, "Bytes read from NVMe."),
    C_("checksum_failures_total", checksum_failures,
       "NVMe reads that failed the payload checksum (a miss)."),
    C_("key_mismatch_total", key_mismatch,
       "NVMe slots naming another block than the index (a miss)."),
    C_("auth_failures_total", auth_failures,
       "Encrypted NVMe reads that failed the AES-GCM tag (a miss)."),
    C_("io_errors_total", io_errors, "NVMe I/O errors."),
    C_("short_io_total", short_io, "NVMe reads or writes cut short."),
    C_("slow_io_total", slow_io, "NVMe operations slower than slow_io_us."),
    C_("nvme_read_races_total", nvme_read_races,
       "NVMe reads of a block evicted during the read (a miss, not damage)."),
    C_("recovered_slots_total", recovered_slots, "Slots recovered at open."),
    C_("recovery_bad_slots_total", recovery_bad_slots,
       "Slots with a damaged header found at open."),
    C_("recovery_dup_slots_total", recovery_dup_slots,
       "Second slots of one block found at open (one kept)."),
    C_("recovery_truncated_blocks_total", recovery_truncated_blocks,
       "Blocks lost to a slab file cut short."),
    C_("slots_wiped_total", slots_wiped,
       "Damaged slots whose header was zeroed (not read again)."),
    CC_("admit_accepted_total", admit_accepted,
        "Blocks the NVMe admission gate wrote, by class."),
    CC_("admit_rejected_total", admit_rejected,
        "Blocks the NVMe admission gate turned away, by class."),
    C_("admit_reused_total", admit_reused, "Admitted NVMe blocks read back."),
    C_("admit_unused_total", admit_unused,
       "Admitted NVMe blocks that left NVMe unread."),
    C_("admit_ghost_hits_total", admit_ghost_hits,
       "Rejected blocks asked for again while remembered."),
    G_("dram_blocks", dram_blocks, "Blocks in DRAM."),
    G_("nvme_blocks", nvme_blocks, "Blocks on NVMe."),
    G_("dram_used_bytes", dram_used_bytes, "DRAM bytes charged to blocks."),
    G_("nvme_used_bytes", nvme_used_bytes, "NVMe slot bytes held."),
    G_("dram_capacity_bytes", dram_bytes, "DRAM capacity in force."),
    G_("nvme_capacity_bytes", nvme_bytes, "NVMe capacity in force."),
};

static const kvp_tier tiers[] = {KVP_TIER_DRAM, KVP_TIER_NVME};

static void head(kvp_text *o, const family *f) {
  kvp_text_printf(o, "# HELP kvplane_tier_%s %s\n# TYPE kvplane_tier_%s %s\n",
                  f->name, f->help, f->name,
                  f->type == COUNTER ? "counter" : "gauge");
}

static void sample(kvp_text *o, const char *name, const char *label,
                   const char *value, uint64_t v) {
  kvp_text_printf(o, "kvplane_tier_%s", name);
  if (label != NULL) {
    kvp_text_printf(o, "{%s=\"", label);
    kvp_text_prom_label(o, value);
    kvp_text_puts(o, "\"}");
  }
  kvp_text_puts(o, " ");
  kvp_text_u64(o, v);
  kvp_text_puts(o, "\n");
}

static void family_write(kvp_text *o, const family *f,
                         const kvp_tier_stats *st) {
  const uint64_t *v = (const uint64_t *)((const char *)st + f->off);
  head(o, f);
  if (f->dim == DIM_NONE)
    sample(o, f->name, NULL, NULL, *v);
  else if (f->dim == DIM_TIER)
    for (size_t i = 0; i < sizeof tiers / sizeof *tiers; i++)
      sample(o, f->name, "tier", kvp_tier_name(tiers[i]), v[tiers[i]]);
  else
    for (int c = 0; c < KVP_CLASS_COUNT_; c++)
      sample(o, f->name, "class", kvp_class_name((kvp_class)c), v[c]);
}

static void bandwidth_write(kvp_text *o, kvp_tier_store *t) {
  kvp_text_puts(o, "# HELP kvplane_tier_read_bandwidth_bytes_per_second "
                   "Measured read bandwidth into caller memory (EWMA; 0: "
                   "none yet).\n# TYPE kvplane_tier_read_bandwidth_bytes_"
                   "per_second gauge\n");
  for (size_t i = 0; i < sizeof tiers / sizeof *tiers; i++) {
    kvp_text_puts(o, "kvplane_tier_read_bandwidth_bytes_per_second{tier=\"");
    kvp_text_prom_label(o, kvp_tier_name(tiers[i]));
    kvp_text_puts(o, "\"} ");
    kvp_text_prom_num(o, kvp_tier_bandwidth(t, tiers[i]));
    kvp_text_puts(o, "\n");
  }
}

int kvp_tier_prometheus_write(kvp_tier_store *t, kvp_write_fn fn,
                              void *opaque) {
  if (t == NULL || fn == NULL)
    return KVP_EINVAL;
  kvp_tier_stats st;
  kvp_tier_stats_get(t, &st);
  char chunk[OUT_CHUNK];
  kvp_text o;
  kvp_text_init_writer(&o, fn, opaque, chunk, sizeof chunk);
  for (size_t i = 0; i < sizeof fams / sizeof *fams; i++)
    family_write(&o, &fams[i], &st);
  bandwidth_write(&o, t);
  return kvp_text_flush(&o);
}

/* A writer that appends to a buffer-mode kvp_text. */
static int text_sink(void *opaque, const char *d, size_t n) {
  kvp_text_put(opaque, d, n);
  return 0;
}

int kvp_tier_prometheus(kvp_tier_store *t, char *buf, size_t cap,
                        size_t *needed) {
  if (buf == NULL && cap > 0)
    return KVP_EINVAL;
  kvp_text m;
  kvp_text_init(&m, buf, cap);
  int rc = kvp_tier_prometheus_write(t, text_sink, &m);
  if (needed != NULL)
    *needed = kvp_text_len(&m);
  if (rc < 0)
    return rc;
  return kvp_text_len(&m) < cap ? 0 : KVP_ENOSPC;
}
