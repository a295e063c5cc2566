/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd replica sync messages (docs/routerd.md#replicas): what a
 * replica alone knows, on NATS for its peers.  msgpack arrays, versioned:
 *   [1, 1 decision, replica, wall_ns, worker_url, request_id, tokens, keys,
 *    session_id (0 = none)]
 *   [1, 2 complete, replica, wall_ns, worker_url, request_id, tokens,
 *    session_id (0 = none; absent in the first builds of version 1)]
 *   [1, 3 snapshot, replica, wall_ns, [[worker_url, requests, tokens]...]]
 * keys: bin of 16-byte block keys (hi, lo big-endian), approximate
 * residency the decision creates (text mode / workers without events; may
 * be empty).  A newer version or unknown type is skipped (counted), a
 * malformed message rejected.  Pure functions over untrusted bytes
 * (tests/fuzz/fuzz_routerd_sync.c). */
#ifndef KVP_ROUTERD_SYNC_MSG_H
#define KVP_ROUTERD_SYNC_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "kvplane/common.h"

#define RD_SYNC_VERSION 1
#define RD_SYNC_URL_MAX 256
#define RD_SYNC_KEYS_MAX 65536 /* per decision (1M tokens at 16) */
#define RD_SYNC_SNAP_MAX 4096  /* workers per snapshot */

typedef enum rd_sync_type {
  RD_SYNC_DECISION = 1,
  RD_SYNC_COMPLETE = 2,
  RD_SYNC_SNAPSHOT = 3
} rd_sync_type;

typedef struct rd_sync_load {
  char url[RD_SYNC_URL_MAX];
  uint64_t requests, tokens;
} rd_sync_load;

typedef struct rd_sync_msg {
  rd_sync_type type;
  uint32_t replica;
  uint64_t wall_ns;
  char url[RD_SYNC_URL_MAX];  /* decision / complete */
  uint64_t request_id, tokens;
  uint64_t session_id;        /* decision, complete: kvp_id64 of the session, 0 = none */
  kvp_key *keys;              /* decision: malloc'd, n_keys */
  size_t n_keys;
  rd_sync_load *loads;        /* snapshot: malloc'd, n_loads */
  size_t n_loads;
} rd_sync_msg;

/* Encodes m into a malloc'd buffer (*out, *len).  0 or -1 (ENOMEM, too
 * many keys/loads). */
int rd_sync_encode(const rd_sync_msg *m, char **out, size_t *len);
/* Decodes.  0: m filled (rd_sync_msg_free); 1: a well-formed message of a
 * newer version or unknown type (skip it); -1: malformed.  Never reads past
 * len. */
int rd_sync_decode(const void *data, size_t len, rd_sync_msg *m);
void rd_sync_msg_free(rd_sync_msg *m);

#endif
