/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane KV-event subscriber (connectors/events, library kvplane-events):
 * hears what serving engines cache and keeps a kvp_index current.
 *
 * vLLM (--kv-events-config '{"enable_kv_cache_events": true, "publisher":
 * "zmq", "endpoint": ..., "replay_endpoint": ...}') publishes every change of
 * its prefix cache on a ZeroMQ PUB socket as frames (topic, seq as 8 bytes
 * big-endian, msgpack EventBatch) and keeps the last batches for replay on a
 * ROUTER socket.  One kvp_events object subscribes to many such sources and
 * applies them to one index: BlockStored -> kvp_index_src_stored, medium GPU
 * -> HBM, CPU -> DRAM, STORAGE / disk -> NVMe; BlockRemoved -> removed;
 * AllBlocksCleared -> every tier the source fed.
 *
 * Reliability (per source): batches are applied in sequence order exactly
 * once.  A gap asks the source's replay socket for the missed batches; when
 * replay is not configured, times out or no longer holds them, the source's
 * residency is dropped (stats.residency_drops) and the stream continues: a
 * routing hint may be lost, a block the worker may no longer hold is never
 * claimed.  A publisher that restarts (seq begins again) is detected and
 * starts a new index epoch (stats.restarts).  A malformed frame is counted
 * and skipped.
 *
 * Keying: an engine names blocks by its own hashes.  Two ways to match them
 * with requests (per source, kvp_events_source.keying):
 *   KVP_EVENTS_REKEY (default): every stored block is re-keyed from the
 *     event's token ids and extra keys with kvplane's own chain (the source's
 *     namespace and hasher options; XXH3-128 by default), so routing works
 *     whatever hash algorithm and seed the engines run (vLLM's default
 *     sha256 pickle, random-seeded xxhash).  Requests are hashed with the
 *     same namespace (kvp_hasher_hash / kvp_chain) and its extras.  Per
 *     source a map engine hash -> kvplane key resolves parents and removals;
 *     its entries go with their blocks, and it is bounded (rekey_capacity).
 *   KVP_EVENTS_ENGINE_HASH: the published hashes are the index keys
 *     (kvp_key.lo = the int hash, or the low 64 bits of a digest); requests
 *     must be hashed with the engines' exact algorithm and seed
 *     (kvp_hasher_opts: KVP_HASH_VLLM_SHA256 ..., python_hash_seed).
 *
 * Hybrid models publish one group per attention kind (group_idx,
 * kv_cache_spec_kind); their hashes are equal across groups, and a sliding
 * window group removes blocks the full-attention group still holds.  Only
 * the full-attention group is indexed (kinds full_attention, mla_attention,
 * sink_full_attention; group 0 or no group when no kind is published);
 * events of other groups are counted (stats.other_groups) and skipped.
 *
 * Threading: kvp_events_start() runs an I/O thread; or drive it from an
 * event loop with kvp_events_fds() + kvp_events_poll().  Never both. */
#ifndef KVPLANE_EVENTS_H
#define KVPLANE_EVENTS_H

#include "kvplane/common.h"
#include "kvplane/index.h"
#include "kvplane/prefix.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- decoded events ---------------------------------------------------------
 * kvp_kv_decode() turns one msgpack payload into these; they point into the
 * decoder's scratch and stay valid until its next decode. */

typedef enum kvp_kv_event_type {
  KVP_KV_UNKNOWN = 0, /* a type this version does not know (skipped) */
  KVP_KV_BLOCK_STORED = 1,
  KVP_KV_BLOCK_REMOVED = 2,
  KVP_KV_ALL_CLEARED = 3
} kvp_kv_event_type;

/* "BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown". */
KVP_API const char *kvp_kv_event_type_name(kvp_kv_event_type t);

/* An engine block hash as published: an int (vLLM's default,
 * VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or the raw digest bytes. */
typedef struct kvp_ehash {
  uint64_t u64;       /* the int, or the low 64 bits of the big-endian digest */
  uint8_t len;        /* 0: int form; else digest length (1..32) */
  uint8_t digest[32]; /* the digest when len > 0 */
  uint8_t reserved[7];
} kvp_ehash;

