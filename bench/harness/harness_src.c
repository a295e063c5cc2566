/* SPDX-License-Identifier: Apache-2.0 */
/* Byte sources for the trace readers: a file or a memory buffer, zstd frames
 * decompressed transparently through libzstd's streaming API (never the
 * whole file in memory), and a line splitter with line numbers. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <zstd.h>

#include "harness.h"

#define IN_CAP (1u << 17)
#define DEC_CAP (1u << 17)
#define LINE_MAX_BYTES (256u << 20)

struct bh_src {
  FILE *f;
  const uint8_t *mem;
  size_t mem_size, mem_pos;
  ZSTD_DStream *ds;  /* NULL: plain */
  size_t zret;       /* last ZSTD_decompressStream result (0: frame done) */
  uint8_t *in;       /* raw bytes read ahead */
  size_t in_pos, in_len;
  bool raw_eof;
  uint8_t *dec;      /* decoded bytes for getline */
  size_t dec_pos, dec_len;
  bool dec_eof;
  char *line;
  size_t line_cap;
  uint64_t lineno;
  char name[256];
  char error[512];
};

static int fill_raw(bh_src *s) {
  if (s->in_pos < s->in_len || s->raw_eof)
    return 0;
  s->in_pos = 0;
  if (s->f != NULL) {
    s->in_len = fread(s->in, 1, IN_CAP, s->f);
    if (s->in_len == 0) {
      if (ferror(s->f)) {
        snprintf(s->error, sizeof s->error, "%s: read error: %s", s->name,
                 strerror(errno));
        return -EIO;
      }
      s->raw_eof = true;
    }
    return 0;
  }
  size_t n = s->mem_size - s->mem_pos;
  if (n > IN_CAP)
    n = IN_CAP;
  memcpy(s->in, s->mem + s->mem_pos, n);
  s->mem_pos += n;
  s->in_len = n;
  if (n == 0)
    s->raw_eof = true;
  return 0;
}

static int src_new(const char *name, bh_src **out) {
  bh_src *s = calloc(1, sizeof *s);
  if (s == NULL)
    return KVP_ENOMEM;
  s->in = malloc(IN_CAP);
  s->dec = malloc(DEC_CAP);
  if (s->in == NULL || s->dec == NULL) {
    bh_src_close(s);
    return KVP_ENOMEM;
  }
  snprintf(s->name, sizeof s->name, "%s", name != NULL ? name : "(memory)");
  *out = s;
  return 0;
}

/* Looks at the first bytes: a zstd frame's magic selects decompression. */
static int src_start(bh_src *s) {
  int rc = fill_raw(s);
  if (rc < 0)
    return rc;
  if (s->in_len >= 4 &&
      ((uint32_t)s->in[0] | (uint32_t)s->in[1] << 8 |
       (uint32_t)s->in[2] << 16 | (uint32_t)s->in[3] << 24) ==
          ZSTD_MAGICNUMBER) {
    s->ds = ZSTD_createDStream();
    if (s->ds == NULL)
      return KVP_ENOMEM;
    /* refuse absurd windows from hostile frames (memory bound) */
    ZSTD_DCtx_setParameter(s->ds, ZSTD_d_windowLogMax, 27);
    s->zret = 1;
  }
  return 0;
}

int bh_src_open_file(const char *path, bh_src **out, char *err, size_t cap) {
  bh_src *s;
  *out = NULL;
  int rc = src_new(path, &s);
  if (rc < 0) {
    snprintf(err, cap, "%s: out of memory", path);
    return rc;
  }
  s->f = fopen(path, "rb");
  if (s->f == NULL) {
    rc = -errno;
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    bh_src_close(s);
    return rc;
  }
  rc = src_start(s);
  if (rc < 0) {
    snprintf(err, cap, "%s", s->error[0] ? s->error : "cannot start reading");
    bh_src_close(s);
    return rc;
  }
  *out = s;
  return 0;
}

