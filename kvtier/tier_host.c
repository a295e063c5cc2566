/* SPDX-License-Identifier: Apache-2.0 */
/* The default DRAM size, shared among a host's stores: a small registry
 * file (KVP_TIER_HOST_REGISTRY, default /dev/shm/kvplane-tier-dram) taken
 * with flock(2) holds the host's budget -- dram_fraction of MemAvailable
 * when the first store opened -- and one line per live default-sized store
 * ("pid bytes").  Lines of processes that died are dropped at every claim,
 * so a crash frees its share.  A store takes budget / host_stores, or what
 * is left when that is at least half of it; else it is refused. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core_internal.h"
#include "kvtier_internal.h"

#define REG_DEFAULT "/dev/shm/kvplane-tier-dram"
#define REG_MAX 256u /* stores per host */

typedef struct reg {
  uint64_t budget;
  uint32_t n;
  struct {
    long pid;
    uint64_t bytes;
  } e[REG_MAX];
} reg;

static const char *reg_path(void) {
  const char *p = getenv("KVP_TIER_HOST_REGISTRY");
  return p != NULL ? p : REG_DEFAULT;
}

/* The registry, created if needed (readable and writable by every user:
 * one host, one budget), locked.  The descriptor or -errno. */
static int reg_open(const char *path) {
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0)
    return -errno;
  (void)fchmod(fd, 0666); /* umask; fails harmlessly on another's file */
  if (flock(fd, LOCK_EX) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

static bool pid_alive(long pid) {
  return pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM);
}

/* "kvtier-host <budget>" then "<pid> <bytes>" lines; dead pids dropped.  A
 * registry that does not parse is taken as empty. */
static void reg_read(int fd, reg *r) {
  char buf[16384];
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  buf[n > 0 ? n : 0] = '\0';
  r->budget = 0;
  r->n = 0;
  char *save, *line = strtok_r(buf, "\n", &save);
  if (line == NULL || sscanf(line, "kvtier-host %" SCNu64, &r->budget) != 1)
    return;
  while ((line = strtok_r(NULL, "\n", &save)) != NULL && r->n < REG_MAX) {
    long pid;
    uint64_t bytes;
    if (sscanf(line, "%ld %" SCNu64, &pid, &bytes) == 2 && pid_alive(pid)) {
      r->e[r->n].pid = pid;
      r->e[r->n++].bytes = bytes;
    }
  }
}

static int reg_write(int fd, const reg *r) {
  char buf[16384];
  int len = snprintf(buf, sizeof buf, "kvtier-host %" PRIu64 "\n", r->budget);
  for (uint32_t i = 0; i < r->n && len < (int)sizeof buf; i++)
    len += snprintf(buf + len, sizeof buf - (size_t)len, "%ld %" PRIu64 "\n",
                    r->e[i].pid, r->e[i].bytes);
  if (len >= (int)sizeof buf)
    return KVP_ERANGE;
  if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)len, 0) != len)
    return -errno;
  return 0;
}

/* Saturating: the file is anyone's to write, and a sum that wrapped would
 * hand out memory that live stores hold. */
static uint64_t reg_used(const reg *r) {
  uint64_t u = 0;
  for (uint32_t i = 0; i < r->n; i++)
    u = r->e[i].bytes > UINT64_MAX - u ? UINT64_MAX : u + r->e[i].bytes;
  return u;
}

static void refuse(const char *path, const reg *r, uint64_t share) {
  char pids[128] = "";
  for (uint32_t i = 0, o = 0; i < r->n && o < sizeof pids - 16; i++)
    o += (uint32_t)snprintf(pids + o, sizeof pids - o, "%s%ld", i ? "," : "",
                            r->e[i].pid);
  KVP_LOGE("kvtier", "DRAM tier refused: this host's budget for default-sized "
           "stores (%" PRIu64 " MiB, dram_fraction of MemAvailable when the "
           "first opened) is claimed by %u live store(s) (pids %s: %" PRIu64
           " MiB), less than half of this store's share (%" PRIu64 " MiB) is "
           "left; set host_stores (tiers.host_stores) to the number of stores "
           "this host runs, or dram_bytes (registry %s)",
           r->budget >> 20, r->n, pids, reg_used(r) >> 20, share >> 20, path);
}

/* Under the lock: this store's claim, or KVP_ENOSPC. */
static int claim_locked(int fd, const char *path, uint64_t budget,
                        uint32_t stores, uint64_t *bytes) {
  reg r;
  reg_read(fd, &r);
  if (r.n == 0) /* the first live store sets the host's budget */
    r.budget = budget;
  uint64_t used = reg_used(&r), share = r.budget / (stores ? stores : 1);
  uint64_t left = used < r.budget ? r.budget - used : 0;
  uint64_t claim = share < left ? share : left;
  if (claim == 0 || claim < share / 2 || r.n == REG_MAX) {
    refuse(path, &r, share);
    return KVP_ENOSPC;
  }
  r.e[r.n].pid = (long)getpid();
  r.e[r.n++].bytes = claim;
  int rc = reg_write(fd, &r);
  if (rc < 0)
    KVP_LOGW("kvtier", "host registry %s: writing: %s", path, kvp_strerror(rc));
  *bytes = claim;
  return 0;
}

int kvp__tier_host_claim(double fraction, uint32_t stores, uint64_t avail,
                         uint64_t *bytes, bool *registered) {
  const char *path = reg_path();
  uint64_t budget = (uint64_t)(fraction * (double)avail);
  *bytes = budget;
  *registered = false;
  if (path[0] == '\0') /* coordination off */
    return 0;
  int fd = reg_open(path);
  if (fd < 0) {
    KVP_LOGW("kvtier", "host registry %s: %s; this store's DRAM size (%" PRIu64
             " MiB) is not shared with the host's other stores", path,
             kvp_strerror(fd), budget >> 20);
    return 0;
  }
  int rc = claim_locked(fd, path, budget, stores, bytes);
  close(fd); /* releases the lock */
  *registered = rc == 0;
  return rc;
}

void kvp__tier_host_release(uint64_t bytes) {
  const char *path = reg_path();
  int fd = path[0] != '\0' ? reg_open(path) : -1;
  if (fd < 0)
    return;
  reg r;
  reg_read(fd, &r);
  for (uint32_t i = 0; i < r.n; i++)
    if (r.e[i].pid == (long)getpid() && r.e[i].bytes == bytes) {
      r.e[i] = r.e[--r.n];
      break;
    }
  if (reg_write(fd, &r) < 0)
    KVP_LOGW("kvtier", "host registry %s: could not drop this store", path);
  close(fd);
}
