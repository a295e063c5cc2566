/* SPDX-License-Identifier: Apache-2.0 */
/* Vector-file reader (jansson) and checker; see cli_vectors.h.  The one
 * subtle part is reading external_u64 exactly: see "exact integers" below. */
#include "cli_vectors.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

/* ---- memory: the caller's kvp_allocator, or libc ----------------------------
 * A connector sees only the public API, so not core's helpers: these follow
 * kvp_allocator's contract (sizes handed back to free) over the struct. */
static kvp_allocator resolve_alloc(const kvp_allocator *a) {
  return a != NULL && a->alloc != NULL ? *a : (kvp_allocator){0};
}

/* 0 bytes become 1, so that "allocated" and "NULL" stay apart. */
static void *mem_alloc(const kvp_allocator *a, size_t n) {
  n = n > 0 ? n : 1;
  return a->alloc != NULL ? a->alloc(a->opaque, n) : malloc(n);
}

static void mem_free(const kvp_allocator *a, void *p, size_t n) {
  if (p == NULL)
    return;
  if (a->alloc != NULL)
    a->free(a->opaque, p, n > 0 ? n : 1);
  else
    free(p);
}

static void *mem_calloc(const kvp_allocator *a, size_t n, size_t size) {
  size_t bytes;
  if (__builtin_mul_overflow(n, size, &bytes))
    return NULL;
  void *p = mem_alloc(a, bytes);
  if (p != NULL)
    memset(p, 0, bytes);
  return p;
}

/* Copies min(old, new) bytes; on failure p is untouched. */
static void *mem_realloc(const kvp_allocator *a, void *p, size_t old_size,
                         size_t new_size) {
  void *q = mem_alloc(a, new_size);
  if (q != NULL && p != NULL) {
    memcpy(q, p, old_size < new_size ? old_size : new_size);
    mem_free(a, p, old_size);
  }
  return q;
}

#if defined(__GNUC__) || defined(__clang__)
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

/* ---- exact integers ---------------------------------------------------------
 * jansson keeps integers as json_int_t (int64) and refuses larger literals
 * ("too big integer"); JSON_DECODE_INT_AS_REAL would round them to doubles.
 * external_u64 runs up to 2^64-1, so before jansson sees the text, a pre-scan
 * rewrites every integer literal outside int64 that stands in a value position
 * into the string "\u0000<literal>".  No string of the input can start that
 * way, because the pre-scan refuses \u0000 escapes (as jansson does by
 * default), so such a string is always a rewritten number: the typed getters
 * read it back digit by digit, exactly, and range-check it per field.  A
 * literal where a key belongs is left alone, so the rewrite never turns
 * invalid JSON into valid JSON. */
#define MARK_OPEN "\"\\u0000"
#define MARK_OPEN_LEN 7u
#define MARK_EXTRA 8u   /* MARK_OPEN and the closing quote */
#define DEPTH_MAX 2048u /* jansson's JSON_PARSER_MAX_DEPTH */

typedef struct prescan {
  const char *s;
  size_t n;
  char *out; /* NULL on the counting pass */
  size_t out_len;
  size_t copied;  /* s[0..copied) is in out */
  size_t *marks;  /* where each rewrite starts in out (error positions) */
  size_t n_big;   /* literals rewritten */
  size_t depth;
  uint8_t is_array[DEPTH_MAX / 8]; /* one bit per open container */
  char prev; /* last structural character; 'v' after a scalar */
} prescan;

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static bool value_position(const prescan *ps) {
  if (ps->prev == ':' || ps->prev == '[')
    return true;
  if (ps->prev != ',' || ps->depth == 0)
    return false;
  size_t d = ps->depth - 1;
  return (ps->is_array[d / 8] >> (d % 8)) & 1;
}

static bool fits_int64(const char *digits, size_t len, bool neg) {
  if (len != 19)
    return len < 19;
  return memcmp(digits, neg ? "9223372036854775808" : "9223372036854775807",
                19) <= 0;
}

static void rewrite(prescan *ps, size_t start, size_t end) {
  if (ps->out != NULL) {
    memcpy(ps->out + ps->out_len, ps->s + ps->copied, start - ps->copied);
    ps->out_len += start - ps->copied;
    ps->marks[ps->n_big] = ps->out_len;
    memcpy(ps->out + ps->out_len, MARK_OPEN, MARK_OPEN_LEN);
    ps->out_len += MARK_OPEN_LEN;
    memcpy(ps->out + ps->out_len, ps->s + start, end - start);
    ps->out_len += end - start;
    ps->out[ps->out_len++] = '"';
    ps->copied = end;
  }
  ps->n_big++;
}

/* s[*i] starts a number ('-' or a digit). */
static void scan_number(prescan *ps, size_t *i) {
  size_t start = *i, j = *i;
  bool neg = ps->s[j] == '-';
  size_t d0 = j += neg;
  while (j < ps->n && is_digit(ps->s[j]))
    j++;
  size_t nd = j - d0;
  bool integer = nd > 0 && !(ps->s[d0] == '0' && nd > 1) &&
                 !(j < ps->n && (ps->s[j] == '.' || ps->s[j] == 'e' ||
                                 ps->s[j] == 'E'));
  if (integer && value_position(ps) && !fits_int64(ps->s + d0, nd, neg))
    rewrite(ps, start, j);
  /* the rest of a real: its digits are not numbers of their own */
  while (j < ps->n && (is_digit(ps->s[j]) || ps->s[j] == '.' ||
                       ps->s[j] == 'e' || ps->s[j] == 'E' ||
                       ps->s[j] == '+' || ps->s[j] == '-'))
    j++;
  *i = j;
  ps->prev = 'v';
}

