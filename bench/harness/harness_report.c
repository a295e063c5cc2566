/* SPDX-License-Identifier: Apache-2.0 */
/* Reports: the terminal table, CSV, JSON (jansson) and one self-contained
 * HTML file with inline SVG plots (no scripts, no network). */
#include <math.h>
#include <string.h>

#include <jansson.h>

#include "harness.h"

static const char *const palette[] = {"#1f77b4", "#d62728", "#2ca02c",
                                      "#ff7f0e", "#9467bd", "#8c564b",
                                      "#e377c2", "#7f7f7f", "#17becf",
                                      "#bcbd22"};

static double pct(uint64_t a, uint64_t b) {
  return b ? 100.0 * (double)a / (double)b : NAN;
}

static double quant_ms(const bh_result *r, double q) {
  return (double)kvp_hist_quantile(r->ttft_us, q) / 1e3;
}

/* Time per output token, ms (NaN: no request had two tokens). */
static double tpot_ms(const bh_result *r, double q) {
  return r->tpot.count ? (double)kvp_hist_quantile(r->tpot_us, q) / 1e3
                       : NAN;
}

static kvp_miss_cause top_cause(const kvp_ledger_totals *t) {
  int best = 0;
  for (int c = 1; c < KVP_MISS_COUNT_; c++)
    if (t->miss_tokens[c] > t->miss_tokens[best])
      best = c;
  return (kvp_miss_cause)best;
}

static double sim_rps(const bh_result *r) {
  return r->wall_seconds > 0 ? (double)r->requests / r->wall_seconds : 0;
}

int bh_report_focus(const bh_run *run, int *peer) {
  int focus = -1;
  *peer = -1;
  for (size_t i = 0; i < run->n_res; i++)
    if (run->res[i].policy == KVP_POLICY_KVPLANE_COST)
      focus = (int)i;
  for (size_t i = 0; i < run->n_res && focus < 0; i++)
    if (run->res[i].policy < KVP_POLICY_COUNT_)
      focus = (int)i;
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    if ((int)i == focus || r->policy >= KVP_POLICY_COUNT_)
      continue;
    if (*peer < 0 || r->ttft_p95_s < run->res[*peer].ttft_p95_s)
      *peer = (int)i;
  }
  return focus;
}

static void table_head(FILE *f, const bh_run *run) {
  const bh_trace *t = run->trace;
  fprintf(f, "\n%s: %zu requests, %.1fM prompt tokens, block %u tokens\n",
          run->label, t->n_reqs, (double)bh_trace_prompt_tokens(t) / 1e6,
          t->block_size);
  fprintf(f, "cluster: %u workers, each HBM %llu / DRAM %llu / NVMe %llu "
             "blocks; placement %s/%s/%s, %s\n",
          run->cl->workers, (unsigned long long)run->cl->hbm_blocks,
          (unsigned long long)run->cl->dram_blocks,
          (unsigned long long)run->cl->nvme_blocks,
          kvp_tier_policy_name(run->cl->tier_policy[KVP_TIER_HBM]),
          kvp_tier_policy_name(run->cl->tier_policy[KVP_TIER_DRAM]),
          kvp_tier_policy_name(run->cl->tier_policy[KVP_TIER_NVME]),
          run->cl->tier_no_classes ? "stability-blind" : "stability aware");
  if (t->records_bad)
    fprintf(f, "  %llu malformed records skipped (first: %.80s)\n",
            (unsigned long long)t->records_bad, t->first_error);
}

/* Every column, as the table was before the compact default. */
static void table_wide(FILE *f, const bh_run *run) {
  fprintf(f, "%-19s %6s %6s %6s %6s %7s %6s %6s %9s %8s %6s %9s %9s %9s %8s "
             "%-17s %9s\n",
          "policy", "hit%", "hbm%", "dram%", "nvme%", "stable%", "semi%",
          "vol%", "avoidedM", "avoid_s", "imbal", "ttft_p50", "ttft_p95",
          "ttft_p99", "loadGB", "top_miss", "sim_req/s");
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    const kvp_ledger_totals *x = &r->tot;
    double gb = (double)(x->load_bytes[1] + x->load_bytes[2]) / 1e9;
    fprintf(f,
            "%-19s %6.2f %6.2f %6.2f %6.2f %7.2f %6.2f %6.2f %9.2f %8.1f "
            "%6.2f %7.1fms %7.1fms %7.1fms %8.1f %-17s %9.0f\n",
            r->name, pct(x->reused_tokens, x->prompt_tokens),
            pct(x->reused_by_tier[0], x->prompt_tokens),
            pct(x->reused_by_tier[1], x->prompt_tokens),
            pct(x->reused_by_tier[2], x->prompt_tokens),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_STABLE),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_SEMI),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_VOLATILE),
            (double)x->reused_tokens / 1e6, x->avoided_gpu_seconds,
            r->imbalance, quant_ms(r, 0.5), quant_ms(r, 0.95),
            quant_ms(r, 0.99), gb, kvp_miss_cause_name(top_cause(x)),
            sim_rps(r));
  }
}

/* A duration in 8 columns: ms below 10 s, then s, then h. */
static const char *dur(char *buf, size_t cap, double ms) {
  if (!isfinite(ms))
    snprintf(buf, cap, "%8s", "-");
  else if (ms < 1e4)
    snprintf(buf, cap, "%6.0fms", ms);
  else if (ms < 3.6e6)
    snprintf(buf, cap, "%7.1fs", ms / 1e3);
  else
    snprintf(buf, cap, "%7.1fh", ms / 3.6e6);
  return buf;
}

/* Under 120 columns: the columns a verdict needs (docs/harness.md). */
static void table_compact(FILE *f, const bh_run *run) {
  fprintf(f, "%-18s %5s %5s %6s %7s %5s %8s %5s %8s %8s %8s %-15s %9s\n",
          "policy", "hit%", "hbm%", "lower%", "stable%", "semi%", "avoid_s",
          "imbal", "ttft_p50", "ttft_p95", "ttft_p99", "top_miss",
          "sim_req/s");
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    const kvp_ledger_totals *x = &r->tot;
    char d[3][16];
    fprintf(f,
            "%-18.18s %5.1f %5.1f %6.1f %7.1f %5.1f %8.0f %5.2f %s %s %s "
            "%-15.15s %9.0f\n",
            r->name, pct(x->reused_tokens, x->prompt_tokens),
            pct(x->reused_by_tier[0], x->prompt_tokens),
            pct(x->reused_by_tier[1] + x->reused_by_tier[2], x->prompt_tokens),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_STABLE),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_SEMI),
            x->avoided_gpu_seconds, r->imbalance,
            dur(d[0], sizeof d[0], quant_ms(r, 0.5)),
            dur(d[1], sizeof d[1], quant_ms(r, 0.95)),
            dur(d[2], sizeof d[2], quant_ms(r, 0.99)),
            kvp_miss_cause_name(top_cause(x)), sim_rps(r));
  }
  fputs("hit%: reused / prompt tokens; hbm%, lower%: reused from HBM, from "
        "DRAM+NVMe; stable%, semi%: hit rate\nof those segment classes; "
        "avoid_s: prefill GPU-s avoided; imbal: max/mean prefill per worker; "
        "--wide: all\n", f);
}

