/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix, block hashing: namespace seeds, the block-hash algorithms
 * (native XXH3-128 / SHA-256; vLLM-exact sha256_cbor / xxhash_cbor and
 * vLLM 0.33's default sha256 / xxhash over pickle protocol 5), the extra keys
 * each vLLM release derives per block, and the incrementally extended key
 * chain of a prompt. */
#include <assert.h>
#include <inttypes.h>
#include <limits.h>
#include <string.h>

#include <cbor.h>
#include <openssl/evp.h>
/* XXH3_state_t for encodings longer than the scratch buffer.  Inlining
 * XXH3 lets the 80-byte (16-token) hot path fold XXH3's length dispatch:
 * measured 10.5 vs 12.2 ns/block against the call into libxxhash. */
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core_internal.h"
#include "prefix_internal.h"

#define LOG_MOD "prefix"
#define N_ALGOS 6
#define N_CHUNKS 4
/* Scratch beyond the largest token encoding (5 B per CBOR uint): extras
 * that fit are hashed in the same single call; longer ones stream. */
#define SCRATCH_SLACK 2048u
#define CBOR_HEAD_MAX 9u
/* vLLM 0.33's DEFAULT_NONE_HASH_SEED (v1/core/kv_cache_utils.py): NONE_HASH's
 * seed for sha256 / sha256_cbor when PYTHONHASHSEED is unset. */
#define VLLM_DEFAULT_SEED "vllm-none-hash"

/* CPython's Modules/_pickle.c framing constants. */
#define PK_FRAME_TARGET 65536u /* FRAME_SIZE_TARGET */
#define PK_FRAME_MIN 4u        /* FRAME_SIZE_MIN: shorter ones stay unframed */
#define PK_FRAME_HDR 9u        /* FRAME + u64le length */
/* The longest frame CPython builds for our objects: it commits a frame when
 * a save() starts with >= PK_FRAME_TARGET bytes in it, and between two
 * save()s writes at most one str/bytes payload below the target (<= 65535
 * bytes + 5 of header + MEMOIZE), then the closing TUPLEn + MEMOIZE of at
 * most three nested tuples and STOP. */
#define PK_FRAME_MAX (2u * PK_FRAME_TARGET + 64u)
#define PK_NO_FRAME SIZE_MAX
#define PK_NO_MEMO UINT32_MAX

/* ---- bytes --------------------------------------------------------------- */
static const bool host_le = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

static inline void put_u32le(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static inline void put_u64le(uint8_t *p, uint64_t v) {
  if (!host_le)
    v = __builtin_bswap64(v);
  memcpy(p, &v, 8);
}

/* memcpy + bswap: one 8-byte store/load that XXH3's own 8-byte loads can
 * forward from (a byte loop cost ~10 ns/block in store-forwarding stalls). */
static inline void put_u64be(uint8_t *p, uint64_t v) {
  if (host_le)
    v = __builtin_bswap64(v);
  memcpy(p, &v, 8);
}

static inline uint64_t get_u64be(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return host_le ? __builtin_bswap64(v) : v;
}

static inline void key_bytes(kvp_key k, uint8_t *out) {
  put_u64be(out, k.hi);
  put_u64be(out + 8, k.lo);
}

static inline kvp_key key_from(const uint8_t *p) {
  return (kvp_key){get_u64be(p), get_u64be(p + 8)};
}

static inline void put_tokens_le(uint8_t *p, const uint32_t *t, size_t n) {
  if (host_le) {
    memcpy(p, t, n * sizeof *t);
    return;
  }
  for (size_t i = 0; i < n; i++)
    put_u32le(p + 4 * i, t[i]);
}

/* ---- algorithms ---------------------------------------------------------- */
static const char *const algo_names[N_ALGOS] = {
    "xxh3_128",    "sha256",      "sha256_cbor",
    "xxhash_cbor", "vllm_sha256", "vllm_xxhash"};

static bool algo_valid(kvp_hash_algo a) { return (unsigned)a < N_ALGOS; }
static bool algo_vllm(kvp_hash_algo a) {
  return algo_valid(a) && a >= KVP_HASH_SHA256_CBOR;
}
static bool algo_cbor(kvp_hash_algo a) {
  return a == KVP_HASH_SHA256_CBOR || a == KVP_HASH_XXHASH_CBOR;
}
static bool algo_pickle(kvp_hash_algo a) {
  return a == KVP_HASH_VLLM_SHA256 || a == KVP_HASH_VLLM_XXHASH;
}
static bool algo_sha(kvp_hash_algo a) {
  return a == KVP_HASH_SHA256 || a == KVP_HASH_SHA256_CBOR ||
         a == KVP_HASH_VLLM_SHA256;
}

int kvp_hash_algo_parse(const char *name, kvp_hash_algo *out) {
  if (name == NULL || out == NULL) {
    KVP_LOGW(LOG_MOD, "hash_algo_parse: NULL %s",
             name == NULL ? "name" : "out");
    return KVP_EINVAL;
  }
  for (unsigned i = 0; i < N_ALGOS; i++)
    if (strcmp(name, algo_names[i]) == 0) {
      *out = (kvp_hash_algo)i;
      return 0;
    }
  KVP_LOGW(LOG_MOD,
           "unknown hash algorithm \"%s\" (want xxh3_128, sha256, "
           "sha256_cbor, xxhash_cbor, vllm_sha256 or vllm_xxhash)",
           name);
  return KVP_EINVAL;
}

const char *kvp_hash_algo_name(kvp_hash_algo algo) {
  return algo_valid(algo) ? algo_names[algo] : "unknown";
}

size_t kvp_hash_algo_digest_len(kvp_hash_algo algo) {
  if (!algo_valid(algo))
    return 0;
  return algo_sha(algo) ? 32 : 16;
}

int kvp_hash_algo_from_vllm(const char *vllm_name, kvp_hash_algo *out) {
  /* vLLM's get_hash_fn_by_name (utils/hashing.py) */
  static const struct {
    const char *name;
    kvp_hash_algo algo;
  } map[] = {{"sha256", KVP_HASH_VLLM_SHA256},
             {"sha256_cbor", KVP_HASH_SHA256_CBOR},
             {"xxhash", KVP_HASH_VLLM_XXHASH},
             {"xxhash_cbor", KVP_HASH_XXHASH_CBOR}};
  if (vllm_name == NULL || out == NULL) {
    KVP_LOGW(LOG_MOD, "hash_algo_from_vllm: NULL %s",
             vllm_name == NULL ? "name" : "out");
    return KVP_EINVAL;
  }
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (strcmp(vllm_name, map[i].name) == 0) {
      *out = map[i].algo;
      return 0;
    }
  KVP_LOGW(LOG_MOD,
           "unknown vLLM hash algorithm \"%s\" (want sha256, sha256_cbor, "
           "xxhash or xxhash_cbor)",
           vllm_name);
  return KVP_EINVAL;
}

/* ---- namespace ----------------------------------------------------------- */
/* Length of an optional UTF-8 field that is hashed with a u32 length. */
static int check_string(const char *what, const char *field, const char *s,
                        size_t *len) {
  *len = s != NULL ? strlen(s) : 0;
  if (*len > UINT32_MAX) {
    KVP_LOGW(LOG_MOD, "%s: %s is longer than 4 GiB", what, field);
    return KVP_EINVAL;
  }
  if (!kvp__utf8_valid(s, *len)) {
    KVP_LOGW(LOG_MOD, "%s: %s is not valid UTF-8", what, field);
    return KVP_EINVAL;
  }
  return 0;
}

/* len[]: model_id, tokenizer_id, kv_layout, tenant_salt. */
static int ns_check(const kvp_namespace_desc *d, size_t len[4]) {
  if (d->model_id == NULL || d->model_id[0] == '\0') {
    KVP_LOGW(LOG_MOD, "namespace: model_id is required");
    return KVP_EINVAL;
  }
  if (d->block_size == 0 || d->block_size > KVP_BLOCK_SIZE_MAX) {
    KVP_LOGW(LOG_MOD, "namespace: block_size %" PRIu32 " not in 1..%u",
             d->block_size, KVP_BLOCK_SIZE_MAX);
    return KVP_EINVAL;
  }
  int rc = check_string("namespace", "model_id", d->model_id, &len[0]);
  if (rc == 0)
    rc = check_string("namespace", "tokenizer_id", d->tokenizer_id, &len[1]);
  if (rc == 0)
    rc = check_string("namespace", "kv_layout", d->kv_layout, &len[2]);
  if (rc == 0)
    rc = check_string("namespace", "tenant_salt", d->tenant_salt, &len[3]);
  return rc;
}

/* u32le length || bytes; returns OpenSSL's 1/0. */
static int sha_lp(EVP_MD_CTX *ctx, const char *s, size_t len) {
  uint8_t n[4];
  put_u32le(n, (uint32_t)len);
  return EVP_DigestUpdate(ctx, n, 4) &&
         (len == 0 || EVP_DigestUpdate(ctx, s, len));
}

static int ns_digest(EVP_MD_CTX *ctx, const kvp_namespace_desc *d,
                     const size_t len[4], uint8_t out[32]) {
  uint8_t bs[4], present = len[3] > 0;
  unsigned dlen = 0;
  put_u32le(bs, d->block_size);
  return EVP_DigestInit_ex2(ctx, EVP_sha256(), NULL) &&
         EVP_DigestUpdate(ctx, KVP__NS_TAG, sizeof KVP__NS_TAG - 1) &&
         sha_lp(ctx, d->model_id, len[0]) &&
         sha_lp(ctx, d->tokenizer_id, len[1]) &&
         sha_lp(ctx, d->kv_layout, len[2]) && EVP_DigestUpdate(ctx, bs, 4) &&
         EVP_DigestUpdate(ctx, &present, 1) &&
         sha_lp(ctx, d->tenant_salt, len[3]) &&
         EVP_DigestFinal_ex(ctx, out, &dlen) && dlen == 32;
}

int kvp_namespace_init(const kvp_namespace_desc *desc, kvp_namespace *out) {
  if (desc == NULL || out == NULL) {
    KVP_LOGW(LOG_MOD, "namespace: NULL argument");
    return KVP_EINVAL;
  }
  size_t len[4];
  int rc = ns_check(desc, len);
  if (rc < 0)
    return rc;
  EVP_MD_CTX *ctx = EVP_MD_CTX_new();
  if (ctx == NULL)
    return KVP_ENOMEM;
  uint8_t d[32];
  int ok = ns_digest(ctx, desc, len, d);
  EVP_MD_CTX_free(ctx);
  if (!ok) {
    KVP_LOGE(LOG_MOD, "namespace: OpenSSL SHA-256 failed");
    return KVP_EIO;
  }
  *out = (kvp_namespace){.seed = key_from(d), .block_size = desc->block_size};
  return 0;
}


/* ---- extras -------------------------------------------------------------- */
static int check_mm(const kvp_mm_span *mm, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const kvp_mm_span *s = &mm[i];
    size_t len = s->id != NULL ? strlen(s->id) : 0;
    if (s->id == NULL || len > UINT32_MAX || !kvp__utf8_valid(s->id, len)) {
      KVP_LOGW(LOG_MOD, "extras: mm[%zu].id is %s", i,
               s->id == NULL ? "NULL" : "not valid UTF-8");
      return KVP_EINVAL;
    }
    /* offsets relative to a block start must fit an i64 */
    if (s->offset > INT64_MAX || s->length > INT64_MAX - s->offset) {
      KVP_LOGW(LOG_MOD, "extras: mm[%zu] offset+length overflows", i);
      return KVP_EINVAL;
    }
    if (i > 0 && s->offset < mm[i - 1].offset) {
      KVP_LOGW(LOG_MOD,
               "extras: mm[%zu].offset %" PRIu64 " < mm[%zu].offset %" PRIu64
               ": placeholders must be sorted by offset",
               i, s->offset, i - 1, mm[i - 1].offset);
      return KVP_EINVAL;
    }
  }
  return 0;
}

static int check_arrays(const kvp_extras *e) {
  if (e->n_mm > 0 && e->mm == NULL) {
    KVP_LOGW(LOG_MOD, "extras: n_mm is %zu but mm is NULL", e->n_mm);
    return KVP_EINVAL;
  }
  if (e->n_prompt_embeds > 0 && e->prompt_embeds == NULL) {
    KVP_LOGW(LOG_MOD, "extras: n_prompt_embeds is %zu but prompt_embeds is "
             "NULL", e->n_prompt_embeds);
    return KVP_EINVAL;
  }
  return 0;
}

int kvp__xview_init(const kvp_extras *e, kvp__xview *out) {
  *out = (kvp__xview){.path = ""};
  if (e == NULL)
    return 0;
  int rc = check_arrays(e);
  if (rc == 0)
    rc = check_string("extras", "lora_name", e->lora_name, &out->lora_len);
  if (rc == 0)
    rc = check_string("extras", "lora_path", e->lora_path, &out->path_len);
  if (rc == 0)
    rc = check_string("extras", "cache_salt", e->cache_salt, &out->salt_len);
  if (rc == 0)
    rc = check_mm(e->mm, e->n_mm);
  if (rc < 0)
    return rc;
  out->lora = e->lora_name;
  out->path = e->lora_path != NULL ? e->lora_path : "";
  out->salt = e->cache_salt;
  out->mm = e->mm;
  out->n_mm = e->n_mm;
  if (e->n_prompt_embeds > 0) {
    out->embeds = e->prompt_embeds;
    out->n_embeds = e->n_prompt_embeds;
  }
  return 0;
}

int kvp__embeds_cover(const kvp__xview *x, size_t first, size_t n) {
  if (x->embeds == NULL || n == 0 || first + n <= x->n_embeds)
    return 0;
  KVP_LOGW(LOG_MOD,
           "extras: prompt_embeds holds %zu block digests, block %zu has none",
           x->n_embeds, first > x->n_embeds ? first : x->n_embeds);
  return KVP_EINVAL;
}

/* vLLM's _gen_mm_extra_hash_keys, one key at a time, so a block's keys can
 * be counted (CBOR array header, pickle tuple opcode) and then emitted
 * without a buffer.  `r033`: vLLM 0.33's test for a placeholder the block
 * has passed (`start >= offset + length`; before: `start > ...`, so one that
 * ends where the block starts still keyed it). */
typedef struct mm_iter {
  size_t idx;
  bool done, r033;
} mm_iter;

static uint64_t mm_end(const kvp_mm_span *s) { return s->offset + s->length; }

static bool mm_passed(const kvp_mm_span *s, uint64_t start, bool r033) {
  return r033 ? start >= mm_end(s) : start > mm_end(s);
}

static mm_iter mm_begin(const kvp__xview *x, uint64_t start, size_t idx,
                        bool r033) {
  /* vLLM's early exit: past the last placeholder, no keys, index kept */
  bool past = x->n_mm == 0 || mm_passed(&x->mm[x->n_mm - 1], start, r033);
  return (mm_iter){idx, past, r033};
}

static bool mm_next(const kvp__xview *x, uint64_t start, uint64_t end,
                    mm_iter *it, size_t *out) {
  while (!it->done && it->idx < x->n_mm) {
    const kvp_mm_span *s = &x->mm[it->idx];
    if (end <= s->offset)
      break; /* not reached yet */
    if (mm_passed(s, start, it->r033)) {
      it->idx++;
      continue;
    }
    *out = it->idx;
    if (end >= mm_end(s))
      it->idx++; /* ends here; the next one may start in this block too */
    else
      it->done = true;
    return true;
  }
  it->done = true;
  return false;
}

/* One block's extra keys, whichever way they came: derived from a request's
 * extras by the walk (mm keys replayed from the span iterator), or given per
 * block (kvp_hasher_block: `mm`).  Absent fields are NULL; path is "" when
 * NULL was given. */
typedef struct bkeys {
  const char *lora, *path, *salt;
  size_t lora_len, path_len, salt_len;
  const uint8_t *embeds; /* 32 bytes */
  size_t n_mm;
  const kvp_mm_key *mm; /* given, or NULL: replayed from x */
  const kvp__xview *x;
  mm_iter it;
  uint64_t start, end;
} bkeys;

/* Where a walk over a block's mm keys stands. */
typedef struct mm_walk {
  mm_iter it;
  size_t k;
} mm_walk;

static size_t bk_count(const bkeys *b) {
  return (size_t)(b->lora != NULL) + b->n_mm + (size_t)(b->salt != NULL) +
         (size_t)(b->embeds != NULL);
}

static mm_walk bk_walk(const bkeys *b) { return (mm_walk){b->it, 0}; }

/* The next mm key of the block, in placeholder order; false after the last.
 * *len receives strlen(id). */
static bool bk_next(const bkeys *b, mm_walk *w, kvp_mm_key *out,
                    size_t *len) {
  if (w->k == b->n_mm)
    return false;
  if (b->mm != NULL) {
    *out = b->mm[w->k];
  } else {
    size_t i = 0;
    bool more = mm_next(b->x, b->start, b->end, &w->it, &i);
    assert(more); /* n_mm was counted by the same iteration */
    (void)more;
    /* i64 two's complement of the u64 difference: may be negative */
    *out = (kvp_mm_key){b->x->mm[i].id,
                        (int64_t)(b->x->mm[i].offset - b->start)};
  }
  w->k++;
  *len = strlen(out->id);
  return true;
}

/* generate_block_hash_extra_keys for the block at cur: lora, mm..., salt,
 * embeds.  *mm_after receives curr_mm_idx for the next block. */
static void plan_block(const kvp__xview *x, const kvp__cursor *cur,
                       uint32_t bs, bool r033, bkeys *b, size_t *mm_after) {
  *b = (bkeys){.x = x, .start = cur->start, .end = cur->start + bs};
  if (x->lora_len > 0) {
    b->lora = x->lora, b->lora_len = x->lora_len;
    b->path = x->path, b->path_len = x->path_len;
  }
  if (x->salt_len > 0 && cur->start == 0)
    b->salt = x->salt, b->salt_len = x->salt_len;
  if (x->embeds != NULL)
    b->embeds = x->embeds[cur->start / bs];
  b->it = mm_begin(x, cur->start, cur->mm_idx, r033);
  mm_iter it = b->it;
  size_t i;
  while (mm_next(x, b->start, b->end, &it, &i))
    b->n_mm++;
  *mm_after = it.idx;
}

/* A caller's per-block extras, validated (KVP_EINVAL, logged). */
static int bkeys_given(const kvp_block_extras *bx, bkeys *b) {
  size_t len[3];
  *b = (bkeys){0};
  if (bx == NULL)
    return 0;
  if (bx->n_mm > 0 && bx->mm == NULL) {
    KVP_LOGW(LOG_MOD, "block extras: n_mm is %zu but mm is NULL", bx->n_mm);
    return KVP_EINVAL;
  }
  int rc = check_string("block extras", "lora_name", bx->lora_name, &len[0]);
  if (rc == 0)
    rc = check_string("block extras", "lora_path", bx->lora_path, &len[1]);
  if (rc == 0)
    rc = check_string("block extras", "cache_salt", bx->cache_salt, &len[2]);
  for (size_t i = 0; rc == 0 && i < bx->n_mm; i++) {
    size_t n;
    if (bx->mm[i].id == NULL) {
      KVP_LOGW(LOG_MOD, "block extras: mm[%zu].id is NULL", i);
      return KVP_EINVAL;
    }
    rc = check_string("block extras", "an mm id", bx->mm[i].id, &n);
  }
  if (rc < 0)
    return rc;
  if (len[0] > 0)
    *b = (bkeys){.lora = bx->lora_name, .lora_len = len[0],
                 .path = bx->lora_path != NULL ? bx->lora_path : "",
                 .path_len = len[1]};
  if (len[2] > 0)
    b->salt = bx->cache_salt, b->salt_len = len[2];
  b->embeds = bx->prompt_embeds;
  b->mm = bx->mm;
  b->n_mm = bx->n_mm;
  return 0;
}

/* ---- hasher -------------------------------------------------------------- */
enum { PK_TAG_LORA, PK_TAG_MM, PK_TAG_SALT, PK_TAG_EMBEDS, PK_N_TAGS };

/* Memo slot of a str CPython shares (see pk_shared), valid in one pickle:
 * the one whose number is `gen`. */
typedef struct pk_slot {
  uint32_t gen, idx;
} pk_slot;

/* The pickle writer's state for the pickle being written. */
typedef struct pk_state {
  size_t frame; /* h->buf offset of the open frame's header; PK_NO_FRAME */
  bool framing; /* false between PROTO and the first save, and for payloads
                   written outside frames */
  uint32_t memo; /* memo entries so far = the next MEMOIZE's index */
  uint32_t tag[PK_N_TAGS];
  uint32_t gen;
  pk_slot single[257]; /* by code point; [256] is "" */
} pk_state;

struct kvp_hasher {
  kvp_allocator alloc;
  kvp_hash_algo algo;
  kvp_vllm_compat compat; /* vLLM modes: PRE_0_33 or 0_33 (resolved) */
  bool r033;              /* vLLM 0.33 placeholder rule (mm_iter) */
  bool tagged;            /* vLLM 0.33 tagged extra keys */
  uint32_t block_size;
  size_t dlen;
  uint8_t root[KVP__DIGEST_MAX]; /* the cursor's parent before block 0 */
  EVP_MD *md;                    /* sha modes: fetched once */
  EVP_MD_CTX *md_ctx;            /* sha modes: reused for every block */
  void *xxh_mem;                 /* xxh modes: holds xxh, 64-byte aligned */
  XXH3_state_t *xxh;
  /* The sink: a block's encoding is built in buf and hashed with one call;
   * only an encoding longer than cap (huge extras) streams through
   * md_ctx / xxh.  Sticky `failed` keeps the encoders free of error paths. */
  uint8_t *buf;
  size_t cap, pos;
  bool streaming, failed;
  bool fast16; /* xxh3_80 verified against XXH3_128bits at create */
  pk_state pk;
  /* tests: a copy of every byte hashed (kvp__hasher_block_bytes) */
  uint8_t *tap;
  size_t tap_cap, tap_len;
};

static void tap_put(kvp_hasher *h, const uint8_t *p, size_t n) {
  if (h->tap_len < h->tap_cap)
    memcpy(h->tap + h->tap_len, p,
           n < h->tap_cap - h->tap_len ? n : h->tap_cap - h->tap_len);
  h->tap_len += n;
}

static void sink_begin(kvp_hasher *h) {
  h->pos = 0;
  h->streaming = false;
  h->failed = false;
}

static void sink_update(kvp_hasher *h, const uint8_t *p, size_t n) {
  if (KVP_UNLIKELY(h->tap != NULL))
    tap_put(h, p, n);
  if (h->md_ctx != NULL)
    h->failed |= !EVP_DigestUpdate(h->md_ctx, p, n);
  else
    h->failed |= XXH3_128bits_update(h->xxh, p, n) != XXH_OK;
}

static void sink_flush(kvp_hasher *h) {
  if (!h->streaming) {
    h->streaming = true;
    if (h->md_ctx != NULL)
      h->failed |= !EVP_DigestInit_ex2(h->md_ctx, h->md, NULL);
    else
      h->failed |= XXH3_128bits_reset(h->xxh) != XXH_OK;
  }
  sink_update(h, h->buf, h->pos);
  h->pos = 0;
}

/* n contiguous writable bytes (n <= cap) at buf + pos. */
static uint8_t *sink_room(kvp_hasher *h, size_t n) {
  assert(n <= h->cap);
  if (h->cap - h->pos < n)
    sink_flush(h);
  return h->buf + h->pos;
}

static void sink_put(kvp_hasher *h, const void *p, size_t n) {
  const uint8_t *s = p;
  while (n > 0) {
    if (h->pos == h->cap)
      sink_flush(h);
    size_t k = h->cap - h->pos < n ? h->cap - h->pos : n;
    memcpy(h->buf + h->pos, s, k);
    h->pos += k;
    s += k;
    n -= k;
  }
}

/* Hashes everything put since sink_begin; writes dlen bytes to out. */
static int sink_final(kvp_hasher *h, uint8_t *out) {
  if (h->md_ctx != NULL) {
    unsigned len = 0;
    sink_flush(h); /* EVP has no one-shot on a reused ctx: init + update */
    h->failed |= !EVP_DigestFinal_ex(h->md_ctx, out, &len) || len != 32;
  } else {
    XXH128_hash_t r;
    if (h->streaming) {
      sink_update(h, h->buf, h->pos);
      r = XXH3_128bits_digest(h->xxh);
    } else {
      if (KVP_UNLIKELY(h->tap != NULL))
        tap_put(h, h->buf, h->pos);
      r = XXH3_128bits(h->buf, h->pos);
    }
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, r);
    memcpy(out, c.digest, 16);
  }
  if (KVP_UNLIKELY(h->failed)) {
    KVP_LOGE(LOG_MOD, "hasher: digest failed (OpenSSL / xxHash)");
    return KVP_EIO;
  }
  return 0;
}

