/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd P/D (prefill/decode disaggregation, docs/routerd.md#pd):
 * the bodies of vLLM's two-step flow and the prefill worker's answer.
 * Pure functions over untrusted bytes (tests/fuzz/fuzz_routerd_pd.c):
 *
 *   prefill leg  the client's body, max_tokens (and max_completion_tokens
 *                where given) 1, stream false, stream_options, min_tokens
 *                and min_completion_tokens dropped, kv_transfer_params
 *                {do_remote_decode: true, do_remote_prefill: false,
 *                remote_*: null} -- what vLLM's toy_proxy_server.py sends;
 *   its answer   a JSON object whose kv_transfer_params the NIXL
 *                connector's request_finished wrote: do_remote_prefill
 *                true, remote_engine_id, remote_host, remote_port,
 *                remote_block_ids (flat, or one list per KV cache group);
 *   decode leg   the client's body with those kv_transfer_params, as given
 *                (keys the router does not read pass through).
 *
 * The legs' bodies keep the client's bytes but for the members named: those
 * are dropped and the new ones appended (a prompt of token ids is copied,
 * never re-encoded).  A key the client spelled with escapes is overridden
 * by the appended member: JSON readers keep the last. */
#ifndef KVP_ROUTERD_PD_MSG_H
#define KVP_ROUTERD_PD_MSG_H

#include <stddef.h>
#include <stdint.h>

#define RD_PD_BLOCKS_MAX (1u << 20) /* remote_block_ids' length */
#define RD_PD_ID_MAX 256            /* remote_engine_id, remote_host */

typedef struct rd_pd_params {
  char engine_id[RD_PD_ID_MAX], host[RD_PD_ID_MAX];
  uint32_t port;
  uint32_t n_blocks; /* remote_block_ids (the first group's, when grouped) */
  uint32_t n_groups; /* 0: a flat list */
} rd_pd_params;

/* The prefill leg's body from the client's (a JSON object: the caller
 * parsed it; any bytes are safe).  Returns 0 with *out malloc'd
 * (NUL-terminated, *out_len bytes) or -1 with err. */
int rd_pd_prefill_body(const char *body, size_t len, char **out,
                       size_t *out_len, char *err, size_t cap);
/* The client's max_completion_tokens, else max_tokens (top-level, a
 * non-negative integer as written); 0 when neither is (the body: a JSON
 * object; any bytes are safe). */
uint32_t rd_pd_max_tokens(const char *body, size_t len);
/* The prefill worker's 200 answer reply[0..len): its kv_transfer_params
 * checked into *p and, as given, into *params (malloc'd compact JSON).
 * Returns 0, or -1 with err saying what is wrong (no parameters, not a
 * prefill's, a field missing or of the wrong type, too many blocks). */
int rd_pd_take_params(const char *reply, size_t len, rd_pd_params *p,
                      char **params, char *err, size_t cap);
/* The decode leg's body: the client's with kv_transfer_params = params (a
 * JSON object's text, rd_pd_take_params').  0 or -1 with err. */
int rd_pd_decode_body(const char *body, size_t len, const char *params,
                      char **out, size_t *out_len, char *err, size_t cap);

#endif
