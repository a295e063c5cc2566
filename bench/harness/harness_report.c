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
  fprintf(f, "%-18s %6s %6s %6s %7s %6s %9s %5s %8s %8s %8s %-15s %9s\n",
          "policy", "hit%", "hbm%", "lower%", "stable%", "semi%", "avoid_s",
          "imbal", "ttft_p50", "ttft_p95", "ttft_p99", "top_miss",
          "sim_req/s");
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    const kvp_ledger_totals *x = &r->tot;
    char d[3][16];
    fprintf(f,
            "%-18.18s %6.2f %6.2f %6.2f %7.2f %6.2f %9.0f %5.2f %s %s %s "
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

void bh_report_table(FILE *f, const bh_run *run) {
  bh_report_table_opts(f, run, 0);
}

void bh_report_table_opts(FILE *f, const bh_run *run, unsigned flags) {
  table_head(f, run);
  if (flags & BH_TABLE_WIDE)
    table_wide(f, run);
  else
    table_compact(f, run);
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

typedef struct plot {
  const char *title, *xlabel, *ylabel;
  size_t n_series;
  const char *const *names;
  const double *const *xs, *const *ys;
  const uint32_t *npts;
  bool logx;
  double ymax; /* 0 = from data */
} plot;

#define PW 640
#define PH 300
#define ML 60
#define MR 150
#define MT 30
#define MB 45

static double tx(const plot *p, double x, double x0, double x1) {
  if (p->logx) {
    x = log10(x > 1e-9 ? x : 1e-9);
    x0 = log10(x0 > 1e-9 ? x0 : 1e-9);
    x1 = log10(x1 > 1e-9 ? x1 : 1e-9);
  }
  return ML + (x1 > x0 ? (x - x0) / (x1 - x0) : 0) * (PW - ML - MR);
}

static void svg_plot(FILE *f, const plot *p) {
  double x0 = INFINITY, x1 = -INFINITY, y1 = p->ymax;
  for (size_t s = 0; s < p->n_series; s++)
    for (uint32_t i = 0; i < p->npts[s]; i++) {
      double x = p->xs[s][i], y = p->ys[s][i];
      if (!isfinite(x) || !isfinite(y) || (p->logx && x <= 0))
        continue;
      x0 = fmin(x0, x);
      x1 = fmax(x1, x);
      if (p->ymax == 0)
        y1 = fmax(y1, y);
    }
  if (!isfinite(x0)) {
    x0 = 0;
    x1 = 1;
  }
  if (y1 <= 0)
    y1 = 1;
  fprintf(f, "<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" "
             "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n",
          PW, PH, PW, PH);
  fputs("<title>", f);
  esc(f, p->title);
  fputs("</title>\n", f);
  fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
             "fill=\"#fafafa\" stroke=\"#999\"/>\n",
          ML, MT, PW - ML - MR, PH - MT - MB);
  fprintf(f, "<text x=\"%d\" y=\"18\" font-size=\"13\" "
             "font-weight=\"bold\">",
          ML);
  esc(f, p->title);
  fputs("</text>\n", f);
  for (int g = 0; g <= 4; g++) { /* y grid */
    double yv = y1 * g / 4, yy = PH - MB - (PH - MT - MB) * g / 4.0;
    fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
               "stroke=\"#ddd\"/><text x=\"%d\" y=\"%.1f\" font-size=\"10\" "
               "text-anchor=\"end\">%.3g</text>\n",
            ML, yy, PW - MR, yy, ML - 4, yy + 3, yv);
  }
  for (int g = 0; g <= 4; g++) { /* x ticks */
    double xv = p->logx ? pow(10, log10(fmax(x0, 1e-9)) +
                                      (log10(fmax(x1, 1e-9)) -
                                       log10(fmax(x0, 1e-9))) * g / 4)
                        : x0 + (x1 - x0) * g / 4;
    fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-size=\"10\" "
               "text-anchor=\"middle\">%.3g</text>\n",
            tx(p, xv, x0, x1), PH - MB + 14, xv);
  }
  fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" "
             "text-anchor=\"middle\">",
          (PW - MR + ML) / 2, PH - 8);
  esc(f, p->xlabel);
  fprintf(f, "</text>\n<text x=\"12\" y=\"%d\" font-size=\"11\" "
             "transform=\"rotate(-90 12 %d)\" text-anchor=\"middle\">",
          PH / 2, PH / 2);
  esc(f, p->ylabel);
  fputs("</text>\n", f);
  for (size_t s = 0; s < p->n_series; s++) {
    const char *col = palette[s % (sizeof palette / sizeof *palette)];
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" "
               "points=\"",
            col);
    for (uint32_t i = 0; i < p->npts[s]; i++) {
      double x = p->xs[s][i], y = p->ys[s][i];
      if (!isfinite(x) || !isfinite(y) || (p->logx && x <= 0))
        continue;
      double yy = PH - MB - (PH - MT - MB) * fmin(y / y1, 1.0);
      fprintf(f, "%.1f,%.1f ", tx(p, x, x0, x1), yy);
    }
    fputs("\"/>\n", f);
    fprintf(f, "<rect x=\"%d\" y=\"%zu\" width=\"10\" height=\"10\" "
               "fill=\"%s\"/><text x=\"%d\" y=\"%zu\" font-size=\"11\">",
            PW - MR + 8, MT + s * 16, col, PW - MR + 22, MT + s * 16 + 9);
    esc(f, p->names[s]);
    fputs("</text>\n", f);
  }
  fputs("</svg>\n", f);
}

