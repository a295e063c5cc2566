/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd request parsing (jansson): the prompt's token ids, the text
 * for approximate mode, and the fields that steer routing. */
#include "rd_req.h"

#include <jansson.h>
#include <stdio.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

static int fail(rd_req_err *e, const char *param, const char *msg) {
  e->status = 400;
  snprintf(e->param, sizeof e->param, "%s", param);
  snprintf(e->message, sizeof e->message, "%s", msg);
  return -1;
}

static int copy_str(json_t *o, const char *key, char *dst, size_t cap,
                    rd_req_err *e) {
  json_t *v = json_object_get(o, key);
  if (v == NULL || json_is_null(v))
    return 0;
  if (!json_is_string(v))
    return fail(e, key, "must be a string");
  if (json_string_length(v) >= cap)
    return fail(e, key, "is too long");
  memcpy(dst, json_string_value(v), json_string_length(v) + 1);
  if (strlen(dst) != json_string_length(v))
    return fail(e, key, "contains a NUL character");
  return 0;
}

/* [ids] -> tokens; 1 when a token array, 0 when not one, -1 on error */
static int take_ids(json_t *a, rd_req *r, rd_req_err *e) {
  size_t n = json_array_size(a);
  if (n == 0 || !json_is_integer(json_array_get(a, 0)))
    return 0;
  r->tokens = malloc(n * sizeof *r->tokens);
  if (r->tokens == NULL)
    return fail(e, "prompt", "out of memory");
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(a, i);
    json_int_t t = json_is_integer(v) ? json_integer_value(v) : -1;
    if (t < 0 || t > (json_int_t)INT32_MAX)
      return fail(e, "prompt", "token ids must be integers in [0, 2^31)");
    r->tokens[i] = (uint32_t)t;
  }
  r->n_tokens = n;
  return 1;
}

static int set_text(rd_req *r, const char *s, size_t n, rd_req_err *e) {
  if (n > RD_REQ_TEXT_MAX)
    return fail(e, "prompt", "prompt text is too long");
  r->text = malloc(n + 1);
  if (r->text == NULL)
    return fail(e, "prompt", "out of memory");
  memcpy(r->text, s, n);
  r->text[n] = '\0';
  r->text_len = n;
  return 0;
}

static int parse_prompt(json_t *p, rd_req *r, rd_req_err *e) {
  if (json_is_string(p))
    return set_text(r, json_string_value(p), json_string_length(p), e);
  if (!json_is_array(p) || json_array_size(p) == 0)
    return fail(e, "prompt", "must be a string, a list of token ids, or a "
                             "non-empty list of either");
  int rc = take_ids(p, r, e);
  if (rc != 0)
    return rc < 0 ? -1 : 0;
  json_t *first = json_array_get(p, 0); /* a batch: the first one routes */
  if (json_is_string(first))
    return set_text(r, json_string_value(first), json_string_length(first), e);
  if (json_is_array(first) && (rc = take_ids(first, r, e)) != 0)
    return rc < 0 ? -1 : 0;
  return fail(e, "prompt", "must be a string, a list of token ids, or a "
                           "non-empty list of either");
}

/* roles and contents joined ("role\ncontent\n"); list contents: text parts */
static int append(char **buf, size_t *len, size_t *cap, const char *s,
                  size_t n) {
  if (*len + n + 2 > RD_REQ_TEXT_MAX)
    return -1;
  if (*len + n + 2 > *cap) {
    size_t nc = (*len + n + 2) * 2;
    char *nb = realloc(*buf, nc);
    if (nb == NULL)
      return -1;
    *buf = nb;
    *cap = nc;
  }
  memcpy(*buf + *len, s, n);
  *len += n;
  (*buf)[(*len)++] = '\n';
  (*buf)[*len] = '\0';
  return 0;
}

static int append_content(char **b, size_t *len, size_t *cap, json_t *c) {
  if (json_is_string(c))
    return append(b, len, cap, json_string_value(c), json_string_length(c));
  size_t i;
  json_t *part;
  json_array_foreach(c, i, part) {
    json_t *t = json_object_get(part, "text");
    if (json_is_string(t) &&
        append(b, len, cap, json_string_value(t), json_string_length(t)) < 0)
      return -1;
  }
  return 0;
}

