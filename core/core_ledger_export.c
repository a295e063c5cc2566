/* SPDX-License-Identifier: Apache-2.0 */
/* The ledger's export: Prometheus text 0.0.4 (globals, health, per tenant)
 * and JSON lines (receipts, totals), written through kvplane/text.h from
 * snapshots taken under the ledger's lock and written without it. */
#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core_internal.h"
#include "core_ledger_internal.h"
#include "kvplane/text.h"

#define OUT_CHUNK 4096 /* bytes handed to a writer at a time */

/* Label values and JSON keys: the shared names (kvplane/common.h) and the
 * ledger's own (ledger.h). */
static const char *tier_n(int i) { return kvp_tier_name((kvp_tier)i); }
static const char *class_n(int i) { return kvp_class_name((kvp_class)i); }
static const char *cause_n(int i) {
  return kvp_miss_cause_name((kvp_miss_cause)i);
}

/* A caller's id: NULL or "" is null ("none"). */
static void json_name(kvp_text *o, const char *s) {
  kvp_text_json_str(o, s != NULL && *s != '\0' ? s : NULL);
}

/* ---- Prometheus -------------------------------------------------------------
 * Every totals field, once as a global family (kvplane_<name>) and once per
 * tenant (kvplane_tenant_<name>{tenant=...}). */
enum { DIM_NONE, DIM_TIER, DIM_CLASS, DIM_CAUSE };

static const struct dim {
  const char *label;
  const char *(*value)(int);
  size_t n;
} dims[] = {
    [DIM_NONE] = {NULL, NULL, 1},
    [DIM_TIER] = {"tier", tier_n, KVP_TIER_COUNT_},
    [DIM_CLASS] = {"class", class_n, KVP_CLASS_COUNT_},
    [DIM_CAUSE] = {"cause", cause_n, KVP_MISS_COUNT_},
};

typedef struct field {
  const char *name, *help;
  uint8_t dim, is_double;
  uint16_t off; /* into kvp_ledger_totals */
} field;

#define FIELD_(n, h, d, dbl, m)                                                \
  { n, h, d, dbl, offsetof(kvp_ledger_totals, m) }
static const field fields[] = {
    FIELD_("requests_total", "Requests recorded in the ledger.", DIM_NONE, 0,
           requests),
    FIELD_("prompt_tokens_total", "Prompt tokens of recorded requests.",
           DIM_NONE, 0, prompt_tokens),
    FIELD_("reused_tokens_total",
           "Prompt tokens served from cached KV, by the tier that held them.",
           DIM_TIER, 0, reused_by_tier),
    FIELD_("recomputed_tokens_total", "Prompt tokens prefilled (not reused).",
           DIM_NONE, 0, recomputed_tokens),
    FIELD_("class_prompt_tokens_total", "Prompt tokens by segment class.",
           DIM_CLASS, 0, prompt_by_class),
    FIELD_("class_reused_tokens_total",
           "Reused prompt tokens by segment class.", DIM_CLASS, 0,
           reused_by_class),
    FIELD_("miss_tokens_total", "Recomputed prompt tokens by miss cause.",
           DIM_CAUSE, 0, miss_tokens),
    FIELD_("prefill_avoided_tokens_total",
           "Prefill avoided, in tokens (equals reused tokens).", DIM_NONE, 0,
           reused_tokens),
    FIELD_("prefill_avoided_flops_total", "Prefill avoided, estimated FLOPs.",
           DIM_NONE, 1, avoided_flops),
    FIELD_("prefill_avoided_gpu_seconds_total",
           "Prefill avoided, estimated GPU-seconds.", DIM_NONE, 1,
           avoided_gpu_seconds),
    FIELD_("load_bytes_total",
           "KV bytes moved from each tier to serve reused tokens.", DIM_TIER, 0,
           load_bytes),
};

static void prom_head(kvp_text *o, const char *prefix, const char *name,
                      const char *type, const char *help) {
  kvp_text_puts(o, "# HELP "), kvp_text_puts(o, prefix), kvp_text_puts(o, name);
  kvp_text_puts(o, " "), kvp_text_puts(o, help);
  kvp_text_puts(o, "\n# TYPE "), kvp_text_puts(o, prefix),
      kvp_text_puts(o, name);
  kvp_text_puts(o, " "), kvp_text_puts(o, type), kvp_text_puts(o, "\n");
}

