/* SPDX-License-Identifier: Apache-2.0 */
/* bench_routerd: the latency and CPU that kvplane-routerd adds in front of
 * an OpenAI-compatible worker, beside nginx (a plain round-robin proxy: the
 * floor of any proxy), vllm-router and sglang-router, in one run on
 * loopback.  Every target proxies to the same stub workers (answering at
 * once); each (prompt, rate) cell runs all targets back to back; "added" is
 * the target's percentile minus direct's in the same cell.
 * kvplane-routerd-x3 is three replicas synced through a nats-server started
 * here, the requests spread round robin over them as a load balancer would:
 * per replica CPU, sync messages/s and sync lag beside one router's row.
 * kvplane-routerd-t2 / -t4 are one router with routerd.threads: 2 / 4
 * (front-door loops on one SO_REUSEPORT address; only with --only).
 *   bench_routerd [--quick] [--duration S] [--rates 2000,10000,max]
 *                 [--only direct,kvplane-routerd,...] [--check] ...
 * docs/performance.md ("kvplane-routerd") has the numbers. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>

#include "bench_routerd.h"

#ifndef KVP_ROUTERD_BIN
#define KVP_ROUTERD_BIN "kvplane-routerd"
#endif
#ifndef KVP_SOURCE_DIR
#define KVP_SOURCE_DIR "."
#endif

enum { T_DIRECT, T_ROUTERD, T_FLEET, T_NGINX, T_VLLM, T_SGLANG, T_ROUTERD_T2,
       T_ROUTERD_T4, T_N };
static const char *const k_tname[T_N] = {
    "direct",        "kvplane-routerd",    "kvplane-routerd-x3",
    "nginx",         "vllm-router",        "sglang-router",
    "kvplane-routerd-t2", "kvplane-routerd-t4"};

/* routerd.threads of a one-process kvplane-routerd target; 0: not one */
static uint32_t routerd_threads(int k) {
  return k == T_ROUTERD ? 1 : k == T_ROUTERD_T2 ? 2 : k == T_ROUTERD_T4 ? 4 : 0;
}
#define FLEET_N 3 /* replicas of kvplane-routerd-x3 */
enum { P_SMALL, P_32K, P_N };
static const char *const k_pname[P_N] = {"small", "32k"};

#define MAX_RATES 8
#define N_BODIES 16

typedef struct opts {
  double duration, warmup, timeout, grace;
  double rates[MAX_RATES]; /* 0 = "max": closed loop */
  uint32_t n_rates;
  bool prompt[P_N], want[T_N];
  uint32_t workers, concurrency, conns, tokens;
  const char *out, *routerd, *venv, *nginx, *peer_policy, *routerd_policy;
  const char *nats_server;
  bool check, quick;
} opts;

typedef struct target {
  int kind;
  bool up;
  pid_t pid;
  uint16_t port;
  pid_t nats, rpid[FLEET_N]; /* kvplane-routerd-x3 */
  uint16_t nats_port, rport[FLEET_N];
  char note[200];
} target;

/* one replica of kvplane-routerd-x3 over a cell: its own /metrics' deltas */
typedef struct rep_row {
  double requests;        /* it received */
  double cpu_us, cpu_pct; /* per request it received; of one core */
  double pub_s, recv_s;   /* sync messages, all types */
  double lag_p50_ms, lag_p99_ms; /* publish to apply, since its start */
} rep_row;

typedef struct row {
  int t, p;
  double rate;
  br_load_result r;
  double cpu_us, stub_us, client_us; /* per request; NAN = n/a */
  double cpu_pct;                    /* the router's CPU, % of one core */
  rep_row rep[FLEET_N];              /* kvplane-routerd-x3 */
  double nats_us, nats_pct;          /* its nats-server */
} row;

typedef struct bench {
  opts o;
  br_stub stub;
  target tg[T_N];
  char *body[P_N][N_BODIES];
  size_t body_len[P_N][N_BODIES];
  row *rows;
  size_t n_rows;
  char load0[64], load1[64];
} bench;

/* ---- processes ---------------------------------------------------------------- */
static uint16_t free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  uint16_t p = 0;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &al) == 0)
    p = ntohs(a.sin_port);
  if (fd >= 0)
    close(fd);
  return p;
}

/* argv[0] with its output in log; its own process group, killed with us */
static pid_t spawn(char *const argv[], const char *log) {
  pid_t p = fork();
  if (p != 0)
    return p;
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  execv(argv[0], argv);
  fprintf(stderr, "bench_routerd: exec %s: %s\n", argv[0], strerror(errno));
  _exit(127);
}

static void reap(pid_t pid) {
  if (pid <= 0)
    return;
  kill(-pid, SIGTERM);
  for (int i = 0; i < 50; i++) {
    if (waitpid(pid, NULL, WNOHANG) == pid)
      return;
    usleep(100000);
  }
  kill(-pid, SIGKILL);
  waitpid(pid, NULL, 0);
}

static bool alive(pid_t pid) { return waitpid(pid, NULL, WNOHANG) == 0; }

/* utime + stime (clock ticks) of pid and its descendants */
static double tree_cpu_s(pid_t root) {
  enum { MAXP = 65536 };
  static pid_t pid[MAXP], ppid[MAXP];
  static double cpu[MAXP];
  size_t n = 0;
  DIR *d = opendir("/proc");
  struct dirent *e;
  while (d && (e = readdir(d)) != NULL && n < MAXP) {
    char path[300], buf[1024];
    if (e->d_name[0] < '0' || e->d_name[0] > '9')
      continue;
    snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    size_t len = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
      fclose(f);
    buf[len] = '\0';
    char *rp = strrchr(buf, ')');
    unsigned long ut, st;
    int pp;
    if (rp && sscanf(rp + 2, "%*c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
                     &pp, &ut, &st) == 3) {
      pid[n] = (pid_t)atoi(e->d_name), ppid[n] = pp;
      cpu[n++] = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
    }
  }
  if (d)
    closedir(d);
  double sum = 0;
  for (size_t i = 0; i < n; i++)
    for (pid_t q = pid[i], hops = 0; q > 1 && hops < 64; hops++) {
      if (q == root) {
        sum += cpu[i];
        break;
      }
      size_t j = 0;
      while (j < n && pid[j] != q)
        j++;
      q = j < n ? ppid[j] : 0;
    }
  return sum;
}

static double self_cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static int threads_of(pid_t pid) {
  char path[64], line[256];
  int n = 0;
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "Threads: %d", &n) == 1)
      break;
  if (f)
    fclose(f);
  return n;
}

