# SPDX-License-Identifier: Apache-2.0
"""cffi API-mode builder for kvplane._kvplane.

The declarations below name only the fields Python reads or writes; every
struct ends in `...;`, so the C compiler -- not this file -- lays them out
(sizes, offsets and enum values come from include/kvplane/*.h at build
time).  setup.py passes include/library directories through the
environment (see setup.py); this file is imported by setuptools through
`cffi_modules`.
"""
import os

from cffi import FFI

CDEF = r"""
/* ---- common.h ---- */
typedef enum kvp_errno { KVP_EINVAL, KVP_ENOMEM, KVP_ERANGE, KVP_ECORRUPT,
  KVP_ENOTSUP, KVP_ENOENT, KVP_EEXIST, KVP_EBUSY, KVP_EIO, KVP_EGPU,
  KVP_ETRUNC, KVP_ENOSPC, KVP_ESTATE, ... } kvp_errno;
const char *kvp_strerror(int err);
const char *kvp_err_name(int err);
const char *kvp_version(void);
uint32_t kvp_version_number(void);
typedef struct kvp_allocator kvp_allocator;
typedef struct kvp_key { uint64_t hi; uint64_t lo; } kvp_key;
typedef enum kvp_tier { KVP_TIER_HBM, KVP_TIER_DRAM, KVP_TIER_NVME,
  KVP_TIER_REMOTE, KVP_TIER_COUNT_, ... } kvp_tier;
typedef enum kvp_class { KVP_CLASS_VOLATILE, KVP_CLASS_SEMI, KVP_CLASS_STABLE,
  KVP_CLASS_COUNT_, KVP_CLASS_AUTO, ... } kvp_class;
const char *kvp_tier_name(kvp_tier t);
const char *kvp_class_name(kvp_class c);
int kvp_tier_parse(const char *s, kvp_tier *out);
int kvp_class_parse(const char *s, kvp_class *out);
uint64_t kvp_id64(const char *s);
#define KVP_WORKERS_MAX ...

/* ---- core.h ---- */
typedef enum kvp_log_level { KVP_LOG_OFF, KVP_LOG_ERROR, KVP_LOG_WARN,
  KVP_LOG_INFO, KVP_LOG_DEBUG, KVP_LOG_TRACE, ... } kvp_log_level;
typedef void (*kvp_log_sink)(void *opaque, kvp_log_level level,
                             const char *module, const char *msg);
kvp_log_level kvp_log_get_level(void);
void kvp_log_set_level(kvp_log_level level);
void kvp_log_set_sink(kvp_log_sink sink, void *opaque);
uint64_t kvp_now_ns(void);

/* ---- prefix.h ---- */
#define KVP_BLOCK_SIZE_MAX ...
typedef struct kvp_namespace_desc {
  const char *model_id; const char *tokenizer_id; const char *kv_layout;
  uint32_t block_size; const char *tenant_salt; ...;
} kvp_namespace_desc;
typedef struct kvp_namespace { kvp_key seed; uint32_t block_size; ...; }
  kvp_namespace;
int kvp_namespace_init(const kvp_namespace_desc *desc, kvp_namespace *out);
typedef enum kvp_hash_algo { KVP_HASH_XXH3_128, KVP_HASH_SHA256,
  KVP_HASH_SHA256_CBOR, KVP_HASH_XXHASH_CBOR, KVP_HASH_VLLM_SHA256,
  KVP_HASH_VLLM_XXHASH, ... } kvp_hash_algo;
typedef enum kvp_vllm_compat { KVP_VLLM_COMPAT_LATEST,
  KVP_VLLM_COMPAT_PRE_0_33, KVP_VLLM_COMPAT_0_33, ... } kvp_vllm_compat;
int kvp_hash_algo_parse(const char *name, kvp_hash_algo *out);
const char *kvp_hash_algo_name(kvp_hash_algo algo);
size_t kvp_hash_algo_digest_len(kvp_hash_algo algo);
int kvp_hash_algo_from_vllm(const char *vllm_name, kvp_hash_algo *out);
typedef struct kvp_mm_span { const char *id; uint64_t offset;
  uint64_t length; ...; } kvp_mm_span;
typedef struct kvp_extras {
  const char *lora_name; const char *cache_salt; const kvp_mm_span *mm;
  size_t n_mm; const char *lora_path; ...;
} kvp_extras;
typedef struct kvp_hasher_opts { kvp_hash_algo algo;
  const char *python_hash_seed; uint32_t vllm_compat; ...; } kvp_hasher_opts;
typedef struct kvp_hasher kvp_hasher;
int kvp_hasher_create(const kvp_namespace *ns, const kvp_hasher_opts *opts,
                      const kvp_allocator *alloc, kvp_hasher **out);
void kvp_hasher_destroy(kvp_hasher *h);
kvp_hash_algo kvp_hasher_algo(const kvp_hasher *h);
uint32_t kvp_hasher_block_size(const kvp_hasher *h);
int kvp_hasher_hash(kvp_hasher *h, const uint32_t *tokens, size_t n,
                    const kvp_extras *extras, kvp_key *keys, size_t cap,
                    size_t *tail);
typedef struct kvp_chain kvp_chain;
typedef struct kvp_chain_opts { uint32_t chunk_tokens[4]; int keep_digests;
  ...; } kvp_chain_opts;
int kvp_chain_create(kvp_hasher *h, const kvp_chain_opts *opts,
                     const kvp_extras *extras, const kvp_allocator *alloc,
                     kvp_chain **out);
void kvp_chain_destroy(kvp_chain *c);
int kvp_chain_extend(kvp_chain *c, const uint32_t *tokens, size_t n);
void kvp_chain_reset(kvp_chain *c);
size_t kvp_chain_len(const kvp_chain *c);
size_t kvp_chain_tokens(const kvp_chain *c);
size_t kvp_chain_tail(const kvp_chain *c);
const kvp_key *kvp_chain_keys(const kvp_chain *c);
const kvp_key *kvp_chain_chunk_keys(const kvp_chain *c, uint32_t chunk_tokens,
                                    size_t *n);
int kvp_chain_digest(const kvp_chain *c, size_t i, uint8_t *buf, size_t cap);
typedef enum kvp_role { KVP_ROLE_OTHER, KVP_ROLE_SYSTEM, KVP_ROLE_TOOLS,
  KVP_ROLE_DOCUMENTS, KVP_ROLE_HISTORY, KVP_ROLE_USER, KVP_ROLE_TOOL_OUTPUT,
  KVP_ROLE_COUNT_, ... } kvp_role;
const char *kvp_role_name(kvp_role r);
int kvp_role_parse(const char *s, kvp_role *out);
kvp_class kvp_role_default_class(kvp_role r);
typedef struct kvp_segment_mark { uint32_t offset; uint32_t length;
  uint8_t role; uint8_t class_hint; ...; } kvp_segment_mark;
typedef struct kvp_stability kvp_stability;
typedef struct kvp_stability_opts { uint32_t capacity;
  uint32_t stable_sessions; uint32_t semi_repeats; ...; } kvp_stability_opts;
typedef struct kvp_classification { uint64_t tokens[3]; uint32_t stable_end;
  uint32_t semi_end; uint32_t n_blocks; uint32_t learned_blocks; ...; }
  kvp_classification;
int kvp_stability_create(const kvp_stability_opts *opts,
                         const kvp_allocator *alloc, kvp_stability **out);
void kvp_stability_destroy(kvp_stability *s);
int kvp_stability_observe(kvp_stability *s, uint64_t session,
                          const kvp_key *keys, size_t n_blocks,
                          uint32_t block_size, size_t tail,
                          const kvp_segment_mark *marks, size_t n_marks,
                          kvp_classification *out);
size_t kvp_stability_size(const kvp_stability *s);
typedef struct kvp_drift_report { int64_t first_diverging_block;
  uint64_t common_prefix_tokens; uint8_t role; uint64_t reappearing_tokens;
  uint64_t shifted_tokens; uint64_t lost_tokens; ...; } kvp_drift_report;
typedef struct kvp_turn_view { const kvp_key *keys; size_t n_blocks;
  const uint32_t *tokens; size_t n_tokens; const kvp_segment_mark *marks;
  size_t n_marks; ...; } kvp_turn_view;
int kvp_drift_compare(const kvp_turn_view *prev, const kvp_turn_view *cur,
                      uint32_t block_size, const kvp_allocator *alloc,
                      kvp_drift_report *out);

/* ---- index.h ---- */
typedef struct kvp_index kvp_index;
typedef struct kvp_index_opts { uint32_t max_workers; uint32_t approx_capacity;
  uint64_t approx_ttl_ns; uint64_t expected_keys; uint32_t prefix_closed;
  ...; } kvp_index_opts;
int kvp_index_create(const kvp_index_opts *opts, const kvp_allocator *alloc,
                     kvp_index **out);
void kvp_index_destroy(kvp_index *ix);
int kvp_index_worker_add(kvp_index *ix, uint32_t worker);
int kvp_index_worker_remove(kvp_index *ix, uint32_t worker);
int kvp_index_stored(kvp_index *ix, uint32_t worker, uint64_t seq,
                     kvp_tier tier, const kvp_key *parent, const kvp_key *keys,
                     size_t n);
int kvp_index_removed(kvp_index *ix, uint32_t worker, uint64_t seq,
                      kvp_tier tier, const kvp_key *keys, size_t n);
int kvp_index_cleared(kvp_index *ix, uint32_t worker, uint64_t seq);
typedef struct kvp_index_src { uint32_t worker; uint32_t stream;
  uint64_t epoch; uint64_t seq; ...; } kvp_index_src;
int kvp_index_src_stored(kvp_index *ix, const kvp_index_src *src,
                         kvp_tier tier, const kvp_key *parent,
                         const kvp_key *keys, size_t n);
int kvp_index_src_removed(kvp_index *ix, const kvp_index_src *src,
                          kvp_tier tier, const kvp_key *keys, size_t n);
int kvp_index_src_resync(kvp_index *ix, const kvp_index_src *src,
                         uint32_t tier_mask, const kvp_key *keys,
                         const uint8_t *tiers, size_t n);
int kvp_index_record_routed(kvp_index *ix, uint32_t worker,
                            const kvp_key *keys, size_t n, uint64_t now_ns);
int kvp_index_expire(kvp_index *ix, uint64_t now_ns);
typedef struct kvp_index_match { uint32_t worker; uint32_t prefix_blocks;
  uint32_t tier_blocks[4]; uint32_t routed_blocks; uint8_t uncertain; ...; }
  kvp_index_match;
int kvp_index_query(kvp_index *ix, const kvp_key *keys, size_t n,
                    uint64_t now_ns, kvp_index_match *out, size_t cap);
int kvp_index_digest(kvp_index *ix, uint32_t worker, uint64_t *digest);
typedef struct kvp_index_stats { uint64_t keys; uint64_t residencies;
  uint64_t routed; uint64_t bytes; uint32_t workers;
  uint32_t uncertain_workers; uint64_t events_applied; uint64_t events_stale;
  uint64_t seq_gaps; uint64_t events_unknown_worker; uint64_t events_invalid;
  uint64_t orphan_stores; uint64_t resyncs; uint64_t routed_expired;
  uint64_t routed_evicted; uint64_t queries; uint64_t query_blocks;
  uint64_t closure_violations; uint64_t epochs; uint64_t epoch_drops; ...; }
  kvp_index_stats;
int kvp_index_stats_get(kvp_index *ix, kvp_index_stats *out);

/* ---- text.h / ledger.h ---- */
typedef int (*kvp_write_fn)(void *opaque, const char *data, size_t len);
typedef enum kvp_miss_cause { KVP_MISS_NEVER_SEEN, KVP_MISS_EVICTED,
  KVP_MISS_OTHER_WORKER, KVP_MISS_PARTIAL_BLOCK, KVP_MISS_NAMESPACE,
  KVP_MISS_DRIFT, KVP_MISS_NOT_WORTH_LOADING, KVP_MISS_UNKNOWN,
  KVP_MISS_COUNT_, ... } kvp_miss_cause;
const char *kvp_miss_cause_name(kvp_miss_cause c);
typedef enum kvp_ledger_reject { KVP_LEDGER_REJECT_COUNT_, ... }
  kvp_ledger_reject;
const char *kvp_ledger_reject_name(kvp_ledger_reject r);
typedef struct kvp_ledger_record {
  const char *tenant; const char *session; const char *request_id;
  int32_t worker; uint64_t unix_time_ns; uint64_t prompt_tokens;
  uint64_t reused_tokens; uint64_t recomputed_tokens;
  uint64_t reused_by_tier[4]; uint64_t prompt_by_class[3];
  uint64_t reused_by_class[3]; uint64_t miss_tokens[8];
  uint64_t load_bytes[4]; double avoided_flops; double avoided_gpu_seconds;
  ...; } kvp_ledger_record;
typedef struct kvp_ledger_totals { uint64_t requests; uint64_t prompt_tokens;
  uint64_t reused_tokens; uint64_t recomputed_tokens;
  uint64_t reused_by_tier[4]; uint64_t prompt_by_class[3];
  uint64_t reused_by_class[3]; uint64_t miss_tokens[8];
  uint64_t load_bytes[4]; double avoided_flops; double avoided_gpu_seconds;
  ...; } kvp_ledger_totals;
typedef struct kvp_ledger_stats { uint64_t rejected_total;
  uint64_t alloc_failures; uint64_t sessions; uint64_t tenants;
  uint64_t session_evictions; uint64_t tenant_evictions; ...; }
  kvp_ledger_stats;
typedef struct kvp_ledger_opts { uint32_t max_sessions; uint32_t max_tenants;
  ...; } kvp_ledger_opts;
typedef struct kvp_ledger kvp_ledger;
int kvp_ledger_create(const kvp_ledger_opts *opts, const kvp_allocator *alloc,
                      kvp_ledger **out);
void kvp_ledger_destroy(kvp_ledger *l);
int kvp_ledger_check(const kvp_ledger_record *r, kvp_ledger_reject *why);
int kvp_ledger_explain(const kvp_ledger_record *r, char *buf, size_t cap);
int kvp_ledger_add(kvp_ledger *l, const kvp_ledger_record *r);
int kvp_ledger_global_totals(kvp_ledger *l, kvp_ledger_totals *out);
int kvp_ledger_tenant_totals(kvp_ledger *l, const char *tenant,
                             kvp_ledger_totals *out);
int kvp_ledger_session_totals(kvp_ledger *l, const char *tenant,
                              const char *session, kvp_ledger_totals *out);
int kvp_ledger_stats_get(kvp_ledger *l, kvp_ledger_stats *out);
int kvp_ledger_prometheus(kvp_ledger *l, char *buf, size_t cap,
                          size_t *needed);
int kvp_ledger_receipt_json(const kvp_ledger_record *r, char *buf, size_t cap);
int kvp_ledger_totals_json(const kvp_ledger_totals *t, const char *tenant,
                           const char *session, char *buf, size_t cap);
#define KVP_LEDGER_JSON_GLOBAL ...
#define KVP_LEDGER_JSON_TENANTS ...
#define KVP_LEDGER_JSON_SESSIONS ...
int kvp_ledger_json_write(kvp_ledger *l, unsigned what, kvp_write_fn fn,
                          void *opaque);

/* ---- route.h ---- */
typedef enum kvp_policy { KVP_POLICY_KVPLANE_COST, KVP_POLICY_ROUND_ROBIN,
  KVP_POLICY_LEAST_LOADED, KVP_POLICY_PREFIX_GREEDY, KVP_POLICY_SGLANG,
  KVP_POLICY_LLMD, KVP_POLICY_DYNAMO, KVP_POLICY_COUNT_, ... } kvp_policy;
int kvp_policy_parse(const char *name, kvp_policy *out);
const char *kvp_policy_name(kvp_policy p);
typedef struct kvp_model_spec { uint32_t layers; uint32_t heads;
  uint32_t kv_heads; uint32_t head_dim; uint32_t dtype_bytes; double params;
  ...; } kvp_model_spec;
typedef struct kvp_gpu_spec { double flops; double efficiency; double bw[4];
  double latency_s[4]; ...; } kvp_gpu_spec;
double kvp_model_kv_bytes_per_token(const kvp_model_spec *m);
double kvp_model_prefill_flops(const kvp_model_spec *m, uint64_t from,
                               uint64_t to);
#define KVP_WORKER_OFFLINE ...
typedef struct kvp_worker_load { uint32_t queued_requests;
  uint32_t running_requests; uint64_t prefill_tokens; uint64_t decode_blocks;
  double kv_util; uint32_t flags; ...; } kvp_worker_load;
#define KVP_MATCH_UNCERTAIN ...
typedef struct kvp_worker_match { uint32_t worker; uint32_t flags;
  uint32_t blocks[4]; ...; } kvp_worker_match;
typedef struct kvp_router kvp_router;
typedef struct kvp_router_opts { kvp_policy policy; uint32_t n_workers;
  uint32_t block_size; uint32_t replica_id; uint64_t seed;
  kvp_model_spec model; kvp_gpu_spec gpu; double guard; uint32_t guard_ref;
  uint32_t guard_min_load; double affinity_eps_rel; double affinity_eps_s;
  double tie_rel; double uncertain_confidence; double dynamo_temperature;
  double llmd_w_prefix; double llmd_w_kv; double llmd_w_queue;
  uint32_t max_inflight; uint32_t max_sessions; uint32_t max_blocks;
  uint32_t record_routed; ...; } kvp_router_opts;
int kvp_router_create(const kvp_router_opts *opts, const kvp_allocator *alloc,
                      kvp_router **out);
void kvp_router_destroy(kvp_router *r);
int kvp_router_set_load(kvp_router *r, uint32_t worker,
                        const kvp_worker_load *load);
int kvp_router_report_bandwidth(kvp_router *r, kvp_tier tier,
                                double bytes_per_s);
double kvp_router_bandwidth(const kvp_router *r, kvp_tier tier);
typedef struct kvp_route_request { const kvp_key *keys; size_t n_blocks;
  uint64_t prompt_tokens; const kvp_classification *cls; uint64_t session_id;
  uint64_t request_id; uint64_t tenant; uint32_t block_size; ...; }
  kvp_route_request;
#define KVP_ROUTE_TOP ...
#define KVP_WORKER_NONE ...
typedef enum kvp_reason { KVP_REASON_COUNT_, ... } kvp_reason;
typedef struct kvp_route_candidate { uint32_t worker; uint32_t flags;
  uint64_t matched_tokens; uint64_t reused_tokens; double queue_s;
  double recompute_s; double load_s; double total_s; double score; ...; }
  kvp_route_candidate;
typedef struct kvp_decision { uint32_t worker; uint8_t policy; uint8_t reason;
  uint8_t n_top; uint8_t flags; uint32_t n_eligible; uint32_t block_size;
  uint64_t request_id; uint64_t session_id; uint64_t tenant;
  uint64_t prompt_tokens; uint64_t matched_tokens[4];
  uint64_t reused_tier_tokens[4]; uint64_t matched_elsewhere_tokens;
  uint64_t reused_class_tokens[3]; uint64_t uncached_tokens;
  uint64_t avoided_tokens; double avoided_flops; double avoided_s;
  double load_s; kvp_route_candidate top[4]; char reason_text[256];
  uint64_t hashed_tokens; uint64_t prompt_class_tokens[3];
  uint64_t load_bytes[4]; ...; } kvp_decision;
int kvp_router_route_matches(kvp_router *r, const kvp_route_request *req,
                             const kvp_worker_match *matches,
                             size_t n_matches, kvp_decision *out);
typedef int (*kvp_match_fn)(void *ctx, uint32_t worker, kvp_worker_match *out);
int kvp_router_route_chosen(kvp_router *r, const kvp_route_request *req,
                            kvp_match_fn fn, void *ctx, kvp_decision *out);
int kvp_policy_compares_matches(kvp_policy p);
#define KVP_DECISION_CHOSEN_ONLY ...
int kvp_router_route(kvp_router *r, kvp_index *ix,
                     const kvp_route_request *req, uint64_t now_ns,
                     kvp_decision *out);
int kvp_router_complete(kvp_router *r, uint32_t worker, uint64_t request_id);
int kvp_router_inflight(const kvp_router *r, uint32_t worker,
                        uint64_t *requests, uint64_t *tokens, double *seconds);
typedef struct kvp_route_names { const char *tenant; const char *session;
  const char *request_id; uint64_t unix_time_ns; ...; } kvp_route_names;
int kvp_ledger_add_decision(kvp_ledger *l, const kvp_decision *d,
                            const kvp_route_names *names);
int kvp_router_receipt_json(const kvp_decision *d,
                            const kvp_route_names *names, char *buf,
                            size_t cap);

/* ---- tier.h ---- */
typedef struct kvp_tier_store kvp_tier_store;
typedef enum kvp_tier_policy_kind { KVP_TIER_POLICY_LRU,
  KVP_TIER_POLICY_S3FIFO, ... } kvp_tier_policy_kind;
typedef enum kvp_tier_io_backend { KVP_TIER_IO_AUTO, KVP_TIER_IO_URING,
  KVP_TIER_IO_POSIX, ... } kvp_tier_io_backend;
typedef enum kvp_tier_admission { ... } kvp_tier_admission;
int kvp_tier_admission_parse(const char *name, kvp_tier_admission *out);
int kvp_tier_policy_parse(const char *name, kvp_tier_policy_kind *out);
typedef struct kvp_tier_event { uint64_t seq; kvp_tier tier; int stored;
  kvp_key ns; kvp_key key; uint64_t bytes; uint64_t epoch; ...; }
  kvp_tier_event;
typedef void (*kvp_tier_event_fn)(void *opaque, const kvp_tier_event *ev);
typedef struct kvp_tier_opts { uint64_t dram_bytes; double dram_fraction;
  const char *nvme_dir; uint64_t nvme_bytes; double nvme_fraction;
  uint32_t queue_depth; uint64_t max_block_bytes;
  kvp_tier_io_backend io_backend; kvp_tier_policy_kind policy;
  uint32_t volatile_nvme_min_hits; uint32_t no_promote;
  kvp_tier_event_fn on_event; void *event_opaque;
  kvp_tier_admission admission; ...; } kvp_tier_opts;
typedef struct kvp_tier_ns_opts { uint64_t block_bytes;
  const uint8_t *aes256_key; double prefill_kv_bytes_per_s; ...; }
  kvp_tier_ns_opts;
int kvp_tier_create(const kvp_tier_opts *opts, const kvp_allocator *alloc,
                    kvp_tier_store **out);
void kvp_tier_destroy(kvp_tier_store *t);
int kvp_tier_ns_add(kvp_tier_store *t, const kvp_namespace *ns,
                    const kvp_tier_ns_opts *o);
#define KVP_TIER_PUT_DURABLE ...
typedef struct kvp_tier_put_opts { kvp_class cls; uint32_t flags; ...; }
  kvp_tier_put_opts;
int kvp_tier_put(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key,
                 const void *data, size_t len, const kvp_tier_put_opts *po);
int kvp_tier_get(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key,
                 void *dst, size_t cap, size_t *len);
int kvp_tier_contains(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key);
int kvp_tier_evict(kvp_tier_store *t, const kvp_namespace *ns, kvp_key key);
int kvp_tier_sync(kvp_tier_store *t);
int kvp_tier_idle(kvp_tier_store *t, uint64_t budget_bytes);
int kvp_tier_get_batch(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, void *const *dst,
                       const size_t *cap, size_t *len, int *results);
int kvp_tier_put_batch(kvp_tier_store *t, const kvp_namespace *ns,
                       const kvp_key *keys, size_t n, const void *const *data,
                       const size_t *len, const kvp_tier_put_opts *po,
                       int *results);
typedef struct kvp_tier_stats { uint64_t puts; uint64_t puts_dup;
  uint64_t puts_rejected; uint64_t hits[4]; uint64_t misses;
  uint64_t demotions; uint64_t promotions; uint64_t nvme_writes;
  uint64_t nvme_reads; uint64_t checksum_failures; uint64_t recovered_slots;
  uint64_t dram_blocks; uint64_t nvme_blocks; uint64_t dram_used_bytes;
  uint64_t nvme_used_bytes; uint64_t dram_bytes; uint64_t nvme_bytes;
  int io_uring; ...; } kvp_tier_stats;
int kvp_tier_stats_get(kvp_tier_store *t, kvp_tier_stats *out);
uint64_t kvp_tier_epoch(const kvp_tier_store *t);
typedef struct kvp_tier_resident { kvp_key ns; kvp_key key; kvp_tier tier;
  uint64_t bytes; ...; } kvp_tier_resident;
typedef int (*kvp_tier_resident_fn)(void *opaque, const kvp_tier_resident *r);
int kvp_tier_keys_each(kvp_tier_store *t, kvp_tier_resident_fn fn,
                       void *opaque, uint64_t *seq);
double kvp_tier_bandwidth(kvp_tier_store *t, kvp_tier tier);

/* ---- device.h ---- */
typedef enum kvp_backend { KVP_BACKEND_CPU, KVP_BACKEND_CUDA, KVP_BACKEND_HIP,
  ... } kvp_backend;
const char *kvp_backend_name(kvp_backend b);
int kvp_backend_available(kvp_backend b, char *why, size_t why_cap);
typedef struct kvp_device kvp_device;
typedef struct kvp_device_opts { kvp_backend backend; int32_t ordinal;
  uint32_t cta_budget; uint32_t flags; ...; } kvp_device_opts;
#define KVP_DEVICE_NO_CALIBRATE ...
int kvp_device_create(const kvp_device_opts *opts, const kvp_allocator *alloc,
                      kvp_device **out);
void kvp_device_destroy(kvp_device *dev);
kvp_backend kvp_device_backend(const kvp_device *dev);
const char *kvp_device_name(const kvp_device *dev);
int kvp_device_native_error(const kvp_device *dev, const char **name);
int kvp_device_host_register(kvp_device *dev, void *ptr, size_t bytes);
int kvp_device_host_unregister(kvp_device *dev, void *ptr);
int kvp_device_synchronize(kvp_device *dev);
typedef struct kvp_stream kvp_stream;
int kvp_stream_wrap(kvp_device *dev, void *native, kvp_stream **out);
void kvp_stream_destroy(kvp_stream *s);
int kvp_stream_synchronize(kvp_stream *s);
typedef enum kvp_layout_kind { KVP_LAYOUT_VLLM_NHD, KVP_LAYOUT_VLLM_NHD_KV,
  KVP_LAYOUT_VLLM_HND, KVP_LAYOUT_VLLM_HND_KV, KVP_LAYOUT_CROSS_LAYER,
  KVP_LAYOUT_MLA, ... } kvp_layout_kind;
typedef struct kvp_kv_layout_desc { kvp_layout_kind kind; uint32_t num_layers;
  uint32_t num_blocks; uint32_t block_size; uint32_t num_kv_heads;
  uint32_t head_dim; uint32_t elem_size; void *const *k_layers;
  void *const *v_layers; void *base; ...; } kvp_kv_layout_desc;
typedef struct kvp_kv_layout kvp_kv_layout;
int kvp_kv_layout_create(kvp_device *dev, const kvp_kv_layout_desc *desc,
                         kvp_kv_layout **out);
void kvp_kv_layout_destroy(kvp_kv_layout *l);
typedef struct kvp_kv_layout_info { uint64_t block_bytes; uint64_t chunk_bytes;
  uint64_t block_stride; uint32_t n_chunks; uint32_t num_blocks;
  uint32_t vector_bytes; ...; } kvp_kv_layout_info;
int kvp_kv_layout_info_get(const kvp_kv_layout *l, kvp_kv_layout_info *out);
typedef enum kvp_xfer_method { KVP_XFER_AUTO, KVP_XFER_KERNEL,
  KVP_XFER_COPY_ENGINE, ... } kvp_xfer_method;
#define KVP_XFER_IDS_UNIQUE ...
typedef struct kvp_xfer { const kvp_kv_layout *layout;
  const uint32_t *block_ids; uint32_t n; uint32_t method; void *staging;
  uint64_t staging_bytes; const uint32_t *staging_slots; uint32_t flags;
  ...; } kvp_xfer;
int kvp_device_gather(kvp_device *dev, kvp_stream *s, const kvp_xfer *x);
int kvp_device_scatter(kvp_device *dev, kvp_stream *s, const kvp_xfer *x);
/* ---- tier.h: the device link ---- */
int kvp_tier_opts_set_device(kvp_tier_opts *o, kvp_device *dev);
/* ---- config.h + tier.h: the YAML `tiers:` section ---- */
typedef struct kvp_config kvp_config;
int kvp_config_load_mem(const void *data, size_t size, const char *name,
                        const kvp_allocator *alloc, kvp_config **out,
                        char *err, size_t cap);
void kvp_config_destroy(kvp_config *c);
int kvp_tier_opts_from_config(kvp_config *c, kvp_tier_opts *o, char *dir,
                              size_t dir_cap, char *err, size_t cap);
typedef struct kvp_tier_link kvp_tier_link;
typedef struct kvp_tier_link_opts { uint32_t staging_blocks; ...; }
  kvp_tier_link_opts;
typedef struct kvp_tier_link_stats { uint64_t saves; uint64_t loads;
  uint64_t blocks_saved; uint64_t blocks_save_failed; uint64_t blocks_loaded;
  uint64_t blocks_missed; uint64_t wrong_length; uint64_t gathers;
  uint64_t scatters; uint64_t blocks_direct; uint64_t blocks_saved_direct;
  uint64_t rounds_overlapped;
  ...; } kvp_tier_link_stats;
int kvp_tier_link_create(kvp_tier_store *t, kvp_device *dev,
                         const kvp_kv_layout *layout, const kvp_namespace *ns,
                         const kvp_tier_link_opts *o, const kvp_allocator *alloc,
                         kvp_tier_link **out);
void kvp_tier_link_destroy(kvp_tier_link *l);
int kvp_tier_save(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                  const uint32_t *block_ids, size_t n,
                  const kvp_tier_put_opts *po, int *results);
int kvp_tier_load(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                  const uint32_t *block_ids, size_t n, int *results);
int kvp_tier_link_stats_get(kvp_tier_link *l, kvp_tier_link_stats *out);

/* ---- events.h (libkvplane-events) ---- */
typedef enum kvp_events_keying { KVP_EVENTS_REKEY, KVP_EVENTS_ENGINE_HASH,
  ... } kvp_events_keying;
typedef enum kvp_events_connect { KVP_EVENTS_AUTO, KVP_EVENTS_CONNECT,
  KVP_EVENTS_BIND, ... } kvp_events_connect;
typedef struct kvp_events_source { const char *endpoint;
  const char *replay_endpoint; const char *topic; uint32_t worker;
  uint32_t stream; uint32_t dp_rank; kvp_events_connect connect;
  kvp_events_keying keying; const kvp_namespace *ns; kvp_hasher_opts hasher;
  uint32_t rekey_capacity; ...; } kvp_events_source;
typedef struct kvp_events_opts { uint32_t replay_timeout_ms;
  uint32_t pending_max; int32_t rcvhwm; uint32_t no_initial_replay;
  uint32_t probe_idle_ms; ...; } kvp_events_opts;
typedef struct kvp_events kvp_events;
int kvp_events_create(kvp_index *ix, const kvp_events_source *sources,
                      size_t n_sources, const kvp_events_opts *opts,
                      const kvp_allocator *alloc, kvp_events **out);
void kvp_events_destroy(kvp_events *ev);
int kvp_events_start(kvp_events *ev);
int kvp_events_stop(kvp_events *ev);
int kvp_events_poll(kvp_events *ev, int timeout_ms);
typedef struct kvp_events_stats { uint64_t batches; uint64_t events;
  uint64_t blocks_stored; uint64_t blocks_removed; uint64_t clears;
  uint64_t gaps; uint64_t decode_errors; uint64_t restarts;
  double lag_seconds; ...; } kvp_events_stats;
int kvp_events_stats_get(kvp_events *ev, uint32_t source,
                         kvp_events_stats *out);
int kvp_events_prometheus(kvp_events *ev, char *buf, size_t cap);

/* ---- callbacks into Python ---- */
extern "Python" void kvp_py_log_sink(void *, kvp_log_level, const char *,
                                     const char *);
extern "Python" int kvp_py_write(void *, const char *, size_t);
extern "Python" int kvp_py_tier_resident(void *, const kvp_tier_resident *);
extern "Python" void kvp_py_tier_event(void *, const kvp_tier_event *);
extern "Python" int kvp_py_chosen_match(void *, uint32_t, kvp_worker_match *);
"""


def _paths(var):
    return [p for p in os.environ.get(var, "").split(os.pathsep) if p]


ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "kvplane._kvplane",
    "#include <kvplane.h>\n#include <kvplane/events.h>\n",
    include_dirs=_paths("KVPLANE_INCLUDE_DIRS"),
    extra_objects=_paths("KVPLANE_STATIC_LIBS"),
    libraries=_paths("KVPLANE_LINK_LIBS"),
    library_dirs=_paths("KVPLANE_LIBRARY_DIRS"),
    extra_compile_args=["-std=c11", "-O2"],
    extra_link_args=["-Wl,--exclude-libs,ALL"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
