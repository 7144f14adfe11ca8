/* tune.c - choosing an algorithm per collective: the cost model and its measured constants,
 * the constraints an algorithm must pass to run an op (algo_usable, algo_constraints_ok),
 * CHORUS_ALGO overrides, the choice log, and chorus_tune_plan (the same choice without a
 * communicator). The choice depends only on facts equal on every rank of a correct program:
 * the collective, its size, the rank and host counts and the intra-host transport. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "tune.h"

/* ------------------------------------------------------------------ measured constants
 * Measured on the development machine (2 cores, shared; Linux; loopback), idle otherwise:
 *   nice make -C tests/c bench_transport && nice tests/c/build/bench_transport
 * Each run prints medians of 5 repetitions between 2 ranks; three runs gave
 *   shm     latency 13.7-17.4 us, overhead 5.1-8.1 us/msg, bandwidth 5.0-5.6 GB/s
 *   socket  latency 29.0-33.4 us, overhead 4.9-5.8 us/msg, bandwidth 3.4-3.6 GB/s (loopback)
 *   reduce  float32 sum over 32 MiB inputs: 2 inputs 10.4-11.9 GB/s, 8 inputs 5.9-6.2 GB/s
 *   memcpy  13.4-14.9 GB/s (32 MiB source into a 4 MiB window)
 * and the values below are their middles. Latency is half a round trip through the public
 * p2p API, so it includes the hand-off to the engine thread and its futex wake-up, which
 * every algorithm step pays. While other jobs loaded the machine, latencies were 2-3x and
 * socket bandwidth 5x worse: the constants describe an idle host. Between hosts nothing
 * could be measured (one host): net uses the loopback socket numbers, a lower bound on the
 * CPU cost of the socket path; set CHORUS_TUNE_MODEL=net=LAT:OVH:GBPS for a real network.
 *
 * Those engines never spin (2 cores cannot give each of 2 ranks two). Where every rank's
 * engine spins (spin_count_for; topo.spin), a step costs a third: three runs of the same
 * command on the 16-core GPU host (Xeon, 4 ranks would spin there as its 2 do) gave
 *   socket  latency 9.66-10.04 us, overhead 2.43-2.72 us/msg, bandwidth 3.35-3.47 GB/s
 * (and shm 2.8-4.4 us, 1.8-2.6 us/msg, 3.7-5.2 GB/s). Only the socket link has a spinning
 * variant: with the spinning shm numbers, the shm choices for 4 ranks from 8 B to 256 MB
 * would change only for all_reduce of 16 and 32 KB (oneshot to twoshot) and reduce of 128
 * and 256 KB (oneshot to the ring), which no measurement supports, while the socket choice
 * of broadcast at 32 KB moves from direct to the ring, measured twice as fast there
 * (docs/PERFORMANCE.md, "Spinning socket constants"). */
const struct tune_model tune_measured = {
    .shm = {15.0, 6.0, 5.3},
    .sock = {31.0, 5.4, 3.5},
    .sock_spin = {10.0, 2.6, 3.4},
    .net = {31.0, 5.4, 3.5},
    .reduce_gbps = 8.5,
    .copy_gbps = 14.0,
};

/* Per-communicator state (engine thread only after tune_init). */
struct tune_state {
  struct tune_topo topo;
  struct tune_model model;
  struct tune_force force;
  const char *source;                          /* "CHORUS_ALGO" or "NCCL_ALGO" */
  uint64_t logged[OP_KIND_COUNT][ALGO_COUNT];  /* size buckets already logged at INFO */
  uint32_t warned;                             /* collectives whose fallback was warned */
};

/* Algorithms that accept v-variants (unequal counts); others get only uniform ops. An
 * algorithm that handles them adds its bit here. */
static const uint32_t algo_v_ok = (1u << ALGO_DIRECT) | (1u << ALGO_RING) | (1u << ALGO_RHD) |
                                  (1u << ALGO_RD) | (1u << ALGO_BRUCK) | (1u << ALGO_PAIRWISE) |
                                  (1u << ALGO_ONESHOT);

#define ALL_ALGOS ((1u << ALGO_COUNT) - 1)

/* ------------------------------------------------------------------ the cost model */
static int ceil_log2(int n) {
  int l = 0;
  while ((1L << l) < n) l++;
  return l;
}
static int floor_log2(int n) {
  int l = 0;
  while ((2L << l) <= n) l++;
  return l;
}
static int is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

/* What one rank does on its critical path. */
struct terms {
  double steps;    /* dependent latencies */
  double msgs;     /* messages posted (each costs the link's overhead) */
  double moved;    /* bytes sent over the link */
  double reduced;  /* input bytes fed to reduce_n */
  double copied;   /* local memcpy bytes */
  int all_pairs;   /* every rank talks off-host at once (shares the host's network) */
};

static double eval(const struct tune_model *m, const struct tune_topo *t, const struct terms *x) {
  const struct tune_link *l;
  double gbps;
  if (t->nhosts > 1) {
    l = &m->net;
    gbps = l->gbps / (x->all_pairs && t->per_host > 1 ? t->per_host : 1);
  } else {
    l = t->shm ? &m->shm : t->spin ? &m->sock_spin : &m->sock;
    gbps = l->gbps;
    /* The shm bandwidth was measured one way between two ranks, the sender's copy into the
     * ring and the receiver's copy out on two cores. When every rank exchanges with several
     * peers at once, each core does both copies of its own traffic: half the rate. (The
     * 16-core host measured a direct all-to-all of 32 MB on 4 ranks at 14.5 ms, 3x the
     * one-way figure, while oneshot moved 8 MB in 1.0 ms.) */
    if (t->shm && x->all_pairs) gbps /= 2;
  }
  /* 1 GB/s is 1e3 bytes per microsecond */
  return x->steps * l->lat_us + x->msgs * l->ovh_us + x->moved / (gbps * 1e3) +
         x->reduced / (m->reduce_gbps * 1e3) + x->copied / (m->copy_gbps * 1e3);
}