/* ---- native encoding ----------------------------------------------------- */
static void put_lp(kvp_hasher *h, const char *s, size_t len) {
  uint8_t n[4];
  put_u32le(n, (uint32_t)len);
  sink_put(h, n, 4);
  sink_put(h, s, len);
}

static void native_extras(kvp_hasher *h, const bkeys *b) {
  uint8_t tag = (uint8_t)(KVP__XTAG | (b->lora ? KVP__XTAG_LORA : 0) |
                          (b->n_mm ? KVP__XTAG_MM : 0) |
                          (b->salt ? KVP__XTAG_SALT : 0) |
                          (b->embeds ? KVP__XTAG_EMBEDS : 0));
  sink_put(h, &tag, 1);
  if (b->lora)
    put_lp(h, b->lora, b->lora_len);
  if (b->n_mm > 0) {
    uint8_t n[8];
    put_u32le(n, (uint32_t)b->n_mm);
    sink_put(h, n, 4);
    mm_walk w = bk_walk(b);
    kvp_mm_key k;
    size_t len;
    while (bk_next(b, &w, &k, &len)) {
      put_lp(h, k.id, len);
      put_u64le(n, (uint64_t)k.offset); /* i64 two's complement */
      sink_put(h, n, 8);
    }
  }
  if (b->salt)
    put_lp(h, b->salt, b->salt_len);
  if (b->embeds)
    sink_put(h, b->embeds, 32);
}

