/* SPDX-License-Identifier: Apache-2.0 */
/* One source's decoded batches -> its kvp_index stream: media to tiers, the
 * full-attention group only, engine hashes or kvplane keys (re-keyed from the
 * events' token ids), one index sequence number per index call. */
#include <string.h>

#include "events_internal.h"

#include <time.h>

int kvp__ev_apply_init(ev_apply *a, kvp_index *ix, const kvp_allocator *alloc,
                       const kvp_events_source *s, ev_counters *ctr) {
  memset(a, 0, sizeof *a);
  a->ix = ix;
  a->alloc = alloc;
  a->ctr = ctr;
  a->keying = s->keying;
  a->src = (kvp_index_src){.worker = s->worker, .stream = s->stream,
                           .epoch = kvp_now_ns()};
  kvp__rk_init(&a->map, s->rekey_capacity ? s->rekey_capacity : 1u << 22);
  if (s->ns == NULL)
    return 0;
  int rc = kvp_hasher_create(s->ns, &s->hasher, alloc, &a->hasher);
  if (rc < 0)
    return rc;
  a->block_size = kvp_hasher_block_size(a->hasher);
  a->digest_len = (uint8_t)kvp_hash_algo_digest_len(kvp_hasher_algo(a->hasher));
  return 0;
}

void kvp__ev_apply_fini(ev_apply *a) {
  kvp_hasher_destroy(a->hasher);
  kvp__rk_free(a->alloc, &a->map);
  kvp__ev_free(a->alloc, a->keys, a->keys_cap * sizeof *a->keys);
  memset(a, 0, sizeof *a);
}

static void map_stats(ev_apply *a) {
  ev_set(&a->ctr->rekey_entries, a->map.used);
  ev_set(&a->ctr->rekey_bytes, kvp__rk_bytes(&a->map));
}

static int index_rc(ev_apply *a, int rc) {
  if (rc < 0)
    ev_add(&a->ctr->index_errors, 1);
  return rc < 0 ? rc : 0;
}

void kvp__ev_apply_drop(ev_apply *a) {
  a->src.seq++;
  (void)index_rc(a, kvp_index_src_cleared(a->ix, &a->src));
  kvp__rk_clear(a->alloc, &a->map);
  ev_add(&a->ctr->residency_drops, 1);
  map_stats(a);
}

void kvp__ev_apply_new_epoch(ev_apply *a) {
  /* the first call of the new epoch drops the old epoch's residency */
  a->src.epoch++;
  a->src.seq = 1;
  (void)index_rc(a, kvp_index_src_cleared(a->ix, &a->src));
  kvp__rk_clear(a->alloc, &a->map);
  map_stats(a);
}

/* vLLM's KVCacheSpecKind values that are full attention (prefix-closed). */
static bool full_kind(const char *k) {
  return strcmp(k, "full_attention") == 0 ||
         strcmp(k, "mla_attention") == 0 ||
         strcmp(k, "sink_full_attention") == 0;
}

/* Learns groups from the kinds stored events publish; without any, group 0
 * (or no group) is taken as the full-attention one. */
static bool group_indexed(ev_apply *a, const kvp_kv_event *e) {
  if (e->group_idx < 0)
    return true;
  uint64_t bit = e->group_idx < 64 ? 1ull << e->group_idx : 0;
  if (e->spec_kind != NULL) {
    bool full = full_kind(e->spec_kind);
    if (full)
      a->full_groups |= bit;
    else
      a->other_groups |= bit;
    return full;
  }
  if (bit & a->full_groups)
    return true;
  if (bit & a->other_groups)
    return false;
  return e->group_idx == 0 && a->full_groups == 0;
}

static int keys_room(ev_apply *a, size_t n) {
  return kvp__ev_grow(a->alloc, (void **)&a->keys, &a->keys_cap, n,
                      sizeof *a->keys);
}

static void key_bytes(kvp_key k, uint8_t out[16]) {
  for (int i = 0; i < 8; i++) {
    out[i] = (uint8_t)(k.hi >> (56 - 8 * i));
    out[8 + i] = (uint8_t)(k.lo >> (56 - 8 * i));
  }
}

/* Re-keys the event's blocks with kvplane's chain; returns how many of them
 * (a prefix) got a key, and the parent's key in *parent (NULL: root). */
