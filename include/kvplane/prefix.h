/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane prefix engine (router/prefix): namespaces, chained block keys,
 * segment marks, the learned stability classifier and prompt-drift reports.
 *
 * A prompt of token ids is cut into full blocks of `block_size` tokens (the
 * tail shorter than a block is reported, never hashed) and each block gets
 *   key_i = H(key_{i-1}, tokens_i, extras_i),   key_{-1} = namespace seed
 * so equal keys at block i imply equal prompts up to the end of block i. */
#ifndef KVPLANE_PREFIX_H
#define KVPLANE_PREFIX_H

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVP_BLOCK_SIZE_MAX 4096u

/* ---- namespace ------------------------------------------------------------
 * Everything that makes two caches' KV bytes incompatible.  Strings are
 * NUL-terminated UTF-8 (invalid UTF-8 -> KVP_EINVAL); NULL means "" except
 * model_id, which is required (NULL or "" -> KVP_EINVAL).  tenant_salt ""
 * is the same as NULL: shared.  Two descriptions that differ in any field
 * give different seeds (length-prefixed encoding, SHA-256 truncated to 128
 * bits; exact bytes in router/prefix_internal.h), hence disjoint key spaces
 * for the native algorithms.  The vLLM algorithms ignore the seed. */
typedef struct kvp_namespace_desc {
  const char *model_id;     /* e.g. "meta-llama/Llama-3.1-8B-Instruct" */
  const char *tokenizer_id; /* e.g. the tokenizer's name@revision */
  const char *kv_layout;    /* KV layout + dtype, e.g. "vllm-nhd:bf16" */
  uint32_t block_size;      /* tokens per block, 1..KVP_BLOCK_SIZE_MAX */
  const char *tenant_salt;  /* isolates tenants; NULL = shared */
} kvp_namespace_desc;

typedef struct kvp_namespace {
  kvp_key seed;
  uint32_t block_size;
  uint32_t reserved_;
} kvp_namespace;

/* Returns 0, or KVP_EINVAL (NULL, model_id missing, block size out of range,
 * invalid UTF-8; logged, naming the field), KVP_ENOMEM or KVP_EIO (OpenSSL
 * failed).  Thread-safe. */
KVP_API int kvp_namespace_init(const kvp_namespace_desc *desc,
                               kvp_namespace *out);

/* ---- hash algorithms ------------------------------------------------------
 * Native algorithms hash parent key (16 bytes, hi then lo, big-endian) ||
 * tokens as u32 LE || extras (only on blocks that have extra keys; encoding
 * in router/prefix_internal.h); block 0's parent is the namespace seed.  They
 * chain the 16-byte key even where the digest is longer. */
typedef enum kvp_hash_algo {
  /* kvplane native: XXH3-128; the key is the 128-bit hash (hi = high64). */
  KVP_HASH_XXH3_128 = 0,
  /* kvplane native, collision resistant: SHA-256 (OpenSSL EVP), key = last
   * 16 bytes of the digest (kvp_chain_digest gives all 32). */
  KVP_HASH_SHA256 = 1,
  /* vLLM v1 exact: sha256(cbor2.dumps((parent, tuple(tokens), extra_keys),
   * canonical=True)); block 0's parent is NONE_HASH = sha256(cbor(seed str)).
   * The namespace seed is NOT mixed in (keys equal vLLM's); use cache_salt
   * for isolation, as vLLM does. */
  KVP_HASH_SHA256_CBOR = 2,
  /* vLLM v1 exact: xxh3_128 of the same CBOR encoding (digest = the
   * canonical big-endian 16 bytes, as python-xxhash's xxh3_128_digest).
   * Both vLLM modes chain the FULL previous digest. */
  KVP_HASH_XXHASH_CBOR = 3,
  /* vLLM exact, its default since 0.33 (--prefix-caching-hash-algo sha256):
   * sha256(pickle.dumps((parent, tuple(tokens), extra_keys), protocol=5));
   * NONE_HASH = sha256(pickle(seed str)). */
  KVP_HASH_VLLM_SHA256 = 4,
  /* vLLM exact ("xxhash"): xxh3_128 of the same pickle.  vLLM seeds
   * NONE_HASH for xxhash / xxhash_cbor with random per-process bytes unless
   * PYTHONHASHSEED is set: such an engine's hashes cannot be reproduced by
   * anyone (use the re-keyed mode of include/kvplane/events.h).
   * The pickle is CPython's byte for byte (protocol 5 framing and memo
   * included); a hasher of either pickle mode holds a 128 KiB frame buffer,
   * as CPython builds a frame whole before it writes the frame's length. */
  KVP_HASH_VLLM_XXHASH = 5
} kvp_hash_algo;

