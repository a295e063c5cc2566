/* SPDX-License-Identifier: Apache-2.0 */
/* connectors/events: the msgpack decoder on vLLM's shapes (map and array
 * forms, malformed input), and the subscriber over real ZeroMQ sockets
 * (tcp loopback, and ipc) against a publisher that speaks vLLM's
 * PUB + replay ROUTER protocol:
 * order, duplicates, gaps with and without replay, a replay that no longer
 * has the batches, publisher restart, bad payloads, re-keying, hybrid
 * groups, stats.  vLLM's own publisher is driven by tests/interop. */
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

#include "events_internal.h"
#include "test_harness.h"

/* ---- payloads as vLLM's msgspec encoder writes them ---------------------------- */

typedef struct pk {
  msgpack_sbuffer sb;
  msgpack_packer p;
} pk;

static void pk_init(pk *k) {
  msgpack_sbuffer_init(&k->sb);
  msgpack_packer_init(&k->p, &k->sb, msgpack_sbuffer_write);
}

static void pk_free(pk *k) { msgpack_sbuffer_destroy(&k->sb); }

static void s_(pk *k, const char *s) {
  msgpack_pack_str(&k->p, strlen(s));
  msgpack_pack_str_body(&k->p, s, strlen(s));
}

static void batch(pk *k, size_t n_events, int dp_rank) {
  msgpack_pack_array(&k->p, dp_rank < 0 ? 2 : 3);
  msgpack_pack_double(&k->p, 1700000000.25);
  if (dp_rank >= 0) {
    /* msgspec writes ts, events, rank: events follow, rank after them */
  }
  msgpack_pack_array(&k->p, n_events);
}

static void batch_end(pk *k, int dp_rank) {
  if (dp_rank >= 0)
    msgpack_pack_int(&k->p, dp_rank);
}

