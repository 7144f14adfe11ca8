/* test_tune.c - unit tests of the tuner (algo/tune.c): CHORUS_ALGO and CHORUS_TUNE_MODEL
 * parsing (good and bad strings), that a choice is deterministic and always a usable
 * algorithm, that the model prefers latency-bound algorithms for small and bandwidth-bound
 * ones for large sizes, topologies up to 4096 ranks, and that chorus_tune_plan agrees with
 * algo_select on a communicator of the same shape (and that a bad CHORUS_ALGO fails
 * tune_init with a message that names the bad token). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/tune.h"

#include "expect.h"

#define BIT(id) (1u << (id))
#define ALL ((1u << ALGO_COUNT) - 1)

/* ------------------------------------------------------------------ CHORUS_ALGO */
static struct tune_force parse_ok(const char *s, const char *want_warn) {
  struct tune_force f;
  memset(&f, 0x5a, sizeof f);
  char err[512] = "", warn[256] = "x";
  int rc = tune_parse_algo(s, &f, err, sizeof err, warn, sizeof warn);
  EXPECT(rc == 0, "tune_parse_algo(\"%s\") failed: %s", s, err);
  if (want_warn)
    EXPECT(strstr(warn, want_warn) != NULL, "\"%s\": warning \"%s\" lacks \"%s\"", s, warn,
           want_warn);
  else
    EXPECT(warn[0] == 0, "\"%s\": unexpected warning \"%s\"", s, warn);
  return f;
}

static void parse_bad(const char *s, const char *want1, const char *want2) {
  struct tune_force f;
  char err[512] = "";
  int rc = tune_parse_algo(s, &f, err, sizeof err, NULL, 0);
  EXPECT(rc == -1, "tune_parse_algo(\"%s\") should fail", s);
  EXPECT(strstr(err, want1) != NULL, "\"%s\": error \"%s\" lacks \"%s\"", s, err, want1);
  if (want2) EXPECT(strstr(err, want2) != NULL, "\"%s\": error \"%s\" lacks \"%s\"", s, err, want2);
}

static void expect_force_all(const struct tune_force *f, int id, const char *s) {
  for (int k = 0; k < OP_KIND_COUNT; k++) {
    EXPECT(f->force[k] == id, "\"%s\": %s forced %d, want %d", s, op_kind_name(k), f->force[k], id);
    EXPECT(f->allow[k] == (id < 0 ? 0 : BIT(id)), "\"%s\": %s allow %#x", s, op_kind_name(k),
           f->allow[k]);
  }
}

static void test_parse_algo(void) {
  struct tune_force f = parse_ok("", NULL);
  expect_force_all(&f, -1, "");
  f = parse_ok("  ", NULL);
  expect_force_all(&f, -1, "  ");
  f = parse_ok("ring", NULL);
  expect_force_all(&f, ALGO_RING, "ring");
  f = parse_ok("Ring", NULL); /* NCCL's spelling */
  expect_force_all(&f, ALGO_RING, "Ring");
  f = parse_ok("TREE", NULL);
  expect_force_all(&f, ALGO_TREE, "TREE");

  const char *s = "allreduce:ring,allgather:rd,broadcast:tree";
  f = parse_ok(s, NULL);
  EXPECT(f.force[OP_ALLREDUCE] == ALGO_RING && f.force[OP_ALLGATHER] == ALGO_RD &&
             f.force[OP_BROADCAST] == ALGO_TREE && f.force[OP_REDUCE] == -1 &&
             f.force[OP_BARRIER] == -1 && f.allow[OP_REDUCE] == 0,
         "\"%s\" parsed wrong", s);
  f = parse_ok(" all_reduce : Tree ; All_To_All:pairwise, reduce_scatter:rhd", NULL);
  EXPECT(f.force[OP_ALLREDUCE] == ALGO_TREE && f.force[OP_ALLTOALL] == ALGO_PAIRWISE &&
             f.force[OP_REDUCE_SCATTER] == ALGO_RHD && f.force[OP_GATHER] == -1,
         "underscored / spaced names parsed wrong");
  f = parse_ok("AllGather:bruck,bcast:direct,reducescatter:ring,alltoall:bruck", NULL);
  EXPECT(f.force[OP_ALLGATHER] == ALGO_BRUCK && f.force[OP_BROADCAST] == ALGO_DIRECT &&
             f.force[OP_REDUCE_SCATTER] == ALGO_RING && f.force[OP_ALLTOALL] == ALGO_BRUCK,
         "NCCL-style collective names parsed wrong");

  /* a list lets the tuner choose among it (NCCL_ALGO=Tree,Ring) */
  f = parse_ok("Tree,Ring", NULL);
  for (int k = 0; k < OP_KIND_COUNT; k++)
    EXPECT(f.force[k] == -1 && f.allow[k] == (BIT(ALGO_TREE) | BIT(ALGO_RING)),
           "Tree,Ring: %s allow %#x force %d", op_kind_name(k), f.allow[k], f.force[k]);
  f = parse_ok("allreduce:tree,ring;broadcast:ring", NULL);
  EXPECT(f.allow[OP_ALLREDUCE] == (BIT(ALGO_TREE) | BIT(ALGO_RING)) &&
             f.force[OP_ALLREDUCE] == -1 && f.force[OP_BROADCAST] == ALGO_RING &&
             f.allow[OP_REDUCE] == 0,
         "NCCL per-collective lists parsed wrong");
  /* a global name plus a per-collective one: the per-collective one wins for it */
  f = parse_ok("ring,allgather:rd", NULL);
  EXPECT(f.force[OP_ALLGATHER] == ALGO_RD && f.force[OP_ALLREDUCE] == ALGO_RING &&
             f.force[OP_BARRIER] == ALGO_RING,
         "global + per-collective parsed wrong");
  /* exclusion */
  f = parse_ok("^ring", NULL);
  for (int k = 0; k < OP_KIND_COUNT; k++)
    EXPECT(f.allow[k] == (ALL & ~BIT(ALGO_RING)) && f.force[k] == -1, "^ring: %s allow %#x",
           op_kind_name(k), f.allow[k]);
  f = parse_ok("allreduce:^ring,tree", NULL);
  EXPECT(f.allow[OP_ALLREDUCE] == (ALL & ~(BIT(ALGO_RING) | BIT(ALGO_TREE))) &&
             f.allow[OP_BROADCAST] == 0,
         "allreduce:^ring,tree parsed wrong");
  /* NCCL names without a counterpart: ignored with a warning */
  f = parse_ok("NVLS", "NVLS");
  expect_force_all(&f, -1, "NVLS");
  f = parse_ok("CollnetDirect,Ring", "CollnetDirect");
  expect_force_all(&f, ALGO_RING, "CollnetDirect,Ring");
  f = parse_ok("ring,", NULL);
  expect_force_all(&f, ALGO_RING, "ring,");

  parse_bad("bogus", "\"bogus\"", "valid: direct, ring, tree");
  parse_bad("allreduce:bogus", "\"bogus\"", "hier");
  parse_bad("allredux:ring", "\"allredux\"", "all_reduce");
  parse_bad("ring,allreduce:nope", "\"nope\"", NULL);
  parse_bad("send:ring", "\"send\"", NULL);
  parse_bad("allreduce:", "missing algorithm", NULL);
  parse_bad("^", "missing algorithm", NULL);
  parse_bad("ring,^tree", "mixes", NULL);
  parse_bad("^direct,ring,tree,rhd,rd,bruck,pairwise,oneshot,twoshot,hier", "every algorithm",
            NULL);
  parse_bad("ring:tree", "\"ring\"", NULL);
}

