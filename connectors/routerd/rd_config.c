/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd configuration: one YAML file.  The daemon binds
 * `routerd:`, `workers:` and `namespace:`; the router module binds `model:`,
 * `gpu:` and `routing:` itself (kvp_router_opts_from_config), so a routing
 * section tuned offline with kvplane-bench is taken as is. */
#include "rd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void defaults(rd_cfg *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->listen, sizeof c->listen, "127.0.0.1:8000");
  snprintf(c->tenant_header, sizeof c->tenant_header, "x-tenant-id");
  snprintf(c->session_header, sizeof c->session_header, "x-session-id");
  snprintf(c->model_id, sizeof c->model_id, "default");
  snprintf(c->hash_algo, sizeof c->hash_algo, "xxh3_128");
  snprintf(c->policy, sizeof c->policy, "kvplane_cost");
  c->max_workers = 64;
  c->max_body = 64u << 20;
  c->max_headers = 64u << 10;
  c->max_upstream_body = 16u << 20;
  c->max_connections = 8192;
  c->max_inflight = 4096;
  c->client_request_timeout_s = 60;
  c->retries = 2;
  c->breaker_failures = 3;
  c->stream_buffer = 1u << 20;
  c->render = true;
  snprintf(c->threads_s, sizeof c->threads_s, "1");
  snprintf(c->response_headers_s, sizeof c->response_headers_s, "auto");
  c->connect_timeout_s = 2;
  c->request_timeout_s = 600;
  c->client_timeout_s = 30;
  c->scrape_interval_s = 0.25;
  c->scrape_budget = 0.02;
  c->breaker_cooldown_s = 5;
  c->drain_timeout_s = 30;
  c->approx_ttl_s = 120;
  c->ropts.block_size = 16;
  snprintf(c->subject_prefix, sizeof c->subject_prefix, "kvplane.routerd");
  c->snapshot_interval_s = 0.1;
  c->peer_timeout_s = 1;
  snprintf(c->events_stream, sizeof c->events_stream, "KVPLANE_EVENTS");
  snprintf(c->events_prefix, sizeof c->events_prefix, "kvplane.events");
}