/* vLLM modes: which release's hash inputs to reproduce. */
typedef enum kvp_vllm_compat {
  KVP_VLLM_COMPAT_LATEST = 0, /* the newest below */
  /* before 0.33: untagged extra keys -- lora name, (mm id, offset), cache
   * salt (../shared/vectors/vllm_block_hashes.json) */
  KVP_VLLM_COMPAT_PRE_0_33 = 1,
  /* 0.33: tagged extra keys -- ("lora", name, path), ("mm", id, offset),
   * ("cache_salt", salt), ("prompt_embeds", sha256 digest)
   * (../shared/vectors/vllm033_block_hashes.json) */
  KVP_VLLM_COMPAT_0_33 = 2,
  KVP_VLLM_COMPAT_COUNT_ = 3
} kvp_vllm_compat;

/* Parses kvplane's names: "xxh3_128" | "sha256" (native) | "sha256_cbor" |
 * "xxhash_cbor" | "vllm_sha256" | "vllm_xxhash" (exact, case-sensitive; vLLM
 * calls the last two "sha256" and "xxhash": kvp_hash_algo_from_vllm).
 * Returns 0 or KVP_EINVAL (*out untouched). */
KVP_API int kvp_hash_algo_parse(const char *name, kvp_hash_algo *out);
/* The name kvp_hash_algo_parse takes; "unknown" (never NULL) otherwise. */
KVP_API const char *kvp_hash_algo_name(kvp_hash_algo algo);
/* Digest length in bytes: 16 (xxh3_128, xxhash_cbor, vllm_xxhash) or 32
 * (sha256, sha256_cbor, vllm_sha256); 0 for an unknown value. */
KVP_API size_t kvp_hash_algo_digest_len(kvp_hash_algo algo);
/* Maps vLLM's --prefix-caching-hash-algo names ("sha256", "sha256_cbor",
 * "xxhash", "xxhash_cbor") to the vLLM modes.  Returns 0 or KVP_EINVAL
 * (*out untouched). */
KVP_API int kvp_hash_algo_from_vllm(const char *vllm_name, kvp_hash_algo *out);

/* A multimodal placeholder in token coordinates (vLLM PlaceholderRange). */
typedef struct kvp_mm_span {
  const char *id;  /* UTF-8 identifier (vLLM's mm hash), not NULL */
  uint64_t offset; /* first token of the placeholder in the prompt */
  uint64_t length; /* tokens; offset + length <= INT64_MAX */
} kvp_mm_span;

/* Per-request extras that enter block hashes exactly as vLLM's
 * generate_block_hash_extra_keys: LoRA name on every block, (mm id, offset of
 * the placeholder relative to the block start, may be negative) on every
 * block the placeholder overlaps, cache salt on block 0 only, the block's
 * prompt-embeddings digest.  Order inside a block's tuple: lora, mm...,
 * salt, embeds.  The zero value means "no extras".  `mm` must be sorted by
 * offset (KVP_EINVAL otherwise).  A placeholder that ends exactly where a
 * block starts: before 0.33 vLLM still keys that block unless an earlier
 * block already passed it (`start > offset + length`); vLLM 0.33 does not
 * (`start >= offset + length`).  Every algorithm follows vllm_compat here,
 * native ones included: the KV-event subscriber re-keys a 0.33 engine's
 * blocks from the per-block keys it publishes, and a request hashed
 * natively must key those blocks alike (set KVP_VLLM_COMPAT_PRE_0_33 for
 * native keys made before kvplane followed 0.33).  Native algorithms hash
 * the same fields with an unambiguous length-prefixed encoding. */