/* P/D: per policy what the split adds (docs/harness.md, "P/D"). */
static void table_pd(FILE *f, const bh_run *run) {
  const bh_cluster *cl = run->cl;
  fprintf(f, "P/D: %u prefill + %u decode workers, link %g GB/s + %g us a "
             "pull; TTFT = prefill leg + pull + decode worker's first token\n",
          cl->pd_prefill, cl->pd_decode, cl->link_gbps, cl->link_latency_us);
  fprintf(f, "  %-18s %8s %8s %8s %9s %7s %8s %8s\n", "policy", "tpot_p50",
          "tpot_p99", "xfer GB", "local%", "pf_imb", "dec_imb", "dec_tok");
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    double off = (double)(r->xfer_blocks + r->local_blocks);
    fprintf(f, "  %-18.18s %6.1fms %6.1fms %8.2f %8.1f%% %7.2f %8.2f %8llu\n",
            r->name, tpot_ms(r, 0.5), tpot_ms(r, 0.99),
            (double)r->xfer_bytes / 1e9,
            off > 0 ? 100 * (double)r->local_blocks / off : 0,
            r->role[BH_ROLE_PREFILL].imbalance,
            r->role[BH_ROLE_DECODE].imbalance,
            (unsigned long long)r->role[BH_ROLE_DECODE].prefill_tokens);
  }
  fputs("  xfer: KV the decode legs pulled; local%: offered blocks the decode "
        "worker held already;\n  pf_imb, dec_imb: max/mean prefill tokens per "
        "prefill worker, decode seconds per decode worker;\n  dec_tok: prompt "
        "tokens the decode workers computed (what was not offered)\n", f);
}

void bh_report_table(FILE *f, const bh_run *run) {
  bh_report_table_opts(f, run, 0);
}

void bh_report_table_opts(FILE *f, const bh_run *run, unsigned flags) {
  table_head(f, run);
  if (flags & BH_TABLE_WIDE)
    table_wide(f, run);
  else
    table_compact(f, run);
  if (run->cl->pd_prefill > 0)
    table_pd(f, run);
  if (!run->cl->nvme_admit_on)
    return;
  fprintf(f, "NVMe admission %s (write weight %g): blocks demoted into NVMe\n",
          kvp_tier_admission_name(run->cl->nvme_admit.mode),
          run->cl->nvme_admit.write_weight > 0 ? run->cl->nvme_admit.write_weight
                                               : 1.0);
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    fprintf(f, "  %-19s written %9.1f GB  admitted %10llu  rejected %10llu\n",
            r->name, (double)r->demoted_bytes[KVP_TIER_NVME] / 1e9,
            (unsigned long long)r->nvme_admitted,
            (unsigned long long)r->nvme_rejected);
  }
}

int bh_report_csv(FILE *f, const bh_run *runs, size_t n, bool header) {
  if (header) {
    fputs("trace,policy,requests,prompt_tokens,reused_tokens,hit_rate", f);
    for (int k = 0; k < 3; k++)
      fprintf(f, ",reused_%s", kvp_tier_name((kvp_tier)k));
    for (int c = 0; c < KVP_CLASS_COUNT_; c++)
      fprintf(f, ",hit_rate_%s", kvp_class_name((kvp_class)c));
    fputs(",avoided_gpu_seconds,imbalance,ttft_p50_s,ttft_p95_s,ttft_p99_s,"
          "load_bytes_dram,load_bytes_nvme,demoted_bytes_dram,"
          "demoted_bytes_nvme", f);
    for (int c = 0; c < KVP_MISS_COUNT_; c++)
      fprintf(f, ",miss_%s", kvp_miss_cause_name((kvp_miss_cause)c));
    fputs(",events_published,events_dropped,sim_seconds,wall_seconds\n", f);
  }
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < runs[i].n_res; j++) {
      const bh_result *r = &runs[i].res[j];
      const kvp_ledger_totals *x = &r->tot;
      fprintf(f, "%s,%s,%llu,%llu,%llu,%.6f", runs[i].label, r->name,
              (unsigned long long)r->requests,
              (unsigned long long)x->prompt_tokens,
              (unsigned long long)x->reused_tokens,
              x->prompt_tokens ? (double)x->reused_tokens / x->prompt_tokens
                               : 0);
      for (int k = 0; k < 3; k++)
        fprintf(f, ",%llu", (unsigned long long)x->reused_by_tier[k]);
      for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
        double h = kvp_ledger_hit_rate(x, (kvp_class)c);
        if (isnan(h))
          fputs(",", f);
        else
          fprintf(f, ",%.6f", h);
      }
      fprintf(f, ",%.3f,%.4f,%.6f,%.6f,%.6f,%llu,%llu,%llu,%llu",
              x->avoided_gpu_seconds, r->imbalance, quant_ms(r, 0.5) / 1e3,
              quant_ms(r, 0.95) / 1e3, quant_ms(r, 0.99) / 1e3,
              (unsigned long long)x->load_bytes[1],
              (unsigned long long)x->load_bytes[2],
              (unsigned long long)r->demoted_bytes[1],
              (unsigned long long)r->demoted_bytes[2]);
      for (int c = 0; c < KVP_MISS_COUNT_; c++)
        fprintf(f, ",%llu", (unsigned long long)x->miss_tokens[c]);
      fprintf(f, ",%llu,%llu,%.3f,%.3f\n",
              (unsigned long long)r->events_published,
              (unsigned long long)r->events_dropped, r->sim_seconds,
              r->wall_seconds);
    }
  return ferror(f) ? KVP_EIO : 0;
}

static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *role_json(const bh_role_load *l) {
  return json_pack("{s:i, s:I, s:I, s:I, s:o, s:o, s:o}", "workers",
                   (int)l->workers, "legs", (json_int_t)l->legs,
                   "prefill_tokens", (json_int_t)l->prefill_tokens,
                   "out_tokens", (json_int_t)l->out_tokens, "prefill_s",
                   jnum(l->prefill_s), "decode_s", jnum(l->decode_s),
                   "imbalance", jnum(l->imbalance));
}

/* P/D: the figures a live P/D row has (make_live.py --pd), under its names
 * where it has one, and the per-role load. */
