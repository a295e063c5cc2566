/* SPDX-License-Identifier: Apache-2.0 */
/* bh_api_parse with a fast path for /v1/completions bodies whose prompt is
 * a flat array of token ids (harness_api_ids.c): the same results as
 * bh_api_parse for every body, errors included, without a JSON value per
 * id (the emulated workers' cost per request at 10-20x time scale). */
#ifndef KVP_BENCH_HARNESS_API_IDS_H
#define KVP_BENCH_HARNESS_API_IDS_H

#include "harness_api.h"

int bh_api_parse_fast(const bh_api_cfg *cfg, bh_api_kind kind,
                      const char *body, size_t len, bh_api_req *out,
                      bh_api_err *err);

#endif /* KVP_BENCH_HARNESS_API_IDS_H */