typedef struct kvp_extras {
  const char *lora_name;  /* NULL or "" = none */
  const char *cache_salt; /* NULL or "" = none */
  const kvp_mm_span *mm;
  size_t n_mm;
  /* vLLM >= 0.33 modes: the adapter's path, hashed with its name (NULL =
   * ""); other modes ignore it (KV events do not carry it). */
  const char *lora_path;
  /* Prompt embeddings: the SHA-256 of each full block's embedding bytes
   * (vLLM: sha256(tensor_data(prompt_embeds[block]))), one per block: a
   * block at or past n_prompt_embeds cannot be hashed (KVP_EINVAL); NULL /
   * 0 = none.  0.33 tags them ("prompt_embeds", digest); older modes and
   * native ones hash the digest. */
  const uint8_t (*prompt_embeds)[32];
  size_t n_prompt_embeds;
} kvp_extras;

/* One block's extra keys, as vLLM's generate_block_hash_extra_keys makes
 * them for that block (and as KV events publish them, untagged). */
typedef struct kvp_mm_key {
  const char *id; /* UTF-8 identifier */
  int64_t offset; /* placeholder start relative to the block start */
} kvp_mm_key;
typedef struct kvp_block_extras {
  const char *lora_name;  /* NULL or "" = none */
  const char *lora_path;  /* 0.33 modes; NULL = "" */
  const kvp_mm_key *mm;   /* in placeholder order */
  size_t n_mm;
  const char *cache_salt; /* NULL or "" = none (vLLM: block 0 only) */
  const uint8_t *prompt_embeds; /* 32-byte digest, NULL = none */
} kvp_block_extras;
/* Strings: UTF-8 (KVP_EINVAL otherwise), as in kvp_extras.  Native
 * algorithms hash lora_name without lora_path (KV events do not carry it). */

typedef struct kvp_hasher_opts {
  kvp_hash_algo algo; /* 0 = KVP_HASH_XXH3_128 */
  /* vLLM modes: the PYTHONHASHSEED string the engine runs with; NONE_HASH =
   * H(serialized seed string).  NULL = the engine runs without
   * PYTHONHASHSEED: vLLM 0.33 then seeds sha256 / sha256_cbor with the
   * fixed "vllm-none-hash" (taken here), and xxhash / xxhash_cbor with
   * random per-process bytes nobody can reproduce (KVP_EINVAL here), as
   * vLLM before 0.33 did for every algorithm (KVP_EINVAL).  Invalid UTF-8 ->
   * KVP_EINVAL ("" is a valid seed).  Ignored by native modes. */
  const char *python_hash_seed;
  uint32_t vllm_compat; /* kvp_vllm_compat; 0 = the newest */
  uint32_t reserved[7];
} kvp_hasher_opts;

/* An algorithm bound to a namespace.  Immutable after creation except for
 * per-hasher scratch: NOT thread-safe; create one per thread (cheap).  The
 * chains of a hasher use its scratch too: one thread at a time for the
 * hasher and all its chains. */
typedef struct kvp_hasher kvp_hasher;

/* Returns 0, KVP_EINVAL (NULL, unknown algo or vllm_compat, namespace not
 * from kvp_namespace_init, python_hash_seed missing where vLLM's NONE_HASH
 * cannot be reproduced without it: see above), KVP_ENOMEM
 * or KVP_ENOTSUP (OpenSSL has no SHA-256).  *out is NULL on failure.  The
 * namespace is copied. */
KVP_API int kvp_hasher_create(const kvp_namespace *ns,
                              const kvp_hasher_opts *opts,
                              const kvp_allocator *alloc, kvp_hasher **out);
KVP_API void kvp_hasher_destroy(kvp_hasher *h);
KVP_API kvp_hash_algo kvp_hasher_algo(const kvp_hasher *h);
KVP_API uint32_t kvp_hasher_block_size(const kvp_hasher *h);

