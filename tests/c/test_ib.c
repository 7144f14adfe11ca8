/* test_ib.c - the verbs transport: CHORUS_IB_HCA list matching; the ABI of ib_verbs.h against
 * rdma-core's <infiniband/verbs.h> where that header is installed; and end to end through the
 * test double tests/fakeverbs (libfakeverbs.so, built by the Makefile first): 4 forked ranks on
 * 2 simulated hosts (CHORUS_HOSTID) run collectives and point-to-point with values checked,
 * over IB with one QP and a ring small enough to wrap, and over RoCE with 2 QPs on 2 NICs;
 * an injected completion error fails both ranks promptly with the peer and the status named;
 * an unloadable library leaves the job on sockets. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "core.h"
#include "expect.h"
#include "free_port.h"
#include "transport/ib_gdr.h"
#include "transport/ib_verbs.h"

int ib_hca_matches(const char *spec, const char *dev, int port);
const char *ib_conn_nic(const conn_t *c, int qp, int *nqp);

/* The test double, built by the Makefile beside this program: <dir of the binary>/fakeverbs/ */
static char fake_path[4096];
static void find_fake(void) {
  char exe[3900];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) n = 0;
  exe[n] = 0;
  char *slash = strrchr(exe, '/');
  if (slash) *slash = 0;
  snprintf(fake_path, sizeof fake_path, "%s/fakeverbs/libfakeverbs.so", exe);
}

static int g_rank;

static void test_hca(void) {
  EXPECT(ib_hca_matches("", "mlx5_0", 1), "empty list takes all");
  EXPECT(ib_hca_matches("mlx5", "mlx5_0", 1), "prefix");
  EXPECT(ib_hca_matches("mlx5", "mlx5_10", 2), "prefix any port");
  EXPECT(!ib_hca_matches("mlx4", "mlx5_0", 1), "other prefix");
  EXPECT(ib_hca_matches("mlx5_0:1,mlx5_1", "mlx5_0", 1), "port given");
  EXPECT(!ib_hca_matches("mlx5_0:1,mlx5_1", "mlx5_0", 2), "other port");
  EXPECT(ib_hca_matches("mlx5_0:1,mlx5_1", "mlx5_1", 2), "second entry");
  EXPECT(ib_hca_matches("=mlx5_1", "mlx5_1", 1), "exact");
  EXPECT(!ib_hca_matches("=mlx5_1", "mlx5_10", 1), "exact is not a prefix");
  EXPECT(!ib_hca_matches("^mlx5_0", "mlx5_0", 1), "excluded");
  EXPECT(ib_hca_matches("^mlx5_0", "mlx4_0", 1), "not excluded");
  EXPECT(!ib_hca_matches("^=mlx5_1", "mlx5_1", 1), "exact exclusion");
  EXPECT(ib_hca_matches("^=mlx5_1", "mlx5_10", 1), "exact exclusion spares longer names");
  EXPECT(ib_hca_matches(" mlx5_0 : 1 , mlx5_1 ", "mlx5_0", 1), "blanks");
}

