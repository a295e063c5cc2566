/* SPDX-License-Identifier: Apache-2.0 */
/* The YAML config loader (libyaml's event parser) and the field binder; see
 * include/kvplane/config.h for the accepted shape. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <yaml.h>

#include "core_internal.h"
#include "kvplane/config.h"

#define MAX_INPUT (1u << 20)
#define MAX_KEYS 4096u
#define VAL_MAX 4096u

typedef struct entry {
  char *section; /* NULL for a section header entry */
  char *key;
  char *value; /* scalars of a sequence joined with ',' (none empty) */
  unsigned line;
  bool seq;
} entry;

typedef struct section {
  char *name;
  unsigned line;
  bool bound;
} section;

struct kvp_config {
  kvp_allocator a;
  char name[256];
  entry *e;
  size_t n, cap;
  section *s;
  size_t ns, scap;
};

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 4, 5)))
#endif
static int fail(char *err, size_t cap, int code, const char *fmt, ...) {
  if (cap > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
  }
  return code;
}

int kvp__config_verr(char *err, size_t cap, const char *file, int line,
                     const char *sec, const char *key, const char *fmt,
                     va_list ap) {
  if (cap == 0)
    return KVP_EINVAL;
  int n = key != NULL
              ? snprintf(err, cap, "%s:%d: %s.%s: ", file, line, sec, key)
              : snprintf(err, cap, "%s:%d: %s: ", file, line, sec);
  if (n >= 0 && (size_t)n < cap)
    vsnprintf(err + n, cap - (size_t)n, fmt, ap);
  return KVP_EINVAL;
}

static char *dup_n(const kvp_allocator *a, const char *s, size_t n) {
  char *d = kvp__malloc(a, n + 1);
  if (d != NULL) {
    memcpy(d, s, n);
    d[n] = '\0';
  }
  return d;
}

static void free_str(const kvp_allocator *a, char *s) {
  if (s != NULL)
    kvp__free(a, s, strlen(s) + 1);
}

void kvp_config_destroy(kvp_config *c) {
  if (c == NULL)
    return;
  kvp_allocator a = c->a;
  for (size_t i = 0; i < c->n; i++) {
    free_str(&a, c->e[i].key);
    free_str(&a, c->e[i].value);
  }
  for (size_t i = 0; i < c->ns; i++)
    free_str(&a, c->s[i].name);
  kvp__free(&a, c->e, c->cap * sizeof *c->e);
  kvp__free(&a, c->s, c->scap * sizeof *c->s);
  kvp__free(&a, c, sizeof *c);
}

/* ---- parsing: a small state machine over libyaml events ---------------------- */
typedef struct parse {
  kvp_config *c;
  yaml_parser_t p;
  char *err;
  size_t cap;
  char val[VAL_MAX];
  size_t val_len;
} parse;

static int next(parse *ps, yaml_event_t *ev) {
  if (!yaml_parser_parse(&ps->p, ev))
    return fail(ps->err, ps->cap, KVP_ECORRUPT, "%s:%zu: YAML: %s",
                ps->c->name, ps->p.problem_mark.line + 1,
                ps->p.problem ? ps->p.problem : "syntax error");
  unsigned line = (unsigned)ev->start_mark.line + 1;
  if (ev->type == YAML_ALIAS_EVENT) {
    yaml_event_delete(ev);
    return fail(ps->err, ps->cap, KVP_ECORRUPT,
                "%s:%u: aliases are not supported", ps->c->name, line);
  }
  if ((ev->type == YAML_SCALAR_EVENT &&
       (ev->data.scalar.anchor || (ev->data.scalar.tag && !ev->data.scalar.plain_implicit &&
                                   !ev->data.scalar.quoted_implicit))) ||
      (ev->type == YAML_MAPPING_START_EVENT && ev->data.mapping_start.anchor) ||
      (ev->type == YAML_SEQUENCE_START_EVENT &&
       ev->data.sequence_start.anchor)) {
    yaml_event_delete(ev);
    return fail(ps->err, ps->cap, KVP_ECORRUPT,
                "%s:%u: anchors and tags are not supported", ps->c->name,
                line);
  }
  return 0;
}

