/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane KV events read back from NATS JetStream (connectors/events,
 * library kvplane-events; libnats): the reader side of `kvplane events
 * relay`, which publishes every engine's batches to the subject
 * <prefix>.<worker name> of one stream, headers Kvp-Seq (the engine's
 * sequence number, decimal) and Nats-Msg-Id "<name>:<seq>:<xxh3 hex>" (the
 * stream's duplicate window drops a batch relayed twice).
 *
 * A reader subscribes to each worker's subject from the stream's first
 * stored message (an ordered ephemeral push consumer, DeliverAll), so a
 * router replica that starts late or restarts rebuilds its index from the
 * stream rather than from every engine's replay buffer.  Each message goes
 * to kvp_events_feed() of the matching EXTERNAL source (endpoint NULL) of a
 * kvp_events: dedup, gaps, restarts, decode errors as documented there.
 *
 * NATS down: create succeeds all the same (the connection retries forever
 * in the background, every 250 ms); poll returns 0 while disconnected; when
 * NATS returns, the subscriptions resume where the stream left off (the
 * ordered consumer restarts after the last stream sequence delivered).
 * Disconnects, reconnects and skipped messages are counted.
 *
 * Threading: libnats delivers on its own threads into a bounded queue (a
 * full queue holds delivery back, and the server's flow control with it);
 * kvp_events_js_poll() drains the queue into kvp_events_feed() on the
 * caller's thread -- the thread that polls the kvp_events (never beside its
 * I/O thread).  libkvplane.so does not link libnats; libkvplane-events
 * does. */
#ifndef KVPLANE_EVENTS_NATS_H
#define KVPLANE_EVENTS_NATS_H

#include "kvplane/events.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_events_js kvp_events_js;

typedef struct kvp_events_js_opts {
  const char *url;            /* NULL = "nats://127.0.0.1:4222" */
  const char *stream;         /* NULL = "KVPLANE_EVENTS" */
  const char *subject_prefix; /* NULL = "kvplane.events" */
  uint32_t reserved[8];
} kvp_events_js_opts;

/* Reads `ev`'s EXTERNAL sources 0..n-1 from JetStream: names[i] is the
 * relay's worker name of source i (its subject <prefix>.<names[i]>; n must
 * equal ev's source count; names are copied).  Connects (or keeps trying in
 * the background when NATS is unreachable) and subscribes from the stream's
 * first stored message (retried every 250 ms while the stream does not
 * exist yet).  Returns 0, KVP_EINVAL (a NULL argument, n not ev's source
 * count, a name empty or with '.', '*', '>' or white space, a bad URL: the
 * reason logged), KVP_ERANGE (source i is not external), KVP_EIO (libnats
 * refused the options; logged) or KVP_ENOMEM.  `ev` is borrowed: it must
 * outlive the reader. */
KVP_API int kvp_events_js_create(kvp_events *ev, const kvp_events_js_opts *o,
                                 const char *const *names, size_t n,
                                 kvp_events_js **out);

/* Feeds what has arrived into kvp_events_feed (seq from the message's
 * Kvp-Seq header; a message without a valid one is counted as bad and
 * skipped), waiting up to timeout_ms (0 = not at all; < 0 = 0) for the
 * first message; never blocks longer than that (a batch or so of feeding
 * aside).  Safe from an event-loop timer.  Returns the number of messages
 * fed (>= 0; 0 while NATS is down), KVP_EINVAL, or kvp_events_feed's
 * KVP_ESTATE (ev's I/O thread runs). */
KVP_API int kvp_events_js_poll(kvp_events_js *js, int timeout_ms);

/* 1 when the connection to NATS is up now, else 0 (also for NULL). */
KVP_API int kvp_events_js_connected(const kvp_events_js *js);

typedef struct kvp_events_js_stats {
  uint64_t messages;      /* received from JetStream */
  uint64_t fed;           /* passed to kvp_events_feed */
  uint64_t bad_messages;  /* no Kvp-Seq header, or not a decimal u64: skipped */
  uint64_t disconnects;   /* connection to NATS lost */
  uint64_t reconnects;    /* connection to NATS back */
  uint64_t subscribes;    /* subscriptions made (first and again) */
  uint64_t subscribe_errors; /* tries that failed (no stream yet, NATS down) */
  uint64_t queued;        /* gauge: messages received, not yet fed */
  uint64_t connected;     /* gauge: 1 while NATS is reachable */
  uint64_t subscribed;    /* gauge: sources with a live subscription */
  uint64_t stream_resets; /* the stream was made again (numbered from 1):
                             every source read over from its start */
  uint64_t reserved[5];
} kvp_events_js_stats;

/* Thread-safe.  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_events_js_stats_get(const kvp_events_js *js,
                                    kvp_events_js_stats *out);
/* Prometheus text 0.0.4: kvplane_events_js_<counter>_total and the gauges
 * kvplane_events_js_{queued,connected,subscribed}, snprintf-like into buf;
 * returns the full length or KVP_EINVAL.  Thread-safe. */
KVP_API int kvp_events_js_prometheus(const kvp_events_js *js, char *buf,
                                     size_t cap);

/* Unsubscribes, closes the connection, frees what is still queued.  NULL is
 * a no-op. */
KVP_API void kvp_events_js_destroy(kvp_events_js *js);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_EVENTS_NATS_H */