/* GPUDirect mode choice, with a made-up library table and /sys tree (no GPU here). */
static void *reg_mr_ptr;
static struct cv_mr stub_mr;
static struct cv_mr *stub_reg_mr(struct cv_pd *pd, void *addr, size_t len, int access) {
  (void)pd, (void)len, (void)access;
  reg_mr_ptr = addr;
  return &stub_mr;
}
static uint64_t dmabuf_args[3];
static struct cv_mr *stub_reg_dmabuf(struct cv_pd *pd, uint64_t off, size_t len, uint64_t iova,
                                     int fd, int access) {
  (void)pd, (void)access;
  dmabuf_args[0] = off, dmabuf_args[1] = iova, dmabuf_args[2] = (uint64_t)fd + len;
  return &stub_mr;
}
static void test_gdr(void) {
  struct ib_api api;
  memset(&api, 0, sizeof api);
  api.reg_mr = stub_reg_mr;
  char root[] = "/tmp/chorus-gdr-XXXXXX", buf[200], path[300];
  const char *why = "";
  EXPECT(mkdtemp(root) != NULL, "mkdtemp");
  EXPECT(ib_gdr_mode(&api, "", root, buf, sizeof buf, &why) == IB_GDR_OFF, "nothing: off");
  snprintf(path, sizeof path, "%s/sys", root);
  EXPECT(mkdir(path, 0700) == 0, "mkdir");
  snprintf(path, sizeof path, "%s/sys/module", root);
  EXPECT(mkdir(path, 0700) == 0, "mkdir");
  snprintf(path, sizeof path, "%s/sys/module/nvidia_peermem", root);
  EXPECT(mkdir(path, 0700) == 0, "mkdir");
  EXPECT(ib_gdr_mode(&api, "", root, buf, sizeof buf, &why) == IB_GDR_PEERMEM, "peermem: %s", why);
  EXPECT(ib_gdr_mode(&api, "SYS", root, buf, sizeof buf, &why) == IB_GDR_PEERMEM, "SYS allows");
  EXPECT(ib_gdr_mode(&api, "LOC", root, buf, sizeof buf, &why) == IB_GDR_OFF, "LOC forbids");
  EXPECT(ib_gdr_mode(&api, "bogus", root, buf, sizeof buf, &why) == IB_GDR_OFF &&
         strstr(why, "bogus"), "bad level named: %s", why);
  int dev;
  EXPECT(ib_reg_device_memory(&api, IB_GDR_PEERMEM, NULL, &dev, 64, -1, 0) == &stub_mr &&
         reg_mr_ptr == &dev, "peermem registers the device pointer itself");
  api.reg_dmabuf_mr = stub_reg_dmabuf;
  EXPECT(ib_gdr_mode(&api, "", root, buf, sizeof buf, &why) == IB_GDR_DMABUF, "dma-buf first");
  EXPECT(ib_reg_device_memory(&api, IB_GDR_DMABUF, NULL, &dev, 64, 9, 4096) == &stub_mr &&
         dmabuf_args[0] == 4096 && dmabuf_args[1] == (uint64_t)(uintptr_t)&dev &&
         dmabuf_args[2] == 9 + 64, "dma-buf registration arguments");
  EXPECT(ib_reg_device_memory(&api, IB_GDR_OFF, NULL, &dev, 64, 9, 0) == NULL, "off: refused");
  rmdir(path);
  snprintf(path, sizeof path, "%s/sys/module", root);
  rmdir(path);
  snprintf(path, sizeof path, "%s/sys", root);
  rmdir(path);
  rmdir(root);
}

#if defined(__has_include)
#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define HAVE_RDMA_CORE 1
#endif
#endif

static void test_abi(void) {
#ifdef HAVE_RDMA_CORE
#define SAME_SIZE(a, b) EXPECT(sizeof(struct a) == sizeof(struct b), "sizeof %s %zu vs %s %zu", #a, sizeof(struct a), #b, sizeof(struct b))
#define SAME_OFF(a, b, f) EXPECT(offsetof(struct a, f) == offsetof(struct b, f), "%s.%s at %zu vs %zu", #a, #f, offsetof(struct a, f), offsetof(struct b, f))
  SAME_SIZE(cv_context_ops, ibv_context_ops);
  SAME_OFF(cv_context_ops, ibv_context_ops, poll_cq);
  SAME_OFF(cv_context_ops, ibv_context_ops, post_send);
  SAME_OFF(cv_context_ops, ibv_context_ops, post_recv);
  SAME_SIZE(cv_context, ibv_context);
  SAME_OFF(cv_context, ibv_context, ops);
  SAME_SIZE(cv_pd, ibv_pd);
  SAME_SIZE(cv_mr, ibv_mr);
  SAME_OFF(cv_mr, ibv_mr, lkey);
  SAME_OFF(cv_mr, ibv_mr, rkey);
  SAME_SIZE(cv_cq, ibv_cq);
  SAME_SIZE(cv_qp, ibv_qp);
  SAME_OFF(cv_qp, ibv_qp, qp_num);
  SAME_OFF(cv_qp, ibv_qp, state);
  SAME_SIZE(cv_port_attr, ibv_port_attr);
  SAME_OFF(cv_port_attr, ibv_port_attr, lid);
  SAME_OFF(cv_port_attr, ibv_port_attr, active_mtu);
  SAME_OFF(cv_port_attr, ibv_port_attr, gid_tbl_len);
  SAME_OFF(cv_port_attr, ibv_port_attr, link_layer);
  SAME_OFF(cv_port_attr, ibv_port_attr, active_speed);
  SAME_SIZE(cv_gid_entry, ibv_gid_entry);
  SAME_OFF(cv_gid_entry, ibv_gid_entry, gid_type);
  SAME_SIZE(cv_wc, ibv_wc);
  SAME_OFF(cv_wc, ibv_wc, status);
  SAME_OFF(cv_wc, ibv_wc, vendor_err);
  SAME_OFF(cv_wc, ibv_wc, imm_data);
  SAME_OFF(cv_wc, ibv_wc, qp_num);
  SAME_OFF(cv_wc, ibv_wc, wc_flags);
  SAME_SIZE(cv_sge, ibv_sge);
  SAME_SIZE(cv_send_wr, ibv_send_wr);
  SAME_OFF(cv_send_wr, ibv_send_wr, opcode);
  SAME_OFF(cv_send_wr, ibv_send_wr, send_flags);
  SAME_OFF(cv_send_wr, ibv_send_wr, imm_data);
  SAME_OFF(cv_send_wr, ibv_send_wr, wr.rdma.remote_addr);
  SAME_OFF(cv_send_wr, ibv_send_wr, wr.rdma.rkey);
  SAME_SIZE(cv_recv_wr, ibv_recv_wr);
  SAME_SIZE(cv_qp_init_attr, ibv_qp_init_attr);
  SAME_OFF(cv_qp_init_attr, ibv_qp_init_attr, cap);
  SAME_OFF(cv_qp_init_attr, ibv_qp_init_attr, qp_type);
  SAME_SIZE(cv_qp_attr, ibv_qp_attr);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, dest_qp_num);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, ah_attr);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, ah_attr.grh.sgid_index);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, ah_attr.grh.traffic_class);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, ah_attr.dlid);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, ah_attr.is_global);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, pkey_index);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, port_num);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, timeout);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, retry_cnt);
  SAME_OFF(cv_qp_attr, ibv_qp_attr, rnr_retry);