/* One-shot, allocation-free: keys of the full blocks of `tokens[0..n)`
 * (block 0 is the prompt's first block: it gets the cache salt).
 * Writes min(n / block_size, cap) keys to `keys` (NULL allowed when cap is
 * 0) and, if non-NULL, the number of tail tokens (n % block_size) to *tail.
 * Returns the number of full blocks (which may exceed cap: then only cap
 * keys were hashed and written), or KVP_EINVAL (NULL, bad extras: logged),
 * KVP_ERANGE (more than INT_MAX blocks) or KVP_EIO (OpenSSL failed).  n == 0
 * is valid and returns 0. */
KVP_API int kvp_hasher_hash(kvp_hasher *h, const uint32_t *tokens, size_t n,
                            const kvp_extras *extras, kvp_key *keys,
                            size_t cap, size_t *tail);

/* One block at a time, for callers that get blocks with their extra keys
 * already cut per block (KV events): digest of (parent, tokens[0..block_size),
 * bx) into digest[0..cap) and its key into *key (either may be NULL).
 * parent = the previous block's full digest (kvp_chain_digest; for native
 * algorithms the 16-byte key, hi then lo big-endian, or native sha256's
 * 32-byte digest, which ends with it), NULL = block 0 (the namespace seed /
 * NONE_HASH; parent_len ignored).  bx NULL = no extras.  Iterating it along
 * a prompt with the extras kvp_hasher_hash derives per block
 * (kvp_hasher_block_extras) gives the same keys and digests.  Returns the
 * digest length, KVP_EINVAL (NULL h or tokens, parent_len not the
 * algorithm's digest length, bad extras: logged), KVP_ENOSPC (digest
 * non-NULL and cap too small) or KVP_EIO.  Same thread rules as
 * kvp_hasher_hash. */
KVP_API int kvp_hasher_block(kvp_hasher *h, const uint8_t *parent,
                             size_t parent_len, const uint32_t *tokens,
                             const kvp_block_extras *bx, uint8_t *digest,
                             size_t cap, kvp_key *key);

/* The extra keys block `block` of a prompt gets from `extras` under h's
 * algorithm and vllm_compat -- what kvp_hasher_hash hashes for it, what
 * vLLM's generate_block_hash_extra_keys makes (native algorithms: as vLLM
 * before 0.33) -- into *out, whose strings and prompt_embeds point into
 * `extras` and whose mm points to `mm` (mm_cap entries; may be NULL when 0).
 * out->lora_path is extras->lora_path whatever the mode.  Replays vLLM's
 * walk over the blocks before `block` in O(placeholders) steps.  Returns
 * the block's number of mm keys; when that exceeds mm_cap nothing is
 * written (ask again with room).  KVP_EINVAL: NULL h or out, bad extras
 * (logged), `block` past the prompt-embeddings digests or past any prompt;
 * KVP_ERANGE: more than INT_MAX keys.  Reads only immutable hasher state:
 * any thread. */
KVP_API int kvp_hasher_block_extras(const kvp_hasher *h,
                                    const kvp_extras *extras, size_t block,
                                    kvp_block_extras *out, kvp_mm_key *mm,
                                    size_t mm_cap);

/* ---- chain: the growing key chain of one prompt or session ---------------- */
typedef struct kvp_chain kvp_chain;

typedef struct kvp_chain_opts {
  /* Coarser chunk keys to produce in the same pass, in tokens: any of 64,
   * 256, 512 (or other multiples of the block size; else, or repeated,
   * KVP_EINVAL at create); 0 terminates.  A chunk key is derived from the
   * fine key at the chunk's last block, so it commits to the whole prefix,
   * and is domain-separated by the granularity:
   *   XXH3-128(fine key (hi, lo big-endian) || u32 LE chunk_tokens || "chunk").
   * Only whole chunks get a key. */
  uint32_t chunk_tokens[4];
  /* Keep every block's full digest (kvp_chain_digest); needed to compare
   * against vLLM's full-width hashes. */
  int keep_digests;
  uint32_t reserved[7];
} kvp_chain_opts;

/* The chain borrows `h` (must outlive it) and copies `extras` (strings and
 * mm spans included).  Returns 0, KVP_EINVAL (logged) or KVP_ENOMEM; *out is
 * NULL on failure. */
