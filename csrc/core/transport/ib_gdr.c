/* ib_gdr.c - GPUDirect RDMA mode choice and device-memory registration (see ib_gdr.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "ib_gdr.h"

const char *ib_gdr_mode_name(enum ib_gdr_mode m) {
  return m == IB_GDR_DMABUF ? "dma-buf" : m == IB_GDR_PEERMEM ? "nvidia-peermem" : "off";
}

static int path_exists(const char *sysroot, const char *path) {
  char full[512];
  snprintf(full, sizeof full, "%s%s", sysroot ? sysroot : "", path);
  return access(full, F_OK) == 0;
}

enum ib_gdr_mode ib_gdr_mode(const struct ib_api *api, const char *level, const char *sysroot,
                             char *buf, size_t cap, const char **why) {
  static const char *const allowed[] = {"PIX", "PXB", "PHB", "SYS", "1", "2", "3", "4", "5"};
  const char *lv = level ? level : "";
  if (strcasecmp(lv, "LOC") == 0 || strcmp(lv, "0") == 0) {
    *why = "NET_GDR_LEVEL forbids it";
    return IB_GDR_OFF;
  }
  if (lv[0]) {
    int ok = 0;
    for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++)
      if (strcasecmp(lv, allowed[i]) == 0) ok = 1;
    if (!ok) {
      snprintf(buf, cap, "NET_GDR_LEVEL '%s' is not LOC, PIX, PXB, PHB, SYS or 0-5", lv);
      *why = buf;
      return IB_GDR_OFF;
    }
  }
  if (api && api->reg_dmabuf_mr) {
    *why = "libibverbs has ibv_reg_dmabuf_mr";
    return IB_GDR_DMABUF;
  }
  if (path_exists(sysroot, "/sys/module/nvidia_peermem") ||
      path_exists(sysroot, "/sys/kernel/mm/memory_peers/nv_mem/version")) {
    *why = "no ibv_reg_dmabuf_mr; the nvidia-peermem module is loaded";
    return IB_GDR_PEERMEM;
  }
  *why = "neither ibv_reg_dmabuf_mr nor nvidia-peermem";
  return IB_GDR_OFF;
}

struct cv_mr *ib_reg_device_memory(const struct ib_api *api, enum ib_gdr_mode mode,
                                   struct cv_pd *pd, void *ptr, size_t len, int dmabuf_fd,
                                   uint64_t offset) {
  const int access = CV_ACCESS_LOCAL_WRITE | CV_ACCESS_REMOTE_WRITE;
  if (mode == IB_GDR_DMABUF && api->reg_dmabuf_mr && dmabuf_fd >= 0)
    return api->reg_dmabuf_mr(pd, offset, len, (uint64_t)(uintptr_t)ptr, dmabuf_fd, access);
  if (mode == IB_GDR_PEERMEM) return api->reg_mr(pd, ptr, len, access);
  errno = ENOTSUP;
  return NULL;
}
