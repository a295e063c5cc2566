/* SPDX-License-Identifier: Apache-2.0 */
/* Built without liburing (KVP_WITH_URING=OFF or not found): the POSIX path
 * is the only one. */
#include "kvtier_internal.h"

int kvp__tier_uring_create(uint32_t entries, const kvp_allocator *a,
                           tier_uring **out) {
  (void)entries, (void)a, (void)out;
  return KVP_ENOTSUP;
}
void kvp__tier_uring_destroy(tier_uring *u) { (void)u; }
bool kvp__tier_uring_register_buffers(tier_uring *u, void *base, size_t each,
                                      uint32_t n) {
  (void)u, (void)base, (void)each, (void)n;
  return false;
}
int kvp__tier_uring_register_file(tier_uring *u, int fd) {
  (void)u, (void)fd;
  return -1;
}
int kvp__tier_uring_run(tier_uring *u, tio_op *ops, size_t n, uint32_t qd) {
  (void)u, (void)qd;
  for (size_t i = 0; i < n; i++)
    ops[i].res = KVP_ENOTSUP;
  return KVP_ENOTSUP;
}
