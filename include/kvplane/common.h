/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane common: export macro, version, the error table, allocator hooks.
 * Every other public header includes this one; it compiles alone as C11 and C++. */
#ifndef KVPLANE_COMMON_H
#define KVPLANE_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "kvplane/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVP_API __attribute__((visibility("default")))
#else
#define KVP_API
#endif

/* Error table: one row per library error, codes below -4000 so they never
 * collide with -errno.  Generates the enum, kvp_strerror() and kvp_err_name()
 * (libuv UV_ERRNO_MAP).  OS errors are returned as -errno and are understood by
 * kvp_strerror() too. */
#define KVP_ERRNO_MAP(X)                                                        \
  X(EINVAL,   -4001, "invalid argument")                                        \
  X(ENOMEM,   -4002, "out of memory")                                           \
  X(ERANGE,   -4003, "value out of range")                                      \
  X(ECORRUPT, -4004, "corrupt or malformed data")                               \
  X(ENOTSUP,  -4005, "operation not supported by this build or backend")        \
  X(ENOENT,   -4006, "no such entry")                                           \
  X(EEXIST,   -4007, "entry already exists")                                    \
  X(EBUSY,    -4008, "resource busy")                                           \
  X(EIO,      -4009, "input/output error")                                      \
  X(EGPU,     -4010, "GPU backend error (see the backend's native code)")       \
  X(ETRUNC,   -4011, "input ended early")                                       \
  X(ENOSPC,   -4012, "no space left in buffer or tier")                         \
  X(ESTATE,   -4013, "object is in the wrong state for this call")

typedef enum kvp_errno {
#define KVP_ERR_ENUM_(name, code, msg) KVP_##name = (code),
  KVP_ERRNO_MAP(KVP_ERR_ENUM_)
#undef KVP_ERR_ENUM_
  KVP_ERRNO_MIN_ = -4014
} kvp_errno;

/* Human-readable text for a kvplane return code (library code or -errno).
 * Never returns NULL; unknown codes get a generic string.  Thread-safe. */
KVP_API const char *kvp_strerror(int err);
/* Symbolic name: "KVP_EINVAL", "ENOENT", ... ; "UNKNOWN" for unknown codes. */
KVP_API const char *kvp_err_name(int err);

/* Allocator hooks.  Every allocating constructor takes `const kvp_allocator *`
 * (NULL = libc malloc/free).  The struct is copied; `opaque` must outlive every
 * object created with it.  alloc must return memory aligned to
 * max_align_t or NULL. */
typedef struct kvp_allocator {
  void *(*alloc)(void *opaque, size_t size);
  void (*free)(void *opaque, void *ptr, size_t size);
  void *opaque;
} kvp_allocator;

/* "0.1.0" (the library actually loaded, which may differ from KVP_VERSION_STR
 * the caller compiled against). */
KVP_API const char *kvp_version(void);
/* KVP_VERSION_NUM of the loaded library. */
KVP_API uint32_t kvp_version_number(void);

/* A 128-bit block key.  For vLLM-compatible algorithms `lo` is the 64-bit
 * external form vLLM publishes in KV events (last 8 digest bytes, big-endian)
 * and `hi` the 8 bytes before it.  Indexes may keep only `lo`; anything that
 * returns KV bytes compares the whole key. */
typedef struct kvp_key {
  uint64_t hi;
  uint64_t lo;
} kvp_key;

static inline int kvp_key_eq(kvp_key a, kvp_key b) {
  return a.hi == b.hi && a.lo == b.lo;
}

/* Shared vocabulary: one row per value generates the enum and the name
 * functions below (as KVP_ERRNO_MAP does), so every module, export and
 * report spells a value the same way.  Columns: enumerator suffix, value,
 * name (lower-case: metric labels, JSON keys, config), label (prose). */

/* Where a block's KV lives on a worker, fastest first.  Shared by the index
 * (router), the tier manager (kvtier), the ledger (core) and the harness. */
#define KVP_TIER_MAP(X)                                                         \
  X(HBM,    0, "hbm",    "HBM")                                                 \
  X(DRAM,   1, "dram",   "DRAM")                                                \
  X(NVME,   2, "nvme",   "NVMe")                                                \
  X(REMOTE, 3, "remote", "remote")

typedef enum kvp_tier {
#define KVP_TIER_ENUM_(id, v, name, label) KVP_TIER_##id = (v),
  KVP_TIER_MAP(KVP_TIER_ENUM_)
#undef KVP_TIER_ENUM_
  KVP_TIER_COUNT_ = 4
} kvp_tier;

/* Segment class of a block, ordered from least to most reusable so that
 * min() composes along a chain (router/prefix learns it; the ledger and the
 * tier manager account and retain by it). */
#define KVP_CLASS_MAP(X)                                                        \
  X(VOLATILE, 0, "volatile", "volatile")                                        \
  X(SEMI,     1, "semi",     "semi-stable")                                     \
  X(STABLE,   2, "stable",   "stable")

typedef enum kvp_class {
#define KVP_CLASS_ENUM_(id, v, name, label) KVP_CLASS_##id = (v),
  KVP_CLASS_MAP(KVP_CLASS_ENUM_)
#undef KVP_CLASS_ENUM_
  KVP_CLASS_COUNT_ = 3,
  KVP_CLASS_AUTO = 255 /* segment mark hint: use the role's default */
} kvp_class;

/* "hbm", "dram", "nvme", "remote"; "unknown" (never NULL) for other values.
 * Thread-safe, static storage (as every name function here). */
KVP_API const char *kvp_tier_name(kvp_tier t);
/* "HBM", "DRAM", "NVMe", "remote" (receipts' reason text); "unknown". */
KVP_API const char *kvp_tier_label(kvp_tier t);
/* "volatile", "semi", "stable", "auto" (KVP_CLASS_AUTO); "unknown" (never
 * NULL) for other values. */
KVP_API const char *kvp_class_name(kvp_class c);
/* Parse the names kvp_tier_name / kvp_class_name give (exact; "auto" is not
 * a class here).  Return 0 or KVP_EINVAL (NULL, unknown; *out untouched). */
KVP_API int kvp_tier_parse(const char *s, kvp_tier *out);
KVP_API int kvp_class_parse(const char *s, kvp_class *out);

/* A stable 64-bit id for a caller's string id (tenant, session, request):
 * the router takes uint64 ids, the ledger and receipts the strings; hash the
 * string with this to get the router's id, so the two always agree.
 * FNV-1a 64 over the bytes, then the splitmix64 finaliser; fixed forever
 * (ids persist in logs and other processes).  NULL or "" -> 0 ("none"); a
 * non-empty string never maps to 0 (1 stands in).  Thread-safe. */
KVP_API uint64_t kvp_id64(const char *s);

/* Workers are numbered 0 .. KVP_WORKERS_MAX-1. */
#define KVP_WORKERS_MAX 4096u

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_COMMON_H */
