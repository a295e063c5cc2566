/* SPDX-License-Identifier: Apache-2.0 */
/* The YAML config loader (libyaml's event parser) and the field binder; see
 * include/kvplane/config.h for the accepted shape. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <yaml.h>

#include "core_internal.h"
#include "kvplane/config.h"

#define MAX_INPUT (1u << 20)
#define MAX_KEYS 4096u
#define VAL_MAX 4096u

typedef struct entry {
  char *section; /* NULL for a section header entry */
  char *key;
  char *value; /* scalars of a sequence joined with ',' */
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
        if (ev.type != YAML_SCALAR_EVENT ||
            memchr(ev.data.scalar.value, '\0', ev.data.scalar.length) ||
            memchr(ev.data.scalar.value, ',', ev.data.scalar.length)) {
          yaml_event_delete(&ev);
          return fail(ps->err, ps->cap, KVP_ECORRUPT,
                      "%s:%u: %s.%s: a list holds plain scalars (no commas)",
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

/* ---- binding -------------------------------------------------------------------- */
/* Checks one value; stores it only when `store` (bind is all or nothing). */
static int bind_value(const kvp_config *c, const char *sec,
                      const kvp_config_field *f, const entry *e, bool store,
                      char *err, size_t cap) {
  const char *v = e->value;
  char *end;
  if (e->seq && f->type != KVP_CONFIG_STR)
    return fail(err, cap, KVP_EINVAL, "%s:%u: %s.%s: expected one value, "
                                      "got a list",
                c->name, e->line, sec, f->name);
  switch (f->type) {
  case KVP_CONFIG_U64: {
    errno = 0;
    unsigned long long u = strtoull(v, &end, 10);
    if (v[0] < '0' || v[0] > '9' || *end || errno ||
        (double)u < f->min || (double)u > f->max)
      return fail(err, cap, KVP_EINVAL,
                  "%s:%u: %s.%s: expected an integer in [%.0f, %.0f], got "
                  "'%.64s'",
                  c->name, e->line, sec, f->name, f->min, f->max, v);
    if (store)
      *(uint64_t *)f->out = u;
    return 0;
  }
  case KVP_CONFIG_F64: {
    errno = 0;
    double d = strtod(v, &end);
    if (v[0] == '\0' || *end || errno || !isfinite(d) || d < f->min ||
        d > f->max)
      return fail(err, cap, KVP_EINVAL,
                  "%s:%u: %s.%s: expected a number in [%g, %g], got '%.64s'",
                  c->name, e->line, sec, f->name, f->min, f->max, v);
    if (store)
      *(double *)f->out = d;
    return 0;
  }
  case KVP_CONFIG_BOOL: {
    static const char *const t[] = {"true", "yes", "on"},
                             *const n[] = {"false", "no", "off"};
    for (int i = 0; i < 3; i++) {
      if (strcmp(v, t[i]) == 0 || strcmp(v, n[i]) == 0) {
        if (store)
          *(bool *)f->out = strcmp(v, t[i]) == 0;
        return 0;
      }
    }
    return fail(err, cap, KVP_EINVAL,
                "%s:%u: %s.%s: expected true or false, got '%.64s'", c->name,
                e->line, sec, f->name, v);
  }
  case KVP_CONFIG_STR:
    if (strlen(v) + 1 > f->cap)
      return fail(err, cap, KVP_EINVAL,
                  "%s:%u: %s.%s: longer than %zu bytes", c->name, e->line,
                  sec, f->name, f->cap ? f->cap - 1 : 0);
    if (store)
      memcpy(f->out, v, strlen(v) + 1);
    return 0;
  }
  return fail(err, cap, KVP_EINVAL, "%s: %s.%s: bad field type", c->name,
              sec, f->name);
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
  c->s[si].bound = true;
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
