/* comm.c - communicators: creation from a bootstrap (secret, host map, transports per
 * peer, progress engine), split, abort, destroy, and the per-communicator error state. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "core.h"

static _Thread_local char create_error[1024];

#ifdef CHORUS_FP_SWITCH
_Atomic int chorus_fp_off; /* core.h: FP_OFF */
#endif

chorus_result_t comm_set_error(struct chorus_comm *comm, chorus_result_t res, const char *fmt,
                               ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!comm) {
    snprintf(create_error, sizeof create_error, "%s", msg);
    return res;
  }
  int first = 0;
  pthread_mutex_lock(&comm->err_mu);
  if (!comm->errbuf[0]) {
    snprintf(comm->errbuf, sizeof comm->errbuf, "%s", msg);
    comm->err = res;
    first = 1;
  }
  pthread_mutex_unlock(&comm->err_mu);
  if (first) {
    atomic_store(&comm->failed, 1);
    snprintf(create_error, sizeof create_error, "%s", msg);
    WARN(comm->rank, "%s", msg);
    shm_publish_error(comm, msg);
  }
  return res;
}

const char *chorus_comm_error(const chorus_comm_t *comm) {
  if (!comm) return create_error;
  return comm->errbuf;
}

int chorus_comm_rank(const chorus_comm_t *comm) { return comm ? comm->rank : -1; }
int chorus_comm_size(const chorus_comm_t *comm) { return comm ? comm->nranks : -1; }
uint64_t chorus_comm_seq(const chorus_comm_t *comm) { return comm ? atomic_load(&comm->seq) : 0; }
void chorus_comm_set_timeout(chorus_comm_t *comm, int timeout_ms) {
  if (comm && timeout_ms > 0) comm->timeout_ms = timeout_ms;
}

static void read_host_id(char *hostid, size_t cap, char *hostname, size_t hcap) {
  char host[64] = "unknown", boot[64] = "";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = 0;
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = read(fd, boot, sizeof boot - 1);
    if (n > 0) {
      boot[n] = 0;
      char *nl = strchr(boot, '\n');
      if (nl) *nl = 0;
    }
    close(fd);
  }
  snprintf(hostid, cap, "%s|%s", host, boot);
  snprintf(hostname, hcap, "%s", host);
  /* CHORUS_HOSTID: containers sharing one kernel, or tests simulating several hosts */
  const char *forced = param_str(PARAM_HOSTID);
  if (forced[0]) {
    snprintf(hostid, cap, "forced|%s", forced);
    snprintf(hostname, hcap, "%s", forced);
  }
}

static int timeout_from(const chorus_comm_options_t *opts) {
  int64_t env_s = param_int(PARAM_TIMEOUT);
  if (env_s > 0) return (int)(env_s * 1000 > 2000000000 ? 2000000000 : env_s * 1000);
  if (opts && opts->timeout_ms > 0) return opts->timeout_ms;
  return 1800 * 1000;
}

static void comm_free(struct chorus_comm *comm) {
  trace_unregister(comm); /* first: waits for a dump that is reading this communicator */
  engine_stop(comm, 1);
  workers_stop(comm);
  cuda_teardown(comm); /* before shm: it reads the peers' flags */
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    if (!comm->conns[ch]) continue;
    for (int p = 0; p < comm->nranks; p++)
      if (comm->conns[ch][p]) comm->conns[ch][p]->ops->close(comm->conns[ch][p]);
    free(comm->conns[ch]);
  }
  socket_teardown(comm);
  reg_teardown(comm); /* before the NICs' protection domains go */
  ib_teardown(comm);
  shm_teardown(comm);
  if (comm->bs_owner && comm->bs.release) comm->bs.release(comm->bs.ctx);
  free(comm->peers);
  free(comm->local_rank_of);
  free(comm->host_of);
  tune_fini(comm);
  trace_fini(comm);
  free(comm->global_ranks);
  pthread_mutex_destroy(&comm->mu);
  pthread_mutex_destroy(&comm->err_mu);
  pthread_mutex_destroy(&comm->reg_mu);
  pthread_cond_destroy(&comm->idle_cv);
  pthread_mutex_destroy(&comm->run_mu);
  free(comm);
}