#define SAME_VAL(a, b) EXPECT((long)(a) == (long)(b), "%s %ld vs %s %ld", #a, (long)(a), #b, (long)(b))
  SAME_VAL(CV_WC_RETRY_EXC_ERR, IBV_WC_RETRY_EXC_ERR);
  SAME_VAL(CV_WC_REM_ACCESS_ERR, IBV_WC_REM_ACCESS_ERR);
  SAME_VAL(CV_WC_RECV_RDMA_WITH_IMM, IBV_WC_RECV_RDMA_WITH_IMM);
  SAME_VAL(CV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE);
  SAME_VAL(CV_WC_WITH_IMM, IBV_WC_WITH_IMM);
  SAME_VAL(CV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE);
  SAME_VAL(CV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM);
  SAME_VAL(CV_SEND_SIGNALED, IBV_SEND_SIGNALED);
  SAME_VAL(CV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_WRITE);
  SAME_VAL(CV_QPT_RC, IBV_QPT_RC);
  SAME_VAL(CV_QP_MIN_RNR_TIMER, IBV_QP_MIN_RNR_TIMER);
  SAME_VAL(CV_QP_DEST_QPN, IBV_QP_DEST_QPN);
  SAME_VAL(CV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_MAX_DEST_RD_ATOMIC);
  SAME_VAL(CV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MAX_QP_RD_ATOMIC);
  SAME_VAL(CV_QP_SQ_PSN, IBV_QP_SQ_PSN);
  SAME_VAL(CV_QP_AV, IBV_QP_AV);
  SAME_VAL(CV_QPS_RTS, IBV_QPS_RTS);
  SAME_VAL(CV_QPS_ERR, IBV_QPS_ERR);
  SAME_VAL(CV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_ETHERNET);
  SAME_VAL(CV_PORT_ACTIVE, IBV_PORT_ACTIVE);
  SAME_VAL(CV_GID_TYPE_ROCE_V2, IBV_GID_TYPE_ROCE_V2);
  printf("ABI checked against <infiniband/verbs.h>\n");
#else
  printf("ABI check skipped: <infiniband/verbs.h> not installed (apt-get install libibverbs-dev)\n");
#endif
}

/* ------------------------------------------------------------ end to end */
static chorus_result_t run_req(chorus_request_t *req, char *err, size_t cap) {
  chorus_result_t r = chorus_wait(req, -1);
  if (err) snprintf(err, cap, "%s", chorus_request_error(req));
  chorus_request_free(req);
  return r;
}

