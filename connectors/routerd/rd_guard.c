/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd front-door guard: libevent 2.1's evhttp has an idle
 * timeout only, so a client sending a byte a second keeps a connection (and
 * its memory) for ever, and it takes any number of connections.  Each loop
 * keeps its accepted connections here (evhttp_set_bevcb: their bufferevent,
 * one reference held so a freed one is still safe to look at) and a sweep
 * cuts the ones whose request has not arrived whole within
 * routerd.client_request_timeout of the connection's accept or its last
 * reply; past routerd.max_connections a new connection gets a 503 with
 * Retry-After and is closed.  All on the loop's own thread. */
#include "rd.h"

#include <event2/bufferevent.h>
#include <event2/http_struct.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef struct guard_conn {
  struct bufferevent *bev; /* referenced: valid after evhttp freed it */
  double since;            /* accepted, or its last reply ended */
  bool busy;               /* a request is being answered */
} guard_conn;

struct rd_guard {
  rd_loop *l;
  struct event *sweep;
  guard_conn *c;
  size_t n, cap;
};

/* evhttp freed it (bufferevent_free clears the callbacks) */
static bool gone(struct bufferevent *bev) {
  bufferevent_data_cb rd = NULL, wr = NULL;
  bufferevent_event_cb ev = NULL;
  void *arg;
  bufferevent_getcb(bev, &rd, &wr, &ev, &arg);
  return rd == NULL && ev == NULL;
}

static void drop(rd_guard *g, size_t i) {
  bufferevent_decref(g->c[i].bev);
  g->c[i] = g->c[--g->n];
}

static void collect(rd_guard *g) {
  for (size_t i = 0; i < g->n;)
    if (gone(g->c[i].bev))
      drop(g, i);
    else
      i++;
}

/* the client sees EOF; evhttp reads it and frees the connection */
static void cut(struct bufferevent *bev) {
  evutil_socket_t fd = bufferevent_getfd(bev);
  if (fd >= 0)
    shutdown(fd, SHUT_RDWR);
}

static void on_sweep(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_guard *g = arg;
  double now = rd_now(), limit = g->l->cfg.client_request_timeout_s;
  collect(g);
  for (size_t i = 0; i < g->n; i++)
    if (!g->c[i].busy && now - g->c[i].since > limit) {
      cut(g->c[i].bev);
      g->c[i].since = now + 3600; /* cut once */
      RD_COUNT(g->l, conns_cut, 1);
    }
}

static const char refuse_body[] =
    "{\"error\":{\"message\":\"too many client connections (routerd.max_"
    "connections)\",\"type\":\"ServiceUnavailableError\",\"param\":null,"
    "\"code\":503}}";

/* after evhttp gave the bufferevent its socket: the 503, then EOF */
static void on_refuse(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  struct bufferevent *bev = arg;
  evutil_socket_t s = gone(bev) ? -1 : bufferevent_getfd(bev);
  if (s >= 0) {
    char m[512];
    int n = snprintf(m, sizeof m, "HTTP/1.1 503 Service Unavailable\r\n"
                     "Content-Type: application/json\r\nRetry-After: 1\r\n"
                     "Connection: close\r\nContent-Length: %zu\r\n\r\n%s",
                     sizeof refuse_body - 1, refuse_body);
    ssize_t r = send(s, m, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)r; /* best effort: a full socket buffer just closes */
    shutdown(s, SHUT_RDWR);
  }
  bufferevent_decref(bev);
}

static struct bufferevent *on_accept(struct event_base *base, void *arg) {
  rd_guard *g = arg;
  struct bufferevent *bev =
      bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
  if (bev == NULL)
    return NULL; /* evhttp makes its own */
  uint64_t max = g->l->cfg.max_connections;
  uint32_t nl = g->l->s->n_loops ? g->l->s->n_loops : 1;
  if (g->n >= (max + nl - 1) / nl)
    collect(g);
  if (g->n >= (max + nl - 1) / nl) {
    RD_COUNT(g->l, conns_refused, 1);
    bufferevent_incref(bev);
    struct timeval now = {0, 0};
    if (event_base_once(base, -1, EV_TIMEOUT, on_refuse, bev, &now) < 0)
      bufferevent_decref(bev);
    return bev;
  }
  if (g->n == g->cap) {
    size_t nc = g->cap ? 2 * g->cap : 64;
    guard_conn *c = realloc(g->c, nc * sizeof *c);
    if (c == NULL)
      return bev; /* unguarded, still served */
    g->c = c;
    g->cap = nc;
  }
  bufferevent_incref(bev);
  g->c[g->n++] = (guard_conn){bev, rd_now(), false};
  return bev;
}

static guard_conn *find(rd_guard *g, struct evhttp_request *hr) {
  struct evhttp_connection *cn = evhttp_request_get_connection(hr);
  struct bufferevent *bev = cn ? evhttp_connection_get_bufferevent(cn) : NULL;
  for (size_t i = 0; bev && i < g->n; i++)
    if (g->c[i].bev == bev)
      return &g->c[i];
  return NULL;
}

static void on_complete(struct evhttp_request *hr, void *arg) {
  guard_conn *c = find(arg, hr);
  if (c) {
    c->busy = false;
    c->since = rd_now();
  }
}

void rd_guard_begin(rd_guard *g, struct evhttp_request *hr) {
  guard_conn *c = g ? find(g, hr) : NULL;
  if (c == NULL)
    return;
  c->busy = true;
  evhttp_request_set_on_complete_cb(hr, on_complete, g);
}

int rd_guard_create(rd_loop *l, rd_guard **out) {
  rd_guard *g = calloc(1, sizeof *g);
  if (g == NULL)
    return -1;
  g->l = l;
  struct timeval tv = {0, 250000};
  g->sweep = event_new(l->base, -1, EV_PERSIST, on_sweep, g);
  if (g->sweep == NULL || event_add(g->sweep, &tv) < 0) {
    rd_guard_destroy(g);
    return -1;
  }
  evhttp_set_bevcb(l->http, on_accept, g);
  *out = g;
  return 0;
}

/* after evhttp_free (its connections freed: only references left) */
void rd_guard_destroy(rd_guard *g) {
  if (g == NULL)
    return;
  if (g->sweep)
    event_free(g->sweep);
  for (size_t i = 0; i < g->n; i++)
    bufferevent_decref(g->c[i].bev);
  free(g->c);
  free(g);
}