KVP_API int kvp_chain_create(kvp_hasher *h, const kvp_chain_opts *opts,
                             const kvp_extras *extras,
                             const kvp_allocator *alloc, kvp_chain **out);
KVP_API void kvp_chain_destroy(kvp_chain *c);
/* Append tokens (the session grew).  Completed blocks are hashed from the last
 * key on: the prefix is never rehashed; any split of a prompt gives the keys
 * kvp_hasher_hash gives for the whole.  n == 0 is valid.  Returns the number
 * of new full blocks, or KVP_EINVAL / KVP_ENOMEM / KVP_ERANGE / KVP_EIO (then
 * the chain is unchanged). */
KVP_API int kvp_chain_extend(kvp_chain *c, const uint32_t *tokens, size_t n);
/* Forget everything (same hasher and extras). */
KVP_API void kvp_chain_reset(kvp_chain *c);
KVP_API size_t kvp_chain_len(const kvp_chain *c);    /* full blocks */
KVP_API size_t kvp_chain_tokens(const kvp_chain *c); /* tokens seen */
KVP_API size_t kvp_chain_tail(const kvp_chain *c);   /* unhashed tail */
/* Pointer to kvp_chain_len() keys (never NULL for a chain, even when empty);
 * valid until the next extend/reset/destroy. */
KVP_API const kvp_key *kvp_chain_keys(const kvp_chain *c);
/* Chunk keys at granularity `chunk_tokens` (one of those asked for at
 * create); *n (may be NULL) receives their count.  NULL, with *n = 0, if
 * that granularity was not asked for; non-NULL otherwise, even with no
 * chunk yet.  Valid until the next extend/reset/destroy. */
KVP_API const kvp_key *kvp_chain_chunk_keys(const kvp_chain *c,
                                            uint32_t chunk_tokens, size_t *n);
/* Copies block i's full digest (16 or 32 bytes) to buf.  Returns its length,
 * KVP_EINVAL (NULL), KVP_ESTATE (keep_digests was off), KVP_ERANGE (i out of
 * range) or KVP_ENOSPC (cap too small), checked in that order. */
KVP_API int kvp_chain_digest(const kvp_chain *c, size_t i, uint8_t *buf,
                             size_t cap);

/* ---- segments ------------------------------------------------------------- */
typedef enum kvp_role {
  KVP_ROLE_OTHER = 0,
  KVP_ROLE_SYSTEM,
  KVP_ROLE_TOOLS,
  KVP_ROLE_DOCUMENTS,
  KVP_ROLE_HISTORY,
  KVP_ROLE_USER,
  KVP_ROLE_TOOL_OUTPUT,
  KVP_ROLE_COUNT_
} kvp_role;

/* kvp_class (volatile / semi / stable) and its names: kvplane/common.h. */

/* "other", "system", "tools", "documents", "history", "user", "tool_output";
 * "unknown" (never NULL) for other values.  Thread-safe. */
KVP_API const char *kvp_role_name(kvp_role r);
/* Parses the names kvp_role_name gives (exact, case-sensitive).  Returns 0
 * or KVP_EINVAL (NULL, unknown name; *out untouched). */
KVP_API int kvp_role_parse(const char *s, kvp_role *out);
/* Default class of a role: system/tools -> stable, documents/history ->
 * semi, user/tool_output/other (and unknown values) -> volatile. */
KVP_API kvp_class kvp_role_default_class(kvp_role r);

/* A caller-supplied segment mark: tokens [offset, offset+length).  Valid
 * when offset + length <= UINT32_MAX, role < KVP_ROLE_COUNT_ and class_hint
 * is a kvp_class or KVP_CLASS_AUTO; a mark may reach past the prompt (it is
 * clipped) and may be empty (it covers nothing).  Marks may overlap and come
 * in any order. */
typedef struct kvp_segment_mark {
  uint32_t offset;
  uint32_t length;
  uint8_t role;       /* kvp_role */
  uint8_t class_hint; /* kvp_class, or KVP_CLASS_AUTO */
  uint8_t reserved[6];
} kvp_segment_mark;

