/* fail_writes.c — libptrain_fail_writes.so: an injector for the I/O fault tests. Preloaded into
 * one rank (LD_PRELOAD), it makes writes to files whose path ends in PTRAIN_FAIL_WRITES_MATCH
 * (not the MPI-IO layer's side files, whose names extend the file's) fail with EIO once
 * PTRAIN_FAIL_WRITES_AFTER bytes (default 0) have been written to such files: a disk that breaks
 * under one rank in the middle of a collective HDF5 write, which no check beforehand can see.
 * With PTRAIN_FAIL_WRITES_DELAY_MS each such write first sleeps that long: a slow file system,
 * so that a background checkpoint write spans several training steps. Without
 * PTRAIN_FAIL_WRITES_MATCH it changes nothing.
 *
 * How: open/open64/openat/creat remember the descriptors of matching paths (close forgets
 * them); write, pwrite, writev and pwritev on them (the calls of Open MPI's and ROMIO's POSIX
 * layers) count the bytes and, past the budget, return -1 with errno EIO. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum { kMaxFd = 65536 };
static unsigned char watched[kMaxFd];
static long long written = 0;

static const char *match(void) { return getenv("PTRAIN_FAIL_WRITES_MATCH"); }
static long long budget(void) {
  const char *s = getenv("PTRAIN_FAIL_WRITES_AFTER");
  return s ? atoll(s) : 0;
}
static int remember(int fd, const char *path) {
  const char *m = match();
  const size_t n = path ? strlen(path) : 0, k = m ? strlen(m) : 0;
  if (fd >= 0 && fd < kMaxFd) watched[fd] = k > 0 && n >= k && strcmp(path + n - k, m) == 0;
  return fd;
}
/* 1 when this write to fd must fail (errno set), else counts it (after the delay). */
static int fails(int fd, size_t bytes) {
  if (fd < 0 || fd >= kMaxFd || !watched[fd]) return 0;
  const char *delay = getenv("PTRAIN_FAIL_WRITES_DELAY_MS");
  if (delay) usleep((useconds_t)(1000 * atoll(delay)));
  if (written + (long long)bytes > budget()) {
    errno = EIO;
    return 1;
  }
  written += (long long)bytes;
  return 0;
}
static size_t iov_bytes(const struct iovec *iov, int n) {
  size_t b = 0;
  for (int i = 0; i < n; ++i) b += iov[i].iov_len;
  return b;
}

#define NEXT(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

static mode_t mode_of(int flags, va_list ap) {
  return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}
int open(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return remember(NEXT(open)(path, flags, mode), path);
}
int open64(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return remember(NEXT(open64)(path, flags, mode), path);
}
int openat(int dir, const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_of(flags, ap);
  va_end(ap);
  return remember(NEXT(openat)(dir, path, flags, mode), path);
}
int creat(const char *path, mode_t mode) { return remember(NEXT(creat)(path, mode), path); }
int close(int fd) {
  if (fd >= 0 && fd < kMaxFd) watched[fd] = 0;
  return NEXT(close)(fd);
}
ssize_t write(int fd, const void *buf, size_t n) {
  return fails(fd, n) ? -1 : NEXT(write)(fd, buf, n);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t at) {
  return fails(fd, n) ? -1 : NEXT(pwrite)(fd, buf, n, at);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t at) {
  return fails(fd, n) ? -1 : NEXT(pwrite64)(fd, buf, n, at);
}
ssize_t writev(int fd, const struct iovec *iov, int n) {
  return fails(fd, iov_bytes(iov, n)) ? -1 : NEXT(writev)(fd, iov, n);
}
ssize_t pwritev(int fd, const struct iovec *iov, int n, off_t at) {
  return fails(fd, iov_bytes(iov, n)) ? -1 : NEXT(pwritev)(fd, iov, n, at);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int n, off_t at) {
  return fails(fd, iov_bytes(iov, n)) ? -1 : NEXT(pwritev64)(fd, iov, n, at);
}

/* With PTRAIN_FAIL_WRITES_REPORT set: the bytes counted, at exit (to size a budget). */
__attribute__((destructor)) static void report(void) {
  if (getenv("PTRAIN_FAIL_WRITES_REPORT")) {
    char line[64];
    const int n = snprintf(line, sizeof line, "fail_writes: %lld bytes\n", written);
    if (n > 0) (void)!NEXT(write)(2, line, (size_t)n);
  }
}
