/* SPDX-License-Identifier: Apache-2.0 */
/* A vLLM 0.33 KV-event publisher (what vllm/distributed/kv_events.py's
 * ZmqEventPublisher sends), for the emulated workers: a ZeroMQ PUB socket
 * sending (topic, seq as 8 bytes big-endian, msgpack EventBatch) with seq
 * counting from 0, and a ROUTER socket that answers a DEALER's
 * [empty, start seq] with every buffered batch from that seq as
 * [empty, topic, seq, payload] and then [empty, empty, -1, empty].
 * EventBatch = [ts, [events...], dp_rank]; events are msgspec tagged maps
 * with vLLM's omit_defaults: BlockStored {type, block_hashes,
 * parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
 * extra_keys, group_idx}, BlockRemoved {type, block_hashes, medium,
 * group_idx}.  Hashes
 * in int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default: the low
 * 64 bits of the big-endian digest = kvp_key.lo of a vLLM-mode hasher).
 * Not thread-safe: one thread drives a publisher. */
#ifndef KVP_BENCH_HARNESS_KVPUB_H
#define KVP_BENCH_HARNESS_KVPUB_H

#include <stddef.h>
#include <stdint.h>

typedef struct bh_kvpub bh_kvpub;

/* Binds endpoint (PUB) and, when non-NULL, replay_endpoint (ROUTER) on
 * zctx; "tcp://127.0.0.1:0" picks a free port.  The bound endpoints are
 * written to pub_ep / replay_ep (cap bytes each; may be NULL).  buffer_steps:
 * batches kept for replay (0 = 10000, vLLM's default).  Returns 0, KVP_EIO
 * (ZeroMQ refused; message in pub_ep) or KVP_ENOMEM. */
int bh_kvpub_create(void *zctx, const char *endpoint,
                    const char *replay_endpoint, const char *topic,
                    uint32_t buffer_steps, bh_kvpub **out, char *pub_ep,
                    char *replay_ep, size_t cap);
void bh_kvpub_destroy(bh_kvpub *p); /* NULL ok */
/* A request's blocks' extra keys, as vLLM 0.33's cache_full_blocks
 * publishes them (to_event_extra_keys): one entry per block, [salt] on the
 * prompt's block 0 when the request has a cache_salt, nil elsewhere. */
typedef struct bh_kvpub_extras {
  const char *cache_salt; /* NULL = none */
  uint64_t first_block;   /* the prompt's index of hashes[0] */
  const char *lora_name;  /* NULL = the base model */
  int64_t lora_id;        /* the deprecated lora_id field (with lora_name) */
} bh_kvpub_extras;

/* Appends an event to the pending batch.  parent NULL = chain root.  x NULL:
 * no extra_keys field (blocks not stored by a request: demotions). */
int bh_kvpub_stored(bh_kvpub *p, const uint64_t *hashes, size_t n,
                    const uint64_t *parent, const uint32_t *tokens,
                    uint32_t block_size, const char *medium,
                    const bh_kvpub_extras *x);
int bh_kvpub_removed(bh_kvpub *p, const uint64_t *hashes, size_t n,
                     const char *medium);
int bh_kvpub_cleared(bh_kvpub *p);
/* Sends the pending events as one batch (nothing when none).  Returns 0 or
 * KVP_EIO / KVP_ENOMEM. */
int bh_kvpub_flush(bh_kvpub *p);
/* Answers waiting replay requests without blocking. */
void bh_kvpub_service(bh_kvpub *p);
/* Batches sent so far (the next seq). */
uint64_t bh_kvpub_batches(const bh_kvpub *p);

#endif /* KVP_BENCH_HARNESS_KVPUB_H */