static void hashes(pk *k, const uint64_t *h, size_t n) {
  msgpack_pack_array(&k->p, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(&k->p, h[i]);
}

typedef struct stored_ev {
  const uint64_t *h;
  size_t n;
  const uint64_t *parent;
  const uint32_t *tokens;
  uint32_t bs;
  const char *medium;
  const char *lora;   /* also the first extra key of every block */
  int group;          /* -1: omitted */
  const char *kind;   /* NULL: omitted */
  bool array_form;
} stored_ev;

static void tokens(pk *k, const uint32_t *t, size_t n) {
  msgpack_pack_array(&k->p, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint32(&k->p, t[i]);
}

static void opt_s(pk *k, const char *s) {
  if (s)
    s_(k, s);
  else
    msgpack_pack_nil(&k->p);
}

static void extra_keys(pk *k, const stored_ev *e) {
  msgpack_pack_array(&k->p, e->n);
  for (size_t i = 0; i < e->n; i++) {
    msgpack_pack_array(&k->p, 1);
    s_(k, e->lora);
  }
}

/* BlockStored as msgspec writes it: the tag, then the fields without
 * defaults always, the others only when set. */
static void stored(pk *k, const stored_ev *e) {
  size_t nf = 7 + (e->lora != NULL) + (e->group >= 0) + (e->kind != NULL);
  if (e->array_form) {
    msgpack_pack_array(&k->p, 1 + 7 + (e->lora || e->group >= 0 || e->kind ? 3 : 0));
    s_(k, "BlockStored");
  } else {
    msgpack_pack_map(&k->p, nf + 1);
    s_(k, "type");
    s_(k, "BlockStored");
  }
#define FIELD(name) if (!e->array_form) s_(k, name)
  FIELD("block_hashes");
  hashes(k, e->h, e->n);
  FIELD("parent_block_hash");
  if (e->parent)
    msgpack_pack_uint64(&k->p, *e->parent);
  else
    msgpack_pack_nil(&k->p);
  FIELD("token_ids");
  tokens(k, e->tokens, e->n * e->bs);
  FIELD("block_size");
  msgpack_pack_uint32(&k->p, e->bs);
  FIELD("lora_id");
  msgpack_pack_nil(&k->p);
  FIELD("medium");
  opt_s(k, e->medium);
  FIELD("lora_name");
  opt_s(k, e->lora);
  if (e->array_form && (e->lora || e->group >= 0 || e->kind)) {
    if (e->lora)
      extra_keys(k, e);
    else
      msgpack_pack_nil(&k->p);
    if (e->group >= 0)
      msgpack_pack_int(&k->p, e->group);
    else
      msgpack_pack_nil(&k->p);
    opt_s(k, e->kind);
    return;
  }
  if (e->lora) {
    FIELD("extra_keys");
    extra_keys(k, e);
  }
  if (e->group >= 0) {
    FIELD("group_idx");
    msgpack_pack_int(&k->p, e->group);
  }
  if (e->kind) {
    FIELD("kv_cache_spec_kind");
    s_(k, e->kind);
  }
#undef FIELD
}

static void removed(pk *k, const uint64_t *h, size_t n, const char *medium,
                    int group) {
  msgpack_pack_map(&k->p, 3 + (group >= 0));
  s_(k, "type");
  s_(k, "BlockRemoved");
  s_(k, "block_hashes");
  hashes(k, h, n);
  s_(k, "medium");
  opt_s(k, medium);
  if (group >= 0) {
    s_(k, "group_idx");
    msgpack_pack_int(&k->p, group);
  }
}

static void cleared(pk *k) {
  msgpack_pack_map(&k->p, 1);
  s_(k, "type");
  s_(k, "AllBlocksCleared");
}

/* ---- a publisher speaking vLLM's protocol ---------------------------------------- */

#define TP_BUF 64

typedef struct tpub {
  void *ctx, *pub, *router;
  char ep[160], rep[160];
  uint64_t seq[TP_BUF];
  char *data[TP_BUF];
  size_t len[TP_BUF];
  size_t n;
  uint64_t keep_from; /* replay serves only seq >= keep_from */
} tpub;

static int test_no;
static bool use_ipc;
static int tp_sndhwm; /* the PUB's ZMQ_SNDHWM (0: ZeroMQ's); set before bind */

/* Binds sock to ep (a tcp port the OS picks when ep ends in ":*"; then ep
 * becomes the bound endpoint).  A port just closed may still be taken:
 * retries for a second. */
static void bind_at(void *sock, char *ep, size_t cap) {
  int rc = -1;
  for (int i = 0; i < 100 && (rc = zmq_bind(sock, ep)) != 0; i++)
    nanosleep(&(struct timespec){0, 10 * 1000000}, NULL);
  ASSERT_EQ(rc, 0);
  size_t n = cap;
  ASSERT_EQ(zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &n), 0);
}

static void tp_open(tpub *t, bool with_replay) {
  memset(t, 0, sizeof *t);
  t->ctx = zmq_ctx_new();
  t->pub = zmq_socket(t->ctx, ZMQ_PUB);
  if (tp_sndhwm > 0)
    ASSERT_EQ(zmq_setsockopt(t->pub, ZMQ_SNDHWM, &tp_sndhwm, sizeof tp_sndhwm),
              0);
  if (use_ipc) {
    snprintf(t->ep, sizeof t->ep, "ipc:///tmp/kvp-test-events-%d-%d",
             getpid(), test_no);
    snprintf(t->rep, sizeof t->rep, "ipc:///tmp/kvp-test-events-%d-%d-r",
             getpid(), test_no++);
  } else {
    snprintf(t->ep, sizeof t->ep, "tcp://127.0.0.1:*");
    snprintf(t->rep, sizeof t->rep, "tcp://127.0.0.1:*");
  }
  bind_at(t->pub, t->ep, sizeof t->ep);
  if (with_replay) {
    t->router = zmq_socket(t->ctx, ZMQ_ROUTER);
    bind_at(t->router, t->rep, sizeof t->rep);
  }
}

static void tp_close(tpub *t) {
  int zero = 0;
  zmq_setsockopt(t->pub, ZMQ_LINGER, &zero, sizeof zero);
  zmq_close(t->pub);
  if (t->router) {
    zmq_setsockopt(t->router, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(t->router);
  }
  zmq_ctx_term(t->ctx);
  for (size_t i = 0; i < t->n; i++)
    free(t->data[i]);
}

static void be8(uint64_t v, uint8_t out[8]) {
  for (int i = 0; i < 8; i++)
    out[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* Buffers batch `seq` for replay; sends it live unless `live` is false (a
 * batch the subscriber misses). */
static void tp_send(tpub *t, uint64_t seq, const void *p, size_t len,
                    bool live) {
  ASSERT_LT(t->n, (size_t)TP_BUF);
  t->seq[t->n] = seq;
  t->data[t->n] = malloc(len ? len : 1);
  memcpy(t->data[t->n], p, len);
  t->len[t->n++] = len;
  if (!live)
    return;
  uint8_t s[8];
  be8(seq, s);
  zmq_send(t->pub, "", 0, ZMQ_SNDMORE);
  zmq_send(t->pub, s, 8, ZMQ_SNDMORE);
  zmq_send(t->pub, p, len, 0);
}

static void tp_send_pk(tpub *t, uint64_t seq, pk *k, bool live) {
  tp_send(t, seq, k->sb.data, k->sb.size, live);
  pk_free(k);
}

/* Answers replay requests: [id, "", start] -> [id, "", topic, seq,
 * payload]... then the end marker. */
static void tp_serve(tpub *t) {
  while (t->router) {
    zmq_msg_t f[3];
    int n = 0;
    for (; n < 3; n++) {
      zmq_msg_init(&f[n]);
      if (zmq_msg_recv(&f[n], t->router, n == 0 ? ZMQ_DONTWAIT : 0) < 0)
        break;
      if (!zmq_msg_more(&f[n])) {
        n++;
        break;
      }
    }
    if (n < 3) {
      for (int i = 0; i <= n && i < 3; i++)
        zmq_msg_close(&f[i]);
      return;
    }
    const uint8_t *sp = zmq_msg_data(&f[2]);
    uint64_t start = 0;
    for (int i = 0; i < 8; i++)
      start = start << 8 | sp[i];
    for (size_t i = 0; i < t->n; i++) {
      if (t->seq[i] < start || t->seq[i] < t->keep_from)
        continue;
      uint8_t s[8];
      be8(t->seq[i], s);
      zmq_send(t->router, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE);
      zmq_send(t->router, "", 0, ZMQ_SNDMORE);
      zmq_send(t->router, "", 0, ZMQ_SNDMORE);
      zmq_send(t->router, s, 8, ZMQ_SNDMORE);
      zmq_send(t->router, t->data[i], t->len[i], 0);
    }
    uint8_t end[8];
    be8(UINT64_MAX, end);
    zmq_send(t->router, zmq_msg_data(&f[0]), zmq_msg_size(&f[0]), ZMQ_SNDMORE);
    zmq_send(t->router, "", 0, ZMQ_SNDMORE);
    zmq_send(t->router, "", 0, ZMQ_SNDMORE);
    zmq_send(t->router, end, 8, ZMQ_SNDMORE);
    zmq_send(t->router, "", 0, 0);
    for (int i = 0; i < 3; i++)
      zmq_msg_close(&f[i]);
  }
}

static void pump(kvp_events *ev, tpub *t, int ms) {
  uint64_t end = kvp_now_ns() + (uint64_t)ms * 1000000u;
  while (kvp_now_ns() < end) {
    tp_serve(t);
    ASSERT_OK(kvp_events_poll(ev, 2));
  }
}

/* Pumps until the subscriber applied `n` batches in all (or 3 s). */
static void pump_until(kvp_events *ev, tpub *t, uint64_t n) {
  kvp_events_stats s;
  for (int i = 0; i < 1500; i++) {
    tp_serve(t);
    ASSERT_OK(kvp_events_poll(ev, 2));
    ASSERT_OK(kvp_events_stats_get(ev, UINT32_MAX, &s));
    if (s.batches >= n)
      return;
  }
  ASSERT_GE(s.batches, n);
}

/* ---- index helpers ---------------------------------------------------------------- */

static uint32_t prefix_on(kvp_index *ix, const kvp_key *keys, size_t n,
                          uint32_t worker, kvp_tier tier) {
  kvp_index_match m[8];
  int c = kvp_index_query(ix, keys, n, 0, m, 8);
  ASSERT_GE(c, 0);
  for (int i = 0; i < c && i < 8; i++)
    if (m[i].worker == worker)
      return tier == KVP_TIER_COUNT_ ? m[i].prefix_blocks
                                     : m[i].tier_blocks[tier];
  return 0;
}

static uint32_t held(kvp_index *ix, const uint64_t *h, size_t n, kvp_tier t) {
  kvp_key k[16];
  for (size_t i = 0; i < n; i++)
    k[i] = (kvp_key){0, h[i]};
  return prefix_on(ix, k, n, 0, t);
}

static kvp_events_stats stats(kvp_events *ev) {
  kvp_events_stats s;
  ASSERT_OK(kvp_events_stats_get(ev, UINT32_MAX, &s));
  return s;
}

/* ---- decoder -------------------------------------------------------------------- */

static const uint64_t H[4] = {0x1111111111111111ull, 0x2222222222222222ull,
                              0xfedcba9876543210ull, 42};
static const uint32_t TOK[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                 13, 14, 15, 4000000000u};

static void check_stored(const kvp_kv_event *e) {
  ASSERT_EQ(e->type, KVP_KV_BLOCK_STORED);
  ASSERT_EQ(e->n_hashes, 2u);
  ASSERT_EQ(e->hashes[0].u64, H[0]);
  ASSERT_EQ(e->hashes[1].u64, H[1]);
  ASSERT_EQ(e->hashes[0].len, 0);
  ASSERT_NOT_NULL(e->parent);
  ASSERT_EQ(e->parent->u64, H[3]);
  ASSERT_EQ(e->n_tokens, 8u);
  ASSERT_EQ(e->tokens[7], 8u);
  ASSERT_EQ(e->block_size, 4u);
  ASSERT_STR_EQ(e->medium, "CPU");
  ASSERT_EQ(e->tier, KVP_TIER_DRAM);
  ASSERT_STR_EQ(e->lora_name, "ad-1");
  ASSERT_NOT_NULL(e->extras);
  ASSERT_STR_EQ(e->extras[1].lora_name, "ad-1");
  ASSERT_NULL(e->extras[1].cache_salt);
  ASSERT_EQ(e->group_idx, 2);
  ASSERT_STR_EQ(e->spec_kind, "full_attention");
}

static void test_decode_forms(void) {
  kvp_kv_decoder *d;
  ASSERT_OK(kvp_kv_decoder_create(NULL, &d));
  for (int form = 0; form < 2; form++) {
    pk k;
    pk_init(&k);
    batch(&k, 4, 3);
    stored_ev e = {.h = H, .n = 2, .parent = &H[3], .tokens = TOK, .bs = 4,
                   .medium = "CPU", .lora = "ad-1", .group = 2,
                   .kind = "full_attention", .array_form = form == 1};
    stored(&k, &e);
    removed(&k, &H[2], 1, NULL, -1);
    msgpack_pack_map(&k.p, 2); /* an event type from the future */
    s_(&k, "type");
    s_(&k, "BlockMoved");
    s_(&k, "x");
    msgpack_pack_int(&k.p, 1);
    cleared(&k);
    batch_end(&k, 3);
    kvp_kv_batch b;
    ASSERT_EQ(kvp_kv_decode(d, k.sb.data, k.sb.size, &b), 3);
    ASSERT_EQ(b.dp_rank, 3);
    ASSERT_EQ(b.unknown_events, 1u);
    ASSERT_DOUBLE_NEAR(b.ts, 1700000000.25, 1e-9);
    check_stored(&b.events[0]);
    ASSERT_EQ(b.events[1].type, KVP_KV_BLOCK_REMOVED);
    ASSERT_EQ(b.events[1].tier, KVP_TIER_HBM); /* medium None = GPU */
    ASSERT_EQ(b.events[1].hashes[0].u64, H[2]);
    ASSERT_EQ(b.events[2].type, KVP_KV_ALL_CLEARED);
    pk_free(&k);
  }
  kvp_kv_decoder_destroy(d);
}

/* Byte-form hashes, mm pairs, the cache salt, unknown fields. */
static void test_decode_digests(void) {
  kvp_kv_decoder *d;
  ASSERT_OK(kvp_kv_decoder_create(NULL, &d));
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 9);
  s_(&k, "type"), s_(&k, "BlockStored");
  s_(&k, "block_hashes");
  msgpack_pack_array(&k.p, 1);
  uint8_t dg[32];
  for (int i = 0; i < 32; i++)
    dg[i] = (uint8_t)(i + 1);
  msgpack_pack_bin(&k.p, 32), msgpack_pack_bin_body(&k.p, dg, 32);
  s_(&k, "parent_block_hash"), msgpack_pack_nil(&k.p);
  s_(&k, "token_ids"), tokens(&k, TOK, 4);
  s_(&k, "block_size"), msgpack_pack_int(&k.p, 4);
  s_(&k, "medium"), s_(&k, "GPU");
  s_(&k, "lora_name"), msgpack_pack_nil(&k.p);
  s_(&k, "extra_keys");
  msgpack_pack_array(&k.p, 1);
  msgpack_pack_array(&k.p, 3);
  msgpack_pack_array(&k.p, 2), s_(&k, "img-7"), msgpack_pack_int(&k.p, -3);
  msgpack_pack_array(&k.p, 2), s_(&k, "img-8"), msgpack_pack_int(&k.p, 2);
  s_(&k, "salt!");
  s_(&k, "future_field"), msgpack_pack_true(&k.p);
  kvp_kv_batch b;
  ASSERT_EQ(kvp_kv_decode(d, k.sb.data, k.sb.size, &b), 1);
  const kvp_kv_event *e = &b.events[0];
  ASSERT_EQ(e->hashes[0].len, 32);
  ASSERT_MEM_EQ(e->hashes[0].digest, dg, 32);
  ASSERT_EQ(e->hashes[0].u64, 0x191a1b1c1d1e1f20ull); /* low 64 bits, BE */
  ASSERT_EQ(e->extras[0].n_mm, 2u);
  ASSERT_STR_EQ(e->extras[0].mm[0].id, "img-7");
  ASSERT_EQ(e->extras[0].mm[0].offset, -3);
  ASSERT_STR_EQ(e->extras[0].mm[1].id, "img-8");
  ASSERT_STR_EQ(e->extras[0].cache_salt, "salt!");
  ASSERT_NULL(e->extras[0].lora_name);
  ASSERT_EQ(e->unknown_fields, 1u);
  ASSERT_EQ(b.dp_rank, -1);
  pk_free(&k);
  kvp_kv_decoder_destroy(d);
}

static void expect_bad(kvp_kv_decoder *d, const void *p, size_t n, int want) {
  kvp_kv_batch b;
  ASSERT_ERR(kvp_kv_decode(d, p, n, &b), want);
  ASSERT_EQ(b.n_events, 0u);
}

static void test_decode_malformed(void) {
  kvp_kv_decoder *d;
  ASSERT_OK(kvp_kv_decoder_create(NULL, &d));
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  stored_ev e = {.h = H, .n = 2, .tokens = TOK, .bs = 4, .group = -1};
  stored(&k, &e);
  kvp_kv_batch b;
  ASSERT_EQ(kvp_kv_decode(d, k.sb.data, k.sb.size, &b), 1);
  for (size_t cut = 0; cut < k.sb.size; cut++) /* every truncation */
    expect_bad(d, k.sb.data, cut, KVP_ECORRUPT);
  char *extra = malloc(k.sb.size + 1); /* trailing garbage */
  memcpy(extra, k.sb.data, k.sb.size);
  extra[k.sb.size] = 0x01;
  expect_bad(d, extra, k.sb.size + 1, KVP_ECORRUPT);
  free(extra);
  pk_free(&k);
  /* a 6-byte header claiming 2^32-1 elements: refused before allocating */
  const uint8_t bomb[] = {0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0,
                          0xdd, 0xff, 0xff, 0xff, 0xff};
  expect_bad(d, bomb, sizeof bomb, KVP_ECORRUPT);
  const uint8_t never[] = {0xc1};
  expect_bad(d, never, 1, KVP_ECORRUPT);
  const uint8_t not_batch[] = {0x2a}; /* the int 42 */
  expect_bad(d, not_batch, 1, KVP_ECORRUPT);
  /* a 33-byte digest, a token id above u32, tokens not block_size each */
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 2), s_(&k, "type"), s_(&k, "BlockRemoved");
  s_(&k, "block_hashes"), msgpack_pack_array(&k.p, 1);
  uint8_t big[33] = {0};
  msgpack_pack_bin(&k.p, 33), msgpack_pack_bin_body(&k.p, big, 33);
  expect_bad(d, k.sb.data, k.sb.size, KVP_ERANGE);
  pk_free(&k);
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 4), s_(&k, "type"), s_(&k, "BlockStored");
  s_(&k, "block_hashes"), hashes(&k, H, 1);
  s_(&k, "block_size"), msgpack_pack_int(&k.p, 2);
  s_(&k, "token_ids"), msgpack_pack_array(&k.p, 2);
  msgpack_pack_uint64(&k.p, 1), msgpack_pack_uint64(&k.p, 1ull << 32);
  expect_bad(d, k.sb.data, k.sb.size, KVP_ERANGE);
  pk_free(&k);
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 4), s_(&k, "type"), s_(&k, "BlockStored");
  s_(&k, "block_hashes"), hashes(&k, H, 2);
  s_(&k, "block_size"), msgpack_pack_int(&k.p, 4);
  s_(&k, "token_ids"), tokens(&k, TOK, 7);
  expect_bad(d, k.sb.data, k.sb.size, KVP_ECORRUPT);
  pk_free(&k);
  /* an event map without "type", a hash that is a string */
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 1), s_(&k, "block_hashes"), hashes(&k, H, 1);
  expect_bad(d, k.sb.data, k.sb.size, KVP_ECORRUPT);
  pk_free(&k);
  pk_init(&k);
  batch(&k, 1, -1);
  msgpack_pack_map(&k.p, 2), s_(&k, "type"), s_(&k, "BlockRemoved");
  s_(&k, "block_hashes"), msgpack_pack_array(&k.p, 1), s_(&k, "abc");
  expect_bad(d, k.sb.data, k.sb.size, KVP_ECORRUPT);
  pk_free(&k);
  kvp_kv_decoder_destroy(d);
}

