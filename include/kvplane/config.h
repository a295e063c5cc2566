/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane config (core/config): one YAML file for cluster, model, policies
 * and tiers, validated with clear errors.
 *
 * Shape: a top-level mapping of sections; each section a mapping of keys to
 * scalars or to flow/block sequences of scalars:
 *
 *   cluster:
 *     workers: 8
 *   routing:
 *     policies: [kvplane_cost, round_robin]
 *
 * Loading parses the whole file (libyaml) and keeps every value with its line.
 * Each module then binds the section it owns to its own option struct with a
 * field table (kvp_config_bind): unknown keys and bad values are rejected
 * there with "file:line: section.key: ..." messages (kvtier binds `tiers:`,
 * the router `model:`, `gpu:` and `routing:`).  kvp_config_check_unbound finally
 * rejects sections nobody bound (e.g. a typo in a section name).  Anchors,
 * aliases, tags, duplicate keys/sections and deeper nesting are errors.
 *
 * Thread safety: a kvp_config is not thread-safe; distinct configs are
 * independent.  All functions are re-entrant. */
#ifndef KVPLANE_CONFIG_H
#define KVPLANE_CONFIG_H

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_config kvp_config;

typedef enum kvp_config_type {
  KVP_CONFIG_U64 = 0,  /* decimal integer in [min, max] */
  KVP_CONFIG_F64 = 1,  /* finite number in [min, max] */
  KVP_CONFIG_BOOL = 2, /* true/false, yes/no, on/off */
  KVP_CONFIG_STR = 3,  /* one string (cap bytes with the NUL); a list is
                          refused (a path is not a list) */
  KVP_CONFIG_LIST = 4, /* a list ([a, b] or a block sequence) or one scalar,
                          which reads like a command line's "a,b"; items are
                          non-empty and hold no ','; stored joined with ','
                          into char[cap]; the item count in [min, max] */
  KVP_CONFIG_SIZE = 5, /* bytes (kvp_config_parse_size: 4096, 64M, 1.5GiB,
                          1T, 1e12) in [min, max], into uint64_t */
  KVP_CONFIG_DURATION = 6 /* seconds (kvp_config_parse_duration: 10us, 2ms,
                             0.5s) in [min, max], into double; a bare
                             number counts 1/cap seconds (cap 1: seconds,
                             1000: ms, 1000000: us) */
} kvp_config_type;

/* One key of a section.  `out` points to uint64_t (U64, SIZE), double (F64,
 * DURATION), bool or char[cap] (STR, LIST) by type; it is written only when
 * the key is present and valid. */
typedef struct kvp_config_field {
  const char *name;
  kvp_config_type type;
  void *out;
  double min, max; /* U64 / F64 / SIZE / DURATION bounds, LIST item counts;
                      inclusive */
  size_t cap;      /* STR / LIST buffer size; DURATION: units per second of
                      a bare number */
} kvp_config_field;

#define KVP_CFG_U64(n, p, lo, hi) {(n), KVP_CONFIG_U64, (p), (double)(lo), (double)(hi), 0}
#define KVP_CFG_F64(n, p, lo, hi) {(n), KVP_CONFIG_F64, (p), (lo), (hi), 0}
#define KVP_CFG_BOOL(n, p) {(n), KVP_CONFIG_BOOL, (p), 0, 1, 0}
#define KVP_CFG_STR(n, p, c) {(n), KVP_CONFIG_STR, (p), 0, 0, (c)}
#define KVP_CFG_LIST(n, p, c, lo, hi) {(n), KVP_CONFIG_LIST, (p), (double)(lo), (double)(hi), (c)}
#define KVP_CFG_SIZE(n, p, lo, hi) {(n), KVP_CONFIG_SIZE, (p), (double)(lo), (double)(hi), 0}
#define KVP_CFG_DURATION(n, p, lo_s, hi_s, per_s) {(n), KVP_CONFIG_DURATION, (p), (lo_s), (hi_s), (per_s)}

/* Units, for the config's typed fields and for command lines that take the
 * same values.
 * A size in bytes: a non-negative number (1024, 1.5, 1e12) and an optional
 * unit, with or without a space: B; K, M, G, T, P or KB .. PB (powers of
 * 1000, as kvplane's GB everywhere); Ki, Mi, Gi, Ti, Pi or KiB .. PiB (powers
 * of 1024); k is taken for K.  The result must be a whole number of bytes
 * that fits uint64_t.  Returns 0, or KVP_EINVAL (NULL, empty, negative,
 * unknown unit, fraction of a byte, overflow) with *out untouched. */
KVP_API int kvp_config_parse_size(const char *s, uint64_t *out);
/* A duration in seconds: a non-negative finite number and an optional unit
 * ns, us, ms or s (space allowed); a bare number counts bare_unit_s seconds
 * each (1e-6 for a key in microseconds).  Returns 0, or KVP_EINVAL with
 * *out_s untouched. */
KVP_API int kvp_config_parse_duration(const char *s, double bare_unit_s,
                                      double *out_s);

typedef struct kvp_config_section {
  const char *name;
  const kvp_config_field *fields;
  size_t n_fields;
} kvp_config_section;

/* Parses YAML from a file or from memory (`name` is used in messages).
 * Returns 0; KVP_ECORRUPT (not YAML or the wrong shape), -errno (file), or
 * KVP_ENOMEM, with "name:line: message" in err (cap > 0).  *out is NULL on
 * failure.  Input is limited to 1 MiB and 4096 keys.  A path that is a
 * directory fails with -EISDIR and says so. */
KVP_API int kvp_config_load_file(const char *path, const kvp_allocator *alloc,
                                 kvp_config **out, char *err, size_t cap);
KVP_API int kvp_config_load_mem(const void *data, size_t size,
                                const char *name, const kvp_allocator *alloc,
                                kvp_config **out, char *err, size_t cap);
/* NULL is a no-op. */
KVP_API void kvp_config_destroy(kvp_config *c);

/* Binds section s->name: every key must be one of s->fields and valid, else
 * KVP_EINVAL with "name:line: unknown key 'x' in section 's'" or "name:line:
 * s.key: expected ..., got '...'" in err.  An absent section binds nothing
 * and succeeds.  Nothing is stored unless every key is valid.  The section
 * counts as bound even when this fails, so that kvp_config_check_unbound
 * does not call it unknown after its real error.  Returns the number of
 * keys set, or KVP_EINVAL. */
KVP_API int kvp_config_bind(kvp_config *c, const kvp_config_section *s,
                            char *err, size_t cap);
/* KVP_EINVAL ("name:line: unknown section 'x'") if a section was neither
 * bound nor listed in `reserved` (sections another module will bind). */
KVP_API int kvp_config_check_unbound(const kvp_config *c,
                                     const char *const *reserved,
                                     size_t n_reserved, char *err, size_t cap);
/* Is section `name` present?  1 / 0; KVP_EINVAL for NULL arguments. */
KVP_API int kvp_config_has_section(const kvp_config *c, const char *name);
/* Where `section`.`key` was set, for a module that checks a bound value
 * further (an enumeration) and reports it as "name:line: ...".  Returns the
 * line (> 0), 0 when the key is absent, KVP_EINVAL for NULL c/section/key;
 * *name (if name != NULL) receives the config's name, valid while c lives. */
KVP_API int kvp_config_key_line(const kvp_config *c, const char *section,
                                const char *key, const char **name);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_CONFIG_H */