#define OK(call)                                                                        \
  do {                                                                                  \
    chorus_result_t r_ = (call);                                                        \
    if (r_ != CHORUS_SUCCESS) {                                                         \
      EXPECT(0, "rank %d: %s failed: %s", g_rank, #call, chorus_result_string(r_));     \
      return;                                                                           \
    }                                                                                   \
  } while (0)

static void check_collectives(chorus_comm_t *c, int n) {
  int me = chorus_comm_rank(c);
  chorus_request_t *req;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  size_t sizes[] = {0, 1, 7, 4099, 100000, 300000};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    size_t count = sizes[s];
    float *in = malloc((count + 1) * sizeof(float)), *out = malloc((count + 1) * sizeof(float));
    for (size_t i = 0; i < count; i++) in[i] = (float)(me + 1) * (float)(i % 97), out[i] = -1.f;
    OK(chorus_iallreduce(c, in, out, count, CHORUS_FLOAT32, sum, &req));
    OK(run_req(req, NULL, 0));
    float f = (float)(n * (n + 1) / 2);
    for (size_t i = 0; i < count; i++)
      if (out[i] != f * (float)(i % 97)) {
        EXPECT(0, "rank %d allreduce %zu: [%zu] = %g, expected %g", me, count, i, out[i],
               f * (float)(i % 97));
        break;
      }
    free(in);
    free(out);
  }
  size_t count = 70000;
  int64_t *b = malloc(count * sizeof *b);
  for (size_t i = 0; i < count; i++) b[i] = me == n - 1 ? (int64_t)i * 3 : -1;
  OK(chorus_ibroadcast(c, b, count, CHORUS_INT64, n - 1, &req));
  OK(run_req(req, NULL, 0));
  for (size_t i = 0; i < count; i++)
    if (b[i] != (int64_t)i * 3) {
      EXPECT(0, "rank %d broadcast [%zu] = %lld", me, i, (long long)b[i]);
      break;
    }
  free(b);
  int32_t *mine = malloc(5000 * sizeof *mine), *all = malloc((size_t)n * 5000 * sizeof *all);
  for (int i = 0; i < 5000; i++) mine[i] = me * 100000 + i;
  OK(chorus_iallgather(c, mine, all, 5000, CHORUS_INT32, &req));
  OK(run_req(req, NULL, 0));
  for (int r = 0; r < n; r++)
    for (int i = 0; i < 5000; i++)
      if (all[r * 5000 + i] != r * 100000 + i) {
        EXPECT(0, "rank %d allgather [%d][%d]", me, r, i);
        r = n;
        break;
      }
  free(mine);
  free(all);
  double *rs_in = malloc((size_t)n * 3000 * sizeof(double)), *rs_out = malloc(3000 * sizeof(double));
  for (int i = 0; i < n * 3000; i++) rs_in[i] = i + me;
  OK(chorus_ireduce_scatter(c, rs_in, rs_out, 3000, CHORUS_FLOAT64, sum, &req));
  OK(run_req(req, NULL, 0));
  for (int i = 0; i < 3000; i++) {
    double e = 0;
    for (int r = 0; r < n; r++) e += me * 3000 + i + r;
    if (rs_out[i] != e) {
      EXPECT(0, "rank %d reduce_scatter [%d] = %g expected %g", me, i, rs_out[i], e);
      break;
    }
  }
  free(rs_in);
  free(rs_out);
  int32_t *a_in = malloc((size_t)n * 2000 * sizeof(int32_t)), *a_out = malloc((size_t)n * 2000 * sizeof(int32_t));
  for (int p = 0; p < n; p++)
    for (int i = 0; i < 2000; i++) a_in[p * 2000 + i] = me * 1000000 + p * 10000 + i;
  OK(chorus_ialltoall(c, a_in, a_out, 2000, CHORUS_INT32, &req));
  OK(run_req(req, NULL, 0));
  for (int p = 0; p < n; p++)
    for (int i = 0; i < 2000; i++)
      if (a_out[p * 2000 + i] != p * 1000000 + me * 10000 + i) {
        EXPECT(0, "rank %d alltoall from %d [%d]", me, p, i);
        p = n;
        break;
      }
  free(a_in);
  free(a_out);
  if (n > 1) { /* a ring of sends posted before the receives, bigger than the rings */
    size_t big = 300000;
    uint8_t *sb = malloc(big), *rb = malloc(big);
    for (size_t i = 0; i < big; i++) sb[i] = (uint8_t)(i * 7 + (size_t)me);
    chorus_request_t *rs, *rr;
    int to = (me + 1) % n, from = (me + n - 1) % n;
    OK(chorus_isend(c, sb, big, CHORUS_UINT8, to, 7, &rs));
    OK(chorus_irecv(c, rb, big, CHORUS_UINT8, from, 7, &rr));
    OK(run_req(rs, NULL, 0));
    OK(run_req(rr, NULL, 0));
    for (size_t i = 0; i < big; i++)
      if (rb[i] != (uint8_t)(i * 7 + (size_t)from)) {
        EXPECT(0, "rank %d recv byte %zu", me, i);
        break;
      }
    free(sb);
    free(rb);
  }
  OK(chorus_ibarrier(c, &req));
  OK(run_req(req, NULL, 0));
}

