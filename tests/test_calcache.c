/* SPDX-License-Identifier: Apache-2.0 */
/* The calibration cache file (kernels/kernels_calcache.c): golden vector of
 * format v1, exact round trip, stale keys, every malformed shape refused,
 * atomic save / load on a real file system, where the file lives, and the
 * C locale whatever the host program set.  The GPU side (a second
 * kvp_device_create reads what the first measured) is test_kernels_cuda's
 * calibration_cache case. */
#include <dirent.h>
#include <locale.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels_internal.h"
#include "test_harness.h"

static const char KEY[] =
    "cuda uuid=00112233445566778899aabbccddeeff pci=00000000:1A:00.0 "
    "driver=13000 kernels=0123456789abcdef name=Test GPU (sm_90, 132 SMs) "
    "kvplane=0.1.0 ctas=16 threads=512";

/* bw[dir][i][m] = 100 * dir + 2 * i + m + 1.5: exact in binary, so %.17g
 * prints them short and the golden text below is readable. */
static void golden_bw(double bw[2][KVP_CAL_SIZES][2]) {
  for (int d = 0; d < 2; d++)
    for (int i = 0; i < KVP_CAL_SIZES; i++)
      for (int m = 0; m < 2; m++)
        bw[d][i][m] = 100.0 * d + 2 * i + m + 1.5;
}

static const char GOLDEN[] =
    "kvplane-calibration 1\n"
    "key cuda uuid=00112233445566778899aabbccddeeff pci=00000000:1A:00.0 "
    "driver=13000 kernels=0123456789abcdef name=Test GPU (sm_90, 132 SMs) "
    "kvplane=0.1.0 ctas=16 threads=512\n"
    "sizes 4096 8192 16384 32768 65536 131072 262144 524288 1048576\n"
    "h2d 1.5 2.5 3.5 4.5 5.5 6.5 7.5 8.5 9.5 10.5 11.5 12.5 13.5 14.5 15.5 "
    "16.5 17.5 18.5\n"
    "d2h 101.5 102.5 103.5 104.5 105.5 106.5 107.5 108.5 109.5 110.5 111.5 "
    "112.5 113.5 114.5 115.5 116.5 117.5 118.5\n"
    "end\n";

TEST(golden_vector) {
  ASSERT_EQ(KVP_CAL_SIZES, 9); /* the golden text has 9 sizes */
  double bw[2][KVP_CAL_SIZES][2], back[2][KVP_CAL_SIZES][2];
  golden_bw(bw);
  char out[8192];
  int n = kvp__calcache_format(KEY, bw, out, sizeof out);
  ASSERT_EQ(n, (int)strlen(GOLDEN));
  ASSERT_STR_EQ(out, GOLDEN);
  memset(back, 0, sizeof back);
  char why[128] = "";
  ASSERT_OK(kvp__calcache_parse(GOLDEN, strlen(GOLDEN), KEY, back, why, sizeof why));
  ASSERT_MEM_EQ(back, bw, sizeof bw);
  /* too small a buffer: KVP_ERANGE, never a cut file */
  ASSERT_ERR(kvp__calcache_format(KEY, bw, out, 64), KVP_ERANGE);
  /* figures a file must not hold are refused when writing too */
  bw[1][3][0] = 0;
  ASSERT_ERR(kvp__calcache_format(KEY, bw, out, sizeof out), KVP_EINVAL);
  golden_bw(bw);
  bw[0][0][1] = NAN;
  ASSERT_ERR(kvp__calcache_format(KEY, bw, out, sizeof out), KVP_EINVAL);
  golden_bw(bw);
  ASSERT_ERR(kvp__calcache_format("bad\nkey", bw, out, sizeof out), KVP_EINVAL);
  ASSERT_ERR(kvp__calcache_format("", bw, out, sizeof out), KVP_EINVAL);
}

