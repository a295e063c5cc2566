/* SPDX-License-Identifier: Apache-2.0 */
/* `kvplane events tail`: subscribes to one engine's KV-event stream with the
 * library's subscriber (replay, restart detection, the index), prints what
 * it decodes, and at exit the residency the index holds and the stats. */
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_events.h"
#include "kvplane.h"
#include "kvplane/events.h"

#define EXIT_USAGE 2

static const char tail_usage[] =
    "usage: kvplane events tail [options] ENDPOINT\n"
    "\n"
    "Subscribes to a vLLM KV-event stream (ZeroMQ PUB, e.g. tcp://host:5557 or\n"
    "ipc:///tmp/kv.sock; a '*' in it binds instead: the engine dials in),\n"
    "applies it to an index as kvplane-routerd would, and prints it.\n"
    "\n"
    "  --json             one JSON object per event: seq, type, medium,\n"
    "                     block_hashes (ints, or hex strings for byte\n"
    "                     hashes), parent_block_hash, token_count\n"
    "  --replay ENDPOINT  the engine's replay ROUTER socket: missed batches\n"
    "                     are asked for (from seq 0 at start, and on gaps)\n"
    "  --topic T          the publisher's topic (default: every topic)\n"
    "  --dp-rank R        data-parallel rank: ports + R, as vLLM offsets them\n"
    "  --max-batches N    exit after N batches were applied\n"
    "  --idle-ms MS       exit after MS ms without a batch applied\n"
    "  --index            at exit, print the residency the index holds, per\n"
    "                     medium, as published: {\"resident\": {\"GPU\": [...]}}\n"
    "                     (with --rekey: kvplane keys' low 64 bits, the\n"
    "                     EXTERNAL_U64 of `kvplane hash --model\n"
    "                     kvplane-events-tail --tokenizer - --layout -`)\n"
    "  --rekey BS         also re-key blocks of BS tokens with kvplane's chain\n"
    "                     (XXH3-128, the namespace above; each block's extra\n"
    "                     keys -- cache salt, LoRA, mm -- from the event; counts\n"
    "                     orphans and map memory in the stats)\n"
    "Once the first connection to the publisher is made (the ZMTP handshake),\n"
    "stderr says \"kvplane events: connected to ENDPOINT\": what the publisher\n"
    "sends from then on reaches the tail (events before it need --replay).\n"
    "At exit (the limits above, SIGINT or SIGTERM) a last line {\"stats\":\n"
    "{...}} holds the subscriber's counters.\n";

typedef struct tail_opts {
  const char *endpoint, *replay, *topic;
  uint32_t dp_rank, rekey_bs;
  uint64_t max_batches;
  uint64_t idle_ms;
  bool json, index;
} tail_opts;

/* digests of byte-form hashes, to print the index's fingerprints as
 * published */
typedef struct seen_digest {
  uint64_t u64;
  uint8_t len;
  uint8_t d[32];
} seen_digest;

typedef struct tail_state {
  const tail_opts *o;
  seen_digest *dig;
  size_t n_dig, cap_dig;
  char medium[KVP_TIER_COUNT_][32]; /* the name each tier was published as */
  uint64_t last_batch_ns;
} tail_state;

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig) {
  (void)sig;
  stop_flag = 1;
}

/* "kvplane events: WHAT ARG" (ARG may be NULL). */
static int usage(const char *what, const char *arg) {
  fprintf(stderr, "kvplane events: %s%s%s\n(see kvplane events tail --help)\n",
          what, arg ? " " : "", arg ? arg : "");
  return EXIT_USAGE;
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out) {
  char *end;
  if (s[0] < '0' || s[0] > '9')
    return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end != 0 || v > max)
    return false;
  *out = v;
  return true;
}

enum { O_JSON = 256, O_REPLAY, O_TOPIC, O_DP, O_MAX, O_IDLE, O_INDEX, O_REKEY };

