/* fuzz_wire.c - libFuzzer target for what a peer sends on the wire: framed messages
 * (msg.c: the 32-byte header, validated before any payload byte is touched, then the
 * payload and its padding) and the socket connection setup (transport/socket.c: the
 * hello an acceptor checks, the ack a connector checks).
 *
 * Input: byte 0 selects the mode; the bytes after a small fixed-size configuration are
 * the hostile stream.
 *   mode & 0x80: setup. cfg = nranks, rank, occupied-connection bits; the stream is a
 *     hello (checked by socket_hello_problem, the function the accept path calls) and
 *     then an ack (socket_ack_ok).
 *   else: a message. cfg = chunk size, then the expected op (kind, dtype, redop, algo,
 *     count, seq, root/tag); the stream is what arrives on the connection, served by an
 *     in-memory transport in windows of at most chunk bytes (x256 for payloads of 4 KiB
 *     or more). mode & 3 picks the receive
 *     path: 0 msg_rx_copy, 1 msg_rx_peek/consume (zero-copy), 2 header-first as in the
 *     engine's any-source probing, 3 a round trip (msg_tx_progress into the buffer, then
 *     msg_rx_copy back; must arrive intact). mode & 4 gives the transport read_direct /
 *     write_direct.
 * Every buffer is allocated at its exact size so that AddressSanitizer catches any access
 * outside it; the fake transport aborts when the caller consumes or commits more than
 * it was offered. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define PAD16(x) (((x) + 15u) & ~(size_t)15u)
#define MAX_COUNT 0xffffu /* elements: up to 512 KiB payloads, past msg.c's DIRECT_MIN */

#include "fuzz.h"

struct fake_conn {
  conn_t base;
  /* incoming stream */
  const uint8_t *in;
  size_t in_len, in_pos, offered;
  size_t ring_end;  /* [in_pos, ring_end) is "received": buffered in the transport */
  int starve;       /* direct transports: the next empty ring is reported empty once */
  /* outgoing stream (round trip) */
  uint8_t *out;
  size_t out_cap, out_len, reserved;
  size_t chunk;
};

static size_t window(const struct fake_conn *f, size_t left) {
  return left < f->chunk ? left : f->chunk;
}

static chorus_result_t f_reserve(conn_t *c, void **ptr, size_t *len) {
  struct fake_conn *f = (struct fake_conn *)c;
  f->reserved = window(f, f->out_cap - f->out_len);
  *ptr = f->reserved ? f->out + f->out_len : NULL;
  *len = f->reserved;
  return CHORUS_SUCCESS;
}

static chorus_result_t f_commit(conn_t *c, size_t len) {
  struct fake_conn *f = (struct fake_conn *)c;
  if (len > f->reserved) FATAL("commit of %zu bytes, %zu reserved", len, f->reserved);
  f->out_len += len;
  f->reserved = 0;
  return CHORUS_SUCCESS;
}

/* Moves up to a window of the stream into the "ring". */
static void receive_more(struct fake_conn *f) {
  f->ring_end = f->in_pos + window(f, f->in_len - f->in_pos);
}

/* The ring's bytes; when it is empty, more arrive, except that a transport with
 * read_direct reports every other empty ring as empty (the bytes wait in the "kernel"),
 * so that the caller may take them with read_direct. */
static chorus_result_t f_peek(conn_t *c, const void **ptr, size_t *len) {
  struct fake_conn *f = (struct fake_conn *)c;
  if (f->ring_end == f->in_pos) {
    if (c->ops->read_direct && (f->starve ^= 1)) {
      f->offered = 0;
      *ptr = NULL;
      *len = 0;
      return CHORUS_SUCCESS;
    }
    receive_more(f);
  }
  f->offered = f->ring_end - f->in_pos;
  *ptr = f->offered ? f->in + f->in_pos : NULL;
  *len = f->offered;
  return CHORUS_SUCCESS;
}