TEST(random_round_trip_exact) {
  char out[8192], why[128];
  for (int r = 0; r < 2000; r++) {
    double bw[2][KVP_CAL_SIZES][2], back[2][KVP_CAL_SIZES][2];
    for (int d = 0; d < 2; d++)
      for (int i = 0; i < KVP_CAL_SIZES; i++)
        for (int m = 0; m < 2; m++) { /* 1e-6 .. 9e4 GB/s, any mantissa */
          double u = (double)(kvt_rand() >> 11) / 9007199254740992.0;
          bw[d][i][m] = 1e-6 + u * 9e4;
        }
    int n = kvp__calcache_format(KEY, bw, out, sizeof out);
    ASSERT_GT(n, 0);
    ASSERT_OK(kvp__calcache_parse(out, (size_t)n, KEY, back, why, sizeof why));
    ASSERT_MEM_EQ(back, bw, sizeof bw); /* bit for bit */
  }
}

TEST(stale_files_are_misses) {
  double bw[2][KVP_CAL_SIZES][2], back[2][KVP_CAL_SIZES][2];
  golden_bw(back);
  char why[160] = "";
  /* another key: same GPU model, other driver */
  char other[sizeof KEY];
  memcpy(other, KEY, sizeof KEY);
  memcpy(strstr(other, "driver=13000"), "driver=12080", 12);
  memset(bw, 0x5a, sizeof bw);
  ASSERT_ERR(kvp__calcache_parse(GOLDEN, strlen(GOLDEN), other, bw, why, sizeof why),
             KVP_ENOENT);
  ASSERT_TRUE(strstr(why, "key differs") != NULL);
  double poison;
  memset(&poison, 0x5a, sizeof poison);
  ASSERT_MEM_EQ(&bw[0][0][0], &poison, sizeof poison); /* untouched */
  /* a prefix of the key is another key */
  char prefix[sizeof KEY];
  memcpy(prefix, KEY, sizeof KEY);
  prefix[sizeof KEY - 2] = 0;
  ASSERT_ERR(kvp__calcache_parse(GOLDEN, strlen(GOLDEN), prefix, bw, why, sizeof why),
             KVP_ENOENT);
  /* measured at other page sizes (an older build) */
  char txt[2048];
  snprintf(txt, sizeof txt, "%s", GOLDEN);
  char *s = strstr(txt, "sizes 4096");
  memcpy(s, "sizes 2048", 10);
  ASSERT_ERR(kvp__calcache_parse(txt, strlen(txt), KEY, bw, why, sizeof why),
             KVP_ENOENT);
  ASSERT_TRUE(strstr(why, "stale") != NULL);
}

static int parse_txt(const char *t, size_t n, char *why, size_t cap) {
  double bw[2][KVP_CAL_SIZES][2];
  return kvp__calcache_parse(t, n, KEY, bw, why, cap);
}

/* replaces the first `from` in GOLDEN by `to` and expects KVP_EINVAL */
static void expect_bad(const char *from, const char *to, const char *why_has) {
  char txt[4096], why[160] = "";
  const char *at = strstr(GOLDEN, from);
  ASSERT_NOT_NULL(at);
  size_t pre = (size_t)(at - GOLDEN);
  int n = snprintf(txt, sizeof txt, "%.*s%s%s", (int)pre, GOLDEN, to,
                   at + strlen(from));
  ASSERT_GT(n, 0);
  int rc = parse_txt(txt, (size_t)n, why, sizeof why);
  if (rc != KVP_EINVAL)
    fprintf(stderr, "accepted: '%s' -> '%s' (rc %d)\n", from, to, rc);
  ASSERT_ERR(rc, KVP_EINVAL);
  if (why_has && !strstr(why, why_has))
    fprintf(stderr, "why: %s (wanted '%s')\n", why, why_has);
  ASSERT_TRUE(why_has == NULL || strstr(why, why_has) != NULL);
}