static int bind_own(kvp_config *k, rd_cfg *c, char *err, size_t cap) {
  const kvp_config_field rf[] = {
      KVP_CFG_STR("listen", c->listen, sizeof c->listen),
      KVP_CFG_STR("admin_listen", c->admin_listen, sizeof c->admin_listen),
      KVP_CFG_STR("admin_token", c->admin_token, sizeof c->admin_token),
      KVP_CFG_STR("indexer_listen", c->indexer_listen, sizeof c->indexer_listen),
      KVP_CFG_STR("indexer_token", c->indexer_token, sizeof c->indexer_token),
      KVP_CFG_BOOL("indexer_routes", &c->indexer_routes),
      KVP_CFG_STR("salt_secret", c->salt_secret, sizeof c->salt_secret),
      KVP_CFG_STR("response_headers", c->response_headers_s,
                  sizeof c->response_headers_s),
      KVP_CFG_STR("receipts", c->receipts, sizeof c->receipts),
      KVP_CFG_STR("tenant_header", c->tenant_header, sizeof c->tenant_header),
      KVP_CFG_STR("session_header", c->session_header, sizeof c->session_header),
      KVP_CFG_STR("policy", c->policy, sizeof c->policy),
      KVP_CFG_U64("max_workers", &c->max_workers, 1, RD_WORKERS_MAX),
      KVP_CFG_SIZE("max_body", &c->max_body, 1024, 1u << 30),
      KVP_CFG_SIZE("max_headers", &c->max_headers, 1024, 1u << 24),
      KVP_CFG_U64("max_connections", &c->max_connections, 0, 1u << 24),
      KVP_CFG_U64("max_inflight", &c->max_inflight, 0, 1u << 24),
      KVP_CFG_DURATION("client_request_timeout", &c->client_request_timeout_s,
                       0.001, 86400, 1),
      KVP_CFG_SIZE("max_upstream_body", &c->max_upstream_body, 4096, 1u << 30),
      KVP_CFG_U64("retries", &c->retries, 0, 16),
      KVP_CFG_U64("breaker_failures", &c->breaker_failures, 1, 1000),
      KVP_CFG_SIZE("stream_buffer", &c->stream_buffer, 4096, 1u << 30),
      KVP_CFG_BOOL("render", &c->render),
      KVP_CFG_STR("threads", c->threads_s, sizeof c->threads_s),
      KVP_CFG_DURATION("connect_timeout", &c->connect_timeout_s, 0.001, 600, 1),
      KVP_CFG_DURATION("request_timeout", &c->request_timeout_s, 0.001, 86400, 1),
      KVP_CFG_DURATION("client_timeout", &c->client_timeout_s, 0.001, 3600, 1),
      KVP_CFG_DURATION("scrape_interval", &c->scrape_interval_s, 0.01, 3600, 1),
      KVP_CFG_F64("scrape_budget", &c->scrape_budget, 0, 1),
      KVP_CFG_DURATION("breaker_cooldown", &c->breaker_cooldown_s, 0.01, 3600, 1),
      KVP_CFG_DURATION("drain_timeout", &c->drain_timeout_s, 0, 3600, 1),
      KVP_CFG_DURATION("approx_ttl", &c->approx_ttl_s, 0.001, 86400, 1),
  };
  const kvp_config_field wf[] = {
      KVP_CFG_LIST("urls", c->urls, sizeof c->urls, 0, RD_WORKERS_MAX),
      KVP_CFG_LIST("kv_events", c->kv_events, sizeof c->kv_events, 0, RD_WORKERS_MAX),
      KVP_CFG_LIST("kv_replay", c->kv_replay, sizeof c->kv_replay, 0, RD_WORKERS_MAX),
      KVP_CFG_LIST("roles", c->roles, sizeof c->roles, 0, RD_WORKERS_MAX),
  };
  const kvp_config_field df[] = { /* P/D: the KV link between workers */
      KVP_CFG_F64("link_gbps", &c->pd_link_gbps, 0.001, 1e6),
      KVP_CFG_DURATION("link_latency_us", &c->pd_link_latency_s, 1e-9, 60,
                       1000000),
  };
  const kvp_config_field nf[] = {
      KVP_CFG_STR("model_id", c->model_id, sizeof c->model_id),
      KVP_CFG_STR("hash", c->hash_algo, sizeof c->hash_algo),
      KVP_CFG_BOOL("engine_hash", &c->engine_hash),
  };
  const kvp_config_field pf[] = {
      KVP_CFG_STR("nats_url", c->nats_url, sizeof c->nats_url),
      KVP_CFG_STR("subject_prefix", c->subject_prefix, sizeof c->subject_prefix),
      KVP_CFG_U64("replica_id", &c->replica_id, 0, UINT32_MAX),
      KVP_CFG_DURATION("snapshot_interval", &c->snapshot_interval_s, 0.001, 60, 1),
      KVP_CFG_DURATION("peer_timeout", &c->peer_timeout_s, 0.01, 3600, 1),
      KVP_CFG_STR("events_stream", c->events_stream, sizeof c->events_stream),
      KVP_CFG_STR("events_prefix", c->events_prefix, sizeof c->events_prefix),
  };
  const kvp_config_section secs[] = {{"routerd", rf, sizeof rf / sizeof *rf},
                                     {"workers", wf, sizeof wf / sizeof *wf},
                                     {"namespace", nf, sizeof nf / sizeof *nf},
                                     {"replicas", pf, sizeof pf / sizeof *pf},
                                     {"pd", df, sizeof df / sizeof *df}};
  for (size_t i = 0; i < sizeof secs / sizeof *secs; i++)
    if (kvp_config_bind(k, &secs[i], err, cap) < 0)
      return -1;
  return 0;
}

static size_t count_items(const char *list) {
  if (*list == '\0')
    return 0;
  size_t n = 1;
  for (; *list; list++)
    n += *list == ',';
  return n;
}

static int where(kvp_config *k, const char *sec, const char *key, char *err,
                 size_t cap, const char *msg) {
  const char *name = "config";
  int line = kvp_config_key_line(k, sec, key, &name);
  snprintf(err, cap, "%s:%d: %s.%s: %s", name, line > 0 ? line : 0, sec, key,
           msg);
  return -1;
}

/* routerd.threads: a count, or `auto` (the online CPUs, at most 16: past
 * that the one routing lock, not the CPUs, bounds the rate).  Replicas
 * work with any count: each loop publishes its own decisions
 * (rd_sync.c). */
static int check_threads(kvp_config *k, rd_cfg *c, char *err, size_t cap) {
  char *end;
  long n = strtol(c->threads_s, &end, 10);
  if (strcmp(c->threads_s, "auto") == 0) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    n = cpus < 1 ? 1 : cpus > RD_THREADS_AUTO ? RD_THREADS_AUTO : cpus;
  } else if (*end != '\0' || end == c->threads_s || n < 1 ||
             n > RD_THREADS_MAX)
    return where(k, "routerd", "threads", err, cap, "expected an integer in "
                 "[1, 64] or auto");
  c->threads = (uint32_t)n;
  return 0;
}

