/* test_hosts.c - unit test of number_hosts (comm.c), which numbers the hosts of a peer
 * table at communicator creation: hosts in order of their lowest rank, every rank of a host
 * with the host's number, the same answer as comparing each rank with the ranks before it.
 * Tables of 1..4096 ranks: hosts in blocks, round robin, at random, one host, one rank per
 * host, and host ids that share long prefixes or differ only in their last character. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#include "expect.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t next_rand(void) { /* xorshift64: the same tables on every run */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

/* The numbering by definition: a rank's host is that of the first earlier rank with the
 * same id, else the next new number. */
static int number_pairwise(const struct peer_info *peers, int n, int *host_of) {
  int nh = 0;
  for (int r = 0; r < n; r++) {
    int h = -1;
    for (int q = 0; q < r && h < 0; q++)
      if (strcmp(peers[q].hostid, peers[r].hostid) == 0) h = host_of[q];
    host_of[r] = h >= 0 ? h : nh++;
  }
  return nh;
}

enum { BLOCKS, ROUND_ROBIN, RANDOM, LAYOUTS };

/* Host h's id: a long shared prefix (as boot ids of one cluster's hostnames do), then the
 * number, with `tail` varying only the last character where asked. */
static void set_id(struct peer_info *p, int h, int tail) {
  if (tail)
    snprintf(p->hostid, sizeof p->hostid, "node-%s-%c", "0000000000000000000000000000",
             'a' + h % 26);
  else
    snprintf(p->hostid, sizeof p->hostid, "gpu-cluster-rack-%04d.example.internal|boot-%08x",
             h, (unsigned)(h * 2654435761u));
}

static void check_table(int n, int hosts, int layout, int tail) {
  struct peer_info *peers = calloc((size_t)n, sizeof *peers);
  int *got = calloc((size_t)n, sizeof(int)), *want = calloc((size_t)n, sizeof(int));
  if (!peers || !got || !want) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  if (tail && hosts > 26) hosts = 26;
  const int per = (n + hosts - 1) / hosts;
  for (int r = 0; r < n; r++) {
    int h = layout == BLOCKS ? r / per : layout == ROUND_ROBIN ? r % hosts
                                                                : (int)(next_rand() % (uint64_t)hosts);
    set_id(&peers[r], h, tail);
  }
  const int nh = number_hosts(peers, n, got);
  const int wh = number_pairwise(peers, n, want);
  int same = nh == wh;
  for (int r = 0; r < n && same; r++) same = got[r] == want[r];
  EXPECT(same, "%d ranks, %d hosts, layout %d, tail %d: %d hosts numbered, want %d", n, hosts,
         layout, tail, nh, wh);
  /* hosts in order of their lowest rank: rank 0 is on host 0, and a new host is one more
   * than the largest so far */
  int top = -1, ordered = 1;
  for (int r = 0; r < n; r++) {
    if (got[r] > top + 1) ordered = 0;
    if (got[r] > top) top = got[r];
  }
  EXPECT(ordered && top + 1 == nh, "%d ranks, layout %d: numbers out of order", n, layout);
  free(peers);
  free(got);
  free(want);
}

int main(void) {
  const int ns[] = {1, 2, 3, 7, 16, 17, 100, 257, 1000, 4096};
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    const int n = ns[i];
    const int hosts[] = {1, 2, 3, n / 8 > 0 ? n / 8 : 1, n};
    for (size_t j = 0; j < sizeof hosts / sizeof hosts[0]; j++)
      for (int layout = 0; layout < LAYOUTS; layout++)
        for (int tail = 0; tail <= 1; tail++) check_table(n, hosts[j], layout, tail);
  }
  /* an empty id is an id like any other */
  struct peer_info p[3];
  memset(p, 0, sizeof p);
  snprintf(p[1].hostid, sizeof p[1].hostid, "x");
  int h[3];
  EXPECT(number_hosts(p, 3, h) == 2 && h[0] == 0 && h[1] == 1 && h[2] == 0,
         "empty ids: %d %d %d", h[0], h[1], h[2]);
  printf("test_hosts: %d checks, %d failed\n", checks, failures);
  return failures != 0;
}