typedef struct kvp_kv_event {
  kvp_kv_event_type type;
  kvp_tier tier;          /* from medium (HBM when absent) */
  const char *medium;     /* as published, NUL-terminated; NULL = absent */
  const kvp_ehash *hashes;
  size_t n_hashes;
  const kvp_ehash *parent; /* BlockStored: NULL = chain root */
  const uint32_t *tokens;  /* BlockStored: n_hashes * block_size tokens */
  size_t n_tokens;
  uint32_t block_size;     /* 0 when absent */
  int32_t group_idx;       /* -1 when absent */
  const char *spec_kind;   /* kv_cache_spec_kind; NULL = absent */
  const char *lora_name;   /* NULL = absent */
  int64_t lora_id;         /* -1 when absent */
  /* per block: the extra keys in the untagged event form, classified (LoRA
   * name, (mm id, offset) pairs, cache salt, prompt-embeds digest); NULL
   * when the event has none. */
  const kvp_block_extras *extras;
  size_t n_extras;         /* == n_hashes when extras != NULL */
  uint32_t unknown_fields; /* fields this version ignores */
  uint32_t reserved32;
} kvp_kv_event;

typedef struct kvp_kv_batch {
  double ts;        /* the publisher's wall clock, seconds */
  int32_t dp_rank;  /* data_parallel_rank; -1 when absent */
  uint32_t unknown_events;
  const kvp_kv_event *events;
  size_t n_events;
} kvp_kv_batch;

/* Decoder scratch: NOT thread-safe; one per thread. */
typedef struct kvp_kv_decoder kvp_kv_decoder;
KVP_API int kvp_kv_decoder_create(const kvp_allocator *alloc,
                                  kvp_kv_decoder **out);
KVP_API void kvp_kv_decoder_destroy(kvp_kv_decoder *d);
/* Decodes one EventBatch payload (vLLM 0.33: array [ts, events, dp_rank?],
 * events as maps tagged by "type"; other encoders' tagged arrays [type,
 * fields in declaration order...] are accepted too).  Missing optional
 * fields take their defaults; unknown fields and event types are counted
 * and skipped.  Returns the number of events, or KVP_ECORRUPT (not msgpack,
 * wrong shape or types; logged at debug level with the reason), KVP_ERANGE
 * (a digest longer than 32 bytes, a token id outside u32, more than
 * KVP_INDEX_CHAIN_MAX blocks), KVP_EINVAL or KVP_ENOMEM.  Never reads past
 * payload[len). */
KVP_API int kvp_kv_decode(kvp_kv_decoder *d, const void *payload, size_t len,
                          kvp_kv_batch *out);
/* skip != 0: token ids are counted (n_tokens, and checked against
 * block_size) but not converted: tokens is NULL.  For consumers that key by
 * the engines' hashes.  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_kv_decoder_skip_tokens(kvp_kv_decoder *d, int skip);

/* Is payload[0..len) exactly one msgpack value whose every declared string,
 * binary and container size fits in the bytes that remain?  The check the
 * decoder makes before it unpacks: msgpack-c sizes its allocations from the
 * declared counts, so a few hostile bytes could ask for gigabytes.  For any
 * msgpack reader of outside bytes (kvplane-routerd's replica messages).
 * Returns 0 or KVP_ECORRUPT (KVP_EINVAL for NULL with len > 0). */
KVP_API int kvp_msgpack_check(const void *payload, size_t len);

/* ---- the subscriber ---------------------------------------------------------- */

typedef enum kvp_events_keying {
  KVP_EVENTS_REKEY = 0,
  KVP_EVENTS_ENGINE_HASH = 1
} kvp_events_keying;

typedef enum kvp_events_connect {
  /* bind when the endpoint has a '*' wildcard (the engines dial in: vLLM
   * connects when its endpoint has no wildcard / ipc / inproc), else
   * connect */
  KVP_EVENTS_AUTO = 0,
  KVP_EVENTS_CONNECT = 1,
  KVP_EVENTS_BIND = 2
} kvp_events_connect;

typedef struct kvp_events_source {
  /* ZeroMQ endpoint of the PUB stream; NULL = an EXTERNAL source: no
   * sockets, its batches come from the caller (kvp_events_feed: a relay,
   * JetStream -- events_nats.h); topic, dp_rank and connect are ignored */
  const char *endpoint;
  const char *replay_endpoint; /* the publisher's ROUTER; NULL = none (and
                                  NULL for an external source) */
  const char *topic;           /* NULL or "" = every topic */
  uint32_t worker;             /* the kvp_index worker it describes */
  uint32_t stream;             /* its kvp_index stream (< KVP_INDEX_STREAMS) */
  /* vLLM data-parallel rank r publishes on port + r (inproc: name_dp<r>);
   * both endpoints are offset as vLLM offsets them. */
  uint32_t dp_rank;
  kvp_events_connect connect;
  kvp_events_keying keying;
  /* REKEY: the namespace and hasher requests are hashed with (a native
   * algorithm; its block size must equal the events' block_size).
   * ENGINE_HASH: ns may be NULL; when given, events with another block_size
   * are skipped. */
  const kvp_namespace *ns;
  kvp_hasher_opts hasher;
  /* REKEY: most engine hashes remembered (0 = 1 << 22); beyond it new
   * blocks are not indexed (stats.rekey_full). */
  uint32_t rekey_capacity;
  uint32_t reserved[7];
} kvp_events_source;

