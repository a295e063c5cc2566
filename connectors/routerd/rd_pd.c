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
