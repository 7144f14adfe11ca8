/* shm.c - the shared-memory transport between ranks of one host. Each rank owns one POSIX
 * shm segment holding its doorbell, its failure notice and one inbound ring per local peer
 * and channel; the segment is unlinked as soon as every local rank has mapped it, so
 * nothing is left in /dev/shm even if ranks are killed later. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../core.h"

#define CACHELINE 64
#define SEG_MAGIC 0x43485348u /* "CHSH" */

struct seg_ctrl {
  uint32_t magic;
  int32_t pid;
  int32_t rank;
  int32_t nlocal;
  uint64_t ring_size;
  uint64_t scratch_size;
  char pad0[CACHELINE - 32];
  _Atomic uint32_t doorbell;
  _Atomic uint32_t sleepers;
  char pad1[CACHELINE - 8];
  _Atomic int32_t failed; /* 1 once this rank recorded an error; text below */
  char error[500];
  char pad2[CACHELINE - (4 + 500) % CACHELINE];
  struct shm_flags flags __attribute__((aligned(CACHELINE))); /* algo/shm_direct.c */
};

struct ring_hdr {
  _Atomic uint64_t head; /* bytes written by the sender */
  char pad0[CACHELINE - 8];
  _Atomic uint64_t tail; /* bytes consumed by the receiver */
  char pad1[CACHELINE - 8];
};

struct shm_conn {
  conn_t base;
  struct ring_hdr *tx; /* ring in the peer's segment */
  uint8_t *tx_data;
  struct ring_hdr *rx; /* ring in our segment */
  uint8_t *rx_data;
  uint64_t size;
  struct seg_ctrl *peer_ctrl;
  int32_t peer_pid;
  int waiting;          /* last peek/reserve found nothing: the peer's liveness matters */
  int64_t next_check_ns;
};

struct shm_state {
  char name[64];
  void *own;            /* our segment */
  size_t own_len;
  void **peer_seg;      /* [local index] */
  size_t *peer_len;
  int *local_ranks;     /* local index -> rank */
  int nlocal;
  int my_local;
  uint64_t ring_size;
  uint64_t scratch_size; /* bytes of each rank's direct-access area (two halves) */
  int unlinked;
};

static size_t seg_size(int nlocal, uint64_t ring, uint64_t scratch) {
  size_t per = sizeof(struct ring_hdr) + ring;
  return sizeof(struct seg_ctrl) + (size_t)(nlocal > 1 ? nlocal - 1 : 0) * CHAN_COUNT * per +
         CACHELINE + scratch;
}

/* The direct-access area sits after the rings, page aligned. */
static size_t scratch_offset(int nlocal, uint64_t ring) {
  return (seg_size(nlocal, ring, 0) + 4095) & ~(size_t)4095;
}

/* Ring of sender local index s inside the segment of receiver local index r. */
static struct ring_hdr *ring_at(void *seg, int recv_local, int send_local, int ch,
                                uint64_t ring) {
  int slot = send_local < recv_local ? send_local : send_local - 1;
  size_t per = sizeof(struct ring_hdr) + ring;
  uint8_t *base = (uint8_t *)seg + sizeof(struct seg_ctrl);
  return (struct ring_hdr *)(base + ((size_t)slot * CHAN_COUNT + (size_t)ch) * per);
}

