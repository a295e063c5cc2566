/* SPDX-License-Identifier: Apache-2.0 */
/* The shared vocabulary's names, generated from KVP_TIER_MAP and
 * KVP_CLASS_MAP (kvplane/common.h), and kvp_id64. */
#include <string.h>

#include "kvplane/common.h"

#define NAME_(id, v, name, label) [v] = name,
#define LABEL_(id, v, name, label) [v] = label,
static const char *const tier_names[KVP_TIER_COUNT_] = {KVP_TIER_MAP(NAME_)};
static const char *const tier_labels[KVP_TIER_COUNT_] = {KVP_TIER_MAP(LABEL_)};
static const char *const class_names[KVP_CLASS_COUNT_] = {KVP_CLASS_MAP(NAME_)};
#undef NAME_
#undef LABEL_

/* Every row of a map has a name: a row past COUNT_ would not compile (array
 * bounds), a missing one would leave a NULL. */
#define ONE_(id, v, name, label) +1
_Static_assert(0 KVP_TIER_MAP(ONE_) == KVP_TIER_COUNT_, "KVP_TIER_MAP rows");
_Static_assert(0 KVP_CLASS_MAP(ONE_) == KVP_CLASS_COUNT_, "KVP_CLASS_MAP rows");
#undef ONE_

const char *kvp_tier_name(kvp_tier t) {
  return (unsigned)t < KVP_TIER_COUNT_ ? tier_names[t] : "unknown";
}

const char *kvp_tier_label(kvp_tier t) {
  return (unsigned)t < KVP_TIER_COUNT_ ? tier_labels[t] : "unknown";
}

const char *kvp_class_name(kvp_class c) {
  if ((unsigned)c < KVP_CLASS_COUNT_)
    return class_names[c];
  return c == KVP_CLASS_AUTO ? "auto" : "unknown";
}

static int parse(const char *s, const char *const *names, int n) {
  for (int i = 0; s != NULL && i < n; i++)
    if (strcmp(s, names[i]) == 0)
      return i;
  return -1;
}

int kvp_tier_parse(const char *s, kvp_tier *out) {
  int i = parse(s, tier_names, KVP_TIER_COUNT_);
  if (i < 0 || out == NULL)
    return KVP_EINVAL;
  *out = (kvp_tier)i;
  return 0;
}

int kvp_class_parse(const char *s, kvp_class *out) {
  int i = parse(s, class_names, KVP_CLASS_COUNT_);
  if (i < 0 || out == NULL)
    return KVP_EINVAL;
  *out = (kvp_class)i;
  return 0;
}

uint64_t kvp_id64(const char *s) {
  if (s == NULL || *s == '\0')
    return 0;
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    h = (h ^ *p) * 0x100000001b3ull;
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64 finaliser */
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  h ^= h >> 31;
  return h != 0 ? h : 1;
}
