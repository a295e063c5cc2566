/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd replicas: what only one replica knows -- its routing
 * decisions (with the approximate residency they create), its in-flight
 * load per worker, its completions -- published on NATS core subjects and
 * applied by its peers, so any replica's decision sees the whole fleet's
 * in-flight load within a bounded lag (docs/routerd.md#replicas).  The KV
 * events themselves reach every replica directly (ZeroMQ) or from
 * JetStream (`kvplane events relay`).
 *
 * libnats runs on the daemon's loop (natsOptions_SetEventLoop): it reads
 * and writes its socket when the loop says it can, and the subscription is
 * synchronous, drained on the loop right after each read -- no reader,
 * flusher or delivery thread between a peer's message and its use (each was
 * a thread wake-up per message).  NATS down: replicas
 * route on local state (peers' contributions expire after peer_timeout),
 * counted and visible; libnats reconnects forever and snapshots resync.
 * With routerd.threads > 1 every loop publishes its own decisions and
 * completions (natsConnection_Publish is thread-safe; the bases are, with
 * evthread); peers' messages are applied on thread 0, under the routing
 * lock where they touch the router. */
#include "rd.h"
#include "rd_sync_msg.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/thread.h>
#include <nats/nats.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PEERS_MAX 64
#define TURNS_MAX 4096  /* peers' session turns in flight, direct-mapped */
#define RETIRED_MAX 1024 /* turns retired here, awaiting their completion */

typedef struct peer {
  uint32_t replica;
  bool used;
  double last_seen;
  uint64_t *req, *tok; /* per worker slot */
} peer;

/* A session's turn a peer routed, in flight there (its decision named the
 * session).  When the session's next turn reaches this replica first, that
 * turn is over -- a client sends the next turn after the last reply -- but
 * the peer's completion may still be on its way: it is published as the
 * reply ends, and on a loaded host the client's next request can arrive
 * before it.  Counted, it makes the session's own worker look one request
 * busier and moves the session (docs/routerd.md#replicas).  Direct-mapped
 * by session: a collision forgets the older turn, which then completes as
 * before. */
typedef struct peer_turn {
  uint64_t session, request_id, tokens;
  uint32_t replica, slot;
} peer_turn;

typedef struct retired_turn {
  uint64_t request_id; /* 0: free */
  uint32_t replica;
} retired_turn;

struct rd_sync {
  rd_server *s;
  natsOptions *opts;
  natsConnection *nc;
  natsSubscription *sub;    /* synchronous: drained on the loop */
  natsConnection *el_nc;    /* the connection libnats attached */
  struct event *ev_r, *ev_w; /* its socket on the loop */
  struct event *ev_snap;
  atomic_int connected;
  atomic_int closed; /* libnats' last callback ran (rd_sync_stop waits) */
  atomic_ullong disconnects, reconnects;
  /* peers, turns and retired: under the routing lock (rd_lock): thread 0
   * applies peers' messages, any loop retires a turn as it routes */
  peer peers[PEERS_MAX];
  peer_turn turns[TURNS_MAX];
  retired_turn retired[RETIRED_MAX];
  _Atomic uint64_t n_retired, n_retired_done;
  char subj[3][160];
  uint32_t replica; /* replicas.replica_id (restart-only), read by any loop */
  /* published from any loop */
  _Atomic uint64_t pub[4], pub_fail, skipped_down;
  /* written by thread 0 only (the subscription is drained there), read by
   * /metrics on any loop: single-writer atomics (Y_COUNT) */
  atomic_uint_fast64_t recv[4], malformed, newer, unknown_worker, own;
  pthread_mutex_t lag_mu; /* thread 0 records, any loop's /metrics reads */
  kvp_hist *lag; /* ns */
};

/* a counter only thread 0 writes: a relaxed load and store, no locked add
 * (as RD_COUNT) */
#define Y_COUNT(v)                                                             \
  atomic_store_explicit(&(v), atomic_load_explicit(&(v), memory_order_relaxed) \
                                  + 1, memory_order_relaxed)
#define Y_READ(v) ((unsigned long long)atomic_load_explicit(&(v),             \
                                                            memory_order_relaxed))

