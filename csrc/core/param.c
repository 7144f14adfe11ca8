/* param.c - the parameters of CHORUS_PARAM_TABLE: lookup (CHORUS_<NAME>, then NCCL_<NAME>
 * where the table allows it, then the default), parsing of int / size / bool values,
 * the per-parameter cache, and the public chorus_param_* introspection. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"

static const chorus_param_info_t param_infos[PARAM_COUNT] = {
#define X_INFO(ID, NAME, TYPE, DEF, NCCL, DOC) {NAME, TYPE, DEF, DOC, NCCL},
    CHORUS_PARAM_TABLE(X_INFO)
#undef X_INFO
};
/* Full variable names, built at compile time so a source pointer can be handed out. */
static const char *const chorus_var_names[PARAM_COUNT] = {
#define X_VAR(ID, NAME, TYPE, DEF, NCCL, DOC) "CHORUS_" NAME,
    CHORUS_PARAM_TABLE(X_VAR)
#undef X_VAR
};
static const char *const nccl_var_names[PARAM_COUNT] = {
#define X_VAR(ID, NAME, TYPE, DEF, NCCL, DOC) "NCCL_" NAME,
    CHORUS_PARAM_TABLE(X_VAR)
#undef X_VAR
};

/* One cached value. Loaded lazily one parameter at a time, so that reading the string
 * parameters of the logger can never trigger a warning (and with it the logger) from a
 * badly set numeric parameter. */
struct param_slot {
  _Atomic int loaded;  /* release-stored after the fields below are final */
  int64_t value;       /* int, size and bool parameters */
  char *text;          /* the value in force as text; never NULL once loaded */
  int text_owned;      /* text was strdup'ed (else it points at the table default) */
  const char *source;  /* "CHORUS_X", "NCCL_X" or "default" */
};
static struct param_slot param_slots[PARAM_COUNT];
static pthread_mutex_t param_mu = PTHREAD_MUTEX_INITIALIZER;

/* ------------------------------------------------------------------ parsers */
/* Trims ASCII white space: [*begin, *end) is what is left. */
static void trim(const char *s, const char **begin, const char **end) {
  const char *e = s + strlen(s);
  while (s < e && isspace((unsigned char)*s)) s++;
  while (e > s && isspace((unsigned char)e[-1])) e--;
  *begin = s;
  *end = e;
}

/* Decimal digits into *out, stopping at the first non-digit; -1 if none or > limit. */
static int parse_digits(const char **p, const char *end, uint64_t limit, uint64_t *out) {
  const char *s = *p;
  uint64_t v = 0;
  if (s == end || !isdigit((unsigned char)*s)) return -1;
  for (; s < end && isdigit((unsigned char)*s); s++) {
    unsigned digit = (unsigned)(*s - '0');
    if (v > (limit - digit) / 10) return -1;
    v = v * 10 + digit;
  }
  *p = s;
  *out = v;
  return 0;
}

int param_parse_int(const char *s, int64_t *out) {
  if (!s) return -1;
  const char *p, *end;
  trim(s, &p, &end);
  int negative = 0;
  if (p < end && (*p == '+' || *p == '-')) negative = *p++ == '-';
  uint64_t mag;
  /* INT64_MIN's magnitude is one more than INT64_MAX's. */
  if (parse_digits(&p, end, negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX, &mag) != 0 ||
      p != end)
    return -1;
  *out = negative ? (int64_t)(0 - mag) : (int64_t)mag;
  return 0;
}

/* Bytes: digits, optional blanks, optional K/M/G (powers of 1024) with optional B or iB;
 * a bare B is accepted too. Case-insensitive. */
int param_parse_size(const char *s, int64_t *out) {
  if (!s) return -1;
  const char *p, *end;
  trim(s, &p, &end);
  if (p < end && *p == '+') p++;
  uint64_t v;
  if (parse_digits(&p, end, (uint64_t)INT64_MAX, &v) != 0) return -1;
  while (p < end && isspace((unsigned char)*p)) p++;
  uint64_t mult = 1;
  if (p < end) {
    switch (toupper((unsigned char)*p)) {
      case 'K': mult = 1ull << 10; p++; break;
      case 'M': mult = 1ull << 20; p++; break;
      case 'G': mult = 1ull << 30; p++; break;
      default: break;
    }
    if (mult > 1 && p < end && toupper((unsigned char)*p) == 'I' && p + 1 < end &&
        toupper((unsigned char)p[1]) == 'B')
      p++;
    if (p < end && toupper((unsigned char)*p) == 'B') p++;
  }
  if (p != end || v > (uint64_t)INT64_MAX / mult) return -1;
  *out = (int64_t)(v * mult);
  return 0;
}