static int add_entry(parse *ps, const char *sec, const char *key,
                     unsigned line, bool seq) {
  kvp_config *c = ps->c;
  for (size_t i = 0; i < c->n; i++)
    if (strcmp(c->e[i].section, sec) == 0 && strcmp(c->e[i].key, key) == 0)
      return fail(ps->err, ps->cap, KVP_ECORRUPT,
                  "%s:%u: duplicate key '%s' in section '%s' (first on line "
                  "%u)",
                  c->name, line, key, sec, c->e[i].line);
  if (c->n == MAX_KEYS)
    return fail(ps->err, ps->cap, KVP_ECORRUPT, "%s:%u: more than %u keys",
                c->name, line, MAX_KEYS);
  if (c->n == c->cap) {
    size_t nc = c->cap ? c->cap * 2 : 16;
    entry *ne = kvp__realloc(&c->a, c->e, c->cap * sizeof *ne, nc * sizeof *ne);
    if (ne == NULL)
      return KVP_ENOMEM;
    c->e = ne;
    c->cap = nc;
  }
  entry *e = &c->e[c->n];
  e->section = c->s[c->ns - 1].name;
  e->key = dup_n(&c->a, key, strlen(key));
  e->value = dup_n(&c->a, ps->val, ps->val_len);
  e->line = line;
  e->seq = seq;
  if (e->key == NULL || e->value == NULL) {
    free_str(&c->a, e->key);
    free_str(&c->a, e->value);
    return KVP_ENOMEM;
  }
  c->n++;
  return 0;
}

static int add_section(parse *ps, const char *name, unsigned line) {
  kvp_config *c = ps->c;
  for (size_t i = 0; i < c->ns; i++)
    if (strcmp(c->s[i].name, name) == 0)
      return fail(ps->err, ps->cap, KVP_ECORRUPT,
                  "%s:%u: duplicate section '%s' (first on line %u)", c->name,
                  line, name, c->s[i].line);
  if (c->ns == c->scap) {
    size_t nc = c->scap ? c->scap * 2 : 8;
    section *ns = kvp__realloc(&c->a, c->s, c->scap * sizeof *ns,
                               nc * sizeof *ns);
    if (ns == NULL)
      return KVP_ENOMEM;
    c->s = ns;
    c->scap = nc;
  }
  c->s[c->ns].name = dup_n(&c->a, name, strlen(name));
  if (c->s[c->ns].name == NULL)
    return KVP_ENOMEM;
  c->s[c->ns].line = line;
  c->s[c->ns].bound = false;
  c->ns++;
  return 0;
}

static int append_val(parse *ps, const char *s, size_t n, unsigned line) {
  if (ps->val_len + n + 2 > VAL_MAX)
    return fail(ps->err, ps->cap, KVP_ECORRUPT, "%s:%u: value too long",
                ps->c->name, line);
  if (ps->val_len > 0)
    ps->val[ps->val_len++] = ',';
  memcpy(ps->val + ps->val_len, s, n);
  ps->val_len += n;
  ps->val[ps->val_len] = '\0';
  return 0;
}

