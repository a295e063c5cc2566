/* SPDX-License-Identifier: Apache-2.0 */
/* The microbenchmarks' common layer, so each bench reads workload / measure /
 * report (after zstd's programs/benchfn.c and timefn.c): an option table
 * (--help lists it), a timed loop into a kvp_hist, the per-worker hash-set
 * baseline the index and routing benches measure against, and one row
 * printer for their tables.  Not the harness's (bench/harness/). */
#ifndef KVP_BENCH_UTIL_H
#define KVP_BENCH_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvplane.h"

/* ---- errors, memory, CPU --------------------------------------------------- */
/* The name every message starts with; bench_parse() sets it. */
extern const char *bench_name;

/* Prints "<bench>: <what>: <kvplane error>" and exits 1. */
void bench_die(const char *what, int rc);
/* calloc that dies on failure. */
void *bench_calloc(size_t n, size_t size);
/* Pins the calling thread to one CPU; cpu < 0 leaves the scheduler alone. */
void bench_pin_cpu(int cpu);

/* ---- time (timefn) ------------------------------------------------------------ */
static inline double bench_secs(uint64_t ns) { return (double)ns / 1e9; }
static inline double bench_secs_since(uint64_t t0_ns) {
  return bench_secs(kvp_now_ns() - t0_ns);
}
/* units per second over ns nanoseconds */
static inline double bench_rate(double units, uint64_t ns) {
  return units / bench_secs(ns);
}

/* ---- options ------------------------------------------------------------------------ */
typedef enum bench_opt_type {
  BENCH_FLAG,   /* bool: present or not */
  BENCH_INT,    /* int (may be negative: --cpu -1) */
  BENCH_U32,    /* uint32_t */
  BENCH_U64,    /* uint64_t (decimal, or 0x hex) */
  BENCH_DOUBLE, /* double */
  BENCH_STR     /* const char *, pointing into argv */
} bench_opt_type;

/* One option: --name VALUE or --name=VALUE (a unique prefix of the name
 * works too, as getopt_long allows).  The table ends with BENCH_OPT_END;
 * `dst`'s value before parsing is the default --help shows. */
typedef struct bench_opt {
  const char *name; /* without the leading "--" */
  bench_opt_type type;
  void *dst;
  const char *arg;  /* what --help calls the value ("N", "KiB"); NULL: flag */
  const char *help;
  bool given;       /* set by bench_parse */
} bench_opt;
#define BENCH_OPT(name_, type_, dst_, arg_, help_)                             \
  {.name = (name_), .type = (type_), .dst = (dst_), .arg = (arg_),             \
   .help = (help_)}
#define BENCH_OPT_END {.name = NULL}

/* Parses argv against opts and sets bench_name = name.  --help prints the
 * usage (about, then one line per option) to stdout and exits 0.  Returns 0,
 * or -1 after printing the usage to stderr (the caller exits 2). */
int bench_parse(const char *name, const char *about, bench_opt *opts, int argc,
                char **argv);
/* Whether the option called `name` was on the command line. */
bool bench_given(const bench_opt *opts, const char *name);

/* ---- the timed loop (benchfn) ----------------------------------------------- */
/* A measured call: rep counts from -warmup (rep < 0: warm-up, not recorded). */
typedef struct bench_fn {
  void (*prep)(void *ctx, int rep);  /* untimed, before each call; or NULL */
  void (*run)(void *ctx, int rep);   /* the timed call */
  bool (*after)(void *ctx, int rep); /* untimed; false ends the loop; or NULL */
  void *ctx;
} bench_fn;

/* Calls fn warmup + reps times and records each timed call's nanoseconds
 * into h (NULL: run() records what it times itself).  Returns the recorded
 * reps (fewer when after() ended the loop). */
int bench_loop(const bench_fn *fn, int warmup, int reps, kvp_hist *h);
/* kvp_hist_create that dies on failure. */
kvp_hist *bench_hist(void);

/* ---- the baseline: a hash set per worker -------------------------------------- */
/* What the index is measured against: per worker, an open-addressing set of
 * 64-bit fingerprints -> mask of the tiers holding the block (linear
 * probing; a removed key keeps its slot with mask 0).  A query probes every
 * worker's set block by block. */
