/* SPDX-License-Identifier: Apache-2.0 */
/* Routing receipts: the reason in words (filled at decision time, when the
 * router's figures are at hand) and the decision as JSON (from the decision
 * alone, so any thread may render any receipt). */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core_internal.h"
#include "route_internal.h"

/* ---- an appending writer with snprintf semantics ------------------------- */
typedef struct sbuf {
  char *p;
  size_t cap, len; /* len = what the full text needs, may exceed cap */
} sbuf;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
static void
sb_printf(sbuf *b, const char *fmt, ...) {
  size_t room = b->len < b->cap ? b->cap - b->len : 0;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(room ? b->p + b->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0)
    b->len += (size_t)n;
}

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
static const char *const tier_label[KVP_TIER_COUNT_] = {"HBM", "DRAM", "NVMe",
                                                        "remote"};

/* "holds 60,000 of 61,000 tokens (HBM 60,000)", or "" when nothing is reused.
 */
static void reuse_clause(sbuf *b, const kvp_decision *d) {
  char x[32], y[32];
  if (d->avoided_tokens == 0)
    return;
  sb_printf(b, "holds %s of %s tokens (", kvp__fmt_count(d->avoided_tokens, x),
            kvp__fmt_count(d->prompt_tokens, y));
  const char *sep = "";
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    if (d->reused_tier_tokens[k]) {
      sb_printf(b, "%s%s %s", sep, tier_label[k],
                kvp__fmt_count(d->reused_tier_tokens[k], x));
      sep = ", ";
    }
  sb_printf(b, ")");
}

static const kvp__route_cand *cand_of(const kvp__route_why *w, uint32_t i) {
  return i < w->r->n ? &w->r->cand[i] : NULL;
}

/* Two numbers only: snprintf of a double costs ~0.4 us, and the receipt's
 * top[] carries every term anyway. */
static void reason_cost(sbuf *b, const kvp__route_why *w,
                        const kvp_decision *d) {
  const kvp__route_cand *c = cand_of(w, d->worker),
                        *o = cand_of(w, w->runner_up);
  sb_printf(b, "cost: worker %u ", d->worker);
  reuse_clause(b, d);
  sb_printf(b, "%sTTFT %.3g s", d->avoided_tokens ? "; " : "", c->total_s);
  if (o != NULL)
    sb_printf(b, " vs %.3g s on worker %u", o->total_s, w->runner_up);
}

static void reason_affinity(sbuf *b, const kvp__route_why *w,
                            const kvp_decision *d) {
  const kvp__route_cand *c = cand_of(w, d->worker),
                        *o = cand_of(w, w->runner_up);
  sb_printf(b,
            "affinity: session stays on worker %u, TTFT %.3g s within "
            "epsilon of best %.3g s (worker %u); ",
            d->worker, c->total_s, o ? o->total_s : c->total_s, w->runner_up);
  reuse_clause(b, d);
}

static void reason_guard(sbuf *b, const kvp__route_why *w,
                         const kvp_decision *d) {
  const kvp__route_cand *g = cand_of(w, w->best_unguarded);
  const kvp__route_cand *c = cand_of(w, d->worker);
  const char *ref = w->r->o.guard_ref == KVP_GUARD_MIN ? "min" : "mean";
  sb_printf(b,
            "guard: worker %u overloaded (load %" PRIu64 " > %.2gx %s %.3g "
            "of the others); chose worker %u, TTFT %.3g s vs %.3g s there",
            w->best_unguarded, g->load_req, w->r->o.guard, ref, w->guard_ref,
            d->worker, c->total_s, g->total_s);
}

static void reason_tie(sbuf *b, const kvp__route_why *w,
                       const kvp_decision *d) {
  sb_printf(b,
            "tie: %u workers within %.3g%% of TTFT %.3g s; hash of (%s %" PRIu64
            ", worker, replica %u) chose worker %u",
            w->n_tied, w->r->o.tie_rel * 100.0, cand_of(w, d->worker)->total_s,
            w->req->session_id ? "session" : "request",
            w->req->session_id ? w->req->session_id : d->request_id,
            w->r->o.replica_id, d->worker);
}

static void reason_peer(sbuf *b, const kvp__route_why *w,
                        const kvp_decision *d) {
  char x[32];
  const kvp__route_cand *c = cand_of(w, d->worker);
  sb_printf(b, "%s: ", kvp_policy_name((kvp_policy)d->policy));
  if (w->detail != NULL)
    sb_printf(b, "%s; ", w->detail);
  switch (d->reason) {
  case KVP_REASON_ROUND_ROBIN:
    sb_printf(b, "next in rotation is worker %u", d->worker);
    break;
  case KVP_REASON_LEAST_LOADED:
    sb_printf(b,
              "worker %u is least loaded (%s pending prefill tokens, %" PRIu64
              " requests)",
              d->worker,
              kvp__fmt_count((uint64_t)w->r->load[d->worker].prefill_tokens +
                                 w->r->ws[d->worker].tokens,
                             x),
              c->load_req);
    break;
  case KVP_REASON_PREFIX:
    sb_printf(b, "worker %u holds the longest prefix (%s tokens)", d->worker,
              kvp__fmt_count(c->matched_blocks * w->r->bs, x));
    break;
  default:
    sb_printf(b, "chose worker %u (score %.4g)", d->worker, c->score);
  }
  sb_printf(b, "; est. TTFT %.3g s", c->total_s);
}

void kvp__route_reason(const kvp__route_why *why, kvp_decision *d) {
  sbuf b = {d->reason_text, sizeof d->reason_text, 0};
  d->reason_text[0] = '\0';
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
    sb_printf(&b, "only: worker %u is the only online worker", d->worker);
    break;
  default:
    reason_cost(&b, why, d);
  }
}

