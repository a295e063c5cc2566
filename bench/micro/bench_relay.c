/* SPDX-License-Identifier: Apache-2.0 */
/* KV events through NATS JetStream against the direct ZeroMQ path, same run:
 *   direct   engine PUB -> kvp_events (ZeroMQ tcp loopback) -> index
 *   relay    engine PUB -> `kvplane events relay` -> JetStream, every batch
 *            acked (file storage)
 *   rebuild  JetStream -> kvp_events_js -> index (a reader that starts after
 *            the stream holds every batch)
 * Rates are batches/s and block hashes/s; ratio = rate / direct rate.  The
 * rebuilt index must equal the direct one (digest), or the run fails.
 *   bench_relay [--quick] [--batches N] [--events E] [--blocks B]
 *               [--cli PATH] [--storage file|memory]
 * nats-server runs on a free loopback port in a temporary directory; 77
 * without it. */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

#include "bench_util.h"
#include "kvplane.h"
#include "kvplane/events.h"
#include "kvplane/events_nats.h"

#define BS 16

typedef struct cfg {
  size_t batches, events, blocks;
  bool quick;
  const char *cli, *storage;
} cfg;

typedef struct payload {
  char *p;
  size_t len;
} payload;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return bench_splitmix(&rng); }

static void die(const char *what) {
  fprintf(stderr, "bench_relay: %s\n", what);
  exit(1);
}

static void sleep_ms(int ms) {
  nanosleep(&(struct timespec){ms / 1000, (long)(ms % 1000) * 1000000L}, NULL);
}

static double secs_since(uint64_t t0) { return (double)(kvp_now_ns() - t0) * 1e-9; }

/* ---- the workload: vLLM 0.33-shaped batches of fresh BlockStored chains ------------ */

static void pstr(msgpack_packer *p, const char *s) {
  msgpack_pack_str(p, strlen(s));
  msgpack_pack_str_body(p, s, strlen(s));
}

static void pack_stored(msgpack_packer *p, size_t n) {
  msgpack_pack_map(p, 9);
  pstr(p, "type"), pstr(p, "BlockStored");
  pstr(p, "block_hashes"), msgpack_pack_array(p, n);
  for (size_t i = 0; i < n; i++)
    msgpack_pack_uint64(p, rnd() | 4);
  pstr(p, "parent_block_hash"), msgpack_pack_nil(p);
  pstr(p, "token_ids"), msgpack_pack_array(p, n * BS);
  for (size_t i = 0; i < n * BS; i++)
    msgpack_pack_uint32(p, (uint32_t)(rnd() % 150000));
  pstr(p, "block_size"), msgpack_pack_int(p, BS);
  pstr(p, "lora_id"), msgpack_pack_nil(p);
  pstr(p, "medium"), pstr(p, "GPU");
  pstr(p, "lora_name"), msgpack_pack_nil(p);
  pstr(p, "group_idx"), msgpack_pack_int(p, 0);
}

static payload *make_workload(const cfg *c) {
  payload *w = calloc(c->batches, sizeof *w);
  for (size_t b = 0; b < c->batches; b++) {
    msgpack_sbuffer sb;
    msgpack_packer p;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&p, &sb, msgpack_sbuffer_write);
    msgpack_pack_array(&p, 3);
    msgpack_pack_double(&p, 1.7e9 + (double)b);
    msgpack_pack_array(&p, c->events);
    for (size_t e = 0; e < c->events; e++)
      pack_stored(&p, c->blocks);
    msgpack_pack_int(&p, 0);
    w[b] = (payload){sb.data, sb.size};
    msgpack_sbuffer_release(&sb);
  }
  return w;
}

/* ---- the engine ---------------------------------------------------------------------- */

typedef struct engine {
  void *ctx, *pub;
  char ep[128];
  const payload *w;
  size_t n;
  _Atomic int go;
  pthread_t th;
} engine;

static void *engine_run(void *arg) {
  engine *e = arg;
  while (!atomic_load(&e->go))
    sleep_ms(1);
  for (size_t i = 0; i < e->n; i++) {
    uint8_t s[8];
    for (int k = 0; k < 8; k++)
      s[k] = (uint8_t)((uint64_t)i >> (56 - 8 * k));
    zmq_send(e->pub, "", 0, ZMQ_SNDMORE);
    zmq_send(e->pub, s, 8, ZMQ_SNDMORE);
    zmq_send(e->pub, e->w[i].p, e->w[i].len, 0);
  }
  return NULL;
}

