/* SPDX-License-Identifier: Apache-2.0 */
/* Synthetic agentic traces, deterministic by seed, in kvplane's JSONL format
 * with segment marks: tenants chosen by Zipf popularity share a system
 * prompt and tool schema; each session adds semi-stable repo context, then
 * turns that grow the history with volatile user input / tool results after
 * exponential think times; some turns fan out sub-agents that share the
 * parent's system + tools prefix.  `drift` is the chance that a turn changes
 * the first system block (a timestamp in the system prompt): from then on
 * nothing of the old prefix matches, and the report shows what it cost. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

typedef struct gen {
  uint64_t s;
  uint64_t next_id;
  const bh_gen_opts *o;
  FILE *f;
  uint32_t bs;
  uint64_t emitted;
} gen;

static uint64_t g_next(gen *g) {
  uint64_t z = (g->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static double g_unit(gen *g) {
  return ((double)(g_next(g) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double g_exp(gen *g, double mean) { return -mean * log(g_unit(g)); }

/* around mean, at least 1 */
static uint64_t g_tokens(gen *g, double mean) {
  double v = g_exp(g, mean);
  return v < 1 ? 1 : (uint64_t)v;
}

typedef struct sess {
  uint64_t *ids;
  size_t n, cap;
  uint64_t tokens;     /* prompt so far */
  uint64_t prev;       /* previous prompt's length */
  uint64_t sys, tools, repo;
} sess;

static int ids_fill(gen *g, sess *s, uint64_t full) {
  if (full > s->cap) {
    size_t nc = s->cap ? s->cap : 256;
    while (nc < full)
      nc *= 2;
    uint64_t *ni = realloc(s->ids, nc * sizeof *ni);
    if (ni == NULL)
      return KVP_ENOMEM;
    s->ids = ni;
    s->cap = nc;
  }
  while (s->n < full)
    s->ids[s->n++] = g->next_id++;
  return 0;
}

static void emit(gen *g, double t, uint32_t tenant, const char *session,
                 const sess *s, uint64_t out, bool tool) {
  FILE *f = g->f;
  uint64_t a = s->sys, b = a + s->tools, c = b + s->repo;
  uint64_t h = s->prev > c ? s->prev : c;
  fprintf(f, "{\"t\":%.3f,\"in\":%llu,\"out\":%llu,\"tenant\":\"tenant-%u\","
             "\"session\":\"%s\",\"segments\":["
             "{\"offset\":0,\"length\":%llu,\"role\":\"system\"},"
             "{\"offset\":%llu,\"length\":%llu,\"role\":\"tools\"},"
             "{\"offset\":%llu,\"length\":%llu,\"role\":\"documents\"},"
             "{\"offset\":%llu,\"length\":%llu,\"role\":\"history\"},"
             "{\"offset\":%llu,\"length\":%llu,\"role\":\"%s\"}],"
             "\"hash_ids\":[",
          t, (unsigned long long)s->tokens, (unsigned long long)out, tenant,
          session, (unsigned long long)a, (unsigned long long)a,
          (unsigned long long)s->tools, (unsigned long long)b,
          (unsigned long long)s->repo, (unsigned long long)c,
          (unsigned long long)(h - c), (unsigned long long)h,
          (unsigned long long)(s->tokens - h), tool ? "tool_output" : "user");
  uint64_t full = s->tokens / g->bs;
  for (uint64_t i = 0; i < full && i < s->n; i++)
    fprintf(f, "%s%llu", i ? "," : "", (unsigned long long)s->ids[i]);
  fputs("]}\n", f);
  g->emitted++;
}

/* A tenant's shared prefix: ids 1<<62 | tenant<<32 | block, plus a drift
 * epoch folded in the first block. */
static void shared_prefix(sess *s, uint32_t tenant, uint32_t bs,
                          uint64_t epoch) {
  uint64_t n = (s->sys + s->tools) / bs;
  for (uint64_t i = 0; i < n && i < s->n; i++)
    s->ids[i] = (1ull << 62) | (uint64_t)tenant << 32 | i;
  if (n > 0 && s->n > 0 && epoch > 0)
    s->ids[0] = (1ull << 61) | epoch; /* the drifted system prompt */
}

