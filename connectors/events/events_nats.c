/* SPDX-License-Identifier: Apache-2.0 */
/* KV events read back from NATS JetStream: one ordered push consumer per
 * worker subject, messages queued by libnats' threads, fed into
 * kvp_events_feed on the caller's thread; a keeper thread (re)subscribes
 * while the stream is missing or a subscription died, and starts every
 * source over when the stream was made again (numbered from 1). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nats/nats.h>

#include "events_internal.h"
#include "kvplane/events_nats.h"

#define JS_MOD "events-js"
#define QUEUE_CAP 65536u   /* messages received, not yet fed */
#define POLL_BUDGET 1024   /* messages fed per take from the queue */
#define RETRY_MS 250       /* reconnect and resubscribe period */
#define HEARTBEAT_NS 1000000000ll /* ordered consumer: a lost one resets */
#define CHECK_NS 1000000000ull    /* the stream's identity, checked this often */
#define DONE_WAIT_MS 2000         /* for libnats to finish a subscription */

#define JS_STATS(X)                                                           \
  X(messages) X(fed) X(bad_messages) X(disconnects) X(reconnects)             \
  X(subscribes) X(subscribe_errors) X(stream_resets)

typedef struct js_src {
  kvp_events_js *js;
  uint32_t idx;
  char *subject;
  natsSubscription *sub;       /* the keeper's (and destroy's, after it) */
  size_t made, done; /* subscriptions made, and those libnats is done with
                        (under js->mu) */
  _Atomic uint64_t last_stream_seq; /* of the last message fed */
  /* the stream's incarnation this source reads: bumped by the keeper when
   * the stream was made again (release; on_msg and poll acquire), followed
   * by poll, which then starts the source over (fed_epoch, its store pairs
   * with the keeper's acquire in read_from) */
  _Atomic uint32_t epoch, fed_epoch;
} js_src;

typedef struct qent {
  natsMsg *m;
  uint32_t src;
  uint32_t epoch; /* the source's when it arrived */
} qent;

struct kvp_events_js {
  kvp_events *ev;
  const kvp_allocator *a; /* ev's: every allocation here goes through it */
  natsOptions *opts;
  natsConnection *nc;
  jsCtx *jc;
  char *stream;
  js_src *src;
  size_t n;
  pthread_mutex_t mu; /* the queue, stopping, js_src.made/done */
  pthread_cond_t cv_data, cv_room, cv_keeper, cv_done;
  qent *q;
  size_t q_head, q_len;
  bool stopping, keeper_started;
  bool closed; /* libnats' closed callback ran: none of its callbacks follow */
  pthread_t keeper;
  int64_t created;     /* the stream's creation time (keeper's) */
  uint64_t checked_ns; /* when the keeper last looked at it */
#define JS_FIELD_(n) _Atomic uint64_t n;
  JS_STATS(JS_FIELD_)
#undef JS_FIELD_
  _Atomic uint64_t subscribed;
};