static int parse_num(const char *name, const char *s, uint64_t max,
                     uint64_t *out) {
  return parse_u64(s, max, out) ? 0 : usage("bad value for", name);
}

static int parse_tail(int argc, char **argv, tail_opts *o) {
  static const struct option lo[] = {
      {"json", no_argument, 0, O_JSON},         {"replay", required_argument, 0, O_REPLAY},
      {"topic", required_argument, 0, O_TOPIC}, {"dp-rank", required_argument, 0, O_DP},
      {"max-batches", required_argument, 0, O_MAX},
      {"idle-ms", required_argument, 0, O_IDLE}, {"index", no_argument, 0, O_INDEX},
      {"rekey", required_argument, 0, O_REKEY}, {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  int c, rc = 0;
  uint64_t v = 0;
  optind = 1;
  while (rc == 0 && (c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
    switch (c) {
    case O_JSON: o->json = true; break;
    case O_INDEX: o->index = true; break;
    case O_REPLAY: o->replay = optarg; break;
    case O_TOPIC: o->topic = optarg; break;
    case O_DP: rc = parse_num("--dp-rank", optarg, 65535, &v); o->dp_rank = (uint32_t)v; break;
    case O_MAX: rc = parse_num("--max-batches", optarg, UINT64_MAX, &o->max_batches); break;
    case O_IDLE: rc = parse_num("--idle-ms", optarg, UINT32_MAX, &o->idle_ms); break;
    case O_REKEY: rc = parse_num("--rekey", optarg, KVP_BLOCK_SIZE_MAX, &v); o->rekey_bs = (uint32_t)v;
      if (rc == 0 && v == 0) rc = usage("--rekey needs a block size >= 1", NULL);
      break;
    case 'h': fputs(tail_usage, stdout); return 0;
    default: return usage("bad option", NULL);
    }
  }
  if (rc != 0)
    return rc;
  if (optind != argc - 1)
    return usage("exactly one ENDPOINT is required", NULL);
  o->endpoint = argv[optind];
  return -1; /* go on */
}

/* ---- printing ------------------------------------------------------------------ */

static void print_hash(const kvp_ehash *h) {
  if (h->len == 0) {
    printf("%" PRIu64, h->u64);
    return;
  }
  putchar('"');
  for (unsigned i = 0; i < h->len; i++)
    printf("%02x", h->digest[i]);
  putchar('"');
}

static void json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\')
      printf("\\%c", c);
    else if (c < 0x20)
      printf("\\u%04x", c);
    else
      putchar(c);
  }
  putchar('"');
}

static void print_event(uint64_t seq, const kvp_kv_event *e) {
  printf("{\"seq\": %" PRIu64 ", \"type\": ", seq);
  json_str(kvp_kv_event_type_name(e->type));
  printf(", \"medium\": ");
  if (e->medium)
    json_str(e->medium);
  else
    printf("null");
  printf(", \"block_hashes\": [");
  for (size_t i = 0; i < e->n_hashes; i++) {
    if (i)
      printf(", ");
    print_hash(&e->hashes[i]);
  }
  printf("], \"parent_block_hash\": ");
  if (e->parent)
    print_hash(e->parent);
  else
    printf("null");
  printf(", \"token_count\": %zu}\n", e->n_tokens);
}

static void remember(tail_state *st, const kvp_kv_event *e) {
  if (e->medium != NULL && e->tier < KVP_TIER_COUNT_ &&
      st->medium[e->tier][0] == 0)
    snprintf(st->medium[e->tier], sizeof st->medium[0], "%s", e->medium);
  for (size_t i = 0; i < e->n_hashes && e->type == KVP_KV_BLOCK_STORED; i++) {
    if (e->hashes[i].len == 0)
      continue;
    if (st->n_dig == st->cap_dig) {
      size_t nc = st->cap_dig ? 2 * st->cap_dig : 1024;
      seen_digest *nd = realloc(st->dig, nc * sizeof *nd);
      if (nd == NULL)
        return;
      st->dig = nd, st->cap_dig = nc;
    }
    seen_digest *d = &st->dig[st->n_dig++];
    d->u64 = e->hashes[i].u64;
    d->len = e->hashes[i].len;
    memcpy(d->d, e->hashes[i].digest, sizeof d->d);
  }
}

static void on_batch(void *opaque, uint32_t source, uint64_t seq,
                     const kvp_kv_batch *b) {
  tail_state *st = opaque;
  (void)source;
  st->last_batch_ns = kvp_now_ns();
  for (size_t i = 0; i < b->n_events; i++) {
    if (st->o->index && !st->o->rekey_bs) /* re-keyed: kvplane keys */
      remember(st, &b->events[i]);
    if (st->o->json)
      print_event(seq, &b->events[i]);
  }
  if (!st->o->json)
    printf("batch %" PRIu64 ": %zu events%s\n", seq, b->n_events,
           b->unknown_events ? " (+ unknown types)" : "");
  fflush(stdout);
}

/* ---- --index -------------------------------------------------------------------- */

typedef struct res_ent {
  uint64_t fp;
  uint32_t tiers;
} res_ent;

typedef struct res_list {
  res_ent *v;
  size_t n, cap;
} res_list;

static int collect(void *opaque, uint64_t fp, uint32_t tier_mask) {
  res_list *l = opaque;
  if (l->n == l->cap) {
    size_t nc = l->cap ? 2 * l->cap : 1024;
    res_ent *nv = realloc(l->v, nc * sizeof *nv);
    if (nv == NULL)
      return KVP_ENOMEM;
    l->v = nv, l->cap = nc;
  }
  l->v[l->n++] = (res_ent){fp, tier_mask};
  return 0;
}

static int cmp_dig(const void *a, const void *b) {
  uint64_t x = ((const seen_digest *)a)->u64, y = ((const seen_digest *)b)->u64;
  return x < y ? -1 : x > y;
}

static int cmp_res(const void *a, const void *b) {
  uint64_t x = ((const res_ent *)a)->fp, y = ((const res_ent *)b)->fp;
  return x < y ? -1 : x > y;
}

static const seen_digest *digest_of(const tail_state *st, uint64_t fp) {
  seen_digest key = {.u64 = fp};
  if (st->n_dig == 0) /* bsearch's base must not be NULL */
    return NULL;
  return bsearch(&key, st->dig, st->n_dig, sizeof key, cmp_dig);
}

/* Byte-form hashes sort by their hex text, ints by value (the publisher
 * uses one form). */
static int cmp_hex(const void *a, const void *b) {
  const seen_digest *x = *(seen_digest *const *)a, *y = *(seen_digest *const *)b;
  size_t n = x->len < y->len ? x->len : y->len;
  int c = memcmp(x->d, y->d, n);
  return c ? c : (x->len > y->len) - (x->len < y->len);
}

static void print_tier(const tail_state *st, const res_list *l, int t) {
  const seen_digest **hex = calloc(l->n + 1, sizeof *hex);
  size_t nh = 0;
  bool first = true;
  for (size_t i = 0; i < l->n; i++) {
    if (!(l->v[i].tiers & (1u << t)))
      continue;
    const seen_digest *d = digest_of(st, l->v[i].fp);
    if (d != NULL && hex != NULL) {
      hex[nh++] = d;
      continue;
    }
    printf("%s%" PRIu64, first ? "" : ", ", l->v[i].fp);
    first = false;
  }
  if (hex != NULL)
    qsort(hex, nh, sizeof *hex, cmp_hex);
  for (size_t i = 0; i < nh; i++) {
    printf("%s\"", first ? "" : ", ");
    for (unsigned k = 0; k < hex[i]->len; k++)
      printf("%02x", hex[i]->d[k]);
    putchar('"');
    first = false;
  }
  free(hex);
}

static int print_index(tail_state *st, kvp_index *ix) {
  res_list l = {0};
  int rc = kvp_index_worker_keys(ix, 0, collect, &l);
  if (rc < 0) {
    free(l.v);
    fprintf(stderr, "kvplane events: index walk failed: %s\n", kvp_strerror(rc));
    return rc;
  }
  if (l.n > 1) /* qsort's base must not be NULL, even for 0 elements */
    qsort(l.v, l.n, sizeof *l.v, cmp_res);
  if (st->n_dig > 1)
    qsort(st->dig, st->n_dig, sizeof *st->dig, cmp_dig);
  static const char *fallback[KVP_TIER_COUNT_] = {"GPU", "CPU", "STORAGE", "REMOTE"};
  printf("{\"resident\": {");
  bool first = true;
  for (int t = 0; t < KVP_TIER_COUNT_; t++) {
    bool any = st->medium[t][0] != 0;
    for (size_t i = 0; i < l.n && !any; i++)
      any = (l.v[i].tiers & (1u << t)) != 0;
    if (!any)
      continue;
    printf("%s", first ? "" : ", ");
    json_str(st->medium[t][0] ? st->medium[t] : fallback[t]);
    printf(": [");
    print_tier(st, &l, t);
    printf("]");
    first = false;
  }
  printf("}}\n");
  free(l.v);
  return 0;
}

static void print_stats(kvp_events *ev) {
  kvp_events_stats s;
  if (kvp_events_stats_get(ev, UINT32_MAX, &s) < 0)
    return;
  printf("{\"stats\": {\"batches\": %" PRIu64 ", \"events\": %" PRIu64
         ", \"blocks_stored\": %" PRIu64 ", \"blocks_removed\": %" PRIu64
         ", \"clears\": %" PRIu64 ", \"gaps\": %" PRIu64
         ", \"batches_missed\": %" PRIu64 ", \"replays\": %" PRIu64
         ", \"batches_replayed\": %" PRIu64 ", \"replay_failures\": %" PRIu64
         ", \"residency_drops\": %" PRIu64 ", \"restarts\": %" PRIu64
         ", \"duplicates\": %" PRIu64 ", \"decode_errors\": %" PRIu64
         ", \"unknown_events\": %" PRIu64 ", \"unknown_fields\": %" PRIu64
         ", \"other_groups\": %" PRIu64 ", \"block_size_mismatch\": %" PRIu64
         ", \"rekey_orphans\": %" PRIu64 ", \"rekey_full\": %" PRIu64
         ", \"rekey_entries\": %" PRIu64 ", \"rekey_bytes\": %" PRIu64
         ", \"queue_drops\": %" PRIu64 ", \"index_errors\": %" PRIu64
         ", \"topic_mismatch\": %" PRIu64 ", \"connects\": %" PRIu64
         ", \"disconnects\": %" PRIu64 "}}\n",
         s.batches, s.events, s.blocks_stored, s.blocks_removed, s.clears,
         s.gaps, s.batches_missed, s.replays, s.batches_replayed,
         s.replay_failures, s.residency_drops, s.restarts, s.duplicates,
         s.decode_errors, s.unknown_events, s.unknown_fields, s.other_groups,
         s.block_size_mismatch, s.rekey_orphans, s.rekey_full,
         s.rekey_entries, s.rekey_bytes, s.queue_drops, s.index_errors,
         s.topic_mismatch, s.connects, s.disconnects);
}

/* ---- the loop ------------------------------------------------------------------- */

static uint64_t batches(kvp_events *ev) {
  kvp_events_stats s;
  return kvp_events_stats_get(ev, UINT32_MAX, &s) == 0 ? s.batches : 0;
}

/* Idle: one resync as a probe (a lost last batch, a restart never seen
 * live); done when it brought nothing new. */
static bool probe_found_more(kvp_events *ev) {
  uint64_t before = batches(ev);
  if (kvp_events_resync(ev, UINT32_MAX) <= 0)
    return false;
  kvp_events_stats s;
  do {
    if (kvp_events_poll(ev, 20) < 0 || stop_flag)
      return false;
  } while (kvp_events_stats_get(ev, UINT32_MAX, &s) == 0 && s.replaying > 0);
  return batches(ev) != before;
}

static bool done(tail_state *st, kvp_events *ev, uint64_t start_ns) {
  if (stop_flag)
    return true;
  if (st->o->max_batches && batches(ev) >= st->o->max_batches)
    return true;
  uint64_t since = st->last_batch_ns ? st->last_batch_ns : start_ns;
  if (!st->o->idle_ms || kvp_now_ns() - since < st->o->idle_ms * 1000000u)
    return false;
  if (!probe_found_more(ev))
    return true;
  st->last_batch_ns = kvp_now_ns();
  return st->o->max_batches && batches(ev) >= st->o->max_batches;
}

static int run_tail(const tail_opts *o) {
  kvp_index *ix = NULL;
  kvp_events *ev = NULL;
  kvp_namespace ns;
  tail_state st = {.o = o};
  kvp_events_source src = {.endpoint = o->endpoint, .replay_endpoint = o->replay,
                           .topic = o->topic, .dp_rank = o->dp_rank,
                           .keying = KVP_EVENTS_ENGINE_HASH};
  if (o->rekey_bs) {
    kvp_namespace_desc d = {.model_id = "kvplane-events-tail", .tokenizer_id = "-",
                            .kv_layout = "-", .block_size = o->rekey_bs};
    if (kvp_namespace_init(&d, &ns) < 0)
      return usage("bad --rekey block size", NULL);
    src.keying = KVP_EVENTS_REKEY;
    src.ns = &ns;
  }
  int rc = kvp_index_create(NULL, NULL, &ix);
  if (rc == 0)
    rc = kvp_index_worker_add(ix, 0);
  if (rc == 0)
    /* the tool probes when idle itself (--idle-ms), see done() */
    rc = kvp_events_create(ix, &src, 1,
                           &(kvp_events_opts){.probe_idle_ms = UINT32_MAX},
                           NULL, &ev);
  if (rc == 0)
    rc = kvp_events_on_batch(ev, on_batch, &st);
  if (rc < 0) {
    fprintf(stderr, "kvplane events: cannot subscribe to %s: %s\n", o->endpoint,
            kvp_strerror(rc));
    kvp_events_destroy(ev);
    kvp_index_destroy(ix);
    return EXIT_USAGE;
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  uint64_t start = kvp_now_ns();
  bool told = false;
  while (!done(&st, ev, start) && (rc = kvp_events_poll(ev, 20)) >= 0) {
    kvp_events_stats s;
    if (!told && kvp_events_stats_get(ev, UINT32_MAX, &s) == 0 && s.connects) {
      /* from here on the publisher sends to us: scripts wait for this line */
      fprintf(stderr, "kvplane events: connected to %s\n", o->endpoint);
      told = true;
    }
  }
  if (o->index)
    (void)print_index(&st, ix);
  print_stats(ev);
  kvp_events_destroy(ev);
  kvp_index_destroy(ix);
  free(st.dig);
  return rc < 0 ? 1 : 0;
}

int kvp_cli_events(int argc, char **argv) {
  const char *sub = argc > 1 ? argv[1] : NULL;
  if (sub == NULL || strcmp(sub, "--help") == 0 || strcmp(sub, "help") == 0) {
    fputs(tail_usage, sub ? stdout : stderr);
    return sub ? 0 : EXIT_USAGE;
  }
  if (strcmp(sub, "relay") == 0)
    return kvp_cli_relay(argc - 1, argv + 1);
  if (strcmp(sub, "tail") != 0)
    return usage("unknown events command", sub);
  tail_opts o = {0};
  int rc = parse_tail(argc - 1, argv + 1, &o);
  return rc >= 0 ? rc : run_tail(&o);
}