/* ------------------------------------------------------------------ CHORUS_TUNE_MODEL */
static void test_parse_model(void) {
  struct tune_model m = tune_measured;
  char err[256];
  EXPECT(tune_parse_model("", &m, err, sizeof err) == 0 &&
             memcmp(&m, &tune_measured, sizeof m) == 0,
         "empty model changed something");
  EXPECT(tune_parse_model("net=10:2:12.5, reduce=8", &m, err, sizeof err) == 0, "%s", err);
  EXPECT(m.net.lat_us == 10 && m.net.ovh_us == 2 && m.net.gbps == 12.5 && m.reduce_gbps == 8 &&
             m.shm.lat_us == tune_measured.shm.lat_us,
         "net/reduce not applied");
  m = tune_measured;
  EXPECT(tune_parse_model("shm=::5,SOCKET=7", &m, err, sizeof err) == 0, "%s", err);
  EXPECT(m.shm.gbps == 5 && m.shm.lat_us == tune_measured.shm.lat_us && m.sock.lat_us == 7 &&
             m.sock.gbps == tune_measured.sock.gbps,
         "partial fields not applied");
  /* socket sets the spinning variant too (a host measured as its engines run); socket_spin
   * only that one */
  EXPECT(m.sock_spin.lat_us == 7 && m.sock_spin.ovh_us == tune_measured.sock_spin.ovh_us &&
             m.sock_spin.gbps == tune_measured.sock_spin.gbps,
         "socket= did not set the spinning socket link");
  m = tune_measured;
  EXPECT(tune_parse_model("socket_spin=4:1:2", &m, err, sizeof err) == 0, "%s", err);
  EXPECT(m.sock_spin.lat_us == 4 && m.sock_spin.ovh_us == 1 && m.sock_spin.gbps == 2 &&
             memcmp(&m.sock, &tune_measured.sock, sizeof m.sock) == 0,
         "socket_spin= not applied alone");
  EXPECT(tune_measured.sock_spin.lat_us < tune_measured.sock.lat_us,
         "a spinning engine's socket step should be the cheaper one");
  const char *bad[] = {"bad=1", "net=1:2:3:4", "reduce=0", "reduce=abc", "net", "shm=-1",
                       "copy=1:2", "net=1:2:0", "socket_spin=1:2:0"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    m = tune_measured;
    EXPECT(tune_parse_model(bad[i], &m, err, sizeof err) == -1, "model \"%s\" accepted", bad[i]);
  }
}

