/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd admin listener (only with routerd.admin_listen; off
 * loopback it needs admin_token, compared in constant time): add, remove
 * and drain workers while serving.  Each change and each refused token is
 * logged with the peer's address.
 *   GET    /admin/workers                     the workers and their state
 *   POST   /admin/workers   {"url", "kv_events"?, "kv_replay"?}   add one
 *   DELETE /admin/workers?url=U               drain, then remove when idle
 *   POST   /admin/workers/drain?url=U         no new requests
 *   POST   /admin/workers/undrain?url=U       serve again
 *   GET    /admin/index                       each worker's residency digest */
#include "rd.h"

#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char *const state_names[] = {"free", "up", "down", "draining"};

static void log_action(struct evhttp_request *hr, int code, const char *url);


/* s->mu: the front-door loops change inflight, requests, failures, state */
static void list(rd_server *s, struct evhttp_request *hr) {
  json_t *a = json_array();
  rd_lock(s);
  for (uint32_t i = 0; i < s->n_w; i++) {
    const rd_worker *w = &s->w[i];
    if (w->state == RD_W_FREE)
      continue;
    json_array_append_new(a, json_pack(
        "{s:i, s:s, s:s, s:s, s:s, s:b, s:I, s:I, s:I, s:i, s:i, s:f}", "id",
        (int)w->id, "url", w->url, "state", state_names[w->state], "kv_events",
        w->kv_events, "kv_replay", w->kv_replay, "removing", w->removing,
        "inflight", (json_int_t)w->inflight, "requests", (json_int_t)w->requests,
        "failures", (json_int_t)w->fails, "running",
        (int)w->load.running_requests, "waiting", (int)w->load.queued_requests,
        "kv_usage", w->load.kv_util));
  }
  rd_unlock(s);
  rd_reply_obj(hr, 200, json_pack("{s:o}", "workers", a));
}

static void add(rd_server *s, struct evhttp_request *hr) {
  struct evbuffer *in = evhttp_request_get_input_buffer(hr);
  json_t *o = json_loadb((const char *)evbuffer_pullup(in, -1),
                         evbuffer_get_length(in), 0, NULL);
  const char *url = json_string_value(json_object_get(o, "url"));
  const char *ev = json_string_value(json_object_get(o, "kv_events"));
  const char *rp = json_string_value(json_object_get(o, "kv_replay"));
  char err[512];
  int id = -1;
  if (url == NULL)
    snprintf(err, sizeof err, "expected {\"url\": ..., \"kv_events\"?: ..., "
             "\"kv_replay\"?: ...}");
  else
    id = rd_worker_add(s, url, ev, rp, err, sizeof err);
  log_action(hr, id >= 0 ? 201 : 400, url);
  if (id >= 0)
    rd_reply_obj(hr, 201, json_pack("{s:i, s:s}", "id", id, "url", url));
  else
    rd_reply_obj(hr, 400, json_pack("{s:{s:s}}", "error", "message", err));
  json_decref(o);
}

/* GET /admin/index: each worker's residency digest (kvp_index_digest):
 * equal digests = equal block sets, e.g. a replica fed from JetStream vs
 * one fed live from ZeroMQ. */
static void index_digests(rd_server *s, struct evhttp_request *hr) {
  json_t *a = json_array();
  for (uint32_t i = 0; i < s->n_w; i++) {
    uint64_t d = 0;
    char hex[20];
    if (s->w[i].state == RD_W_FREE || kvp_index_digest(s->ix, i, &d) < 0)
      continue;
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)d);
    json_array_append_new(a, json_pack("{s:s, s:s}", "url", s->w[i].url,
                                       "digest", hex));
  }
  rd_reply_obj(hr, 200, json_pack("{s:o}", "workers", a));
}

static rd_worker *by_query(rd_server *s, struct evhttp_request *hr) {
  struct evkeyvalq q;
  const char *uri = evhttp_request_get_uri(hr), *qs = strchr(uri, '?');
  rd_worker *w = NULL;
  if (qs && evhttp_parse_query_str(qs + 1, &q) == 0) {
    const char *url = evhttp_find_header(&q, "url");
    w = url ? rd_worker_find(s, url) : NULL;
    evhttp_clear_headers(&q);
  }
  return w;
}

/* constant time whatever the lengths: the digests are compared */
static bool token_eq(const char *got, size_t n, const char *want) {
  unsigned char a[SHA256_DIGEST_LENGTH], b[SHA256_DIGEST_LENGTH];
  SHA256((const unsigned char *)got, n, a);
  SHA256((const unsigned char *)want, strlen(want), b);
  return CRYPTO_memcmp(a, b, sizeof a) == 0;
}

void rd_peer(struct evhttp_request *hr, char *out, size_t cap) {
  struct evhttp_connection *cn = evhttp_request_get_connection(hr);
  const char *addr = NULL;
  uint16_t port = 0;
  if (cn)
    evhttp_connection_get_peer(cn, (char **)&addr, &port);
  snprintf(out, cap, "%s:%u", addr ? addr : "?", port);
}

