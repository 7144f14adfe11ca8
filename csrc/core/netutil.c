/* netutil.c - small helpers shared by the TCP rendezvous and the socket transport (and the
 * engine's clock): monotonic time, the cores this process may use, poll deadlines,
 * exact-length I/O on non-blocking sockets, big-endian wire integers. No dependency on the
 * rest of the core. */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

long cpu_mask_of_process(uint8_t *mask) {
  memset(mask, 0, CPU_MASK_BYTES);
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
    for (int c = 0; c < CPU_SETSIZE && c < CPU_MASK_BYTES * 8; c++)
      if (CPU_ISSET(c, &set)) mask[c / 8] |= (uint8_t)(1u << (c % 8));
    return CPU_COUNT(&set);
  }
#endif
  long n = sysconf(_SC_NPROCESSORS_ONLN); /* CPUs 0..n-1 */
  if (n < 1) n = 1;
  for (long c = 0; c < n && c < CPU_MASK_BYTES * 8; c++) mask[c / 8] |= (uint8_t)(1u << (c % 8));
  return n;
}

long cores_usable(void) {
  uint8_t mask[CPU_MASK_BYTES];
  return cpu_mask_of_process(mask);
}

int ms_until(int64_t deadline, int cap_ms) {
  int64_t left = deadline - now_ns();
  if (left <= 0) return 0;
  int64_t ms = (left + 999999) / 1000000;
  return ms > cap_ms ? cap_ms : (int)ms;
}

int io_full(int fd, void *buf, size_t len, int64_t deadline, int writing) {
  uint8_t *p = buf;
  while (len) {
    ssize_t r = writing ? send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recv(fd, p, len, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
      continue;
    }
    if (r == 0 && !writing) return -1;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return errno;
    int ms = ms_until(deadline, 1000);
    if (ms == 0) return ETIMEDOUT;
    struct pollfd pfd = {fd, (short)(writing ? POLLOUT : POLLIN), 0};
    if (poll(&pfd, 1, ms) < 0 && errno != EINTR) return errno;
  }
  return 0;
}

void put32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}
uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
