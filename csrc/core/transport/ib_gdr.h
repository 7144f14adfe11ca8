/* ib_gdr.h - GPUDirect RDMA for the verbs transport: which way device memory could be
 * registered (CHORUS_NET_GDR_LEVEL, dma-buf, nvidia-peermem), and the registration itself.
 * Not reached by the data path yet (device buffers are staged through host memory between
 * hosts); ib.c logs the mode at setup. Needs a GPU and an RDMA NIC to run for real. */
#ifndef CHORUS_IB_GDR_H
#define CHORUS_IB_GDR_H

#include <stddef.h>
#include <stdint.h>

#include "ib_verbs.h"

enum ib_gdr_mode { IB_GDR_OFF = 0, IB_GDR_DMABUF = 1, IB_GDR_PEERMEM = 2 };

/* The mode for this host: level is CHORUS_NET_GDR_LEVEL ("" = allowed where possible; LOC or
 * 0 = never; PIX, PXB, PHB, SYS or 1-5 = allowed: without a PCI topology model every level
 * above LOC allows it), sysroot prefixes the /sys paths probed ("" for the real ones).
 * dma-buf wins where the library exports ibv_reg_dmabuf_mr, else nvidia-peermem where its
 * module is loaded. *why (static or in buf) says how the mode was chosen. */
enum ib_gdr_mode ib_gdr_mode(const struct ib_api *api, const char *level, const char *sysroot,
                             char *buf, size_t cap, const char **why);
const char *ib_gdr_mode_name(enum ib_gdr_mode m);

/* Registers device memory [ptr, ptr + len) on pd for remote writes: with dma-buf, through the
 * exporter's dmabuf_fd at offset (the CUDA driver's cuMemGetHandleForAddressRange gives both);
 * with nvidia-peermem, as plain ibv_reg_mr of the device pointer. NULL on failure (errno). */
struct cv_mr *ib_reg_device_memory(const struct ib_api *api, enum ib_gdr_mode mode,
                                   struct cv_pd *pd, void *ptr, size_t len, int dmabuf_fd,
                                   uint64_t offset);

#endif /* CHORUS_IB_GDR_H */
