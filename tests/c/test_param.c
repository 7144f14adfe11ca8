/* test_param.c - unit tests of param.c: the int / size / bool parsers, the lookup order
 * CHORUS_<NAME> > NCCL_<NAME> (where allowed) > default for every table entry, the WARN
 * on invalid values, chorus_param_value / chorus_param_get_info, concurrent first reads. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"

#include "expect.h"

/* ------------------------------------------------------------------ parsers */
typedef int (*parser_fn)(const char *, int64_t *);

static void expect_parse(parser_fn fn, const char *fname, const char *s, int64_t want) {
  int64_t got = -12345;
  int rc = fn(s, &got);
  EXPECT(rc == 0 && got == want, "%s(\"%s\") = %d, %lld; want 0, %lld", fname, s, rc,
         (long long)got, (long long)want);
}
static void expect_reject(parser_fn fn, const char *fname, const char *s) {
  int64_t got = -12345;
  int rc = fn(s, &got);
  EXPECT(rc == -1 && got == -12345, "%s(\"%s\") should fail and leave out alone (rc %d, %lld)",
         fname, s ? s : "(null)", rc, (long long)got);
}

static void test_parsers(void) {
  expect_parse(param_parse_int, "int", "0", 0);
  expect_parse(param_parse_int, "int", "42", 42);
  expect_parse(param_parse_int, "int", "-17", -17);
  expect_parse(param_parse_int, "int", "+5", 5);
  expect_parse(param_parse_int, "int", "  12\t\n", 12);
  expect_parse(param_parse_int, "int", "007", 7); /* decimal, not octal */
  expect_parse(param_parse_int, "int", "9223372036854775807", INT64_MAX);
  expect_parse(param_parse_int, "int", "-9223372036854775808", INT64_MIN);
  const char *bad_ints[] = {"", "  ", "abc", "12abc", "1.5", "9223372036854775808",
                            "-9223372036854775809", "99999999999999999999999", "--1", "+-1",
                            "-", "0x10", "1 2", "1e3", "4K"};
  for (size_t i = 0; i < sizeof bad_ints / sizeof bad_ints[0]; i++)
    expect_reject(param_parse_int, "int", bad_ints[i]);
  expect_reject(param_parse_int, "int", NULL);

  expect_parse(param_parse_size, "size", "0", 0);
  expect_parse(param_parse_size, "size", "4096", 4096);
  expect_parse(param_parse_size, "size", "4K", 4096);
  expect_parse(param_parse_size, "size", "4k", 4096);
  expect_parse(param_parse_size, "size", "4KB", 4096);
  expect_parse(param_parse_size, "size", "4kb", 4096);
  expect_parse(param_parse_size, "size", "4Kb", 4096);
  expect_parse(param_parse_size, "size", "2M", 2 << 20);
  expect_parse(param_parse_size, "size", "2mB", 2 << 20);
  expect_parse(param_parse_size, "size", "1G", 1 << 30);
  expect_parse(param_parse_size, "size", "3gb", 3ll << 30);
  expect_parse(param_parse_size, "size", "3KiB", 3 << 10);
  expect_parse(param_parse_size, "size", "1 M", 1 << 20);
  expect_parse(param_parse_size, "size", " 8M ", 8 << 20);
  expect_parse(param_parse_size, "size", "+16", 16);
  expect_parse(param_parse_size, "size", "5B", 5);
  expect_parse(param_parse_size, "size", "9223372036854775807", INT64_MAX);
  expect_parse(param_parse_size, "size", "8589934591G", 8589934591ll << 30);
  const char *bad_sizes[] = {"", "-1", "-1K", "4X", "K", "M4", "4MM", "4.5M", "4 M B", "4BK",
                             "4KK", "1T", "8589934592G", "9007199254740992K", "4Mi",
                             "9223372036854775808", "99999999999999999999", "0x10", "4 4"};
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++)
    expect_reject(param_parse_size, "size", bad_sizes[i]);
  expect_reject(param_parse_size, "size", NULL);

  const char *trues[] = {"1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " true "};
  const char *falses[] = {"0", "false", "FALSE", "no", "No", "off", "Off", "\t0\n"};
  for (size_t i = 0; i < sizeof trues / sizeof trues[0]; i++)
    expect_parse(param_parse_bool, "bool", trues[i], 1);
  for (size_t i = 0; i < sizeof falses / sizeof falses[0]; i++)
    expect_parse(param_parse_bool, "bool", falses[i], 0);
  const char *bad_bools[] = {"", "2", "-1", "maybe", "tru", "yess", "o", "onn", "true1", "00"};
  for (size_t i = 0; i < sizeof bad_bools / sizeof bad_bools[0]; i++)
    expect_reject(param_parse_bool, "bool", bad_bools[i]);
  expect_reject(param_parse_bool, "bool", NULL);
}

