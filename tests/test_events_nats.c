/* SPDX-License-Identifier: Apache-2.0 */
/* KV events through NATS JetStream, end to end: vLLM-shaped batches on ZeroMQ
 * PUB (+ replay ROUTER) -> `kvplane events relay` (two of them: dedup) ->
 * JetStream (nats-server -js, file storage, started here on a free loopback
 * port) -> kvp_events_js readers that start after the batches were relayed.
 * Their per-worker index digests must equal those of a subscriber fed live
 * from ZeroMQ, through a relay restart (the engines' replay fills the gap),
 * a NATS restart mid-stream, malformed messages in the stream, and a
 * memory stream made again after a NATS restart (the relay refills it from
 * the engines' replay buffers; a running reader starts over on it, ending
 * equal to the live subscriber and to a reader that starts on it).
 *   test_events_nats [KVPLANE_CLI]  (or KVP_CLI=; exit 77 without
 *   nats-server) */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <nats/nats.h>
#include <zmq.h>

#include "kvplane.h"
#include "kvplane/events.h"
#include "kvplane/events_nats.h"
#include "test_harness.h"

#define WORKERS 2
#define MAXB 4096 /* batches per publisher */

static const char *cli;
static char url[64], dir[128];
static int port;

static void sleep_ms(int ms) {
  nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L}, NULL);
}

/* ---- nats-server and the relay as child processes ------------------------------- */

/* A loopback port for nats-server that binds now, drawn below the kernel's
 * ephemeral range (32768 and up): a port found by binding port 0 goes back
 * to that range when the probe closes, and another process's bind(0) or
 * outgoing connection may take it before nats-server binds it. */
static int free_port(void) {
  static unsigned seed; /* one sequence per process: calls differ */
  if (seed == 0)
    seed = (unsigned)getpid() ^ (unsigned)time(NULL) ^ 1u;
  for (int tries = 0; tries < 200; tries++) {
    int p = 20000 + (int)(rand_r(&seed) % 12000u);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(s, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)p),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int rc = bind(s, (struct sockaddr *)&a, sizeof a);
    close(s);
    if (rc == 0)
      return p;
  }
  kvt_fail_(__FILE__, __LINE__, "no free loopback port in [20000, 32000)");
  return -1;
}

static bool port_open(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = connect(s, (struct sockaddr *)&a, sizeof a) == 0;
  close(s);
  return ok;
}

static pid_t spawn(char *const argv[], const char *out) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    FILE *f = freopen(out ? out : "/dev/null", "w", stdout);
    (void)f;
    if (getenv("KVP_TEST_VERBOSE") == NULL)
      f = freopen("/dev/null", "w", stderr);
    execvp(argv[0], argv);
    _exit(127);
  }
  return pid;
}

static pid_t nats_start(void) {
  char p[16];
  snprintf(p, sizeof p, "%d", port);
  char *argv[] = {"nats-server", "-js", "-a", "127.0.0.1", "-p", p, "-sd", dir, NULL};
  pid_t pid = spawn(argv, NULL);
  for (int i = 0; i < 500 && !port_open(); i++)
    sleep_ms(10);
  ASSERT_TRUE(port_open());
  return pid;
}

static int stop(pid_t pid) {
  int st = 0;
  kill(pid, SIGTERM);
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* ---- engines: PUB + replay ROUTER, every batch kept for replay --------------------- */

typedef struct engine {
  void *pub, *router;
  char ep[128], rep[128];
  char *data[MAXB];
  size_t len[MAXB];
  uint64_t n;          /* batches published */
  uint64_t live[64];   /* stored hashes still in the cache */
  size_t n_live;
  uint64_t rng;
} engine;

static void *zctx;
static engine eng[WORKERS];

static void bind_any(void *sock, char *ep, size_t cap) {
  snprintf(ep, cap, "tcp://127.0.0.1:*");
  ASSERT_OK(zmq_bind(sock, ep));
  size_t n = cap;
  ASSERT_OK(zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &n));
}