/* ---- prompts ------------------------------------------------------------------ */
static uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static char *body_tokens(uint32_t v, uint32_t n, size_t *len) {
  size_t cap = 128 + (size_t)n * 8;
  char *s = malloc(cap), *p = s;
  if (s == NULL)
    return NULL;
  p += sprintf(p, "{\"model\":\"bench\",\"prompt\":[");
  for (uint32_t i = 0; i < n; i++)
    p += sprintf(p, "%s%u", i ? "," : "",
                 256 + (uint32_t)(mix(((uint64_t)v << 32) | i) % 120000));
  p += sprintf(p, "],\"max_tokens\":1,\"temperature\":0}");
  *len = (size_t)(p - s);
  return s;
}

static char *body_text(uint32_t v, size_t *len) {
  char *s = malloc(512);
  if (s == NULL)
    return NULL;
  int n = snprintf(s, 512,
                   "{\"model\":\"bench\",\"prompt\":\"Request %u: summarise the "
                   "three main causes of tail latency in a reverse proxy, in "
                   "one sentence.\",\"max_tokens\":1,\"temperature\":0}",
                   v);
  *len = (size_t)n;
  return s;
}

static int make_bodies(bench *B) {
  for (uint32_t v = 0; v < N_BODIES; v++) {
    B->body[P_SMALL][v] = body_text(v, &B->body_len[P_SMALL][v]);
    B->body[P_32K][v] = body_tokens(v, B->o.tokens, &B->body_len[P_32K][v]);
    if (!B->body[P_SMALL][v] || !B->body[P_32K][v])
      return -1;
  }
  return 0;
}

/* ---- targets ------------------------------------------------------------------ */
static void worker_url(const bench *B, uint32_t i, char *dst, size_t cap) {
  snprintf(dst, cap, "http://127.0.0.1:%u", B->stub.port[i]);
}

static int write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return -1;
  fputs(text, f);
  return fclose(f);
}

/* One kvplane-routerd on port with `threads` front-door loops; id > 0:
 * replica id of kvplane-routerd-x3, synced through the nats-server on
 * nats_port. */
static pid_t routerd_proc(bench *B, uint16_t port, uint32_t id,
                          uint16_t nats_port, uint32_t threads) {
  char cfg[8192], path[600], log[600], url[64], name[32];
  if (id)
    snprintf(name, sizeof name, "routerd-x3-%u", id);
  else
    snprintf(name, sizeof name, threads > 1 ? "routerd-t%u" : "routerd",
             threads);
  int n = snprintf(cfg, sizeof cfg,
                   "# bench_routerd: token-id prompts route as sent; text "
                   "prompts in approximate\n# (character) mode -- no render "
                   "call (the stub worker has no tokenizer)\n"
                   "routerd:\n  listen: 127.0.0.1:%u\n  render: false\n"
                   "  policy: %s\n",
                   port, B->o.routerd_policy);
  if (threads > 1) /* unset for one: --routerd may name an older binary */
    n += snprintf(cfg + n, sizeof cfg - (size_t)n, "  threads: %u\n",
                  threads);
  n += snprintf(cfg + n, sizeof cfg - (size_t)n, "workers:\n  urls: [");
  for (uint32_t i = 0; i < B->stub.n; i++) {
    worker_url(B, i, url, sizeof url);
    n += snprintf(cfg + n, sizeof cfg - (size_t)n, "%s%s", i ? ", " : "", url);
  }
  n += snprintf(cfg + n, sizeof cfg - (size_t)n, "]\nmodel:\n  block_size: 16\n");
  if (id) /* sync defaults otherwise: snapshot 100 ms, peer timeout 1 s */
    snprintf(cfg + n, sizeof cfg - (size_t)n, "replicas:\n  nats_url: "
             "nats://127.0.0.1:%u\n  replica_id: %u\n  subject_prefix: "
             "kvplane.bench\n", nats_port, id);
  snprintf(path, sizeof path, "%s/%s.yaml", B->o.out, name);
  snprintf(log, sizeof log, "%s/%s.log", B->o.out, name);
  if (write_file(path, cfg) < 0)
    return -1;
  char *argv[] = {(char *)B->o.routerd, "--config", path, "--log", "warn", NULL};
  return spawn(argv, log);
}

static pid_t start_routerd(bench *B, target *t) {
  uint32_t n = routerd_threads(t->kind);
  snprintf(t->note, sizeof t->note, "policy %s, %u front-door thread%s "
           "(libevent)", B->o.routerd_policy, n, n > 1 ? "s" : "");
  return routerd_proc(B, t->port, 0, 0, n);
}

static pid_t start_nginx(bench *B, target *t) {
  char dir[600], cfg[8192], path[700], log[700], url[64];
  snprintf(dir, sizeof dir, "%s/nginx", B->o.out);
  mkdir(dir, 0755);
  int n = snprintf(cfg, sizeof cfg,
      "# bench_routerd: a plain round-robin proxy, one process\n"
      "daemon off;\nmaster_process off;\nworker_processes 1;\n"
      "pid %s/nginx.pid;\nerror_log %s/error.log warn;\n"
      "events { worker_connections 8192; }\nhttp {\n  access_log off;\n"
      "  client_max_body_size 64m;\n  client_body_buffer_size 1m;\n"
      "  client_body_temp_path %s/body;\n  proxy_temp_path %s/proxy;\n"
      "  fastcgi_temp_path %s/fcgi;\n  uwsgi_temp_path %s/uwsgi;\n"
      "  scgi_temp_path %s/scgi;\n  upstream w {\n",
      dir, dir, dir, dir, dir, dir, dir);
  for (uint32_t i = 0; i < B->stub.n; i++) {
    worker_url(B, i, url, sizeof url);
    n += snprintf(cfg + n, sizeof cfg - (size_t)n, "    server %s;\n", url + 7);
  }
  snprintf(cfg + n, sizeof cfg - (size_t)n,
           "    keepalive 256;\n  }\n  server {\n    listen 127.0.0.1:%u;\n"
           "    location / {\n      proxy_pass http://w;\n"
           "      proxy_http_version 1.1;\n"
           "      proxy_set_header Connection \"\";\n"
           "      proxy_buffering off;\n    }\n  }\n}\n",
           t->port);
  snprintf(path, sizeof path, "%s/nginx.conf", dir);
  snprintf(log, sizeof log, "%s/nginx.log", B->o.out);
  if (write_file(path, cfg) < 0)
    return -1;
  char prefix[700], errl[700];
  snprintf(prefix, sizeof prefix, "%s/", dir);
  snprintf(errl, sizeof errl, "%s/error.log", dir);
  char *argv[] = {(char *)B->o.nginx, "-p", prefix, "-c", path, "-e", errl,
                  NULL};
  snprintf(t->note, sizeof t->note, "round robin, keepalive 256, "
           "proxy_buffering off, 1 worker process");
  return spawn(argv, log);
}

