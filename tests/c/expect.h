/* expect.h - the check macro of the C unit tests: EXPECT(cond, printf-style message) counts
 * a check, and on failure counts it and prints file:line and the message. Each test prints
 * `checks` and `failures` at the end and exits non-zero when failures > 0. */
#ifndef CHORUS_TEST_EXPECT_H
#define CHORUS_TEST_EXPECT_H
#include <stdio.h>

static int checks, failures;

#define EXPECT(cond, ...)                                  \
  do {                                                     \
    checks++;                                              \
    if (!(cond)) {                                         \
      failures++;                                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
    }                                                      \
  } while (0)

#endif