static int parse_messages(json_t *m, rd_req *r, rd_req_err *e) {
  if (!json_is_array(m) || json_array_size(m) == 0)
    return fail(e, "messages", "must be a non-empty list of messages");
  char *b = NULL;
  size_t len = 0, cap = 0, i;
  json_t *msg;
  json_array_foreach(m, i, msg) {
    json_t *role = json_object_get(msg, "role"),
           *c = json_object_get(msg, "content");
    if (!json_is_object(msg) || !json_is_string(role))
      return free(b), fail(e, "messages", "each message needs a string role");
    if (c != NULL && !json_is_null(c) && !json_is_string(c) && !json_is_array(c))
      return free(b), fail(e, "messages", "content must be a string or a list");
    if (append(&b, &len, &cap, json_string_value(role),
               json_string_length(role)) < 0 ||
        (json_is_null(c) || c == NULL ? 0 : append_content(&b, &len, &cap, c)) < 0)
      return free(b), fail(e, "messages", "messages are too long");
  }
  r->text = b;
  r->text_len = len;
  return 0;
}

/* ---- the token-id fast path ------------------------------------------------ */
/* A 32K-token prompt is a jansson tree of 32K integer nodes: ~4 ms of the
 * router's CPU per request (bench_routerd), over the 1 ms it may add.  A
 * top-level "prompt": [ids] of plain integers is read here straight from
 * the bytes, and jansson parses -- and validates -- the rest of the body
 * with that array spliced out ("prompt":null).  Anything else (a batch, a
 * negative or non-integer id, an escaped key) takes the jansson path, which
 * says what is wrong; the results are the same (tests/test_routerd_req.c). */
size_t rd_json_skip_ws(const char *b, size_t i, size_t n) {
  while (i < n && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r'))
    i++;
  return i;
}

/* b[i] == '"': the index past the closing quote, or n */
size_t rd_json_skip_str(const char *b, size_t i, size_t n) {
  for (i++; i < n; i++)
    if (b[i] == '\\')
      i++;
    else if (b[i] == '"')
      return i + 1;
  return n;
}

/* one value (not validated: jansson does that); the index past it */
size_t rd_json_skip_value(const char *b, size_t i, size_t n) {
  size_t depth = 0;
  while (i < n) {
    char c = b[i];
    if (c == '"')
      i = rd_json_skip_str(b, i, n);
    else if (c == '{' || c == '[')
      depth++, i++;
    else if (c == '}' || c == ']') {
      if (depth == 0)
        return i;
      depth--, i++;
    } else if (c == ',' && depth == 0)
      return i;
    else
      i++;
    if (depth == 0 && (c == '"' || c == '}' || c == ']'))
      return i;
  }
  return n;
}

/* Up to 8 leading ASCII digits of p[0..8) (8 readable bytes): their count,
 * and their value in *v -- eight bytes at a time (SWAR), the byte loop was
 * a quarter of the router's CPU on 32K-token prompts (bench_routerd). */
static inline __attribute__((always_inline)) unsigned
digits8(const char *p, uint64_t *v) {
  uint64_t x;
  memcpy(&x, p, 8);
  uint64_t t = x - 0x3030303030303030ull;
  /* a byte is a digit iff (b - '0') < 10: its high bit stays clear in both */
  uint64_t bad = (t | (t + 0x7676767676767676ull)) & 0x8080808080808080ull;
  unsigned n = bad ? (unsigned)__builtin_ctzll(bad) / 8 : 8;
  if (n == 0)
    return 0;
  t <<= 8 * (8 - n); /* the digits to the top, zeros (value 0) below */
  t = ((t & 0x0F0F0F0F0F0F0F0Full) * 2561) >> 8;
  t = ((t & 0x00FF00FF00FF00FFull) * 6553601) >> 16;
  *v = ((t & 0x0000FFFF0000FFFFull) * 42949672960001ull) >> 32;
  return n;
}

/* One decimal at b[i..n): the index past it (== i: none) */
static size_t number(const char *b, size_t i, size_t n, uint64_t *v) {
  *v = 0;
  if (n - i >= 8) {
    unsigned k = digits8(b + i, v);
    if (k < 8)
      return i + k;
    i += 8; /* 8 digits or more: the slow path finishes (and overflows) */
  }
  while (i < n && b[i] >= '0' && b[i] <= '9' && *v <= INT32_MAX)
    *v = *v * 10 + (uint64_t)(b[i++] - '0');
  return i;
}

/* Bit j set: p[j] of p[0..64) is an ASCII digit. */
#if defined(__SSE2__)
static inline uint64_t digit_bits64(const char *p) {
  const __m128i lo = _mm_set1_epi8('0' - 1), hi = _mm_set1_epi8('9' + 1);
  uint64_t m = 0;
  for (int k = 0; k < 4; k++) {
    __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * k));
    /* signed compares: bytes >= 0x80 are below '0' */
    __m128i d = _mm_and_si128(_mm_cmpgt_epi8(x, lo), _mm_cmplt_epi8(x, hi));
    m |= (uint64_t)(uint16_t)_mm_movemask_epi8(d) << (16 * k);
  }
  return m;
}
#else
static inline uint64_t digit_bits64(const char *p) {
  uint64_t m = 0;
  for (int j = 0; j < 64; j++)
    m |= (uint64_t)(p[j] >= '0' && p[j] <= '9') << j;
  return m;
}
#endif