static json_t *pd_json(const bh_result *r) {
  const kvp_ledger_totals *x = &r->tot;
  return json_pack(
      "{s:I, s:I, s:I, s:o, s:{s:o, s:o, s:o, s:o}, s:{s:o, s:o}}",
      "xfer_bytes", (json_int_t)r->xfer_bytes, "xfer_blocks",
      (json_int_t)r->xfer_blocks, "local_blocks", (json_int_t)r->local_blocks,
      "prefill_hit_rate",
      jnum(x->prompt_tokens ? (double)x->reused_tokens / x->prompt_tokens
                            : NAN),
      "tpot_s", "p50", jnum(tpot_ms(r, 0.5) / 1e3), "p95",
      jnum(tpot_ms(r, 0.95) / 1e3), "p99", jnum(tpot_ms(r, 0.99) / 1e3),
      "mean", jnum(r->tpot.count ? r->tpot.mean / 1e6 : NAN), "roles",
      "prefill", role_json(&r->role[BH_ROLE_PREFILL]), "decode",
      role_json(&r->role[BH_ROLE_DECODE]));
}

static json_t *result_json(const bh_result *r) {
  const kvp_ledger_totals *x = &r->tot;
  json_t *o = json_object();
  json_object_set_new(o, "policy", json_string(r->name));
  json_object_set_new(o, "requests", json_integer((json_int_t)r->requests));
  json_object_set_new(o, "prompt_tokens",
                      json_integer((json_int_t)x->prompt_tokens));
  json_object_set_new(o, "reused_tokens",
                      json_integer((json_int_t)x->reused_tokens));
  json_object_set_new(o, "hit_rate",
                      jnum(x->prompt_tokens ? (double)x->reused_tokens /
                                                  x->prompt_tokens
                                            : NAN));
  json_t *bt = json_object(), *bc = json_object(), *mc = json_object(),
         *lb = json_object();
  for (int k = 0; k < 3; k++) {
    json_object_set_new(bt, kvp_tier_name((kvp_tier)k),
                        json_integer((json_int_t)x->reused_by_tier[k]));
    json_object_set_new(lb, kvp_tier_name((kvp_tier)k),
                        json_integer((json_int_t)x->load_bytes[k]));
  }
  for (int c = 0; c < KVP_CLASS_COUNT_; c++)
    json_object_set_new(bc, kvp_class_name((kvp_class)c),
                        jnum(kvp_ledger_hit_rate(x, (kvp_class)c)));
  for (int c = 0; c < KVP_MISS_COUNT_; c++)
    json_object_set_new(mc, kvp_miss_cause_name((kvp_miss_cause)c),
                        json_integer((json_int_t)x->miss_tokens[c]));
  json_object_set_new(o, "reused_by_tier", bt);
  json_object_set_new(o, "hit_rate_by_class", bc);
  json_object_set_new(o, "miss_tokens", mc);
  json_object_set_new(o, "load_bytes", lb);
  json_object_set_new(o, "avoided_gpu_seconds", jnum(x->avoided_gpu_seconds));
  json_object_set_new(o, "avoided_flops", jnum(x->avoided_flops));
  json_object_set_new(o, "imbalance", jnum(r->imbalance));
  json_t *tt = json_object();
  json_object_set_new(tt, "p50", jnum(quant_ms(r, 0.5) / 1e3));
  json_object_set_new(tt, "p95", jnum(quant_ms(r, 0.95) / 1e3));
  json_object_set_new(tt, "p99", jnum(quant_ms(r, 0.99) / 1e3));
  json_object_set_new(tt, "mean", jnum(r->ttft.mean / 1e6));
  json_object_set_new(o, "ttft_s", tt);
  if (r->pd)
    json_object_set_new(o, "pd", pd_json(r));
  json_object_set_new(o, "events_published",
                      json_integer((json_int_t)r->events_published));
  json_object_set_new(o, "events_dropped",
                      json_integer((json_int_t)r->events_dropped));
  json_object_set_new(o, "ledger_rejects",
                      json_integer((json_int_t)r->ledger_rejects));
  json_object_set_new(o, "sim_seconds", jnum(r->sim_seconds));
  json_object_set_new(o, "wall_seconds", jnum(r->wall_seconds));
  json_object_set_new(o, "simulated_requests_per_s", jnum(sim_rps(r)));
  return o;
}