static void native_block(kvp_hasher *h, const uint8_t *parent,
                         const uint32_t *tok, const bkeys *b) {
  size_t tb = (size_t)h->block_size * 4;
  sink_put(h, parent, 16);
  put_tokens_le(sink_room(h, tb), tok, h->block_size);
  h->pos += tb;
  if (bk_count(b) > 0)
    native_extras(h, b);
}

/* ---- CBOR encoding (cbor2.dumps(..., canonical=True) of vLLM's tuple) ---- */
static void cb_array(kvp_hasher *h, size_t n) {
  uint8_t *p = sink_room(h, CBOR_HEAD_MAX);
  h->pos += cbor_encode_array_start(n, p, CBOR_HEAD_MAX);
}

static void cb_text(kvp_hasher *h, const char *s, size_t len) {
  uint8_t *p = sink_room(h, CBOR_HEAD_MAX);
  h->pos += cbor_encode_string_start(len, p, CBOR_HEAD_MAX);
  sink_put(h, s, len);
}

static void cb_bytes(kvp_hasher *h, const uint8_t *s, size_t len) {
  uint8_t *p = sink_room(h, CBOR_HEAD_MAX);
  h->pos += cbor_encode_bytestring_start(len, p, CBOR_HEAD_MAX);
  sink_put(h, s, len);
}

static void cb_int(kvp_hasher *h, int64_t v) {
  uint8_t *p = sink_room(h, CBOR_HEAD_MAX);
  h->pos += v >= 0 ? cbor_encode_uint((uint64_t)v, p, CBOR_HEAD_MAX)
                   : cbor_encode_negint((uint64_t)(-(v + 1)), p, CBOR_HEAD_MAX);
}

static void cb_null(kvp_hasher *h) {
  uint8_t *p = sink_room(h, 1);
  h->pos += cbor_encode_null(p, 1);
}

static void cb_tokens(kvp_hasher *h, const uint32_t *tok) {
  cb_array(h, h->block_size);
  uint8_t *p = sink_room(h, (size_t)h->block_size * 5), *q = p;
  for (uint32_t i = 0; i < h->block_size; i++)
    q += cbor_encode_uint(tok[i], q, 5);
  h->pos += (size_t)(q - p);
}

/* 0.33's tagged key head: [tag, ... (n - 1 more) */
static void cb_tag(kvp_hasher *h, const char *tag, size_t n) {
  if (!h->tagged)
    return;
  cb_array(h, n);
  cb_text(h, tag, strlen(tag));
}

