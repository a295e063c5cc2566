/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd front-door loops (routerd.threads): loop 0 is thread 0's
 * (s->base); loops 1..N-1 each run on their own thread with their own
 * event_base and evhttp.  With N > 1 every loop listens on its own
 * SO_REUSEPORT socket bound to the same address, and the kernel spreads
 * the connections over them.  Thread 0 posts to the others through each
 * loop's eventfd (a new config, drain, stop): no base is touched from a
 * thread not its own, so libevent runs without its locks, as with one
 * loop. */
#include "rd.h"

#include <errno.h>
#include <event2/dns.h>
#include <event2/listener.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

void rd_lock(rd_server *s) { pthread_mutex_lock(&s->mu); }
void rd_unlock(rd_server *s) { pthread_mutex_unlock(&s->mu); }

/* ---- sockets ------------------------------------------------------------------ */
/* A listening socket on host:port, SO_REUSEPORT when `share`; -1 (errno). */
static evutil_socket_t listen_on(const char *host, uint16_t port, bool share) {
  struct evutil_addrinfo hints = {.ai_family = AF_UNSPEC,
                                  .ai_socktype = SOCK_STREAM,
                                  .ai_flags = EVUTIL_AI_PASSIVE |
                                              EVUTIL_AI_NUMERICSERV},
                         *ai = NULL;
  char ps[8];
  snprintf(ps, sizeof ps, "%u", port);
  if (evutil_getaddrinfo(host, ps, &hints, &ai) != 0 || ai == NULL) {
    errno = EADDRNOTAVAIL;
    return -1;
  }
  evutil_socket_t fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK |
                                                 SOCK_CLOEXEC, 0);
  /* evhttp_bind_socket's backlog, so one loop or several queue alike */
  if (fd < 0 || evutil_make_listen_socket_reuseable(fd) < 0 ||
      (share && evutil_make_listen_socket_reuseable_port(fd) < 0) ||
      bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
    int e = errno;
    if (fd >= 0)
      evutil_closesocket(fd);
    fd = -1;
    errno = e;
  }
  evutil_freeaddrinfo(ai);
  return fd;
}

static uint16_t port_of(evutil_socket_t fd) {
  struct sockaddr_storage a;
  socklen_t n = sizeof a;
  if (getsockname(fd, (struct sockaddr *)&a, &n) < 0)
    return 0;
  return ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port
                                       : ((struct sockaddr_in *)&a)->sin_port);
}

/* SO_REUSEPORT would let these sockets join another process's group on the
 * same port (same user) without a word: a plain bind first says "in use"
 * as the single-loop path does, and resolves port 0 for all the loops. */
static int shared_port(const char *host, uint16_t *port) {
  evutil_socket_t fd = listen_on(host, *port, false);
  if (fd < 0)
    return -1;
  *port = port_of(fd);
  evutil_closesocket(fd);
  return *port ? 0 : -1;
}

static int listen_shared(rd_server *s) {
  char host[RD_URL_MAX];
  uint16_t port;
  if (rd_split_hostport(s->cfg.listen, host, sizeof host, &port) < 0 ||
      shared_port(host, &port) < 0)
    goto fail;
  for (uint32_t i = 0; i < s->n_loops; i++) {
    rd_loop *l = &s->loops[i];
    evutil_socket_t fd = listen_on(host, port, true);
    if (fd < 0)
      goto fail;
    l->sock = evhttp_accept_socket_with_handle(l->http, fd);
    if (l->sock == NULL) {
      evutil_closesocket(fd);
      goto fail;
    }
  }
  return 0;
fail:
  fprintf(stderr, "kvplane-routerd: cannot listen on %s: %s\n", s->cfg.listen,
          strerror(errno));
  return -1;
}

/* ---- posts from thread 0 --------------------------------------------------------- */
static void take_cfg(rd_loop *l) {
  rd_server *s = l->s;
  rd_lock(s);
  l->cfg = s->cfg;
  l->cfg_gen = atomic_load_explicit(&s->cfg_gen, memory_order_relaxed);
  rd_unlock(s);
  rd_http_limits(&l->cfg, l->http);
}

static void stop_accepting(rd_loop *l) {
  if (l->sock) { /* no new connections; open ones finish */
    evhttp_del_accept_socket(l->http, l->sock);
    l->sock = NULL;
  }
}

/* What thread 0 posted: flags it set (release) before writing the eventfd. */
static void on_wake(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  rd_loop *l = arg;
  rd_server *s = l->s;
  uint64_t n;
  if (read(fd, &n, sizeof n) < 0) /* EAGAIN: a post already taken */
    return;
  /* pairs with the release increment in rd_loops_reconfigure */
  if (atomic_load_explicit(&s->cfg_gen, memory_order_acquire) != l->cfg_gen)
    take_cfg(l);
  if (atomic_load_explicit(&s->draining, memory_order_acquire))
    stop_accepting(l);
  if (atomic_load_explicit(&l->stop, memory_order_acquire))
    event_base_loopbreak(l->base);
}

