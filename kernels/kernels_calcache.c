/* SPDX-License-Identifier: Apache-2.0 */
/* The calibration cache: kvp__calibrate's figures kept in a small text file
 * per GPU, so a restart (or the next worker process on the same GPU) skips
 * the ~0.3 s measurement.  A file is used only when its key -- the device's
 * identity (UUID, PCI bus, driver version), this library's version, a hash
 * of the embedded kernels and the CTA budget / threads the kernel figures
 * were measured with -- equals the running one; anything else (another GPU,
 * a driver or kvplane upgrade, a malformed or truncated file) is a miss that
 * measures again and rewrites the file (temporary file + rename: readers
 * never see half a file).  The figures only choose between two correct
 * transfer methods and feed cost models: a bad file can cost speed, never
 * bytes.
 *
 * Format v1 (ASCII, '\n' line ends, exactly these lines in this order):
 *   kvplane-calibration 1
 *   key <printable ASCII, 1..511 bytes, no control characters>
 *   sizes <KVP_CAL_SIZES page sizes: 4096 8192 ... as decimal integers>
 *   h2d <kernel GB/s> <copy-engine GB/s>   (one pair per size, same order)
 *   d2h <kernel GB/s> <copy-engine GB/s> ...
 *   end
 * GB/s figures are finite, > 0 and < 100000, printed with %.17g (exact
 * round trip). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels_internal.h"

#define CAL_MAGIC "kvplane-calibration 1"
#define CAL_FILE_MAX 8192

static int bad(char *why, size_t cap, const char *what, int line) {
  if (why && cap)
    snprintf(why, cap, "line %d: %s", line, what);
  return KVP_EINVAL;
}

/* printf / strtod follow LC_NUMERIC, which a host program may have set to a
 * decimal comma: the file is always written and read in the C locale. */
static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static void c_locale_init(void) {
  c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
}
static locale_t enter_c(void) {
  pthread_once(&c_locale_once, c_locale_init);
  return c_locale ? uselocale(c_locale) : (locale_t)0;
}
static void leave_c(locale_t old) {
  if (old)
    uselocale(old);
}

static int format_c(const char *key, const double bw[2][KVP_CAL_SIZES][2],
                    char *out, size_t cap) {
  size_t klen = key ? strlen(key) : 0;
  if (!key || klen == 0 || klen > KVP_CALCACHE_KEY_MAX)
    return KVP_EINVAL;
  for (size_t i = 0; i < klen; i++)
    if ((unsigned char)key[i] < 0x20 || (unsigned char)key[i] > 0x7e)
      return KVP_EINVAL;
  size_t n = 0;
#define PUT(...)                                                               \
  do {                                                                         \
    int k_ = snprintf(out + n, n < cap ? cap - n : 0, __VA_ARGS__);            \
    if (k_ < 0)                                                                \
      return KVP_EINVAL;                                                       \
    n += (size_t)k_;                                                           \
  } while (0)
  PUT("%s\nkey %s\nsizes", CAL_MAGIC, key);
  for (int i = 0; i < KVP_CAL_SIZES; i++)
    PUT(" %llu", 4096ull << i);
  for (int dir = 0; dir < 2; dir++) {
    PUT("\n%s", dir == KVP_DIR_H2D ? "h2d" : "d2h");
    for (int i = 0; i < KVP_CAL_SIZES; i++)
      for (int m = 0; m < 2; m++) {
        double v = bw[dir][i][m];
        if (!isfinite(v) || v <= 0 || v >= 100000)
          return KVP_EINVAL;
        PUT(" %.17g", v);
      }
  }
  PUT("\nend\n");
#undef PUT
  return n < cap ? (int)n : KVP_ERANGE;
}

/* The next line of [*p, end) into [*l, *le) (without '\n'); false at the
 * end or when the line has no '\n'. */
static bool next_line(const char **p, const char *end, const char **l,
                      const char **le) {
  const char *nl = memchr(*p, '\n', (size_t)(end - *p));
  if (!nl)
    return false;
  *l = *p, *le = nl;
  *p = nl + 1;
  return true;
}

static bool starts(const char *l, const char *le, const char *word) {
  size_t k = strlen(word);
  return (size_t)(le - l) > k && memcmp(l, word, k) == 0 && l[k] == ' ';
}

/* count numbers separated by single spaces from l (after "word "), each
 * parsed by strtod/strtoull with nothing left over. */