int bh_report_json(FILE *f, const bh_run *runs, size_t n) {
  json_t *root = json_object(), *arr = json_array();
  json_object_set_new(root, "tool", json_string("kvplane-bench"));
  json_object_set_new(root, "version", json_string(kvp_version()));
  for (size_t i = 0; i < n; i++) {
    json_t *o = json_object(), *rs = json_array();
    const bh_trace *t = runs[i].trace;
    json_object_set_new(o, "trace", json_string(runs[i].label));
    json_object_set_new(o, "source", json_string(t->label));
    json_object_set_new(o, "requests", json_integer((json_int_t)t->n_reqs));
    json_object_set_new(o, "block_size", json_integer(t->block_size));
    json_object_set_new(o, "records_bad",
                        json_integer((json_int_t)t->records_bad));
    json_object_set_new(o, "workers", json_integer(runs[i].cl->workers));
    if (runs[i].cl->pd_prefill > 0)
      json_object_set_new(
          o, "pd",
          json_pack("{s:i, s:i, s:o, s:o}", "prefill",
                    (int)runs[i].cl->pd_prefill, "decode",
                    (int)runs[i].cl->pd_decode, "link_gbps",
                    jnum(runs[i].cl->link_gbps), "link_latency_us",
                    jnum(runs[i].cl->link_latency_us)));
    const bh_cluster *cl = runs[i].cl;
    json_object_set_new(
        o, "placement",
        json_pack("{s:s, s:s, s:s, s:b}", "hbm",
                  kvp_tier_policy_name(cl->tier_policy[KVP_TIER_HBM]), "dram",
                  kvp_tier_policy_name(cl->tier_policy[KVP_TIER_DRAM]), "nvme",
                  kvp_tier_policy_name(cl->tier_policy[KVP_TIER_NVME]),
                  "stability_aware", !cl->tier_no_classes));
    for (size_t j = 0; j < runs[i].n_res; j++)
      json_array_append_new(rs, result_json(&runs[i].res[j]));
    json_object_set_new(o, "policies", rs);
    json_array_append_new(arr, o);
  }
  json_object_set_new(root, "runs", arr);
  int rc = json_dumpf(root, f, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
  fputc('\n', f);
  json_decref(root);
  return rc < 0 || ferror(f) ? KVP_EIO : 0;
}

/* ---- HTML + SVG ---------------------------------------------------------------- */
static void esc(FILE *f, const char *s) {
  for (; *s; s++)
    switch (*s) {
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '&': fputs("&amp;", f); break;
    case '"': fputs("&quot;", f); break;
    default: fputc(*s, f);
    }
}

/* Series styles: the focus policy and its peer stand out, bounds are
 * dashed / dotted, the other policies are context in grey. */
enum { ST_PLAIN, ST_FOCUS, ST_PEER, ST_UPPER, ST_LOWER, ST_FAINT };

typedef struct plot {
  const char *title, *xlabel, *ylabel;
  size_t n_series;
  const char *const *names;
  const double *const *xs, *const *ys;
  const uint32_t *npts;
  const uint8_t *style; /* per series; NULL = all plain */
  bool logx, logy;
  double ymin, ymax;    /* ymax 0 = from data; logy: ymin > 0 */
  double xlo, xhi;      /* both 0 = from data */
  /* x tick labels: NULL = the value (%.3g) */
  void (*xfmt)(char *buf, size_t cap, double x, const void *ctx);
  const void *xctx;
  const double *hy;     /* labelled horizontal guides (n_hy of them) */
  const char *const *hy_names;
  size_t n_hy;
} plot;

#define PW 760
#define PH 320
#define ML 64
#define MR 170
#define MT 30
#define MB 58

static double lg(double v) { return log10(v > 1e-12 ? v : 1e-12); }

static double px(const plot *p, double x, double x0, double x1) {
  if (p->logx)
    x = lg(x), x0 = lg(x0), x1 = lg(x1);
  return ML + (x1 > x0 ? (x - x0) / (x1 - x0) : 0) * (PW - ML - MR);
}

static double py(const plot *p, double y, double y0, double y1) {
  if (p->logy)
    y = lg(y), y0 = lg(y0), y1 = lg(y1);
  double f = y1 > y0 ? (y - y0) / (y1 - y0) : 0;
  f = f < 0 ? 0 : f > 1 ? 1 : f;
  return PH - MB - f * (PH - MT - MB);
}

static bool usable(const plot *p, double x, double y) {
  return isfinite(x) && isfinite(y) && (!p->logx || x > 0) &&
         (!p->logy || y > 0);
}

static void data_range(const plot *p, double *x0, double *x1, double *y1) {
  *x0 = INFINITY, *x1 = -INFINITY, *y1 = p->ymax;
  for (size_t s = 0; s < p->n_series; s++)
    for (uint32_t i = 0; i < p->npts[s]; i++) {
      double x = p->xs[s][i], y = p->ys[s][i];
      if (!usable(p, x, y))
        continue;
      *x0 = fmin(*x0, x);
      *x1 = fmax(*x1, x);
      if (p->ymax == 0)
        *y1 = fmax(*y1, y);
    }
  if (p->xhi > p->xlo)
    *x0 = p->xlo, *x1 = p->xhi;
  if (!isfinite(*x0))
    *x0 = p->logx ? 1 : 0, *x1 = p->logx ? 10 : 1;
  if (*x1 <= *x0)
    *x1 = p->logx ? *x0 * 10 : *x0 + 1;
  if (*y1 <= p->ymin)
    *y1 = p->logy ? p->ymin * 10 : p->ymin + 1;
}

static const char *stroke_of(const plot *p, size_t s, char *dash,
                             double *width) {
  int st = p->style ? p->style[s] : ST_PLAIN;
  *width = st == ST_FOCUS || st == ST_PEER ? 2.6 : 1.4;
  dash[0] = '\0';
  if (st == ST_UPPER)
    strcpy(dash, " stroke-dasharray=\"6 3\"");
  if (st == ST_LOWER)
    strcpy(dash, " stroke-dasharray=\"2 3\"");
  switch (st) {
  case ST_FOCUS: return "#d62728";
  case ST_PEER: return "#1f77b4";
  case ST_UPPER: return "#2ca02c";
  case ST_LOWER: return "#7f7f7f";
  case ST_FAINT: return "#c7c7c7";
  default: return palette[s % (sizeof palette / sizeof *palette)];
  }
}

/* One series as a path; a gap (NaN, or off a log axis) starts a new
 * segment instead of drawing a line across it. */
static void svg_series(FILE *f, const plot *p, size_t s, double x0, double x1,
                       double y0, double y1) {
  char dash[48];
  double w;
  const char *col = stroke_of(p, s, dash, &w);
  fprintf(f, "<path class=\"series\" data-name=\"");
  esc(f, p->names[s]);
  fprintf(f, "\" fill=\"none\" stroke=\"%s\" stroke-width=\"%.1f\"%s d=\"",
          col, w, dash);
  bool pen = false;
  for (uint32_t i = 0; i < p->npts[s]; i++) {
    double x = p->xs[s][i], y = p->ys[s][i];
    if (!usable(p, x, y)) {
      pen = false;
      continue;
    }
    fprintf(f, "%c%.1f,%.1f ", pen ? 'L' : 'M', px(p, x, x0, x1),
            py(p, y, y0, y1));
    pen = true;
  }
  fputs("\"/>\n", f);
  fprintf(f, "<line x1=\"%d\" y1=\"%zu\" x2=\"%d\" y2=\"%zu\" stroke=\"%s\" "
             "stroke-width=\"%.1f\"%s/><text x=\"%d\" y=\"%zu\" "
             "font-size=\"11\">",
          PW - MR + 8, MT + s * 16 + 5, PW - MR + 26, MT + s * 16 + 5, col, w,
          dash, PW - MR + 30, MT + s * 16 + 9);
  esc(f, p->names[s]);
  fputs("</text>\n", f);
}

static void svg_yaxis(FILE *f, const plot *p, double y0, double y1) {
  int n = p->logy ? (int)ceil(lg(y1) - lg(y0) - 1e-9) : 4;
  for (int g = 0; g <= n; g++) {
    double v = p->logy ? pow(10, lg(y0) + g) : y0 + (y1 - y0) * g / n;
    double yy = py(p, v, y0, y1);
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
               "stroke=\"#e4e4e4\"/><text x=\"%d\" y=\"%.1f\" font-size=\"10\" "
               "text-anchor=\"end\">%.3g</text>\n",
            ML, yy, PW - MR, yy, ML - 4, yy + 3, v);
  }
  for (size_t h = 0; h < p->n_hy; h++) {
    double yy = py(p, p->hy[h], y0, y1);
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
               "stroke=\"#999\" stroke-dasharray=\"1 2\"/><text x=\"%d\" "
               "y=\"%.1f\" font-size=\"10\" fill=\"#555\">",
            ML, yy, PW - MR, yy, ML + 3, yy - 2);
    esc(f, p->hy_names[h]);
    fputs("</text>\n", f);
  }
}

static void svg_xaxis(FILE *f, const plot *p, double x0, double x1) {
  int n = p->logx ? (int)ceil(lg(x1) - floor(lg(x0)) - 1e-9) : 5;
  double base = p->logx ? floor(lg(x0)) : 0;
  for (int g = 0; g <= n; g++) {
    double v = p->logx ? pow(10, base + g) : x0 + (x1 - x0) * g / n;
    if (p->logx && (v < x0 * 0.999 || v > x1 * 1.001))
      continue;
    char lab[64];
    if (p->xfmt)
      p->xfmt(lab, sizeof lab, v, p->xctx);
    else
      snprintf(lab, sizeof lab, "%.3g", v);
    double xx = px(p, v, x0, x1);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" "
               "stroke=\"#e4e4e4\"/><text x=\"%.1f\" y=\"%d\" font-size=\"10\" "
               "text-anchor=\"middle\">",
            xx, MT, xx, PH - MB, xx, PH - MB + 14);
    esc(f, lab);
    fputs("</text>\n", f);
  }
}

