/* SPDX-License-Identifier: Apache-2.0 */
/* core/config: the YAML loader and binder -- values of every type, lists,
 * unknown keys and sections with their lines, bad values, duplicates,
 * aliases and other shapes that must be refused, the shipped example. */
#include <errno.h>
#include <stdbool.h>
#include <unistd.h>

#include "test_harness.h"

static kvp_config *load(const char *y, char *err, size_t cap) {
  kvp_config *c = NULL;
  int rc = kvp_config_load_mem(y, strlen(y), "t.yaml", NULL, &c, err, cap);
  if (rc < 0)
    ASSERT_NULL(c);
  return c;
}

typedef struct opts {
  uint64_t workers;
  double gb;
  bool on;
  char pol[64];
} opts;

static int bind(kvp_config *c, opts *o, char *err, size_t cap) {
  const kvp_config_field f[] = {KVP_CFG_U64("workers", &o->workers, 1, 64),
                                KVP_CFG_F64("gb", &o->gb, 0, 100),
                                KVP_CFG_BOOL("on", &o->on),
                                KVP_CFG_LIST("policies", o->pol, sizeof o->pol,
                                             1, 8)};
  kvp_config_section s = {"cluster", f, 4};
  return kvp_config_bind(c, &s, err, cap);
}

TEST(good) {
  char err[256];
  kvp_config *c = load("# comment\ncluster:\n  workers: 12\n  gb: 2.5e1\n"
                       "  on: yes\n  policies: [a, b,c]\nother:\n",
                       err, sizeof err);
  ASSERT_NOT_NULL(c);
  opts o = {0};
  ASSERT_EQ(bind(c, &o, err, sizeof err), 4);
  ASSERT_EQ(o.workers, 12u);
  ASSERT_DOUBLE_NEAR(o.gb, 25.0, 0);
  ASSERT_TRUE(o.on);
  ASSERT_STR_EQ(o.pol, "a,b,c");
  ASSERT_EQ(kvp_config_has_section(c, "other"), 1);
  ASSERT_EQ(kvp_config_has_section(c, "nope"), 0);
  /* "other" was never bound */
  ASSERT_ERR(kvp_config_check_unbound(c, NULL, 0, err, sizeof err), KVP_EINVAL);
  ASSERT_STR_EQ(err, "t.yaml:7: unknown section 'other'");
  const char *res[] = {"other"};
  ASSERT_OK(kvp_config_check_unbound(c, res, 1, err, sizeof err));
  kvp_config_destroy(c);
  /* block list; an absent section binds nothing */
  c = load("cluster:\n  policies:\n    - x\n    - y\n", err, sizeof err);
  ASSERT_NOT_NULL(c);
  o = (opts){.workers = 3};
  ASSERT_EQ(bind(c, &o, err, sizeof err), 1);
  ASSERT_STR_EQ(o.pol, "x,y");
  ASSERT_EQ(o.workers, 3u);
  kvp_config_destroy(c);
  c = load("", err, sizeof err);
  ASSERT_NOT_NULL(c);
  ASSERT_EQ(bind(c, &o, err, sizeof err), 0);
  kvp_config_destroy(c);
  kvp_config_destroy(NULL);
}