static void post(rd_loop *l) {
  uint64_t one = 1;
  if (l->wake_fd >= 0 && write(l->wake_fd, &one, sizeof one) < 0)
    kvp_log(KVP_LOG_ERROR, "routerd", "front-door thread %u: post: %s",
            l->idx, strerror(errno));
}

void rd_loops_reconfigure(rd_server *s) {
  /* pairs with on_wake's acquire load: the copy reads this cfg */
  atomic_fetch_add_explicit(&s->cfg_gen, 1, memory_order_release);
  for (uint32_t i = 0; i < s->n_loops; i++)
    if (i == 0) /* thread 0's own: now */
      take_cfg(&s->loops[0]);
    else
      post(&s->loops[i]);
}

void rd_loops_drain(rd_server *s) {
  atomic_store_explicit(&s->draining, true, memory_order_release);
  stop_accepting(&s->loops[0]);
  for (uint32_t i = 1; i < s->n_loops; i++)
    post(&s->loops[i]);
}

/* ---- life ------------------------------------------------------------------------ */
static int own_hashers(rd_loop *l) {
  kvp_hasher_opts ho = {.algo = kvp_hasher_algo(l->s->hasher)};
  if (l->idx == 0) { /* thread 0 keeps using s's */
    l->hasher = l->s->hasher;
    l->text_hasher = l->s->text_hasher;
    return 0;
  }
  if (kvp_hasher_create(&l->s->ns, &ho, NULL, &l->hasher) < 0 ||
      kvp_hasher_create(&l->s->text_ns, &ho, NULL, &l->text_hasher) < 0)
    return -1;
  return 0;
}

static int loop_init(rd_server *s, rd_loop *l, uint32_t idx) {
  l->s = s;
  l->idx = idx;
  l->wake_fd = -1;
  l->cfg = s->cfg;
  pthread_mutex_init(&l->hmu, NULL);
  l->base = idx == 0 ? s->base : rd_base_new();
  l->ixm = calloc(s->n_w, sizeof *l->ixm);
  l->wm = calloc(s->n_w, sizeof *l->wm);
  l->pool = calloc(s->n_w, sizeof *l->pool);
  if (l->base == NULL || l->ixm == NULL || l->wm == NULL ||
      l->pool == NULL || own_hashers(l) < 0 ||
      kvp_hist_create(NULL, &l->h_render) < 0 ||
      kvp_hist_create(NULL, &l->h_route) < 0 ||
      kvp_hist_create(NULL, &l->h_wait) < 0 ||
      kvp_hist_create(NULL, &l->h_held) < 0)
    return -1;
  /* pending as long as it lives: the loop runs until told to stop, not
   * until its front door drained */
  l->wake_fd = idx > 0 ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1;
  if (idx > 0 && (l->wake_fd < 0 ||
                  (l->wake = event_new(l->base, l->wake_fd,
                                       EV_READ | EV_PERSIST, on_wake, l)) ==
                      NULL ||
                  event_add(l->wake, NULL) < 0))
    return -1;
  l->dns = evdns_base_new(l->base, EVDNS_BASE_INITIALIZE_NAMESERVERS |
                                        EVDNS_BASE_DISABLE_WHEN_INACTIVE);
  if (l->dns == NULL)
    kvp_log(KVP_LOG_WARN, "routerd", "loop %u: evdns did not start (no "
            "/etc/resolv.conf?): worker host names resolve blocking", idx);
  l->http = rd_http_new(l->base, &l->cfg, rd_on_http, l);
  return l->http && rd_guard_create(l, &l->guard) == 0 ? 0 : -1;
}

int rd_loops_create(rd_server *s) {
  s->n_loops = s->cfg.threads ? s->cfg.threads : 1;
  s->loops = calloc(s->n_loops, sizeof *s->loops);
  if (s->loops == NULL)
    return -1;
  for (uint32_t i = 0; i < s->n_loops; i++)
    if (loop_init(s, &s->loops[i], i) < 0) {
      fprintf(stderr, "kvplane-routerd: cannot make front-door loop %u\n", i);
      return -1;
    }
  if (s->n_loops > 1)
    return listen_shared(s);
  /* one loop: evhttp's own bind, as before threads existed */
  char host[RD_URL_MAX];
  uint16_t port;
  rd_split_hostport(s->cfg.listen, host, sizeof host, &port);
  s->loops[0].sock = evhttp_bind_socket_with_handle(s->loops[0].http, host,
                                                    port);
  if (s->loops[0].sock == NULL) {
    fprintf(stderr, "kvplane-routerd: cannot listen on %s: %s\n",
            s->cfg.listen, strerror(errno));
    return -1;
  }
  return 0;
}