static uint64_t wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- libnats' callbacks (its threads) ------------------------------------------ */
static void on_disconnected(natsConnection *nc, void *arg) {
  (void)nc;
  rd_sync *y = arg;
  atomic_store_explicit(&y->connected, 0, memory_order_relaxed);
  atomic_fetch_add_explicit(&y->disconnects, 1, memory_order_relaxed);
}

/* libnats runs its callbacks on its own thread after natsConnection_Close
 * returns; the closed callback comes last: stop waits for it before
 * freeing what the others touch. */
static void on_closed(natsConnection *nc, void *arg) {
  (void)nc;
  atomic_store_explicit(&((rd_sync *)arg)->closed, 1, memory_order_release);
}

static void on_reconnected(natsConnection *nc, void *arg) {
  (void)nc;
  rd_sync *y = arg;
  atomic_store_explicit(&y->connected, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&y->reconnects, 1, memory_order_relaxed);
}

/* ---- peers' state ---------------------------------------------------------------- */
/* Under the routing lock (the router, shared with the front-door loops). */
static void resum(rd_sync *y, uint32_t slot) {
  rd_server *s = y->s;
  uint64_t r = 0, t = 0;
  for (int i = 0; i < PEERS_MAX; i++)
    if (y->peers[i].used) {
      r += y->peers[i].req[slot];
      t += y->peers[i].tok[slot];
    }
  s->peer_req[slot] = r;
  s->peer_tok[slot] = t;
  rd_worker_sync(&s->w[slot]);
}

