/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd KV-indexer service: its request bodies (docs/routerd-
 * indexer.md), in the two dialects it speaks -- NVIDIA Dynamo's standalone
 * indexer (model_name, ...) and Mooncake's conductor indexer (modelname /
 * model, type, seq_hashes, ...).  A pure function over untrusted bytes
 * (tests/fuzz/fuzz_routerd_indexer.c). */
#ifndef KVP_ROUTERD_IDX_REQ_H
#define KVP_ROUTERD_IDX_REQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rd_req.h"

typedef enum rd_ix_op {
  RD_IX_REGISTER = 0,   /* POST /register */
  RD_IX_UNREGISTER = 1, /* POST /unregister */
  RD_IX_QUERY = 2,      /* POST /query */
  RD_IX_QUERY_HASH = 3  /* POST /query_by_hash */
} rd_ix_op;

typedef enum rd_ix_dialect {
  RD_IX_DYNAMO = 0,  /* "model_name": Dynamo's response shapes */
  RD_IX_MOONCAKE = 1 /* "modelname" / "model" / "type": Mooncake's */
} rd_ix_dialect;

#define RD_IX_EP_MAX 256

typedef struct rd_ix_req {
  rd_ix_op op;
  rd_ix_dialect dialect;
  /* instance_id: a non-negative integer (Dynamo) or a string (Mooncake),
   * kept as text; "" = absent */
  char instance[RD_REQ_ID_MAX];
  bool instance_int;
  char endpoint[RD_IX_EP_MAX]; /* register: the ZMQ PUB endpoint */
  char replay[RD_IX_EP_MAX];   /* register: replay_endpoint or "" */
  char url[RD_IX_EP_MAX];      /* register: the worker's HTTP URL or "" */
  char model[RD_REQ_ID_MAX];   /* "" = absent */
  char tenant[RD_REQ_ID_MAX];  /* tenant_id; "" = absent */
  char group[RD_REQ_ID_MAX];   /* routing_group; "" = absent */
  char lora_name[RD_REQ_ID_MAX];
  char cache_salt[RD_REQ_ID_MAX];
  bool has_salt;       /* cache_salt present and not null */
  uint32_t block_size; /* 0 = absent */
  int64_t dp_rank;     /* -1 = absent */
  uint32_t *tokens;    /* query: token_ids (malloc'd) */
  size_t n_tokens;
  uint64_t *hashes;    /* query_by_hash: the hashes as u64 (malloc'd) */
  size_t n_hashes;
} rd_ix_req;

/* Longest token_ids / hash list accepted (the index's chain bound at block
 * size 1 for hashes; 16M tokens). */
#define RD_IX_TOKENS_MAX ((size_t)1 << 24)
#define RD_IX_HASHES_MAX ((size_t)1 << 20)

/* Parses body[0..len) for op.  Returns 0 (out filled; rd_ix_free it) or -1
 * with *err (status 400, the field in param) and out empty.  Any bytes are
 * safe; never reads past len. */
int rd_ix_parse(rd_ix_op op, const char *body, size_t len, rd_ix_req *out,
                rd_req_err *err);
void rd_ix_free(rd_ix_req *r);

/* The cache salt the front door hashes a request with and sends to the
 * engine (vLLM's cache_salt): "kvp1-" + base64url (no padding) of
 * HMAC-SHA256(key, len64be(tenant) tenant len64be(salt) salt), the tenant
 * from its header ("" = none) and salt the request's own cache_salt ("" =
 * none); "" when both are empty.  A client can neither forge another
 * tenant's salt (it does not know the router's key) nor collide two
 * (tenant, salt) pairs (length-prefixed); the result is 48 characters of
 * [A-Za-z0-9_-], which vLLM accepts.  Shared by rd_proxy.c and the indexer
 * so /query matches what the front door indexed.  cap >= RD_SALT_MAX;
 * returns the length written, or -1 (cap too small, or OpenSSL failed:
 * out is ""). */
#define RD_SALT_KEY_LEN 32
#define RD_SALT_MAX 64
int rd_salt_for(const unsigned char key[RD_SALT_KEY_LEN], const char *tenant,
                const char *cache_salt, char *out, size_t cap);

#endif
