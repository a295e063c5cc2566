/* SPDX-License-Identifier: Apache-2.0 */
/* Built against the INSTALLED headers and library, as C11 and as C++. */
#include <kvplane.h>
#include <stdio.h>
#include <string.h>

#if !KVP_VERSION_AT_LEAST(0, 1, 0)
#error "version macros missing"
#endif

int main(void) {
  kvp_namespace_desc d;
  memset(&d, 0, sizeof d);
  d.model_id = "m";
  d.block_size = 16;
  kvp_namespace ns;
  kvp_hasher *h = NULL;
  if (kvp_namespace_init(&d, &ns) != 0 || kvp_hasher_create(&ns, NULL, NULL, &h) != 0)
    return 1;
  uint32_t toks[32];
  for (unsigned i = 0; i < 32; i++)
    toks[i] = i;
  kvp_key keys[2];
  size_t tail = 99;
  int n = kvp_hasher_hash(h, toks, 32, NULL, keys, 2, &tail);
  kvp_hasher_destroy(h);
  if (n != 2 || tail != 0 || strcmp(kvp_version(), KVP_VERSION_STR) != 0)
    return 1;
  printf("consumer ok: kvplane %s\n", kvp_version());
  return 0;
}
