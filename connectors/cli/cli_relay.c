/* SPDX-License-Identifier: Apache-2.0 */
/* `kvplane events relay`: every engine's KV-event PUB stream (raw frames:
 * topic, 8-byte big-endian seq, payload) into one NATS JetStream stream,
 * subject <prefix>.<worker name>, deduplicated by (worker, seq, payload
 * hash); router replicas read it back with kvp_events_js (events_nats.h). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_events.h"
#include "kvplane.h"

#define EXIT_USAGE 2

#ifndef KVP_HAVE_NATS
int kvp_cli_relay(int argc, char **argv) {
  (void)argc, (void)argv;
  fprintf(stderr, "kvplane events relay: this kvplane was built without "
          "libnats (pkg-config libnats; .ci/deps installs libnats-dev)\n");
  return EXIT_USAGE;
}
#else
#include <nats/nats.h>
#include <xxhash.h>
#include <zmq.h>

static const char relay_usage[] =
    "usage: kvplane events relay --nats URL [options] --worker NAME=PUB[,REPLAY] ...\n"
    "\n"
    "Relays each engine's vLLM KV-event stream (ZeroMQ PUB; REPLAY = its\n"
    "replay ROUTER) into a NATS JetStream stream, subject PREFIX.NAME, with\n"
    "headers Kvp-Seq (the engine's seq) and Nats-Msg-Id NAME:SEQ:XXH3 (the\n"
    "stream's duplicate window drops a batch relayed twice: run two relays\n"
    "for availability).  Router replicas read it back (kvp_events_js).\n"
    "\n"
    "  --nats URL            NATS server (nats://127.0.0.1:4222)\n"
    "  --stream S            JetStream stream (KVPLANE_EVENTS), created or\n"
    "                        updated: subjects PREFIX.>\n"
    "  --subject-prefix P    subject prefix (kvplane.events)\n"
    "  --storage file|memory stream storage (file)\n"
    "  --max-age DUR         drop batches older than DUR (30s, 10m, 2h, 7d;\n"
    "                        0 = never, the default)\n"
    "  --max-bytes SIZE      stream size limit, oldest dropped (1GiB; 0 = none)\n"
    "  --dup-window DUR      duplicate window (2m)\n"
    "  --max-pending N       publishes awaiting their ack (4096)\n"
    "  --stats-every SEC     progress line on stderr every SEC s (10; 0 = off)\n"
    "  --max-batches N       exit after N batches were relayed (tests)\n"
    "  --worker NAME=PUB[,REPLAY]  one engine (repeat); NAME: no '.', '*', '>'\n"
    "With REPLAY, the relay asks for the engine's buffered batches at start\n"
    "(a restarted relay fills what it missed), on a gap, and to refill a\n"
    "stream made again after a reconnect (memory storage).  SIGINT/SIGTERM:\n"
    "waits for the acks in flight (10 s at most), prints {\"relay\": {...}}\n"
    "and exits 0.\n";

#define MAX_WORKERS 1024

typedef struct rworker {
  const char *name;
  char *pub_ep, *replay_ep; /* copies */
  char *subject;
  void *sub, *dealer;
  uint64_t next;  /* the seq expected next */
  bool have;      /* next is known */
  uint64_t in, gaps, missed, replayed, regress, replay_failures;
} rworker;

typedef struct relay_opts {
  const char *url, *stream, *prefix;
  bool memory;
  double max_age_s, dup_window_s;
  uint64_t max_bytes, max_pending, stats_every, max_batches;
  rworker *w;
  size_t n;
} relay_opts;

/* the ack handler's (libnats' thread) and the loop's, under mu */
typedef struct relay_acks {
  pthread_mutex_t mu;
  natsMsg **retry;
  size_t n_retry, cap_retry;
  uint64_t acked, duplicates, errors, lost;
} relay_acks;

