/* SPDX-License-Identifier: Apache-2.0 */
/* The subscriber: ZeroMQ SUB (+ DEALER for replay) per source, the sequence
 * state machine (in order, exactly once; gaps replayed; restarts detected),
 * an optional I/O thread, stats and their Prometheus text. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>
#include <zmq.h>

#include "events_internal.h"

#define DUP_RING_MIN 8192u
#define DRAIN_BUDGET 4096 /* messages per socket per poll round */
#define SEQ_END UINT64_MAX /* the replay end marker: -1 as 8 bytes */

typedef struct pend {
  uint64_t seq;
  zmq_msg_t payload;
} pend;

typedef struct dup_ent {
  uint64_t seq, hash;
} dup_ent;

typedef struct source {
  kvp_events_source d; /* strings point into the copies below */
  char *endpoint, *replay_endpoint, *topic;
  size_t topic_len;
  void *sub, *dealer;
  ev_apply ap;
  ev_counters ctr;
  void *mon;          /* PAIR end of the SUB's monitor (connects, disconnects) */
  uint64_t next;      /* the publisher's next sequence number */
  bool have_last;     /* batch next-1 was applied in this epoch */
  bool need_verify;   /* the SUB lost a connection: resync on next batch */
  bool replaying;
  bool replay_verify; /* asked from the last batch applied: check it */
  bool replay_probe;  /* asked by an idle probe or after a disconnect: what
                         it brings beyond the last batch was missed live */
  bool probe_found;   /* ... and it brought some (the gap counted once) */
  bool replay_first;  /* a batch came back for this replay */
  bool replay_discard; /* the answer is from another publisher: ignore */
  uint64_t replay_from;
  uint64_t replay_deadline_ns;
  uint64_t last_heard_ns; /* last live batch or probe */
  pend *pending;      /* live batches held while replaying, seq order */
  size_t n_pending;
  dup_ent *ring;      /* recently applied (seq, payload hash) */
  size_t ring_cap;
} source;

struct kvp_events {
  kvp_allocator alloc;
  const kvp_allocator *ap; /* &alloc, or NULL for libc */
  kvp_index *ix;
  kvp_events_opts o;
  void *zctx;
  source *src;
  size_t n_src;
  kvp_kv_decoder *dec;
  kvp_events_batch_fn on_batch;
  void *on_batch_opaque;
  zmq_pollitem_t *items;
  /* One epoll set over every socket's ZMQ_FD: the event-loop form's single
   * fd (kvp_events_fds), stable while sockets are closed and reopened (a
   * reopened DEALER's ZMQ_FD is a new fd; a caller watching the old number
   * would watch a closed fd, then whatever reuses it). */
  int epfd;
  int mode; /* 0 none yet, 1 thread, 2 poll */
  bool started_replays;
  _Atomic bool running;
  pthread_t thread;
};

/* ---- endpoints ------------------------------------------------------------------ */

/* vLLM's offset_endpoint_port: tcp port + rank (port 0 stays), inproc name
 * + "_dp<rank>", anything else refused for rank > 0. */
static char *offset_endpoint(const kvp_allocator *a, const char *ep,
                             uint32_t rank) {
  size_t n = strlen(ep) + 16;
  char *out = kvp__ev_alloc(a, n);
  if (out == NULL)
    return NULL;
  const char *colon = strrchr(ep, ':');
  if (rank == 0) {
    snprintf(out, n, "%s", ep);
  } else if (strncmp(ep, "inproc://", 9) == 0) {
    snprintf(out, n, "%s_dp%" PRIu32, ep, rank);
  } else if (strncmp(ep, "tcp://", 6) == 0 && colon != NULL && colon > ep + 5) {
    char *end;
    unsigned long port = strtoul(colon + 1, &end, 10);
    if (*end != 0 || port > 65535 || port + rank > 65535) {
      kvp__ev_free(a, out, n);
      return NULL;
    }
    snprintf(out, n, "%.*s:%lu", (int)(colon - ep), ep,
             port == 0 ? 0 : port + rank);
  } else {
    kvp__ev_free(a, out, n);
    return NULL;
  }
  return out;
}

/* ---- sockets --------------------------------------------------------------------- */

/* errno's text: zmq_strerror covers system errors too (epoll_ctl). */
static int zerr(const char *what, const char *ep) {
  kvp_log(KVP_LOG_ERROR, EV_MOD, "%s %s: %s", what, ep, zmq_strerror(errno));
  return KVP_EIO;
}

/* Adds (level-triggered) or removes socket `sock`'s ZMQ_FD in ev's epoll
 * set; 0 or -1 (errno). */
static int watch(kvp_events *ev, void *sock, int op) {
  int fd;
  size_t sz = sizeof fd;
  if (zmq_getsockopt(sock, ZMQ_FD, &fd, &sz) != 0)
    return -1;
  struct epoll_event e = {.events = EPOLLIN, .data.fd = fd};
  return epoll_ctl(ev->epfd, op, fd, &e);
}

static bool wants_bind(const source *s) {
  if (s->d.connect == KVP_EVENTS_AUTO)
    return strchr(s->endpoint, '*') != NULL;
  return s->d.connect == KVP_EVENTS_BIND;
}

