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
int kvp__tier_uring_set_user_buffers(tier_uring *u, const struct iovec *iov,
                                     uint32_t n, uint32_t *first) {
  (void)u, (void)iov, (void)n, (void)first;
  return KVP_ENOTSUP;
}
int kvp__tier_uring_register_file(tier_uring *u, int fd) {
  (void)u, (void)fd;
  return -1;
}
int kvp__tier_uring_queue(tier_uring *u, tio_op *op, uint64_t tag) {
  (void)u, (void)op, (void)tag;
  return KVP_ENOTSUP;
}
int kvp__tier_uring_reap(tier_uring *u, tier_uring_cb cb, void *arg) {
  (void)u, (void)cb, (void)arg;
  return KVP_ENOTSUP;
}
void kvp__tier_uring_submit(tier_uring *u) { (void)u; }
