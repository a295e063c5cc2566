/* SPDX-License-Identifier: Apache-2.0 */
/* Test helper for test_prefix_pickle.py: reads one JSON request a line on
 * stdin, answers one JSON line on stdout with what router/prefix hashes --
 * the exact bytes (pickle / CBOR / native encoding) and the digests -- so
 * that CPython's pickle, cbor2, hashlib and xxhash can check them.
 *
 * Every request names the hasher: {"algo": kvplane name, "compat": 0..2,
 * "block_size": n, "seed": str|null} and an op:
 *   "block": "parent": hex|null, "tokens": [...], "bx": null | {"lora_name",
 *            "lora_path", "mm": [[id, offset]...], "cache_salt", "embeds":
 *            hex} (absent or null fields: NULL)
 *            -> {"bytes": hex, "digest": hex, "lo": u64}
 *   "seed":  "text": str -> {"bytes": hex} (NONE_HASH's input)
 *   "root":  -> {"root": hex}
 *   "chain": "tokens", "extras": {"lora_name", "lora_path", "cache_salt",
 *            "mm": [[id, offset, length]...], "embeds": [hex...]}
 *            -> {"digests": [hex...], "block": [digest of kvp_hasher_block
 *            fed kvp_hasher_block_extras, block by block]}
 * Errors: {"error": "KVP_E..."}. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "prefix_internal.h"

#define BYTES_MAX (8u << 20)

static void die(const char *why) {
  fprintf(stderr, "prefix_dump: %s\n", why);
  exit(2);
}

static void hex_out(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    printf("%02x", p[i]);
}

static size_t hex_in(const char *s, uint8_t *out, size_t cap) {
  size_t n = strlen(s) / 2;
  if (n > cap)
    die("hex too long");
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1)
      die("bad hex");
    out[i] = (uint8_t)v;
  }
  return n;
}

static const char *str_or_null(const json_t *o, const char *k) {
  const json_t *v = json_object_get(o, k);
  return json_is_string(v) ? json_string_value(v) : NULL;
}

static uint32_t *tokens_of(const json_t *req, size_t *n) {
  const json_t *a = json_object_get(req, "tokens");
  *n = json_array_size(a);
  uint32_t *t = calloc(*n + 1, sizeof *t);
  if (t == NULL)
    die("out of memory");
  for (size_t i = 0; i < *n; i++)
    t[i] = (uint32_t)json_integer_value(json_array_get(a, i));
  return t;
}

static kvp_hasher *hasher_of(const json_t *req) {
  kvp_hash_algo algo;
  if (kvp_hash_algo_parse(str_or_null(req, "algo"), &algo) < 0)
    die("bad algo");
  kvp_namespace_desc nd = {
      .model_id = "m",
      .block_size =
          (uint32_t)json_integer_value(json_object_get(req, "block_size"))};
  kvp_namespace ns;
  if (kvp_namespace_init(&nd, &ns) < 0)
    die("bad block_size");
  kvp_hasher_opts o = {
      .algo = algo,
      .python_hash_seed = str_or_null(req, "seed"),
      .vllm_compat =
          (uint32_t)json_integer_value(json_object_get(req, "compat"))};
  kvp_hasher *h = NULL;
  int rc = kvp_hasher_create(&ns, &o, NULL, &h);
  if (rc < 0) {
    printf("{\"error\":\"%s\"}\n", kvp_err_name(rc));
    return NULL;
  }
  return h;
}

static void op_block(kvp_hasher *h, const json_t *req) {
  static uint8_t bytes[BYTES_MAX];
  uint8_t parent[32], embeds[32], d[32];
  const char *ph = str_or_null(req, "parent");
  size_t plen = ph != NULL ? hex_in(ph, parent, sizeof parent) : 0, n, len;
  uint32_t *t = tokens_of(req, &n);
  if (n != kvp_hasher_block_size(h))
    die("tokens: not one block");
  const json_t *jb = json_object_get(req, "bx");
  kvp_block_extras bx = {0};
  const json_t *jm = json_object_get(jb, "mm");
  kvp_mm_key *mm = calloc(json_array_size(jm) + 1, sizeof *mm);
  if (mm == NULL)
    die("out of memory");
  for (size_t i = 0; i < json_array_size(jm); i++) {
    const json_t *k = json_array_get(jm, i);
    mm[i] = (kvp_mm_key){json_string_value(json_array_get(k, 0)),
                         (int64_t)json_integer_value(json_array_get(k, 1))};
  }
  if (json_is_object(jb)) {
    const char *e = str_or_null(jb, "embeds");
    bx = (kvp_block_extras){.lora_name = str_or_null(jb, "lora_name"),
                            .lora_path = str_or_null(jb, "lora_path"),
                            .mm = mm,
                            .n_mm = json_array_size(jm),
                            .cache_salt = str_or_null(jb, "cache_salt"),
                            .prompt_embeds = e != NULL ? embeds : NULL};
    if (e != NULL && hex_in(e, embeds, 32) != 32)
      die("embeds: not 32 bytes");
  }
  const kvp_block_extras *pbx = json_is_object(jb) ? &bx : NULL;
  kvp_key key;
  int rc = kvp__hasher_block_bytes(h, ph ? parent : NULL, plen, t, pbx, bytes,
                                   sizeof bytes, &len);
  if (rc >= 0)
    rc = kvp_hasher_block(h, ph ? parent : NULL, plen, t, pbx, d, sizeof d,
                          &key);
  if (rc < 0) {
    printf("{\"error\":\"%s\"}\n", kvp_err_name(rc));
  } else {
    printf("{\"bytes\":\"");
    hex_out(bytes, len);
    printf("\",\"digest\":\"");
    hex_out(d, (size_t)rc);
    printf("\",\"lo\":%" PRIu64 "}\n", key.lo);
  }
  free(mm);
  free(t);
}

static void op_seed(kvp_hasher *h, const json_t *req) {
  static uint8_t bytes[BYTES_MAX];
  size_t len;
  int rc = kvp__hasher_seed_bytes(h, str_or_null(req, "text"), bytes,
                                  sizeof bytes, &len);
  if (rc < 0) {
    printf("{\"error\":\"%s\"}\n", kvp_err_name(rc));
    return;
  }
  printf("{\"bytes\":\"");
  hex_out(bytes, len);
  printf("\"}\n");
}

/* Request-level extras; the arrays are freed by the caller. */
static void extras_of(const json_t *je, kvp_extras *ex, kvp_mm_span **mm,
                      uint8_t (**emb)[32]) {
  const json_t *jm = json_object_get(je, "mm"), *jx = json_object_get(je,
                                                                      "embeds");
  *mm = calloc(json_array_size(jm) + 1, sizeof **mm);
  *emb = calloc(json_array_size(jx) + 1, sizeof **emb);
  if (*mm == NULL || *emb == NULL)
    die("out of memory");
  for (size_t i = 0; i < json_array_size(jm); i++) {
    const json_t *k = json_array_get(jm, i);
    (*mm)[i] = (kvp_mm_span){
        json_string_value(json_array_get(k, 0)),
        (uint64_t)json_integer_value(json_array_get(k, 1)),
        (uint64_t)json_integer_value(json_array_get(k, 2))};
  }
  for (size_t i = 0; i < json_array_size(jx); i++)
    if (hex_in(json_string_value(json_array_get(jx, i)), (*emb)[i], 32) != 32)
      die("embeds: not 32 bytes");
  *ex = (kvp_extras){.lora_name = str_or_null(je, "lora_name"),
                     .lora_path = str_or_null(je, "lora_path"),
                     .cache_salt = str_or_null(je, "cache_salt"),
                     .mm = *mm,
                     .n_mm = json_array_size(jm),
                     .prompt_embeds = json_array_size(jx) ? *emb : NULL,
                     .n_prompt_embeds = json_array_size(jx)};
}