/* ---- the subscriber ---------------------------------------------------------------- */

typedef struct fixture {
  tpub t;
  kvp_index *ix;
  kvp_events *ev;
  kvp_namespace ns;
} fixture;

static void fx_open(fixture *f, bool replay, kvp_events_keying keying,
                    uint32_t replay_timeout_ms) {
  memset(f, 0, sizeof *f);
  tp_open(&f->t, replay);
  ASSERT_OK(kvp_index_create(NULL, NULL, &f->ix));
  ASSERT_OK(kvp_index_worker_add(f->ix, 0));
  kvp_namespace_desc nd = {.model_id = "m", .tokenizer_id = "t",
                           .kv_layout = "l", .block_size = 4};
  ASSERT_OK(kvp_namespace_init(&nd, &f->ns));
  kvp_events_source s = {.endpoint = f->t.ep,
                         .replay_endpoint = replay ? f->t.rep : NULL,
                         .keying = keying,
                         .ns = keying == KVP_EVENTS_REKEY ? &f->ns : NULL};
  kvp_events_opts o = {.replay_timeout_ms = replay_timeout_ms};
  ASSERT_OK(kvp_events_create(f->ix, &s, 1, &o, NULL, &f->ev));
  pump(f->ev, &f->t, 150); /* the SUB connects (ZeroMQ is asynchronous) */
}

