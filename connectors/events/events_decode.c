/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM's KV-event wire format -> kvp_kv_batch, with msgpack-c.  The shapes
 * are those of vllm/distributed/kv_events.py (0.33): EventBatch is array-like
 * [ts, events, data_parallel_rank?]; events are msgspec tagged structs with
 * omit_defaults, i.e. maps with "type" = the class name, or (other encoders,
 * older vLLM) arrays [type, fields in declaration order...]. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "events_internal.h"

/* Where one event's fields are in the unpacked tree (NULL = absent). */
typedef struct ev_fields {
  kvp_kv_event_type type;
  const msgpack_object *hashes, *parent, *tokens, *block_size, *lora_id,
      *medium, *lora_name, *extra_keys, *group_idx, *kind;
  uint32_t unknown;
} ev_fields;

struct kvp_kv_decoder {
  kvp_allocator alloc;
  msgpack_zone zone;
  bool zone_ok;
  ev_fields *f;
  kvp_kv_event *ev;
  size_t f_cap, ev_cap;
  kvp_ehash *h; /* every event's hashes and parents */
  uint32_t *tok;
  kvp_block_extras *bx;
  kvp_mm_key *mm;
  char *str; /* NUL-terminated copies of strings; 32-byte digests */
  size_t h_cap, tok_cap, bx_cap, mm_cap, str_cap;
  size_t h_n, tok_n, bx_n, mm_n, str_n;
  const char *why; /* the last rejection, for the debug log */
  bool skip_tokens;
};

/* ---- allocation ------------------------------------------------------------ */

void *kvp__ev_alloc(const kvp_allocator *a, size_t n) {
  if (n == 0)
    n = 1;
  return a && a->alloc ? a->alloc(a->opaque, n) : malloc(n);
}

char *kvp__ev_strdup(const kvp_allocator *a, const char *s) {
  size_t n = strlen(s) + 1;
  char *c = kvp__ev_alloc(a, n);
  if (c != NULL)
    memcpy(c, s, n);
  return c;
}

void kvp__ev_strfree(const kvp_allocator *a, char *s) {
  if (s != NULL)
    kvp__ev_free(a, s, strlen(s) + 1);
}

void *kvp__ev_calloc(const kvp_allocator *a, size_t n, size_t size) {
  if (size != 0 && n > SIZE_MAX / size)
    return NULL;
  void *p = kvp__ev_alloc(a, n * size);
  if (p != NULL)
    memset(p, 0, n * size != 0 ? n * size : 1);
  return p;
}

void kvp__ev_free(const kvp_allocator *a, void *p, size_t n) {
  if (p == NULL)
    return;
  if (a && a->free)
    a->free(a->opaque, p, n ? n : 1);
  else
    free(p);
}

int kvp__ev_grow(const kvp_allocator *a, void **p, size_t *cap, size_t need,
                 size_t size) {
  if (need <= *cap)
    return 0;
  size_t nc = *cap ? *cap : 64;
  while (nc < need) {
    if (nc > SIZE_MAX / 2 / size)
      return KVP_ENOMEM;
    nc *= 2;
  }
  void *np = kvp__ev_alloc(a, nc * size);
  if (np == NULL)
    return KVP_ENOMEM;
  if (*cap)
    memcpy(np, *p, *cap * size);
  kvp__ev_free(a, *p, *cap * size);
  *p = np;
  *cap = nc;
  return 0;
}

/* ---- the pre-check ----------------------------------------------------------- */

static uint64_t be(const uint8_t *p, unsigned n) {
  uint64_t v = 0;
  for (unsigned i = 0; i < n; i++)
    v = v << 8 | p[i];
  return v;
}

/* Bytes after the type byte, before any payload, and the payload length
 * (strings, bins, exts) or element count (containers, maps counted twice). */