bool rd_loopback(const char *hostport) {
  char host[RD_URL_MAX];
  uint16_t port;
  if (rd_split_hostport(hostport, host, sizeof host, &port) < 0)
    return false;
  return strncmp(host, "127.", 4) == 0 || strcmp(host, "localhost") == 0 ||
         strcmp(host, "::1") == 0 || strcmp(host, "[::1]") == 0;
}

/* A listener that changes what the router routes to (admin, the indexer's
 * /register) reachable from other hosts without a token: refused. */
static int check_access(kvp_config *k, rd_cfg *c, char *err, size_t cap) {
  static const char *const rh[] = {"auto", "true", "false"};
  c->response_headers = -1;
  for (int i = 0; i < 3; i++)
    if (strcmp(c->response_headers_s, rh[i]) == 0)
      c->response_headers = i;
  if (c->response_headers < 0)
    return where(k, "routerd", "response_headers", err, cap,
                 "expected auto, true or false");
  if (*c->admin_listen && !rd_loopback(c->admin_listen) && !*c->admin_token)
    return where(k, "routerd", "admin_listen", err, cap, "off loopback "
                 "without routerd.admin_token: anyone who reaches it could "
                 "add or remove workers; set admin_token");
  if (*c->indexer_listen && !rd_loopback(c->indexer_listen) &&
      !*c->admin_token && !*c->indexer_token)
    return where(k, "routerd", "indexer_listen", err, cap, "off loopback "
                 "without routerd.indexer_token (or admin_token): anyone who "
                 "reaches it could register or unregister workers; set one");
  return 0;
}

int rd_cfg_warn(const rd_cfg *c, FILE *f) {
  int n = 0;
  if (!rd_loopback(c->listen))
    n += fprintf(f, "kvplane-routerd: WARNING: routerd.listen %s is off "
                 "loopback and the front door asks no token (it passes the "
                 "client's Authorization to the workers): put it behind a "
                 "firewall or an authenticating proxy\n", c->listen) > 0;
  if (!*c->salt_secret && *c->nats_url)
    n += fprintf(f, "kvplane-routerd: WARNING: replicas without "
                 "routerd.salt_secret: each replica derives tenant cache "
                 "salts from its own random key, so a tenant's prefixes are "
                 "not shared between replicas; set the same secret on all\n") > 0;
  return n;
}

/* workers.roles: one per url, prefill / decode / both; P/D when some
 * worker is not both, and then each leg has a worker */
static int check_roles(kvp_config *k, rd_cfg *c, char *err, size_t cap) {
  bool leg[3] = {false, false, false};
  size_t n = 0;
  for (const char *p = c->roles; *c->roles && p; n++) {
    size_t len = strcspn(p, ",");
    char name[16];
    rd_role r;
    snprintf(name, sizeof name, "%.*s", (int)(len < 15 ? len : 15), p);
    if (len >= sizeof name || rd_role_parse(name, &r) < 0)
      return where(k, "workers", "roles", err, cap, "expected prefill, "
                   "decode or both for each url");
    leg[r] = true;
    p = p[len] ? p + len + 1 : NULL;
  }
  if (n && n != count_items(c->urls))
    return where(k, "workers", "roles", err, cap,
                 "one entry per url expected");
  c->pd = leg[RD_ROLE_PREFILL] || leg[RD_ROLE_DECODE];
  if (c->pd && !((leg[RD_ROLE_PREFILL] || leg[RD_ROLE_BOTH]) &&
                 (leg[RD_ROLE_DECODE] || leg[RD_ROLE_BOTH])))
    return where(k, "workers", "roles", err, cap, "P/D needs a worker for "
                 "each leg: a prefill (or both) and a decode (or both)");
  return 0;
}

