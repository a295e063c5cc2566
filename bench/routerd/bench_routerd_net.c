/* SPDX-License-Identifier: Apache-2.0 */
/* bench_routerd's network half: the stub worker (a forked libevent process
 * answering at once, so a router's cost is not hidden behind the worker's)
 * and the open-loop load generator (libevent evhttp client, keep-alive
 * connections; each request is timed from its scheduled send time, so a
 * stall delays the schedule's later requests in the numbers too -- no
 * coordinated omission). */
#include "bench_routerd.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the stub worker -------------------------------------------------------- */
static const char k_completion[] =
    "{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,"
    "\"model\":\"bench\",\"choices\":[{\"index\":0,\"text\":\" ok\","
    "\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null}],"
    "\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2,"
    "\"prompt_tokens_details\":{\"cached_tokens\":0}}}";
static const char k_chat[] =
    "{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion\",\"created\":0,"
    "\"model\":\"bench\",\"choices\":[{\"index\":0,\"message\":{\"role\":"
    "\"assistant\",\"content\":\" ok\"},\"finish_reason\":\"length\"}],"
    "\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2,"
    "\"prompt_tokens_details\":{\"cached_tokens\":0}}}";
static const char k_models[] =
    "{\"object\":\"list\",\"data\":[{\"id\":\"bench\",\"object\":\"model\","
    "\"created\":0,\"owned_by\":\"kvplane\",\"max_model_len\":1048576}]}";
static const char k_metrics[] =
    "vllm:num_requests_running{model_name=\"bench\"} 0\n"
    "vllm:num_requests_waiting{model_name=\"bench\"} 0\n"
    "vllm:kv_cache_usage_perc{model_name=\"bench\"} 0\n";
static const char k_info[] =
    "{\"status\":\"ok\",\"model_path\":\"bench\",\"tokenizer_path\":\"bench\","
    "\"served_model_name\":\"bench\",\"is_generation\":true,"
    "\"version\":\"0.0.0\"}";

static void stub_reply(struct evhttp_request *hr, const char *ct,
                       const char *body) {
  evbuffer_add_reference(evhttp_request_get_output_buffer(hr), body,
                         strlen(body), NULL, NULL);
  evhttp_add_header(evhttp_request_get_output_headers(hr), "Content-Type", ct);
  evhttp_send_reply(hr, 200, "OK", NULL);
}

static void stub_on_http(struct evhttp_request *hr, void *arg) {
  (void)arg;
  const char *uri = evhttp_request_get_uri(hr);
  if (evhttp_request_get_command(hr) == EVHTTP_REQ_POST)
    stub_reply(hr, "application/json",
               strstr(uri, "/chat/") ? k_chat : k_completion);
  else if (strncmp(uri, "/metrics", 8) == 0)
    stub_reply(hr, "text/plain; version=0.0.4", k_metrics);
  else if (strncmp(uri, "/v1/models", 10) == 0)
    stub_reply(hr, "application/json", k_models);
  else
    stub_reply(hr, "application/json", k_info);
}

/* A loopback listener on an ephemeral port; TCP_NODELAY set here is
 * inherited by every accepted socket (Linux). */
static int listen_any(uint16_t *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (fd < 0)
    return -errno;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 4096) < 0 ||
      getsockname(fd, (struct sockaddr *)&a, &al) < 0) {
    int e = -errno;
    close(fd);
    return e;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

static void stub_serve(const int *fds, uint32_t n) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  struct event_base *base = event_base_new();
  for (uint32_t i = 0; base && i < n; i++) {
    struct evhttp *h = evhttp_new(base);
    if (h == NULL || evhttp_accept_socket_with_handle(h, fds[i]) == NULL)
      _exit(3);
    evhttp_set_gencb(h, stub_on_http, NULL);
  }
  if (base == NULL)
    _exit(3);
  event_base_dispatch(base);
  _exit(0);
}

