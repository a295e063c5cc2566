/* SPDX-License-Identifier: Apache-2.0 */
/* cli_vectors: reader for vLLM block-hash vector files (the format of
 * ../shared/vectors/vllm_block_hashes.json) and a checker that recomputes one
 * case with the library.  Used by the `kvplane` tool, the tests and a fuzzer.
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
} cli_vector_block;

/* One case, as plain data owned by its cli_vectors (tests may mutate it). */
typedef struct cli_vector_case {
  size_t index;            /* position in the file's cases[] */
  kvp_hash_algo algo;      /* KVP_HASH_SHA256_CBOR or KVP_HASH_XXHASH_CBOR */
  size_t digest_len;       /* 32 (sha256_cbor) or 16 (xxhash_cbor) */
  uint32_t block_size;     /* 1..KVP_BLOCK_SIZE_MAX */
  char *python_hash_seed;  /* never NULL */
  char *cache_salt;        /* NULL for JSON null */
  char *lora_name;         /* NULL for JSON null */
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

/* Recomputes case `c` with the library (namespace + hasher + chain with
 * keep_digests, fed in two uneven pieces, and the one-shot kvp_hasher_hash)
 * and compares every block's full digest and external u64 (== key.lo; key.hi
 * == the 8 digest bytes before it).  NONE_HASH is not checked: the public API
 * does not expose it, and block 0 depends on it anyway.
 * Returns 0 when all match, 1 on a mismatch (`why`: "case 3: block 2: digest
 * ... expected ..., got ..."), or a negative KVP_E* the library returned
 * (`why` says which call).  Thread-safe. */
int cli_vectors_check(const cli_vector_case *c, char *why, size_t cap);

#endif /* KVP_CLI_VECTORS_H */