static int open_sub(kvp_events *ev, source *s) {
  int hwm = ev->o.rcvhwm > 0 ? ev->o.rcvhwm : 100000, zero = 0;
  s->sub = zmq_socket(ev->zctx, ZMQ_SUB);
  if (s->sub == NULL)
    return zerr("zmq_socket(SUB) for", s->endpoint);
  (void)zmq_setsockopt(s->sub, ZMQ_RCVHWM, &hwm, sizeof hwm);
  (void)zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, s->topic, s->topic_len) != 0)
    return zerr("subscribe on", s->endpoint);
  bool bind = wants_bind(s);
  if ((bind ? zmq_bind : zmq_connect)(s->sub, s->endpoint) != 0)
    return zerr(bind ? "bind" : "connect", s->endpoint);
  /* a lost connection may hide a publisher restart: watch for it */
  char mon[64];
  snprintf(mon, sizeof mon, "inproc://kvp-events-mon-%p", (void *)s);
  if (zmq_socket_monitor(s->sub, mon,
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED) != 0 ||
      (s->mon = zmq_socket(ev->zctx, ZMQ_PAIR)) == NULL ||
      zmq_setsockopt(s->mon, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
      /* unbounded: the monitor's send must never block an I/O thread */
      zmq_setsockopt(s->mon, ZMQ_RCVHWM, &zero, sizeof zero) != 0 ||
      zmq_connect(s->mon, mon) != 0)
    return zerr("monitor for", s->endpoint);
  if (watch(ev, s->sub, EPOLL_CTL_ADD) < 0 ||
      watch(ev, s->mon, EPOLL_CTL_ADD) < 0)
    return zerr("epoll_ctl for", s->endpoint);
  return 0;
}

static void close_dealer(kvp_events *ev, source *s) {
  if (s->dealer != NULL) {
    (void)watch(ev, s->dealer, EPOLL_CTL_DEL); /* before its fd closes */
    zmq_close(s->dealer);
  }
  s->dealer = NULL;
}

static int open_dealer(kvp_events *ev, source *s) {
  int zero = 0;
  close_dealer(ev, s);
  s->dealer = zmq_socket(ev->zctx, ZMQ_DEALER);
  if (s->dealer == NULL)
    return zerr("zmq_socket(DEALER) for", s->replay_endpoint);
  (void)zmq_setsockopt(s->dealer, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_connect(s->dealer, s->replay_endpoint) != 0)
    return zerr("connect", s->replay_endpoint);
  if (watch(ev, s->dealer, EPOLL_CTL_ADD) < 0)
    return zerr("epoll_ctl for", s->replay_endpoint);
  return 0;
}

/* ---- the sequence state machine --------------------------------------------------
 * Per source, batches apply in order, each once.  vLLM has no epoch: a
 * restarted publisher numbers from 0 again with nothing in its frames to say
 * so.  A resync therefore asks for a replay from the last batch applied (L)
 * and expects L back with the bytes applied under it: a later first batch
 * means the publisher no longer reaches back (the batches between are lost:
 * the residency is dropped), other bytes or nothing at L mean another
 * publisher (restart: new epoch, replay from 0).  Resyncs run on a gap, on a
 * batch under a passed number that is not a duplicate, after the SUB lost a
 * connection, and as a probe when a source has been quiet (a lost last batch,
 * a restart not seen live). */

static uint64_t now_ns(void) { return kvp_now_ns(); }

static uint64_t hash_bytes(const void *p, size_t n) {
  return XXH3_64bits(p, n);
}

static uint64_t hash_of(zmq_msg_t *m) {
  return hash_bytes(zmq_msg_data(m), zmq_msg_size(m));
}

static bool ring_has(const source *s, uint64_t seq, uint64_t h) {
  const dup_ent *e = &s->ring[seq % s->ring_cap];
  return e->seq == seq && e->hash == h;
}

static void ring_clear(source *s) {
  for (size_t i = 0; i < s->ring_cap; i++)
    s->ring[i] = (dup_ent){UINT64_MAX, 0};
}

/* Decodes and applies batch `seq` (== s->next) of bytes p[0, n); an
 * undecodable batch is a lost batch: the source's residency is dropped. */
static void apply_bytes(kvp_events *ev, source *s, uint64_t seq, const void *p,
                        size_t n, bool replayed) {
  kvp_kv_batch b;
  /* engine hashes need no token ids (the batch callback still sees counts) */
  (void)kvp_kv_decoder_skip_tokens(ev->dec, s->ap.keying == KVP_EVENTS_ENGINE_HASH);
  int rc = kvp_kv_decode(ev->dec, p, n, &b);
  s->next = seq + 1;
  s->ring[seq % s->ring_cap] = (dup_ent){seq, hash_bytes(p, n)};
  if (rc < 0) {
    ev_add(&s->ctr.decode_errors, 1);
    kvp_log(KVP_LOG_WARN, EV_MOD, "%s: batch %" PRIu64 " undecodable (%s): "
            "dropping this source's residency", s->endpoint, seq,
            kvp_err_name(rc));
    kvp__ev_apply_drop(&s->ap);
    s->have_last = false;
    return;
  }
  s->have_last = true;
  (void)kvp__ev_apply_batch(&s->ap, &b);
  if (replayed)
    ev_add(&s->ctr.batches_replayed, 1);
  if (ev->on_batch != NULL)
    ev->on_batch(ev->on_batch_opaque, (uint32_t)(s - ev->src), seq, &b);
}

static void apply(kvp_events *ev, source *s, uint64_t seq, zmq_msg_t *m,
                  bool replayed) {
  apply_bytes(ev, s, seq, zmq_msg_data(m), zmq_msg_size(m), replayed);
}

/* Batches [next, seq) are gone for good: what they removed may still be in
 * the index, so the source's residency goes and the stream restarts at seq. */
static void lost_until(source *s, uint64_t seq) {
  if (s->dealer != NULL)
    ev_add(&s->ctr.replay_failures, 1);
  kvp__ev_apply_drop(&s->ap);
  s->have_last = false;
  s->next = seq;
}