/* ------------------------------------------------------------------ decisions */
static const enum op_kind kinds[] = {OP_ALLREDUCE, OP_BROADCAST, OP_REDUCE, OP_ALLGATHER,
                                     OP_REDUCE_SCATTER, OP_GATHER, OP_SCATTER, OP_ALLTOALL,
                                     OP_BARRIER};
#define NKINDS (sizeof kinds / sizeof kinds[0])

static struct tune_topo topo(int n, int k, int shm) {
  struct tune_topo t = {n, (n + k - 1) / k, k, shm, 0};
  return t;
}

static uint32_t topo_mask(const struct tune_topo *t, enum op_kind k) {
  uint32_t m = 0;
  for (int id = 0; id < ALGO_COUNT; id++)
    if (tune_topo_ok(t, k, id)) m |= BIT(id);
  return m;
}

static uint64_t rng = 88172645463325252ull;
static uint32_t next_rand(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)rng;
}

static void test_decide_usable_deterministic(void) {
  const int ns[] = {1, 2, 3, 4, 5, 7, 8, 16, 17, 64, 100, 1000, 1024, 4095, 4096};
  const double sizes[] = {0, 1, 8, 1000, 65536, 1 << 20, 3e7, 1 << 30, 1e12};
  struct tune_force none;
  for (int k = 0; k < OP_KIND_COUNT; k++) none.allow[k] = 0, none.force[k] = -1;
  int bad = 0;
  for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
    for (int kk = 1; kk <= ns[a] && kk <= 16; kk = kk * 2 + (kk == 1 ? 0 : 1)) {
      for (int shm = 0; shm <= 1; shm++) {
        struct tune_topo t = topo(ns[a], kk, shm);
        for (size_t q = 0; q < NKINDS; q++)
          for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            uint32_t usable = topo_mask(&t, kinds[q]) & (next_rand() | BIT(ALGO_DIRECT));
            if (next_rand() % 8 == 0) usable &= next_rand(); /* sometimes even without direct */
            struct tune_pick p1 = tune_decide(&tune_measured, &t, kinds[q], sizes[s], usable, &none);
            struct tune_pick p2 = tune_decide(&tune_measured, &t, kinds[q], sizes[s], usable, &none);
            int ok = p1.id == p2.id && p1.us == p2.us &&
                     (usable ? (usable & BIT(p1.id)) != 0 : p1.id == ALGO_DIRECT);
            /* the choice is the cheapest: the first of the ranking */
            int ids[ALGO_COUNT];
            double costs[ALGO_COUNT];
            int n = tune_rank(&tune_measured, &t, kinds[q], sizes[s], usable, ids, costs, ALGO_COUNT);
            if (usable) ok = ok && n > 0 && ids[0] == p1.id;
            for (int i = 1; i < n; i++)
              if (costs[i] >= 0 && (costs[i - 1] < 0 || costs[i] < costs[i - 1])) ok = 0;
            if (!ok && bad++ < 5)
              fprintf(stderr, "n=%d k=%d shm=%d %s %.0f: usable %#x chose %d/%d\n", ns[a], kk,
                      shm, op_kind_name(kinds[q]), sizes[s], usable, p1.id, p2.id);
            checks++;
          }
      }
    }
  failures += bad;
  /* forcing: a usable forced id wins, an unusable one falls back and says so */
  struct tune_topo t = topo(64, 8, 1);
  struct tune_force f = none;
  f.force[OP_ALLREDUCE] = ALGO_RING;
  f.allow[OP_ALLREDUCE] = BIT(ALGO_RING);
  struct tune_pick p = tune_decide(&tune_measured, &t, OP_ALLREDUCE, 8, ALL, &f);
  EXPECT(p.id == ALGO_RING && p.forced && !p.fell_back, "forced ring not chosen");
  p = tune_decide(&tune_measured, &t, OP_ALLREDUCE, 8, BIT(ALGO_DIRECT), &f);
  EXPECT(p.id == ALGO_DIRECT && !p.forced && p.fell_back, "unusable forced ring not refused");
  f.force[OP_ALLREDUCE] = -1;
  f.allow[OP_ALLREDUCE] = BIT(ALGO_RING) | BIT(ALGO_TREE);
  p = tune_decide(&tune_measured, &t, OP_ALLREDUCE, 8, ALL, &f);
  EXPECT((p.id == ALGO_RING || p.id == ALGO_TREE) && !p.forced, "allowed set ignored: %d", p.id);
}

/* With every algorithm the topology allows (what the tuner picks once all are built). */
static int best(int n, int k, int shm, enum op_kind kind, double bytes) {
  struct tune_topo t = topo(n, k, shm);
  return tune_decide(&tune_measured, &t, kind, bytes, topo_mask(&t, kind), NULL).id;
}

static int in_set(int id, uint32_t set) { return (set & BIT(id)) != 0; }