/* ---- stability classifier ---------------------------------------------------
 * Learns from what it observes, in bounded memory: a block key seen across
 * >= stable_sessions distinct sessions is stable; one re-seen within a
 * session is semi-stable; the rest is volatile.  Because a chained key commits
 * to its whole prefix, a block is never more reusable than the block before
 * it: classes are made non-increasing along the chain, so a request is always
 * [stable blocks][semi blocks][volatile blocks][volatile tail].
 *
 * Precisely, for each block, from what was learned BEFORE this request:
 *   stable    the key's distinct-session estimate >= stable_sessions.  Each
 *             key keeps a 64-bit sketch, one bit per hash(session) % 64; the
 *             estimate is linear counting, -64 ln(1 - k/64) for k bits set,
 *             which is k itself for small k (k <= 8: "3 sessions" = 3 bits).
 *             Two sessions on one bit count once: it under-counts, never
 *             over-counts.
 *   semi      this session's bit was already set (it sent the key before)
 *             and the key's sightings so far >= semi_repeats - 1, i.e. this
 *             is at least its semi_repeats-th sighting.  Sightings are counted
 *             over all sessions: exact for a key private to one session (what
 *             semi is for); a shared key is on its way to stable anyway.
 *   volatile  everything else, first sightings included.
 * Keys are tracked by their 64-bit fingerprint `lo` (50 bits of it stored):
 * a collision can only mis-classify a block, never serve KV bytes.
 *
 * The keys of a request must be a chain (kvp_hasher_hash / kvp_chain keys):
 * each key commits to all blocks before it, so whoever sent block i sent
 * blocks 0..i-1 too.  Observe relies on it: the blocks this session already
 * sent (a prefix of the request) are found by binary search and not walked
 * one by one -- O(log n) probes for them (prefetched together when the
 * request extends the session's last one), the per-block cost only for the
 * rest, e.g. a conversation's new turn.  While nothing is evicted this gives
 * exactly the classes and state described above.  Once CLOCK evicts, the
 * first request of a chain in each epoch (a quarter revolution of the CLOCK
 * hand) walks all its blocks again, so a chain sent at least every 3/4
 * revolution keeps its entries (the per-block path: every revolution);
 * between those walks, an entry evicted from the middle of an
 * already-sent prefix (CLOCK's bounded sweep can take a recently used one)
 * may go unnoticed, and its blocks then get what the prefix's last block
 * proves: never more than a table that had forgotten nothing would say (a
 * block is reported stable only if >= stable_sessions sessions sent it).  A
 * re-learned entry inherits what the next block of its chain proves. */
typedef struct kvp_stability kvp_stability;

typedef struct kvp_stability_opts {
  /* Tracked block keys; 0 = 1<<20.  CLOCK (an LRU approximation) evicts
   * beyond it.  Memory: a power of two >= capacity / 0.75 slots of 16 bytes
   * (1<<20 -> 32 MiB), allocated and written at create, plus 16 bytes of
   * per-session prefetch hints per 64 keys (1<<20 -> 256 KiB). */
  uint32_t capacity;
  uint32_t stable_sessions; /* distinct sessions for stable: 1..256; 0 = 3 */
  uint32_t semi_repeats;    /* sightings within one session for semi:
                               2..128; 0 = 2 */
  uint32_t reserved[5];
} kvp_stability_opts;

typedef struct kvp_classification {
  uint64_t tokens[KVP_CLASS_COUNT_]; /* indexed by kvp_class; tail volatile */
  uint32_t stable_end;    /* blocks [0, stable_end) are stable */
  uint32_t semi_end;      /* blocks [stable_end, semi_end) semi-stable */
  uint32_t n_blocks;      /* blocks [semi_end, n_blocks) volatile */
  uint32_t learned_blocks; /* blocks classified by learning (not by marks) */
  uint32_t reserved[4];
} kvp_classification;

/* opts may be NULL (defaults).  Returns 0, KVP_EINVAL (NULL out, thresholds
 * out of range) or KVP_ENOMEM; *out is NULL on failure.  With the default
 * allocator the table is advised to use transparent huge pages (Linux). */