static void html_table(FILE *f, const bh_run *run) {
  fputs("<table><tr><th>policy</th><th>hit %</th><th>HBM %</th>"
        "<th>DRAM %</th><th>NVMe %</th><th>stable %</th><th>semi %</th>"
        "<th>volatile %</th><th>avoided tokens</th><th>avoided GPU-s</th>"
        "<th>imbalance</th><th>TTFT p50 ms</th><th>p95 ms</th>"
        "<th>p99 ms</th><th>loaded GB (DRAM+NVMe)</th><th>demoted GB</th>"
        "<th>top miss cause</th></tr>\n",
        f);
  for (size_t i = 0; i < run->n_res; i++) {
    const bh_result *r = &run->res[i];
    const kvp_ledger_totals *x = &r->tot;
    fputs("<tr><td>", f);
    esc(f, r->name);
    fprintf(f,
            "</td><td>%.2f</td><td>%.2f</td><td>%.2f</td><td>%.2f</td>"
            "<td>%.2f</td><td>%.2f</td><td>%.2f</td><td>%llu</td>"
            "<td>%.1f</td><td>%.2f</td><td>%.1f</td><td>%.1f</td>"
            "<td>%.1f</td><td>%.1f</td><td>%.1f</td><td>%s</td></tr>\n",
            pct(x->reused_tokens, x->prompt_tokens),
            pct(x->reused_by_tier[0], x->prompt_tokens),
            pct(x->reused_by_tier[1], x->prompt_tokens),
            pct(x->reused_by_tier[2], x->prompt_tokens),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_STABLE),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_SEMI),
            100 * kvp_ledger_hit_rate(x, KVP_CLASS_VOLATILE),
            (unsigned long long)x->reused_tokens, x->avoided_gpu_seconds,
            r->imbalance, quant_ms(r, 0.5), quant_ms(r, 0.95),
            quant_ms(r, 0.99),
            (double)(x->load_bytes[1] + x->load_bytes[2]) / 1e9,
            (double)(r->demoted_bytes[1] + r->demoted_bytes[2]) / 1e9,
            kvp_miss_cause_name(top_cause(x)));
  }
  fputs("</table>\n<h3>Miss causes (recomputed tokens)</h3>\n<table><tr>"
        "<th>policy</th>",
        f);
  for (int c = 0; c < KVP_MISS_COUNT_; c++)
    fprintf(f, "<th>%s</th>", kvp_miss_cause_name((kvp_miss_cause)c));
  fputs("</tr>\n", f);
  for (size_t i = 0; i < run->n_res; i++) {
    fputs("<tr><td>", f);
    esc(f, run->res[i].name);
    fputs("</td>", f);
    for (int c = 0; c < KVP_MISS_COUNT_; c++)
      fprintf(f, "<td>%llu</td>",
              (unsigned long long)run->res[i].tot.miss_tokens[c]);
    fputs("</tr>\n", f);
  }
  fputs("</table>\n", f);
}