static void test_model_sensible(void) {
  const uint32_t latency = BIT(ALGO_RD) | BIT(ALGO_TREE) | BIT(ALGO_HIER) | BIT(ALGO_BRUCK) |
                           BIT(ALGO_RHD) | BIT(ALGO_ONESHOT) | BIT(ALGO_DIRECT);
  const uint32_t bandwidth = BIT(ALGO_RING) | BIT(ALGO_RHD) | BIT(ALGO_TWOSHOT) |
                             BIT(ALGO_HIER) | BIT(ALGO_TREE) | BIT(ALGO_PAIRWISE);
  /* many hosts: small all-reduce avoids O(n) steps; huge one avoids moving n x bytes */
  int s = best(4096, 8, 1, OP_ALLREDUCE, 8), l = best(4096, 8, 1, OP_ALLREDUCE, 1 << 30);
  EXPECT(in_set(s, latency) && s != ALGO_DIRECT && s != ALGO_RING,
         "4096x8 all_reduce 8 B chose %s", algo_name(s));
  EXPECT(in_set(l, bandwidth) && l != ALGO_RD, "4096x8 all_reduce 1 GiB chose %s", algo_name(l));
  /* one host with shm: small all-reduce takes the one-sync path, large one not oneshot */
  s = best(8, 8, 1, OP_ALLREDUCE, 64);
  l = best(8, 8, 1, OP_ALLREDUCE, 256 << 20);
  EXPECT(s == ALGO_ONESHOT, "8 ranks one host all_reduce 64 B chose %s", algo_name(s));
  EXPECT(l != ALGO_ONESHOT && in_set(l, bandwidth), "8 ranks 256 MiB chose %s", algo_name(l));
  /* without shm oneshot/twoshot never appear */
  for (double b = 1; b <= (1 << 30); b *= 8) {
    int id = best(8, 8, 0, OP_ALLREDUCE, b);
    EXPECT(id != ALGO_ONESHOT && id != ALGO_TWOSHOT, "no shm but %s", algo_name(id));
  }
  /* Spinning engines (the 16-core host, 4 ranks over sockets): a 32 KB broadcast takes the
   * ring, measured twice as fast there as direct; without spinning (the 2-core host) direct
   * stays. Spinning changes nothing where no socket link on one host is involved: with shm,
   * or between hosts (the hierarchy's phases inside a host excepted). */
  struct tune_topo st = topo(4, 4, 0), ss = st;
  ss.spin = 1;
  EXPECT(tune_decide(&tune_measured, &st, OP_BROADCAST, 32768, topo_mask(&st, OP_BROADCAST),
                     NULL).id == ALGO_DIRECT,
         "4 ranks socket broadcast 32 KB without spinning: not direct");
  EXPECT(tune_decide(&tune_measured, &ss, OP_BROADCAST, 32768, topo_mask(&ss, OP_BROADCAST),
                     NULL).id == ALGO_RING,
         "4 ranks socket broadcast 32 KB with spinning engines: not the ring");
  EXPECT(tune_cost(&tune_measured, &ss, OP_ALLREDUCE, ALGO_RD, 8) <
             tune_cost(&tune_measured, &st, OP_ALLREDUCE, ALGO_RD, 8),
         "spinning did not make socket steps cheaper");
  const int shapes[][3] = {{4, 4, 1}, {8, 8, 1}, {16, 4, 0}, {64, 8, 1}, {8, 1, 0}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    struct tune_topo a = topo(shapes[i][0], shapes[i][1], shapes[i][2]), b = a;
    b.spin = 1;
    for (size_t q = 0; q < NKINDS; q++)
      for (int id = 0; id < ALGO_COUNT; id++)
        for (double x = 1; x <= (1 << 30); x *= 32)
          if (tune_topo_ok(&a, kinds[q], id) && !(id == ALGO_HIER && !a.shm))
            EXPECT(tune_cost(&tune_measured, &a, kinds[q], id, x) ==
                       tune_cost(&tune_measured, &b, kinds[q], id, x),
                   "n=%d k=%d shm=%d %s %s: spin changed the cost", shapes[i][0], shapes[i][1],
                   shapes[i][2], algo_name(id), op_kind_name(kinds[q]));
  }
  /* barrier on many ranks: logarithmic */
  s = best(4096, 8, 1, OP_BARRIER, 0);
  EXPECT(s != ALGO_DIRECT, "4096-rank barrier chose direct");
  /* all_gather: small many ranks logarithmic, large a bandwidth one */
  s = best(1024, 1, 0, OP_ALLGATHER, 1024);
  l = best(1024, 1, 0, OP_ALLGATHER, 1 << 30);
  EXPECT(s == ALGO_BRUCK || s == ALGO_RD, "1024 hosts all_gather 1 KiB chose %s", algo_name(s));
  EXPECT(l == ALGO_RING || l == ALGO_RD || l == ALGO_BRUCK || l == ALGO_PAIRWISE,
         "1024 hosts all_gather 1 GiB chose %s", algo_name(l));

  /* every algorithm's prediction grows with the size and with the rank count */
  int bad = 0;
  for (size_t q = 0; q < NKINDS; q++)
    for (int id = 0; id < ALGO_COUNT; id++) {
      const int ns[] = {2, 3, 8, 64, 512, 4096};
      for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
        struct tune_topo t = topo(ns[a], ns[a] >= 8 ? 8 : ns[a], 1);
        if (!tune_topo_ok(&t, kinds[q], id)) continue;
        double prev = -1;
        for (double b = 0; b <= 4e9; b = b ? b * 4 : 1) {
          double c = tune_cost(&tune_measured, &t, kinds[q], id, b);
          if (c < 0) break;
          if (c < prev && bad++ < 5)
            fprintf(stderr, "%s %s n=%d: cost falls from %g to %g at %.0f B\n", algo_name(id),
                    op_kind_name(kinds[q]), ns[a], prev, c, b);
          prev = c;
          checks++;
        }
      }
    }
  failures += bad;
}