static void engine_open(engine *e, const payload *w, size_t n) {
  memset(e, 0, sizeof *e);
  e->w = w, e->n = n;
  e->ctx = zmq_ctx_new();
  e->pub = zmq_socket(e->ctx, ZMQ_PUB);
  int hwm = 0, zero = 0; /* a benchmark must not drop */
  zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
  zmq_setsockopt(e->pub, ZMQ_LINGER, &zero, sizeof zero);
  if (zmq_bind(e->pub, "tcp://127.0.0.1:*") != 0)
    die("bind");
  size_t len = sizeof e->ep;
  zmq_getsockopt(e->pub, ZMQ_LAST_ENDPOINT, e->ep, &len);
  pthread_create(&e->th, NULL, engine_run, e);
}

static void engine_close(engine *e) {
  atomic_store(&e->go, 1);
  pthread_join(e->th, NULL);
  zmq_close(e->pub);
  zmq_ctx_term(e->ctx);
}

/* ---- nats-server and the relay --------------------------------------------------------- */

static int free_port(void) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(s, (struct sockaddr *)&a, &len) != 0)
    die("no free port");
  close(s);
  return ntohs(a.sin_port);
}

static bool port_open(int port) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = connect(s, (struct sockaddr *)&a, sizeof a) == 0;
  close(s);
  return ok;
}

static pid_t spawn(char *const argv[], const char *out) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE *f = freopen(out ? out : "/dev/null", "w", stdout);
    f = freopen("/dev/null", "w", stderr);
    (void)f;
    execvp(argv[0], argv);
    _exit(127);
  }
  return pid;
}

static int wait_exit(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static uint64_t json_u64(const char *path, const char *key) {
  char buf[4096], pat[64];
  FILE *f = fopen(path, "r");
  if (f == NULL)
    die("no relay output");
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *p = strstr(buf, pat);
  return p ? strtoull(p + strlen(pat), NULL, 10) : 0;
}

/* ---- the three paths ------------------------------------------------------------------- */

static kvp_index *new_index(void) {
  kvp_index *ix;
  if (kvp_index_create(NULL, NULL, &ix) < 0 || kvp_index_worker_add(ix, 0) < 0)
    die("index");
  return ix;
}

static uint64_t applied(kvp_events *ev) {
  kvp_events_stats s;
  kvp_events_stats_get(ev, UINT32_MAX, &s);
  return s.batches;
}

static double run_direct(const cfg *c, const payload *w, kvp_index **out) {
  engine e;
  engine_open(&e, w, c->batches);
  kvp_index *ix = new_index();
  kvp_events_source s = {.endpoint = e.ep, .keying = KVP_EVENTS_ENGINE_HASH};
  kvp_events_opts o = {.rcvhwm = 0x7fffffff};
  kvp_events *ev;
  if (kvp_events_create(ix, &s, 1, &o, NULL, &ev) < 0)
    die("subscriber");
  for (int i = 0; i < 40; i++)
    (void)kvp_events_poll(ev, 5); /* connected */
  uint64_t t0 = kvp_now_ns();
  atomic_store(&e.go, 1);
  while (applied(ev) < c->batches && kvp_events_poll(ev, 2000) > 0)
    ;
  double t = secs_since(t0);
  if (applied(ev) != c->batches)
    die("direct: batches missing");
  kvp_events_destroy(ev);
  engine_close(&e);
  *out = ix;
  return t;
}

static double run_relay(const cfg *c, const payload *w, const char *url,
                        const char *dir) {
  engine e;
  engine_open(&e, w, c->batches);
  char out[300], wk[300], maxb[32];
  snprintf(out, sizeof out, "%s/relay.json", dir);
  snprintf(wk, sizeof wk, "w0=%s", e.ep);
  snprintf(maxb, sizeof maxb, "%zu", c->batches);
  char *argv[] = {(char *)c->cli, "events", "relay", "--nats", (char *)url,
                  "--storage", (char *)c->storage, "--stats-every", "0",
                  "--max-batches", maxb, "--worker", wk, NULL};
  pid_t pid = spawn(argv, out);
  sleep_ms(1000); /* connected to NATS and the engine */
  uint64_t t0 = kvp_now_ns();
  atomic_store(&e.go, 1);
  int rc = wait_exit(pid); /* after every batch was acked */
  double t = secs_since(t0);
  engine_close(&e);
  if (rc != 0 || json_u64(out, "acked") != c->batches)
    die("relay: not every batch acked (or the relay failed)");
  return t;
}

static double run_rebuild(const cfg *c, const char *url, kvp_index **out) {
  kvp_index *ix = new_index();
  kvp_events_source s = {.keying = KVP_EVENTS_ENGINE_HASH}; /* external */
  kvp_events *ev;
  kvp_events_js *js;
  const char *names[1] = {"w0"};
  kvp_events_js_opts o = {.url = url};
  uint64_t t0 = kvp_now_ns();
  if (kvp_events_create(ix, &s, 1, NULL, NULL, &ev) < 0 ||
      kvp_events_js_create(ev, &o, names, 1, &js) < 0)
    die("reader");
  for (int idle = 0; applied(ev) < c->batches && idle < 200;)
    idle = kvp_events_js_poll(js, 10) > 0 ? 0 : idle + 1;
  double t = secs_since(t0);
  if (applied(ev) != c->batches)
    die("rebuild: batches missing");
  kvp_events_js_destroy(js);
  kvp_events_destroy(ev);
  *out = ix;
  return t;
}

/* ---- main ---------------------------------------------------------------------------- */

static int parse(int argc, char **argv, cfg *c) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--quick") == 0) {
      c->quick = true, c->batches = 2000;
      continue;
    }
    if (v == NULL)
      return -1;
    i++;
    if (strcmp(a, "--batches") == 0) c->batches = strtoull(v, NULL, 10);
    else if (strcmp(a, "--events") == 0) c->events = strtoull(v, NULL, 10);
    else if (strcmp(a, "--blocks") == 0) c->blocks = strtoull(v, NULL, 10);
    else if (strcmp(a, "--cli") == 0) c->cli = v;
    else if (strcmp(a, "--storage") == 0) c->storage = v;
    else return -1;
  }
  return c->batches && c->events && c->blocks ? 0 : -1;
}

