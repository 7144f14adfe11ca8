/* bootstrap.c - small collectives over the out-of-band key/value exchange (the c10d
 * Store through the binding's callbacks, or the built-in TCP rendezvous): used only while
 * creating and splitting communicators, never on the data path. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

static void full_key(struct chorus_comm *comm, const char *key, char *out, size_t cap) {
  snprintf(out, cap, "%s/%s", comm->prefix, key);
}

chorus_result_t bs_set(struct chorus_comm *comm, const char *key, const void *val, size_t len) {
  char k[256];
  full_key(comm, key, k, sizeof k);
  chorus_result_t res = comm->bs.set(comm->bs.ctx, k, val, len);
  if (res != CHORUS_SUCCESS)
    return comm_set_error(comm, res, "rank %d: bootstrap store set of '%s' failed", comm->rank, k);
  return CHORUS_SUCCESS;
}

chorus_result_t bs_get(struct chorus_comm *comm, const char *key, void *buf, size_t len) {
  char k[256];
  size_t got = 0;
  full_key(comm, key, k, sizeof k);
  chorus_result_t res = comm->bs.get(comm->bs.ctx, k, buf, len, &got, comm->timeout_ms);
  if (res != CHORUS_SUCCESS)
    return comm_set_error(comm, res,
                          "rank %d: bootstrap store get of '%s' failed (%s): a rank did not "
                          "arrive within %d ms",
                          comm->rank, k, chorus_result_string(res), comm->timeout_ms);
  if (got != len)
    return comm_set_error(comm, CHORUS_ERR_MISMATCH,
                          "rank %d: bootstrap value '%s' has %zu bytes, expected %zu (ranks run "
                          "different Chorus versions?)",
                          comm->rank, k, got, len);
  return CHORUS_SUCCESS;
}

chorus_result_t bs_try_set(struct chorus_comm *comm, const char *key, const void *val,
                           size_t len) {
  char k[256];
  full_key(comm, key, k, sizeof k);
  return comm->bs.set ? comm->bs.set(comm->bs.ctx, k, val, len) : CHORUS_ERR_UNSUPPORTED;
}

chorus_result_t bs_try_get(struct chorus_comm *comm, const char *key, void *buf, size_t cap,
                           size_t *len, int timeout_ms) {
  char k[256];
  full_key(comm, key, k, sizeof k);
  *len = 0;
  return comm->bs.get ? comm->bs.get(comm->bs.ctx, k, buf, cap, len, timeout_ms)
                      : CHORUS_ERR_UNSUPPORTED;
}

chorus_result_t bs_allgather(struct chorus_comm *comm, const char *tag, const void *mine,
                             void *out, size_t len) {
  char key[160];
  snprintf(key, sizeof key, "%s/%d", tag, comm->rank);
  CHECK(bs_set(comm, key, mine, len));
  for (int r = 0; r < comm->nranks; r++) {
    uint8_t *dst = (uint8_t *)out + (size_t)r * len;
    if (r == comm->rank) {
      memcpy(dst, mine, len);
      continue;
    }
    snprintf(key, sizeof key, "%s/%d", tag, r);
    CHECK(bs_get(comm, key, dst, len));
  }
  return CHORUS_SUCCESS;
}

chorus_result_t bs_barrier(struct chorus_comm *comm, const char *tag) {
  uint8_t one = 1;
  uint8_t *all = malloc((size_t)comm->nranks);
  if (!all) return CHORUS_ERR_NOMEM;
  chorus_result_t res = bs_allgather(comm, tag, &one, all, 1);
  free(all);
  return res;
}
