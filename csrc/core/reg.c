/* reg.c - buffers the caller registers with a communicator (chorus_comm_register), so that
 * network transports able to send straight from user memory may do so: the verbs transport
 * RDMA-writes a registered buffer's bytes without copying them into its rings.
 *
 * Registrations are reference counted and shared: registering a range that an existing
 * registration covers takes another reference on it rather than pinning the pages again.
 * A send that uses a registration holds a reference for as long as the NIC may still read
 * the buffer, so deregistering while such a send is in flight only drops the caller's
 * reference; the memory regions go when the last reference does. The registry is guarded
 * by comm->reg_mu (the caller's thread registers, the engine thread looks up). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "core.h"

static uintptr_t page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (uintptr_t)p : 4096u;
}

/* Unlinks and frees r; comm->reg_mu held. */
static void reg_free(struct chorus_comm *comm, struct chorus_reg *r) {
  for (struct chorus_reg **pp = &comm->regs; *pp; pp = &(*pp)->next)
    if (*pp == r) {
      *pp = r->next;
      break;
    }
  ib_reg_release(comm, r);
  free(r);
}

/* The caller's live registration that covers [start, end), or NULL; comm->reg_mu held. */
static struct chorus_reg *covering(struct chorus_comm *comm, uintptr_t start, uintptr_t end) {
  for (struct chorus_reg *r = comm->regs; r; r = r->next)
    if (r->user > 0 && r->start <= start && end <= r->end) return r;
  return NULL;
}

chorus_result_t chorus_comm_register(chorus_comm_t *comm, const void *ptr, size_t bytes,
                                     void **handle) {
  if (!handle) return comm_set_error(NULL, CHORUS_ERR_INVALID, "register: handle is NULL");
  *handle = NULL;
  if (!comm) return comm_set_error(NULL, CHORUS_ERR_INVALID, "register: communicator is NULL");
  if (!ptr || bytes == 0)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "register: rank %d: %s", comm->rank,
                          ptr ? "0 bytes" : "buffer is NULL");
  uintptr_t pg = page_size(), s = (uintptr_t)ptr;
  if (bytes > UINTPTR_MAX - s - pg)
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "register: rank %d: %zu bytes at %p wrap "
                          "around the address space", comm->rank, bytes, ptr);
  uintptr_t start = s & ~(pg - 1), end = (s + bytes + pg - 1) & ~(pg - 1);
  chorus_result_t res = CHORUS_SUCCESS;
  pthread_mutex_lock(&comm->reg_mu);
  struct chorus_reg *r = covering(comm, start, end);
  if (r) {
    r->user++;
    r->refs++;
    *handle = r;
    goto out;
  }
  r = calloc(1, sizeof *r);
  if (!r) {
    res = comm_set_error(NULL, CHORUS_ERR_NOMEM, "register: rank %d: out of memory", comm->rank);
    goto out;
  }
  r->start = start;
  r->end = end;
  r->user = 1;
  r->refs = 1;
  res = ib_reg_create(comm, r);
  if (res != CHORUS_SUCCESS) {
    free(r);
    goto out;
  }
  r->next = comm->regs;
  comm->regs = r;
  comm->nregs_made++;
  *handle = r;
out:
  pthread_mutex_unlock(&comm->reg_mu);
  return res;
}

chorus_result_t chorus_comm_deregister(chorus_comm_t *comm, void *handle) {
  if (!comm) return comm_set_error(NULL, CHORUS_ERR_INVALID, "deregister: communicator is NULL");
  chorus_result_t res = CHORUS_SUCCESS;
  pthread_mutex_lock(&comm->reg_mu);
  struct chorus_reg *r = comm->regs;
  while (r && r != handle) r = r->next;
  if (!r || r->user <= 0) {
    res = comm_set_error(NULL, CHORUS_ERR_INVALID, "deregister: rank %d: %p is not a "
                         "registration held on this communicator", comm->rank, handle);
  } else {
    r->user--;
    if (--r->refs == 0) reg_free(comm, r);
  }
  pthread_mutex_unlock(&comm->reg_mu);
  return res;
}

struct chorus_reg *reg_find(struct chorus_comm *comm, const void *ptr, size_t bytes) {
  uintptr_t s = (uintptr_t)ptr;
  if (!ptr || !bytes || bytes > UINTPTR_MAX - s) return NULL;
  pthread_mutex_lock(&comm->reg_mu);
  struct chorus_reg *r = covering(comm, s, s + bytes);
  if (r) r->refs++;
  pthread_mutex_unlock(&comm->reg_mu);
  return r;
}

void reg_put(struct chorus_comm *comm, struct chorus_reg *r) {
  if (!r) return;
  pthread_mutex_lock(&comm->reg_mu);
  if (--r->refs == 0) reg_free(comm, r);
  pthread_mutex_unlock(&comm->reg_mu);
}

void reg_teardown(struct chorus_comm *comm) {
  pthread_mutex_lock(&comm->reg_mu);
  int left = 0;
  while (comm->regs) {
    left += comm->regs->user;
    reg_free(comm, comm->regs);
  }
  pthread_mutex_unlock(&comm->reg_mu);
  if (left)
    INFO(SUB_INIT, comm->rank, "destroy: %d buffer registration%s still held; released", left,
         left == 1 ? "" : "s");
}
