/* SPDX-License-Identifier: Apache-2.0 */
/* Corpus replay driver (zstd tests/fuzz): runs a libFuzzer target's entry
 * point over every file named on the command line (directories are walked
 * one level), so plain CI without clang's fuzzer runtime still exercises the
 * corpus under whatever sanitizers the build has. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    return 1;
  }
  size_t cap = 1 << 16, n = 0;
  uint8_t *buf = malloc(cap);
  for (size_t r; buf != NULL && (r = fread(buf + n, 1, cap - n, f)) > 0;) {
    n += r;
    if (n == cap) {
      uint8_t *nb = realloc(buf, cap *= 2);
      if (nb == NULL)
        free(buf);
      buf = nb;
    }
  }
  fclose(f);
  if (buf == NULL)
    return 1;
  LLVMFuzzerTestOneInput(buf, n);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  int files = 0, rc = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      perror(argv[i]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      rc |= run_file(argv[i]);
      files++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
      if (e->d_name[0] == '.')
        continue;
      char p[4096];
      snprintf(p, sizeof p, "%s/%s", argv[i], e->d_name);
      rc |= run_file(p);
      files++;
    }
    if (d != NULL)
      closedir(d);
  }
  printf("replayed %d inputs\n", files);
  return rc != 0 || files == 0;
}
