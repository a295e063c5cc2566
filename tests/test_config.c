/* SPDX-License-Identifier: Apache-2.0 */
/* core/config: the YAML loader and binder -- values of every type, lists,
 * unknown keys and sections with their lines, bad values, duplicates,
 * aliases and other shapes that must be refused, the shipped example. */
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
                                KVP_CFG_STR("policies", o->pol, sizeof o->pol)};
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

TEST_MAIN(TEST_ENTRY(good), TEST_ENTRY(bad_values), TEST_ENTRY(bad_shapes),
          TEST_ENTRY(shipped_example))