/* vllm-router / sglang-router from the peers' venv */
static pid_t start_peer(bench *B, target *t, const char *exe, bool sglang) {
  char bin[600], port[16], prom[16], log[600];
  char urls[BR_PORTS_MAX][64];
  char *argv[40];
  int a = 0;
  snprintf(bin, sizeof bin, "%s/bin/%s", B->o.venv, exe);
  if (access(bin, X_OK) != 0)
    return 0;
  snprintf(port, sizeof port, "%u", t->port);
  snprintf(prom, sizeof prom, "%u", free_port());
  snprintf(log, sizeof log, "%s/%s.log", B->o.out, exe);
  argv[a++] = bin;
  if (sglang)
    argv[a++] = "launch";
  char *fixed[] = {"--host", "127.0.0.1", "--port", port, "--policy",
                   (char *)B->o.peer_policy, "--prometheus-port", prom,
                   "--log-level", sglang ? "warn" : "warning",
                   "--worker-startup-check-interval", "1", "--worker-urls"};
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
    argv[a++] = fixed[i];
  for (uint32_t i = 0; i < B->stub.n; i++) {
    worker_url(B, i, urls[i], sizeof urls[i]);
    argv[a++] = urls[i];
  }
  argv[a] = NULL;
  snprintf(t->note, sizeof t->note, "policy %s", B->o.peer_policy);
  return spawn(argv, log);
}

static bool installed(const bench *B, int k) {
  char bin[600];
  if (k == T_VLLM || k == T_SGLANG) {
    snprintf(bin, sizeof bin, "%s/bin/%s", B->o.venv, k_tname[k]);
    return access(bin, X_OK) == 0;
  }
  if (k == T_NGINX)
    return B->o.nginx != NULL && access(B->o.nginx, X_OK) == 0;
  if (k == T_FLEET && (B->o.nats_server == NULL ||
                       access(B->o.nats_server, X_OK) != 0))
    return false;
  return (!routerd_threads(k) && k != T_FLEET) ||
         access(B->o.routerd, X_OK) == 0;
}

/* one request per worker and then some, end to end */
static bool ready(bench *B, target *t) {
  br_load_opts lo = {.n_ports = 1, .path = "/v1/completions",
                     .bodies = (const char *const *)B->body[P_SMALL],
                     .body_len = B->body_len[P_SMALL], .n_bodies = N_BODIES,
                     .closed = 1, .count = 2 * B->stub.n + 2,
                     .timeout_s = 2, .max_conns = 1};
  lo.port[0] = t->port;
  for (int i = 0; i < 300; i++) {
    br_load_result r;
    if (t->pid > 0 && !alive(t->pid))
      return false;
    if (br_load_run(&lo, &r) == 0 && r.ok == lo.count)
      return true;
    usleep(200000);
  }
  return false;
}

/* ---- kvplane-routerd-x3: three replicas and their nats-server --------------- */
static bool listening(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

/* core NATS only (the sync needs no JetStream), loopback */
static pid_t start_nats(bench *B, uint16_t port) {
  char p[16], log[600];
  snprintf(p, sizeof p, "%u", port);
  snprintf(log, sizeof log, "%s/nats-server.log", B->o.out);
  char *argv[] = {(char *)B->o.nats_server, "-a", "127.0.0.1", "-p", p, NULL};
  pid_t pid = spawn(argv, log);
  /* up to 30 s: beside a busy neighbour (ctest -j2 pairs this with headless
   * chromium at times) nats-server was seen not to listen within 5 s */
  for (int i = 0; i < 3000 && pid > 0 && alive(pid) && !listening(port); i++)
    usleep(10000);
  if (pid > 0 && listening(port))
    return pid;
  reap(pid);
  return -1;
}

/* The value of one series (name with its labels, exactly) in Prometheus
 * text; NAN when absent. */
static double prom(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; p != NULL && (p = strstr(p, series)) != NULL; p += n)
    if ((p == text || p[-1] == '\n') && p[n] == ' ')
      return strtod(p + n + 1, NULL);
  return NAN;
}

typedef struct rep_snap {
  double cpu_s, requests, pub, recv, p50, p99, peers;
} rep_snap;

static void rep_sample(const target *t, uint32_t i, rep_snap *s) {
  static const char *const ty[3] = {"decision", "complete", "snapshot"};
  char *m = br_http_get(t->rport[i], "/metrics");
  *s = (rep_snap){.cpu_s = tree_cpu_s(t->rpid[i])};
  s->requests = prom(m, "kvplane_routerd_requests_total");
  s->peers = prom(m, "kvplane_routerd_sync_peers");
  s->p50 = prom(m, "kvplane_routerd_sync_lag_seconds{quantile=\"0.5\"}");
  s->p99 = prom(m, "kvplane_routerd_sync_lag_seconds{quantile=\"0.99\"}");
  for (int k = 0; k < 3; k++) {
    char se[96];
    snprintf(se, sizeof se, "kvplane_routerd_sync_published_total{type=\"%s\"}",
             ty[k]);
    s->pub += prom(m, se);
    snprintf(se, sizeof se, "kvplane_routerd_sync_received_total{type=\"%s\"}",
             ty[k]);
    s->recv += prom(m, se);
  }
  free(m);
}

/* every replica hears its FLEET_N - 1 peers (up to 5 s) */
static bool fleet_synced(const target *t) {
  for (int k = 0; k < 400; k++) { /* 20 s: the replicas may start slowly, too */
    uint32_t ok = 0;
    for (uint32_t i = 0; i < FLEET_N; i++) {
      rep_snap s;
      rep_sample(t, i, &s);
      ok += s.peers == FLEET_N - 1;
    }
    if (ok == FLEET_N)
      return true;
    usleep(50000);
  }
  return false;
}

static void fleet_down(target *t) {
  for (uint32_t i = 0; i < FLEET_N; i++)
    reap(t->rpid[i]), t->rpid[i] = 0;
  reap(t->nats);
  t->nats = 0;
}

