/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM 0.33 KV-event publisher: ZeroMQ PUB + replay ROUTER (harness_kvpub.h). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <msgpack.h>
#include <zmq.h>

#include "harness_kvpub.h"
#include "kvplane.h"

typedef struct kept {
  uint64_t seq;
  char *data;
  size_t len;
} kept;

struct bh_kvpub {
  void *pub, *replay;
  char topic[128];
  size_t topic_len;
  msgpack_sbuffer ev; /* pending events, packed back to back */
  msgpack_packer pk;
  size_t n_ev;
  uint64_t seq;
  kept *ring; /* replay buffer: ring[seq % cap] */
  uint32_t cap;
};

static void be64(uint64_t v, unsigned char out[8]) {
  for (int i = 7; i >= 0; i--, v >>= 8)
    out[i] = (unsigned char)v;
}

static void pack_str(msgpack_packer *pk, const char *s) {
  size_t n = strlen(s);
  msgpack_pack_str(pk, n);
  msgpack_pack_str_body(pk, s, n);
}

static int open_sock(void *zctx, int type, const char *ep, void **out,
                     char *bound, size_t cap) {
  void *s = zmq_socket(zctx, type);
  int linger = 0, hwm = 100000;
  if (s == NULL)
    return KVP_EIO;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
  char ep2[256];
  snprintf(ep2, sizeof ep2, "%s", ep);
  size_t L = strlen(ep2); /* "tcp://h:0": ZeroMQ's wildcard port is "*" */
  if (L > 2 && strcmp(ep2 + L - 2, ":0") == 0)
    snprintf(ep2 + L - 1, sizeof ep2 - (L - 1), "*");
  if (zmq_bind(s, ep2) != 0) {
    if (bound)
      snprintf(bound, cap, "bind %s: %s", ep, zmq_strerror(zmq_errno()));
    zmq_close(s);
    return KVP_EIO;
  }
  if (bound) {
    size_t n = cap;
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, bound, &n);
  }
  *out = s;
  return 0;
}

int bh_kvpub_create(void *zctx, const char *endpoint,
                    const char *replay_endpoint, const char *topic,
                    uint32_t buffer_steps, bh_kvpub **out, char *pub_ep,
                    char *replay_ep, size_t cap) {
  *out = NULL;
  bh_kvpub *p = calloc(1, sizeof *p);
  if (p == NULL)
    return KVP_ENOMEM;
  p->cap = buffer_steps ? buffer_steps : 10000;
  p->ring = calloc(p->cap, sizeof *p->ring);
  snprintf(p->topic, sizeof p->topic, "%s", topic ? topic : "");
  p->topic_len = strlen(p->topic);
  msgpack_sbuffer_init(&p->ev);
  msgpack_packer_init(&p->pk, &p->ev, msgpack_sbuffer_write);
  int rc = p->ring ? 0 : KVP_ENOMEM;
  if (rc == 0)
    rc = open_sock(zctx, ZMQ_PUB, endpoint, &p->pub, pub_ep, cap);
  if (rc == 0 && replay_endpoint)
    rc = open_sock(zctx, ZMQ_ROUTER, replay_endpoint, &p->replay,
                   replay_ep ? replay_ep : pub_ep, cap);
  if (rc < 0) {
    bh_kvpub_destroy(p);
    return rc;
  }
  *out = p;
  return 0;
}

void bh_kvpub_destroy(bh_kvpub *p) {
  if (p == NULL)
    return;
  if (p->pub)
    zmq_close(p->pub);
  if (p->replay)
    zmq_close(p->replay);
  for (uint32_t i = 0; p->ring && i < p->cap; i++)
    free(p->ring[i].data);
  free(p->ring);
  msgpack_sbuffer_destroy(&p->ev);
  free(p);
}

/* msgspec sizes a struct's map header by the fields the struct declares, not
 * by those written: BlockStored declares 16 (+ the tag), so its header is a
 * map16 even for 9 or 10 entries; BlockRemoved's (7) is a fixmap.  The same
 * headers keep the bytes vLLM's (tests/interop/test_live_engine.py). */
