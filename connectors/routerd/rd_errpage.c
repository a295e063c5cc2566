/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd: the errors evhttp answers on its own (a malformed request
 * line or header, a chunk it cannot parse: 400; headers or a body over
 * max_headers / max_body: 413; a bad Expect: 417; a method no listener
 * takes: 501) go out as OpenAI-style JSON with the code's reason phrase,
 * like every error the router writes itself.  libevent 2.1 has no hook for
 * them (evhttp_send_error writes a fixed HTML page), so each accepted
 * connection's output buffer is watched: a reply that is exactly evhttp's
 * error page -- its HTML body written whole right after a head with
 * "Content-Type: text/html" and "Connection: close" -- is replaced in the
 * buffer before a byte of it is written.  evhttp still closes the
 * connection after it, as it would have. */
#include "rd.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char page_head[] = "<HTML><HEAD>\n<TITLE>";
static const char page_tail[] = "</BODY></HTML>\n";

#define PAGE_MAX 512 /* evhttp's page: the code and its phrase twice */
#define HEAD_MAX 1024

static _Thread_local bool rewriting; /* our own edit calls us back */

static const char *message(int code) {
  switch (code) {
  /* libevent's classes: a header line over max_headers is a 400, a
   * chunk size it cannot read a 413 */
  case 400: return "malformed HTTP request (request line or headers), or "
                   "headers over routerd.max_headers";
  case 413: return "request body over routerd.max_body, or its chunked "
                   "framing malformed";
  case 417: return "unsupported Expect header (only 100-continue)";
  case 501: return "method not implemented here";
  default:  return "request refused by the HTTP layer";
  }
}

/* The codes evhttp_send_error is called with inside libevent 2.1.12 --
 * 400, 413, 417, 501 -- with their phrases there: an add whose length is
 * none of their pages' is not one and is not looked at, so the relay's
 * chunks pass with four compares. */
/* evhttp_send_error's ERR_FORMAT with (code, phrase, phrase): its length */
#define PAGE_LEN(r)                                                            \
  (sizeof "<HTML><HEAD>\n<TITLE>000 </TITLE>\n</HEAD><BODY>\n<H1></H1>\n"    \
          "</BODY></HTML>\n" - 1 + 2 * (sizeof r - 1))

static const size_t page_lens[] = {
    PAGE_LEN("Bad Request"), PAGE_LEN("Request Entity Too Large"),
    PAGE_LEN("Expectation Failed"), PAGE_LEN("Not Implemented")};

static bool page_sized(size_t n) {
  for (size_t i = 0; i < sizeof page_lens / sizeof *page_lens; i++)
    if (n == page_lens[i])
      return true;
  return false;
}

static const char *phrase(int code) {
  switch (code) { /* libevent's own phrases, as evhttp_send_reply writes */
  case 400: return "Bad Request";
  case 413: return "Request Entity Too Large";
  case 417: return "Expectation Failed";
  case 501: return "Not Implemented";
  case 503: return "Service Unavailable";
  default:  return code < 500 ? "Bad Request" : "Internal Server Error";
  }
}

/* where the head of the reply whose body starts at body_at begins: the last
 * status line before it; -1 if none */
static ev_ssize_t head_start(struct evbuffer *out, size_t body_at) {
  ev_ssize_t last = -1;
  struct evbuffer_ptr p = evbuffer_search(out, "HTTP/1.", 7, NULL);
  while (p.pos != -1 && (size_t)p.pos < body_at) {
    last = p.pos;
    if (evbuffer_ptr_set(out, &p, 1, EVBUFFER_PTR_ADD) < 0)
      break;
    p = evbuffer_search(out, "HTTP/1.", 7, &p);
  }
  return last;
}

/* n bytes of out from at (evbuffer_peek: evbuffer_copyout_from refuses a
 * socket bufferevent's output once written: its start is frozen) */