static bool fleet_up(bench *B, target *t) {
  t->nats_port = free_port();
  if ((t->nats = start_nats(B, t->nats_port)) <= 0)
    return t->nats = 0, false;
  for (uint32_t i = 0; i < FLEET_N; i++) {
    t->rport[i] = free_port();
    t->rpid[i] = routerd_proc(B, t->rport[i], i + 1, t->nats_port, 1);
    if (t->rpid[i] <= 0)
      return t->rpid[i] = 0, false;
  }
  for (uint32_t i = 0; i < FLEET_N; i++) {
    target r = {.kind = T_ROUTERD, .pid = t->rpid[i], .port = t->rport[i]};
    if (!ready(B, &r))
      return false;
  }
  t->port = t->rport[0];
  snprintf(t->note, sizeof t->note, "%d replicas (policy %s, 1 thread each) "
           "+ nats-server on loopback, round robin over the replicas; "
           "restarted before each cell", FLEET_N, B->o.routerd_policy);
  return fleet_synced(t);
}

static void start_target(bench *B, target *t) {
  if (t->kind == T_DIRECT) {
    t->up = true;
    snprintf(t->note, sizeof t->note, "%u stub workers, round robin",
             B->stub.n);
    return;
  }
  if (t->kind == T_FLEET) {
    if (!(t->up = fleet_up(B, t))) {
      snprintf(t->note, sizeof t->note, "failed to start (see %s/)", B->o.out);
      fleet_down(t);
    }
    return;
  }
  t->port = free_port();
  t->pid = routerd_threads(t->kind) ? start_routerd(B, t)
           : t->kind == T_NGINX ? start_nginx(B, t)
                                : start_peer(B, t, k_tname[t->kind],
                                             t->kind == T_SGLANG);
  t->up = t->pid > 0 && ready(B, t);
  if (!t->up) {
    snprintf(t->note, sizeof t->note, "failed to start (see %s/)", B->o.out);
    reap(t->pid);
    t->pid = 0;
    return;
  }
  size_t n = strlen(t->note);
  if (!routerd_threads(t->kind))
    snprintf(t->note + n, sizeof t->note - n, ", %d thread(s)",
             threads_of(t->pid));
}

/* ---- one cell ----------------------------------------------------------------- */
static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* kvplane-routerd-x3 over the cell: each replica's deltas (f0: before),
 * the fleet's CPU in the row's columns, nats-server's beside them */
static void fleet_row(const target *t, row *w, const rep_snap *f0,
                      double nats0, double span, double n) {
  double sum = 0;
  for (uint32_t i = 0; i < FLEET_N; i++) {
    rep_snap f1;
    rep_sample(t, i, &f1);
    rep_row *r = &w->rep[i];
    double dc = f1.cpu_s - f0[i].cpu_s;
    r->requests = f1.requests - f0[i].requests;
    r->cpu_us = r->requests > 0 ? dc * 1e6 / r->requests : NAN;
    r->cpu_pct = dc / span * 100;
    r->pub_s = (f1.pub - f0[i].pub) / span;
    r->recv_s = (f1.recv - f0[i].recv) / span;
    r->lag_p50_ms = f1.p50 * 1e3;
    r->lag_p99_ms = f1.p99 * 1e3;
    sum += dc;
  }
  double dn = tree_cpu_s(t->nats) - nats0;
  w->cpu_us = sum * 1e6 / n;
  w->cpu_pct = sum / span * 100;
  w->nats_us = dn * 1e6 / n;
  w->nats_pct = dn / span * 100;
}

static void run_cell(bench *B, target *t, int p, double rate, row *w) {
  const opts *o = &B->o;
  bool fleet = t->kind == T_FLEET;
  br_load_opts lo = {.path = "/v1/completions",
                     .bodies = (const char *const *)B->body[p],
                     .body_len = B->body_len[p], .n_bodies = N_BODIES,
                     .rate = rate, .closed = o->concurrency,
                     .warmup_s = o->warmup, .duration_s = o->duration,
                     .timeout_s = o->timeout, .grace_s = o->grace,
                     .max_conns = rate > 0 ? o->conns : o->concurrency,
                     .want_header = routerd_threads(t->kind) || fleet
                                        ? "x-kvplane-worker" : NULL};
  lo.n_ports = t->kind == T_DIRECT ? B->stub.n : fleet ? FLEET_N : 1;
  for (uint32_t i = 0; i < lo.n_ports; i++)
    lo.port[i] = t->kind == T_DIRECT ? B->stub.port[i]
                 : fleet             ? t->rport[i] : t->port;
  rep_snap f0[FLEET_N];
  for (uint32_t i = 0; fleet && i < FLEET_N; i++)
    rep_sample(t, i, &f0[i]);
  double c0 = t->pid ? tree_cpu_s(t->pid) : 0, s0 = tree_cpu_s(B->stub.pid),
         m0 = self_cpu_s(), n0 = fleet ? tree_cpu_s(t->nats) : 0;
  *w = (row){.t = t->kind, .p = p, .rate = rate, .nats_us = NAN,
             .nats_pct = NAN};
  double w0 = mono_s();
  br_load_run(&lo, &w->r);
  double n = w->r.done_all ? (double)w->r.done_all : NAN, span = mono_s() - w0;
  double dc = t->pid ? tree_cpu_s(t->pid) - c0 : NAN;
  w->cpu_us = dc * 1e6 / n;
  w->cpu_pct = dc / span * 100;
  if (fleet)
    fleet_row(t, w, f0, n0, span, n);
  w->stub_us = (tree_cpu_s(B->stub.pid) - s0) * 1e6 / n;
  w->client_us = (self_cpu_s() - m0) * 1e6 / n;
  fprintf(stderr, "  %-16s %-5s %6.0f/s: p50 %.3f ms p99 %.3f ms, %llu ok, "
          "%llu errors, %llu unfinished\n", k_tname[t->kind], k_pname[p],
          rate > 0 ? rate : w->r.achieved, w->r.p50_us / 1e3,
          w->r.p99_us / 1e3, (unsigned long long)w->r.ok,
          (unsigned long long)w->r.errors, (unsigned long long)w->r.unfinished);
}

static const row *find_row(const bench *B, int t, int p, double rate) {
  for (size_t i = 0; i < B->n_rows; i++)
    if (B->rows[i].t == t && B->rows[i].p == p && B->rows[i].rate == rate)
      return &B->rows[i];
  return NULL;
}

/* ---- the report --------------------------------------------------------------- */
static void rate_label(double rate, char *dst, size_t cap) {
  if (rate > 0)
    snprintf(dst, cap, "%.0f", rate);
  else
    snprintf(dst, cap, "max");
}

static void fmt_ms(double us, char *dst, size_t cap, bool sign) {
  if (isnan(us))
    snprintf(dst, cap, "-");
  else
    snprintf(dst, cap, sign ? "%+.3f" : "%.3f", us / 1e3);
}