/* Fills x for a single-level algorithm; returns 0 if it has no model for kind. n > 1. */
static int terms_of(int id, enum op_kind k, int n, double B, struct terms *x) {
  memset(x, 0, sizeof *x);
  const double s = B / n, L = ceil_log2(n);
  const int p2 = is_pow2(n);
  /* non-power-of-two butterflies fold the extra ranks in and out: 2 steps, full vectors */
  const double fold = p2 ? 0 : 2, Lf = p2 ? L : floor_log2(n);
  switch (id) {
    case ALGO_DIRECT:
      switch (k) {
        case OP_ALLREDUCE:  /* reduce-scatter then all-gather, all pairs at once */
          *x = (struct terms){2, 2.0 * (n - 1), 2.0 * (n - 1) * s, B, 0, 1};
          return 1;
        case OP_BROADCAST:  /* the root sends everything to everyone */
          *x = (struct terms){1, n - 1, (n - 1) * B, 0, 0, 1};
          return 1;
        case OP_REDUCE:     /* the root receives and reduces every input */
          *x = (struct terms){1, n - 1, (n - 1) * B, n * B, 0, 1};
          return 1;
        case OP_ALLGATHER: case OP_ALLTOALL: case OP_GATHER: case OP_SCATTER:
          *x = (struct terms){1, n - 1, (n - 1) * s, 0, 0, 1};
          return 1;
        case OP_REDUCE_SCATTER:
          *x = (struct terms){1, n - 1, (n - 1) * s, B, 0, 1};
          return 1;
        case OP_BARRIER:
          *x = (struct terms){1, n - 1, 0, 0, 0, 1};
          return 1;
        default: return 0;
      }
    case ALGO_RING:  /* pipelined: every step moves one slice to the next rank */
      switch (k) {
        case OP_ALLREDUCE:
          *x = (struct terms){2.0 * (n - 1), 2.0 * (n - 1), 2.0 * (n - 1) * s, 2.0 * (n - 1) * s, 0, 0};
          return 1;
        case OP_ALLGATHER:
          *x = (struct terms){n - 1, n - 1, (n - 1) * s, 0, 0, 0};
          return 1;
        case OP_REDUCE_SCATTER:
          *x = (struct terms){n - 1, n - 1, (n - 1) * s, 2.0 * (n - 1) * s, 0, 0};
          return 1;
        case OP_BROADCAST:  /* chain: the pipeline fills in n-1 steps, then streams B */
          *x = (struct terms){n - 1, 1, B, 0, 0, 0};
          return 1;
        case OP_REDUCE:
          *x = (struct terms){n - 1, 1, B, 2 * B, 0, 0};
          return 1;
        default: return 0;
      }
    case ALGO_TREE:  /* double binary tree, pipelined: depth L each way */
      switch (k) {
        case OP_ALLREDUCE:  /* each tree carries B/2; a rank is inner in one of them */
          *x = (struct terms){2 * L, 6, 2 * B, 1.5 * B, 0, 0};
          return 1;
        case OP_BROADCAST:
          *x = (struct terms){L, 2, 2 * B, 0, 0, 0};
          return 1;
        case OP_REDUCE:
          *x = (struct terms){L, 2, 2 * B, 3 * B, 0, 0};
          return 1;
        case OP_GATHER: case OP_SCATTER:  /* binomial: the root moves everything */
          *x = (struct terms){L, L, (n - 1) * s, 0, 0, 0};
          return 1;
        case OP_BARRIER:
          *x = (struct terms){2 * L, 3, 0, 0, 0, 0};
          return 1;
        default: return 0;
      }
    case ALGO_RHD:  /* Rabenseifner: recursive halving then doubling */
      switch (k) {
        case OP_ALLREDUCE:
          *x = (struct terms){2 * Lf + fold, 2 * Lf + fold, 2.0 * (n - 1) * s + fold * B,
                              2.0 * (n - 1) * s + fold * B, 0, 1};
          return 1;
        case OP_REDUCE_SCATTER:
          *x = (struct terms){Lf + fold, Lf + fold, (n - 1) * s + fold * B,
                              2.0 * (n - 1) * s + fold * B, 0, 1};
          return 1;
        case OP_BROADCAST:  /* scatter + all-gather (van de Geijn) */
          *x = (struct terms){2 * Lf + fold, 2 * Lf + fold, 2.0 * (n - 1) * s + fold * B, 0, 0, 1};
          return 1;
        case OP_REDUCE:     /* reduce-scatter + gather */
          *x = (struct terms){2 * Lf + fold, 2 * Lf + fold, 2.0 * (n - 1) * s + fold * B,
                              2.0 * (n - 1) * s + fold * B, 0, 1};
          return 1;
        default: return 0;
      }
    case ALGO_RD:  /* butterfly: every step exchanges everything gathered so far */
      switch (k) {
        case OP_ALLREDUCE:
          *x = (struct terms){Lf + fold, Lf + fold, (Lf + fold) * B, 2 * (Lf + fold) * B, 0, 1};
          return 1;
        case OP_ALLGATHER:
          *x = (struct terms){Lf + fold, Lf + fold, (n - 1) * s + fold * B, 0, 0, 1};
          return 1;
        case OP_BARRIER:
          *x = (struct terms){Lf + fold, Lf + fold, 0, 0, 0, 1};
          return 1;
        default: return 0;
      }
    case ALGO_BRUCK:  /* ceil(log2 n) steps for any n, local rotations */
      switch (k) {
        case OP_ALLGATHER:
          *x = (struct terms){L, L, (n - 1) * s, 0, B, 1};
          return 1;
        case OP_ALLTOALL:
          *x = (struct terms){L, L, L * B / 2, 0, 2 * B, 1};
          return 1;
        case OP_BARRIER:  /* dissemination */
          *x = (struct terms){L, L, 0, 0, 0, 1};
          return 1;
        default: return 0;
      }
    case ALGO_PAIRWISE:  /* n-1 exchanges with one peer each */
      switch (k) {
        case OP_ALLTOALL: case OP_ALLGATHER:
          *x = (struct terms){n - 1, n - 1, (n - 1) * s, 0, 0, 1};
          return 1;
        case OP_REDUCE_SCATTER:
          *x = (struct terms){n - 1, n - 1, (n - 1) * s, B, 0, 1};
          return 1;
        case OP_ALLREDUCE:
          *x = (struct terms){2.0 * (n - 1), 2.0 * (n - 1), 2.0 * (n - 1) * s, B, 0, 1};
          return 1;
        default: return 0;
      }
    case ALGO_ONESHOT:  /* shared scratch: copy in once, one sync, read what is needed */
      switch (k) {
        case OP_ALLREDUCE:       /* every rank reduces all n inputs itself */
          *x = (struct terms){1, 0, 0, n * B, B, 0};
          return 1;
        case OP_REDUCE:
          *x = (struct terms){1, 0, 0, n * B, B, 0};
          return 1;
        case OP_BROADCAST:
          *x = (struct terms){1, 0, 0, 0, 2 * B, 0};
          return 1;
        case OP_ALLGATHER:
          *x = (struct terms){1, 0, 0, 0, s + B, 0};
          return 1;
        case OP_REDUCE_SCATTER:  /* each rank reduces its slice from every input */
          *x = (struct terms){1, 0, 0, B, B, 0};
          return 1;
        case OP_ALLTOALL:
          *x = (struct terms){1, 0, 0, 0, 2 * B, 0};
          return 1;
        case OP_BARRIER:
          *x = (struct terms){1, 0, 0, 0, 0, 0};
          return 1;
        default: return 0;
      }
    case ALGO_TWOSHOT:  /* reduce 1/n from all inputs, publish it, all gather: 2 syncs */
      if (k != OP_ALLREDUCE) return 0;
      *x = (struct terms){2, 0, 0, B, B + s + (n - 1) * s, 0};
      return 1;
    default:
      return 0;
  }
}