/* A section body: mapping of key -> scalar | sequence of scalars. */
static int parse_section(parse *ps, const char *sec) {
  yaml_event_t ev;
  int rc;
  for (;;) {
    if ((rc = next(ps, &ev)) < 0)
      return rc;
    if (ev.type == YAML_MAPPING_END_EVENT) {
      yaml_event_delete(&ev);
      return 0;
    }
    unsigned line = (unsigned)ev.start_mark.line + 1;
    if (ev.type != YAML_SCALAR_EVENT) {
      yaml_event_delete(&ev);
      return fail(ps->err, ps->cap, KVP_ECORRUPT,
                  "%s:%u: section '%s': expected a key", ps->c->name, line,
                  sec);
    }
    char key[128];
    if (ev.data.scalar.length >= sizeof key ||
        memchr(ev.data.scalar.value, '\0', ev.data.scalar.length)) {
      yaml_event_delete(&ev);
      return fail(ps->err, ps->cap, KVP_ECORRUPT, "%s:%u: key too long",
                  ps->c->name, line);
    }
    memcpy(key, ev.data.scalar.value, ev.data.scalar.length + 1);
    yaml_event_delete(&ev);
    if ((rc = next(ps, &ev)) < 0)
      return rc;
    ps->val_len = 0;
    ps->val[0] = '\0';
    bool seq = false;
    if (ev.type == YAML_SCALAR_EVENT) {
      rc = memchr(ev.data.scalar.value, '\0', ev.data.scalar.length)
               ? fail(ps->err, ps->cap, KVP_ECORRUPT,
                      "%s:%u: NUL byte in a value", ps->c->name, line)
               : append_val(ps, (const char *)ev.data.scalar.value,
                            ev.data.scalar.length, line);
      yaml_event_delete(&ev);
    } else if (ev.type == YAML_SEQUENCE_START_EVENT) {
      seq = true;
      yaml_event_delete(&ev);
      for (rc = 0; rc == 0;) {
        if ((rc = next(ps, &ev)) < 0)
          return rc;
        if (ev.type == YAML_SEQUENCE_END_EVENT) {
          yaml_event_delete(&ev);
          break;
        }
        if (ev.type != YAML_SCALAR_EVENT || ev.data.scalar.length == 0 ||
            memchr(ev.data.scalar.value, '\0', ev.data.scalar.length) ||
            memchr(ev.data.scalar.value, ',', ev.data.scalar.length)) {
          yaml_event_delete(&ev);
          return fail(ps->err, ps->cap, KVP_ECORRUPT,
                      "%s:%u: %s.%s: a list holds plain scalars (not empty, "
                      "no commas)",
                      ps->c->name, line, sec, key);
        }
        rc = append_val(ps, (const char *)ev.data.scalar.value,
                        ev.data.scalar.length, line);
        yaml_event_delete(&ev);
      }
    } else {
      yaml_event_delete(&ev);
      return fail(ps->err, ps->cap, KVP_ECORRUPT,
                  "%s:%u: %s.%s: expected a value or a list, not a mapping",
                  ps->c->name, line, sec, key);
    }
    if (rc < 0 || (rc = add_entry(ps, sec, key, line, seq)) < 0)
      return rc;
  }
}

static int parse_doc(parse *ps) {
  yaml_event_t ev;
  int rc;
  /* stream start, then a document or an empty stream */
  if ((rc = next(ps, &ev)) < 0)
    return rc;
  yaml_event_delete(&ev);
  if ((rc = next(ps, &ev)) < 0)
    return rc;
  if (ev.type == YAML_STREAM_END_EVENT) {
    yaml_event_delete(&ev);
    return 0;
  }
  yaml_event_delete(&ev); /* document start */
  if ((rc = next(ps, &ev)) < 0)
    return rc;
  unsigned line = (unsigned)ev.start_mark.line + 1;
  if (ev.type == YAML_SCALAR_EVENT && ev.data.scalar.length == 0) {
    yaml_event_delete(&ev); /* an empty document */
  } else if (ev.type != YAML_MAPPING_START_EVENT) {
    yaml_event_delete(&ev);
    return fail(ps->err, ps->cap, KVP_ECORRUPT,
                "%s:%u: expected a mapping of sections (cluster:, model:, "
                "...)",
                ps->c->name, line);
  } else {
    yaml_event_delete(&ev);
    for (;;) {
      if ((rc = next(ps, &ev)) < 0)
        return rc;
      if (ev.type == YAML_MAPPING_END_EVENT) {
        yaml_event_delete(&ev);
        break;
      }
      line = (unsigned)ev.start_mark.line + 1;
      if (ev.type != YAML_SCALAR_EVENT || ev.data.scalar.length == 0 ||
          ev.data.scalar.length >= 128 ||
          memchr(ev.data.scalar.value, '\0', ev.data.scalar.length)) {
        yaml_event_delete(&ev);
        return fail(ps->err, ps->cap, KVP_ECORRUPT,
                    "%s:%u: expected a section name", ps->c->name, line);
      }
      char sec[128];
      memcpy(sec, ev.data.scalar.value, ev.data.scalar.length + 1);
      yaml_event_delete(&ev);
      if ((rc = add_section(ps, sec, line)) < 0)
        return rc;
      if ((rc = next(ps, &ev)) < 0)
        return rc;
      bool empty = ev.type == YAML_SCALAR_EVENT && ev.data.scalar.length == 0;
      bool map = ev.type == YAML_MAPPING_START_EVENT;
      unsigned vl = (unsigned)ev.start_mark.line + 1;
      yaml_event_delete(&ev);
      if (empty)
        continue;
      if (!map)
        return fail(ps->err, ps->cap, KVP_ECORRUPT,
                    "%s:%u: section '%s' must be a mapping of keys",
                    ps->c->name, vl, sec);
      if ((rc = parse_section(ps, sec)) < 0)
        return rc;
    }
  }
  if ((rc = next(ps, &ev)) < 0)
    return rc;
  bool end = ev.type == YAML_DOCUMENT_END_EVENT;
  line = (unsigned)ev.start_mark.line + 1;
  yaml_event_delete(&ev);
  if (!end)
    return fail(ps->err, ps->cap, KVP_ECORRUPT,
                "%s:%u: trailing content", ps->c->name, line);
  if ((rc = next(ps, &ev)) < 0)
    return rc;
  end = ev.type == YAML_STREAM_END_EVENT;
  line = (unsigned)ev.start_mark.line + 1;
  yaml_event_delete(&ev);
  if (!end)
    return fail(ps->err, ps->cap, KVP_ECORRUPT,
                "%s:%u: one YAML document expected", ps->c->name, line);
  return 0;
}