static int mp_head(const uint8_t *p, size_t left, size_t *hdr, uint64_t *body,
                   uint64_t *items) {
  uint8_t b = p[0];
  static const uint8_t fixed[] = {[0xca - 0xc0] = 4, [0xcb - 0xc0] = 8,
                                  [0xcc - 0xc0] = 1, [0xcd - 0xc0] = 2,
                                  [0xce - 0xc0] = 4, [0xcf - 0xc0] = 8,
                                  [0xd0 - 0xc0] = 1, [0xd1 - 0xc0] = 2,
                                  [0xd2 - 0xc0] = 4, [0xd3 - 0xc0] = 8};
  *hdr = 0, *body = 0, *items = 0;
  if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
    return 0;
  if (b <= 0x8f)
    return (void)(*items = 2u * (b & 0x0f)), 0;
  if (b <= 0x9f)
    return (void)(*items = b & 0x0f), 0;
  if (b <= 0xbf)
    return (void)(*body = b & 0x1f), 0;
  if (b >= 0xca && b <= 0xd3)
    return (void)(*body = fixed[b - 0xc0]), 0;
  if (b >= 0xd4 && b <= 0xd8)
    return (void)(*body = 1u + (1u << (b - 0xd4))), 0;
  unsigned n;
  switch (b) {
  case 0xc4: case 0xd9: n = 1; break;
  case 0xc5: case 0xda: case 0xdc: case 0xde: n = 2; break;
  case 0xc6: case 0xdb: case 0xdd: case 0xdf: n = 4; break;
  case 0xc7: n = 1; break;
  case 0xc8: n = 2; break;
  case 0xc9: n = 4; break;
  default: return KVP_ECORRUPT; /* 0xc1: never used */
  }
  if (left < 1 + (size_t)n)
    return KVP_ECORRUPT;
  uint64_t v = be(p + 1, n);
  *hdr = n;
  if (b == 0xdc || b == 0xdd)
    *items = v;
  else if (b == 0xde || b == 0xdf)
    *items = 2 * v;
  else
    *body = v + (b >= 0xc7 && b <= 0xc9); /* ext: + its type byte */
  return 0;
}

int kvp__mp_check(const uint8_t *p, size_t len) {
  uint64_t need = 1; /* values still to read */
  size_t off = 0;
  while (need > 0) {
    if (off >= len || need > len - off)
      return KVP_ECORRUPT;
    uint8_t b = p[off];
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0) { /* fixints, nil: token ids */
      off++, need--;
      continue;
    }
    if (b == 0xcd || b == 0xce || b == 0xcf) { /* uint16/32/64 */
      size_t w = (size_t)1 << (b - 0xcc);
      if (w > len - off - 1)
        return KVP_ECORRUPT;
      off += 1 + w, need--;
      continue;
    }
    size_t hdr;
    uint64_t body, items;
    if (mp_head(p + off, len - off, &hdr, &body, &items) < 0)
      return KVP_ECORRUPT;
    off += 1 + hdr;
    if (body > len - off)
      return KVP_ECORRUPT;
    off += (size_t)body;
    need = need - 1 + items;
  }
  return off == len ? 0 : KVP_ECORRUPT;
}

int kvp_msgpack_check(const void *payload, size_t len) {
  if (payload == NULL && len > 0)
    return KVP_EINVAL;
  return kvp__mp_check(payload, len);
}

/* ---- small readers ------------------------------------------------------------ */

#define BAD(d, reason) ((d)->why = (reason), KVP_ECORRUPT)
/* p + i for scratch that may not exist yet (nothing reserved: NULL) */
#define AT(p, i) ((p) != NULL ? (p) + (i) : NULL)

static bool is_nil(const msgpack_object *o) {
  return o == NULL || o->type == MSGPACK_OBJECT_NIL;
}

static bool str_eq(const msgpack_object *o, const char *s, size_t n) {
  return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n &&
         memcmp(o->via.str.ptr, s, n) == 0;
}

/* Integers of either sign as int64 (u64 above INT64_MAX -> KVP_ERANGE). */
static int get_i64(const msgpack_object *o, int64_t *v) {
  if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
    return (void)(*v = o->via.i64), 0;
  if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
    return KVP_ECORRUPT;
  if (o->via.u64 > INT64_MAX)
    return KVP_ERANGE;
  return (void)(*v = (int64_t)o->via.u64), 0;
}

