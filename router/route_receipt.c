/* SPDX-License-Identifier: Apache-2.0 */
/* Routing receipts: the reason in words (filled at decision time, when the
 * router's figures are at hand); the decision as a ledger record, added to a
 * ledger or rendered as the ledger's receipt plus a "route" member (from the
 * decision alone, so any thread may render any receipt).  All text goes
 * through kvplane/text.h (C locale, one JSON escaping). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core_internal.h"
#include "route_internal.h"

const char *kvp__fmt_count(uint64_t v, char buf[32]) {
  char tmp[32];
  int n = snprintf(tmp, sizeof tmp, "%" PRIu64, v), o = 0;
  for (int i = 0; i < n; i++) {
    if (i > 0 && (n - i) % 3 == 0)
      buf[o++] = ',';
    buf[o++] = tmp[i];
  }
  buf[o] = '\0';
  return buf;
}

/* ---- reason text --------------------------------------------------------- */
/* "<lead>holds 60,000 of 61,000 tokens (HBM 60,000)", or nothing at all when
 * nothing is reused. */
static void reuse_clause(kvp_text *b, const kvp_decision *d, const char *lead) {
  char x[32], y[32];
  if (d->avoided_tokens == 0)
    return;
  kvp_text_printf(b, "%sholds %s of %s tokens (", lead,
                  kvp__fmt_count(d->avoided_tokens, x),
                  kvp__fmt_count(d->prompt_tokens, y));
  const char *sep = "";
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    if (d->reused_tier_tokens[k]) {
      kvp_text_printf(b, "%s%s %s", sep, kvp_tier_label((kvp_tier)k),
                      kvp__fmt_count(d->reused_tier_tokens[k], x));
      sep = ", ";
    }
  kvp_text_printf(b, ")");
}

static const kvp__route_cand *cand_of(const kvp__route_why *w, uint32_t i) {
  return i < w->r->n ? &w->r->cand[i] : NULL;
}

/* Two numbers only: snprintf of a double costs ~0.4 us, and the receipt's
 * top[] carries every term anyway. */
static void reason_cost(kvp_text *b, const kvp__route_why *w,
                        const kvp_decision *d) {
  const kvp__route_cand *c = cand_of(w, d->worker),
                        *o = cand_of(w, w->runner_up);
  kvp_text_printf(b, "cost: worker %u ", d->worker);
  reuse_clause(b, d, "");
  kvp_text_printf(b, "%sTTFT %.3g s", d->avoided_tokens ? "; " : "",
                  c->total_s);
  if (o != NULL)
    kvp_text_printf(b, " vs %.3g s on worker %u", o->total_s, w->runner_up);
}

static void reason_affinity(kvp_text *b, const kvp__route_why *w,
                            const kvp_decision *d) {
  const kvp__route_cand *c = cand_of(w, d->worker),
                        *o = cand_of(w, w->runner_up);
  kvp_text_printf(b,
                  "affinity: session stays on worker %u, TTFT %.3g s within "
                  "epsilon of best %.3g s (worker %u)",
                  d->worker, c->total_s, o ? o->total_s : c->total_s,
                  w->runner_up);
  reuse_clause(b, d, "; ");
}

static void reason_guard(kvp_text *b, const kvp__route_why *w,
                         const kvp_decision *d) {
  const kvp__route_cand *g = cand_of(w, w->best_unguarded);
  const kvp__route_cand *c = cand_of(w, d->worker);
  const char *ref = w->r->o.guard_ref == KVP_GUARD_MIN ? "min" : "mean";
  kvp_text_printf(
      b,
      "guard: worker %u overloaded (load %" PRIu64 " > %.2gx %s %.3g "
      "of the others); chose worker %u, TTFT %.3g s vs %.3g s there",
      w->best_unguarded, g->load_guard, w->r->o.guard, ref, w->guard_ref,
      d->worker, c->total_s, g->total_s);
}

