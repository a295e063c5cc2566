/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd front-door guard: libevent 2.1's evhttp has an idle
 * timeout only, so a client sending a byte a second keeps a connection (and
 * its memory) for ever.  Each accepted connection's input buffer reports
 * every read here (evhttp_set_bevcb + evbuffer_add_cb, the bufferevent as
 * the callback's argument: alive whenever its buffer calls); per socket the
 * guard keeps when the request now arriving began, and a read that comes
 * more than routerd.client_request_timeout after it shuts the socket down
 * (evhttp then reads EOF and frees the connection as usual).  No reference
 * to the bufferevent is held and no socket is closed here: a held one kept
 * its events past evhttp's free and the epoll changelist then changed a
 * closed fd ("Epoll MOD ... Bad file descriptor").  All on the loop's own
 * thread. */
#include "rd.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef struct guard_fd {
  const struct bufferevent *bev; /* compared only, never dereferenced */
  double since;                  /* the request now arriving began; 0 none */
  bool busy;                     /* it arrived whole: being answered */
} guard_fd;

#define FRESH_MAX 256 /* accepted, not read from yet (a ring) */

struct rd_guard {
  rd_loop *l;
  guard_fd *fd; /* by socket */
  size_t n_fd;
  const struct bufferevent *fresh[FRESH_MAX];
  size_t n_fresh;  /* accepted so far: the ring's next slot */
  size_t waiting;  /* non-NULL entries of fresh: 0, no scan per read */
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

/* whether bev was accepted since its socket's slot was last reset */
static bool take_fresh(rd_guard *g, const struct bufferevent *bev) {
  for (size_t i = 0; g->waiting > 0 && i < FRESH_MAX; i++)
    if (g->fresh[i] == bev) {
      g->fresh[i] = NULL;
      g->waiting--;
      return true;
    }
  return false;
}

static void on_input(struct evbuffer *in, const struct evbuffer_cb_info *info,
                     void *arg) {
  (void)in;
  struct bufferevent *bev = arg;
  if (info->n_added == 0)
    return;
  rd_guard *g = guard_of(bufferevent_get_base(bev));
  evutil_socket_t fd = bufferevent_getfd(bev);
  guard_fd *s = g ? slot(g, fd) : NULL;
  if (s == NULL)
    return;
  double now = rd_now();
  if (take_fresh(g, bev) || s->bev != bev)
    *s = (guard_fd){bev, 0, false};
  if (s->busy)
    return;
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

static struct bufferevent *on_accept(struct event_base *base, void *arg) {
  rd_guard *g = arg;
  struct bufferevent *bev =
      bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
  if (bev == NULL)
    return NULL; /* evhttp makes its own, unguarded */
  const struct bufferevent **f = &g->fresh[g->n_fresh++ % FRESH_MAX];
  g->waiting += *f == NULL; /* a wrapped-over entry: never read from */
  *f = bev;
  evbuffer_add_cb(bufferevent_get_input(bev), on_input, bev);
  return bev;
}

static guard_fd *slot_of(rd_guard *g, struct evhttp_request *hr) {
  struct evhttp_connection *cn = evhttp_request_get_connection(hr);
  struct bufferevent *bev = cn ? evhttp_connection_get_bufferevent(cn) : NULL;
  guard_fd *s = bev ? slot(g, bufferevent_getfd(bev)) : NULL;
  return s && s->bev == bev ? s : NULL;
}

static void on_complete(struct evhttp_request *hr, void *arg) {
  guard_fd *s = slot_of(arg, hr);
  if (s) /* the next request's first byte starts its time */
    *s = (guard_fd){s->bev, 0, false};
}

void rd_guard_begin(rd_guard *g, struct evhttp_request *hr) {
  guard_fd *s = g ? slot_of(g, hr) : NULL;
  if (s == NULL)
    return;
  s->busy = true;
  evhttp_request_set_on_complete_cb(hr, on_complete, g);
}

/* thread 0, before the loops run */
int rd_guard_create(rd_loop *l, rd_guard **out) {
  rd_guard *g = calloc(1, sizeof *g);
  size_t i = 0;
  while (i < RD_THREADS_MAX && guards[i].base && guards[i].base != l->base)
    i++;
  if (g == NULL || i == RD_THREADS_MAX) {
    free(g);
    return -1;
  }
  g->l = l;
  guards[i].base = l->base;
  guards[i].g = g;
  evhttp_set_bevcb(l->http, on_accept, g);
  *out = g;
  return 0;
}

/* after evhttp_free */
void rd_guard_destroy(rd_guard *g) {
  if (g == NULL)
    return;
  for (size_t i = 0; i < RD_THREADS_MAX; i++)
    if (guards[i].g == g)
      guards[i].g = NULL, guards[i].base = NULL;
  free(g->fd);
  free(g);
}