typedef struct relay {
  relay_opts *o;
  void *zctx;
  natsOptions *nopts;
  natsConnection *nc;
  jsCtx *jc;
  relay_acks acks;
  _Atomic bool reconnected;
  int64_t stream_created; /* the stream's creation time, as last seen */
  bool stream_new;        /* ... changed at the last ensure_stream */
  uint64_t published, publish_errors, stalls, retried, refills;
  uint64_t give_up_ns; /* flushing: stop waiting for room then */
  uint64_t t0_ns, last_stats_ns, last_in;
} relay;

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig) {
  (void)sig;
  stop_flag = 1;
}

static int usage(const char *what, const char *arg) {
  fprintf(stderr, "kvplane events relay: %s%s%s\n(see kvplane events relay --help)\n",
          what, arg ? " " : "", arg ? arg : "");
  return EXIT_USAGE;
}

/* ---- options ---------------------------------------------------------------------- */

/* kvp_config_parse_duration plus m, h, d. */
static bool parse_dur(const char *s, double *out) {
  size_t n = strlen(s);
  double mul = 0;
  if (n > 1 && s[n - 1] == 'm' && s[n - 2] >= '0' && s[n - 2] <= '9')
    mul = 60;
  else if (n > 1 && s[n - 1] == 'h')
    mul = 3600;
  else if (n > 1 && s[n - 1] == 'd')
    mul = 86400;
  if (mul == 0)
    return kvp_config_parse_duration(s, 1.0, out) == 0;
  char buf[64];
  if (n >= sizeof buf)
    return false;
  memcpy(buf, s, n - 1);
  buf[n - 1] = 0;
  double v;
  if (kvp_config_parse_duration(buf, 1.0, &v) != 0)
    return false;
  *out = v * mul;
  return true;
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out) {
  char *end;
  if (s[0] < '0' || s[0] > '9')
    return false;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != 0 || errno != 0 || v > max)
    return false;
  *out = v;
  return true;
}

static bool name_ok(const char *s, size_t n) {
  if (n == 0)
    return false;
  for (size_t i = 0; i < n; i++)
    if (s[i] == '.' || s[i] == '*' || s[i] == '>' || (unsigned char)s[i] <= ' ')
      return false;
  return true;
}

static char *dup_n(const char *s, size_t n) {
  char *c = malloc(n + 1);
  if (c != NULL) {
    memcpy(c, s, n);
    c[n] = 0;
  }
  return c;
}

/* NAME=PUB[,REPLAY] */
static int parse_worker(relay_opts *o, const char *arg) {
  const char *eq = strchr(arg, '=');
  if (eq == NULL || !name_ok(arg, (size_t)(eq - arg)) || eq[1] == 0)
    return usage("bad --worker (NAME=PUB[,REPLAY]; NAME without '.', '*', '>'):", arg);
  if (o->n == MAX_WORKERS)
    return usage("too many --worker", NULL);
  rworker *w = &o->w[o->n++];
  memset(w, 0, sizeof *w);
  w->name = dup_n(arg, (size_t)(eq - arg));
  const char *comma = strchr(eq + 1, ',');
  w->pub_ep = comma ? dup_n(eq + 1, (size_t)(comma - eq - 1)) : dup_n(eq + 1, strlen(eq + 1));
  w->replay_ep = comma && comma[1] ? dup_n(comma + 1, strlen(comma + 1)) : NULL;
  for (size_t i = 0; i + 1 < o->n; i++)
    if (strcmp(o->w[i].name, w->name) == 0)
      return usage("a worker name twice:", w->name);
  return w->name && w->pub_ep ? 0 : usage("out of memory", NULL);
}

enum { O_NATS = 256, O_STREAM, O_PREFIX, O_STORAGE, O_AGE, O_BYTES, O_DUP,
       O_PENDING, O_STATS, O_MAX, O_WORKER };