static void reason_tie(kvp_text *b, const kvp__route_why *w,
                       const kvp_decision *d) {
  kvp_text_printf(
      b,
      "tie: %u workers within %.3g%% of TTFT %.3g s; hash of (%s %" PRIu64
      ", worker, replica %u) chose worker %u",
      w->n_tied, w->r->o.tie_rel * 100.0, cand_of(w, d->worker)->total_s,
      w->req->session_id ? "session" : "request",
      w->req->session_id ? w->req->session_id : d->request_id,
      w->r->o.replica_id, d->worker);
}

static void reason_peer(kvp_text *b, const kvp__route_why *w,
                        const kvp_decision *d) {
  char x[32];
  const kvp__route_cand *c = cand_of(w, d->worker);
  kvp_text_printf(b, "%s: ", kvp_policy_name((kvp_policy)d->policy));
  if (w->detail != NULL)
    kvp_text_printf(b, "%s; ", w->detail);
  switch (d->reason) {
  case KVP_REASON_ROUND_ROBIN:
    kvp_text_printf(b, "next in rotation is worker %u", d->worker);
    break;
  case KVP_REASON_LEAST_LOADED:
    kvp_text_printf(
        b,
        "worker %u is least loaded (%s pending prefill tokens, %" PRIu64
        " requests)",
        d->worker,
        kvp__fmt_count((uint64_t)w->r->load[d->worker].prefill_tokens +
                           w->r->ws[d->worker].tokens,
                       x),
        c->load_req);
    break;
  case KVP_REASON_PREFIX:
    kvp_text_printf(b, "worker %u holds the longest prefix (%s tokens)",
                    d->worker, kvp__fmt_count(c->matched_blocks * w->r->bs, x));
    break;
  default:
    kvp_text_printf(b, "chose worker %u (score %.4g)", d->worker, c->score);
  }
  kvp_text_printf(b, "; est. TTFT %.3g s", c->total_s);
}

void kvp__route_reason(const kvp__route_why *why, kvp_decision *d) {
  kvp_text b;
  kvp_text_init(&b, d->reason_text, sizeof d->reason_text);
  if (d->policy != KVP_POLICY_KVPLANE_COST) {
    reason_peer(&b, why, d);
    return;
  }
  switch (d->reason) {
  case KVP_REASON_AFFINITY:
    reason_affinity(&b, why, d);
    break;
  case KVP_REASON_GUARD:
    reason_guard(&b, why, d);
    break;
  case KVP_REASON_TIE:
    reason_tie(&b, why, d);
    break;
  case KVP_REASON_ONLY:
    kvp_text_printf(&b, "only: worker %u is the only online worker", d->worker);
    break;
  default:
    reason_cost(&b, why, d);
  }
}

/* ---- the decision as a ledger record ------------------------------------- */
/* The caller's names for the decision's ids (tenant, session, request): a
 * given name must hash to the id; a missing one is the id in decimal, or
 * none for 0.  `dec` holds the decimal forms. */
static int names_of(const kvp_decision *d, const kvp_route_names *nm,
                    const char *out[3], char dec[3][24]) {
  static const char *const field[3] = {"tenant", "session", "request_id"};
  static const char *const id_field[3] = {"tenant", "session_id", "request_id"};
  const uint64_t id[3] = {d->tenant, d->session_id, d->request_id};
  const char *given[3] = {nm ? nm->tenant : NULL, nm ? nm->session : NULL,
                          nm ? nm->request_id : NULL};
  for (int i = 0; i < 3; i++) {
    out[i] = given[i];
    if (given[i] != NULL && kvp_id64(given[i]) != id[i]) {
      KVP_LOGW("route",
               "names.%s \"%.64s\" hashes to %" PRIu64 " but the decision's "
               "%s is %" PRIu64 ": route with kvp_id64(name)",
               field[i], given[i], kvp_id64(given[i]), id_field[i], id[i]);
      return KVP_EINVAL;
    }
    if (given[i] == NULL && id[i] != 0) {
      snprintf(dec[i], sizeof dec[i], "%" PRIu64, id[i]);
      out[i] = dec[i];
    }
  }
  return 0;
}

/* Recomputed tokens by cause; they sum to prompt - avoided (kvp_decision:
 * avoided <= matched on the chosen worker <= hashed <= prompt). */