TEST(malformed_files_refused) {
  char why[160];
  /* every strict prefix: truncated writes, cut downloads */
  for (size_t k = 0; k < strlen(GOLDEN); k++)
    ASSERT_ERR(parse_txt(GOLDEN, k, why, sizeof why), KVP_EINVAL);
  expect_bad("kvplane-calibration 1", "kvplane-calibration 2", "not a kvplane");
  expect_bad("key ", "kee ", "key");
  expect_bad("h2d 1.5", "h2d inf", "h2d");
  expect_bad("h2d 1.5", "h2d nan", "h2d");
  expect_bad("h2d 1.5", "h2d -1.5", "h2d");
  expect_bad("h2d 1.5", "h2d 0", "out of range");
  expect_bad("h2d 1.5", "h2d 1e300", "out of range");
  expect_bad("h2d 1.5", "h2d 0x1p3", "h2d");
  expect_bad("h2d 1.5 2.5", "h2d 1.5  2.5", "h2d");
  expect_bad("h2d 1.5 2.5", "h2d 1.5,2.5", "h2d");
  expect_bad("18.5\n", "18.5 \n", "h2d");
  expect_bad("18.5\n", "18.5 19.5\n", "h2d");
  expect_bad(" 17.5 18.5\n", " 17.5\n", "h2d");
  expect_bad("118.5\n", "118.5\r\n", "d2h");
  expect_bad("sizes 4096 8192", "sizes 4096 -8192", "sizes");
  expect_bad("sizes 4096", "sizes 99999999999999999999999", "sizes");
  expect_bad("\nd2h", "\nD2H", "d2h");
  expect_bad("end\n", "end\nmore\n", "after");
  expect_bad("end\n", "fin\n", "end");
  expect_bad("Test GPU", "Test\x01GPU", "key");
  expect_bad("Test GPU", "Test\xc3\xa9GPU", "key");
  /* NUL inside, file too large */
  char txt[10000];
  size_t n = strlen(GOLDEN);
  memcpy(txt, GOLDEN, n);
  txt[20] = 0;
  ASSERT_ERR(parse_txt(txt, n, why, sizeof why), KVP_EINVAL);
  memset(txt, 'a', sizeof txt);
  ASSERT_ERR(parse_txt(txt, sizeof txt, why, sizeof why), KVP_EINVAL);
  ASSERT_TRUE(strstr(why, "8 KiB") != NULL);
  /* one-byte changes anywhere: refused, a stale miss, or (a digit changed)
   * another valid file -- never a crash (ASan build) */
  static const char subst[] = {'x', ' ', '\n', '\0', '-', '9', '.', 'e'};
  for (size_t k = 0; k < n; k++)
    for (size_t s = 0; s < sizeof subst; s++) {
      memcpy(txt, GOLDEN, n);
      txt[k] = subst[s];
      int rc = parse_txt(txt, n, why, sizeof why);
      ASSERT_TRUE(rc == 0 || rc == KVP_EINVAL || rc == KVP_ENOENT);
    }
}

static char tmpdir[256];

static void make_tmpdir(void) {
  if (tmpdir[0])
    return;
  snprintf(tmpdir, sizeof tmpdir, "/tmp/kvp-calcache-XXXXXX");
  ASSERT_NOT_NULL(mkdtemp(tmpdir));
}

static size_t count_entries(const char *dir) {
  DIR *d = opendir(dir);
  ASSERT_NOT_NULL(d);
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d));)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