static int parse_one(relay_opts *o, int c, const char *a) {
  switch (c) {
  case O_NATS: o->url = a; return 0;
  case O_STREAM: o->stream = a; return 0;
  case O_PREFIX: o->prefix = a; return 0;
  case O_STORAGE:
    if (strcmp(a, "file") != 0 && strcmp(a, "memory") != 0)
      return usage("--storage is file or memory, not", a);
    o->memory = strcmp(a, "memory") == 0;
    return 0;
  case O_AGE: return parse_dur(a, &o->max_age_s) ? 0 : usage("bad --max-age", a);
  case O_DUP:
    return parse_dur(a, &o->dup_window_s) && o->dup_window_s > 0 ? 0
                                                                  : usage("bad --dup-window", a);
  case O_BYTES: return kvp_config_parse_size(a, &o->max_bytes) == 0 ? 0 : usage("bad --max-bytes", a);
  case O_PENDING:
    return parse_u64(a, 1u << 20, &o->max_pending) && o->max_pending ? 0
                                                                    : usage("bad --max-pending", a);
  case O_STATS: return parse_u64(a, 86400, &o->stats_every) ? 0 : usage("bad --stats-every", a);
  case O_MAX: return parse_u64(a, UINT64_MAX, &o->max_batches) ? 0 : usage("bad --max-batches", a);
  case O_WORKER: return parse_worker(o, a);
  default: return usage("bad option", NULL);
  }
}