static void add(_Atomic uint64_t *c, uint64_t v) {
  atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static uint64_t get(const _Atomic uint64_t *c) {
  return atomic_load_explicit(c, memory_order_relaxed);
}

static struct timespec deadline_in(int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

/* ---- libnats' threads ----------------------------------------------------------- */

/* A message for source s->idx: queued; a full queue holds this delivery
 * thread back (and the consumer's flow control with it). */
static void on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *m,
                   void *closure) {
  js_src *s = closure;
  kvp_events_js *js = s->js;
  (void)nc, (void)sub;
  add(&js->messages, 1);
  pthread_mutex_lock(&js->mu);
  while (js->q_len == QUEUE_CAP && !js->stopping)
    pthread_cond_wait(&js->cv_room, &js->mu);
  if (js->stopping) {
    pthread_mutex_unlock(&js->mu);
    natsMsg_Destroy(m);
    return;
  }
  uint32_t ep = atomic_load_explicit(&s->epoch, memory_order_acquire);
  js->q[(js->q_head + js->q_len++) % QUEUE_CAP] = (qent){m, s->idx, ep};
  pthread_cond_signal(&js->cv_data);
  pthread_mutex_unlock(&js->mu);
}

static void on_complete(void *closure) {
  js_src *s = closure;
  kvp_events_js *js = s->js;
  pthread_mutex_lock(&js->mu);
  s->done++;
  pthread_cond_broadcast(&js->cv_done);
  pthread_mutex_unlock(&js->mu);
}

static void on_disconnected(natsConnection *nc, void *closure) {
  (void)nc;
  add(&((kvp_events_js *)closure)->disconnects, 1);
}

/* The last callback libnats makes on a connection (its async callback
 * thread runs after natsConnection_Close returns): destroy waits for it, or
 * a disconnected callback queued before it would touch freed memory (ASan
 * saw it in bench_relay). */
static void on_closed(natsConnection *nc, void *closure) {
  kvp_events_js *js = closure;
  (void)nc;
  pthread_mutex_lock(&js->mu);
  js->closed = true;
  pthread_cond_broadcast(&js->cv_done);
  pthread_mutex_unlock(&js->mu);
}

static void on_connected(natsConnection *nc, void *closure) {
  kvp_events_js *js = closure;
  (void)nc;
  pthread_mutex_lock(&js->mu); /* subscribe now */
  pthread_cond_signal(&js->cv_keeper);
  pthread_mutex_unlock(&js->mu);
}

static void on_reconnected(natsConnection *nc, void *closure) {
  kvp_events_js *js = closure;
  (void)nc;
  add(&js->reconnects, 1);
  pthread_mutex_lock(&js->mu); /* resubscribe what needs it now */
  pthread_cond_signal(&js->cv_keeper);
  pthread_mutex_unlock(&js->mu);
}

/* ---- the keeper: subscriptions ---------------------------------------------------- */

/* Under js->mu. */
static bool all_done(const kvp_events_js *js) {
  for (size_t i = 0; i < js->n; i++)
    if (js->src[i].done < js->src[i].made)
      return false;
  return true;
}

/* Until libnats is done with every subscription unsubscribed (their
 * on_complete ran: no more on_msg for them), or ms passed. */
static void wait_all_done(kvp_events_js *js, int ms) {
  pthread_mutex_lock(&js->mu);
  struct timespec dl = deadline_in(ms);
  while (!all_done(js) &&
         pthread_cond_timedwait(&js->cv_done, &js->mu, &dl) != ETIMEDOUT)
    ;
  pthread_mutex_unlock(&js->mu);
}

static int connected(const kvp_events_js *js) {
  return js != NULL && js->nc != NULL &&
         natsConnection_Status(js->nc) == NATS_CONN_STATUS_CONNECTED;
}

/* The stream sequence of the last message fed from the stream's present
 * incarnation; 0 until poll started the source over on it. */
static uint64_t read_from(js_src *s) {
  uint32_t fed = atomic_load_explicit(&s->fed_epoch, memory_order_acquire);
  return fed == atomic_load_explicit(&s->epoch, memory_order_relaxed)
             ? get(&s->last_stream_seq)
             : 0;
}

/* From the stream's first message, or after the last one fed. */
static void subscribe(kvp_events_js *js, js_src *s) {
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = js->stream;
  so.Ordered = true;
  so.Config.Heartbeat = HEARTBEAT_NS;
  uint64_t last = read_from(s);
  so.Config.DeliverPolicy = last ? js_DeliverByStartSequence : js_DeliverAll;
  so.Config.OptStartSeq = last ? last + 1 : 0;
  jsErrCode jerr = 0;
  natsSubscription *sub = NULL;
  natsStatus st = js_Subscribe(&sub, js->jc, s->subject, on_msg, s, NULL, &so,
                               &jerr);
  if (st == NATS_OK)
    st = natsSubscription_SetOnCompleteCB(sub, on_complete, s);
  if (st != NATS_OK) {
    if (get(&js->subscribe_errors) % 40 == 0) /* every ~10 s of trying */
      kvp_log(KVP_LOG_WARN, JS_MOD, "subscribe %s (stream %s): %s (%d)",
              s->subject, js->stream, natsStatus_GetText(st), (int)jerr);
    add(&js->subscribe_errors, 1);
    natsSubscription_Destroy(sub);
    return;
  }
  s->sub = sub;
  pthread_mutex_lock(&js->mu);
  s->made++;
  pthread_mutex_unlock(&js->mu);
  add(&js->subscribes, 1);
  add(&js->subscribed, 1);
}

/* A subscription libnats gave up on (its consumer could not be made
 * again): dropped here, made again after the last message fed. */
static void check_sub(kvp_events_js *js, js_src *s) {
  if (s->sub != NULL && natsSubscription_IsValid(s->sub))
    return;
  if (s->sub != NULL) {
    natsSubscription_Destroy(s->sub);
    s->sub = NULL;
    atomic_fetch_sub_explicit(&js->subscribed, 1, memory_order_relaxed);
  }
  if (connected(js))
    subscribe(js, s);
}

/* The stream was deleted and made again -- a memory stream gone with its
 * server, a wiped file store -- and numbers from 1 again: what was read no
 * longer says where to resume.  Seen as another creation time, or as a
 * last sequence below one already fed (read before the stream's, so a
 * message arriving meanwhile cannot look like one from the future). */
static bool stream_recreated(kvp_events_js *js) {
  uint64_t now = kvp_now_ns();
  if (now - js->checked_ns < CHECK_NS || !connected(js))
    return false;
  uint64_t fed = 0;
  for (size_t i = 0; i < js->n; i++) {
    uint64_t f = read_from(&js->src[i]);
    fed = f > fed ? f : fed;
  }
  jsStreamInfo *si = NULL;
  if (js_GetStreamInfo(&si, js->jc, js->stream, NULL, NULL) != NATS_OK)
    return false; /* missing (being made again), or NATS just went: again
                     on the keeper's next round */
  js->checked_ns = now;
  bool again = (js->created != 0 && si->Created != js->created) ||
               fed > si->State.LastSeq;
  js->created = si->Created;
  jsStreamInfo_Destroy(si);
  return again;
}

/* Every source's subscription ended (waiting up to DONE_WAIT_MS for
 * libnats to deliver no more), then a new epoch: poll starts each source
 * over and drops what the old subscriptions had queued; check_sub
 * subscribes from the stream's first message. */
static void start_over(kvp_events_js *js) {
  add(&js->stream_resets, 1);
  kvp_log(KVP_LOG_WARN, JS_MOD, "stream %s was made again (its sequence "
          "numbers start over): reading it from its start", js->stream);
  for (size_t i = 0; i < js->n; i++)
    if (js->src[i].sub != NULL)
      (void)natsSubscription_Unsubscribe(js->src[i].sub);
  wait_all_done(js, DONE_WAIT_MS);
  for (size_t i = 0; i < js->n; i++) {
    js_src *s = &js->src[i];
    if (s->sub != NULL) {
      natsSubscription_Destroy(s->sub);
      s->sub = NULL;
      atomic_fetch_sub_explicit(&js->subscribed, 1, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&s->epoch, 1, memory_order_release);
  }
}

static void *keeper(void *arg) {
  kvp_events_js *js = arg;
  pthread_mutex_lock(&js->mu);
  while (!js->stopping) {
    pthread_mutex_unlock(&js->mu);
    if (stream_recreated(js))
      start_over(js);
    /* nothing is read before the stream's creation time is known: a stream
     * made again before the first look would not be told from this one (a
     * refilled one soon has more messages than were fed) */
    for (size_t i = 0; js->created != 0 && i < js->n; i++)
      check_sub(js, &js->src[i]);
    pthread_mutex_lock(&js->mu);
    struct timespec dl = deadline_in(RETRY_MS);
    if (!js->stopping)
      pthread_cond_timedwait(&js->cv_keeper, &js->mu, &dl);
  }
  pthread_mutex_unlock(&js->mu);
  return NULL;
}

/* ---- polling ---------------------------------------------------------------------- */

/* Strict decimal u64. */
static bool parse_seq(const char *v, uint64_t *out) {
  uint64_t x = 0;
  if (v == NULL || *v == 0)
    return false;
  for (; *v; v++) {
    if (*v < '0' || *v > '9' || x > (UINT64_MAX - (uint64_t)(*v - '0')) / 10)
      return false;
    x = x * 10 + (uint64_t)(*v - '0');
  }
  *out = x;
  return true;
}

static int feed_one(kvp_events_js *js, const qent *e) {
  js_src *s = &js->src[e->src];
  if (e->epoch != atomic_load_explicit(&s->fed_epoch, memory_order_relaxed))
    return 0; /* from the stream before it was made again */
  jsMsgMetaData *meta = NULL;
  if (natsMsg_GetMetaData(&meta, e->m) == NATS_OK) {
    atomic_store_explicit(&s->last_stream_seq, meta->Sequence.Stream,
                          memory_order_relaxed);
    jsMsgMetaData_Destroy(meta);
  }
  const char *v = NULL;
  uint64_t seq;
  if (natsMsgHeader_Get(e->m, "Kvp-Seq", &v) != NATS_OK || !parse_seq(v, &seq)) {
    add(&js->bad_messages, 1);
    kvp_log(KVP_LOG_DEBUG, JS_MOD, "%s: message without a valid Kvp-Seq: "
            "skipped", s->subject);
    return 0;
  }
  int len = natsMsg_GetDataLength(e->m);
  int rc = kvp_events_feed(js->ev, s->idx, seq, natsMsg_GetData(e->m),
                           len > 0 ? (size_t)len : 0);
  if (rc == 0)
    add(&js->fed, 1);
  return rc < 0 ? rc : 1;
}

/* Up to POLL_BUDGET queued messages into `out`, waiting up to timeout_ms for
 * the first. */
static size_t take(kvp_events_js *js, qent *out, int timeout_ms) {
  pthread_mutex_lock(&js->mu);
  if (js->q_len == 0 && timeout_ms > 0) {
    struct timespec dl = deadline_in(timeout_ms);
    while (js->q_len == 0 && !js->stopping &&
           pthread_cond_timedwait(&js->cv_data, &js->mu, &dl) != ETIMEDOUT)
      ;
  }
  size_t n = 0;
  for (; n < POLL_BUDGET && js->q_len > 0; n++, js->q_len--) {
    out[n] = js->q[js->q_head];
    js->q_head = (js->q_head + 1) % QUEUE_CAP;
  }
  if (n > 0)
    pthread_cond_broadcast(&js->cv_room);
  pthread_mutex_unlock(&js->mu);
  return n;
}

/* The keeper saw the stream made again: each source's index residency and
 * sequence state go, as for a reader that starts now.  After take(): every
 * message taken carries an epoch at most the one followed here (on_msg read
 * it before queueing under the mutex take() held since). */
static int follow_epochs(kvp_events_js *js) {
  for (size_t i = 0; i < js->n; i++) {
    js_src *s = &js->src[i];
    uint32_t ep = atomic_load_explicit(&s->epoch, memory_order_acquire);
    if (ep == atomic_load_explicit(&s->fed_epoch, memory_order_relaxed))
      continue;
    int rc = kvp__ev_source_restart(js->ev, s->idx);
    if (rc < 0)
      return rc; /* KVP_ESTATE: the caller's mistake, as in feed */
    atomic_store_explicit(&s->last_stream_seq, 0, memory_order_relaxed);
    /* pairs with read_from's acquire: the keeper resumes from here */
    atomic_store_explicit(&s->fed_epoch, ep, memory_order_release);
  }
  return 0;
}

int kvp_events_js_poll(kvp_events_js *js, int timeout_ms) {
  if (js == NULL)
    return KVP_EINVAL;
  qent got[POLL_BUDGET];
  size_t n = take(js, got, timeout_ms);
  int fed = 0, err = follow_epochs(js);
  for (size_t i = 0; i < n; i++) {
    int rc = err ? 0 : feed_one(js, &got[i]);
    if (rc < 0)
      err = rc; /* the caller's mistake (KVP_ESTATE): the rest is dropped */
    else
      fed += rc;
    natsMsg_Destroy(got[i].m);
  }
  return err ? err : fed;
}

int kvp_events_js_connected(const kvp_events_js *js) {
  return connected(js) ? 1 : 0;
}

/* ---- create / destroy ------------------------------------------------------------- */

static bool name_ok(const char *s) {
  if (s == NULL || *s == 0)
    return false;
  for (; *s; s++)
    if (*s == '.' || *s == '*' || *s == '>' || (unsigned char)*s <= ' ' ||
        *s == 0x7f)
      return false;
  return true;
}

static int nats_err(const char *what, natsStatus st) {
  kvp_log(KVP_LOG_ERROR, JS_MOD, "%s: %s", what, natsStatus_GetText(st));
  return st == NATS_INVALID_ARG || st == NATS_ERR ? KVP_EINVAL
         : st == NATS_NO_MEMORY                   ? KVP_ENOMEM
                                                  : KVP_EIO;
}

/* Retries forever (also the first connect), every RETRY_MS. */
static int connect_nats(kvp_events_js *js, const char *url) {
  natsStatus st = natsOptions_Create(&js->opts);
  if (st == NATS_OK)
    st = natsOptions_SetURL(js->opts, url);
  if (st == NATS_OK)
    st = natsOptions_SetName(js->opts, "kvplane-events-js");
  if (st == NATS_OK)
    st = natsOptions_SetMaxReconnect(js->opts, -1);
  if (st == NATS_OK)
    st = natsOptions_SetReconnectWait(js->opts, RETRY_MS);
  if (st == NATS_OK)
    st = natsOptions_SetTimeout(js->opts, 1000);
  if (st == NATS_OK)
    /* with a callback, the first connect retries in the background */
    st = natsOptions_SetRetryOnFailedConnect(js->opts, true, on_connected, js);
  if (st == NATS_OK)
    st = natsOptions_SetDisconnectedCB(js->opts, on_disconnected, js);
  if (st == NATS_OK)
    st = natsOptions_SetReconnectedCB(js->opts, on_reconnected, js);
  if (st == NATS_OK)
    st = natsOptions_SetClosedCB(js->opts, on_closed, js);
  if (st != NATS_OK)
    return nats_err("NATS options", st);
  st = natsConnection_Connect(&js->nc, js->opts);
  if (st != NATS_OK && st != NATS_NOT_YET_CONNECTED) {
    kvp_log(KVP_LOG_ERROR, JS_MOD, "connect %s: %s", url, natsStatus_GetText(st));
    return st == NATS_NO_MEMORY ? KVP_ENOMEM : KVP_EINVAL;
  }
  if (st == NATS_NOT_YET_CONNECTED)
    kvp_log(KVP_LOG_WARN, JS_MOD, "%s unreachable: retrying in the background",
            url);
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = 2000;
  st = natsConnection_JetStream(&js->jc, js->nc, &jo);
  return st == NATS_OK ? 0 : nats_err("JetStream context", st);
}

static int make_sources(kvp_events_js *js, const char *prefix,
                        const char *const *names) {
  js->src = kvp__ev_calloc(js->a, js->n, sizeof *js->src);
  if (js->src == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; i < js->n; i++) {
    js_src *s = &js->src[i];
    s->js = js;
    s->idx = (uint32_t)i;
    atomic_init(&s->last_stream_seq, 0);
    atomic_init(&s->epoch, 0);
    atomic_init(&s->fed_epoch, 0);
    size_t len = strlen(prefix) + strlen(names[i]) + 2;
    if ((s->subject = kvp__ev_alloc(js->a, len)) == NULL)
      return KVP_ENOMEM;
    snprintf(s->subject, len, "%s.%s", prefix, names[i]);
  }
  return 0;
}

static int check_args(kvp_events *ev, const char *const *names, size_t n,
                      const char *prefix) {
  if (ev == NULL || names == NULL || n == 0 || n != kvp__ev_source_count(ev))
    return KVP_EINVAL;
  if (prefix[0] == 0 || prefix[strlen(prefix) - 1] == '.' ||
      strpbrk(prefix, "*> \t") != NULL) {
    kvp_log(KVP_LOG_ERROR, JS_MOD, "bad subject prefix \"%s\"", prefix);
    return KVP_EINVAL;
  }
  for (size_t i = 0; i < n; i++) {
    if (!name_ok(names[i])) {
      kvp_log(KVP_LOG_ERROR, JS_MOD, "worker name %zu \"%s\": empty, or "
              "has '.', '*', '>' or white space", i, names[i] ? names[i] : "");
      return KVP_EINVAL;
    }
    if (!kvp__ev_source_external(ev, (uint32_t)i)) {
      kvp_log(KVP_LOG_ERROR, JS_MOD, "source %zu is not external "
              "(endpoint NULL)", i);
      return KVP_ERANGE;
    }
  }
  return 0;
}

static int sync_init(kvp_events_js *js) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&js->mu, NULL);
  pthread_cond_init(&js->cv_data, &ca);
  pthread_cond_init(&js->cv_room, &ca);
  pthread_cond_init(&js->cv_keeper, &ca);
  pthread_cond_init(&js->cv_done, &ca);
  pthread_condattr_destroy(&ca);
  js->q = kvp__ev_calloc(js->a, QUEUE_CAP, sizeof *js->q);
  return js->q != NULL ? 0 : KVP_ENOMEM;
}