int br_stub_start(uint32_t n, br_stub *out) {
  int fds[BR_PORTS_MAX];
  memset(out, 0, sizeof *out);
  if (n == 0 || n > BR_PORTS_MAX)
    return -EINVAL;
  for (uint32_t i = 0; i < n; i++) {
    fds[i] = listen_any(&out->port[i]);
    if (fds[i] < 0) {
      int e = fds[i];
      while (i-- > 0)
        close(fds[i]);
      return e;
    }
  }
  pid_t p = fork();
  if (p == 0)
    stub_serve(fds, n);
  for (uint32_t i = 0; i < n; i++)
    close(fds[i]);
  if (p < 0)
    return -errno;
  out->pid = p;
  out->n = n;
  return 0;
}

void br_stub_stop(br_stub *s) {
  if (s->pid <= 0)
    return;
  kill(s->pid, SIGTERM);
  waitpid(s->pid, NULL, 0);
  s->pid = 0;
}

/* ---- the load generator ------------------------------------------------------ */
typedef struct lg lg;

typedef struct conn {
  lg *L;
  struct evhttp_connection *c;
  uint32_t port_i;
  bool busy;
  uint64_t idx;
  double t_sched;
} conn;

struct lg {
  const br_load_opts *o;
  br_load_result *r;
  struct event_base *base;
  struct event *timer, *cut;
  conn *conns;
  uint32_t n_conns, *idle, *n_idle; /* idle[port * max_conns + k] */
  uint64_t *wait, wait_head, wait_n; /* requests due, no connection yet */
  uint64_t next, total, n_warm, done, inflight;
  uint32_t rr;
  double t0, t_meas, t_stop, t_last_done;
  double *lat; /* us: measured, 200 or unfinished */
  size_t n_lat, cap_lat;
  bool cut_done;
};

static bool open_loop(const lg *L) { return L->o->rate > 0; }

static double sched_of(const lg *L, uint64_t i) {
  return L->t0 + (double)i / L->o->rate;
}

static bool measured(const lg *L, uint64_t idx, double t_sched) {
  if (open_loop(L))
    return idx >= L->n_warm;
  return L->o->count > 0 || t_sched >= L->t_meas;
}

static void add_lat(lg *L, double us) {
  if (L->n_lat == L->cap_lat) {
    size_t nc = L->cap_lat ? 2 * L->cap_lat : 4096;
    double *n = realloc(L->lat, nc * sizeof *n);
    if (n == NULL)
      return;
    L->lat = n;
    L->cap_lat = nc;
  }
  L->lat[L->n_lat++] = us;
}

static void free_later(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  evhttp_connection_free(arg);
}