static void *loop_main(void *arg) {
  rd_loop *l = arg;
  event_base_dispatch(l->base);
  return NULL;
}

int rd_loops_start(rd_server *s) {
  for (uint32_t i = 1; i < s->n_loops; i++) {
    int rc = pthread_create(&s->loops[i].th, NULL, loop_main, &s->loops[i]);
    if (rc != 0) {
      fprintf(stderr, "kvplane-routerd: front-door thread %u: %s\n", i,
              strerror(rc));
      return -1;
    }
    s->loops[i].started = true;
  }
  return 0;
}

void rd_loops_stop(rd_server *s) {
  for (uint32_t i = 1; s->loops && i < s->n_loops; i++) {
    rd_loop *l = &s->loops[i];
    if (!l->started)
      continue;
    /* pairs with on_wake's acquire load; a post made before the loop
     * dispatches waits for it in the eventfd */
    atomic_store_explicit(&l->stop, true, memory_order_release);
    post(l);
    pthread_join(l->th, NULL);
    l->started = false;
  }
}

static void pool_free(rd_pool *p) {
  for (size_t i = 0; i < p->n; i++)
    evhttp_connection_free(p->idle[i]);
  free(p->idle);
  memset(p, 0, sizeof *p);
}

/* Threads joined: thread 0 frees what the loops made (their bases are idle). */
static void loop_free(rd_loop *l) {
  if (l->s == NULL) /* never made */
    return;
  for (uint32_t k = 0; l->pool && k < l->s->n_w; k++)
    pool_free(&l->pool[k]);
  free(l->pool);
  if (l->http)
    evhttp_free(l->http);
  rd_guard_destroy(l->guard); /* its references: after evhttp's */
  if (l->dns) /* no connection left that resolves */
    evdns_base_free(l->dns, 0);
  if (l->wake)
    event_free(l->wake);
  if (l->wake_fd >= 0)
    close(l->wake_fd);
  if (l->idx > 0) {
    kvp_hasher_destroy(l->hasher);
    kvp_hasher_destroy(l->text_hasher);
    if (l->base)
      event_base_free(l->base);
  }
  kvp_hist_destroy(l->h_render);
  kvp_hist_destroy(l->h_route);
  kvp_hist_destroy(l->h_wait);
  kvp_hist_destroy(l->h_held);
  free(l->ixm);
  free(l->wm);
  pthread_mutex_destroy(&l->hmu);
}

void rd_loops_free(rd_server *s) {
  for (uint32_t i = 0; s->loops && i < s->n_loops; i++)
    loop_free(&s->loops[i]);
  free(s->loops);
  s->loops = NULL;
}

/* ---- keep-alive pools ----------------------------------------------------------- */
/* Connections made before w's slot was freed or its circuit opened point at
 * a gone or dead peer: dropped here, by the loop that owns them. */
static rd_pool *pool_of(rd_loop *l, rd_worker *w) {
  rd_pool *p = &l->pool[w->id];
  uint64_t g = atomic_load_explicit(&w->gen, memory_order_relaxed);
  if (p->gen != g) {
    for (size_t i = 0; i < p->n; i++)
      evhttp_connection_free(p->idle[i]);
    p->n = 0;
    p->gen = g;
  }
  return p;
}

struct evhttp_connection *rd_conn_get(rd_loop *l, rd_worker *w) {
  rd_pool *p = pool_of(l, w);
  if (p->n > 0)
    return p->idle[--p->n];
  struct evhttp_connection *c =
      evhttp_connection_base_new(l->base, l->dns, w->host, w->port);
  if (c == NULL)
    return NULL;
  struct timeval tv = rd_tv(l->cfg.request_timeout_s);
  evhttp_connection_set_timeout_tv(c, &tv);
  evhttp_connection_set_retries(c, 0);
  return c;
}

#define POOL_MAX 64

void rd_conn_put(rd_loop *l, rd_worker *w, struct evhttp_connection *c) {
  rd_pool *p = pool_of(l, w);
  if (p->n == p->cap && p->cap < POOL_MAX) {
    size_t nc = p->cap ? 2 * p->cap : 8;
    struct evhttp_connection **ni = realloc(p->idle, nc * sizeof *ni);
    if (ni) {
      p->idle = ni;
      p->cap = nc;
    }
  }
  if (p->n < p->cap)
    p->idle[p->n++] = c;
  else
    evhttp_connection_free(c);
}