/* From the peer table and host_of, per host: its rank count and the cores of the union of
 * its ranks' affinity masks (a cpuset shared by every rank counts once, per-rank bindings
 * add up). They give this host's local_cores, max_per_host, and all_spin: whether every
 * rank's engine spins, by spin_count_for applied to each rank's CHORUS_SPIN_COUNT and host.
 * Every rank computes the same max_per_host and all_spin, so the tuner, which takes faster
 * socket constants for spinning engines, makes the same choice everywhere. */
static chorus_result_t tally_hosts(struct chorus_comm *comm) {
  const int n = comm->nranks, nh = comm->nhosts;
  int *count = calloc((size_t)nh, sizeof(int));
  long *cores = calloc((size_t)nh, sizeof(long));
  uint8_t *mask = calloc((size_t)nh, CPU_MASK_BYTES);
  if (!count || !cores || !mask) {
    free(count);
    free(cores);
    free(mask);
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  }
  for (int r = 0; r < n; r++) {
    const int h = comm->host_of[r];
    count[h]++;
    uint8_t *m = mask + (size_t)h * CPU_MASK_BYTES;
    for (int b = 0; b < CPU_MASK_BYTES; b++) m[b] |= comm->peers[r].cpus[b];
  }
  comm->max_per_host = 0;
  for (int h = 0; h < nh; h++) {
    for (int b = 0; b < CPU_MASK_BYTES; b++)
      cores[h] += __builtin_popcount(mask[(size_t)h * CPU_MASK_BYTES + b]);
    if (count[h] > comm->max_per_host) comm->max_per_host = count[h];
  }
  comm->local_cores = cores[comm->host_of[comm->rank]];
  comm->all_spin = 1;
  for (int r = 0; r < n; r++) {
    const int h = comm->host_of[r];
    if (spin_count_for(comm->peers[r].spin_param, count[h], cores[h]) <= 0) comm->all_spin = 0;
  }
  free(count);
  free(cores);
  free(mask);
  return CHORUS_SUCCESS;
}

static uint64_t hostid_hash(const char *id) { /* FNV-1a */
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char *p = (const unsigned char *)id; *p; p++) h = (h ^ *p) * 1099511628211ull;
  return h;
}

/* Numbers the hosts of a peer table in order of their lowest rank, the same on every rank:
 * host_of[r] for each rank, and the count as the result (-1: out of memory). One pass over
 * an open-addressing table of the host ids (at most half full), so 4096 ranks cost 4096
 * lookups rather than comparing every rank with the ranks before it. */
int number_hosts(const struct peer_info *peers, int n, int *host_of) {
  size_t cap = 16;
  while (cap < 2 * (size_t)n) cap *= 2;
  int *slot = malloc(cap * sizeof(int)); /* a rank of the host, or -1 */
  if (!slot) return -1;
  for (size_t i = 0; i < cap; i++) slot[i] = -1;
  int nhosts = 0;
  for (int r = 0; r < n; r++) {
    size_t i = (size_t)hostid_hash(peers[r].hostid) & (cap - 1);
    while (slot[i] >= 0 && strcmp(peers[slot[i]].hostid, peers[r].hostid) != 0)
      i = (i + 1) & (cap - 1);
    if (slot[i] < 0) {
      slot[i] = r;
      host_of[r] = nhosts++;
    } else {
      host_of[r] = host_of[slot[i]];
    }
  }
  free(slot);
  return nhosts;
}