/* ------------------------------------------------------------------ plan vs algo_select */
/* A communicator as comm_init leaves it, without transports: ranks fill hosts of k in
 * order. shm is NULL, so one-host shm shapes are not representable (a real communicator
 * is needed there; the pytest checks that case against the INFO log). */
struct fake {
  struct chorus_comm comm;
  size_t *counts;
};

static void fake_init(struct fake *f, int n, int k, int shm_ok) {
  memset(f, 0, sizeof *f);
  struct chorus_comm *c = &f->comm;
  c->rank = 0;
  c->nranks = n;
  c->peers = calloc((size_t)n, sizeof *c->peers);
  c->host_of = calloc((size_t)n, sizeof(int));
  c->local_rank_of = calloc((size_t)n, sizeof(int));
  f->counts = calloc((size_t)n, sizeof(size_t));
  if (!c->peers || !c->host_of || !c->local_rank_of || !f->counts) exit(2);
  for (int r = 0; r < n; r++) {
    c->peers[r].shm_ok = shm_ok;
    c->host_of[r] = r / k;
    c->local_rank_of[r] = r < k ? r : -1;
  }
  c->nlocal = k < n ? k : n;
  c->nhosts = (n + k - 1) / k;
  c->max_per_host = k < n ? k : n;
  pthread_mutex_init(&c->err_mu, NULL);
}

static void fake_free(struct fake *f) {
  tune_fini(&f->comm);
  pthread_mutex_destroy(&f->comm.err_mu);
  free(f->comm.peers);
  free(f->comm.host_of);
  free(f->comm.local_rank_of);
  free(f->counts);
}

/* An op of `bytes` (the plan's convention) for kind on a comm of n ranks. */
static size_t op_displs[4096], op_counts2[4096];

static void make_op(struct op *op, enum op_kind kind, size_t bytes, int n, size_t *counts) {
  memset(op, 0, sizeof *op);
  op->kind = kind;
  op->dtype = CHORUS_UINT8;
  op->op.kind = CHORUS_SUM;
  op->count = bytes;
  size_t per = bytes / (size_t)n;
  if (kind == OP_GATHER || kind == OP_SCATTER) op->count = per;
  if (kind == OP_ALLGATHER || kind == OP_REDUCE_SCATTER || kind == OP_ALLTOALL) {
    for (int p = 0; p < n; p++) {
      counts[p] = op_counts2[p] = per;
      op_displs[p] = per * (size_t)p; /* packed, as the API builds them */
    }
    op->count = kind == OP_ALLTOALL ? 0 : per * (size_t)n;
    op->counts = counts;
    op->displs = op_displs;
    if (kind == OP_ALLTOALL) {
      op->counts2 = op_counts2;
      op->displs2 = op_displs;
    }
    op->uniform = 1;
  }
  if (kind == OP_BARRIER) op->count = 0;
}

static void test_plan_matches_select(void) {
  setenv("CHORUS_ALGO", "", 1);
  setenv("CHORUS_DEBUG", "WARN", 1);
  param_reset_cache();
  /* n, k, shm, and whether every engine spins */
  const int shapes[][4] = {{2, 1, 1, 0},    {3, 1, 0, 0},    {4, 2, 1, 0},    {4, 4, 0, 0},
                           {4, 4, 0, 1},    {8, 3, 1, 1},    {16, 4, 1, 0},   {16, 16, 0, 0},
                           {16, 16, 0, 1},  {100, 8, 1, 0},  {1000, 7, 1, 0}, {4096, 8, 1, 1},
                           {4096, 1, 0, 0}, {4096, 4096, 0, 0}, {4096, 4096, 0, 1}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    int n = shapes[i][0], k = shapes[i][1], shm = shapes[i][2], spin = shapes[i][3];
    if (n / k <= 1 && shm) continue; /* needs a real shm communicator */
    struct fake f;
    fake_init(&f, n, k, shm);
    f.comm.all_spin = spin;
    EXPECT(tune_init(&f.comm) == CHORUS_SUCCESS, "tune_init: %s", f.comm.errbuf);
    chorus_tune_topology_t tt = {n, k, shm, spin};
    for (size_t q = 0; q < NKINDS; q++)
      for (size_t bytes = (size_t)n; bytes <= ((size_t)1 << 30); bytes *= 16) {
        struct op op;
        make_op(&op, kinds[q], bytes, n, f.counts);
        int id = algo_select(&f.comm, &op);
        chorus_tune_plan_t plan;
        chorus_result_t r = chorus_tune_plan(op_kind_name(kinds[q]), bytes, &tt, NULL, 0, &plan);
        EXPECT(r == CHORUS_SUCCESS, "plan failed: %s", chorus_comm_error(NULL));
        EXPECT(strcmp(plan.algo, algo_name(id)) == 0 && algo_usable(&f.comm, &op, id) &&
                   plan.spin == spin,
               "n=%d k=%d shm=%d spin=%d %s %zu B: algo_select %s, plan %s", n, k, shm, spin,
               op_kind_name(kinds[q]), bytes, algo_name(id), plan.algo);
        EXPECT(plan.ncandidates > 0 && strcmp(plan.candidates[0].algo, plan.algo) == 0,
               "plan's first candidate is not its choice");
      }
    fake_free(&f);
  }
}