int kvp_config_load_mem(const void *data, size_t size, const char *name,
                        const kvp_allocator *alloc, kvp_config **out,
                        char *err, size_t cap) {
  if (cap > 0)
    err[0] = '\0';
  if (out == NULL || (data == NULL && size > 0))
    return fail(err, cap, KVP_EINVAL, "invalid arguments");
  *out = NULL;
  if (name == NULL)
    name = "(config)";
  if (size > MAX_INPUT)
    return fail(err, cap, KVP_ECORRUPT, "%s: larger than %u bytes", name,
                MAX_INPUT);
  kvp_allocator a = kvp__allocator(alloc);
  kvp_config *c = kvp__calloc(&a, 1, sizeof *c);
  if (c == NULL)
    return fail(err, cap, KVP_ENOMEM, "%s: out of memory", name);
  c->a = a;
  snprintf(c->name, sizeof c->name, "%s", name);
  parse *ps = kvp__malloc(&a, sizeof *ps);
  if (ps == NULL) {
    kvp_config_destroy(c);
    return fail(err, cap, KVP_ENOMEM, "%s: out of memory", name);
  }
  ps->c = c;
  ps->err = err;
  ps->cap = cap;
  int rc = yaml_parser_initialize(&ps->p) ? 0 : KVP_ENOMEM;
  if (rc == 0) {
    yaml_parser_set_input_string(&ps->p, data ? data : (const void *)"", size);
    rc = parse_doc(ps);
    yaml_parser_delete(&ps->p);
  }
  kvp__free(&a, ps, sizeof *ps);
  if (rc < 0) {
    if (rc == KVP_ENOMEM && cap > 0 && err[0] == '\0')
      fail(err, cap, rc, "%s: out of memory", name);
    kvp_config_destroy(c);
    return rc;
  }
  *out = c;
  return 0;
}

int kvp_config_load_file(const char *path, const kvp_allocator *alloc,
                         kvp_config **out, char *err, size_t cap) {
  if (path == NULL || out == NULL)
    return fail(err, cap, KVP_EINVAL, "invalid arguments");
  *out = NULL;
  FILE *f = fopen(path, "rb");
  struct stat st;
  if (f != NULL && fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
    fclose(f);
    return fail(err, cap, -EISDIR, "%s: is a directory, not a YAML file",
                path);
  }
  if (f == NULL) {
    int e = errno;
    return fail(err, cap, -e, "%s: %s", path, strerror(e));
  }
  kvp_allocator a = kvp__allocator(alloc);
  char *buf = kvp__malloc(&a, MAX_INPUT + 1);
  if (buf == NULL) {
    fclose(f);
    return fail(err, cap, KVP_ENOMEM, "%s: out of memory", path);
  }
  size_t n = fread(buf, 1, MAX_INPUT + 1, f);
  int rc = ferror(f) ? fail(err, cap, KVP_EIO, "%s: read error", path) : 0;
  fclose(f);
  if (rc == 0)
    rc = n > MAX_INPUT ? fail(err, cap, KVP_ECORRUPT,
                              "%s: larger than %u bytes", path, MAX_INPUT)
                       : kvp_config_load_mem(buf, n, path, alloc, out, err,
                                             cap);
  kvp__free(&a, buf, MAX_INPUT + 1);
  return rc;
}