typedef struct kvp_events_opts {
  /* a replay that has not ended after this long is abandoned and the
   * source's residency dropped (0 = 2000 ms) */
  uint32_t replay_timeout_ms;
  /* live batches kept while a replay runs, per source (0 = 4096); beyond,
   * they are dropped (stats.queue_drops) and recovered by the next replay */
  uint32_t pending_max;
  /* ZMQ_RCVHWM of the SUB sockets (0 = 100000 messages) */
  int32_t rcvhwm;
  /* 1: do not ask for replay from seq 0 when a source starts */
  uint32_t no_initial_replay;
  /* a source with a replay socket that has been quiet this long asks for a
   * replay from its last batch: it finds a lost last batch or a restart not
   * seen live (0 = 5000 ms; UINT32_MAX = never) */
  uint32_t probe_idle_ms;
  uint32_t reserved[7];
} kvp_events_opts;

typedef struct kvp_events kvp_events;

/* Called, when set, for every batch applied (after the index saw it), from
 * the thread that applies it; `b` is valid during the call only. */
typedef void (*kvp_events_batch_fn)(void *opaque, uint32_t source,
                                    uint64_t seq, const kvp_kv_batch *b);

/* Creates a subscriber feeding `ix` (borrowed: must outlive it; the
 * sources' workers must have been added).  Opens and binds/connects every
 * source's sockets (endpoints copied).  Returns 0, KVP_EINVAL (a field
 * named in the log: endpoint NULL, stream out of range, REKEY without a
 * namespace or with a vLLM algorithm, an external source with a
 * replay_endpoint ...), KVP_EIO (ZeroMQ refused an
 * endpoint: logged with zmq_strerror), KVP_ENOMEM. */
KVP_API int kvp_events_create(kvp_index *ix, const kvp_events_source *sources,
                              size_t n_sources, const kvp_events_opts *opts,
                              const kvp_allocator *alloc, kvp_events **out);
/* Stops the I/O thread if running, closes the sockets.  NULL is a no-op. */
KVP_API void kvp_events_destroy(kvp_events *ev);
/* Set before start / the first poll. */
KVP_API int kvp_events_on_batch(kvp_events *ev, kvp_events_batch_fn fn,
                                void *opaque);

/* Runs the I/O thread.  Returns 0, KVP_ESTATE (already started / polled),
 * or -errno from pthread_create. */
KVP_API int kvp_events_start(kvp_events *ev);
/* Stops and joins the I/O thread (destroy does it too).  Returns 0. */
KVP_API int kvp_events_stop(kvp_events *ev);

/* Asks source `source` (UINT32_MAX: every source with a replay socket) for
 * a replay from its last batch now -- what the idle probe does; the answer
 * is applied by the following polls (stats.replaying falls to 0 when all
 * are done).  Returns how many replays started, KVP_ERANGE, or KVP_ESTATE
 * (the I/O thread runs: it probes by itself). */
KVP_API int kvp_events_resync(kvp_events *ev, uint32_t source);

/* Event-loop form: the fd to watch -- one epoll set over every socket's
 * ZeroMQ notification fd, readable when a socket MAY have messages, the same
 * fd while sockets are reopened.  Stores it in fds[0] (when cap > 0) and
 * returns 1, or 0 when every source is external (nothing to watch).  Call
 * kvp_events_poll(ev, 0) whenever it is readable and at least every 100 ms
 * (replay deadlines and idle probes). */
KVP_API int kvp_events_fds(kvp_events *ev, int *fds, size_t cap);
/* Receives and applies what is there, waiting up to timeout_ms (-1 =
 * forever, 0 = not at all) for the first message.  Returns the number of
 * batches applied (>= 0) or KVP_ESTATE (the I/O thread runs). */
KVP_API int kvp_events_poll(kvp_events *ev, int timeout_ms);