TEST(bad_values) {
  static const struct {
    const char *yaml, *msg;
  } cases[] = {
      {"cluster:\n  workers: 8\n  wrokers: 3\n",
       "t.yaml:3: unknown key 'wrokers' in section 'cluster'"},
      {"cluster:\n  workers: abc\n",
       "t.yaml:2: cluster.workers: expected an integer in [1, 64], got 'abc'"},
      {"cluster:\n  workers: 65\n", "t.yaml:2: cluster.workers: expected"},
      {"cluster:\n  workers: -1\n", "t.yaml:2: cluster.workers: expected"},
      {"cluster:\n  workers: 1.5\n", "t.yaml:2: cluster.workers: expected"},
      {"cluster:\n  gb: nan\n", "t.yaml:2: cluster.gb: expected a number"},
      {"cluster:\n  gb: 1e999\n", "t.yaml:2: cluster.gb: expected a number"},
      {"cluster:\n  gb: 101\n", "t.yaml:2: cluster.gb: expected a number"},
      {"cluster:\n  gb: \n", "t.yaml:2: cluster.gb: expected a number"},
      {"cluster:\n  on: maybe\n", "t.yaml:2: cluster.on: expected true or false"},
      {"cluster:\n  workers: [1, 2]\n",
       "t.yaml:2: cluster.workers: expected one value, got a list"},
      {"cluster:\n  policies: "
       "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
       "t.yaml:2: cluster.policies: longer than 63 bytes"},
      /* a list key: empty, an empty item, too many items */
      {"cluster:\n  policies: []\n",
       "t.yaml:2: cluster.policies: expected a list of 1 to 8 non-empty items "
       "([a, b]), got '[]'"},
      {"cluster:\n  policies:\n", "t.yaml:2: cluster.policies: expected a list"},
      {"cluster:\n  policies: a,,b\n", "t.yaml:2: cluster.policies: expected a list"},
      {"cluster:\n  policies: [a, b, c, d, e, f, g, h, i]\n",
       "t.yaml:2: cluster.policies: expected a list of 1 to 8"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char err[256];
    kvp_config *c = load(cases[i].yaml, err, sizeof err);
    ASSERT_NOT_NULL(c);
    opts o = {0};
    ASSERT_ERR(bind(c, &o, err, sizeof err), KVP_EINVAL);
    if (strncmp(err, cases[i].msg, strlen(cases[i].msg)) != 0) {
      fprintf(stderr, "case %zu: got '%s'\n", i, err);
      ASSERT_TRUE(0);
    }
    ASSERT_EQ(o.workers, 0u); /* nothing written by a failed key */
    kvp_config_destroy(c);
  }
}

TEST(bad_shapes) {
  static const struct {
    const char *yaml, *msg;
  } cases[] = {
      {"- a\n- b\n", "t.yaml:1: expected a mapping of sections"},
      {"cluster: 3\n", "t.yaml:1: section 'cluster' must be a mapping"},
      {"cluster:\n  a:\n    b: 1\n", "t.yaml:2: cluster.a: expected a value"},
      {"cluster:\n  a: 1\n  a: 2\n",
       "t.yaml:3: duplicate key 'a' in section 'cluster' (first on line 2)"},
      {"cluster:\n  a: 1\ncluster:\n  b: 2\n",
       "t.yaml:3: duplicate section 'cluster'"},
      {"cluster:\n  a: &x 1\n  b: *x\n", "t.yaml:2: anchors"},
      {"cluster:\n  a: !!str 1\n", "t.yaml:2: anchors and tags"},
      {"cluster:\n  a: [1, [2]]\n", "t.yaml:2: cluster.a: a list holds plain"},
      {"cluster:\n  a: ['x,y']\n", "t.yaml:2: cluster.a: a list holds plain"},
      {"cluster: {a: 1\n", "t.yaml:"},
      {"a: 1\n---\nb: 2\n", "t.yaml:"},
      {"\t- bad\n", "t.yaml:"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char err[256] = "";
    kvp_config *c = load(cases[i].yaml, err, sizeof err);
    if (c != NULL || strncmp(err, cases[i].msg, strlen(cases[i].msg)) != 0) {
      fprintf(stderr, "case %zu: got '%s'\n", i, err);
      ASSERT_TRUE(0);
    }
  }
  char err[64];
  kvp_config *c;
  ASSERT_LT(kvp_config_load_file("/nonexistent/x.yaml", NULL, &c, err,
                                 sizeof err), 0);
  ASSERT_NULL(c);
  ASSERT_ERR(kvp_config_load_mem(NULL, 3, "x", NULL, &c, err, sizeof err),
             KVP_EINVAL);
}

/* The documented example binds completely in kvplane-bench (test_bench_cli
 * runs it); here: it parses and holds the sections the README names. */
TEST(shipped_example) {
  char err[256];
  kvp_config *c;
  const char *src = getenv("KVP_SOURCE_DIR");
  char p[4096];
  snprintf(p, sizeof p, "%s/bench/configs/default.yaml", src ? src : "..");
  if (access(p, R_OK) != 0)
    KVT_SKIP_BECAUSE("%s not found (set KVP_SOURCE_DIR)", p);
  ASSERT_OK(kvp_config_load_file(p, NULL, &c, err, sizeof err));
  const char *secs[] = {"cluster", "model", "gpu", "routing", "replay"};
  for (size_t i = 0; i < 5; i++)
    ASSERT_EQ(kvp_config_has_section(c, secs[i]), 1);
  kvp_config_destroy(c);
}

/* ---- `tiers:` bound by kvtier (kvp_tier_opts_from_config) ------------------ */
static int tiers(const char *y, kvp_tier_opts *o, char *dir, size_t dcap,
                 char *err, size_t cap) {
  kvp_config *c = load(y, err, cap);
  ASSERT_NOT_NULL(c);
  err[0] = '\0';
  int rc = kvp_tier_opts_from_config(c, o, dir, dcap, err, cap);
  static const char *const others[] = {"cluster"};
  if (rc >= 0) /* bound: the section is not "unknown" any more */
    ASSERT_OK(kvp_config_check_unbound(c, others, 1, err, cap));
  kvp_config_destroy(c);
  return rc;
}

TEST(tiers_good) {
  char err[256], dir[64] = "untouched";
  kvp_tier_opts o = {0};
  int n = tiers("tiers:\n  dram_bytes: 1073741824\n  dram_fraction: 0.1\n"
                "  huge_pages: thp\n  nvme_dir: /var/lib/kv\n"
                "  nvme_bytes: 4096000\n  nvme_fraction: 0.5\n"
                "  queue_depth: 64\n  max_block_bytes: 2097152\n"
                "  io_backend: posix\n  slow_io_us: 5000\n  policy: lru\n"
                "  volatile_nvme_min_hits: 2\n  promote: off\n"
                "  host_stores: 4\n",
                &o, dir, sizeof dir, err, sizeof err);
  if (n < 0)
    fprintf(stderr, "%s\n", err);
  ASSERT_EQ(n, 14);
  ASSERT_EQ(o.host_stores, 4u);
  ASSERT_EQ(o.dram_bytes, 1073741824u);
  ASSERT_DOUBLE_NEAR(o.dram_fraction, 0.1, 1e-12);
  ASSERT_EQ((int)o.huge_pages, (int)KVP_TIER_HUGE_THP);
  ASSERT_STR_EQ(o.nvme_dir, "/var/lib/kv");
  ASSERT_TRUE(o.nvme_dir == dir);
  ASSERT_EQ(o.nvme_bytes, 4096000u);
  ASSERT_DOUBLE_NEAR(o.nvme_fraction, 0.5, 1e-12);
  ASSERT_EQ(o.queue_depth, 64u);
  ASSERT_EQ(o.max_block_bytes, 2097152u);
  ASSERT_EQ((int)o.io_backend, (int)KVP_TIER_IO_POSIX);
  ASSERT_EQ(o.slow_io_us, 5000u);
  ASSERT_EQ((int)o.policy, (int)KVP_TIER_POLICY_LRU);
  ASSERT_EQ(o.volatile_nvme_min_hits, 2u);
  ASSERT_EQ(o.no_promote, 1u); /* promote: off */
  /* keys left out keep what the caller had; no section binds nothing */
  kvp_tier_opts p = {.queue_depth = 7, .policy = KVP_TIER_POLICY_LRU};
  ASSERT_EQ(tiers("tiers:\n  promote: on\n", &p, NULL, 0, err, sizeof err), 1);
  ASSERT_EQ(p.queue_depth, 7u);
  ASSERT_EQ((int)p.policy, (int)KVP_TIER_POLICY_LRU);
  ASSERT_EQ(p.no_promote, 0u);
  ASSERT_EQ(tiers("cluster:\n  workers: 2\n", &p, NULL, 0, err, sizeof err),
            0);
  ASSERT_EQ(p.queue_depth, 7u);
  /* the bound store takes them: kvp_tier_create accepts what binds */
  kvp_tier_opts q = {0};
  ASSERT_EQ(tiers("tiers:\n  dram_bytes: 8388608\n  policy: s3fifo\n"
                  "  queue_depth: 1024\n",
                  &q, NULL, 0, err, sizeof err),
            3);
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&q, NULL, &t));
  int64_t v;
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_POLICY, &v));
  ASSERT_EQ(v, (int64_t)KVP_TIER_POLICY_S3FIFO);
  kvp_tier_destroy(t);
}