typedef struct bench_set {
  uint64_t *fp; /* 0: empty slot */
  uint8_t *mask;
  size_t cap, n;     /* n counts the slots ever used */
  unsigned load_pct; /* grows past this load (0 means 75) */
} bench_set;

/* Keys 0 and 1 are remapped as the index remaps its fingerprints. */
static inline uint64_t bench_fp(kvp_key k) { return k.lo < 2 ? k.lo + 2 : k.lo; }

static inline uint64_t bench_mix64(uint64_t z) { /* splitmix64's finalizer */
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* splitmix64: the next number of the sequence *state seeds (the benches'
 * workloads; reproducible from the seed). */
static inline uint64_t bench_splitmix(uint64_t *state) {
  return bench_mix64(*state += 0x9E3779B97F4A7C15ull);
}

/* The slot holding fp, or the empty one where it would go (cap > 0). */
static inline size_t bench_set_slot(const bench_set *s, uint64_t fp) {
  size_t i = (size_t)bench_mix64(fp) & (s->cap - 1);
  while (s->fp[i] != 0 && s->fp[i] != fp)
    i = (i + 1) & (s->cap - 1);
  return i;
}

/* fp's tier mask; 0 when absent. */
static inline uint8_t bench_set_get(const bench_set *s, uint64_t fp) {
  if (s->cap == 0)
    return 0;
  size_t i = bench_set_slot(s, fp);
  return s->fp[i] == fp ? s->mask[i] : 0;
}

/* Doubles the table (n keeps counting the tombstones, which stay behind). */
void bench_set_grow(bench_set *s);

/* mask = (mask | add) & ~del; an absent fp is inserted only when add != 0.
 * Inline: the baseline's ingest loop calls it per block, as it did when
 * each bench had its own copy. */
static inline void bench_set_update(bench_set *s, uint64_t fp, uint8_t add,
                                    uint8_t del) {
  unsigned load = s->load_pct ? s->load_pct : 75;
  if ((s->n + 1) * 100 > s->cap * load)
    bench_set_grow(s);
  size_t i = bench_set_slot(s, fp);
  if (s->fp[i] == 0) {
    if (add == 0)
      return;
    s->fp[i] = fp;
    s->n++;
  }
  s->mask[i] = (uint8_t)((s->mask[i] | add) & ~del);
}
/* Every worker's prefix of k[0..n) (blocks counted by their fastest tier),
 * as kvp_index_query reports it; all_blocks: probe every block of every
 * worker, with no stop at the first miss.  Returns the workers holding a
 * prefix; writes the first `cap` of them to out. */
int bench_sets_query(const bench_set *sets, uint32_t nw, const kvp_key *k,
                     size_t n, bool all_blocks, kvp_index_match *out,
                     size_t cap);
void bench_sets_free(bench_set *sets, uint32_t nw);

/* ---- one row printer ------------------------------------------------------------ */
typedef enum bench_style {
  BENCH_TEXT,    /* aligned columns: the first left, the rest right */
  BENCH_MARKDOWN /* | a | b | rows under a |---| line */
} bench_style;

typedef struct bench_col {
  const char *head;
  int width; /* BENCH_TEXT: the column's width */
} bench_col;

typedef struct bench_table {
  bench_style style;
  int indent; /* BENCH_TEXT: spaces before each line */
  const bench_col *cols;
  int ncols;
} bench_table;

/* A row being printed, cell after cell (at most ncols). */
typedef struct bench_row {
  const bench_table *t;
  int col;
} bench_row;

/* The header line (and |---| for markdown); `tail` follows it, or NULL. */
void bench_table_head(const bench_table *t, const char *tail);
bench_row bench_row_start(const bench_table *t);
void bench_cell(bench_row *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* num / den as "%.{digits}fx" (bold: **..** in markdown); "-" when den is 0. */
void bench_cell_ratio(bench_row *r, double num, double den, int digits,
                      bool bold);
/* Ends the line; `tail` (or NULL) is printed after the last cell. */
void bench_row_end(bench_row *r, const char *tail);
/* One BENCH_TEXT row of a latency histogram: label, then p50, p99, p99.9
 * and mean in microseconds (columns 1..4 of t). */
void bench_row_hist(const bench_table *t, const char *label, const kvp_hist *h);

#endif /* KVP_BENCH_UTIL_H */