static void cbor_extras(kvp_hasher *h, const bkeys *b) {
  cb_array(h, bk_count(b));
  if (b->lora) {
    cb_tag(h, "lora", 3);
    cb_text(h, b->lora, b->lora_len);
    if (h->tagged)
      cb_text(h, b->path, b->path_len);
  }
  mm_walk w = bk_walk(b);
  kvp_mm_key k;
  size_t len;
  while (bk_next(b, &w, &k, &len)) {
    if (h->tagged)
      cb_tag(h, "mm", 3);
    else
      cb_array(h, 2);
    cb_text(h, k.id, len);
    cb_int(h, k.offset);
  }
  if (b->salt) {
    cb_tag(h, "cache_salt", 2);
    cb_text(h, b->salt, b->salt_len);
  }
  if (b->embeds) {
    cb_tag(h, "prompt_embeds", 2);
    cb_bytes(h, b->embeds, 32);
  }
}

static void cbor_block(kvp_hasher *h, const uint8_t *parent,
                       const uint32_t *tok, const bkeys *b) {
  cb_array(h, 3);
  cb_bytes(h, parent, h->dlen);
  cb_tokens(h, tok);
  if (bk_count(b) > 0)
    cbor_extras(h, b);
  else
    cb_null(h);
}

/* ---- pickle (protocol 5), byte for byte as CPython's C pickler ------------
 * vLLM >= 0.33 hashes pickle.dumps(obj, protocol=5) (utils/hashing.py).
 * Only what its block tuples hold: bytes, str, int, None, tuple, written as
 * Modules/_pickle.c does: the smallest opcode per value (save_long,
 * save_bytes, save_unicode, save_tuple); MEMOIZE after every bytes, str and
 * non-empty tuple; BINGET / LONG_BINGET for an object already in the memo,
 * which is by identity (pk_shared says which of our strings are one object
 * in vLLM).  Framing (_Pickler_Write, _Pickler_CommitFrame,
 * _Pickler_OpcodeBoundary, _Pickler_write_bytes): after PROTO 5 a frame is
 * opened by the next write (9 header bytes reserved) and committed -- FRAME
 * + u64le length written into the reserved bytes, or the content moved down
 * over them when shorter than PK_FRAME_MIN -- when a save() starts with
 * >= PK_FRAME_TARGET bytes in the frame, before a bytes/str payload of >=
 * PK_FRAME_TARGET (whose opcode and data are then written outside any
 * frame), and at the end after STOP.  Frames are built in place in h->buf,
 * which holds PK_FRAME_MAX beyond the header, so a frame is never flushed
 * into the digest before its length is known. */
static void pk_raw(kvp_hasher *h, const void *p, size_t n) {
  pk_state *pk = &h->pk;
  if (!pk->framing) {
    sink_put(h, p, n);
    return;
  }
  if (pk->frame == PK_NO_FRAME) {
    if (h->cap - h->pos < PK_FRAME_HDR + PK_FRAME_MAX)
      sink_flush(h);
    pk->frame = h->pos;
    h->pos += PK_FRAME_HDR;
  }
  /* PK_FRAME_MAX bounds every frame; were it wrong, fail the digest rather
   * than write past the buffer */
  assert(h->cap - h->pos >= n);
  if (KVP_UNLIKELY(h->cap - h->pos < n)) {
    h->failed = true;
    return;
  }
  memcpy(h->buf + h->pos, p, n);
  h->pos += n;
}

static void pk_commit(kvp_hasher *h) {
  pk_state *pk = &h->pk;
  if (pk->frame == PK_NO_FRAME)
    return;
  uint8_t *f = h->buf + pk->frame;
  size_t len = h->pos - pk->frame - PK_FRAME_HDR;
  if (len >= PK_FRAME_MIN) {
    f[0] = 0x95; /* FRAME */
    put_u64le(f + 1, len);
  } else {
    memmove(f, f + PK_FRAME_HDR, len);
    h->pos -= PK_FRAME_HDR;
  }
  pk->frame = PK_NO_FRAME;
}

/* Where CPython's save() starts: _Pickler_OpcodeBoundary. */
static void pk_save(kvp_hasher *h) {
  const pk_state *pk = &h->pk;
  if (pk->frame != PK_NO_FRAME &&
      h->pos - pk->frame - PK_FRAME_HDR >= PK_FRAME_TARGET)
    pk_commit(h);
}

static void pk_memoize(kvp_hasher *h) {
  pk_raw(h, "\x94", 1);
  h->pk.memo++;
}

static void pk_get(kvp_hasher *h, uint32_t idx) {
  uint8_t b[5] = {'h', (uint8_t)idx};
  if (idx < 256) {
    pk_raw(h, b, 2);
    return;
  }
  b[0] = 'j'; /* LONG_BINGET */
  put_u32le(b + 1, idx);
  pk_raw(h, b, 5);
}

/* A str / bytes: opcode with a 1-, 4- or 8-byte length, payload, MEMOIZE. */
static void pk_sized(kvp_hasher *h, const uint8_t ops[3], const void *p,
                     size_t n) {
  uint8_t head[9];
  size_t hn;
  if (n <= 0xff) {
    head[0] = ops[0], head[1] = (uint8_t)n, hn = 2;
  } else if (n <= 0xffffffffu) {
    head[0] = ops[1], hn = 5;
    put_u32le(head + 1, (uint32_t)n);
  } else {
    head[0] = ops[2], hn = 9;
    put_u64le(head + 1, n);
  }
  bool bypass = n >= PK_FRAME_TARGET;
  if (bypass) {
    pk_commit(h);
    h->pk.framing = false;
  }
  pk_raw(h, head, hn);
  pk_raw(h, p, n);
  h->pk.framing = true;
  pk_memoize(h);
}

static void pk_bytes(kvp_hasher *h, const uint8_t *p, size_t n) {
  static const uint8_t ops[3] = {'C', 'B', 0x8e}; /* SHORT_BINBYTES... */
  pk_save(h);
  pk_sized(h, ops, p, n);
}

/* The memo slot of a str that is one object wherever it appears in vLLM's
 * tuples, or NULL for a fresh object: the tag literals (code constants) and
 * the str objects CPython caches -- "" and the 256 one-character latin-1
 * strings, which every decode or slice returns (unicode_result()).  vLLM's
 * other strings (names, paths, ids, salts) are distinct objects, even when
 * equal. */
static uint32_t *pk_shared(kvp_hasher *h, const char *s, size_t n, int tag) {
  pk_state *pk = &h->pk;
  const uint8_t *u = (const uint8_t *)s;
  int cp = -1;
  if (tag >= 0)
    return &pk->tag[tag];
  if (n == 0)
    cp = 256;
  else if (n == 1)
    cp = u[0]; /* ASCII: valid UTF-8 */
  else if (n == 2 && (u[0] == 0xc2 || u[0] == 0xc3))
    cp = (u[0] & 0x1f) << 6 | (u[1] & 0x3f); /* U+0080..U+00FF */
  if (cp < 0)
    return NULL;
  pk_slot *sl = &pk->single[cp];
  if (sl->gen != pk->gen)
    *sl = (pk_slot){pk->gen, PK_NO_MEMO};
  return &sl->idx;
}

/* A str (valid UTF-8: CPython's encoding of it); tag: PK_TAG_* or -1. */
static void pk_str(kvp_hasher *h, const char *s, size_t n, int tag) {
  static const uint8_t ops[3] = {0x8c, 'X', 0x8d}; /* SHORT_BINUNICODE... */
  pk_save(h);
  uint32_t *slot = pk_shared(h, s, n, tag);
  if (slot != NULL && *slot != PK_NO_MEMO) {
    pk_get(h, *slot);
    return;
  }
  pk_sized(h, ops, s, n);
  if (slot != NULL)
    *slot = h->pk.memo - 1;
}

static void pk_none(kvp_hasher *h) {
  pk_save(h);
  pk_raw(h, "N", 1);
}

/* save_long: BININT1 / BININT2 / BININT for what fits a signed 32-bit int,
 * else LONG1 with the shortest little-endian two's complement. */
static size_t pk_put_int(uint8_t *q, int64_t v) {
  if (v >= 0 && v <= 0xff) {
    q[0] = 'K', q[1] = (uint8_t)v;
    return 2;
  }
  if (v >= 0 && v <= 0xffff) {
    q[0] = 'M', q[1] = (uint8_t)v, q[2] = (uint8_t)(v >> 8);
    return 3;
  }
  if (v >= INT32_MIN && v <= INT32_MAX) {
    q[0] = 'J';
    put_u32le(q + 1, (uint32_t)v);
    return 5;
  }
  uint8_t *b = q + 2;
  size_t n = 8;
  put_u64le(b, (uint64_t)v);
  /* drop top bytes that only repeat the sign of the one below */
  while (n > 1 && ((b[n - 1] == 0x00 && !(b[n - 2] & 0x80)) ||
                   (b[n - 1] == 0xff && (b[n - 2] & 0x80))))
    n--;
  q[0] = 0x8a, q[1] = (uint8_t)n; /* LONG1 */
  return 2 + n;
}

static void pk_int(kvp_hasher *h, int64_t v) {
  uint8_t b[10];
  pk_save(h);
  pk_raw(h, b, pk_put_int(b, v));
}

static void pk_tuple_open(kvp_hasher *h, size_t n) {
  pk_save(h);
  if (n == 0)
    pk_raw(h, ")", 1); /* EMPTY_TUPLE: not memoized */
  else if (n > 3)
    pk_raw(h, "(", 1); /* MARK */
}

static void pk_tuple_close(kvp_hasher *h, size_t n) {
  uint8_t op = n <= 3 ? (uint8_t)(0x84 + n) : 't'; /* TUPLE1..3, TUPLE */
  if (n == 0)
    return;
  pk_raw(h, &op, 1);
  pk_memoize(h);
}

/* The token tuple in one go: no save() among the tokens can commit a frame,
 * as the frame holds only the parent's ~40 bytes before them and 4096
 * tokens of at most 7 bytes stay below PK_FRAME_TARGET. */