static void fx_close(fixture *f) {
  kvp_events_destroy(f->ev);
  kvp_index_destroy(f->ix);
  tp_close(&f->t);
}

static void send_stored(fixture *f, uint64_t seq, const uint64_t *h, size_t n,
                        const uint64_t *parent, const char *medium,
                        bool live) {
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  stored_ev e = {.h = h, .n = n, .parent = parent, .tokens = TOK, .bs = 4,
                 .medium = medium, .group = -1};
  stored(&k, &e);
  tp_send_pk(&f->t, seq, &k, live);
}

static void send_removed(fixture *f, uint64_t seq, const uint64_t *h, size_t n,
                         bool live) {
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  removed(&k, h, n, "GPU", -1);
  tp_send_pk(&f->t, seq, &k, live);
}

static void test_in_order(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  send_stored(&f, 1, &H[2], 1, &H[1], "GPU", true);
  send_stored(&f, 2, H, 2, NULL, "CPU", true);
  pump_until(f.ev, &f.t, 3);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_COUNT_), 3u);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_HBM), 3u);
  send_removed(&f, 3, &H[1], 2, true);
  pump_until(f.ev, &f.t, 4);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_HBM), 1u);  /* block 1 left HBM */
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_COUNT_), 2u); /* still in DRAM */
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.batches, 4u);
  ASSERT_EQ(s.blocks_stored, 5u);
  ASSERT_EQ(s.blocks_removed, 2u);
  ASSERT_EQ(s.gaps, 0u);
  ASSERT_EQ(s.residency_drops, 0u);
  /* a duplicate (same seq, same bytes) changes nothing */
  free(f.t.data[--f.t.n]); /* resend batch 3, byte for byte */
  send_removed(&f, 3, &H[1], 2, true);
  pump(f.ev, &f.t, 100);
  ASSERT_EQ(stats(f.ev).duplicates, 1u);
  ASSERT_EQ(stats(f.ev).restarts, 0u);
  fx_close(&f);
}

static void test_gap_replayed(void) {
  fixture f;
  fx_open(&f, true, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 1, NULL, "GPU", true);
  send_stored(&f, 1, &H[1], 1, &H[0], "GPU", false); /* lost on the wire */
  send_stored(&f, 2, &H[2], 1, &H[1], "GPU", true);
  pump_until(f.ev, &f.t, 3);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_HBM), 3u);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.gaps, 1u);
  ASSERT_EQ(s.batches_missed, 1u);
  ASSERT_GE(s.replays, 2u); /* the one at start, the one for the gap */
  ASSERT_GE(s.batches_replayed, 1u);
  ASSERT_EQ(s.residency_drops, 0u);
  ASSERT_EQ(s.batches, 3u); /* each exactly once */
  fx_close(&f);
}

static void test_gap_lost(bool replay) {
  fixture f;
  fx_open(&f, replay, KVP_EVENTS_ENGINE_HASH, 0);
  f.t.keep_from = 2; /* the publisher's buffer lost batches 0 and 1 */
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 1);
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_HBM), 2u);
  send_removed(&f, 1, H, 2, false); /* lost: the blocks are gone */
  send_stored(&f, 2, &H[2], 1, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 2);
  pump(f.ev, &f.t, 50);
  /* never claim what may be gone: blocks 0-1 dropped, block 2 known */
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, &H[2], 1, KVP_TIER_HBM), 1u);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.residency_drops, 1u);
  ASSERT_EQ(s.replay_failures, replay ? 1u : 0u);
  ASSERT_EQ(s.gaps, 1u);
  fx_close(&f);
}

static void test_replay_timeout(void) {
  fixture f;
  fx_open(&f, true, KVP_EVENTS_ENGINE_HASH, 100);
  zmq_close(f.t.router); /* the replay socket stops answering */
  f.t.router = NULL;
  send_stored(&f, 0, H, 1, NULL, "GPU", true);
  pump(f.ev, &f.t, 250);
  ASSERT_EQ(held(f.ix, H, 1, KVP_TIER_HBM), 1u);
  send_stored(&f, 2, &H[2], 1, NULL, "GPU", true); /* batch 1 lost */
  pump(f.ev, &f.t, 300);
  ASSERT_EQ(held(f.ix, H, 1, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, &H[2], 1, KVP_TIER_HBM), 1u);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.residency_drops, 1u);
  ASSERT_GE(s.replay_failures, 1u);
  fx_close(&f);
}

/* The event-loop form: one fd, the same one after the replay socket is
 * reopened (a replay timeout), and watching only it is enough -- the
 * reopened socket's answers wake it.  Before, the fds were the sockets' own
 * ZMQ_FDs: a timeout closed one under the caller's event loop (libevent:
 * "Epoll MOD ... Bad file descriptor", then a reused number). */
static void test_loop_fd(void) {
  fixture f;
  fx_open(&f, true, KVP_EVENTS_ENGINE_HASH, 100);
  int fds[8];
  ASSERT_EQ(kvp_events_fds(f.ev, fds, 8), 1);
  int fd = fds[0];
  send_stored(&f, 0, H, 1, NULL, "GPU", true);
  send_stored(&f, 1, &H[1], 1, &H[0], "GPU", false);
  send_stored(&f, 2, &H[2], 1, &H[1], "GPU", true); /* a gap: a replay */
  uint64_t end = kvp_now_ns() + 300 * 1000000ull;
  while (kvp_now_ns() < end) /* nobody answers it: the socket is reopened */
    ASSERT_OK(kvp_events_poll(f.ev, 2));
  kvp_events_stats s = stats(f.ev);
  ASSERT_GE(s.replay_failures, 1u);
  ASSERT_EQ(kvp_events_fds(f.ev, fds, 8), 1);
  ASSERT_EQ(fds[0], fd);
  ASSERT_NE(fcntl(fd, F_GETFD), -1);
  /* another gap: the reopened socket asks, and its answer must reach the
   * loop through `fd` alone */
  static const uint64_t L[2] = {0x5555555555555555ull, 0x6666666666666666ull};
  send_stored(&f, 3, L, 1, &H[2], "GPU", false);
  send_stored(&f, 4, &L[1], 1, L, "GPU", true);
  uint64_t replayed = s.batches_replayed;
  end = kvp_now_ns() + 3000 * 1000000ull;
  while (kvp_now_ns() < end && stats(f.ev).batches_replayed == replayed) {
    tp_serve(&f.t);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 10) > 0)
      ASSERT_GE(kvp_events_poll(f.ev, 0), 0);
  }
  s = stats(f.ev);
  ASSERT_GT(s.batches_replayed, replayed);
  ASSERT_EQ(held(f.ix, L, 2, KVP_TIER_HBM), 2u); /* L[0] came by replay */
  fx_close(&f);
}

