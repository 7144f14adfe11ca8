/* log.c - the library's log: level, subsystem mask and destination read once from the
 * DEBUG / DEBUG_SUBSYS / DEBUG_FILE parameters; one write(2) per line so that lines of
 * concurrent threads and processes never interleave. Also result names and the version. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core.h"

/* Written only by the initialising thread before log_ready is release-stored, read only
 * after it is acquire-loaded (or by the initialising thread itself). */
static int log_level = LOG_WARN;
static int log_mask = SUB_ALL;
static int log_fd = STDERR_FILENO;
static char log_host[64] = "unknown";

static _Atomic int log_ready;
static pthread_mutex_t log_init_mu = PTHREAD_MUTEX_INITIALIZER;
/* Set while this thread initialises, so that anything logged from inside the
 * initialisation uses the defaults instead of deadlocking on log_init_mu. */
static _Thread_local int log_in_init;

static const struct {
  const char *name;
  int bit;
} subsys_names[] = {{"INIT", SUB_INIT}, {"COLL", SUB_COLL}, {"TRANSPORT", SUB_TRANSPORT},
                    {"NET", SUB_NET},   {"SHM", SUB_SHM},   {"TUNE", SUB_TUNE},
                    {"ALLOC", SUB_ALLOC}, {"P2P", SUB_P2P}, {"ALL", SUB_ALL},
                    /* NCCL's spellings of the same things */
                    {"TUNING", SUB_TUNE}, {"BOOTSTRAP", SUB_INIT}};

#define INIT_WARN_MAX 4
#define INIT_WARN_LEN 320
struct init_warnings {
  int count;
  char text[INIT_WARN_MAX][INIT_WARN_LEN];
};
static void add_warning(struct init_warnings *w, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void add_warning(struct init_warnings *w, const char *fmt, ...) {
  if (w->count >= INIT_WARN_MAX) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(w->text[w->count++], INIT_WARN_LEN, fmt, ap);
  va_end(ap);
}

/* The variable a parameter's value came from, for messages. */
static const char *param_origin(const char *name) {
  const char *source = "default";
  char unused[2];
  if (chorus_param_value(name, unused, sizeof unused, &source) != 0) return "?";
  return source;
}

static int parse_level(const char *s, struct init_warnings *w, int *version_requested) {
  static const struct {
    const char *name;
    int level;
  } levels[] = {{"NONE", LOG_NONE}, {"WARN", LOG_WARN}, {"INFO", LOG_INFO}, {"TRACE", LOG_TRACE},
                /* NCCL: VERSION prints the version once, ABORT aborts on warnings; both
                 * otherwise log warnings only. */
                {"VERSION", LOG_WARN}, {"ABORT", LOG_WARN}};
  while (*s == ' ' || *s == '\t') s++;
  size_t len = strcspn(s, " \t");
  for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++) {
    if (strlen(levels[i].name) == len && strncasecmp(s, levels[i].name, len) == 0) {
      *version_requested = strcmp(levels[i].name, "VERSION") == 0;
      return levels[i].level;
    }
  }
  add_warning(w, "%s=\"%s\" is not a log level (NONE, WARN, INFO, TRACE); using WARN",
              param_origin("DEBUG"), s);
  return LOG_WARN;
}

