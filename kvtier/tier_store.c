/* SPDX-License-Identifier: Apache-2.0 */
/* The block store: the (namespace, key) index's entries (kvtier_table.h)
 * and what the tiers' results mean to them -- events, bandwidth notes,
 * admission outcomes --, the DRAM tier's placement (the cascade decides
 * demotions; promote on hit, idle write-back), batch and asynchronous calls,
 * options and stats.  One mutex (mu) guards the store; a batch's NVMe reads
 * release it and run under the NVMe tier's read lock (kvtier_nvme.h); the
 * job queue has its own (jmu), always taken after mu or alone. */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core_internal.h"
#include "kvtier_internal.h"
#include "kvtier_nvme.h"

const tier_ns *kvp__tier_ns_find(const kvp_tier_store *t, kvp_key seed) {
  for (uint32_t i = 0; i < t->nns; i++)
    if (kvp_key_eq(t->nss[i].seed, seed))
      return &t->nss[i];
  return NULL;
}

static void emit(kvp_tier_store *t, kvp_tier tier, int stored,
                    const tier_entry *e) {
  if (t->o.on_event == NULL)
    return;
  kvp_tier_event ev = {.seq = ++t->seq, .tier = tier, .stored = stored,
                       .ns = e->ns, .key = e->key, .bytes = e->len,
                       .epoch = t->ev_epoch};
  t->o.on_event(t->o.event_opaque, &ev);
}

/* A new store's event epoch: CLOCK_REALTIME in ns, so that a store reopened
 * by the next process on this host (after a restart) has a larger one unless
 * the clock went back; and strictly increasing within this process, so two
 * stores created in one nanosecond, or across a clock step back, differ. */
static uint64_t epoch_next(void) {
  static _Atomic uint64_t last;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
  /* relaxed: the value is all that is shared, and the CAS loop orders the
   * stores of this one word */
  uint64_t prev = atomic_load_explicit(&last, memory_order_relaxed), e;
  do
    e = now > prev ? now : prev + 1;
  while (!atomic_compare_exchange_weak_explicit(
      &last, &prev, e, memory_order_relaxed, memory_order_relaxed));
  return e;
}

static void bw_note(kvp_tier_store *t, kvp_tier tier, uint64_t bytes,
                       uint64_t ns) {
  if (ns == 0 || (unsigned)tier >= KVP_TIER_COUNT_)
    return;
  double bps = (double)bytes * 1e9 / (double)ns;
  t->bw[tier] = t->bw[tier] == 0 ? bps : 0.75 * t->bw[tier] + 0.25 * bps;
}

/* ---- NVMe admission (the gate: kvtier/tier_admit.c) ----------------------------*/
static uint64_t fp_of(kvp_key ns, kvp_key key) { return key.lo ^ ns.lo; }

/* The block's recompute / NVMe read / NVMe write times: measured NVMe
 * bandwidths once there are any, configured ones before. */
static tier_admit_cost admit_cost(const kvp_tier_store *t,
                                  const tier_entry *e) {
  const tier_ns *ns = kvp__tier_ns_find(t, e->ns);
  double pre = ns != NULL && ns->prefill_bps > 0 ? ns->prefill_bps
                                                 : t->o.prefill_kv_bytes_per_s;
  double rd = t->bw[KVP_TIER_NVME] > 0      ? t->bw[KVP_TIER_NVME]
              : t->o.nvme_read_bytes_per_s > 0 ? t->o.nvme_read_bytes_per_s
                                               : 2e9;
  double wr = t->bw_write > 0                  ? t->bw_write
              : t->o.nvme_write_bytes_per_s > 0 ? t->o.nvme_write_bytes_per_s
                                                : 1e9;
  double b = (double)e->len;
  return (tier_admit_cost){pre > 0 ? b / pre : 0, b / rd, b / wr};
}

static tier_admit *gate_of(const kvp_tier_store *t) {
  return kvp__tier_cascade_gate(t->cas);
}

/* The idle write-back's question to the gate (demotions ask the cascade). */
static bool nvme_admits(const kvp_tier_store *t, const tier_entry *e) {
  if (t->nv == NULL)
    return false;
  tier_admit_cost c = admit_cost(t, e);
  return kvp__tier_admit_decide(gate_of(t), (kvp_class)e->cls, e->hits, &c) == 1;
}

static tier_admit_opts admit_opts(const kvp_tier_store *t) {
  return (tier_admit_opts){.mode = t->o.admission,
                           .volatile_min_hits = t->o.volatile_nvme_min_hits,
                           .write_weight = t->o.admit_write_weight,
                           .min_samples = t->o.admit_min_samples};
}

static int admit_sync(kvp_tier_store *t) {
  tier_admit_opts ao = admit_opts(t);
  return gate_of(t) != NULL ? kvp__tier_admit_opts_set(gate_of(t), &ao) : 0;
}

/* An NVMe block's admission outcome (e->adm): read back or left unread. */
static void admit_outcome(kvp_tier_store *t, tier_entry *e, bool reused) {
  if (e->adm == 0)
    return;
  kvp__tier_admit_note_cell(gate_of(t), e->adm, reused);
  if (reused)
    t->st.admit_reused++;
  else
    t->st.admit_unused++;
  e->adm = 0;
}

/* A key this store does not hold was asked for: a rejected block's ghost? */
static void admit_seen(kvp_tier_store *t, kvp_key ns, kvp_key key) {
  if (kvp__tier_admit_seen(gate_of(t), fp_of(ns, key)))
    t->st.admit_ghost_hits++;
}

/* ---- the NVMe tier's results (kvtier_nvme.h) in the index ---------------------*/
/* Recovery found a slot: a new entry owns it, unless its block is owned
 * already (the same block twice: one slot kept). */
static uint32_t nvme_found(void *arg, const tier_slot_hdr *h, int32_t ci,
                           uint64_t slot, kvp_class *cls) {
  kvp_tier_store *t = arg;
  if (kvp__tier_table_find(&t->tbl, h->ns, h->key) != TIER_NIL) {
    t->st.recovery_dup_slots++;
    return TIER_NIL;
  }
  uint32_t id = kvp__tier_table_new(&t->tbl, h->ns, h->key);
  if (id == TIER_NIL)
    return TIER_NIL;
  tier_entry *e = &t->tbl.ents[id];
  e->len = h->len;
  e->nsum = h->payload_sum;
  e->nenc = h->flags & TIER_HDR_F_AESGCM ? 1 : 0;
  e->cls = KVP_CLASS_SEMI; /* admitted to NVMe once: at least reused */
  e->nclass = ci;
  e->nslot = slot;
  t->st.nvme_blocks++;
  t->st.recovered_slots++;
  emit(t, KVP_TIER_NVME, 1, e);
  *cls = (kvp_class)e->cls;
  return id;
}

/* Entry id leaves NVMe (its header zeroed first with wipe). */
static void nvme_drop(kvp_tier_store *t, uint32_t id, bool wipe, bool evicted) {
  tier_entry *e = &t->tbl.ents[id];
  if (e->nclass < 0)
    return;
  kvp__tier_nvme_free(t->nv, id, e->nclass, e->nslot, wipe, evicted);
  admit_outcome(t, e, false); /* left unread */
  e->nclass = -1;
  t->st.nvme_blocks--;
  emit(t, KVP_TIER_NVME, 0, e);
}

/* A slot for a block of len bytes, evicting the entries a full class gives
 * up.  0 with *ci >= 0, or the error (*ci -1). */