/* s[*i] is '"'. */
static int skip_string(prescan *ps, size_t *i, char *why, size_t cap) {
  size_t j = *i + 1;
  while (j < ps->n && ps->s[j] != '"') {
    if (ps->s[j] == '\\') {
      if (j + 5 < ps->n && memcmp(ps->s + j + 1, "u0000", 5) == 0) {
        snprintf(why, cap, "byte %zu: \\u0000 (NUL) in a string is not "
                 "supported", j);
        return KVP_ECORRUPT;
      }
      j++; /* the escaped character, '"' and '\\' included */
    }
    j++;
  }
  *i = j < ps->n ? j + 1 : ps->n;
  ps->prev = 'v';
  return 0;
}

static int open_container(prescan *ps, bool array, size_t at, char *why,
                          size_t cap) {
  if (ps->depth == DEPTH_MAX) {
    snprintf(why, cap, "byte %zu: nested deeper than %u levels", at,
             DEPTH_MAX);
    return KVP_ECORRUPT;
  }
  size_t d = ps->depth++;
  if (array)
    ps->is_array[d / 8] |= (uint8_t)(1u << (d % 8));
  else
    ps->is_array[d / 8] &= (uint8_t)~(1u << (d % 8));
  return 0;
}

/* Counts (out == NULL) or performs the rewrites.  Errors only on what jansson
 * would refuse anyway. */
static int prescan_run(prescan *ps, char *why, size_t cap) {
  size_t i = 0;
  while (i < ps->n) {
    char c = ps->s[i];
    int rc = 0;
    if (c == '"') {
      rc = skip_string(ps, &i, why, cap);
    } else if (c == '-' || is_digit(c)) {
      scan_number(ps, &i);
    } else {
      if (c == '{' || c == '[')
        rc = open_container(ps, c == '[', i, why, cap);
      else if ((c == '}' || c == ']') && ps->depth > 0)
        ps->depth--;
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
        ps->prev = c;
      i++;
    }
    if (rc < 0)
      return rc;
  }
  if (ps->out != NULL) {
    memcpy(ps->out + ps->out_len, ps->s + ps->copied, ps->n - ps->copied);
    ps->out_len += ps->n - ps->copied;
  }
  return 0;
}

static int decode(const char *text, size_t len, size_t flags,
                  const size_t *marks, size_t n_marks, json_t **out,
                  char *why, size_t cap) {
  json_error_t e;
  *out = json_loadb(text, len, flags | JSON_REJECT_DUPLICATES, &e);
  if (*out != NULL)
    return 0;
  if (json_error_code(&e) == json_error_out_of_memory) {
    snprintf(why, cap, "out of memory parsing JSON");
    return KVP_ENOMEM;
  }
  if (e.position < 0) {
    snprintf(why, cap, "not valid JSON: %s", e.text);
    return KVP_ECORRUPT;
  }
  /* report the byte offset in the caller's text, before the rewrites */
  size_t pos = (size_t)e.position, shift = 0;
  for (size_t k = 0; k < n_marks && marks[k] < pos; k++)
    shift += MARK_EXTRA;
  snprintf(why, cap, "not valid JSON at line %d, byte %zu: %s", e.line,
           pos > shift ? pos - shift : 0, e.text);
  return KVP_ECORRUPT;
}

static int load_json(const char *buf, size_t len, const kvp_allocator *a,
                     json_t **out, char *why, size_t cap) {
  prescan ps = {.s = buf, .n = len};
  int rc = prescan_run(&ps, why, cap);
  if (rc < 0 || ps.n_big == 0)
    return rc < 0 ? rc : decode(buf, len, 0, NULL, 0, out, why, cap);

  size_t n_big = ps.n_big, text_cap = len + n_big * MARK_EXTRA;
  char *text = mem_alloc(a, text_cap);
  size_t *marks = mem_calloc(a, n_big, sizeof *marks);
  rc = KVP_ENOMEM;
  if (text == NULL || marks == NULL) {
    snprintf(why, cap, "out of memory");
    goto out;
  }
  ps = (prescan){.s = buf, .n = len, .out = text, .marks = marks};
  rc = prescan_run(&ps, why, cap); /* same input: cannot fail now */
  if (rc == 0) {
    assert(ps.n_big == n_big && ps.out_len <= text_cap);
    rc = decode(text, ps.out_len, JSON_ALLOW_NUL, marks, n_big, out, why,
                cap);
  }
out:
  mem_free(a, marks, n_big * sizeof *marks);
  mem_free(a, text, text_cap);
  return rc;
}

/* ---- typed reading with errors that name the case and the field ------------ */
typedef struct reader {
  char *why;
  size_t cap;
  bool in_case;
  size_t case_i;
  kvp_allocator a;
  char prefix[64]; /* "" or "blocks[2]." ... */
  char name[128];  /* prefix + key of the field being read */
} reader;

PRINTF_LIKE(3, 4)
static int failc(reader *r, int rc, const char *fmt, ...) {
  int off = 0;
  if (r->in_case)
    off = snprintf(r->why, r->cap, "case %zu: ", r->case_i);
  if (off < 0 || (size_t)off >= r->cap)
    return rc;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->why + off, r->cap - (size_t)off, fmt, ap);
  va_end(ap);
  return rc;
}
#define fail(r, ...) failc(r, KVP_ECORRUPT, __VA_ARGS__)

PRINTF_LIKE(2, 3)
static const char *set_prefix(reader *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->prefix, sizeof r->prefix, fmt, ap);
  va_end(ap);
  return r->prefix;
}

