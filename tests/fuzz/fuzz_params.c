/* fuzz_params.c - libFuzzer target for the text a user hands the library: the int / size /
 * bool parsers of param.c, the lookup through the environment (CHORUS_<NAME> set to the
 * input, then read back through param_int / param_str / chorus_param_value), CHORUS_ALGO
 * (tune_parse_algo), CHORUS_TUNE_MODEL (tune_parse_model) and collective names
 * (tune_collective_from_name).
 *
 * Input: byte 0 picks the error / warning buffer sizes (so truncated messages are
 * exercised too) and the parameter the environment path sets; the rest is the string
 * (cut at its first NUL, as an environment variable would be). The parsers' results are
 * checked for their documented properties; a violation aborts. */
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "algo/tune.h"

#include "fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  setenv("CHORUS_DEBUG", "NONE", 0); /* a bad value set below is warned about */
  param_str(PARAM_DEBUG);
  return 0;
}

static void check_int(const char *s) {
  int64_t v = 12345;
  if (param_parse_int(s, &v) != 0) {
    if (v != 12345) FATAL("param_parse_int wrote its output on failure");
    return;
  }
  /* the value printed back parses to itself */
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRId64, v);
  int64_t w;
  if (param_parse_int(buf, &w) != 0 || w != v) FATAL("int %s does not round-trip", buf);
}

static void check_size(const char *s) {
  int64_t v = 12345;
  if (param_parse_size(s, &v) != 0) {
    if (v != 12345) FATAL("param_parse_size wrote its output on failure");
    return;
  }
  if (v < 0) FATAL("size \"%s\" parsed to %" PRId64, s, v);
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRId64, v);
  int64_t w;
  if (param_parse_size(buf, &w) != 0 || w != v) FATAL("size %s does not round-trip", buf);
}

static void check_bool(const char *s) {
  int64_t v = 12345;
  if (param_parse_bool(s, &v) != 0) {
    if (v != 12345) FATAL("param_parse_bool wrote its output on failure");
    return;
  }
  if (v != 0 && v != 1) FATAL("bool parsed to %" PRId64, v);
}

/* Each error message is NUL-terminated within its buffer (a canary byte after it). */
static void check_terminated(const char *buf, size_t cap, const char *what) {
  if (cap && !memchr(buf, 0, cap)) FATAL("%s not terminated", what);
  if ((unsigned char)buf[cap] != 0xee) FATAL("%s written past its %zu bytes", what, cap);
}

static void check_algo(const char *s, size_t err_cap, size_t warn_cap) {
  char *err = malloc(err_cap + 1), *warn = malloc(warn_cap + 1);
  memset(err, 0xee, err_cap + 1);
  memset(warn, 0xee, warn_cap + 1);
  struct tune_force f;
  memset(&f, 0x5a, sizeof f);
  if (tune_parse_algo(s, &f, err, err_cap, warn, warn_cap) == 0) {
    for (int k = 0; k < OP_KIND_COUNT; k++) {
      if (f.allow[k] >> ALGO_COUNT) FATAL("allow[%d] = 0x%x names no algorithm", k, f.allow[k]);
      if (f.force[k] < -1 || f.force[k] >= ALGO_COUNT) FATAL("force[%d] = %d", k, f.force[k]);
      if (f.force[k] >= 0 && f.allow[k] != 1u << f.force[k]) FATAL("force without allow");
    }
    if (warn_cap) check_terminated(warn, warn_cap, "warning");
  } else {
    check_terminated(err, err_cap, "error");
  }
  /* as chorus_tune_plan calls it */
  if (tune_parse_algo(s, &f, err, err_cap, NULL, 0) != 0) check_terminated(err, err_cap, "error");
  free(err);
  free(warn);
}

static int link_ok(const struct tune_link *l) {
  return isfinite(l->lat_us) && l->lat_us >= 0 && isfinite(l->ovh_us) && l->ovh_us >= 0 &&
         isfinite(l->gbps) && l->gbps > 0;
}

static void check_model(const char *s, size_t err_cap) {
  char *err = malloc(err_cap + 1);
  memset(err, 0xee, err_cap + 1);
  struct tune_model m = tune_measured;
  if (tune_parse_model(s, &m, err, err_cap) == 0) {
    if (!link_ok(&m.shm) || !link_ok(&m.sock) || !link_ok(&m.net) || !isfinite(m.reduce_gbps) ||
        !(m.reduce_gbps > 0) || !isfinite(m.copy_gbps) || !(m.copy_gbps > 0))
      FATAL("model \"%s\" accepted with a bad constant", s);
  } else {
    check_terminated(err, err_cap, "error");
  }
  free(err);
}

/* The environment path: CHORUS_<NAME> (a numeric parameter) = s, read back. */
static void check_env(const char *s, unsigned pick) {
  static const enum param_id ids[] = {PARAM_TIMEOUT, PARAM_BUFFSIZE, PARAM_SHM_DISABLE,
                                      PARAM_SPIN_COUNT, PARAM_SHM_SCRATCH, PARAM_SOCKET_SNDBUF};
  enum param_id id = ids[pick % (sizeof ids / sizeof ids[0])];
  const chorus_param_info_t *info = chorus_param_get_info((int)id);
  /* putenv of one buffer per variable, rewritten in place: setenv would leak a copy of
   * every value (the C library cannot free replaced environment strings) */
  static char env[sizeof ids / sizeof ids[0]][4200];
  char *e = env[pick % (sizeof ids / sizeof ids[0])];
  int first = !e[0];
  int n = snprintf(e, sizeof env[0], "CHORUS_%s=", info->name);
  snprintf(e + n, sizeof env[0] - (size_t)n, "%s", s);
  if (first) putenv(e);
  const char *var = e;
  param_reset_cache();
  int64_t v = param_int(id);
  const char *text = param_str(id);
  char value[64];
  const char *source = NULL;
  if (chorus_param_value(info->name, value, sizeof value, &source) != 0 || !source)
    FATAL("chorus_param_value(%s) failed", info->name);
  /* what is in force is either the variable's valid value or the default */
  int64_t w;
  int (*parse)(const char *, int64_t *) = strcmp(info->type, "int") == 0    ? param_parse_int
                                          : strcmp(info->type, "size") == 0 ? param_parse_size
                                                                            : param_parse_bool;
  if (parse(text, &w) != 0 || w != v)
    FATAL("%.*s in force as \"%s\" but %" PRId64, n - 1, var, text, v);
  if (strcmp(source, "default") == 0 && strcmp(text, info->default_value) != 0)
    FATAL("%.*s: default source but \"%s\"", n - 1, var, text);
  e[n] = 0; /* empty: counts as unset */
  param_reset_cache();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  unsigned cfg = data[0];
  char *s = malloc(size);
  memcpy(s, data + 1, size - 1);
  s[size - 1] = 0;
  check_int(s);
  check_size(s);
  check_bool(s);
  size_t caps[4] = {0, 1, 24, 512};
  check_algo(s, caps[cfg & 3], caps[(cfg >> 2) & 3]);
  check_model(s, caps[(cfg >> 4) & 3]);
  (void)tune_collective_from_name(s);
  if (s[0]) check_env(s, cfg % 6); /* an empty variable counts as unset */
  free(s);
  return 0;
}
