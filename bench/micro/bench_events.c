/* SPDX-License-Identifier: Apache-2.0 */
/* KV-event ingest: vLLM-shaped msgpack batches (BlockStored chains, then
 * their BlockRemoved) decoded and applied to a kvp_index, in process and end
 * to end over real ZeroMQ sockets (ipc, tcp loopback), each next to the
 * index-only ingest of the same keys (the floor: what the index alone
 * costs) in the same run.  Rates are block hashes per second; the ratio
 * column is rate / index-only rate.
 *   bench_events [--quick] [--batches N] [--events E] [--blocks B]
 * --quick: small sizes; checks that every path ends with the same index
 * (CTest).  The vLLM publisher's own send rate is measured by
 * tests/interop/publisher_rate.py (Python). */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <msgpack.h>
#include <zmq.h>

#include "bench_util.h"
#include "kvplane.h"
#include "kvplane/events.h"

#define BS 16 /* tokens per block */

typedef struct cfg {
  size_t batches, events, blocks; /* per batch, per event */
  bool quick;
} cfg;

typedef struct payload {
  char *p;
  size_t len;
} payload;

typedef struct workload {
  payload *b;      /* stored batches, then removed batches */
  size_t n;        /* total batches */
  kvp_key *keys;   /* engine hashes as index keys, in stored order */
  size_t n_keys;
  size_t n_stored; /* batches that store */
} workload;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return bench_splitmix(&rng); }

/* CPU time of the calling thread: the subscriber's own cost, whatever the
 * publisher thread on the other core does. */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pstr(msgpack_packer *p, const char *s) {
  msgpack_pack_str(p, strlen(s));
  msgpack_pack_str_body(p, s, strlen(s));
}