/* ---- units ------------------------------------------------------------------ */
/* A non-negative decimal number (digits, optional fraction and exponent; no
 * sign, hex, inf or nan) at the start of s; *rest is what follows it. */
static bool scan_number(const char *s, double *v, bool *integral,
                        const char **rest) {
  const char *p = s;
  while (*p >= '0' && *p <= '9')
    p++;
  bool digits = p > s;
  *integral = *p != '.' && *p != 'e' && *p != 'E';
  if (*p == '.')
    for (p++; *p >= '0' && *p <= '9'; p++)
      digits = true;
  if (!digits)
    return false;
  if (*p == 'e' || *p == 'E') {
    const char *q = p + 1 + (p[1] == '+' || p[1] == '-');
    if (*q < '0' || *q > '9')
      return false;
    for (p = q; *p >= '0' && *p <= '9'; p++)
      ;
  }
  char buf[64];
  if ((size_t)(p - s) >= sizeof buf)
    return false;
  memcpy(buf, s, (size_t)(p - s));
  buf[p - s] = '\0';
  errno = 0;
  *v = strtod(buf, NULL);
  *rest = p;
  while (**rest == ' ')
    (*rest)++;
  return errno == 0 && isfinite(*v);
}

/* The multiplier of a size unit; 0 for an unknown one. */
static uint64_t size_unit(const char *u) {
  static const char prefixes[] = "KMGTP";
  if (u[0] == '\0' || strcmp(u, "B") == 0)
    return 1;
  const char *at = strchr(prefixes, u[0] == 'k' ? 'K' : u[0]);
  if (at == NULL)
    return 0;
  bool bin = u[1] == 'i';
  const char *tail = u + 1 + bin;
  if (strcmp(tail, "") != 0 && strcmp(tail, "B") != 0)
    return 0;
  uint64_t m = 1;
  for (const char *q = prefixes; q <= at; q++)
    m *= bin ? 1024 : 1000;
  return m;
}

int kvp_config_parse_size(const char *s, uint64_t *out) {
  double v;
  bool integral;
  const char *unit;
  if (s == NULL || out == NULL || !scan_number(s, &v, &integral, &unit))
    return KVP_EINVAL;
  uint64_t m = size_unit(unit), r;
  if (m == 0)
    return KVP_EINVAL;
  if (integral) { /* exact, all 64 bits */
    errno = 0;
    unsigned long long u = strtoull(s, NULL, 10);
    if (errno != 0 || __builtin_mul_overflow((uint64_t)u, m, &r))
      return KVP_EINVAL;
  } else {
    double b = v * (double)m;
    if (!(b < 18446744073709551616.0) || fabs(b - nearbyint(b)) > 1e-6)
      return KVP_EINVAL;
    r = (uint64_t)nearbyint(b);
  }
  *out = r;
  return 0;
}

int kvp_config_parse_duration(const char *s, double bare_unit_s,
                              double *out_s) {
  static const struct {
    const char *name;
    double s;
  } units[] = {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}};
  double v;
  bool integral;
  const char *unit;
  if (s == NULL || out_s == NULL || !isfinite(bare_unit_s) ||
      bare_unit_s <= 0 || !scan_number(s, &v, &integral, &unit))
    return KVP_EINVAL;
  double m = unit[0] == '\0' ? bare_unit_s : 0;
  for (size_t i = 0; i < sizeof units / sizeof *units && m == 0; i++)
    if (strcmp(unit, units[i].name) == 0)
      m = units[i].s;
  if (m == 0 || !isfinite(v * m))
    return KVP_EINVAL;
  *out_s = v * m;
  return 0;
}

/* ---- binding -------------------------------------------------------------------- */
typedef union value {
  uint64_t u;
  double d;
  bool b;
} value;

static bool in_bounds(double v, const kvp_config_field *f) {
  return v >= f->min && v <= f->max;
}

/* A bound given in seconds, checked with a little slack: a bare value in
 * microseconds at its bound must not fail on the last bit of v * 1e-6. */
static bool in_bounds_s(double v, const kvp_config_field *f) {
  return v >= f->min * (1 - 1e-12) && v <= f->max * (1 + 1e-12);
}

static bool parse_u64(const char *v, const kvp_config_field *f, value *out) {
  char *end;
  errno = 0;
  unsigned long long u = strtoull(v, &end, 10);
  out->u = u;
  return v[0] >= '0' && v[0] <= '9' && *end == '\0' && errno == 0 &&
         in_bounds((double)u, f);
}