void ib_sent_bytes(const struct chorus_comm *comm, uint64_t *zero_copy, uint64_t *ring);
uint64_t ib_received_direct_bytes(const struct chorus_comm *comm);

/* Registered buffers (chorus_comm_register): sends from them over verbs go without a copy
 * (remote "verbs": bytes counted as zero-copy on the ranks whose peer across hosts reads
 * from them; "socket": nothing is), results stay right, the buffer may be rewritten as soon
 * as an op completes (the double fails any send whose source changes before its
 * completion), and registrations are shared, counted and refused when unknown. */
static void check_registered(chorus_comm_t *c, int n, const char *remote) {
  int me = chorus_comm_rank(c);
  chorus_request_t *req;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  size_t count = 300000; /* 1.2 MB: several times the 64 KiB rings */
  float *buf = malloc(count * sizeof(float));
  void *h = NULL, *h2 = NULL, *h3 = NULL;
  uint64_t made0 = c->nregs_made, zc0, ring0, zc1, ring1;
  ib_sent_bytes(c, &zc0, &ring0);
  OK(chorus_comm_register(c, buf, count * sizeof(float), &h));
  OK(chorus_comm_register(c, buf + 1000, 4000 * sizeof(float), &h2)); /* inside: shared */
  EXPECT(h2 == h, "rank %d: a range inside a registration got a new one", me);
  EXPECT(c->nregs_made == made0 + 1, "rank %d: %llu registrations made for one buffer", me,
         (unsigned long long)(c->nregs_made - made0));
  for (int round = 0; round < 3; round++) {
    for (size_t i = 0; i < count; i++) buf[i] = (float)((me + 1) * (int)(i % 89) + round);
    OK(chorus_iallreduce(c, buf, buf, count, CHORUS_FLOAT32, sum, &req));
    OK(run_req(req, NULL, 0));
    float f = (float)(n * (n + 1) / 2);
    for (size_t i = 0; i < count; i++)
      if (buf[i] != f * (float)(i % 89) + (float)(n * round)) {
        EXPECT(0, "rank %d registered allreduce round %d: [%zu] = %g", me, round, i, buf[i]);
        break;
      }
    /* rewritten at once: a send still reading it would fail in the double */
    for (size_t i = 0; i < count; i++) buf[i] = me == round % n ? (float)i : -1.f;
    OK(chorus_ibroadcast(c, buf, count, CHORUS_FLOAT32, round % n, &req));
    OK(run_req(req, NULL, 0));
    for (size_t i = 0; i < count; i++)
      if (buf[i] != (float)i) {
        EXPECT(0, "rank %d registered broadcast from %d: [%zu] = %g", me, round % n, i, buf[i]);
        break;
      }
  }
  uint64_t rz0 = ib_received_direct_bytes(c);
  if (n > 1) { /* sends along the ring from the registered buffer into a registered one */
    float *rb = malloc(count * sizeof(float));
    void *hr = NULL;
    OK(chorus_comm_register(c, rb, count * sizeof(float), &hr));
    int to = (me + 1) % n, from = (me + n - 1) % n;
    for (int round = 0; round < 4; round++) {
      memset(rb, 0, count * sizeof(float));
      for (size_t i = 0; i < count; i++) buf[i] = (float)(me * 7 + round) + (float)(i % 1000);
      chorus_request_t *rs, *rr;
      OK(chorus_isend(c, buf, count, CHORUS_FLOAT32, to, 9, &rs));
      OK(chorus_irecv(c, rb, count, CHORUS_FLOAT32, from, 9, &rr));
      OK(run_req(rs, NULL, 0));
      memset(buf, 0xff, count * sizeof(float)); /* the send completed: free to reuse */
      OK(run_req(rr, NULL, 0));
      for (size_t i = 0; i < count; i++)
        if (rb[i] != (float)(from * 7 + round) + (float)(i % 1000)) {
          EXPECT(0, "rank %d registered recv from %d round %d: [%zu] = %g", me, from, round, i,
                 rb[i]);
          break;
        }
    }
    /* deregistered while the send may still be in flight: the send keeps its pages */
    void *hs = NULL;
    for (size_t i = 0; i < count; i++) rb[i] = (float)(me * 3) + (float)(i % 500);
    chorus_request_t *rs, *rr;
    float *in = malloc(count * sizeof(float));
    OK(chorus_comm_register(c, rb, count * sizeof(float), &hs));
    OK(chorus_isend(c, rb, count, CHORUS_FLOAT32, to, 11, &rs));
    OK(chorus_comm_deregister(c, hs));
    OK(chorus_comm_deregister(c, hr));
    OK(chorus_irecv(c, in, count, CHORUS_FLOAT32, from, 11, &rr));
    OK(run_req(rs, NULL, 0));
    OK(run_req(rr, NULL, 0));
    for (size_t i = 0; i < count; i++)
      if (in[i] != (float)(from * 3) + (float)(i % 500)) {
        EXPECT(0, "rank %d recv after deregistering: [%zu] = %g", me, i, in[i]);
        break;
      }
    free(in);
    free(rb);
  }
  uint64_t rz1 = ib_received_direct_bytes(c);
  ib_sent_bytes(c, &zc1, &ring1);
  /* ranks 1 and 3 send to the other simulated host from the buffer (1 -> 2, 3 -> 0) */
  int crosses = c->host_of[(me + 1) % n] != c->host_of[me];
  if (strcmp(remote, "verbs") == 0 && crosses)
    EXPECT(zc1 - zc0 >= 4 * count * sizeof(float), "rank %d: only %llu bytes went zero-copy",
           me, (unsigned long long)(zc1 - zc0));
  /* ranks 2 and 0 receive from the other host into rb: what the sender has not posted when
   * the request arrives goes straight into rb. With 64 KiB rings the sender stalls after
   * 64 KiB of the 1.2 MB; rings bigger than the message take it all before the request. */
  const char *ring = getenv("CHORUS_BUFFSIZE");
  if (strcmp(remote, "verbs") == 0 && c->host_of[(me + n - 1) % n] != c->host_of[me] && ring &&
      strcmp(ring, "64K") == 0)
    EXPECT(rz1 - rz0 > 0, "rank %d: nothing was received straight into the registered buffer",
           me);
  if (strcmp(remote, "verbs") != 0)
    EXPECT(rz1 == 0, "rank %d: %llu bytes received directly without verbs", me,
           (unsigned long long)rz1);
  if (strcmp(remote, "verbs") != 0)
    EXPECT(zc1 == 0, "rank %d: %llu zero-copy bytes without verbs", me, (unsigned long long)zc1);
  printf("rank %d: %llu bytes zero-copy, %llu through the rings, %llu received directly\n",
         me, (unsigned long long)(zc1 - zc0), (unsigned long long)(ring1 - ring0),
         (unsigned long long)(rz1 - rz0));
  fflush(stdout);
  OK(chorus_comm_deregister(c, h2));
  OK(chorus_comm_deregister(c, h));
  EXPECT(chorus_comm_deregister(c, h) == CHORUS_ERR_INVALID &&
             strstr(chorus_comm_error(NULL), "not a registration"),
         "rank %d: a third deregistration of two was accepted", me);
  EXPECT(chorus_comm_register(c, NULL, 8, &h3) == CHORUS_ERR_INVALID && h3 == NULL &&
             strstr(chorus_comm_error(NULL), "buffer is NULL"),
         "rank %d: registering NULL was accepted", me);
  EXPECT(c->regs == NULL, "rank %d: registrations left after deregistering all", me);
  /* unregistered now: the same sends go through the rings */
  OK(chorus_ibroadcast(c, buf, count, CHORUS_FLOAT32, 0, &req));
  OK(run_req(req, NULL, 0));
  uint64_t zc2, ring2;
  ib_sent_bytes(c, &zc2, &ring2);
  EXPECT(zc2 == zc1, "rank %d: %llu bytes zero-copy from a deregistered buffer", me,
         (unsigned long long)(zc2 - zc1));
  /* left registered: destroy releases it */
  OK(chorus_comm_register(c, buf, 4096, &h3));
  free(buf);
}