static size_t rekey(ev_apply *a, const kvp_kv_event *e, kvp_key *parent_out,
                    bool *has_parent) {
  size_t n = e->n_hashes, bs = a->block_size;
  uint8_t pd[16];
  const uint8_t *parent = NULL;
  *has_parent = false;
  if (e->parent != NULL) {
    rk_slot *ps = kvp__rk_find(&a->map, e->parent->u64);
    if (ps == NULL) {
      ev_add(&a->ctr->rekey_orphans, n);
      return 0;
    }
    *parent_out = ps->key;
    *has_parent = true;
    key_bytes(ps->key, pd);
    parent = pd;
  }
  if (e->n_tokens != n * bs) {
    ev_add(&a->ctr->rekey_orphans, n); /* no tokens to key them by */
    return 0;
  }
  kvp__rk_prefetch(&a->map, e->hashes, n);
  for (size_t i = 0; i < n; i++) {
    kvp_key k;
    int rc = kvp_hasher_block(a->hasher, parent, a->digest_len,
                              e->tokens + i * bs,
                              e->extras ? &e->extras[i] : NULL, NULL, 0, &k);
    int err = 0;
    rk_slot *s = rc < 0 ? NULL : kvp__rk_upsert(a->alloc, &a->map,
                                                e->hashes[i].u64, &err);
    if (s == NULL) {
      ev_add(rc < 0 ? &a->ctr->rekey_orphans : &a->ctr->rekey_full, n - i);
      return i;
    }
    s->key = k;
    s->tiers |= (uint8_t)(1u << e->tier);
    a->keys[i] = k;
    key_bytes(k, pd);
    parent = pd;
  }
  return n;
}

static int apply_stored(ev_apply *a, const kvp_kv_event *e) {
  if (a->block_size != 0 && e->block_size != a->block_size) {
    ev_add(&a->ctr->block_size_mismatch, 1);
    return 0;
  }
  int rc = keys_room(a, e->n_hashes);
  if (rc < 0)
    return rc;
  kvp_key parent = {0};
  bool has_parent = e->parent != NULL;
  size_t n = e->n_hashes;
  if (a->keying == KVP_EVENTS_REKEY) {
    n = rekey(a, e, &parent, &has_parent);
    map_stats(a);
  } else {
    for (size_t i = 0; i < n; i++)
      a->keys[i] = (kvp_key){0, e->hashes[i].u64};
    if (has_parent)
      parent = (kvp_key){0, e->parent->u64};
  }
  if (n == 0)
    return 0;
  a->src.seq++;
  rc = kvp_index_src_stored(a->ix, &a->src, e->tier,
                            has_parent ? &parent : NULL, a->keys, n);
  ev_add(&a->ctr->blocks_stored, n);
  return index_rc(a, rc);
}

static int apply_removed(ev_apply *a, const kvp_kv_event *e) {
  int rc = keys_room(a, e->n_hashes);
  if (rc < 0)
    return rc;
  size_t n = 0;
  if (a->keying == KVP_EVENTS_REKEY)
    kvp__rk_prefetch(&a->map, e->hashes, e->n_hashes);
  for (size_t i = 0; i < e->n_hashes; i++) {
    if (a->keying == KVP_EVENTS_ENGINE_HASH) {
      a->keys[n++] = (kvp_key){0, e->hashes[i].u64};
      continue;
    }
    rk_slot *s = kvp__rk_find(&a->map, e->hashes[i].u64);
    if (s == NULL)
      continue; /* never indexed: nothing to remove */
    a->keys[n++] = s->key;
    s->tiers &= (uint8_t)~(1u << e->tier);
    if (s->tiers == 0)
      kvp__rk_erase(&a->map, s);
  }
  map_stats(a);
  ev_add(&a->ctr->blocks_removed, e->n_hashes);
  if (n == 0)
    return 0;
  a->src.seq++;
  return index_rc(a, kvp_index_src_removed(a->ix, &a->src, e->tier, a->keys,
                                           n));
}

static int apply_event(ev_apply *a, const kvp_kv_event *e) {
  ev_add(&a->ctr->unknown_fields, e->unknown_fields);
  if (e->type == KVP_KV_ALL_CLEARED) {
    a->src.seq++;
    ev_add(&a->ctr->clears, 1);
    kvp__rk_clear(a->alloc, &a->map);
    map_stats(a);
    return index_rc(a, kvp_index_src_cleared(a->ix, &a->src));
  }
  if (e->tier >= KVP_TIER_COUNT_) {
    ev_add(&a->ctr->unknown_media, 1);
    return 0;
  }
  if (!group_indexed(a, e)) {
    ev_add(&a->ctr->other_groups, 1);
    return 0;
  }
  return e->type == KVP_KV_BLOCK_STORED ? apply_stored(a, e)
                                        : apply_removed(a, e);
}

int kvp__ev_apply_batch(ev_apply *a, const kvp_kv_batch *b) {
  int first = 0;
  for (size_t i = 0; i < b->n_events; i++) {
    int rc = apply_event(a, &b->events[i]);
    if (rc < 0 && first == 0)
      first = rc;
  }
  ev_add(&a->ctr->events, b->n_events);
  ev_add(&a->ctr->unknown_events, b->unknown_events);
  ev_add(&a->ctr->batches, 1);
  /* the lag of what is delivered, fixed at delivery: it must not grow
   * while the worker is idle (that is idle time, kept apart) */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  union {
    double d;
    uint64_t u;
  } at = {.d = (double)now.tv_sec + (double)now.tv_nsec * 1e-9}, lag;
  lag.d = at.d - b->ts;
  ev_set(&a->ctr->last_lag_bits, lag.u);
  ev_set(&a->ctr->last_applied_bits, at.u);
  return first;
}