static void test_restart(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  send_stored(&f, 1, &H[2], 1, &H[1], "GPU", true);
  pump_until(f.ev, &f.t, 2);
  kvp_index_stream_info si0;
  ASSERT_OK(kvp_index_stream_get(f.ix, 0, 0, &si0));
  /* the engine restarts: numbering from 0 again, an empty cache */
  send_stored(&f, 0, &H[3], 1, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 3);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, &H[3], 1, KVP_TIER_HBM), 1u);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.restarts, 1u);
  ASSERT_EQ(s.duplicates, 0u);
  kvp_index_stream_info si1;
  ASSERT_OK(kvp_index_stream_get(f.ix, 0, 0, &si1));
  ASSERT_GT(si1.epoch, si0.epoch);
  /* the old numbering is not "stale": seq 1 after the restart applies */
  send_stored(&f, 1, &H[0], 1, &H[3], "GPU", true);
  pump_until(f.ev, &f.t, 4);
  ASSERT_EQ(held(f.ix, (uint64_t[]){H[3], H[0]}, 2, KVP_TIER_HBM), 2u);
  fx_close(&f);
}

static void test_bad_payload(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 1);
  tp_send(&f.t, 1, "\xc1garbage", 8, true); /* its effect is unknown */
  zmq_send(f.t.pub, "only one frame", 14, 0); /* not (topic, seq, payload) */
  send_stored(&f, 2, &H[2], 1, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 2);
  pump(f.ev, &f.t, 50);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.decode_errors, 2u);
  ASSERT_EQ(s.residency_drops, 1u);
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, &H[2], 1, KVP_TIER_HBM), 1u);
  fx_close(&f);
}

/* Re-keyed: whatever the engine's hashes are, a request hashed with the
 * namespace finds the worker. */
static void test_rekey(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_REKEY, 0);
  const uint64_t eh[4] = {0xdead, 0xbeef, 0xcafe, 0xf00d}; /* arbitrary */
  pk k;
  pk_init(&k);
  batch(&k, 2, -1);
  stored_ev e = {.h = eh, .n = 2, .tokens = TOK, .bs = 4, .medium = "GPU",
                 .group = -1};
  stored(&k, &e);
  stored_ev c = {.h = &eh[2], .n = 1, .parent = &eh[1], .tokens = TOK + 8,
                 .bs = 4, .medium = "GPU", .group = -1};
  stored(&k, &c);
  tp_send_pk(&f.t, 0, &k, true);
  pump_until(f.ev, &f.t, 1);
  kvp_hasher *h;
  ASSERT_OK(kvp_hasher_create(&f.ns, NULL, NULL, &h));
  kvp_key keys[4];
  ASSERT_EQ(kvp_hasher_hash(h, TOK, 16, NULL, keys, 4, NULL), 4);
  ASSERT_EQ(prefix_on(f.ix, keys, 4, 0, KVP_TIER_HBM), 3u);
  /* a LoRA request does not match base-model blocks */
  kvp_extras x = {.lora_name = "ad-1"};
  kvp_key lk[4];
  ASSERT_EQ(kvp_hasher_hash(h, TOK, 16, &x, lk, 4, NULL), 4);
  ASSERT_EQ(prefix_on(f.ix, lk, 4, 0, KVP_TIER_COUNT_), 0u);
  /* LoRA blocks, published with their untagged extra keys */
  pk_init(&k);
  batch(&k, 1, -1);
  stored_ev l = {.h = &eh[3], .n = 1, .tokens = TOK, .bs = 4,
                 .medium = "GPU", .lora = "ad-1", .group = -1};
  stored(&k, &l);
  tp_send_pk(&f.t, 1, &k, true);
  /* removal by engine hash; an orphan (parent never stored) */
  send_removed(&f, 2, &eh[1], 1, true);
  const uint64_t unknown_parent = 0x5555;
  send_stored(&f, 3, &eh[0], 1, &unknown_parent, "GPU", true);
  pump_until(f.ev, &f.t, 4);
  ASSERT_EQ(prefix_on(f.ix, lk, 4, 0, KVP_TIER_HBM), 1u);
  ASSERT_EQ(prefix_on(f.ix, keys, 4, 0, KVP_TIER_HBM), 1u);
  kvp_events_stats s = stats(f.ev);
  ASSERT_EQ(s.rekey_orphans, 1u);
  ASSERT_EQ(s.rekey_entries, 3u); /* eh 0, 2, 3 */
  ASSERT_GT(s.rekey_bytes, 0u);
  kvp_hasher_destroy(h);
  fx_close(&f);
}

/* Hybrid models: only the full-attention group is indexed. */
static void test_groups(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  pk k;
  pk_init(&k);
  batch(&k, 2, -1);
  stored_ev full = {.h = H, .n = 2, .tokens = TOK, .bs = 4, .medium = "GPU",
                    .group = 1, .kind = "full_attention"};
  stored(&k, &full);
  stored_ev swa = {.h = &H[2], .n = 1, .tokens = TOK, .bs = 4,
                   .medium = "GPU", .group = 0, .kind = "sliding_window"};
  stored(&k, &swa);
  tp_send_pk(&f.t, 0, &k, true);
  pk_init(&k);
  batch(&k, 2, -1);
  removed(&k, H, 1, "GPU", 0); /* the window moved: not a prefix loss */
  removed(&k, &H[1], 1, "GPU", 1);
  tp_send_pk(&f.t, 1, &k, true);
  pump_until(f.ev, &f.t, 2);
  ASSERT_EQ(held(f.ix, H, 1, KVP_TIER_HBM), 1u);
  ASSERT_EQ(held(f.ix, &H[1], 1, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, &H[2], 1, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(stats(f.ev).other_groups, 2u);
  char buf[16384];
  int n = kvp_events_prometheus(f.ev, buf, sizeof buf);
  ASSERT_GT(n, 0);
  ASSERT_LT((size_t)n, sizeof buf);
  ASSERT_NOT_NULL(strstr(buf, "# TYPE kvplane_events_other_groups_total counter\n"));
  ASSERT_NOT_NULL(strstr(buf, "kvplane_events_other_groups_total{source=\"0\",worker=\"0\""));
  ASSERT_NOT_NULL(strstr(buf, "} 2\n"));
  ASSERT_NOT_NULL(strstr(buf, "kvplane_events_lag_seconds{"));
  fx_close(&f);
}

static void test_bad_sources(void) {
  kvp_index *ix;
  kvp_events *ev;
  ASSERT_OK(kvp_index_create(NULL, NULL, &ix));
  ASSERT_OK(kvp_index_worker_add(ix, 0));
  kvp_events_source s = {.endpoint = "ipc:///tmp/kvp-test-events-nobody"};
  ASSERT_ERR(kvp_events_create(ix, &s, 1, NULL, NULL, &ev), KVP_EINVAL);
  ASSERT_NULL(ev); /* REKEY without a namespace */
  s.keying = KVP_EVENTS_ENGINE_HASH;
  s.worker = 1; /* not added */
  ASSERT_ERR(kvp_events_create(ix, &s, 1, NULL, NULL, &ev), KVP_EINVAL);
  s.worker = 0;
  s.stream = KVP_INDEX_STREAMS;
  ASSERT_ERR(kvp_events_create(ix, &s, 1, NULL, NULL, &ev), KVP_EINVAL);
  s.stream = 0;
  s.endpoint = "nonsense://x";
  ASSERT_ERR(kvp_events_create(ix, &s, 1, NULL, NULL, &ev), KVP_EIO);
  s.endpoint = "ipc:///tmp/x";
  s.dp_rank = 1; /* vLLM offsets tcp ports and inproc names only */
  ASSERT_ERR(kvp_events_create(ix, &s, 1, NULL, NULL, &ev), KVP_EINVAL);
  s.endpoint = "tcp://127.0.0.1:5557";
  s.dp_rank = 2;
  ASSERT_OK(kvp_events_create(ix, &s, 1, NULL, NULL, &ev));
  char buf[8192];
  ASSERT_GT(kvp_events_prometheus(ev, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "endpoint=\"tcp://127.0.0.1:5559\""));
  kvp_events_destroy(ev);
  kvp_index_destroy(ix);
}

/* The I/O thread form applies what arrives without the caller polling. */
static void test_thread(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  ASSERT_OK(kvp_events_stop(f.ev));
  kvp_events *ev = f.ev;
  kvp_events_destroy(ev);
  kvp_events_source s = {.endpoint = f.t.ep, .keying = KVP_EVENTS_ENGINE_HASH};
  ASSERT_OK(kvp_events_create(f.ix, &s, 1, NULL, NULL, &f.ev));
  ASSERT_OK(kvp_events_start(f.ev));
  ASSERT_ERR(kvp_events_poll(f.ev, 0), KVP_ESTATE);
  struct timespec ts = {0, 150 * 1000000};
  nanosleep(&ts, NULL);
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  for (int i = 0; i < 300 && stats(f.ev).batches < 1; i++)
    nanosleep(&(struct timespec){0, 10 * 1000000}, NULL);
  ASSERT_EQ(stats(f.ev).batches, 1u);
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_HBM), 2u);
  ASSERT_OK(kvp_events_stop(f.ev));
  fx_close(&f);
}