/* BlockStored as vLLM 0.33 publishes it (map, omit_defaults). */
static void pack_stored(msgpack_packer *p, const kvp_key *k, size_t n,
                        const kvp_key *parent) {
  msgpack_pack_map(p, 9);
  pstr(p, "type"), pstr(p, "BlockStored");
  pstr(p, "block_hashes"), msgpack_pack_array(p, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(p, k[i].lo);
  pstr(p, "parent_block_hash");
  if (parent)
    msgpack_pack_uint64(p, parent->lo);
  else
    msgpack_pack_nil(p);
  pstr(p, "token_ids"), msgpack_pack_array(p, n * BS);
  for (size_t i = 0; i < n * BS; i++)
    msgpack_pack_uint32(p, (uint32_t)(rnd() % 150000));
  pstr(p, "block_size"), msgpack_pack_int(p, BS);
  pstr(p, "lora_id"), msgpack_pack_nil(p);
  pstr(p, "medium"), pstr(p, "GPU");
  pstr(p, "lora_name"), msgpack_pack_nil(p);
  pstr(p, "group_idx"), msgpack_pack_int(p, 0);
}

static void pack_removed(msgpack_packer *p, const kvp_key *k, size_t n) {
  msgpack_pack_map(p, 4);
  pstr(p, "type"), pstr(p, "BlockRemoved");
  pstr(p, "block_hashes"), msgpack_pack_array(p, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(p, k[i].lo);
  pstr(p, "medium"), pstr(p, "GPU");
  pstr(p, "group_idx"), msgpack_pack_int(p, 0);
}

static payload finish(msgpack_sbuffer *sb) {
  payload out = {sb->data, sb->size};
  sb->data = NULL; /* ownership moves to the payload */
  msgpack_sbuffer_destroy(sb);
  return out;
}

/* Each event stores one fresh chain of `blocks` blocks (a request's new
 * blocks); every chain is removed again later in the same order. */
static void make_workload(const cfg *c, workload *w) {
  size_t per = c->events * c->blocks;
  w->n_stored = c->batches;
  w->n = 2 * c->batches;
  w->b = calloc(w->n, sizeof *w->b);
  w->n_keys = c->batches * per;
  w->keys = malloc(w->n_keys * sizeof *w->keys);
  for (size_t i = 0; i < w->n_keys; i++)
    w->keys[i] = (kvp_key){0, rnd() | 4};
  for (int phase = 0; phase < 2; phase++)
    for (size_t b = 0; b < c->batches; b++) {
      msgpack_sbuffer sb;
      msgpack_packer p;
      msgpack_sbuffer_init(&sb);
      msgpack_packer_init(&p, &sb, msgpack_sbuffer_write);
      msgpack_pack_array(&p, 3);
      msgpack_pack_double(&p, 1.7e9 + (double)b);
      msgpack_pack_array(&p, c->events);
      for (size_t e = 0; e < c->events; e++) {
        const kvp_key *k = &w->keys[(b * c->events + e) * c->blocks];
        if (phase == 0)
          pack_stored(&p, k, c->blocks, NULL);
        else
          pack_removed(&p, k, c->blocks);
      }
      msgpack_pack_int(&p, 0);
      w->b[phase * c->batches + b] = finish(&sb);
    }
}

/* ---- in process ------------------------------------------------------------------ */

static kvp_index *new_index(void) {
  kvp_index *ix;
  if (kvp_index_create(NULL, NULL, &ix) < 0 || kvp_index_worker_add(ix, 0) < 0)
    exit(1);
  return ix;
}

/* The floor: the same keys straight into the index, one call per event. */
static double run_index_only(const cfg *c, const workload *w, kvp_index **out) {
  kvp_index *ix = new_index();
  kvp_index_src src = {.worker = 0, .epoch = 1};
  uint64_t t0 = kvp_now_ns();
  size_t per = c->blocks, nev = w->n_keys / per;
  for (size_t e = 0; e < nev; e++) {
    src.seq++;
    if (kvp_index_src_stored(ix, &src, KVP_TIER_HBM, NULL, &w->keys[e * per],
                             per) < 0)
      exit(1);
  }
  for (size_t e = 0; e < nev; e++) {
    src.seq++;
    (void)kvp_index_src_removed(ix, &src, KVP_TIER_HBM, &w->keys[e * per], per);
  }
  double t = bench_secs_since(t0);
  *out = ix;
  return t;
}

static double run_decode(const workload *w, size_t *blocks) {
  kvp_kv_decoder *d;
  kvp_kv_decoder_create(NULL, &d);
  uint64_t t0 = kvp_now_ns();
  size_t n = 0;
  for (size_t i = 0; i < w->n; i++) {
    kvp_kv_batch b;
    if (kvp_kv_decode(d, w->b[i].p, w->b[i].len, &b) < 0)
      exit(1);
    for (size_t e = 0; e < b.n_events; e++)
      n += b.events[e].n_hashes;
  }
  double t = bench_secs_since(t0);
  kvp_kv_decoder_destroy(d);
  *blocks = n;
  return t;
}

/* ---- over ZeroMQ -------------------------------------------------------------------- */

typedef struct pubarg {
  const workload *w;
  char ep[128]; /* the bound endpoint */
  void *ctx, *pub;
  _Atomic int go;
} pubarg;

/* Binds the publisher's socket here; its thread then owns it (pthread_create
 * is the barrier ZeroMQ asks for when a socket changes threads). */
static void pub_bind(pubarg *a, const char *ep) {
  a->pub = zmq_socket(a->ctx, ZMQ_PUB);
  int hwm = 0; /* no limit: a benchmark must not drop */
  zmq_setsockopt(a->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
  if (zmq_bind(a->pub, ep) != 0) {
    fprintf(stderr, "bench_events: bind %s: %s\n", ep, zmq_strerror(errno));
    exit(1);
  }
  size_t n = sizeof a->ep;
  zmq_getsockopt(a->pub, ZMQ_LAST_ENDPOINT, a->ep, &n);
}

static void *publisher(void *arg) {
  pubarg *a = arg;
  void *pub = a->pub;
  while (!a->go) /* the subscriber connects first (slow joiner) */
    nanosleep(&(struct timespec){0, 1000000}, NULL);
  for (size_t i = 0; i < a->w->n; i++) {
    uint8_t s[8];
    for (int k = 0; k < 8; k++)
      s[k] = (uint8_t)((uint64_t)i >> (56 - 8 * k));
    zmq_send(pub, "", 0, ZMQ_SNDMORE);
    zmq_send(pub, s, 8, ZMQ_SNDMORE);
    zmq_send(pub, a->w->b[i].p, a->w->b[i].len, 0);
  }
  /* ZeroMQ's default linger: what is still queued for the subscriber is
   * delivered before zmq_ctx_term returns (a linger of 0 dropped the tail
   * a subscriber on a loaded machine had not read yet, which no subscriber
   * without a replay socket can see: bench_events then lost thousands of
   * batches with 0 gaps) */
  zmq_close(pub);
  return NULL;
}

static double run_wire(const cfg *c, const workload *w, const char *ep,
                       kvp_events_keying keying, kvp_index **out,
                       kvp_events_stats *st, double *cpu) {
  kvp_index *ix = new_index();
  kvp_namespace ns;
  kvp_namespace_desc nd = {.model_id = "bench", .tokenizer_id = "t",
                           .kv_layout = "l", .block_size = BS};
  kvp_namespace_init(&nd, &ns);
  kvp_events_opts o = {.rcvhwm = 0x7fffffff};
  pubarg a = {.w = w, .ctx = zmq_ctx_new()};
  pub_bind(&a, ep);
  kvp_events_source s = {.endpoint = a.ep, .keying = keying,
                         .ns = keying == KVP_EVENTS_REKEY ? &ns : NULL};
  pthread_t th;
  pthread_create(&th, NULL, publisher, &a);
  kvp_events *ev;
  if (kvp_events_create(ix, &s, 1, &o, NULL, &ev) < 0)
    exit(1);
  for (int i = 0; i < 20; i++)
    (void)kvp_events_poll(ev, 5); /* connected */
  uint64_t t0 = kvp_now_ns();
  double c0 = cpu_s();
  a.go = 1; /* from here: the publisher sends, this thread receives */
  for (;;) {
    int r = kvp_events_poll(ev, 1000);
    kvp_events_stats_get(ev, UINT32_MAX, st);
    if (st->batches >= w->n || r == 0)
      break;
  }
  double t = bench_secs_since(t0);
  *cpu = cpu_s() - c0;
  pthread_join(th, NULL);
  kvp_events_destroy(ev);
  zmq_ctx_term(a.ctx);
  (void)c;
  *out = ix;
  return t;
}

/* ---- checks and report ------------------------------------------------------------ */

static uint64_t residencies(kvp_index *ix) {
  kvp_index_stats s;
  kvp_index_stats_get(ix, &s);
  return s.residencies;
}

static const bench_col cols[] = {{"path", 30}, {"rate", 12}, {"ratio", 8}};
static const bench_table table = {BENCH_TEXT, 0, cols, 3};

static void row(const char *name, double blocks, double t, double floor_rate,
                double cpu) {
  double rate = blocks / t;
  char tail[64] = "";
  if (cpu > 0)
    snprintf(tail, sizeof tail, "   %8.2f M per subscriber CPU-s",
             blocks / cpu / 1e6);
  bench_row w = bench_row_start(&table);
  bench_cell(&w, "%s", name);
  bench_cell(&w, "%.2f M/s", rate / 1e6);
  bench_cell_ratio(&w, rate, floor_rate > 0 ? floor_rate : rate, 3, false);
  bench_row_end(&w, tail);
}

static int parse(int argc, char **argv, cfg *c) {
  uint64_t batches = 4000, events = 32, blocks = 16;
  bench_opt t[] = {
      BENCH_OPT("quick", BENCH_FLAG, &c->quick, NULL,
                "64 batches x 4 events x 8 blocks; checks that every path "
                "ends with the same index"),
      BENCH_OPT("batches", BENCH_U64, &batches, "N", "msgpack batches"),
      BENCH_OPT("events", BENCH_U64, &events, "E", "events per batch"),
      BENCH_OPT("blocks", BENCH_U64, &blocks, "B", "blocks per event"),
      BENCH_OPT_END};
  if (bench_parse("bench_events",
                  "vLLM-shaped KV-event batches decoded and applied to an "
                  "index, in process and\nover ZeroMQ ipc / tcp loopback, "
                  "against the index-only ingest of the same keys.\nOptions "
                  "given explicitly win over --quick's.\n",
                  t, argc, argv) < 0)
    return 2;
  c->batches = c->quick && !bench_given(t, "batches") ? 64 : batches;
  c->events = c->quick && !bench_given(t, "events") ? 4 : events;
  c->blocks = c->quick && !bench_given(t, "blocks") ? 8 : blocks;
  if (c->batches == 0 || c->events == 0 || c->blocks == 0) {
    fprintf(stderr, "bench_events: sizes must be >= 1\n");
    return 2;
  }
  return 0;
}

typedef struct wire_path {
  const char *name, *ep;
  kvp_events_keying k;
} wire_path;

static const wire_path wire[] = {
    {"ipc, engine hashes", "ipc:///tmp/kvp-bench-events", KVP_EVENTS_ENGINE_HASH},
    {"tcp loopback, engine hashes", "tcp://127.0.0.1:*", KVP_EVENTS_ENGINE_HASH},
    {"ipc, re-keyed (XXH3-128)", "ipc:///tmp/kvp-bench-events-rk", KVP_EVENTS_REKEY},
    {"tcp loopback, re-keyed", "tcp://127.0.0.1:*", KVP_EVENTS_REKEY}};

/* One path over ZeroMQ, reported; returns 1 when its index differs from
 * ix0 (the index-only ingest's) or batches were lost. */
static int measure_wire(const cfg *c, const workload *w, const wire_path *p,
                        kvp_index *ix0, double floor_rate) {
  kvp_index *ix;
  kvp_events_stats st;
  double cpu, blocks = 2.0 * (double)w->n_keys; /* stored + removed */
  double t = run_wire(c, w, p->ep, p->k, &ix, &st, &cpu);
  int bad = 0;
  if (st.batches != w->n || residencies(ix) != residencies(ix0) ||
      st.gaps != 0 || st.decode_errors != 0) {
    fprintf(stderr, "%s: %" PRIu64 " of %zu batches, %" PRIu64
            " residencies (want %" PRIu64 "), %" PRIu64 " gaps, %" PRIu64
            " missed, %" PRIu64 " queue drops\n", p->name, st.batches, w->n,
            residencies(ix), residencies(ix0), st.gaps, st.batches_missed,
            st.queue_drops);
    bad = 1;
  }
  row(p->name, blocks, t, floor_rate, cpu);
  if (p->k == KVP_EVENTS_REKEY)
    /* the map never shrinks: its size now is its size at the peak, when
     * every stored block was remembered */
    printf("%-30s %8.1f map bytes per remembered block at the peak\n", "",
           (double)st.rekey_bytes / (double)w->n_keys);
  kvp_index_destroy(ix);
  return bad;
}

int main(int argc, char **argv) {
  cfg c = {0};
  if (parse(argc, argv, &c) != 0)
    return 2;
  workload w;
  make_workload(&c, &w);
  double blocks = 2.0 * (double)w.n_keys; /* stored + removed */
  size_t bytes = 0;
  for (size_t i = 0; i < w.n; i++)
    bytes += w.b[i].len;
  printf("bench_events: %zu batches x %zu events x %zu blocks (%d tokens "
         "each), stored then removed: %.0f block hashes, %.1f MB of msgpack\n",
         c.batches, c.events, c.blocks, BS, blocks, (double)bytes / 1e6);
  kvp_index *ix0;
  double t_ix = run_index_only(&c, &w, &ix0);
  double floor_rate = blocks / t_ix;
  size_t nb;
  double t_dec = run_decode(&w, &nb);
  if ((double)nb != blocks)
    return fprintf(stderr, "decode saw %zu blocks\n", nb), 1;
  bench_table_head(&table, "   (block hashes per second; ratio to the index "
                           "alone)");
  row("index only (floor)", blocks, t_ix, 0, 0);
  row("decode only", blocks, t_dec, floor_rate, 0);
  int bad = 0;
  for (size_t i = 0; i < sizeof wire / sizeof *wire; i++)
    bad |= measure_wire(&c, &w, &wire[i], ix0, floor_rate);
  kvp_index_destroy(ix0);
  for (size_t i = 0; i < w.n; i++)
    free(w.b[i].p);
  free(w.b);
  free(w.keys);
  return bad;
}