bool rd_req_wide_scan = true;

/* The ids from b[p] on (a number must start there), 64 bytes at a time: a
 * digit bitmap names every number's start at once, so each number converts
 * on its own (digits8) instead of waiting for the one before it to end --
 * the byte-by-byte scan's dependency chain was ~7 ns an id, a quarter of
 * kvplane-routerd's CPU on 32K-token prompts.  Each start must be where the
 * previous number's separator ends, so nothing between numbers goes
 * unread.  Returns where the byte loop goes on (a number due there); 0: not
 * a fast array; *end: past the closing ']' when the array ended here. */
size_t rd_ids_wide(const char *b, size_t p, size_t n, uint32_t *t, size_t *k,
                   size_t cap, size_t *end) {
  size_t c = p, m = *k; /* m: ids taken (a local, not *k, in the loop) */
  uint64_t carry = 0;   /* the last chunk ended inside a number */
  for (; c + 64 + 16 <= n; c += 64) {
    uint64_t dig = digit_bits64(b + c);
    uint64_t starts = dig & ~(dig << 1 | carry);
    carry = dig >> 63;
    for (; starts != 0; starts &= starts - 1) {
      size_t s = c + (size_t)__builtin_ctzll(starts), e;
      uint64_t v = 0;
      if (s != p || m == cap)
        goto stop;
      unsigned d = digits8(b + s, &v); /* s + 8 <= n: 16 bytes of room */
      e = d < 8 ? s + d : number(b, s, n, &v);
      if (v > INT32_MAX || (b[s] == '0' && e - s > 1))
        goto stop;
      t[m++] = (uint32_t)v;
      if (e + 1 < n && b[e] == ',') { /* "12,34" or "12, 34" */
        p = (unsigned char)b[e + 1] <= ' ' ? rd_json_skip_ws(b, e + 1, n)
                                           : e + 1;
        continue;
      }
      e = rd_json_skip_ws(b, e, n);
      if (e < n && b[e] == ']') {
        *k = m;
        return *end = e + 1, e + 1;
      }
      if (e >= n || b[e] != ',')
        goto stop;
      p = rd_json_skip_ws(b, e + 1, n);
    }
  }
  *k = m;
  return p >= c ? p : 0; /* a number due at p < c never started */
stop:
  *k = m;
  return 0;
}

/* b[i] == '[': plain integers in [0, 2^31) -> r->tokens; the index past
 * ']', or 0 when the array is anything else */