static chorus_result_t f_consume(conn_t *c, size_t len) {
  struct fake_conn *f = (struct fake_conn *)c;
  if (len > f->offered) FATAL("consume of %zu bytes, %zu offered", len, f->offered);
  f->in_pos += len;
  f->offered -= len;
  return CHORUS_SUCCESS;
}

static chorus_result_t f_progress(conn_t *c, int *progressed) {
  (void)c;
  (void)progressed;
  return CHORUS_SUCCESS;
}

static int f_pollfd(conn_t *c, struct pollfd *pfd) {
  (void)c;
  (void)pfd;
  return 0;
}

static void f_close(conn_t *c) { (void)c; }

/* As the socket's: only when nothing is buffered, which here means nothing was offered
 * and not consumed. */
static chorus_result_t f_read_direct(conn_t *c, void *dst, size_t n, size_t *got,
                                     int *progressed) {
  struct fake_conn *f = (struct fake_conn *)c;
  if (f->ring_end != f->in_pos) FATAL("read_direct with %zu bytes buffered", f->ring_end - f->in_pos);
  size_t k = window(f, f->in_len - f->in_pos);
  if (k > n) k = n;
  memcpy(dst, f->in + f->in_pos, k);
  f->in_pos += k;
  f->offered = 0;
  receive_more(f); /* read-ahead into the ring */
  *got = k;
  if (k) *progressed = 1;
  return CHORUS_SUCCESS;
}

static chorus_result_t f_write_direct(conn_t *c, const void *src, size_t n, size_t *wrote,
                                      int *progressed) {
  struct fake_conn *f = (struct fake_conn *)c;
  size_t k = window(f, f->out_cap - f->out_len);
  if (k > n) k = n;
  memcpy(f->out + f->out_len, src, k);
  f->out_len += k;
  *wrote = k;
  if (k) *progressed = 1;
  return CHORUS_SUCCESS;
}

static const struct transport_ops fake_ops = {
    .name = "fuzz",
    .reserve = f_reserve,
    .commit = f_commit,
    .peek = f_peek,
    .consume = f_consume,
    .progress = f_progress,
    .pollfd = f_pollfd,
    .close = f_close,
};
static const struct transport_ops fake_direct_ops = {
    .name = "fuzz-direct",
    .reserve = f_reserve,
    .commit = f_commit,
    .peek = f_peek,
    .consume = f_consume,
    .progress = f_progress,
    .pollfd = f_pollfd,
    .close = f_close,
    .write_direct = f_write_direct,
    .read_direct = f_read_direct,
};

static struct chorus_comm comm;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  /* every rejected message is reported through comm_set_error, which logs it */
  setenv("CHORUS_DEBUG", "NONE", 0);
  pthread_mutex_init(&comm.err_mu, NULL);
  return 0;
}

static void comm_reset(int rank, int nranks) {
  comm.rank = rank;
  comm.nranks = nranks;
  comm.errbuf[0] = 0;
  comm.err = CHORUS_SUCCESS;
  atomic_store(&comm.failed, 0);
}