/* The admission gate's keys bind, reach a store, and read back. */
TEST(tiers_admission) {
  char err[256];
  kvp_tier_opts o = {0};
  int n = tiers("tiers:\n  admission: hits\n  admit_write_weight: 2.5\n"
                "  admit_min_samples: 64\n  prefill_kv_bytes_per_s: 2.6e9\n"
                "  nvme_read_bytes_per_s: 3e9\n"
                "  nvme_write_bytes_per_s: 1.5e9\n",
                &o, NULL, 0, err, sizeof err);
  if (n < 0)
    fprintf(stderr, "%s\n", err);
  ASSERT_EQ(n, 6);
  ASSERT_EQ((int)o.admission, (int)KVP_TIER_ADMIT_HITS);
  ASSERT_DOUBLE_NEAR(o.admit_write_weight, 2.5, 1e-12);
  ASSERT_EQ(o.admit_min_samples, 64u);
  ASSERT_DOUBLE_NEAR(o.prefill_kv_bytes_per_s, 2.6e9, 1);
  ASSERT_DOUBLE_NEAR(o.nvme_read_bytes_per_s, 3e9, 1);
  ASSERT_DOUBLE_NEAR(o.nvme_write_bytes_per_s, 1.5e9, 1);
  o.dram_bytes = 8u << 20;
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  int64_t v;
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_ADMISSION, &v));
  ASSERT_EQ(v, (int64_t)KVP_TIER_ADMIT_HITS);
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI, &v));
  ASSERT_EQ(v, 2500);
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_PREFILL_KV_BPS, &v));
  ASSERT_EQ(v, INT64_C(2600000000));
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_ADMIT_MIN_SAMPLES, &v));
  ASSERT_EQ(v, 64);
  kvp_tier_destroy(t);
  ASSERT_EQ(tiers("tiers:\n  admission: gate\n", &o, NULL, 0, err, sizeof err),
            1);
  ASSERT_EQ((int)o.admission, (int)KVP_TIER_ADMIT_GATE);
}