static void row(const char *name, double t, const cfg *c, double direct_t) {
  double b = (double)c->batches, h = b * (double)(c->events * c->blocks);
  printf("%-34s %12.0f %14.0f %8.3f %9.3f\n", name, b / t, h / t, direct_t / t, t);
}

int main(int argc, char **argv) {
  cfg c = {.batches = 50000, .events = 4, .blocks = 4, .cli = KVP_CLI_PATH,
           .storage = "file"};
  if (parse(argc, argv, &c) < 0) {
    fprintf(stderr, "usage: bench_relay [--quick] [--batches N] [--events E] "
            "[--blocks B] [--cli PATH] [--storage file|memory]\n");
    return 2;
  }
  if (system("command -v nats-server >/dev/null 2>&1") != 0) {
    printf("SKIP: nats-server is not installed\n");
    return 77;
  }
  signal(SIGPIPE, SIG_IGN);
  char dir[] = "/tmp/kvp-bench-relay-XXXXXX", url[64], port_s[16];
  if (mkdtemp(dir) == NULL)
    die("mkdtemp");
  int port = free_port();
  snprintf(url, sizeof url, "nats://127.0.0.1:%d", port);
  snprintf(port_s, sizeof port_s, "%d", port);
  char *nargv[] = {"nats-server", "-js", "-a", "127.0.0.1", "-p", port_s, "-sd", dir, NULL};
  pid_t nats = spawn(nargv, NULL);
  for (int i = 0; i < 500 && !port_open(port); i++)
    sleep_ms(10);
  payload *w = make_workload(&c);
  kvp_index *ix_direct, *ix_js;
  double td = run_direct(&c, w, &ix_direct);
  double tr = run_relay(&c, w, url, dir);
  double tb = run_rebuild(&c, url, &ix_js);
  uint64_t d0, d1;
  kvp_index_digest(ix_direct, 0, &d0);
  kvp_index_digest(ix_js, 0, &d1);
  printf("bench_relay: %zu batches x %zu events x %zu blocks (%zu tokens/block), "
         "JetStream %s storage\n", c.batches, c.events, c.blocks, (size_t)BS, c.storage);
  printf("%-34s %12s %14s %8s %9s\n", "path", "batches/s", "hashes/s", "ratio", "seconds");
  row("direct: ZMQ -> kvp_events", td, &c, td);
  row("relay: ZMQ -> JetStream (acked)", tr, &c, td);
  row("rebuild: JetStream -> kvp_events", tb, &c, td);
  printf("index digests %s\n", d0 == d1 ? "equal" : "DIFFER");
  kill(nats, SIGTERM);
  wait_exit(nats);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0)
    fprintf(stderr, "bench_relay: could not remove %s\n", dir);
  kvp_index_destroy(ix_direct);
  kvp_index_destroy(ix_js);
  for (size_t i = 0; i < c.batches; i++)
    free(w[i].p);
  free(w);
  return d0 == d1 ? 0 : 1;
}
