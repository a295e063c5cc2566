/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd: what the router reads from an OpenAI request body.  A
 * pure function over untrusted bytes (tests/fuzz/fuzz_routerd_req.c): the
 * body is only read, never rewritten, except to set the cache_salt the
 * router derives (rd_req_with_salt, spliced in). */
#ifndef KVP_ROUTERD_REQ_H
#define KVP_ROUTERD_REQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum rd_kind {
  RD_COMPLETIONS = 0, /* POST /v1/completions */
  RD_CHAT = 1         /* POST /v1/chat/completions */
} rd_kind;

#define RD_REQ_TEXT_MAX ((size_t)64 << 20)
#define RD_REQ_ID_MAX 128

typedef struct rd_req {
  rd_kind kind;
  bool stream;
  /* token-id prompt as sent (completions: [ids] or [[ids], ...]: the first
   * prompt routes the batch); NULL when the prompt is text or messages */
  uint32_t *tokens;
  size_t n_tokens;
  /* text for approximate (character) mode: the completions prompt string,
   * or the chat messages' roles and contents joined; malloc'd, may be "" */
  char *text;
  size_t text_len;
  char model[RD_REQ_ID_MAX];      /* "model" or "" */
  char user[RD_REQ_ID_MAX];       /* OpenAI "user" or "" (session affinity) */
  char cache_salt[RD_REQ_ID_MAX]; /* the request's own cache_salt or "" */
  char request_id[RD_REQ_ID_MAX]; /* vLLM's "request_id" field or "" */
} rd_req;

typedef struct rd_req_err {
  int status;       /* 400 */
  char param[32];   /* the offending field, "" = none */
  char message[256];
} rd_req_err;

/* Parses body[0..len).  Returns 0 (out filled; rd_req_free it) or -1 with
 * *err set and out empty.  Any bytes are safe; never reads past len. */
/* Scanners over JSON bytes b[0..n) that jansson validates elsewhere (the
 * splicers keep every byte they do not touch as sent): past whitespace;
 * b[i] == '"' -> past its closing quote; past one value (a scalar stops at
 * the ',', '}' or ']' after it).  n when the bytes end first. */
size_t rd_json_skip_ws(const char *b, size_t i, size_t n);
size_t rd_json_skip_str(const char *b, size_t i, size_t n);
size_t rd_json_skip_value(const char *b, size_t i, size_t n);

/* true (the default): token ids are scanned 64 bytes at a time; false: one
 * byte at a time (the benchmark's baseline; tests run both).  Same results. */
extern bool rd_req_wide_scan;
/* The wide scan itself (tests): ids from b[p] (a number due there) into
 * t[*k..cap); returns where a byte-by-byte scan would go on, 0 when the
 * array is not plain ids, and sets *end past ']' when it ended here. */
size_t rd_ids_wide(const char *b, size_t p, size_t n, uint32_t *t, size_t *k,
                   size_t cap, size_t *end);

int rd_req_parse(rd_kind kind, const char *body, size_t len, rd_req *out,
                 rd_req_err *err);
void rd_req_free(rd_req *r);

/* body with its top-level "cache_salt" set to salt ([A-Za-z0-9_-] only):
 * the value replaced in place, or the member appended last (a second
 * spelling of the key, e.g. escaped, is then overridden: JSON readers keep
 * the last).  Every other byte is kept as sent (numbers, token ids).  The
 * body must have parsed as a JSON object.  malloc'd NUL-terminated, its
 * length in *out_len; NULL on ENOMEM or a body that is not an object. */
char *rd_req_with_salt(const char *body, size_t len, const char *salt,
                       size_t *out_len);

/* The OpenAI error body {"error": {"message", "type", "param", "code"}},
 * malloc'd (NULL on ENOMEM). */
char *rd_error_json(int status, const char *param, const char *message);

#endif