static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* ------------------------------------------------------------ connection setup */
static void fuzz_setup(const uint8_t *cfg, const uint8_t *data, size_t size) {
  /* cfg: nranks (1..16), rank, occupied-connection bits (rank bit i: conns[i % 2][i / 2]) */
  int nranks = cfg[0] % 16 + 1;
  int rank = cfg[1] % nranks;
  comm_reset(rank, nranks);
  for (int i = 0; i < 32; i++) comm.secret[i] = (uint8_t)(0xa5 ^ i);
  conn_t *slots = calloc((size_t)nranks, sizeof(conn_t));
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    comm.conns[ch] = calloc((size_t)nranks, sizeof(conn_t *));
    for (int p = 0; p < nranks; p++)
      if ((cfg[2] >> ((p * CHAN_COUNT + ch) % 8)) & 1) comm.conns[ch][p] = &slots[p];
  }
  if (size >= SOCK_HELLO_LEN) {
    uint8_t *h = malloc(SOCK_HELLO_LEN);
    memcpy(h, data, SOCK_HELLO_LEN);
    char why[160];
    const char *bad = socket_hello_problem(&comm, h, why, sizeof why);
    if (!bad) {
      /* accepted: what hello_done then indexes must be in range and free */
      uint32_t r = get32(h + 40), ch = get32(h + 44);
      if (r >= (uint32_t)nranks || (int)r <= rank || ch >= CHAN_COUNT || comm.conns[ch][r])
        FATAL("hello accepted with rank %u channel %u (rank %d of %d)", r, ch, rank, nranks);
    } else if (!bad[0] || strlen(bad) >= sizeof why) {
      FATAL("bad rejection reason");
    }
    free(h);
    data += SOCK_HELLO_LEN;
    size -= SOCK_HELLO_LEN;
  }
  if (size >= SOCK_ACK_LEN) {
    uint8_t *a = malloc(SOCK_ACK_LEN);
    memcpy(a, data, SOCK_ACK_LEN);
    (void)socket_ack_ok(a, (int)(cfg[1] % 16), cfg[2] & 1, (int)(cfg[0] % 4));
    free(a);
  }
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    free(comm.conns[ch]);
    comm.conns[ch] = NULL;
  }
  free(slots);
}

/* ------------------------------------------------------------ messages */
#define MSG_CFG 16

static chorus_result_t receive(struct msg_rx *rx, struct fake_conn *f, int path, uint8_t *dst,
                               const struct op *op, size_t len) {
  int progressed = 0;
  if (path == 0) {
    /* the loop of a schedule: copy until done or nothing moves */
    for (int idle = 0; idle < 2;) {
      size_t before = f->in_pos;
      CHECK(msg_rx_copy(rx, dst, &progressed));
      if (rx->done) return CHORUS_SUCCESS;
      idle = f->in_pos == before ? idle + 1 : 0;
    }
    return CHORUS_SUCCESS;
  }
  if (path == 1) {
    /* zero-copy, as reduce_from_peers: peek, use the bytes, consume them */
    for (int idle = 0; idle < 2;) {
      const void *p;
      size_t n;
      size_t before = f->in_pos;
      CHECK(msg_rx_peek(rx, &p, &n));
      if (rx->done) return CHORUS_SUCCESS;
      if (n) {
        if (rx->pos + n > len) FATAL("peek past the payload: %zu + %zu > %zu", rx->pos, n, len);
        memcpy(dst + rx->pos, p, n);
        CHECK(msg_rx_consume(rx, n));
      }
      idle = f->in_pos == before ? idle + 1 : 0;
    }
    return CHORUS_SUCCESS;
  }
  /* path 2: as p2p_progress with an any-source receive: the header is read against a probe
   * of length 0, then the bound receive takes it over (got, hdr_pos) and copies */
  struct op probe = *op;
  msg_rx_init(rx, &f->base, &probe, 0);
  int ready = 0;
  for (int idle = 0; idle < 2 && !ready;) {
    size_t before = f->in_pos;
    CHECK(msg_rx_header(rx, &ready));
    idle = f->in_pos == before ? idle + 1 : 0;
  }
  if (!ready) return CHORUS_SUCCESS;
  struct msg_hdr got = rx->got;
  size_t hp = rx->hdr_pos;
  msg_rx_init(rx, &f->base, op, len);
  rx->got = got;
  rx->hdr_pos = hp;
  return receive(rx, f, 0, dst, op, len);
}