/* What each rank reaches its peers with: every peer on the other simulated host by verbs,
 * on the NICs CHORUS_IB_HCA allows (env TEST_NICS: the names expected, comma-joined); with
 * several QPs and NICs, a connection's QPs use different NICs. */
static void check_transports(chorus_comm_t *c, const char *remote) {
  const char *nics = getenv("TEST_NICS");
  for (int p = 0; p < c->nranks; p++) {
    if (p == c->rank) continue;
    const char *want = c->host_of[p] == c->host_of[c->rank] ? "shm" : remote;
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      conn_t *cn = c->conns[ch][p];
      EXPECT(strcmp(cn->ops->name, want) == 0, "rank %d peer %d channel %d: %s, expected %s",
             c->rank, p, ch, cn->ops->name, want);
      if (strcmp(want, "verbs") != 0 || strcmp(cn->ops->name, "verbs") != 0 || !nics) continue;
      int nqp = 0;
      const char *first = ib_conn_nic(cn, 0, &nqp);
      for (int q = 0; q < nqp; q++) {
        const char *nic = ib_conn_nic(cn, q, &nqp);
        EXPECT(nic && strstr(nics, nic), "rank %d peer %d QP %d on %s, not one of %s", c->rank,
               p, q, nic ? nic : "?", nics);
        if (q > 0 && strchr(nics, ','))
          EXPECT(strcmp(nic, first) != 0, "rank %d peer %d: QPs 0 and %d both on %s", c->rank,
                 p, q, nic);
      }
    }
  }
}

