/* SPDX-License-Identifier: Apache-2.0 */
/* The text writer (kvplane/text.h): snprintf-style buffer or chunked writer,
 * JSON strings and numbers, Prometheus labels and values, all in the C
 * locale. */
#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_internal.h"
#include "kvplane/text.h"

/* ---- the C locale --------------------------------------------------------
 * printf's decimal point follows LC_NUMERIC, which a host program may have
 * set to a comma-decimal locale with setlocale(LC_ALL, ""); JSON and
 * Prometheus need '.', so every number is formatted under a per-thread
 * switch to this locale object (uselocale), which leaves the host's global
 * and per-thread settings as they were. */
static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static void c_locale_init(void) {
  c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
}

static locale_t c_locale_enter(void) {
  pthread_once(&c_locale_once, c_locale_init);
  return c_locale ? uselocale(c_locale) : (locale_t)0;
}

static void c_locale_leave(locale_t old) {
  if (old)
    uselocale(old);
}

/* ---- the writer ---------------------------------------------------------- */
void kvp_text_init(kvp_text *t, char *buf, size_t cap) {
  memset(t, 0, sizeof *t);
  t->buf = cap > 0 ? buf : NULL;
  t->cap = t->buf != NULL ? cap : 0;
  if (t->cap > 0)
    t->buf[0] = '\0';
}

void kvp_text_init_writer(kvp_text *t, kvp_write_fn fn, void *opaque,
                          char *chunk, size_t cap) {
  memset(t, 0, sizeof *t);
  t->buf = chunk, t->cap = cap, t->fn = fn, t->opaque = opaque;
}

int kvp_text_flush(kvp_text *t) {
  if (t->fn != NULL && t->fill > 0 && t->err == 0) {
    int rc = t->fn(t->opaque, t->buf, t->fill);
    if (rc < 0)
      t->err = rc;
  }
  t->fill = 0;
  return t->err;
}

size_t kvp_text_len(const kvp_text *t) { return t->len; }

static void put_chunked(kvp_text *t, const char *s, size_t n) {
  while (n > 0 && t->err == 0) {
    if (t->fill == t->cap)
      kvp_text_flush(t);
    size_t k = t->cap - t->fill < n ? t->cap - t->fill : n;
    memcpy(t->buf + t->fill, s, k);
    t->fill += k, t->len += k, s += k, n -= k;
  }
}

void kvp_text_put(kvp_text *t, const char *s, size_t n) {
  if (t->fn != NULL) {
    put_chunked(t, s, n);
    return;
  }
  if (t->len < t->cap) { /* room for cap-1 bytes and the NUL */
    size_t room = t->cap - 1 - t->len, k = n < room ? n : room;
    memcpy(t->buf + t->len, s, k);
    t->buf[t->len + k] = '\0';
  }
  t->len += n;
}

void kvp_text_puts(kvp_text *t, const char *s) {
  kvp_text_put(t, s, strlen(s));
}

/* Buffer mode formats in place (snprintf semantics for free); writer mode
 * through a stack buffer, or a heap one for the rare long text. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 0)))
#endif
static int vprintf_chunked(kvp_text *t, const char *fmt, va_list ap,
                           va_list ap2) {
  char tmp[256];
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  if (n > 0 && n < (int)sizeof tmp) {
    kvp_text_put(t, tmp, (size_t)n);
  } else if (n > 0) {
    kvp_allocator a = kvp__allocator(NULL);
    char *big = kvp__malloc(&a, (size_t)n + 1);
    if (big != NULL && vsnprintf(big, (size_t)n + 1, fmt, ap2) == n)
      kvp_text_put(t, big, (size_t)n);
    else if (t->err == 0)
      t->err = KVP_ENOMEM;
    if (big != NULL)
      kvp__free(&a, big, (size_t)n + 1);
  }
  return n;
}

void kvp_text_vprintf(kvp_text *t, const char *fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  locale_t old = c_locale_enter();
  if (t->fn != NULL) {
    vprintf_chunked(t, fmt, ap, ap2);
  } else {
    size_t room = t->len < t->cap ? t->cap - t->len : 0;
    int n = vsnprintf(room ? t->buf + t->len : NULL, room, fmt, ap);
    if (n > 0)
      t->len += (size_t)n;
  }
  c_locale_leave(old);
  va_end(ap2);
}

void kvp_text_printf(kvp_text *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kvp_text_vprintf(t, fmt, ap);
  va_end(ap);
}

void kvp_text_u64(kvp_text *t, uint64_t v) {
  char tmp[24], *p = tmp + sizeof tmp;
  do /* no printf: no locale, and this is the hottest number */
    *--p = (char)('0' + v % 10);
  while ((v /= 10) != 0);
  kvp_text_put(t, p, (size_t)(tmp + sizeof tmp - p));
}