static void miss_split(const kvp_decision *d, uint64_t m[KVP_MISS_COUNT_]) {
  uint64_t hashed =
      d->hashed_tokens < d->prompt_tokens ? d->hashed_tokens : d->prompt_tokens;
  uint64_t mine = 0, other = d->matched_elsewhere_tokens;
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    mine += d->matched_tokens[k];
  mine = mine < hashed ? mine : hashed;
  other = other < hashed ? other : hashed;
  uint64_t held = mine > other ? mine : other;
  uint64_t avoided = d->avoided_tokens < mine ? d->avoided_tokens : mine;
  m[KVP_MISS_NOT_WORTH_LOADING] = mine - avoided;
  m[KVP_MISS_OTHER_WORKER] = held - mine;
  if (d->flags & KVP_DECISION_SEEN) { /* blocks are chained: past the seen
                                         prefix, nothing was ever held */
    uint64_t seen = (uint64_t)d->seen_blocks * d->block_size;
    seen = seen < hashed ? seen : hashed;
    m[KVP_MISS_EVICTED] = seen > held ? seen - held : 0;
    m[KVP_MISS_NEVER_SEEN] = hashed - held - m[KVP_MISS_EVICTED];
  } else {
    m[KVP_MISS_UNKNOWN] = hashed - held;
  }
  m[KVP_MISS_PARTIAL_BLOCK] = d->prompt_tokens - hashed;
}

static void record_of(const kvp_decision *d, const char *const nm[3],
                      uint64_t unix_time_ns, kvp_ledger_record *r) {
  memset(r, 0, sizeof *r);
  r->tenant = nm[0], r->session = nm[1], r->request_id = nm[2];
  r->worker = d->worker < KVP_WORKERS_MAX ? (int32_t)d->worker : -1;
  r->unix_time_ns = unix_time_ns;
  r->prompt_tokens = d->prompt_tokens;
  r->reused_tokens = d->avoided_tokens;
  r->recomputed_tokens = d->uncached_tokens;
  memcpy(r->reused_by_tier, d->reused_tier_tokens, sizeof r->reused_by_tier);
  memcpy(r->prompt_by_class, d->prompt_class_tokens, sizeof r->prompt_by_class);
  memcpy(r->reused_by_class, d->reused_class_tokens, sizeof r->reused_by_class);
  memcpy(r->load_bytes, d->load_bytes, sizeof r->load_bytes);
  miss_split(d, r->miss_tokens);
  r->avoided_flops = d->avoided_flops;
  r->avoided_gpu_seconds = d->avoided_s;
}

/* The record of a successful decision, names resolved into dec. */
static int decision_record(const kvp_decision *d, const kvp_route_names *nm,
                           char dec[3][24], kvp_ledger_record *r) {
  const char *names[3];
  if (d->worker == KVP_WORKER_NONE) {
    KVP_LOGW("route", "decision.worker is KVP_WORKER_NONE: a failed "
                      "decision has no record");
    return KVP_EINVAL;
  }
  int rc = names_of(d, nm, names, dec);
  if (rc == 0)
    record_of(d, names, nm ? nm->unix_time_ns : 0, r);
  return rc;
}

int kvp_ledger_add_decision(kvp_ledger *l, const kvp_decision *d,
                            const kvp_route_names *names) {
  char dec[3][24];
  kvp_ledger_record r;
  if (l == NULL || d == NULL)
    return KVP_EINVAL;
  int rc = decision_record(d, names, dec, &r);
  return rc < 0 ? rc : kvp_ledger_add(l, &r);
}

/* ---- JSON: the ledger's receipt + "route" -------------------------------- */
static const char *const reason_names[KVP_REASON_COUNT_] = {
    "cost",        "affinity",     "guard",  "tie",   "only",
    "round_robin", "least_loaded", "prefix", "score", "sampled"};

const char *kvp_reason_name(kvp_reason r) {
  return (unsigned)r < KVP_REASON_COUNT_ ? reason_names[r] : "unknown";
}