/* ------------------------------------------------------------------ the table */
struct expected_param {
  const char *name, *type, *def;
  int nccl;
};
/* Straight from the X-macro table of core.h, the source of truth the accessors must
 * reproduce. */
static const struct expected_param expected[] = {
#define X_EXPECT(ID, NAME, TYPE, DEF, NCCL, DOC) {NAME, TYPE, DEF, NCCL},
    CHORUS_PARAM_TABLE(X_EXPECT)
#undef X_EXPECT
};
#define NEXPECTED ((int)(sizeof expected / sizeof expected[0]))

static void test_info(void) {
  EXPECT(chorus_param_count() == PARAM_COUNT, "count %d vs %d", chorus_param_count(), PARAM_COUNT);
  EXPECT(chorus_param_count() == NEXPECTED, "count %d, expected %d", chorus_param_count(), NEXPECTED);
  for (int i = 0; i < chorus_param_count() && i < NEXPECTED; i++) {
    const chorus_param_info_t *info = chorus_param_get_info(i);
    EXPECT(info != NULL, "info %d", i);
    if (!info) continue;
    EXPECT(strcmp(info->name, expected[i].name) == 0, "name %d: %s", i, info->name);
    EXPECT(strcmp(info->type, "int") == 0 || strcmp(info->type, "size") == 0 ||
               strcmp(info->type, "bool") == 0 || strcmp(info->type, "string") == 0,
           "type of %s is one of int, size, bool, string", info->name);
    EXPECT(info->nccl_fallback == 0 || info->nccl_fallback == 1, "nccl flag of %s", info->name);
    EXPECT(strcmp(info->type, expected[i].type) == 0, "type of %s: %s", info->name, info->type);
    EXPECT(strcmp(info->default_value, expected[i].def) == 0, "default of %s", info->name);
    EXPECT(info->nccl_fallback == expected[i].nccl, "nccl_fallback of %s", info->name);
    EXPECT(info->doc && strlen(info->doc) > 10, "doc of %s", info->name);
    int64_t v;
    int parses = strcmp(info->type, "int") == 0    ? param_parse_int(info->default_value, &v)
                 : strcmp(info->type, "size") == 0 ? param_parse_size(info->default_value, &v)
                 : strcmp(info->type, "bool") == 0 ? param_parse_bool(info->default_value, &v)
                                                   : 0;
    EXPECT(parses == 0, "default of %s parses as %s", info->name, info->type);
  }
  EXPECT(strcmp(chorus_param_get_info(PARAM_BUFFSIZE)->name, "BUFFSIZE") == 0 &&
             strcmp(chorus_param_get_info(PARAM_DEBUG)->name, "DEBUG") == 0,
         "indices follow enum param_id");
  EXPECT(chorus_param_get_info(-1) == NULL, "index -1");
  EXPECT(chorus_param_get_info(PARAM_COUNT) == NULL, "index PARAM_COUNT");
}

/* ------------------------------------------------------------------ lookup order */
static char log_path[256];

static void var_name(char *buf, size_t cap, const char *prefix, const char *name) {
  snprintf(buf, cap, "%s%s", prefix, name);
}

static void clear_env(void) {
  char var[128];
  for (int i = 0; i < PARAM_COUNT; i++) {
    const char *name = chorus_param_get_info(i)->name;
    /* Keep the log going to our file: the WARN checks read it. */
    if (strcmp(name, "DEBUG_FILE") != 0 && strcmp(name, "DEBUG") != 0) {
      var_name(var, sizeof var, "CHORUS_", name);
      unsetenv(var);
    }
    var_name(var, sizeof var, "NCCL_", name);
    unsetenv(var);
  }
  param_reset_cache();
}

/* A valid non-default value of each type, and what param_int must give for it. */
static const char *sample_value(const char *type, int64_t *as_int) {
  if (strcmp(type, "int") == 0) return *as_int = -123, "-123";
  if (strcmp(type, "size") == 0) return *as_int = 3 << 20, "3M";
  if (strcmp(type, "bool") == 0) return *as_int = 1, "yes";
  return *as_int = 0, "eth0,^ib";
}
static const char *other_value(const char *type, int64_t *as_int) {
  if (strcmp(type, "int") == 0) return *as_int = 77, "77";
  if (strcmp(type, "size") == 0) return *as_int = 5 << 10, "5k";
  if (strcmp(type, "bool") == 0) return *as_int = 1, "on";
  return *as_int = 0, "other";
}