static double flat_cost(const struct tune_model *m, const struct tune_topo *t, enum op_kind k,
                        int id, double B) {
  if (t->nranks <= 1) return 0;
  struct terms x;
  if (!terms_of(id, k, t->nranks, B, &x)) return -1;
  return eval(m, t, &x);
}

/* Cheapest single-level algorithm for a phase of hier (whatever hier.c runs inside a host
 * or between leaders, the model assumes it runs the best one). */
static double best_flat(const struct tune_model *m, const struct tune_topo *t, enum op_kind k,
                        double B) {
  double best = -1;
  for (int id = 0; id < ALGO_COUNT; id++) {
    if (id == ALGO_HIER || !tune_topo_ok(t, k, id)) continue;
    double c = flat_cost(m, t, k, id, B);
    if (c >= 0 && (best < 0 || c < best)) best = c;
  }
  return best < 0 ? 0 : best;
}

static double hier_cost(const struct tune_model *m, const struct tune_topo *t, enum op_kind k,
                        double B) {
  const int H = t->nhosts;
  struct tune_topo in = {t->per_host, 1, t->per_host, t->shm, t->spin}; /* inside one host */
  struct tune_topo out = {H, H, 1, 0, 0};                                /* between leaders */
  switch (k) {
    case OP_ALLREDUCE:
      return best_flat(m, &in, OP_REDUCE, B) + best_flat(m, &out, OP_ALLREDUCE, B) +
             best_flat(m, &in, OP_BROADCAST, B);
    case OP_BROADCAST:
      return best_flat(m, &out, OP_BROADCAST, B) + best_flat(m, &in, OP_BROADCAST, B);
    case OP_REDUCE:
      return best_flat(m, &in, OP_REDUCE, B) + best_flat(m, &out, OP_REDUCE, B);
    case OP_ALLGATHER:
      return best_flat(m, &in, OP_GATHER, B / H) + best_flat(m, &out, OP_ALLGATHER, B) +
             best_flat(m, &in, OP_BROADCAST, B);
    case OP_REDUCE_SCATTER:
      return best_flat(m, &in, OP_REDUCE, B) + best_flat(m, &out, OP_REDUCE_SCATTER, B) +
             best_flat(m, &in, OP_SCATTER, B / H);
    case OP_BARRIER:
      return 2 * best_flat(m, &in, OP_BARRIER, 0) + best_flat(m, &out, OP_BARRIER, 0);
    default:
      return -1;
  }
}

double tune_cost(const struct tune_model *m, const struct tune_topo *t, enum op_kind kind,
                 int id, double bytes) {
  if ((unsigned)kind > OP_BARRIER || id < 0 || id >= ALGO_COUNT) return -1;
  if (kind == OP_BARRIER) bytes = 0;
  if (id == ALGO_HIER) return t->nhosts > 1 ? hier_cost(m, t, kind, bytes) : -1;
  return flat_cost(m, t, kind, id, bytes);
}

/* ------------------------------------------------------------------ constraints */
int tune_topo_ok(const struct tune_topo *t, enum op_kind kind, int id) {
  (void)kind;
  switch (id) {
    case ALGO_ONESHOT: case ALGO_TWOSHOT:  /* every rank on one host, through shm, and no
                                             * more of them than shm_direct.c serves */
      return t->nhosts == 1 && t->shm && t->nranks > 1 && t->nranks <= CHORUS_MAX_LOCAL_DIRECT;
    case ALGO_HIER:
      return t->nhosts > 1 && t->per_host > 1;
    default:
      return id >= 0 && id < ALGO_COUNT;
  }
}

/* Unequal counts (all_gatherv, reduce_scatterv), or an all_to_all issued as alltoallv: the
 * per-peer counts of those differ between ranks, so only the API call is a shared fact. */
static int op_is_v(const struct chorus_comm *comm, const struct op *op) {
  if (op->kind == OP_ALLTOALL) return !op->uniform;
  if (!op->counts) return 0;
  for (int p = 1; p < comm->nranks; p++)
    if (op->counts[p] != op->counts[0]) return 1;
  return 0;
}