static const char *name_of(reader *r, const char *key) {
  snprintf(r->name, sizeof r->name, "%s%s", r->prefix, key);
  return r->name;
}

/* A rewritten out-of-int64 integer (see "exact integers"). */
static bool is_mark(const json_t *v) {
  return json_is_string(v) && json_string_length(v) > 0 &&
         json_string_value(v)[0] == '\0';
}

static bool is_text(const json_t *v) { return json_is_string(v) && !is_mark(v); }

static const char *type_name(const json_t *v) {
  switch (json_typeof(v)) {
  case JSON_OBJECT: return "an object";
  case JSON_ARRAY: return "an array";
  case JSON_STRING: return is_mark(v) ? "an integer" : "a string";
  case JSON_INTEGER: return "an integer";
  case JSON_REAL: return "a real number";
  case JSON_TRUE: return "true";
  case JSON_FALSE: return "false";
  case JSON_NULL: return "null";
  }
  return "an unknown JSON type";
}

static int lookup(reader *r, const json_t *obj, const char *key, json_t **v) {
  *v = json_object_get(obj, key);
  return *v != NULL ? 0 : fail(r, "%s: missing", name_of(r, key));
}

/* Decimal digits (as the pre-scan left them) to u64; false past 2^64-1. */
static bool parse_u64(const char *d, uint64_t *out) {
  uint64_t x = 0;
  if (*d == '\0' || *d == '-')
    return false;
  for (; *d != '\0'; d++) {
    unsigned dig = (unsigned)(*d - '0');
    if (dig > 9 || x > (UINT64_MAX - dig) / 10)
      return false;
    x = x * 10 + dig;
  }
  *out = x;
  return true;
}

static int uint_value(reader *r, const json_t *v, const char *name,
                      uint64_t min, uint64_t max, uint64_t *out) {
  char text[32];
  if (json_is_integer(v)) {
    json_int_t x = json_integer_value(v);
    if (x >= 0 && (uint64_t)x >= min && (uint64_t)x <= max) {
      *out = (uint64_t)x;
      return 0;
    }
    snprintf(text, sizeof text, "%" JSON_INTEGER_FORMAT, x);
  } else if (is_mark(v)) {
    const char *d = json_string_value(v) + 1;
    if (parse_u64(d, out) && *out >= min && *out <= max)
      return 0;
    snprintf(text, sizeof text, "%.24s%s", d, strlen(d) > 24 ? "..." : "");
  } else {
    return fail(r, "%s: expected an integer, got %s", name, type_name(v));
  }
  return fail(r, "%s: %s is out of range %" PRIu64 "..%" PRIu64, name, text,
              min, max);
}

static int read_uint(reader *r, const json_t *obj, const char *key,
                     uint64_t min, uint64_t max, uint64_t *out) {
  json_t *v;
  int rc = lookup(r, obj, key, &v);
  return rc < 0 ? rc : uint_value(r, v, name_of(r, key), min, max, out);
}

/* A string (or null when `nullable`: *out = NULL), copied. */
static int read_str(reader *r, const json_t *obj, const char *key,
                    bool nullable, char **out) {
  json_t *v;
  int rc = lookup(r, obj, key, &v);
  if (rc < 0 || (nullable && json_is_null(v)))
    return rc;
  if (!is_text(v))
    return fail(r, "%s: expected a string%s, got %s", name_of(r, key),
                nullable ? " or null" : "", type_name(v));
  size_t len = json_string_length(v); /* no NUL inside: pre-scan */
  *out = mem_alloc(&r->a, len + 1);
  if (*out == NULL)
    return failc(r, KVP_ENOMEM, "%s: out of memory", name_of(r, key));
  memcpy(*out, json_string_value(v), len + 1);
  return 0;
}

/* As read_str with nullable, but the key may be missing too (*out NULL). */
static int read_opt_str(reader *r, const json_t *obj, const char *key,
                        char **out) {
  if (json_object_get(obj, key) == NULL)
    return 0;
  return read_str(r, obj, key, true, out);
}

/* An array or null, kept as compact JSON text in r->a's memory; a missing
 * key is an error when `required`, else *out stays NULL. */
