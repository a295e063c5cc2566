/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kv layout descriptors and transfer requests as an engine
 * connector would build them from outside data (shapes from a config, block
 * ids and pool slots from events), on the CPU backend.  Bad shapes and ids
 * must be refused; accepted transfers must move exactly the bytes the
 * reference says, never touching memory outside the tensors or staging
 * (ASan checks that).  Input: 16 bytes of shape, then u32 ids (and slots).
 * Shapes are capped so one input allocates at most a few MiB. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvp_device *dev;

static uint32_t rd32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!dev && kvp_device_create(NULL, NULL, &dev) < 0)
    abort();
  if (size < 16)
    return 0;
  kvp_kv_layout_desc d = {
      .kind = (kvp_layout_kind)(data[0] % 12), /* includes invalid 0 and 11 */
      .num_layers = data[1] % 5,               /* 0..4; 0 is invalid */
      .num_blocks = data[2] % 65,
      .block_size = data[3] % 9,
      .num_kv_heads = data[4] % 4,
      .head_dim = data[5] % 80,
      .elem_size = data[6] % 6, /* 0..5: 1, 2, 4 valid */
  };
  const uint8_t mode = data[7];
  /* tensors big enough for any valid shape of these bounds: t[0] holds the
   * one-tensor kinds (all layers), the others one layer ([2, blocks, ...]) */
  const size_t page = (size_t)8 * 3 * 79 * 4, tl = 2 * 64 * page;
  void *t[8] = {0}, *k[4], *v[4];
  for (int i = 0; i < 8; i++)
    if (!(t[i] = malloc(i ? tl : 4 * tl)))
      abort();
  for (int l = 0; l < 4; l++)
    k[l] = t[2 * l], v[l] = t[2 * l + 1];
  if (mode & 1)
    d.k_layers = k;
  if (mode & 2)
    d.v_layers = v;
  if (mode & 4)
    d.base = t[0];
  kvp_kv_layout *lay = NULL;
  if (kvp_kv_layout_create(dev, &d, &lay) == 0) {
    kvp_kv_layout_info in;
    kvp_kv_layout_info_get(lay, &in);
    size_t n = (size - 16) / 4;
    if (n > 256)
      n = 256;
    uint32_t *ids = malloc((n ? n : 1) * 4), *slots = NULL;
    for (size_t i = 0; i < n; i++)
      ids[i] = rd32(data + 16 + 4 * i) % (in.num_blocks + 2); /* some out of range */
    if (mode & 8) {
      slots = malloc((n ? n : 1) * 4);
      for (size_t i = 0; i < n; i++)
        slots[i] = (ids[i] * 7 + (uint32_t)i) % (uint32_t)(n + 3);
    }
    uint64_t cap = (uint64_t)(rd32(data + 8) % (n + 4));
    uint64_t sbytes = cap * in.block_bytes;
    unsigned char *st = malloc(sbytes ? sbytes : 1);
    kvp_xfer x = {.layout = lay, .block_ids = ids, .n = (uint32_t)n,
                  .staging = st, .staging_bytes = sbytes, .staging_slots = slots,
                  .method = data[12] % 3};
    int rc = (mode & 16) ? kvp_device_scatter(dev, NULL, &x)
                         : kvp_device_gather(dev, NULL, &x);
    if (rc >= 0) { /* accepted: every id in range, every slot inside staging */
      for (size_t i = 0; i < n; i++)
        if (ids[i] >= in.num_blocks ||
            (uint64_t)(slots ? slots[i] : i) >= cap)
          abort();
    }
    free(st), free(ids), free(slots);
    kvp_kv_layout_destroy(lay);
  }
  for (int i = 0; i < 8; i++)
    free(t[i]);
  return 0;
}
