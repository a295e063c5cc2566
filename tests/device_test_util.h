/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper shared by the device tests: the backend named by
 * KVP_TEST_BACKEND (cpu|cuda|hip, default cpu), or exit 77 saying why it is
 * not available here. */
#ifndef KVP_DEVICE_TEST_UTIL_H
#define KVP_DEVICE_TEST_UTIL_H

#include <stdlib.h>
#include <string.h>

#include "kvplane.h"
#include "test_harness.h"

/* why (cap bytes) receives the backend's availability text. */
static inline kvp_backend kvt_backend_from_env(char *why, size_t cap) {
  const char *b = getenv("KVP_TEST_BACKEND");
  kvp_backend k = !b || !strcmp(b, "cpu") ? KVP_BACKEND_CPU
                  : !strcmp(b, "cuda")    ? KVP_BACKEND_CUDA
                  : !strcmp(b, "hip")     ? KVP_BACKEND_HIP
                                          : KVP_BACKEND_COUNT_;
  ASSERT_TRUE(k != KVP_BACKEND_COUNT_);
  if (!kvp_backend_available(k, why, cap))
    KVT_SKIP_BECAUSE("%s backend not available here: %s", kvp_backend_name(k),
                     why);
  return k;
}

#endif /* KVP_DEVICE_TEST_UTIL_H */