static int html_section(FILE *f, const bh_run *run) {
  size_t n = run->n_res;
  const char *names[BH_POLICY_COUNT * 2];
  const double *xs[BH_POLICY_COUNT * 2], *ys[BH_POLICY_COUNT * 2];
  uint32_t np[BH_POLICY_COUNT * 2];
  double cx[BH_POLICY_COUNT][101], cy[BH_POLICY_COUNT][101];
  double *tb = NULL;
  if (n > BH_POLICY_COUNT)
    n = BH_POLICY_COUNT;
  fputs("<section>\n<h2>", f);
  esc(f, run->label);
  fputs("</h2>\n<p>", f);
  esc(f, run->trace->label);
  fprintf(f, " &#8212; %zu requests, block %u tokens, %u workers; %llu bad "
             "records skipped.</p>\n",
          run->trace->n_reqs, run->trace->block_size, run->cl->workers,
          (unsigned long long)run->trace->records_bad);
  html_table(f, run);
  /* 1: hit rate over time */
  uint32_t nb = n ? run->res[0].series.n : 0;
  tb = calloc(nb + 1, sizeof *tb);
  if (tb == NULL)
    return KVP_ENOMEM;
  double span = n ? run->res[0].series.t_end : 0;
  for (uint32_t b = 0; b < nb; b++)
    tb[b] = span > 0 ? span * (b + 0.5) / nb / 60.0 : (b + 0.5) / nb * 100;
  for (size_t i = 0; i < n; i++) {
    names[i] = run->res[i].name;
    xs[i] = tb;
    ys[i] = run->res[i].series.hit;
    np[i] = run->res[i].series.n;
  }
  plot p1 = {"Prefix hit rate over time (reused / prompt tokens)",
             span > 0 ? "simulated time (min)" : "requests (% of trace)",
             "hit rate", n, names, xs, ys, np, false, 1.0};
  svg_plot(f, &p1);
  /* 2: TTFT CDF */
  for (size_t i = 0; i < n; i++) {
    for (int q = 0; q <= 100; q++) {
      double qq = q == 100 ? 0.999 : q / 100.0;
      cx[i][q] = (double)kvp_hist_quantile(run->res[i].ttft_us, qq) / 1e3;
      cy[i][q] = qq;
    }
    xs[i] = cx[i];
    ys[i] = cy[i];
    np[i] = 101;
  }
  plot p2 = {"TTFT CDF per policy", "TTFT (ms, log scale)", "fraction",
             n, names, xs, ys, np, true, 1.0};
  svg_plot(f, &p2);
  /* 3: tier occupancy of the first non-bound policy */
  size_t pick = 0;
  for (size_t i = 0; i < n; i++)
    if (run->res[i].policy < KVP_POLICY_COUNT_) {
      pick = i;
      break;
    }
  const char *tn[3];
  for (int k = 0; k < 3; k++)
    tn[k] = kvp_tier_label((kvp_tier)k);
  for (int k = 0; n > 0 && k < 3; k++) {
    xs[k] = tb;
    ys[k] = run->res[pick].series.occ[k];
    np[k] = nb;
  }
  char title[128];
  snprintf(title, sizeof title, "Tier occupancy over time (%s, all workers)",
           n ? run->res[pick].name : "-");
  plot p3 = {title,
             span > 0 ? "simulated time (min)" : "requests (% of trace)",
             "used / capacity", n ? 3 : 0, tn, xs, ys, np, false, 1.0};
  svg_plot(f, &p3);
  fputs("</section>\n", f);
  free(tb);
  return 0;
}

int bh_report_html(FILE *f, const bh_run *runs, size_t n) {
  fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
        "<title>kvplane-bench report</title>\n<style>\n"
        "body{font-family:sans-serif;margin:2em;max-width:1200px}\n"
        "table{border-collapse:collapse;font-size:12px;margin:0.5em 0}\n"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}\n"
        "td:first-child,th:first-child{text-align:left}\n"
        "svg.plot{display:block;margin:1em 0}\n"
        "</style>\n</head>\n<body>\n<h1>kvplane-bench report</h1>\n"
        "<p>Every policy replays identical work through the production "
        "kvplane router, locality index and ledger on a simulated cluster. "
        "<b>infinite</b> is the upper bound (one unbounded cache holding "
        "every block from its request's arrival); <b>random</b> routes "
        "uniformly (a lower reference).</p>\n",
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
  plot a = {"Prefill avoided", xname, "GPU-seconds", n_lines, names, xs, ys,
            np, false, 0};
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
  plot b = {"TTFT p95", xname, "seconds", n, names, xs, ys, np, false, 0};
  svg_plot(f, &b);
  fputs("</section>\n</body>\n</html>\n", f);
  return ferror(f) ? KVP_EIO : 0;
}