static int numbers(const char *l, const char *le, size_t skip, double *out,
                   int count, bool integers) {
  char buf[1024];
  size_t len = (size_t)(le - l);
  if (len >= sizeof buf)
    return -1;
  memcpy(buf, l, len);
  buf[len] = 0;
  char *s = buf + skip;
  for (int i = 0; i < count; i++) {
    if (*s < '0' || *s > '9') /* no sign, space, inf, nan */
      return -1;
    size_t tok = strcspn(s, " ");
    if (strspn(s, integers ? "0123456789" : "0123456789.eE+-") != tok)
      return -1; /* no hex floats, no locale's digits */
    char *e;
    errno = 0;
    if (integers) {
      unsigned long long v = strtoull(s, &e, 10);
      out[i] = (double)v;
    } else {
      out[i] = strtod(s, &e);
    }
    if (errno || e == s || (*e != ' ' && *e != 0) || (*e == 0) != (i == count - 1))
      return -1;
    s = *e ? e + 1 : e;
  }
  return 0;
}

static int parse_c(const char *text, size_t len, const char *key,
                   double bw[2][KVP_CAL_SIZES][2], char *why, size_t cap) {
  if (!text || !key)
    return KVP_EINVAL;
  if (len > CAL_FILE_MAX)
    return bad(why, cap, "file larger than 8 KiB", 0);
  if (memchr(text, 0, len))
    return bad(why, cap, "NUL byte", 0);
  const char *p = text, *end = text + len, *l, *le;
  if (!next_line(&p, end, &l, &le) || (size_t)(le - l) != strlen(CAL_MAGIC) ||
      memcmp(l, CAL_MAGIC, (size_t)(le - l)) != 0)
    return bad(why, cap, "not a kvplane calibration file (v1)", 1);
  if (!next_line(&p, end, &l, &le) || !starts(l, le, "key"))
    return bad(why, cap, "expected 'key <...>'", 2);
  size_t klen = (size_t)(le - l) - 4;
  if (klen == 0 || klen > KVP_CALCACHE_KEY_MAX)
    return bad(why, cap, "key length out of range", 2);
  for (const char *c = l + 4; c < le; c++)
    if ((unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e)
      return bad(why, cap, "control or non-ASCII byte in key", 2);
  bool same_key = klen == strlen(key) && memcmp(l + 4, key, klen) == 0;
  double sz[KVP_CAL_SIZES], v[2][2 * KVP_CAL_SIZES];
  if (!next_line(&p, end, &l, &le) || !starts(l, le, "sizes") ||
      numbers(l, le, 6, sz, KVP_CAL_SIZES, true) < 0)
    return bad(why, cap, "expected 'sizes' and the page sizes", 3);
  for (int dir = 0; dir < 2; dir++) {
    const char *w = dir == KVP_DIR_H2D ? "h2d" : "d2h";
    if (!next_line(&p, end, &l, &le) || !starts(l, le, w) ||
        numbers(l, le, 4, v[dir], 2 * KVP_CAL_SIZES, false) < 0)
      return bad(why, cap, dir == KVP_DIR_H2D ? "expected 'h2d' and 2 figures per size"
                                               : "expected 'd2h' and 2 figures per size",
                 4 + dir);
    for (int k = 0; k < 2 * KVP_CAL_SIZES; k++)
      if (!isfinite(v[dir][k]) || v[dir][k] <= 0 || v[dir][k] >= 100000)
        return bad(why, cap, "bandwidth out of range (0, 100000) GB/s", 4 + dir);
  }
  if (!next_line(&p, end, &l, &le) || le - l != 3 || memcmp(l, "end", 3) != 0)
    return bad(why, cap, "expected 'end'", 6);
  if (p != end)
    return bad(why, cap, "bytes after 'end'", 7);
  for (int i = 0; i < KVP_CAL_SIZES; i++)
    if (sz[i] != (double)(4096ull << i)) {
      if (why && cap)
        snprintf(why, cap, "measured at other page sizes (stale)");
      return KVP_ENOENT;
    }
  if (!same_key) {
    if (why && cap)
      snprintf(why, cap, "key differs (other device, driver, kvplane or CTA budget)");
    return KVP_ENOENT;
  }
  for (int dir = 0; dir < 2; dir++)
    for (int i = 0; i < KVP_CAL_SIZES; i++)
      for (int m = 0; m < 2; m++)
        bw[dir][i][m] = v[dir][2 * i + m];
  return 0;
}

int kvp__calcache_format(const char *key, const double bw[2][KVP_CAL_SIZES][2],
                         char *out, size_t cap) {
  locale_t old = enter_c();
  int rc = format_c(key, bw, out, cap);
  leave_c(old);
  return rc;
}

int kvp__calcache_parse(const char *text, size_t len, const char *key,
                        double bw[2][KVP_CAL_SIZES][2], char *why, size_t cap) {
  locale_t old = enter_c();
  int rc = parse_c(text, len, key, bw, why, cap);
  leave_c(old);
  return rc;
}

int kvp__calcache_load(const char *path, const char *key,
                       double bw[2][KVP_CAL_SIZES][2], char *why, size_t cap) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int e = errno;
    if (why && cap)
      snprintf(why, cap, "%s", strerror(e));
    return e == ENOENT ? KVP_ENOENT : -e;
  }
  char buf[CAL_FILE_MAX + 1];
  size_t n = 0;
  ssize_t r;
  while (n < sizeof buf && (r = read(fd, buf + n, sizeof buf - n)) != 0) {
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0) {
      int e = errno;
      close(fd);
      if (why && cap)
        snprintf(why, cap, "read: %s", strerror(e));
      return -e;
    }
    n += (size_t)r;
  }
  close(fd);
  return kvp__calcache_parse(buf, n, key, bw, why, cap);
}

