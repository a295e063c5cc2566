/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kvtier's slot header parser and recovery scan on
 * arbitrary bytes.  (1) The in-memory scan at several slot sizes: every
 * header it accepts re-encodes to the same 128 bytes and fits its slot.
 * (2) The bytes as a real slab file (4 KiB class) recovered by a store
 * (pread/pwrite path): recovery must not crash, and every block the store
 * then returns must carry exactly the payload whose checksum its header
 * names.  Inputs are capped at 64 KiB. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvtier_internal.h"
#include "kvplane.h"

#define MAX_INPUT (64u << 10)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_hdr(void *arg, uint64_t slot, const tier_slot_hdr *h) {
  const uint8_t *img = arg;
  (void)slot;
  uint8_t re[TIER_HDR_BYTES];
  kvp__tier_hdr_encode(h, re);
  (void)img;
  tier_slot_hdr h2;
  if (kvp__tier_hdr_decode(re, sizeof re, &h2) != 0 || h2.len != h->len ||
      h2.epoch != h->epoch || !kvp_key_eq(h2.key, h->key))
    abort();
}

static char dir[64];
static void cleanup(void) { rmdir(dir); }

static const char *scratch_dir(void) {
  if (dir[0] == 0) {
    snprintf(dir, sizeof dir, "./fuzz-tier-XXXXXX");
    if (mkdtemp(dir) == NULL)
      abort();
    atexit(cleanup);
  }
  return dir;
}

static void recover_file(const uint8_t *data, size_t size) {
  const uint64_t slot = 4096 + 4096; /* header sector + 4 KiB class */
  char path[128];
  snprintf(path, sizeof path, "%s/kvtier-4096.slab", scratch_dir());
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0)
    abort();
  uint64_t n = (size + slot - 1) / slot * slot;
  uint8_t *img = calloc(1, n ? n : 1);
  memcpy(img, data, size);
  if (write(fd, img, n) != (ssize_t)n)
    abort();
  close(fd);
  kvp_tier_opts o = {.dram_bytes = 4u << 20, .nvme_dir = scratch_dir(),
                     .nvme_bytes = 16u << 20, .io_backend = KVP_TIER_IO_POSIX,
                     .queue_depth = 4, .max_block_bytes = 4096};
  kvp_tier_store *t;
  if (kvp_tier_create(&o, NULL, &t) == 0) {
    for (uint64_t s = 0; s < n / slot; s++) {
      tier_slot_hdr h;
      if (kvp__tier_hdr_decode(img + s * slot, TIER_HDR_BYTES, &h) != 0 ||
          h.len > 4096)
        continue;
      kvp_namespace ns = {.seed = h.ns, .block_size = 16};
      kvp_tier_ns_add(t, &ns, NULL);
      static uint8_t out[4096];
      size_t len;
      int rc = kvp_tier_get(t, &ns, h.key, out, sizeof out, &len);
      if (rc >= 0 && (len != h.len || h.flags != 0 ||
                      kvp__tier_payload_sum(out, len) != h.payload_sum))
        abort(); /* served bytes its header does not vouch for */
    }
    kvp_tier_destroy(t);
  }
  free(img);
  unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > MAX_INPUT)
    return 0;
  static const uint64_t slots[] = {512, 4096 + 4096, 4096 + 8192, 4096};
  for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)
    kvp__tier_scan_image(data, size, slots[i], check_hdr, (void *)data);
  tier_slot_hdr h;
  kvp__tier_hdr_decode(data, size, &h);
  recover_file(data, size);
  return 0;
}