static int nvme_reserve(kvp_tier_store *t, uint64_t len, int32_t *ci,
                        uint64_t *slot) {
  uint32_t v;
  int rc;
  while ((rc = kvp__tier_nvme_reserve(t->nv, len, ci, slot, &v)) == 1) {
    t->st.evictions[KVP_TIER_NVME]++;
    nvme_drop(t, v, false, true);
    kvp__tier_table_gc(&t->tbl, v);
  }
  if (rc < 0)
    *ci = -1;
  return rc;
}

static tier_nwrite nwrite_of(const kvp_tier_store *t, uint32_t id) {
  const tier_entry *e = &t->tbl.ents[id];
  const tier_ns *ns = kvp__tier_ns_find(t, e->ns);
  return (tier_nwrite){.id = id, .ns = e->ns, .key = e->key, .len = e->len,
                       .src = e->dram, .cls = (kvp_class)e->cls,
                       .enc = ns != NULL && ns->enc,
                       .aes = ns != NULL ? ns->key : NULL, .ci = -1};
}

/* Block w is on NVMe now: the entry's location, its admission cell. */
static void nvme_landed(kvp_tier_store *t, const tier_nwrite *w) {
  tier_entry *e = &t->tbl.ents[w->id];
  e->nclass = w->ci;
  e->nslot = w->slot;
  e->nsum = w->sum;
  e->nenc = w->nenc;
  e->adm = kvp__tier_admit_cell((kvp_class)e->cls, e->hits);
  t->st.nvme_blocks++;
  emit(t, KVP_TIER_NVME, 1, e);
}

/* Writes entries ids[0..n) (in DRAM) to NVMe; res[i] 0 or error; with
 * durable, fdatasyncs the touched files and fails the batch on error. */
static void nvme_write(kvp_tier_store *t, const uint32_t *ids, size_t n,
                       bool durable, int *res) {
  if (n == 0)
    return;
  tier_nwrite *w = t->nv != NULL ? kvp__calloc(&t->a, n, sizeof *w) : NULL;
  for (size_t i = 0; i < n; i++)
    res[i] = t->nv == NULL ? KVP_ENOTSUP : w == NULL ? KVP_ENOMEM : 0;
  if (res[0] < 0)
    goto out;
  for (size_t i = 0; i < n; i++) { /* metadata first: classes and slots */
    w[i] = nwrite_of(t, ids[i]);
    w[i].res = nvme_reserve(t, w[i].len, &w[i].ci, &w[i].slot);
  }
  tier_nvme_batch b;
  kvp__tier_nvme_write(t->nv, w, n, t->qd, !t->no_stage_ahead, durable, &b);
  if (b.bytes > 0 && b.ns > 0) {
    double bps = (double)b.bytes * 1e9 / (double)b.ns;
    t->bw_write = t->bw_write == 0 ? bps : 0.75 * t->bw_write + 0.25 * bps;
  }
  for (size_t i = 0; i < n; i++) {
    res[i] = w[i].res;
    if (w[i].ci >= 0)
      nvme_landed(t, &w[i]);
  }
out:
  kvp__free(&t->a, w, w != NULL ? n * sizeof *w : 0);
}

static tier_nread nread_of(const kvp_tier_store *t, uint32_t id, void *dst) {
  const tier_entry *e = &t->tbl.ents[id];
  const tier_ns *ns = kvp__tier_ns_find(t, e->ns);
  tier_nread r = {.ns = e->ns, .key = e->key, .len = e->len, .sum = e->nsum,
                  .slot = e->nslot, .ci = e->nclass, .ns_ok = ns != NULL,
                  .ns_enc = ns != NULL && ns->enc, .enc = e->nenc, .dst = dst};
  if (r.ns_enc)
    memcpy(r.aes, ns->key, 32);
  return r;
}

/* The entry still names the block that was read, in the same slot. */
static bool still_ours(const kvp_tier_store *t, uint32_t id,
                       const tier_nread *r) {
  const tier_entry *e = &t->tbl.ents[id];
  return id < t->tbl.n && e->live && e->nclass == r->ci &&
         e->nslot == r->slot && kvp_key_eq(e->key, r->key) &&
         kvp_key_eq(e->ns, r->ns);
}

/* mu held: what the reads found, per block: unpins, counts, and drops the
 * slots that failed their checks (when still the entry's). */
static void read_finish(kvp_tier_store *t, const uint32_t *ids, size_t n,
                        const tier_nread *r) {
  for (size_t i = 0; i < n; i++) {
    kvp__tier_nvme_unpin(t->nv, r[i].ci, r[i].slot);
    bool ours = still_ours(t, ids[i], &r[i]);
    switch (r[i].fail) {
    case TIER_RF_IO: t->st.io_errors++; break;
    case TIER_RF_SHORT: t->st.short_io++; break;
    /* a check that failed because the block was evicted (header wiped)
     * under the read is a race, not damage: not counted */
    case TIER_RF_SUM: t->st.checksum_failures += ours; break;
    case TIER_RF_KEY: t->st.key_mismatch += ours; break;
    case TIER_RF_AUTH: t->st.auth_failures += ours; break;
    default: break;
    }
    t->st.nvme_read_races += !ours && r[i].fail >= TIER_RF_SUM;
    if (!ours)
      continue;
    bool damage = r[i].fail >= TIER_RF_SUM;
    if (damage) /* logged once per file, counted; wiped by the drop */
      kvp__tier_nvme_damaged(t->nv, r[i].ci, r[i].slot, r[i].fail);
    if (r[i].fail == TIER_RF_NONE) /* read back: the gate's admission paid */
      admit_outcome(t, &t->tbl.ents[ids[i]], true);
    else /* a miss; the slot is not trusted again (nor after a restart) */
      nvme_drop(t, ids[i], damage, false);
  }
}

/* Reads entries ids[0..n) (on NVMe) into dst[i]; res[i] KVP_TIER_NVME or a
 * miss code (the slot is then dropped, if the entry still owns it).  Called
 * with mu held; RELEASES mu while the I/O and the checks run (unless
 * KVP_TIER_OPT_READ_UNLOCKED is 0) and retakes it before returning: entries
 * may have been evicted or re-put meanwhile. */
static void nvme_read(kvp_tier_store *t, const uint32_t *ids, size_t n,
                      void *const *dst, int *res) {
  tier_nread *r = kvp__calloc(&t->a, n, sizeof *r);
  tier_nvme_batch b;
  for (size_t i = 0; r != NULL && i < n; i++)
    r[i] = nread_of(t, ids[i], dst[i]);
  if (r == NULL || kvp__tier_nvme_read(t->nv, r, n, t->qd,
                                       t->reads_locked ? NULL : &t->mu, &b) < 0) {
    for (size_t i = 0; i < n; i++)
      res[i] = KVP_ENOENT;
    goto out;
  }
  if (b.bytes > 0)
    bw_note(t, KVP_TIER_NVME, b.bytes, b.ns);
  read_finish(t, ids, n, r);
  for (size_t i = 0; i < n; i++)
    res[i] = r[i].res;
out:
  kvp__free(&t->a, r, r != NULL ? n * sizeof *r : 0);
}

/* An NVMe owner's fingerprint and class (kvp__tier_nvme_set_policy). */
static void owner_info(void *arg, uint32_t id, uint64_t *fp, kvp_class *cls) {
  const tier_entry *e = &((const kvp_tier_store *)arg)->tbl.ents[id];
  *fp = e->key.lo ^ e->ns.lo;
  *cls = (kvp_class)e->cls;
}