static int parse_relay(int argc, char **argv, relay_opts *o) {
  static const struct option lo[] = {
      {"nats", required_argument, 0, O_NATS}, {"stream", required_argument, 0, O_STREAM},
      {"subject-prefix", required_argument, 0, O_PREFIX},
      {"storage", required_argument, 0, O_STORAGE}, {"max-age", required_argument, 0, O_AGE},
      {"max-bytes", required_argument, 0, O_BYTES}, {"dup-window", required_argument, 0, O_DUP},
      {"max-pending", required_argument, 0, O_PENDING},
      {"stats-every", required_argument, 0, O_STATS},
      {"max-batches", required_argument, 0, O_MAX}, {"worker", required_argument, 0, O_WORKER},
      {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c, rc = 0;
  optind = 1;
  while (rc == 0 && (c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
    if (c == 'h') {
      fputs(relay_usage, stdout);
      return 0;
    }
    rc = parse_one(o, c, optarg);
  }
  if (rc != 0)
    return rc;
  if (optind != argc)
    return usage("unexpected argument", argv[optind]);
  if (o->url == NULL)
    return usage("--nats URL is required", NULL);
  if (o->n == 0)
    return usage("at least one --worker NAME=PUB[,REPLAY] is required", NULL);
  if (o->prefix[0] == 0 || o->prefix[strlen(o->prefix) - 1] == '.' ||
      strpbrk(o->prefix, "*> \t") != NULL)
    return usage("bad --subject-prefix", o->prefix);
  return -1; /* go on */
}

/* ---- NATS ------------------------------------------------------------------------- */

static void on_ack(jsCtx *jc, natsMsg *m, jsPubAck *pa, jsPubAckErr *pae,
                   void *closure) {
  relay_acks *a = closure;
  (void)jc;
  pthread_mutex_lock(&a->mu);
  if (pa != NULL) {
    a->acked++;
    a->duplicates += pa->Duplicate;
  } else if (pae != NULL && (pae->Err == NATS_TIMEOUT || pae->Err == NATS_NO_RESPONDERS)) {
    a->errors++; /* the ack (or the stream) was not there: sent again */
    if (a->n_retry == a->cap_retry) {
      size_t nc = a->cap_retry ? 2 * a->cap_retry : 256;
      natsMsg **nr = realloc(a->retry, nc * sizeof *nr);
      if (nr != NULL)
        a->retry = nr, a->cap_retry = nc;
    }
    if (a->n_retry < a->cap_retry) {
      a->retry[a->n_retry++] = m;
      m = NULL; /* ours now */
    } else {
      a->lost++;
    }
  } else {
    a->errors++;
    a->lost++;
    fprintf(stderr, "kvplane events relay: publish refused: %s (%d)\n",
            pae && pae->ErrText ? pae->ErrText : "?", pae ? (int)pae->ErrCode : 0);
  }
  pthread_mutex_unlock(&a->mu);
  natsMsg_Destroy(m);
}

static void on_reconnected(natsConnection *nc, void *closure) {
  (void)nc;
  atomic_store_explicit(&((relay *)closure)->reconnected, true,
                        memory_order_relaxed);
}

static void on_disconnected(natsConnection *nc, void *closure) {
  (void)nc, (void)closure;
  fprintf(stderr, "kvplane events relay: NATS disconnected: reconnecting\n");
}

/* Creates the stream, or updates its limits. */
static int ensure_stream(relay *r) {
  const relay_opts *o = r->o;
  char subj[512];
  snprintf(subj, sizeof subj, "%s.>", o->prefix);
  const char *subjects[1] = {subj};
  jsStreamConfig sc;
  jsStreamConfig_Init(&sc);
  sc.Name = o->stream;
  sc.Subjects = subjects;
  sc.SubjectsLen = 1;
  sc.Storage = o->memory ? js_MemoryStorage : js_FileStorage;
  sc.MaxAge = (int64_t)(o->max_age_s * 1e9);
  sc.MaxBytes = o->max_bytes ? (int64_t)o->max_bytes : -1;
  sc.Duplicates = (int64_t)(o->dup_window_s * 1e9);
  sc.Discard = js_DiscardOld;
  jsErrCode je = 0;
  natsStatus st = NATS_ERR;
  int64_t created = 0;
  /* retried for ~5 s: JetStream just started, or another relay creating the
   * same stream at the same moment (a fresh-clone CI run saw one relay of
   * two exit here on a loaded machine) */
  for (int i = 0; i < 20 && st != NATS_OK; i++) {
    if (i > 0)
      nats_Sleep(250);
    jsStreamInfo *si = NULL;
    je = 0;
    st = js_AddStream(&si, r->jc, &sc, NULL, &je);
    if (st != NATS_OK && je == JSStreamNameExistErr) {
      jsStreamInfo_Destroy(si);
      si = NULL;
      st = js_UpdateStream(&si, r->jc, &sc, NULL, &je);
    }
    created = st == NATS_OK && si != NULL ? si->Created : 0;
    jsStreamInfo_Destroy(si);
  }
  if (st != NATS_OK) {
    fprintf(stderr, "kvplane events relay: stream %s: %s (%d) %s\n", o->stream,
            natsStatus_GetText(st), (int)je, nats_GetLastError(NULL));
    return -1;
  }
  /* made again since we last looked (a memory stream after a NATS restart,
   * a wiped store): it lacks everything before now */
  r->stream_new = r->stream_created != 0 && created != r->stream_created;
  r->stream_created = created;
  return 0;
}

static int connect_nats(relay *r) {
  natsStatus st = natsOptions_Create(&r->nopts);
  if (st == NATS_OK) st = natsOptions_SetURL(r->nopts, r->o->url);
  if (st == NATS_OK) st = natsOptions_SetName(r->nopts, "kvplane-events-relay");
  if (st == NATS_OK) st = natsOptions_SetMaxReconnect(r->nopts, -1);
  if (st == NATS_OK) st = natsOptions_SetReconnectWait(r->nopts, 250);
  if (st == NATS_OK) st = natsOptions_SetReconnectBufSize(r->nopts, 64 << 20);
  if (st == NATS_OK) st = natsOptions_SetReconnectedCB(r->nopts, on_reconnected, r);
  if (st == NATS_OK) st = natsOptions_SetDisconnectedCB(r->nopts, on_disconnected, r);
  if (st == NATS_OK) st = natsConnection_Connect(&r->nc, r->nopts);
  if (st != NATS_OK) {
    fprintf(stderr, "kvplane events relay: cannot connect to %s: %s\n", r->o->url,
            natsStatus_GetText(st));
    return -1;
  }
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = 5000;
  jo.PublishAsync.MaxPending = (int64_t)r->o->max_pending;
  jo.PublishAsync.AckHandler = on_ack;
  jo.PublishAsync.AckHandlerClosure = &r->acks;
  jo.PublishAsync.StallWait = 100;
  st = natsConnection_JetStream(&r->jc, r->nc, &jo);
  if (st != NATS_OK) {
    fprintf(stderr, "kvplane events relay: JetStream: %s\n", natsStatus_GetText(st));
    return -1;
  }
  return ensure_stream(r);
}

/* Async publish; while MaxPending acks are outstanding it waits (StallWait
 * at a time), so the relay never holds more than that in flight. */
static void send_msg(relay *r, natsMsg **m) {
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MaxWait = 5000; /* an ack not back by then: sent again (on_ack) */
  for (;;) {
    natsStatus st = js_PublishMsgAsync(r->jc, m, &po);
    if (st == NATS_OK)
      return;
    bool wait = r->give_up_ns ? kvp_now_ns() < r->give_up_ns : !stop_flag;
    if (st == NATS_TIMEOUT && wait) {
      r->stalls++;
      continue;
    }
    r->publish_errors++;
    natsMsg_Destroy(*m);
    *m = NULL;
    return;
  }
}

static void publish(relay *r, rworker *w, uint64_t seq, const void *p, size_t n) {
  char id[320], seqs[24];
  snprintf(id, sizeof id, "%s:%" PRIu64 ":%016" PRIx64, w->name, seq,
           (uint64_t)XXH3_64bits(p, n));
  snprintf(seqs, sizeof seqs, "%" PRIu64, seq);
  natsMsg *m = NULL;
  natsStatus st = natsMsg_Create(&m, w->subject, NULL, p, (int)n);
  if (st == NATS_OK) st = natsMsgHeader_Set(m, "Nats-Msg-Id", id);
  if (st == NATS_OK) st = natsMsgHeader_Set(m, "Kvp-Seq", seqs);
  if (st != NATS_OK) {
    r->publish_errors++;
    natsMsg_Destroy(m);
    return;
  }
  r->published++;
  send_msg(r, &m);
}

static void retry_failed(relay *r) {
  pthread_mutex_lock(&r->acks.mu);
  natsMsg **v = r->acks.retry;
  size_t n = r->acks.n_retry;
  r->acks.retry = NULL;
  r->acks.n_retry = r->acks.cap_retry = 0;
  pthread_mutex_unlock(&r->acks.mu);
  for (size_t i = 0; i < n; i++) {
    r->retried++;
    send_msg(r, &v[i]);
  }
  free(v);
}

/* ---- ZeroMQ ------------------------------------------------------------------------ */

static uint64_t be64(const void *p) {
  const uint8_t *b = p;
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | b[i];
  return v;
}

/* One multipart message into f (at most 4 parts kept); its part count, 0
 * when none is there (or before the deadline, when blocking). */
static int recv_msg(void *sock, zmq_msg_t *f, int flags) {
  int n = 0, more = 1;
  while (more) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, sock, n == 0 ? flags : 0) < 0) {
      zmq_msg_close(&m);
      return n;
    }
    more = zmq_msg_more(&m);
    if (n < 4)
      zmq_msg_move(&f[n], &m);
    zmq_msg_close(&m);
    n++;
  }
  return n;
}