/* name{tenant="...",label="value"} ; either part optional. */
static void prom_name(kvp_text *o, const char *prefix, const char *name,
                      const char *tenant, const char *label,
                      const char *value) {
  kvp_text_puts(o, prefix), kvp_text_puts(o, name);
  if (tenant == NULL && label == NULL)
    return;
  kvp_text_puts(o, "{");
  if (tenant != NULL)
    kvp_text_puts(o, "tenant=\""), kvp_text_prom_label(o, tenant),
        kvp_text_puts(o, "\"");
  if (tenant != NULL && label != NULL)
    kvp_text_puts(o, ",");
  if (label != NULL)
    kvp_text_puts(o, label), kvp_text_puts(o, "=\""),
        kvp_text_prom_label(o, value), kvp_text_puts(o, "\"");
  kvp_text_puts(o, "}");
}

static void prom_field(kvp_text *o, const char *prefix, const field *f,
                       const char *tenant, const kvp_ledger_totals *t) {
  const struct dim *d = &dims[f->dim];
  const char *base = (const char *)t + f->off;
  for (size_t i = 0; i < d->n; i++) {
    prom_name(o, prefix, f->name, tenant, d->label,
              d->value ? d->value((int)i) : NULL);
    kvp_text_puts(o, " ");
    if (f->is_double) {
      double v;
      memcpy(&v, base + i * sizeof v, sizeof v);
      kvp_text_prom_num(o, v);
    } else {
      uint64_t v;
      memcpy(&v, base + i * sizeof v, sizeof v);
      kvp_text_u64(o, v);
    }
    kvp_text_puts(o, "\n");
  }
}

static void prom_hist(kvp_text *o, const char *name, const char *help,
                      const hist *h, const double *le, size_t n_le) {
  char tmp[40], bucket[64];
  uint64_t cum = 0;
  prom_head(o, "kvplane_", name, "histogram", help);
  snprintf(bucket, sizeof bucket, "%s_bucket", name);
  for (size_t i = 0; i <= n_le; i++) {
    cum += h->counts[i];
    if (i < n_le)
      kvp_text_fmt_double(tmp, sizeof tmp, le[i]);
    prom_name(o, "kvplane_", bucket, NULL, "le", i < n_le ? tmp : "+Inf");
    kvp_text_puts(o, " "), kvp_text_u64(o, cum), kvp_text_puts(o, "\n");
  }
  assert(cum == h->count);
  kvp_text_puts(o, "kvplane_"), kvp_text_puts(o, name),
      kvp_text_puts(o, "_sum ");
  kvp_text_prom_num(o, h->sum), kvp_text_puts(o, "\n");
  kvp_text_puts(o, "kvplane_"), kvp_text_puts(o, name),
      kvp_text_puts(o, "_count ");
  kvp_text_u64(o, h->count), kvp_text_puts(o, "\n");
}

static void prom_simple(kvp_text *o, const char *name, const char *type,
                        const char *help, uint64_t v) {
  prom_head(o, "kvplane_", name, type, help);
  kvp_text_puts(o, "kvplane_"), kvp_text_puts(o, name), kvp_text_puts(o, " ");
  kvp_text_u64(o, v), kvp_text_puts(o, "\n");
}

typedef struct prom_snap {
  kvp_ledger_totals global;
  kvp_ledger_stats stats;
  hist avoided_tokens, reuse_ratio;
  snap tenants; /* sorted by tenant */
} prom_snap;

static int prom_snapshot(kvp_ledger *l, prom_snap *ps) {
  pthread_mutex_lock(&l->mu);
  ps->global = l->global;
  kvp__ledger_stats_locked(l, &ps->stats);
  ps->avoided_tokens = l->avoided_tokens;
  ps->reuse_ratio = l->reuse_ratio;
  int rc = kvp__ledger_snap_take(&l->tenants, &l->alloc, -1, &ps->tenants);
  pthread_mutex_unlock(&l->mu);
  if (rc == 0)
    qsort(ps->tenants.rows, ps->tenants.n, sizeof(row), kvp__ledger_row_cmp);
  return rc;
}