static void pack_struct(bh_kvpub *p, unsigned fields) {
  unsigned char h[3] = {0xde, (unsigned char)(fields >> 8),
                        (unsigned char)fields};
  msgpack_sbuffer_write(&p->ev, (const char *)h, sizeof h);
}

static void pack_hashes(msgpack_packer *pk, const uint64_t *h, size_t n) {
  msgpack_pack_array(pk, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(pk, h[i]);
}

/* extra_keys: the untagged per-block tuples (msgpack arrays) or nil, as
 * vLLM 0.33 lists them: the LoRA name (every block), then the salt (block
 * 0). */
static void pack_extras(msgpack_packer *pk, size_t n,
                        const bh_kvpub_extras *x) {
  pack_str(pk, "extra_keys");
  msgpack_pack_array(pk, n);
  for (size_t i = 0; i < n; i++) {
    bool salt = x->cache_salt != NULL && x->first_block + i == 0;
    size_t k = (x->lora_name != NULL) + salt;
    if (k == 0) {
      msgpack_pack_nil(pk);
      continue;
    }
    msgpack_pack_array(pk, k);
    if (x->lora_name != NULL)
      pack_str(pk, x->lora_name);
    if (salt)
      pack_str(pk, x->cache_salt);
  }
}

int bh_kvpub_stored(bh_kvpub *p, const uint64_t *hashes, size_t n,
                    const uint64_t *parent, const uint32_t *tokens,
                    uint32_t block_size, const char *medium,
                    const bh_kvpub_extras *x) {
  msgpack_packer *pk = &p->pk;
  pack_struct(p, x != NULL && n > 0 ? 10 : 9);
  pack_str(pk, "type");
  pack_str(pk, "BlockStored");
  pack_str(pk, "block_hashes");
  pack_hashes(pk, hashes, n);
  pack_str(pk, "parent_block_hash");
  if (parent)
    msgpack_pack_uint64(pk, *parent);
  else
    msgpack_pack_nil(pk);
  pack_str(pk, "token_ids");
  msgpack_pack_array(pk, n * block_size);
  for (size_t i = 0; i < n * block_size; i++)
    msgpack_pack_uint32(pk, tokens[i]);
  pack_str(pk, "block_size");
  msgpack_pack_uint32(pk, block_size);
  bool lora = x != NULL && x->lora_name != NULL;
  pack_str(pk, "lora_id");
  if (lora)
    msgpack_pack_int64(pk, x->lora_id);
  else
    msgpack_pack_nil(pk);
  pack_str(pk, "medium");
  pack_str(pk, medium);
  pack_str(pk, "lora_name");
  if (lora)
    pack_str(pk, x->lora_name);
  else
    msgpack_pack_nil(pk);
  if (x != NULL && n > 0) /* vLLM: an empty list is None, left out */
    pack_extras(pk, n, x);
  pack_str(pk, "group_idx");
  msgpack_pack_int(pk, 0);
  p->n_ev++;
  return 0;
}

int bh_kvpub_removed(bh_kvpub *p, const uint64_t *hashes, size_t n,
                     const char *medium) {
  msgpack_packer *pk = &p->pk;
  msgpack_pack_map(pk, 4);
  pack_str(pk, "type");
  pack_str(pk, "BlockRemoved");
  pack_str(pk, "block_hashes");
  pack_hashes(pk, hashes, n);
  pack_str(pk, "medium");
  pack_str(pk, medium);
  pack_str(pk, "group_idx");
  msgpack_pack_int(pk, 0);
  p->n_ev++;
  return 0;
}

int bh_kvpub_cleared(bh_kvpub *p) {
  msgpack_pack_map(&p->pk, 1);
  pack_str(&p->pk, "type");
  pack_str(&p->pk, "AllBlocksCleared");
  p->n_ev++;
  return 0;
}

static int send3(void *s, const void *a, size_t al, const void *b, size_t bl,
                 const void *c, size_t cl, int more_last) {
  if (zmq_send(s, a, al, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(s, b, bl, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
      zmq_send(s, c, cl, more_last | ZMQ_DONTWAIT) < 0)
    return KVP_EIO;
  return 0;
}

int bh_kvpub_flush(bh_kvpub *p) {
  if (p->n_ev == 0)
    return 0;
  msgpack_sbuffer b;
  msgpack_packer pk;
  msgpack_sbuffer_init(&b);
  msgpack_packer_init(&pk, &b, msgpack_sbuffer_write);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  msgpack_pack_array(&pk, 3);
  msgpack_pack_double(&pk, (double)ts.tv_sec + ts.tv_nsec / 1e9);
  msgpack_pack_array(&pk, p->n_ev);
  msgpack_sbuffer_write(&b, p->ev.data, p->ev.size);
  msgpack_pack_int(&pk, 0); /* data_parallel_rank */
  p->ev.size = 0;
  p->n_ev = 0;
  if (b.data == NULL)
    return KVP_ENOMEM;
  unsigned char sq[8];
  uint64_t seq = p->seq++;
  be64(seq, sq);
  /* a full PUB queue drops, as vLLM's does; replay recovers it */
  send3(p->pub, p->topic, p->topic_len, sq, 8, b.data, b.size, 0);
  kept *k = &p->ring[seq % p->cap];
  free(k->data);
  k->seq = seq;
  k->len = b.size;
  k->data = msgpack_sbuffer_release(&b);
  return 0;
}

static void answer(bh_kvpub *p, zmq_msg_t *id, uint64_t start) {
  unsigned char sq[8];
  uint64_t first = p->seq > p->cap ? p->seq - p->cap : 0;
  if (start > first)
    first = start;
  for (uint64_t s = first; s < p->seq; s++) {
    kept *k = &p->ring[s % p->cap];
    be64(s, sq);
    zmq_send(p->replay, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE);
    send3(p->replay, "", 0, p->topic, p->topic_len, sq, 8, ZMQ_SNDMORE);
    zmq_send(p->replay, k->data, k->len, 0);
  }
  be64(UINT64_MAX, sq); /* -1 as 8 bytes: the end marker */
  zmq_send(p->replay, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE);
  send3(p->replay, "", 0, "", 0, sq, 8, ZMQ_SNDMORE);
  zmq_send(p->replay, "", 0, 0);
}

/* One request: [identity, empty, start seq (8 bytes)]; anything else is
 * dropped (vLLM logs it). */
static bool serve_one(bh_kvpub *p) {
  zmq_msg_t f[4];
  int n = 0, more = 1;
  while (more && n < 4) {
    zmq_msg_init(&f[n]);
    if (zmq_msg_recv(&f[n], p->replay, n ? 0 : ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&f[n]);
      more = 0; /* nothing waiting (or a broken message) */
      break;
    }
    more = zmq_msg_more(&f[n++]);
  }
  while (more) { /* drain extra frames */
    zmq_msg_t x;
    zmq_msg_init(&x);
    zmq_msg_recv(&x, p->replay, 0);
    more = zmq_msg_more(&x);
    zmq_msg_close(&x);
  }
  if (n == 3 && zmq_msg_size(&f[2]) == 8) {
    const unsigned char *b = zmq_msg_data(&f[2]);
    uint64_t start = 0;
    for (int i = 0; i < 8; i++)
      start = start << 8 | b[i];
    answer(p, &f[0], start);
  }
  for (int i = 0; i < n; i++)
    zmq_msg_close(&f[i]);
  return n > 0;
}

void bh_kvpub_service(bh_kvpub *p) {
  if (p->replay == NULL)
    return;
  for (int i = 0; i < 64 && serve_one(p); i++)
    ;
}

uint64_t bh_kvpub_batches(const bh_kvpub *p) { return p->seq; }