static void no_delay(struct evhttp_connection *c) {
  struct bufferevent *bev = evhttp_connection_get_bufferevent(c);
  int fd = bev ? bufferevent_getfd(bev) : -1, one = 1;
  if (fd >= 0)
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void note_error(lg *L, struct evhttp_request *hr, int code) {
  if (L->r->first_error[0])
    return;
  char body[96] = "";
  struct evbuffer *b = hr ? evhttp_request_get_input_buffer(hr) : NULL;
  size_t n = b ? evbuffer_copyout(b, body, sizeof body - 1) : 0;
  body[n] = '\0';
  for (char *p = body; *p; p++)
    *p = *p == '\n' || *p == '\r' ? ' ' : *p;
  snprintf(L->r->first_error, sizeof L->r->first_error, "%s %d%s%s",
           code ? "HTTP" : "connection failed or timed out", code,
           *body ? ": " : "", body);
}

static void dispatch(lg *L, uint64_t idx, double t_sched);
static void pump(lg *L);

static void account(lg *L, conn *k, struct evhttp_request *hr, int code) {
  double t = now_s();
  L->done++;
  L->r->done_all++;
  if (!measured(L, k->idx, k->t_sched))
    return;
  L->t_last_done = t;
  if (code == 200) {
    L->r->ok++;
    add_lat(L, (t - k->t_sched) * 1e6);
    const char *h = L->o->want_header;
    L->r->with_header +=
        h && evhttp_find_header(evhttp_request_get_input_headers(hr), h) != NULL;
  } else {
    L->r->errors++;
    note_error(L, hr, code);
  }
}

static void next_for(lg *L, conn *k) {
  (void)k; /* on the idle list again: the waiting request takes it */
  if (L->wait_n > 0) {
    uint64_t idx = L->wait[L->wait_head++ % L->total];
    L->wait_n--;
    dispatch(L, idx, open_loop(L) ? sched_of(L, idx) : now_s());
  } else if (!open_loop(L))
    pump(L);
}

static void on_done(struct evhttp_request *hr, void *arg) {
  conn *k = arg;
  lg *L = k->L;
  int code = hr ? evhttp_request_get_response_code(hr) : 0;
  account(L, k, hr, code);
  L->inflight--;
  if (code == 0) { /* not reusable: a fresh one next time */
    event_base_once(L->base, -1, EV_TIMEOUT, free_later, k->c, NULL);
    k->c = NULL;
  }
  k->busy = false;
  L->idle[k->port_i * L->o->max_conns + L->n_idle[k->port_i]++] =
      (uint32_t)(k - L->conns);
  bool fin = open_loop(L) ? L->done == L->total
                          : L->inflight == 0 && (L->o->count
                                                     ? L->done >= L->o->count
                                                     : now_s() >= L->t_stop);
  if (fin)
    event_base_loopexit(L->base, NULL);
  else
    next_for(L, k);
}

/* an idle connection to port p, a new one, or NULL (all busy) */
static conn *conn_for(lg *L, uint32_t p) {
  conn *k = NULL;
  for (uint32_t j = 0; j < L->o->n_ports && L->n_idle[p] == 0; j++)
    p = L->n_conns < L->o->max_conns ? p : (p + 1) % L->o->n_ports;
  if (L->n_idle[p] > 0)
    k = &L->conns[L->idle[p * L->o->max_conns + --L->n_idle[p]]];
  else if (L->n_conns < L->o->max_conns) {
    k = &L->conns[L->n_conns++];
    *k = (conn){.L = L, .port_i = p};
  }
  if (k && k->c == NULL) {
    k->c = evhttp_connection_base_new(L->base, NULL, "127.0.0.1",
                                      L->o->port[p]);
    if (k->c)
      evhttp_connection_set_timeout(k->c, (int)ceil(L->o->timeout_s));
  }
  return k;
}

static int send_on(lg *L, conn *k, uint64_t idx) {
  const br_load_opts *o = L->o;
  struct evhttp_request *hr = evhttp_request_new(on_done, k);
  if (hr == NULL)
    return -1;
  uint32_t b = (uint32_t)(idx % o->n_bodies);
  struct evkeyvalq *h = evhttp_request_get_output_headers(hr);
  evhttp_add_header(h, "Host", "127.0.0.1");
  evhttp_add_header(h, "Content-Type", "application/json");
  evbuffer_add_reference(evhttp_request_get_output_buffer(hr), o->bodies[b],
                         o->body_len[b], NULL, NULL);
  if (evhttp_make_request(k->c, hr, EVHTTP_REQ_POST, o->path) != 0)
    return -1; /* hr freed by libevent */
  no_delay(k->c);
  return 0;
}

static void dispatch(lg *L, uint64_t idx, double t_sched) {
  uint32_t p = L->rr++ % L->o->n_ports;
  conn *k = conn_for(L, p);
  if (k == NULL || k->c == NULL) {
    if (k) /* could not create one: back to the idle list, retried later */
      L->idle[p * L->o->max_conns + L->n_idle[p]++] = (uint32_t)(k - L->conns);
    L->wait[(L->wait_head + L->wait_n++) % L->total] = idx;
    return;
  }
  double lag = now_s() - t_sched;
  L->r->late_us_max = fmax(L->r->late_us_max, lag * 1e6);
  k->busy = true;
  k->idx = idx;
  k->t_sched = t_sched;
  L->inflight++;
  if (send_on(L, k, idx) < 0)
    on_done(NULL, k); /* counted as an error */
}

static void on_timer(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  pump(arg);
}

static void arm(lg *L, double in_s) {
  struct timeval tv = {(time_t)in_s, (suseconds_t)((in_s - floor(in_s)) * 1e6)};
  evtimer_add(L->timer, &tv);
}

/* Open loop: everything due goes out now, the timer waits for the next.
 * Closed loop: refills up to o->closed outstanding until the stop time. */
static void pump(lg *L) {
  double now = now_s();
  if (!open_loop(L)) {
    bool more = L->o->count ? L->next < L->o->count : now < L->t_stop;
    while (more && L->inflight + L->wait_n < L->o->closed) {
      dispatch(L, L->next++, now);
      more = L->o->count ? L->next < L->o->count : true;
    }
    return;
  }
  while (L->next < L->total && sched_of(L, L->next) <= now) {
    dispatch(L, L->next, sched_of(L, L->next));
    L->next++;
  }
  if (L->next < L->total)
    arm(L, fmax(0, sched_of(L, L->next) - now_s()));
}

/* The deadline: whatever measured request is not done is counted at its
 * age (a lower bound on its latency) and the run ends. */
static void on_cut(evutil_socket_t fd, short ev, void *arg) {
  (void)fd, (void)ev;
  lg *L = arg;
  double t = now_s();
  for (uint32_t i = 0; i < L->n_conns; i++) {
    conn *k = &L->conns[i];
    if (k->busy && measured(L, k->idx, k->t_sched)) {
      L->r->unfinished++;
      add_lat(L, (t - k->t_sched) * 1e6);
    }
  }
  for (uint64_t j = 0; j < L->wait_n; j++) {
    uint64_t idx = L->wait[(L->wait_head + j) % L->total];
    if (open_loop(L) && measured(L, idx, 0)) {
      L->r->unfinished++;
      add_lat(L, (t - sched_of(L, idx)) * 1e6);
    }
  }
  for (uint64_t i = L->next; open_loop(L) && i < L->total; i++)
    if (measured(L, i, 0)) {
      L->r->unfinished++;
      add_lat(L, (t - sched_of(L, i)) * 1e6);
    }
  L->cut_done = true;
  event_base_loopexit(L->base, NULL);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double pct(const double *v, size_t n, double q) {
  if (n == 0)
    return NAN;
  size_t i = (size_t)ceil(q * (double)n);
  return v[i > 0 ? i - 1 : 0];
}

static void summarize(lg *L) {
  br_load_result *r = L->r;
  const br_load_opts *o = L->o;
  r->measured = open_loop(L) ? L->total - L->n_warm
                             : r->ok + r->errors + r->unfinished;
  if (L->n_lat > 0) /* qsort(NULL, 0, ...) is undefined */
    qsort(L->lat, L->n_lat, sizeof *L->lat, cmp_d);
  r->p50_us = pct(L->lat, L->n_lat, 0.50);
  r->p99_us = pct(L->lat, L->n_lat, 0.99);
  r->max_us = L->n_lat ? L->lat[L->n_lat - 1] : NAN;
  double span = o->duration_s;
  if (open_loop(L) && L->t_last_done - L->t_meas > span)
    span = L->t_last_done - L->t_meas;
  r->achieved = span > 0 ? (double)r->ok / span : 0;
}

static int lg_init(lg *L, const br_load_opts *o, br_load_result *r) {
  memset(r, 0, sizeof *r);
  *L = (lg){.o = o, .r = r};
  uint64_t cap = o->rate > 0 ? (uint64_t)ceil(o->rate * o->warmup_s) +
                                   (uint64_t)ceil(o->rate * o->duration_s)
                             : (uint64_t)o->closed + 1;
  L->n_warm = o->rate > 0 ? (uint64_t)ceil(o->rate * o->warmup_s) : 0;
  L->total = cap;
  struct event_config *cfg = event_config_new(); /* sub-ms arrivals */
  if (cfg) {
    event_config_set_flag(cfg, EVENT_BASE_FLAG_PRECISE_TIMER);
    L->base = event_base_new_with_config(cfg);
    event_config_free(cfg);
  }
  L->conns = calloc(o->max_conns, sizeof *L->conns);
  L->idle = calloc((size_t)o->max_conns * o->n_ports, sizeof *L->idle);
  L->n_idle = calloc(o->n_ports, sizeof *L->n_idle);
  L->wait = calloc(cap, sizeof *L->wait);
  if (L->base == NULL || !L->conns || !L->idle || !L->n_idle || !L->wait)
    return -1;
  L->timer = evtimer_new(L->base, on_timer, L);
  L->cut = evtimer_new(L->base, on_cut, L);
  return L->timer && L->cut ? 0 : -1;
}

static void lg_fini(lg *L) {
  for (uint32_t i = 0; i < L->n_conns; i++)
    if (L->conns[i].c)
      evhttp_connection_free(L->conns[i].c);
  if (L->timer)
    event_free(L->timer);
  if (L->cut)
    event_free(L->cut);
  if (L->base) {
    event_base_loop(L->base, EVLOOP_NONBLOCK); /* deferred frees */
    event_base_free(L->base);
  }
  free(L->conns);
  free(L->idle);
  free(L->n_idle);
  free(L->wait);
  free(L->lat);
}

int br_load_run(const br_load_opts *o, br_load_result *r) {
  lg L;
  if (o->n_ports == 0 || o->n_ports > BR_PORTS_MAX || o->n_bodies == 0 ||
      o->max_conns == 0 || (o->rate <= 0 && o->closed == 0)) {
    memset(r, 0, sizeof *r);
    return -1;
  }
  int rc = lg_init(&L, o, r);
  if (rc == 0) {
    L.t0 = now_s() + 0.001;
    L.t_meas = open_loop(&L) ? sched_of(&L, L.n_warm) : L.t0 + o->warmup_s;
    L.t_stop = open_loop(&L) ? sched_of(&L, L.total)
                             : L.t_meas + (o->count ? 0 : o->duration_s);
    double cut = o->count ? o->timeout_s : L.t_stop - L.t0 + o->grace_s;
    arm(&L, 0.001);
    struct timeval tv = {(time_t)cut, (suseconds_t)((cut - floor(cut)) * 1e6)};
    evtimer_add(L.cut, &tv);
    event_base_dispatch(L.base);
    summarize(&L);
  }
  lg_fini(&L);
  return rc;
}

/* ---- a plain GET (the routers' /metrics) ---------------------------------- */
char *br_http_get(uint16_t port, const char *path) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  struct timeval tv = {2, 0};
  char req[256];
  int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
                   path);
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  if (fd < 0 || buf == NULL ||
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) < 0 ||
      connect(fd, (struct sockaddr *)&a, sizeof a) < 0 ||
      send(fd, req, (size_t)n, MSG_NOSIGNAL) != n)
    goto fail;
  for (ssize_t r; (r = recv(fd, buf + len, cap - len - 1, 0)) != 0;) {
    if (r < 0)
      goto fail;
    len += (size_t)r;
    char *nb = len + 1 == cap ? realloc(buf, cap *= 2) : buf;
    if (nb == NULL)
      goto fail;
    buf = nb;
  }
  close(fd);
  buf[len] = '\0';
  char *body = strstr(buf, "\r\n\r\n");
  if (strncmp(buf, "HTTP/1.", 7) != 0 || atoi(buf + 9) != 200 || body == NULL)
    return free(buf), NULL;
  memmove(buf, body + 4, strlen(body + 4) + 1);
  return buf;
fail:
  if (fd >= 0)
    close(fd);
  free(buf);
  return NULL;
}