/* Every refusal names file:line and the key, and changes nothing. */
static void tiers_bad(const char *y, const char *want) {
  char err[512], dir[16] = "keep";
  kvp_tier_opts o = {.queue_depth = 9};
  ASSERT_ERR(tiers(y, &o, dir, sizeof dir, err, sizeof err), KVP_EINVAL);
  if (strstr(err, want) == NULL)
    fprintf(stderr, "got: %s\nwant: %s\n", err, want);
  ASSERT_NOT_NULL(strstr(err, want));
  ASSERT_EQ(o.queue_depth, 9u);
  ASSERT_NULL(o.nvme_dir);
  ASSERT_STR_EQ(dir, "keep");
}

TEST(tiers_unknown_key) {
  tiers_bad("tiers:\n  queue_depth: 8\n  dram_byte: 5\n",
            "t.yaml:3: unknown key 'dram_byte' in section 'tiers' (known: "
            "dram_bytes,");
}

TEST(tiers_out_of_range) {
  tiers_bad("tiers:\n  queue_depth: 1025\n",
            "t.yaml:2: tiers.queue_depth: expected an integer in [1, 1024]");
  tiers_bad("tiers:\n  queue_depth: 0\n",
            "t.yaml:2: tiers.queue_depth: expected an integer in [1, 1024]");
  tiers_bad("tiers:\n  dram_fraction: 0.95\n",
            "t.yaml:2: tiers.dram_fraction: expected a number in [0, 0.9]");
  tiers_bad("tiers:\n  volatile_nvme_min_hits: 2000000\n",
            "t.yaml:2: tiers.volatile_nvme_min_hits: expected an integer in "
            "[0, 1048576]");
  tiers_bad("tiers:\n  queue_depth: 8\n  nvme_dir: /a/path/longer/than/16\n",
            "t.yaml:3: tiers.nvme_dir: longer than 15 bytes");
  tiers_bad("tiers:\n  admission: sometimes\n",
            "t.yaml:2: tiers.admission: expected one of gate, hits, all, got "
            "'sometimes'");
  tiers_bad("tiers:\n  admit_write_weight: 0\n",
            "t.yaml:2: tiers.admit_write_weight: expected a number in "
            "[0.001, 1000]");
  tiers_bad("tiers:\n  admit_min_samples: 513\n",
            "t.yaml:2: tiers.admit_min_samples: expected an integer in "
            "[1, 512]");
  tiers_bad("tiers:\n  prefill_kv_bytes_per_s: -1\n",
            "t.yaml:2: tiers.prefill_kv_bytes_per_s: expected a number in "
            "[0, 1e+15]");
  tiers_bad("tiers:\n  nvme_write_bytes_per_s: fast\n",
            "t.yaml:2: tiers.nvme_write_bytes_per_s: expected a number");
}

