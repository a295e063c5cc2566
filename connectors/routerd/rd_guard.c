/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd front-door guard: libevent 2.1's evhttp has an idle
 * timeout only, so a client sending a byte a second keeps a connection (and
 * its memory) for ever, and it takes any number of connections.
 *
 * Each connection evhttp accepts is admitted here on the same loop pass
 * (evhttp_set_bevcb, then an event made active: evhttp has set the
 * bufferevent up by then, and nothing can free it before the loop turns;
 * one reference is held for that pass only).  Admitting takes the
 * connection's close callback, which libevent calls exactly once when it
 * resets or frees an incoming connection: the open connections are counted
 * by it, and past routerd.max_connections a new one is answered 503 with
 * Retry-After and closed, as nginx's limit_conn answers.  Callers that want
 * the close callback themselves (a request cancelled when its client goes)
 * set it through rd_guard_on_gone.
 *
 * Each connection's input buffer reports every read (evbuffer_add_cb, the
 * bufferevent as the callback's argument: alive whenever its buffer calls);
 * per socket the guard keeps when the request now arriving began, and a
 * read that comes more than routerd.client_request_timeout after it shuts
 * the socket down (evhttp then reads EOF and frees the connection as
 * usual).  No reference outlives the admitting pass and no socket is closed
 * here: a held one kept its events past evhttp's free and the epoll
 * changelist then changed a closed fd ("Epoll MOD ... Bad file
 * descriptor").  All on the loop's own thread. */
#include "rd.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

typedef void (*gone_cb)(struct evhttp_connection *, void *);

typedef struct guard_fd {
  const struct bufferevent *bev; /* compared only, never dereferenced */
  struct evhttp_connection *cn;  /* admitted: counted until it closes */
  gone_cb gone;                  /* the caller's close callback */
  void *gone_arg;
  double since; /* the request now arriving began; 0 none */
  bool busy;    /* it arrived whole: being answered */
  bool refused; /* over max_connections: 503 sent, closing */
  bool ahead;   /* read_ahead is adding to its input (no recursion) */
} guard_fd;

struct rd_guard {
  rd_loop *l;
  guard_fd *fd; /* by socket */
  size_t n_fd;
  struct event *admit;     /* active while pending is not empty */
  struct bufferevent **pending; /* accepted this pass, one reference each */
  size_t n_pending, cap_pending;
  uint64_t open;           /* admitted, not closed yet */
};

/* bases -> guards (evbuffer callbacks know the bufferevent, not the loop) */
static struct {
  struct event_base *base;
  rd_guard *g;
} guards[RD_THREADS_MAX];

static rd_guard *guard_of(struct event_base *b) {
  for (size_t i = 0; i < RD_THREADS_MAX && guards[i].base; i++)
    if (guards[i].base == b)
      return guards[i].g;
  return NULL;
}

static guard_fd *slot(rd_guard *g, evutil_socket_t fd) {
  if (fd < 0)
    return NULL;
  if ((size_t)fd >= g->n_fd) {
    size_t n = (size_t)fd + 64;
    guard_fd *t = realloc(g->fd, n * sizeof *t);
    if (t == NULL)
      return NULL;
    memset(t + g->n_fd, 0, (n - g->n_fd) * sizeof *t);
    g->fd = t;
    g->n_fd = n;
  }
  return &g->fd[fd];
}

static guard_fd *slot_of_conn(rd_guard *g, struct evhttp_connection *cn) {
  struct bufferevent *bev = cn ? evhttp_connection_get_bufferevent(cn) : NULL;
  evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
  guard_fd *s = fd >= 0 && (size_t)fd < g->n_fd ? &g->fd[fd] : NULL;
  return s && s->cn == cn ? s : NULL;
}

/* libevent 2.1 reads a socket at most 4 KiB a loop pass (EVBUFFER_MAX_READ
 * in evbuffer_read): a 32K-token prompt's ~220 KB body took ~55 passes,
 * each an epoll_wait, a FIONREAD ioctl and a readv.  After a read that
 * filled its 4 KiB, whatever else the socket holds (up to READ_AHEAD) is
 * read here into the same buffer, in one readv; evhttp then finds it there
 * as if libevent had read it.  Errors and EOF are left for libevent's next
 * read to find. */
#define READ_AHEAD ((size_t)1 << 20)

static void read_ahead(guard_fd *s, struct evbuffer *in, evutil_socket_t fd) {
  int avail = 0;
  if (ioctl(fd, FIONREAD, &avail) < 0 || avail <= 0)
    return;
  size_t want = (size_t)avail < READ_AHEAD ? (size_t)avail : READ_AHEAD;
  struct evbuffer_iovec v[2];
  int nv = evbuffer_reserve_space(in, (ev_ssize_t)want, v, 2);
  if (nv <= 0)
    return;
  struct iovec io[2];
  for (int i = 0; i < nv; i++)
    io[i] = (struct iovec){v[i].iov_base, v[i].iov_len};
  ssize_t r = readv(fd, io, nv);
  if (r <= 0)
    return; /* the reservation lapses uncommitted */
  size_t left = (size_t)r;
  int nc = 0;
  for (; nc < nv && left > 0; nc++) {
    v[nc].iov_len = left < v[nc].iov_len ? left : v[nc].iov_len;
    left -= v[nc].iov_len;
  }
  s->ahead = true; /* committing calls on_input again */
  evbuffer_commit_space(in, v, nc);
  s->ahead = false;
}

static void on_input(struct evbuffer *in, const struct evbuffer_cb_info *info,
                     void *arg) {
  struct bufferevent *bev = arg;
  if (info->n_added == 0)
    return;
  rd_guard *g = guard_of(bufferevent_get_base(bev));
  evutil_socket_t fd = bufferevent_getfd(bev);
  guard_fd *s = g ? slot(g, fd) : NULL;
  if (s == NULL || s->bev != bev) /* not admitted: unguarded */
    return;
  if (info->n_added >= 4096 && !s->ahead && !s->refused)
    read_ahead(s, in, fd);
  if (s->busy)
    return;
  double now = rd_now();
  if (s->since == 0) {
    s->since = now;
    return;
  }
  if (now - s->since <= g->l->cfg.client_request_timeout_s)
    return;
  shutdown(fd, SHUT_RDWR); /* evhttp reads EOF: the connection freed */
  s->since = now + 1e9;    /* once */
  RD_COUNT(g->l, conns_cut, 1);
}

/* libevent resets or frees an admitted connection (once) */
static void on_close(struct evhttp_connection *cn, void *arg) {
  rd_guard *g = arg;
  guard_fd *s = slot_of_conn(g, cn);
  if (s == NULL)
    return;
  gone_cb gone = s->gone;
  void *gone_arg = s->gone_arg;
  *s = (guard_fd){0};
  g->open--;
  RD_COUNT(g->l, conns_open, -1);
  if (gone)
    gone(cn, gone_arg);
}

static const char refuse_body[] =
    "{\"error\":{\"message\":\"too many client connections (routerd.max_"
    "connections): retry shortly\",\"type\":\"ServiceUnavailableError\","
    "\"param\":null,\"code\":503}}";

/* The 503 goes out before evhttp has read anything; the write side is shut
 * (the client reads the reply, then EOF) and evhttp frees the connection
 * at the client's close, at its next request (answered 503 again by
 * rd_guard_begin's caller into a closed write side) or within a second. */
static void refuse(rd_guard *g, guard_fd *s, evutil_socket_t fd) {
  char m[512];
  int n = snprintf(m, sizeof m, "HTTP/1.1 503 Service Unavailable\r\n"
                   "Content-Type: application/json\r\nRetry-After: 1\r\n"
                   "Connection: close\r\nContent-Length: %zu\r\n\r\n%s",
                   sizeof refuse_body - 1, refuse_body);
  ssize_t r = send(fd, m, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)r; /* a fresh socket's buffer takes it; else the client sees EOF */
  shutdown(fd, SHUT_WR);
  s->refused = true;
  evhttp_connection_set_timeout(s->cn, 1);
  RD_COUNT(g->l, conns_refused, 1);
}

static void admit_one(rd_guard *g, struct bufferevent *bev) {
  bufferevent_data_cb rd = NULL, wr = NULL;
  bufferevent_event_cb ev = NULL;
  void *cn = NULL;
  bufferevent_getcb(bev, &rd, &wr, &ev, &cn);
  if (rd == NULL && ev == NULL) /* evhttp freed it already (out of memory) */
    return;
  evutil_socket_t fd = bufferevent_getfd(bev);
  guard_fd *s = cn ? slot(g, fd) : NULL;
  if (s == NULL)
    return; /* unguarded, still served */
  *s = (guard_fd){.bev = bev, .cn = cn};
  evhttp_connection_set_closecb(cn, on_close, g);
  g->open++;
  RD_COUNT(g->l, conns_open, 1);
  uint64_t max = g->l->cfg.max_connections;
  uint32_t nl = g->l->s->n_loops ? g->l->s->n_loops : 1;
  if (max && g->open > (max + nl - 1) / nl)
    refuse(g, s, fd);
}

static void on_admit(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_guard *g = arg;
  for (size_t i = 0; i < g->n_pending; i++) {
    admit_one(g, g->pending[i]);
    bufferevent_decref(g->pending[i]);
  }
  g->n_pending = 0;
}

static struct bufferevent *on_accept(struct event_base *base, void *arg) {
  rd_guard *g = arg;
  struct bufferevent *bev =
      bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
  if (bev == NULL)
    return NULL; /* evhttp makes its own, unguarded */
  rd_errpage_watch(bev);
  if (g->n_pending == g->cap_pending) {
    size_t n = g->cap_pending ? 2 * g->cap_pending : 64;
    struct bufferevent **p = realloc(g->pending, n * sizeof *p);
    if (p == NULL)
      return bev; /* unguarded, still served */
    g->pending = p;
    g->cap_pending = n;
  }
  if (g->n_pending == 0)
    event_active(g->admit, EV_TIMEOUT, 0);
  bufferevent_incref(bev); /* this pass only: on_admit drops it */
  g->pending[g->n_pending++] = bev;
  evbuffer_add_cb(bufferevent_get_input(bev), on_input, bev);
  return bev;
}

static void on_complete(struct evhttp_request *hr, void *arg) {
  guard_fd *s = slot_of_conn(arg, evhttp_request_get_connection(hr));
  if (s) { /* the next request's first byte starts its time */
    s->since = 0;
    s->busy = false;
  }
}

bool rd_guard_begin(rd_guard *g, struct evhttp_request *hr) {
  guard_fd *s = g ? slot_of_conn(g, evhttp_request_get_connection(hr)) : NULL;
  if (s == NULL)
    return true;
  if (s->refused)
    return false;
  s->busy = true;
  evhttp_request_set_on_complete_cb(hr, on_complete, g);
  return true;
}

void rd_guard_on_gone(rd_guard *g, struct evhttp_request *hr,
                      void (*cb)(struct evhttp_connection *, void *),
                      void *arg) {
  struct evhttp_connection *cn = evhttp_request_get_connection(hr);
  guard_fd *s = g ? slot_of_conn(g, cn) : NULL;
  if (s) {
    s->gone = cb;
    s->gone_arg = arg;
  } else if (cn) {
    evhttp_connection_set_closecb(cn, cb, arg);
  }
}

/* thread 0, before the loops run */
int rd_guard_create(rd_loop *l, rd_guard **out) {
  rd_guard *g = calloc(1, sizeof *g);
  size_t i = 0;
  while (i < RD_THREADS_MAX && guards[i].base && guards[i].base != l->base)
    i++;
  if (g == NULL || i == RD_THREADS_MAX)
    goto fail;
  g->l = l;
  g->admit = event_new(l->base, -1, 0, on_admit, g);
  if (g->admit == NULL)
    goto fail;
  guards[i].base = l->base;
  guards[i].g = g;
  evhttp_set_bevcb(l->http, on_accept, g);
  *out = g;
  return 0;
fail:
  free(g);
  return -1;
}

/* after evhttp_free (every connection closed: on_close ran for each) */
void rd_guard_destroy(rd_guard *g) {
  if (g == NULL)
    return;
  for (size_t i = 0; i < RD_THREADS_MAX; i++)
    if (guards[i].g == g)
      guards[i].g = NULL, guards[i].base = NULL;
  for (size_t i = 0; i < g->n_pending; i++)
    bufferevent_decref(g->pending[i]);
  if (g->admit)
    event_free(g->admit);
  free(g->pending);
  free(g->fd);
  free(g);
}