static int opt_int(kvp_kv_decoder *d, const msgpack_object *o, int64_t lo,
                   int64_t hi, int64_t *v, const char *what) {
  if (is_nil(o))
    return 0;
  int64_t x;
  if (get_i64(o, &x) < 0 || x < lo || x > hi)
    return BAD(d, what);
  return (void)(*v = x), 0;
}

/* A NUL-terminated copy in the arena (reserved by the sizing pass). */
static const char *str_copy(kvp_kv_decoder *d, const msgpack_object *o) {
  size_t n = o->via.str.size;
  char *s = d->str + d->str_n;
  memcpy(s, o->via.str.ptr, n);
  s[n] = 0;
  d->str_n += n + 1;
  return s;
}

static int str_ok(kvp_kv_decoder *d, const msgpack_object *o) {
  if (o->type != MSGPACK_OBJECT_STR)
    return BAD(d, "expected a string");
  if (memchr(o->via.str.ptr, 0, o->via.str.size) != NULL)
    return BAD(d, "NUL inside a string");
  return 0;
}

static const char *opt_str(kvp_kv_decoder *d, const msgpack_object *o) {
  return is_nil(o) ? NULL : str_copy(d, o);
}

static int get_hash(kvp_kv_decoder *d, const msgpack_object *o, kvp_ehash *h) {
  memset(h, 0, sizeof *h);
  if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
    return (void)(h->u64 = o->via.u64), 0;
  if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) /* older vLLM: hash() */
    return (void)(h->u64 = (uint64_t)o->via.i64), 0;
  if (o->type != MSGPACK_OBJECT_BIN)
    return BAD(d, "a block hash is neither an int nor bytes");
  size_t n = o->via.bin.size;
  if (n == 0 || n > sizeof h->digest)
    return (void)(d->why = "a block hash digest is empty or over 32 bytes"),
           KVP_ERANGE;
  memcpy(h->digest, o->via.bin.ptr, n);
  h->len = (uint8_t)n;
  h->u64 = be(h->digest + (n > 8 ? n - 8 : 0), n > 8 ? 8 : (unsigned)n);
  return 0;
}

/* ---- locating an event's fields ------------------------------------------------- */

typedef enum fid {
  F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
  F_EXTRA_KEYS, F_GROUP_IDX, F_KIND, F_KNOWN /* known, not used */, F_NONE
} fid;

static const struct {
  const char *name;
  fid id;
} field_names[] = {
    {"block_hashes", F_HASHES},   {"parent_block_hash", F_PARENT},
    {"token_ids", F_TOKENS},      {"block_size", F_BLOCK_SIZE},
    {"lora_id", F_LORA_ID},       {"medium", F_MEDIUM},
    {"lora_name", F_LORA_NAME},   {"extra_keys", F_EXTRA_KEYS},
    {"group_idx", F_GROUP_IDX},   {"kv_cache_spec_kind", F_KIND},
    {"kv_cache_spec_sliding_window", F_KNOWN}, {"locality", F_KNOWN},
    {"ownership", F_KNOWN},       {"session_id", F_KNOWN},
    {"lookahead_token_ids", F_KNOWN},
};

/* Declaration order of each struct (vllm/distributed/kv_events.py): the
 * array form lists fields in this order after the tag. */
static const fid stored_order[] = {
    F_HASHES,   F_PARENT,   F_TOKENS,  F_BLOCK_SIZE, F_LORA_ID,
    F_MEDIUM,   F_LORA_NAME, F_EXTRA_KEYS, F_GROUP_IDX, F_KIND,
    F_KNOWN,    F_KNOWN,    F_KNOWN,   F_KNOWN,      F_KNOWN};
static const fid removed_order[] = {F_HASHES, F_MEDIUM, F_GROUP_IDX, F_KNOWN,
                                    F_KNOWN};

