/* ib_wrap.c - loads libibverbs with dlopen (CHORUS_IBVERBS_LIB, default libibverbs.so.1)
 * and resolves the entry points of struct ib_api. Required symbols missing: verbs are
 * unavailable. Optional, newer ones (dma-buf registration, the extended GID query) may be
 * absent. The library is loaded once per process and never unloaded (providers keep threads
 * and handles that outlive any one communicator). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "ib_verbs.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct ib_api api;
static int api_ok;
static char api_why[600];

/* dlsym returns void *; converting it to a function pointer is what POSIX requires to work */
#define RESOLVE(field, name, required)                                          \
  do {                                                                          \
    void *sym_ = dlsym(h, name);                                                \
    if (!sym_ && (required)) {                                                  \
      snprintf(api_why, sizeof api_why, "%s lacks %s", lib, name);              \
      goto fail;                                                                \
    }                                                                           \
    memcpy(&api.field, &sym_, sizeof sym_);                                     \
  } while (0)

static void load(void) {
  const char *lib = param_str(PARAM_IBVERBS_LIB);
  if (!lib[0]) lib = "libibverbs.so.1";
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(api_why, sizeof api_why, "cannot load %s: %s", lib, e ? e : "unknown error");
    return;
  }
  api.handle = h;
  RESOLVE(get_device_list, "ibv_get_device_list", 1);
  RESOLVE(free_device_list, "ibv_free_device_list", 1);
  RESOLVE(get_device_name, "ibv_get_device_name", 1);
  RESOLVE(open_device, "ibv_open_device", 1);
  RESOLVE(close_device, "ibv_close_device", 1);
  RESOLVE(query_port, "ibv_query_port", 1);
  RESOLVE(query_gid, "ibv_query_gid", 1);
  RESOLVE(alloc_pd, "ibv_alloc_pd", 1);
  RESOLVE(dealloc_pd, "ibv_dealloc_pd", 1);
  RESOLVE(reg_mr, "ibv_reg_mr", 1);
  RESOLVE(dereg_mr, "ibv_dereg_mr", 1);
  RESOLVE(create_cq, "ibv_create_cq", 1);
  RESOLVE(destroy_cq, "ibv_destroy_cq", 1);
  RESOLVE(create_qp, "ibv_create_qp", 1);
  RESOLVE(modify_qp, "ibv_modify_qp", 1);
  RESOLVE(destroy_qp, "ibv_destroy_qp", 1);
  RESOLVE(wc_status_str, "ibv_wc_status_str", 1);
  RESOLVE(query_gid_ex, "_ibv_query_gid_ex", 0);
  RESOLVE(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 0);
  api_ok = 1;
  snprintf(api_why, sizeof api_why, "%s loaded%s%s", lib,
           api.reg_dmabuf_mr ? "" : " (no ibv_reg_dmabuf_mr: dma-buf registration unavailable)",
           api.query_gid_ex ? "" : " (no _ibv_query_gid_ex: GID types read from sysfs)");
  return;
fail:
  dlclose(h);
  memset(&api, 0, sizeof api);
}

const struct ib_api *ib_api_get(const char **why) {
  pthread_once(&once, load);
  if (why) *why = api_why;
  return api_ok ? &api : NULL;
}

const char *ib_wc_status_name(int status) {
  const char *s = api_ok && api.wc_status_str ? api.wc_status_str(status) : NULL;
  return s ? s : "unknown status";
}