static void prom_globals(kvp_text *o, const prom_snap *ps) {
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    prom_head(o, "kvplane_", fields[i].name, "counter", fields[i].help);
    prom_field(o, "kvplane_", &fields[i], NULL, &ps->global);
  }
  prom_head(o, "kvplane_", "class_hit_ratio", "gauge",
            "Reused / prompt tokens per segment class since start "
            "(NaN before the first token of the class).");
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    prom_name(o, "kvplane_", "class_hit_ratio", NULL, "class", class_n(c));
    kvp_text_puts(o, " ");
    kvp_text_prom_num(o, kvp_ledger_hit_rate(&ps->global, (kvp_class)c));
    kvp_text_puts(o, "\n");
  }
  prom_hist(o, "request_prefill_avoided_tokens",
            "Prefill avoided per request, in tokens.", &ps->avoided_tokens,
            tokens_le, N_TOKENS_LE);
  prom_hist(o, "request_reuse_ratio",
            "Reused / prompt tokens per request (requests with a non-empty "
            "prompt).",
            &ps->reuse_ratio, ratio_le, N_RATIO_LE);
}

static void prom_health(kvp_text *o, const kvp_ledger_stats *s) {
  prom_head(o, "kvplane_", "ledger_rejected_records_total", "counter",
            "Ledger records rejected with KVP_EINVAL, by the rule broken.");
  for (int r = 0; r < KVP_LEDGER_REJECT_COUNT_; r++) {
    prom_name(o, "kvplane_", "ledger_rejected_records_total", NULL, "reason",
              kvp_ledger_reject_name((kvp_ledger_reject)r));
    kvp_text_puts(o, " "), kvp_text_u64(o, s->rejected[r]),
        kvp_text_puts(o, "\n");
  }
  prom_simple(o, "ledger_alloc_failures_total", "counter",
              "Ledger records refused for lack of memory (not counted).",
              s->alloc_failures);
  prom_simple(o, "ledger_tenants", "gauge", "Tenants tracked now.", s->tenants);
  prom_simple(o, "ledger_sessions", "gauge", "Sessions tracked now.",
              s->sessions);
  prom_simple(o, "ledger_tenant_evictions_total", "counter",
              "Tenants dropped by the LRU cap (still in the global families).",
              s->tenant_evictions);
  prom_simple(o, "ledger_session_evictions_total", "counter",
              "Sessions dropped by the LRU cap (still in the global families).",
              s->session_evictions);
}

static void prom_tenants(kvp_text *o, const snap *s) {
  char help[128];
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    snprintf(help, sizeof help, "Per tenant: %s", fields[i].help);
    prom_head(o, "kvplane_tenant_", fields[i].name, "counter", help);
    for (size_t r = 0; r < s->n; r++)
      prom_field(o, "kvplane_tenant_", &fields[i], s->rows[r].tenant,
                 &s->rows[r].t);
  }
}

int kvp_ledger_prometheus_write(kvp_ledger *l, kvp_write_fn fn, void *opaque) {
  if (l == NULL || fn == NULL)
    return KVP_EINVAL;
  prom_snap ps;
  int rc = prom_snapshot(l, &ps);
  if (rc < 0)
    return rc;
  char chunk[OUT_CHUNK];
  kvp_text o;
  kvp_text_init_writer(&o, fn, opaque, chunk, sizeof chunk);
  prom_globals(&o, &ps);
  prom_health(&o, &ps.stats);
  prom_tenants(&o, &ps.tenants);
  rc = kvp_text_flush(&o);
  kvp__ledger_snap_free(&l->alloc, &ps.tenants);
  return rc;
}

/* A writer that appends to a buffer-mode kvp_text. */
static int text_sink(void *opaque, const char *d, size_t n) {
  kvp_text_put(opaque, d, n);
  return 0;
}

int kvp_ledger_prometheus(kvp_ledger *l, char *buf, size_t cap,
                          size_t *needed) {
  if (buf == NULL && cap > 0)
    return KVP_EINVAL;
  kvp_text m;
  kvp_text_init(&m, buf, cap);
  int rc = kvp_ledger_prometheus_write(l, text_sink, &m);
  if (needed != NULL)
    *needed = kvp_text_len(&m);
  if (rc < 0)
    return rc;
  return kvp_text_len(&m) < cap ? 0 : KVP_ENOSPC;
}