/* ---- DRAM placement ----------------------------------------------------------*/

static tier_policy *dram_policy(const kvp_tier_store *t) {
  return kvp__tier_cascade_policy(t->cas, KVP_TIER_DRAM);
}

static void dram_free(kvp_tier_store *t, void *p, uint32_t pool,
                      uint64_t charge) {
  kvp__tier_dram_free(t->dram, p, pool);
  t->dram_used -= charge;
}

/* Entry id leaves DRAM; a slot in-place loads still read goes to dfree
 * (room is there: dfree_cap >= npinned). */
static void dram_release(kvp_tier_store *t, uint32_t id) {
  tier_entry *e = &t->tbl.ents[id];
  if (e->dpin > 0) {
    assert(t->ndfree < t->dfree_cap);
    t->dfree[t->ndfree++] = (tier_dfree){.p = e->dram, .charge = e->dram_charge,
                                         .pool = e->pool, .pins = e->dpin};
    e->dpin = 0;
  } else {
    dram_free(t, e->dram, e->pool, e->dram_charge);
  }
  e->dram = NULL;
  t->st.dram_blocks--;
  emit(t, KVP_TIER_DRAM, 0, e);
}

bool kvp__tier_pin_room(kvp_tier_store *t, uint32_t n) {
  uint64_t need = (uint64_t)t->npinned + n;
  if (need <= t->dfree_cap)
    return true;
  uint64_t cap = need < 256 ? 256 : need * 2;
  if (cap > UINT32_MAX)
    return false;
  tier_dfree *d = kvp__realloc(&t->a, t->dfree, t->dfree_cap * sizeof *d,
                               cap * sizeof *d);
  if (d == NULL)
    return false;
  t->dfree = d;
  t->dfree_cap = (uint32_t)cap;
  return true;
}

void kvp__tier_pin(kvp_tier_store *t, uint32_t id) {
  assert(t->npinned < t->dfree_cap); /* kvp__tier_pin_room first */
  t->tbl.ents[id].dpin++;
  t->npinned++;
}

void kvp__tier_unpin(kvp_tier_store *t, uint32_t id, const void *p) {
  t->npinned--;
  tier_entry *e = id < t->tbl.n ? &t->tbl.ents[id] : NULL;
  if (e != NULL && e->live && e->dram == p && e->dpin > 0) {
    e->dpin--; /* still the entry's: a deferred slot is never reused */
    return;
  }
  for (uint32_t i = 0; i < t->ndfree; i++)
    if (t->dfree[i].p == p) {
      tier_dfree *d = &t->dfree[i];
      if (--d->pins == 0) {
        dram_free(t, d->p, d->pool, d->charge);
        *d = t->dfree[--t->ndfree];
      }
      return;
    }
  assert(!"unpin of a slot nobody pinned");
}

/* What the cascade asks about a DRAM victim. */
static void victim_info(void *arg, uint32_t id, tier_victim *v) {
  const kvp_tier_store *t = arg;
  const tier_entry *e = &t->tbl.ents[id];
  *v = (tier_victim){.fp = fp_of(e->ns, e->key), .cls = (kvp_class)e->cls,
                     .hits = e->hits, .below = e->nclass >= 0};
  if (!v->below && t->nv != NULL)
    v->cost = admit_cost(t, e);
}

/* Evicts DRAM victims until `need` more bytes fit under the capacity (and,
 * with force, at least one victim), demoting those NVMe admits in one
 * batch.  Returns false when DRAM is empty. */
static bool dram_evict(kvp_tier_store *t, uint64_t need, bool force) {
  uint32_t ids[256], wr[256];
  int res[256];
  size_t n = 0, nw = 0;
  tier_move m;
  while (n < 256 && kvp__tier_cascade_next(t->cas, KVP_TIER_DRAM, need, force,
                                            victim_info, t, &m) > 0) {
    uint8_t cls = t->tbl.ents[m.id].cls;
    ids[n++] = m.id;
    if (m.gate == TIER_GATE_ADMIT) {
      wr[nw++] = m.id;
      t->st.admit_accepted[cls]++;
    } else if (m.gate == TIER_GATE_REJECT) {
      t->st.admit_rejected[cls]++;
    }
    force = false;
  }
  if (nw > 0)
    nvme_write(t, wr, nw, false, res);
  for (size_t i = 0, j = 0; i < n; i++) {
    tier_entry *e = &t->tbl.ents[ids[i]];
    if (j < nw && wr[j] == ids[i]) {
      if (res[j++] == 0)
        t->st.demotions++;
    } else if (e->nclass < 0 && e->cls == KVP_CLASS_VOLATILE) {
      t->st.drops_volatile++;
    }
    t->st.evictions[KVP_TIER_DRAM]++;
    dram_release(t, ids[i]);
    kvp__tier_table_gc(&t->tbl, ids[i]);
  }
  return n > 0;
}

/* A DRAM block of len bytes for namespace nsk (its fixed-size slots when
 * it has them), evicting to make room, charged to the capacity.  NULL: no
 * room even after eviction. */
static void *dram_take(kvp_tier_store *t, kvp_key nsk, uint64_t len,
                       uint32_t *pool, uint64_t *charge) {
  const tier_ns *ns = kvp__tier_ns_find(t, nsk);
  if (len > t->dram_cap)
    return NULL;
  while (t->dram_used + len > t->dram_cap)
    if (!dram_evict(t, len, false))
      break;
  void *p;
  *charge = 0;
  while ((p = kvp__tier_dram_alloc(t->dram, len, ns ? ns->block_bytes : 0,
                                   pool, charge)) == NULL)
    if (!dram_evict(t, len, true))
      return NULL;
  t->dram_used += *charge;
  return p;
}

/* Entry id's bytes are in DRAM block p (charged): index it there. */
static void dram_attach(kvp_tier_store *t, uint32_t id, void *p, uint32_t pool,
                        uint64_t charge) {
  tier_entry *e = &t->tbl.ents[id];
  e->dram = p;
  e->pool = pool;
  e->dram_charge = charge;
  t->st.dram_blocks++;
  kvp__tier_policy_insert(dram_policy(t), id, e->key.lo ^ e->ns.lo, charge,
                          e->cls);
  emit(t, KVP_TIER_DRAM, 1, e);
}

/* Puts len bytes from src into DRAM for entry id.  0 or KVP_ENOSPC. */
static int dram_place(kvp_tier_store *t, uint32_t id, const void *src) {
  uint64_t charge, len = t->tbl.ents[id].len;
  uint32_t pool;
  void *p = dram_take(t, t->tbl.ents[id].ns, len, &pool, &charge);
  if (p == NULL)
    return KVP_ENOSPC;
  memcpy(p, src, len); /* eviction never moves entries */
  dram_attach(t, id, p, pool, charge);
  return 0;
}

/* ---- create / destroy -----------------------------------------------------*/
static uint64_t mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  uint64_t kb = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "MemAvailable: %" SCNu64 " kB", &kb) == 1)
      break;
  if (f != NULL)
    fclose(f);
  return kb * 1024;
}