static void futex_wake_all(_Atomic uint32_t *w) {
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void ring_doorbell(struct seg_ctrl *ctrl) {
  atomic_fetch_add(&ctrl->doorbell, 1);
  if (atomic_load(&ctrl->sleepers) > 0) futex_wake_all(&ctrl->doorbell);
}

static struct seg_ctrl *own_ctrl(struct chorus_comm *comm) {
  return (struct seg_ctrl *)comm->shm->own;
}

uint32_t shm_doorbell_value(struct chorus_comm *comm) {
  return atomic_load(&own_ctrl(comm)->doorbell);
}

void shm_ring_own_doorbell(struct chorus_comm *comm) { ring_doorbell(own_ctrl(comm)); }

void shm_wait_doorbell(struct chorus_comm *comm, uint32_t seen, int timeout_us) {
  struct seg_ctrl *c = own_ctrl(comm);
  atomic_fetch_add(&c->sleepers, 1);
  if (atomic_load(&c->doorbell) == seen) {
    struct timespec ts = {.tv_sec = timeout_us / 1000000, .tv_nsec = (timeout_us % 1000000) * 1000L};
    syscall(SYS_futex, (uint32_t *)&c->doorbell, FUTEX_WAIT, seen, &ts, NULL, 0);
  }
  atomic_fetch_sub(&c->sleepers, 1);
}

void shm_publish_error(struct chorus_comm *comm, const char *msg) {
  if (!comm->shm || !comm->shm->own) return;
  struct seg_ctrl *c = own_ctrl(comm);
  if (atomic_load(&c->failed)) return;
  snprintf(c->error, sizeof c->error, "%s", msg);
  atomic_store(&c->failed, 1);
  /* wake every local peer so it sees the notice now */
  for (int i = 0; i < comm->shm->nlocal; i++)
    if (i != comm->shm->my_local && comm->shm->peer_seg[i])
      ring_doorbell((struct seg_ctrl *)comm->shm->peer_seg[i]);
}

/* A killed rank whose parent has not reaped it yet still answers kill(pid, 0). */
static int pid_is_zombie(int32_t pid) {
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char *rp = strrchr(buf, ')'); /* the command name may contain spaces */
  return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

int shm_failed_peer(struct chorus_comm *comm) {
  struct shm_state *st = comm->shm;
  if (!st) return -1;
  for (int i = 0; i < st->nlocal; i++) {
    if (i == st->my_local || !st->peer_seg[i]) continue;
    if (atomic_load(&((struct seg_ctrl *)st->peer_seg[i])->failed)) return st->local_ranks[i];
  }
  return -1;
}

/* ---------------------------------------------------------------- vtable */
static chorus_result_t shm_check_peer(struct shm_conn *s) {
  struct chorus_comm *comm = s->base.comm;
  if (atomic_load(&s->peer_ctrl->failed))
    return comm_set_error(comm, CHORUS_ERR_PEER, "rank %d reported a failure: %.400s",
                          s->base.peer, s->peer_ctrl->error);
  if (!s->waiting) return CHORUS_SUCCESS;
  int64_t now = now_ns();
  if (now < s->next_check_ns) return CHORUS_SUCCESS;
  s->next_check_ns = now + 20 * 1000000LL;
  if ((kill(s->peer_pid, 0) != 0 && errno == ESRCH) || pid_is_zombie(s->peer_pid))
    return comm_set_error(comm, CHORUS_ERR_PEER,
                          "rank %d (pid %d, same host) exited while rank %d waited for it",
                          s->base.peer, s->peer_pid, comm->rank);
  return CHORUS_SUCCESS;
}

static chorus_result_t shm_reserve(conn_t *c, void **ptr, size_t *len) {
  struct shm_conn *s = (struct shm_conn *)c;
  uint64_t head = atomic_load_explicit(&s->tx->head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&s->tx->tail, memory_order_acquire);
  uint64_t free_b = s->size - (head - tail);
  uint64_t off = head % s->size;
  uint64_t contig = s->size - off;
  *len = (size_t)(free_b < contig ? free_b : contig);
  *ptr = s->tx_data + off;
  s->waiting = *len == 0;
  return CHORUS_SUCCESS;
}

static chorus_result_t shm_commit(conn_t *c, size_t len) {
  struct shm_conn *s = (struct shm_conn *)c;
  uint64_t head = atomic_load_explicit(&s->tx->head, memory_order_relaxed);
  atomic_store_explicit(&s->tx->head, head + len, memory_order_release);
  ring_doorbell(s->peer_ctrl);
  return CHORUS_SUCCESS;
}

static chorus_result_t shm_peek(conn_t *c, const void **ptr, size_t *len) {
  struct shm_conn *s = (struct shm_conn *)c;
  uint64_t tail = atomic_load_explicit(&s->rx->tail, memory_order_relaxed);
  uint64_t head = atomic_load_explicit(&s->rx->head, memory_order_acquire);
  uint64_t avail = head - tail;
  uint64_t off = tail % s->size;
  uint64_t contig = s->size - off;
  *len = (size_t)(avail < contig ? avail : contig);
  *ptr = s->rx_data + off;
  s->waiting = *len == 0;
  return CHORUS_SUCCESS;
}

static chorus_result_t shm_consume(conn_t *c, size_t len) {
  struct shm_conn *s = (struct shm_conn *)c;
  uint64_t tail = atomic_load_explicit(&s->rx->tail, memory_order_relaxed);
  atomic_store_explicit(&s->rx->tail, tail + len, memory_order_release);
  ring_doorbell(s->peer_ctrl);
  return CHORUS_SUCCESS;
}

static chorus_result_t shm_progress(conn_t *c, int *progressed) {
  (void)progressed;
  return shm_check_peer((struct shm_conn *)c);
}

static void shm_close(conn_t *c) { free(c); }

static const struct transport_ops shm_ops = {
    .name = "shm",
    .reserve = shm_reserve,
    .commit = shm_commit,
    .peek = shm_peek,
    .consume = shm_consume,
    .progress = shm_progress,
    .pollfd = NULL,
    .close = shm_close,
};

/* ---------------------------------------------------------------- setup */
static void seg_name(char *buf, size_t cap, uint64_t nonce, int rank) {
  snprintf(buf, cap, "/chorus-%016llx-%d", (unsigned long long)nonce, rank);
}

chorus_result_t shm_setup(struct chorus_comm *comm) {
  int me = comm->rank;
  if (!comm->peers[me].shm_ok) return CHORUS_SUCCESS;
  int nlocal = 0, my_local = -1;
  for (int r = 0; r < comm->nranks; r++) {
    int local = comm->local_rank_of[r] >= 0 && comm->peers[r].shm_ok;
    if (local) {
      if (r == me) my_local = nlocal;
      nlocal++;
    }
  }
  if (nlocal <= 1) return CHORUS_SUCCESS;

  struct shm_state *st = calloc(1, sizeof(*st));
  if (!st) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
  comm->shm = st;
  st->nlocal = nlocal;
  st->my_local = my_local;
  st->local_ranks = calloc((size_t)nlocal, sizeof(int));
  st->peer_seg = calloc((size_t)nlocal, sizeof(void *));
  st->peer_len = calloc((size_t)nlocal, sizeof(size_t));
  if (!st->local_ranks || !st->peer_seg || !st->peer_len)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
  for (int r = 0, i = 0; r < comm->nranks; r++)
    if (comm->local_rank_of[r] >= 0 && comm->peers[r].shm_ok) st->local_ranks[i++] = r;

  uint64_t ring = (uint64_t)param_int(PARAM_BUFFSIZE);
  if (ring < 4096) ring = 4096;
  ring = (ring + 4095) & ~(uint64_t)4095;
  st->ring_size = ring;
  uint64_t scratch = shm_scratch_bytes();
  st->scratch_size = scratch;
  size_t len = scratch_offset(nlocal, ring) + scratch;

  seg_name(st->name, sizeof st->name, comm->job_nonce, me);
  int fd = shm_open(st->name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: shm_open(%s) failed: %s", me,
                          st->name, strerror(errno));
  int err = posix_fallocate(fd, 0, (off_t)len);
  if (err != 0) {
    close(fd);
    shm_unlink(st->name);
    st->unlinked = 1;
    return comm_set_error(comm, CHORUS_ERR_SYSTEM,
                          "rank %d: cannot reserve %zu bytes of shared memory in /dev/shm (%s); "
                          "lower CHORUS_BUFFSIZE or set CHORUS_SHM_DISABLE=1",
                          me, len, strerror(err));
  }
  void *seg = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (seg == MAP_FAILED) {
    shm_unlink(st->name);
    st->unlinked = 1;
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: mmap of %zu bytes failed: %s", me,
                          len, strerror(errno));
  }
  st->own = seg;
  st->own_len = len;
  st->peer_seg[my_local] = seg;
  struct seg_ctrl *ctrl = seg;
  ctrl->magic = SEG_MAGIC;
  ctrl->pid = (int32_t)getpid();
  ctrl->rank = me;
  ctrl->nlocal = nlocal;
  ctrl->ring_size = ring;
  ctrl->scratch_size = scratch;

  chorus_result_t res = bs_barrier(comm, "shm_created");
  if (res == CHORUS_SUCCESS) {
    for (int i = 0; i < nlocal; i++) {
      if (i == my_local) continue;
      char name[64];
      seg_name(name, sizeof name, comm->job_nonce, st->local_ranks[i]);
      int pfd = shm_open(name, O_RDWR, 0600);
      if (pfd < 0) {
        res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: cannot open rank %d's segment %s: %s",
                             me, st->local_ranks[i], name, strerror(errno));
        break;
      }
      void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
      close(pfd);
      if (p == MAP_FAILED) {
        res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: cannot map rank %d's segment: %s",
                             me, st->local_ranks[i], strerror(errno));
        break;
      }
      st->peer_seg[i] = p;
      st->peer_len[i] = len;
      if (((struct seg_ctrl *)p)->magic != SEG_MAGIC || ((struct seg_ctrl *)p)->ring_size != ring ||
          ((struct seg_ctrl *)p)->scratch_size != scratch) {
        res = comm_set_error(comm, CHORUS_ERR_INVALID,
                             "rank %d: rank %d uses a different CHORUS_BUFFSIZE or "
                             "CHORUS_SHM_SCRATCH", me, st->local_ranks[i]);
        break;
      }
    }
  }
  /* Everyone has mapped (or failed): the name is no longer needed. */
  chorus_result_t res2 = bs_barrier(comm, "shm_mapped");
  shm_unlink(st->name);
  st->unlinked = 1;
  if (res != CHORUS_SUCCESS) return res;
  if (res2 != CHORUS_SUCCESS) return res2;

  for (int i = 0; i < nlocal; i++) {
    if (i == my_local) continue;
    int peer = st->local_ranks[i];
    struct seg_ctrl *pc = st->peer_seg[i];
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      struct shm_conn *s = calloc(1, sizeof(*s));
      if (!s) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
      s->base.ops = &shm_ops;
      s->base.comm = comm;
      s->base.peer = peer;
      s->base.channel = ch;
      s->size = ring;
      s->tx = ring_at(st->peer_seg[i], i, my_local, ch, ring);
      s->tx_data = (uint8_t *)s->tx + sizeof(struct ring_hdr);
      s->rx = ring_at(seg, my_local, i, ch, ring);
      s->rx_data = (uint8_t *)s->rx + sizeof(struct ring_hdr);
      s->peer_ctrl = pc;
      s->peer_pid = pc->pid;
      comm->conns[ch][peer] = &s->base;
    }
    INFO(SUB_SHM, me, "peer %d via shm (pid %d, %llu-byte rings)", peer, pc->pid,
         (unsigned long long)ring);
  }
  return CHORUS_SUCCESS;
}

