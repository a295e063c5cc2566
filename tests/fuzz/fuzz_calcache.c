/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the calibration cache file (kernels/kernels_calcache.c),
 * which kvp_device_create reads from the user's cache directory.  Any bytes:
 * refused (KVP_EINVAL), a stale miss (KVP_ENOENT), or accepted -- and then
 * every figure is finite and in (0, 100000), and formatting them again
 * parses back to the same figures, bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char KEY[] = "cuda uuid=00112233445566778899aabbccddeeff pci=0000:1a:00.0 "
                          "driver=13000 kernels=0123456789abcdef name=Test GPU "
                          "kvplane=0.1.0 ctas=16 threads=512";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  double bw[2][KVP_CAL_SIZES][2], again[2][KVP_CAL_SIZES][2];
  char why[160];
  int rc = kvp__calcache_parse((const char *)data, size, KEY, bw, why, sizeof why);
  if (rc == KVP_EINVAL || rc == KVP_ENOENT)
    return 0;
  if (rc != 0)
    abort();
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < KVP_CAL_SIZES; i++)
      for (int m = 0; m < 2; m++)
        if (!isfinite(bw[d][i][m]) || bw[d][i][m] <= 0 || bw[d][i][m] >= 100000)
          abort();
  char out[8192];
  int n = kvp__calcache_format(KEY, bw, out, sizeof out);
  if (n <= 0 || kvp__calcache_parse(out, (size_t)n, KEY, again, why, sizeof why) != 0 ||
      memcmp(again, bw, sizeof bw) != 0)
    abort();
  return 0;
}
