/* fuzz.h - shared by the fuzz targets: FATAL reports a broken invariant and aborts, which
 * libFuzzer records as a crash with the input that caused it. */
#ifndef CHORUS_FUZZ_H
#define CHORUS_FUZZ_H
#include <stdio.h>
#include <stdlib.h>

#define FATAL(...)                \
  do {                            \
    fprintf(stderr, __VA_ARGS__); \
    fputc('\n', stderr);          \
    abort();                      \
  } while (0)

#endif
