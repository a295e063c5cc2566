/* SPDX-License-Identifier: Apache-2.0 */
/* The on-disk slot header (format in tier_internal.h), size classes and the
 * recovery scan over a slab image.  Pure functions: the fuzz target drives
 * them directly. */
#include <string.h>
#include <xxhash.h>

#include "core_internal.h"
#include "kvtier_internal.h"

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

void kvp__tier_hdr_encode(const tier_slot_hdr *h, uint8_t out[TIER_HDR_BYTES]) {
  memset(out, 0, TIER_HDR_BYTES);
  put32(out + 0, TIER_HDR_MAGIC);
  put16(out + 4, TIER_HDR_VERSION);
  put16(out + 6, h->flags);
  put32(out + 8, TIER_HDR_BYTES);
  put64(out + 16, h->ns.hi);
  put64(out + 24, h->ns.lo);
  put64(out + 32, h->key.hi);
  put64(out + 40, h->key.lo);
  put64(out + 48, h->len);
  put64(out + 56, h->epoch);
  memcpy(out + 64, h->iv, 12);
  memcpy(out + 80, h->tag, 16);
  put64(out + 96, h->payload_sum);
  put64(out + 120, XXH3_64bits(out, 120));
}

static bool all_zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != 0)
      return false;
  return true;
}

int kvp__tier_hdr_decode(const uint8_t *b, size_t n, tier_slot_hdr *h) {
  if (n < TIER_HDR_BYTES)
    return KVP_ETRUNC;
  if (get32(b) != TIER_HDR_MAGIC || get16(b + 4) != TIER_HDR_VERSION ||
      get32(b + 8) != TIER_HDR_BYTES || get32(b + 12) != 0 ||
      get32(b + 76) != 0 || !all_zero(b + 104, 16))
    return KVP_ECORRUPT;
  if (get64(b + 120) != XXH3_64bits(b, 120))
    return KVP_ECORRUPT;
  uint16_t flags = get16(b + 6);
  if ((flags & ~TIER_HDR_F_AESGCM) != 0)
    return KVP_ECORRUPT;
  h->flags = flags;
  h->ns = (kvp_key){get64(b + 16), get64(b + 24)};
  h->key = (kvp_key){get64(b + 32), get64(b + 40)};
  h->len = get64(b + 48);
  h->epoch = get64(b + 56);
  memcpy(h->iv, b + 64, 12);
  memcpy(h->tag, b + 80, 16);
  h->payload_sum = get64(b + 96);
  if (h->len == 0 || h->len > (UINT64_C(1) << 40))
    return KVP_ECORRUPT;
  return 0;
}

uint64_t kvp__tier_payload_sum(const void *p, size_t n) {
  return XXH3_64bits(p, n);
}

uint64_t kvp__tier_class_bytes(uint64_t len) {
  if (len <= 16384)
    return (len + 4095) & ~UINT64_C(4095);
  int top = 63 - __builtin_clzll(len - 1); /* 2^top < len <= 2^(top+1) */
  uint64_t step = UINT64_C(1) << (top - 2);  /* four classes per doubling */
  return (len + step - 1) & ~(step - 1);
}

uint64_t kvp__tier_scan_image(const uint8_t *img, size_t n, uint64_t slot_bytes,
                              tier_scan_fn fn, void *arg) {
  if (img == NULL || slot_bytes < TIER_HDR_BYTES)
    return 0;
  uint64_t slots = n / slot_bytes, i;
  for (i = 0; i < slots; i++) {
    tier_slot_hdr h;
    if (kvp__tier_hdr_decode(img + i * slot_bytes, TIER_HDR_BYTES, &h) == 0 &&
        h.len <= slot_bytes - TIER_HDR_BYTES)
      fn(arg, i, &h);
  }
  return i;
}
