/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd P/D (docs/routerd.md#pd): worker roles, the decode leg's
 * matches (the prefix priced as a transfer from the prefill worker) and the
 * P/D counters.  The two legs themselves run in rd_proxy.c; their bodies
 * and the prefill worker's answer are rd_pd_msg.c's. */
#include "rd.h"

#include <event2/buffer.h>
#include <string.h>

static const char *const role_names[] = {"both", "prefill", "decode"};

int rd_role_parse(const char *name, rd_role *out) {
  for (int i = 0; i < 3; i++)
    if (strcmp(name, role_names[i]) == 0) {
      *out = (rd_role)i;
      return 0;
    }
  return -1;
}

const char *rd_role_name(rd_role r) {
  return (unsigned)r < 3 ? role_names[r] : "unknown";
}

void rd_pd_set_role(rd_worker *w, rd_role r) {
  rd_lock(w->s);
  w->role = r;
  rd_unlock(w->s);
}

bool rd_role_serves(const rd_worker *w, rd_role leg) {
  return leg == RD_ROLE_BOTH || w->role == RD_ROLE_BOTH || w->role == leg;
}

static kvp_worker_match *match_of(kvp_worker_match *wm, size_t *nm,
                                  uint32_t id) {
  for (size_t i = 0; i < *nm; i++)
    if (wm[i].worker == id)
      return &wm[i];
  kvp_worker_match *m = &wm[(*nm)++];
  memset(m, 0, sizeof *m);
  m->worker = id;
  return m;
}

size_t rd_pd_decode_matches(rd_server *s, kvp_worker_match *wm, size_t nm,
                            uint64_t n_pull) {
  for (uint32_t id = 0; id < s->n_w; id++) {
    const rd_worker *w = &s->w[id];
    if (!rd_worker_routable(w) || !rd_role_serves(w, RD_ROLE_DECODE))
      continue;
    kvp_worker_match *m = match_of(wm, &nm, id);
    uint64_t own = 0;
    for (int t = 0; t < KVP_TIER_COUNT_; t++)
      own += m->blocks[t];
    if (own < n_pull) /* the rest crosses the link */
      m->blocks[KVP_TIER_REMOTE] += (uint32_t)(n_pull - own);
  }
  return nm;
}

static uint64_t own_blocks(const kvp_worker_match *wm, size_t nm,
                           uint32_t id) {
  uint64_t own = 0;
  for (size_t i = 0; i < nm; i++)
    for (int t = 0; wm[i].worker == id && t < KVP_TIER_COUNT_; t++)
      own += t == KVP_TIER_REMOTE ? 0 : wm[i].blocks[t];
  return own;
}

/* Seconds the decode leg on w costs beyond the others: the transfer of
 * the blocks it lacks, and the decode-batch KV it would read each step. */
static double decode_cost(rd_server *s, const rd_worker *w, uint64_t lack,
                          uint64_t prompt, uint32_t out_tokens) {
  const kvp_router_opts *o = &s->cfg.ropts;
  double kvb = kvp_model_kv_bytes_per_token(&o->model);
  double link = kvp_router_bandwidth(s->router, KVP_TIER_REMOTE);
  double hbm = kvp_router_bandwidth(s->router, KVP_TIER_HBM);
  double lat = o->gpu.latency_s[KVP_TIER_REMOTE] > 0
                   ? o->gpu.latency_s[KVP_TIER_REMOTE] : 50e-6;
  double xfer = lack ? lat + (double)lack * o->block_size * kvb / link : 0;
  double step = hbm > 0 ? (double)(w->pd_decode_tokens + prompt) * kvb / hbm
                        : 0;
  return xfer + (double)out_tokens * step;
}

/* The decode leg's KV (prompt + output) fits in what w has free: its
 * capacity (vLLM's cache_config_info, scraped) less the larger of its
 * scraped use and the decode legs this router has in flight there.  A
 * worker that cannot hold it would preempt (vLLM recomputes a preempted
 * request).  Capacity not known: it fits. */
static bool kv_fits(const rd_worker *w, uint64_t need) {
  if (w->kv_cap_tokens == 0)
    return true;
  double cap = (double)w->kv_cap_tokens, used = w->load.kv_util * cap;
  if ((double)w->pd_decode_tokens > used)
    used = (double)w->pd_decode_tokens;
  return used + (double)need <= cap;
}

/* Routable decode workers; with room for the leg's KV when any has it
 * (else all: the least bad by cost, counted). */
static bool decode_candidate(const rd_worker *w, uint64_t need, bool room) {
  return rd_worker_routable(w) && rd_role_serves(w, RD_ROLE_DECODE) &&
         (!room || kv_fits(w, need));
}

uint32_t rd_pd_decode_eligible(rd_server *s, const kvp_worker_match *wm,
                               size_t nm, uint64_t n_pull, uint64_t prompt,
                               uint32_t out_tokens, uint64_t *elig) {
  double cost[RD_WORKERS_MAX], best = -1;
  uint64_t need = prompt + out_tokens;
  bool room = false;
  for (uint32_t id = 0; id < s->n_w && !room; id++)
    room = decode_candidate(&s->w[id], need, true);
  if (!room)
    atomic_fetch_add_explicit(&s->pd.decode_kv_full, 1, memory_order_relaxed);
  for (uint32_t id = 0; id < s->n_w; id++) {
    const rd_worker *w = &s->w[id];
    cost[id] = -1;
    if (!decode_candidate(w, need, room))
      continue;
    uint64_t own = own_blocks(wm, nm, id);
    cost[id] = decode_cost(s, w, own < n_pull ? n_pull - own : 0, prompt,
                           out_tokens);
    if (best < 0 || cost[id] < best)
      best = cost[id];
  }
  uint32_t n = 0;
  memset(elig, 0, ((s->n_w + 63) / 64) * sizeof *elig);
  for (uint32_t id = 0; id < s->n_w; id++)
    if (cost[id] >= 0 && cost[id] <= best * 1.05 + 1e-4) {
      elig[id / 64] |= 1ull << (id % 64);
      n++;
    }
  return n;
}

#define LOAD(f) atomic_load_explicit(&s->pd.f, memory_order_relaxed)

static void counter(struct evbuffer *b, const char *name, const char *help,
                    uint64_t v) {
  evbuffer_add_printf(b, "# HELP kvplane_routerd_pd_%s %s\n# TYPE "
                      "kvplane_routerd_pd_%s counter\nkvplane_routerd_pd_%s "
                      "%llu\n", name, help, name, name, (unsigned long long)v);
}

void rd_pd_metrics(rd_server *s, struct evbuffer *b) {
  counter(b, "calls_total", "requests served as a prefill leg then a "
          "decode leg", LOAD(calls));
  counter(b, "prefill_ok_total", "prefill legs answered with usable "
          "kv_transfer_params", LOAD(prefill_ok));
  counter(b, "prefill_retries_total", "prefill legs tried again on another "
          "prefill worker", LOAD(prefill_retries));
  counter(b, "decode_retries_total", "decode legs tried again on another "
          "decode worker", LOAD(decode_retries));
  counter(b, "bad_params_total", "prefill answers whose kv_transfer_params "
          "were refused (missing, malformed)", LOAD(bad_params));
  counter(b, "prefill_refused_total", "prefill legs the worker refused (4xx, "
          "or 5xx with no retry left): the client got its answer",
          LOAD(prefill_refused));
  counter(b, "transfer_predicted_tokens_total", "prompt tokens the decode "
          "choice predicted to cross the link", LOAD(pred_transfer_tokens));
  counter(b, "transfer_predicted_bytes_total", "KV bytes the decode choice "
          "predicted to cross the link", LOAD(pred_transfer_bytes));
  counter(b, "transfer_offered_blocks_total", "blocks the prefill workers "
          "offered (remote_block_ids)", LOAD(offered_blocks));
  counter(b, "decode_local_tokens_total", "prompt tokens the chosen decode "
          "worker held already (no transfer)", LOAD(decode_local_tokens));
  counter(b, "decode_kv_full_total", "decode legs no decode worker had free "
          "KV for (capacity from cache_config_info): chosen by cost alone",
          LOAD(decode_kv_full));
  evbuffer_add_printf(b, "# HELP kvplane_routerd_worker_role its P/D role\n"
                      "# TYPE kvplane_routerd_worker_role gauge\n");
  rd_lock(s);
  for (uint32_t i = 0; i < s->n_w; i++)
    if (s->w[i].state != RD_W_FREE && !s->w[i].index_only)
      evbuffer_add_printf(b, "kvplane_routerd_worker_role{worker=\"%s\","
                          "role=\"%s\"} 1\n", s->w[i].url,
                          rd_role_name(s->w[i].role));
  rd_unlock(s);
}
