/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: one kvplane-bench trace reader (KVP_FUZZ_FORMAT picks
 * which; one binary per format) on arbitrary bytes, zstd-framed or not.
 * Every failure must explain itself; whatever parses must satisfy the
 * reader's promises (keys inside the key array, full blocks inside the
 * prompt, marks inside the mark array), classify, and -- when small --
 * replay through the simulator with every record accepted by the ledger. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define MAX_INPUT (1u << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > MAX_INPUT)
    return 0;
  bh_src *s;
  if (bh_src_open_mem(data, size, "fuzz", &s) < 0)
    return 0;
  bh_trace t;
  bh_trace_init(&t);
  /* the first byte picks skip or stop, and the shared prefix option */
  bh_read_opts o = {.on_error = size > 0 && (data[0] & 1) ? BH_ERR_STOP
                                                          : BH_ERR_SKIP,
                    .no_shared_prefix = size > 0 && (data[0] & 2),
                    .quiet = true,
                    .max_requests = 4096};
  char err[512] = "";
  int rc = bh_read(s, KVP_FUZZ_FORMAT, &o, &t, err, sizeof err);
  bh_src_close(s);
  if (rc < 0 && (err[0] == '\0' || memchr(err, '\0', sizeof err) == NULL))
    abort();
  if (t.records_bad > 0 && t.first_error[0] == '\0')
    abort();
  uint64_t blocks = 0;
  for (size_t i = 0; i < t.n_reqs; i++) {
    const bh_req *q = &t.reqs[i];
    if (q->key_off + q->n_blocks > t.n_keys ||
        (uint64_t)q->n_blocks * t.block_size > q->in_tokens ||
        (uint64_t)q->mark_off + q->n_marks > t.n_marks)
      abort();
    blocks += q->n_blocks;
  }
  if (rc >= 0 && t.n_reqs > 0 && bh_trace_finish(&t) == 0 && t.n_reqs <= 64 &&
      blocks <= 8192) {
    bh_sim_opts so = {.policy = (int)(size % BH_POLICY_COUNT), .seed = size};
    bh_cluster_defaults(&so.cl);
    so.cl.workers = 2;
    so.cl.hbm_blocks = 8; /* tiny tiers: demotion and eviction paths */
    so.cl.dram_blocks = 8;
    so.cl.nvme_blocks = 8;
    so.drop_events = (data[0] & 4) ? 0.3 : 0;
    bh_result r;
    if (bh_sim_run(&t, &so, &r, err, sizeof err) == 0) {
      if (r.ledger_rejects != 0 || r.requests != t.n_reqs ||
          r.tot.reused_tokens + r.tot.recomputed_tokens != r.tot.prompt_tokens)
        abort();
    }
    bh_result_free(&r);
  }
  bh_trace_free(&t);
  return 0;
}