static void pk_tokens(kvp_hasher *h, const uint32_t *tok) {
  const size_t bs = h->block_size;
  static_assert(KVP_BLOCK_SIZE_MAX * 7 + 64 < PK_FRAME_TARGET,
                "the token tuple fits one frame below its target");
  pk_tuple_open(h, bs);
  pk_raw(h, "", 0); /* open the frame if the MARK did not */
  assert(h->pk.frame != PK_NO_FRAME &&
         h->pos - h->pk.frame - PK_FRAME_HDR < 64);
  assert(h->cap - h->pos >= bs * 7);
  uint8_t *q = h->buf + h->pos, *p = q;
  for (size_t i = 0; i < bs; i++)
    q += pk_put_int(q, tok[i]);
  h->pos += (size_t)(q - p);
  pk_tuple_close(h, bs);
}

static void pk_begin(kvp_hasher *h) {
  pk_state *pk = &h->pk;
  pk->frame = PK_NO_FRAME;
  pk->framing = false;
  pk->memo = 0;
  for (int t = 0; t < PK_N_TAGS; t++)
    pk->tag[t] = PK_NO_MEMO;
  if (++pk->gen == 0) { /* slots of 2^32 pickles ago would look current */
    memset(pk->single, 0, sizeof pk->single);
    pk->gen = 1;
  }
  pk_raw(h, "\x80\x05", 2); /* PROTO 5, outside any frame */
  pk->framing = true;
}

static void pk_end(kvp_hasher *h) {
  pk_raw(h, ".", 1); /* STOP */
  pk_commit(h);
}

static void pk_tagstr(kvp_hasher *h, int tag) {
  static const char *const names[PK_N_TAGS] = {"lora", "mm", "cache_salt",
                                               "prompt_embeds"};
  pk_str(h, names[tag], strlen(names[tag]), tag);
}

/* Untagged (before 0.33): name, (id, offset)..., salt, digest; 0.33:
 * ("lora", name, path), ("mm", id, offset)..., ("cache_salt", salt),
 * ("prompt_embeds", digest). */
static void pickle_extras(kvp_hasher *h, const bkeys *b) {
  const bool t = h->tagged;
  size_t n = bk_count(b), len;
  pk_tuple_open(h, n);
  if (b->lora) {
    if (t)
      pk_tuple_open(h, 3), pk_tagstr(h, PK_TAG_LORA);
    pk_str(h, b->lora, b->lora_len, -1);
    if (t)
      pk_str(h, b->path, b->path_len, -1), pk_tuple_close(h, 3);
  }
  mm_walk w = bk_walk(b);
  kvp_mm_key k;
  while (bk_next(b, &w, &k, &len)) {
    pk_tuple_open(h, t ? 3 : 2);
    if (t)
      pk_tagstr(h, PK_TAG_MM);
    pk_str(h, k.id, len, -1);
    pk_int(h, k.offset);
    pk_tuple_close(h, t ? 3 : 2);
  }
  if (b->salt) {
    if (t)
      pk_tuple_open(h, 2), pk_tagstr(h, PK_TAG_SALT);
    pk_str(h, b->salt, b->salt_len, -1);
    if (t)
      pk_tuple_close(h, 2);
  }
  if (b->embeds) {
    if (t)
      pk_tuple_open(h, 2), pk_tagstr(h, PK_TAG_EMBEDS);
    pk_bytes(h, b->embeds, 32);
    if (t)
      pk_tuple_close(h, 2);
  }
  pk_tuple_close(h, n);
}

static void pickle_block(kvp_hasher *h, const uint8_t *parent,
                         const uint32_t *tok, const bkeys *b) {
  pk_begin(h);
  pk_tuple_open(h, 3);
  pk_bytes(h, parent, h->dlen);
  pk_tokens(h, tok);
  if (bk_count(b) > 0)
    pickle_extras(h, b);
  else
    pk_none(h);
  pk_tuple_close(h, 3);
  pk_end(h);
}

/* ---- blocks -------------------------------------------------------------- */
/* The digest of one block into d (dlen bytes); parent as the algorithm
 * chains it (16-byte key or full vLLM digest). */
static int digest_block(kvp_hasher *h, const uint8_t *parent,
                        const uint32_t *tok, const bkeys *b, uint8_t *d) {
  sink_begin(h);
  if (algo_pickle(h->algo))
    pickle_block(h, parent, tok, b);
  else if (algo_cbor(h->algo))
    cbor_block(h, parent, tok, b);
  else
    native_block(h, parent, tok, b);
  return sink_final(h, d);
}

static int hash_block(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tok,
                      const kvp__xview *x, kvp_key *key, uint8_t *digest) {
  bkeys b;
  size_t mm_after;
  uint8_t d[KVP__DIGEST_MAX];
  plan_block(x, cur, h->block_size, h->r033, &b, &mm_after);
  int rc = digest_block(h, cur->parent, tok, &b, d);
  if (rc < 0)
    return rc;
  *key = key_from(d + h->dlen - 16);
  if (digest != NULL)
    memcpy(digest, d, h->dlen);
  /* vLLM chains the full digest; native modes the 16-byte key */
  if (algo_vllm(h->algo))
    memcpy(cur->parent, d, h->dlen);
  else
    memcpy(cur->parent, d + h->dlen - 16, 16);
  cur->start = b.end;
  cur->mm_idx = mm_after;
  return 0;
}

/* True when every block from `start` on has no extra keys under XXH3-128:
 * no lora, no embeddings, salt only on block 0, and past the last
 * placeholder (every algorithm: the rule of its vllm_compat). */
static bool plain_from(const kvp_hasher *h, const kvp__xview *x,
                       uint64_t start) {
  if (h->algo != KVP_HASH_XXH3_128 || x->lora_len > 0 || x->embeds != NULL)
    return false;
  if (x->salt_len > 0 && start == 0)
    return false;
  return x->n_mm == 0 || mm_passed(&x->mm[x->n_mm - 1], start, false);
}

/* The hot path: one XXH3 call per block over parent || tokens in scratch.
 * Always inlined into callers with a constant bs, so that the 16-token case
 * copies and hashes a compile-time 80 bytes (measured: ~2x faster). */
static inline __attribute__((always_inline)) void
xxh3_run(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tok, size_t n,
         kvp_key *keys, uint8_t *digests, const uint32_t bs) {
  const size_t len = 16 + (size_t)bs * 4;
  uint8_t *buf = h->buf;
  memcpy(buf, cur->parent, 16);
  for (size_t i = 0; i < n; i++) {
    put_tokens_le(buf + 16, tok + i * bs, bs);
    XXH128_hash_t r = XXH3_128bits(buf, len);
    keys[i] = (kvp_key){r.high64, r.low64};
    key_bytes(keys[i], buf);
    if (digests != NULL)
      memcpy(digests + 16 * i, buf, 16);
  }
  memcpy(cur->parent, buf, 16);
  cur->start += (uint64_t)n * bs;
}

/* XXH3_128bits(parent || 64 token bytes), bit-exact with XXH3's 17..128-byte
 * path for len 80, read from two places: the parent from registers, the
 * tokens from the caller's array (no copy, no store-to-load of the key). */
static inline XXH128_hash_t xxh3_80(const uint8_t par[16], const uint8_t *tk) {
  const uint8_t *sec = XXH3_kSecret;
  XXH128_hash_t acc = {80 * XXH_PRIME64_1, 0};
  acc = XXH128_mix32B(acc, tk + 16, tk + 16, sec + 64, 0);
  acc = XXH128_mix32B(acc, tk, tk + 32, sec + 32, 0);
  acc = XXH128_mix32B(acc, par, tk + 48, sec, 0);
  XXH128_hash_t r;
  r.low64 = XXH3_avalanche(acc.low64 + acc.high64);
  r.high64 = 0 - XXH3_avalanche(acc.low64 * XXH_PRIME64_1 +
                                acc.high64 * XXH_PRIME64_4 + 80 * XXH_PRIME64_2);
  return r;
}

/* xxh3_80 re-expresses xxHash internals (XXH128_mix32B, XXH3_avalanche,
 * the default secret): verify it against the library's own XXH3_128bits at
 * create, so a different xxHash release degrades to the generic path instead
 * of changing keys. */
static bool xxh3_80_selftest(void) {
  uint8_t in[80];
  for (unsigned i = 0; i < sizeof in; i++)
    in[i] = (uint8_t)(i * 151u + 7u);
  XXH128_hash_t want = XXH3_128bits(in, sizeof in);
  XXH128_hash_t got = xxh3_80(in, in + 16);
  return want.low64 == got.low64 && want.high64 == got.high64;
}

static void xxh3_run16(kvp__cursor *cur, const uint32_t *tok, size_t n,
                       kvp_key *keys, uint8_t *digests) {
  kvp_key k = key_from(cur->parent);
  for (size_t i = 0; i < n; i++) {
    uint8_t par[16];
    key_bytes(k, par);
    XXH128_hash_t r = xxh3_80(par, (const uint8_t *)(tok + i * 16));
    k = (kvp_key){r.high64, r.low64};
    keys[i] = k;
    if (digests != NULL)
      key_bytes(k, digests + 16 * i);
  }
  key_bytes(k, cur->parent);
  cur->start += (uint64_t)n * 16;
}

__attribute__((flatten)) static void xxh3_plain(kvp_hasher *h, kvp__cursor *cur,
                                                const uint32_t *tok, size_t n,
                                                kvp_key *keys,
                                                uint8_t *digests) {
  if (h->fast16)
    xxh3_run16(cur, tok, n, keys, digests);
  else if (h->block_size == 16)
    xxh3_run(h, cur, tok, n, keys, digests, 16);
  else
    xxh3_run(h, cur, tok, n, keys, digests, h->block_size);
}


void kvp__cursor_init(const kvp_hasher *h, kvp__cursor *cur) {
  *cur = (kvp__cursor){0};
  memcpy(cur->parent, h->root, KVP__DIGEST_MAX);
}