static int check_opts(const kvp_tier_opts *o) {
  if (o->dram_fraction < 0 || o->dram_fraction > 0.9 || o->nvme_fraction < 0 ||
      o->nvme_fraction > 0.95 || o->queue_depth > 1024 ||
      (unsigned)o->policy >= KVP_TIER_POLICY_COUNT_ ||
      (unsigned)o->io_backend > KVP_TIER_IO_POSIX ||
      (unsigned)o->huge_pages > KVP_TIER_HUGE_NONE || o->no_promote > 1 ||
      o->max_block_bytes > (UINT64_C(256) << 20) ||
      (unsigned)o->admission >= KVP_TIER_ADMIT_COUNT_ ||
      o->admit_min_samples > 512 || o->host_stores > 256 ||
      !(o->admit_write_weight >= 0) ||
      !(o->prefill_kv_bytes_per_s >= 0) || !(o->nvme_read_bytes_per_s >= 0) ||
      !(o->nvme_write_bytes_per_s >= 0) || isinf(o->admit_write_weight) ||
      isinf(o->prefill_kv_bytes_per_s) || isinf(o->nvme_read_bytes_per_s) ||
      isinf(o->nvme_write_bytes_per_s)) {
    KVP_LOGE("kvtier", "invalid kvp_tier_opts");
    return KVP_EINVAL;
  }
  return 0;
}

static int create_dram(kvp_tier_store *t) {
  uint64_t bytes = t->o.dram_bytes;
  int rc;
  if (bytes == 0) { /* a share of the host's budget */
    double f = t->o.dram_fraction > 0 ? t->o.dram_fraction : 0.25;
    rc = kvp__tier_host_claim(f, t->o.host_stores, mem_available(), &bytes,
                              &t->host_claimed);
    if (rc < 0)
      return rc;
    t->host_bytes = bytes;
  }
  rc = kvp__tier_dram_create(bytes, t->o.huge_pages, &t->a, &t->dram);
  if (rc < 0) {
    KVP_LOGE("kvtier", "DRAM region of %" PRIu64 " bytes: %s", bytes,
             kvp_strerror(rc));
    return rc;
  }
  t->dram_cap = bytes;
  void *base;
  size_t len;
  kvp__tier_dram_region(t->dram, &base, &len);
  t->dram_region = len;
  if (t->o.dram_register != NULL) {
    if ((rc = t->o.dram_register(t->o.register_opaque, base, len)) < 0)
      return rc;
    t->registered = true;
  }
  return 0;
}

/* DRAM's victims go to NVMe (when there is an NVMe tier: its slab classes
 * make room for themselves) through the admission gate. */
static int create_cascade(kvp_tier_store *t) {
  tier_cascade_opts co = {.with_policy = 1u << KVP_TIER_DRAM,
                          .gate = t->nv != NULL, .gate_opts = admit_opts(t)};
  co.policy[KVP_TIER_DRAM] = t->o.policy;
  co.cap[KVP_TIER_DRAM] = t->dram_cap;
  co.cap[KVP_TIER_NVME] = t->nv != NULL ? UINT64_MAX : 0;
  return kvp__tier_cascade_create(&co, &t->a, &t->cas);
}

int kvp_tier_create(const kvp_tier_opts *opts, const kvp_allocator *alloc,
                    kvp_tier_store **out) {
  kvp_tier_opts zero = {0};
  const kvp_tier_opts *o = opts ? opts : &zero;
  if (out == NULL || check_opts(o) < 0)
    return KVP_EINVAL;
  kvp_tier_store *t = kvp__calloc(alloc, 1, sizeof *t);
  if (t == NULL)
    return KVP_ENOMEM;
  t->a = kvp__allocator(alloc);
  t->o = *o;
  t->ev_epoch = epoch_next(); /* before recovery emits its first events */
  kvp__tier_table_init(&t->tbl, &t->a);
  t->qd_max = t->qd = o->queue_depth ? o->queue_depth : 32;
  pthread_mutex_init(&t->mu, NULL);
  pthread_mutex_init(&t->jmu, NULL);
  pthread_cond_init(&t->jcv, NULL);
  pthread_cond_init(&t->dcv, NULL);
  int rc = create_dram(t);
  if (rc == 0 && o->nvme_dir != NULL) {
    size_t n = strlen(o->nvme_dir) + 1;
    t->dir = kvp__malloc(&t->a, n);
    rc = t->dir == NULL ? KVP_ENOMEM : 0;
    if (rc == 0) {
      memcpy(t->dir, o->nvme_dir, n);
      rc = kvp__tier_nvme_open(&t->o, t->dir, t->qd_max, &t->a, nvme_found, t,
                               &t->nv);
    if (rc == 0)
      t->nvme_cap = kvp__tier_nvme_cap(t->nv);
    }
  }
  if (rc == 0)
    rc = create_cascade(t);
  t->o.nvme_dir = NULL; /* t->dir is the copy */
  if (rc < 0) {
    kvp_tier_destroy(t);
    return rc;
  }
  *out = t;
  return 0;
}

static void stop_worker(kvp_tier_store *t);

void kvp_tier_destroy(kvp_tier_store *t) {
  if (t == NULL)
    return;
  stop_worker(t);
  kvp__tier_nvme_close(t->nv);
  if (t->dram != NULL) {
    void *base;
    size_t len;
    kvp__tier_dram_region(t->dram, &base, &len);
    if (t->registered && t->o.dram_unregister != NULL)
      t->o.dram_unregister(t->o.register_opaque, base, len);
  }
  kvp__tier_dram_destroy(t->dram);
  if (t->host_claimed)
    kvp__tier_host_release(t->host_bytes);
  kvp__tier_cascade_destroy(t->cas);
  kvp__tier_table_fini(&t->tbl);
  assert(t->npinned == 0 && t->ndfree == 0);
  kvp__free(&t->a, t->dfree, t->dfree_cap * sizeof *t->dfree);
  kvp__free(&t->a, t->nss, t->nns * sizeof *t->nss);
  kvp__free(&t->a, t->dir, t->dir ? strlen(t->dir) + 1 : 0);
  pthread_mutex_destroy(&t->mu);
  pthread_mutex_destroy(&t->jmu);
  pthread_cond_destroy(&t->jcv);
  pthread_cond_destroy(&t->dcv);
  kvp_allocator a = t->a;
  kvp__free(&a, t, sizeof *t);
}