static size_t take_fast_ids(const char *b, size_t i, size_t n, rd_req *r) {
  size_t cap = (n - i) / 2 + 1, k = 0, end = 0;
  uint32_t *t = malloc(cap * sizeof *t);
  i = rd_json_skip_ws(b, i + 1, n);
  if (t != NULL && rd_req_wide_scan)
    i = rd_ids_wide(b, i, n, t, &k, cap, &end);
  for (; t != NULL && end == 0 && i != 0 && i < n;
       i = rd_json_skip_ws(b, i, n)) {
    uint64_t v;
    size_t d = i;
    i = number(b, i, n, &v);
    if (i == d || v > INT32_MAX || (b[d] == '0' && i - d > 1) || k == cap)
      break;
    t[k++] = (uint32_t)v;
    if (i < n && b[i] == ',') { /* the common case: "12,34" */
      i++;
      continue;
    }
    i = rd_json_skip_ws(b, i, n);
    if (i < n && b[i] == ']')
      end = i + 1;
    else if (i >= n || b[i] != ',')
      break;
    else
      i++;
  }
  if (end != 0) {
    r->tokens = t;
    r->n_tokens = k;
    return end;
  }
  free(t);
  return 0;
}

/* The body without its top-level token-id prompt (taken into r), or NULL:
 * no such prompt, or no memory (the jansson path then runs as before). */
static char *splice_prompt(const char *b, size_t n, rd_req *r, size_t *out) {
  size_t i = rd_json_skip_ws(b, 0, n);
  if (i >= n || b[i] != '{')
    return NULL;
  for (i = rd_json_skip_ws(b, i + 1, n); i < n && b[i] == '"'; ) {
    size_t k0 = i + 1, k1 = rd_json_skip_str(b, i, n);
    i = rd_json_skip_ws(b, k1, n);
    if (i >= n || b[i] != ':')
      return NULL;
    i = rd_json_skip_ws(b, i + 1, n);
    if (k1 - k0 == 7 && memcmp(b + k0, "prompt\"", 7) == 0) {
      size_t end = i < n && b[i] == '[' ? take_fast_ids(b, i, n, r) : 0;
      /* "null", not a number: no byte after the array can extend it into
       * a valid value ([1,2].5 would read as 0.5) -- fuzz_routerd_req */
      char *s = end ? malloc(n - (end - i) + 5) : NULL;
      if (s == NULL)
        return rd_req_free(r), NULL;
      memcpy(s, b, i);
      memcpy(s + i, "null", 4);
      memcpy(s + i + 4, b + end, n - end);
      *out = n - (end - i) + 4;
      s[*out] = '\0';
      return s;
    }
    i = rd_json_skip_ws(b, rd_json_skip_value(b, i, n), n);
    if (i >= n || b[i] != ',')
      return NULL;
    i = rd_json_skip_ws(b, i + 1, n);
  }
  return NULL;
}

static int parse_obj(json_t *o, rd_kind kind, rd_req *r, rd_req_err *e) {
  json_t *s = json_object_get(o, "stream");
  if (s != NULL && !json_is_null(s) && !json_is_boolean(s))
    return fail(e, "stream", "must be a boolean");
  r->stream = json_is_true(s);
  if (copy_str(o, "model", r->model, sizeof r->model, e) < 0 ||
      copy_str(o, "user", r->user, sizeof r->user, e) < 0 ||
      copy_str(o, "cache_salt", r->cache_salt, sizeof r->cache_salt, e) < 0 ||
      copy_str(o, "request_id", r->request_id, sizeof r->request_id, e) < 0)
    return -1;
  if (kind == RD_CHAT)
    return parse_messages(json_object_get(o, "messages"), r, e);
  json_t *p = json_object_get(o, "prompt");
  if (p == NULL)
    return fail(e, "prompt", "is required");
  return r->tokens ? 0 : parse_prompt(p, r, e); /* tokens: the fast path's */
}

