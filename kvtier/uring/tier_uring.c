/* SPDX-License-Identifier: Apache-2.0 */
/* io_uring backend: one ring per store (used under the store's lock),
 * registered files (sparse table, filled as slab files open) and registered
 * buffers (the staging pool).  tier_io.c drives the queue: queue ops while
 * there is room, reap completions, queue more. */
#include <errno.h>
#include <liburing.h>

#include "core_internal.h"
#include "kvtier_internal.h"

#define FILES_MAX 256u

struct tier_uring {
  kvp_allocator a;
  struct io_uring ring;
  bool files_ok, bufs_ok;
  uint32_t nfiles;
  /* the registered buffer table: staging [0, nstage), then the caller's
   * ranges [nstage, nstage + nuser) (kvp_tier_register_buffers) */
  struct iovec *tab;
  uint32_t nstage, nuser;
};

int kvp__tier_uring_create(uint32_t entries, const kvp_allocator *a,
                           tier_uring **out) {
  tier_uring *u = kvp__calloc(a, 1, sizeof *u);
  if (u == NULL)
    return KVP_ENOMEM;
  u->a = kvp__allocator(a);
  /* completions' task work runs when we next enter the kernel (we always
   * do, to reap) instead of by interrupting us: fewer IPIs.
   * Kernels before 5.19 refuse the flag: plain ring then. */
  int rc = io_uring_queue_init(entries, &u->ring, IORING_SETUP_COOP_TASKRUN);
  if (rc == -EINVAL)
    rc = io_uring_queue_init(entries, &u->ring, 0);
  if (rc < 0) {
    kvp__free(a, u, sizeof *u);
    return rc; /* -EPERM / -ENOSYS in locked-down containers */
  }
  u->files_ok = io_uring_register_files_sparse(&u->ring, FILES_MAX) == 0;
  *out = u;
  return 0;
}

void kvp__tier_uring_destroy(tier_uring *u) {
  if (u == NULL)
    return;
  io_uring_queue_exit(&u->ring);
  kvp__free(&u->a, u->tab, TIER_URING_BUFS_MAX * sizeof *u->tab);
  kvp__free(&u->a, u, sizeof *u);
}

/* (Re)registers tab[0, n): the table can only be replaced whole (sparse
 * tables with updates need 5.19+ and liburing 2.2's tags); the ring is idle
 * here (the store's lock is held, no batch is running). */
static int register_tab(tier_uring *u, uint32_t n) {
  if (u->bufs_ok)
    io_uring_unregister_buffers(&u->ring);
  u->bufs_ok = false;
  int rc = n > 0 ? io_uring_register_buffers(&u->ring, u->tab, n) : 0;
  u->bufs_ok = n > 0 && rc == 0;
  return rc;
}

static bool ensure_tab(tier_uring *u) {
  if (u->tab == NULL)
    u->tab = kvp__calloc(&u->a, TIER_URING_BUFS_MAX, sizeof *u->tab);
  return u->tab != NULL;
}

bool kvp__tier_uring_register_buffers(tier_uring *u, void *base, size_t each,
                                      uint32_t n) {
  if (n == 0 || n > 1024 || each > (1u << 30) || !ensure_tab(u))
    return false;
  for (uint32_t i = 0; i < n; i++)
    u->tab[i] = (struct iovec){(char *)base + (size_t)i * each, each};
  u->nstage = n;
  u->nuser = 0;
  return register_tab(u, n) == 0;
}

int kvp__tier_uring_set_user_buffers(tier_uring *u, const struct iovec *iov,
                                     uint32_t n, uint32_t *first) {
  if (!ensure_tab(u))
    return KVP_ENOMEM;
  if (n > TIER_URING_BUFS_MAX - u->nstage)
    return KVP_ERANGE;
  for (uint32_t i = 0; i < n; i++)
    u->tab[u->nstage + i] = iov[i];
  int rc = register_tab(u, u->nstage + n);
  if (rc < 0 && n > 0) /* keep staging registered; no caller ranges */
    register_tab(u, u->nstage);
  u->nuser = rc < 0 ? 0 : n;
  *first = u->nstage;
  return rc;
}

int kvp__tier_uring_register_file(tier_uring *u, int fd) {
  if (!u->files_ok || u->nfiles >= FILES_MAX)
    return -1;
  int idx = (int)u->nfiles;
  if (io_uring_register_files_update(&u->ring, (unsigned)idx, &fd, 1) != 1)
    return -1;
  u->nfiles++;
  return idx;
}

int kvp__tier_uring_queue(tier_uring *u, tio_op *o, uint64_t tag) {
  struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
  if (sqe == NULL)
    return KVP_EBUSY;
  int fd = o->file >= 0 ? o->file : o->fd;
  if (o->op == TIO_SYNC) {
    io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
  } else if (o->buf2 != NULL) { /* header sector + caller's buffer */
    o->iov[0] = (struct iovec){o->buf, o->len};
    o->iov[1] = (struct iovec){o->buf2, o->len2};
    io_uring_prep_readv(sqe, fd, o->iov, 2, o->off);
  } else if (o->buf_index >= 0 && o->op == TIO_READ)
    io_uring_prep_read_fixed(sqe, fd, o->buf, o->len, o->off, o->buf_index);
  else if (o->buf_index >= 0)
    io_uring_prep_write_fixed(sqe, fd, o->buf, o->len, o->off, o->buf_index);
  else if (o->op == TIO_READ)
    io_uring_prep_read(sqe, fd, o->buf, o->len, o->off);
  else
    io_uring_prep_write(sqe, fd, o->buf, o->len, o->off);
  if (o->file >= 0)
    sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data64(sqe, tag);
  return 0;
}

void kvp__tier_uring_submit(tier_uring *u) {
  int rc;
  do
    rc = io_uring_submit(&u->ring);
  while (rc == -EINTR);
}

int kvp__tier_uring_reap(tier_uring *u, tier_uring_cb cb, void *arg) {
  int rc;
  if (io_uring_cq_ready(&u->ring) == 0) { /* else: no syscall needed */
    do
      rc = io_uring_submit_and_wait(&u->ring, 1);
    while (rc == -EINTR);
    if (rc < 0 && rc != -EAGAIN && rc != -EBUSY)
      return rc;
  }
  struct io_uring_cqe *cqe;
  unsigned head, seen = 0;
  io_uring_for_each_cqe(&u->ring, head, cqe) {
    cb(arg, io_uring_cqe_get_data64(cqe), cqe->res);
    seen++;
  }
  io_uring_cq_advance(&u->ring, seen);
  return (int)seen;
}
