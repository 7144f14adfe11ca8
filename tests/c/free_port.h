/* free_port.h - a free TCP port on 127.0.0.1 for the C tests and benchmarks that start a
 * built-in TCP rendezvous: bind port 0, read the number back, close. The short window before
 * the rendezvous binds it again is acceptable on a test machine. -1 if no port was had. */
#ifndef CHORUS_TEST_FREE_PORT_H
#define CHORUS_TEST_FREE_PORT_H
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

static inline int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  socklen_t l = sizeof a;
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &l) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  close(fd);
  return ntohs(a.sin_port);
}

#endif