static void topo_of_comm(const struct chorus_comm *comm, struct tune_topo *t) {
  if (comm->tune) { /* shm from the peer table, cached; hosts read again (tests fake them) */
    *t = comm->tune->topo;
    t->nhosts = comm->nhosts > 0 ? comm->nhosts : 1;
    t->per_host = comm->max_per_host > 0 ? comm->max_per_host : comm->nranks;
    return;
  }
  t->nranks = comm->nranks;
  t->nhosts = comm->nhosts > 0 ? comm->nhosts : 1;
  t->per_host = comm->max_per_host > 0 ? comm->max_per_host : comm->nranks;
  t->shm = 1;
  for (int r = 0; r < comm->nranks; r++)
    if (comm->peers && !comm->peers[r].shm_ok) t->shm = 0;
  t->spin = comm->all_spin;
}

/* Every check that decides whether algorithm id may run op on comm, beyond being
 * implemented. Checks that depend only on the topology belong in tune_topo_ok (so that
 * chorus_tune_plan sees them too); checks on the op's shape go here. Every input must be
 * equal on all ranks of a correct program. */
/* fp16/bf16 (and float8) sums and products must round once, to within 2 ulp of the
 * float32-accumulated result (the foundation's bar): a schedule that adds partial results in steps (ring, trees,
 * halving-doubling, the hierarchy) rounds to the dtype at every step and drifts several ulp
 * where terms cancel. With more than two ranks those ops go to schedules in which one rank
 * combines every input in a single float32 pass: direct, oneshot, twoshot. */
static int rounds_in_steps(const struct chorus_comm *comm, const struct op *op, int id) {
  if (comm->nranks <= 2) return 0;
  if (comm->stepwise_halves_ok && id == comm->algo_force[op->kind]) return 0;
  if (op->dtype != CHORUS_FLOAT16 && op->dtype != CHORUS_BFLOAT16 &&
      op->dtype != CHORUS_FLOAT8_E4M3 && op->dtype != CHORUS_FLOAT8_E5M2)
    return 0;
  if (op->kind != OP_ALLREDUCE && op->kind != OP_REDUCE && op->kind != OP_REDUCE_SCATTER)
    return 0;
  switch (op->op.kind) {
    case CHORUS_SUM:
    case CHORUS_PROD:
    case CHORUS_AVG:
    case CHORUS_PREMUL_SUM:
      break;
    default:
      return 0; /* min, max and bitwise ops are exact in any order */
  }
  return id != ALGO_DIRECT && id != ALGO_ONESHOT && id != ALGO_TWOSHOT;
}

static int constraints_ok(const struct chorus_comm *comm, const struct op *op, int id, int v) {
  if (rounds_in_steps(comm, op, id)) return 0;
  struct tune_topo t;
  topo_of_comm(comm, &t);
  if (!tune_topo_ok(&t, op->kind, id)) return 0;
  if (v && !(algo_v_ok & (1u << id))) return 0;
  if ((id == ALGO_ONESHOT || id == ALGO_TWOSHOT) &&
      (!comm->shm || comm->nlocal != comm->nranks))
    return 0;
  return algo_shape_ok(comm, op, id);
}

int algo_constraints_ok(const struct chorus_comm *comm, const struct op *op, int id) {
  return constraints_ok(comm, op, id, op_is_v(comm, op));
}

int algo_usable(const struct chorus_comm *comm, const struct op *op, int id) {
  if (id < 0 || id >= ALGO_COUNT || (unsigned)op->kind > OP_BARRIER) return 0;
  if (!algo_table[id].run[op->kind]) return 0;
  return algo_constraints_ok(comm, op, id);
}

/* ------------------------------------------------------------------ the decision */
/* Order of two algorithms with modelled costs ca and cb: the cheaper first; on a tie the
 * pipelined ring before the others, then the lower id. The model adds reduction and copy
 * time to transfer time, which a pipelined schedule overlaps and a phased one does not; the
 * costs tie exactly where the terms are equal, as direct and ring are at 2 ranks, and there
 * the ring was measured faster (2 simulated hosts over a veth pair, 256 MiB all_reduce:
 * 0.80-0.83 of a one-way TCP stream's rate against 0.67-0.73 for direct; docs/design.md,
 * "Tuner"). */
static int goes_before(const struct tune_topo *t, int a, double ca, int b, double cb) {
  if (ca != cb) return ca < cb;
  /* only between hosts, where it was measured (a cost of 0 is a group of one) */
  if (t->nhosts > 1 && ca > 0 && (a == ALGO_RING) != (b == ALGO_RING)) return a == ALGO_RING;
  return a < b;
}

int tune_rank(const struct tune_model *m, const struct tune_topo *t, enum op_kind kind,
              double bytes, uint32_t mask, int *ids, double *costs, int cap) {
  int n = 0;
  for (int id = 0; id < ALGO_COUNT && n < cap; id++) {
    if (!(mask & (1u << id))) continue;
    double c = tune_cost(m, t, kind, id, bytes);
    /* insertion by (modelled first, then goes_before); ids arrive in increasing order */
    int j = n++;
    while (j > 0) {
      double pc = costs[j - 1];
      int before = c >= 0 && (pc < 0 || goes_before(t, id, c, ids[j - 1], pc));
      if (!before) break;
      ids[j] = ids[j - 1];
      costs[j] = costs[j - 1];
      j--;
    }
    ids[j] = id;
    costs[j] = c;
  }
  return n;
}

/* Cheapest modelled id in mask (ties: goes_before); an unmodelled one only if none is. */
static int cheapest(const struct tune_model *m, const struct tune_topo *t, enum op_kind k,
                    double B, uint32_t mask, double *us) {
  int best = -1, fallback = -1;
  double best_c = 0;
  for (int id = 0; id < ALGO_COUNT; id++) {
    if (!(mask & (1u << id))) continue;
    double c = tune_cost(m, t, k, id, B);
    if (c < 0) {
      if (fallback < 0) fallback = id;
    } else if (best < 0 || goes_before(t, id, c, best, best_c)) {
      best = id;
      best_c = c;
    }
  }
  if (best >= 0) {
    *us = best_c;
    return best;
  }
  *us = -1;
  return fallback;
}