int bh_src_open_mem(const void *data, size_t size, const char *name,
                    bh_src **out) {
  bh_src *s;
  *out = NULL;
  int rc = src_new(name, &s);
  if (rc < 0)
    return rc;
  s->mem = data;
  s->mem_size = size;
  rc = src_start(s);
  if (rc < 0) {
    bh_src_close(s);
    return rc;
  }
  *out = s;
  return 0;
}

void bh_src_close(bh_src *s) {
  if (s == NULL)
    return;
  if (s->f != NULL)
    fclose(s->f);
  ZSTD_freeDStream(s->ds);
  free(s->in);
  free(s->dec);
  free(s->line);
  free(s);
}

const char *bh_src_name(const bh_src *s) { return s->name; }
uint64_t bh_src_lineno(const bh_src *s) { return s->lineno; }
const char *bh_src_error(const bh_src *s) { return s->error; }

long bh_src_read(bh_src *s, void *buf, size_t cap) {
  if (cap == 0)
    return 0;
  for (;;) {
    int rc = fill_raw(s);
    if (rc < 0)
      return rc;
    if (s->ds == NULL) {
      size_t n = s->in_len - s->in_pos;
      if (n > cap)
        n = cap;
      memcpy(buf, s->in + s->in_pos, n);
      s->in_pos += n;
      return (long)n;
    }
    if (s->in_pos == s->in_len && s->raw_eof) {
      if (s->zret != 0) {
        snprintf(s->error, sizeof s->error,
                 "%s: truncated zstd stream (frame incomplete)", s->name);
        return KVP_ETRUNC;
      }
      return 0;
    }
    ZSTD_inBuffer zi = {s->in, s->in_len, s->in_pos};
    ZSTD_outBuffer zo = {buf, cap, 0};
    size_t r = ZSTD_decompressStream(s->ds, &zo, &zi);
    s->in_pos = zi.pos;
    if (ZSTD_isError(r)) {
      snprintf(s->error, sizeof s->error, "%s: zstd: %s", s->name,
               ZSTD_getErrorName(r));
      return KVP_ECORRUPT;
    }
    s->zret = r;
    if (zo.pos > 0)
      return (long)zo.pos;
  }
}

int bh_src_getline(bh_src *s, char **line, size_t *len) {
  size_t n = 0;
  bool any = false;
  for (;;) {
    if (s->dec_pos == s->dec_len) {
      if (s->dec_eof)
        break;
      long r = bh_src_read(s, s->dec, DEC_CAP);
      if (r < 0)
        return (int)r;
      if (r == 0) {
        s->dec_eof = true;
        break;
      }
      s->dec_pos = 0;
      s->dec_len = (size_t)r;
    }
    any = true;
    uint8_t *p = s->dec + s->dec_pos;
    size_t avail = s->dec_len - s->dec_pos;
    uint8_t *nl = memchr(p, '\n', avail);
    size_t take = nl != NULL ? (size_t)(nl - p) : avail;
    if (n + take + 1 > s->line_cap) {
      if (n + take + 1 > LINE_MAX_BYTES) {
        snprintf(s->error, sizeof s->error, "%s:%llu: line longer than %u bytes",
                 s->name, (unsigned long long)s->lineno + 1, LINE_MAX_BYTES);
        return KVP_ERANGE;
      }
      size_t nc = s->line_cap ? s->line_cap : 4096;
      while (nc < n + take + 1)
        nc *= 2;
      char *nb = realloc(s->line, nc);
      if (nb == NULL)
        return KVP_ENOMEM;
      s->line = nb;
      s->line_cap = nc;
    }
    memcpy(s->line + n, p, take);
    n += take;
    s->dec_pos += take + (nl != NULL);
    if (nl != NULL)
      goto done;
  }
  if (!any && n == 0)
    return 0;
done:
  if (s->line == NULL) { /* empty first line */
    s->line = malloc(1);
    if (s->line == NULL)
      return KVP_ENOMEM;
    s->line_cap = 1;
  }
  if (n > 0 && s->line[n - 1] == '\r')
    n--;
  s->line[n] = '\0';
  s->lineno++;
  *line = s->line;
  *len = n;
  return 1;
}
