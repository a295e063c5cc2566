/* SPDX-License-Identifier: Apache-2.0 */
/* Token-id text reader; see cli_tokens.h.  It reads a character at a time
 * and keeps the position of the last one, so that an error can name the
 * exact line and column; ids collect in one fixed batch. */
#include "cli_tokens.h"

#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <string.h>

#include "kvplane.h"

#if defined(__GNUC__) || defined(__clang__)
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

typedef struct reader {
  FILE *f;
  const char *name;
  size_t line, col; /* of the character last read, 1-based */
  size_t count;     /* tokens read */
  bool json;        /* inside "[ ... ]" */
  cli_tokens_fn fn;
  void *arg;
  char *why;
  size_t cap;
  uint32_t batch[CLI_TOKENS_BATCH];
  size_t n;
} reader;

static int next_char(reader *r) {
  int c = getc(r->f);
  if (c == '\n') {
    r->line++;
    r->col = 0;
  } else if (c != EOF) {
    r->col++;
  }
  return c;
}

static bool is_blank(int c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' ||
         c == '\v';
}

static int skip_blanks(reader *r) {
  int c;
  while ((c = next_char(r)) != EOF && is_blank(c))
    ;
  return c;
}

/* Strict decimal in 0..UINT32_MAX: no sign, blanks or other text.  NUL
 * bytes never reach it: read_token replaces them with '?' so "12\0x" is an
 * error, not 12. */
static bool parse_id(const char *s, uint32_t *out) {
  uint64_t x = 0;
  if (*s == '\0')
    return false;
  for (; *s != '\0'; s++) {
    unsigned d = (unsigned)(*s - '0');
    if (d > 9 || (x = x * 10 + d) > UINT32_MAX)
      return false;
  }
  *out = (uint32_t)x;
  return true;
}

/* Writes "NAME:LINE:COL: ..." (or "NAME: ..." when line is 0: end-of-input
 * errors never had a position) and returns rc, so callers can return it. */
PRINTF_LIKE(5, 6)
static int fail_at(reader *r, int rc, size_t line, size_t col,
                   const char *fmt, ...) {
  va_list ap;
  int n = line > 0 ? snprintf(r->why, r->cap, "%s:%zu:%zu: ", r->name, line,
                              col)
                   : snprintf(r->why, r->cap, "%s: ", r->name);
  if (n < 0 || (size_t)n >= r->cap)
    return rc;
  va_start(ap, fmt);
  vsnprintf(r->why + n, r->cap - (size_t)n, fmt, ap);
  va_end(ap);
  return rc;
}

static int flush_batch(reader *r) {
  int rc = r->n > 0 ? r->fn(r->arg, r->batch, r->n) : 0;
  r->n = 0;
  if (rc < 0)
    return fail_at(r, rc, 0, 0, "stopped after token %zu: the callback "
                   "returned %d (%s)", r->count, rc, kvp_err_name(rc));
  return 0;
}

/* One token starting with `c`; returns the character after it, and the
 * outcome in *rc. */
static int read_token(reader *r, int c, int *rc) {
  char text[28];
  size_t len = 0, line = r->line, col = r->col;
  uint32_t id;
  for (; c != EOF && !is_blank(c) && c != ',' && !(r->json && c == ']');
       c = next_char(r)) {
    if (len < sizeof text - 4) {
      text[len++] = c == '\0' ? '?' : (char)c; /* a NUL would end the text */
    } else if (len == sizeof text - 4) { /* too long to be an id: cut it */
      memcpy(text + len, "...", 3);
      len += 3;
    }
  }
  text[len] = '\0';
  r->count++;
  if (!parse_id(text, &id)) {
    *rc = fail_at(r, KVP_ECORRUPT, line, col, "token %zu \"%s\" is not a "
                  "token id (expected an integer 0..4294967295)", r->count,
                  text);
    return c;
  }
  r->batch[r->n++] = id;
  *rc = r->n == CLI_TOKENS_BATCH ? flush_batch(r) : 0;
  return c;
}

/* What may follow the last token: EOF, or "]" and blanks in JSON mode. */
static int read_end(reader *r, int c, bool after_comma) {
  if (ferror(r->f)) /* getc() says EOF on errors too: do not hash a prefix */
    return fail_at(r, -EIO, r->line, r->col, "read error after token %zu",
                   r->count);
  if (after_comma)
    return fail_at(r, KVP_ECORRUPT, 0, 0,
                   "a token id must follow the last ','");
  if (r->json && c != ']')
    return fail_at(r, KVP_ECORRUPT, 0, 0,
                   "the JSON array lacks its closing ']'");
  if (r->json && skip_blanks(r) != EOF)
    return fail_at(r, KVP_ECORRUPT, r->line, r->col,
                   "unexpected text after ']'");
  return flush_batch(r);
}

static int read_all(reader *r) {
  bool after_comma = false, first = true;
  int c = skip_blanks(r), rc = 0;
  if (c == '[') {
    r->json = true;
    c = skip_blanks(r);
  }
  while (rc == 0) {
    while (is_blank(c))
      c = next_char(r);
    if (c == EOF || (r->json && c == ']'))
      return read_end(r, c, after_comma);
    if (c == ',') {
      if (first || after_comma)
        return fail_at(r, KVP_ECORRUPT, r->line, r->col,
                       "',' without a token id before it");
      after_comma = true;
      c = next_char(r);
      continue;
    }
    c = read_token(r, c, &rc);
    after_comma = first = false;
  }
  return rc;
}

int cli_tokens_read(FILE *f, const char *name, cli_tokens_fn fn, void *arg,
                    char *why, size_t cap) {
  assert(f != NULL && fn != NULL && name != NULL);
  /* 16 KiB with its batch: on the stack, as in the tool before, so that the
   * reader allocates nothing and cannot leak */
  reader r = {.f = f, .name = name, .line = 1, .fn = fn, .arg = arg,
              .why = why, .cap = why != NULL ? cap : 0};
  if (r.cap > 0)
    why[0] = '\0';
  return read_all(&r);
}
