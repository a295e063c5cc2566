/* SPDX-License-Identifier: Apache-2.0 */
/* Error strings and names generated from KVP_ERRNO_MAP, plus -errno. */
#include <errno.h>
#include <string.h>

#include "kvplane/common.h"

const char *kvp_strerror(int err) {
  switch (err) {
#define KVP_ERR_STR_(name, code, msg)                                           \
  case code:                                                                    \
    return msg;
    KVP_ERRNO_MAP(KVP_ERR_STR_)
#undef KVP_ERR_STR_
  case 0:
    return "success";
  default:
    break;
  }
  /* strerror() is not thread-safe in general; glibc's strerrordesc_np is
   * and returns static storage. */
  if (err < 0 && err > -4000) {
    const char *s = strerrordesc_np(-err);
    if (s != NULL)
      return s;
  }
  return "unknown error";
}

const char *kvp_err_name(int err) {
  switch (err) {
#define KVP_ERR_NAME_(name, code, msg)                                          \
  case code:                                                                    \
    return "KVP_" #name;
    KVP_ERRNO_MAP(KVP_ERR_NAME_)
#undef KVP_ERR_NAME_
  case 0:
    return "OK";
  default:
    break;
  }
  if (err < 0 && err > -4000) {
    const char *s = strerrorname_np(-err);
    if (s != NULL)
      return s;
  }
  return "UNKNOWN";
}
