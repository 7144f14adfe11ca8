/* tree.c - double binary tree: two complementary binary trees over the members other than
 * the root (the second is the first mirrored, or shifted by one for odd sizes, so a member
 * that is interior in one tree is a leaf in the other), each carrying half of the data in
 * pipelined chunks, both hanging below the root. All-reduce = reduce up + broadcast down;
 * broadcast and reduce use one direction.
 * Every message is sent and received in the same step t of a clock derived from tree depths
 * (reduce: a member at depth d sends chunk j at step j + D - d + 1; broadcast: receives chunk
 * j at step j + base + d), so the lockstep argument excludes deadlock even where the two
 * trees connect the same pair of members in opposite directions. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

/* In-order binary tree over 0..m-1 rooted at 0 (one child), as NCCL builds it: the parent
 * of r clears r's lowest set bit and sets the next one (or just clears it near the end). */
static void btree(int m, int r, int *up, int *c0, int *c1) {
  int bit = 1;
  while (bit < m && !(bit & r)) bit <<= 1;
  *c0 = *c1 = -1;
  if (r == 0) {
    *up = -1;
    *c1 = m > 1 ? bit >> 1 : -1;
    return;
  }
  int p = (r ^ bit) | (bit << 1);
  if (p >= m) p = r ^ bit;
  *up = p;
  int low = bit >> 1;
  if (low == 0) return;
  *c0 = r - low;
  while (low > 0 && r + low >= m) low >>= 1;
  *c1 = low > 0 ? r + low : -1;
}

/* Tree t (0 or 1) over sub-members 0..m-1; returns parent (-1 for the sub-root). */
static void dtree(int t, int m, int s, int *up, int *c0, int *c1) {
  if (t == 0 || m == 1) {
    btree(m, s, up, c0, c1);
    return;
  }
  int u, a, b;
  if (m % 2 == 0) { /* mirror */
    btree(m, m - 1 - s, &u, &a, &b);
    *up = u < 0 ? -1 : m - 1 - u;
    *c0 = a < 0 ? -1 : m - 1 - a;
    *c1 = b < 0 ? -1 : m - 1 - b;
  } else { /* shift by one */
    btree(m, (s + m - 1) % m, &u, &a, &b);
    *up = u < 0 ? -1 : (u + 1) % m;
    *c0 = a < 0 ? -1 : (a + 1) % m;
    *c1 = b < 0 ? -1 : (b + 1) % m;
  }
}

/* One member's place in one tree, in group member indices. */
struct tnode {
  int parent;       /* -1 at the root */
  int child[2];
  int nchild;
  int depth, maxdepth;
  size_t lo, cnt;   /* elements of this tree's half */
  size_t nchunks;
  uint8_t *scratch; /* two chunks: partial sums on their way up */
};

static void tree_place(const struct group *g, int root, int t, struct tnode *nd) {
  const int n = g->n, m = n - 1;
  memset(nd, 0, sizeof *nd);
  nd->parent = -1;
  nd->child[0] = nd->child[1] = -1;
  if (n == 1) return;
#define MEMBER(sub) ((root + 1 + (sub)) % n)
  int u, a, b;
  /* depth of every sub-member: walk up (m is small enough; O(m log m)) */
  for (int s = 0; s < m; s++) {
    int d = 1, x = s;
    for (;;) {
      dtree(t, m, x, &u, &a, &b);
      if (u < 0) break;
      x = u;
      d++;
    }
    if (d > nd->maxdepth) nd->maxdepth = d;
  }
  if (g->me == root) {
    for (int s = 0; s < m; s++) {
      dtree(t, m, s, &u, &a, &b);
      if (u < 0) nd->child[nd->nchild++] = MEMBER(s);
    }
    return;
  }
  int s = (g->me - root - 1 + n) % n;
  dtree(t, m, s, &u, &a, &b);
  nd->parent = u < 0 ? root : MEMBER(u);
  if (a >= 0) nd->child[nd->nchild++] = MEMBER(a);
  if (b >= 0) nd->child[nd->nchild++] = MEMBER(b);
  int d = 1, x = s;
  for (;;) {
    int uu;
    dtree(t, m, x, &uu, &a, &b);
    if (uu < 0) break;
    x = uu;
    d++;
  }
  nd->depth = d;
#undef MEMBER
}

static size_t chunk_len(size_t cnt, size_t lo, size_t chunk) {
  if (lo >= cnt) return 0;
  return cnt - lo < chunk ? cnt - lo : chunk;
}

/* The double tree over g rooted at member root. up: out(root) = op over all members' in;
 * down: root's out reaches every member's out. divisor > 0 divides the root's result. */