static kvp_kv_event_type type_of(const msgpack_object *o) {
  if (str_eq(o, "BlockStored", 11))
    return KVP_KV_BLOCK_STORED;
  if (str_eq(o, "BlockRemoved", 12))
    return KVP_KV_BLOCK_REMOVED;
  if (str_eq(o, "AllBlocksCleared", 16))
    return KVP_KV_ALL_CLEARED;
  return KVP_KV_UNKNOWN;
}

static void set_field(ev_fields *f, fid id, const msgpack_object *v) {
  const msgpack_object **slot[] = {
      [F_HASHES] = &f->hashes,         [F_PARENT] = &f->parent,
      [F_TOKENS] = &f->tokens,         [F_BLOCK_SIZE] = &f->block_size,
      [F_LORA_ID] = &f->lora_id,       [F_MEDIUM] = &f->medium,
      [F_LORA_NAME] = &f->lora_name,   [F_EXTRA_KEYS] = &f->extra_keys,
      [F_GROUP_IDX] = &f->group_idx,   [F_KIND] = &f->kind};
  if (id < F_KNOWN)
    *slot[id] = v;
  else if (id == F_NONE)
    f->unknown++;
}

static fid field_id(const msgpack_object *k) {
  if (k->type != MSGPACK_OBJECT_STR)
    return F_NONE;
  for (size_t i = 0; i < sizeof field_names / sizeof *field_names; i++)
    if (str_eq(k, field_names[i].name, strlen(field_names[i].name)))
      return field_names[i].id;
  return F_NONE;
}

static int locate_map(kvp_kv_decoder *d, const msgpack_object *o,
                      ev_fields *f) {
  const msgpack_object *tag = NULL;
  for (uint32_t i = 0; i < o->via.map.size; i++) {
    const msgpack_object_kv *kv = &o->via.map.ptr[i];
    if (str_eq(&kv->key, "type", 4))
      tag = &kv->val;
    else
      set_field(f, field_id(&kv->key), &kv->val);
  }
  if (tag == NULL || tag->type != MSGPACK_OBJECT_STR)
    return BAD(d, "an event map without a string \"type\"");
  f->type = type_of(tag);
  return 0;
}

static int locate_array(kvp_kv_decoder *d, const msgpack_object *o,
                        ev_fields *f) {
  const msgpack_object *a = o->via.array.ptr;
  uint32_t n = o->via.array.size;
  if (n == 0 || a[0].type != MSGPACK_OBJECT_STR)
    return BAD(d, "an event array without a string tag");
  f->type = type_of(&a[0]);
  const fid *order = f->type == KVP_KV_BLOCK_STORED ? stored_order
                     : f->type == KVP_KV_BLOCK_REMOVED ? removed_order
                                                       : NULL;
  size_t n_order = f->type == KVP_KV_BLOCK_STORED
                       ? sizeof stored_order / sizeof *stored_order
                   : f->type == KVP_KV_BLOCK_REMOVED
                       ? sizeof removed_order / sizeof *removed_order
                       : 0;
  for (uint32_t i = 1; i < n; i++)
    set_field(f, i - 1 < n_order ? order[i - 1] : F_NONE, &a[i]);
  return 0;
}

static int locate(kvp_kv_decoder *d, const msgpack_object *o, ev_fields *f) {
  memset(f, 0, sizeof *f);
  if (o->type == MSGPACK_OBJECT_MAP)
    return locate_map(d, o, f);
  if (o->type == MSGPACK_OBJECT_ARRAY)
    return locate_array(d, o, f);
  return BAD(d, "an event is neither a map nor an array");
}

/* ---- sizing: checks types and counts what an event needs -------------------- */

typedef struct ev_need {
  size_t h, tok, bx, mm, str;
} ev_need;

static int size_str(kvp_kv_decoder *d, const msgpack_object *o, ev_need *n) {
  if (is_nil(o))
    return 0;
  int rc = str_ok(d, o);
  n->str += o->via.str.size + 1;
  return rc;
}