static void test_plan_api(void) {
  chorus_tune_topology_t tt = {4096, 8, 1, 0};
  chorus_tune_plan_t plan;
  EXPECT(chorus_tune_plan("all_reduce", 1 << 20, &tt, "", CHORUS_TUNE_UNIMPLEMENTED, &plan) ==
                 CHORUS_SUCCESS &&
             plan.nhosts == 512 && plan.ncandidates >= 5 && plan.predicted_us > 0,
         "4096x8 plan: %s", chorus_comm_error(NULL));
  for (int i = 1; i < plan.ncandidates; i++)
    EXPECT(plan.candidates[i].predicted_us < 0 ||
               plan.candidates[i].predicted_us >= plan.candidates[i - 1].predicted_us,
           "candidates not sorted");
  EXPECT(chorus_tune_plan("AllReduce", 8, &tt, "allreduce:rd", CHORUS_TUNE_UNIMPLEMENTED, &plan) ==
                 CHORUS_SUCCESS &&
             strcmp(plan.algo, "rd") == 0 && plan.forced,
         "override not honoured: %s", plan.algo);
  /* only what this build implements without the flag: direct at least */
  EXPECT(chorus_tune_plan("barrier", 0, &tt, "", 0, &plan) == CHORUS_SUCCESS &&
             plan.candidates[0].implemented,
         "plan without flag");
  /* the remainder host: 10 ranks, 4 per host -> 3 hosts */
  chorus_tune_topology_t rem = {10, 4, 1, 0};
  EXPECT(chorus_tune_plan("broadcast", 100, &rem, "", 0, &plan) == CHORUS_SUCCESS &&
             plan.nhosts == 3,
         "remainder host: %d hosts", plan.nhosts);
  chorus_tune_topology_t one = {1, 1, 1, 0};
  EXPECT(chorus_tune_plan("all_gather", 1 << 20, &one, "", CHORUS_TUNE_UNIMPLEMENTED, &plan) ==
                 CHORUS_SUCCESS &&
             strcmp(plan.algo, "direct") == 0,
         "one rank: %s", plan.algo);
  struct {
    const char *coll;
    chorus_tune_topology_t t;
    const char *algo;
    const char *want;
  } bad[] = {{"all_reduce", {0, 1, 1, 0}, "", "nranks"},
             {"all_reduce", {4, 0, 1, 0}, "", "ranks_per_host"},
             {"all_reduce", {4, 8, 1, 0}, "", "ranks_per_host"},
             {"all_reduce", {4, 2, 2, 0}, "", "shm"},
             {"all_reduce", {4, 2, 1, 2}, "", "spin"},
             {"all_reduce", {4, 2, 1, -2}, "", "spin"},
             {"allreduse", {4, 2, 1, 0}, "", "allreduse"},
             {"send", {4, 2, 1, 0}, "", "send"},
             {"all_reduce", {4, 2, 1, 0}, "bogus", "bogus"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    chorus_result_t r = chorus_tune_plan(bad[i].coll, 8, &bad[i].t, bad[i].algo, 0, &plan);
    EXPECT(r == CHORUS_ERR_INVALID && strstr(chorus_comm_error(NULL), bad[i].want),
           "bad plan %zu: %d \"%s\"", i, (int)r, chorus_comm_error(NULL));
  }
}

/* spin -1: as ranks_per_host ranks on this machine would, CHORUS_SPIN_COUNT first */
static void test_plan_spin_auto(void) {
  chorus_tune_plan_t plan;
  const char *want[] = {"0", "5"};
  for (int i = 0; i < 2; i++) {
    setenv("CHORUS_SPIN_COUNT", want[i], 1);
    param_reset_cache();
    chorus_tune_topology_t t = {4, 4, 0, -1};
    EXPECT(chorus_tune_plan("broadcast", 32768, &t, "", 0, &plan) == CHORUS_SUCCESS &&
               plan.spin == i,
           "CHORUS_SPIN_COUNT=%s: plan.spin %d", want[i], plan.spin);
  }
  /* automatic: spins where this process has two cores per rank */
  unsetenv("CHORUS_SPIN_COUNT");
  param_reset_cache();
  long cores = cores_usable();
  for (int k = 1; k <= 64; k *= 4) {
    chorus_tune_topology_t t = {k, k, 0, -1};
    EXPECT(chorus_tune_plan("broadcast", 32768, &t, "", 0, &plan) == CHORUS_SUCCESS &&
               plan.spin == (2L * k <= cores),
           "%d ranks on %ld cores: plan.spin %d", k, cores, plan.spin);
  }
}

/* One host with more ranks than the direct-access algorithms serve (shm_direct_ok refuses
 * them at run time): the plan must not offer oneshot or twoshot there, while one rank fewer
 * than the cap it still may. */
/* Whether the plan of n ranks on one host offers, or chooses, oneshot or twoshot for any
 * collective and size. */
static void plan_direct(int n, int *offered, int *chosen) {
  chorus_tune_plan_t plan;
  chorus_tune_topology_t t = {n, n, 1, 0};
  *offered = *chosen = 0;
  for (size_t q = 0; q < NKINDS; q++)
    for (size_t bytes = 8; bytes <= ((size_t)1 << 30); bytes *= 32) {
      EXPECT(chorus_tune_plan(op_kind_name(kinds[q]), bytes, &t, "", CHORUS_TUNE_UNIMPLEMENTED,
                              &plan) == CHORUS_SUCCESS,
             "plan %d ranks: %s", n, chorus_comm_error(NULL));
      for (int c = 0; c < plan.ncandidates; c++)
        if (!strcmp(plan.candidates[c].algo, "oneshot") ||
            !strcmp(plan.candidates[c].algo, "twoshot"))
          *offered = 1;
      if (!strcmp(plan.algo, "oneshot") || !strcmp(plan.algo, "twoshot")) *chosen = 1;
    }
}

static void test_plan_direct_cap(void) {
  const int ns[2] = {CHORUS_MAX_LOCAL_DIRECT, CHORUS_MAX_LOCAL_DIRECT + 1};
  for (int i = 0; i < 2; i++) {
    int offered, chosen;
    plan_direct(ns[i], &offered, &chosen);
    if (i == 1)
      EXPECT(!chosen, "%d ranks on one host: the plan chose oneshot/twoshot, which cannot run "
             "there", ns[i]);
    EXPECT(offered == (i == 0), "%d ranks on one host: oneshot/twoshot %soffered", ns[i],
           offered ? "" : "not ");
  }
}

/* The plan reads CHORUS_SHM_SCRATCH as a segment would: a scratch half under 4 KiB (0) or
 * under 64 bytes a rank makes the run refuse oneshot and twoshot (shm_direct_ok), so the plan
 * must not offer them either. */
static void test_plan_scratch(void) {
  const struct {
    const char *scratch;
    int n, usable;
  } cases[] = {{NULL, 8, 1},   {"0", 8, 0},    {"0", 2, 0},    {"8K", 8, 1},  {"8K", 64, 1},
               {"8K", 65, 0},  {"16K", 65, 1}, {"16K", 129, 0}, {"6K", 64, 1}, {"1", 2, 1}};
  /* (a segment rounds its scratch up to two pages: 6K and 1 byte give 4 KiB halves) */
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    if (cases[i].scratch) setenv("CHORUS_SHM_SCRATCH", cases[i].scratch, 1);
    else unsetenv("CHORUS_SHM_SCRATCH");
    param_reset_cache();
    EXPECT(shm_direct_scratch_ok((size_t)(shm_scratch_bytes() / 2), cases[i].n) ==
               cases[i].usable,
           "CHORUS_SHM_SCRATCH=%s, %d ranks: scratch check says %d", cases[i].scratch,
           cases[i].n, !cases[i].usable);
    int offered, chosen;
    plan_direct(cases[i].n, &offered, &chosen);
    EXPECT(offered == cases[i].usable && (cases[i].usable || !chosen),
           "CHORUS_SHM_SCRATCH=%s, %d ranks on one host: oneshot/twoshot offered %d, chosen %d",
           cases[i].scratch ? cases[i].scratch : "(default)", cases[i].n, offered, chosen);
  }
  unsetenv("CHORUS_SHM_SCRATCH");
  param_reset_cache();
}

