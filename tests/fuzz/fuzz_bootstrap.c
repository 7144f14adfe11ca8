/* fuzz_bootstrap.c - libFuzzer target for the request parser of the built-in TCP rendezvous
 * server (csrc/core/bootstrap_tcp.c, compiled into this file so that its static functions
 * can be driven without a thread or a listening port). Two clients talk to one store over
 * socketpairs, so that a GET waiting for a key is answered by another client's SET.
 *
 * Input layout: a sequence of steps, each a control byte and then up to 128 bytes:
 *   control bit 0: which client (0 or 1) the bytes go to; bits 1-7: the number of bytes
 *   minus one. The bytes are written to that client's socket and the server reads what
 *   arrived (client_read), then writes what it owes (client_write) and expires waiters when
 *   bit 7 of the control byte is set, as its poll loop would. A client the server dropped is
 *   replaced by a new connection. At the end both clients hang up.
 * Checked invariants: the store never holds more than BS_MAX_TOTAL, every response carries
 * the magic, and a client is never left mid-response once its responses were all read. */
#include "../../csrc/core/bootstrap_tcp.c"

#include "fuzz.h"

struct peer {
  struct srv_client *c;
  int other; /* the fuzzer's end */
};

static void peer_open(struct bs_server *s, struct peer *p, int slot) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
    FATAL("socketpair: %s", strerror(errno));
  struct srv_client *c = calloc(1, sizeof *c);
  if (!c) FATAL("out of memory");
  c->fd = sv[0];
  c->state = CL_HDR;
  snprintf(c->addr, sizeof c->addr, "fuzz-client-%d", slot);
  p->c = c;
  p->other = sv[1];
  s->cl[slot] = c;
}

static void peer_close(struct peer *p) {
  client_drop(p->c, NULL);
  free(p->c);
  p->c = NULL;
  close(p->other);
  p->other = -1;
}

/* Reads and checks what the server sent to this peer. */
static void drain(struct peer *p) {
  static uint8_t buf[1 << 16];
  for (;;) {
    ssize_t r = recv(p->other, buf, sizeof buf, MSG_DONTWAIT);
    if (r <= 0) return;
  }
}

static void check_responses_start(const struct srv_client *c) {
  if (c->state == CL_WRITE && c->resp_pos == 0 && get32(c->resp) != BS_MAGIC)
    FATAL("a response without the magic");
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  setenv("CHORUS_DEBUG", "NONE", 0); /* dropped clients are warned about */
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct bs_server *s = calloc(1, sizeof *s);
  if (!s) FATAL("out of memory");
  s->listen_fd = -1;
  s->wake[0] = s->wake[1] = -1;
  s->cl = calloc(2, sizeof *s->cl);
  if (!s->cl) FATAL("out of memory");
  s->ncl = s->capcl = 2;
  struct peer peers[2];
  for (int i = 0; i < 2; i++) peer_open(s, &peers[i], i);

  size_t pos = 0;
  while (pos < size) {
    uint8_t ctl = data[pos++];
    int who = ctl & 1;
    size_t n = (size_t)((ctl >> 1) & 0x3f) + 1;
    if (n > size - pos) n = size - pos;
    struct peer *p = &peers[who];
    if (n) {
      ssize_t w = send(p->other, data + pos, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      (void)w; /* a full socket buffer just loses bytes, like a stalled client */
      pos += n;
    }
    for (int i = 0; i < 2; i++) {
      struct srv_client *c = peers[i].c;
      if (c->fd >= 0 && (c->state == CL_HDR || c->state == CL_BODY)) client_read(s, c);
      if (c->fd >= 0 && c->state == CL_WAIT && (ctl & 0x80)) respond(c, BS_TIMEOUT, NULL);
      check_responses_start(c);
      if (c->fd >= 0 && c->state == CL_WRITE) client_write(c);
      drain(&peers[i]);
      if (c->fd >= 0 && c->state == CL_WRITE) client_write(c);
      drain(&peers[i]);
      if (c->fd >= 0 && c->state == CL_WRITE && c->resp_pos == BS_RESP_LEN &&
          (!c->outval || c->out_pos == c->outval->len))
        FATAL("a finished response that did not reset the client");
      if (c->fd < 0) { /* dropped: a new client takes its place */
        peer_close(&peers[i]);
        peer_open(s, &peers[i], i);
      }
    }
    if (s->total > BS_MAX_TOTAL) FATAL("store holds %llu bytes", (unsigned long long)s->total);
  }
  /* both hang up: the server sees the end of the stream */
  for (int i = 0; i < 2; i++) {
    shutdown(peers[i].other, SHUT_WR);
    struct srv_client *c = peers[i].c;
    if (c->fd >= 0 && (c->state == CL_HDR || c->state == CL_BODY)) client_read(s, c);
  }
  for (int i = 0; i < 2; i++) {
    close(peers[i].other);
    peers[i].other = -1;
  }
  server_free(s); /* drops and frees both clients and the store */
  return 0;
}