static int size_block_extras(kvp_kv_decoder *d, const msgpack_object *o,
                             ev_need *n) {
  if (is_nil(o))
    return 0;
  if (o->type != MSGPACK_OBJECT_ARRAY)
    return BAD(d, "a block's extra keys are not an array");
  for (uint32_t i = 0; i < o->via.array.size; i++) {
    const msgpack_object *it = &o->via.array.ptr[i];
    int rc = 0;
    if (it->type == MSGPACK_OBJECT_STR) {
      rc = size_str(d, it, n);
    } else if (it->type == MSGPACK_OBJECT_BIN) {
      if (it->via.bin.size != 32)
        return BAD(d, "a prompt-embeds extra key is not 32 bytes");
      n->str += 32;
    } else if (it->type == MSGPACK_OBJECT_ARRAY &&
               it->via.array.size == 2) {
      int64_t off;
      if (get_i64(&it->via.array.ptr[1], &off) < 0)
        return BAD(d, "an mm extra key's offset is not an int");
      rc = size_str(d, &it->via.array.ptr[0], n);
      n->mm++;
    } else {
      return BAD(d, "an extra key is not a string, (id, offset) or bytes");
    }
    if (rc < 0)
      return rc;
  }
  return 0;
}

static int size_event(kvp_kv_decoder *d, const ev_fields *f, ev_need *n) {
  if (f->type != KVP_KV_BLOCK_STORED && f->type != KVP_KV_BLOCK_REMOVED)
    return 0;
  if (f->hashes == NULL || f->hashes->type != MSGPACK_OBJECT_ARRAY)
    return BAD(d, "block_hashes missing or not an array");
  size_t nh = f->hashes->via.array.size;
  if (nh > KVP_INDEX_CHAIN_MAX)
    return (void)(d->why = "more blocks than KVP_INDEX_CHAIN_MAX"), KVP_ERANGE;
  n->h += nh + !is_nil(f->parent);
  int rc = size_str(d, f->medium, n);
  if (rc == 0)
    rc = size_str(d, f->kind, n);
  if (rc == 0)
    rc = size_str(d, f->lora_name, n);
  if (rc < 0 || f->type == KVP_KV_BLOCK_REMOVED)
    return rc;
  if (!is_nil(f->tokens)) {
    if (f->tokens->type != MSGPACK_OBJECT_ARRAY)
      return BAD(d, "token_ids is not an array");
    n->tok += d->skip_tokens ? 0 : f->tokens->via.array.size;
  }
  if (is_nil(f->extra_keys))
    return 0;
  if (f->extra_keys->type != MSGPACK_OBJECT_ARRAY ||
      f->extra_keys->via.array.size != nh)
    return BAD(d, "extra_keys is not one entry per block");
  n->bx += nh;
  for (size_t i = 0; rc == 0 && i < nh; i++)
    rc = size_block_extras(d, &f->extra_keys->via.array.ptr[i], n);
  return rc;
}

static int reserve(kvp_kv_decoder *d, const ev_need *n) {
  const kvp_allocator *a = &d->alloc;
  int rc = kvp__ev_grow(a, (void **)&d->h, &d->h_cap, n->h, sizeof *d->h);
  if (rc == 0)
    rc = kvp__ev_grow(a, (void **)&d->tok, &d->tok_cap, n->tok,
                      sizeof *d->tok);
  if (rc == 0)
    rc = kvp__ev_grow(a, (void **)&d->bx, &d->bx_cap, n->bx, sizeof *d->bx);
  if (rc == 0)
    rc = kvp__ev_grow(a, (void **)&d->mm, &d->mm_cap, n->mm, sizeof *d->mm);
  if (rc == 0)
    rc = kvp__ev_grow(a, (void **)&d->str, &d->str_cap, n->str, 1);
  return rc;
}

/* ---- filling ------------------------------------------------------------------ */

