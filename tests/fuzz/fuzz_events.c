/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: vLLM KV-event payloads (msgpack EventBatch) through the
 * decoder, then every decoded batch through the subscriber's apply step in
 * both keying modes (index + re-key map).  Seed corpus: payloads captured
 * from vLLM 0.33's own ZmqEventPublisher (tests/interop/capture_corpus.py). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "events_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_batch(const kvp_kv_batch *b) {
  for (size_t i = 0; i < b->n_events; i++) {
    const kvp_kv_event *e = &b->events[i];
    if (e->n_hashes > 0 && e->hashes == NULL)
      abort();
    if (e->extras != NULL && e->n_extras != e->n_hashes)
      abort();
    if (e->n_tokens != 0 && e->block_size != 0 &&
        e->n_tokens != e->n_hashes * (size_t)e->block_size)
      abort();
    for (size_t k = 0; k < e->n_hashes; k++)
      if (e->hashes[k].len > 32)
        abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static kvp_kv_decoder *dec;
  static kvp_index *ix;
  static ev_apply ap[2];
  static ev_counters ctr[2];
  static kvp_namespace ns;
  if (dec == NULL) {
    kvp_log_set_level(KVP_LOG_OFF);
    kvp_namespace_desc d = {.model_id = "m", .tokenizer_id = "t",
                            .kv_layout = "l", .block_size = 4};
    if (kvp_kv_decoder_create(NULL, &dec) < 0 ||
        kvp_namespace_init(&d, &ns) < 0 ||
        kvp_index_create(NULL, NULL, &ix) < 0 ||
        kvp_index_worker_add(ix, 0) < 0 || kvp_index_worker_add(ix, 1) < 0)
      abort();
    kvp_events_source s = {.worker = 0, .ns = &ns, .rekey_capacity = 4096};
    if (kvp__ev_apply_init(&ap[0], ix, NULL, &s, &ctr[0]) < 0)
      abort();
    s.worker = 1;
    s.keying = KVP_EVENTS_ENGINE_HASH;
    s.ns = NULL;
    if (kvp__ev_apply_init(&ap[1], ix, NULL, &s, &ctr[1]) < 0)
      abort();
  }
  kvp_kv_batch b;
  int rc = kvp_kv_decode(dec, data, size, &b);
  if (rc < 0) {
    if (b.n_events != 0 || b.events != NULL)
      abort(); /* a failed decode hands out nothing */
    return 0;
  }
  if ((size_t)rc != b.n_events)
    abort();
  check_batch(&b);
  (void)kvp__ev_apply_batch(&ap[0], &b);
  (void)kvp__ev_apply_batch(&ap[1], &b);
  if (ap[0].map.used > 4096)
    abort(); /* the re-key map stays bounded */
  return 0;
}