/* "INIT,NET" enables those; "^INIT,NET" enables everything else. */
static int parse_subsys(const char *s, struct init_warnings *w) {
  const char *origin = param_origin("DEBUG_SUBSYS");
  /* NCCL knows subsystems Chorus does not have (ENV, GRAPH, PROXY...); only complain
   * about unknown names the user addressed to Chorus itself. */
  int strict = strncmp(origin, "NCCL_", 5) != 0;
  while (*s == ' ' || *s == '\t') s++;
  int exclude = *s == '^';
  if (exclude) s++;
  int mask = 0;
  while (*s) {
    size_t len = strcspn(s, ",");
    const char *tok = s, *tok_end = s + len;
    while (tok < tok_end && (*tok == ' ' || *tok == '\t')) tok++;
    while (tok_end > tok && (tok_end[-1] == ' ' || tok_end[-1] == '\t')) tok_end--;
    size_t tok_len = (size_t)(tok_end - tok);
    if (tok_len > 0) {
      int found = 0;
      for (size_t i = 0; i < sizeof subsys_names / sizeof subsys_names[0]; i++) {
        if (strlen(subsys_names[i].name) == tok_len &&
            strncasecmp(tok, subsys_names[i].name, tok_len) == 0) {
          mask |= subsys_names[i].bit;
          found = 1;
        }
      }
      if (!found && strict)
        add_warning(w, "%s: unknown subsystem \"%.*s\" ignored", origin, (int)tok_len, tok);
    }
    s += len;
    if (*s == ',') s++;
  }
  return exclude ? SUB_ALL & ~mask : mask;
}

/* DEBUG_FILE with %h -> host name, %p -> pid, %% -> %. */
static void open_log_file(const char *pattern, struct init_warnings *w) {
  char path[4096];
  size_t len = 0;
  int too_long = 0;
  for (const char *p = pattern; *p && !too_long; p++) {
    char piece[80];
    const char *add = piece;
    if (p[0] == '%' && p[1] == 'h') {
      add = log_host;
      p++;
    } else if (p[0] == '%' && p[1] == 'p') {
      snprintf(piece, sizeof piece, "%d", (int)getpid());
      p++;
    } else if (p[0] == '%' && p[1] == '%') {
      piece[0] = '%', piece[1] = '\0';
      p++;
    } else {
      piece[0] = *p, piece[1] = '\0';
    }
    size_t n = strlen(add);
    if (len + n >= sizeof path) too_long = 1;
    else memcpy(path + len, add, n), len += n;
  }
  path[len] = '\0';
  int fd = too_long ? -1 : open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    add_warning(w, "%s: cannot open log file \"%s\" (%s); logging to stderr",
                param_origin("DEBUG_FILE"), path, too_long ? "path too long" : strerror(errno));
    return;
  }
  log_fd = fd;
}