static void restarted(source *s, const char *how) {
  ev_add(&s->ctr.restarts, 1);
  kvp_log(KVP_LOG_INFO, EV_MOD, "%s: publisher restarted (%s): new epoch",
          s->endpoint, how);
  kvp__ev_apply_new_epoch(&s->ap);
  ring_clear(s);
  s->next = 0;
  s->have_last = false;
}

static void set_replaying(source *s, bool on) {
  s->replaying = on;
  ev_set(&s->ctr.replaying, on);
}

static void send_replay(kvp_events *ev, source *s, uint64_t from, bool verify) {
  uint8_t req[8];
  for (int i = 0; i < 8; i++)
    req[i] = (uint8_t)(from >> (56 - 8 * i));
  ev_add(&s->ctr.replays, 1);
  if (zmq_send(s->dealer, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(s->dealer, req, 8, ZMQ_DONTWAIT) < 0) {
    kvp_log(KVP_LOG_WARN, EV_MOD, "%s: replay request failed: %s",
            s->replay_endpoint, zmq_strerror(errno));
    (void)open_dealer(ev, s); /* drop a half-sent request */
    ev_add(&s->ctr.replay_failures, 1);
    set_replaying(s, false);
    return;
  }
  set_replaying(s, true);
  s->replay_from = from;
  s->replay_verify = verify;
  s->replay_probe = s->probe_found = false;
  s->replay_first = s->replay_discard = false;
  uint32_t t = ev->o.replay_timeout_ms ? ev->o.replay_timeout_ms : 2000;
  s->replay_deadline_ns = now_ns() + (uint64_t)t * 1000000u;
}

/* From the last batch applied (checked), or from the next one when there is
 * none in this epoch. */
static void resync(kvp_events *ev, source *s) {
  if (s->dealer == NULL || s->replaying)
    return;
  s->last_heard_ns = now_ns();
  send_replay(ev, s, s->have_last ? s->next - 1 : s->next, s->have_last);
}

/* A resync not started by a gap seen live (an idle probe, a reconnect):
 * batches it finds past the last one were lost without a trace -- a lost
 * tail, or what was sent while disconnected -- and are counted as a gap
 * found late (stats.gaps, batches_missed) as they are applied. */
static void resync_probe(kvp_events *ev, source *s) {
  resync(ev, s);
  s->replay_probe = s->replaying;
}

/* seq waits in the pending queue: it came live during the replay */
static bool pending_has(const source *s, uint64_t seq) {
  for (size_t i = 0; i < s->n_pending; i++)
    if (s->pending[i].seq == seq)
      return true;
  return false;
}

static void pend_push(kvp_events *ev, source *s, uint64_t seq, zmq_msg_t *m) {
  size_t max = ev->o.pending_max ? ev->o.pending_max : 4096;
  if (s->n_pending >= max) {
    ev_add(&s->ctr.queue_drops, 1); /* the next resync recovers it */
    return;
  }
  pend *q = &s->pending[s->n_pending++];
  q->seq = seq;
  zmq_msg_init(&q->payload);
  zmq_msg_move(&q->payload, m);
}

/* After a replay: the live batches held meanwhile, in order.  Those under a
 * passed number are duplicates or were overtaken by the resync (stale); a gap
 * starts another resync, or after a failed replay is a loss. */
static void finish_replay(kvp_events *ev, source *s, bool may_resync) {
  set_replaying(s, false);
  size_t i = 0;
  for (; i < s->n_pending && !s->replaying; i++) {
    pend *q = &s->pending[i];
    if (q->seq < s->next) {
      ev_add(ring_has(s, q->seq, hash_of(&q->payload)) ? &s->ctr.duplicates
                                                       : &s->ctr.stale, 1);
    } else if (q->seq > s->next && may_resync) {
      ev_add(&s->ctr.gaps, 1);
      ev_add(&s->ctr.batches_missed, q->seq - s->next);
      resync(ev, s);
      if (s->replaying)
        break; /* this one and the rest wait for the new replay */
      lost_until(s, q->seq);
      apply(ev, s, q->seq, &q->payload, false);
    } else {
      if (q->seq > s->next)
        lost_until(s, q->seq);
      apply(ev, s, q->seq, &q->payload, false);
    }
    zmq_msg_close(&q->payload);
  }
  size_t left = s->n_pending - i;
  memmove(s->pending, s->pending + i, left * sizeof *s->pending);
  s->n_pending = left;
}

static void count_gap(source *s, uint64_t seq) {
  if (seq > s->next) {
    ev_add(&s->ctr.gaps, 1);
    ev_add(&s->ctr.batches_missed, seq - s->next);
  }
}

/* One live batch of a source without a replay socket (a ZeroMQ one, or an
 * external one fed by kvp_events_feed): nothing to ask, so it starts where
 * it joins, a gap is a loss and a regression with other bytes a restart. */
static void on_live_direct(kvp_events *ev, source *s, uint64_t seq,
                           const void *p, size_t n) {
  if (seq == s->next || (!s->have_last && s->next == 0)) {
    apply_bytes(ev, s, seq, p, n, false);
    return;
  }
  if (seq < s->next && ring_has(s, seq, hash_bytes(p, n))) {
    ev_add(&s->ctr.duplicates, 1);
    return;
  }
  count_gap(s, seq);
  if (seq < s->next)
    restarted(s, "an earlier sequence number with other bytes");
  else
    lost_until(s, seq);
  s->next = seq;
  apply_bytes(ev, s, seq, p, n, false);
}

/* One batch from the live stream. */
static void on_live(kvp_events *ev, source *s, uint64_t seq, zmq_msg_t *m) {
  s->last_heard_ns = now_ns();
  if (s->need_verify && s->dealer != NULL && !s->replaying) {
    s->need_verify = false;
    resync_probe(ev, s);
  }
  if (s->replaying) {
    pend_push(ev, s, seq, m);
    return;
  }
  if (s->dealer == NULL) {
    on_live_direct(ev, s, seq, zmq_msg_data(m), zmq_msg_size(m));
    return;
  }
  if (seq == s->next) {
    apply(ev, s, seq, m, false);
    return;
  }
  if (seq < s->next && ring_has(s, seq, hash_of(m))) {
    ev_add(&s->ctr.duplicates, 1);
    return;
  }
  count_gap(s, seq);
  resync(ev, s);
  pend_push(ev, s, seq, m);
}

size_t kvp__ev_source_count(const kvp_events *ev) { return ev->n_src; }

const kvp_allocator *kvp__ev_allocator(const kvp_events *ev) { return ev->ap; }

bool kvp__ev_source_external(const kvp_events *ev, uint32_t source_id) {
  return source_id < ev->n_src && ev->src[source_id].d.endpoint == NULL;
}

int kvp__ev_source_restart(kvp_events *ev, uint32_t source_id) {
  if (!kvp__ev_source_external(ev, source_id))
    return KVP_ERANGE;
  if (ev->mode == 1)
    return KVP_ESTATE;
  source *s = &ev->src[source_id];
  kvp__ev_apply_drop(&s->ap);
  ring_clear(s);
  s->next = 0;
  s->have_last = false;
  return 0;
}

int kvp_events_feed(kvp_events *ev, uint32_t source_id, uint64_t seq,
                    const void *payload, size_t len) {
  if (ev == NULL || (payload == NULL && len > 0))
    return KVP_EINVAL;
  if (source_id >= ev->n_src || ev->src[source_id].d.endpoint != NULL)
    return KVP_ERANGE; /* out of range, or not an external source */
  if (ev->mode == 1)
    return KVP_ESTATE;
  ev->mode = 2;
  source *s = &ev->src[source_id];
  s->last_heard_ns = now_ns();
  on_live_direct(ev, s, seq, len ? payload : "", len);
  return 0;
}

/* One replayed batch (seq != the end marker). */
static void on_replayed(kvp_events *ev, source *s, uint64_t seq,
                        zmq_msg_t *m) {
  if (!s->replaying || s->replay_discard)
    return; /* an answer we gave up on, or another publisher's */
  if (!s->replay_first) {
    s->replay_first = true;
    if (s->replay_verify && seq == s->replay_from &&
        ring_has(s, seq, hash_of(m)))
      return; /* the publisher we follow: what comes next is new */
    if (s->replay_verify && seq <= s->replay_from) {
      restarted(s, "the replay's batch at the last sequence number differs");
      s->replay_discard = true; /* then a replay from 0 */
      return;
    }
    if (seq > s->next) /* it no longer reaches back */
      lost_until(s, seq);
  }
  if (seq < s->next) {
    ev_add(&s->ctr.duplicates, 1);
    return;
  }
  if (seq > s->next)
    lost_until(s, seq);
  if (s->replay_probe && !pending_has(s, seq)) {
    if (!s->probe_found)
      ev_add(&s->ctr.gaps, 1);
    s->probe_found = true;
    ev_add(&s->ctr.batches_missed, 1);
  }
  apply(ev, s, seq, m, true);
}

static void on_replay_end(kvp_events *ev, source *s) {
  if (!s->replaying)
    return;
  if (s->replay_verify && !s->replay_first && !s->replay_discard)
    restarted(s, "the replay has nothing at the last sequence number");
  if (s->replay_discard || (s->replay_verify && !s->replay_first)) {
    send_replay(ev, s, 0, false);
    return;
  }
  finish_replay(ev, s, true);
}

int kvp_events_resync(kvp_events *ev, uint32_t source_id) {
  if (ev == NULL)
    return KVP_EINVAL;
  if (source_id != UINT32_MAX && source_id >= ev->n_src)
    return KVP_ERANGE;
  if (ev->mode == 1)
    return KVP_ESTATE;
  int n = 0;
  for (size_t i = 0; i < ev->n_src; i++) {
    source *s = &ev->src[i];
    if ((source_id != UINT32_MAX && i != source_id) || s->dealer == NULL ||
        s->replaying)
      continue;
    resync(ev, s);
    n += s->replaying;
  }
  return n;
}

/* ---- receiving ------------------------------------------------------------------- */

#define FRAMES_MAX 5

/* One whole multipart message, without waiting.  Returns its part count
 * (extra parts beyond FRAMES_MAX are read and dropped), 0 when none is
 * there, or -1 on error. */
static int recv_parts(void *sock, zmq_msg_t *f) {
  int n = 0, more = 1;
  while (more) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, sock, n == 0 ? ZMQ_DONTWAIT : 0) < 0) {
      zmq_msg_close(&m);
      return n == 0 && errno == EAGAIN ? 0 : -1;
    }
    more = zmq_msg_more(&m);
    if (n < FRAMES_MAX)
      zmq_msg_move(&f[n], &m);
    zmq_msg_close(&m);
    n++;
  }
  return n;
}