int kvp_events_js_create(kvp_events *ev, const kvp_events_js_opts *o,
                         const char *const *names, size_t n,
                         kvp_events_js **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  kvp_events_js_opts d = {0};
  if (o != NULL)
    d = *o;
  const char *prefix = d.subject_prefix ? d.subject_prefix : "kvplane.events";
  int rc = check_args(ev, names, n, prefix);
  if (rc < 0)
    return rc;
  const kvp_allocator *a = kvp__ev_allocator(ev);
  kvp_events_js *js = kvp__ev_calloc(a, 1, sizeof *js);
  if (js == NULL)
    return KVP_ENOMEM;
  js->ev = ev;
  js->a = a;
  js->n = n;
  if ((rc = sync_init(js)) < 0 ||
      (rc = make_sources(js, prefix, names)) < 0)
    goto fail;
  js->stream = kvp__ev_strdup(a, d.stream ? d.stream : "KVPLANE_EVENTS");
  if (js->stream == NULL) {
    rc = KVP_ENOMEM;
    goto fail;
  }
  if ((rc = connect_nats(js, d.url ? d.url : "nats://127.0.0.1:4222")) < 0)
    goto fail;
  if ((rc = -pthread_create(&js->keeper, NULL, keeper, js)) < 0)
    goto fail;
  js->keeper_started = true;
  *out = js;
  return 0;
fail:
  kvp_events_js_destroy(js);
  return rc;
}