static void engine_open(engine *e, uint64_t seed) {
  memset(e, 0, sizeof *e);
  e->rng = seed;
  e->pub = zmq_socket(zctx, ZMQ_PUB);
  e->router = zmq_socket(zctx, ZMQ_ROUTER);
  int zero = 0;
  zmq_setsockopt(e->pub, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(e->router, ZMQ_LINGER, &zero, sizeof zero);
  bind_any(e->pub, e->ep, sizeof e->ep);
  bind_any(e->router, e->rep, sizeof e->rep);
}

static uint64_t rnd(engine *e) {
  uint64_t z = (e->rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void s_(msgpack_packer *p, const char *s) {
  msgpack_pack_str(p, strlen(s));
  msgpack_pack_str_body(p, s, strlen(s));
}

/* BlockStored of 1-4 new blocks chained on a live one (or a root). */
static void pack_stored(engine *e, msgpack_packer *p) {
  size_t n = 1 + rnd(e) % 4;
  uint64_t parent = e->n_live ? e->live[rnd(e) % e->n_live] : 0;
  msgpack_pack_map(p, 7);
  s_(p, "type"), s_(p, "BlockStored");
  s_(p, "block_hashes"), msgpack_pack_array(p, n);
  for (size_t i = 0; i < n; i++) {
    uint64_t h = rnd(e);
    msgpack_pack_uint64(p, h);
    if (e->n_live < 64)
      e->live[e->n_live++] = h;
  }
  s_(p, "parent_block_hash");
  if (parent)
    msgpack_pack_uint64(p, parent);
  else
    msgpack_pack_nil(p);
  s_(p, "token_ids"), msgpack_pack_array(p, n * 4);
  for (size_t i = 0; i < n * 4; i++)
    msgpack_pack_uint32(p, (uint32_t)(rnd(e) % 50000));
  s_(p, "block_size"), msgpack_pack_uint32(p, 4);
  s_(p, "lora_id"), msgpack_pack_nil(p);
  s_(p, "medium"), s_(p, rnd(e) % 4 ? "GPU" : "CPU");
}

static void pack_removed(engine *e, msgpack_packer *p) {
  size_t i = rnd(e) % e->n_live;
  uint64_t h = e->live[i];
  e->live[i] = e->live[--e->n_live];
  msgpack_pack_map(p, 3);
  s_(p, "type"), s_(p, "BlockRemoved");
  s_(p, "block_hashes"), msgpack_pack_array(p, 1), msgpack_pack_uint64(p, h);
  s_(p, "medium"), s_(p, "GPU");
}

static void be8(uint64_t v, uint8_t out[8]) {
  for (int i = 0; i < 8; i++)
    out[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* One vLLM-shaped batch: [ts, [events...]], 1-3 events; kept for replay,
 * and sent live unless `hidden` (a batch lost on the wire). */
static void engine_send(engine *e, bool hidden) {
  ASSERT_LT(e->n, (uint64_t)MAXB);
  msgpack_sbuffer sb;
  msgpack_packer p;
  msgpack_sbuffer_init(&sb);
  msgpack_packer_init(&p, &sb, msgpack_sbuffer_write);
  size_t ne = 1 + rnd(e) % 3;
  msgpack_pack_array(&p, 2);
  msgpack_pack_double(&p, 1.7e9 + (double)e->n);
  msgpack_pack_array(&p, ne);
  for (size_t i = 0; i < ne; i++)
    if (e->n_live > 8 && rnd(e) % 3 == 0)
      pack_removed(e, &p);
    else
      pack_stored(e, &p);
  uint8_t s[8];
  be8(e->n, s);
  if (!hidden) {
    zmq_send(e->pub, "", 0, ZMQ_SNDMORE);
    zmq_send(e->pub, s, 8, ZMQ_SNDMORE);
    zmq_send(e->pub, sb.data, sb.size, 0);
  }
  e->data[e->n] = sb.data; /* kept for replay */
  e->len[e->n++] = sb.size;
  msgpack_sbuffer_release(&sb);
}

/* Answers replay requests ["", start] with every kept batch >= start. */
static void engine_serve(engine *e) {
  for (;;) {
    zmq_msg_t f[3];
    int n = 0;
    for (int i = 0; i < 3; i++)
      zmq_msg_init(&f[i]);
    while (n < 3 && zmq_msg_recv(&f[n], e->router, n ? 0 : ZMQ_DONTWAIT) >= 0 &&
           zmq_msg_more(&f[n++]))
      ;
    if (n == 3 && zmq_msg_size(&f[2]) == 8) {
      const uint8_t *sp = zmq_msg_data(&f[2]);
      uint64_t start = 0;
      for (int i = 0; i < 8; i++)
        start = start << 8 | sp[i];
      for (uint64_t q = start; q <= e->n; q++) {
        uint8_t s[8];
        be8(q == e->n ? UINT64_MAX : q, s);
        zmq_send(e->router, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE);
        zmq_send(e->router, "", 0, ZMQ_SNDMORE);
        zmq_send(e->router, "", 0, ZMQ_SNDMORE);
        zmq_send(e->router, s, 8, ZMQ_SNDMORE);
        zmq_send(e->router, q == e->n ? "" : e->data[q], q == e->n ? 0 : e->len[q], 0);
      }
    }
    for (int i = 0; i < 3; i++)
      zmq_msg_close(&f[i]);
    if (n == 0)
      return;
  }
}

static void engine_publish(engine *e) { engine_send(e, false); }

static void engine_close(engine *e) {
  zmq_close(e->pub);
  zmq_close(e->router);
  for (uint64_t i = 0; i < e->n; i++)
    free(e->data[i]);
}

/* ---- the relay --------------------------------------------------------------------- */

#define MEM_STREAM "KVP_EVENTS_MEM"
#define MEM_PREFIX "kvplane.mem"

/* stream NULL: KVPLANE_EVENTS on file storage; else that one in memory */
static pid_t relay_start_on(const char *out, const char *stream) {
  char w[WORKERS][400];
  char *argv[14 + 2 * WORKERS] = {(char *)cli, "events", "relay", "--nats", url,
                                  "--stats-every", "0"};
  int a = 7;
  if (stream != NULL) {
    argv[a++] = "--stream";
    argv[a++] = (char *)stream;
    argv[a++] = "--storage";
    argv[a++] = "memory";
    argv[a++] = "--subject-prefix"; /* streams' subjects may not overlap */
    argv[a++] = MEM_PREFIX;
  }
  for (int i = 0; i < WORKERS; i++) {
    snprintf(w[i], sizeof w[i], "w%d=%s,%s", i, eng[i].ep, eng[i].rep);
    argv[a++] = "--worker";
    argv[a++] = w[i];
  }
  argv[a] = NULL;
  return spawn(argv, out);
}

static pid_t relay_start(const char *out) { return relay_start_on(out, NULL); }

/* Its final {"relay": {...}} line: the value of "key". */
static uint64_t relay_stat(const char *out, const char *key) {
  char buf[4096], pat[64];
  FILE *f = fopen(out, "r");
  ASSERT_NOT_NULL(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *p = strstr(buf, pat);
  ASSERT_NOT_NULL(p);
  return strtoull(p + strlen(pat), NULL, 10);
}

/* ---- the subscribers ------------------------------------------------------------ */

typedef struct side {
  kvp_index *ix;
  kvp_events *ev;
  kvp_events_js *js; /* NULL: the live ZeroMQ one */
} side;

static void side_open_on(side *s, bool via_js, const char *stream) {
  memset(s, 0, sizeof *s);
  ASSERT_OK(kvp_index_create(NULL, NULL, &s->ix));
  kvp_events_source src[WORKERS];
  for (uint32_t i = 0; i < WORKERS; i++) {
    ASSERT_OK(kvp_index_worker_add(s->ix, i));
    src[i] = (kvp_events_source){.worker = i, .keying = KVP_EVENTS_ENGINE_HASH,
                                 .endpoint = via_js ? NULL : eng[i].ep,
                                 .replay_endpoint = via_js ? NULL : eng[i].rep};
  }
  ASSERT_OK(kvp_events_create(s->ix, src, WORKERS, NULL, NULL, &s->ev));
  if (!via_js)
    return;
  const char *names[WORKERS] = {"w0", "w1"};
  kvp_events_js_opts o = {.url = url, .stream = stream,
                          .subject_prefix = stream ? MEM_PREFIX : NULL};
  ASSERT_OK(kvp_events_js_create(s->ev, &o, names, WORKERS, &s->js));
}

static void side_open(side *s, bool via_js) { side_open_on(s, via_js, NULL); }

static void side_close(side *s) {
  kvp_events_js_destroy(s->js);
  kvp_events_destroy(s->ev);
  kvp_index_destroy(s->ix);
}

static side live;
static side *readers[4];
static size_t n_readers;

/* One round: engines answer replays, every subscriber polls. */
static void pump(int ms) {
  uint64_t end = kvp_now_ns() + (uint64_t)ms * 1000000u;
  do {
    for (int i = 0; i < WORKERS; i++)
      engine_serve(&eng[i]);
    ASSERT_GE(kvp_events_poll(live.ev, 1), 0);
    for (size_t i = 0; i < n_readers; i++)
      ASSERT_GE(kvp_events_js_poll(readers[i]->js, 1), 0);
  } while (kvp_now_ns() < end);
}

static uint64_t applied(const side *s) {
  kvp_events_stats st;
  ASSERT_OK(kvp_events_stats_get(s->ev, UINT32_MAX, &st));
  return st.batches;
}

static uint64_t published(void) {
  uint64_t n = 0;
  for (int i = 0; i < WORKERS; i++)
    n += eng[i].n;
  return n;
}

/* Pumps until `s` applied every batch published (or 20 s). */
static void catch_up(const side *s) {
  for (int i = 0; i < 2000 && applied(s) < published(); i++)
    pump(10);
  ASSERT_EQ(applied(s), published());
}

static void same_index(const side *s) {
  for (uint32_t w = 0; w < WORKERS; w++) {
    uint64_t a, b;
    ASSERT_OK(kvp_index_digest(live.ix, w, &a));
    ASSERT_OK(kvp_index_digest(s->ix, w, &b));
    ASSERT_EQ(a, b);
  }
  kvp_events_stats st;
  ASSERT_OK(kvp_events_stats_get(s->ev, UINT32_MAX, &st));
  ASSERT_EQ(st.gaps, 0u);
  ASSERT_EQ(st.restarts, 0u);
  ASSERT_EQ(st.residency_drops, 0u);
  ASSERT_EQ(st.decode_errors, 0u);
}

static void publish_all(int per_worker) {
  for (int k = 0; k < per_worker; k++) {
    for (int i = 0; i < WORKERS; i++)
      engine_publish(&eng[i]);
    if (k % 20 == 19)
      pump(5);
  }
}

static kvp_events_js_stats js_stats(const side *s) {
  kvp_events_js_stats st;
  ASSERT_OK(kvp_events_js_stats_get(s->js, &st));
  return st;
}

/* ---- the scenarios ------------------------------------------------------------------- */

/* A message in the stream without a usable Kvp-Seq is counted and skipped. */
static void publish_malformed(void) {
  natsConnection *nc = NULL;
  jsCtx *jc = NULL;
  ASSERT_EQ(natsConnection_ConnectTo(&nc, url), NATS_OK);
  ASSERT_EQ(natsConnection_JetStream(&jc, nc, NULL), NATS_OK);
  const char *bad[2] = {NULL, "12x"};
  for (int i = 0; i < 2; i++) {
    natsMsg *m = NULL;
    ASSERT_EQ(natsMsg_Create(&m, "kvplane.events.w0", NULL, "\x92\xcb", 2), NATS_OK);
    if (bad[i])
      ASSERT_EQ(natsMsgHeader_Set(m, "Kvp-Seq", bad[i]), NATS_OK);
    jsPubAck *pa = NULL;
    ASSERT_EQ(js_PublishMsg(&pa, jc, m, NULL, NULL), NATS_OK);
    jsPubAck_Destroy(pa);
    natsMsg_Destroy(m);
  }
  jsCtx_Destroy(jc);
  natsConnection_Destroy(nc);
}

static void wait_connected(const side *s, int want) {
  for (int i = 0; i < 1000 && kvp_events_js_connected(s->js) != want; i++)
    pump(10);
  ASSERT_EQ(kvp_events_js_connected(s->js), want);
}

static char out_a[256], out_b[256], out_c[256];
static pid_t nats;
static side r1, r2;

/* Two relays on the same engines: the stream's dedup keeps one copy; a
 * reader that starts after the batches were relayed rebuilds the index. */
static void stage_dedup(void) {
  pid_t ra = relay_start(out_a), rb = relay_start(out_b);
  pump(700); /* SUBs connect; the relays' start-up replays answered */
  publish_all(300);
  catch_up(&live);
  pump(500); /* the relays publish and get their acks */
  side_open(&r1, true);
  readers[n_readers++] = &r1;
  catch_up(&r1);
  same_index(&r1);
  ASSERT_EQ(js_stats(&r1).fed, published());
  ASSERT_EQ(js_stats(&r1).subscribed, (uint64_t)WORKERS);
  ASSERT_EQ(stop(ra), 0);
  ASSERT_EQ(stop(rb), 0);
  uint64_t relayed = relay_stat(out_a, "acked") + relay_stat(out_b, "acked");
  ASSERT_EQ(relayed, 2 * published());
  ASSERT_EQ(relay_stat(out_a, "duplicates") + relay_stat(out_b, "duplicates"),
            published());
}

/* No relay while the engines go on; a new one fills in from their replay
 * sockets, at start and for batches lost on the wire.  Returns its pid. */
static pid_t stage_relay_restart(void) {
  publish_all(50);
  catch_up(&live);
  pid_t rc = relay_start(out_c);
  catch_up(&r1);
  same_index(&r1);
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < WORKERS; i++) {
      engine_send(&eng[i], true);
      engine_publish(&eng[i]);
    }
  catch_up(&live);
  catch_up(&r1);
  same_index(&r1);
  return rc;
}

/* NATS restarts mid-stream (file storage): the relay holds what comes
 * meanwhile, the reader resumes. */
static void stage_nats_restart(void) {
  (void)stop(nats);
  wait_connected(&r1, 0);
  publish_all(50);
  catch_up(&live);
  pump(300);
  nats = nats_start();
  wait_connected(&r1, 1);
  catch_up(&r1);
  same_index(&r1);
  kvp_events_js_stats st = js_stats(&r1);
  ASSERT_GE(st.disconnects, 1u);
  ASSERT_GE(st.reconnects, 1u);
}

static void wait_bad(const side *s, uint64_t n) {
  for (int i = 0; i < 500 && js_stats(s).bad_messages < n; i++)
    pump(10);
  ASSERT_EQ(js_stats(s).bad_messages, n);
}

/* Malformed messages: counted and skipped, by this reader and a late one. */
static void stage_malformed(void) {
  publish_malformed();
  wait_bad(&r1, 2);
  same_index(&r1);
  side_open(&r2, true);
  readers[n_readers++] = &r2;
  catch_up(&r2);
  wait_bad(&r2, 2);
  same_index(&r2);
  ASSERT_EQ(js_stats(&r2).fed, published());
  char prom[4096];
  ASSERT_GT(kvp_events_js_prometheus(r2.js, prom, sizeof prom), 0);
  ASSERT_NOT_NULL(strstr(prom, "kvplane_events_js_bad_messages_total 2\n"));
  ASSERT_NOT_NULL(strstr(prom, "kvplane_events_js_connected 1\n"));
}

static char out_m[256];
static side r3, r4;

/* Messages in stream `name` now; 0 while it does not exist. */
static uint64_t stream_msgs(const char *name) {
  natsConnection *nc = NULL;
  jsCtx *jc = NULL;
  jsStreamInfo *si = NULL;
  uint64_t n = 0;
  ASSERT_EQ(natsConnection_ConnectTo(&nc, url), NATS_OK);
  ASSERT_EQ(natsConnection_JetStream(&jc, nc, NULL), NATS_OK);
  if (js_GetStreamInfo(&si, jc, name, NULL, NULL) == NATS_OK)
    n = si->State.Msgs;
  jsStreamInfo_Destroy(si);
  jsCtx_Destroy(jc);
  natsConnection_Destroy(nc);
  return n;
}

static bool same_digests(const side *a, const side *b) {
  for (uint32_t w = 0; w < WORKERS; w++) {
    uint64_t x, y;
    ASSERT_OK(kvp_index_digest(a->ix, w, &x));
    ASSERT_OK(kvp_index_digest(b->ix, w, &y));
    if (x != y)
      return false;
  }
  return true;
}

/* Pumps until `s` fed n messages in all (or 20 s). */
static void wait_fed(const side *s, uint64_t n) {
  for (int i = 0; i < 2000 && js_stats(s).fed < n; i++)
    pump(10);
  ASSERT_EQ(js_stats(s).fed, n);
}

static void wait_stream(const char *name, uint64_t n) {
  for (int i = 0; i < 2000 && stream_msgs(name) < n; i++)
    pump(10);
  ASSERT_EQ(stream_msgs(name), n);
}

/* Pumps until `s` has reset `resets` times and its index equals the live
 * one (or 20 s). */
static void wait_live(const side *s, uint64_t resets) {
  for (int i = 0; i < 2000 && !(js_stats(s).stream_resets == resets &&
                                same_digests(s, &live));
       i++)
    pump(10);
}

/* A memory stream goes with its server; the relay makes it again (its
 * sequence numbers from 1) and refills it from the engines' replay buffers
 * before any newer batch.  The reader that ran through it notices (the
 * stream's creation time changed), drops what it had and reads the new
 * stream from its start: its index ends equal to the live one again, as
 * does a reader that starts on the new stream.  The file stream's readers
 * resume without a reset. */
static void stage_stream_recreated(void) {
  pid_t rm = relay_start_on(out_m, MEM_STREAM);
  publish_all(60);
  catch_up(&live);
  side_open_on(&r3, true, MEM_STREAM);
  readers[n_readers++] = &r3;
  catch_up(&r3); /* the relay's start-up replay: the engines' history */
  same_index(&r3);
  ASSERT_EQ(js_stats(&r3).fed, published());
  (void)stop(nats);
  wait_connected(&r3, 0);
  nats = nats_start();
  wait_connected(&r3, 1);
  publish_all(60);
  catch_up(&live);
  wait_stream(MEM_STREAM, published()); /* the refill: every batch again */
  side_open_on(&r4, true, MEM_STREAM);
  readers[n_readers++] = &r4;
  wait_fed(&r4, published());
  ASSERT_TRUE(same_digests(&r4, &live));
  /* r3 may have fed some of the refill before it noticed the new stream
   * (its keeper looks once a second) and then read it all again: how many
   * it fed depends on that timing; its index is what counts */
  wait_live(&r3, 1);
  ASSERT_EQ(js_stats(&r3).stream_resets, 1u);
  ASSERT_TRUE(same_digests(&r3, &live)); /* the past is back */
  publish_all(20); /* and on from there */
  catch_up(&live);
  wait_fed(&r4, published());
  wait_live(&r3, 1);
  ASSERT_TRUE(same_digests(&r3, &live));
  ASSERT_TRUE(same_digests(&r4, &live));
  ASSERT_EQ(js_stats(&r3).stream_resets, 1u);
  ASSERT_EQ(js_stats(&r4).stream_resets, 0u);
  char prom[4096];
  ASSERT_GT(kvp_events_js_prometheus(r3.js, prom, sizeof prom), 0);
  ASSERT_NOT_NULL(strstr(prom, "kvplane_events_js_stream_resets_total 1\n"));
  catch_up(&r1); /* the file stream survived: no reset, nothing lost */
  same_index(&r1);
  ASSERT_EQ(js_stats(&r1).stream_resets, 0u);
  ASSERT_EQ(stop(rm), 0);
  ASSERT_EQ(relay_stat(out_m, "lost"), 0u);
  ASSERT_EQ(relay_stat(out_m, "refills"), 1u);
}

static void run(void) {
  snprintf(out_a, sizeof out_a, "%s/relay-a.json", dir);
  snprintf(out_b, sizeof out_b, "%s/relay-b.json", dir);
  snprintf(out_c, sizeof out_c, "%s/relay-c.json", dir);
  snprintf(out_m, sizeof out_m, "%s/relay-m.json", dir);
  nats = nats_start();
  side_open(&live, false);
  stage_dedup();
  pid_t rc = stage_relay_restart();
  stage_nats_restart();
  stage_malformed();
  stage_stream_recreated();
  ASSERT_EQ(stop(rc), 0);
  ASSERT_EQ(relay_stat(out_c, "lost"), 0u);
  ASSERT_EQ(relay_stat(out_c, "gaps"), 3u * WORKERS);
  ASSERT_EQ(relay_stat(out_c, "batches_missed"), 3u * WORKERS);
  n_readers = 0;
  side_close(&r4);
  side_close(&r3);
  side_close(&r2);
  side_close(&r1);
  side_close(&live);
  (void)stop(nats);
}

/* NATS not there at all: create works, poll returns 0, nothing connects. */
static void test_unreachable(void) {
  side s;
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", free_port());
  side_open(&s, true);
  ASSERT_EQ(kvp_events_js_connected(s.js), 0);
  uint64_t t0 = kvp_now_ns();
  ASSERT_EQ(kvp_events_js_poll(s.js, 50), 0);
  ASSERT_LT(kvp_now_ns() - t0, 1000000000ull); /* bounded by the timeout */
  const char *bad[WORKERS] = {"w.0", "w1"};
  kvp_events_js *js = NULL;
  ASSERT_ERR(kvp_events_js_create(s.ev, NULL, bad, WORKERS, &js), KVP_EINVAL);
  ASSERT_ERR(kvp_events_js_create(s.ev, NULL, bad, 1, &js), KVP_EINVAL);
  side_close(&s);
  /* a ZeroMQ source cannot be read from JetStream */
  side z;
  side_open(&z, false);
  const char *names[WORKERS] = {"w0", "w1"};
  ASSERT_ERR(kvp_events_js_create(z.ev, NULL, names, WORKERS, &js), KVP_ERANGE);
  side_close(&z);
}

int main(int argc, char **argv) {
  cli = argc == 2 ? argv[1] : getenv("KVP_CLI");
  if (cli == NULL) {
    fprintf(stderr, "usage: test_events_nats KVPLANE_CLI (or KVP_CLI=...)\n");
    return 2;
  }
  if (system("command -v nats-server >/dev/null 2>&1") != 0) {
    printf("SKIP: nats-server is not installed (Debian: nats-server)\n");
    return 77;
  }
  signal(SIGPIPE, SIG_IGN);
  snprintf(dir, sizeof dir, "/tmp/kvp-test-nats-XXXXXX");
  ASSERT_NOT_NULL(mkdtemp(dir));
  zctx = zmq_ctx_new();
  for (int i = 0; i < WORKERS; i++)
    engine_open(&eng[i], 1000 + (uint64_t)i);
  test_unreachable();
  port = free_port();
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  run();
  for (int i = 0; i < WORKERS; i++)
    engine_close(&eng[i]);
  zmq_ctx_term(zctx);
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", dir);
  printf("test_events_nats: ok\n");
  return 0;
}
