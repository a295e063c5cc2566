/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd replica sync messages: msgpack-c encode / decode. */
#include "rd_sync_msg.h"

#include "kvplane/events.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

static void be64(uint8_t *p, uint64_t v) {
  for (int i = 7; i >= 0; i--, v >>= 8)
    p[i] = (uint8_t)v;
}

static uint64_t rd64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = v << 8 | p[i];
  return v;
}

static void pack_str(msgpack_packer *pk, const char *s) {
  size_t n = strlen(s);
  msgpack_pack_str(pk, n);
  msgpack_pack_str_body(pk, s, n);
}

static int pack_keys(msgpack_packer *pk, const kvp_key *k, size_t n) {
  uint8_t *b = malloc(n ? n * 16 : 1);
  if (b == NULL)
    return -1;
  for (size_t i = 0; i < n; i++) {
    be64(b + 16 * i, k[i].hi);
    be64(b + 16 * i + 8, k[i].lo);
  }
  msgpack_pack_bin(pk, n * 16);
  msgpack_pack_bin_body(pk, b, n * 16);
  free(b);
  return 0;
}

int rd_sync_encode(const rd_sync_msg *m, char **out, size_t *len) {
  if (m->n_keys > RD_SYNC_KEYS_MAX || m->n_loads > RD_SYNC_SNAP_MAX)
    return -1;
  msgpack_sbuffer sb;
  msgpack_packer pk;
  msgpack_sbuffer_init(&sb);
  msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
  int rc = 0;
  msgpack_pack_array(&pk, m->type == RD_SYNC_DECISION   ? 9
                          : m->type == RD_SYNC_COMPLETE ? 8
                                                        : 5);
  msgpack_pack_uint32(&pk, RD_SYNC_VERSION);
  msgpack_pack_uint32(&pk, (uint32_t)m->type);
  msgpack_pack_uint32(&pk, m->replica);
  msgpack_pack_uint64(&pk, m->wall_ns);
  if (m->type == RD_SYNC_SNAPSHOT) {
    msgpack_pack_array(&pk, m->n_loads);
    for (size_t i = 0; i < m->n_loads; i++) {
      msgpack_pack_array(&pk, 3);
      pack_str(&pk, m->loads[i].url);
      msgpack_pack_uint64(&pk, m->loads[i].requests);
      msgpack_pack_uint64(&pk, m->loads[i].tokens);
    }
  } else {
    pack_str(&pk, m->url);
    msgpack_pack_uint64(&pk, m->request_id);
    msgpack_pack_uint64(&pk, m->tokens);
    if (m->type == RD_SYNC_DECISION)
      rc = pack_keys(&pk, m->keys, m->n_keys);
    msgpack_pack_uint64(&pk, m->session_id);
  }
  if (rc < 0 || sb.data == NULL) {
    msgpack_sbuffer_destroy(&sb);
    return -1;
  }
  *out = sb.data; /* the sbuffer's malloc'd bytes */
  *len = sb.size;
  return 0;
}

static int get_u64(const msgpack_object *o, uint64_t *v) {
  if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
    return -1;
  *v = o->via.u64;
  return 0;
}

static int get_str(const msgpack_object *o, char *dst, size_t cap) {
  if (o->type != MSGPACK_OBJECT_STR || o->via.str.size == 0 ||
      o->via.str.size >= cap || memchr(o->via.str.ptr, 0, o->via.str.size))
    return -1;
  memcpy(dst, o->via.str.ptr, o->via.str.size);
  dst[o->via.str.size] = '\0';
  return 0;
}

static int get_keys(const msgpack_object *o, rd_sync_msg *m) {
  if (o->type != MSGPACK_OBJECT_BIN || o->via.bin.size % 16 != 0 ||
      o->via.bin.size / 16 > RD_SYNC_KEYS_MAX)
    return -1;
  size_t n = o->via.bin.size / 16;
  const uint8_t *p = (const uint8_t *)o->via.bin.ptr;
  m->keys = malloc(n ? n * sizeof *m->keys : 1);
  if (m->keys == NULL)
    return -1;
  for (size_t i = 0; i < n; i++)
    m->keys[i] = (kvp_key){rd64(p + 16 * i), rd64(p + 16 * i + 8)};
  m->n_keys = n;
  return 0;
}

static int get_loads(const msgpack_object *o, rd_sync_msg *m) {
  if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size > RD_SYNC_SNAP_MAX)
    return -1;
  size_t n = o->via.array.size;
  m->loads = calloc(n ? n : 1, sizeof *m->loads);
  if (m->loads == NULL)
    return -1;
  m->n_loads = n;
  for (size_t i = 0; i < n; i++) {
    const msgpack_object *e = &o->via.array.ptr[i];
    if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size != 3 ||
        get_str(&e->via.array.ptr[0], m->loads[i].url, RD_SYNC_URL_MAX) < 0 ||
        get_u64(&e->via.array.ptr[1], &m->loads[i].requests) < 0 ||
        get_u64(&e->via.array.ptr[2], &m->loads[i].tokens) < 0)
      return -1;
  }
  return 0;
}

static int decode_obj(const msgpack_object *o, rd_sync_msg *m) {
  uint64_t ver, type, rep;
  if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size < 4)
    return -1;
  const msgpack_object *a = o->via.array.ptr;
  size_t n = o->via.array.size;
  if (get_u64(&a[0], &ver) < 0 || get_u64(&a[1], &type) < 0 ||
      get_u64(&a[2], &rep) < 0 || rep > UINT32_MAX ||
      get_u64(&a[3], &m->wall_ns) < 0)
    return -1;
  if (ver != RD_SYNC_VERSION || type < 1 || type > 3)
    return ver > RD_SYNC_VERSION || type > 3 ? 1 : -1;
  m->type = (rd_sync_type)type;
  m->replica = (uint32_t)rep;
  if (m->type == RD_SYNC_SNAPSHOT)
    return n == 5 ? get_loads(&a[4], m) : -1;
  /* a completion's session came later in version 1: 7 fields without */
  if ((m->type == RD_SYNC_DECISION ? n != 9u : n != 7u && n != 8u) ||
      get_str(&a[4], m->url, sizeof m->url) < 0 ||
      get_u64(&a[5], &m->request_id) < 0 || get_u64(&a[6], &m->tokens) < 0)
    return -1;
  if (m->type != RD_SYNC_DECISION)
    return n == 8u ? get_u64(&a[7], &m->session_id) : 0;
  return get_u64(&a[8], &m->session_id) < 0 ? -1 : get_keys(&a[7], m);
}

int rd_sync_decode(const void *data, size_t len, rd_sync_msg *m) {
  memset(m, 0, sizeof *m);
  msgpack_unpacked u;
  msgpack_unpacked_init(&u);
  size_t off = 0;
  int rc = -1;
  if (len <= ((size_t)RD_SYNC_KEYS_MAX * 16 + 65536 + (size_t)RD_SYNC_SNAP_MAX * 300) &&
      kvp_msgpack_check(data, len) == 0 &&
      msgpack_unpack_next(&u, data, len, &off) == MSGPACK_UNPACK_SUCCESS &&
      off == len)
    rc = decode_obj(&u.data, m);
  msgpack_unpacked_destroy(&u);
  if (rc != 0)
    rd_sync_msg_free(m);
  return rc;
}

void rd_sync_msg_free(rd_sync_msg *m) {
  free(m->keys);
  free(m->loads);
  m->keys = NULL;
  m->loads = NULL;
  m->n_keys = m->n_loads = 0;
}