static bool copy_at(struct evbuffer *out, size_t at, char *dst, size_t n) {
  struct evbuffer_ptr p;
  struct evbuffer_iovec v[8];
  if (evbuffer_ptr_set(out, &p, at, EVBUFFER_PTR_SET) < 0)
    return false;
  int nv = evbuffer_peek(out, (ev_ssize_t)n, &p, v, 8);
  size_t got = 0;
  for (int i = 0; i < nv && i < 8 && got < n; i++) {
    size_t k = v[i].iov_len < n - got ? v[i].iov_len : n - got;
    memcpy(dst + got, v[i].iov_base, k);
    got += k;
  }
  return got == n;
}

/* the reply [head, end of out) replaced by the JSON one */
static void replace(struct evbuffer *out, size_t head, int code) {
  char *j = rd_error_json(code, "", message(code));
  if (j == NULL)
    return; /* the HTML page goes out: better than none */
  char m[HEAD_MAX + 512];
  int n = snprintf(m, sizeof m, "HTTP/1.1 %d %s\r\nContent-Type: "
                   "application/json\r\nConnection: close\r\nContent-Length: "
                   "%zu\r\n\r\n%s", code, phrase(code), strlen(j), j);
  free(j);
  if (n < 0 || (size_t)n >= sizeof m)
    return;
  struct evbuffer *keep = evbuffer_new();
  if (keep == NULL)
    return;
  /* A socket bufferevent's output is frozen at its start once written
   * (only its write callback drains it, unfreezing around the write): the
   * same here, around the edit.  A drain of 0 bytes fails only if frozen. */
  bool frozen = evbuffer_drain(out, 0) < 0;
  if (frozen)
    evbuffer_unfreeze(out, 1);
  rewriting = true;
  size_t len = evbuffer_get_length(out);
  if (evbuffer_remove_buffer(out, keep, head) == (int)head &&
      evbuffer_drain(out, len - head) == 0) {
    evbuffer_add_buffer(out, keep);
    evbuffer_add(out, m, (size_t)n);
  } else { /* cannot happen: keep it whole */
    evbuffer_prepend_buffer(out, keep);
  }
  rewriting = false;
  if (frozen)
    evbuffer_freeze(out, 1);
  evbuffer_free(keep);
}

static void on_output(struct evbuffer *out, const struct evbuffer_cb_info *info,
                      void *arg) {
  (void)arg;
  size_t len = evbuffer_get_length(out), nb = info->n_added;
  if (rewriting || !page_sized(nb) || nb > PAGE_MAX || info->n_deleted ||
      len < nb)
    return;
  char page[PAGE_MAX + 1];
  size_t body_at = len - nb;
  if (!copy_at(out, body_at, page, nb))
    return;
  page[nb] = 0;
  if (memcmp(page, page_head, sizeof page_head - 1) ||
      strcmp(page + nb - (sizeof page_tail - 1), page_tail))
    return;
  int code = atoi(page + sizeof page_head - 1);
  ev_ssize_t head = head_start(out, body_at);

  if (code < 400 || code > 599 || head < 0 ||
      body_at - (size_t)head > HEAD_MAX)
    return;
  char h[HEAD_MAX + 1];
  size_t hn = body_at - (size_t)head;
  if (!copy_at(out, (size_t)head, h, hn))
    return;
  h[hn] = 0;
  if (hn >= 4 && !strcmp(h + hn - 4, "\r\n\r\n") &&
      strstr(h, "\r\nContent-Type: text/html\r\n") &&
      strstr(h, "\r\nConnection: close\r\n"))
    replace(out, (size_t)head, code);
}

void rd_errpage_watch(struct bufferevent *bev) {
  evbuffer_add_cb(bufferevent_get_output(bev), on_output, NULL);
}

struct bufferevent *rd_errpage_bevcb(struct event_base *base, void *arg) {
  (void)arg;
  struct bufferevent *bev =
      bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
  if (bev)
    rd_errpage_watch(bev);
  return bev; /* NULL: evhttp makes its own, unwatched */
}