bool rd_authorized(struct evhttp_request *hr, const char *what,
                   const char *tok1, const char *tok2) {
  if (!*tok1 && !*tok2)
    return true;
  const char *a = evhttp_find_header(evhttp_request_get_input_headers(hr),
                                     "Authorization");
  bool ok = false;
  if (a && strncasecmp(a, "Bearer", 6) == 0 && (a[6] == ' ' || a[6] == '\t')) {
    const char *t = a + 7;
    t += strspn(t, " \t");
    size_t n = strlen(t);
    while (n && (t[n - 1] == ' ' || t[n - 1] == '\t'))
      n--;
    bool m1 = *tok1 && token_eq(t, n, tok1); /* both compared: no early */
    bool m2 = *tok2 && token_eq(t, n, tok2); /* out on the first token */
    ok = m1 || m2;
  }
  if (!ok) {
    char peer[80];
    rd_peer(hr, peer, sizeof peer);
    kvp_log(KVP_LOG_WARN, "routerd", "%s: refused %s %s from %s: %s", what,
            rd_method_name(evhttp_request_get_command(hr)),
            evhttp_request_get_uri(hr), peer,
            a ? "wrong bearer token" : "no bearer token");
    evhttp_add_header(evhttp_request_get_output_headers(hr),
                      "WWW-Authenticate", "Bearer realm=\"kvplane-routerd\"");
    rd_reply_error(hr, 401, "", a ? "wrong bearer token"
                                  : "a bearer token is required");
  }
  return ok;
}

const char *rd_method_name(enum evhttp_cmd_type m) {
  switch (m) {
  case EVHTTP_REQ_GET: return "GET";
  case EVHTTP_REQ_POST: return "POST";
  case EVHTTP_REQ_DELETE: return "DELETE";
  case EVHTTP_REQ_PUT: return "PUT";
  case EVHTTP_REQ_HEAD: return "HEAD";
  default: return "OTHER";
  }
}

/* every change an admin makes, with who made it */
static void log_action(struct evhttp_request *hr, int code, const char *url) {
  char peer[80];
  rd_peer(hr, peer, sizeof peer);
  kvp_log(KVP_LOG_WARN, "routerd", "admin: %s %s (url %s) from %s: %d",
          rd_method_name(evhttp_request_get_command(hr)),
          evhttp_request_get_uri(hr), url ? url : "-", peer, code);
}

static void mutate(rd_server *s, struct evhttp_request *hr, bool drain,
                   bool undrain) {
  rd_worker *w = by_query(s, hr);
  if (w == NULL) {
    log_action(hr, 404, NULL);
    rd_reply_error(hr, 404, "url", "no worker with that ?url=");
    return;
  }
  if (undrain)
    rd_worker_undrain(w);
  else
    rd_worker_drain(w, !drain);
  log_action(hr, 202, w->url);
  rd_reply_obj(hr, 202, json_pack("{s:s, s:s}", "url", w->url, "state",
                                  state_names[w->state]));
}

void rd_on_admin(struct evhttp_request *hr, void *arg) {
  rd_server *s = arg;
  const char *uri = evhttp_request_get_uri(hr);
  size_t plen = strcspn(uri, "?");
  enum evhttp_cmd_type m = evhttp_request_get_command(hr);
  if (!rd_framing_ok(hr) || !rd_authorized(hr, "admin", s->cfg.admin_token, ""))
    return;
  bool workers = plen == 14 && strncmp(uri, "/admin/workers", 14) == 0;
  bool drain = strncmp(uri, "/admin/workers/drain", plen) == 0 && plen == 20;
  bool undrain = strncmp(uri, "/admin/workers/undrain", plen) == 0 && plen == 22;
  bool index = plen == 12 && strncmp(uri, "/admin/index", 12) == 0;
  bool post = m == EVHTTP_REQ_POST, get = m == EVHTTP_REQ_GET;
  if (workers && get)
    list(s, hr);
  else if (index && get)
    index_digests(s, hr);
  else if (workers && post)
    add(s, hr);
  else if ((workers && m == EVHTTP_REQ_DELETE) || ((drain || undrain) && post))
    mutate(s, hr, drain, undrain);
  else if (workers || index || drain || undrain) {
    evhttp_add_header(evhttp_request_get_output_headers(hr), "Allow",
                      workers ? "GET, POST, DELETE" : index ? "GET" : "POST");
    rd_reply_error(hr, 405, "", "method not allowed here");
  } else
    rd_reply_error(hr, 404, "", "no such admin endpoint");
}

/* ---- the config's worker list is the truth (start, SIGHUP) -------------- */
static const char *item(const char *list, size_t i, char *buf, size_t cap) {
  const char *p = list;
  for (size_t k = 0; k < i && p; k++)
    p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
  if (p == NULL || *list == '\0')
    return "";
  size_t n = strcspn(p, ",");
  snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
  return buf;
}

int rd_apply_workers(rd_server *s, const rd_cfg *c) {
  char u[RD_URL_MAX], e[RD_URL_MAX], r[RD_URL_MAX], err[512];
  int bad = 0;
  for (uint32_t i = 0; i < s->n_w; i++) { /* gone from the list: removed */
    rd_worker *w = &s->w[i];
    bool keep = false;
    for (size_t k = 0; w->state != RD_W_FREE && *item(c->urls, k, u, sizeof u); k++)
      keep = keep || strcmp(u, w->url) == 0;
    if (w->state != RD_W_FREE && !keep)
      rd_worker_drain(w, true);
  }
  for (size_t k = 0; *item(c->urls, k, u, sizeof u); k++) {
    if (rd_worker_find(s, u))
      continue;
    if (rd_worker_add(s, u, item(c->kv_events, k, e, sizeof e),
                      item(c->kv_replay, k, r, sizeof r), err, sizeof err) < 0) {
      kvp_log(KVP_LOG_ERROR, "routerd", "%s", err);
      bad++;
    }
  }
  for (size_t k = 0; *item(c->urls, k, u, sizeof u); k++) { /* P/D roles */
    rd_worker *w = rd_worker_find(s, u);
    rd_role role = RD_ROLE_BOTH;
    if (w && rd_role_parse(item(c->roles, k, r, sizeof r), &role) == 0)
      rd_pd_set_role(w, role);
    else if (w) /* no roles list: every worker serves both */
      rd_pd_set_role(w, RD_ROLE_BOTH);
  }
  return bad ? -1 : 0;
}