/* Unsubscribes and waits (up to 2 s) until libnats delivers no more. */
static void unsubscribe_all(kvp_events_js *js) {
  for (size_t i = 0; i < js->n; i++)
    if (js->src[i].sub != NULL)
      (void)natsSubscription_Unsubscribe(js->src[i].sub);
  wait_all_done(js, DONE_WAIT_MS);
  for (size_t i = 0; i < js->n; i++)
    natsSubscription_Destroy(js->src[i].sub);
}

void kvp_events_js_destroy(kvp_events_js *js) {
  if (js == NULL)
    return;
  pthread_mutex_lock(&js->mu);
  js->stopping = true; /* wakes a delivery held back by a full queue */
  pthread_cond_broadcast(&js->cv_room);
  pthread_cond_broadcast(&js->cv_keeper);
  pthread_mutex_unlock(&js->mu);
  if (js->keeper_started)
    pthread_join(js->keeper, NULL);
  if (js->src != NULL)
    unsubscribe_all(js);
  jsCtx_Destroy(js->jc);
  if (js->nc != NULL) { /* close, then wait for the last callback */
    natsConnection_Close(js->nc);
    pthread_mutex_lock(&js->mu);
    struct timespec dl = deadline_in(5000);
    while (!js->closed &&
           pthread_cond_timedwait(&js->cv_done, &js->mu, &dl) != ETIMEDOUT)
      ;
    pthread_mutex_unlock(&js->mu);
  }
  natsConnection_Destroy(js->nc);
  natsOptions_Destroy(js->opts);
  for (; js->q != NULL && js->q_len > 0; js->q_len--) {
    natsMsg_Destroy(js->q[js->q_head].m);
    js->q_head = (js->q_head + 1) % QUEUE_CAP;
  }
  for (size_t i = 0; js->src != NULL && i < js->n; i++)
    kvp__ev_strfree(js->a, js->src[i].subject);
  kvp__ev_free(js->a, js->src, js->n * sizeof *js->src);
  kvp__ev_free(js->a, js->q, QUEUE_CAP * sizeof *js->q);
  kvp__ev_strfree(js->a, js->stream);
  pthread_cond_destroy(&js->cv_data);
  pthread_cond_destroy(&js->cv_room);
  pthread_cond_destroy(&js->cv_keeper);
  pthread_cond_destroy(&js->cv_done);
  pthread_mutex_destroy(&js->mu);
  kvp__ev_free(js->a, js, sizeof *js);
}