static chorus_result_t dtree_run(struct chorus_comm *comm, struct op *op, const struct group *g,
                                 const void *in, void *out, size_t count, int root, int up,
                                 int down, int divisor) {
  const int n = g->n, me = g->me;
  const size_t es = dtype_size(op->dtype), C = algo_chunk_elems(op->dtype);
  const uint8_t *src = in;
  uint8_t *dst = out;
  if (n == 1) {
    if (up && dst != src && count) memmove(dst, src, count * es);
    if (up && divisor > 0) reduce_divide(dst, count, op->dtype, divisor);
    return CHORUS_SUCCESS;
  }
  struct tnode tn[2];
  chorus_result_t res = CHORUS_SUCCESS;
  size_t half = (count + 1) / 2;
  long last = 0;
  for (int t = 0; t < 2; t++) {
    tree_place(g, root, t, &tn[t]);
    tn[t].lo = t == 0 ? 0 : half;
    tn[t].cnt = t == 0 ? half : count - half;
    tn[t].nchunks = tn[t].cnt ? (tn[t].cnt + C - 1) / C : 1;
    tn[t].scratch = NULL;
    long steps = (long)tn[t].nchunks + (up ? tn[t].maxdepth : 0) + (down ? tn[t].maxdepth : 0) + 1;
    if (steps > last) last = steps;
  }
  for (int t = 0; t < 2; t++)
    if (up && me != root && tn[t].nchild > 0)
      CHECK_GOTO(algo_alloc(comm, 2 * C * es, (void **)&tn[t].scratch), res, done);
  for (long step = 0; step <= last; step++) {
    struct sched_step s;
    sched_begin(&s, comm, op, g);
    for (int t = 0; t < 2; t++) {
      struct tnode *nd = &tn[t];
      const long D = nd->maxdepth, d = nd->depth, nch = (long)nd->nchunks;
      if (up) {
        /* receive and reduce chunk j from the children at step j + D - d */
        long j = step - (D - d);
        if (nd->nchild > 0 && j >= 0 && j < nch) {
          size_t lo = nd->lo + (size_t)j * C, len = chunk_len(nd->cnt, (size_t)j * C, C);
          uint8_t *ob = me == root ? dst + lo * es : nd->scratch + (size_t)(j & 1) * C * es;
          int r = sched_reduce(&s, src + lo * es, ob, len, 0);
          for (int k = 0; k < nd->nchild; k++) sched_reduce_add(&s, r, nd->child[k]);
        }
        /* send chunk j to the parent at step j + D - d + 1 */
        j = step - (D - d + 1);
        if (me != root && j >= 0 && j < nch) {
          size_t lo = nd->lo + (size_t)j * C, len = chunk_len(nd->cnt, (size_t)j * C, C);
          const uint8_t *sb =
              nd->nchild > 0 ? nd->scratch + (size_t)(j & 1) * C * es : src + lo * es;
          sched_send(&s, nd->parent, sb, len * es);
        }
      }
      if (down) {
        long base = up ? D : 0;
        long j = step - (base + d); /* receive chunk j from the parent */
        if (me != root && j >= 0 && j < nch) {
          size_t lo = nd->lo + (size_t)j * C, len = chunk_len(nd->cnt, (size_t)j * C, C);
          sched_recv(&s, nd->parent, dst + lo * es, len * es);
        }
        j = step - (base + d + 1); /* forward chunk j to the children */
        if (nd->nchild > 0 && j >= 0 && j < nch) {
          size_t lo = nd->lo + (size_t)j * C, len = chunk_len(nd->cnt, (size_t)j * C, C);
          for (int k = 0; k < nd->nchild; k++) sched_send(&s, nd->child[k], dst + lo * es, len * es);
        }
      }
    }
    if (s.ntx || s.nrx || s.nred) CHECK_GOTO(sched_run(&s), res, done);
    if (up && me == root && divisor > 0)
      for (int t = 0; t < 2; t++) { /* chunks finished at this step */
        long j = step - tn[t].maxdepth;
        if (j >= 0 && j < (long)tn[t].nchunks) {
          size_t lo = tn[t].lo + (size_t)j * C, len = chunk_len(tn[t].cnt, (size_t)j * C, C);
          if (len) reduce_divide(dst + lo * es, len, op->dtype, divisor);
        }
      }
  }
done:
  free(tn[0].scratch);
  free(tn[1].scratch);
  return res;
}

chorus_result_t tree_allreduce_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, const void *in, void *out,
                                     size_t count, int divisor) {
  return dtree_run(comm, op, g, in, out, count, 0, 1, 1, divisor);
}

chorus_result_t tree_allreduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      tree_allreduce_group(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count,
                           op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}

chorus_result_t tree_broadcast(struct chorus_comm *comm, struct op *op) {
  struct group g = group_world(comm);
  return dtree_run(comm, op, &g, op->recvbuf, op->recvbuf, op->count, op->root, 0, 1, 0);
}

chorus_result_t tree_reduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      dtree_run(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count, op->root, 1,
                0, op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}