static void svg_frame(FILE *f, const plot *p) {
  fprintf(f, "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" "
             "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n<title>",
          PW, PH, PW, PH);
  esc(f, p->title);
  fprintf(f, "</title>\n<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
             "fill=\"#fcfcfc\" stroke=\"#999\"/>\n<text x=\"%d\" y=\"18\" "
             "font-size=\"13\" font-weight=\"bold\">",
          ML, MT, PW - ML - MR, PH - MT - MB, ML);
  esc(f, p->title);
  fprintf(f, "</text>\n<text x=\"%d\" y=\"%d\" font-size=\"11\" "
             "text-anchor=\"middle\">",
          (PW - MR + ML) / 2, PH - 8);
  esc(f, p->xlabel);
  fprintf(f, "</text>\n<text x=\"14\" y=\"%d\" font-size=\"11\" "
             "transform=\"rotate(-90 14 %d)\" text-anchor=\"middle\">",
          (PH - MB + MT) / 2, (PH - MB + MT) / 2);
  esc(f, p->ylabel);
  fputs("</text>\n", f);
}

static void svg_plot(FILE *f, const plot *p) {
  double x0, x1, y1, y0 = p->ymin;
  data_range(p, &x0, &x1, &y1);
  svg_frame(f, p);
  svg_yaxis(f, p, y0, y1);
  svg_xaxis(f, p, x0, x1);
  for (size_t s = 0; s < p->n_series; s++) /* faint ones first, underneath */
    if (p->style && p->style[s] == ST_FAINT)
      svg_series(f, p, s, x0, x1, y0, y1);
  for (size_t s = 0; s < p->n_series; s++)
    if (!p->style || p->style[s] != ST_FAINT)
      svg_series(f, p, s, x0, x1, y0, y1);
  fputs("</svg>\n", f);
}

/* ---- the report's pieces ------------------------------------------------------- */
/* A duration in readable units. */
static void fmt_secs(char *buf, size_t cap, double s) {
  if (!isfinite(s))
    snprintf(buf, cap, "-");
  else if (s < 1)
    snprintf(buf, cap, "%.0f ms", s * 1e3);
  else if (s < 120)
    snprintf(buf, cap, "%.3g s", s);
  else if (s < 7200)
    snprintf(buf, cap, "%.3g min", s / 60);
  else if (s < 3 * 86400)
    snprintf(buf, cap, "%.3g h", s / 3600);
  else
    snprintf(buf, cap, "%.3g d", s / 86400);
}

static void fmt_ms(char *buf, size_t cap, double ms, const void *ctx) {
  (void)ctx;
  fmt_secs(buf, cap, ms / 1e3);
}

/* x = % of requests replayed; the label adds the simulated time then. */
static void fmt_progress(char *buf, size_t cap, double x, const void *ctx) {
  const bh_series *se = ctx;
  uint32_t b = (uint32_t)(x / 100.0 * se->n);
  b = b == 0 ? 0 : b - 1;
  if (b >= se->n)
    b = se->n - 1;
  char t[32];
  fmt_secs(t, sizeof t, se->t != NULL ? se->t[b] : NAN);
  if (se->t != NULL && se->t_end > 0 && x > 0) /* t: a live run may lack it */
    snprintf(buf, cap, "%.0f%% (%s)", x, t);
  else
    snprintf(buf, cap, "%.0f%%", x);
}

static uint8_t style_of(const bh_run *run, size_t i, int focus, int peer) {
  if ((int)i == focus)
    return ST_FOCUS;
  if ((int)i == peer)
    return ST_PEER;
  if (run->res[i].policy == BH_POLICY_INFINITE)
    return ST_UPPER;
  if (run->res[i].policy == BH_POLICY_RANDOM)
    return ST_LOWER;
  return ST_FAINT;
}

static void html_model(FILE *f, const bh_cluster *cl, uint32_t bs) {
  const kvp_model_spec *m = &cl->model;
  const kvp_gpu_spec *g = &cl->gpu;
  bool dflt = m->layers == 0 && m->params == 0;
  double kvb = kvp_model_kv_bytes_per_token(m);
  fprintf(f, "<li><b>Model</b>: %s%u layers, %u heads, %u KV heads &#215; %u, "
             "%u-byte KV, %.3g B parameters: %.0f KiB of KV per token, "
             "%.2f MB per %u-token block</li>\n",
          dflt ? "Llama-3.1-8B (default): " : "",
          m->layers ? m->layers : 32, m->heads ? m->heads : 32,
          m->kv_heads ? m->kv_heads : 8, m->head_dim ? m->head_dim : 128,
          m->dtype_bytes ? m->dtype_bytes : 2,
          (m->params > 0 ? m->params : 8.03e9) / 1e9, kvb / 1024,
          kvb * bs / 1e6, bs);
  fprintf(f, "<li><b>GPU</b>: %s%.0f TFLOP/s peak at %.0f%% in prefill; "
             "KV load from DRAM %.0f GB/s, NVMe %.1f GB/s</li>\n",
          g->flops == 0 ? "H100 SXM (default): " : "",
          (g->flops > 0 ? g->flops : 989e12) / 1e12,
          100 * (g->efficiency > 0 ? g->efficiency : 0.5),
          (g->bw[KVP_TIER_DRAM] > 0 ? g->bw[KVP_TIER_DRAM] : 50e9) / 1e9,
          (g->bw[KVP_TIER_NVME] > 0 ? g->bw[KVP_TIER_NVME] : 6e9) / 1e9);
  double blk = kvb * bs / 1e9;
  fprintf(f, "<li><b>Cluster</b>: %u workers, each with KV tiers HBM %.3g GB "
             "(%llu blocks), DRAM %.3g GB (%llu), NVMe %.3g GB (%llu); "
             "placement HBM %s, DRAM %s, NVMe %s, %s</li>\n",
          cl->workers, (double)cl->hbm_blocks * blk,
          (unsigned long long)cl->hbm_blocks, (double)cl->dram_blocks * blk,
          (unsigned long long)cl->dram_blocks, (double)cl->nvme_blocks * blk,
          (unsigned long long)cl->nvme_blocks,
          kvp_tier_policy_name(cl->tier_policy[KVP_TIER_HBM]),
          kvp_tier_policy_name(cl->tier_policy[KVP_TIER_DRAM]),
          kvp_tier_policy_name(cl->tier_policy[KVP_TIER_NVME]),
          cl->tier_no_classes ? "stability-blind" : "stability aware");
}

