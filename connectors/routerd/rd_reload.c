/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd SIGHUP (systemctl reload): the config file is read again
 * and, once it validates, every setting that can change live is applied;
 * those fixed at start (listeners, threads, the namespace, worker slots,
 * replicas) keep their running values and are named in one WARN line. */
#include "rd.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- settings that take a restart ----------------------------------------
 * They made the listening sockets, the hashers (namespace), the index's and
 * router's worker slots or the NATS connection; a reload
 * keeps the running value.  name NULL: derived from a named one, kept
 * silently. */
typedef struct fixed_key {
  const char *name;
  size_t off, len;
  bool str; /* compared up to its NUL */
} fixed_key;

#define FIXED_(name, field, str) {name, offsetof(rd_cfg, field), \
                                  sizeof(((rd_cfg *)0)->field), str}
static const fixed_key fixed[] = {
    FIXED_("listen", listen, true),
    FIXED_("admin_listen", admin_listen, true),
    FIXED_("indexer_listen", indexer_listen, true),
    FIXED_("salt_secret", salt_secret, true),
    FIXED_("threads", threads_s, true),
    FIXED_(NULL, threads, false),
    FIXED_("max_workers", max_workers, false),
    FIXED_(NULL, ropts.n_workers, false),
    FIXED_("namespace.model_id", model_id, true),
    FIXED_("namespace.hash", hash_algo, true),
    FIXED_("namespace.engine_hash", engine_hash, false),
    FIXED_("model.block_size", ropts.block_size, false),
    FIXED_("replicas.nats_url", nats_url, true),
    FIXED_("replicas.subject_prefix", subject_prefix, true),
    FIXED_("replicas.replica_id", replica_id, false),
    FIXED_(NULL, ropts.replica_id, false),
    FIXED_("replicas.snapshot_interval", snapshot_interval_s, false),
    FIXED_("replicas.peer_timeout", peer_timeout_s, false),
    FIXED_("replicas.events_stream", events_stream, true),
    FIXED_("replicas.events_prefix", events_prefix, true),
};

/* Puts the running values of the fixed keys back into c; the names of
 * those that differ go into `changed` (", "-joined).  Returns how many. */
static int keep_fixed(const rd_cfg *run, rd_cfg *c, char *changed,
                      size_t cap) {
  int n = 0;
  size_t len = 0;
  *changed = '\0';
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++) {
    const char *was = (const char *)run + fixed[i].off;
    char *now = (char *)c + fixed[i].off;
    if (fixed[i].str ? strncmp(was, now, fixed[i].len) == 0
                     : memcmp(was, now, fixed[i].len) == 0)
      continue;
    memcpy(now, was, fixed[i].len);
    if (fixed[i].name == NULL || len >= cap)
      continue;
    len += (size_t)snprintf(changed + len, cap - len, "%s%s", n ? ", " : "",
                            fixed[i].name);
    n++;
  }
  return n;
}

/* ---- live settings ------------------------------------------------------- */
int rd_receipts_open(const char *path, FILE **out) {
  *out = NULL;
  if (*path == '\0')
    return 0;
  if (strcmp(path, "-") == 0) {
    *out = stdout;
    return 0;
  }
  if ((*out = fopen(path, "a")) == NULL)
    return -1;
  /* whole lines only: a reader tailing the file never sees half a receipt */
  setvbuf(*out, NULL, _IOLBF, 1 << 16);
  return 0;
}

/* The receipts file opened again at its configured path: after logrotate
 * renamed it, new receipts go to a new file.  On failure the open one is
 * kept (logged). */
static void receipts_reopen(rd_server *s) {
  FILE *f;
  if (rd_receipts_open(s->cfg.receipts, &f) < 0) {
    kvp_log(KVP_LOG_ERROR, "routerd", "reload: receipts %s: %s (receipts "
            "still go to the file open before)", s->cfg.receipts,
            strerror(errno));
    return;
  }
  pthread_mutex_lock(&s->rc_mu); /* the loops write receipts under it */
  FILE *was = s->receipts;
  s->receipts = f;
  if (was && was != stdout)
    fclose(was);
  else if (was)
    fflush(was);
  pthread_mutex_unlock(&s->rc_mu);
}