static bool seq_of(zmq_msg_t *m, uint64_t *seq) {
  if (zmq_msg_size(m) != 8)
    return false;
  const uint8_t *p = zmq_msg_data(m);
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | p[i];
  *seq = v;
  return true;
}

static bool topic_ok(source *s, zmq_msg_t *t) {
  if (s->topic_len == 0 ||
      (zmq_msg_size(t) == s->topic_len &&
       memcmp(zmq_msg_data(t), s->topic, s->topic_len) == 0))
    return true;
  ev_add(&s->ctr.topic_mismatch, 1);
  return false;
}

typedef void (*frames_fn)(kvp_events *ev, source *s, zmq_msg_t *f, int n);

/* Receives whole messages from sock, up to DRAIN_BUDGET, into fn. */
static void drain(kvp_events *ev, source *s, void *sock, frames_fn fn) {
  for (int got = 0; got < DRAIN_BUDGET && sock != NULL; got++) {
    zmq_msg_t f[FRAMES_MAX];
    for (int i = 0; i < FRAMES_MAX; i++)
      zmq_msg_init(&f[i]);
    int n = recv_parts(sock, f);
    if (n > 0)
      fn(ev, s, f, n);
    for (int i = 0; i < FRAMES_MAX; i++)
      zmq_msg_close(&f[i]);
    if (n <= 0)
      break;
  }
}