/* ---- JSON lines --------------------------------------------------------- */
static void json_u64(kvp_text *o, const char *k, uint64_t v) {
  kvp_text_puts(o, ",\""), kvp_text_puts(o, k), kvp_text_puts(o, "\":"),
      kvp_text_u64(o, v);
}

static void json_map(kvp_text *o, const char *k, const uint64_t *v,
                     const char *(*names)(int), size_t n) {
  kvp_text_puts(o, ",\""), kvp_text_puts(o, k), kvp_text_puts(o, "\":{");
  for (size_t i = 0; i < n; i++) {
    kvp_text_puts(o, i ? ",\"" : "\""), kvp_text_puts(o, names((int)i)),
        kvp_text_puts(o, "\":");
    kvp_text_u64(o, v[i]);
  }
  kvp_text_puts(o, "}");
}

/* Fields shared by receipts and totals (a receipt is one request's totals). */
static void json_body(kvp_text *o, const kvp_ledger_totals *t) {
  json_u64(o, "prompt_tokens", t->prompt_tokens);
  json_u64(o, "reused_tokens", t->reused_tokens);
  json_u64(o, "recomputed_tokens", t->recomputed_tokens);
  kvp_text_puts(o, ",\"prefill_avoided\":{\"tokens\":");
  kvp_text_u64(o, t->reused_tokens);
  kvp_text_puts(o, ",\"flops\":"), kvp_text_json_num(o, t->avoided_flops);
  kvp_text_puts(o, ",\"gpu_seconds\":"),
      kvp_text_json_num(o, t->avoided_gpu_seconds);
  kvp_text_puts(o, "}");
  json_map(o, "reused_by_tier", t->reused_by_tier, tier_n, KVP_TIER_COUNT_);
  json_map(o, "prompt_by_class", t->prompt_by_class, class_n, KVP_CLASS_COUNT_);
  json_map(o, "reused_by_class", t->reused_by_class, class_n, KVP_CLASS_COUNT_);
  json_map(o, "miss_tokens", t->miss_tokens, cause_n, KVP_MISS_COUNT_);
  json_map(o, "load_bytes", t->load_bytes, tier_n, KVP_TIER_COUNT_);
}

/* The receipt format (ledger.h, kvp_ledger_receipt_json) without its closing
 * brace; the router's receipts append their "route" member. */
void kvp__ledger_receipt_open(kvp_text *o, const kvp_ledger_record *r) {
  kvp_ledger_totals t = {0};
  kvp__ledger_totals_add(&t, r);
  kvp_text_puts(o, "{\"kind\":\"receipt\",\"request_id\":");
  json_name(o, r->request_id);
  kvp_text_puts(o, ",\"tenant\":"), json_name(o, r->tenant);
  kvp_text_puts(o, ",\"session\":"), json_name(o, r->session);
  kvp_text_puts(o, ",\"worker\":");
  if (r->worker >= 0)
    kvp_text_u64(o, (uint64_t)r->worker);
  else
    kvp_text_puts(o, "null");
  kvp_text_puts(o, ",\"unix_time_ns\":");
  if (r->unix_time_ns != 0)
    kvp_text_u64(o, r->unix_time_ns);
  else
    kvp_text_puts(o, "null");
  kvp_text_puts(o, ",\"reuse_ratio\":");
  double ratio = r->prompt_tokens
                     ? (double)r->reused_tokens / (double)r->prompt_tokens
                     : NAN; /* null: no prompt, no ratio */
  kvp_text_json_num(o, ratio);
  json_body(o, &t);
}