TEST(save_and_load_files) {
  make_tmpdir();
  char path[512], why[160];
  snprintf(path, sizeof path, "%s/a/b/calibration-x.txt", tmpdir);
  double bw[2][KVP_CAL_SIZES][2], back[2][KVP_CAL_SIZES][2];
  golden_bw(bw);
  ASSERT_ERR(kvp__calcache_load(path, KEY, back, why, sizeof why), KVP_ENOENT);
  ASSERT_OK(kvp__calcache_save(path, KEY, bw)); /* creates a/b (0700) */
  struct stat st;
  char sub[512];
  snprintf(sub, sizeof sub, "%s/a/b", tmpdir);
  ASSERT_OK(stat(sub, &st));
  ASSERT_EQ(st.st_mode & 0777, 0700u);
  /* the file holds exactly the golden text */
  FILE *f = fopen(path, "rb");
  ASSERT_NOT_NULL(f);
  char buf[4096];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  ASSERT_EQ(n, strlen(GOLDEN));
  ASSERT_MEM_EQ(buf, GOLDEN, n);
  memset(back, 0, sizeof back);
  ASSERT_OK(kvp__calcache_load(path, KEY, back, why, sizeof why));
  ASSERT_MEM_EQ(back, bw, sizeof bw);
  /* rewritten in place: new figures read back, no temporary left behind */
  bw[0][4][1] = 42.25;
  ASSERT_OK(kvp__calcache_save(path, KEY, bw));
  ASSERT_OK(kvp__calcache_load(path, KEY, back, why, sizeof why));
  ASSERT_MEM_EQ(back, bw, sizeof bw);
  ASSERT_EQ(count_entries(sub), 1u);
  /* a malformed file on disk: refused with the line, then overwritten */
  f = fopen(path, "wb");
  ASSERT_NOT_NULL(f);
  fputs("kvplane-calibration 1\nkey x\n", f);
  fclose(f);
  ASSERT_ERR(kvp__calcache_load(path, KEY, back, why, sizeof why), KVP_EINVAL);
  ASSERT_TRUE(strstr(why, "line 3") != NULL);
  ASSERT_OK(kvp__calcache_save(path, KEY, bw));
  ASSERT_OK(kvp__calcache_load(path, KEY, back, why, sizeof why));
  /* a symlink is not followed on load; unwritable places fail cleanly */
  char link[512];
  snprintf(link, sizeof link, "%s/link.txt", tmpdir);
  ASSERT_OK(symlink(path, link));
  ASSERT_TRUE(kvp__calcache_load(link, KEY, back, why, sizeof why) < 0);
  if (geteuid() != 0) { /* root writes anywhere */
    ASSERT_TRUE(kvp__calcache_save("/proc/kvp-no/x.txt", KEY, bw) < 0);
  }
  ASSERT_TRUE(kvp__calcache_save("/dev/null/x/y.txt", KEY, bw) < 0);
  /* a directory where the file should be */
  ASSERT_TRUE(kvp__calcache_load(sub, KEY, back, why, sizeof why) < 0);
  unlink(link);
}

TEST(where_the_file_lives) {
  char p[512];
  const char *home = getenv("HOME");
  char *home_copy = home ? strdup(home) : NULL;
  unsetenv("KVP_CALIBRATION_CACHE");
  unsetenv("XDG_CACHE_HOME");
  ASSERT_OK(kvp__calcache_path("/x/explicit.txt", "cuda-ab", p, sizeof p));
  ASSERT_STR_EQ(p, "/x/explicit.txt");
  setenv("HOME", "/home/u", 1);
  ASSERT_OK(kvp__calcache_path(NULL, "cuda-ab", p, sizeof p));
  ASSERT_STR_EQ(p, "/home/u/.cache/kvplane/calibration-cuda-ab.txt");
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  ASSERT_OK(kvp__calcache_path("", "cuda-ab", p, sizeof p));
  ASSERT_STR_EQ(p, "/xdg/kvplane/calibration-cuda-ab.txt");
  setenv("XDG_CACHE_HOME", "relative", 1); /* the spec says ignore it */
  ASSERT_OK(kvp__calcache_path(NULL, "cuda-ab", p, sizeof p));
  ASSERT_STR_EQ(p, "/home/u/.cache/kvplane/calibration-cuda-ab.txt");
  setenv("KVP_CALIBRATION_CACHE", "/shared/kvp", 1);
  ASSERT_OK(kvp__calcache_path(NULL, "cuda-ab", p, sizeof p));
  ASSERT_STR_EQ(p, "/shared/kvp/calibration-cuda-ab.txt");
  unsetenv("KVP_CALIBRATION_CACHE");
  unsetenv("XDG_CACHE_HOME");
  unsetenv("HOME");
  ASSERT_ERR(kvp__calcache_path(NULL, "cuda-ab", p, sizeof p), KVP_ENOENT);
  ASSERT_ERR(kvp__calcache_path("/a/long/path.txt", "t", p, 8), KVP_ERANGE);
  if (home_copy)
    setenv("HOME", home_copy, 1);
  free(home_copy);
}