int kvp__hash_blocks(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tokens,
                     size_t n_blocks, const kvp__xview *x, kvp_key *keys,
                     uint8_t *digests) {
  const size_t bs = h->block_size;
  for (size_t i = 0; i < n_blocks; i++) {
    uint8_t *d = digests != NULL ? digests + i * h->dlen : NULL;
    if (plain_from(h, x, cur->start)) {
      xxh3_plain(h, cur, tokens + i * bs, n_blocks - i, keys + i, d);
      return 0;
    }
    int rc = hash_block(h, cur, tokens + i * bs, x, &keys[i], d);
    if (rc < 0)
      return rc;
  }
  return 0;
}


kvp_key kvp__chunk_key(kvp_key fine, uint32_t chunk_tokens) {
  uint8_t b[16 + 4 + sizeof KVP__CHUNK_TAG - 1];
  key_bytes(fine, b);
  put_u32le(b + 16, chunk_tokens);
  memcpy(b + 20, KVP__CHUNK_TAG, sizeof KVP__CHUNK_TAG - 1);
  XXH128_hash_t r = XXH3_128bits(b, sizeof b);
  return (kvp_key){r.high64, r.low64};
}


/* ---- hasher lifetime ----------------------------------------------------- */
/* The seed NONE_HASH is derived from, as vLLM's init_none_hash resolves it;
 * NULL (logged) where vLLM would draw random bytes nobody can reproduce. */
static const char *none_hash_seed(const kvp_hasher_opts *o,
                                  kvp_vllm_compat compat) {
  if (o->python_hash_seed != NULL)
    return o->python_hash_seed;
  if (compat == KVP_VLLM_COMPAT_0_33 && algo_sha(o->algo))
    return VLLM_DEFAULT_SEED;
  if (compat == KVP_VLLM_COMPAT_0_33)
    KVP_LOGW(LOG_MOD,
             "hasher: %s needs python_hash_seed: without PYTHONHASHSEED "
             "vLLM seeds it with random per-process bytes, which nobody "
             "can reproduce",
             algo_names[o->algo]);
  else
    KVP_LOGW(LOG_MOD,
             "hasher: %s before vLLM 0.33 needs python_hash_seed (vLLM's "
             "PYTHONHASHSEED; without it NONE_HASH is random)",
             algo_names[o->algo]);
  return NULL;
}

static int hasher_check(const kvp_namespace *ns, const kvp_hasher_opts *o,
                        kvp_vllm_compat *compat, const char **seed) {
  if (!algo_valid(o->algo)) {
    KVP_LOGW(LOG_MOD, "hasher: unknown algo %d", (int)o->algo);
    return KVP_EINVAL;
  }
  if (o->vllm_compat >= KVP_VLLM_COMPAT_COUNT_) {
    KVP_LOGW(LOG_MOD, "hasher: unknown vllm_compat %" PRIu32, o->vllm_compat);
    return KVP_EINVAL;
  }
  if (ns->block_size == 0 || ns->block_size > KVP_BLOCK_SIZE_MAX) {
    KVP_LOGW(LOG_MOD,
             "hasher: namespace block_size %" PRIu32
             " not in 1..%u (use kvp_namespace_init)",
             ns->block_size, KVP_BLOCK_SIZE_MAX);
    return KVP_EINVAL;
  }
  *compat = o->vllm_compat == KVP_VLLM_COMPAT_LATEST
                ? KVP_VLLM_COMPAT_0_33
                : (kvp_vllm_compat)o->vllm_compat;
  *seed = NULL;
  if (!algo_vllm(o->algo))
    return 0;
  *seed = none_hash_seed(o, *compat);
  if (*seed == NULL)
    return KVP_EINVAL;
  size_t len;
  return check_string("hasher", "python_hash_seed", *seed, &len);
}

static void backend_free(kvp_hasher *h) {
  EVP_MD_CTX_free(h->md_ctx);
  EVP_MD_free(h->md);
  kvp__free(&h->alloc, h->xxh_mem, sizeof(XXH3_state_t) + 63);
  h->md_ctx = NULL;
  h->md = NULL;
  h->xxh_mem = NULL;
}

static int backend_init(kvp_hasher *h) {
  if (algo_sha(h->algo)) {
    h->md = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (h->md == NULL) {
      KVP_LOGE(LOG_MOD, "hasher: OpenSSL has no SHA256 in this context");
      return KVP_ENOTSUP;
    }
    h->md_ctx = EVP_MD_CTX_new();
    return h->md_ctx != NULL ? 0 : KVP_ENOMEM; /* caller frees md */
  }
  /* XXH3_state_t wants 64-byte alignment; the allocator promises 16 */
  h->xxh_mem = kvp__malloc(&h->alloc, sizeof(XXH3_state_t) + 63);
  if (h->xxh_mem == NULL)
    return KVP_ENOMEM;
  h->xxh = (XXH3_state_t *)(((uintptr_t)h->xxh_mem + 63) & ~(uintptr_t)63);
  XXH3_INITSTATE(h->xxh);
  return 0;
}

/* vLLM's NONE_HASH = hash_fn(seed): the seed str serialized as the mode
 * serializes everything. */
static void seed_encode(kvp_hasher *h, const char *seed) {
  size_t len = strlen(seed);
  if (algo_pickle(h->algo)) {
    pk_begin(h);
    pk_str(h, seed, len, -1);
    pk_end(h);
  } else {
    cb_text(h, seed, len);
  }
}

static int root_init(kvp_hasher *h, const kvp_namespace *ns, const char *seed) {
  if (!algo_vllm(h->algo)) {
    key_bytes(ns->seed, h->root);
    return 0;
  }
  sink_begin(h);
  seed_encode(h, seed);
  return sink_final(h, h->root);
}

/* Scratch: the largest block encoding that hashes in one call; a pickle
 * mode's also holds a whole frame (PK_FRAME_MAX) after PROTO. */
static size_t scratch_size(kvp_hash_algo algo, uint32_t bs) {
  if (algo_pickle(algo))
    return PK_FRAME_HDR + PK_FRAME_MAX + 64;
  return 64 + (size_t)bs * 5 + SCRATCH_SLACK;
}

int kvp_hasher_create(const kvp_namespace *ns, const kvp_hasher_opts *opts,
                      const kvp_allocator *alloc, kvp_hasher **out) {
  if (out != NULL)
    *out = NULL;
  if (ns == NULL || out == NULL) {
    KVP_LOGW(LOG_MOD, "hasher: NULL argument");
    return KVP_EINVAL;
  }
  kvp_hasher_opts o = opts != NULL ? *opts : (kvp_hasher_opts){0};
  kvp_vllm_compat compat;
  const char *seed;
  int rc = hasher_check(ns, &o, &compat, &seed);
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_hasher *h = kvp__calloc(&a, 1, sizeof *h);
  if (h == NULL)
    return KVP_ENOMEM;
  bool v033 = algo_vllm(o.algo) && compat == KVP_VLLM_COMPAT_0_33;
  *h = (kvp_hasher){.alloc = a,
                    .algo = o.algo,
                    .compat = compat,
                    .r033 = compat == KVP_VLLM_COMPAT_0_33,
                    .tagged = v033,
                    .block_size = ns->block_size,
                    .dlen = kvp_hash_algo_digest_len(o.algo),
                    .cap = scratch_size(o.algo, ns->block_size)};
  rc = KVP_ENOMEM;
  h->buf = kvp__malloc(&a, h->cap);
  if (h->buf == NULL)
    goto fail_hasher;
  rc = backend_init(h);
  if (rc < 0)
    goto fail_backend;
  rc = root_init(h, ns, seed);
  if (rc < 0)
    goto fail_backend;
  if (h->algo == KVP_HASH_XXH3_128 && h->block_size == 16 && host_le) {
    h->fast16 = xxh3_80_selftest();
    if (!h->fast16)
      KVP_LOGW(LOG_MOD, "xxh3 fast path disagrees with this xxHash build; "
               "using the generic path (same keys, slower)");
  }
  *out = h;
  return 0;
fail_backend:
  backend_free(h);
  kvp__free(&a, h->buf, h->cap);
fail_hasher:
  kvp__free(&a, h, sizeof *h);
  return rc;
}

void kvp_hasher_destroy(kvp_hasher *h) {
  if (h == NULL)
    return;
  kvp_allocator a = h->alloc;
  backend_free(h);
  kvp__free(&a, h->buf, h->cap);
  kvp__free(&a, h, sizeof *h);
}

kvp_hash_algo kvp_hasher_algo(const kvp_hasher *h) {
  return h != NULL ? h->algo : KVP_HASH_XXH3_128;
}

uint32_t kvp_hasher_block_size(const kvp_hasher *h) {
  return h != NULL ? h->block_size : 0;
}

int kvp_hasher_hash(kvp_hasher *h, const uint32_t *tokens, size_t n,
                    const kvp_extras *extras, kvp_key *keys, size_t cap,
                    size_t *tail) {
  if (h == NULL || (n > 0 && tokens == NULL) || (cap > 0 && keys == NULL)) {
    KVP_LOGW(LOG_MOD, "hasher_hash: NULL %s",
             h == NULL                 ? "hasher"
             : n > 0 && tokens == NULL ? "tokens"
                                       : "keys");
    return KVP_EINVAL;
  }
  kvp__xview x;
  int rc = kvp__xview_init(extras, &x);
  if (rc < 0)
    return rc;
  size_t nb = n / h->block_size, todo = nb < cap ? nb : cap;
  if (nb > INT_MAX) {
    KVP_LOGW(LOG_MOD, "hasher_hash: %zu blocks do not fit the int result", nb);
    return KVP_ERANGE;
  }
  rc = kvp__embeds_cover(&x, 0, todo);
  if (rc < 0)
    return rc;
  kvp__cursor cur;
  kvp__cursor_init(h, &cur);
  rc = kvp__hash_blocks(h, &cur, tokens, todo, &x, keys, NULL);
  if (rc < 0)
    return rc;
  if (tail != NULL)
    *tail = n % h->block_size;
  return (int)nb;
}