static int read_json_text(reader *r, const json_t *obj, const char *key,
                          bool required, char **out) {
  const size_t flags = JSON_COMPACT | JSON_ENCODE_ANY;
  json_t *v = json_object_get(obj, key);
  if (v == NULL)
    return required ? fail(r, "%s: missing", name_of(r, key)) : 0;
  if (!json_is_array(v) && !json_is_null(v))
    return fail(r, "%s: expected an array or null, got %s", name_of(r, key),
                type_name(v));
  size_t n = json_dumpb(v, NULL, 0, flags);
  *out = n > 0 ? mem_alloc(&r->a, n + 1) : NULL;
  if (*out == NULL)
    return failc(r, KVP_ENOMEM, "%s: out of memory", name_of(r, key));
  json_dumpb(v, *out, n, flags);
  (*out)[n] = '\0';
  return 0;
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

static int read_hex(reader *r, const json_t *obj, const char *key,
                    size_t nbytes, uint8_t *out) {
  json_t *v;
  int rc = lookup(r, obj, key, &v);
  if (rc < 0)
    return rc;
  if (!is_text(v))
    return fail(r, "%s: expected a string of %zu hex digits, got %s",
                name_of(r, key), 2 * nbytes, type_name(v));
  const char *s = json_string_value(v);
  size_t len = json_string_length(v);
  if (len != 2 * nbytes)
    return fail(r, "%s: expected %zu hex digits, got %zu characters",
                name_of(r, key), 2 * nbytes, len);
  for (size_t k = 0; k < len; k += 2) {
    int hi = hex_digit(s[k]), lo = hex_digit(s[k + 1]);
    if (hi < 0 || lo < 0)
      return fail(r, "%s: character %zu is not a hex digit", name_of(r, key),
                  k + (hi >= 0));
    out[k / 2] = (uint8_t)(hi << 4 | lo);
  }
  return 0;
}

/* An array of at most `limit` entries (larger: KVP_ERANGE). */
static int read_array(reader *r, const json_t *obj, const char *key,
                      size_t limit, json_t **out) {
  int rc = lookup(r, obj, key, out);
  if (rc < 0)
    return rc;
  if (!json_is_array(*out))
    return fail(r, "%s: expected an array, got %s", name_of(r, key),
                type_name(*out));
  if (json_array_size(*out) > limit)
    return failc(r, KVP_ERANGE, "%s: %zu entries, more than the limit %zu",
                 name_of(r, key), json_array_size(*out), limit);
  return 0;
}

/* Zeroed; an empty array stays NULL (mem_alloc rounds 0 bytes up to 1, which
 * would then be freed with size 0). */
static int alloc_array(reader *r, size_t n, size_t size, const char *key,
                       void *out) {
  void *p = n > 0 ? mem_calloc(&r->a, n, size) : NULL;
  memcpy(out, &p, sizeof p);
  if (n > 0 && p == NULL)
    return failc(r, KVP_ENOMEM, "%s: out of memory", name_of(r, key));
  return 0;
}

/* ---- the case fields -------------------------------------------------------- */
static int read_algo(reader *r, const json_t *jc, cli_vector_case *c) {
  json_t *v;
  int rc = lookup(r, jc, "algo", &v);
  if (rc < 0)
    return rc;
  if (!is_text(v))
    return fail(r, "algo: expected a string, got %s", type_name(v));
  /* the file format names vLLM's algorithms, by vLLM's names: native keys
   * would need a namespace the format does not carry */
  const char *s = json_string_value(v);
  if (kvp_hash_algo_from_vllm(s, &c->algo) < 0)
    return fail(r, "algo: unknown algorithm \"%.40s\" (expected vLLM's "
                "sha256, sha256_cbor, xxhash or xxhash_cbor)", s);
  c->digest_len = kvp_hash_algo_digest_len(c->algo);
  return 0;
}

static bool is_digits(const char *s, size_t n) {
  for (size_t k = 0; k < n; k++)
    if (!is_digit(s[k]))
      return false;
  return n > 0 && n <= 9;
}

int cli_vllm_compat(const char *version, uint32_t *compat) {
  if (version == NULL)
    return -1;
  const char *dot = strchr(version, '.'), *end;
  if (dot == NULL || !is_digits(version, (size_t)(dot - version)))
    return -1;
  for (end = dot + 1; is_digit(*end); end++)
    ;
  /* then the end, a patch level, or a suffix: rc1, +cu128, -dev, .post1 */
  if (!is_digits(dot + 1, (size_t)(end - dot - 1)) ||
      !(*end == '\0' || *end == '.' || *end == '+' || *end == '-' ||
        (*end >= 'a' && *end <= 'z')))
    return -1;
  long major = strtol(version, NULL, 10), minor = strtol(dot + 1, NULL, 10);
  *compat = major > 0 || minor >= 33 ? KVP_VLLM_COMPAT_0_33
                                     : KVP_VLLM_COMPAT_PRE_0_33;
  return 0;
}

/* vllm_version (absent: the scheme of the files before it, pre-0.33), then
 * the seeds: pythonhashseed may be null from 0.33 on. */
static int read_version_seed(reader *r, const json_t *jc,
                             cli_vector_case *c) {
  char *version = NULL;
  int rc = read_opt_str(r, jc, "vllm_version", &version);
  if (rc < 0)
    return rc;
  c->vllm_compat = KVP_VLLM_COMPAT_PRE_0_33;
  if (version != NULL) {
    bool ok = cli_vllm_compat(version, &c->vllm_compat) == 0;
    if (!ok)
      rc = fail(r, "vllm_version: \"%.40s\" is not a version like "
                "\"0.33.0\"", version);
    mem_free(&r->a, version, strlen(version) + 1);
    if (rc < 0)
      return rc;
  }
  bool nullable = c->vllm_compat != KVP_VLLM_COMPAT_PRE_0_33;
  rc = read_str(r, jc, "pythonhashseed", nullable, &c->python_hash_seed);
  if (rc == 0)
    rc = read_opt_str(r, jc, "none_hash_seed", &c->none_hash_seed);
  return rc;
}

static int read_tokens(reader *r, const json_t *jc, cli_vector_case *c) {
  json_t *arr;
  int rc = read_array(r, jc, "token_ids", CLI_VECTORS_MAX_TOKENS, &arr);
  if (rc < 0)
    return rc;
  size_t n = json_array_size(arr);
  if ((rc = alloc_array(r, n, sizeof *c->tokens, "token_ids", &c->tokens)) < 0)
    return rc;
  c->n_tokens = n;
  for (size_t i = 0; i < n; i++) {
    uint64_t t;
    snprintf(r->name, sizeof r->name, "token_ids[%zu]", i);
    rc = uint_value(r, json_array_get(arr, i), r->name, 0, UINT32_MAX, &t);
    if (rc < 0)
      return rc;
    c->tokens[i] = (uint32_t)t;
  }
  return 0;
}

static int read_span(reader *r, const json_t *jm, kvp_mm_span *m) {
  char *id = NULL;
  int rc;
  if (!json_is_object(jm))
    return fail(r, "%.*s: expected an object, got %s",
                (int)strlen(r->prefix) - 1, r->prefix, type_name(jm));
  if ((rc = read_str(r, jm, "identifier", false, &id)) < 0)
    return rc;
  m->id = id;
  if ((rc = read_uint(r, jm, "offset", 0, UINT64_MAX, &m->offset)) < 0)
    return rc;
  return read_uint(r, jm, "length", 0, UINT64_MAX, &m->length);
}

static int read_mm(reader *r, const json_t *jc, cli_vector_case *c) {
  json_t *arr;
  int rc = read_array(r, jc, "mm_placeholders", CLI_VECTORS_MAX_MM, &arr);
  if (rc < 0)
    return rc;
  size_t n = json_array_size(arr);
  if ((rc = alloc_array(r, n, sizeof *c->mm, "mm_placeholders", &c->mm)) < 0)
    return rc;
  c->n_mm = n;
  for (size_t i = 0; i < n && rc == 0; i++) {
    set_prefix(r, "mm_placeholders[%zu].", i);
    rc = read_span(r, json_array_get(arr, i), &c->mm[i]);
  }
  set_prefix(r, "%s", "");
  return rc;
}

static int read_block(reader *r, const json_t *jb, const cli_vector_case *c,
                      cli_vector_block *b) {
  int rc;
  if (!json_is_object(jb))
    return fail(r, "%.*s: expected an object, got %s",
                (int)strlen(r->prefix) - 1, r->prefix, type_name(jb));
  if ((rc = read_hex(r, jb, "hash_hex", c->digest_len, b->digest)) < 0 ||
      (rc = read_uint(r, jb, "external_u64", 0, UINT64_MAX,
                      &b->external_u64)) < 0)
    return rc;
  /* the tuples vLLM hashed and published: the checker compares kvplane's */
  if ((rc = read_json_text(r, jb, "extra_keys", true, &b->extra_keys)) < 0)
    return rc;
  return read_json_text(r, jb, "event_extra_keys", false, &b->event_keys);
}

static int read_blocks(reader *r, const json_t *jc, cli_vector_case *c) {
  json_t *arr;
  int rc = read_array(r, jc, "blocks", CLI_VECTORS_MAX_TOKENS, &arr);
  if (rc < 0)
    return rc;
  size_t n = json_array_size(arr), want = c->n_tokens / c->block_size;
  if (n != want)
    return fail(r, "blocks: %zu entries, but token_ids holds %zu full blocks "
                "of %" PRIu32 " tokens", n, want, c->block_size);
  if ((rc = alloc_array(r, n, sizeof *c->blocks, "blocks", &c->blocks)) < 0)
    return rc;
  c->n_blocks = n;
  for (size_t i = 0; i < n && rc == 0; i++) {
    set_prefix(r, "blocks[%zu].", i);
    rc = read_block(r, json_array_get(arr, i), c, &c->blocks[i]);
  }
  set_prefix(r, "%s", "");
  return rc;
}

static int read_case(reader *r, const json_t *jc, cli_vector_case *c) {
  uint64_t bs;
  int rc;
  if (!json_is_object(jc))
    return fail(r, "expected an object, got %s", type_name(jc));
  if ((rc = read_algo(r, jc, c)) < 0 ||
      (rc = read_uint(r, jc, "block_size", 1, KVP_BLOCK_SIZE_MAX, &bs)) < 0)
    return rc;
  c->block_size = (uint32_t)bs;
  if ((rc = read_version_seed(r, jc, c)) < 0 ||
      (rc = read_str(r, jc, "cache_salt", true, &c->cache_salt)) < 0 ||
      (rc = read_str(r, jc, "lora_name", true, &c->lora_name)) < 0 ||
      (rc = read_opt_str(r, jc, "lora_path", &c->lora_path)) < 0 ||
      (rc = read_hex(r, jc, "none_hash_hex", c->digest_len,
                     c->none_hash)) < 0 ||
      (rc = read_tokens(r, jc, c)) < 0 || (rc = read_mm(r, jc, c)) < 0)
    return rc;
  return read_blocks(r, jc, c);
}

static int read_root(reader *r, const json_t *root, cli_vectors *v) {
  json_t *cases;
  if (!json_is_object(root))
    return fail(r, "top level: expected an object, got %s", type_name(root));
  int rc = read_array(r, root, "cases", CLI_VECTORS_MAX_CASES, &cases);
  if (rc < 0)
    return rc;
  size_t n = json_array_size(cases);
  if (n == 0)
    return fail(r, "cases: empty, nothing to check");
  if ((rc = alloc_array(r, n, sizeof *v->cases, "cases", &v->cases)) < 0)
    return rc;
  v->n_cases = n;
  for (size_t i = 0; i < n && rc == 0; i++) {
    r->in_case = true;
    r->case_i = v->cases[i].index = i;
    rc = read_case(r, json_array_get(cases, i), &v->cases[i]);
    v->n_blocks += v->cases[i].n_blocks;
  }
  return rc;
}

/* ---- the set ---------------------------------------------------------------- */
static void free_str(const kvp_allocator *a, const char *s) {
  if (s != NULL)
    mem_free(a, (char *)s, strlen(s) + 1);
}

static void free_case(const kvp_allocator *a, cli_vector_case *c) {
  free_str(a, c->python_hash_seed);
  free_str(a, c->none_hash_seed);
  free_str(a, c->cache_salt);
  free_str(a, c->lora_name);
  free_str(a, c->lora_path);
  for (size_t k = 0; k < c->n_blocks; k++) {
    free_str(a, c->blocks[k].extra_keys);
    free_str(a, c->blocks[k].event_keys);
  }
  for (size_t k = 0; k < c->n_mm; k++)
    free_str(a, c->mm[k].id);
  mem_free(a, c->mm, c->n_mm * sizeof *c->mm);
  mem_free(a, c->tokens, c->n_tokens * sizeof *c->tokens);
  mem_free(a, c->blocks, c->n_blocks * sizeof *c->blocks);
}

void cli_vectors_destroy(cli_vectors *v) {
  if (v == NULL)
    return;
  kvp_allocator a = v->alloc_;
  for (size_t i = 0; i < v->n_cases; i++)
    free_case(&a, &v->cases[i]);
  mem_free(&a, v->cases, v->n_cases * sizeof *v->cases);
  mem_free(&a, v, sizeof *v);
}

int cli_vectors_parse(const void *buf, size_t len, const kvp_allocator *alloc,
                      cli_vectors **out, char *why, size_t cap) {
  if (why == NULL)
    cap = 0;
  else if (cap > 0)
    why[0] = '\0';
  if (out == NULL || (buf == NULL && len > 0)) {
    snprintf(why, cap, "invalid argument");
    return KVP_EINVAL;
  }
  *out = NULL;
  if (len > CLI_VECTORS_MAX_BYTES) {
    snprintf(why, cap, "%zu bytes, more than the limit %u", len,
             CLI_VECTORS_MAX_BYTES);
    return KVP_ERANGE;
  }
  reader r = {.why = why, .cap = cap, .a = resolve_alloc(alloc)};
  json_t *root = NULL;
  cli_vectors *v = mem_calloc(&r.a, 1, sizeof *v);
  int rc = KVP_ENOMEM;
  snprintf(why, cap, "out of memory");
  if (v == NULL)
    goto err;
  v->alloc_ = r.a;
  if ((rc = load_json(len > 0 ? buf : "", len, &r.a, &root, why, cap)) < 0 ||
      (rc = read_root(&r, root, v)) < 0)
    goto err;
  json_decref(root);
  if (cap > 0)
    why[0] = '\0';
  *out = v;
  return 0;
err:
  json_decref(root);
  cli_vectors_destroy(v);
  return rc;
}

/* Reads all of f; KVP_ERANGE past CLI_VECTORS_MAX_BYTES (reading one byte
 * more than the limit tells "too large" from "exactly the limit"). */
static int slurp(FILE *f, const kvp_allocator *a, char **buf, size_t *len,
                 size_t *size) {
  const size_t limit = (size_t)CLI_VECTORS_MAX_BYTES + 1;
  size_t n = 0, cap = 1 << 16, got = 1;
  char *p = mem_alloc(a, cap);
  while (p != NULL && got > 0 && n < limit) {
    if (n == cap) {
      size_t ncap = cap * 2 < limit ? cap * 2 : limit;
      char *q = mem_realloc(a, p, cap, ncap);
      if (q == NULL)
        mem_free(a, p, cap);
      p = q, cap = ncap;
      continue;
    }
    got = fread(p + n, 1, cap - n, f);
    n += got;
  }
  if (p == NULL)
    return KVP_ENOMEM;
  int rc = ferror(f) ? (errno ? -errno : KVP_EIO) : n >= limit ? KVP_ERANGE : 0;
  if (rc < 0) {
    mem_free(a, p, cap);
    return rc;
  }
  *buf = p, *len = n, *size = cap;
  return 0;
}

int cli_vectors_load(const char *path, const kvp_allocator *alloc,
                     cli_vectors **out, char *why, size_t cap) {
  char inner[512], *buf = NULL;
  size_t len = 0, size = 0;
  kvp_allocator a = resolve_alloc(alloc);
  if (why == NULL)
    cap = 0;
  if (path == NULL || out == NULL) {
    snprintf(why, cap, "invalid argument");
    return KVP_EINVAL;
  }
  *out = NULL;
  FILE *f = fopen(path, "rb");
  int rc = f != NULL ? 0 : -errno;
  if (f != NULL) {
    errno = 0;
    rc = slurp(f, &a, &buf, &len, &size);
    fclose(f);
  }
  if (rc == KVP_ERANGE)
    snprintf(inner, sizeof inner, "larger than the limit of %u bytes",
             CLI_VECTORS_MAX_BYTES);
  else if (rc < 0)
    snprintf(inner, sizeof inner, "%s", kvp_strerror(rc));
  else
    rc = cli_vectors_parse(buf, len, &a, out, inner, sizeof inner);
  if (rc < 0)
    snprintf(why, cap, "%s: %s", path, inner);
  mem_free(&a, buf, size);
  return rc;
}

/* ---- the checker --------------------------------------------------------------- */
static void to_hex(const uint8_t *b, size_t n, char *out) {
  static const char digits[] = "0123456789abcdef";
  for (size_t k = 0; k < n; k++) {
    out[2 * k] = digits[b[k] >> 4];
    out[2 * k + 1] = digits[b[k] & 15];
  }
  out[2 * n] = '\0';
}

static uint64_t load_be64(const uint8_t *p) {
  uint64_t x = 0;
  for (int k = 0; k < 8; k++)
    x = x << 8 | p[k];
  return x;
}

/* What one check needs besides the case: the library's results. */
typedef struct check_ctx {
  const cli_vector_case *c;
  kvp_hasher *h;
  const kvp_chain *ch;
  const kvp_key *oneshot;
  kvp_extras ex;
  kvp_mm_key *mm; /* room for every placeholder */
} check_ctx;

static json_t *hex_json(const uint8_t *b, size_t n) {
  char hex[2 * 32 + 1];
  to_hex(b, n, hex);
  return json_string(hex);
}

/* One key of a block as the vector files write it (JSON lists for tuples,
 * bytes as hex): vLLM 0.33's tagged form, or the untagged one of earlier
 * releases and of KV events. */
static json_t *key_json(bool tagged, const char *tag, json_t *a, json_t *b) {
  if (tagged)
    return b != NULL ? json_pack("[soo]", tag, a, b)
                     : json_pack("[so]", tag, a);
  return b != NULL ? json_pack("[oo]", a, b) : a;
}

/* The block's extra keys, NULL when jansson is out of memory. */
static json_t *keys_json(const kvp_block_extras *bx, bool tagged) {
  json_t *keys = json_array();
  const char *path = bx->lora_path != NULL ? bx->lora_path : "";
  if (keys == NULL)
    return NULL;
  if (bx->lora_name != NULL)
    json_array_append_new(
        keys, tagged ? json_pack("[sss]", "lora", bx->lora_name, path)
                     : json_string(bx->lora_name));
  for (size_t k = 0; k < bx->n_mm; k++)
    json_array_append_new(keys,
                          key_json(tagged, "mm", json_string(bx->mm[k].id),
                                   json_integer(bx->mm[k].offset)));
  if (bx->cache_salt != NULL)
    json_array_append_new(
        keys, key_json(tagged, "cache_salt", json_string(bx->cache_salt), NULL));
  if (bx->prompt_embeds != NULL)
    json_array_append_new(keys, key_json(tagged, "prompt_embeds",
                                         hex_json(bx->prompt_embeds, 32), NULL));
  if (json_array_size(keys) > 0)
    return keys;
  json_decref(keys);
  return json_null();
}

/* 0 when kvplane's keys for block i, rendered, equal the file's `want`
 * (compact JSON), 1 with `msg` when not, KVP_ENOMEM. */
static int compare_keys(const kvp_block_extras *bx, bool tagged,
                        const char *want, const char *what, size_t i,
                        char *msg, size_t cap) {
  json_t *k = keys_json(bx, tagged);
  char *got = k != NULL ? json_dumps(k, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
  json_decref(k);
  if (got == NULL) {
    snprintf(msg, cap, "block %zu: out of memory", i);
    return KVP_ENOMEM;
  }
  int rc = strcmp(got, want) != 0;
  if (rc)
    snprintf(msg, cap, "block %zu: %s %.90s%s from kvplane, expected %.90s%s",
             i, what, got, strlen(got) > 90 ? "..." : "", want,
             strlen(want) > 90 ? "..." : "");
  free(got);
  return rc;
}

/* The extra keys: the file's hashed form and its event form. */
static int check_keys(const check_ctx *x, size_t i, kvp_block_extras *bx,
                      char *msg, size_t cap) {
  const cli_vector_block *b = &x->c->blocks[i];
  bool tagged = x->c->vllm_compat == KVP_VLLM_COMPAT_0_33;
  int rc = kvp_hasher_block_extras(x->h, &x->ex, i, bx, x->mm, x->c->n_mm);
  if (rc < 0) {
    snprintf(msg, cap, "kvp_hasher_block_extras(%zu): %s", i,
             kvp_err_name(rc));
    return rc;
  }
  rc = compare_keys(bx, tagged, b->extra_keys, "extra keys", i, msg, cap);
  if (rc == 0 && b->event_keys != NULL)
    rc = compare_keys(bx, false, b->event_keys, "event extra keys", i, msg,
                      cap);
  return rc;
}

/* Block i alone through kvp_hasher_block, from the chain's previous digest
 * (so that a bad digest in the file fails its own block only). */
static int check_one_block(const check_ctx *x, size_t i,
                           const kvp_block_extras *bx, char *msg,
                           size_t cap) {
  const cli_vector_case *c = x->c;
  uint8_t d[CLI_VECTORS_DIGEST_MAX], parent[CLI_VECTORS_DIGEST_MAX];
  int rc = i > 0 ? kvp_chain_digest(x->ch, i - 1, parent, sizeof parent) : 0;
  if (rc >= 0)
    rc = kvp_hasher_block(x->h, i > 0 ? parent : NULL, c->digest_len,
                          c->tokens + i * c->block_size, bx, d, sizeof d,
                          NULL);
  if (rc < 0) {
    snprintf(msg, cap, "kvp_hasher_block(%zu): %s", i, kvp_err_name(rc));
    return rc;
  }
  if (memcmp(d, c->blocks[i].digest, c->digest_len) == 0)
    return 0;
  snprintf(msg, cap, "block %zu: kvp_hasher_block's digest differs (the "
           "chain's agrees)", i);
  return 1;
}

/* 0 when block i agrees everywhere, 1 with `msg` when not, <0 from the
 * library. */
static int check_block(const check_ctx *x, size_t i, char *msg, size_t cap) {
  const cli_vector_case *c = x->c;
  const cli_vector_block *b = &c->blocks[i];
  kvp_key key = kvp_chain_keys(x->ch)[i];
  kvp_block_extras bx;
  uint8_t d[CLI_VECTORS_DIGEST_MAX];
  char got[2 * CLI_VECTORS_DIGEST_MAX + 1], want[sizeof got];
  int rc = check_keys(x, i, &bx, msg, cap);
  if (rc != 0)
    return rc;
  int len = kvp_chain_digest(x->ch, i, d, sizeof d);
  if (len < 0) {
    snprintf(msg, cap, "kvp_chain_digest(%zu): %s", i, kvp_err_name(len));
    return len;
  }
  if ((size_t)len != c->digest_len || memcmp(d, b->digest, c->digest_len)) {
    to_hex(d, (size_t)len, got);
    to_hex(b->digest, c->digest_len, want);
    snprintf(msg, cap, "block %zu: digest %s, expected %s", i, got, want);
  } else if (key.lo != b->external_u64) {
    snprintf(msg, cap, "block %zu: external u64 (key.lo) %" PRIu64
             ", expected %" PRIu64, i, key.lo, b->external_u64);
  } else if (key.hi != load_be64(b->digest + c->digest_len - 16)) {
    snprintf(msg, cap, "block %zu: key.hi %016" PRIx64 " is not the 8 digest "
             "bytes before the external u64", i, key.hi);
  } else if (!kvp_key_eq(key, x->oneshot[i])) {
    snprintf(msg, cap, "block %zu: kvp_hasher_hash key differs from the "
             "chain's", i);
  } else {
    return check_one_block(x, i, &bx, msg, cap);
  }
  return 1;
}

static int check_blocks(const check_ctx *x, char *why, size_t cap) {
  const cli_vector_case *c = x->c;
  char msg[256], first[256] = "";
  size_t bad = 0;
  if (kvp_chain_len(x->ch) != c->n_blocks) {
    snprintf(why, cap, "case %zu: the chain has %zu blocks, expected %zu",
             c->index, kvp_chain_len(x->ch), c->n_blocks);
    return 1;
  }
  for (size_t i = 0; i < c->n_blocks; i++) {
    int rc = check_block(x, i, msg, sizeof msg);
    if (rc < 0) {
      snprintf(why, cap, "case %zu: %s", c->index, msg);
      return rc;
    }
    if (rc > 0 && bad++ == 0)
      memcpy(first, msg, sizeof first);
  }
  if (bad == 0)
    return 0;
  snprintf(why, cap, "case %zu: %s (%zu of %zu blocks differ)", c->index,
           first, bad, c->n_blocks);
  return 1;
}

/* vLLM 0.33's resolve_none_hash_seed: PYTHONHASHSEED, else its fixed seed
 * (the library applies it; a file that says otherwise is inconsistent). */
static int check_none_seed(const cli_vector_case *c, char *why, size_t cap) {
  const char *want =
      c->python_hash_seed != NULL ? c->python_hash_seed : "vllm-none-hash";
  if (c->none_hash_seed == NULL || strcmp(c->none_hash_seed, want) == 0)
    return 0;
  snprintf(why, cap, "case %zu: none_hash_seed \"%.40s\" is not the seed vLLM "
           "derives NONE_HASH from (\"%.40s\")", c->index, c->none_hash_seed,
           want);
  return 1;
}

/* Feeds the chain in two uneven pieces, so that a block straddles the cut and
 * the tail carried between extends is exercised too. */
static int extend_split(kvp_chain *ch, const cli_vector_case *c) {
  size_t cut = c->n_tokens / 3 + 1, n = c->n_tokens;
  int rc = 0;
  if (cut > n)
    cut = n;
  if (cut > 0)
    rc = kvp_chain_extend(ch, c->tokens, cut);
  if (rc >= 0 && n > cut)
    rc = kvp_chain_extend(ch, c->tokens + cut, n - cut);
  return rc;
}

#define LIB_CALL(call, what)                                                    \
  do {                                                                          \
    if ((rc = (call)) < 0) {                                                    \
      snprintf(why, cap, "case %zu: %s: %s (%s)", c->index, what,               \
               kvp_err_name(rc), kvp_strerror(rc));                             \
      goto out;                                                                 \
    }                                                                           \
  } while (0)

int cli_vectors_check(const cli_vector_case *c, char *why, size_t cap) {
  /* vLLM modes do not mix the namespace seed in; only block_size matters */
  kvp_namespace_desc nd = {.model_id = "vllm", .block_size = c->block_size};
  kvp_hasher_opts ho = {.algo = c->algo,
                        .python_hash_seed = c->python_hash_seed,
                        .vllm_compat = c->vllm_compat};
  kvp_chain_opts co = {.keep_digests = 1};
  kvp_namespace ns;
  kvp_chain *ch = NULL;
  check_ctx x = {
      .c = c,
      .ex = {.lora_name = c->lora_name, .cache_salt = c->cache_salt,
             .mm = c->mm, .n_mm = c->n_mm, .lora_path = c->lora_path},
      .mm = calloc(c->n_mm + 1, sizeof *x.mm)};
  kvp_key *oneshot = calloc(c->n_blocks + 1, sizeof *oneshot);
  int rc = KVP_ENOMEM;
  if (why == NULL)
    cap = 0;
  snprintf(why, cap, "case %zu: out of memory", c->index);
  if (oneshot == NULL || x.mm == NULL)
    goto out;
  if ((rc = check_none_seed(c, why, cap)) != 0)
    goto out;
  LIB_CALL(kvp_namespace_init(&nd, &ns), "kvp_namespace_init");
  LIB_CALL(kvp_hasher_create(&ns, &ho, NULL, &x.h), "kvp_hasher_create");
  LIB_CALL(kvp_chain_create(x.h, &co, &x.ex, NULL, &ch), "kvp_chain_create");
  LIB_CALL(extend_split(ch, c), "kvp_chain_extend");
  LIB_CALL(kvp_hasher_hash(x.h, c->tokens, c->n_tokens, &x.ex, oneshot,
                           c->n_blocks, NULL), "kvp_hasher_hash");
  x.ch = ch;
  x.oneshot = oneshot;
  rc = check_blocks(&x, why, cap);
  if (rc == 0 && cap > 0)
    why[0] = '\0';
out:
  kvp_chain_destroy(ch);
  kvp_hasher_destroy(x.h);
  free(oneshot);
  free(x.mm);
  return rc;
}
