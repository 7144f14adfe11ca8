/* test_log.c - unit tests of log.c: line format, level and subsystem filtering (each
 * configuration in a forked child, since the log reads its settings once per process),
 * DEBUG_FILE expansion and fallback, whole lines under concurrency, result strings. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core.h"

#include "expect.h"

static char tmpdir[] = "/tmp/chorus_test_log_XXXXXX";

static char *read_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  size_t n;
  while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) buf = realloc(buf, cap *= 2);
  }
  buf[len] = '\0';
  fclose(f);
  return buf;
}

static void short_hostname(char *buf, size_t cap) {
  if (gethostname(buf, cap) != 0) snprintf(buf, cap, "unknown");
  buf[cap - 1] = '\0';
  buf[strcspn(buf, ".")] = '\0';
}

/* ------------------------------------------------------------------ configurations */
/* Runs in a child with the given environment; the exit code has one bit per answer of
 * chorus_log_enabled, so the parent checks what the settings produced. */
struct probe {
  int level, subsys;
};
static const struct probe probes[] = {
    {LOG_WARN, SUB_COLL}, {LOG_INFO, SUB_INIT}, {LOG_INFO, SUB_COLL}, {LOG_INFO, SUB_NET},
    {LOG_TRACE, SUB_INIT}, {LOG_TRACE, SUB_P2P}, {LOG_INFO, SUB_ALL},
};
#define NPROBES ((int)(sizeof probes / sizeof probes[0]))