/* Feeds batch `seq` (bytes payload[0, len), an EventBatch as published) of
 * EXTERNAL source `source` (endpoint NULL): exactly the live path of a
 * source without a replay socket.  In order it applies; the first batch a
 * source sees applies whatever its number (it starts where it joins); a
 * batch under a passed number with the bytes applied under it is a duplicate
 * (stats.duplicates; a ring of the last max(8192, 2 * pending_max) batches);
 * with other bytes the publisher restarted (stats.restarts: a new index
 * epoch, the old epoch's residency dropped, numbering from seq); a gap
 * (seq beyond the next) is a loss: stats.gaps and batches_missed count it,
 * the source's residency is dropped (stats.residency_drops: what the missed
 * batches removed may still be in the index) and the stream goes on from
 * seq.  A payload that does not decode is counted (stats.decode_errors) and
 * is a lost batch (residency dropped).  Then the on_batch callback, as for
 * a ZeroMQ source.  The payload is read during the call only.  Returns 0
 * (applied, or dropped as a duplicate: see the stats), KVP_EINVAL (ev NULL,
 * payload NULL with len > 0), KVP_ERANGE (source out of range or not
 * external) or KVP_ESTATE (the I/O thread runs).  Not thread-safe: from the
 * thread that polls (or no poll at all). */
KVP_API int kvp_events_feed(kvp_events *ev, uint32_t source, uint64_t seq,
                            const void *payload, size_t len);

typedef struct kvp_events_stats {
  uint64_t batches;      /* applied (live + replayed) */
  uint64_t events;       /* applied */
  uint64_t blocks_stored;
  uint64_t blocks_removed;
  uint64_t clears;       /* AllBlocksCleared applied */
  uint64_t gaps;         /* sequence gaps seen on live streams, or found
                            late: a probe's replay bringing batches past the
                            last one (a lost tail, a reconnect) */
  uint64_t batches_missed;   /* batches those gaps skipped */
  uint64_t replays;          /* replay requests sent */
  uint64_t batches_replayed; /* batches applied from replay */
  uint64_t replay_failures;  /* timed out, or the batches were gone */
  uint64_t residency_drops;  /* a source's residency dropped (lost events) */
  uint64_t restarts;         /* publisher restarts seen (new epochs) */
  uint64_t duplicates;       /* batches received twice (replay + live) */
  uint64_t decode_errors;    /* malformed frames or payloads */
  uint64_t unknown_events;   /* event types skipped */
  uint64_t unknown_fields;   /* fields ignored */
  uint64_t other_groups;     /* events of non-full-attention groups */
  uint64_t block_size_mismatch; /* events skipped: not the namespace's */
  uint64_t rekey_orphans;   /* stored blocks whose parent was unknown */
  uint64_t rekey_full;      /* blocks not indexed: map at capacity */
  uint64_t rekey_entries;   /* engine hashes remembered now */
  uint64_t rekey_bytes;     /* memory of those maps */
  uint64_t queue_drops;     /* live batches dropped during a replay */
  uint64_t index_errors;    /* index calls that failed */
  uint64_t topic_mismatch;  /* frames of another topic (prefix match) */
  uint64_t unknown_media;   /* events of a medium this version does not know */
  uint64_t stale;           /* live batches a resync overtook (not applied) */
  uint64_t connects;        /* SUB connections made (ZMTP handshakes done) */
  uint64_t disconnects;     /* SUB connections lost (each makes a resync;
                               one lost before its handshake counts too) */
  uint64_t replaying;       /* sources with a replay in flight now (gauge) */
  double lag_seconds;       /* the last batch applied: wall clock at its
                               delivery - its ts (fixed once applied) */
  double idle_seconds;      /* since the last batch was applied (wall) */
  uint64_t reserved[1];
} kvp_events_stats;

/* All sources (source = UINT32_MAX) or one.  Thread-safe (counters read
 * one by one).  Returns 0, KVP_EINVAL or KVP_ERANGE. */
KVP_API int kvp_events_stats_get(kvp_events *ev, uint32_t source,
                                 kvp_events_stats *out);
/* Prometheus text exposition 0.0.4: every counter above as
 * kvplane_events_<name>_total{source="i",worker="w"} (lag as a gauge),
 * snprintf-like into buf (cap-1 bytes + NUL); returns the full length or
 * KVP_EINVAL.  Thread-safe. */
KVP_API int kvp_events_prometheus(kvp_events *ev, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_EVENTS_H */