static void fuzz_msg(int mode, const uint8_t *cfg, const uint8_t *data, size_t size) {
  comm_reset(0, 2);
  struct op op;
  memset(&op, 0, sizeof op);
  op.kind = (enum op_kind)(cfg[1] % OP_KIND_COUNT);
  op.dtype = (chorus_dtype_t)(cfg[2] % CHORUS_DTYPE_COUNT);
  op.op.kind = (chorus_op_kind_t)(cfg[3] % CHORUS_OP_COUNT);
  op.algo = cfg[4] % 16;
  op.count = (size_t)(cfg[5] | cfg[6] << 8) & MAX_COUNT;
  op.seq = rd32(cfg + 7);
  op.root = op.tag = (int32_t)rd32(cfg + 11);
  size_t len = op.count * dtype_size(op.dtype);
  int path = mode & 3;

  struct fake_conn f;
  memset(&f, 0, sizeof f);
  f.base.ops = (mode & 4) ? &fake_direct_ops : &fake_ops;
  f.base.comm = &comm;
  f.base.peer = 1;
  f.base.channel = (op.kind == OP_RECV || op.kind == OP_SEND) ? CHAN_P2P : CHAN_COLL;
  f.chunk = cfg[0] ? cfg[0] : SIZE_MAX;
  if (len >= 4096 && f.chunk < 256) f.chunk *= 256; /* big payloads: bigger windows (speed) */

  uint8_t *src = NULL, *wire = NULL;
  if (path == 3) {
    /* round trip: the payload comes from the input (zero-filled past its end) */
    src = malloc(len ? len : 1);
    size_t k = size < len ? size : len;
    if (k) memcpy(src, data, k);
    if (len > k) memset(src + k, 0, len - k);
    f.out_cap = sizeof(struct msg_hdr) + PAD16(len);
    f.out = wire = malloc(f.out_cap);
    struct msg_tx tx;
    msg_tx_init(&tx, &f.base, &op, src, len);
    int progressed = 0;
    while (!tx.done) {
      size_t before = f.out_len;
      if (msg_tx_progress(&tx, &progressed) != CHORUS_SUCCESS) FATAL("tx failed");
      if (!tx.done && f.out_len == before) FATAL("tx stalled at %zu", f.out_len);
    }
    if (f.out_len != f.out_cap) FATAL("tx wrote %zu of %zu bytes", f.out_len, f.out_cap);
    if (op.kind == OP_SEND) op.kind = OP_RECV; /* the receiving side's op */
    f.in = wire;
    f.in_len = f.out_len;
  } else {
    wire = malloc(size ? size : 1);
    if (size) memcpy(wire, data, size);
    f.in = wire;
    f.in_len = size;
  }

  uint8_t *dst = malloc(len ? len : 1);
  struct msg_rx rx;
  msg_rx_init(&rx, &f.base, &op, len);
  chorus_result_t res = receive(&rx, &f, path == 3 ? 0 : path, dst, &op, len);

  if (res == CHORUS_SUCCESS && rx.done) {
    /* accepted: exactly one framed message was read, its header matching what we expect */
    size_t whole = sizeof(struct msg_hdr) + PAD16(len);
    if (f.in_pos != whole) FATAL("message done after %zu bytes, framed size %zu", f.in_pos, whole);
    if (rx.got.len != len || rx.got.magic != MSG_MAGIC) FATAL("accepted a wrong header");
  } else if (res != CHORUS_SUCCESS) {
    if (res != CHORUS_ERR_PEER && res != CHORUS_ERR_MISMATCH) FATAL("unexpected result %d", res);
    if (!comm.errbuf[0]) FATAL("error %d without a message", res);
  }
  if (path == 3) {
    if (res != CHORUS_SUCCESS || !rx.done) FATAL("round trip failed: %d (%s)", res, comm.errbuf);
    if (len && memcmp(src, dst, len) != 0) FATAL("round trip changed the payload");
  }
  free(dst);
  free(wire);
  free(src);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  int mode = data[0];
  data++;
  size--;
  if (mode & 0x80) {
    if (size < 3) return 0;
    fuzz_setup(data, data + 3, size - 3);
    return 0;
  }
  if (size < MSG_CFG) return 0;
  fuzz_msg(mode, data, data + MSG_CFG, size - MSG_CFG);
  return 0;
}