static void json_totals(kvp_text *o, const kvp_ledger_totals *t,
                        const char *tenant, const char *session) {
  bool has_t = tenant && *tenant, has_s = session && *session;
  kvp_text_puts(o, "{\"kind\":\"totals\",\"scope\":");
  kvp_text_puts(o, has_s ? "\"session\"" : has_t ? "\"tenant\"" : "\"global\"");
  kvp_text_puts(o, ",\"tenant\":"), json_name(o, tenant);
  kvp_text_puts(o, ",\"session\":"), json_name(o, session);
  json_u64(o, "requests", t->requests);
  json_body(o, t);
  kvp_text_puts(o, ",\"hit_rate_by_class\":{");
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    kvp_text_puts(o, c ? ",\"" : "\""), kvp_text_puts(o, class_n(c)),
        kvp_text_puts(o, "\":");
    kvp_text_json_num(o, kvp_ledger_hit_rate(t, (kvp_class)c));
  }
  kvp_text_puts(o, "}}\n");
}

/* Runs a formatter into a caller buffer, snprintf-like. */
static int to_buffer(char *buf, size_t cap, const kvp_ledger_record *r,
                     const kvp_ledger_totals *t, const char *tenant,
                     const char *session) {
  kvp_text o;
  kvp_text_init(&o, buf, cap);
  if (r != NULL)
    kvp__ledger_receipt_open(&o, r), kvp_text_puts(&o, "}\n");
  else
    json_totals(&o, t, tenant, session);
  /* three bounded names and fixed fields */
  assert(kvp_text_len(&o) < INT32_MAX);
  return (int)kvp_text_len(&o);
}

int kvp_ledger_receipt_json(const kvp_ledger_record *r, char *buf, size_t cap) {
  if (r == NULL || (buf == NULL && cap > 0) || kvp__ledger_check_reason(r) >= 0)
    return KVP_EINVAL;
  return to_buffer(buf, cap, r, NULL, NULL, NULL);
}

int kvp_ledger_totals_json(const kvp_ledger_totals *t, const char *tenant,
                           const char *session, char *buf, size_t cap) {
  if (t == NULL || (buf == NULL && cap > 0) || !kvp__ledger_name_ok(tenant) ||
      !kvp__ledger_name_ok(session))
    return KVP_EINVAL;
  return to_buffer(buf, cap, NULL, t, tenant, session);
}

/* Tenants in one sorted snapshot; sessions slice by slice, so the lock is
 * held for 1/64 of the table at a time and the copy stays small. */
static int json_table(kvp_ledger *l, table *tb, bool sessions, kvp_text *o) {
  int first = sessions ? 0 : -1;
  int last = sessions ? (1 << MIN_BITS) - 1 : -1;
  for (int s = first; s <= last && o->err == 0; s++) {
    snap sn;
    pthread_mutex_lock(&l->mu);
    int rc = kvp__ledger_snap_take(tb, &l->alloc, s, &sn);
    pthread_mutex_unlock(&l->mu);
    if (rc < 0)
      return rc;
    qsort(sn.rows, sn.n, sizeof(row), kvp__ledger_row_cmp);
    for (size_t i = 0; i < sn.n; i++)
      json_totals(o, &sn.rows[i].t, sn.rows[i].tenant,
                  sessions ? sn.rows[i].session : NULL);
    kvp__ledger_snap_free(&l->alloc, &sn);
  }
  return o->err;
}

int kvp_ledger_json_write(kvp_ledger *l, unsigned what, kvp_write_fn fn,
                          void *opaque) {
  const unsigned known = KVP_LEDGER_JSON_GLOBAL | KVP_LEDGER_JSON_TENANTS |
                         KVP_LEDGER_JSON_SESSIONS;
  if (l == NULL || fn == NULL || what == 0 || (what & ~known) != 0)
    return KVP_EINVAL;
  char chunk[OUT_CHUNK];
  kvp_text o;
  kvp_text_init_writer(&o, fn, opaque, chunk, sizeof chunk);
  int rc = 0;
  if (what & KVP_LEDGER_JSON_GLOBAL) {
    kvp_ledger_totals g;
    kvp_ledger_global_totals(l, &g);
    json_totals(&o, &g, NULL, NULL);
  }
  if (rc == 0 && (what & KVP_LEDGER_JSON_TENANTS))
    rc = json_table(l, &l->tenants, false, &o);
  if (rc == 0 && (what & KVP_LEDGER_JSON_SESSIONS))
    rc = json_table(l, &l->sessions, true, &o);
  int frc = kvp_text_flush(&o);
  return rc < 0 ? rc : frc;
}