struct tune_pick tune_decide(const struct tune_model *m, const struct tune_topo *t,
                             enum op_kind kind, double bytes, uint32_t usable,
                             const struct tune_force *f) {
  struct tune_pick p = {ALGO_DIRECT, -1, 0, 0};
  int force = f ? f->force[kind] : -1;
  uint32_t allow = f ? f->allow[kind] : 0;
  if (force >= 0 && (usable & (1u << force))) {
    p.id = force;
    p.us = tune_cost(m, t, kind, force, bytes);
    p.forced = 1;
    return p;
  }
  uint32_t cand = usable;
  if (allow) {
    if (usable & allow) cand = usable & allow;
    else p.fell_back = 1;
  }
  double us;
  int id = cheapest(m, t, kind, bytes, cand, &us);
  if (id >= 0) {
    p.id = id;
    p.us = us;
  }
  return p;
}

/* ------------------------------------------------------------------ names and parsing */
/* Names of op_kind_name(), also accepted without underscores, in any case. */
int tune_collective_from_name(const char *name) {
  static const struct {
    const char *name;
    enum op_kind kind;
  } aliases[] = {{"bcast", OP_BROADCAST}, {"alltoall", OP_ALLTOALL}};
  char want[32], have[32];
  size_t j = 0;
  for (const char *p = name; *p && j + 1 < sizeof want; p++)
    if (*p != '_' && *p != '-') want[j++] = (char)tolower((unsigned char)*p);
  want[j] = 0;
  if (!want[0]) return -1;
  for (int k = 0; k <= OP_BARRIER; k++) {
    j = 0;
    for (const char *p = op_kind_name((enum op_kind)k); *p && j + 1 < sizeof have; p++)
      if (*p != '_') have[j++] = *p;
    have[j] = 0;
    if (strcmp(want, have) == 0) return k;
  }
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (strcmp(want, aliases[i].name) == 0) return (int)aliases[i].kind;
  return -1;
}

/* Algorithm names NCCL uses that have no Chorus counterpart (skipped with a warning). */
static int nccl_only_name(const char *name) {
  static const char *const names[] = {"collnet", "collnetdirect", "collnetchain", "nvls",
                                      "nvlstree", "pat"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcasecmp(name, names[i]) == 0) return 1;
  return 0;
}

static int algo_from_name_ci(const char *name) {
  for (int i = 0; i < ALGO_COUNT; i++)
    if (strcasecmp(algo_table[i].name, name) == 0) return i;
  return -1;
}

static void valid_names(char *buf, size_t cap) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < ALGO_COUNT && used < cap; i++)
    used += (size_t)snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", algo_table[i].name);
}

static void valid_collectives(char *buf, size_t cap) {
  size_t used = 0;
  buf[0] = 0;
  for (int k = 0; k <= OP_BARRIER && used < cap; k++)
    used += (size_t)snprintf(buf + used, cap - used, "%s%s", k ? ", " : "",
                             op_kind_name((enum op_kind)k));
}

/* Copies [b, e) trimmed into out (cap bytes); returns its length or -1 if too long. */
static int copy_trimmed(const char *b, const char *e, char *out, size_t cap) {
  while (b < e && isspace((unsigned char)*b)) b++;
  while (e > b && isspace((unsigned char)e[-1])) e--;
  if ((size_t)(e - b) >= cap) return -1;
  memcpy(out, b, (size_t)(e - b));
  out[e - b] = 0;
  return (int)(e - b);
}

/* Syntax: groups separated by ';', items by ','. An item is [collective ':'] ['^'] name.
 * An item with a collective starts that collective's list; a bare item continues the list
 * of the current group (the global list if the group has named no collective yet). A list
 * allows its algorithms (one: forced), or with '^' in front excludes them all. Per-collective
 * lists replace the global one for their collective. */
int tune_parse_algo(const char *text, struct tune_force *out, char *err, size_t err_cap,
                    char *warn, size_t warn_cap) {
  uint32_t list[OP_KIND_COUNT + 1] = {0};   /* [OP_KIND_COUNT] is the global list */
  int mode[OP_KIND_COUNT + 1] = {0};        /* 0 unset, 1 allow, 2 exclude */
  int named[OP_KIND_COUNT + 1] = {0};
  char names[256];
  valid_names(names, sizeof names);
  if (warn && warn_cap) warn[0] = 0;
  size_t wused = 0;
  const char *p = text ? text : "";
  int cur = OP_KIND_COUNT;
  while (*p) {
    const char *e = p;
    while (*e && *e != ',' && *e != ';') e++;
    char item[64], coll[64];
    if (copy_trimmed(p, e, item, sizeof item) < 0) {
      snprintf(err, err_cap, "item \"%.*s\" is too long", (int)(e - p > 40 ? 40 : e - p), p);
      return -1;
    }
    char *name = item;
    char *colon = strchr(item, ':');
    if (colon) {
      *colon = 0;
      if (copy_trimmed(item, colon, coll, sizeof coll) < 0) coll[0] = 0;
      int k = tune_collective_from_name(coll);
      if (k < 0) {
        char colls[256];
        valid_collectives(colls, sizeof colls);
        snprintf(err, err_cap, "unknown collective \"%s\" (valid: %s; underscores optional)",
                 coll, colls);
        return -1;
      }
      cur = k;
      /* a collective named twice: the later list replaces the earlier */
      list[cur] = 0;
      mode[cur] = 0;
      named[cur] = 1;
      name = colon + 1;
      while (isspace((unsigned char)*name)) name++;
    }
    if (*name || colon) {
      int exclude = 0;
      if (*name == '^') {
        exclude = 1;
        name++;
        while (isspace((unsigned char)*name)) name++;
      }
      if (!*name) {
        snprintf(err, err_cap, "missing algorithm name after \"%s\" (valid: %s)",
                 colon ? coll : "^", names);
        return -1;
      }
      if (nccl_only_name(name)) {
        if (warn && wused < warn_cap)
          wused += (size_t)snprintf(warn + wused, warn_cap - wused, "%sNCCL's %s has no Chorus counterpart; ignored",
                                    wused ? "; " : "", name);
      } else {
        int id = algo_from_name_ci(name);
        if (id < 0) {
          snprintf(err, err_cap, "unknown algorithm \"%s\" (valid: %s)", name, names);
          return -1;
        }
        /* as in NCCL, a ^ in front of a list excludes the whole list */
        int m = exclude || mode[cur] == 2 ? 2 : 1;
        if (mode[cur] && mode[cur] != m) {
          snprintf(err, err_cap, "\"%s\" mixes allowed and excluded (^) algorithms in one list",
                   name);
          return -1;
        }
        mode[cur] = m;
        list[cur] |= 1u << id;
        named[cur] = 1;
      }
    }
    if (*e == ';') cur = OP_KIND_COUNT;
    p = *e ? e + 1 : e;
  }
  for (int k = 0; k < OP_KIND_COUNT; k++) {
    int src = named[k] ? k : OP_KIND_COUNT;
    uint32_t allow = 0;
    if (mode[src] == 1) allow = list[src];
    else if (mode[src] == 2) allow = ALL_ALGOS & ~list[src];
    if (mode[src] == 2 && !allow) {
      snprintf(err, err_cap, "every algorithm is excluded for %s",
               src == OP_KIND_COUNT ? "every collective" : op_kind_name((enum op_kind)k));
      return -1;
    }
    out->allow[k] = allow;
    out->force[k] = -1;
    if (allow && (allow & (allow - 1)) == 0)
      for (int id = 0; id < ALGO_COUNT; id++)
        if (allow == 1u << id) out->force[k] = id;
  }
  return 0;
}