static void print_row(const bench *B, const row *w) {
  const row *d = find_row(B, T_DIRECT, w->p, w->rate);
  const row *ng = find_row(B, T_NGINX, w->p, w->rate);
  char rl[16], p50[16], p99[16], a50[16], a99[16], vn[16], cpu[16], cr[16];
  bool prox = w->t != T_DIRECT;
  rate_label(w->rate, rl, sizeof rl);
  fmt_ms(w->r.p50_us, p50, sizeof p50, false);
  fmt_ms(w->r.p99_us, p99, sizeof p99, false);
  fmt_ms(prox && d ? w->r.p50_us - d->r.p50_us : NAN, a50, sizeof a50, true);
  fmt_ms(prox && d ? w->r.p99_us - d->r.p99_us : NAN, a99, sizeof a99, true);
  bool vsn = prox && w->t != T_NGINX && ng;
  fmt_ms(vsn ? w->r.p99_us - ng->r.p99_us : NAN, vn, sizeof vn, true);
  snprintf(cpu, sizeof cpu, isnan(w->cpu_us) ? "-" : "%.1f", w->cpu_us);
  snprintf(cr, sizeof cr, vsn && ng->cpu_us > 0 ? "%.2fx" : "-",
           vsn ? w->cpu_us / ng->cpu_us : 0);
  printf("%-18s %-6s %6s %9.0f %9s %9s %9s %9s %10s %9s %7s %7llu %6llu\n",
         k_tname[w->t], k_pname[w->p], rl, w->r.achieved, p50, p99, a50, a99,
         vn, cpu, cr, (unsigned long long)w->r.errors,
         (unsigned long long)w->r.unfinished);
}

static void print_table(const bench *B) {
  printf("\n%-18s %-6s %6s %9s %9s %9s %9s %9s %10s %9s %7s %7s %6s\n",
         "target", "prompt", "rate", "achieved", "p50 ms", "p99 ms",
         "added p50", "added p99", "p99-nginx", "CPU us/rq", "CPU/ngx",
         "errors", "unfin");
  for (int p = 0; p < P_N; p++)
    for (uint32_t k = 0; k < B->o.n_rates; k++)
      for (int t = 0; t < T_N; t++) {
        const row *w = find_row(B, t, p, B->o.rates[k]);
        if (w)
          print_row(B, w);
      }
  for (int t = 0; t < T_N; t++)
    if (B->o.want[t] && !B->tg[t].up)
      printf("%-18s %s\n", k_tname[t], B->tg[t].note);
  for (size_t i = 0; i < B->n_rows; i++) /* what the errors were */
    if (B->rows[i].r.first_error[0])
      printf("  %s %s: %.100s\n", k_tname[B->rows[i].t],
             k_pname[B->rows[i].p], B->rows[i].r.first_error);
}

/* kvplane-routerd-x3 per replica, one router's row of the cell beside it */
static void print_fleet_cell(const bench *B, const row *w) {
  const row *one = find_row(B, T_ROUTERD, w->p, w->rate);
  char rl[16];
  rate_label(w->rate, rl, sizeof rl);
  if (one)
    printf("%-6s %6s %-8s %9.0f %9.1f %6.1f %9s %9s %9s %9s\n", k_pname[w->p],
           rl, "one", (double)one->r.done_all, one->cpu_us, one->cpu_pct, "-",
           "-", "-", "-");
  for (uint32_t i = 0; i < FLEET_N; i++) {
    const rep_row *r = &w->rep[i];
    char id[16];
    snprintf(id, sizeof id, "x3 #%u", i + 1);
    printf("%-6s %6s %-8s %9.0f %9.1f %6.1f %9.0f %9.0f %9.3f %9.3f\n",
           k_pname[w->p], rl, id, r->requests, r->cpu_us, r->cpu_pct,
           r->pub_s, r->recv_s, r->lag_p50_ms, r->lag_p99_ms);
  }
  printf("%-6s %6s %-8s %9s %9.1f %6.1f  (nats-server; CPU per fleet "
         "request)\n", k_pname[w->p], rl, "nats", "-", w->nats_us, w->nats_pct);
}

static void print_fleet(const bench *B) {
  if (!B->tg[T_FLEET].up)
    return; /* print_table said why */
  printf("\nkvplane-routerd-x3 per replica (\"one\": kvplane-routerd alone, "
         "same cell); sync msgs/s all types; lag = publish to apply, since "
         "the replica started\n%-6s %6s %-8s %9s %9s %6s %9s %9s %9s %9s\n",
         "prompt", "rate", "replica", "requests", "CPU us/rq", "CPU %",
         "pub/s", "recv/s", "lag p50ms", "lag p99ms");
  for (size_t i = 0; i < B->n_rows; i++)
    if (B->rows[i].t == T_FLEET)
      print_fleet_cell(B, &B->rows[i]);
}

static void print_notes(const bench *B) {
  printf("bench_routerd: loopback, %ld CPU cores shared by the load "
         "generator, the stub workers and the router under test (and "
         "anything else on the machine: load average %s at the start, %s at "
         "the end)\n", sysconf(_SC_NPROCESSORS_ONLN), B->load0, B->load1);
  printf("  %u stub workers (forked, answer at once; direct spreads round "
         "robin); %.1f s measured + %.2f s warm-up per cell, open loop at "
         "the rate (latency from the scheduled send), 'max' = closed loop "
         "with %u outstanding\n", B->stub.n, B->o.duration, B->o.warmup,
         B->o.concurrency);
  printf("  prompts: small = a ~100-character text prompt; 32k = %u token "
         "ids (~%zu KB of JSON); %d distinct bodies of each, cycled\n",
         B->o.tokens, B->body_len[P_32K][0] / 1024, N_BODIES);
  for (int t = 0; t < T_N; t++)
    if (B->o.want[t] && B->tg[t].up)
      printf("  %-18s %s\n", k_tname[t], B->tg[t].note);
  printf("  added = percentile minus direct's in the same cell; CPU us/rq = "
         "utime+stime of the router's process tree / requests completed "
         "(warm-up included; kvplane-routerd-x3: its 3 replicas' sum, "
         "nats-server apart)\n");
}

static void verdict(const char *what, int ok) {
  printf("  %-72s %s\n", what, ok < 0 ? "not measured" : ok ? "HOLDS" : "MISSED");
}

/* The highest open-loop rate of the run that nginx holds with 32K-token
 * prompts: every request sent on time answered, p99 added <= 1 ms; 0: none. */
