/* SPDX-License-Identifier: Apache-2.0 */
/* Start-up calibration, the same for every GPU backend (through its ops):
 * kernel vs copy engine, H2D (scatter) and D2H (gather), random pages of
 * 4 KiB .. 1 MiB, 16 MiB per sample, best of two timed runs after a warm-up.
 * The results drive KVP_XFER_AUTO and kvp_device_bandwidth_get. */
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

#define CAL_BYTES (16ull << 20)

typedef struct cal {
  kvp_device *d;
  uint64_t dev_buf, host_dptr;
  void *host, *e0, *e1;
  uint32_t *ids;
} cal;

static int cal_time(cal *c, const kvp__plan *p, int method, double *gbps) {
  kvp_device *d = c->d;
  const kvp__dev_ops *o = d->ops;
  double best = 0;
  for (int rep = 0; rep < 3; rep++) { /* rep 0 warms up */
    uint64_t ns = 0;
    int rc;
    if ((rc = o->event_record(d, c->e0, NULL)) < 0 ||
        (rc = method == KVP_XFER_KERNEL ? o->run_kernel(d, p)
                                        : o->run_copy_engine(d, p)) < 0 ||
        (rc = o->event_record(d, c->e1, NULL)) < 0 ||
        (rc = o->event_sync(d, c->e1)) < 0 ||
        (rc = o->event_elapsed(d, c->e0, c->e1, &ns)) < 0)
      return rc;
    double g = ns ? (double)p->n * p->layout->info.block_bytes / (double)ns : 0;
    if (rep && g > best)
      best = g;
  }
  *gbps = best;
  return 0;
}

/* Random distinct blocks of a cache twice the sample: few adjacent runs. */
static void shuffle(uint32_t *ids, uint32_t nb, uint64_t *rng) {
  for (uint32_t k = 0; k < nb; k++)
    ids[k] = k;
  for (uint32_t k = nb - 1; k > 0; k--) {
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t r = (uint32_t)(((*rng >> 32) * (k + 1)) >> 32), t = ids[k];
    ids[k] = ids[r], ids[r] = t;
  }
}

static int cal_sizes(cal *c) {
  kvp_device *d = c->d;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < KVP_CAL_SIZES; i++) {
    uint64_t page = 4096ull << i, base = c->dev_buf;
    uint32_t pages = (uint32_t)(CAL_BYTES / page);
    shuffle(c->ids, 2 * pages, &rng);
    kvp_kv_layout l = {.dev = d, .chunk_base = &base};
    l.info = (kvp_kv_layout_info){.block_bytes = page, .chunk_bytes = page,
                                  .block_stride = page, .n_chunks = 1,
                                  .num_blocks = 2 * pages, .vector_bytes = 16};
    int rc = d->ops->layout_upload(d, &l);
    for (int dir = 0; dir < 2 && rc >= 0; dir++) {
      kvp__plan p = {.layout = &l, .ids = c->ids, .n = pages,
                     .scatter = dir == KVP_DIR_H2D, .staging_is_host = true,
                     .staging = c->host_dptr};
      for (int m = 0; m < 2 && rc >= 0; m++)
        rc = cal_time(c, &p, m + 1, &d->bw[dir][i][m]);
    }
    if (l.chunk_table_dev)
      d->ops->layout_release(d, &l);
    if (rc < 0)
      return rc;
  }
  return 0;
}

int kvp__calibrate(kvp_device *d) {
  const kvp__dev_ops *o = d->ops;
  cal c = {.d = d};
  int rc;
  c.ids = malloc(2 * CAL_BYTES / 4096 * sizeof *c.ids);
  c.host = aligned_alloc(4096, CAL_BYTES);
  if (!c.ids || !c.host) {
    rc = KVP_ENOMEM;
    goto out;
  }
  memset(c.host, 0x5a, CAL_BYTES); /* touched: no first-use faults timed */
  if ((rc = o->alloc(d, 2 * CAL_BYTES, &c.dev_buf)) < 0 ||
      (rc = o->host_register(d, c.host, CAL_BYTES, &c.host_dptr)) < 0) {
    c.host_dptr = 0;
    goto out;
  }
  if ((rc = o->event_create(d, &c.e0)) < 0 || (rc = o->event_create(d, &c.e1)) < 0)
    goto out;
  if ((rc = cal_sizes(&c)) < 0)
    goto out;
  d->calibrated = true;
  for (int i = 0; i < KVP_CAL_SIZES; i++)
    KVP_LOGI(KVP_KERNELS_MOD,
             "%s: %7llu B pages: H2D kernel %.1f / copy engine %.1f GB/s, "
             "D2H %.1f / %.1f", d->name, 4096ull << i, d->bw[0][i][0],
             d->bw[0][i][1], d->bw[1][i][0], d->bw[1][i][1]);
out:
  if (c.e1)
    o->event_destroy(d, c.e1);
  if (c.e0)
    o->event_destroy(d, c.e0);
  if (c.host_dptr)
    o->host_unregister(d, c.host);
  if (c.dev_buf)
    o->free(d, c.dev_buf);
  free(c.host);
  free(c.ids);
  return rc;
}
