/* SPDX-License-Identifier: Apache-2.0 */
/* The microbenchmarks' common layer: options, the timed loop, the per-worker
 * hash-set baseline, the row printer (see bench_util.h). */
#include "bench_util.h"

#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

const char *bench_name = "bench";

void bench_die(const char *what, int rc) {
  fprintf(stderr, "%s: %s: %s\n", bench_name, what, kvp_strerror(rc));
  exit(1);
}

void *bench_calloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (p == NULL) {
    fprintf(stderr, "%s: out of memory (%zu x %zu)\n", bench_name, n, size);
    exit(1);
  }
  return p;
}

void bench_pin_cpu(int cpu) {
  if (cpu < 0)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0)
    fprintf(stderr, "%s: cannot pin to CPU %d (%s); running unpinned\n",
            bench_name, cpu, strerror(errno));
}

/* ---- options ----------------------------------------------------------------- */
static void opt_default(FILE *f, const bench_opt *o) {
  switch (o->type) {
  case BENCH_INT:
    fprintf(f, " (default %d)", *(const int *)o->dst);
    break;
  case BENCH_U32:
    fprintf(f, " (default %" PRIu32 ")", *(const uint32_t *)o->dst);
    break;
  case BENCH_U64:
    fprintf(f, " (default %" PRIu64 ")", *(const uint64_t *)o->dst);
    break;
  case BENCH_DOUBLE:
    fprintf(f, " (default %g)", *(const double *)o->dst);
    break;
  case BENCH_STR:
    if (*(const char *const *)o->dst != NULL)
      fprintf(f, " (default %s)", *(const char *const *)o->dst);
    break;
  case BENCH_FLAG:
    break;
  }
}

static void usage(FILE *f, const char *about, const bench_opt *opts) {
  fprintf(f, "usage: %s [options]\n%s", bench_name, about ? about : "");
  for (const bench_opt *o = opts; o->name != NULL; o++) {
    char lhs[64];
    snprintf(lhs, sizeof lhs, "--%s%s%s", o->name, o->arg ? " " : "",
             o->arg ? o->arg : "");
    fprintf(f, "  %-22s %s", lhs, o->help);
    opt_default(f, o);
    fputc('\n', f);
  }
  fprintf(f, "  %-22s %s\n", "--help", "this text");
}

/* The entry `name` (len bytes) names: exact, else a unique prefix. */
static bench_opt *find_opt(bench_opt *opts, const char *name, size_t len) {
  bench_opt *hit = NULL;
  int n = 0;
  for (bench_opt *o = opts; o->name != NULL; o++) {
    if (strncmp(o->name, name, len) != 0)
      continue;
    if (o->name[len] == '\0')
      return o;
    hit = o, n++;
  }
  return n == 1 ? hit : NULL;
}

static int parse_int(const char *s, long long lo, long long hi, long long *v) {
  char *end;
  errno = 0;
  bool hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  *v = strtoll(s, &end, hex ? 16 : 10);
  return errno == 0 && end != s && *end == '\0' && *v >= lo && *v <= hi ? 0 : -1;
}

static int parse_u64(const char *s, uint64_t *v) {
  char *end;
  errno = 0;
  bool hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  *v = strtoull(s, &end, hex ? 16 : 10);
  return errno == 0 && end != s && *end == '\0' && s[0] != '-' ? 0 : -1;
}

static int set_value(bench_opt *o, const char *v) {
  long long x;
  switch (o->type) {
  case BENCH_INT:
    if (parse_int(v, INT32_MIN, INT32_MAX, &x) < 0)
      return -1;
    *(int *)o->dst = (int)x;
    return 0;
  case BENCH_U32:
    if (parse_int(v, 0, UINT32_MAX, &x) < 0)
      return -1;
    *(uint32_t *)o->dst = (uint32_t)x;
    return 0;
  case BENCH_U64:
    return parse_u64(v, (uint64_t *)o->dst);
  case BENCH_DOUBLE: {
    char *end;
    *(double *)o->dst = strtod(v, &end);
    return end != v && *end == '\0' ? 0 : -1;
  }
  case BENCH_STR:
    *(const char **)o->dst = v;
    return 0;
  case BENCH_FLAG:
    break;
  }
  return -1;
}

/* argv[*i] is an option: applies it (and its value) or says why not. */
static int parse_one(bench_opt *opts, int argc, char **argv, int *i) {
  const char *a = argv[*i] + 2, *eq = strchr(a, '=');
  size_t len = eq ? (size_t)(eq - a) : strlen(a);
  bench_opt *o = find_opt(opts, a, len);
  if (o == NULL) {
    fprintf(stderr, "%s: unknown or ambiguous option %s\n", bench_name, argv[*i]);
    return -1;
  }
  o->given = true;
  if (o->type == BENCH_FLAG) {
    *(bool *)o->dst = true;
    return eq == NULL ? 0 : -1;
  }
  const char *v = eq ? eq + 1 : *i + 1 < argc ? argv[++*i] : NULL;
  if (v == NULL || set_value(o, v) < 0) {
    fprintf(stderr, "%s: --%s needs %s%s\n", bench_name, o->name,
            v ? "a valid " : "", o->arg ? o->arg : "a value");
    return -1;
  }
  return 0;
}

int bench_parse(const char *name, const char *about, bench_opt *opts, int argc,
                char **argv) {
  bench_name = name;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0) {
      usage(stdout, about, opts);
      exit(0);
    }
    if (strncmp(argv[i], "--", 2) != 0 || parse_one(opts, argc, argv, &i) < 0) {
      usage(stderr, about, opts);
      return -1;
    }
  }
  return 0;
}