static int run_config(const char *debug, const char *subsys, const char *nccl_debug,
                      const char *file, const char *stderr_path) {
  pid_t pid = fork();
  if (pid == 0) {
    unsetenv("CHORUS_DEBUG");
    unsetenv("NCCL_DEBUG");
    unsetenv("CHORUS_DEBUG_SUBSYS");
    unsetenv("NCCL_DEBUG_SUBSYS");
    unsetenv("CHORUS_DEBUG_FILE");
    unsetenv("NCCL_DEBUG_FILE");
    if (debug) setenv("CHORUS_DEBUG", debug, 1);
    if (nccl_debug) setenv("NCCL_DEBUG", nccl_debug, 1);
    if (subsys) setenv("CHORUS_DEBUG_SUBSYS", subsys, 1);
    if (file) setenv("CHORUS_DEBUG_FILE", file, 1);
    if (!freopen(stderr_path ? stderr_path : "/dev/null", "w", stderr)) _exit(255);
    int bits = 0;
    for (int i = 0; i < NPROBES; i++)
      if (chorus_log_enabled(probes[i].level, probes[i].subsys)) bits |= 1 << i;
    WARN(1, "probe warning");
    INFO(SUB_INIT, 2, "probe info");
    _exit(bits);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Bits for: WARN/COLL, INFO/INIT, INFO/COLL, INFO/NET, TRACE/INIT, TRACE/P2P, INFO/ALL */
static void test_configs(void) {
  EXPECT(run_config(NULL, NULL, NULL, NULL, NULL) == 0x01, "default: warnings only");
  EXPECT(run_config("NONE", NULL, NULL, NULL, NULL) == 0x00, "NONE: nothing");
  EXPECT(run_config("info", NULL, NULL, NULL, NULL) == 0x4f, "info (lower case)");
  EXPECT(run_config("TRACE", NULL, NULL, NULL, NULL) == 0x7f, "TRACE: everything");
  EXPECT(run_config("INFO", "INIT,NET", NULL, NULL, NULL) == 0x4b, "INFO INIT,NET");
  EXPECT(run_config("TRACE", "^INIT, coll", NULL, NULL, NULL) == 0x69, "TRACE ^INIT,coll");
  EXPECT(run_config("INFO", "ALL", NULL, NULL, NULL) == 0x4f, "ALL");
  EXPECT(run_config("INFO", "^ALL", NULL, NULL, NULL) == 0x01, "^ALL keeps warnings");
  EXPECT(run_config(NULL, NULL, "INFO", NULL, NULL) == 0x4f, "NCCL_DEBUG honoured");
  EXPECT(run_config("WARN", NULL, "INFO", NULL, NULL) == 0x01, "CHORUS_DEBUG wins over NCCL_");
  EXPECT(run_config(NULL, NULL, "VERSION", NULL, NULL) == 0x01, "NCCL VERSION is warn-level");
  EXPECT(run_config(NULL, NULL, "ABORT", NULL, NULL) == 0x01, "NCCL ABORT is warn-level");

  /* Bad settings: a warning names the variable, and the rest still works. */
  char errpath[512];
  snprintf(errpath, sizeof errpath, "%s/stderr.txt", tmpdir);
  EXPECT(run_config("LOUD", NULL, NULL, NULL, errpath) == 0x01, "invalid level -> WARN");
  char *err = read_file(errpath);
  EXPECT(err && strstr(err, "CHORUS_DEBUG") && strstr(err, "LOUD") && strstr(err, " WARN "),
         "warning about CHORUS_DEBUG=LOUD: [%s]", err ? err : "");
  EXPECT(err && strstr(err, "probe warning"), "warnings still printed");
  free(err);
  EXPECT(run_config("INFO", "INIT,BOGUS", NULL, NULL, errpath) == 0x43, "unknown subsystem ignored");
  err = read_file(errpath);
  EXPECT(err && strstr(err, "BOGUS") && strstr(err, "CHORUS_DEBUG_SUBSYS"), "warning about BOGUS");
  free(err);
  EXPECT(run_config("INFO", NULL, NULL, "/nonexistent_dir/x/log", errpath) == 0x4f,
         "unopenable file");
  err = read_file(errpath);
  EXPECT(err && strstr(err, "/nonexistent_dir/x/log") && strstr(err, "probe info"),
         "falls back to stderr with a warning: [%s]", err ? err : "");
  free(err);
  EXPECT(run_config("NONE", NULL, NULL, NULL, errpath) == 0, "NONE");
  err = read_file(errpath);
  EXPECT(err && err[0] == '\0', "NONE prints nothing, not even warnings: [%s]", err ? err : "");
  free(err);

  /* errno survives the first log call, even when opening the file fails inside it. */
  pid_t epid = fork();
  if (epid == 0) {
    if (!freopen("/dev/null", "w", stderr)) _exit(255);
    setenv("CHORUS_DEBUG", "INFO", 1);
    setenv("CHORUS_DEBUG_FILE", "/nonexistent_dir/y/log", 1);
    errno = 1234;
    INFO(SUB_INIT, 0, "first line");
    int ok = errno == 1234;
    WARN(0, "second line");
    _exit(ok && errno == 1234 ? 0 : 1);
  }
  int estatus = -1;
  waitpid(epid, &estatus, 0);
  EXPECT(WIFEXITED(estatus) && WEXITSTATUS(estatus) == 0, "errno preserved across log init");

  /* %h and %p in DEBUG_FILE; the child's pid is in the name. */
  char pattern[512], host[256];
  short_hostname(host, sizeof host);
  snprintf(pattern, sizeof pattern, "%s/log.%%h.%%p.%%%%.txt", tmpdir);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("CHORUS_DEBUG", "INFO", 1);
    setenv("CHORUS_DEBUG_FILE", pattern, 1);
    INFO(SUB_NET, 5, "to the file");
    _exit(0);
  }
  waitpid(pid, NULL, 0);
  char path[700];
  snprintf(path, sizeof path, "%s/log.%s.%d.%%.txt", tmpdir, host, (int)pid);
  char *text = read_file(path);
  char want[400];
  snprintf(want, sizeof want, "%s:%d:5 chorus INFO NET to the file\n", host, (int)pid);
  EXPECT(text && strcmp(text, want) == 0, "file %s holds [%s], want [%s]", path,
         text ? text : "(missing)", want);
  free(text);
}

/* ------------------------------------------------------------------ format and threads */
static char log_path[512];

struct writer_arg {
  int id;
};
enum { NTHREADS = 8, LINES_PER_THREAD = 300 };

static const char dots[] =
    "..............................................................................";

static void *writer(void *p) {
  const struct writer_arg *arg = p;
  for (int i = 0; i < LINES_PER_THREAD; i++)
    INFO(SUB_COLL, arg->id, "thread %d line %d %s", arg->id, i, dots);
  return NULL;
}

static void test_format_and_threads(void) {
  char host[256];
  short_hostname(host, sizeof host);
  int pid = (int)getpid();

  EXPECT(chorus_log_enabled(LOG_INFO, SUB_COLL) && chorus_log_enabled(LOG_INFO, SUB_INIT),
         "INFO enabled");
  EXPECT(!chorus_log_enabled(LOG_TRACE, SUB_COLL), "TRACE disabled");

  errno = 1234;
  INFO(SUB_INIT, 3, "hello %d", 42);
  EXPECT(errno == 1234, "errno preserved by logging");
  WARN(-1, "a warning with a newline\n");
  TRACE(SUB_INIT, 0, "not shown");
  chorus_log(LOG_INFO, SUB_SHM, 0, "%s", "");
  char long_msg[5001];
  memset(long_msg, 'x', 5000);
  long_msg[5000] = '\0';
  INFO(SUB_TRANSPORT, 7, "long %s end", long_msg);

  char *text = read_file(log_path);
  char want[7000];
  snprintf(want, sizeof want,
           "%s:%d:3 chorus INFO INIT hello 42\n"
           "%s:%d:- chorus WARN ALL a warning with a newline\n"
           "%s:%d:0 chorus INFO SHM \n"
           "%s:%d:7 chorus INFO TRANSPORT long %s end\n",
           host, pid, host, pid, host, pid, host, pid, long_msg);
  EXPECT(text && strcmp(text, want) == 0, "log file:\n[%s]\nwant:\n[%s]", text ? text : "", want);
  free(text);

  /* Concurrent writers: every line must come out whole. */
  EXPECT(truncate(log_path, 0) == 0, "truncate the log");
  pthread_t threads[NTHREADS];
  struct writer_arg args[NTHREADS];
  for (int t = 0; t < NTHREADS; t++) {
    args[t].id = t;
    pthread_create(&threads[t], NULL, writer, &args[t]);
  }
  for (int t = 0; t < NTHREADS; t++) pthread_join(threads[t], NULL);
  text = read_file(log_path);
  int lines = 0, malformed = 0;
  int seen[NTHREADS] = {0};
  for (char *line = text, *next; line && *line; line = next) {
    char *nl = strchr(line, '\n');
    if (!nl) {
      malformed++;
      break;
    }
    *nl = '\0';
    next = nl + 1;
    lines++;
    /* Which thread wrote it, then the exact text that thread must have written. */
    char prefix[300], expect_line[500];
    int id = -1, idx = -1;
    snprintf(prefix, sizeof prefix, "%s:%d:", host, pid);
    if (strncmp(line, prefix, strlen(prefix)) == 0)
      sscanf(line + strlen(prefix), "%*d chorus INFO COLL thread %d line %d", &id, &idx);
    if (id < 0 || id >= NTHREADS) {
      malformed++;
      continue;
    }
    snprintf(expect_line, sizeof expect_line, "%s%d chorus INFO COLL thread %d line %d %s", prefix,
             id, id, seen[id], dots);
    if (strcmp(line, expect_line) != 0) malformed++;
    seen[id]++;
  }
  EXPECT(lines == NTHREADS * LINES_PER_THREAD && malformed == 0,
         "%d lines (want %d), %d malformed or out of order", lines, NTHREADS * LINES_PER_THREAD,
         malformed);
  free(text);
}

static void test_strings(void) {
  const char *seen[CHORUS_INPROGRESS + 1];
  for (int r = 0; r <= CHORUS_INPROGRESS; r++) {
    seen[r] = chorus_result_string((chorus_result_t)r);
    EXPECT(seen[r] && strlen(seen[r]) > 0 && strcmp(seen[r], "unknown result") != 0,
           "result %d has a name", r);
    for (int q = 0; q < r; q++) EXPECT(strcmp(seen[q], seen[r]) != 0, "results %d, %d differ", q, r);
  }
  EXPECT(strcmp(chorus_result_string(CHORUS_SUCCESS), "success") == 0, "success");
  EXPECT(strcmp(chorus_result_string((chorus_result_t)99), "unknown result") == 0, "unknown");
  EXPECT(strcmp(chorus_version(), CHORUS_VERSION_STRING) == 0 && strcmp(chorus_version(), "0.1.0") == 0,
         "version");
}

int main(void) {
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  test_configs(); /* forks first: the children must not inherit a configured log */
  snprintf(log_path, sizeof log_path, "%s/main.log", tmpdir);
  setenv("CHORUS_DEBUG", "INFO", 1);
  setenv("CHORUS_DEBUG_SUBSYS", "^NET", 1);
  setenv("CHORUS_DEBUG_FILE", log_path, 1);
  test_format_and_threads();
  test_strings();

  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpdir);
  printf("test_log: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