static void log_emit(int level, int subsys, int rank, const char *fmt, va_list ap);
static void log_emit_fmt(int level, int subsys, int rank, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void log_emit_fmt(int level, int subsys, int rank, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_emit(level, subsys, rank, fmt, ap);
  va_end(ap);
}

static void log_init(void) {
  if (atomic_load_explicit(&log_ready, memory_order_acquire) || log_in_init) return;
  int saved_errno = errno; /* INFO() gets here before any caller could save errno */
  struct init_warnings warnings = {0};
  int version_requested = 0, first = 0;
  pthread_mutex_lock(&log_init_mu);
  if (!atomic_load_explicit(&log_ready, memory_order_relaxed)) {
    first = 1;
    log_in_init = 1;
    char host[256];
    if (gethostname(host, sizeof host) == 0) {
      host[sizeof host - 1] = '\0';
      host[strcspn(host, ".")] = '\0'; /* short name, as NCCL prints it */
      size_t n = strlen(host);
      if (n >= sizeof log_host) n = sizeof log_host - 1;
      memcpy(log_host, host, n);
      log_host[n] = '\0';
    }
    log_level = parse_level(param_str(PARAM_DEBUG), &warnings, &version_requested);
    log_mask = parse_subsys(param_str(PARAM_DEBUG_SUBSYS), &warnings);
    const char *file = param_str(PARAM_DEBUG_FILE);
    if (log_level > LOG_NONE && file[0]) open_log_file(file, &warnings);
    log_in_init = 0;
    atomic_store_explicit(&log_ready, 1, memory_order_release);
  }
  pthread_mutex_unlock(&log_init_mu);
  if (first) {
    if (version_requested)
      log_emit_fmt(LOG_INFO, SUB_INIT, -1, "Chorus version %s", chorus_version());
    for (int i = 0; i < warnings.count; i++)
      if (log_level >= LOG_WARN) log_emit_fmt(LOG_WARN, SUB_INIT, -1, "%s", warnings.text[i]);
  }
  errno = saved_errno;
}

int chorus_log_enabled(int level, int subsys) {
  if (!atomic_load_explicit(&log_ready, memory_order_acquire)) log_init();
  if (level <= LOG_NONE || level > log_level) return 0;
  /* Warnings ignore the subsystem mask. */
  return level == LOG_WARN || (log_mask & subsys) != 0;
}

static const char *subsys_name(int subsys) {
  if ((subsys & SUB_ALL) == SUB_ALL) return "ALL";
  for (size_t i = 0; i < sizeof subsys_names / sizeof subsys_names[0]; i++)
    if (subsys & subsys_names[i].bit) return subsys_names[i].name;
  return "-";
}

/* Formats "host:pid:rank chorus LEVEL SUBSYS message\n" and writes it in one call. */
static void log_emit(int level, int subsys, int rank, const char *fmt, va_list ap) {
  static const char *const level_names[] = {"NONE", "WARN", "INFO", "TRACE"};
  char stack_buf[1024], *line = stack_buf;
  char rank_str[16] = "-";
  if (rank >= 0) snprintf(rank_str, sizeof rank_str, "%d", rank);
  int head = snprintf(stack_buf, sizeof stack_buf, "%s:%d:%s chorus %s %s ", log_host,
                      (int)getpid(), rank_str,
                      level >= 0 && level <= LOG_TRACE ? level_names[level] : "LOG",
                      subsys_name(subsys));
  if (head < 0 || (size_t)head >= sizeof stack_buf) return;
  va_list ap2;
  va_copy(ap2, ap);
  int body = vsnprintf(stack_buf + head, sizeof stack_buf - (size_t)head, fmt, ap);
  if (body < 0) body = 0;
  size_t cap = sizeof stack_buf;
  if ((size_t)head + (size_t)body + 2 > sizeof stack_buf) {
    /* Long message: format again into a heap buffer; if that fails, truncate. */
    char *big = malloc((size_t)head + (size_t)body + 2);
    if (big) {
      memcpy(big, stack_buf, (size_t)head);
      vsnprintf(big + head, (size_t)body + 1, fmt, ap2);
      line = big;
      cap = (size_t)head + (size_t)body + 2;
    } else {
      body = (int)(sizeof stack_buf - (size_t)head - 2);
    }
  }
  va_end(ap2);
  size_t len = (size_t)head + (size_t)body;
  if (len > cap - 2) len = cap - 2;
  while (len > (size_t)head && line[len - 1] == '\n') len--; /* the newline is ours */
  line[len++] = '\n';
  for (size_t off = 0; off < len;) {
    ssize_t n = write(log_fd, line + off, len - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    off += (size_t)n;
  }
  if (line != stack_buf) free(line);
}

void chorus_log(int level, int subsys, int rank, const char *fmt, ...) {
  int saved_errno = errno; /* callers often log and then report errno */
  if (chorus_log_enabled(level, subsys)) {
    va_list ap;
    va_start(ap, fmt);
    log_emit(level, subsys, rank, fmt, ap);
    va_end(ap);
  }
  errno = saved_errno;
}

const char *chorus_result_string(chorus_result_t res) {
  switch (res) {
    case CHORUS_SUCCESS: return "success";
    case CHORUS_ERR_INVALID: return "invalid argument";
    case CHORUS_ERR_SYSTEM: return "system call failed";
    case CHORUS_ERR_TIMEOUT: return "timed out";
    case CHORUS_ERR_PEER: return "peer failed";
    case CHORUS_ERR_MISMATCH: return "ranks disagree on the operation";
    case CHORUS_ERR_ABORTED: return "aborted";
    case CHORUS_ERR_NOMEM: return "out of memory";
    case CHORUS_ERR_INTERNAL: return "internal error";
    case CHORUS_ERR_UNSUPPORTED: return "unsupported";
    case CHORUS_INPROGRESS: return "in progress";
  }
  return "unknown result";
}

const char *chorus_version(void) { return CHORUS_VERSION_STRING; }
