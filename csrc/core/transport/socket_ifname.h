/* socket_ifname.h - the SOCKET_IFNAME interface-list matcher of the socket transport
 * (socket.c), exposed so unit tests can exercise it without opening sockets. */
#ifndef CHORUS_SOCKET_IFNAME_H
#define CHORUS_SOCKET_IFNAME_H

/* NCCL syntax: a comma-separated list of interface-name prefixes. A leading '^' selects
 * the interfaces NOT listed; a leading '=' (after any '^') compares whole names instead
 * of prefixes. Blanks around entries are ignored. An empty list selects every name.
 * Returns 1 if name is selected, 0 if not (also for NULL arguments). */
int ifname_matches(const char *spec, const char *name);

#endif /* CHORUS_SOCKET_IFNAME_H */
