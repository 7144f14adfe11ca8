/* ib_verbs.h - the part of the libibverbs ABI the verbs transport uses, declared here so the
 * core builds without rdma-core's headers (libibverbs is dlopen'd at run time, see ib_wrap.c).
 *
 * Every struct below has the layout of its namesake in rdma-core's <infiniband/verbs.h>
 * (cv_X <-> ibv_X) for the members listed; members the transport never touches keep their
 * place as padding of the same size. tests/c/test_ib_abi.c compares sizes and offsets with
 * the real header where one is installed. Structs the library allocates (context, qp, cq,
 * mr, pd) are only read through pointers, so only their leading members are declared.
 *
 * ibv_post_send, ibv_post_recv and ibv_poll_cq are static inline functions in verbs.h that
 * call through context->ops; ib_wrap.c calls through the same slots. */
#ifndef CHORUS_IB_VERBS_H
#define CHORUS_IB_VERBS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

union cv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix; /* big-endian */
    uint64_t interface_id;
  } global;
};

enum {
  CV_GID_TYPE_IB = 0,
  CV_GID_TYPE_ROCE_V1 = 1,
  CV_GID_TYPE_ROCE_V2 = 2,
};

enum { CV_MTU_256 = 1, CV_MTU_512 = 2, CV_MTU_1024 = 3, CV_MTU_2048 = 4, CV_MTU_4096 = 5 };
enum { CV_PORT_ACTIVE = 4 };
enum { CV_LINK_LAYER_UNSPECIFIED = 0, CV_LINK_LAYER_INFINIBAND = 1, CV_LINK_LAYER_ETHERNET = 2 };

enum cv_wc_status {
  CV_WC_SUCCESS = 0,
  CV_WC_LOC_LEN_ERR,
  CV_WC_LOC_QP_OP_ERR,
  CV_WC_LOC_EEC_OP_ERR,
  CV_WC_LOC_PROT_ERR,
  CV_WC_WR_FLUSH_ERR,
  CV_WC_MW_BIND_ERR,
  CV_WC_BAD_RESP_ERR,
  CV_WC_LOC_ACCESS_ERR,
  CV_WC_REM_INV_REQ_ERR,
  CV_WC_REM_ACCESS_ERR,
  CV_WC_REM_OP_ERR,
  CV_WC_RETRY_EXC_ERR,
  CV_WC_RNR_RETRY_EXC_ERR,
  CV_WC_LOC_RDD_VIOL_ERR,
  CV_WC_REM_INV_RD_REQ_ERR,
  CV_WC_REM_ABORT_ERR,
  CV_WC_INV_EECN_ERR,
  CV_WC_INV_EEC_STATE_ERR,
  CV_WC_FATAL_ERR,
  CV_WC_RESP_TIMEOUT_ERR,
  CV_WC_GENERAL_ERR,
};

/* ibv_wc_opcode: sends 0.., receives from 128 */
enum { CV_WC_SEND = 0, CV_WC_RDMA_WRITE = 1, CV_WC_RECV = 128, CV_WC_RECV_RDMA_WITH_IMM = 129 };
enum { CV_WC_WITH_IMM = 1 << 1 };
enum { CV_WR_RDMA_WRITE = 0, CV_WR_RDMA_WRITE_WITH_IMM = 1, CV_WR_SEND = 2 };
enum { CV_SEND_FENCE = 1 << 0, CV_SEND_SIGNALED = 1 << 1, CV_SEND_INLINE = 1 << 3 };
enum {
  CV_ACCESS_LOCAL_WRITE = 1,
  CV_ACCESS_REMOTE_WRITE = 1 << 1,
  CV_ACCESS_REMOTE_READ = 1 << 2,
};
enum { CV_QPT_RC = 2 };
enum {
  CV_QPS_RESET = 0,
  CV_QPS_INIT,
  CV_QPS_RTR,
  CV_QPS_RTS,
  CV_QPS_SQD,
  CV_QPS_SQE,
  CV_QPS_ERR,
};
enum {
  CV_QP_STATE = 1 << 0,
  CV_QP_ACCESS_FLAGS = 1 << 3,
  CV_QP_PKEY_INDEX = 1 << 4,
  CV_QP_PORT = 1 << 5,
  CV_QP_AV = 1 << 7,
  CV_QP_PATH_MTU = 1 << 8,
  CV_QP_TIMEOUT = 1 << 9,
  CV_QP_RETRY_CNT = 1 << 10,
  CV_QP_RNR_RETRY = 1 << 11,
  CV_QP_RQ_PSN = 1 << 12,
  CV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
  CV_QP_MIN_RNR_TIMER = 1 << 15,
  CV_QP_SQ_PSN = 1 << 16,
  CV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
  CV_QP_DEST_QPN = 1 << 20,
};

struct cv_device; /* opaque: named through ibv_get_device_name */
struct cv_context;
struct cv_qp;
struct cv_cq;
struct cv_send_wr;
struct cv_recv_wr;
struct cv_wc;

/* struct ibv_context_ops: 32 function pointers; the three the data path calls are named. */
struct cv_context_ops {
  void *slot0_10[11];  /* _compat_query_device .. _compat_create_cq */
  int (*poll_cq)(struct cv_cq *cq, int num_entries, struct cv_wc *wc);   /* slot 11 */
  void *slot12_24[13]; /* req_notify_cq .. _compat_destroy_qp */
  int (*post_send)(struct cv_qp *qp, struct cv_send_wr *wr, struct cv_send_wr **bad); /* 25 */
  int (*post_recv)(struct cv_qp *qp, struct cv_recv_wr *wr, struct cv_recv_wr **bad); /* 26 */
  void *slot27_31[5];  /* _compat_create_ah .. _compat_async_event */
};