static void html_setup(FILE *f, const bh_run *run) {
  const bh_trace *t = run->trace;
  double span = run->n_res ? run->res[0].series.t_end : 0;
  char sp[32];
  fmt_secs(sp, sizeof sp, span);
  fputs("<ul class=\"setup\">\n<li><b>Trace</b>: ", f);
  esc(f, t->label);
  fprintf(f, ": %zu requests, %.1fM prompt tokens over %s, %u-token blocks, "
             "%llu malformed records skipped</li>\n",
          t->n_reqs, (double)bh_trace_prompt_tokens(t) / 1e6,
          span > 0 ? sp : "(closed loop)", t->block_size,
          (unsigned long long)t->records_bad);
  html_model(f, run->cl, t->block_size);
  fputs("</ul>\n", f);
}

static double hit_of(const bh_result *r) {
  return pct(r->tot.reused_tokens, r->tot.prompt_tokens);
}

static double share(const bh_result *r, uint64_t v) {
  return pct(v, r->tot.prompt_tokens);
}

/* "Which policy, by how much, why" in three sentences. */
static void html_verdict(FILE *f, const bh_run *run, int focus, int peer) {
  if (focus < 0)
    return;
  const bh_result *a = &run->res[focus], *b = peer >= 0 ? &run->res[peer] : NULL;
  const bh_result *up = NULL, *lo = NULL;
  for (size_t i = 0; i < run->n_res; i++) {
    up = run->res[i].policy == BH_POLICY_INFINITE ? &run->res[i] : up;
    lo = run->res[i].policy == BH_POLICY_RANDOM ? &run->res[i] : lo;
  }
  char x[4][32];
  fputs("<div class=\"verdict\"><p><b>", f);
  esc(f, a->name);
  fmt_secs(x[0], sizeof x[0], quant_ms(a, 0.95) / 1e3);
  fmt_secs(x[1], sizeof x[1], quant_ms(a, 0.99) / 1e3);
  fprintf(f, "</b>: TTFT p95 %s, p99 %s, hit rate %.1f%%, %.0f prefill "
             "GPU-s avoided.</p>\n", x[0], x[1], hit_of(a),
          a->tot.avoided_gpu_seconds);
  if (b != NULL) {
    fmt_secs(x[2], sizeof x[2], quant_ms(b, 0.95) / 1e3);
    fmt_secs(x[3], sizeof x[3], quant_ms(b, 0.99) / 1e3);
    double r95 = quant_ms(b, 0.95) / quant_ms(a, 0.95);
    fputs("<p>Best peer by TTFT p95: <b>", f);
    esc(f, b->name);
    fprintf(f, "</b> (p95 %s, p99 %s, hit rate %.1f%%): %s has a %.2fx %s "
               "p95, %.2fx p99, %+.1f points of hit rate.</p>\n",
            x[2], x[3], hit_of(b), a->name, r95 >= 1 ? r95 : 1 / r95,
            r95 >= 1 ? "lower" : "higher",
            quant_ms(b, 0.99) / quant_ms(a, 0.99), hit_of(a) - hit_of(b));
    fprintf(f, "<p>Why: hits from HBM %.1f%% vs %.1f%%, from DRAM/NVMe "
               "%.1f%% vs %.1f%% (loads cost time); load imbalance (max / "
               "mean prefill per worker) %.2f vs %.2f; recomputed because "
               "the blocks sat on another worker %.1f%% vs %.1f%%, evicted "
               "%.1f%% vs %.1f%% of prompt tokens.</p>\n",
            share(a, a->tot.reused_by_tier[0]), share(b, b->tot.reused_by_tier[0]),
            share(a, a->tot.reused_by_tier[1] + a->tot.reused_by_tier[2]),
            share(b, b->tot.reused_by_tier[1] + b->tot.reused_by_tier[2]),
            a->imbalance, b->imbalance,
            share(a, a->tot.miss_tokens[KVP_MISS_OTHER_WORKER]),
            share(b, b->tot.miss_tokens[KVP_MISS_OTHER_WORKER]),
            share(a, a->tot.miss_tokens[KVP_MISS_EVICTED]),
            share(b, b->tot.miss_tokens[KVP_MISS_EVICTED]));
  }
  if (up != NULL || lo != NULL)
    fprintf(f, "<p>Bounds: hit rate %.1f%% with one unbounded shared cache "
               "(infinite), %.1f%% routing at random.</p>\n",
            up ? hit_of(up) : NAN, lo ? hit_of(lo) : NAN);
  fputs("</div>\n", f);
}

/* Where each policy's prompt tokens went: reused per tier, recomputed per
 * miss cause; one horizontal bar per policy (the "why" at a glance). */
static void svg_bars(FILE *f, const bh_run *run, int focus) {
  static const char *const col[] = {"#2ca02c", "#98df8a", "#dbdb8d",
                                    "#d62728", "#ff9896", "#9467bd",
                                    "#c5b0d5", "#8c564b", "#c49c94",
                                    "#e377c2", "#bbbbbb"};
  int rowh = 20, h = MT + 26 + (int)run->n_res * rowh + 60;
  int x0 = 150, w = PW - x0 - 20;
  fprintf(f, "<svg class=\"plot bars\" xmlns=\"http://www.w3.org/2000/svg\" "
             "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n"
             "<title>Where the prompt tokens went</title>\n<text x=\"10\" "
             "y=\"18\" font-size=\"13\" font-weight=\"bold\">Where the prompt "
             "tokens went (share of all prompt tokens)</text>\n",
          PW, h, PW, h);
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    double y = MT + 10 + (double)i * rowh, at = x0;
    fprintf(f, "<text x=\"%d\" y=\"%.0f\" font-size=\"11\" text-anchor=\"end\""
               "%s>", x0 - 6, y + 13,
            (int)i == focus ? " font-weight=\"bold\"" : "");
    esc(f, r->name);
    fputs("</text>\n", f);
    for (int k = 0; k < 3 + KVP_MISS_COUNT_; k++) {
      uint64_t v = k < 3 ? r->tot.reused_by_tier[k] : r->tot.miss_tokens[k - 3];
      double ww = w * share(r, v) / 100;
      if (!(ww > 0.05))
        continue;
      fprintf(f, "<rect class=\"bar\" x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" "
                 "height=\"%d\" fill=\"%s\"/>\n",
              at, y, ww, rowh - 4, col[k]);
      at += ww;
    }
  }
  double ly = MT + 22 + (double)run->n_res * rowh;
  for (int k = 0; k < 3 + KVP_MISS_COUNT_; k++) {
    double lx = 10 + (k % 6) * 125, yy = ly + (k / 6) * 16;
    fprintf(f, "<rect x=\"%.0f\" y=\"%.0f\" width=\"10\" height=\"10\" "
               "fill=\"%s\"/><text x=\"%.0f\" y=\"%.0f\" font-size=\"10\">",
            lx, yy, col[k], lx + 14, yy + 9);
    if (k < 3)
      fprintf(f, "hit: %s", kvp_tier_label((kvp_tier)k));
    else
      fprintf(f, "miss: %s", kvp_miss_cause_name((kvp_miss_cause)(k - 3)));
    fputs("</text>\n", f);
  }
  fputs("</svg>\n", f);
}

