/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU reference backend: the correctness oracle for the GPU backends and
 * the fallback everywhere.  Every operation completes before it returns;
 * streams and events are tokens.  Gather/scatter is one memcpy per chunk,
 * written for obviousness, not speed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

static int cpu_open(kvp_device *d, const kvp_device_opts *o) {
  (void)o;
  snprintf(d->name, sizeof d->name, "cpu (reference)");
  return 0;
}
static void cpu_close(kvp_device *d) { (void)d; }

static int cpu_alloc(kvp_device *d, size_t bytes, uint64_t *out) {
  (void)d;
  void *p = NULL;
  if (posix_memalign(&p, 64, bytes))
    return KVP_ENOMEM;
  *out = (uint64_t)(uintptr_t)p;
  return 0;
}
static void cpu_free(kvp_device *d, uint64_t p) {
  (void)d;
  free((void *)(uintptr_t)p);
}
static int cpu_host_register(kvp_device *d, void *p, size_t n, uint64_t *dp) {
  (void)d, (void)n;
  *dp = (uint64_t)(uintptr_t)p;
  return 0;
}
static int cpu_host_unregister(kvp_device *d, void *p) {
  (void)d, (void)p;
  return 0;
}
/* Host pointers cannot be range-checked: the caller vouches for them. */
static int cpu_check_range(kvp_device *d, uint64_t a, uint64_t n) {
  (void)d, (void)n;
  return a ? 0 : KVP_EINVAL;
}
static int cpu_memcpy(kvp_device *d, void *dst, const void *src, size_t n) {
  (void)d;
  memmove(dst, src, n);
  return 0;
}

static char cpu_token;
static int cpu_stream_create(kvp_device *d, void **out) {
  (void)d;
  *out = &cpu_token;
  return 0;
}
static void cpu_stream_destroy(kvp_device *d, void *s) { (void)d, (void)s; }
static int cpu_sync(kvp_device *d, void *s) {
  (void)d, (void)s;
  return 0;
}
static int cpu_wait(kvp_device *d, void *s, void *e) {
  (void)d, (void)s, (void)e;
  return 0;
}
/* An event is the time it was recorded (all work before it is done). */
static int cpu_event_create(kvp_device *d, void **out) {
  uint64_t *t = kvp__calloc(&d->alloc, 1, sizeof *t);
  if (!t)
    return KVP_ENOMEM;
  *out = t;
  return 0;
}
static void cpu_event_destroy(kvp_device *d, void *e) {
  kvp__free(&d->alloc, e, sizeof(uint64_t));
}
static int cpu_event_record(kvp_device *d, void *e, void *s) {
  (void)d, (void)s;
  *(uint64_t *)e = kvp_now_ns();
  return 0;
}
static int cpu_event_elapsed(kvp_device *d, void *a, void *b, uint64_t *ns) {
  (void)d;
  uint64_t ta = *(uint64_t *)a, tb = *(uint64_t *)b;
  *ns = tb > ta ? tb - ta : 0;
  return 0;
}
static int cpu_layout_upload(kvp_device *d, kvp_kv_layout *l) {
  (void)d;
  l->chunk_table_dev = (uint64_t)(uintptr_t)l->chunk_base;
  return 0;
}
static void cpu_layout_release(kvp_device *d, kvp_kv_layout *l) {
  (void)d, (void)l;
}

/* The reference: block i, chunk c <-> staging slot, chunk c. */
static int cpu_run(kvp_device *d, const kvp__plan *p) {
  (void)d;
  const kvp_kv_layout_info *in = &p->layout->info;
  for (uint32_t i = 0; i < p->n; i++) {
    uint64_t slot = p->slots ? p->slots[i] : i;
    for (uint32_t c = 0; c < in->n_chunks; c++) {
      char *paged = (char *)(uintptr_t)(p->layout->chunk_base[c] +
                                        p->ids[i] * in->block_stride);
      char *stage = (char *)(uintptr_t)(p->staging + (slot * in->n_chunks + c) *
                                                         in->chunk_bytes);
      if (p->scatter)
        memcpy(paged, stage, in->chunk_bytes);
      else
        memcpy(stage, paged, in->chunk_bytes);
    }
  }
  return 0;
}

const kvp__dev_ops kvp__cpu_ops = {
    .open = cpu_open,
    .close = cpu_close,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_register = cpu_host_register,
    .host_unregister = cpu_host_unregister,
    .check_device_range = cpu_check_range,
    .memcpy = cpu_memcpy,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .stream_sync = cpu_sync,
    .stream_query = cpu_sync,
    .stream_wait = cpu_wait,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .event_sync = cpu_sync,
    .event_query = cpu_sync,
    .event_elapsed = cpu_event_elapsed,
    .layout_upload = cpu_layout_upload,
    .layout_release = cpu_layout_release,
    .run_kernel = cpu_run,
    .run_copy_engine = cpu_run,
    .calibrate = false,
};
