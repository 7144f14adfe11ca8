/* msg.c - framed messages over a transport connection: a 32-byte header that carries
 * the operation's fingerprint (sequence, kind, dtype, op, root, count) and the payload
 * length, then the payload padded to 16 bytes. Receivers validate every header field
 * before touching payload, so ranks that disagree fail with both sides named. */
#include <stdio.h>
#include <string.h>

#include "core.h"

#define PAD16(x) (((x) + 15u) & ~(size_t)15u)
/* Payload left to move at or above which a transport's direct path is used (it saves a
 * copy through the ring but costs a system call for whatever arrives). */
#define DIRECT_MIN ((size_t)64 << 10)

static void fill_hdr(struct msg_hdr *h, const struct op *op, size_t len) {
  memset(h, 0, sizeof(*h));
  h->magic = MSG_MAGIC;
  h->seq = (uint32_t)op->seq;
  h->kind = (uint8_t)op->kind;
  h->dtype = (uint8_t)op->dtype;
  h->redop = (uint8_t)op->op.kind;
  h->root = (op->kind == OP_SEND || op->kind == OP_RECV) ? op->tag : op->root;
  h->count = op->count;
  h->len = len;
  if (op->kind != OP_SEND && op->kind != OP_RECV) h->flags = (uint8_t)op->algo;
}

void msg_tx_init(struct msg_tx *tx, conn_t *c, const struct op *op, const void *buf, size_t len) {
  memset(tx, 0, sizeof(*tx));
  tx->c = c;
  fill_hdr(&tx->hdr, op, len);
  if (op->kind == OP_SEND) tx->hdr.kind = OP_RECV; /* what the receiver runs */
  tx->buf = (const uint8_t *)buf;
  tx->len = len;
}

void msg_rx_init(struct msg_rx *rx, conn_t *c, const struct op *op, size_t len) {
  memset(rx, 0, sizeof(*rx));
  rx->c = c;
  fill_hdr(&rx->expect, op, len);
  rx->len = len;
}

chorus_result_t msg_stream_write(conn_t *c, const void *src, size_t n, size_t *wrote) {
  *wrote = 0;
  while (*wrote < n) {
    void *p;
    size_t avail;
    CHECK(c->ops->reserve(c, &p, &avail));
    if (avail == 0) break;
    size_t k = n - *wrote < avail ? n - *wrote : avail;
    if (src) memcpy(p, (const uint8_t *)src + *wrote, k);
    else memset(p, 0, k);
    CHECK(c->ops->commit(c, k));
    *wrote += k;
  }
  return CHORUS_SUCCESS;
}

chorus_result_t msg_tx_progress(struct msg_tx *tx, int *progressed) {
  if (tx->done) return CHORUS_SUCCESS;
  const size_t hl = sizeof(struct msg_hdr);
  const size_t total = hl + PAD16(tx->len);
  while (tx->pos < total) {
    size_t w = 0;
    if (tx->pos < hl) {
      CHECK(msg_stream_write(tx->c, (const uint8_t *)&tx->hdr + tx->pos, hl - tx->pos, &w));
    } else if (tx->pos < hl + tx->len) {
      size_t rem = hl + tx->len - tx->pos;
      /* once direct, direct to the end: the transport polls for it until then */
      if ((rem >= DIRECT_MIN || tx->direct) && tx->c->ops->write_direct) {
        tx->direct = 1;
        CHECK(tx->c->ops->write_direct(tx->c, tx->buf + (tx->pos - hl), rem, &w, progressed));
      } else {
        CHECK(msg_stream_write(tx->c, tx->buf + (tx->pos - hl), rem, &w));
      }
    } else {
      CHECK(msg_stream_write(tx->c, NULL, total - tx->pos, &w));
    }
    if (w == 0) break;
    tx->pos += w;
    *progressed = 1;
  }
  if (tx->pos == total) tx->done = 1;
  return CHORUS_SUCCESS;
}

static const char *kind_str(unsigned k) {
  return k < OP_KIND_COUNT ? op_kind_name((enum op_kind)k) : "unknown";
}
static const char *dtype_str(unsigned d) {
  return d < CHORUS_DTYPE_COUNT ? chorus_dtype_name((chorus_dtype_t)d) : "unknown";
}
static const char *redop_str(unsigned o) {
  return o < CHORUS_OP_COUNT ? chorus_op_name((chorus_op_kind_t)o) : "unknown";
}

static int describe_hdr(const struct msg_hdr *h, int is_p2p, char *buf, size_t cap) {
  int n = snprintf(buf, cap, "%s seq %u count %llu %s %s %s %d (%llu bytes)", kind_str(h->kind),
                   h->seq, (unsigned long long)h->count, dtype_str(h->dtype), redop_str(h->redop),
                   is_p2p ? "tag" : "root", h->root, (unsigned long long)h->len);
  if (!is_p2p && n > 0 && (size_t)n < cap)
    n += snprintf(buf + n, cap - (size_t)n, " with algorithm %s", algo_name(h->flags));
  return n;
}