void shm_teardown(struct chorus_comm *comm) {
  struct shm_state *st = comm->shm;
  if (!st) return;
  if (!st->unlinked && st->name[0]) shm_unlink(st->name);
  for (int i = 0; i < st->nlocal; i++)
    if (i != st->my_local && st->peer_seg && st->peer_seg[i])
      munmap(st->peer_seg[i], st->peer_len[i]);
  if (st->own) munmap(st->own, st->own_len);
  free(st->local_ranks);
  free(st->peer_seg);
  free(st->peer_len);
  free(st);
  comm->shm = NULL;
}

/* ---------------------------------------------------------------- direct access */
uint64_t shm_scratch_bytes(void) {
  return ((uint64_t)param_int(PARAM_SHM_SCRATCH) + 8191) & ~(uint64_t)8191;
}

size_t shm_scratch_half(const struct chorus_comm *comm) {
  return comm->shm ? (size_t)(comm->shm->scratch_size / 2) : 0;
}

void *shm_scratch(struct chorus_comm *comm, int local, int half) {
  struct shm_state *st = comm->shm;
  return (uint8_t *)st->peer_seg[local] + scratch_offset(st->nlocal, st->ring_size) +
         (size_t)half * (size_t)(st->scratch_size / 2);
}

struct shm_flags *shm_flags_of(struct chorus_comm *comm, int local) {
  return &((struct seg_ctrl *)comm->shm->peer_seg[local])->flags;
}

void shm_notify_local(struct chorus_comm *comm) {
  struct shm_state *st = comm->shm;
  for (int i = 0; i < st->nlocal; i++)
    if (i != st->my_local) ring_doorbell((struct seg_ctrl *)st->peer_seg[i]);
}

void shm_mark_waiting(struct chorus_comm *comm, int peer) {
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    conn_t *c = comm->conns[ch][peer];
    if (c && c->ops == &shm_ops) ((struct shm_conn *)c)->waiting = 1;
  }
}