static void close_frames(zmq_msg_t *f) {
  for (int i = 0; i < 4; i++)
    zmq_msg_close(&f[i]);
}

/* Asks the replay socket for batches from `from` and publishes those under
 * `until`, in order; up to 2 s for the end marker. */
static void fetch_replay(relay *r, rworker *w, uint64_t from, uint64_t until) {
  uint8_t req[8];
  for (int i = 0; i < 8; i++)
    req[i] = (uint8_t)(from >> (56 - 8 * i));
  int ms = 2000;
  (void)zmq_setsockopt(w->dealer, ZMQ_RCVTIMEO, &ms, sizeof ms);
  if (zmq_send(w->dealer, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(w->dealer, req, 8, 0) < 0) {
    w->replay_failures++;
    return;
  }
  for (;;) {
    zmq_msg_t f[4];
    for (int i = 0; i < 4; i++)
      zmq_msg_init(&f[i]);
    int n = recv_msg(w->dealer, f, 0);
    int k = n == 4 ? 2 : 1; /* ["", topic, seq, payload] or ["", seq, payload] */
    bool ok = (n == 3 || n == 4) && zmq_msg_size(&f[k]) == 8;
    uint64_t seq = ok ? be64(zmq_msg_data(&f[k])) : 0;
    if (ok && seq != UINT64_MAX && seq >= from && seq < until) {
      publish(r, w, seq, zmq_msg_data(&f[k + 1]), zmq_msg_size(&f[k + 1]));
      w->replayed++;
      w->next = seq + 1;
      w->have = true;
    }
    close_frames(f);
    if (ok && seq == UINT64_MAX && !w->have) {
      w->have = true; /* nothing buffered: from here on, a gap is a gap */
      w->next = from;
    }
    if (!ok || seq == UINT64_MAX) {
      w->replay_failures += !ok;
      return;
    }
  }
}

/* A live batch: a gap asks the replay socket first; an earlier seq (the
 * engine restarted, or a replayed batch seen live) goes out as it is: the
 * stream's dedup drops what it already holds. */
static void on_live(relay *r, rworker *w, uint64_t seq, const void *p, size_t n) {
  w->in++;
  if (w->have && seq > w->next) {
    w->gaps++;
    w->missed += seq - w->next;
    if (w->dealer != NULL)
      fetch_replay(r, w, w->next, seq);
  } else if (w->have && seq < w->next) {
    w->regress++;
  }
  publish(r, w, seq, p, n);
  w->next = seq + 1;
  w->have = true;
}

static void drain(relay *r, rworker *w) {
  for (int got = 0; got < 1024; got++) {
    zmq_msg_t f[4];
    for (int i = 0; i < 4; i++)
      zmq_msg_init(&f[i]);
    int n = recv_msg(w->sub, f, ZMQ_DONTWAIT);
    if (n == 3 && zmq_msg_size(&f[1]) == 8)
      on_live(r, w, be64(zmq_msg_data(&f[1])), zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
    else if (n > 0)
      fprintf(stderr, "kvplane events relay: %s: a message of %d frames skipped\n",
              w->name, n);
    close_frames(f);
    if (n == 0)
      return;
  }
}

static int open_worker(relay *r, rworker *w) {
  int zero = 0, hwm = 100000; /* as kvp_events' SUB sockets */
  size_t len = strlen(r->o->prefix) + strlen(w->name) + 2;
  w->subject = malloc(len);
  if (w->subject == NULL)
    return -1;
  snprintf(w->subject, len, "%s.%s", r->o->prefix, w->name);
  w->sub = zmq_socket(r->zctx, ZMQ_SUB);
  (void)zmq_setsockopt(w->sub, ZMQ_RCVHWM, &hwm, sizeof hwm);
  (void)zmq_setsockopt(w->sub, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_setsockopt(w->sub, ZMQ_SUBSCRIBE, "", 0) != 0 ||
      (strchr(w->pub_ep, '*') ? zmq_bind : zmq_connect)(w->sub, w->pub_ep) != 0) {
    fprintf(stderr, "kvplane events relay: %s: %s: %s\n", w->name, w->pub_ep,
            zmq_strerror(errno));
    return -1;
  }
  if (w->replay_ep == NULL)
    return 0;
  w->dealer = zmq_socket(r->zctx, ZMQ_DEALER);
  (void)zmq_setsockopt(w->dealer, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_connect(w->dealer, w->replay_ep) != 0) {
    fprintf(stderr, "kvplane events relay: %s: %s: %s\n", w->name, w->replay_ep,
            zmq_strerror(errno));
    return -1;
  }
  return 0;
}

/* ---- the loop ---------------------------------------------------------------------- */

static uint64_t total_in(const relay *r) {
  uint64_t n = 0;
  for (size_t i = 0; i < r->o->n; i++)
    n += r->o->w[i].in + r->o->w[i].replayed;
  return n;
}

static void sum(const relay *r, uint64_t *gaps, uint64_t *replayed, uint64_t *failures) {
  *gaps = *replayed = *failures = 0;
  for (size_t i = 0; i < r->o->n; i++) {
    *gaps += r->o->w[i].gaps;
    *replayed += r->o->w[i].replayed;
    *failures += r->o->w[i].replay_failures;
  }
}

static void stats_line(relay *r, uint64_t now) {
  uint64_t gaps, replayed, fails, in = total_in(r);
  sum(r, &gaps, &replayed, &fails);
  pthread_mutex_lock(&r->acks.mu);
  uint64_t acked = r->acks.acked, errs = r->acks.errors, dups = r->acks.duplicates;
  uint64_t done = acked + r->acks.lost + r->acks.n_retry;
  pthread_mutex_unlock(&r->acks.mu);
  double dt = (double)(now - r->last_stats_ns) * 1e-9;
  fprintf(stderr, "kvplane events relay: %" PRIu64 " batches in (%.0f/s), %" PRIu64
          " published, %" PRIu64 " acked (%" PRIu64 " duplicates), %" PRIu64
          " ack errors, %" PRIu64 " pending, %" PRIu64 " gaps, %" PRIu64
          " replayed, NATS %s\n", in, dt > 0 ? (double)(in - r->last_in) / dt : 0.0,
          r->published, acked, dups, errs, r->published - (done < r->published ? done : r->published),
          gaps, replayed,
          natsConnection_Status(r->nc) == NATS_CONN_STATUS_CONNECTED ? "up" : "down");
  r->last_stats_ns = now;
  r->last_in = in;
}

static void final_line(relay *r) {
  uint64_t gaps, replayed, fails, missed = 0, regress = 0;
  sum(r, &gaps, &replayed, &fails);
  for (size_t i = 0; i < r->o->n; i++)
    missed += r->o->w[i].missed, regress += r->o->w[i].regress;
  pthread_mutex_lock(&r->acks.mu);
  printf("{\"relay\": {\"batches\": %" PRIu64 ", \"published\": %" PRIu64
         ", \"acked\": %" PRIu64 ", \"duplicates\": %" PRIu64 ", \"ack_errors\": %"
         PRIu64 ", \"lost\": %" PRIu64 ", \"retried\": %" PRIu64 ", \"publish_errors\": %"
         PRIu64 ", \"stalls\": %" PRIu64 ", \"gaps\": %" PRIu64 ", \"batches_missed\": %"
         PRIu64 ", \"replayed\": %" PRIu64 ", \"replay_failures\": %" PRIu64
         ", \"regressions\": %" PRIu64 ", \"refills\": %" PRIu64
         ", \"seconds\": %.3f}}\n",
         total_in(r), r->published, r->acks.acked, r->acks.duplicates, r->acks.errors,
         r->acks.lost, r->retried, r->publish_errors, r->stalls, gaps, missed, replayed,
         fails, regress, r->refills, (double)(kvp_now_ns() - r->t0_ns) * 1e-9);
  pthread_mutex_unlock(&r->acks.mu);
  fflush(stdout);
}

/* After a reconnect: the stream again (a memory stream went with its
 * server), and when it is a new one, the engines' buffered batches into it
 * first, in order -- before any newer live batch and before the ones that
 * failed while it was gone (those are in the engines' buffers too: the
 * stream's dedup drops them) -- so readers that start over from it rebuild
 * what the engines still hold. */
static void after_reconnect(relay *r) {
  if (ensure_stream(r) < 0 || !r->stream_new)
    return;
  r->refills++;
  fprintf(stderr, "kvplane events relay: stream %s was made again: refilling "
          "it from the engines' replay buffers\n", r->o->stream);
  for (size_t i = 0; i < r->o->n; i++)
    if (r->o->w[i].dealer != NULL)
      fetch_replay(r, &r->o->w[i], 0, UINT64_MAX);
}

static void loop(relay *r, zmq_pollitem_t *items) {
  relay_opts *o = r->o;
  while (!stop_flag && (!o->max_batches || total_in(r) < o->max_batches)) {
    (void)zmq_poll(items, (int)o->n, 100);
    if (atomic_exchange_explicit(&r->reconnected, false, memory_order_relaxed))
      after_reconnect(r);
    for (size_t i = 0; i < o->n; i++)
      drain(r, &o->w[i]);
    retry_failed(r);
    uint64_t now = kvp_now_ns();
    if (o->stats_every && now - r->last_stats_ns >= o->stats_every * 1000000000ull)
      stats_line(r, now);
  }
}

/* Waits for the acks in flight, the failed ones sent again, up to 10 s. */
static void flush(relay *r) {
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MaxWait = 10000;
  uint64_t end = kvp_now_ns() + 10000000000ull;
  r->give_up_ns = end; /* send_msg may wait for room until then */
  do {
    retry_failed(r);
    (void)js_PublishAsyncComplete(r->jc, &po);
    pthread_mutex_lock(&r->acks.mu);
    size_t left = r->acks.n_retry;
    pthread_mutex_unlock(&r->acks.mu);
    if (left == 0)
      break;
  } while (kvp_now_ns() < end);
}

static int run_relay(relay_opts *o) {
  relay r = {.o = o};
  int rc = 1;
  pthread_mutex_init(&r.acks.mu, NULL);
  zmq_pollitem_t *items = calloc(o->n, sizeof *items);
  r.zctx = zmq_ctx_new();
  if (items == NULL || r.zctx == NULL || connect_nats(&r) < 0)
    goto out;
  for (size_t i = 0; i < o->n; i++) {
    if (open_worker(&r, &o->w[i]) < 0)
      goto out;
    items[i] = (zmq_pollitem_t){.socket = o->w[i].sub, .events = ZMQ_POLLIN};
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  r.t0_ns = r.last_stats_ns = kvp_now_ns();
  for (size_t i = 0; i < o->n; i++) /* what the engines still buffer */
    if (o->w[i].dealer != NULL)
      fetch_replay(&r, &o->w[i], 0, UINT64_MAX);
  loop(&r, items);
  flush(&r);
  final_line(&r);
  rc = 0;
out:
  for (size_t i = 0; i < o->n; i++) {
    if (o->w[i].sub) zmq_close(o->w[i].sub);
    if (o->w[i].dealer) zmq_close(o->w[i].dealer);
  }
  if (r.zctx)
    zmq_ctx_term(r.zctx);
  jsCtx_Destroy(r.jc);
  natsConnection_Destroy(r.nc);
  natsOptions_Destroy(r.nopts);
  for (size_t i = 0; i < r.acks.n_retry; i++)
    natsMsg_Destroy(r.acks.retry[i]);
  free(r.acks.retry);
  free(items);
  pthread_mutex_destroy(&r.acks.mu);
  return rc;
}

int kvp_cli_relay(int argc, char **argv) {
  relay_opts o = {.stream = "KVPLANE_EVENTS", .prefix = "kvplane.events",
                  .dup_window_s = 120, .max_bytes = 1ull << 30, .max_pending = 4096,
                  .stats_every = 10};
  o.w = calloc(MAX_WORKERS, sizeof *o.w);
  if (o.w == NULL)
    return 1;
  int rc = parse_relay(argc, argv, &o);
  if (rc < 0)
    rc = run_relay(&o);
  for (size_t i = 0; i < o.n; i++) {
    free((char *)o.w[i].name);
    free(o.w[i].pub_ep);
    free(o.w[i].replay_ep);
    free(o.w[i].subject);
  }
  free(o.w);
  return rc;
}
#endif /* KVP_HAVE_NATS */
