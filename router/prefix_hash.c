/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix, block hashing: namespace seeds, the four block-hash
 * algorithms (native XXH3-128 / SHA-256, vLLM-exact sha256_cbor /
 * xxhash_cbor) and the incrementally extended key chain of a prompt. */
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
#define N_ALGOS 4
#define N_CHUNKS 4
/* Scratch beyond the largest token encoding (5 B per CBOR uint): extras
 * that fit are hashed in the same single call; longer ones stream. */
#define SCRATCH_SLACK 2048u
#define CBOR_HEAD_MAX 9u

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
static const char *const algo_names[N_ALGOS] = {"xxh3_128", "sha256",
                                                "sha256_cbor", "xxhash_cbor"};

static bool algo_valid(kvp_hash_algo a) { return (unsigned)a < N_ALGOS; }
static bool algo_cbor(kvp_hash_algo a) {
  return a == KVP_HASH_SHA256_CBOR || a == KVP_HASH_XXHASH_CBOR;
}
static bool algo_sha(kvp_hash_algo a) {
  return a == KVP_HASH_SHA256 || a == KVP_HASH_SHA256_CBOR;
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
           "sha256_cbor or xxhash_cbor)",
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

int kvp__xview_init(const kvp_extras *e, kvp__xview *out) {
  *out = (kvp__xview){0};
  if (e == NULL)
    return 0;
  if (e->n_mm > 0 && e->mm == NULL) {
    KVP_LOGW(LOG_MOD, "extras: n_mm is %zu but mm is NULL", e->n_mm);
    return KVP_EINVAL;
  }
  int rc = check_string("extras", "lora_name", e->lora_name, &out->lora_len);
  if (rc == 0)
    rc = check_string("extras", "cache_salt", e->cache_salt, &out->salt_len);
  if (rc == 0)
    rc = check_mm(e->mm, e->n_mm);
  if (rc < 0)
    return rc;
  out->lora = e->lora_name;
  out->salt = e->cache_salt;
  out->mm = e->mm;
  out->n_mm = e->n_mm;
  return 0;
}

/* vLLM's _gen_mm_extra_hash_keys, one key at a time, so a block's keys can
 * be counted (CBOR array header) and then emitted without a buffer. */
typedef struct mm_iter {
  size_t idx;
  bool done;
} mm_iter;

static uint64_t mm_end(const kvp_mm_span *s) { return s->offset + s->length; }

static mm_iter mm_begin(const kvp__xview *x, uint64_t start, size_t idx) {
  /* vLLM's early exit: past the last placeholder, no keys, index kept */
  bool past = x->n_mm == 0 || mm_end(&x->mm[x->n_mm - 1]) < start;
  return (mm_iter){idx, past};
}

static bool mm_next(const kvp__xview *x, uint64_t start, uint64_t end,
                    mm_iter *it, size_t *out) {
  while (!it->done && it->idx < x->n_mm) {
    const kvp_mm_span *s = &x->mm[it->idx];
    if (end <= s->offset)
      break;                 /* not reached yet */
    if (start > mm_end(s)) { /* passed (vLLM: strictly, so an end == start
                                placeholder still keys the block) */
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

/* What one block's extra-keys tuple holds: lora, mm..., salt. */
typedef struct xplan {
  mm_iter mm; /* replay from here to emit the mm keys */
  size_t n_mm;
  size_t mm_after; /* curr_mm_idx for the next block */
  bool lora, salt;
} xplan;

static size_t plan_block(const kvp__xview *x, const kvp__cursor *cur,
                         uint64_t end, xplan *p) {
  p->lora = x->lora_len > 0;
  p->salt = x->salt_len > 0 && cur->start == 0;
  p->mm = mm_begin(x, cur->start, cur->mm_idx);
  p->n_mm = 0;
  mm_iter it = p->mm;
  size_t i;
  while (mm_next(x, cur->start, end, &it, &i))
    p->n_mm++;
  p->mm_after = it.idx;
  return (size_t)p->lora + p->n_mm + (size_t)p->salt;
}

/* ---- hasher -------------------------------------------------------------- */
struct kvp_hasher {
  kvp_allocator alloc;
  kvp_hash_algo algo;
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
};

static void sink_begin(kvp_hasher *h) {
  h->pos = 0;
  h->streaming = false;
  h->failed = false;
}

static void sink_update(kvp_hasher *h, const uint8_t *p, size_t n) {
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

static void native_extras(kvp_hasher *h, const kvp__xview *x, uint64_t start,
                          const xplan *p) {
  uint8_t tag =
      (uint8_t)(KVP__XTAG | (p->lora ? KVP__XTAG_LORA : 0) |
                (p->n_mm ? KVP__XTAG_MM : 0) | (p->salt ? KVP__XTAG_SALT : 0));
  sink_put(h, &tag, 1);
  if (p->lora)
    put_lp(h, x->lora, x->lora_len);
  if (p->n_mm > 0) {
    uint8_t b[8];
    put_u32le(b, (uint32_t)p->n_mm);
    sink_put(h, b, 4);
    mm_iter it = p->mm;
    size_t i;
    while (mm_next(x, start, start + h->block_size, &it, &i)) {
      put_lp(h, x->mm[i].id, strlen(x->mm[i].id));
      put_u64le(b, x->mm[i].offset - start); /* i64 two's complement */
      sink_put(h, b, 8);
    }
  }
  if (p->salt)
    put_lp(h, x->salt, x->salt_len);
}

static void native_block(kvp_hasher *h, const kvp__cursor *cur,
                         const uint32_t *tok, const kvp__xview *x,
                         const xplan *p, size_t n_extra) {
  size_t tb = (size_t)h->block_size * 4;
  sink_put(h, cur->parent, 16);
  put_tokens_le(sink_room(h, tb), tok, h->block_size);
  h->pos += tb;
  if (n_extra > 0)
    native_extras(h, x, cur->start, p);
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

static void cbor_extras(kvp_hasher *h, const kvp__xview *x, uint64_t start,
                        const xplan *p, size_t n_extra) {
  cb_array(h, n_extra);
  if (p->lora)
    cb_text(h, x->lora, x->lora_len);
  mm_iter it = p->mm;
  size_t i;
  while (p->n_mm > 0 && mm_next(x, start, start + h->block_size, &it, &i)) {
    cb_array(h, 2);
    cb_text(h, x->mm[i].id, strlen(x->mm[i].id));
    cb_int(h, (int64_t)(x->mm[i].offset - start));
  }
  if (p->salt)
    cb_text(h, x->salt, x->salt_len);
}

static void cbor_block(kvp_hasher *h, const kvp__cursor *cur,
                       const uint32_t *tok, const kvp__xview *x, const xplan *p,
                       size_t n_extra) {
  cb_array(h, 3);
  cb_bytes(h, cur->parent, h->dlen);
  cb_tokens(h, tok);
  if (n_extra > 0)
    cbor_extras(h, x, cur->start, p, n_extra);
  else
    cb_null(h);
}

/* ---- blocks -------------------------------------------------------------- */
static int hash_block(kvp_hasher *h, kvp__cursor *cur, const uint32_t *tok,
                      const kvp__xview *x, kvp_key *key, uint8_t *digest) {
  uint64_t end = cur->start + h->block_size;
  xplan p;
  size_t n_extra = plan_block(x, cur, end, &p);
  uint8_t d[KVP__DIGEST_MAX];
  sink_begin(h);
  if (algo_cbor(h->algo))
    cbor_block(h, cur, tok, x, &p, n_extra);
  else
    native_block(h, cur, tok, x, &p, n_extra);
  int rc = sink_final(h, d);
  if (rc < 0)
    return rc;
  *key = key_from(d + h->dlen - 16);
  if (digest != NULL)
    memcpy(digest, d, h->dlen);
  /* vLLM chains the full digest; native modes the 16-byte key */
  if (algo_cbor(h->algo))
    memcpy(cur->parent, d, h->dlen);
  else
    memcpy(cur->parent, d + h->dlen - 16, 16);
  cur->start = end;
  cur->mm_idx = p.mm_after;
  return 0;
}

/* True when every block from `start` on has no extra keys under XXH3-128:
 * no lora, salt only on block 0, and past the last placeholder. */
static bool plain_from(const kvp_hasher *h, const kvp__xview *x,
                       uint64_t start) {
  if (h->algo != KVP_HASH_XXH3_128 || x->lora_len > 0)
    return false;
  if (x->salt_len > 0 && start == 0)
    return false;
  return x->n_mm == 0 || mm_end(&x->mm[x->n_mm - 1]) < start;
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
static int hasher_check(const kvp_namespace *ns, const kvp_hasher_opts *o) {
  if (!algo_valid(o->algo)) {
    KVP_LOGW(LOG_MOD, "hasher: unknown algo %d", (int)o->algo);
    return KVP_EINVAL;
  }
  if (ns->block_size == 0 || ns->block_size > KVP_BLOCK_SIZE_MAX) {
    KVP_LOGW(LOG_MOD,
             "hasher: namespace block_size %" PRIu32
             " not in 1..%u (use kvp_namespace_init)",
             ns->block_size, KVP_BLOCK_SIZE_MAX);
    return KVP_EINVAL;
  }
  if (!algo_cbor(o->algo))
    return 0;
  if (o->python_hash_seed == NULL) {
    KVP_LOGW(LOG_MOD,
             "hasher: %s needs python_hash_seed (vLLM's "
             "PYTHONHASHSEED)",
             algo_names[o->algo]);
    return KVP_EINVAL;
  }
  size_t len;
  return check_string("hasher", "python_hash_seed", o->python_hash_seed, &len);
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

static int root_init(kvp_hasher *h, const kvp_namespace *ns, const char *seed) {
  if (!algo_cbor(h->algo)) {
    key_bytes(ns->seed, h->root);
    return 0;
  }
  /* vLLM NONE_HASH = hash_fn(PYTHONHASHSEED): CBOR of a text string */
  sink_begin(h);
  cb_text(h, seed, strlen(seed));
  return sink_final(h, h->root);
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
  int rc = hasher_check(ns, &o);
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_hasher *h = kvp__calloc(&a, 1, sizeof *h);
  if (h == NULL)
    return KVP_ENOMEM;
  *h = (kvp_hasher){.alloc = a,
                    .algo = o.algo,
                    .block_size = ns->block_size,
                    .dlen = kvp_hash_algo_digest_len(o.algo)};
  h->cap = 64 + (size_t)h->block_size * 5 + SCRATCH_SLACK;
  rc = KVP_ENOMEM;
  h->buf = kvp__malloc(&a, h->cap);
  if (h->buf == NULL)
    goto fail_hasher;
  rc = backend_init(h);
  if (rc < 0)
    goto fail_backend;
  rc = root_init(h, ns, o.python_hash_seed);
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
  size_t nb = n / h->block_size;
  if (nb > INT_MAX) {
    KVP_LOGW(LOG_MOD, "hasher_hash: %zu blocks do not fit the int result", nb);
    return KVP_ERANGE;
  }
  kvp__cursor cur;
  kvp__cursor_init(h, &cur);
  rc = kvp__hash_blocks(h, &cur, tokens, nb < cap ? nb : cap, &x, keys, NULL);
  if (rc < 0)
    return rc;
  if (tail != NULL)
    *tail = n % h->block_size;
  return (int)nb;
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

/* One allocation: mm spans, then every string NUL-terminated. */
static int xview_copy(kvp_chain *c, const kvp__xview *src) {
  size_t sz;
  if (!kvp__mul_ok(src->n_mm, sizeof(kvp_mm_span), &sz))
    return KVP_ENOMEM;
  sz += src->lora_len + 1 + src->salt_len + 1;
  for (size_t i = 0; i < src->n_mm; i++)
    sz += strlen(src->mm[i].id) + 1;
  c->xmem = kvp__malloc(&c->alloc, sz);
  if (c->xmem == NULL)
    return KVP_ENOMEM;
  c->xmem_size = sz;
  kvp_mm_span *mm = c->xmem;
  char *s = (char *)(mm + src->n_mm);
  for (size_t i = 0; i < src->n_mm; i++) {
    mm[i] = src->mm[i];
    mm[i].id = copy_str(&s, src->mm[i].id, strlen(src->mm[i].id));
  }
  c->x = (kvp__xview){.lora = copy_str(&s, src->lora, src->lora_len),
                      .lora_len = src->lora_len,
                      .salt = copy_str(&s, src->salt, src->salt_len),
                      .salt_len = src->salt_len,
                      .mm = mm,
                      .n_mm = src->n_mm};
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
  int rc = chain_reserve(c, nb);
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
