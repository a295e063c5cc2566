/* SPDX-License-Identifier: Apache-2.0 */
/* cli_vectors: reader for vLLM block-hash vector files (the format of
 * ../shared/vectors/vllm_block_hashes.json and vllm033_block_hashes.json)
 * and a checker that recomputes one case with the library.  Used by the
 * `kvplane` tool, the tests and a fuzzer.  Public API only (a connector).
 *
 * Input is untrusted: every malformed file gets an error naming the case and
 * the field ("case 7: blocks[2].hash_hex: expected 64 hex digits, got 63");
 * memory is bounded by CLI_VECTORS_MAX_BYTES (jansson's tree costs up to ~20x
 * the text) and the per-case limits below. */
#ifndef KVP_CLI_VECTORS_H
#define KVP_CLI_VECTORS_H

#include <stddef.h>
#include <stdint.h>

#include "kvplane/prefix.h"

#define CLI_VECTORS_MAX_BYTES (64u << 20)  /* file size */
#define CLI_VECTORS_MAX_CASES (1u << 16)
#define CLI_VECTORS_MAX_TOKENS (1u << 20)  /* token_ids per case */
#define CLI_VECTORS_MAX_MM 4096u           /* mm_placeholders per case */
#define CLI_VECTORS_DIGEST_MAX 32u

typedef struct cli_vector_block {
  uint8_t digest[CLI_VECTORS_DIGEST_MAX]; /* hash_hex; digest_len bytes */
  uint64_t external_u64;                  /* exact, up to 2^64-1 */
  /* extra_keys and event_extra_keys as compact JSON text ("null" for
   * null; event_keys NULL when the file has no event_extra_keys) */
  char *extra_keys, *event_keys;
} cli_vector_block;

/* One case, as plain data owned by its cli_vectors (tests may mutate it). */
typedef struct cli_vector_case {
  size_t index;            /* position in the file's cases[] */
  kvp_hash_algo algo;      /* vLLM's name through kvp_hash_algo_from_vllm */
  size_t digest_len;       /* 32 (sha256*) or 16 (xxhash*) */
  uint32_t vllm_compat;    /* from vllm_version; absent: PRE_0_33 */
  uint32_t block_size;     /* 1..KVP_BLOCK_SIZE_MAX */
  char *python_hash_seed;  /* NULL for JSON null (vLLM >= 0.33 only) */
  char *none_hash_seed;    /* NULL when absent */
  char *cache_salt;        /* NULL for JSON null */
  char *lora_name;         /* NULL for JSON null */
  char *lora_path;         /* NULL for JSON null or absent */
  kvp_mm_span *mm;         /* ids owned by the set */
  size_t n_mm;
  uint32_t *tokens;
  size_t n_tokens;
  uint8_t none_hash[CLI_VECTORS_DIGEST_MAX]; /* digest_len bytes */
  cli_vector_block *blocks; /* exactly n_tokens / block_size */
  size_t n_blocks;
} cli_vector_case;

typedef struct cli_vectors {
  cli_vector_case *cases;
  size_t n_cases;
  size_t n_blocks; /* over all cases */
  kvp_allocator alloc_;
} cli_vectors;

/* Parses a vector file held in memory (`buf` need not be NUL-terminated).
 * Returns 0 and a set to free with cli_vectors_destroy(), or KVP_ECORRUPT
 * (malformed), KVP_ERANGE (a size limit), KVP_ENOMEM; then `why` (may be
 * NULL) holds a one-line reason and *out is NULL.  Thread-safe. */
int cli_vectors_parse(const void *buf, size_t len, const kvp_allocator *alloc,
                      cli_vectors **out, char *why, size_t cap);

/* Reads and parses the file at `path`; as cli_vectors_parse, plus -errno when
 * it cannot be read and KVP_ERANGE when larger than CLI_VECTORS_MAX_BYTES.
 * `why` names the path. */
int cli_vectors_load(const char *path, const kvp_allocator *alloc,
                     cli_vectors **out, char *why, size_t cap);

void cli_vectors_destroy(cli_vectors *v); /* NULL is a no-op */

/* Recomputes case `c` with the library (namespace + hasher with the case's
 * vllm_compat and its pythonhashseed, NULL included: the library resolves
 * NONE_HASH's seed as vLLM does; chain with keep_digests, fed in two uneven
 * pieces; the one-shot kvp_hasher_hash) and compares, block by block: the
 * extra keys kvplane derives (kvp_hasher_block_extras) with extra_keys
 * (tagged for 0.33) and event_extra_keys (untagged), so that a scheme
 * mismatch is named as such; the full digest; the external u64 (== key.lo;
 * key.hi == the 8 digest bytes before it); the one-shot key; and
 * kvp_hasher_block's digest from those extra keys and the chain's previous
 * digest.  A none_hash_seed must be what vLLM 0.33 derives from
 * pythonhashseed.  NONE_HASH itself is not compared: the public API does
 * not expose it, and block 0 depends on it anyway.
 * Returns 0 when all match, 1 on a mismatch (`why`: "case 3: block 2: digest
 * ... expected ..., got ..."), or a negative KVP_E* the library returned
 * (`why` says which call).  Thread-safe. */
int cli_vectors_check(const cli_vector_case *c, char *why, size_t cap);

/* The extra-key scheme of vLLM `version` ("0.33.0", "0.11.0rc1", ...):
 * KVP_VLLM_COMPAT_0_33 from 0.33 on (the newest kvplane knows), else
 * KVP_VLLM_COMPAT_PRE_0_33.  Returns 0, or -1 when `version` does not start
 * with MAJOR.MINOR. */
int cli_vllm_compat(const char *version, uint32_t *compat);

#endif /* KVP_CLI_VECTORS_H */