int kvp_tier_ns_add(kvp_tier_store *t, const kvp_namespace *ns,
                    const kvp_tier_ns_opts *o) {
  if (t == NULL || ns == NULL || (o && o->block_bytes > t->dram_region) ||
      (o && (!(o->prefill_kv_bytes_per_s >= 0) ||
             isinf(o->prefill_kv_bytes_per_s))))
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = 0;
  if (kvp__tier_ns_find(t, ns->seed) != NULL) {
    rc = KVP_EEXIST;
  } else {
    tier_ns *n = kvp__realloc(&t->a, t->nss, t->nns * sizeof *n,
                              (t->nns + 1) * sizeof *n);
    if (n == NULL) {
      rc = KVP_ENOMEM;
    } else {
      t->nss = n;
      n[t->nns] = (tier_ns){.seed = ns->seed,
                            .block_bytes = o ? o->block_bytes : 0,
                            .prefill_bps = o ? o->prefill_kv_bytes_per_s : 0};
      if (o && o->aes256_key) {
        n[t->nns].enc = true;
        memcpy(n[t->nns].key, o->aes256_key, 32);
      }
      t->nns++;
    }
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

/* ---- block calls -------------------------------------------------------------*/
/* A put of a key already stored (blocks are immutable: the same key is the
 * same block): its class may rise; durable writes it through.  1 or the
 * error. */
static int put_dup(kvp_tier_store *t, uint32_t id, const kvp_tier_put_opts *po,
                   bool durable) {
  int rc = 0;
  t->st.puts_dup++;
  tier_entry *e = &t->tbl.ents[id];
  if (po && po->cls > e->cls && (unsigned)po->cls < KVP_CLASS_COUNT_)
    e->cls = (uint8_t)po->cls;
  if (durable && e->nclass < 0) {
    if (e->dram == NULL)
      return KVP_ESTATE;
    nvme_write(t, &id, 1, true, &rc);
  } else if (durable) {
    rc = kvp__tier_nvme_sync(t->nv, t->qd);
  }
  return rc < 0 ? rc : 1;
}

/* put's checks before anything is stored: 0, or its error. */
static int put_check(const kvp_tier_store *t, kvp_key nsk, uint64_t len,
                     const kvp_tier_put_opts *po) {
  if (kvp__tier_ns_find(t, nsk) == NULL)
    return KVP_ENOENT;
  bool durable = po && (po->flags & KVP_TIER_PUT_DURABLE);
  if (len == 0)
    return KVP_ERANGE;
  return durable && t->nv == NULL ? KVP_EINVAL : 0;
}

static bool is_durable(const kvp_tier_put_opts *po) {
  return po != NULL && (po->flags & KVP_TIER_PUT_DURABLE);
}

/* A new entry for (nsk, key) of len bytes and po's class; TIER_NIL: out of
 * memory. */
static uint32_t entry_new(kvp_tier_store *t, kvp_key nsk, kvp_key key,
                          uint64_t len, const kvp_tier_put_opts *po) {
  admit_seen(t, nsk, key); /* recomputed after a reject? */
  uint32_t id = kvp__tier_table_new(&t->tbl, nsk, key);
  if (id == TIER_NIL)
    return id;
  tier_entry *e = &t->tbl.ents[id];
  e->len = len;
  e->cls = po && (unsigned)po->cls < KVP_CLASS_COUNT_ ? (uint8_t)po->cls : 0;
  return id;
}

static int put_one(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key,
                   const void *data, size_t len, const kvp_tier_put_opts *po) {
  int rc = put_check(t, ns->seed, len, po);
  if (rc == 0 && data == NULL)
    rc = KVP_EINVAL;
  if (rc < 0)
    return rc;
  t->st.puts++;
  uint32_t id = kvp__tier_table_find(&t->tbl, ns->seed, key);
  if (id != TIER_NIL)
    return put_dup(t, id, po, is_durable(po));
  if ((id = entry_new(t, ns->seed, key, len, po)) == TIER_NIL)
    return KVP_ENOMEM;
  if ((rc = dram_place(t, id, data)) < 0) {
    t->st.puts_rejected++;
    kvp__tier_table_gc(&t->tbl, id);
    return rc;
  }
  if (is_durable(po)) {
    nvme_write(t, &id, 1, true, &rc);
    if (rc < 0)
      return rc;
  }
  return 1;
}

/* ---- saves straight into DRAM (kvtier_internal.h) ----------------------------*/
void kvp__tier_reserve(kvp_tier_store *t, kvp_key ns, const kvp_key *keys,
                       size_t n, uint64_t len, const kvp_tier_put_opts *po,
                       tier_resv *r, int *res) {
  for (size_t i = 0; i < n; i++) {
    r[i].p = NULL;
    if ((res[i] = put_check(t, ns, len, po)) < 0)
      continue;
    uint32_t id = kvp__tier_table_find(&t->tbl, ns, keys[i]);
    if (id != TIER_NIL) {
      t->st.puts++;
      res[i] = put_dup(t, id, po, is_durable(po));
      continue;
    }
    r[i].p = dram_take(t, ns, len, &r[i].pool, &r[i].charge);
    if (r[i].p == NULL) {
      t->st.puts++;
      t->st.puts_rejected++;
      res[i] = KVP_ENOSPC;
    }
  }
}

void kvp__tier_cancel(kvp_tier_store *t, tier_resv *r, const int *res,
                      size_t n) {
  for (size_t i = 0; i < n; i++)
    if (res[i] == 0 && r[i].p != NULL) {
      dram_free(t, r[i].p, r[i].pool, r[i].charge);
      r[i].p = NULL;
    }
}

/* One reserved block becomes entry (ns, key): put's result. */
static int commit_one(kvp_tier_store *t, kvp_key ns, kvp_key key,
                      uint64_t len, const kvp_tier_put_opts *po,
                      tier_resv *r) {
  t->st.puts++;
  uint32_t id = kvp__tier_table_find(&t->tbl, ns, key);
  if (id != TIER_NIL) { /* another put of it committed meanwhile */
    dram_free(t, r->p, r->pool, r->charge);
    return put_dup(t, id, po, is_durable(po));
  }
  if ((id = entry_new(t, ns, key, len, po)) == TIER_NIL) {
    dram_free(t, r->p, r->pool, r->charge);
    return KVP_ENOMEM;
  }
  dram_attach(t, id, r->p, r->pool, r->charge);
  int rc = 0;
  if (is_durable(po))
    nvme_write(t, &id, 1, true, &rc);
  return rc < 0 ? rc : 1;
}

void kvp__tier_commit(kvp_tier_store *t, kvp_key ns, const kvp_key *keys,
                      size_t n, uint64_t len, const kvp_tier_put_opts *po,
                      tier_resv *r, int *res) {
  for (size_t i = 0; i < n; i++)
    if (res[i] == 0 && r[i].p != NULL) {
      res[i] = commit_one(t, ns, keys[i], len, po, &r[i]);
      r[i].p = NULL;
    }
}

int kvp_tier_put(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key,
                 const void *data, size_t len, const kvp_tier_put_opts *po) {
  if (t == NULL || ns == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = put_one(t, ns, key, data, len, po);
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_put_batch(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, const void *const *data,
                       const size_t *len, const kvp_tier_put_opts *po,
                       int *results) {
  if (t == NULL || ns == NULL || (n > 0 && (keys == NULL || data == NULL ||
                                            len == NULL || results == NULL)))
    return KVP_EINVAL;
  int ok = 0;
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < n; i++)
    ok += (results[i] = put_one(t, ns, keys[i], data[i], len[i], po)) > 0;
  pthread_mutex_unlock(&t->mu);
  return ok;
}

/* Reads the NVMe-only blocks collected by get_many, then promotes them
 * (a promotion may evict: an entry gone meanwhile is not promoted). */
static int nvme_flush(kvp_tier_store *t, const uint32_t *nv, void *const *nvd,
                      const size_t *nvi, size_t k, int *res) {
  int nres[256], hits = 0;
  kvp_key kk[256][2];
  for (size_t j = 0; j < k; j++) { /* which block each entry named */
    kk[j][0] = t->tbl.ents[nv[j]].ns;
    kk[j][1] = t->tbl.ents[nv[j]].key;
  }
  nvme_read(t, nv, k, nvd, nres); /* releases mu meanwhile */
  for (size_t j = 0; j < k; j++) {
    tier_entry *e = &t->tbl.ents[nv[j]];
    bool same = e->live && kvp_key_eq(e->ns, kk[j][0]) &&
                kvp_key_eq(e->key, kk[j][1]);
    res[nvi[j]] = nres[j];
    if (nres[j] < 0) {
      t->st.misses++;
      if (same)
        kvp__tier_table_gc(&t->tbl, nv[j]);
      continue;
    }
    t->st.hits[KVP_TIER_NVME]++;
    hits++;
    /* promote unless it was evicted (or re-put into DRAM) meanwhile */
    if (same && !t->o.no_promote && e->dram == NULL &&
        dram_place(t, nv[j], nvd[j]) == 0)
      t->st.promotions++;
  }
  return hits;
}

/* Gets: DRAM hits are copied at once; NVMe-only blocks are read in one
 * batch, then promoted. */
static int get_many(kvp_tier_store *t, kvp_key seed, const kvp_key *keys,
                    size_t n, void *const *dst, const size_t *cap, size_t *len,
                    int *res) {
  uint32_t nv[256];
  void *nvd[256];
  size_t nvi[256], k = 0;
  int hits = 0;
  bool ns_ok = kvp__tier_ns_find(t, seed) != NULL;
  for (size_t i = 0; i < n; i++) {
    uint32_t id = ns_ok ? kvp__tier_table_find(&t->tbl, seed, keys[i]) : TIER_NIL;
    if (id == TIER_NIL) {
      res[i] = KVP_ENOENT;
      t->st.misses++;
      if (ns_ok)
        admit_seen(t, seed, keys[i]);
      continue;
    }
    tier_entry *e = &t->tbl.ents[id];
    len[i] = e->len;
    if (cap[i] < e->len) {
      res[i] = KVP_ERANGE;
      continue;
    }
    e->hits++;
    if (e->dram != NULL) {
      uint64_t t0 = kvp_now_ns();
      memcpy(dst[i], e->dram, e->len);
      bw_note(t, KVP_TIER_DRAM, e->len, kvp_now_ns() - t0);
      kvp__tier_policy_touch(dram_policy(t), id);
      res[i] = KVP_TIER_DRAM;
      t->st.hits[KVP_TIER_DRAM]++;
      hits++;
      continue;
    }
    kvp__tier_nvme_touch(t->nv, e->nclass, id);
    nv[k] = id;
    nvd[k] = dst[i];
    nvi[k++] = i;
    if (k == 256) {
      hits += nvme_flush(t, nv, nvd, nvi, k, res);
      k = 0;
    }
  }
  if (k > 0)
    hits += nvme_flush(t, nv, nvd, nvi, k, res);
  return hits;
}

int kvp_tier_get_batch(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, void *const *dst,
                       const size_t *cap, size_t *len, int *results) {
  if (t == NULL || ns == NULL || (n > 0 && (keys == NULL || dst == NULL ||
                                            cap == NULL || len == NULL ||
                                            results == NULL)))
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = get_many(t, ns->seed, keys, n, dst, cap, len, results);
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_get(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key,
                 void *dst, size_t cap, size_t *len) {
  size_t l = 0;
  int res;
  if (dst == NULL && cap > 0)
    return KVP_EINVAL;
  int rc = kvp_tier_get_batch(t, ns, &key, 1, &dst, &cap, &l, &res);
  if (len != NULL)
    *len = l;
  return rc < 0 ? rc : res;
}

int kvp_tier_contains(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key) {
  if (t == NULL || ns == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  uint32_t id = kvp__tier_table_find(&t->tbl, ns->seed, key);
  int rc = id == TIER_NIL ? KVP_ENOENT
           : t->tbl.ents[id].dram != NULL ? KVP_TIER_DRAM : KVP_TIER_NVME;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_evict(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key) {
  if (t == NULL || ns == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  uint32_t id = kvp__tier_table_find(&t->tbl, ns->seed, key);
  if (id != TIER_NIL) {
    tier_entry *e = &t->tbl.ents[id];
    if (e->dram != NULL) {
      kvp__tier_policy_remove(dram_policy(t), id, 0);
      dram_release(t, id);
    }
    nvme_drop(t, id, true, false);
    kvp__tier_table_gc(&t->tbl, id);
  }
  pthread_mutex_unlock(&t->mu);
  return id != TIER_NIL;
}

int kvp_tier_sync(kvp_tier_store *t) {
  if (t == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = t->nv ? kvp__tier_nvme_sync(t->nv, t->qd) : 0;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_register_buffers(kvp_tier_store *t, const struct iovec *iov,
                              unsigned n) {
  if (t == NULL || (iov == NULL && n > 0))
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  int rc = t->nv ? kvp__tier_nvme_register(t->nv, iov, n) : 0; /* mu -> rmu */
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_unregister_buffers(kvp_tier_store *t) {
  int rc = kvp_tier_register_buffers(t, NULL, 0);
  return rc < 0 ? rc : 0;
}

int kvp_tier_idle(kvp_tier_store *t, uint64_t budget) {
  if (t == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  uint32_t ids[256];
  size_t n = 0;
  int res[256], wrote = 0;
  /* coldest first: walk entries in victim order without evicting is not
   * what the policy offers, so take DRAM blocks not on NVMe, least stable
   * class first, as the policy would */
  for (int c = 0; c < KVP_CLASS_COUNT_ && budget > 0; c++)
    for (uint32_t i = 0; i < t->tbl.n && n < 256 && budget > 0; i++) {
      tier_entry *e = &t->tbl.ents[i];
      if (e->live && e->cls == c && e->dram && e->nclass < 0 && nvme_admits(t, e)) {
        ids[n++] = i;
        budget = e->len >= budget ? 0 : budget - e->len;
      }
    }
  if (n > 0)
    nvme_write(t, ids, n, false, res);
  for (size_t i = 0; i < n; i++)
    if (res[i] == 0) {
      wrote++;
      t->st.admit_accepted[t->tbl.ents[ids[i]].cls]++;
    }
  pthread_mutex_unlock(&t->mu);
  return wrote;
}

/* ---- options -----------------------------------------------------------------*/
int kvp_tier_opt_bounds(kvp_tier_store *t, kvp_tier_opt opt, int64_t *lo,
                        int64_t *hi) {
  if (lo == NULL || hi == NULL)
    return KVP_EINVAL;
  /* t NULL: before a store exists, what kvp_tier_create accepts */
  switch (opt) {
  case KVP_TIER_OPT_DRAM_BYTES:
    *lo = 0;
    *hi = t ? (int64_t)t->dram_region : INT64_MAX;
    break;
  case KVP_TIER_OPT_NVME_BYTES: *lo = 0; *hi = INT64_MAX; break;
  case KVP_TIER_OPT_POLICY: *lo = 0; *hi = KVP_TIER_POLICY_COUNT_ - 1; break;
  case KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS: *lo = 0; *hi = 1 << 20; break;
  case KVP_TIER_OPT_PROMOTE: *lo = 0; *hi = 1; break;
  case KVP_TIER_OPT_QUEUE_DEPTH: *lo = 1; *hi = t ? t->qd_max : 1024; break;
  case KVP_TIER_OPT_ADMISSION: *lo = 0; *hi = KVP_TIER_ADMIT_COUNT_ - 1; break;
  case KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI: *lo = 1; *hi = 1000000; break;
  case KVP_TIER_OPT_PREFILL_KV_BPS: *lo = 0; *hi = INT64_MAX; break;
  case KVP_TIER_OPT_ADMIT_MIN_SAMPLES: *lo = 1; *hi = 512; break;
  case KVP_TIER_OPT_READ_UNLOCKED: *lo = 0; *hi = 1; break;
  case KVP_TIER_OPT_STAGE_AHEAD: *lo = 0; *hi = 1; break;
  case KVP_TIER_OPT_LOAD_UNLOCKED: *lo = 0; *hi = 1; break;
  default: return KVP_EINVAL;
  }
  return 0;
}

static int set_policy(kvp_tier_store *t, kvp_tier_policy_kind k) {
  tier_policy *np;
  int rc = kvp__tier_policy_create(k, &t->a, &np);
  if (rc < 0)
    return rc;
  for (uint32_t i = 0; i < t->tbl.n; i++) {
    tier_entry *e = &t->tbl.ents[i];
    if (e->live && e->dram)
      kvp__tier_policy_insert(np, i, e->key.lo ^ e->ns.lo, e->dram_charge, e->cls);
  }
  kvp__tier_cascade_set_policy(t->cas, KVP_TIER_DRAM, np);
  t->o.policy = k;
  return t->nv ? kvp__tier_nvme_set_policy(t->nv, k, owner_info, t) : 0;
}

int kvp_tier_set(kvp_tier_store *t, kvp_tier_opt opt, int64_t v) {
  int64_t lo, hi;
  int rc = kvp_tier_opt_bounds(t, opt, &lo, &hi);
  if (rc < 0)
    return rc;
  if (v < lo || v > hi)
    return KVP_ERANGE;
  pthread_mutex_lock(&t->mu);
  kvp_tier_admission was = t->o.admission;
  switch (opt) {
  case KVP_TIER_OPT_DRAM_BYTES:
    t->dram_cap = (uint64_t)v;
    kvp__tier_cascade_set_cap(t->cas, KVP_TIER_DRAM, t->dram_cap);
    while (t->dram_used > t->dram_cap && dram_evict(t, 0, false)) {
    }
    break;
  case KVP_TIER_OPT_NVME_BYTES:
    t->nvme_cap = (uint64_t)v;
    if (t->nv != NULL)
      kvp__tier_nvme_set_cap(t->nv, t->nvme_cap);
    break;
  case KVP_TIER_OPT_POLICY:
    if ((kvp_tier_policy_kind)v != t->o.policy)
      rc = set_policy(t, (kvp_tier_policy_kind)v);
    break;
  case KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS:
    t->o.volatile_nvme_min_hits = (uint32_t)v;
    break;
  case KVP_TIER_OPT_PROMOTE: t->o.no_promote = v ? 0 : 1; break;
  case KVP_TIER_OPT_QUEUE_DEPTH: t->qd = (uint32_t)v; break;
  case KVP_TIER_OPT_ADMISSION: t->o.admission = (kvp_tier_admission)v; break;
  case KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI:
    t->o.admit_write_weight = (double)v / 1000;
    break;
  case KVP_TIER_OPT_PREFILL_KV_BPS: t->o.prefill_kv_bytes_per_s = (double)v; break;
  case KVP_TIER_OPT_ADMIT_MIN_SAMPLES: t->o.admit_min_samples = (uint32_t)v; break;
  case KVP_TIER_OPT_READ_UNLOCKED: t->reads_locked = v == 0; break;
  case KVP_TIER_OPT_STAGE_AHEAD: t->no_stage_ahead = v == 0; break;
  case KVP_TIER_OPT_LOAD_UNLOCKED: t->scatter_locked = v == 0; break;
  }
  /* admit_sync fails only for the gate's ghosts, wanted by an admission
   * leaving all (KVP_ENOMEM): the store then stays on the old one */
  if (rc == 0 && (rc = admit_sync(t)) < 0)
    t->o.admission = was;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvp_tier_opt_get(kvp_tier_store *t, kvp_tier_opt opt, int64_t *v) {
  int64_t lo, hi;
  int rc = kvp_tier_opt_bounds(t, opt, &lo, &hi);
  if (rc < 0 || v == NULL)
    return rc < 0 ? rc : KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  switch (opt) {
  case KVP_TIER_OPT_DRAM_BYTES: *v = (int64_t)t->dram_cap; break;
  case KVP_TIER_OPT_NVME_BYTES: *v = (int64_t)t->nvme_cap; break;
  case KVP_TIER_OPT_POLICY: *v = t->o.policy; break;
  case KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS: *v = t->o.volatile_nvme_min_hits; break;
  case KVP_TIER_OPT_PROMOTE: *v = !t->o.no_promote; break;
  case KVP_TIER_OPT_QUEUE_DEPTH: *v = t->qd; break;
  case KVP_TIER_OPT_ADMISSION: *v = t->o.admission; break;
  case KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI:
    *v = t->o.admit_write_weight > 0
             ? (int64_t)(t->o.admit_write_weight * 1000 + 0.5)
             : 1000;
    break;
  case KVP_TIER_OPT_PREFILL_KV_BPS:
    *v = (int64_t)t->o.prefill_kv_bytes_per_s;
    break;
  case KVP_TIER_OPT_ADMIT_MIN_SAMPLES:
    *v = t->o.admit_min_samples ? t->o.admit_min_samples : 32;
    break;
  case KVP_TIER_OPT_READ_UNLOCKED: *v = !t->reads_locked; break;
  case KVP_TIER_OPT_STAGE_AHEAD: *v = !t->no_stage_ahead; break;
  case KVP_TIER_OPT_LOAD_UNLOCKED: *v = !t->scatter_locked; break;
  }
  pthread_mutex_unlock(&t->mu);
  return 0;
}

/* ---- observability ----------------------------------------------------------*/
int kvp_tier_stats_get(kvp_tier_store *t, kvp_tier_stats *out) {
  if (t == NULL || out == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&t->mu);
  *out = t->st;
  out->dram_used_bytes = t->dram_used;
  out->dram_bytes = t->dram_cap;
  out->dram_slot_bytes = kvp__tier_dram_slot_bytes(t->dram);
  if (t->nv != NULL) /* mu -> rmu */
    kvp__tier_nvme_stats(t->nv, out);
  out->huge_pages = kvp__tier_dram_huge(t->dram);
  pthread_mutex_unlock(&t->mu);
  return 0;
}

uint64_t kvp_tier_epoch(const kvp_tier_store *t) {
  return t != NULL ? t->ev_epoch : 0; /* set before the store is returned */
}

/* Entry e's tiers to fn, DRAM first. */
static int resident_each(const tier_entry *e, kvp_tier_resident_fn fn,
                         void *opaque) {
  kvp_tier_resident r = {.ns = e->ns, .key = e->key, .bytes = e->len};
  int rc = 0;
  if (e->dram != NULL) {
    r.tier = KVP_TIER_DRAM;
    rc = fn(opaque, &r);
  }
  if (rc == 0 && e->nclass >= 0) {
    r.tier = KVP_TIER_NVME;
    rc = fn(opaque, &r);
  }
  return rc;
}

/* Under mu, which every event is emitted under: the listing and *seq are
 * one state.  A batch's NVMe reads run without mu, but change no entry's
 * tiers until they retake it. */
int kvp_tier_keys_each(kvp_tier_store *t, kvp_tier_resident_fn fn,
                       void *opaque, uint64_t *seq) {
  if (t == NULL || fn == NULL)
    return KVP_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&t->mu);
  for (uint32_t i = 0; rc == 0 && i < t->tbl.n; i++)
    if (t->tbl.ents[i].live)
      rc = resident_each(&t->tbl.ents[i], fn, opaque);
  if (seq != NULL)
    *seq = t->seq;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

double kvp_tier_bandwidth(kvp_tier_store *t, kvp_tier tier) {
  if (t == NULL || (unsigned)tier >= KVP_TIER_COUNT_)
    return 0;
  pthread_mutex_lock(&t->mu);
  double v = t->bw[tier];
  pthread_mutex_unlock(&t->mu);
  return v;
}

int kvp_tier_dram_region(kvp_tier_store *t, void **base, size_t *len) {
  if (t == NULL || base == NULL || len == NULL)
    return KVP_EINVAL;
  kvp__tier_dram_region(t->dram, base, len);
  return 0;
}

/* ---- asynchronous calls: one worker thread per store --------------------------*/
enum { JOB_GET, JOB_PUT, JOB_PREFETCH };

struct tier_job { /* == kvp_ticket */
  tier_job *next;
  kvp_tier_store *t;
  int kind;
  kvp_namespace ns;
  const kvp_key *keys;
  size_t n;
  void *const *dst;
  const void *const *data;
  const size_t *cap;
  size_t *len;
  const size_t *clen;
  int *results;
  kvp_tier_put_opts po;
  bool has_po, detached;
  int done; /* under jmu */
  int result;
};

static int run_prefetch(kvp_tier_store *t, tier_job *j) {
  int got = 0;
  for (size_t i = 0; i < j->n; i++) {
    pthread_mutex_lock(&t->mu);
    uint32_t id = kvp__tier_table_find(&t->tbl, j->ns.seed, j->keys[i]);
    bool want = id != TIER_NIL && t->tbl.ents[id].dram == NULL &&
                t->tbl.ents[id].nclass >= 0 && !t->o.no_promote;
    if (want) { /* read through get_many, which promotes */
      size_t len = t->tbl.ents[id].len, l;
      void *buf = kvp__malloc(&t->a, len);
      int r;
      if (buf != NULL) {
        got += get_many(t, j->ns.seed, &j->keys[i], 1, &buf, &len, &l, &r) > 0;
        kvp__free(&t->a, buf, len);
      }
    }
    pthread_mutex_unlock(&t->mu);
  }
  return got;
}

static void *worker(void *arg) {
  kvp_tier_store *t = arg;
  pthread_mutex_lock(&t->jmu);
  for (;;) {
    while (t->jhead == NULL && !t->stop)
      pthread_cond_wait(&t->jcv, &t->jmu);
    if (t->jhead == NULL)
      break;
    tier_job *j = t->jhead;
    t->jhead = j->next;
    if (t->jhead == NULL)
      t->jtail = NULL;
    pthread_mutex_unlock(&t->jmu);
    int r;
    if (j->kind == JOB_GET)
      r = kvp_tier_get_batch(t, &j->ns, j->keys, j->n, j->dst, j->cap, j->len,
                             j->results);
    else if (j->kind == JOB_PUT)
      r = kvp_tier_put_batch(t, &j->ns, j->keys, j->n, j->data, j->clen,
                             j->has_po ? &j->po : NULL, j->results);
    else
      r = run_prefetch(t, j);
    pthread_mutex_lock(&t->jmu);
    if (j->detached) {
      kvp__free(&t->a, j, sizeof *j);
      continue;
    }
    j->result = r;
    j->done = 1;
    pthread_cond_broadcast(&t->dcv);
  }
  pthread_mutex_unlock(&t->jmu);
  return NULL;
}

static void stop_worker(kvp_tier_store *t) {
  pthread_mutex_lock(&t->jmu);
  bool on = t->thr_on;
  t->stop = true;
  pthread_cond_broadcast(&t->jcv);
  pthread_mutex_unlock(&t->jmu);
  if (on)
    pthread_join(t->thr, NULL); /* drains the queue first */
}

static int submit(kvp_tier_store *t, tier_job *j, kvp_ticket **ticket) {
  pthread_mutex_lock(&t->jmu);
  int rc = 0;
  if (t->stop) {
    rc = KVP_ESTATE;
  } else if (!t->thr_on) {
    rc = pthread_create(&t->thr, NULL, worker, t) == 0 ? 0 : KVP_ENOMEM;
    t->thr_on = rc == 0;
  }
  if (rc == 0) {
    j->detached = ticket == NULL;
    if (t->jtail)
      t->jtail->next = j;
    else
      t->jhead = j;
    t->jtail = j;
    pthread_cond_signal(&t->jcv);
  }
  pthread_mutex_unlock(&t->jmu);
  if (rc < 0)
    kvp__free(&t->a, j, sizeof *j);
  else if (ticket != NULL)
    *ticket = (kvp_ticket *)j;
  return rc;
}

static tier_job *job_new(kvp_tier_store *t, int kind, const kvp_namespace *ns,
                         const kvp_key *keys, size_t n) {
  tier_job *j = kvp__calloc(&t->a, 1, sizeof *j);
  if (j != NULL)
    *j = (tier_job){.t = t, .kind = kind, .ns = *ns, .keys = keys, .n = n};
  return j;
}

int kvp_tier_get_async(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, void *const *dst,
                       const size_t *cap, size_t *len, int *results,
                       kvp_ticket **ticket) {
  if (t == NULL || ns == NULL || ticket == NULL ||
      (n > 0 && (!keys || !dst || !cap || !len || !results)))
    return KVP_EINVAL;
  tier_job *j = job_new(t, JOB_GET, ns, keys, n);
  if (j == NULL)
    return KVP_ENOMEM;
  j->dst = dst, j->cap = cap, j->len = len, j->results = results;
  return submit(t, j, ticket);
}

int kvp_tier_put_async(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, const void *const *data,
                       const size_t *len, const kvp_tier_put_opts *po,
                       int *results, kvp_ticket **ticket) {
  if (t == NULL || ns == NULL || ticket == NULL ||
      (n > 0 && (!keys || !data || !len || !results)))
    return KVP_EINVAL;
  tier_job *j = job_new(t, JOB_PUT, ns, keys, n);
  if (j == NULL)
    return KVP_ENOMEM;
  j->data = data, j->clen = len, j->results = results;
  if (po != NULL) {
    j->po = *po;
    j->has_po = true;
  }
  return submit(t, j, ticket);
}

int kvp_tier_prefetch(kvp_tier_store *t, const kvp_namespace *ns,
                      const kvp_key *keys, size_t n, kvp_ticket **ticket) {
  if (t == NULL || ns == NULL || (n > 0 && keys == NULL))
    return KVP_EINVAL;
  tier_job *j = job_new(t, JOB_PREFETCH, ns, keys, n);
  if (j == NULL)
    return KVP_ENOMEM;
  return submit(t, j, ticket);
}

int kvp_ticket_poll(kvp_ticket *k) {
  tier_job *j = (tier_job *)k;
  if (j == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&j->t->jmu);
  int r = j->done ? j->result : KVP_EBUSY;
  pthread_mutex_unlock(&j->t->jmu);
  return r;
}

int kvp_ticket_wait(kvp_ticket *k, uint64_t timeout_ns) {
  tier_job *j = (tier_job *)k;
  if (j == NULL)
    return KVP_EINVAL;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  uint64_t ns = (uint64_t)dl.tv_nsec + timeout_ns;
  dl.tv_sec += (time_t)(ns / 1000000000u);
  dl.tv_nsec = (long)(ns % 1000000000u);
  pthread_mutex_lock(&j->t->jmu);
  int rc = 0;
  while (!j->done && rc != ETIMEDOUT)
    rc = timeout_ns ? pthread_cond_timedwait(&j->t->dcv, &j->t->jmu, &dl)
                    : pthread_cond_wait(&j->t->dcv, &j->t->jmu);
  int r = j->done ? j->result : KVP_EBUSY;
  pthread_mutex_unlock(&j->t->jmu);
  return r;
}

void kvp_ticket_free(kvp_ticket *k) {
  tier_job *j = (tier_job *)k;
  if (j == NULL)
    return;
  kvp_ticket_wait(k, 0);
  kvp__free(&j->t->a, j, sizeof *j);
}