/* ---- numbers ------------------------------------------------------------- */
void kvp_text_fmt_double(char *buf, size_t cap, double v) {
  if (!isfinite(v)) {
    snprintf(buf, cap, "%s", isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf");
    return;
  }
  locale_t old = c_locale_enter();
  snprintf(buf, cap, "%.15g", v);
  if (strtod(buf, NULL) != v)
    snprintf(buf, cap, "%.17g", v);
  c_locale_leave(old);
}

void kvp_text_json_num(kvp_text *t, double v) {
  char tmp[32];
  if (!isfinite(v)) {
    kvp_text_put(t, "null", 4);
    return;
  }
  kvp_text_fmt_double(tmp, sizeof tmp, v);
  kvp_text_puts(t, tmp);
}

void kvp_text_prom_num(kvp_text *t, double v) {
  char tmp[32];
  kvp_text_fmt_double(tmp, sizeof tmp, v);
  kvp_text_puts(t, tmp);
}

/* ---- strings ------------------------------------------------------------- */
/* Length of the valid UTF-8 sequence at p (lead byte >= 0x80), or 0.  Reads
 * no further than the first byte that is not a continuation (the NUL is
 * not), so a truncated sequence at the end of a string is safe. */
static size_t utf8_seq(const unsigned char *p) {
  unsigned char c = p[0], lo = 0x80, hi = 0xbf;
  size_t n = c >= 0xc2 && c <= 0xdf   ? 2
             : c >= 0xe0 && c <= 0xef ? 3
             : c >= 0xf0 && c <= 0xf4 ? 4
                                      : 0;
  if (c == 0xe0)
    lo = 0xa0; /* overlong */
  else if (c == 0xed)
    hi = 0x9f; /* surrogates */
  else if (c == 0xf0)
    lo = 0x90; /* overlong */
  else if (c == 0xf4)
    hi = 0x8f; /* > U+10FFFF */
  for (size_t i = 1; i < n; i++, lo = 0x80, hi = 0xbf)
    if (p[i] < lo || p[i] > hi)
      return 0;
  return n;
}

/* The escape for an ASCII byte, or NULL when it stands as is. */
static const char *json_escape(unsigned char c, char esc[8]) {
  switch (c) {
  case '"':
    return "\\\"";
  case '\\':
    return "\\\\";
  case '\n':
    return "\\n";
  case '\r':
    return "\\r";
  case '\t':
    return "\\t";
  default:
    break;
  }
  if (c >= 0x20 && c != 0x7f)
    return NULL;
  snprintf(esc, 8, "\\u%04x", c);
  return esc;
}

void kvp_text_json_str(kvp_text *t, const char *s) {
  if (s == NULL) {
    kvp_text_put(t, "null", 4);
    return;
  }
  kvp_text_put(t, "\"", 1);
  const unsigned char *p = (const unsigned char *)s, *run = p;
  while (*p != '\0') {
    char esc[8];
    const char *e = NULL;
    size_t adv = 1;
    if (*p >= 0x80 && (adv = utf8_seq(p)) == 0)
      e = "\\ufffd", adv = 1;
    else if (*p < 0x80)
      e = json_escape(*p, esc);
    if (e == NULL) {
      p += adv;
      continue;
    }
    kvp_text_put(t, (const char *)run, (size_t)(p - run));
    kvp_text_puts(t, e);
    run = p += adv;
  }
  kvp_text_put(t, (const char *)run, (size_t)(p - run));
  kvp_text_put(t, "\"", 1);
}

void kvp_text_prom_label(kvp_text *t, const char *s) {
  const char *run = s;
  for (;; s++) {
    const char *esc = *s == '\\'   ? "\\\\"
                      : *s == '"'  ? "\\\""
                      : *s == '\n' ? "\\n"
                                   : NULL;
    if (esc == NULL && *s != '\0')
      continue;
    kvp_text_put(t, run, (size_t)(s - run));
    if (*s == '\0')
      return;
    kvp_text_puts(t, esc);
    run = s + 1;
  }
}