static double nginx_holds_32k(const bench *B) {
  double best = 0;
  for (uint32_t k = 0; k < B->o.n_rates; k++) {
    double rate = B->o.rates[k];
    const row *n = find_row(B, T_NGINX, P_32K, rate),
              *d = find_row(B, T_DIRECT, P_32K, rate);
    if (rate > 0 && n && d && n->r.unfinished == 0 && n->r.errors == 0 &&
        n->r.achieved >= 0.99 * rate && n->r.p99_us - d->r.p99_us <= 1000 &&
        rate > best)
      best = rate;
  }
  return best;
}

/* Issue 38's targets for this 2-core machine, each on cells of this run. */
static void print_targets(const bench *B) {
  printf("\ntargets (docs/performance.md):\n");
  char s[160], rl[16];
  for (uint32_t k = 0; k < B->o.n_rates; k++) {
    const row *a = find_row(B, T_ROUTERD, P_32K, B->o.rates[k]);
    const row *n = find_row(B, T_NGINX, P_32K, B->o.rates[k]);
    rate_label(B->o.rates[k], rl, sizeof rl);
    double x = a && n && n->cpu_us > 0 ? a->cpu_us / n->cpu_us : NAN;
    snprintf(s, sizeof s, "32k at %s: router CPU per request <= 1.3x nginx's "
             "(%.2fx)", rl, x);
    verdict(s, isnan(x) ? -1 : x <= 1.3);
  }
  double hold = nginx_holds_32k(B);
  const row *r = find_row(B, T_ROUTERD, P_32K, hold),
            *d = find_row(B, T_DIRECT, P_32K, hold);
  double add = hold > 0 && r && d ? r->r.p99_us - d->r.p99_us : NAN;
  snprintf(s, sizeof s, "32k: p99 added <= 1 ms at the highest rate nginx "
           "holds (%.0f/s: %+.3f ms)", hold, add / 1e3);
  verdict(s, isnan(add) ? -1 : add <= 1000 && r->r.unfinished == 0);
  for (uint32_t k = 0; k < B->o.n_rates; k++) {
    const row *a = find_row(B, T_ROUTERD, P_SMALL, B->o.rates[k]);
    const row *n = find_row(B, T_NGINX, P_SMALL, B->o.rates[k]);
    const row *v = find_row(B, T_VLLM, P_SMALL, B->o.rates[k]);
    rate_label(B->o.rates[k], rl, sizeof rl);
    double gap = a && n ? a->r.p99_us - n->r.p99_us : NAN;
    snprintf(s, sizeof s, "small prompts at %s: p99 <= nginx p99 + 0.3 ms "
             "(%+.3f ms)", rl, gap / 1e3);
    verdict(s, isnan(gap) ? -1 : gap <= 300);
    if (B->o.rates[k] > 0) /* open loop: both carry what is sent */
      continue;
    snprintf(s, sizeof s, "small prompts at %s: throughput >= 2x vllm-router's "
             "(%.0f vs %.0f/s)", rl, a ? a->r.achieved : NAN,
             v ? v->r.achieved : NAN);
    verdict(s, !a || !v || (a->r.ok == 0 && v->r.ok == 0)
                   ? -1 /* neither answered in time: nothing compared */
                   : a->r.achieved >= 2 * 0.99 * v->r.achieved);
  }
}

static void write_csv(const bench *B) {
  char path[600];
  snprintf(path, sizeof path, "%s/bench_routerd.csv", B->o.out);
  FILE *f = fopen(path, "w");
  if (f == NULL)
    return;
  fprintf(f, "target,prompt,rate,achieved_rps,measured,ok,errors,unfinished,"
          "p50_us,p99_us,max_us,added_p50_us,added_p99_us,router_cpu_us_per_req,"
          "stub_cpu_us_per_req,client_cpu_us_per_req,with_kvplane_header,"
          "generator_lag_max_us,first_error\n");
  for (size_t i = 0; i < B->n_rows; i++) {
    const row *w = &B->rows[i], *d = find_row(B, T_DIRECT, w->p, w->rate);
    char rl[16];
    rate_label(w->rate, rl, sizeof rl);
    fprintf(f, "%s,%s,%s,%.1f,%llu,%llu,%llu,%llu,%.1f,%.1f,%.1f,%.1f,%.1f,"
            "%.2f,%.2f,%.2f,%llu,%.1f,\"%s\"\n", k_tname[w->t], k_pname[w->p],
            rl, w->r.achieved, (unsigned long long)w->r.measured,
            (unsigned long long)w->r.ok, (unsigned long long)w->r.errors,
            (unsigned long long)w->r.unfinished, w->r.p50_us, w->r.p99_us,
            w->r.max_us, d ? w->r.p50_us - d->r.p50_us : NAN,
            d ? w->r.p99_us - d->r.p99_us : NAN, w->cpu_us, w->stub_us,
            w->client_us, (unsigned long long)w->r.with_header,
            w->r.late_us_max, w->r.first_error);
  }
  fclose(f);
  printf("\nCSV: %s (logs and configs beside it)\n", path);
}

static void write_fleet_csv(const bench *B) {
  char path[600];
  snprintf(path, sizeof path, "%s/bench_routerd_fleet.csv", B->o.out);
  FILE *f = B->tg[T_FLEET].up ? fopen(path, "w") : NULL;
  if (f == NULL)
    return;
  fprintf(f, "prompt,rate,replica,requests,cpu_us_per_req,cpu_pct,"
          "sync_published_per_s,sync_received_per_s,lag_p50_ms,lag_p99_ms\n");
  for (size_t k = 0; k < B->n_rows; k++) {
    const row *w = &B->rows[k];
    char rl[16];
    rate_label(w->rate, rl, sizeof rl);
    for (uint32_t i = 0; w->t == T_FLEET && i < FLEET_N; i++) {
      const rep_row *r = &w->rep[i];
      fprintf(f, "%s,%s,%u,%.0f,%.2f,%.2f,%.1f,%.1f,%.4f,%.4f\n",
              k_pname[w->p], rl, i + 1, r->requests, r->cpu_us, r->cpu_pct,
              r->pub_s, r->recv_s, r->lag_p50_ms, r->lag_p99_ms);
    }
    if (w->t == T_FLEET)
      fprintf(f, "%s,%s,nats-server,,%.2f,%.2f,,,,\n", k_pname[w->p], rl,
              w->nats_us, w->nats_pct);
  }
  fclose(f);
  printf("CSV: %s\n", path);
}

/* kvplane-routerd-x3: every replica took requests and heard its peers */
static int check_fleet(const row *w) {
  int bad = 0;
  for (uint32_t i = 0; i < FLEET_N; i++) {
    const rep_row *r = &w->rep[i];
    if (!(r->requests > 0) || !(r->recv_s > 0) || !(r->pub_s > 0) ||
        isnan(r->lag_p99_ms)) {
      printf("check: %s %s replica %u: %.0f requests, %.1f sync msgs/s out, "
             "%.1f in, lag p99 %.3f ms\n", k_tname[w->t], k_pname[w->p],
             i + 1, r->requests, r->pub_s, r->recv_s, r->lag_p99_ms);
      bad++;
    }
  }
  return bad;
}