/* "shm=LAT:OVH:GBPS,socket=...,socket_spin=...,net=...,reduce=GBPS,copy=GBPS"; empty fields
 * keep values. socket sets the spinning variant too (bench_transport measures one host as
 * its engines run there); socket_spin sets only that. */
int tune_parse_model(const char *text, struct tune_model *model, char *err, size_t err_cap) {
  const char *p = text ? text : "";
  while (*p) {
    const char *e = p;
    while (*e && *e != ',' && *e != ';') e++;
    char item[128];
    if (copy_trimmed(p, e, item, sizeof item) < 0) {
      snprintf(err, err_cap, "item too long");
      return -1;
    }
    p = *e ? e + 1 : e;
    if (!item[0]) continue;
    char *eq = strchr(item, '=');
    if (!eq) {
      snprintf(err, err_cap, "\"%s\" is not KEY=VALUE", item);
      return -1;
    }
    *eq = 0;
    char *val = eq + 1;
    double *fields[3] = {0}, *mirror[3] = {0};
    int nfields = 1;
    struct tune_link *l = NULL, *also = NULL;
    if (strcasecmp(item, "shm") == 0) {
      l = &model->shm;
    } else if (strcasecmp(item, "socket") == 0 || strcasecmp(item, "sock") == 0) {
      l = &model->sock;
      also = &model->sock_spin;
    } else if (strcasecmp(item, "socket_spin") == 0 || strcasecmp(item, "sock_spin") == 0) {
      l = &model->sock_spin;
    } else if (strcasecmp(item, "net") == 0) {
      l = &model->net;
    }
    if (l) {
      fields[0] = &l->lat_us;
      fields[1] = &l->ovh_us;
      fields[2] = &l->gbps;
      if (also) {
        mirror[0] = &also->lat_us;
        mirror[1] = &also->ovh_us;
        mirror[2] = &also->gbps;
      }
      nfields = 3;
    } else if (strcasecmp(item, "reduce") == 0) {
      fields[0] = &model->reduce_gbps;
    } else if (strcasecmp(item, "copy") == 0) {
      fields[0] = &model->copy_gbps;
    } else {
      snprintf(err, err_cap,
               "unknown key \"%s\" (valid: shm, socket, socket_spin, net, reduce, copy)", item);
      return -1;
    }
    for (int f = 0; f < nfields; f++) {
      char *end = val;
      while (*end && *end != ':') end++;
      char sep = *end;
      *end = 0;
      if (*val) {
        char *stop;
        double v = strtod(val, &stop);
        int rate = f == nfields - 1; /* the last field is a rate: must be > 0 */
        if (*stop || !(v >= 0) || !isfinite(v) || (rate && v <= 0)) {
          snprintf(err, err_cap, "%s: bad number \"%s\"", item, val);
          return -1;
        }
        *fields[f] = v;
        if (mirror[f]) *mirror[f] = v;
      }
      if (!sep) break;
      if (f == nfields - 1) {
        snprintf(err, err_cap, "%s takes %d value%s", item, nfields, nfields > 1 ? "s" : "");
        return -1;
      }
      val = end + 1;
    }
  }
  return 0;
}

/* Reads CHORUS_TUNE_MODEL over the measured constants. */
static int model_from_params(struct tune_model *m, char *err, size_t cap) {
  *m = tune_measured;
  if (tune_parse_model(param_str(PARAM_TUNE_MODEL), m, err, cap) != 0) return -1;
  return 0;
}

/* ------------------------------------------------------------------ communicator side */
/* CHORUS_TUNE_MODEL and CHORUS_ALGO into st; an error names the variable and the bad token.
 * warn_too: also log what parses with a warning. */
static chorus_result_t params_into(struct chorus_comm *comm, struct tune_state *st,
                                   int warn_too) {
  char err[512];
  if (model_from_params(&st->model, err, sizeof err) != 0)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: CHORUS_TUNE_MODEL=\"%s\": %s",
                          comm->rank, param_str(PARAM_TUNE_MODEL), err);
  const char *source = "CHORUS_ALGO";
  char value[2];
  chorus_param_value("ALGO", value, sizeof value, &source);
  if (strcmp(source, "default") == 0) source = "CHORUS_ALGO";
  st->source = source; /* static strings of param.c */
  char warn[256];
  const char *text = param_str(PARAM_ALGO);
  if (tune_parse_algo(text, &st->force, err, sizeof err, warn, sizeof warn) != 0)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: %s=\"%s\": %s", comm->rank,
                          source, text, err);
  if (warn_too && warn[0]) WARN(comm->rank, "%s=\"%s\": %s", source, text, warn);
  return CHORUS_SUCCESS;
}

