/* test_workers.c - unit tests of the helper threads (workers.c): every element of a split
 * copy, gather, premultiply and reduction is written exactly once and right, for sizes
 * around every split boundary and element size; thousands of back-to-back jobs (helpers
 * spinning) and jobs after the helpers went to sleep; copy lists (pieces in and out of
 * order, guard bytes between them); the helper count follows
 * CHORUS_SHM_THREADS; workers_stop joins every helper (no thread left behind); with one
 * thread nothing is started; the default counts the cores of the affinity mask. */
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "algo/algo.h"
#include "core.h"

#include "expect.h"

static int threads_of_process(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* A joined thread can stay listed in /proc/self/task for a moment: glibc's pthread_join
 * returns when the kernel clears the thread id, which happens before the kernel releases the
 * task.  Poll up to 2 s for the count to settle at the one expected. */
static int threads_settled(int expected) {
  int n = threads_of_process();
  for (int i = 0; i < 2000 && n != expected; i++) {
    usleep(1000);
    n = threads_of_process();
  }
  return n;
}

static void comm_with_threads(struct chorus_comm *c, const char *threads) {
  memset(c, 0, sizeof *c);
  c->nlocal = 1;
  setenv("CHORUS_SHM_THREADS", threads, 1);
  param_reset_cache();
}

/* A job that counts how often each element is visited. */
struct visit_job {
  _Atomic unsigned char *seen;
};
static void visit(void *ctx, size_t b, size_t e) {
  struct visit_job *j = ctx;
  for (size_t i = b; i < e; i++) atomic_fetch_add(&j->seen[i], 1);
}

static void test_ranges(struct chorus_comm *c) {
  const size_t sizes[] = {0, 1, 63, 64, 65, 4096, (128 << 10) - 1, 128 << 10, (128 << 10) + 1,
                          (256 << 10) + 3, (1 << 20) + 17, 3 << 20};
  const size_t ess[] = {1, 2, 4, 8};
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
    for (size_t ei = 0; ei < 4; ei++) {
      size_t n = sizes[si];
      _Atomic unsigned char *seen = calloc(n + 1, 1);
      if (!seen) exit(2);
      struct visit_job j = {seen};
      workers_for(c, n, ess[ei], visit, &j);
      size_t bad = 0;
      for (size_t i = 0; i < n; i++) bad += seen[i] != 1;
      EXPECT(bad == 0 && seen[n] == 0, "%zu elements of %zu bytes: %zu visited != once", n,
             ess[ei], bad);
      free(seen);
    }
}

static void test_jobs(struct chorus_comm *c) {
  const size_t big = (3 << 20) + 40; /* bytes */
  uint8_t *src = malloc(big), *dst = malloc(big);
  float *a = malloc(big), *b = malloc(big), *o = malloc(big);
  if (!src || !dst || !a || !b || !o) exit(2);
  for (size_t i = 0; i < big; i++) src[i] = (uint8_t)(i * 131 + 7);
  const size_t lens[] = {100, 200 << 10, (1 << 20) + 5, big};
  for (int stream = 0; stream < 2; stream++)
    for (size_t li = 0; li < 4; li++) {
      memset(dst, 0, big);
      workers_copy(c, dst, src, lens[li], stream);
      EXPECT(memcmp(dst, src, lens[li]) == 0 && (lens[li] == big || dst[lens[li]] == 0),
             "copy of %zu bytes (stream %d)", lens[li], stream);
    }
  /* gather: slice p of the output from buffer p */
  const uint8_t *bufs[4];
  uint8_t *parts[4];
  for (int p = 0; p < 4; p++) {
    parts[p] = malloc(big);
    if (!parts[p]) exit(2);
    memset(parts[p], 0x10 + p, big);
    bufs[p] = parts[p];
  }
  size_t slice = (big + 3) / 4;
  slice += 64 - slice % 64;
  workers_gather(c, dst, bufs, slice, big, 1);
  size_t bad = 0;
  for (size_t i = 0; i < big; i++) bad += dst[i] != 0x10 + i / slice;
  EXPECT(bad == 0, "gather: %zu bytes wrong", bad);
  for (int p = 0; p < 4; p++) free(parts[p]);

  /* reductions: sum and average of two float inputs, exact values */
  size_t n = big / sizeof(float);
  for (size_t i = 0; i < n; i++) {
    a[i] = (float)(i % 1000);
    b[i] = (float)(2 * (i % 77));
  }
  const void *in[2] = {a, b};
  workers_reduce(c, o, in, 2, n, CHORUS_FLOAT32, CHORUS_SUM, 1);
  bad = 0;
  for (size_t i = 0; i < n; i++) bad += o[i] != a[i] + b[i];
  EXPECT(bad == 0, "sum: %zu wrong", bad);
  workers_reduce(c, o, in, 2, n, CHORUS_FLOAT32, CHORUS_SUM, 2);
  bad = 0;
  for (size_t i = 0; i < n; i++) bad += o[i] != (a[i] + b[i]) / 2;
  EXPECT(bad == 0, "average: %zu wrong", bad);
  workers_premul(c, o, a, n, CHORUS_FLOAT32, 0.5);
  bad = 0;
  for (size_t i = 0; i < n; i++) bad += o[i] != a[i] * 0.5f;
  EXPECT(bad == 0, "premul: %zu wrong", bad);

  /* many back-to-back jobs, then one after the helpers have gone to sleep */
  bad = 0;
  for (int r = 0; r < 3000; r++) {
    size_t len = (size_t)(256 << 10) + (size_t)r * 64;
    src[0] = (uint8_t)r;
    workers_copy(c, dst, src, len, r & 1);
    bad += memcmp(dst, src, len) != 0;
  }
  EXPECT(bad == 0, "%zu of 3000 back-to-back copies wrong", bad);
  usleep(50000);
  src[1] ^= 0xff;
  workers_copy(c, dst, src, big, 0);
  EXPECT(memcmp(dst, src, big) == 0, "copy after the helpers slept");
  free(src);
  free(dst);
  free(a);
  free(b);
  free(o);
}

/* Back-to-back jobs of 1 to 4 parts, some after the helpers went to sleep: every element is
 * visited exactly once by its own job, and no late thread touches the previous job's array
 * after that job returned (each job has its own of two arrays, the other one re-checked). */
static void test_job_boundaries(struct chorus_comm *c) {
  const size_t most = (5 << 20) / 16 + 64; /* elements of 8 bytes: up to 5 parts' worth */
  _Atomic unsigned char *arr[2] = {calloc(most, 1), calloc(most, 1)};
  if (!arr[0] || !arr[1]) exit(2);
  size_t prev_n = 0, bad = 0, stale = 0;
  for (int k = 0; k < 1000; k++) {
    size_t n = (size_t)(64 << 10) / 8 * (size_t)(1 + k % 5) + (size_t)(k % 7);
    _Atomic unsigned char *mine = arr[k & 1], *other = arr[(k + 1) & 1];
    memset((void *)mine, 0, n);
    struct visit_job j = {mine};
    workers_for(c, n, 8, visit, &j);
    for (size_t i = 0; i < n; i++) bad += mine[i] != 1;
    for (size_t i = 0; k > 0 && i < prev_n; i++) stale += other[i] != 1;
    prev_n = n;
    if (k % 100 == 99) usleep(1000); /* past the helpers' spin: they sleep */
  }
  EXPECT(bad == 0, "back-to-back jobs: %zu elements visited != once", bad);
  EXPECT(stale == 0, "back-to-back jobs: %zu elements of a finished job touched later", stale);
  free((void *)arr[0]);
  free((void *)arr[1]);
}

/* Copy lists: pieces of assorted lengths (empty ones included) from one buffer to another
 * in reverse order, each destination piece followed by a guard byte that must stay
 * untouched; lists shorter than, equal to and longer than what one job takes
 * (COPY_LIST_MAX, 512), with and without streaming stores. */
static void test_copy_list(struct chorus_comm *c) {
  static const size_t lens[] = {0, 1, 63, 64, 4096, 100 << 10, 129 << 10, 7};
  static const int counts[] = {1, 3, 17, 512, 513, 1300};
  for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
    for (int stream = 0; stream < 2; stream++) {
      int n = counts[ci];
      struct copy_seg *segs = calloc((size_t)n, sizeof *segs);
      size_t *len = calloc((size_t)n, sizeof *len), total = 0;
      if (!segs || !len) exit(2);
      for (int i = 0; i < n; i++) {
        len[i] = lens[(size_t)(i * 5 + n) % (sizeof lens / sizeof lens[0])];
        total += len[i] + 1;
      }
      uint8_t *src = malloc(total), *dst = malloc(total);
      if (!src || !dst) exit(2);
      for (size_t i = 0; i < total; i++) src[i] = (uint8_t)(i * 29 + ci);
      memset(dst, 0xee, total);
      size_t so = 0, d_end = total;
      for (int i = 0; i < n; i++) {
        d_end -= len[i] + 1; /* piece i lands at the far end, the guard byte after it */
        segs[i] = (struct copy_seg){dst + d_end, src + so, len[i]};
        so += len[i] + 1;
      }
      workers_copy_list(c, segs, n, stream);
      size_t bad = 0, guards = 0;
      so = 0;
      d_end = total;
      for (int i = 0; i < n; i++) {
        d_end -= len[i] + 1;
        bad += memcmp(dst + d_end, src + so, len[i]) != 0;
        guards += dst[d_end + len[i]] != 0xee;
        so += len[i] + 1;
      }
      EXPECT(bad == 0 && guards == 0, "copy list of %d pieces (%zu bytes, stream %d): %zu "
             "pieces wrong, %zu guard bytes written", n, total, stream, bad, guards);
      free(src);
      free(dst);
      free(segs);
      free(len);
    }
}

static void *noop_thread(void *arg) { return arg; }

int main(void) {
  setenv("CHORUS_DEBUG", "WARN", 1);
  /* ThreadSanitizer starts its own background thread at the first pthread_create: one
   * thread started and joined first makes the baseline count include it */
  pthread_t warm;
  if (pthread_create(&warm, NULL, noop_thread, NULL) == 0) pthread_join(warm, NULL);
  /* the warm-up thread may still be listed (see threads_settled): the least count seen over
   * 50 ms is the baseline */
  int base = threads_of_process();
  for (int i = 0; i < 50; i++) {
    usleep(1000);
    int n = threads_of_process();
    if (n < base) base = n;
  }
  struct chorus_comm c;

  comm_with_threads(&c, "4");
  test_ranges(&c);
  test_jobs(&c);
  test_job_boundaries(&c);
  test_copy_list(&c);
  EXPECT(c.workers != NULL, "CHORUS_SHM_THREADS=4 started no helper");
  EXPECT(threads_of_process() == base + 3, "4 threads per rank: %d threads, expected %d",
         threads_of_process(), base + 3);
  workers_stop(&c);
  int after = threads_settled(base);
  EXPECT(c.workers == NULL && after == base, "after workers_stop: %d threads, expected %d",
         after, base);

  comm_with_threads(&c, "1");
  test_ranges(&c);
  test_jobs(&c);
  test_copy_list(&c);
  EXPECT(c.workers == NULL && threads_of_process() == base,
         "CHORUS_SHM_THREADS=1 started helpers (%d threads)", threads_of_process());
  workers_stop(&c);

  comm_with_threads(&c, "2");
  test_jobs(&c);
  test_job_boundaries(&c);
  EXPECT(threads_of_process() == base + 1, "2 threads: %d, expected %d", threads_of_process(),
         base + 1);
  workers_stop(&c);
  workers_stop(&c); /* twice is harmless */

  unsetenv("CHORUS_SHM_THREADS");
  param_reset_cache();

  /* The defaults count the cores of the affinity mask (a cpuset, taskset), not the host's:
   * narrowed to one core, no helper starts (three quarters of one core is none). */
  cpu_set_t all, one;
  if (sched_getaffinity(0, sizeof all, &all) == 0) {
    int first = 0;
    while (!CPU_ISSET(first, &all)) first++;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    if (sched_setaffinity(0, sizeof one, &one) == 0) {
      EXPECT(cores_usable() == 1, "one core in the affinity mask: cores_usable() = %ld",
             cores_usable());
      memset(&c, 0, sizeof c);
      c.nlocal = 1;
      test_jobs(&c);
      EXPECT(c.workers == NULL, "default helper count on one core started helpers");
      workers_stop(&c);
      sched_setaffinity(0, sizeof all, &all);
    }
    EXPECT(cores_usable() == CPU_COUNT(&all), "cores_usable() = %ld, affinity mask has %d",
           cores_usable(), CPU_COUNT(&all));
  }
  printf("test_workers: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
