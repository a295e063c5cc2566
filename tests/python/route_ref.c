/* SPDX-License-Identifier: Apache-2.0 */
/* The C side of connectors/python/tests/test_router.py: runs a routing
 * scenario through the C API and prints one receipt (kvp_router_receipt_json)
 * a line, for the Python package to reproduce byte for byte.  Input lines:
 *   router N_WORKERS BLOCK_SIZE POLICY
 *   load WORKER QUEUED RUNNING PREFILL_TOKENS DECODE_BLOCKS KV_UTIL
 *   stored WORKER SEQ TIER KEY...        (KEY: 32 hex digits, hi then lo)
 *   route NOW_NS PROMPT_TOKENS TENANT SESSION REQUEST KEY...
 *   complete                             (the last decision's request)
 * Exit 0, 1 on any failure (with a message). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"

#define MAX_KEYS 4096

typedef struct state {
  kvp_router *r;
  kvp_index *ix;
  uint32_t block_size;
  kvp_decision last;
} state;

static int fail(const char *what, int rc) {
  fprintf(stderr, "route_ref: %s: %s\n", what, kvp_strerror(rc));
  return 1;
}

/* Parses the remaining blank-separated 32-hex-digit keys of the line. */
static size_t read_keys(kvp_key *keys) {
  size_t n = 0;
  char *tok;
  while (n < MAX_KEYS && (tok = strtok(NULL, " \n")) != NULL) {
    char hi[17] = {0};
    memcpy(hi, tok, 16);
    keys[n].hi = strtoull(hi, NULL, 16);
    keys[n].lo = strtoull(tok + 16, NULL, 16);
    n++;
  }
  return n;
}

static const char *next(void) {
  const char *t = strtok(NULL, " \n");
  return t != NULL ? t : "";
}

static int cmd_router(state *s) {
  kvp_router_opts o = {0};
  o.n_workers = (uint32_t)atoi(next());
  o.block_size = s->block_size = (uint32_t)atoi(next());
  int rc = kvp_policy_parse(next(), &o.policy);
  if (rc < 0 || (rc = kvp_router_create(&o, NULL, &s->r)) < 0)
    return fail("router", rc);
  if ((rc = kvp_index_create(NULL, NULL, &s->ix)) < 0)
    return fail("index", rc);
  for (uint32_t w = 0; w < o.n_workers; w++)
    if ((rc = kvp_index_worker_add(s->ix, w)) < 0)
      return fail("worker_add", rc);
  return 0;
}

static int cmd_load(state *s) {
  kvp_worker_load l = {0};
  uint32_t w = (uint32_t)atoi(next());
  l.queued_requests = (uint32_t)atoi(next());
  l.running_requests = (uint32_t)atoi(next());
  l.prefill_tokens = strtoull(next(), NULL, 10);
  l.decode_blocks = strtoull(next(), NULL, 10);
  l.kv_util = atof(next());
  int rc = kvp_router_set_load(s->r, w, &l);
  return rc < 0 ? fail("load", rc) : 0;
}

static int cmd_stored(state *s, kvp_key *keys) {
  uint32_t w = (uint32_t)atoi(next());
  uint64_t seq = strtoull(next(), NULL, 10);
  kvp_tier tier;
  int rc = kvp_tier_parse(next(), &tier);
  if (rc == 0)
    rc = kvp_index_stored(s->ix, w, seq, tier, NULL, keys, read_keys(keys));
  return rc < 0 ? fail("stored", rc) : 0;
}

static int cmd_route(state *s, kvp_key *keys) {
  uint64_t now = strtoull(next(), NULL, 10);
  kvp_route_request q = {0};
  q.prompt_tokens = strtoull(next(), NULL, 10);
  char names[3][128];
  for (int i = 0; i < 3; i++)
    snprintf(names[i], sizeof names[i], "%s", next());
  q.tenant = kvp_id64(names[0]);
  q.session_id = kvp_id64(names[1]);
  q.request_id = kvp_id64(names[2]);
  q.keys = keys;
  q.n_blocks = read_keys(keys);
  q.block_size = s->block_size;
  int rc = kvp_router_route(s->r, s->ix, &q, now, &s->last);
  if (rc < 0)
    return fail("route", rc);
  kvp_route_names nm = {names[0], names[1], names[2], 0, {0}};
  static char buf[1 << 16];
  if ((rc = kvp_router_receipt_json(&s->last, &nm, buf, sizeof buf)) < 0)
    return fail("receipt", rc);
  puts(buf);
  return 0;
}

int main(void) {
  static kvp_key keys[MAX_KEYS];
  static char line[1 << 17];
  state s = {0};
  int rc = 0;
  while (rc == 0 && fgets(line, sizeof line, stdin) != NULL) {
    const char *cmd = strtok(line, " \n");
    if (cmd == NULL)
      continue;
    if (strcmp(cmd, "router") == 0)
      rc = cmd_router(&s);
    else if (strcmp(cmd, "load") == 0)
      rc = cmd_load(&s);
    else if (strcmp(cmd, "stored") == 0)
      rc = cmd_stored(&s, keys);
    else if (strcmp(cmd, "route") == 0)
      rc = cmd_route(&s, keys);
    else if (strcmp(cmd, "complete") == 0)
      rc = kvp_router_complete(s.r, s.last.worker, s.last.request_id) < 0;
    else
      rc = fail(cmd, KVP_EINVAL);
  }
  kvp_router_destroy(s.r);
  kvp_index_destroy(s.ix);
  return rc;
}