enum mode { PLAIN, FAULT, QPERR, FAULTREG };

static int rank_main(int rank, int n, int port, enum mode mode, const char *remote) {
  g_rank = rank;
  char host[32];
  snprintf(host, sizeof host, "simhost%d", n == 2 ? rank : rank / 2);
  setenv("CHORUS_HOSTID", host, 1);
  if (mode == FAULT && rank == 0) setenv("FAKEVERBS_FAIL_AFTER", "30", 1);
  if (mode == FAULTREG && rank == 0) setenv("FAKEVERBS_FAIL_AFTER", "300", 1);
  if (mode == QPERR && rank == 1) setenv("FAKEVERBS_QP_ERROR", "25", 1);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t bs;
  if (chorus_bootstrap_tcp(addr, rank, n, 20000, &bs) != CHORUS_SUCCESS) {
    fprintf(stderr, "rank %d: bootstrap failed: %s\n", rank, chorus_comm_error(NULL));
    return 1;
  }
  chorus_comm_t *c;
  chorus_comm_options_t o = {20000, "ib"};
  if (chorus_comm_create(rank, n, &bs, &o, &c) != CHORUS_SUCCESS) {
    fprintf(stderr, "rank %d: create failed: %s\n", rank, chorus_comm_error(NULL));
    return 1;
  }
  check_transports(c, remote);
  if (mode == FAULT || mode == QPERR || mode == FAULTREG) {
    /* all-reduces until the injected failure: both ranks must fail fast, not time out.
     * FAULTREG: 1.2 MB from and into registered buffers (all-reduce, then broadcast), so the
     * failure hits sends and receives without a copy; their registrations are released. */
    size_t cnt = mode == FAULTREG ? 300000 : 4096;
    float *x = malloc(cnt * sizeof(float));
    void *h = NULL;
    if (mode == FAULTREG && chorus_comm_register(c, x, cnt * sizeof(float), &h) != CHORUS_SUCCESS)
      EXPECT(0, "rank %d: register: %s", rank, chorus_comm_error(NULL));
    chorus_redop_t sum = {CHORUS_SUM, 1.0};
    char err[1024] = "";
    chorus_result_t r = CHORUS_SUCCESS;
    time_t t0 = time(NULL);
    for (int i = 0; i < 200 && r == CHORUS_SUCCESS; i++) {
      chorus_request_t *req;
      for (size_t k = 0; k < cnt; k++) x[k] = 1.f;
      if (mode == FAULTREG && i % 2)
        r = chorus_ibroadcast(c, x, cnt, CHORUS_FLOAT32, i % 4 == 1 ? 0 : 1, &req);
      else
        r = chorus_iallreduce(c, x, x, cnt, CHORUS_FLOAT32, sum, &req);
      if (r != CHORUS_SUCCESS) /* refused: the communicator failed after the last one */
        snprintf(err, sizeof err, "%s", chorus_comm_error(c));
      else
        r = run_req(req, err, sizeof err);
    }
    long secs = (long)(time(NULL) - t0);
    EXPECT(r != CHORUS_SUCCESS, "rank %d: no failure after the injected error", rank);
    EXPECT(secs < 10, "rank %d: the failure took %ld s", rank, secs);
    if (mode == FAULT || (mode == FAULTREG && rank == 0))
      EXPECT(strstr(err, "transport retry counter exceeded") && strstr(err, "status 12"),
             "rank %d: status not named: %s", rank, err);
    else if (mode == FAULTREG) /* rank 1: its peer's notice, or its own failed write */
      EXPECT(strstr(err, "status "), "rank %d: no status named: %s", rank, err);
    else if (rank == 1) /* its QP was moved to the error state: its writes are flushed */
      EXPECT(strstr(err, "Work Request Flushed Error") && strstr(err, "status 5"),
             "rank %d: status not named: %s", rank, err);
    else /* rank 0 writes to a QP in error (retries run out), or reads rank 1's notice */
      EXPECT(strstr(err, "status "), "rank %d: no status named: %s", rank, err);
    EXPECT(strstr(err, rank == 0 ? "rank 0 peer 1 (verbs" : "rank 1 peer 0 (verbs"),
           "rank %d: peer not named: %s", rank, err);
    printf("rank %d failed as expected: %s\n", rank, err);
    if (mode == FAULTREG) {
      uint64_t zc, ring;
      ib_sent_bytes(c, &zc, &ring);
      EXPECT(zc > 0, "rank %d: nothing was sent from the registered buffer before the error",
             rank);
    }
    chorus_comm_destroy(c); /* x still registered: destroy releases it */
    c = NULL;
    free(x);
  } else {
    check_collectives(c, n);
    check_registered(c, n, remote);
  }
  if (c) chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  return failures ? 1 : 0;
}