static uint64_t mix64(uint64_t x) { /* splitmix64's finaliser */
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static size_t turn_home(uint64_t session) {
  return (size_t)(mix64(session) & (TURNS_MAX - 1));
}

static retired_turn *retired_home(rd_sync *y, uint32_t replica, uint64_t id) {
  return &y->retired[mix64(id ^ (uint64_t)replica << 40) & (RETIRED_MAX - 1)];
}

static void peer_dec(peer *p, uint32_t slot, uint64_t tokens) {
  p->req[slot] -= p->req[slot] > 0;
  p->tok[slot] -= p->tok[slot] > tokens ? tokens : p->tok[slot];
}

static peer *peer_find(rd_sync *y, uint32_t replica) {
  for (int i = 0; i < PEERS_MAX; i++)
    if (y->peers[i].used && y->peers[i].replica == replica)
      return &y->peers[i];
  return NULL;
}

void rd_sync_turn_over(rd_server *s, uint64_t session_id) {
  rd_sync *y = s->sync;
  if (y == NULL || session_id == 0)
    return;
  peer_turn *t = &y->turns[turn_home(session_id)];
  if (t->session != session_id)
    return;
  t->session = 0;
  peer *p = peer_find(y, t->replica);
  if (p == NULL || t->slot >= s->n_w)
    return;
  peer_dec(p, t->slot, t->tokens);
  resum(y, t->slot);
  *retired_home(y, t->replica, t->request_id) =
      (retired_turn){.request_id = t->request_id, .replica = t->replica};
  atomic_fetch_add_explicit(&y->n_retired, 1, memory_order_relaxed);
}

static void peer_zero(rd_sync *y, peer *p) {
  memset(p->req, 0, y->s->n_w * sizeof *p->req);
  memset(p->tok, 0, y->s->n_w * sizeof *p->tok);
}

static peer *peer_get(rd_sync *y, uint32_t replica) {
  peer *free_p = NULL;
  for (int i = 0; i < PEERS_MAX; i++) {
    if (y->peers[i].used && y->peers[i].replica == replica)
      return &y->peers[i];
    if (!y->peers[i].used && free_p == NULL)
      free_p = &y->peers[i];
  }
  if (free_p) {
    free_p->used = true;
    free_p->replica = replica;
    peer_zero(y, free_p);
    kvp_log(KVP_LOG_INFO, "routerd", "replica %u joined", replica);
  }
  return free_p;
}

/* A completion of a turn retired here (rd_sync_turn_over) was counted
 * down then: true, and the record goes. */
static bool was_retired(rd_sync *y, const rd_sync_msg *m) {
  retired_turn *r = retired_home(y, m->replica, m->request_id);
  if (r->request_id != m->request_id || r->replica != m->replica)
    return false;
  r->request_id = 0;
  atomic_fetch_add_explicit(&y->n_retired_done, 1, memory_order_relaxed);
  return true;
}

/* Under the routing lock. */
static void apply_delta(rd_sync *y, peer *p, uint32_t i, const rd_sync_msg *m) {
  peer_turn *t = m->session_id ? &y->turns[turn_home(m->session_id)] : NULL;
  if (m->type == RD_SYNC_DECISION) {
    p->req[i]++;
    p->tok[i] += m->tokens;
    if (t) { /* the session's next turn here keeps its worker */
      kvp_router_session_set(y->s->router, m->session_id, i);
      *t = (peer_turn){.session = m->session_id, .request_id = m->request_id,
                       .tokens = m->tokens, .replica = m->replica, .slot = i};
    }
  } else {
    if (t && t->session == m->session_id && t->request_id == m->request_id &&
        t->replica == m->replica)
      t->session = 0; /* over before this replica saw the next turn */
    if (!was_retired(y, m))
      peer_dec(p, i, m->tokens);
  }
  resum(y, i);
}

/* Under the routing lock. */
static void apply_snapshot(rd_sync *y, peer *p, const rd_sync_msg *m) {
  peer_zero(y, p);
  for (size_t k = 0; k < m->n_loads; k++) {
    rd_worker *w = rd_worker_find(y->s, m->loads[k].url);
    if (w == NULL) {
      Y_COUNT(y->unknown_worker);
      continue;
    }
    p->req[w->id] = m->loads[k].requests;
    p->tok[w->id] = m->loads[k].tokens;
  }
  for (uint32_t i = 0; i < y->s->n_w; i++)
    resum(y, i);
}

static void handle(rd_sync *y, natsMsg *nm) {
  rd_sync_msg m;
  int rc = rd_sync_decode(natsMsg_GetData(nm), (size_t)natsMsg_GetDataLength(nm), &m);
  if (rc != 0) {
    if (rc < 0)
      Y_COUNT(y->malformed);
    else
      Y_COUNT(y->newer);
    return;
  }
  if (m.replica == y->replica) {
    /* not echoed (NoEcho): another process runs with this replica id */
    Y_COUNT(y->own);
    if (Y_READ(y->own) == 1)
      kvp_log(KVP_LOG_ERROR, "routerd", "another replica publishes with this "
              "replica's id %u: give each replica its own replicas.id "
              "(its messages are ignored)", m.replica);
  } else {
    uint64_t now = wall_ns();
    Y_COUNT(y->recv[m.type]);
    pthread_mutex_lock(&y->lag_mu);
    kvp_hist_record(y->lag, now > m.wall_ns ? now - m.wall_ns : 0);
    pthread_mutex_unlock(&y->lag_mu);
    rd_worker *w = NULL;
    if (m.type != RD_SYNC_SNAPSHOT &&
        (w = rd_worker_find(y->s, m.url)) == NULL) {
      Y_COUNT(y->unknown_worker);
      rd_sync_msg_free(&m);
      return;
    }
    if (w && m.type == RD_SYNC_DECISION && m.n_keys) /* lock-free index */
      kvp_index_record_routed(y->s->ix, w->id, m.keys, m.n_keys, kvp_now_ns());
    rd_lock(y->s);
    peer *p = peer_get(y, m.replica);
    if (p) {
      p->last_seen = rd_now();
      if (m.type == RD_SYNC_SNAPSHOT)
        apply_snapshot(y, p, &m);
      else
        apply_delta(y, p, w->id, &m);
    }
    rd_unlock(y->s);
  }
  rd_sync_msg_free(&m);
}

static void drain(rd_sync *y) {
  natsMsg *m;
  while (y->sub && natsSubscription_NextMsg(&m, y->sub, 0) == NATS_OK) {
    handle(y, m);
    natsMsg_Destroy(m);
  }
}

/* ---- libnats on the loop (natsOptions_SetEventLoop) ------------------------------
 * As libnats' own libevent adapter does it, plus the drain after a read.
 * libnats attaches again after a reconnect and asks for write polling from
 * its own threads (pings, reconnects): the base is thread-safe (evthread,
 * rd_sync_thread_safe before the base exists). */
static void el_on_io(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  rd_sync *y = arg;
  if (what & EV_READ) {
    natsConnection_ProcessReadEvent(y->el_nc);
    drain(y);
  }
  if (what & EV_WRITE)
    natsConnection_ProcessWriteEvent(y->el_nc);
}

static void el_free(rd_sync *y) {
  if (y->ev_r)
    event_free(y->ev_r);
  if (y->ev_w)
    event_free(y->ev_w);
  y->ev_r = y->ev_w = NULL;
}

static natsStatus el_attach(void **ud, void *loop, natsConnection *nc,
                            natsSock fd) {
  rd_sync *y = loop;
  *ud = y;
  el_free(y); /* a reconnect: the old socket's events */
  y->el_nc = nc;
  y->ev_r = event_new(y->s->base, fd, EV_READ | EV_PERSIST, el_on_io, y);
  y->ev_w = event_new(y->s->base, fd, EV_WRITE | EV_PERSIST, el_on_io, y);
  return y->ev_r && y->ev_w && event_add(y->ev_r, NULL) == 0 ? NATS_OK
                                                             : NATS_ERR;
}

static natsStatus el_poll(struct event *ev, bool add) {
  int rc = ev == NULL ? -1 : add ? event_add(ev, NULL) : event_del_noblock(ev);
  return rc == 0 ? NATS_OK : NATS_ERR;
}

static natsStatus el_read(void *ud, bool add) {
  return el_poll(((rd_sync *)ud)->ev_r, add);
}

static natsStatus el_write(void *ud, bool add) {
  return el_poll(((rd_sync *)ud)->ev_w, add);
}

static natsStatus el_detach(void *ud) {
  el_free(ud);
  return NATS_OK;
}

int rd_sync_thread_safe(void) {
  return evthread_use_pthreads();
}

/* ---- publishing --------------------------------------------------------------- */
static void publish(rd_sync *y, const rd_sync_msg *m) {
  if (!atomic_load_explicit(&y->connected, memory_order_relaxed)) {
    /* a delta would arrive stale: snapshots resync */
    atomic_fetch_add_explicit(&y->skipped_down, 1, memory_order_relaxed);
    return;
  }
  char *b = NULL;
  size_t n = 0;
  if (rd_sync_encode(m, &b, &n) < 0 ||
      natsConnection_Publish(y->nc, y->subj[m->type - 1], b, (int)n) != NATS_OK)
    atomic_fetch_add_explicit(&y->pub_fail, 1, memory_order_relaxed);
  else
    atomic_fetch_add_explicit(&y->pub[m->type], 1, memory_order_relaxed);
  free(b);
}

void rd_sync_decision(rd_server *s, const char *url, const kvp_decision *d,
                      const kvp_key *keys, size_t n_keys) {
  if (s->sync == NULL)
    return;
  rd_sync_msg m = {.type = RD_SYNC_DECISION,
                   .replica = s->sync->replica,
                   .wall_ns = wall_ns(),
                   .request_id = d->request_id,
                   .tokens = d->uncached_tokens,
                   .session_id = d->session_id,
                   .keys = (kvp_key *)keys,
                   .n_keys = n_keys < RD_SYNC_KEYS_MAX ? n_keys : RD_SYNC_KEYS_MAX};
  snprintf(m.url, sizeof m.url, "%s", url);
  publish(s->sync, &m);
}

void rd_sync_complete(rd_server *s, const char *url, uint64_t request_id,
                      uint64_t tokens, uint64_t session_id) {
  if (s->sync == NULL)
    return;
  rd_sync_msg m = {.type = RD_SYNC_COMPLETE,
                   .replica = s->sync->replica,
                   .wall_ns = wall_ns(),
                   .request_id = request_id,
                   .tokens = tokens,
                   .session_id = session_id};
  snprintf(m.url, sizeof m.url, "%s", url);
  publish(s->sync, &m);
}

/* Every snapshot_interval: this replica's in-flight per worker (the
 * deltas' correction), and peers not heard for peer_timeout expire. */
static void on_snapshot(evutil_socket_t fd, short what, void *arg) {
  (void)fd, (void)what;
  rd_sync *y = arg;
  rd_server *s = y->s;
  rd_sync_load *l = calloc(s->n_w ? s->n_w : 1, sizeof *l);
  rd_sync_msg m = {.type = RD_SYNC_SNAPSHOT,
                   .replica = y->replica,
                   .wall_ns = wall_ns(),
                   .loads = l};
  rd_lock(s); /* the router's in-flight, which every loop changes */
  for (uint32_t i = 0; l && i < s->n_w; i++) {
    if (s->w[i].state == RD_W_FREE)
      continue;
    snprintf(l[m.n_loads].url, RD_SYNC_URL_MAX, "%s", s->w[i].url);
    kvp_router_inflight(s->router, i, &l[m.n_loads].requests,
                        &l[m.n_loads].tokens, NULL);
    m.n_loads++;
  }
  rd_unlock(s);
  if (l)
    publish(y, &m);
  free(l);
  double now = rd_now();
  rd_lock(s);
  for (int i = 0; i < PEERS_MAX; i++) {
    peer *p = &y->peers[i];
    if (p->used && now - p->last_seen > s->cfg.peer_timeout_s) {
      kvp_log(KVP_LOG_WARN, "routerd", "replica %u silent for %.1f s: its "
              "load no longer counts", p->replica, now - p->last_seen);
      p->used = false;
      peer_zero(y, p);
      for (uint32_t k = 0; k < s->n_w; k++)
        resum(y, k);
    }
  }
  rd_unlock(s);
}

/* ---- set-up ------------------------------------------------------------------- */
static int nats_fail(char *err, size_t cap, const char *what, natsStatus st) {
  snprintf(err, cap, "NATS %s: %s", what, natsStatus_GetText(st));
  return -1;
}

static int connect_nats(rd_sync *y, char *err, size_t cap) {
  natsStatus st;
  if ((st = natsOptions_Create(&y->opts)) != NATS_OK ||
      (st = natsOptions_SetURL(y->opts, y->s->cfg.nats_url)) != NATS_OK ||
      (st = natsOptions_SetMaxReconnect(y->opts, -1)) != NATS_OK ||
      (st = natsOptions_SetReconnectWait(y->opts, 250)) != NATS_OK ||
      (st = natsOptions_SetRetryOnFailedConnect(y->opts, true, NULL, NULL)) != NATS_OK ||
      (st = natsOptions_SetDisconnectedCB(y->opts, on_disconnected, y)) != NATS_OK ||
      (st = natsOptions_SetReconnectedCB(y->opts, on_reconnected, y)) != NATS_OK ||
      (st = natsOptions_SetClosedCB(y->opts, on_closed, y)) != NATS_OK ||
      (st = natsOptions_SetEventLoop(y->opts, y, el_attach, el_read, el_write,
                                     el_detach)) != NATS_OK ||
      /* a publish asks the loop to write (this pass's messages in one write);
       * without it libnats' flusher thread waits ~1 ms to batch */
      (st = natsOptions_SetSendAsap(y->opts, true)) != NATS_OK ||
      /* the server does not send a replica its own messages back: a third
       * of what a 3-replica fleet's replica would receive and drop */
      (st = natsOptions_SetNoEcho(y->opts, true)) != NATS_OK ||
      (st = natsOptions_SetName(y->opts, "kvplane-routerd")) != NATS_OK)
    return nats_fail(err, cap, "options", st);
  st = natsConnection_Connect(&y->nc, y->opts);
  if (st != NATS_OK && st != NATS_NOT_YET_CONNECTED)
    return nats_fail(err, cap, y->s->cfg.nats_url, st);
  atomic_store(&y->connected, st == NATS_OK);
  if (st == NATS_NOT_YET_CONNECTED)
    kvp_log(KVP_LOG_WARN, "routerd", "NATS %s not reachable yet: routing on "
            "local state until it is", y->s->cfg.nats_url);
  char wild[176];
  snprintf(wild, sizeof wild, "%s.*", y->s->cfg.subject_prefix);
  if ((st = natsConnection_SubscribeSync(&y->sub, y->nc, wild)) != NATS_OK ||
      (st = natsSubscription_SetPendingLimits(y->sub, -1, -1)) != NATS_OK)
    return nats_fail(err, cap, "subscribe", st);
  return 0;
}

int rd_sync_start(rd_server *s, char *err, size_t cap) {
  rd_sync *y = calloc(1, sizeof *y);
  if (y == NULL || (s->peer_req = calloc(s->n_w, sizeof *s->peer_req)) == NULL ||
      (s->peer_tok = calloc(s->n_w, sizeof *s->peer_tok)) == NULL)
    return snprintf(err, cap, "out of memory"), free(y), -1;
  pthread_mutex_init(&y->lag_mu, NULL);
  s->sync = y;
  y->s = s;
  y->replica = s->cfg.ropts.replica_id;
  const char *sfx[3] = {"decision", "complete", "snapshot"};
  for (int i = 0; i < 3; i++)
    snprintf(y->subj[i], sizeof y->subj[i], "%s.%s", s->cfg.subject_prefix, sfx[i]);
  for (int i = 0; i < PEERS_MAX; i++) {
    y->peers[i].req = calloc(s->n_w, sizeof(uint64_t));
    y->peers[i].tok = calloc(s->n_w, sizeof(uint64_t));
    if (!y->peers[i].req || !y->peers[i].tok)
      return snprintf(err, cap, "out of memory"), -1;
  }
  struct timeval tv = rd_tv(s->cfg.snapshot_interval_s);
  if (kvp_hist_create(NULL, &y->lag) < 0 ||
      (y->ev_snap = event_new(s->base, -1, EV_PERSIST, on_snapshot, y)) == NULL ||
      event_add(y->ev_snap, &tv) < 0)
    return snprintf(err, cap, "sync set-up failed"), -1;
  return connect_nats(y, err, cap);
}

void rd_sync_stop(rd_server *s) {
  rd_sync *y = s->sync;
  if (y == NULL)
    return;
  if (y->sub) {
    natsSubscription_Unsubscribe(y->sub);
    natsSubscription_Destroy(y->sub);
  }
  if (y->nc) {
    natsConnection_Close(y->nc);
    /* pairs with on_closed's release store; bounded: 5 s */
    for (int i = 0; i < 5000 && !atomic_load_explicit(&y->closed,
                                                      memory_order_acquire); i++)
      usleep(1000);
    natsConnection_Destroy(y->nc);
  }
  natsOptions_Destroy(y->opts);
  el_free(y); /* never attached (NATS never reached), or detached already */
  if (y->ev_snap)
    event_free(y->ev_snap);
  for (int i = 0; i < PEERS_MAX; i++)
    free(y->peers[i].req), free(y->peers[i].tok);
  kvp_hist_destroy(y->lag);
  pthread_mutex_destroy(&y->lag_mu);
  free(y);
  s->sync = NULL;
  free(s->peer_req);
  free(s->peer_tok);
  s->peer_req = s->peer_tok = NULL;
}

void rd_sync_metrics(rd_server *s, struct evbuffer *b) {
  rd_sync *y = s->sync;
  if (y == NULL)
    return;
  int peers = 0;
  for (int i = 0; i < PEERS_MAX; i++)
    peers += y->peers[i].used;
  kvp_hist_summary h;
  pthread_mutex_lock(&y->lag_mu);
  kvp_hist_summarize(y->lag, &h);
  pthread_mutex_unlock(&y->lag_mu);
  const char *t[4] = {"", "decision", "complete", "snapshot"};
  evbuffer_add_printf(b, "# TYPE kvplane_routerd_sync_connected gauge\n"
      "kvplane_routerd_sync_connected %d\n# TYPE kvplane_routerd_sync_peers gauge\n"
      "kvplane_routerd_sync_peers %d\n# TYPE kvplane_routerd_sync_published_total counter\n"
      "# TYPE kvplane_routerd_sync_received_total counter\n",
      atomic_load(&y->connected), peers);
  for (int i = 1; i < 4; i++)
    evbuffer_add_printf(b, "kvplane_routerd_sync_published_total{type=\"%s\"} %llu\n"
                        "kvplane_routerd_sync_received_total{type=\"%s\"} %llu\n",
                        t[i], (unsigned long long)atomic_load(&y->pub[i]), t[i],
                        Y_READ(y->recv[i]));
  evbuffer_add_printf(b, "# TYPE kvplane_routerd_sync_errors_total counter\n"
      "kvplane_routerd_sync_errors_total{reason=\"publish\"} %llu\n"
      "kvplane_routerd_sync_errors_total{reason=\"skipped_while_down\"} %llu\n"
      "kvplane_routerd_sync_errors_total{reason=\"malformed\"} %llu\n"
      "kvplane_routerd_sync_errors_total{reason=\"newer_version\"} %llu\n"
      "kvplane_routerd_sync_errors_total{reason=\"unknown_worker\"} %llu\n"
      "kvplane_routerd_sync_errors_total{reason=\"duplicate_replica_id\"} %llu\n"
      "# TYPE kvplane_routerd_sync_disconnects_total counter\n"
      "kvplane_routerd_sync_disconnects_total %llu\n"
      "# TYPE kvplane_routerd_sync_lag_seconds summary\n"
      "kvplane_routerd_sync_lag_seconds{quantile=\"0.5\"} %.9f\n"
      "kvplane_routerd_sync_lag_seconds{quantile=\"0.99\"} %.9f\n"
      "kvplane_routerd_sync_lag_seconds_count %llu\n"
      "# HELP kvplane_routerd_sync_turns_retired_total peers' session turns this "
      "replica counted over when the session's next turn reached it before the "
      "peer's completion (done: that completion arrived)\n"
      "# TYPE kvplane_routerd_sync_turns_retired_total counter\n"
      "kvplane_routerd_sync_turns_retired_total{state=\"retired\"} %llu\n"
      "kvplane_routerd_sync_turns_retired_total{state=\"done\"} %llu\n",
      (unsigned long long)atomic_load(&y->pub_fail),
      (unsigned long long)atomic_load(&y->skipped_down),
      Y_READ(y->malformed), Y_READ(y->newer), Y_READ(y->unknown_worker),
      Y_READ(y->own),
      (unsigned long long)atomic_load(&y->disconnects), (double)h.p50 * 1e-9,
      (double)h.p99 * 1e-9, (unsigned long long)h.count,
      (unsigned long long)atomic_load(&y->n_retired),
      (unsigned long long)atomic_load(&y->n_retired_done));
}