/* Live frames: (topic, seq, payload). */
static void sub_frames(kvp_events *ev, source *s, zmq_msg_t *f, int n) {
  uint64_t seq;
  if (n == 3 && seq_of(&f[1], &seq)) {
    if (topic_ok(s, &f[0]))
      on_live(ev, s, seq, &f[2]);
  } else {
    ev_add(&s->ctr.decode_errors, 1); /* not (topic, seq, payload) */
  }
}

/* Replay frames: vLLM 0.33 ["", topic, seq, payload]; older ["", seq,
 * payload]; the end: seq -1 (with an empty topic and payload). */
static void dealer_frames(kvp_events *ev, source *s, zmq_msg_t *f, int n) {
  uint64_t seq;
  int k = n == 4 ? 2 : 1;
  if ((n != 4 && n != 3) || zmq_msg_size(&f[0]) != 0 || !seq_of(&f[k], &seq)) {
    ev_add(&s->ctr.decode_errors, 1);
  } else if (seq == SEQ_END) {
    on_replay_end(ev, s);
  } else if (n == 3 || topic_ok(s, &f[1])) {
    on_replayed(ev, s, seq, &f[k + 1]);
  }
}

/* Monitor events: [6 bytes: u16 event, u32 value][endpoint]. */
static void mon_frames(kvp_events *ev, source *s, zmq_msg_t *f, int n) {
  (void)ev;
  if (n < 1 || zmq_msg_size(&f[0]) < 2)
    return;
  uint16_t e;
  memcpy(&e, zmq_msg_data(&f[0]), sizeof e);
  if (e == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
    ev_add(&s->ctr.connects, 1);
  } else if (e == ZMQ_EVENT_DISCONNECTED) {
    ev_add(&s->ctr.disconnects, 1);
    s->need_verify = s->dealer != NULL;
  }
}

static void check_timers(kvp_events *ev) {
  uint64_t now = now_ns();
  uint64_t probe = ev->o.probe_idle_ms ? ev->o.probe_idle_ms : 5000;
  for (size_t i = 0; i < ev->n_src; i++) {
    source *s = &ev->src[i];
    if (s->replaying && now >= s->replay_deadline_ns) {
      kvp_log(KVP_LOG_WARN, EV_MOD, "%s: no end of replay from %s in time",
              s->endpoint, s->replay_endpoint);
      ev_add(&s->ctr.replay_failures, 1);
      (void)open_dealer(ev, s); /* a late answer must not end the next one */
      finish_replay(ev, s, false);
    } else if (!s->replaying && s->dealer != NULL &&
               ev->o.probe_idle_ms != UINT32_MAX &&
               now - s->last_heard_ns >= probe * 1000000u) {
      resync_probe(ev, s); /* quiet for a while: check we still follow it */
    }
  }
}

/* The poll's wait: up to the caller's, the nearest replay deadline, and a
 * tenth of a second while probes may fall due. */
static int poll_timeout(kvp_events *ev, int timeout_ms) {
  uint64_t now = now_ns();
  for (size_t i = 0; i < ev->n_src; i++) {
    source *s = &ev->src[i];
    uint64_t left = UINT64_MAX;
    if (s->replaying)
      left = s->replay_deadline_ns > now
                 ? (s->replay_deadline_ns - now) / 1000000u + 1
                 : 0;
    else if (s->dealer != NULL && ev->o.probe_idle_ms != UINT32_MAX)
      left = 100;
    if (left != UINT64_MAX && (timeout_ms < 0 || left < (uint64_t)timeout_ms))
      timeout_ms = (int)left;
  }
  return timeout_ms;
}

static uint64_t applied(const kvp_events *ev) {
  uint64_t n = 0;
  for (size_t i = 0; i < ev->n_src; i++)
    n += atomic_load_explicit(&ev->src[i].ctr.batches, memory_order_relaxed);
  return n;
}

static void add_item(kvp_events *ev, size_t *n, void *sock) {
  if (sock != NULL)
    ev->items[(*n)++] = (zmq_pollitem_t){.socket = sock, .events = ZMQ_POLLIN};
}