chorus_result_t tune_check_params(struct chorus_comm *comm) {
  struct tune_state *st = calloc(1, sizeof *st);
  if (!st) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  chorus_result_t res = params_into(comm, st, 0);
  free(st);
  return res;
}

chorus_result_t tune_init(struct chorus_comm *comm) {
  for (int k = 0; k < OP_KIND_COUNT; k++) comm->algo_force[k] = -1;
  struct tune_state *st = calloc(1, sizeof *st);
  if (!st) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  comm->tune = NULL;
  topo_of_comm(comm, &st->topo);
  chorus_result_t res = params_into(comm, st, 1);
  if (res != CHORUS_SUCCESS) {
    free(st);
    return res;
  }
  const char *source = st->source, *text = param_str(PARAM_ALGO);
  for (int k = 0; k < OP_KIND_COUNT; k++) comm->algo_force[k] = st->force.force[k];
  comm->tune = st;
  INFO(SUB_TUNE, comm->rank,
       "tuner: %d ranks, %d host%s, up to %d per host, intra-host %s, %s%s%s", st->topo.nranks,
       st->topo.nhosts, st->topo.nhosts > 1 ? "s" : "", st->topo.per_host,
       st->topo.shm ? "shm" : "socket",
       st->topo.spin ? "every engine spins" : "not every engine spins",
       text[0] ? "; " : "", text[0] ? source : "");
  return CHORUS_SUCCESS;
}

void tune_fini(struct chorus_comm *comm) {
  free(comm->tune);
  comm->tune = NULL;
}

/* The size the model is given: the larger buffer of one rank (see chorus_tune_plan). */
static double op_bytes(const struct chorus_comm *comm, const struct op *op) {
  double es = (double)dtype_size(op->dtype), n = comm->nranks;
  switch (op->kind) {
    case OP_GATHER: case OP_SCATTER: return (double)op->count * es * n;
    case OP_ALLTOALL: return op->counts ? (double)op->counts[0] * es * n : 0;
    case OP_BARRIER: return 0;
    default: return (double)op->count * es;
  }
}

/* floor(log2(bytes)) + 1, 0 for 0 bytes, at most 63 */
static int size_bucket(double bytes) {
  int b = 0;
  for (; b < 63 && bytes >= 1.0; b++) bytes /= 2;
  return b;
}

static void log_choice(struct chorus_comm *comm, const struct tune_state *st, const struct op *op,
                       double bytes, uint32_t usable, const struct tune_pick *pk, int level) {
  int ids[ALGO_COUNT];
  double costs[ALGO_COUNT];
  int n = tune_rank(&st->model, &st->topo, op->kind, bytes, usable, ids, costs, ALGO_COUNT);
  char others[256];
  size_t used = 0;
  others[0] = 0;
  for (int i = 0, shown = 0; i < n && shown < 4 && used < sizeof others; i++) {
    if (ids[i] == pk->id || costs[i] < 0) continue;
    used += (size_t)snprintf(others + used, sizeof others - used, "%s %s %.0f", shown ? "," : ";",
                             algo_name(ids[i]), costs[i]);
    shown++;
  }
  char pred[48];
  if (pk->us >= 0) snprintf(pred, sizeof pred, "predicted %.0f us", pk->us);
  else snprintf(pred, sizeof pred, "no prediction");
  const char *src = pk->forced ? st->source : "tuner";
  if (level == LOG_INFO)
    chorus_log(LOG_INFO, SUB_TUNE, comm->rank, "%s %.0f bytes x %d ranks: %s (%s%s) [%s]",
               op_kind_name(op->kind), bytes, comm->nranks, algo_name(pk->id), pred, others, src);
  else
    chorus_log(LOG_TRACE, SUB_TUNE, comm->rank, "%s seq %llu %.0f bytes x %d ranks: %s (%s%s) [%s]",
               op_kind_name(op->kind), (unsigned long long)op->seq, bytes, comm->nranks,
               algo_name(pk->id), pred, others, src);
}

int algo_select(struct chorus_comm *comm, const struct op *op) {
  if ((unsigned)op->kind > OP_BARRIER) return ALGO_DIRECT;
  struct tune_state *st = comm->tune;
  struct tune_state fallback;
  if (!st) { /* only before tune_init (tests): the measured model, no overrides */
    memset(&fallback, 0, sizeof fallback);
    topo_of_comm(comm, &fallback.topo);
    fallback.model = tune_measured;
    for (int k = 0; k < OP_KIND_COUNT; k++) fallback.force.force[k] = -1;
    fallback.source = "CHORUS_ALGO";
    st = &fallback;
  }
  int v = op_is_v(comm, op);
  uint32_t usable = 0;
  for (int id = 0; id < ALGO_COUNT; id++)
    if (algo_table[id].run[op->kind] && constraints_ok(comm, op, id, v)) usable |= 1u << id;
  /* alltoallv: sizes differ per rank, so the choice among v-capable algorithms must not
   * depend on them: the model is asked about an empty op. (all_gatherv and reduce_scatterv
   * totals are equal on every rank.) */
  double bytes = v && op->kind == OP_ALLTOALL ? 0 : op_bytes(comm, op);
  struct tune_pick pk = tune_decide(&st->model, &st->topo, op->kind, bytes, usable, &st->force);
  if (!(usable & (1u << pk.id))) pk.id = ALGO_DIRECT;
  if (st != &fallback) {
    uint32_t bit = 1u << op->kind;
    int force = st->force.force[op->kind];
    if ((pk.fell_back || (force >= 0 && !pk.forced)) && !(st->warned & bit)) {
      st->warned |= bit;
      char want[128];
      size_t used = 0;
      want[0] = 0;
      for (int id = 0; id < ALGO_COUNT && used < sizeof want; id++)
        if (st->force.allow[op->kind] & (1u << id))
          used += (size_t)snprintf(want + used, sizeof want - used, "%s%s", used ? "/" : "",
                                   algo_name(id));
      const char *why = "its constraints fail here";
      if (force >= 0 && !algo_table[force].run[op->kind]) why = "it is not implemented for it";
      else if (force >= 0 && v && !(algo_v_ok & (1u << force)))
        why = "it does not take unequal counts";
      else if (force >= 0 && rounds_in_steps(comm, op, force))
        why = "it would round 16-bit or float8 partial results at every step";
      WARN(comm->rank, "%s=\"%s\" asks for %s for %s, but %s; the tuner chooses %s instead",
           st->source, param_str(PARAM_ALGO), want, op_kind_name(op->kind),
           force >= 0 ? why : "none of them can run it here", algo_name(pk.id));
    }
    if (chorus_log_enabled(LOG_TRACE, SUB_TUNE)) {
      log_choice(comm, st, op, bytes, usable, &pk, LOG_TRACE);
    } else if (chorus_log_enabled(LOG_INFO, SUB_TUNE)) {
      uint64_t b = 1ull << size_bucket(bytes);
      if (!(st->logged[op->kind][pk.id] & b)) {
        st->logged[op->kind][pk.id] |= b;
        log_choice(comm, st, op, bytes, usable, &pk, LOG_INFO);
      }
    }
  }
  return pk.id;
}