static void json_key(kvp_text *b, const char *key) {
  kvp_text_puts(b, ",\""), kvp_text_puts(b, key), kvp_text_puts(b, "\":");
}

static void json_num(kvp_text *b, const char *key, double v) {
  json_key(b, key);
  kvp_text_json_num(b, v);
}

static void json_u64(kvp_text *b, const char *key, uint64_t v) {
  json_key(b, key);
  kvp_text_u64(b, v);
}

static const char *bool_str(uint32_t flags, uint32_t bit) {
  return (flags & bit) ? "true" : "false";
}

static void json_candidate(kvp_text *b, const kvp_route_candidate *c) {
  kvp_text_puts(b, "{\"worker\":"), kvp_text_u64(b, c->worker);
  json_u64(b, "matched_tokens", c->matched_tokens);
  json_u64(b, "reused_tokens", c->reused_tokens);
  json_num(b, "queue_s", c->queue_s);
  json_num(b, "recompute_s", c->recompute_s);
  json_num(b, "load_s", c->load_s);
  json_num(b, "total_s", c->total_s);
  json_num(b, "score", c->score);
  kvp_text_printf(b, ",\"guarded\":%s,\"uncertain\":%s,\"session_worker\":%s}",
                  bool_str(c->flags, KVP_CAND_GUARDED),
                  bool_str(c->flags, KVP_CAND_UNCERTAIN),
                  bool_str(c->flags, KVP_CAND_AFFINE));
}

static void json_flags(kvp_text *b, const kvp_decision *d) {
  static const char *const names[] = {"untracked", "all_guarded", "replaced",
                                      "no_index", "not_recorded",
                                      "chosen_only"};
  const char *sep = "";
  json_key(b, "flags");
  kvp_text_puts(b, "[");
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (d->flags & (1u << i)) {
      kvp_text_printf(b, "%s\"%s\"", sep, names[i]);
      sep = ",";
    }
  kvp_text_puts(b, "]");
}

static void json_route(kvp_text *b, const kvp_decision *d) {
  kvp_text_printf(b, ",\"route\":{\"policy\":\"%s\",\"reason\":\"%s\"",
                  kvp_policy_name((kvp_policy)d->policy),
                  d->reason < KVP_REASON_COUNT_ ? reason_names[d->reason]
                                                : "unknown");
  json_key(b, "reason_text");
  kvp_text_json_str(b, d->reason_text);
  json_u64(b, "n_eligible", d->n_eligible);
  json_u64(b, "block_size", d->block_size);
  json_key(b, "matched_tokens");
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    kvp_text_printf(b, "%s\"%s\":", k ? "," : "{", kvp_tier_name((kvp_tier)k));
    kvp_text_u64(b, d->matched_tokens[k]);
  }
  kvp_text_puts(b, "}");
  json_u64(b, "matched_elsewhere_tokens", d->matched_elsewhere_tokens);
  json_num(b, "load_s", d->load_s);
  json_flags(b, d);
  kvp_text_puts(b, ",\"top\":[");
  for (unsigned i = 0; i < d->n_top && i < KVP_ROUTE_TOP; i++) {
    kvp_text_puts(b, i ? "," : "");
    json_candidate(b, &d->top[i]);
  }
  kvp_text_puts(b, "]}");
}

int kvp_router_receipt_json(const kvp_decision *d, const kvp_route_names *names,
                            char *buf, size_t cap) {
  char dec[3][24];
  kvp_ledger_record r;
  if (d == NULL || (buf == NULL && cap > 0))
    return KVP_EINVAL;
  int rc = decision_record(d, names, dec, &r);
  if (rc < 0)
    return rc;
  /* Rendered even if the record would fail kvp_ledger_check (a decision
   * edited by hand): the writer keeps any values valid JSON. */
  kvp_text b;
  kvp_text_init(&b, buf, cap);
  kvp__ledger_receipt_open(&b, &r);
  json_route(&b, d);
  kvp_text_puts(&b, "}");
  return kvp_text_len(&b) > (size_t)INT32_MAX ? KVP_ERANGE
                                              : (int)kvp_text_len(&b);
}