static void html_table(FILE *f, const bh_run *run, int focus) {
  fputs("<div class=\"wide\"><table><tr><th>policy</th><th>hit %</th>"
        "<th>HBM %</th>"
        "<th>DRAM %</th><th>NVMe %</th><th>stable %</th><th>semi %</th>"
        "<th>volatile %</th><th>avoided tokens</th><th>avoided GPU-s</th>"
        "<th>imbalance</th><th>TTFT p50</th><th>p95</th>"
        "<th>p99</th><th>loaded GB</th><th>demoted GB</th>"
        "<th>top miss cause</th></tr>\n",
        f);
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    const kvp_ledger_totals *x = &r->tot;
    char d[3][32];
    fmt_secs(d[0], sizeof d[0], quant_ms(r, 0.5) / 1e3);
    fmt_secs(d[1], sizeof d[1], quant_ms(r, 0.95) / 1e3);
    fmt_secs(d[2], sizeof d[2], quant_ms(r, 0.99) / 1e3);
    fprintf(f, "<tr%s><td>", (int)i == focus ? " class=\"focus\"" : "");
    esc(f, r->name);
    fprintf(f,
            "</td><td>%.2f</td><td>%.2f</td><td>%.2f</td><td>%.2f</td>"
            "<td>%.2f</td><td>%.2f</td><td>%.2f</td><td>%.1fM</td>"
            "<td>%.0f</td><td>%.2f</td><td>%s</td><td>%s</td>"
            "<td>%s</td><td>%.1f</td><td>%.1f</td><td>%s</td></tr>\n",
            hit_of(r), share(r, x->reused_by_tier[0]),
            share(r, x->reused_by_tier[1]), share(r, x->reused_by_tier[2]),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_STABLE),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_SEMI),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_VOLATILE),
            (double)x->reused_tokens / 1e6, x->avoided_gpu_seconds,
            r->imbalance, d[0], d[1], d[2],
            (double)(x->load_bytes[1] + x->load_bytes[2]) / 1e9,
            (double)(r->demoted_bytes[1] + r->demoted_bytes[2]) / 1e9,
            kvp_miss_cause_name(top_cause(x)));
  }
  fputs("</table></div>\n", f);
}

static const char glossary[] =
    "<details open=\"open\"><summary>What the columns mean</summary><dl>\n"
    "<dt>hit %</dt><dd>prompt tokens served from a cache (reused) / all "
    "prompt tokens. HBM / DRAM / NVMe %: the same split by the tier the "
    "reused blocks came from (DRAM and NVMe hits cost load time).</dd>\n"
    "<dt>stable %, semi %, volatile % (terminal: stable%, semi%, vol%)</dt>"
    "<dd>hit rate within each segment class the production stability "
    "classifier assigned: stable = seen across sessions (system prompt, "
    "tools), semi-stable = re-seen within a session (history), volatile = "
    "the rest.</dd>\n"
    "<dt>avoided tokens (terminal: avoidedM, millions)</dt><dd>prompt "
    "tokens not recomputed.</dd>\n"
    "<dt>avoided GPU-s (terminal: avoid_s)</dt><dd>prefill GPU-seconds those "
    "tokens would have cost on the simulated GPU.</dd>\n"
    "<dt>imbalance (imbal)</dt><dd>the busiest worker's prefill tokens / "
    "the mean: 1 is even.</dd>\n"
    "<dt>TTFT p50 / p95 / p99</dt><dd>time to first token: queueing + "
    "loading cached blocks + prefill of the rest.</dd>\n"
    "<dt>loaded GB (loadGB)</dt><dd>KV bytes read from DRAM and NVMe into "
    "HBM. demoted GB: bytes written down into DRAM and NVMe.</dd>\n"
    "<dt>top miss cause (top_miss)</dt><dd>why most recomputed tokens were "
    "recomputed: never_seen (new content), on_other_worker (cached on a "
    "worker not chosen), evicted, drift (the prompt changed before them), "
    "partial_block, not_worth_loading.</dd>\n"
    "<dt>infinite, random</dt><dd>bounds, not policies: one unbounded "
    "shared cache holding every block from its request's arrival (no "
    "policy reuses more), and uniform random routing.</dd>\n"
    "<dt>sim_req/s</dt><dd>requests simulated per second of host time "
    "(the harness's speed, not the cluster's).</dd>\n"
    "</dl></details>\n";

/* Hit rate over the replay: focus and peer bold, bounds dashed, the rest
 * grey underneath. */
static void plot_hits(FILE *f, const bh_run *run, const uint8_t *st,
                      const double *xb) {
  const char *names[BH_POLICY_COUNT];
  const double *xs[BH_POLICY_COUNT], *ys[BH_POLICY_COUNT];
  uint32_t np[BH_POLICY_COUNT];
  for (size_t i = 0; i < run->n_res; i++) {
    names[i] = run->res[i].name;
    xs[i] = xb;
    ys[i] = run->res[i].series.hit;
    np[i] = run->res[i].series.n;
  }
  plot p = {.title = "Prefix hit rate over the replay (reused / prompt "
                     "tokens, per 1/n of the requests)",
            .xlabel = "requests replayed (simulated time then)",
            .ylabel = "hit rate", .n_series = run->n_res, .names = names,
            .xs = xs, .ys = ys, .npts = np, .style = st, .ymax = 1.0,
            .xhi = 100, .xfmt = fmt_progress, .xctx = &run->res[0].series};
  svg_plot(f, &p);
}