/* A restart that the live stream alone cannot tell: the new publisher's
 * first live batch carries exactly the number the old one would have sent
 * next.  The SUB's disconnect makes a resync; the replay's batch at the last
 * number differs: new epoch, replay from 0, only the new publisher's blocks
 * remain. */
static void test_restart_replayed(void) {
  fixture f;
  fx_open(&f, true, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 2, NULL, "GPU", true);
  send_stored(&f, 1, &H[2], 1, &H[1], "GPU", true);
  pump_until(f.ev, &f.t, 2);
  char ep[160], rep[160];
  snprintf(ep, sizeof ep, "%s", f.t.ep);
  snprintf(rep, sizeof rep, "%s", f.t.rep);
  tp_close(&f.t);
  pump(f.ev, &f.t, 50); /* the subscriber sees the connection go */
  /* the new publisher, same endpoints, already at seq 2 */
  memset(&f.t, 0, sizeof f.t);
  f.t.ctx = zmq_ctx_new();
  f.t.pub = zmq_socket(f.t.ctx, ZMQ_PUB);
  f.t.router = zmq_socket(f.t.ctx, ZMQ_ROUTER);
  snprintf(f.t.ep, sizeof f.t.ep, "%s", ep);
  snprintf(f.t.rep, sizeof f.t.rep, "%s", rep);
  bind_at(f.t.pub, f.t.ep, sizeof f.t.ep); /* the same endpoints again */
  bind_at(f.t.router, f.t.rep, sizeof f.t.rep);
  const uint64_t n3[3] = {0x31, 0x32, 0x33};
  for (uint64_t q = 0; q < 2; q++)
    send_stored(&f, q, &n3[q], 1, q ? &n3[q - 1] : NULL, "GPU", false);
  pump(f.ev, &f.t, 300); /* reconnected */
  send_stored(&f, 2, &n3[2], 1, &n3[1], "GPU", true);
  kvp_events_stats s;
  for (int i = 0; i < 300; i++) {
    pump(f.ev, &f.t, 10);
    s = stats(f.ev);
    /* the monitor's handshake event comes on its own socket: the new
     * publisher's data and replay can be read before it (seen under ASan) */
    if (s.restarts >= 1 && s.replaying == 0 && s.batches >= 5 &&
        s.connects >= 2)
      break;
  }
  ASSERT_EQ(s.restarts, 1u);
  ASSERT_GE(s.disconnects, 1u);
  /* the first handshake and the new publisher's; a connection lost before
   * its handshake (the old publisher closing, the new one not bound yet)
   * counts as a disconnect without a connect, so only an upper bound */
  ASSERT_GE(s.connects, 2u);
  ASSERT_LE(s.connects, s.disconnects + 1);
  ASSERT_EQ(held(f.ix, H, 3, KVP_TIER_COUNT_), 0u);
  ASSERT_EQ(held(f.ix, n3, 3, KVP_TIER_HBM), 3u);
  ASSERT_EQ(s.batches, 5u); /* 2 old + 3 new, each once */
  fx_close(&f);
}

/* A lost last batch is found by the idle probe. */
static void test_idle_probe(void) {
  fixture f;
  memset(&f, 0, sizeof f);
  tp_open(&f.t, true);
  ASSERT_OK(kvp_index_create(NULL, NULL, &f.ix));
  ASSERT_OK(kvp_index_worker_add(f.ix, 0));
  kvp_events_source src = {.endpoint = f.t.ep, .replay_endpoint = f.t.rep,
                           .keying = KVP_EVENTS_ENGINE_HASH};
  kvp_events_opts o = {.probe_idle_ms = 200};
  ASSERT_OK(kvp_events_create(f.ix, &src, 1, &o, NULL, &f.ev));
  pump(f.ev, &f.t, 150);
  send_stored(&f, 0, H, 1, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 1);
  send_stored(&f, 1, &H[1], 1, &H[0], "GPU", false); /* lost, and the last */
  pump(f.ev, &f.t, 100);
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_HBM), 1u); /* not yet: nothing says */
  pump_until(f.ev, &f.t, 2);
  ASSERT_EQ(held(f.ix, H, 2, KVP_TIER_HBM), 2u);
  ASSERT_EQ(stats(f.ev).residency_drops, 0u);
  ASSERT_EQ(stats(f.ev).restarts, 0u);
  /* a verified probe that finds nothing new changes nothing; first the
   * probe that found batch 2 ends (its batch can be applied before its
   * replay is over: a resync then starts nothing, as CI saw once) */
  for (int i = 0; i < 1500 && stats(f.ev).replaying != 0; i++)
    pump(f.ev, &f.t, 2);
  ASSERT_EQ(stats(f.ev).replaying, 0u);
  uint64_t r = stats(f.ev).replays;
  ASSERT_EQ(kvp_events_resync(f.ev, UINT32_MAX), 1);
  for (int i = 0; i < 1500 && (stats(f.ev).replays < r + 1 ||
                               stats(f.ev).replaying != 0); i++)
    pump(f.ev, &f.t, 2);
  ASSERT_EQ(stats(f.ev).replays, r + 1);
  ASSERT_EQ(stats(f.ev).batches, 2u);
  ASSERT_EQ(stats(f.ev).replaying, 0u);
  fx_close(&f);
}

/* The lag is the delivered batches' (wall clock at delivery - their ts):
 * it stays put while the worker is idle; the idle time is its own gauge. */