/* mkdir -p for the cache directory (0700: per user). */
static int mkdirs(const char *dir) {
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof tmp, "%s", dir) >= (int)sizeof tmp)
    return -ENAMETOOLONG;
  for (char *s = tmp + 1; *s; s++)
    if (*s == '/') {
      *s = 0;
      if (mkdir(tmp, 0700) < 0 && errno != EEXIST)
        return -errno;
      *s = '/';
    }
  if (mkdir(tmp, 0700) < 0 && errno != EEXIST)
    return -errno;
  return 0;
}

int kvp__calcache_save(const char *path, const char *key,
                       const double bw[2][KVP_CAL_SIZES][2]) {
  char text[CAL_FILE_MAX], dir[PATH_MAX], tmp[PATH_MAX + 16];
  int n = kvp__calcache_format(key, bw, text, sizeof text);
  if (n < 0)
    return n;
  const char *slash = strrchr(path, '/');
  if (slash && slash != path) {
    if ((size_t)(slash - path) >= sizeof dir)
      return -ENAMETOOLONG;
    memcpy(dir, path, (size_t)(slash - path));
    dir[slash - path] = 0;
    int rc = mkdirs(dir);
    if (rc < 0)
      return rc;
  }
  if (snprintf(tmp, sizeof tmp, "%s.XXXXXX", path) >= (int)sizeof tmp)
    return -ENAMETOOLONG;
  int fd = mkstemp(tmp);
  if (fd < 0)
    return -errno;
  size_t off = 0;
  while (off < (size_t)n) {
    ssize_t w = write(fd, text + off, (size_t)n - off);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0) {
      int e = w < 0 ? errno : EIO;
      close(fd);
      unlink(tmp);
      return -e;
    }
    off += (size_t)w;
  }
  if (close(fd) < 0 || rename(tmp, path) < 0) {
    int e = errno;
    unlink(tmp);
    return -e;
  }
  return 0;
}

int kvp__calcache_path(const char *explicit_path, const char *device_tag,
                       char *out, size_t cap) {
  int k;
  if (explicit_path && *explicit_path)
    k = snprintf(out, cap, "%s", explicit_path);
  else {
    const char *env = getenv("KVP_CALIBRATION_CACHE");
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (env && *env)
      k = snprintf(out, cap, "%s/calibration-%s.txt", env, device_tag);
    else if (xdg && xdg[0] == '/')
      k = snprintf(out, cap, "%s/kvplane/calibration-%s.txt", xdg, device_tag);
    else if (home && home[0] == '/')
      k = snprintf(out, cap, "%s/.cache/kvplane/calibration-%s.txt", home,
                   device_tag);
    else
      return KVP_ENOENT; /* nowhere to keep it: measure every time */
  }
  return k > 0 && (size_t)k < cap ? 0 : KVP_ERANGE;
}