TEST(decimal_comma_locale) {
  static const char *const names[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8",
                                      "ru_RU.UTF-8", "pl_PL.UTF-8"};
  const char *got = NULL;
  for (size_t i = 0; i < sizeof names / sizeof names[0] && !got; i++)
    if (setlocale(LC_NUMERIC, names[i]) && localeconv()->decimal_point[0] == ',')
      got = names[i];
  if (!got) { /* compile one (Debian's locales package has the sources) */
    make_tmpdir();
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "localedef -i de_DE -f UTF-8 '%s/de_DE.UTF-8' >/dev/null 2>&1", tmpdir);
    if (system(cmd) == 0) {
      setenv("LOCPATH", tmpdir, 1);
      if (setlocale(LC_NUMERIC, "de_DE.UTF-8") &&
          localeconv()->decimal_point[0] == ',')
        got = "de_DE.UTF-8 (compiled by localedef)";
    }
  }
  if (!got) {
    setlocale(LC_NUMERIC, "C");
    printf("# no decimal-comma locale (none installed, localedef failed): "
           "checked in the C locale only\n");
  } else {
    printf("# LC_NUMERIC=%s\n", got);
  }
  double bw[2][KVP_CAL_SIZES][2], back[2][KVP_CAL_SIZES][2];
  golden_bw(bw);
  char out[8192], why[128], probe[16];
  snprintf(probe, sizeof probe, "%.1f", 1.5);
  ASSERT_STR_EQ(probe, got ? "1,5" : "1.5"); /* the locale took effect */
  ASSERT_GT(kvp__calcache_format(KEY, bw, out, sizeof out), 0);
  ASSERT_STR_EQ(out, GOLDEN);
  ASSERT_OK(kvp__calcache_parse(GOLDEN, strlen(GOLDEN), KEY, back, why, sizeof why));
  ASSERT_MEM_EQ(back, bw, sizeof bw);
  setlocale(LC_NUMERIC, "C");
  unsetenv("LOCPATH");
}

TEST(cpu_device_has_no_calibration) {
  make_tmpdir();
  char path[512];
  snprintf(path, sizeof path, "%s/cpu.txt", tmpdir);
  kvp_device *d;
  kvp_device_opts o = {.calibration_cache = path};
  ASSERT_OK(kvp_device_create(&o, NULL, &d));
  ASSERT_EQ(kvp_device_calibration_source(d), 0);
  kvp_device_destroy(d);
  ASSERT_TRUE(access(path, F_OK) != 0); /* nothing written */
  o.flags = 0x8; /* unknown flag */
  ASSERT_ERR(kvp_device_create(&o, NULL, &d), KVP_EINVAL);
  ASSERT_EQ(kvp_device_calibration_source(NULL), 0);
}

TEST(cleanup) {
  if (tmpdir[0]) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    ASSERT_EQ(system(cmd), 0);
  }
}

TEST_MAIN(TEST_ENTRY(golden_vector), TEST_ENTRY(random_round_trip_exact),
          TEST_ENTRY(stale_files_are_misses), TEST_ENTRY(malformed_files_refused),
          TEST_ENTRY(save_and_load_files), TEST_ENTRY(where_the_file_lives),
          TEST_ENTRY(decimal_comma_locale), TEST_ENTRY(cpu_device_has_no_calibration),
          TEST_ENTRY(cleanup))
