/* SPDX-License-Identifier: Apache-2.0 */
/* core internals shared with the modules docs/architecture.md lets use core
 * (router, kvtier, kernels; connectors are clients of the public API and do
 * not): the one allocation helper, logging macros, small checks, the config
 * bindings' error message.  Not installed. */
#ifndef KVP_CORE_INTERNAL_H
#define KVP_CORE_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane/common.h"
#include "kvplane/core.h"
#include "kvplane/ledger.h"
#include "kvplane/text.h"

/* Resolve a caller's allocator (NULL -> libc) into a value to keep. */
kvp_allocator kvp__allocator(const kvp_allocator *a);
/* All allocation in kvplane goes through these (zstd allocations.h). */
void *kvp__malloc(const kvp_allocator *a, size_t size);
void *kvp__calloc(const kvp_allocator *a, size_t n, size_t size);
void kvp__free(const kvp_allocator *a, void *p, size_t size);
/* realloc on top of alloc/free: copies min(old,new) bytes (malloc's own
 * realloc when a has no hooks: it may grow in place). NULL on failure
 * (the old block is then untouched). */
void *kvp__realloc(const kvp_allocator *a, void *p, size_t old_size,
                   size_t new_size);

/* Big arrays read at random, in 2 MiB pages.  For libc's memory only:
 * allocate kvp__huge_size(bytes) with libc's malloc -- 0 when bytes is under
 * 2 MiB (or too big): allocate as usual then -- and pass the block to
 * kvp__huge_place, which returns where the bytes start (a 2 MiB boundary
 * inside the block), zeroed.  The whole 2 MiB pages they lie in ask for
 * transparent huge pages.  Each one all in memory already (malloc hands back
 * memory it faulted in before) is cleared in place: dropping it only to
 * fault it in again was most of a batch simulation's kernel time
 * (docs/performance.md, "Tried").  The others are dropped
 * (MADV_DONTNEED: they read as zero and fault in, huge where the kernel
 * can, when first touched).  Where madvise is refused the bytes are zeroed
 * by hand.  Meant to spare random reads TLB misses (under a hypervisor each
 * walks two page tables); on the dev VM no end-to-end gain survived a
 * balanced A/B for these arrays alone (docs/methodology.md, "A/B order bias").
 * Free the block, not the pointer returned.
 * kvp__huge_calloc does both (calloc under 2 MiB); *block is what to free. */
size_t kvp__huge_size(size_t bytes);
void *kvp__huge_place(void *block, size_t bytes);
void *kvp__huge_calloc(size_t n, size_t size, void **block);
/* Whether a (resolved by kvp__allocator) is libc's own. */
bool kvp__allocator_libc(const kvp_allocator *a);

/* n * size without overflow; false on overflow. */
static inline bool kvp__mul_ok(size_t n, size_t size, size_t *out) {
  return !__builtin_mul_overflow(n, size, out);
}

/* Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF); len bytes. */
bool kvp__utf8_valid(const char *s, size_t len);

/* A config binding's error, as every module that binds a section writes it:
 * "FILE:LINE: SEC.KEY: " (or "FILE:LINE: SEC: " when key is NULL) and the
 * message, into err (cap bytes, cut to fit; nothing when cap is 0).  LINE
 * as kvp_config_key_line gives it.  Returns KVP_EINVAL. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 7, 0)))
#endif
int kvp__config_verr(char *err, size_t cap, const char *file, int line,
                     const char *sec, const char *key, const char *fmt,
                     va_list ap);

/* The ledger's receipt JSON object for a record that passes
 * kvp_ledger_check, without its closing brace, so that the router's receipts
 * (one format) can append their "route" member. */
void kvp__ledger_receipt_open(kvp_text *t, const kvp_ledger_record *r);

#define KVP_LOGE(mod, ...) kvp_log(KVP_LOG_ERROR, mod, __VA_ARGS__)
#define KVP_LOGW(mod, ...) kvp_log(KVP_LOG_WARN, mod, __VA_ARGS__)
#define KVP_LOGI(mod, ...) kvp_log(KVP_LOG_INFO, mod, __VA_ARGS__)
#define KVP_LOGD(mod, ...) kvp_log(KVP_LOG_DEBUG, mod, __VA_ARGS__)

#if defined(__GNUC__) || defined(__clang__)
#define KVP_LIKELY(x) __builtin_expect(!!(x), 1)
#define KVP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define KVP_LIKELY(x) (x)
#define KVP_UNLIKELY(x) (x)
#endif

#endif /* KVP_CORE_INTERNAL_H */