static void expect_value(int id, const char *want_text, int64_t want_int, const char *want_source,
                         const char *what) {
  const chorus_param_info_t *info = chorus_param_get_info(id);
  char value[256] = "poison";
  const char *source = "poison";
  int rc = chorus_param_value(info->name, value, sizeof value, &source);
  EXPECT(rc == 0 && strcmp(value, want_text) == 0 && strcmp(source, want_source) == 0,
         "%s %s: value \"%s\" from %s, want \"%s\" from %s", info->name, what, value, source,
         want_text, want_source);
  EXPECT(strcmp(param_str((enum param_id)id), want_text) == 0, "%s %s: param_str \"%s\"",
         info->name, what, param_str((enum param_id)id));
  if (strcmp(info->type, "string") != 0)
    EXPECT(param_int((enum param_id)id) == want_int, "%s %s: param_int %lld, want %lld",
           info->name, what, (long long)param_int((enum param_id)id), (long long)want_int);
  else
    EXPECT(param_int((enum param_id)id) == 0, "%s: param_int of a string", info->name);
}

/* Lines of the log file that contain both needles. */
static int count_log_lines(const char *needle1, const char *needle2) {
  FILE *f = fopen(log_path, "r");
  if (!f) return -1;
  char line[2048];
  int n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, needle1) && strstr(line, needle2)) n++;
  fclose(f);
  return n;
}

static void test_lookup_order(void) {
  char cvar[128], nvar[128];
  for (int id = 0; id < PARAM_COUNT; id++) {
    const chorus_param_info_t *info = chorus_param_get_info(id);
    if (strcmp(info->name, "DEBUG_FILE") == 0 || strcmp(info->name, "DEBUG") == 0)
      continue; /* kept pointing at the log file; checked below by name only */
    var_name(cvar, sizeof cvar, "CHORUS_", info->name);
    var_name(nvar, sizeof nvar, "NCCL_", info->name);
    int64_t def_int = 0, s_int, o_int;
    if (strcmp(info->type, "string") != 0) {
      int rc = strcmp(info->type, "int") == 0    ? param_parse_int(info->default_value, &def_int)
               : strcmp(info->type, "size") == 0 ? param_parse_size(info->default_value, &def_int)
                                                 : param_parse_bool(info->default_value, &def_int);
      EXPECT(rc == 0, "default parses");
    }
    const char *sample = sample_value(info->type, &s_int);
    const char *other = other_value(info->type, &o_int);

    clear_env();
    expect_value(id, info->default_value, def_int, "default", "unset");

    setenv(nvar, sample, 1);
    param_reset_cache();
    if (info->nccl_fallback)
      expect_value(id, sample, s_int, nvar, "NCCL_ only");
    else
      expect_value(id, info->default_value, def_int, "default", "NCCL_ only (not honoured)");

    setenv(cvar, other, 1);
    param_reset_cache();
    expect_value(id, other, o_int, cvar, "both set");

    setenv(cvar, "", 1); /* empty counts as unset, without a warning */
    param_reset_cache();
    int warns_before_empty = count_log_lines(cvar, "");
    param_int((enum param_id)id);
    EXPECT(count_log_lines(cvar, "") == warns_before_empty, "%s=\"\" logs nothing", cvar);
    if (info->nccl_fallback)
      expect_value(id, sample, s_int, nvar, "CHORUS_ empty");
    else
      expect_value(id, info->default_value, def_int, "default", "CHORUS_ empty");

    unsetenv(nvar);
    setenv(cvar, other, 1);
    param_reset_cache();
    expect_value(id, other, o_int, cvar, "CHORUS_ only");

    /* The cache holds: changing the environment alone changes nothing. */
    setenv(cvar, sample, 1);
    expect_value(id, other, o_int, cvar, "cached");

    if (strcmp(info->type, "string") != 0) {
      /* Invalid: one WARN naming the variable and the value, then the default. */
      const char *bad = strcmp(info->type, "bool") == 0 ? "perhaps" : "12Q";
      int before = count_log_lines(cvar, bad);
      setenv(cvar, bad, 1);
      param_reset_cache();
      for (int r = 0; r < 3; r++) expect_value(id, info->default_value, def_int, "default", "invalid");
      int after = count_log_lines(cvar, bad);
      EXPECT(after - before == 1, "%s=%s: %d WARN lines, want 1", cvar, bad, after - before);
      EXPECT(count_log_lines(" WARN ", bad) - before >= 1, "the line is a WARN");

      /* An invalid CHORUS_ value does not fall through to NCCL_. */
      if (info->nccl_fallback) {
        setenv(nvar, sample, 1);
        param_reset_cache();
        expect_value(id, info->default_value, def_int, "default", "invalid CHORUS_, valid NCCL_");
        setenv(cvar, sample, 1);
        setenv(nvar, bad, 1);
        param_reset_cache();
        expect_value(id, sample, s_int, cvar, "valid CHORUS_, invalid NCCL_");
      }
    }
    clear_env();
  }
  /* DEBUG_FILE is what main() set. */
  char value[300];
  const char *source = NULL;
  EXPECT(chorus_param_value("DEBUG_FILE", value, sizeof value, &source) == 0 &&
             strcmp(value, log_path) == 0 && strcmp(source, "CHORUS_DEBUG_FILE") == 0,
         "DEBUG_FILE from CHORUS_DEBUG_FILE");
}