static chorus_result_t validate_hdr(struct msg_rx *rx) {
  const struct msg_hdr *g = &rx->got, *e = &rx->expect;
  struct chorus_comm *comm = rx->c->comm;
  int peer = rx->c->peer;
  if (g->magic != MSG_MAGIC)
    return comm_set_error(comm, CHORUS_ERR_PEER,
                          "rank %d received a corrupt message header from rank %d (magic 0x%x)",
                          comm->rank, peer, g->magic);
  int p2p = e->kind == OP_RECV;
  int same;
  if (FP_OFF()) {
    /* Measurement builds only (FP_OFF, core.h): the fingerprint is not compared, only the
     * framing: magic above, and len, which decides how many payload bytes are read. */
    same = g->len == e->len;
  } else {
    same = g->seq == e->seq && g->kind == e->kind && g->len == e->len && g->root == e->root;
    if (!p2p) same = same && g->dtype == e->dtype && g->count == e->count && g->flags == e->flags;
    if (!p2p && (e->kind == OP_ALLREDUCE || e->kind == OP_REDUCE || e->kind == OP_REDUCE_SCATTER))
      same = same && g->redop == e->redop;
  }
  if (same) return CHORUS_SUCCESS;
  char mine[256], theirs[256];
  describe_hdr(e, p2p, mine, sizeof mine);
  describe_hdr(g, p2p, theirs, sizeof theirs);
  return comm_set_error(comm, CHORUS_ERR_MISMATCH,
                        "mismatched calls: rank %d called %s but rank %d called %s", comm->rank,
                        mine, peer, theirs);
}

chorus_result_t msg_rx_header(struct msg_rx *rx, int *ready) {
  const size_t hl = sizeof(struct msg_hdr);
  conn_t *c = rx->c;
  while (rx->hdr_pos < hl) {
    const void *p;
    size_t avail;
    CHECK(c->ops->peek(c, &p, &avail));
    if (avail == 0) break;
    size_t k = hl - rx->hdr_pos < avail ? hl - rx->hdr_pos : avail;
    memcpy((uint8_t *)&rx->got + rx->hdr_pos, p, k);
    CHECK(c->ops->consume(c, k));
    rx->hdr_pos += k;
  }
  *ready = rx->hdr_pos == hl;
  return CHORUS_SUCCESS;
}

/* Skips the padding after the payload once it has all been consumed. */
static chorus_result_t finish_payload(struct msg_rx *rx) {
  conn_t *c = rx->c;
  size_t pad = PAD16(rx->len) - rx->pos; /* less what an earlier call skipped */
  while (pad > 0) {
    const void *p;
    size_t avail;
    CHECK(c->ops->peek(c, &p, &avail));
    if (avail == 0) return CHORUS_SUCCESS;
    size_t k = pad < avail ? pad : avail;
    CHECK(c->ops->consume(c, k));
    rx->pos += k; /* pos runs past len while skipping padding */
    pad -= k;
  }
  rx->done = 1;
  return CHORUS_SUCCESS;
}

static chorus_result_t ensure_header(struct msg_rx *rx, int *ready) {
  if (rx->hdr_ok) {
    *ready = 1;
    return CHORUS_SUCCESS;
  }
  CHECK(msg_rx_header(rx, ready));
  if (!*ready) return CHORUS_SUCCESS;
  CHECK(validate_hdr(rx));
  rx->hdr_ok = 1;
  return CHORUS_SUCCESS;
}

chorus_result_t msg_rx_peek(struct msg_rx *rx, const void **ptr, size_t *len) {
  int ready;
  *len = 0;
  *ptr = NULL;
  if (rx->done) return CHORUS_SUCCESS;
  CHECK(ensure_header(rx, &ready));
  if (!ready) return CHORUS_SUCCESS;
  if (rx->pos >= rx->len) return finish_payload(rx);
  if (rx->stage && !rx->staged) {
    rx->staged = 1;
    if (rx->pos == 0 && rx->c->ops->stage) CHECK(rx->c->ops->stage(rx->c, rx->len));
  }
  size_t avail;
  CHECK(rx->c->ops->peek(rx->c, ptr, &avail));
  size_t rem = rx->len - rx->pos;
  *len = avail < rem ? avail : rem;
  return CHORUS_SUCCESS;
}

chorus_result_t msg_rx_consume(struct msg_rx *rx, size_t len) {
  if (len) CHECK(rx->c->ops->consume(rx->c, len));
  rx->pos += len;
  if (rx->pos >= rx->len && !rx->done) return finish_payload(rx);
  return CHORUS_SUCCESS;
}

chorus_result_t msg_rx_copy(struct msg_rx *rx, void *dst, int *progressed) {
  while (!rx->done) {
    const void *p;
    size_t n;
    CHECK(msg_rx_peek(rx, &p, &n));
    if (rx->done) {
      *progressed = 1;
      break;
    }
    if (n == 0) {
      size_t rem = rx->hdr_ok && rx->pos < rx->len ? rx->len - rx->pos : 0;
      /* once direct, direct to the end: the transport leaves the bytes to it until then */
      if (!rem || (rem < DIRECT_MIN && !rx->direct) || !rx->c->ops->read_direct) break;
      rx->direct = 1;
      size_t got = 0;
      CHECK(rx->c->ops->read_direct(rx->c, (uint8_t *)dst + rx->pos, rem, &got, progressed));
      if (got == 0) break;
      rx->pos += got;
      if (rx->pos >= rx->len) CHECK(finish_payload(rx));
      continue;
    }
    memcpy((uint8_t *)dst + rx->pos, p, n);
    CHECK(msg_rx_consume(rx, n));
    *progressed = 1;
  }
  return CHORUS_SUCCESS;
}