static bool parse_f64(const char *v, const kvp_config_field *f, value *out) {
  char *end;
  errno = 0;
  out->d = strtod(v, &end);
  return v[0] != '\0' && *end == '\0' && errno == 0 && isfinite(out->d) &&
         in_bounds(out->d, f);
}

static bool parse_bool(const char *v, value *out) {
  static const char *const t[] = {"true", "yes", "on"},
                           *const n[] = {"false", "no", "off"};
  for (int i = 0; i < 3; i++)
    if (strcmp(v, t[i]) == 0 || strcmp(v, n[i]) == 0) {
      out->b = strcmp(v, t[i]) == 0;
      return true;
    }
  return false;
}

/* Items of a list value (joined with ','); -1 if one is empty. */
static long list_items(const char *v) {
  if (v[0] == '\0')
    return 0;
  long n = 1;
  for (const char *p = v; *p; p++) {
    if (*p == ',' && (p == v || p[1] == '\0' || p[1] == ','))
      return -1;
    n += *p == ',';
  }
  return n;
}

static const char *per_s_name(size_t per_s) {
  return per_s == 1 ? "seconds" : per_s == 1000 ? "ms"
         : per_s == 1000000 ? "us" : per_s == 1000000000 ? "ns" : "units";
}

/* "name:line: sec.key: expected ..., got 'v'" for a value of f's type. */
static int bad_value(const kvp_config *c, const char *sec,
                     const kvp_config_field *f, const entry *e, char *err,
                     size_t cap) {
  char want[160];
  switch (f->type) {
  case KVP_CONFIG_U64:
    snprintf(want, sizeof want, "an integer in [%.0f, %.0f]", f->min, f->max);
    break;
  case KVP_CONFIG_F64:
    snprintf(want, sizeof want, "a number in [%g, %g]", f->min, f->max);
    break;
  case KVP_CONFIG_BOOL:
    snprintf(want, sizeof want, "true or false");
    break;
  case KVP_CONFIG_SIZE:
    snprintf(want, sizeof want, "a size in [%.0f, %.0f] bytes (4096, 64M, "
             "1.5GiB, 1T)", f->min, f->max);
    break;
  case KVP_CONFIG_DURATION:
    snprintf(want, sizeof want, "a duration in [%g, %g] s (10us, 2ms, 1s; "
             "a bare number counts %s)", f->min, f->max, per_s_name(f->cap));
    break;
  default:
    snprintf(want, sizeof want, "a list of %.0f to %.0f non-empty items "
             "([a, b])", f->min, f->max);
    break;
  }
  return fail(err, cap, KVP_EINVAL, "%s:%u: %s.%s: expected %s, got '%.64s'",
              c->name, e->line, sec, f->name, want,
              e->seq && e->value[0] == '\0' ? "[]" : e->value);
}

/* Checks one value; stores it only when `store` (bind is all or nothing). */
static int bind_value(const kvp_config *c, const char *sec,
                      const kvp_config_field *f, const entry *e, bool store,
                      char *err, size_t cap) {
  const char *v = e->value;
  value x = {0};
  bool ok;
  if (e->seq && f->type != KVP_CONFIG_LIST)
    return fail(err, cap, KVP_EINVAL, "%s:%u: %s.%s: expected one value, "
                                      "got a list",
                c->name, e->line, sec, f->name);
  if (f->type == KVP_CONFIG_STR || f->type == KVP_CONFIG_LIST) {
    long n = f->type == KVP_CONFIG_LIST ? list_items(v) : 0;
    if (n < 0 || (f->type == KVP_CONFIG_LIST && !in_bounds((double)n, f)))
      return bad_value(c, sec, f, e, err, cap);
    if (strlen(v) + 1 > f->cap)
      return fail(err, cap, KVP_EINVAL,
                  "%s:%u: %s.%s: longer than %zu bytes", c->name, e->line,
                  sec, f->name, f->cap ? f->cap - 1 : 0);
    if (store)
      memcpy(f->out, v, strlen(v) + 1);
    return 0;
  }
  switch (f->type) {
  case KVP_CONFIG_U64: ok = parse_u64(v, f, &x); break;
  case KVP_CONFIG_F64: ok = parse_f64(v, f, &x); break;
  case KVP_CONFIG_BOOL: ok = parse_bool(v, &x); break;
  case KVP_CONFIG_SIZE:
    ok = kvp_config_parse_size(v, &x.u) == 0 && in_bounds((double)x.u, f);
    break;
  case KVP_CONFIG_DURATION:
    ok = f->cap > 0 &&
         kvp_config_parse_duration(v, 1.0 / (double)f->cap, &x.d) == 0 &&
         in_bounds_s(x.d, f);
    break;
  default:
    return fail(err, cap, KVP_EINVAL, "%s: %s.%s: bad field type", c->name,
                sec, f->name);
  }
  if (!ok)
    return bad_value(c, sec, f, e, err, cap);
  if (store && (f->type == KVP_CONFIG_U64 || f->type == KVP_CONFIG_SIZE))
    *(uint64_t *)f->out = x.u;
  else if (store && f->type == KVP_CONFIG_BOOL)
    *(bool *)f->out = x.b;
  else if (store)
    *(double *)f->out = x.d;
  return 0;
}