/* The parent kvp_hasher_block chains from, as the algorithm uses it. */
static int block_parent(const kvp_hasher *h, const uint8_t *parent,
                        size_t parent_len, const uint8_t **out) {
  if (parent == NULL) {
    *out = h->root;
    return 0;
  }
  /* native sha256: its 16-byte key or the 32-byte digest ending with it */
  bool native_key = !algo_vllm(h->algo) && parent_len == 16;
  if (parent_len != h->dlen && !native_key) {
    KVP_LOGW(LOG_MOD, "hasher_block: parent_len %zu, %s digests are %zu bytes",
             parent_len, algo_names[h->algo], h->dlen);
    return KVP_EINVAL;
  }
  *out = algo_vllm(h->algo) ? parent : parent + parent_len - 16;
  return 0;
}

int kvp_hasher_block(kvp_hasher *h, const uint8_t *parent, size_t parent_len,
                     const uint32_t *tokens, const kvp_block_extras *bx,
                     uint8_t *digest, size_t cap, kvp_key *key) {
  if (h == NULL || tokens == NULL) {
    KVP_LOGW(LOG_MOD, "hasher_block: NULL %s", h == NULL ? "hasher" : "tokens");
    return KVP_EINVAL;
  }
  const uint8_t *par;
  bkeys b;
  int rc = block_parent(h, parent, parent_len, &par);
  if (rc == 0)
    rc = bkeys_given(bx, &b);
  if (rc < 0)
    return rc;
  if (digest != NULL && cap < h->dlen)
    return KVP_ENOSPC;
  uint8_t d[KVP__DIGEST_MAX];
  rc = digest_block(h, par, tokens, &b, d);
  if (rc < 0)
    return rc;
  if (digest != NULL)
    memcpy(digest, d, h->dlen);
  if (key != NULL)
    *key = key_from(d + h->dlen - 16);
  return (int)h->dlen;
}

/* bkeys -> the public per-block form, mm keys into mm[0..n_mm). */
static void bkeys_export(const bkeys *b, const kvp_extras *e,
                         kvp_block_extras *out, kvp_mm_key *mm) {
  mm_walk w = bk_walk(b);
  kvp_mm_key k;
  size_t i = 0, len;
  while (bk_next(b, &w, &k, &len))
    mm[i++] = k;
  *out = (kvp_block_extras){.lora_name = b->lora,
                            .lora_path = e != NULL ? e->lora_path : NULL,
                            .mm = b->n_mm > 0 ? mm : NULL,
                            .n_mm = b->n_mm,
                            .cache_salt = b->salt,
                            .prompt_embeds = b->embeds};
}

int kvp_hasher_block_extras(const kvp_hasher *h, const kvp_extras *extras,
                            size_t block, kvp_block_extras *out,
                            kvp_mm_key *mm, size_t mm_cap) {
  if (h == NULL || out == NULL || (mm_cap > 0 && mm == NULL)) {
    KVP_LOGW(LOG_MOD, "hasher_block_extras: NULL %s",
             h == NULL ? "hasher" : out == NULL ? "out" : "mm");
    return KVP_EINVAL;
  }
  kvp__xview x;
  int rc = kvp__xview_init(extras, &x);
  if (rc == 0)
    rc = kvp__embeds_cover(&x, block, 1);
  if (rc < 0)
    return rc;
  const uint32_t bs = h->block_size;
  if (block > (UINT64_MAX - bs) / bs) {
    KVP_LOGW(LOG_MOD, "hasher_block_extras: block %zu is past any prompt",
             block);
    return KVP_EINVAL;
  }
  kvp__cursor cur = {0};
  bkeys b;
  size_t mm_after;
  /* The walk's only state is curr_mm_idx = k.  It cannot move before the
   * block that holds the end of placeholder k (earlier blocks end before
   * it, so neither pass it nor contain its end), nor at all once k is past
   * the last one or the last one is passed (vLLM's early exit): jump there,
   * O(placeholders) steps, not O(blocks). */
  for (size_t i = 0; i < block;) {
    if (cur.mm_idx >= x.n_mm ||
        mm_passed(&x.mm[x.n_mm - 1], cur.start, h->r033))
      break;
    uint64_t e = mm_end(&x.mm[cur.mm_idx]), j = e > 0 ? (e - 1) / bs : 0;
    if (j > i) {
      i = j < block ? (size_t)j : block;
      cur.start = (uint64_t)i * bs;
      continue;
    }
    plan_block(&x, &cur, bs, h->r033, &b, &mm_after);
    cur.start = b.end;
    cur.mm_idx = mm_after;
    i++;
  }
  cur.start = (uint64_t)block * bs;
  plan_block(&x, &cur, bs, h->r033, &b, &mm_after);
  if (b.n_mm > INT_MAX)
    return KVP_ERANGE;
  if (b.n_mm <= mm_cap)
    bkeys_export(&b, extras, out, mm);
  return (int)b.n_mm;
}

/* ---- for tests ------------------------------------------------------------ */
int kvp__hasher_block_bytes(kvp_hasher *h, const uint8_t *parent,
                            size_t parent_len, const uint32_t *tokens,
                            const kvp_block_extras *bx, uint8_t *buf,
                            size_t cap, size_t *len) {
  h->tap = buf, h->tap_cap = cap, h->tap_len = 0;
  int rc = kvp_hasher_block(h, parent, parent_len, tokens, bx, NULL, 0, NULL);
  *len = h->tap_len;
  h->tap = NULL;
  return rc >= 0 && *len > cap ? KVP_ENOSPC : rc;
}

int kvp__hasher_seed_bytes(kvp_hasher *h, const char *seed, uint8_t *buf,
                           size_t cap, size_t *len) {
  uint8_t d[KVP__DIGEST_MAX];
  if (!algo_vllm(h->algo))
    return KVP_EINVAL;
  h->tap = buf, h->tap_cap = cap, h->tap_len = 0;
  sink_begin(h);
  seed_encode(h, seed);
  int rc = sink_final(h, d);
  *len = h->tap_len;
  h->tap = NULL;
  return rc >= 0 && *len > cap ? KVP_ENOSPC : rc;
}

size_t kvp__hasher_root(const kvp_hasher *h, uint8_t out[KVP__DIGEST_MAX]) {
  size_t n = algo_vllm(h->algo) ? h->dlen : 16;
  memcpy(out, h->root, n);
  return n;
}

/* ---- chain --------------------------------------------------------------- */
typedef struct chunk_track {
  uint32_t tokens; /* granularity */
  uint32_t per;    /* blocks per chunk */
  kvp_key *keys;
  size_t n, cap;
} chunk_track;

struct kvp_chain {
  kvp_allocator alloc;
  kvp_hasher *h;
  kvp__xview x; /* points into xmem */
  void *xmem;
  size_t xmem_size;
  kvp__cursor cur;
  uint32_t *tail; /* block_size tokens of room */
  size_t n_tail, n_tokens;
  kvp_key *keys;
  size_t n_keys, cap_keys;
  uint8_t *digests; /* cap_digests blocks of dlen bytes */
  size_t cap_digests;
  bool keep_digests;
  chunk_track chunk[N_CHUNKS];
  size_t n_chunk;
};

/* So that accessors never return NULL for a live chain. */
static const kvp_key no_keys[1];

static int chunks_check(const kvp_chain_opts *o, uint32_t bs, size_t *n) {
  for (*n = 0; *n < N_CHUNKS && o->chunk_tokens[*n] != 0; (*n)++) {
    uint32_t g = o->chunk_tokens[*n];
    if (g % bs != 0) {
      KVP_LOGW(LOG_MOD,
               "chain: chunk_tokens[%zu] = %" PRIu32
               " is not a multiple of block_size %" PRIu32,
               *n, g, bs);
      return KVP_EINVAL;
    }
    for (size_t j = 0; j < *n; j++)
      if (o->chunk_tokens[j] == g) {
        KVP_LOGW(LOG_MOD, "chain: chunk_tokens %" PRIu32 " asked twice", g);
        return KVP_EINVAL;
      }
  }
  return 0;
}

static char *copy_str(char **dst, const char *s, size_t len) {
  char *p = *dst;
  if (len > 0)
    memcpy(p, s, len);
  p[len] = '\0';
  *dst += len + 1;
  return p;
}

/* One allocation: mm spans, embeddings digests, then every string
 * NUL-terminated. */
static int xview_copy(kvp_chain *c, const kvp__xview *src) {
  size_t sz, emb;
  if (!kvp__mul_ok(src->n_mm, sizeof(kvp_mm_span), &sz) ||
      !kvp__mul_ok(src->n_embeds, 32, &emb) ||
      __builtin_add_overflow(sz, emb, &sz))
    return KVP_ENOMEM;
  sz += src->lora_len + 1 + src->path_len + 1 + src->salt_len + 1;
  for (size_t i = 0; i < src->n_mm; i++)
    sz += strlen(src->mm[i].id) + 1;
  c->xmem = kvp__malloc(&c->alloc, sz);
  if (c->xmem == NULL)
    return KVP_ENOMEM;
  c->xmem_size = sz;
  kvp_mm_span *mm = c->xmem;
  uint8_t(*embeds)[32] = (uint8_t(*)[32])(mm + src->n_mm);
  char *s = (char *)(embeds + src->n_embeds);
  if (emb > 0)
    memcpy(embeds, src->embeds, emb);
  for (size_t i = 0; i < src->n_mm; i++) {
    mm[i] = src->mm[i];
    mm[i].id = copy_str(&s, src->mm[i].id, strlen(src->mm[i].id));
  }
  c->x = (kvp__xview){.lora = copy_str(&s, src->lora, src->lora_len),
                      .lora_len = src->lora_len,
                      .path = copy_str(&s, src->path, src->path_len),
                      .path_len = src->path_len,
                      .salt = copy_str(&s, src->salt, src->salt_len),
                      .salt_len = src->salt_len,
                      .mm = mm,
                      .n_mm = src->n_mm,
                      .embeds = src->embeds != NULL ? embeds : NULL,
                      .n_embeds = src->n_embeds};
  return 0;
}

