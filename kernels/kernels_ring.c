/* SPDX-License-Identifier: Apache-2.0 */
/* The GPU backends' launch-argument ring and copy-engine runs
 * (kernels_ring.h). */
#include "kernels_ring.h"

#include <string.h>

int kvp__ring_take(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                   size_t need, unsigned *i) {
  unsigned k = r->next;
  kvp__ring_slot *s = &r->slot[k];
  r->next = (k + 1) % KVP__RING;
  int rc;
  if (s->pending && (rc = o->wait(d, k)) < 0)
    return rc;
  if (o->reuse)
    o->reuse(d, k);
  if (s->cap < need) {
    size_t cap = need < 4096 ? 4096 : need + need / 2;
    if (s->host)
      o->host_free(d, s->host), s->host = NULL;
    s->cap = 0;
    if ((rc = o->host_alloc(d, cap * sizeof(uint32_t), &s->host, &s->dev)) < 0)
      return rc;
    s->cap = cap;
  }
  *i = k;
  return 0;
}

int kvp__ring_args_take(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                        size_t entries, uint32_t **host, void **slot) {
  unsigned i;
  int rc = kvp__ring_take(d, r, o, entries, &i);
  if (rc < 0)
    return rc;
  *host = r->slot[i].host;
  *slot = &r->slot[i];
  return 0;
}

int kvp__ring_plan_slot(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                        const kvp__plan *p, unsigned *i) {
  if (p->arg_slot != NULL) {
    *i = (unsigned)((const kvp__ring_slot *)p->arg_slot - r->slot);
    return 0;
  }
  int rc = kvp__ring_take(d, r, o, p->slots ? 2 * (size_t)p->n : p->n, i);
  if (rc < 0)
    return rc;
  uint32_t *h = r->slot[*i].host;
  memcpy(h, p->ids, p->n * sizeof(uint32_t));
  if (p->slots)
    memcpy(h + p->n, p->slots, p->n * sizeof(uint32_t));
  return 0;
}

void kvp__ring_free(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                    bool wait) {
  for (unsigned i = 0; i < KVP__RING; i++) {
    kvp__ring_slot *s = &r->slot[i];
    if (wait && s->pending)
      o->wait(d, i);
    if (s->host)
      o->host_free(d, s->host);
    s->host = NULL;
    s->cap = 0;
  }
}

int kvp__copy_runs(kvp_device *d, const kvp__plan *p, void *stream,
                   kvp__copy2d_fn copy) {
  const kvp_kv_layout_info *in = &p->layout->info;
  const uint64_t sp = (uint64_t)in->n_chunks * in->chunk_bytes; /* staging pitch */
  for (uint32_t i = 0; i < p->n;) {
    uint32_t j = i + 1;
    uint64_t si = p->slots ? p->slots[i] : i;
    while (j < p->n && p->ids[j] == p->ids[i] + (j - i) &&
           (p->slots ? p->slots[j] : j) == si + (j - i))
      j++;
    for (uint32_t c = 0; c < in->n_chunks; c++) {
      uint64_t paged = p->layout->chunk_base[c] + p->ids[i] * in->block_stride;
      uint64_t stage = p->staging + (si * in->n_chunks + c) * in->chunk_bytes;
      uint64_t src = p->scatter ? stage : paged, dst = p->scatter ? paged : stage;
      uint64_t spitch = p->scatter ? sp : in->block_stride;
      uint64_t dpitch = p->scatter ? in->block_stride : sp;
      int rc = copy(d, stream, dst, dpitch, src, spitch, in->chunk_bytes, j - i);
      if (rc < 0)
        return rc;
    }
    i = j;
  }
  return 0;
}