bool bench_given(const bench_opt *opts, const char *name) {
  for (const bench_opt *o = opts; o->name != NULL; o++)
    if (strcmp(o->name, name) == 0)
      return o->given;
  return false;
}

/* ---- the timed loop ----------------------------------------------------------- */
int bench_loop(const bench_fn *fn, int warmup, int reps, kvp_hist *h) {
  int done = 0;
  for (int rep = -warmup; rep < reps; rep++) {
    if (fn->prep != NULL)
      fn->prep(fn->ctx, rep);
    uint64_t t0 = kvp_now_ns();
    fn->run(fn->ctx, rep);
    uint64_t t1 = kvp_now_ns();
    if (rep >= 0 && h != NULL)
      kvp_hist_record(h, t1 - t0);
    done += rep >= 0;
    if (fn->after != NULL && !fn->after(fn->ctx, rep))
      break;
  }
  return done;
}

kvp_hist *bench_hist(void) {
  kvp_hist *h = NULL;
  int rc = kvp_hist_create(NULL, &h);
  if (rc < 0)
    bench_die("kvp_hist_create", rc);
  return h;
}

/* ---- the baseline ---------------------------------------------------------------- */
void bench_set_grow(bench_set *s) {
  bench_set o = *s;
  s->cap = o.cap ? o.cap * 2 : 64;
  s->fp = bench_calloc(s->cap, sizeof *s->fp);
  s->mask = bench_calloc(s->cap, 1); /* n keeps counting the tombstones */
  for (size_t i = 0; i < o.cap; i++)
    if (o.fp[i] != 0 && o.mask[i] != 0) { /* tombstones stay behind */
      size_t j = bench_set_slot(s, o.fp[i]);
      s->fp[j] = o.fp[i];
      s->mask[j] = o.mask[i];
    }
  free(o.fp);
  free(o.mask);
}

/* One worker's prefix: up to the first miss (the index's answer), or --
 * all_blocks -- probing the rest of the chain too (as a naive router
 * does); two loops so each is the tight loop its bench had. */
static kvp_index_match set_prefix(const bench_set *s, uint32_t w,
                                  const kvp_key *k, size_t n, bool all_blocks) {
  kvp_index_match m = {.worker = w};
  if (!all_blocks) {
    for (size_t i = 0; i < n; i++) {
      uint8_t mk = bench_set_get(s, bench_fp(k[i]));
      if (mk == 0)
        break;
      m.prefix_blocks++;
      m.tier_blocks[__builtin_ctz(mk)]++;
    }
    return m;
  }
  bool prefix = true;
  for (size_t i = 0; i < n; i++) {
    uint8_t mk = bench_set_get(s, bench_fp(k[i]));
    prefix = prefix && mk != 0;
    if (prefix) {
      m.prefix_blocks++;
      m.tier_blocks[__builtin_ctz(mk)]++;
    }
  }
  return m;
}

int bench_sets_query(const bench_set *sets, uint32_t nw, const kvp_key *k,
                     size_t n, bool all_blocks, kvp_index_match *out,
                     size_t cap) {
  int found = 0;
  for (uint32_t w = 0; w < nw; w++) {
    kvp_index_match m = set_prefix(&sets[w], w, k, n, all_blocks);
    if (m.prefix_blocks > 0 && (size_t)found < cap)
      out[found] = m;
    found += m.prefix_blocks > 0;
  }
  return found;
}

void bench_sets_free(bench_set *sets, uint32_t nw) {
  for (uint32_t w = 0; sets != NULL && w < nw; w++) {
    free(sets[w].fp);
    free(sets[w].mask);
  }
  free(sets);
}

/* ---- the row printer --------------------------------------------------------------- */
static void put_cell(const bench_table *t, int col, const char *s) {
  if (t->style == BENCH_MARKDOWN) {
    printf("%s%s ", col ? " " : "| ", s);
    printf("|");
    return;
  }
  int w = col < t->ncols ? t->cols[col].width : 0;
  if (col == 0)
    printf("%*s%-*s", t->indent, "", w, s);
  else
    printf(" %*s", w, s);
}

void bench_table_head(const bench_table *t, const char *tail) {
  for (int c = 0; c < t->ncols; c++)
    put_cell(t, c, t->cols[c].head);
  printf("%s\n", tail ? tail : "");
  if (t->style != BENCH_MARKDOWN)
    return;
  for (int c = 0; c < t->ncols; c++)
    printf("|---");
  printf("|\n");
}

bench_row bench_row_start(const bench_table *t) { return (bench_row){t, 0}; }

void bench_cell(bench_row *r, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  put_cell(r->t, r->col++, buf);
}

void bench_cell_ratio(bench_row *r, double num, double den, int digits,
                      bool bold) {
  if (den == 0) {
    bench_cell(r, "-");
    return;
  }
  bool md = bold && r->t->style == BENCH_MARKDOWN;
  bench_cell(r, "%s%.*fx%s", md ? "**" : "", digits, num / den, md ? "**" : "");
}

void bench_row_end(bench_row *r, const char *tail) {
  printf("%s\n", tail ? tail : "");
  r->col = 0;
}

void bench_row_hist(const bench_table *t, const char *label, const kvp_hist *h) {
  kvp_hist_summary s;
  kvp_hist_summarize(h, &s);
  bench_row r = bench_row_start(t);
  bench_cell(&r, "%s", label);
  bench_cell(&r, "%.2f", s.p50 / 1e3);
  bench_cell(&r, "%.2f", s.p99 / 1e3);
  bench_cell(&r, "%.2f", s.p999 / 1e3);
  bench_cell(&r, "%.2f", s.mean / 1e3);
  bench_row_end(&r, NULL);
}