TEST(tiers_wrong_type) {
  tiers_bad("tiers:\n  dram_bytes: lots\n",
            "t.yaml:2: tiers.dram_bytes: expected a size in [0, ");
  tiers_bad("tiers:\n  max_block_bytes: 1K\n",
            "t.yaml:2: tiers.max_block_bytes: expected a size in [4096, "
            "268435456] bytes");
  tiers_bad("tiers:\n  queue_depth: 8\n  nvme_dir: [a, b]\n",
            "t.yaml:3: tiers.nvme_dir: expected one value, got a list");
  tiers_bad("tiers:\n  queue_depth: 8\n  promote: maybe\n",
            "t.yaml:3: tiers.promote: expected true or false, got 'maybe'");
  tiers_bad("tiers:\n  queue_depth: 8\n\n  policy: arc\n",
            "t.yaml:4: tiers.policy: expected s3fifo or lru, got 'arc'");
  tiers_bad("tiers:\n  huge_pages: always\n",
            "t.yaml:2: tiers.huge_pages: expected one of auto, thp, none, got "
            "'always'");
  tiers_bad("tiers:\n  io_backend: aio\n",
            "t.yaml:2: tiers.io_backend: expected one of auto, uring, posix");
  tiers_bad("tiers:\n  queue_depth: [1, 2]\n",
            "t.yaml:2: tiers.queue_depth: expected one value, got a list");
}

TEST(key_line) {
  char err[256];
  kvp_config *c = load("a:\n  x: 1\n\n  y: [1,\n      2]\nb:\n  x: 3\n", err,
                       sizeof err);
  ASSERT_NOT_NULL(c);
  const char *name = NULL;
  ASSERT_EQ(kvp_config_key_line(c, "a", "x", &name), 2);
  ASSERT_STR_EQ(name, "t.yaml");
  ASSERT_EQ(kvp_config_key_line(c, "a", "y", NULL), 4);
  ASSERT_EQ(kvp_config_key_line(c, "b", "x", NULL), 7);
  ASSERT_EQ(kvp_config_key_line(c, "b", "y", NULL), 0);
  ASSERT_EQ(kvp_config_key_line(c, "c", "x", NULL), 0);
  ASSERT_ERR(kvp_config_key_line(c, NULL, "x", NULL), KVP_EINVAL);
  kvp_config_destroy(c);
}

/* ---- units ----------------------------------------------------------------- */
TEST(parse_size) {
  static const struct {
    const char *s;
    uint64_t v;
  } good[] = {{"0", 0},
              {"4096", 4096},
              {"1T", 1000000000000ull},
              {"1e12", 1000000000000ull},
              {"1.5G", 1500000000ull},
              {"64 GiB", 68719476736ull},
              {"512MiB", 536870912ull},
              {"2Ki", 2048},
              {"3k", 3000},
              {"7KB", 7000},
              {"1PB", 1000000000000000ull},
              {"1Pi", 1125899906842624ull},
              {"10B", 10},
              {"18446744073709551615", UINT64_MAX}};
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    uint64_t v = 7;
    if (kvp_config_parse_size(good[i].s, &v) != 0 || v != good[i].v)
      fprintf(stderr, "size '%s': got %llu\n", good[i].s,
              (unsigned long long)v);
    ASSERT_OK(kvp_config_parse_size(good[i].s, &v));
    ASSERT_EQ(v, good[i].v);
  }
  static const char *const bad[] = {
      "", "-1", "+1", "1X", "1 TT", "1KiBB", "0.5", "1.0001K", "nan", "inf",
      "0x10", "1e", "18446744073709551616", "20000P", "K", ".", "1kib", "1 k B"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    uint64_t v = 7;
    if (kvp_config_parse_size(bad[i], &v) == 0)
      fprintf(stderr, "size '%s' accepted\n", bad[i]);
    ASSERT_ERR(kvp_config_parse_size(bad[i], &v), KVP_EINVAL);
    ASSERT_EQ(v, 7u);
  }
  ASSERT_ERR(kvp_config_parse_size(NULL, NULL), KVP_EINVAL);
}

TEST(parse_duration) {
  static const struct {
    const char *s;
    double bare, v;
  } good[] = {{"10", 1e-6, 10e-6}, {"10us", 1, 10e-6}, {"2ms", 1e-6, 2e-3},
              {"0.5s", 1e-6, 0.5},  {"3 ns", 1, 3e-9},  {"1.5", 1, 1.5},
              {"1e3us", 1, 1e-3},   {"0", 1e-3, 0}};
  for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
    double v = -1;
    ASSERT_OK(kvp_config_parse_duration(good[i].s, good[i].bare, &v));
    ASSERT_DOUBLE_NEAR(v, good[i].v, good[i].v * 1e-12);
  }
  /* a bare number in microseconds is exactly value * 1e-6 (as the
   * harness's old inline conversion computed it) */
  double v;
  ASSERT_OK(kvp_config_parse_duration("10", 1e-6, &v));
  ASSERT_TRUE(v == 10 * 1e-6);
  static const char *const bad[] = {"", "-1", "1m", "1 h", "s", "1e999",
                                    "1usec", "nan"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    v = 7;
    ASSERT_ERR(kvp_config_parse_duration(bad[i], 1, &v), KVP_EINVAL);
    ASSERT_DOUBLE_NEAR(v, 7, 0);
  }
  ASSERT_ERR(kvp_config_parse_duration("1", 0, &v), KVP_EINVAL);
}