static chorus_result_t comm_init(struct chorus_comm *comm, const chorus_comm_options_t *opts) {
  int me = comm->rank, n = comm->nranks;
  CHECK(tune_check_params(comm));
  /* Secret and nonce: rank 0 draws them, everyone reads them from the store. */
  uint8_t blob[40];
  if (me == 0) {
    if (getrandom(blob, sizeof blob, 0) != (ssize_t)sizeof blob)
      return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank 0: getrandom failed: %s",
                            strerror(errno));
    CHECK(bs_set(comm, "secret", blob, sizeof blob));
  } else {
    CHECK(bs_get(comm, "secret", blob, sizeof blob));
  }
  memcpy(comm->secret, blob, 32);
  memcpy(&comm->job_nonce, blob + 32, 8);

  struct peer_info mine;
  memset(&mine, 0, sizeof mine);
  read_host_id(mine.hostid, sizeof mine.hostid, mine.hostname, sizeof mine.hostname);
  mine.pid = (int32_t)getpid();
  mine.shm_ok = param_int(PARAM_SHM_DISABLE) ? 0 : 1;
  const int64_t spin_param = param_int(PARAM_SPIN_COUNT);
  mine.spin_param = spin_param < 0 ? -1 : spin_param > INT32_MAX ? INT32_MAX : (int32_t)spin_param;
  const long my_cores = cpu_mask_of_process(mine.cpus);
  if (n > 1) CHECK(socket_listen(comm, &mine));
  comm->peers = calloc((size_t)n, sizeof(struct peer_info));
  comm->local_rank_of = calloc((size_t)n, sizeof(int));
  comm->host_of = calloc((size_t)n, sizeof(int));
  for (int ch = 0; ch < CHAN_COUNT; ch++) comm->conns[ch] = calloc((size_t)n, sizeof(conn_t *));
  if (!comm->peers || !comm->local_rank_of || !comm->host_of || !comm->conns[0] || !comm->conns[1])
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
  CHECK(bs_allgather(comm, "peers", &mine, comm->peers, sizeof mine));
  for (int r = 0; r < n; r++) { /* every string of the table ends within its field */
    struct peer_info *pi = &comm->peers[r];
    pi->hostid[sizeof pi->hostid - 1] = pi->sock_addr[sizeof pi->sock_addr - 1] =
        pi->hostname[sizeof pi->hostname - 1] = '\0';
  }
  comm->nhosts = number_hosts(comm->peers, n, comm->host_of);
  if (comm->nhosts < 0) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
  comm->nlocal = 0; /* this host's ranks, numbered in rank order */
  for (int r = 0; r < n; r++)
    comm->local_rank_of[r] = comm->host_of[r] == comm->host_of[me] ? comm->nlocal++ : -1;
  CHECK(tally_hosts(comm));
  INFO(SUB_INIT, me, "%ld cores for the %d ranks on this host (the union of their affinity "
       "masks; this rank may use %ld)", comm->local_cores, comm->nlocal, my_cores);
  if (n > 1) {
    CHECK(shm_setup(comm));
    CHECK(ib_setup(comm));
    CHECK(socket_connect_all(comm));
  }
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    if (!comm->conns[CHAN_COLL][p] || !comm->conns[CHAN_P2P][p])
      return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: no transport reaches rank %d",
                            me, p);
    INFO(SUB_INIT, me, "peer %d (%s) via %s", p, comm->peers[p].hostname,
         comm->conns[CHAN_COLL][p]->ops->name);
  }
  CHECK(tune_init(comm));
  CHECK(trace_init(comm));
  CHECK(trace_signal_setup(comm));
  CHECK(engine_start(comm));
  INFO(SUB_INIT, me, "communicator %s ready: %d ranks, %d on this host, timeout %d ms",
       comm->name[0] ? comm->name : "-", n, comm->nlocal, comm->timeout_ms);
  (void)opts;
  return CHORUS_SUCCESS;
}

static chorus_result_t comm_new(int rank, int nranks, const chorus_bootstrap_t *bs,
                                const char *prefix, const chorus_comm_options_t *opts,
                                int bs_owner, chorus_comm_t **out) {
  *out = NULL;
  struct chorus_comm *comm = calloc(1, sizeof(*comm));
  if (!comm) return comm_set_error(NULL, CHORUS_ERR_NOMEM, "rank %d: out of memory", rank);
  comm->rank = rank;
  comm->nranks = nranks;
  comm->bs = *bs;
  comm->bs_owner = bs_owner;
  comm->wake_fd = -1;
  snprintf(comm->prefix, sizeof comm->prefix, "%s", prefix);
  if (opts && opts->name) snprintf(comm->name, sizeof comm->name, "%s", opts->name);
  comm->timeout_ms = timeout_from(opts);
  pthread_mutex_init(&comm->mu, NULL);
  pthread_mutex_init(&comm->err_mu, NULL);
  pthread_mutex_init(&comm->reg_mu, NULL);
  pthread_cond_init(&comm->idle_cv, NULL);
  pthread_mutex_init(&comm->run_mu, NULL);
  chorus_result_t res = comm_init(comm, opts);
  if (res != CHORUS_SUCCESS) {
    snprintf(create_error, sizeof create_error, "%s",
             comm->errbuf[0] ? comm->errbuf : chorus_result_string(res));
    comm->bs_owner = 0; /* the caller still owns the bootstrap on failure */
    comm_free(comm);
    return res;
  }
  trace_register(comm);
  *out = comm;
  return CHORUS_SUCCESS;
}