static kvp_tier tier_of(const char *m) {
  static const struct {
    const char *name;
    kvp_tier tier;
  } media[] = {{"GPU", KVP_TIER_HBM},      {"gpu", KVP_TIER_HBM},
               {"cuda", KVP_TIER_HBM},     {"CPU", KVP_TIER_DRAM},
               {"cpu", KVP_TIER_DRAM},     {"STORAGE", KVP_TIER_NVME},
               {"storage", KVP_TIER_NVME}, {"disk", KVP_TIER_NVME},
               {"DISK", KVP_TIER_NVME}};
  if (m == NULL)
    return KVP_TIER_HBM; /* vLLM's default medium */
  for (size_t i = 0; i < sizeof media / sizeof *media; i++)
    if (strcmp(m, media[i].name) == 0)
      return media[i].tier;
  return KVP_TIER_COUNT_; /* unknown: the subscriber skips and counts it */
}

/* One block's untagged extra keys.  Strings are told apart by position and
 * the event's lora_name: vLLM lists the LoRA name first, then the
 * (identifier, offset) pairs, then the salt (block 0), then the digest. */
static int fill_block_extras(kvp_kv_decoder *d, const msgpack_object *o,
                             const char *lora, kvp_block_extras *bx) {
  memset(bx, 0, sizeof *bx);
  if (is_nil(o))
    return 0;
  size_t mm0 = d->mm_n;
  for (uint32_t i = 0; i < o->via.array.size; i++) {
    const msgpack_object *it = &o->via.array.ptr[i];
    if (it->type == MSGPACK_OBJECT_ARRAY) {
      kvp_mm_key *k = &d->mm[d->mm_n++];
      (void)get_i64(&it->via.array.ptr[1], &k->offset);
      k->id = str_copy(d, &it->via.array.ptr[0]);
      bx->n_mm++;
    } else if (it->type == MSGPACK_OBJECT_BIN) {
      if (bx->prompt_embeds != NULL)
        return BAD(d, "two prompt-embeds digests in one block");
      memcpy(d->str + d->str_n, it->via.bin.ptr, 32);
      bx->prompt_embeds = (const uint8_t *)d->str + d->str_n;
      d->str_n += 32;
    } else if (i == 0 && lora != NULL &&
               str_eq(it, lora, strlen(lora))) {
      bx->lora_name = str_copy(d, it);
    } else if (bx->cache_salt == NULL && bx->prompt_embeds == NULL) {
      bx->cache_salt = str_copy(d, it);
    } else {
      return BAD(d, "a string extra key that is neither the LoRA name nor "
                    "the cache salt");
    }
  }
  bx->mm = bx->n_mm ? d->mm + mm0 : NULL;
  return 0;
}