/* CHORUS_ALGO / NCCL_ALGO at communicator creation, and forced algorithms at run time. */
static void test_comm_env(void) {
  struct fake f;
  setenv("CHORUS_DEBUG", "NONE", 1); /* the expected WARNs would clutter the output */
  setenv("CHORUS_ALGO", "allreduce:bogus", 1);
  param_reset_cache();
  fake_init(&f, 8, 4, 1);
  EXPECT(tune_init(&f.comm) == CHORUS_ERR_INVALID && strstr(f.comm.errbuf, "CHORUS_ALGO") &&
             strstr(f.comm.errbuf, "\"bogus\"") && strstr(f.comm.errbuf, "valid: direct"),
         "bogus CHORUS_ALGO: \"%s\"", f.comm.errbuf);
  fake_free(&f);

  unsetenv("CHORUS_ALGO");
  setenv("NCCL_ALGO", "Tree", 1);
  param_reset_cache();
  fake_init(&f, 8, 4, 1);
  EXPECT(tune_init(&f.comm) == CHORUS_SUCCESS && f.comm.algo_force[OP_ALLREDUCE] == ALGO_TREE,
         "NCCL_ALGO=Tree not honoured");
  /* tree may not be built: then the choice falls back to a usable one */
  struct op op;
  make_op(&op, OP_ALLREDUCE, 1 << 20, 8, f.counts);
  int id = algo_select(&f.comm, &op);
  EXPECT(algo_usable(&f.comm, &op, id) &&
             (id == ALGO_TREE) == (algo_table[ALGO_TREE].run[OP_ALLREDUCE] != NULL),
         "forced tree: chose %s", algo_name(id));
  fake_free(&f);

  /* direct forced for an all_gatherv (unequal counts): allowed */
  setenv("CHORUS_ALGO", "direct", 1);
  param_reset_cache();
  fake_init(&f, 8, 4, 1);
  EXPECT(tune_init(&f.comm) == CHORUS_SUCCESS, "direct");
  make_op(&op, OP_ALLGATHER, 800, 8, f.counts);
  f.counts[3] = 7;
  EXPECT(algo_select(&f.comm, &op) == ALGO_DIRECT, "all_gatherv forced direct");
  /* all_gatherv (one count changed, so the displacements are no longer packed): ring and
   * bruck take it too; rhd and rd need packed blocks; oneshot would if this fake
   * communicator had shared memory; the rest have no all-gather. */
  for (int x = 1; x < ALGO_COUNT; x++) {
    int want = x == ALGO_RING || x == ALGO_BRUCK;
    EXPECT(algo_usable(&f.comm, &op, x) == want, "%s %s the all_gatherv", algo_name(x),
           want ? "refuses" : "accepts");
  }
  op.counts = NULL;
  fake_free(&f);

  /* fp16/bf16 sums and products on more than two ranks: only schedules that round once */
  unsetenv("CHORUS_ALGO");
  param_reset_cache();
  for (int nr = 2; nr <= 8; nr += 6) {
    fake_init(&f, nr, nr, 0);
    EXPECT(tune_init(&f.comm) == CHORUS_SUCCESS, "plain comm");
    const chorus_dtype_t halves[2] = {CHORUS_FLOAT16, CHORUS_BFLOAT16};
    const chorus_op_kind_t rops[5] = {CHORUS_SUM, CHORUS_AVG, CHORUS_PREMUL_SUM, CHORUS_PROD,
                                      CHORUS_MAX};
    const enum op_kind ks[3] = {OP_ALLREDUCE, OP_REDUCE, OP_REDUCE_SCATTER};
    for (int h = 0; h < 2; h++)
      for (int q = 0; q < 5; q++)
        for (int kk = 0; kk < 3; kk++) {
          make_op(&op, ks[kk], 1 << 16, nr, f.counts);
          op.dtype = halves[h];
          op.op.kind = rops[q];
          int chosen = algo_select(&f.comm, &op);
          int once = chosen == ALGO_DIRECT || chosen == ALGO_ONESHOT || chosen == ALGO_TWOSHOT;
          EXPECT(nr == 2 || rops[q] == CHORUS_MAX || once,
                 "%d ranks %s %s %s: chose %s, which rounds in steps", nr,
                 chorus_dtype_name(halves[h]), chorus_op_name(rops[q]), op_kind_name(ks[kk]),
                 algo_name(chosen));
          for (int x = 0; x < ALGO_COUNT; x++) {
            if (!algo_table[x].run[ks[kk]]) continue;
            int single = x == ALGO_DIRECT || x == ALGO_ONESHOT || x == ALGO_TWOSHOT;
            if (nr > 2 && rops[q] != CHORUS_MAX && !single)
              EXPECT(!algo_usable(&f.comm, &op, x), "%s usable for %s %s on %d ranks",
                     algo_name(x), chorus_dtype_name(halves[h]), chorus_op_name(rops[q]), nr);
          }
          op.counts = NULL;
        }
    /* the same op in float32 may use a stepwise schedule */
    make_op(&op, OP_ALLREDUCE, 1 << 16, nr, f.counts);
    op.dtype = CHORUS_FLOAT32;
    EXPECT(algo_usable(&f.comm, &op, ALGO_RING), "ring refused for float32 on %d ranks", nr);
    fake_free(&f);
  }

  setenv("CHORUS_TUNE_MODEL", "net=1:2", 1);
  param_reset_cache();
  fake_init(&f, 8, 4, 1);
  EXPECT(tune_init(&f.comm) == CHORUS_SUCCESS, "partial net model: %s", f.comm.errbuf);
  fake_free(&f);
  setenv("CHORUS_TUNE_MODEL", "net=x", 1);
  param_reset_cache();
  fake_init(&f, 8, 4, 1);
  EXPECT(tune_init(&f.comm) == CHORUS_ERR_INVALID && strstr(f.comm.errbuf, "CHORUS_TUNE_MODEL"),
         "bad model accepted: %s", f.comm.errbuf);
  fake_free(&f);
  unsetenv("CHORUS_TUNE_MODEL");
  unsetenv("CHORUS_ALGO");
  unsetenv("NCCL_ALGO");
  param_reset_cache();
}

int main(void) {
  test_parse_algo();
  test_parse_model();
  test_decide_usable_deterministic();
  test_model_sensible();
  test_plan_matches_select();
  test_plan_api();
  test_plan_spin_auto();
  test_plan_direct_cap();
  test_plan_scratch();
  test_comm_env();
  printf("test_tune: %d checks, %d failed\n", checks, failures);
  return failures != 0;
}