static int run_session(gen *g, double t, uint32_t tenant, const char *name,
                       uint32_t turns, bool sub, uint64_t *epoch) {
  const bh_gen_opts *o = g->o;
  sess s = {0};
  s.sys = o->system_tokens;
  s.tools = o->tools_tokens;
  s.repo = sub ? o->repo_tokens / 4 : o->repo_tokens;
  s.tokens = s.sys + s.tools + s.repo;
  int rc = 0;
  for (uint32_t k = 0; k < turns && rc == 0; k++) {
    bool tool = k > 0 && g_unit(g) < 0.7;
    uint64_t add = g_tokens(g, o->turn_tokens);
    s.prev = s.tokens;
    s.tokens += add;
    /* drawn whether or not drift is on: equal seeds give equal sessions,
     * and the knob changes only the prompts */
    if (g_unit(g) < o->drift)
      *epoch = g->next_id++;
    if ((rc = ids_fill(g, &s, s.tokens / g->bs)) < 0)
      break;
    shared_prefix(&s, tenant, g->bs, *epoch);
    uint64_t out = g_tokens(g, 300);
    emit(g, t, tenant, name, &s, out, tool);
    s.tokens += out; /* the answer joins the history */
    if (!sub && o->subagent_p > 0 && g_unit(g) < o->subagent_p) {
      uint32_t fan = 1 + (uint32_t)(g_next(g) % 3);
      for (uint32_t a = 0; a < fan && rc == 0; a++) {
        char sn[160];
        snprintf(sn, sizeof sn, "%s/agent-%u-%u", name, k, a);
        uint64_t sub_epoch = *epoch;
        rc = run_session(g, t + 0.5 * a, tenant, sn,
                         3 + (uint32_t)(g_next(g) % 6), true, &sub_epoch);
      }
    }
    t += g_exp(g, o->think_s) + (double)out * 0.02; /* decode + think */
  }
  free(s.ids);
  return rc;
}

int bh_gen(const bh_gen_opts *in, FILE *f) {
  bh_gen_opts o = *in;
  if (!o.tenants) o.tenants = 4;
  if (!o.sessions) o.sessions = 64;
  if (!o.turns) o.turns = 20;
  if (!o.block_size) o.block_size = 64;
  if (!o.system_tokens) o.system_tokens = 3000;
  if (!o.tools_tokens) o.tools_tokens = 12000;
  if (!o.repo_tokens) o.repo_tokens = 20000;
  if (!o.turn_tokens) o.turn_tokens = 1500;
  if (o.think_s == 0) o.think_s = 8;
  if (o.session_gap_s == 0) o.session_gap_s = 5;
  if (o.subagent_p == 0) o.subagent_p = 0.05;
  if (o.zipf_s == 0) o.zipf_s = 1.1;
  if (o.block_size > KVP_BLOCK_SIZE_MAX || o.drift < 0 || o.drift > 1)
    return KVP_EINVAL;
  gen g = {.s = o.seed, .next_id = 1, .o = &o, .f = f, .bs = o.block_size};
  double *cdf = malloc(o.tenants * sizeof *cdf), z = 0;
  if (cdf == NULL)
    return KVP_ENOMEM;
  for (uint32_t i = 0; i < o.tenants; i++)
    cdf[i] = (z += pow(i + 1.0, -o.zipf_s));
  fprintf(f, "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":%u}\n",
          o.block_size);
  double t = 0;
  int rc = 0;
  uint64_t *epochs = calloc(o.tenants, sizeof *epochs);
  if (epochs == NULL)
    rc = KVP_ENOMEM;
  for (uint32_t s = 0; s < o.sessions && rc == 0; s++) {
    double u = g_unit(&g) * z;
    uint32_t tenant = 0;
    while (tenant + 1 < o.tenants && cdf[tenant] < u)
      tenant++;
    char name[64];
    snprintf(name, sizeof name, "s%u", s);
    uint32_t turns = 1 + (uint32_t)g_exp(&g, o.turns);
    rc = run_session(&g, t, tenant, name, turns, false, &epochs[tenant]);
    t += g_exp(&g, o.session_gap_s);
  }
  free(cdf);
  free(epochs);
  return rc < 0 ? rc : ferror(f) ? KVP_EIO : 0;
}