static void test_param_value_api(void) {
  clear_env();
  setenv("CHORUS_BUFFSIZE", "8M", 1);
  param_reset_cache();
  char value[16];
  const char *source = NULL;
  EXPECT(chorus_param_value("buffsize", value, sizeof value, &source) == 0 &&
             strcmp(value, "8M") == 0 && strcmp(source, "CHORUS_BUFFSIZE") == 0,
         "case-insensitive name");
  EXPECT(chorus_param_value("CHORUS_BUFFSIZE", value, sizeof value, NULL) == 0 &&
             strcmp(value, "8M") == 0, "CHORUS_ prefix accepted, NULL source");
  EXPECT(chorus_param_value("BUFFSIZE", value, 2, NULL) == 0 && strcmp(value, "8") == 0,
         "value truncated to cap and terminated");
  EXPECT(chorus_param_value("BUFFSIZE", NULL, 0, &source) == 0, "NULL value buffer");
  EXPECT(chorus_param_value("NO_SUCH_PARAM", value, sizeof value, &source) == -1, "unknown");
  EXPECT(chorus_param_value("", value, sizeof value, &source) == -1, "empty name");
  EXPECT(chorus_param_value(NULL, value, sizeof value, &source) == -1, "NULL name");
  EXPECT(chorus_param_value("BUFF", value, sizeof value, &source) == -1, "prefix of a name");
  EXPECT(param_int(PARAM_BUFFSIZE) == 8 << 20, "param_int of BUFFSIZE");
  EXPECT(param_int(PARAM_COUNT) == 0 && strcmp(param_str(PARAM_COUNT), "") == 0, "bad id");
  clear_env();
}

/* ------------------------------------------------------------------ concurrency */
static void *reader(void *arg) {
  int64_t *out = arg;
  out[0] = param_int(PARAM_SPIN_COUNT);
  out[1] = param_int(PARAM_BUFFSIZE);
  out[2] = strcmp(param_str(PARAM_SOCKET_IFNAME), "eth9") == 0;
  return NULL;
}

static void test_concurrent_first_read(void) {
  clear_env();
  setenv("CHORUS_SPIN_COUNT", "31", 1);
  setenv("NCCL_BUFFSIZE", "1K", 1);
  setenv("NCCL_SOCKET_IFNAME", "eth9", 1);
  param_reset_cache();
  enum { NTHREADS = 8 };
  pthread_t threads[NTHREADS];
  int64_t results[NTHREADS][3];
  for (int i = 0; i < NTHREADS; i++) pthread_create(&threads[i], NULL, reader, results[i]);
  int bad = 0;
  for (int i = 0; i < NTHREADS; i++) {
    pthread_join(threads[i], NULL);
    bad += results[i][0] != 31 || results[i][1] != 1024 || results[i][2] != 1;
  }
  EXPECT(bad == 0, "%d threads saw wrong values", bad);
  clear_env();
}

int main(void) {
  snprintf(log_path, sizeof log_path, "/tmp/chorus_test_param_%d.log", (int)getpid());
  unlink(log_path);
  setenv("CHORUS_DEBUG_FILE", log_path, 1);
  setenv("CHORUS_DEBUG", "WARN", 1);
  unsetenv("CHORUS_DEBUG_SUBSYS");
  unsetenv("NCCL_DEBUG_SUBSYS");
  chorus_log_enabled(LOG_WARN, SUB_ALL); /* open the log now, with this environment */

  test_parsers();
  test_info();
  test_lookup_order();
  test_param_value_api();
  test_concurrent_first_read();
  unlink(log_path);
  printf("test_param: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
