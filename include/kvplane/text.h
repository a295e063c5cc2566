/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane text (core/text): the one writer behind the text kvplane emits --
 * JSON receipts and lines, Prometheus exposition, reason strings -- so that
 * escaping and numbers agree everywhere.
 *
 * A kvp_text appends either into a caller's buffer with snprintf semantics
 * (at most cap-1 bytes and a NUL; the length counts the whole text, so a
 * caller can grow the buffer and retry) or into a chunk that is handed to a
 * writer callback whenever it fills.
 *
 * Invariants: numbers are always written as the C locale writes them ('.' as
 * the decimal point), whatever LC_NUMERIC the host program set with
 * setlocale(); JSON strings are always valid JSON and valid UTF-8 (invalid
 * input bytes become U+FFFD); a writer's first error stops all later output.
 *
 * Thread safety: a kvp_text is used by one thread at a time; the functions
 * keep no other state (the C locale object is created once, thread-safely). */
#ifndef KVPLANE_TEXT_H
#define KVPLANE_TEXT_H

#include <stdarg.h>

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Receives text in pieces; return < 0 to stop (kvp_text_flush and the
 * exporting call return that value).  `data` is valid only during the call
 * and is not NUL-terminated. */
typedef int (*kvp_write_fn)(void *opaque, const char *data, size_t len);

/* Fields are private: use the functions.  On the caller's stack; owns
 * nothing (the buffer or chunk is the caller's and must outlive it). */
typedef struct kvp_text {
  char *buf;        /* the caller's buffer, or the chunk */
  size_t cap;       /* its size in bytes */
  size_t len;       /* bytes of text so far (buffer mode: may exceed cap) */
  size_t fill;      /* writer mode: bytes pending in the chunk */
  kvp_write_fn fn;  /* NULL: buffer mode */
  void *opaque;
  int err;          /* writer mode: the writer's first error */
  uint32_t reserved;
} kvp_text;

/* Buffer mode, snprintf-like: buf may be NULL only when cap is 0; when
 * cap > 0 the buffer is NUL-terminated after every call. */
KVP_API void kvp_text_init(kvp_text *t, char *buf, size_t cap);
/* Writer mode: text collects in chunk[0..cap) (cap >= 1) and goes to fn
 * whenever the chunk is full and at kvp_text_flush. */
KVP_API void kvp_text_init_writer(kvp_text *t, kvp_write_fn fn, void *opaque,
                                  char *chunk, size_t cap);
/* Writer mode: hands over what is pending.  Returns 0 or the writer's first
 * error (buffer mode: 0). */
KVP_API int kvp_text_flush(kvp_text *t);
/* Bytes of text appended so far, without the NUL (buffer mode: the length
 * the whole text needs, >= cap when it was truncated). */
KVP_API size_t kvp_text_len(const kvp_text *t);

KVP_API void kvp_text_put(kvp_text *t, const char *s, size_t n);
KVP_API void kvp_text_puts(kvp_text *t, const char *s);
/* printf in the C locale ("%.3g" of 0.5 is "0.5" under de_DE too). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
KVP_API void kvp_text_printf(kvp_text *t, const char *fmt, ...);
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 0)))
#endif
KVP_API void kvp_text_vprintf(kvp_text *t, const char *fmt, va_list ap);
KVP_API void kvp_text_u64(kvp_text *t, uint64_t v);
/* The shortest of %.15g / %.17g that reads back as v, in the C locale;
 * non-finite values as kvp_text_json_num / kvp_text_prom_num say.  buf gets
 * at most cap-1 bytes and a NUL (32 bytes always suffice). */
KVP_API void kvp_text_fmt_double(char *buf, size_t cap, double v);

/* ---- JSON (RFC 8259) ---- */
/* A JSON string: quotes; '"', '\\' and every control character escaped
 * (\n \r \t short, the rest and DEL as \u00XX); valid UTF-8 as is,
 * each invalid byte as \ufffd.  NULL is written as null. */
KVP_API void kvp_text_json_str(kvp_text *t, const char *s);
/* A JSON number as kvp_text_fmt_double writes it; NaN and infinities (which
 * JSON cannot spell) as null. */
KVP_API void kvp_text_json_num(kvp_text *t, double v);

/* ---- Prometheus text format 0.0.4 ---- */
/* A label value (without its quotes): '\\', '"' and newline escaped, the
 * rest (UTF-8) as is. */
KVP_API void kvp_text_prom_label(kvp_text *t, const char *s);
/* A sample value: as kvp_text_fmt_double, or NaN, +Inf, -Inf. */
KVP_API void kvp_text_prom_num(kvp_text *t, double v);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_TEXT_H */