/* ---- JSON ---------------------------------------------------------------- */
static const char *const reason_names[KVP_REASON_COUNT_] = {
    "cost",        "affinity",     "guard",  "tie",   "only",
    "round_robin", "least_loaded", "prefix", "score", "sampled"};
static const char *const tier_keys[KVP_TIER_COUNT_] = {"hbm", "dram", "nvme",
                                                       "remote"};
static const char *const class_keys[KVP_CLASS_COUNT_] = {"volatile", "semi",
                                                         "stable"};

static void json_str(sbuf *b, const char *s, size_t max) {
  sb_printf(b, "\"");
  for (size_t i = 0; i < max && s[i]; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (ch == '"' || ch == '\\')
      sb_printf(b, "\\%c", ch);
    else if (ch < 0x20 || ch == 0x7f)
      sb_printf(b, "\\u%04x", ch);
    else
      sb_printf(b, "%c", ch);
  }
  sb_printf(b, "\"");
}

/* JSON has no NaN or infinity: those become null. */
static void json_num(sbuf *b, const char *key, double v) {
  if (isfinite(v))
    sb_printf(b, ",\"%s\":%.9g", key, v);
  else
    sb_printf(b, ",\"%s\":null", key);
}

static void json_u64_map(sbuf *b, const char *key, const uint64_t *v,
                         const char *const *names, int n) {
  sb_printf(b, ",\"%s\":{", key);
  for (int i = 0; i < n; i++)
    sb_printf(b, "%s\"%s\":%" PRIu64, i ? "," : "", names[i], v[i]);
  sb_printf(b, "}");
}

static void json_candidate(sbuf *b, const kvp_route_candidate *c) {
  sb_printf(b,
            "{\"worker\":%u,\"matched_tokens\":%" PRIu64
            ",\"reused_tokens\":%" PRIu64,
            c->worker, c->matched_tokens, c->reused_tokens);
  json_num(b, "queue_s", c->queue_s);
  json_num(b, "recompute_s", c->recompute_s);
  json_num(b, "load_s", c->load_s);
  json_num(b, "total_s", c->total_s);
  json_num(b, "score", c->score);
  sb_printf(b, ",\"guarded\":%s,\"uncertain\":%s,\"session_worker\":%s}",
            (c->flags & KVP_CAND_GUARDED) ? "true" : "false",
            (c->flags & KVP_CAND_UNCERTAIN) ? "true" : "false",
            (c->flags & KVP_CAND_AFFINE) ? "true" : "false");
}

static void json_head(sbuf *b, const kvp_decision *d) {
  const char *reason =
      d->reason < KVP_REASON_COUNT_ ? reason_names[d->reason] : "unknown";
  if (d->worker == KVP_WORKER_NONE)
    sb_printf(b, "{\"worker\":null");
  else
    sb_printf(b, "{\"worker\":%u", d->worker);
  sb_printf(b, ",\"policy\":\"%s\",\"reason\":\"%s\",\"reason_text\":",
            kvp_policy_name((kvp_policy)d->policy), reason);
  json_str(b, d->reason_text, sizeof d->reason_text);
  /* 64-bit ids as strings: JSON parsers keep at most 53 bits of a number */
  sb_printf(b,
            ",\"request_id\":\"%" PRIu64 "\",\"session_id\":\"%" PRIu64
            "\",\"tenant\":\"%" PRIu64 "\",\"prompt_tokens\":%" PRIu64
            ",\"uncached_tokens\":%" PRIu64 ",\"n_eligible\":%u",
            d->request_id, d->session_id, d->tenant, d->prompt_tokens,
            d->uncached_tokens, d->n_eligible);
}

static void json_flags(sbuf *b, const kvp_decision *d) {
  sb_printf(b, ",\"flags\":[");
  const char *sep = "";
  static const char *const names[] = {"untracked", "all_guarded", "replaced"};
  for (int i = 0; i < 3; i++)
    if (d->flags & (1u << i)) {
      sb_printf(b, "%s\"%s\"", sep, names[i]);
      sep = ",";
    }
  sb_printf(b, "]");
}

int kvp_router_receipt_json(const kvp_decision *d, char *buf, size_t cap) {
  if (d == NULL || (buf == NULL && cap > 0))
    return KVP_EINVAL;
  sbuf b = {buf, cap, 0};
  if (cap > 0)
    buf[0] = '\0';
  json_head(&b, d);
  json_u64_map(&b, "matched_tokens", d->matched_tokens, tier_keys,
               KVP_TIER_COUNT_);
  json_u64_map(&b, "reused_tokens", d->reused_tier_tokens, tier_keys,
               KVP_TIER_COUNT_);
  json_u64_map(&b, "reused_class_tokens", d->reused_class_tokens, class_keys,
               KVP_CLASS_COUNT_);
  sb_printf(&b,
            ",\"matched_elsewhere_tokens\":%" PRIu64
            ",\"avoided\":{\"tokens\":%" PRIu64,
            d->matched_elsewhere_tokens, d->avoided_tokens);
  json_num(&b, "flops", d->avoided_flops);
  json_num(&b, "seconds", d->avoided_s);
  sb_printf(&b, "}");
  json_num(&b, "load_s", d->load_s);
  json_flags(&b, d);
  sb_printf(&b, ",\"top\":[");
  for (unsigned i = 0; i < d->n_top && i < KVP_ROUTE_TOP; i++) {
    sb_printf(&b, "%s", i ? "," : "");
    json_candidate(&b, &d->top[i]);
  }
  sb_printf(&b, "]}");
  return b.len > (size_t)INT32_MAX ? KVP_ERANGE : (int)b.len;
}