/* Block by block through kvp_hasher_block_extras + kvp_hasher_block. */
static int per_block(kvp_hasher *h, const kvp_extras *ex, const uint32_t *t,
                     size_t nb, size_t n_mm, uint8_t *out) {
  size_t bs = kvp_hasher_block_size(h);
  size_t dlen = kvp_hash_algo_digest_len(kvp_hasher_algo(h));
  kvp_mm_key *mm = calloc(n_mm + 1, sizeof *mm);
  int rc = mm != NULL ? 0 : KVP_ENOMEM;
  for (size_t i = 0; i < nb && rc >= 0; i++) {
    kvp_block_extras bx;
    rc = kvp_hasher_block_extras(h, ex, i, &bx, mm, n_mm);
    if (rc >= 0)
      rc = kvp_hasher_block(h, i ? out + (i - 1) * dlen : NULL, dlen,
                            t + i * bs, &bx, out + i * dlen, dlen, NULL);
  }
  free(mm);
  return rc;
}

static void op_chain(kvp_hasher *h, const json_t *req) {
  size_t n, dlen = kvp_hash_algo_digest_len(kvp_hasher_algo(h));
  uint32_t *t = tokens_of(req, &n);
  kvp_extras ex;
  kvp_mm_span *mm;
  uint8_t(*emb)[32];
  extras_of(json_object_get(req, "extras"), &ex, &mm, &emb);
  kvp_chain_opts co = {.keep_digests = 1};
  kvp_chain *c = NULL;
  size_t nb = n / kvp_hasher_block_size(h);
  uint8_t *d = calloc(nb + 1, dlen);
  int rc = d != NULL ? kvp_chain_create(h, &co, &ex, NULL, &c) : KVP_ENOMEM;
  if (rc >= 0)
    rc = kvp_chain_extend(c, t, n);
  if (rc >= 0)
    rc = per_block(h, &ex, t, nb, ex.n_mm, d);
  if (rc < 0) {
    printf("{\"error\":\"%s\"}\n", kvp_err_name(rc));
  } else {
    uint8_t g[32];
    printf("{\"digests\":[");
    for (size_t i = 0; i < nb; i++) {
      printf("%s\"", i ? "," : "");
      hex_out(g, (size_t)kvp_chain_digest(c, i, g, sizeof g));
      printf("\"");
    }
    printf("],\"block\":[");
    for (size_t i = 0; i < nb; i++) {
      printf("%s\"", i ? "," : "");
      hex_out(d + i * dlen, dlen);
      printf("\"");
    }
    printf("]}\n");
  }
  kvp_chain_destroy(c);
  free(d);
  free(mm);
  free(emb);
  free(t);
}

int main(void) {
  static char line[1 << 24];
  while (fgets(line, sizeof line, stdin) != NULL) {
    json_error_t e;
    json_t *req = json_loads(line, 0, &e);
    if (req == NULL)
      die(e.text);
    kvp_hasher *h = hasher_of(req);
    const char *op = str_or_null(req, "op");
    if (h != NULL && op != NULL) {
      if (strcmp(op, "block") == 0)
        op_block(h, req);
      else if (strcmp(op, "seed") == 0)
        op_seed(h, req);
      else if (strcmp(op, "chain") == 0)
        op_chain(h, req);
      else if (strcmp(op, "root") == 0) {
        uint8_t r[KVP__DIGEST_MAX];
        printf("{\"root\":\"");
        hex_out(r, kvp__hasher_root(h, r));
        printf("\"}\n");
      } else
        die("unknown op");
    }
    kvp_hasher_destroy(h);
    json_decref(req);
    fflush(stdout);
  }
  return 0;
}