static const char *only_world;
static int run_world(const char *name, int n, enum mode mode, const char *remote) {
  if (only_world && strncmp(name, only_world, strlen(only_world)) != 0) return 0;
  int port = free_port();
  pid_t pids[8];
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = rank_main(r, n, port, mode, remote);
      if (getenv("TEST_CHILD_EXIT")) exit(rc);
      _exit(rc);
    }
  }
  int bad = 0;
  for (int r = 0; r < n; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      bad = 1;
      if (WIFSIGNALED(st)) printf("rank %d died by signal %d\n", r, WTERMSIG(st));
    }
  }
  printf("%s %s\n", bad ? "FAIL" : "ok  ", name);
  return bad;
}

int main(void) {
  const char *only = getenv("TEST_IB_ONLY"); /* a world's name prefix, to debug one */
  find_fake();
  test_hca();
  test_gdr();
  test_abi();
  only_world = only;
  int bad = 0;
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 1);
  if (access(fake_path, R_OK) != 0) {
    fprintf(stderr, "FAIL: %s is missing (make -C tests/fakeverbs)\n", fake_path);
    bad++;
  } else {
    setenv("CHORUS_IBVERBS_LIB", fake_path, 1);
    setenv("CHORUS_BUFFSIZE", "64K", 1); /* every big message wraps the rings */
    /* IB: three devices, IB_HCA leaves only fake1 */
    setenv("FAKEVERBS_DEVICES", "fake0,fake1,fake2", 1);
    setenv("CHORUS_IB_HCA", "^=fake0,fake2", 1);
    setenv("TEST_NICS", "fake1", 1);
    bad += run_world("4 ranks, 2 hosts, IB, 1 QP", 4, PLAIN, "verbs");
    /* rings of 4 MiB: collectives' messages reach write_direct's 64 KiB too, so sends from
     * registered buffers interleave with reductions into them (ring all-reduce in place) */
    setenv("CHORUS_BUFFSIZE", "4M", 1);
    bad += run_world("4 ranks, 2 hosts, IB, 1 QP, 4 MiB rings", 4, PLAIN, "verbs");
    setenv("CHORUS_BUFFSIZE", "64K", 1);
    unsetenv("CHORUS_IB_HCA");
    setenv("FAKEVERBS_DEVICES", "fake0/roce,fake1/roce", 1);
    setenv("CHORUS_IB_QPS_PER_CONNECTION", "2", 1);
    setenv("TEST_NICS", "fake0,fake1", 1);
    bad += run_world("4 ranks, 2 hosts, RoCE, 2 QPs, 2 NICs", 4, PLAIN, "verbs");
    unsetenv("CHORUS_IB_QPS_PER_CONNECTION");
    unsetenv("TEST_NICS");
    setenv("FAKEVERBS_DEVICES", "fake0", 1);
    bad += run_world("injected completion error", 2, FAULT, "verbs");
    bad += run_world("injected QP error", 2, QPERR, "verbs");
    setenv("CHORUS_BUFFSIZE", "4M", 1); /* collectives' messages reach write_direct */
    bad += run_world("injected completion error, registered buffers", 2, FAULTREG, "verbs");
    setenv("CHORUS_BUFFSIZE", "64K", 1);
    setenv("CHORUS_IB_DISABLE", "1", 1);
    bad += run_world("IB_DISABLE=1: sockets", 4, PLAIN, "socket");
    unsetenv("CHORUS_IB_DISABLE");
  }
  setenv("CHORUS_IBVERBS_LIB", "/nonexistent/libibverbs.so.1", 1);
  bad += run_world("no libibverbs: sockets", 4, PLAIN, "socket");
  printf("%d checks, %d failures, %d worlds failed\n", checks, failures, bad);
  return failures || bad ? 1 : 0;
}