/* ------------------------------------------------------------------ chorus_tune_plan */
chorus_result_t chorus_tune_plan(const char *collective, size_t bytes,
                                 const chorus_tune_topology_t *topo, const char *algo_override,
                                 unsigned flags, chorus_tune_plan_t *plan) {
  char err[512];
  if (!plan || !topo || !collective)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_tune_plan: NULL argument");
  memset(plan, 0, sizeof *plan);
  int k = tune_collective_from_name(collective);
  if (k < 0) {
    char colls[256];
    valid_collectives(colls, sizeof colls);
    return comm_set_error(NULL, CHORUS_ERR_INVALID,
                          "chorus_tune_plan: unknown collective \"%s\" (valid: %s)", collective,
                          colls);
  }
  if (topo->nranks < 1 || topo->nranks > (1 << 24))
    return comm_set_error(NULL, CHORUS_ERR_INVALID,
                          "chorus_tune_plan: nranks must be 1..16777216, got %d", topo->nranks);
  if (topo->ranks_per_host < 1 || topo->ranks_per_host > topo->nranks)
    return comm_set_error(NULL, CHORUS_ERR_INVALID,
                          "chorus_tune_plan: ranks_per_host must be 1..nranks (%d), got %d",
                          topo->nranks, topo->ranks_per_host);
  if (topo->shm != 0 && topo->shm != 1)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_tune_plan: shm must be 0 or 1, got %d",
                          topo->shm);
  if (topo->spin < -1 || topo->spin > 1)
    return comm_set_error(NULL, CHORUS_ERR_INVALID,
                          "chorus_tune_plan: spin must be -1, 0 or 1, got %d", topo->spin);
  struct tune_model model;
  if (model_from_params(&model, err, sizeof err) != 0)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "CHORUS_TUNE_MODEL=\"%s\": %s",
                          param_str(PARAM_TUNE_MODEL), err);
  const char *source = "CHORUS_ALGO";
  const char *text = algo_override;
  if (!text) {
    char value[2];
    chorus_param_value("ALGO", value, sizeof value, &source);
    if (strcmp(source, "default") == 0) source = "CHORUS_ALGO";
    text = param_str(PARAM_ALGO);
  }
  struct tune_force force;
  if (tune_parse_algo(text, &force, err, sizeof err, NULL, 0) != 0)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "%s=\"%s\": %s", source, text, err);

  /* The topology a communicator of this shape sees: hosts filled in rank order. */
  struct tune_topo t;
  t.nranks = topo->nranks;
  t.per_host = topo->ranks_per_host;
  t.nhosts = (topo->nranks + topo->ranks_per_host - 1) / topo->ranks_per_host;
  t.shm = topo->shm;
  /* -1: as engines of ranks_per_host ranks on a host like this process's would decide */
  t.spin = topo->spin >= 0 ? topo->spin
                           : spin_count_for(param_int(PARAM_SPIN_COUNT), topo->ranks_per_host,
                                            cores_usable()) > 0;
  uint32_t usable = 0, implemented = 0;
  /* what the segment's scratch half would be: too small a CHORUS_SHM_SCRATCH makes the run
   * refuse the direct-access algorithms (shm_direct_ok), so the plan leaves them out too */
  int scratch_ok = shm_direct_scratch_ok((size_t)(shm_scratch_bytes() / 2), t.nranks);
  for (int id = 0; id < ALGO_COUNT; id++) {
    if (algo_table[id].run[k]) implemented |= 1u << id;
    if (!tune_topo_ok(&t, (enum op_kind)k, id)) continue;
    if ((id == ALGO_ONESHOT || id == ALGO_TWOSHOT) && !scratch_ok) continue;
    if ((implemented & (1u << id)) || ((flags & CHORUS_TUNE_UNIMPLEMENTED) &&
                                       tune_cost(&model, &t, (enum op_kind)k, id, 0) >= 0))
      usable |= 1u << id;
  }
  double B = k == OP_BARRIER ? 0 : (double)bytes;
  struct tune_pick pk = tune_decide(&model, &t, (enum op_kind)k, B, usable, &force);
  snprintf(plan->algo, sizeof plan->algo, "%s", algo_name(pk.id));
  plan->predicted_us = pk.us;
  plan->forced = pk.forced;
  plan->fell_back = pk.fell_back || (force.force[k] >= 0 && !pk.forced);
  plan->nhosts = t.nhosts;
  plan->spin = t.spin;
  int ids[ALGO_COUNT];
  double costs[ALGO_COUNT];
  int n = tune_rank(&model, &t, (enum op_kind)k, B, usable, ids, costs, ALGO_COUNT);
  for (int i = 0; i < n && i < CHORUS_TUNE_MAX_CANDIDATES; i++) {
    chorus_tune_candidate_t *c = &plan->candidates[plan->ncandidates++];
    snprintf(c->algo, sizeof c->algo, "%s", algo_name(ids[i]));
    c->predicted_us = costs[i];
    c->implemented = (implemented >> ids[i]) & 1;
  }
  return CHORUS_SUCCESS;
}