static int fill_stored(kvp_kv_decoder *d, const ev_fields *f,
                       kvp_kv_event *e) {
  int64_t bs = 0;
  int rc = opt_int(d, f->block_size, 1, UINT32_MAX, &bs,
                   "block_size is not an int in 1..2^32-1");
  if (rc < 0)
    return rc;
  e->block_size = (uint32_t)bs;
  if (!is_nil(f->tokens) && d->skip_tokens) {
    e->n_tokens = f->tokens->via.array.size; /* counted, not copied */
  } else if (!is_nil(f->tokens)) {
    const msgpack_object *t = f->tokens->via.array.ptr;
    uint32_t *out = AT(d->tok, d->tok_n);
    for (uint32_t i = 0; i < f->tokens->via.array.size; i++) {
      if (t[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return BAD(d, "a token id is not a non-negative int");
      if (t[i].via.u64 > UINT32_MAX)
        return (void)(d->why = "a token id above 2^32-1"), KVP_ERANGE;
      out[i] = (uint32_t)t[i].via.u64;
    }
    e->tokens = out;
    e->n_tokens = f->tokens->via.array.size;
    d->tok_n += e->n_tokens;
  }
  if (e->n_tokens != 0 && e->block_size != 0 &&
      e->n_tokens != (uint64_t)e->n_hashes * e->block_size)
    return BAD(d, "token_ids is not block_size tokens per block");
  if (e->block_size == 0 && e->n_tokens != 0 && e->n_hashes != 0 &&
      e->n_tokens % e->n_hashes == 0)
    e->block_size = (uint32_t)(e->n_tokens / e->n_hashes);
  if (is_nil(f->extra_keys))
    return 0;
  kvp_block_extras *bx = AT(d->bx, d->bx_n);
  for (size_t i = 0; rc == 0 && i < e->n_hashes; i++)
    rc = fill_block_extras(d, &f->extra_keys->via.array.ptr[i], e->lora_name,
                           &bx[i]);
  e->extras = bx;
  e->n_extras = e->n_hashes;
  d->bx_n += e->n_hashes;
  return rc;
}

static int fill_event(kvp_kv_decoder *d, const ev_fields *f,
                      kvp_kv_event *e) {
  memset(e, 0, sizeof *e);
  e->type = f->type;
  e->group_idx = -1;
  e->lora_id = -1;
  e->unknown_fields = f->unknown;
  if (f->type != KVP_KV_BLOCK_STORED && f->type != KVP_KV_BLOCK_REMOVED)
    return 0;
  e->medium = opt_str(d, f->medium);
  e->spec_kind = opt_str(d, f->kind);
  e->lora_name = opt_str(d, f->lora_name);
  e->tier = tier_of(e->medium);
  int64_t g = -1, lid = -1;
  int rc = opt_int(d, f->group_idx, 0, INT32_MAX, &g,
                   "group_idx is not an int in 0..2^31-1");
  if (rc == 0)
    rc = opt_int(d, f->lora_id, INT64_MIN, INT64_MAX, &lid,
                 "lora_id is not an int");
  e->group_idx = (int32_t)g;
  e->lora_id = lid;
  e->hashes = AT(d->h, d->h_n);
  e->n_hashes = f->hashes->via.array.size;
  for (size_t i = 0; rc == 0 && i < e->n_hashes; i++)
    rc = get_hash(d, &f->hashes->via.array.ptr[i], &d->h[d->h_n + i]);
  d->h_n += e->n_hashes;
  if (rc == 0 && !is_nil(f->parent)) {
    rc = get_hash(d, f->parent, &d->h[d->h_n]);
    e->parent = &d->h[d->h_n++];
  }
  if (rc == 0 && f->type == KVP_KV_BLOCK_STORED)
    rc = fill_stored(d, f, e);
  return rc;
}

/* ---- the batch ------------------------------------------------------------------ */

static int decode_tree(kvp_kv_decoder *d, const msgpack_object *top,
                       kvp_kv_batch *out) {
  if (top->type != MSGPACK_OBJECT_ARRAY || top->via.array.size < 2)
    return BAD(d, "the batch is not an array [ts, events, ...]");
  const msgpack_object *a = top->via.array.ptr;
  if (a[0].type == MSGPACK_OBJECT_FLOAT64 ||
      a[0].type == MSGPACK_OBJECT_FLOAT32)
    out->ts = a[0].via.f64;
  else if (a[0].type == MSGPACK_OBJECT_POSITIVE_INTEGER)
    out->ts = (double)a[0].via.u64;
  else
    return BAD(d, "the batch's ts is not a number");
  if (a[1].type != MSGPACK_OBJECT_ARRAY)
    return BAD(d, "the batch's events are not an array");
  int64_t rank = -1;
  int rc = top->via.array.size > 2
               ? opt_int(d, &a[2], 0, INT32_MAX, &rank,
                         "data_parallel_rank is not an int")
               : 0;
  out->dp_rank = (int32_t)rank;
  size_t n = a[1].via.array.size;
  if (rc == 0)
    rc = kvp__ev_grow(&d->alloc, (void **)&d->f, &d->f_cap, n, sizeof *d->f);
  if (rc == 0)
    rc = kvp__ev_grow(&d->alloc, (void **)&d->ev, &d->ev_cap, n,
                      sizeof *d->ev);
  ev_need need = {0};
  for (size_t i = 0; rc == 0 && i < n; i++)
    if ((rc = locate(d, &a[1].via.array.ptr[i], &d->f[i])) == 0)
      rc = size_event(d, &d->f[i], &need);
  if (rc == 0)
    rc = reserve(d, &need);
  d->h_n = d->tok_n = d->bx_n = d->mm_n = d->str_n = 0;
  size_t k = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (d->f[i].type == KVP_KV_UNKNOWN)
      out->unknown_events++;
    else
      rc = fill_event(d, &d->f[i], &d->ev[k++]);
  }
  out->events = d->ev;
  out->n_events = k;
  return rc < 0 ? rc : (int)(k > INT32_MAX ? INT32_MAX : k);
}

int kvp_kv_decode(kvp_kv_decoder *d, const void *payload, size_t len,
                  kvp_kv_batch *out) {
  if (d == NULL || out == NULL || (payload == NULL && len > 0))
    return KVP_EINVAL;
  memset(out, 0, sizeof *out);
  out->dp_rank = -1;
  d->why = NULL;
  if (kvp__mp_check(payload, len) < 0) {
    kvp_log(KVP_LOG_DEBUG, EV_MOD, "payload of %zu bytes is not one msgpack "
            "value", len);
    return KVP_ECORRUPT;
  }
  msgpack_zone_clear(&d->zone);
  msgpack_object top;
  size_t off = 0;
  msgpack_unpack_return ur =
      msgpack_unpack(payload, len, &off, &d->zone, &top);
  if (ur != MSGPACK_UNPACK_SUCCESS)
    return ur == MSGPACK_UNPACK_NOMEM_ERROR ? KVP_ENOMEM : KVP_ECORRUPT;
  int rc = decode_tree(d, &top, out);
  if (rc < 0) {
    kvp_log(KVP_LOG_DEBUG, EV_MOD, "bad event batch: %s",
            d->why ? d->why : kvp_strerror(rc));
    memset(out, 0, sizeof *out);
    out->dp_rank = -1;
  }
  return rc;
}

int kvp_kv_decoder_create(const kvp_allocator *alloc, kvp_kv_decoder **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  kvp_kv_decoder *d = kvp__ev_calloc(alloc, 1, sizeof *d);
  if (d == NULL)
    return KVP_ENOMEM;
  if (alloc)
    d->alloc = *alloc;
  /* one chunk that a typical batch fits in: clearing keeps it, so the
   * unpacker does not malloc per batch */
  if (!msgpack_zone_init(&d->zone, (size_t)1 << 20)) {
    kvp__ev_free(alloc, d, sizeof *d);
    return KVP_ENOMEM;
  }
  *out = d;
  return 0;
}

void kvp_kv_decoder_destroy(kvp_kv_decoder *d) {
  if (d == NULL)
    return;
  const kvp_allocator *a = &d->alloc;
  msgpack_zone_destroy(&d->zone);
  kvp__ev_free(a, d->f, d->f_cap * sizeof *d->f);
  kvp__ev_free(a, d->ev, d->ev_cap * sizeof *d->ev);
  kvp__ev_free(a, d->h, d->h_cap * sizeof *d->h);
  kvp__ev_free(a, d->tok, d->tok_cap * sizeof *d->tok);
  kvp__ev_free(a, d->bx, d->bx_cap * sizeof *d->bx);
  kvp__ev_free(a, d->mm, d->mm_cap * sizeof *d->mm);
  kvp__ev_free(a, d->str, d->str_cap);
  kvp_allocator copy = d->alloc;
  kvp__ev_free(&copy, d, sizeof *d);
}

int kvp_kv_decoder_skip_tokens(kvp_kv_decoder *d, int skip) {
  if (d == NULL)
    return KVP_EINVAL;
  d->skip_tokens = skip != 0;
  return 0;
}

const char *kvp_kv_event_type_name(kvp_kv_event_type t) {
  switch (t) {
  case KVP_KV_BLOCK_STORED: return "BlockStored";
  case KVP_KV_BLOCK_REMOVED: return "BlockRemoved";
  case KVP_KV_ALL_CLEARED: return "AllBlocksCleared";
  default: return "unknown";
  }
}