static void test_lag_idle(void) {
  fixture f;
  fx_open(&f, false, KVP_EVENTS_ENGINE_HASH, 0);
  send_stored(&f, 0, H, 1, NULL, "GPU", true);
  pump_until(f.ev, &f.t, 1);
  kvp_events_stats a = stats(f.ev);
  pump(f.ev, &f.t, 300);
  kvp_events_stats b = stats(f.ev);
  /* (doubles: ASSERT_TRUE, the typed asserts compare integers) */
  ASSERT_TRUE(a.lag_seconds > 1e7); /* the test batches' ts is in 2023 */
  ASSERT_TRUE(b.lag_seconds == a.lag_seconds);
  ASSERT_TRUE(b.idle_seconds >= a.idle_seconds + 0.25);
  ASSERT_TRUE(a.idle_seconds < 0.25);
  char buf[8192];
  ASSERT_GT(kvp_events_prometheus(f.ev, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "# TYPE kvplane_events_idle_seconds gauge\n"));
  ASSERT_NOT_NULL(strstr(buf, "kvplane_events_idle_seconds{source=\"0\""));
  fx_close(&f);
}

/* ---- a subscriber slower than its publisher ------------------------------------- */

/* A publisher outruns a subscriber that does not read (SNDHWM and RCVHWM 8
 * messages, batches of SLOW_BLOCKS blocks: far more than the pipes and the
 * kernel's socket buffers hold), so ZeroMQ's PUB drops batches without a
 * word.  Nothing may be lost silently: with a replay socket every batch is
 * applied exactly once in the end and the index holds every block; without
 * one, once a later batch shows the gap, every batch is either applied or
 * counted missed, the source's residency is dropped (no block of a missed
 * batch claimed) and the rest applied. */
#define SLOW_N 48
#define SLOW_BLOCKS 4096

static uint64_t slow_hash(size_t b, size_t i) {
  return ((uint64_t)(b + 1) << 32) | (uint64_t)(i + 1);
}

static void slow_send(tpub *t, uint64_t seq, uint64_t *h, const uint32_t *tok) {
  for (size_t i = 0; i < SLOW_BLOCKS; i++)
    h[i] = slow_hash((size_t)seq, i);
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  stored_ev e = {.h = h, .n = SLOW_BLOCKS, .tokens = tok, .bs = 4,
                 .medium = "GPU", .group = -1};
  stored(&k, &e);
  tp_send_pk(t, seq, &k, true);
}

static void test_slow_subscriber(bool replay) {
  uint64_t *h = malloc(SLOW_BLOCKS * sizeof *h);
  uint32_t *tok = malloc(SLOW_BLOCKS * 4 * sizeof *tok);
  ASSERT_TRUE(h != NULL && tok != NULL);
  for (size_t i = 0; i < SLOW_BLOCKS * 4; i++)
    tok[i] = (uint32_t)(i % 1000) + 1;
  fixture f;
  memset(&f, 0, sizeof f);
  use_ipc = true;
  tp_sndhwm = 8;
  tp_open(&f.t, replay);
  use_ipc = false;
  tp_sndhwm = 0;
  ASSERT_OK(kvp_index_create(NULL, NULL, &f.ix));
  ASSERT_OK(kvp_index_worker_add(f.ix, 0));
  kvp_events_source src = {.endpoint = f.t.ep,
                           .replay_endpoint = replay ? f.t.rep : NULL,
                           .keying = KVP_EVENTS_ENGINE_HASH};
  kvp_events_opts o = {.rcvhwm = 8, .probe_idle_ms = 300};
  ASSERT_OK(kvp_events_create(f.ix, &src, 1, &o, NULL, &f.ev));
  pump(f.ev, &f.t, 150);
  for (uint64_t b = 0; b < SLOW_N; b++) /* the subscriber reads nothing */
    slow_send(&f.t, b, h, tok);
  uint64_t want = replay ? SLOW_N : SLOW_N + 1;
  kvp_events_stats s = stats(f.ev);
  for (int i = 0; i < 3000 && s.batches + s.batches_missed < want; i++) {
    pump(f.ev, &f.t, 5);
    s = stats(f.ev);
    if (!replay && i == 300) /* drained by now: a later batch shows the gap */
      slow_send(&f.t, SLOW_N, h, tok);
  }
  for (int i = 0; i < 1500 && s.replaying != 0; i++) {
    pump(f.ev, &f.t, 2);
    s = stats(f.ev);
  }
  printf("slow subscriber (%s replay): %" PRIu64 " batches applied, %" PRIu64
         " missed, %" PRIu64 " gaps, %" PRIu64 " replayed, %" PRIu64
         " residency drops\n", replay ? "with" : "without", s.batches,
         s.batches_missed, s.gaps, s.batches_replayed, s.residency_drops);
  ASSERT_GE(s.gaps, 1u); /* it was outrun, and knows it */
  ASSERT_GE(s.batches_missed, 1u);
  kvp_index_stats is;
  ASSERT_OK(kvp_index_stats_get(f.ix, &is));
  if (replay) {
    ASSERT_EQ(s.batches, (uint64_t)SLOW_N); /* each exactly once */
    ASSERT_EQ(s.residency_drops, 0u);
    ASSERT_EQ(is.residencies, (uint64_t)SLOW_N * SLOW_BLOCKS);
    for (size_t b = 0; b < SLOW_N; b++) { /* each batch's first blocks */
      for (size_t i = 0; i < 4; i++)
        h[i] = slow_hash(b, i);
      ASSERT_EQ(held(f.ix, h, 4, KVP_TIER_HBM), 4u);
    }
  } else {
    /* every batch accounted for: applied or counted missed */
    ASSERT_EQ(s.batches + s.batches_missed, (uint64_t)SLOW_N + 1);
    ASSERT_GE(s.residency_drops, 1u);
    /* the drop forgot what came before the gap: only batches applied after
     * it may be claimed, never a missed batch's blocks; the last is held */
    ASSERT_LE(is.residencies, s.batches * (uint64_t)SLOW_BLOCKS);
    ASSERT_LT(is.residencies, (uint64_t)SLOW_N * SLOW_BLOCKS);
    for (size_t i = 0; i < 4; i++)
      h[i] = slow_hash(SLOW_N, i);
    ASSERT_EQ(held(f.ix, h, 4, KVP_TIER_HBM), 4u);
  }
  fx_close(&f);
  free(h);
  free(tok);
}

/* ---- external sources (kvp_events_feed) ------------------------------------------ */

/* The same batches to a ZeroMQ source (worker 0, no replay socket) and to an
 * external one (worker 1) fed by hand: equal stats, equal index digests. */
typedef struct feed_fx {
  tpub t;
  kvp_index *ix;
  kvp_events *ev;
} feed_fx;

static void ff_send(feed_fx *f, uint64_t seq, const void *p, size_t n) {
  tp_send(&f->t, seq, p, n, true);
  ASSERT_OK(kvp_events_feed(f->ev, 1, seq, p, n));
  for (int i = 0; i < 300; i++) {
    kvp_events_stats a, b;
    ASSERT_OK(kvp_events_poll(f->ev, 2));
    ASSERT_OK(kvp_events_stats_get(f->ev, 0, &a));
    ASSERT_OK(kvp_events_stats_get(f->ev, 1, &b));
    if (a.batches + a.duplicates + a.decode_errors ==
        b.batches + b.duplicates + b.decode_errors)
      return;
  }
  ASSERT_TRUE(false); /* the ZeroMQ source never caught up */
}