/* ---- stats ------------------------------------------------------------------------ */

int kvp_events_js_stats_get(const kvp_events_js *js, kvp_events_js_stats *out) {
  if (js == NULL || out == NULL)
    return KVP_EINVAL;
  memset(out, 0, sizeof *out);
#define JS_GET_(n) out->n = get(&js->n);
  JS_STATS(JS_GET_)
#undef JS_GET_
  pthread_mutex_lock((pthread_mutex_t *)&js->mu);
  out->queued = js->q_len;
  pthread_mutex_unlock((pthread_mutex_t *)&js->mu);
  out->connected = (uint64_t)connected(js);
  out->subscribed = get(&js->subscribed);
  return 0;
}

int kvp_events_js_prometheus(const kvp_events_js *js, char *buf, size_t cap) {
  kvp_events_js_stats s;
  if (buf == NULL && cap > 0)
    return KVP_EINVAL;
  int rc = kvp_events_js_stats_get(js, &s);
  if (rc < 0)
    return rc;
  size_t len = 0;
#define JS_PROM_(n)                                                            \
  len += (size_t)snprintf(len < cap ? buf + len : NULL, len < cap ? cap - len : 0, \
                          "# TYPE kvplane_events_js_" #n "_total counter\n"    \
                          "kvplane_events_js_" #n "_total %" PRIu64 "\n", s.n);
  JS_STATS(JS_PROM_)
#undef JS_PROM_
  const char *g[3] = {"queued", "connected", "subscribed"};
  uint64_t gv[3] = {s.queued, s.connected, s.subscribed};
  for (int i = 0; i < 3; i++)
    len += (size_t)snprintf(len < cap ? buf + len : NULL,
                            len < cap ? cap - len : 0,
                            "# TYPE kvplane_events_js_%s gauge\n"
                            "kvplane_events_js_%s %" PRIu64 "\n",
                            g[i], g[i], gv[i]);
  return len > INT32_MAX ? KVP_ERANGE : (int)len;
}