/* SIZE and DURATION fields: units bind, bounds name the field. */
TEST(typed_units) {
  char err[256];
  kvp_config *c = load("x:\n  size: 1T\n  lat: 250us\n  bare: 20\n", err,
                       sizeof err);
  ASSERT_NOT_NULL(c);
  uint64_t size = 0;
  double lat = 0, bare = 0;
  kvp_config_field f[] = {KVP_CFG_SIZE("size", &size, 0, 2e12),
                          KVP_CFG_DURATION("lat", &lat, 0, 1, 1000),
                          KVP_CFG_DURATION("bare", &bare, 0, 1, 1000)};
  kvp_config_section s = {"x", f, 3};
  ASSERT_EQ(kvp_config_bind(c, &s, err, sizeof err), 3);
  ASSERT_EQ(size, 1000000000000ull);
  ASSERT_DOUBLE_NEAR(lat, 250e-6, 1e-15);
  ASSERT_DOUBLE_NEAR(bare, 0.02, 1e-15); /* bare: ms */
  kvp_config_destroy(c);
  c = load("x:\n  size: 3T\n", err, sizeof err);
  ASSERT_ERR(kvp_config_bind(c, &s, err, sizeof err), KVP_EINVAL);
  ASSERT_STR_EQ(err, "t.yaml:2: x.size: expected a size in [0, 2000000000000] "
                     "bytes (4096, 64M, 1.5GiB, 1T), got '3T'");
  kvp_config_destroy(c);
  c = load("x:\n  lat: 2s\n", err, sizeof err);
  ASSERT_ERR(kvp_config_bind(c, &s, err, sizeof err), KVP_EINVAL);
  ASSERT_STR_EQ(err, "t.yaml:2: x.lat: expected a duration in [0, 1] s "
                     "(10us, 2ms, 1s; a bare number counts ms), got '2s'");
  kvp_config_destroy(c);
}

/* The size keys of `tiers:` take units. */
TEST(tiers_sizes) {
  char err[256];
  kvp_tier_opts o = {0};
  ASSERT_EQ(tiers("tiers:\n  dram_bytes: 1T\n  nvme_bytes: 1e12\n"
                  "  max_block_bytes: 2MiB\n",
                  &o, NULL, 0, err, sizeof err),
            3);
  ASSERT_EQ(o.dram_bytes, 1000000000000ull);
  ASSERT_EQ(o.nvme_bytes, 1000000000000ull);
  ASSERT_EQ(o.max_block_bytes, 2097152u);
}

/* A directory given as the config file says so, with its path. */
TEST(load_directory) {
  char err[256];
  kvp_config *c = (kvp_config *)1;
  ASSERT_ERR(kvp_config_load_file("/tmp", NULL, &c, err, sizeof err),
             -EISDIR);
  ASSERT_NULL(c);
  ASSERT_STR_EQ(err, "/tmp: is a directory, not a YAML file");
}

/* After a section's bind fails, only its real error is reported: the
 * section is not also "unknown". */
TEST(failed_bind_not_unknown) {
  char err[256];
  kvp_config *c = load("tiers:\n  queue_depth: 5000\nbogus:\n  a: 1\n", err,
                       sizeof err);
  ASSERT_NOT_NULL(c);
  kvp_tier_opts o = {0};
  ASSERT_ERR(kvp_tier_opts_from_config(c, &o, NULL, 0, err, sizeof err),
             KVP_EINVAL);
  ASSERT_NOT_NULL(strstr(err, "tiers.queue_depth"));
  ASSERT_ERR(kvp_config_check_unbound(c, NULL, 0, err, sizeof err),
             KVP_EINVAL);
  ASSERT_STR_EQ(err, "t.yaml:3: unknown section 'bogus'");
  kvp_config_destroy(c);
}

/* ---- `model:`, `gpu:`, `routing:` bound by the router ---------------------- */
static int route_cfg(const char *y, kvp_router_opts *o, char *pol,
                     size_t pcap, char *err, size_t cap) {
  kvp_config *c = load(y, err, cap);
  ASSERT_NOT_NULL(c);
  err[0] = '\0';
  int rc = kvp_router_opts_from_config(c, o, pol, pcap, err, cap);
  if (rc >= 0)
    ASSERT_OK(kvp_config_check_unbound(c, NULL, 0, err, cap));
  kvp_config_destroy(c);
  return rc;
}

