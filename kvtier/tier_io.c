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
  uint64_t slow_ns, slow;
};

void kvp__tier_io_set_slow(tier_io *io, uint64_t slow_ns) { io->slow_ns = slow_ns; }
uint64_t kvp__tier_io_slow_count(const tier_io *io) { return io->slow; }

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

int kvp__tier_io_set_user_buffers(tier_io *io, const struct iovec *iov,
                                  uint32_t n, uint32_t *first) {
  return io->u != NULL ? kvp__tier_uring_set_user_buffers(io->u, iov, n, first)
                       : KVP_ENOTSUP;
}

int kvp__tier_io_register_file(tier_io *io, int fd) {
  return io->u != NULL ? kvp__tier_uring_register_file(io->u, fd) : -1;
}

static int posix_one(tio_op *o) {
  ssize_t r;
  o->iov[0] = (struct iovec){o->buf, o->len};
  o->iov[1] = (struct iovec){o->buf2, o->len2};
  do {
    if (o->op == TIO_READ && o->buf2 != NULL)
      r = preadv(o->fd, o->iov, 2, (off_t)o->off);
    else if (o->op == TIO_READ)
      r = pread(o->fd, o->buf, o->len, (off_t)o->off);
    else if (o->op == TIO_WRITE)
      r = pwrite(o->fd, o->buf, o->len, (off_t)o->off);
    else
      r = fdatasync(o->fd);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : (int)r;
}

typedef struct run_state {
  tier_io *io;
  tio_op *ops;
  const tio_pool *pool;
  tio_cb done;
  void *arg;
  uint32_t *freeb, nfree;
  uint32_t *cq, ncq; /* completed, not yet handed to done (FIFO) */
  uint32_t cq_head;
  uint64_t now; /* one clock read per reap round, not two per op */
  size_t finished;
} run_state;

static void finish(run_state *r, size_t i) {
  tio_op *o = &r->ops[i];
  o->inflight = false;
  if (r->io->filter != NULL && !o->skipped) {
    o->res = r->io->filter(r->io->fopaque, o->op, o->buf2 ? o->buf2 : o->buf,
                           (size_t)o->len + o->len2, o->off, o->res);
    r->now = kvp_now_ns(); /* a filter may delay (fault injection) */
  }
  if (!o->skipped && r->now - o->t_start > r->io->slow_ns)
    r->io->slow++; /* after the filter: injected delays count too */
  if (r->done != NULL)
    r->done(r->arg, i, o);
  if (o->pool_idx >= 0)
    r->freeb[r->nfree++] = (uint32_t)o->pool_idx;
  o->pool_idx = -1;
  r->finished++;
}

/* A completion is only noted here: the loop first refills the queue, then
 * runs done (the read checksum), so verification overlaps the I/O still in
 * flight instead of leaving the device idle. */
static void on_cqe(void *arg, uint64_t tag, int res) {
  run_state *r = arg;
  r->ops[tag].res = res;
  r->ops[tag].inflight = false;
  r->cq[r->ncq++] = (uint32_t)tag;
}

static bool finish_noted(run_state *r) {
  if (r->cq_head == r->ncq)
    return false;
  finish(r, r->cq[r->cq_head++]);
  if (r->cq_head == r->ncq)
    r->cq_head = r->ncq = 0;
  return true;
}

/* Gives op i its buffer (if it needs one) and runs prep; false when no
 * buffer is free (nothing done). */
static bool take_and_prep(run_state *r, tio_op *o, size_t i, tio_cb prep) {
  o->pool_idx = -1;
  o->buf_index = o->user_buf - 1; /* -1 unless in a caller range */
  if (o->needs_buf) {
    if (r->nfree == 0)
      return false;
    uint32_t b = r->freeb[--r->nfree];
    o->pool_idx = (int)b;
    o->buf = r->pool->base + (size_t)b * r->pool->each;
    o->buf_index = r->pool->fixed ? (int)b : -1;
  }
  o->res = 0;
  o->skipped = false;
  if (prep != NULL)
    prep(r->arg, i, o);
  o->prepped = true;
  return true;
}

int kvp__tier_io_run(tier_io *io, tio_op *ops, size_t n, uint32_t qd,
                     const tio_pool *pool, tio_cb prep, tio_cb done, void *arg) {
  uint32_t freeb[1024], cq[1024];
  run_state r = {.io = io, .ops = ops, .pool = pool, .done = done, .arg = arg,
                 .freeb = freeb, .cq = cq};
  uint32_t nbuf = pool ? (pool->n < 1024 ? pool->n : 1024) : 0;
  for (uint32_t b = nbuf; b-- > 0;)
    freeb[r.nfree++] = b;
  qd = qd < 1024 ? qd : 1024; /* bounds cq: only in-flight ops complete */
  size_t next = 0, inflight = 0;
  int err = 0;
  for (size_t i = 0; i < n; i++)
    ops[i].prepped = false;
  while (r.finished < n) {
    bool queued = false;
    uint64_t t_sub = kvp_now_ns();
    while (next < n && inflight < qd && err == 0) {
      tio_op *o = &ops[next];
      if (!o->prepped && !take_and_prep(&r, o, next, prep))
        break; /* no buffer free: reap first */
      o->t_start = t_sub;
      if (o->res < 0) { /* prep failed: no I/O, no filter */
        o->skipped = true;
        finish(&r, next);
      } else if (io->u != NULL) {
        if (kvp__tier_uring_queue(io->u, o, next) < 0) {
          o->prepped = true; /* keeps its buffer: staged, not queued */
          break;             /* ring full: reap first */
        }
        o->prepped = false;
        o->inflight = true;
        inflight++;
        queued = true;
      } else {
        o->res = posix_one(o);
        r.now = t_sub = kvp_now_ns();
        finish(&r, next);
      }
      next++;
    }
    if (queued)
      kvp__tier_uring_submit(io->u); /* errors surface at the next reap */
    /* the queue is full: stage the next op now, with the spare buffer */
    if (io->u != NULL && prep != NULL && err == 0 && next < n &&
        inflight >= qd && !ops[next].prepped)
      take_and_prep(&r, &ops[next], next, prep);
    if (finish_noted(&r)) /* verify one while the refilled queue runs */
      continue;
    if (inflight == 0) {
      if (err != 0 || (next == n && r.finished == n))
        break;
      continue;
    }
    int rc = kvp__tier_uring_reap(io->u, on_cqe, &r);
    r.now = kvp_now_ns();
    if (rc < 0) { /* ring unusable: fail the rest */
      err = rc;
      while (finish_noted(&r))
        ;
      for (size_t i = 0; i < n; i++)
        if (i >= next || ops[i].inflight) {
          if (i >= next)
            ops[i].pool_idx = -1;
          ops[i].res = rc;
          ops[i].skipped = true;
          finish(&r, i);
        }
      break;
    }
    inflight -= (size_t)rc;
  }
  return err;
}