static int poll_once(kvp_events *ev, int timeout_ms) {
  if (!ev->started_replays) { /* batches sent before the SUB connected */
    ev->started_replays = true;
    for (size_t i = 0; i < ev->n_src && !ev->o.no_initial_replay; i++)
      resync(ev, &ev->src[i]);
  }
  size_t n = 0;
  for (size_t i = 0; i < ev->n_src; i++) {
    add_item(ev, &n, ev->src[i].sub);
    add_item(ev, &n, ev->src[i].dealer);
    add_item(ev, &n, ev->src[i].mon);
  }
  uint64_t before = applied(ev);
  int rc = zmq_poll(ev->items, (int)n, poll_timeout(ev, timeout_ms));
  if (rc < 0 && errno != EINTR)
    return KVP_EIO;
  /* ZMQ_FD users may call with nothing flagged: drain every socket; the
   * monitor first (a disconnect before the batch that follows it), the
   * replay answers before the live batches they may cover */
  for (size_t i = 0; i < ev->n_src; i++) {
    source *s = &ev->src[i];
    drain(ev, s, s->mon, mon_frames);
    drain(ev, s, s->dealer, dealer_frames);
    drain(ev, s, s->sub, sub_frames);
  }
  check_timers(ev);
  uint64_t d = applied(ev) - before;
  return d > INT32_MAX ? INT32_MAX : (int)d;
}

static void *io_thread(void *arg) {
  kvp_events *ev = arg;
  /* acquire: pairs with the release store in kvp_events_stop */
  while (atomic_load_explicit(&ev->running, memory_order_acquire))
    (void)poll_once(ev, 50);
  return NULL;
}

int kvp_events_poll(kvp_events *ev, int timeout_ms) {
  if (ev == NULL)
    return KVP_EINVAL;
  if (ev->mode == 1)
    return KVP_ESTATE;
  ev->mode = 2;
  return poll_once(ev, timeout_ms);
}

int kvp_events_start(kvp_events *ev) {
  if (ev == NULL)
    return KVP_EINVAL;
  if (ev->mode != 0)
    return KVP_ESTATE;
  atomic_store_explicit(&ev->running, true, memory_order_relaxed);
  int rc = pthread_create(&ev->thread, NULL, io_thread, ev);
  if (rc != 0) {
    atomic_store_explicit(&ev->running, false, memory_order_relaxed);
    return -rc;
  }
  ev->mode = 1;
  return 0;
}

int kvp_events_stop(kvp_events *ev) {
  if (ev == NULL)
    return KVP_EINVAL;
  if (ev->mode != 1)
    return 0;
  /* release: pairs with the acquire in io_thread */
  atomic_store_explicit(&ev->running, false, memory_order_release);
  pthread_join(ev->thread, NULL);
  ev->mode = 2; /* the caller may poll from now on */
  return 0;
}

int kvp_events_fds(kvp_events *ev, int *fds, size_t cap) {
  if (ev == NULL || (fds == NULL && cap > 0))
    return KVP_EINVAL;
  bool sockets = false;
  for (size_t i = 0; i < ev->n_src; i++)
    sockets |= ev->src[i].sub != NULL;
  if (!sockets)
    return 0; /* external sources only: nothing to watch */
  if (cap > 0)
    fds[0] = ev->epfd;
  return 1;
}

int kvp_events_on_batch(kvp_events *ev, kvp_events_batch_fn fn,
                        void *opaque) {
  if (ev == NULL)
    return KVP_EINVAL;
  if (ev->mode == 1)
    return KVP_ESTATE;
  ev->on_batch = fn;
  ev->on_batch_opaque = opaque;
  return 0;
}

/* ---- create / destroy ---------------------------------------------------------- */

static int check_source(kvp_index *ix, const kvp_events_source *d, size_t i) {
  kvp_index_stream_info si;
  const char *why = NULL;
  if (d->endpoint != NULL && d->endpoint[0] == 0)
    why = "endpoint is empty (NULL makes an external source)";
  else if (d->endpoint == NULL && d->replay_endpoint != NULL)
    why = "an external source (endpoint NULL) has no replay_endpoint";
  else if (d->stream >= KVP_INDEX_STREAMS)
    why = "stream is not below KVP_INDEX_STREAMS";
  else if (kvp_index_stream_get(ix, d->worker, d->stream, &si) < 0)
    why = "worker is not added to the index";
  else if (d->keying != KVP_EVENTS_REKEY && d->keying != KVP_EVENTS_ENGINE_HASH)
    why = "keying is not REKEY or ENGINE_HASH";
  else if (d->keying == KVP_EVENTS_REKEY && d->ns == NULL)
    why = "REKEY needs the namespace requests are hashed in (ns)";
  else if (d->keying == KVP_EVENTS_REKEY && d->hasher.algo != KVP_HASH_XXH3_128 &&
           d->hasher.algo != KVP_HASH_SHA256)
    why = "REKEY keys with a native algorithm (xxh3_128 or sha256)";
  else if (d->connect > KVP_EVENTS_BIND)
    why = "connect is not AUTO, CONNECT or BIND";
  if (why == NULL)
    return 0;
  kvp_log(KVP_LOG_ERROR, EV_MOD, "source %zu (%s): %s", i,
          d->endpoint ? d->endpoint : "external", why);
  return KVP_EINVAL;
}

/* The dedup ring, and the live batches held during a replay (not for an
 * external source: it never replays). */
static int ring_init(kvp_events *ev, source *s, bool pending) {
  size_t pmax = ev->o.pending_max ? ev->o.pending_max : 4096;
  s->ring_cap = 2 * pmax > DUP_RING_MIN ? 2 * pmax : DUP_RING_MIN;
  s->ring = kvp__ev_calloc(ev->ap, s->ring_cap, sizeof *s->ring);
  if (pending)
    s->pending = kvp__ev_calloc(ev->ap, pmax, sizeof *s->pending);
  if (s->ring == NULL || (pending && s->pending == NULL))
    return KVP_ENOMEM;
  ring_clear(s);
  return 0;
}

/* An external source: no sockets; kvp_events_feed brings its batches.  Its
 * name in logs and metrics is "external:<i>". */
