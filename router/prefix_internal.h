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
 *   LORA:   u32le len || name bytes (never the path)
 *   MM:     u32le count || count * (u32le len || id bytes || i64le offset -
 *           start)
 *   SALT:   u32le len || bytes
 *   EMBEDS: the block's 32-byte prompt-embeddings digest
 * (a new flag, not a new tag: blocks without embeddings keep their keys) */
#define KVP__XTAG 0xE0u
#define KVP__XTAG_LORA 0x01u
#define KVP__XTAG_MM 0x02u
#define KVP__XTAG_SALT 0x04u
#define KVP__XTAG_EMBEDS 0x08u

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

/* A kvp_extras after validation, string lengths resolved ("" = absent;
 * path "" also when NULL). */
typedef struct kvp__xview {
  const char *lora;
  size_t lora_len;
  const char *path;
  size_t path_len;
  const char *salt;
  size_t salt_len;
  const kvp_mm_span *mm;
  size_t n_mm;
  const uint8_t (*embeds)[32]; /* NULL = none */
  size_t n_embeds;
} kvp__xview;

/* Validates `e` (NULL = no extras) into `out`, which borrows e's strings.
 * Returns 0 or KVP_EINVAL (logged: which field and why). */
int kvp__xview_init(const kvp_extras *e, kvp__xview *out);

/* The cursor before block 0 of a prompt hashed by `h`. */
void kvp__cursor_init(const kvp_hasher *h, kvp__cursor *cur);

/* Hashes `n_blocks` full blocks of tokens from `cur` on and advances `cur`.
 * keys[0..n_blocks) receive the keys; digests (NULL = not wanted) receives
 * n_blocks * kvp_hash_algo_digest_len() bytes.  The caller has checked that
 * x's prompt-embeddings digests cover these blocks (kvp__embeds_cover).
 * Allocation-free.  Returns 0, or KVP_EIO if OpenSSL failed (then `cur` and
 * the outputs are garbage). */
int kvp__hash_blocks(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tokens,
                     size_t n_blocks, const kvp__xview *x, kvp_key *keys,
                     uint8_t *digests);

/* KVP_EINVAL (logged) when blocks [first, first + n) are not all covered
 * by x's prompt-embeddings digests (x has some); else 0. */
int kvp__embeds_cover(const kvp__xview *x, size_t first, size_t n);

/* The chunk key of granularity `chunk_tokens` whose last block has key `fine`.
 */
kvp_key kvp__chunk_key(kvp_key fine, uint32_t chunk_tokens);

/* ---- for tests ------------------------------------------------------------
 * The exact bytes a hasher hashes, recorded on the way into the digest:
 * kvp_hasher_block's encoding of one block (pickle / CBOR / native) and the
 * encoding of a NONE_HASH seed string (vLLM modes).  They write up to `cap`
 * bytes to buf, the full length to *len, and return what kvp_hasher_block
 * returns, or KVP_ENOSPC when the encoding is longer than cap (*len says how
 * long).  kvp__hasher_root copies the parent of block 0 (NONE_HASH, or the
 * native namespace seed's 16 bytes) and returns its length. */
int kvp__hasher_block_bytes(kvp_hasher *h, const uint8_t *parent,
                            size_t parent_len, const uint32_t *tokens,
                            const kvp_block_extras *bx, uint8_t *buf,
                            size_t cap, size_t *len);
int kvp__hasher_seed_bytes(kvp_hasher *h, const char *seed, uint8_t *buf,
                           size_t cap, size_t *len);
size_t kvp__hasher_root(const kvp_hasher *h, uint8_t out[KVP__DIGEST_MAX]);

#endif /* KVP_PREFIX_INTERNAL_H */