int rd_req_parse(rd_kind kind, const char *body, size_t len, rd_req *out,
                 rd_req_err *err) {
  memset(out, 0, sizeof *out);
  out->kind = kind;
  /* no JSON text holds a raw NUL (RFC 8259), yet jansson 2.14 takes one
   * right after a number ({"a":0\0}) -- and the fast path and the salt
   * splice would then read the body differently (fuzz_routerd_req) */
  if (memchr(body, '\0', len) != NULL)
    return fail(err, "", "the body is not JSON (it holds a NUL byte)");
  json_error_t je;
  size_t slen = 0;
  char *spliced = kind == RD_COMPLETIONS ? splice_prompt(body, len, out, &slen)
                                         : NULL;
  json_t *o = spliced ? json_loadb(spliced, slen, JSON_REJECT_DUPLICATES, &je)
                      : json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
  free(spliced);
  if (o == NULL || !json_is_object(o)) {
    json_decref(o);
    char m[200];
    snprintf(m, sizeof m, "the body is not a JSON object (%s)",
             o ? "another JSON value" : je.text);
    rd_req_free(out);
    return fail(err, "", m);
  }
  int rc = parse_obj(o, kind, out, err);
  json_decref(o);
  if (rc < 0)
    rd_req_free(out);
  return rc;
}

void rd_req_free(rd_req *r) {
  free(r->tokens);
  free(r->text);
  r->tokens = NULL;
  r->text = NULL;
  r->n_tokens = r->text_len = 0;
}

/* The top-level "cache_salt" key's value in b (the key's bytes as sent):
 * [*v0, *v1), left alone when there is none.  *close: the index of the
 * object's closing '}'; *empty: it has no member.  false: b is not an
 * object this scan can walk (the caller parsed it with jansson first). */
static bool find_salt(const char *b, size_t n, size_t *v0, size_t *v1,
                      size_t *close, bool *empty) {
  size_t i = rd_json_skip_ws(b, 0, n);
  if (i >= n || b[i] != '{')
    return false;
  i = rd_json_skip_ws(b, i + 1, n);
  *empty = i < n && b[i] == '}';
  while (i < n && b[i] == '"') {
    size_t k0 = i + 1, k1 = rd_json_skip_str(b, i, n);
    i = rd_json_skip_ws(b, k1, n);
    if (i >= n || b[i] != ':')
      return false;
    i = rd_json_skip_ws(b, i + 1, n);
    size_t end = rd_json_skip_value(b, i, n);
    if (k1 - k0 == 11 && memcmp(b + k0, "cache_salt\"", 11) == 0)
      *v0 = i, *v1 = end;
    i = rd_json_skip_ws(b, end, n);
    if (i < n && b[i] == ',')
      i = rd_json_skip_ws(b, i + 1, n);
  }
  *close = i;
  return i < n && b[i] == '}';
}

char *rd_req_with_salt(const char *body, size_t len, const char *salt,
                       size_t *out_len) {
  size_t v0 = 0, v1 = 0, close = 0, sl = strlen(salt);
  bool empty = false;
  if (!find_salt(body, len, &v0, &v1, &close, &empty))
    return NULL;
  bool replace = v1 > v0;
  size_t head = replace ? v0 : close, tail = replace ? v1 : close;
  char *s = malloc(len + sl + 32);
  if (s == NULL)
    return NULL;
  size_t k = 0;
  memcpy(s, body, head);
  k = head;
  k += (size_t)sprintf(s + k, "%s\"%s\"", replace ? "" : empty ? "\"cache_salt\":"
                                                    : ",\"cache_salt\":", salt);
  memcpy(s + k, body + tail, len - tail);
  k += len - tail;
  s[k] = '\0';
  *out_len = k;
  return s;
}

char *rd_error_json(int status, const char *param, const char *message) {
  const char *type = status == 404   ? "NotFoundError"
                     : status == 400 ? "BadRequestError"
                     : status == 413 ? "RequestTooLargeError"
                     : status == 401 ? "AuthenticationError"
                     : status < 500  ? "BadRequestError"
                                     : "ServiceUnavailableError";
  json_t *o = json_pack("{s:{s:s, s:s, s:o, s:i}}", "error", "message",
                        message, "type", type, "param",
                        param && *param ? json_string(param) : json_null(),
                        "code", status);
  char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
  json_decref(o);
  return s;
}