static int check(kvp_config *k, rd_cfg *c, char *err, size_t cap) {
  char host[RD_URL_MAX];
  uint16_t port;
  kvp_policy p;
  kvp_hash_algo a;
  size_t nu = count_items(c->urls);
  if (rd_split_hostport(c->listen, host, sizeof host, &port) < 0)
    return where(k, "routerd", "listen", err, cap, "expected host:port");
  if (check_threads(k, c, err, cap) < 0 || check_access(k, c, err, cap) < 0)
    return -1;
  if (kvp_policy_parse(c->policy, &p) < 0)
    return where(k, "routerd", "policy", err, cap, "unknown policy (kvplane_"
                 "cost, round_robin, least_loaded, prefix_greedy, sglang_cache"
                 "_aware, llmd_weighted, dynamo_cost)");
  c->ropts.policy = p;
  if (kvp_hash_algo_parse(c->hash_algo, &a) < 0 ||
      (a != KVP_HASH_XXH3_128 && a != KVP_HASH_SHA256))
    return where(k, "namespace", "hash", err, cap,
                 "expected xxh3_128 or sha256 (kvplane's native keys)");
  if (nu > c->max_workers)
    return where(k, "workers", "urls", err, cap, "more workers than "
                 "routerd.max_workers");
  if (*c->kv_events && count_items(c->kv_events) != nu)
    return where(k, "workers", "kv_events", err, cap,
                 "one entry per url expected ('-' for none)");
  if (strstr(c->kv_events, "js:") && *c->nats_url == '\0')
    return where(k, "workers", "kv_events", err, cap, "js:NAME (KV events "
                 "from JetStream) needs replicas.nats_url");
  if (*c->kv_replay && count_items(c->kv_replay) != nu)
    return where(k, "workers", "kv_replay", err, cap,
                 "one entry per url expected ('-' for none)");
  return check_roles(k, c, err, cap);
}

/* a routing.policies list (kvplane-bench's, several to compare): its first
 * one routes, unless routerd.policy names one */
static int take_policies(kvp_config *k, rd_cfg *c, const char *pols,
                         char *err, size_t cap) {
  if (*pols == '\0' || kvp_config_key_line(k, "routerd", "policy", NULL) > 0)
    return 0;
  size_t n = strcspn(pols, ",");
  if (n >= sizeof c->policy)
    return where(k, "routing", "policies", err, cap, "policy name too long");
  memcpy(c->policy, pols, n);
  c->policy[n] = '\0';
  return 0;
}

/* The routing section binds each key's type and range; the router itself
 * checks how they fit together (kvp_router_create, which logs the option
 * it refuses): a config it would refuse at start, or on SIGHUP, fails
 * here too, so --check-config says so. */
static int check_router(const char *path, const rd_cfg *c, char *err,
                        size_t cap) {
  kvp_router *r = NULL;
  int rc = kvp_router_create(&c->ropts, NULL, &r);
  if (rc < 0) {
    snprintf(err, cap, "%s: routing: the router refuses these options (%s; "
             "the line above names the option)", path, kvp_strerror(rc));
    return -1;
  }
  kvp_router_destroy(r);
  return 0;
}

int rd_cfg_load(const char *path, rd_cfg *c, char *err, size_t cap) {
  kvp_config *k = NULL;
  defaults(c);
  snprintf(c->path, sizeof c->path, "%s", path);
  if (kvp_config_load_file(path, NULL, &k, err, cap) < 0)
    return -1;
  int rc = -1;
  char pols[512] = "";
  if (bind_own(k, c, err, cap) < 0 ||
      kvp_router_opts_from_config(k, &c->ropts, pols, sizeof pols, err,
                                  cap) < 0 ||
      take_policies(k, c, pols, err, cap) < 0 ||
      kvp_config_check_unbound(k, NULL, 0, err, cap) < 0 ||
      check(k, c, err, cap) < 0)
    goto out;
  c->ropts.n_workers = (uint32_t)c->max_workers;
  if (c->pd_link_gbps > 0) /* P/D: the decode leg's transfer price */
    c->ropts.gpu.bw[KVP_TIER_REMOTE] = c->pd_link_gbps * 1e9;
  if (c->pd_link_latency_s > 0)
    c->ropts.gpu.latency_s[KVP_TIER_REMOTE] = c->pd_link_latency_s;
  c->ropts.replica_id = c->replica_id ? (uint32_t)c->replica_id
                                      : (uint32_t)getpid();
  rc = check_router(path, c, err, cap);
out:
  kvp_config_destroy(k);
  return rc;
}

int rd_split_hostport(const char *s, char *host, size_t cap, uint16_t *port) {
  const char *colon = strrchr(s, ':');
  if (colon == NULL || colon == s || (size_t)(colon - s) >= cap)
    return -1;
  char *end;
  long v = strtol(colon + 1, &end, 10);
  if (*end != '\0' || end == colon + 1 || v < 0 || v > 65535)
    return -1;
  memcpy(host, s, (size_t)(colon - s));
  host[colon - s] = '\0';
  *port = (uint16_t)v;
  return 0;
}