int param_parse_bool(const char *s, int64_t *out) {
  static const struct {
    const char *word;
    int value;
  } words[] = {{"1", 1},   {"true", 1},  {"yes", 1}, {"on", 1},
               {"0", 0},   {"false", 0}, {"no", 0},  {"off", 0}};
  if (!s) return -1;
  const char *p, *end;
  trim(s, &p, &end);
  size_t len = (size_t)(end - p);
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
    if (strlen(words[i].word) == len && strncasecmp(p, words[i].word, len) == 0) {
      *out = words[i].value;
      return 0;
    }
  }
  return -1;
}

/* ------------------------------------------------------------------ lookup and cache */
static int parse_typed(const char *type, const char *text, int64_t *out) {
  if (strcmp(type, "int") == 0) return param_parse_int(text, out);
  if (strcmp(type, "size") == 0) return param_parse_size(text, out);
  if (strcmp(type, "bool") == 0) return param_parse_bool(text, out);
  *out = 0; /* string */
  return 0;
}

/* Fills the slot; called with param_mu held. A warning is only formatted here, into
 * warn, and logged by the caller after the lock is released. */
static void load_slot(int id, char *warn, size_t warn_cap) {
  const chorus_param_info_t *info = &param_infos[id];
  struct param_slot *slot = &param_slots[id];
  const char *var = chorus_var_names[id];
  const char *raw = getenv(var);
  /* An empty variable counts as unset, as in NCCL. */
  if ((!raw || !*raw) && info->nccl_fallback) {
    var = nccl_var_names[id];
    raw = getenv(var);
  }
  if (raw && !*raw) raw = NULL;

  const char *text = raw ? raw : info->default_value;
  slot->source = raw ? var : "default";
  if (parse_typed(info->type, text, &slot->value) != 0) {
    if (raw)
      snprintf(warn, warn_cap, "%s=\"%s\" is not a valid %s value; using the default %s",
               var, raw, info->type, info->default_value);
    text = info->default_value;
    slot->source = "default";
    if (parse_typed(info->type, text, &slot->value) != 0) slot->value = 0;
  }
  slot->text = (char *)info->default_value;
  slot->text_owned = 0;
  if (text != info->default_value) {
    char *copy = strdup(text);
    if (copy) {
      slot->text = copy;
      slot->text_owned = 1;
    } else { /* out of memory: the default stays in force, consistently */
      slot->source = "default";
      if (parse_typed(info->type, info->default_value, &slot->value) != 0) slot->value = 0;
    }
  }
  atomic_store_explicit(&slot->loaded, 1, memory_order_release);
}

static const struct param_slot *get_slot(int id) {
  struct param_slot *slot = &param_slots[id];
  if (!atomic_load_explicit(&slot->loaded, memory_order_acquire)) {
    char warn[512] = "";
    pthread_mutex_lock(&param_mu);
    if (!atomic_load_explicit(&slot->loaded, memory_order_relaxed)) load_slot(id, warn, sizeof warn);
    pthread_mutex_unlock(&param_mu);
    if (warn[0]) WARN(-1, "%s", warn);
  }
  return slot;
}

int64_t param_int(enum param_id id) {
  if ((unsigned)id >= PARAM_COUNT) return 0;
  return get_slot((int)id)->value;
}

const char *param_str(enum param_id id) {
  if ((unsigned)id >= PARAM_COUNT) return "";
  return get_slot((int)id)->text;
}

/* Pointers returned by param_str before the reset become invalid (tests only). */
void param_reset_cache(void) {
  pthread_mutex_lock(&param_mu);
  for (int id = 0; id < PARAM_COUNT; id++) {
    struct param_slot *slot = &param_slots[id];
    if (!atomic_load_explicit(&slot->loaded, memory_order_relaxed)) continue;
    atomic_store_explicit(&slot->loaded, 0, memory_order_relaxed);
    if (slot->text_owned) free(slot->text);
    slot->text = NULL;
    slot->text_owned = 0;
  }
  pthread_mutex_unlock(&param_mu);
}

/* ------------------------------------------------------------------ public API */
int chorus_param_count(void) { return PARAM_COUNT; }

const chorus_param_info_t *chorus_param_get_info(int index) {
  return index >= 0 && index < PARAM_COUNT ? &param_infos[index] : NULL;
}

/* name is the table name ("BUFFSIZE"); a CHORUS_ prefix and any case are accepted. */
int chorus_param_value(const char *name, char *value, size_t cap, const char **source) {
  if (!name) return -1;
  if (strncasecmp(name, "CHORUS_", 7) == 0) name += 7;
  for (int id = 0; id < PARAM_COUNT; id++) {
    if (strcasecmp(name, param_infos[id].name) != 0) continue;
    const struct param_slot *slot = get_slot(id);
    if (value && cap > 0) snprintf(value, cap, "%s", slot->text);
    if (source) *source = slot->source;
    return 0;
  }
  return -1;
}