int kvp_chain_create(kvp_hasher *h, const kvp_chain_opts *opts,
                     const kvp_extras *extras, const kvp_allocator *alloc,
                     kvp_chain **out) {
  if (out != NULL)
    *out = NULL;
  if (h == NULL || out == NULL) {
    KVP_LOGW(LOG_MOD, "chain: NULL argument");
    return KVP_EINVAL;
  }
  kvp_chain_opts o = opts != NULL ? *opts : (kvp_chain_opts){0};
  kvp__xview x;
  size_t n_chunk = 0;
  int rc = kvp__xview_init(extras, &x);
  if (rc == 0)
    rc = chunks_check(&o, h->block_size, &n_chunk);
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_chain *c = kvp__calloc(&a, 1, sizeof *c);
  if (c == NULL)
    return KVP_ENOMEM;
  *c = (kvp_chain){.alloc = a,
                   .h = h,
                   .keep_digests = o.keep_digests != 0,
                   .n_chunk = n_chunk};
  for (size_t i = 0; i < n_chunk; i++)
    c->chunk[i] = (chunk_track){.tokens = o.chunk_tokens[i],
                                .per = o.chunk_tokens[i] / h->block_size};
  rc = KVP_ENOMEM;
  c->tail = kvp__malloc(&a, (size_t)h->block_size * sizeof *c->tail);
  if (c->tail == NULL)
    goto fail_chain;
  rc = xview_copy(c, &x);
  if (rc < 0)
    goto fail_tail;
  kvp__cursor_init(h, &c->cur);
  *out = c;
  return 0;
fail_tail:
  kvp__free(&a, c->tail, (size_t)h->block_size * sizeof *c->tail);
fail_chain:
  kvp__free(&a, c, sizeof *c);
  return rc;
}

void kvp_chain_destroy(kvp_chain *c) {
  if (c == NULL)
    return;
  kvp_allocator a = c->alloc;
  for (size_t i = 0; i < c->n_chunk; i++)
    kvp__free(&a, c->chunk[i].keys, c->chunk[i].cap * sizeof(kvp_key));
  kvp__free(&a, c->digests, c->cap_digests * c->h->dlen);
  kvp__free(&a, c->keys, c->cap_keys * sizeof(kvp_key));
  kvp__free(&a, c->xmem, c->xmem_size);
  kvp__free(&a, c->tail, (size_t)c->h->block_size * sizeof *c->tail);
  kvp__free(&a, c, sizeof *c);
}

/* Makes array p of *cap elements of `elem` bytes hold `need`, growing it
 * geometrically; *out receives the array to use.  On failure p is untouched
 * (and still owned by the caller). */
static int reserve(const kvp_allocator *a, void *p, size_t *cap, size_t need,
                   size_t elem, void **out) {
  *out = p;
  if (need <= *cap)
    return 0;
  size_t nc = *cap < 16 ? 16 : *cap, bytes;
  while (nc < need)
    nc = nc > SIZE_MAX / 2 ? need : nc * 2;
  if (!kvp__mul_ok(nc, elem, &bytes))
    return KVP_ENOMEM;
  void *q = kvp__realloc(a, p, *cap * elem, bytes);
  if (q == NULL)
    return KVP_ENOMEM;
  *cap = nc;
  *out = q;
  return 0;
}

/* Room for nb more blocks everywhere, before anything is hashed, so extend
 * cannot fail half way.  Capacity grown here is kept on a later failure. */
static int chain_reserve(kvp_chain *c, size_t nb) {
  const kvp_allocator *a = &c->alloc;
  size_t need = c->n_keys + nb;
  void *p;
  if (reserve(a, c->keys, &c->cap_keys, need, sizeof(kvp_key), &p) < 0)
    return KVP_ENOMEM;
  c->keys = p;
  if (c->keep_digests) {
    if (reserve(a, c->digests, &c->cap_digests, need, c->h->dlen, &p) < 0)
      return KVP_ENOMEM;
    c->digests = p;
  }
  for (size_t i = 0; i < c->n_chunk; i++) {
    chunk_track *t = &c->chunk[i];
    if (reserve(a, t->keys, &t->cap, need / t->per, sizeof(kvp_key), &p) < 0)
      return KVP_ENOMEM;
    t->keys = p;
  }
  return 0;
}

static void chunks_update(kvp_chain *c) {
  for (size_t i = 0; i < c->n_chunk; i++) {
    chunk_track *t = &c->chunk[i];
    for (; (t->n + 1) * t->per <= c->n_keys; t->n++)
      t->keys[t->n] =
          kvp__chunk_key(c->keys[(t->n + 1) * t->per - 1], t->tokens);
  }
}

/* Hashes nb > 0 blocks of tail ++ tokens into the slots after n_keys (room
 * reserved), from a copy of the cursor; *used receives how many of `tokens`
 * went into blocks.  Only tail[n_tail..] is written, so on failure the chain
 * is as it was. */
static int chain_hash(kvp_chain *c, kvp__cursor *cur, const uint32_t *tokens,
                      size_t nb, size_t *used) {
  const size_t bs = c->h->block_size, dlen = c->h->dlen;
  size_t done = 0;
  assert(nb > 0);
  *used = 0;
  if (c->n_tail > 0) {
    *used = bs - c->n_tail;
    memcpy(c->tail + c->n_tail, tokens, *used * sizeof *tokens);
    done = 1;
  }
  uint8_t *d = c->keep_digests ? c->digests + c->n_keys * dlen : NULL;
  int rc = done ? kvp__hash_blocks(c->h, cur, c->tail, 1, &c->x,
                                   c->keys + c->n_keys, d)
                : 0;
  if (rc == 0 && nb > done)
    rc = kvp__hash_blocks(c->h, cur, tokens + *used, nb - done, &c->x,
                          c->keys + c->n_keys + done,
                          d ? d + done * dlen : NULL);
  *used += (nb - done) * bs;
  return rc;
}

int kvp_chain_extend(kvp_chain *c, const uint32_t *tokens, size_t n) {
  if (c == NULL || (n > 0 && tokens == NULL)) {
    KVP_LOGW(LOG_MOD, "chain_extend: NULL %s", c == NULL ? "chain" : "tokens");
    return KVP_EINVAL;
  }
  const size_t bs = c->h->block_size;
  size_t nb = (c->n_tail + n) / bs, used;
  if (nb > INT_MAX) {
    KVP_LOGW(LOG_MOD, "chain_extend: %zu blocks do not fit the int result", nb);
    return KVP_ERANGE;
  }
  int rc = kvp__embeds_cover(&c->x, c->n_keys, nb);
  if (rc == 0)
    rc = chain_reserve(c, nb);
  if (rc < 0)
    return rc;
  kvp__cursor cur = c->cur;
  rc = nb > 0 ? chain_hash(c, &cur, tokens, nb, &used) : 0;
  if (rc < 0)
    return rc;
  /* commit */
  if (nb == 0) {
    if (n > 0)
      memcpy(c->tail + c->n_tail, tokens, n * sizeof *tokens);
    c->n_tail += n;
  } else {
    c->n_tail = n - used;
    if (c->n_tail > 0)
      memcpy(c->tail, tokens + used, c->n_tail * sizeof *tokens);
  }
  c->cur = cur;
  c->n_keys += nb;
  c->n_tokens += n;
  chunks_update(c);
  return (int)nb;
}

void kvp_chain_reset(kvp_chain *c) {
  if (c == NULL)
    return;
  kvp__cursor_init(c->h, &c->cur);
  c->n_tail = c->n_tokens = c->n_keys = 0;
  for (size_t i = 0; i < c->n_chunk; i++)
    c->chunk[i].n = 0;
}

size_t kvp_chain_len(const kvp_chain *c) { return c != NULL ? c->n_keys : 0; }
size_t kvp_chain_tokens(const kvp_chain *c) {
  return c != NULL ? c->n_tokens : 0;
}
size_t kvp_chain_tail(const kvp_chain *c) { return c != NULL ? c->n_tail : 0; }

const kvp_key *kvp_chain_keys(const kvp_chain *c) {
  if (c == NULL)
    return NULL;
  return c->keys != NULL ? c->keys : no_keys;
}

const kvp_key *kvp_chain_chunk_keys(const kvp_chain *c, uint32_t chunk_tokens,
                                    size_t *n) {
  if (n != NULL)
    *n = 0;
  for (size_t i = 0; c != NULL && i < c->n_chunk; i++) {
    const chunk_track *t = &c->chunk[i];
    if (t->tokens != chunk_tokens)
      continue;
    if (n != NULL)
      *n = t->n;
    return t->keys != NULL ? t->keys : no_keys;
  }
  return NULL;
}

int kvp_chain_digest(const kvp_chain *c, size_t i, uint8_t *buf, size_t cap) {
  if (c == NULL || buf == NULL) {
    KVP_LOGW(LOG_MOD, "chain_digest: NULL %s", c == NULL ? "chain" : "buf");
    return KVP_EINVAL;
  }
  if (!c->keep_digests)
    return KVP_ESTATE;
  if (i >= c->n_keys)
    return KVP_ERANGE;
  if (cap < c->h->dlen)
    return KVP_ENOSPC;
  memcpy(buf, c->digests + i * c->h->dlen, c->h->dlen);
  return (int)c->h->dlen;
}
