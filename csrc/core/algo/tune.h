/* tune.h - the tuner's internals, shared by tune.c and its unit test: the topology facts a
 * choice depends on, the cost model and its constants, and the parsed CHORUS_ALGO. */
#ifndef CHORUS_TUNE_H
#define CHORUS_TUNE_H

#include "algo.h"

/* What a choice may depend on besides the collective and its size: facts that are equal on
 * every rank (they come from the all-gathered peer table). */
struct tune_topo {
  int nranks;
  int nhosts;
  int per_host;   /* most ranks on one host */
  int shm;        /* ranks of a host talk through shared memory (every rank allows it) */
  int spin;       /* every rank's engine spins (a core each): the faster socket constants */
};

/* One transport: latency of a step (a message and its reply depend on it), CPU overhead of
 * each further message a rank posts in the same step, streaming bandwidth. */
struct tune_link {
  double lat_us;
  double ovh_us;
  double gbps;    /* GB/s (1e9 bytes per second) */
};
struct tune_model {
  struct tune_link shm;     /* same host, shared-memory rings */
  struct tune_link sock;    /* same host, TCP over loopback (CHORUS_SHM_DISABLE=1) */
  struct tune_link sock_spin; /* the same where every rank's engine spins */
  struct tune_link net;     /* between hosts, TCP */
  double reduce_gbps;       /* reduce_n, input bytes per second */
  double copy_gbps;         /* memcpy */
};
extern const struct tune_model tune_measured; /* the constants measured on the dev machine */

/* CHORUS_ALGO parsed: per collective, the set of algorithms allowed (0: no restriction)
 * and the one forced (when the set has one member), else -1. */
struct tune_force {
  uint32_t allow[OP_KIND_COUNT];
  int force[OP_KIND_COUNT];
};
/* Parses a CHORUS_ALGO value. Returns 0, or -1 with the reason in err. Names that NCCL knows
 * but Chorus has no counterpart for are skipped with a note in warn ("" if none). */
int tune_parse_algo(const char *text, struct tune_force *out, char *err, size_t err_cap,
                    char *warn, size_t warn_cap);
/* Parses CHORUS_TUNE_MODEL over *model (fields not named keep their value). 0 or -1. */
int tune_parse_model(const char *text, struct tune_model *model, char *err, size_t err_cap);

/* Collective name ("all_reduce", "allreduce", "AllReduce", "bcast") to enum op_kind, or -1. */
int tune_collective_from_name(const char *name);

/* Predicted microseconds of algorithm id running collective kind over bytes on topo, or
 * -1 if the model has no estimate for that pair. bytes: the larger buffer of one rank. */
double tune_cost(const struct tune_model *m, const struct tune_topo *t, enum op_kind kind,
                 int id, double bytes);
/* Does the topology allow algorithm id for kind (ignoring whether it is implemented)? */
int tune_topo_ok(const struct tune_topo *t, enum op_kind kind, int id);

/* The choice among the algorithms in usable (bit per id): the forced one if usable, else
 * the cheapest allowed one, else the cheapest usable one. fell_back: CHORUS_ALGO named
 * something that cannot run here. Never fails: ALGO_DIRECT if usable is empty. */
struct tune_pick {
  int id;
  double us;       /* predicted; -1 if unmodelled */
  int forced;      /* chosen because CHORUS_ALGO said so */
  int fell_back;
};
struct tune_pick tune_decide(const struct tune_model *m, const struct tune_topo *t,
                             enum op_kind kind, double bytes, uint32_t usable,
                             const struct tune_force *f);
/* Usable ids of mask ordered by predicted time (unmodelled last, ties by id): writes at
 * most cap ids and their costs, returns how many. */
int tune_rank(const struct tune_model *m, const struct tune_topo *t, enum op_kind kind,
              double bytes, uint32_t mask, int *ids, double *costs, int cap);

#endif
