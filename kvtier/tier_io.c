/* SPDX-License-Identifier: Apache-2.0 */
/* The NVMe I/O layer: one batch call over io_uring (kvtier/uring/) or
 * pread/pwrite/fdatasync, with the injectable filter applied to every
 * result on both paths.  The backend is chosen at run time: io_uring when
 * built in and the kernel lets us set up a ring (containers may not). */
#include <errno.h>
#include <unistd.h>

#include "core_internal.h"
#include "kvtier_config.h"
#include "kvtier_internal.h"

struct tier_io {
  kvp_allocator a;
  tier_uring *u; /* NULL: POSIX */
  kvp_tier_io_filter filter;
  void *fopaque;
};

int kvp__tier_io_create(kvp_tier_io_backend b, uint32_t qd,
                        kvp_tier_io_filter filter, void *fopaque,
                        const kvp_allocator *a, tier_io **out) {
  tier_io *io = kvp__calloc(a, 1, sizeof *io);
  if (io == NULL)
    return KVP_ENOMEM;
  io->a = kvp__allocator(a);
  io->filter = filter;
  io->fopaque = fopaque;
  if (b != KVP_TIER_IO_POSIX) {
    int rc = tier_config_uring ? kvp__tier_uring_create(qd, a, &io->u)
                               : KVP_ENOTSUP;
    if (rc < 0) {
      if (b == KVP_TIER_IO_URING) {
        KVP_LOGE("kvtier", "io_uring requested but unavailable: %s%s",
                 kvp_strerror(rc),
                 tier_config_uring ? "" : " (built without liburing)");
        kvp__free(a, io, sizeof *io);
        return KVP_ENOTSUP;
      }
      KVP_LOGI("kvtier", "io_uring unavailable (%s): using pread/pwrite",
               kvp_strerror(rc));
      io->u = NULL;
    }
  }
  *out = io;
  return 0;
}

void kvp__tier_io_destroy(tier_io *io) {
  if (io == NULL)
    return;
  kvp__tier_uring_destroy(io->u);
  kvp__free(&io->a, io, sizeof *io);
}

bool kvp__tier_io_is_uring(const tier_io *io) { return io->u != NULL; }

bool kvp__tier_io_register_buffers(tier_io *io, void *base, size_t each,
                                   uint32_t n) {
  return io->u != NULL && kvp__tier_uring_register_buffers(io->u, base, each, n);
}

int kvp__tier_io_register_file(tier_io *io, int fd) {
  return io->u != NULL ? kvp__tier_uring_register_file(io->u, fd) : -1;
}

static int posix_one(const tio_op *o) {
  ssize_t r;
  do {
    if (o->op == TIO_READ)
      r = pread(o->fd, o->buf, o->len, (off_t)o->off);
    else if (o->op == TIO_WRITE)
      r = pwrite(o->fd, o->buf, o->len, (off_t)o->off);
    else
      r = fdatasync(o->fd);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : (int)r;
}

int kvp__tier_io_run(tier_io *io, tio_op *ops, size_t n, uint32_t qd) {
  if (io->u != NULL) {
    kvp__tier_uring_run(io->u, ops, n, qd);
  } else {
    for (size_t i = 0; i < n; i++)
      ops[i].res = posix_one(&ops[i]);
  }
  if (io->filter != NULL)
    for (size_t i = 0; i < n; i++)
      ops[i].res = io->filter(io->fopaque, ops[i].op, ops[i].buf, ops[i].len,
                              ops[i].off, ops[i].res);
  return 0;
}