int kvp_config_bind(kvp_config *c, const kvp_config_section *s, char *err,
                    size_t cap) {
  if (c == NULL || s == NULL || s->name == NULL ||
      (s->fields == NULL && s->n_fields > 0))
    return fail(err, cap, KVP_EINVAL, "invalid arguments");
  size_t si = c->ns;
  for (size_t i = 0; i < c->ns; i++)
    if (strcmp(c->s[i].name, s->name) == 0)
      si = i;
  if (si == c->ns)
    return 0;
  c->s[si].bound = true; /* even if a key fails: its error is the real one */
  int set = 0;
  for (int pass = 0; pass < 2; pass++)
    for (size_t i = 0; i < c->n; i++) {
      const entry *e = &c->e[i];
      if (e->section != c->s[si].name)
        continue;
      const kvp_config_field *f = NULL;
      for (size_t j = 0; j < s->n_fields && f == NULL; j++)
        if (strcmp(s->fields[j].name, e->key) == 0)
          f = &s->fields[j];
      if (f == NULL) {
        char known[512] = "";
        size_t kl = 0;
        for (size_t j = 0; j < s->n_fields && kl < sizeof known; j++)
          kl += (size_t)snprintf(known + kl, sizeof known - kl, "%s%s",
                                 j ? ", " : "", s->fields[j].name);
        return fail(err, cap, KVP_EINVAL,
                    "%s:%u: unknown key '%.64s' in section '%s' (known: %s)",
                    c->name, e->line, e->key, s->name, known);
      }
      int rc = bind_value(c, s->name, f, e, pass == 1, err, cap);
      if (rc < 0)
        return rc;
      set += pass;
    }
  return set;
}

int kvp_config_check_unbound(const kvp_config *c, const char *const *reserved,
                             size_t n_reserved, char *err, size_t cap) {
  if (c == NULL || (reserved == NULL && n_reserved > 0))
    return fail(err, cap, KVP_EINVAL, "invalid arguments");
  for (size_t i = 0; i < c->ns; i++) {
    bool ok = c->s[i].bound;
    for (size_t j = 0; j < n_reserved && !ok; j++)
      ok = strcmp(reserved[j], c->s[i].name) == 0;
    if (!ok)
      return fail(err, cap, KVP_EINVAL, "%s:%u: unknown section '%.64s'",
                  c->name, c->s[i].line, c->s[i].name);
  }
  return 0;
}

int kvp_config_has_section(const kvp_config *c, const char *name) {
  if (c == NULL || name == NULL)
    return KVP_EINVAL;
  for (size_t i = 0; i < c->ns; i++)
    if (strcmp(c->s[i].name, name) == 0)
      return 1;
  return 0;
}

int kvp_config_key_line(const kvp_config *c, const char *sec,
                        const char *key, const char **name) {
  if (c == NULL || sec == NULL || key == NULL)
    return KVP_EINVAL;
  if (name != NULL)
    *name = c->name;
  for (size_t i = 0; i < c->n; i++)
    if (c->e[i].section != NULL && strcmp(c->e[i].section, sec) == 0 &&
        strcmp(c->e[i].key, key) == 0)
      return c->e[i].line > 0 ? (int)c->e[i].line : 1;
  return 0;
}