TEST(router_keys) {
  char err[256], pol[128] = "";
  kvp_router_opts o = {.n_workers = 3};
  int n = route_cfg("model:\n  layers: 40\n  heads: 40\n  kv_heads: 8\n"
                    "  head_dim: 128\n  dtype_bytes: 2\n  params_billion: 13\n"
                    "  block_size: 32\n"
                    "gpu:\n  tflops: 400\n  efficiency: 0.4\n"
                    "  hbm_bandwidth_gbps: 2000\n  dram_bandwidth_gbps: 25\n"
                    "  nvme_bandwidth_gbps: 3\n  dram_latency_us: 15\n"
                    "  nvme_latency_us: 0.2ms\n  prefill_overhead_s: 170ms\n"
                    "routing:\n  policies: [kvplane_cost, random]\n"
                    "  guard: 1.5\n  guard_min_load: 2\n  guard_load: requests\n"
                    "  affinity_eps_rel: 0.1\n  tie_rel: 0.02\n"
                    "  dynamo_temperature: 0.5\n  llmd_w_prefix: 2.5\n"
                    "  llmd_w_kv: 1.5\n  llmd_w_queue: 3.5\n"
                    "  pending: 1.5s\n  inflight_decay: on\n",
                    &o, pol, sizeof pol, err, sizeof err);
  if (n < 0)
    fprintf(stderr, "%s\n", err);
  ASSERT_EQ(n, 27);
  ASSERT_EQ(o.pending_ms, 1500u);
  ASSERT_EQ(o.inflight_decay, 1u);
  ASSERT_EQ(o.n_workers, 3u); /* not a config key: kept */
  ASSERT_EQ(o.model.layers, 40u);
  ASSERT_EQ(o.model.heads, 40u);
  ASSERT_EQ(o.model.kv_heads, 8u);
  ASSERT_EQ(o.model.head_dim, 128u);
  ASSERT_EQ(o.model.dtype_bytes, 2u);
  ASSERT_DOUBLE_NEAR(o.model.params, 13e9, 1e-3);
  ASSERT_EQ(o.block_size, 32u);
  ASSERT_DOUBLE_NEAR(o.gpu.flops, 400e12, 1);
  ASSERT_DOUBLE_NEAR(o.gpu.efficiency, 0.4, 1e-15);
  ASSERT_DOUBLE_NEAR(o.gpu.bw[KVP_TIER_HBM], 2000e9, 1e-3);
  ASSERT_DOUBLE_NEAR(o.gpu.bw[KVP_TIER_DRAM], 25e9, 1e-3);
  ASSERT_DOUBLE_NEAR(o.gpu.bw[KVP_TIER_NVME], 3e9, 1e-3);
  ASSERT_DOUBLE_NEAR(o.gpu.bw[KVP_TIER_REMOTE], 0, 0);
  ASSERT_DOUBLE_NEAR(o.gpu.latency_s[KVP_TIER_DRAM], 15e-6, 1e-18);
  ASSERT_DOUBLE_NEAR(o.gpu.latency_s[KVP_TIER_NVME], 200e-6, 1e-18);
  ASSERT_DOUBLE_NEAR(o.gpu.prefill_overhead_s, 0.17, 1e-15);
  ASSERT_EQ(o.guard_load, (uint32_t)KVP_GUARD_LOAD_REQUESTS);
  ASSERT_STR_EQ(pol, "kvplane_cost,random");
  ASSERT_DOUBLE_NEAR(o.guard, 1.5, 0);
  ASSERT_EQ(o.guard_min_load, 2u);
  ASSERT_DOUBLE_NEAR(o.affinity_eps_rel, 0.1, 0);
  ASSERT_DOUBLE_NEAR(o.tie_rel, 0.02, 0);
  ASSERT_DOUBLE_NEAR(o.dynamo_temperature, 0.5, 0);
  ASSERT_DOUBLE_NEAR(o.llmd_w_prefix, 2.5, 0);
  ASSERT_DOUBLE_NEAR(o.llmd_w_kv, 1.5, 0);
  ASSERT_DOUBLE_NEAR(o.llmd_w_queue, 3.5, 0);
  /* what binds makes a router */
  kvp_router *r;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  ASSERT_DOUBLE_NEAR(kvp_router_bandwidth(r, KVP_TIER_HBM), 2000e9, 1e-3);
  kvp_router_destroy(r);
  /* absent keys keep the caller's values; no sections bind nothing */
  kvp_router_opts p = {.guard = 3, .block_size = 16};
  ASSERT_EQ(route_cfg("routing:\n  tie_rel: 0.5\n", &p, NULL, 0, err,
                      sizeof err), 1);
  ASSERT_DOUBLE_NEAR(p.guard, 3, 0);
  ASSERT_EQ(p.block_size, 16u);
  ASSERT_DOUBLE_NEAR(p.tie_rel, 0.5, 0);
  ASSERT_EQ(route_cfg("", &p, NULL, 0, err, sizeof err), 0);
}