struct cv_context {
  struct cv_device *device;
  struct cv_context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void *abi_compat;
};

struct cv_pd {
  struct cv_context *context;
  uint32_t handle;
};

struct cv_mr {
  struct cv_context *context;
  struct cv_pd *pd;
  void *addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct cv_cq {
  struct cv_context *context;
  void *channel;
  void *cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct cv_qp {
  struct cv_context *context;
  void *qp_context;
  struct cv_pd *pd;
  struct cv_cq *send_cq;
  struct cv_cq *recv_cq;
  void *srq;
  uint32_t handle;
  uint32_t qp_num;
  int state;
  int qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

/* struct ibv_port_attr as filled by the exported ibv_query_port (its compat part ends at
 * link_layer; the last two members are newer and stay zero there). */
struct cv_port_attr {
  int state;
  int max_mtu;
  int active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint16_t port_cap_flags2;
};

struct cv_gid_entry {
  union cv_gid gid;
  uint32_t gid_index;
  uint32_t port_num;
  uint32_t gid_type;
  uint32_t ndev_ifindex;
};

struct cv_wc {
  uint64_t wr_id;
  int status;   /* enum cv_wc_status */
  int opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data; /* network byte order */
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

struct cv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct cv_send_wr {
  uint64_t wr_id;
  struct cv_send_wr *next;
  struct cv_sge *sg_list;
  int num_sge;
  int opcode;
  unsigned int send_flags;
  uint32_t imm_data; /* network byte order */
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr, compare_add, swap;
      uint32_t rkey;
    } atomic;
  } wr;
  uint32_t qp_type_xrc_remote_srqn;
  union {
    struct {
      void *mw;
      uint32_t rkey;
      void *mr;
      uint64_t addr, length;
      unsigned int access;
    } bind_mw;
  } extra;
};

struct cv_recv_wr {
  uint64_t wr_id;
  struct cv_recv_wr *next;
  struct cv_sge *sg_list;
  int num_sge;
};

struct cv_qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct cv_qp_init_attr {
  void *qp_context;
  struct cv_cq *send_cq;
  struct cv_cq *recv_cq;
  void *srq;
  struct cv_qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

struct cv_global_route {
  union cv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct cv_ah_attr {
  struct cv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct cv_qp_attr {
  int qp_state;
  int cur_qp_state;
  int path_mtu;
  int path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;
  struct cv_qp_cap cap;
  struct cv_ah_attr ah_attr;
  struct cv_ah_attr alt_ah_attr;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

/* The exported functions the transport resolves with dlsym (ib_wrap.c). */
struct ib_api {
  void *handle;
  struct cv_device **(*get_device_list)(int *num);
  void (*free_device_list)(struct cv_device **list);
  const char *(*get_device_name)(struct cv_device *dev);
  struct cv_context *(*open_device)(struct cv_device *dev);
  int (*close_device)(struct cv_context *ctx);
  int (*query_port)(struct cv_context *ctx, uint8_t port, struct cv_port_attr *attr);
  int (*query_gid)(struct cv_context *ctx, uint8_t port, int index, union cv_gid *gid);
  struct cv_pd *(*alloc_pd)(struct cv_context *ctx);
  int (*dealloc_pd)(struct cv_pd *pd);
  struct cv_mr *(*reg_mr)(struct cv_pd *pd, void *addr, size_t len, int access);
  int (*dereg_mr)(struct cv_mr *mr);
  struct cv_cq *(*create_cq)(struct cv_context *ctx, int cqe, void *cq_context, void *channel,
                             int comp_vector);
  int (*destroy_cq)(struct cv_cq *cq);
  struct cv_qp *(*create_qp)(struct cv_pd *pd, struct cv_qp_init_attr *attr);
  int (*modify_qp)(struct cv_qp *qp, struct cv_qp_attr *attr, int mask);
  int (*destroy_qp)(struct cv_qp *qp);
  const char *(*wc_status_str)(int status);
  /* optional (NULL where the library is older) */
  int (*query_gid_ex)(struct cv_context *ctx, uint32_t port, uint32_t index,
                      struct cv_gid_entry *entry, uint32_t flags, size_t entry_size);
  struct cv_mr *(*reg_dmabuf_mr)(struct cv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                 int fd, int access);
};

/* ib_wrap.c: loads the library once per process (CHORUS_IBVERBS_LIB or libibverbs.so.1).
 * Returns NULL when it cannot be loaded or lacks a required symbol; *why then says which
 * (static text). Thread-safe. */
const struct ib_api *ib_api_get(const char **why);
/* The data path, through the context's ops exactly as verbs.h's inline functions do. */
static inline int ib_post_send(struct cv_qp *qp, struct cv_send_wr *wr, struct cv_send_wr **bad) {
  return qp->context->ops.post_send(qp, wr, bad);
}
static inline int ib_post_recv(struct cv_qp *qp, struct cv_recv_wr *wr, struct cv_recv_wr **bad) {
  return qp->context->ops.post_recv(qp, wr, bad);
}
static inline int ib_poll_cq(struct cv_cq *cq, int n, struct cv_wc *wc) {
  return cq->context->ops.poll_cq(cq, n, wc);
}
/* Name of a work-completion status: the library's text, else ours. */
const char *ib_wc_status_name(int status);

#endif /* CHORUS_IB_VERBS_H */