/* the targets --check holds to: direct, kvplane-routerd (-t2, -t4), and
 * kvplane-routerd-x3 where nats-server is installed */
static bool checked(const bench *B, int t) {
  return t == T_DIRECT || routerd_threads(t) ||
         (t == T_FLEET && installed(B, t));
}

/* --check: the smoke test's assertions */
static int check(const bench *B) {
  int bad = 0;
  for (int t = 0; t < T_N; t++)
    if (B->o.want[t] && checked(B, t) && !B->tg[t].up) {
      printf("check: %s did not start\n", k_tname[t]);
      bad++;
    }
  for (size_t i = 0; i < B->n_rows; i++) {
    const row *w = &B->rows[i];
    if (!checked(B, w->t))
      continue;
    if (w->t == T_FLEET)
      bad += check_fleet(w);
    if (w->r.errors || w->r.unfinished || w->r.ok == 0) {
      printf("check: %s %s: %llu ok, %llu errors, %llu unfinished (%s)\n",
             k_tname[w->t], k_pname[w->p], (unsigned long long)w->r.ok,
             (unsigned long long)w->r.errors,
             (unsigned long long)w->r.unfinished, w->r.first_error);
      bad++;
    }
    if (w->t != T_DIRECT && w->r.with_header != w->r.ok) {
      printf("check: %s %s: %llu of %llu replies carried x-kvplane-worker\n",
             k_tname[w->t], k_pname[w->p],
             (unsigned long long)w->r.with_header, (unsigned long long)w->r.ok);
      bad++;
    }
  }
  printf("check: %s\n", bad ? "FAILED" : "ok");
  return bad ? 1 : 0;
}

/* ---- options ------------------------------------------------------------------ */
static void usage(FILE *f) {
  fprintf(f,
      "usage: bench_routerd [--quick] [--duration S] [--warmup S]\n"
      "         [--rates R,...] [--only T,...] [--prompts small,32k]\n"
      "         [--tokens N] [--workers N] [--concurrency C] [--conns N]\n"
      "         [--out DIR] [--routerd PATH] [--venv DIR] [--nginx PATH]\n"
      "         [--policy P] [--peer-policy P] [--nats-server PATH] [--check]\n"
      "The latency kvplane-routerd adds in front of an OpenAI worker, beside\n"
      "nginx, vllm-router and sglang-router (docs/performance.md).\n"
      "  rates: requests/s, open loop (2k = 2000); 'max' = closed loop with\n"
      "         --concurrency outstanding (default 2000,10000,max)\n"
      "  targets: direct, kvplane-routerd, kvplane-routerd-x3 (3 replicas\n"
      "         synced through a nats-server started here; skipped without\n"
      "         one), nginx, vllm-router, sglang-router; with --only:\n"
      "         kvplane-routerd-t2, -t4 (routerd.threads: 2, 4)\n"
      "  --check: exit 1 unless direct and kvplane-routerd (and -x3, with\n"
      "         nats-server) had no errors, every router reply carried\n"
      "         x-kvplane-worker and every replica heard its peers\n");
}

static int parse_rates(opts *o, const char *s) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  o->n_rates = 0;
  for (char *sp, *t = strtok_r(buf, ",", &sp); t; t = strtok_r(NULL, ",", &sp)) {
    char *end;
    double v = strcmp(t, "max") == 0 ? 0 : strtod(t, &end);
    if (strcmp(t, "max") != 0 && (end == t || !(v > 0) ||
                                  (*end && strcmp(end, "k") != 0)))
      return -1;
    if (strcmp(t, "max") != 0 && *end == 'k')
      v *= 1000;
    if (o->n_rates == MAX_RATES)
      return -1;
    o->rates[o->n_rates++] = v;
  }
  return o->n_rates ? 0 : -1;
}

static int parse_list(bool *dst, const char *const *names, int n, const char *s) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  memset(dst, 0, (size_t)n * sizeof *dst);
  for (char *sp, *t = strtok_r(buf, ",", &sp); t; t = strtok_r(NULL, ",", &sp)) {
    int i = 0;
    while (i < n && strcmp(names[i], t) != 0)
      i++;
    if (i == n && strcmp(t, "routerd") == 0)
      i = T_ROUTERD;
    if (i == n)
      return -1;
    dst[i] = true;
  }
  return 0;
}

static const char *find_nginx(void) {
  static const char *const cand[] = {"/usr/sbin/nginx", "/usr/local/sbin/nginx",
                                     "/usr/bin/nginx", "/usr/local/nginx/sbin/nginx"};
  for (size_t i = 0; i < sizeof cand / sizeof *cand; i++)
    if (access(cand[i], X_OK) == 0)
      return cand[i];
  return NULL;
}

static const char *find_nats_server(void) {
  static const char *const cand[] = {"/usr/sbin/nats-server", "/usr/bin/nats-server",
                                     "/usr/local/bin/nats-server"};
  for (size_t i = 0; i < sizeof cand / sizeof *cand; i++)
    if (access(cand[i], X_OK) == 0)
      return cand[i];
  return NULL;
}

static void defaults(opts *o) {
  *o = (opts){.duration = 5, .warmup = 1, .timeout = 10, .grace = 3,
              .workers = 2, .concurrency = 64, .conns = 512, .tokens = 32768,
              .out = "bench-routerd", .routerd = KVP_ROUTERD_BIN,
              .venv = KVP_SOURCE_DIR "/.venv-peers", .nginx = find_nginx(),
              .peer_policy = "cache_aware", .routerd_policy = "kvplane_cost",
              .nats_server = find_nats_server()};
  parse_rates(o, "2000,10000,max");
  for (int i = 0; i < T_N; i++) /* the threaded ones: asked by name */
    o->want[i] = i != T_ROUTERD_T2 && i != T_ROUTERD_T4;
  o->prompt[P_SMALL] = o->prompt[P_32K] = true;
}

static int parse_num(const char *s, double lo, double hi, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= lo && v <= hi))
    return -1;
  *out = v;
  return 0;
}