chorus_result_t chorus_comm_create(int rank, int nranks, const chorus_bootstrap_t *bootstrap,
                                   const chorus_comm_options_t *opts, chorus_comm_t **comm) {
  if (!comm) return CHORUS_ERR_INVALID;
  *comm = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return comm_set_error(NULL, CHORUS_ERR_INVALID,
                          "chorus_comm_create: rank %d is not in [0, %d)", rank, nranks);
  if (!bootstrap || !bootstrap->set || !bootstrap->get)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_comm_create: no bootstrap given");
  return comm_new(rank, nranks, bootstrap, "chorus", opts, 0, comm);
}

chorus_result_t chorus_comm_abort(chorus_comm_t *comm) {
  if (!comm) return CHORUS_ERR_INVALID;
  comm_set_error(comm, CHORUS_ERR_ABORTED, "communicator aborted on rank %d", comm->rank);
  atomic_store(&comm->aborted, 1);
  pthread_mutex_lock(&comm->mu);
  pthread_cond_broadcast(&comm->idle_cv);
  pthread_mutex_unlock(&comm->mu);
  engine_wake(comm);
  return CHORUS_SUCCESS;
}

chorus_result_t chorus_comm_destroy(chorus_comm_t *comm) {
  if (!comm) return CHORUS_ERR_INVALID;
  engine_stop(comm, 0);
  chorus_result_t res = atomic_load(&comm->failed) ? comm->err : CHORUS_SUCCESS;
  if (res == CHORUS_ERR_ABORTED) res = CHORUS_SUCCESS;
  comm_free(comm);
  return res;
}

struct split_entry {
  int32_t color, key, rank;
};

static int cmp_entry(const void *a, const void *b) {
  const struct split_entry *x = a, *y = b;
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  return x->rank < y->rank ? -1 : (x->rank > y->rank);
}

chorus_result_t chorus_comm_split(chorus_comm_t *comm, int color, int key,
                                  const chorus_comm_options_t *opts, chorus_comm_t **newcomm) {
  if (!comm || !newcomm) return CHORUS_ERR_INVALID;
  *newcomm = NULL;
  if (atomic_load(&comm->failed)) return comm->err;
  uint64_t k = comm->nsplits++;
  char tag[64];
  snprintf(tag, sizeof tag, "split%llu", (unsigned long long)k);
  struct split_entry mine = {color < 0 ? -1 : color, key, comm->rank};
  struct split_entry *all = calloc((size_t)comm->nranks, sizeof(*all));
  if (!all) return CHORUS_ERR_NOMEM;
  chorus_result_t res = bs_allgather(comm, tag, &mine, all, sizeof mine);
  if (res != CHORUS_SUCCESS || color < 0) {
    free(all);
    return res;
  }
  int m = 0;
  for (int r = 0; r < comm->nranks; r++)
    if (all[r].color == color) all[m++] = all[r];
  qsort(all, (size_t)m, sizeof(*all), cmp_entry);
  int newrank = -1;
  int *granks = comm->global_ranks ? malloc((size_t)m * sizeof(int)) : NULL;
  for (int i = 0; i < m; i++) {
    if (all[i].rank == comm->rank) newrank = i;
    if (granks) granks[i] = comm->global_ranks[all[i].rank];
  }
  free(all);
  char prefix[96];
  snprintf(prefix, sizeof prefix, "%.60s/s%llu.%d", comm->prefix, (unsigned long long)k, color);
  chorus_comm_options_t o = {0};
  if (opts) o = *opts;
  if (o.timeout_ms <= 0) o.timeout_ms = comm->timeout_ms;
  res = comm_new(newrank, m, &comm->bs, prefix, &o, 0, newcomm);
  if (res == CHORUS_SUCCESS && granks) chorus_comm_set_global_ranks(*newcomm, granks, m);
  free(granks);
  return res;
}