static void ff_stored(feed_fx *f, uint64_t seq, const uint64_t *h, size_t n,
                      const uint64_t *parent) {
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  stored_ev e = {.h = h, .n = n, .parent = parent, .tokens = TOK, .bs = 4,
                 .medium = "GPU", .group = -1};
  stored(&k, &e);
  ff_send(f, seq, k.sb.data, k.sb.size);
  pk_free(&k);
}

static void ff_removed(feed_fx *f, uint64_t seq, const uint64_t *h, size_t n) {
  pk k;
  pk_init(&k);
  batch(&k, 1, -1);
  removed(&k, h, n, "GPU", -1);
  ff_send(f, seq, k.sb.data, k.sb.size);
  pk_free(&k);
}

static void ff_same(feed_fx *f) {
  kvp_events_stats a, b;
  ASSERT_OK(kvp_events_stats_get(f->ev, 0, &a));
  ASSERT_OK(kvp_events_stats_get(f->ev, 1, &b));
  ASSERT_EQ(a.batches, b.batches);
  ASSERT_EQ(a.blocks_stored, b.blocks_stored);
  ASSERT_EQ(a.blocks_removed, b.blocks_removed);
  ASSERT_EQ(a.gaps, b.gaps);
  ASSERT_EQ(a.batches_missed, b.batches_missed);
  ASSERT_EQ(a.residency_drops, b.residency_drops);
  ASSERT_EQ(a.restarts, b.restarts);
  ASSERT_EQ(a.duplicates, b.duplicates);
  ASSERT_EQ(a.decode_errors, b.decode_errors);
  uint64_t d0, d1;
  ASSERT_OK(kvp_index_digest(f->ix, 0, &d0));
  ASSERT_OK(kvp_index_digest(f->ix, 1, &d1));
  ASSERT_EQ(d0, d1);
}

static uint32_t held_on(kvp_index *ix, uint32_t w, const uint64_t *h, size_t n) {
  kvp_key k[16];
  for (size_t i = 0; i < n; i++)
    k[i] = (kvp_key){0, h[i]};
  return prefix_on(ix, k, n, w, KVP_TIER_HBM);
}

static void test_feed(void) {
  feed_fx f;
  memset(&f, 0, sizeof f);
  tp_open(&f.t, false);
  ASSERT_OK(kvp_index_create(NULL, NULL, &f.ix));
  ASSERT_OK(kvp_index_worker_add(f.ix, 0));
  ASSERT_OK(kvp_index_worker_add(f.ix, 1));
  kvp_events_source s[2] = {
      {.endpoint = f.t.ep, .worker = 0, .keying = KVP_EVENTS_ENGINE_HASH},
      {.endpoint = NULL, .worker = 1, .keying = KVP_EVENTS_ENGINE_HASH}};
  ASSERT_OK(kvp_events_create(f.ix, s, 2, NULL, NULL, &f.ev));
  ASSERT_ERR(kvp_events_feed(f.ev, 0, 0, "x", 1), KVP_ERANGE); /* ZeroMQ */
  ASSERT_ERR(kvp_events_feed(f.ev, 2, 0, "x", 1), KVP_ERANGE);
  ASSERT_ERR(kvp_events_feed(f.ev, 1, 0, NULL, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_events_feed(NULL, 1, 0, "x", 1), KVP_EINVAL);
  pump(f.ev, &f.t, 150); /* the SUB connects */
  /* in order */
  ff_stored(&f, 0, H, 2, NULL);
  ff_stored(&f, 1, &H[2], 1, &H[1]);
  ASSERT_EQ(held_on(f.ix, 1, H, 3), 3u);
  ff_same(&f);
  /* a duplicate: nothing changes */
  ff_stored(&f, 1, &H[2], 1, &H[1]);
  ASSERT_EQ(stats(f.ev).duplicates, 2u);
  ff_removed(&f, 2, &H[2], 1);
  ASSERT_EQ(held_on(f.ix, 1, H, 3), 2u);
  ff_same(&f);
  /* a gap: batch 3 lost, the residency goes, the stream goes on */
  ff_stored(&f, 4, &H[3], 1, NULL);
  ASSERT_EQ(held_on(f.ix, 1, H, 2), 0u);
  ASSERT_EQ(held_on(f.ix, 1, &H[3], 1), 1u);
  kvp_events_stats b;
  ASSERT_OK(kvp_events_stats_get(f.ev, 1, &b));
  ASSERT_EQ(b.gaps, 1u);
  ASSERT_EQ(b.batches_missed, 1u);
  ASSERT_EQ(b.residency_drops, 1u);
  ff_same(&f);
  /* a malformed payload: counted, a lost batch */
  ff_send(&f, 5, "\xc1garbage", 8);
  ASSERT_OK(kvp_events_stats_get(f.ev, 1, &b));
  ASSERT_EQ(b.decode_errors, 1u);
  ASSERT_EQ(b.residency_drops, 2u);
  ASSERT_EQ(held_on(f.ix, 1, &H[3], 1), 0u);
  ff_stored(&f, 6, H, 2, NULL);
  ff_same(&f);
  /* the publisher restarts: seq 0 again, other bytes -> a new epoch */
  kvp_index_stream_info si0, si1;
  ASSERT_OK(kvp_index_stream_get(f.ix, 1, 0, &si0));
  ff_stored(&f, 0, &H[3], 1, NULL);
  ASSERT_OK(kvp_index_stream_get(f.ix, 1, 0, &si1));
  ASSERT_GT(si1.epoch, si0.epoch);
  ASSERT_EQ(held_on(f.ix, 1, H, 2), 0u);
  ASSERT_EQ(held_on(f.ix, 1, &H[3], 1), 1u);
  ASSERT_OK(kvp_events_stats_get(f.ev, 1, &b));
  ASSERT_EQ(b.restarts, 1u);
  ff_stored(&f, 1, H, 1, &H[3]);
  ff_same(&f);
  ASSERT_EQ(b.batches, 6u);
  char buf[16384];
  ASSERT_GT(kvp_events_prometheus(f.ev, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "endpoint=\"external:1\""));
  /* an I/O thread owns the sources: no feeding beside it */
  kvp_events_destroy(f.ev);
  ASSERT_OK(kvp_events_create(f.ix, &s[1], 1, NULL, NULL, &f.ev));
  ASSERT_OK(kvp_events_start(f.ev));
  ASSERT_ERR(kvp_events_feed(f.ev, 0, 7, "x", 1), KVP_ESTATE);
  kvp_events_destroy(f.ev);
  /* an external source has no replay socket */
  kvp_events_source bad = {.replay_endpoint = "tcp://127.0.0.1:5558",
                           .keying = KVP_EVENTS_ENGINE_HASH};
  ASSERT_ERR(kvp_events_create(f.ix, &bad, 1, NULL, NULL, &f.ev), KVP_EINVAL);
  kvp_index_destroy(f.ix);
  tp_close(&f.t);
}

int main(void) {
  test_decode_forms();
  test_decode_digests();
  test_decode_malformed();
  test_in_order();
  use_ipc = true; /* the same over ipc */
  test_in_order();
  test_gap_replayed();
  use_ipc = false;
  test_gap_replayed();
  test_gap_lost(true);
  test_gap_lost(false);
  test_replay_timeout();
  test_loop_fd();
  test_restart();
  test_restart_replayed();
  test_idle_probe();
  test_lag_idle();
  test_slow_subscriber(true);
  test_slow_subscriber(false);
  test_bad_payload();
  test_rekey();
  test_groups();
  test_bad_sources();
  test_thread();
  test_feed();
  printf("test_events: ok\n");
  return 0;
}