static int take_opt(opts *o, int c, const char *v, bool *set_dur) {
  double x = 0;
  switch (c) {
  case 'q': o->quick = true; return 0;
  case 'd': *set_dur = true; return parse_num(v, 0.05, 3600, &o->duration);
  case 'W': return parse_num(v, 0, 600, &o->warmup);
  case 'r': return parse_rates(o, v);
  case 'O': return parse_list(o->want, k_tname, T_N, v);
  case 'P': return parse_list(o->prompt, k_pname, P_N, v);
  case 't': if (parse_num(v, 1, 1 << 20, &x) < 0) return -1;
            o->tokens = (uint32_t)x; return 0;
  case 'w': if (parse_num(v, 1, BR_PORTS_MAX, &x) < 0) return -1;
            o->workers = (uint32_t)x; return 0;
  case 'C': if (parse_num(v, 1, 4096, &x) < 0) return -1;
            o->concurrency = (uint32_t)x; return 0;
  case 'N': if (parse_num(v, 1, 16384, &x) < 0) return -1;
            o->conns = (uint32_t)x; return 0;
  case 'o': o->out = v; return 0;
  case 'R': o->routerd = v; return 0;
  case 'V': o->venv = v; return 0;
  case 'X': o->nginx = v; return 0;
  case 'p': o->routerd_policy = v; return 0;
  case 'y': o->peer_policy = v; return 0;
  case 'k': o->check = true; return 0;
  case 'S': o->nats_server = v; return 0;
  default: return -1;
  }
}

static int parse_args(opts *o, int argc, char **argv) {
  static const struct option lo[] = {
      {"quick", 0, 0, 'q'},    {"duration", 1, 0, 'd'}, {"warmup", 1, 0, 'W'},
      {"rates", 1, 0, 'r'},    {"only", 1, 0, 'O'},     {"prompts", 1, 0, 'P'},
      {"tokens", 1, 0, 't'},   {"workers", 1, 0, 'w'},  {"concurrency", 1, 0, 'C'},
      {"conns", 1, 0, 'N'},    {"out", 1, 0, 'o'},      {"routerd", 1, 0, 'R'},
      {"venv", 1, 0, 'V'},     {"nginx", 1, 0, 'X'},    {"policy", 1, 0, 'p'},
      {"peer-policy", 1, 0, 'y'}, {"check", 0, 0, 'k'}, {"help", 0, 0, 'h'},
      {"nats-server", 1, 0, 'S'},
      {0, 0, 0, 0}};
  bool set_dur = false, set_warm = false;
  int c;
  defaults(o);
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    if (c == 'h')
      return usage(stdout), 1;
    set_warm |= c == 'W';
    if (c == '?' || take_opt(o, c, optarg, &set_dur) < 0) {
      if (c != '?')
        fprintf(stderr, "bench_routerd: bad value '%s'\n", optarg);
      return usage(stderr), -1;
    }
  }
  if (optind < argc)
    return usage(stderr), -1;
  if (o->quick && !set_dur)
    o->duration = 1;
  if (o->quick && !set_warm)
    o->warmup = 0.25;
  if (o->quick)
    o->grace = 2;
  return 0;
}

/* ---- main --------------------------------------------------------------------- */
static void loadavg(char *dst, size_t cap) {
  FILE *f = fopen("/proc/loadavg", "r");
  double a = 0, b = 0, c = 0;
  if (f == NULL || fscanf(f, "%lf %lf %lf", &a, &b, &c) != 3)
    snprintf(dst, cap, "?");
  else
    snprintf(dst, cap, "%.2f/%.2f/%.2f", a, b, c);
  if (f)
    fclose(f);
}

static void start_all(bench *B) {
  for (int t = 0; t < T_N; t++) {
    target *g = &B->tg[t];
    g->kind = t;
    if (!B->o.want[t])
      continue;
    if (!installed(B, t)) {
      snprintf(g->note, sizeof g->note, t == T_FLEET
               ? "skipped: no nats-server (Debian: nats-server; --nats-server "
                 "PATH)" : "not installed");
      continue;
    }
    fprintf(stderr, "bench_routerd: starting %s\n", k_tname[t]);
    start_target(B, g);
  }
}

/* kvplane-routerd-x3 starts afresh before each cell but the first: its sync
 * lag percentiles (since the replica started) are then the cell's */
static bool fleet_fresh(bench *B, target *t, bool *first) {
  if (t->kind != T_FLEET)
    return true;
  if (*first)
    return *first = false, true;
  fleet_down(t);
  if ((t->up = fleet_up(B, t)))
    return true;
  fleet_down(t);
  snprintf(t->note, sizeof t->note, "failed to restart (see %s/)", B->o.out);
  return false;
}

static void run_all(bench *B) {
  const opts *o = &B->o;
  size_t cap = (size_t)P_N * o->n_rates * T_N;
  bool first = true;
  B->rows = calloc(cap, sizeof *B->rows);
  for (int p = 0; p < P_N && B->rows; p++)
    for (uint32_t k = 0; o->prompt[p] && k < o->n_rates; k++)
      for (int t = 0; t < T_N; t++)
        if (B->tg[t].up && fleet_fresh(B, &B->tg[t], &first))
          run_cell(B, &B->tg[t], p, o->rates[k], &B->rows[B->n_rows++]);
}

static void teardown(bench *B) {
  for (int t = 0; t < T_N; t++)
    reap(B->tg[t].pid);
  fleet_down(&B->tg[T_FLEET]);
  br_stub_stop(&B->stub);
  for (int p = 0; p < P_N; p++)
    for (int v = 0; v < N_BODIES; v++)
      free(B->body[p][v]);
  free(B->rows);
}

int main(int argc, char **argv) {
  static bench B;
  int rc = parse_args(&B.o, argc, argv);
  if (rc != 0)
    return rc < 0 ? 2 : 0;
  signal(SIGPIPE, SIG_IGN);
  mkdir(B.o.out, 0755);
  /* absolute: nginx reads -c relative to its -p prefix, and the peers and
   * replicas may change directory */
  char *out = realpath(B.o.out, NULL);
  if (out == NULL) {
    fprintf(stderr, "bench_routerd: --out %s: %s\n", B.o.out, strerror(errno));
    return 1;
  }
  B.o.out = out;
  if (make_bodies(&B) < 0 || br_stub_start(B.o.workers, &B.stub) < 0) {
    fprintf(stderr, "bench_routerd: cannot start the stub workers\n");
    return 1;
  }
  loadavg(B.load0, sizeof B.load0);
  start_all(&B);
  run_all(&B);
  loadavg(B.load1, sizeof B.load1);
  print_notes(&B);
  print_table(&B);
  print_fleet(&B);
  print_targets(&B);
  write_csv(&B);
  write_fleet_csv(&B);
  rc = B.o.check ? check(&B) : 0;
  teardown(&B);
  free(out);
  return rc;
}