/* Every refusal names file:line and section.key, and changes nothing. */
static void router_refuses(const char *y, const char *want) {
  char err[512], pol[32] = "keep";
  kvp_router_opts o = {.guard = 9};
  ASSERT_ERR(route_cfg(y, &o, pol, sizeof pol, err, sizeof err), KVP_EINVAL);
  if (strstr(err, want) == NULL)
    fprintf(stderr, "got: %s\nwant: %s\n", err, want);
  ASSERT_NOT_NULL(strstr(err, want));
  ASSERT_DOUBLE_NEAR(o.guard, 9, 0);
  ASSERT_EQ(o.model.layers, 0u);
  ASSERT_STR_EQ(pol, "keep");
}

TEST(router_bad) {
  router_refuses("routing:\n  policies: []\n",
             "t.yaml:2: routing.policies: expected a list of 1 to 64 "
             "non-empty items ([a, b]), got '[]'");
  router_refuses("routing:\n  guard: 0.5\n",
             "t.yaml:2: routing.guard: expected a number in [1, 1000]");
  router_refuses("routing:\n  gaurd: 2\n",
             "t.yaml:2: unknown key 'gaurd' in section 'routing'");
  router_refuses("routing:\n  policies: [kvplane_cost, dynamo_cost, round_robin, "
             "least_loaded]\n",
             "t.yaml:2: routing.policies: longer than 31 bytes");
  router_refuses("model:\n  layers: 32\n  heads: 32\n",
             "t.yaml:2: model: needs all of layers, heads, kv_heads, "
             "head_dim, dtype_bytes, params_billion");
  router_refuses("model:\n  layers: 32\n  heads: 8\n  kv_heads: 16\n"
             "  head_dim: 128\n  dtype_bytes: 2\n  params_billion: 8\n",
             "t.yaml:2: model: kv_heads must be <= heads");
  router_refuses("model:\n  block_size: 0\n",
             "t.yaml:2: model.block_size: expected an integer in [1, 65536]");
  router_refuses("gpu:\n  dram_latency_us: 2s\n",
             "t.yaml:2: gpu.dram_latency_us: expected a duration in [1e-09, "
             "1] s (10us, 2ms, 1s; a bare number counts us), got '2s'");
  router_refuses("routing:\n  guard_load: decode\n",
             "t.yaml:2: routing.guard_load: 'decode': expected prefill or requests");
  router_refuses("routing:\n  pending: 2h\n",
             "t.yaml:2: routing.pending: expected a duration");
  router_refuses("routing:\n  inflight_decay: maybe\n",
             "t.yaml:2: routing.inflight_decay: expected true or false");
  router_refuses("gpu:\n  prefill_overhead_s: 2min\n",
             "t.yaml:2: gpu.prefill_overhead_s: expected a duration");
  router_refuses("gpu:\n  efficiency: [0.5]\n",
             "t.yaml:2: gpu.efficiency: expected one value, got a list");
  /* a later section's error: the earlier sections' keys are not applied */
  router_refuses("routing:\n  guard: 2\ngpu:\n  tflops: fast\n",
             "t.yaml:4: gpu.tflops: expected a number");
}

TEST_MAIN(TEST_ENTRY(good), TEST_ENTRY(bad_values), TEST_ENTRY(bad_shapes),
          TEST_ENTRY(shipped_example), TEST_ENTRY(tiers_good),
          TEST_ENTRY(tiers_admission), TEST_ENTRY(tiers_unknown_key), TEST_ENTRY(tiers_out_of_range),
          TEST_ENTRY(tiers_wrong_type), TEST_ENTRY(key_line),
          TEST_ENTRY(parse_size), TEST_ENTRY(parse_duration),
          TEST_ENTRY(typed_units), TEST_ENTRY(tiers_sizes),
          TEST_ENTRY(load_directory), TEST_ENTRY(failed_bind_not_unknown),
          TEST_ENTRY(router_keys), TEST_ENTRY(router_bad))