KVP_API int kvp_stability_create(const kvp_stability_opts *opts,
                                 const kvp_allocator *alloc,
                                 kvp_stability **out);
/* NULL is a no-op. */
KVP_API void kvp_stability_destroy(kvp_stability *s);
/* Observe one request of `session` and classify it.  `keys` are its n_blocks
 * block keys (block_size tokens each) followed by `tail` unhashed tokens.
 * Marks (may be NULL/0) override learning for the blocks they cover: a block
 * takes the least reusable class of the marks overlapping it (hint, or the
 * role's default); uncovered blocks use what was learned before this call.
 * Then classes are made non-increasing along the chain.  Every block is
 * learned, marked or not.  Never allocates.  Cost: O(log n_blocks) probes for
 * the prefix this session already sent (see above), then a few ns per block
 * when the table is cache-resident, one memory miss (prefetched) when not.
 * Returns 0 or KVP_EINVAL (NULL s/out, keys NULL with n_blocks > 0,
 * n_blocks > UINT32_MAX, block_size 0 or > KVP_BLOCK_SIZE_MAX, marks NULL
 * with n_marks > 0, an invalid mark); a rejected call learns nothing.
 * Not thread-safe (one per router thread, or lock). */
KVP_API int kvp_stability_observe(kvp_stability *s, uint64_t session,
                                  const kvp_key *keys, size_t n_blocks,
                                  uint32_t block_size, size_t tail,
                                  const kvp_segment_mark *marks, size_t n_marks,
                                  kvp_classification *out);
/* Keys currently tracked (<= capacity); 0 for NULL. */
KVP_API size_t kvp_stability_size(const kvp_stability *s);

/* ---- drift ------------------------------------------------------------------
 * Why did this turn miss?  Compares a session's previous turn with this one. */
typedef struct kvp_drift_report {
  int64_t first_diverging_block; /* -1 when no block differs */
  uint64_t common_prefix_tokens; /* tokens in the equal leading blocks */
  uint8_t role;  /* kvp_role at the first token of the diverging block: the
                    narrowest covering mark of this turn, else of the previous
                    turn, else OTHER (also OTHER when nothing diverges) */
  uint8_t reserved0[7];
  /* Tokens of the previous turn after the divergence that reappear unchanged
   * (whole blocks of the previous turn, at its block boundaries, whose exact
   * tokens occur anywhere in this turn at or after the divergence's first
   * token, at any alignment): reusable only had the prompt kept its order. */
  uint64_t reappearing_tokens;
  uint64_t shifted_tokens;  /* of those, found only at other offsets */
  uint64_t lost_tokens;     /* previous turn's full-block tokens from the
                               diverging block on */
  uint32_t reserved[4];
} kvp_drift_report;

/* One turn as the drift detector sees it: its block keys (same hasher for
 * both turns), its tokens and optional marks. */
typedef struct kvp_turn_view {
  const kvp_key *keys;
  size_t n_blocks;
  const uint32_t *tokens;
  size_t n_tokens; /* >= n_blocks * block_size */
  const kvp_segment_mark *marks; /* may be NULL */
  size_t n_marks;
} kvp_turn_view;

/* first_diverging_block is the first block whose keys differ; when cur runs
 * out of blocks first it is cur's block count, and when cur equals prev or
 * extends it block for block it is -1 (common_prefix_tokens then covers all
 * of prev's blocks).  Finding the reappearing blocks takes O(tokens) time
 * (Rabin-Karp over block-sized windows, every match confirmed with memcmp)
 * and one allocation, freed before returning.
 * Returns 0, KVP_EINVAL (NULL, block_size out of range, a view's keys or
 * tokens NULL while counted, n_tokens < n_blocks * block_size, n_blocks >
 * UINT32_MAX, an invalid mark) or KVP_ENOMEM; *out is meaningful only on 0.
 * Thread-safe (no shared state). */
KVP_API int kvp_drift_compare(const kvp_turn_view *prev,
                              const kvp_turn_view *cur, uint32_t block_size,
                              const kvp_allocator *alloc,
                              kvp_drift_report *out);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_PREFIX_H */