/* TTFT CCDF: P(TTFT > x) on log-log axes, so the p95 / p99 tail shows. */
static void plot_ccdf(FILE *f, const bh_run *run, const uint8_t *st) {
  enum { NQ = 61 };
  static double cx[BH_POLICY_COUNT][NQ], cy[BH_POLICY_COUNT][NQ];
  const char *names[BH_POLICY_COUNT];
  const double *xs[BH_POLICY_COUNT], *ys[BH_POLICY_COUNT];
  uint32_t np[BH_POLICY_COUNT];
  double floor_p = 1.0 / (double)(run->trace->n_reqs ? run->trace->n_reqs : 1);
  floor_p = floor_p > 1e-3 ? floor_p : 1e-3;
  for (size_t i = 0; i < run->n_res; i++) {
    uint32_t k = 0;
    for (int q = 0; q < NQ; q++) {
      double tail = pow(10, -3.0 * q / (NQ - 1)); /* 1 .. 1e-3 */
      if (tail < floor_p * 0.999)
        break;
      cx[i][k] = (double)kvp_hist_quantile(run->res[i].ttft_us,
                                           1 - tail) / 1e3;
      cy[i][k++] = tail;
    }
    names[i] = run->res[i].name;
    xs[i] = cx[i];
    ys[i] = cy[i];
    np[i] = k;
  }
  static const double hy[] = {0.5, 0.05, 0.01};
  static const char *const hn[] = {"p50", "p95", "p99"};
  plot p = {.title = "TTFT tail: fraction of requests slower than x (CCDF)",
            .xlabel = "TTFT (log scale)", .ylabel = "P(TTFT > x), log",
            .n_series = run->n_res, .names = names, .xs = xs, .ys = ys,
            .npts = np, .style = st, .logx = true, .logy = true,
            .ymin = floor_p < 1e-3 ? 1e-3 : pow(10, floor(lg(floor_p))),
            .ymax = 1.0, .xfmt = fmt_ms, .hy = hy, .hy_names = hn,
            .n_hy = 3};
  svg_plot(f, &p);
}

static void plot_occupancy(FILE *f, const bh_run *run, int focus,
                           const double *xb) {
  const bh_result *r = &run->res[focus];
  const char *tn[3];
  const double *xs[3], *ys[3];
  uint32_t np[3];
  for (int k = 0; k < 3; k++) {
    tn[k] = kvp_tier_label((kvp_tier)k);
    xs[k] = xb;
    ys[k] = r->series.occ[k];
    np[k] = r->series.n;
  }
  char title[128];
  snprintf(title, sizeof title, "Tier occupancy, %s (blocks in use / "
                                "capacity, all workers)", r->name);
  plot p = {.title = title, .xlabel = "requests replayed (simulated time then)",
            .ylabel = "used / capacity", .n_series = 3, .names = tn,
            .xs = xs, .ys = ys, .npts = np, .ymax = 1.0, .xhi = 100,
            .xfmt = fmt_progress, .xctx = &r->series};
  svg_plot(f, &p);
}

static int html_section(FILE *f, const bh_run *run) {
  int peer, focus = bh_report_focus(run, &peer);
  uint8_t st[BH_POLICY_COUNT];
  size_t n = run->n_res < BH_POLICY_COUNT ? run->n_res : BH_POLICY_COUNT;
  bh_run r = *run;
  r.n_res = n;
  for (size_t i = 0; i < n; i++)
    st[i] = style_of(run, i, focus, peer);
  fputs("<section>\n<h2>", f);
  esc(f, run->label);
  fputs("</h2>\n", f);
  html_setup(f, run);
  html_verdict(f, run, focus, peer);
  html_table(f, &r, focus);
  fputs(glossary, f);
  if (n == 0) {
    fputs("</section>\n", f);
    return 0;
  }
  uint32_t nb = run->res[0].series.n;
  double *xb = calloc(nb + 1, sizeof *xb);
  if (xb == NULL)
    return KVP_ENOMEM;
  for (uint32_t b = 0; b < nb; b++)
    xb[b] = 100.0 * (b + 1) / nb;
  svg_bars(f, &r, focus);
  plot_hits(f, &r, st, xb);
  plot_ccdf(f, &r, st);
  if (focus >= 0)
    plot_occupancy(f, &r, focus, xb);
  fputs("</section>\n", f);
  free(xb);
  return 0;
}

int bh_report_html(FILE *f, const bh_run *runs, size_t n) {
  fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
        "<title>kvplane-bench report</title>\n<style>\n"
        "body{font-family:sans-serif;margin:2em;max-width:1200px}\n"
        "table{border-collapse:collapse;font-size:12px;margin:0.5em 0}\n"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}\n"
        "td{white-space:nowrap}\n.wide{overflow-x:auto}\n"
        "td:first-child,th:first-child{text-align:left}\n"
        "tr.focus td{background:#fdecea;font-weight:bold}\n"
        ".verdict{border-left:4px solid #d62728;background:#fafafa;"
        "padding:0.2em 1em;margin:1em 0}\n"
        "dl{font-size:12px}dt{font-weight:bold}dd{margin:0 0 0.3em 1.5em}\n"
        "svg.plot{display:block;margin:1em 0}\n"
        "</style>\n</head>\n<body>\n<h1>kvplane-bench report</h1>\n"
        "<p>Every policy replays identical work through the production "
        "kvplane router, locality index and ledger. The policy of interest "
        "(kvplane_cost when present) is drawn in red and its best peer by "
        "TTFT p95 in blue; <b>infinite</b> (dashed) is the upper bound, "
        "<b>random</b> (dotted) a lower reference, other policies are grey."
        "</p>\n",
        f);
  for (size_t i = 0; i < n; i++) {
    int rc = html_section(f, &runs[i]);
    if (rc < 0)
      return rc;
  }
  fputs("</body>\n</html>\n", f);
  return ferror(f) ? KVP_EIO : 0;
}

int bh_report_sweep_html(FILE *f, const char *title, const char *xname,
                         size_t n_lines, const char *const *line_names,
                         const double *x, uint32_t nx,
                         const double *const *avoided,
                         const double *const *p95, double bound) {
  if (n_lines == 0 || n_lines > 16)
    return KVP_EINVAL;
  const double *xs[17], *ys[17];
  const char *names[17];
  uint32_t np[17];
  double bx[2] = {x[0], x[nx - 1]}, by[2] = {bound, bound};
  for (size_t i = 0; i < n_lines; i++) {
    xs[i] = x;
    ys[i] = avoided[i];
    np[i] = nx;
    names[i] = line_names[i];
  }
  fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
        "<title>kvplane-bench sweep</title>\n<style>body{font-family:sans-serif;"
        "margin:2em}svg.plot{display:block;margin:1em 0}</style>\n</head>\n"
        "<body>\n<h1>",
        f);
  esc(f, title);
  fputs("</h1>\n<section>\n", f);
  plot a = {.title = "Prefill avoided", .xlabel = xname,
            .ylabel = "GPU-seconds", .n_series = n_lines, .names = names,
            .xs = xs, .ys = ys, .npts = np};
  svg_plot(f, &a);
  for (size_t i = 0; i < n_lines; i++)
    ys[i] = p95[i];
  size_t n = n_lines;
  if (bound > 0) {
    xs[n] = bx;
    ys[n] = by;
    np[n] = 2;
    names[n++] = "p95 bound";
  }
  plot b = {.title = "TTFT p95", .xlabel = xname, .ylabel = "seconds",
            .n_series = n, .names = names, .xs = xs, .ys = ys, .npts = np};
  svg_plot(f, &b);
  fputs("</section>\n</body>\n</html>\n", f);
  return ferror(f) ? KVP_EIO : 0;
}
