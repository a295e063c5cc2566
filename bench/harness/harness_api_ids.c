/* SPDX-License-Identifier: Apache-2.0 */
/* bh_api_parse_fast (harness_api.h): a /v1/completions body whose "prompt"
 * is a flat array of token ids is parsed without building a JSON value per
 * id.  The array is read here (strictly: digits, commas, JSON whitespace);
 * the rest of the body -- the array replaced by [0] -- goes through
 * bh_api_parse, whose context-length check is shifted by the ids the [0]
 * stands for.  Anything else, and any refusal, is parsed again the slow way,
 * so the result (error messages included) is always bh_api_parse's
 * (tests/test_api_ids.c checks it). */
#include <stdlib.h>
#include <string.h>

#include "harness_api_ids.h"

static bool ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static size_t skip_ws(const char *b, size_t i, size_t n) {
  while (i < n && ws(b[i]))
    i++;
  return i;
}

/* A string starting at b[i] == '"': the index past its closing quote, or 0
 * (unterminated); *esc set when it holds a backslash. */
static size_t skip_string(const char *b, size_t i, size_t n, bool *esc) {
  for (i++; i < n; i++) {
    if (b[i] == '\\') {
      *esc = true;
      i++;
    } else if (b[i] == '"') {
      return i + 1;
    }
  }
  return 0;
}

/* Any value at b[i]: the index past it, or 0 when it does not look like one
 * (jansson then says why). */
static size_t skip_value(const char *b, size_t i, size_t n) {
  bool esc = false;
  if (i >= n)
    return 0;
  if (b[i] == '"')
    return skip_string(b, i, n, &esc);
  if (b[i] != '[' && b[i] != '{') { /* a number, true, false, null */
    size_t j = i;
    while (j < n && !ws(b[j]) && b[j] != ',' && b[j] != ']' && b[j] != '}')
      j++;
    return j > i ? j : 0;
  }
  size_t depth = 0;
  for (; i < n; i++) {
    if (b[i] == '"') {
      size_t j = skip_string(b, i, n, &esc);
      if (j == 0)
        return 0;
      i = j - 1;
    } else if (b[i] == '[' || b[i] == '{') {
      depth++;
    } else if (b[i] == ']' || b[i] == '}') {
      if (--depth == 0)
        return i + 1;
    }
  }
  return 0;
}

/* The array at b[i] == '[': ids (each below vocab, JSON integers without
 * sign, fraction, exponent or leading zero) into *out; the index past ']',
 * or 0 when it is anything else. */
static size_t read_ids(const char *b, size_t i, size_t n, uint32_t vocab,
                       uint32_t **out, size_t *n_out) {
  size_t cap = (n - i) / 2 + 1, k = 0;
  uint32_t *v = malloc(cap * sizeof *v);
  if (v == NULL)
    return 0;
  i = skip_ws(b, i + 1, n);
  if (i < n && b[i] == ']') { /* empty: the slow path says so */
    free(v);
    return 0;
  }
  while (i < n) {
    if (b[i] < '0' || b[i] > '9' || (b[i] == '0' && i + 1 < n &&
                                      b[i + 1] >= '0' && b[i + 1] <= '9'))
      break;
    uint64_t t = 0;
    for (; i < n && b[i] >= '0' && b[i] <= '9'; i++) {
      t = t * 10 + (uint64_t)(b[i] - '0');
      if (t >= vocab)
        goto no;
    }
    v[k++] = (uint32_t)t;
    i = skip_ws(b, i, n);
    if (i < n && b[i] == ']') {
      *out = v;
      *n_out = k;
      return i + 1;
    }
    if (i >= n || b[i] != ',' || k == cap)
      break;
    i = skip_ws(b, i + 1, n);
  }
no:
  free(v);
  return 0;
}

/* The top-level "prompt" value's extent when it is an id array. */
static bool find_ids(const bh_api_cfg *cfg, const char *b, size_t n,
                     size_t *from, size_t *to, uint32_t **ids, size_t *n_ids) {
  size_t i = skip_ws(b, 0, n);
  if (i >= n || b[i] != '{')
    return false;
  i = skip_ws(b, i + 1, n);
  while (i < n && b[i] == '"') {
    bool esc = false;
    size_t k = i, j = skip_string(b, i, n, &esc);
    if (j == 0)
      return false;
    i = skip_ws(b, j, n);
    if (i >= n || b[i] != ':')
      return false;
    i = skip_ws(b, i + 1, n);
    if (!esc && j - k == 8 && memcmp(b + k, "\"prompt\"", 8) == 0) {
      if (i >= n || b[i] != '[')
        return false;
      size_t e = read_ids(b, i, n, cfg->vocab, ids, n_ids);
      if (e == 0)
        return false;
      *from = i;
      *to = e;
      return true;
    }
    if ((i = skip_value(b, i, n)) == 0)
      return false;
    i = skip_ws(b, i, n);
    if (i >= n || b[i] != ',')
      return false;
    i = skip_ws(b, i + 1, n);
  }
  return false;
}

static int fast(const bh_api_cfg *cfg, const char *body, size_t len,
                bh_api_req *out, bh_api_err *err) {
  size_t from, to, n;
  uint32_t *ids = NULL;
  if (!find_ids(cfg, body, len, &from, &to, &ids, &n))
    return -1;
  int rc = -1;
  char *small = NULL;
  if (n - 1 > cfg->max_model_len) /* too long: the slow path's message */
    goto out;
  size_t sl = from + 3 + (len - to);
  if ((small = malloc(sl)) == NULL)
    goto out;
  memcpy(small, body, from);
  memcpy(small + from, "[0]", 3);
  memcpy(small + from + 3, body + to, len - to);
  bh_api_cfg c = *cfg;
  c.max_model_len = cfg->max_model_len - (uint32_t)(n - 1);
  if (bh_api_parse(&c, BH_API_COMPLETIONS, small, sl, out, err) < 0)
    goto out;
  if (out->n_tokens != 1 || out->tokens[0] != 0) { /* not ours after all */
    bh_api_req_free(out);
    goto out;
  }
  free(out->tokens);
  out->tokens = ids;
  out->n_tokens = n;
  ids = NULL;
  rc = 0;
out:
  free(small);
  free(ids);
  return rc;
}

int bh_api_parse_fast(const bh_api_cfg *cfg, bh_api_kind kind,
                      const char *body, size_t len, bh_api_req *out,
                      bh_api_err *err) {
  if (kind == BH_API_COMPLETIONS && len > 0 &&
      fast(cfg, body, len, out, err) == 0)
    return 0;
  return bh_api_parse(cfg, kind, body, len, out, err);
}