static int external_init(kvp_events *ev, source *s, size_t i) {
  char name[32];
  snprintf(name, sizeof name, "external:%zu", i);
  s->endpoint = kvp__ev_strdup(ev->ap, name);
  s->topic = kvp__ev_strdup(ev->ap, "");
  if (s->endpoint == NULL || s->topic == NULL)
    return KVP_ENOMEM;
  s->d.endpoint = s->d.replay_endpoint = NULL;
  s->d.topic = s->topic;
  int rc = ring_init(ev, s, false);
  if (rc < 0)
    return rc;
  return kvp__ev_apply_init(&s->ap, ev->ix, ev->ap, &s->d, &s->ctr);
}

static int source_init(kvp_events *ev, source *s, const kvp_events_source *d,
                       size_t i) {
  const kvp_allocator *a = ev->ap;
  int rc = check_source(ev->ix, d, i);
  if (rc < 0)
    return rc;
  s->d = *d;
  if (d->endpoint == NULL)
    return external_init(ev, s, i);
  s->endpoint = offset_endpoint(a, d->endpoint, d->dp_rank);
  s->replay_endpoint = d->replay_endpoint
                           ? offset_endpoint(a, d->replay_endpoint, d->dp_rank)
                           : NULL;
  s->topic = kvp__ev_strdup(a, d->topic ? d->topic : "");
  if (s->endpoint == NULL || s->topic == NULL ||
      (d->replay_endpoint && s->replay_endpoint == NULL)) {
    kvp_log(KVP_LOG_ERROR, EV_MOD, "source %zu (%s): dp_rank %" PRIu32
            " cannot offset this endpoint (tcp port or inproc only)", i,
            d->endpoint, d->dp_rank);
    return KVP_EINVAL;
  }
  s->topic_len = strlen(s->topic);
  s->d.endpoint = s->endpoint;
  s->d.replay_endpoint = s->replay_endpoint;
  s->d.topic = s->topic;
  if ((rc = ring_init(ev, s, true)) < 0)
    return rc;
  if ((rc = kvp__ev_apply_init(&s->ap, ev->ix, a, d, &s->ctr)) < 0)
    return rc;
  if ((rc = open_sub(ev, s)) < 0)
    return rc;
  return s->replay_endpoint ? open_dealer(ev, s) : 0;
}

static void source_fini(kvp_events *ev, source *s) {
  const kvp_allocator *a = ev->ap;
  /* Stop the monitor before closing its reader: libzmq sends monitor events
   * blocking, under the lock that stopping takes, and a PAIR with no peer
   * blocks -- a disconnect after the reader closed would hang both. */
  if (s->sub != NULL)
    (void)zmq_socket_monitor(s->sub, NULL, 0);
  if (s->mon != NULL)
    zmq_close(s->mon);
  if (s->sub != NULL)
    zmq_close(s->sub);
  close_dealer(ev, s);
  for (size_t i = 0; i < s->n_pending; i++)
    zmq_msg_close(&s->pending[i].payload);
  size_t pmax = ev->o.pending_max ? ev->o.pending_max : 4096;
  kvp__ev_free(a, s->pending, pmax * sizeof *s->pending);
  kvp__ev_free(a, s->ring, s->ring_cap * sizeof *s->ring);
  if (s->ap.ix != NULL)
    kvp__ev_apply_fini(&s->ap);
  kvp__ev_strfree(a, s->endpoint);
  kvp__ev_strfree(a, s->replay_endpoint);
  kvp__ev_strfree(a, s->topic);
}

void kvp_events_destroy(kvp_events *ev) {
  if (ev == NULL)
    return;
  (void)kvp_events_stop(ev);
  for (size_t i = 0; i < ev->n_src; i++)
    source_fini(ev, &ev->src[i]);
  if (ev->zctx != NULL)
    zmq_ctx_term(ev->zctx);
  if (ev->epfd >= 0)
    close(ev->epfd);
  kvp_kv_decoder_destroy(ev->dec);
  const kvp_allocator *a = ev->ap;
  kvp_allocator copy = ev->alloc;
  if (a != NULL)
    a = &copy;
  kvp__ev_free(a, ev->items, 3 * ev->n_src * sizeof *ev->items);
  kvp__ev_free(a, ev->src, ev->n_src * sizeof *ev->src);
  kvp__ev_free(a, ev, sizeof *ev);
}