/* The workers' /metrics scrape connections are kept for good: they take
 * the new connect_timeout now.  (Request connections take theirs when made;
 * pooled keep-alive ones keep the old one until they close.) */
static void probe_timeouts(rd_server *s) {
  struct timeval tv = rd_tv(s->cfg.connect_timeout_s);
  for (uint32_t i = 0; i < s->n_w; i++)
    if (s->w[i].state != RD_W_FREE && s->w[i].probe) {
      evhttp_connection_set_timeout_tv(s->w[i].probe, &tv);
      evhttp_connection_set_max_body_size(s->w[i].probe,
                                          (ev_ssize_t)s->cfg.max_upstream_body);
    }
}

/* Everything but the router's options (applied first: they may refuse). */
static int apply_live(rd_server *s, double old_scrape) {
  struct evhttp *hs[] = {s->admin, s->indexer_http};
  for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
    if (hs[i]) /* limits of connections accepted from now on */
      rd_http_limits(&s->cfg, hs[i]);
  rd_loops_reconfigure(s); /* the front doors' copies and limits */
  if (s->cfg.scrape_interval_s != old_scrape)
    rd_tick_arm(s);
  probe_timeouts(s);
  kvp_index_set_approx_ttl(s->ix, (uint64_t)(s->cfg.approx_ttl_s * 1e9));
  receipts_reopen(s);
  return rd_apply_workers(s, &s->cfg);
}

void rd_config_applied(rd_server *s) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  rd_lock(s); /* /metrics reads them on any loop */
  s->config_ok_unix = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
  s->reload_failed = false;
  rd_unlock(s);
}

/* Applies c (validated) to the running server; -1 when the routing options
 * are refused (nothing applied then). */
static int apply(rd_server *s, rd_cfg *c) {
  char changed[512];
  int n = keep_fixed(&s->cfg, c, changed, sizeof changed);
  rd_lock(s); /* the router; s->cfg, which the loops copy under it */
  int rc = kvp_router_set_opts(s->router, &c->ropts);
  double old_scrape = s->cfg.scrape_interval_s;
  if (rc == 0)
    s->cfg = *c;
  rd_unlock(s);
  if (rc < 0) { /* logged the field */
    kvp_log(KVP_LOG_ERROR, "routerd", "reload refused, keeping the running "
            "config: %s: the routing options (model:, gpu:, routing:) do "
            "not hold (see the line above)", s->cfg.path);
    return -1;
  }
  int bad = apply_live(s, old_scrape);
  rd_lock(s); /* /metrics reads it under s->mu */
  s->restart_pending = n > 0;
  rd_unlock(s);
  if (n > 0)
    kvp_log(KVP_LOG_WARN, "routerd", "reload: %s changed: %s a restart "
            "(running %s kept)", changed, n > 1 ? "they take" : "it takes",
            n > 1 ? "values" : "value");
  kvp_log(KVP_LOG_WARN, "routerd", "reloaded %s: policy %s, max_body %llu, "
          "retries %llu, receipts %s, workers %s", s->cfg.path, s->cfg.policy,
          (unsigned long long)s->cfg.max_body,
          (unsigned long long)s->cfg.retries,
          *s->cfg.receipts ? s->cfg.receipts : "off",
          bad ? "applied (some refused: see above)" : "applied");
  return 0;
}

int rd_reload(rd_server *s) {
  rd_cfg *c = malloc(sizeof *c);
  char err[512];
  int rc = -1;
  if (c == NULL)
    kvp_log(KVP_LOG_ERROR, "routerd", "reload refused: out of memory");
  else if (rd_cfg_load(s->cfg.path, c, err, sizeof err) < 0)
    kvp_log(KVP_LOG_ERROR, "routerd", "reload refused, keeping the running "
            "config: %s", err);
  else
    rc = apply(s, c);
  free(c);
  rd_lock(s);
  if (rc == 0)
    s->reloads_ok++;
  else
    s->reloads_refused++, s->reload_failed = true;
  rd_unlock(s);
  if (rc == 0)
    rd_config_applied(s);
  return rc;
}
