/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix internals: the resumable walk over a chain's blocks, the
 * validated view of a request's extras, and the constants of the native
 * encodings (tests/data/gen_native_vectors.py re-implements them; change
 * both together and bump the tags).  Not installed. */
#ifndef KVP_PREFIX_INTERNAL_H
#define KVP_PREFIX_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane/prefix.h"

/* Namespace seed = SHA-256("kvplane-ns-v1" || u32le len || model_id ||
 * u32le len || tokenizer_id || u32le len || kv_layout || u32le block_size ||
 * u8 salt_present || u32le len || tenant_salt)[0..16). */
#define KVP__NS_TAG "kvplane-ns-v1"
/* Chunk key = XXH3-128(fine key (16 B, hi BE || lo BE) || u32le G || "chunk").
 */
#define KVP__CHUNK_TAG "chunk"
/* Native block encoding: parent (16 B) || tokens (u32le each) and, only when
 * the block has extra keys, a tag byte 0xE0 | flags followed by the fields
 * the flags name, in this order:
 *   LORA: u32le len || bytes
 *   MM:   u32le count || count * (u32le len || id bytes || i64le offset -
 * start) SALT: u32le len || bytes */
#define KVP__XTAG 0xE0u
#define KVP__XTAG_LORA 0x01u
#define KVP__XTAG_MM 0x02u
#define KVP__XTAG_SALT 0x04u

/* Widest digest any algorithm produces (SHA-256). */
#define KVP__DIGEST_MAX 32u

/* Where a walk over a prompt's blocks stands: everything block i needs from
 * blocks < i, so extending a chain never looks at its prefix again. */
typedef struct kvp__cursor {
  /* Parent of the next block: the previous key's 16 bytes (native modes) or
   * the previous full digest (vLLM modes); the namespace seed / NONE_HASH
   * before block 0. */
  uint8_t parent[KVP__DIGEST_MAX];
  uint64_t start; /* token index where the next block starts */
  size_t mm_idx;  /* vLLM's curr_mm_idx: first placeholder still in play */
} kvp__cursor;

/* A kvp_extras after validation, string lengths resolved ("" = absent). */
typedef struct kvp__xview {
  const char *lora;
  size_t lora_len;
  const char *salt;
  size_t salt_len;
  const kvp_mm_span *mm;
  size_t n_mm;
} kvp__xview;

/* Validates `e` (NULL = no extras) into `out`, which borrows e's strings.
 * Returns 0 or KVP_EINVAL (logged: which field and why). */
int kvp__xview_init(const kvp_extras *e, kvp__xview *out);

/* The cursor before block 0 of a prompt hashed by `h`. */
void kvp__cursor_init(const kvp_hasher *h, kvp__cursor *cur);

/* Hashes `n_blocks` full blocks of tokens from `cur` on and advances `cur`.
 * keys[0..n_blocks) receive the keys; digests (NULL = not wanted) receives
 * n_blocks * kvp_hash_algo_digest_len() bytes.  Allocation-free.  Returns 0,
 * or KVP_EIO if OpenSSL failed (then `cur` and the outputs are garbage). */
int kvp__hash_blocks(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tokens,
                     size_t n_blocks, const kvp__xview *x, kvp_key *keys,
                     uint8_t *digests);

/* The chunk key of granularity `chunk_tokens` whose last block has key `fine`.
 */
kvp_key kvp__chunk_key(kvp_key fine, uint32_t chunk_tokens);

#endif /* KVP_PREFIX_INTERNAL_H */
