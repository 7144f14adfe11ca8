/* tools/cma_bw.c - how fast one process copies another's memory with process_vm_readv
 * (cross-memory attach), against memcpy in the same process: the measurement behind
 * docs/PERFORMANCE.md's note on reading peers' buffers without a staging copy.
 * Usage: cc -O2 -o /tmp/cma_bw tools/cma_bw.c && /tmp/cma_bw [PIECE_BYTES]
 * Copies 64 MiB from a forked child in pieces of PIECE_BYTES (default 1 MiB), three passes
 * (the first also faults the destination in). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  const size_t total = (size_t)64 << 20;
  size_t piece = argc > 1 ? (size_t)strtoull(argv[1], NULL, 0) : ((size_t)1 << 20);
  if (piece == 0 || total % piece) {
    fprintf(stderr, "cma_bw: PIECE_BYTES must divide 64 MiB\n");
    return 2;
  }
  char *src = malloc(total), *dst = malloc(total);
  if (!src || !dst) return 1;
  memset(src, 1, total);
  pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) { /* holds its copy of src (copy-on-write pages) until killed */
    pause();
    _exit(0);
  }
  int rc = 0;
  for (int pass = 1; pass <= 3 && !rc; pass++) {
    double t0 = now();
    for (size_t o = 0; o < total; o += piece) {
      struct iovec l = {dst + o, piece}, r = {src + o, piece};
      if (process_vm_readv(child, &l, 1, &r, 1, 0) != (ssize_t)piece) {
        perror("cma_bw: process_vm_readv");
        rc = 1;
        break;
      }
    }
    double t1 = now();
    memcpy(dst, src, total);
    double t2 = now();
    if (!rc)
      printf("pass %d, pieces of %zu B: process_vm_readv %.2f GB/s, memcpy %.2f GB/s\n", pass,
             piece, (double)total / (t1 - t0) / 1e9, (double)total / (t2 - t1) / 1e9);
  }
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  free(src);
  free(dst);
  return rc;
}