int kvp_events_create(kvp_index *ix, const kvp_events_source *sources,
                      size_t n_sources, const kvp_events_opts *opts,
                      const kvp_allocator *alloc, kvp_events **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  if (ix == NULL || sources == NULL || n_sources == 0 ||
      n_sources > KVP_WORKERS_MAX * KVP_INDEX_STREAMS)
    return KVP_EINVAL;
  kvp_events *ev = kvp__ev_calloc(alloc, 1, sizeof *ev);
  if (ev == NULL)
    return KVP_ENOMEM;
  if (alloc != NULL) {
    ev->alloc = *alloc;
    ev->ap = &ev->alloc;
  }
  ev->ix = ix;
  if (opts != NULL)
    ev->o = *opts;
  int rc = KVP_ENOMEM;
  if ((ev->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0) {
    rc = zerr("epoll_create1", "for the event-loop fd");
    goto fail;
  }
  ev->src = kvp__ev_calloc(ev->ap, n_sources, sizeof *ev->src);
  ev->items = kvp__ev_calloc(ev->ap, 3 * n_sources, sizeof *ev->items);
  ev->zctx = zmq_ctx_new();
  if (ev->src == NULL || ev->items == NULL || ev->zctx == NULL ||
      kvp_kv_decoder_create(ev->ap, &ev->dec) < 0)
    goto fail;
  for (ev->n_src = 0; ev->n_src < n_sources; ev->n_src++)
    if ((rc = source_init(ev, &ev->src[ev->n_src], &sources[ev->n_src],
                          ev->n_src)) < 0) {
      ev->n_src++; /* fini the half-made one too */
      goto fail;
    }
  *out = ev;
  return 0;
fail:
  kvp_events_destroy(ev);
  return rc;
}

/* ---- stats ----------------------------------------------------------------------- */

static double wall_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double bits_d(const _Atomic uint64_t *v) {
  union {
    uint64_t u;
    double d;
  } x = {.u = atomic_load_explicit(v, memory_order_relaxed)};
  return x.d; /* 0 bits: 0.0 */
}

/* the last batch's lag at delivery (not growing while the source is idle) */
static double lag_of(const source *s) { return bits_d(&s->ctr.last_lag_bits); }

/* since the last batch was applied; 0 before the first */
static double idle_of(const source *s) {
  double at = bits_d(&s->ctr.last_applied_bits);
  return at == 0 ? 0.0 : wall_s() - at;
}

static void add_source(const source *s, kvp_events_stats *o) {
#define EV_SUM_(n) o->n += atomic_load_explicit(&s->ctr.n, memory_order_relaxed);
  EV_STATS(EV_SUM_)
#undef EV_SUM_
  double lag = lag_of(s), idle = idle_of(s);
  if (lag > o->lag_seconds)
    o->lag_seconds = lag;
  if (idle > o->idle_seconds)
    o->idle_seconds = idle;
}

int kvp_events_stats_get(kvp_events *ev, uint32_t source_id,
                         kvp_events_stats *out) {
  if (ev == NULL || out == NULL)
    return KVP_EINVAL;
  if (source_id != UINT32_MAX && source_id >= ev->n_src)
    return KVP_ERANGE;
  memset(out, 0, sizeof *out);
  for (size_t i = 0; i < ev->n_src; i++)
    if (source_id == UINT32_MAX || i == source_id)
      add_source(&ev->src[i], out);
  return 0;
}

/* Prometheus label value escaping: backslash, double quote, newline. */
static size_t esc(char *out, size_t cap, const char *s) {
  size_t n = 0;
  for (; *s; s++) {
    const char *r = *s == '\\' ? "\\\\" : *s == '"' ? "\\\"" : *s == '\n' ? "\\n" : NULL;
    char one[2] = {*s, 0};
    for (const char *c = r ? r : one; *c; c++, n++)
      if (n + 1 < cap)
        out[n] = *c;
  }
  if (cap)
    out[n < cap ? n : cap - 1] = 0;
  return n;
}

typedef struct pbuf {
  char *buf;
  size_t cap, len;
} pbuf;

static void pb(pbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void pb(pbuf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = b->len < b->cap ? b->cap - b->len : 0;
  int n = vsnprintf(room ? b->buf + b->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0)
    b->len += (size_t)n;
}

static void prom_family(kvp_events *ev, pbuf *b, const char *name,
                        size_t offset, bool gauge) {
  pb(b, "# TYPE kvplane_events_%s%s %s\n", name, gauge ? "" : "_total",
     gauge ? "gauge" : "counter");
  for (size_t i = 0; i < ev->n_src; i++) {
    const source *s = &ev->src[i];
    char ep[512];
    (void)esc(ep, sizeof ep, s->endpoint);
    uint64_t v = atomic_load_explicit(
        (const _Atomic uint64_t *)((const char *)&s->ctr + offset),
        memory_order_relaxed);
    pb(b, "kvplane_events_%s%s{source=\"%zu\",worker=\"%" PRIu32
          "\",endpoint=\"%s\"} %" PRIu64 "\n",
       name, gauge ? "" : "_total", i, s->d.worker, ep, v);
  }
}

/* a gauge in seconds per source, in fixed point by hand: printf's %f
 * follows LC_NUMERIC, and a host program under a comma-decimal locale would
 * break the exposition */
static void prom_seconds(kvp_events *ev, pbuf *b, const char *name,
                         double (*of)(const source *)) {
  pb(b, "# TYPE kvplane_events_%s gauge\n", name);
  for (size_t i = 0; i < ev->n_src; i++) {
    char ep[512];
    (void)esc(ep, sizeof ep, ev->src[i].endpoint);
    double v = of(&ev->src[i]);
    long long us = (long long)(v * 1e6 + (v < 0 ? -0.5 : 0.5));
    unsigned long long mag = us < 0 ? (unsigned long long)-us : (unsigned long long)us;
    pb(b, "kvplane_events_%s{source=\"%zu\",worker=\"%" PRIu32
          "\",endpoint=\"%s\"} %s%llu.%06llu\n",
       name, i, ev->src[i].d.worker, ep, us < 0 ? "-" : "", mag / 1000000u,
       mag % 1000000u);
  }
}

int kvp_events_prometheus(kvp_events *ev, char *buf, size_t cap) {
  if (ev == NULL || (buf == NULL && cap > 0))
    return KVP_EINVAL;
  pbuf b = {buf, cap, 0};
#define EV_PROM_(n)                                                            \
  prom_family(ev, &b, #n, offsetof(ev_counters, n),                            \
              strcmp(#n, "rekey_entries") == 0 || strcmp(#n, "rekey_bytes") == 0 || \
                  strcmp(#n, "replaying") == 0);
  EV_STATS(EV_PROM_)
#undef EV_PROM_
  prom_seconds(ev, &b, "lag_seconds", lag_of);
  prom_seconds(ev, &b, "idle_seconds", idle_of);
  if (cap > 0 && b.len >= cap)
    buf[cap - 1] = 0;
  return b.len > INT32_MAX ? KVP_ERANGE : (int)b.len;
}
