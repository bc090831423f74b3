/* request.c: a generate request's defaults, its local validation (the protocol's declared ranges,
 * as the Python SamplingParams judges them) and the frames this client sends. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FLOAT32_MAX 3.4028234663852886e38
#define MAX_TOP_K 1024
#define MAX_LOGPROBS 20
#define MAX_N 128
#define MAX_TIMEOUT_MS 86400000

void rl_request_init(rl_request* r) {
  memset(r, 0, sizeof *r);
  r->temperature = 0.0;
  r->top_p = 1.0;
  r->repetition_penalty = 1.0;
  r->n = 1;
}

void rl_options_init(rl_options* o) {
  o->connect_timeout_ms = RL_DEFAULT_CONNECT_TIMEOUT_MS;
  o->reply_timeout_ms = RL_DEFAULT_REPLY_TIMEOUT_MS;
  o->max_frame_bytes = RL_DEFAULT_MAX_FRAME_BYTES;
}

/* Characters in a UTF-8 string, or -1 when it is not valid UTF-8. */
static long utf8_chars(const char* s) {
  const unsigned char* p = (const unsigned char*)s;
  long chars = 0;
  while (*p) {
    unsigned char c = *p;
    int k = c < 0x80                   ? 0
            : (c >= 0xc2 && c <= 0xdf) ? 1
            : (c >= 0xe0 && c <= 0xef) ? 2
            : (c >= 0xf0 && c <= 0xf4) ? 3
                                       : -1;
    if (k < 0) return -1;
    unsigned long cp = k == 0 ? c : c & (0x3fu >> k);
    for (int j = 1; j <= k; j++) {
      if ((p[j] & 0xc0) != 0x80) return -1; /* also stops at the NUL */
      cp = (cp << 6) | (p[j] & 0x3fu);
    }
    if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return -1;
    p += k + 1;
    chars++;
  }
  return chars;
}

typedef struct {
  char* msg;
  size_t cap;
} judge;

__attribute__((format(printf, 3, 4))) static rl_code refuse(judge* j, const char* field,
                                                            const char* fmt, ...) {
  if (j->msg && j->cap) {
    int n = snprintf(j->msg, j->cap, "%s: ", field);
    if (n >= 0 && (size_t)n < j->cap) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(j->msg + n, j->cap - (size_t)n, fmt, ap);
      va_end(ap);
    }
  }
  return RL_ERR_INVALID_ARGUMENT;
}

/* A float field: finite, within [lo, hi] (lo excluded when low_open). */
static bool float_ok(double x, double lo, double hi, bool low_open) {
  return isfinite(x) && (low_open ? x > lo : x >= lo) && x <= hi;
}

/* x as Python's repr writes it: the fewest digits that read back the same. */
static const char* shortest(double x, char* buf, size_t cap) {
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, cap, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) break;
  }
  return buf;
}

/* A constraint's text (a schema's JSON text, a pattern): NUL-terminated UTF-8, non-empty; its
 * characters, or a refusal naming `field`. */
static rl_code constraint_text(judge* j, const char* field, const char* text, long* chars) {
  if (!text) return refuse(j, field, "must be a non-empty str, got NULL");
  *chars = utf8_chars(text);
  if (*chars < 0) return refuse(j, field, "must be valid UTF-8");
  if (*chars == 0) return refuse(j, field, "must be a non-empty str, got ''");
  return RL_OK;
}

/* The structured constraint (1.8), in the words of the Python client (ipc/structured.py). */
static rl_code validate_structured(judge* j, const rl_request* r) {
  long chars = 0;
  switch (r->structured) {
    case RL_STRUCTURED_NONE:
    case RL_STRUCTURED_JSON_OBJECT:
      return RL_OK;
    case RL_STRUCTURED_JSON: /* the server parses it, and bounds its canonical text */
      return constraint_text(j, "structured.json", r->structured_text, &chars);
    case RL_STRUCTURED_REGEX:
      if (constraint_text(j, "structured.regex", r->structured_text, &chars) != RL_OK)
        return RL_ERR_INVALID_ARGUMENT;
      if (chars > RL_MAX_CONSTRAINT_CHARS)
        return refuse(j, "structured.regex", "is %ld characters, limit %d", chars,
                      RL_MAX_CONSTRAINT_CHARS);
      return RL_OK;
    case RL_STRUCTURED_CHOICE: {
      if (!r->choices || r->n_choices < 1)
        return refuse(j, "structured.choice", "must be a non-empty list of non-empty strs");
      if (r->n_choices > RL_MAX_CHOICES)
        return refuse(j, "structured.choice", "has %zu choices, limit %d", r->n_choices,
                      RL_MAX_CHOICES);
      long total = 0;
      for (size_t i = 0; i < r->n_choices; i++) {
        if (constraint_text(j, "structured.choice", r->choices[i], &chars) != RL_OK)
          return RL_ERR_INVALID_ARGUMENT;
        total += chars;
      }
      if (total > RL_MAX_CONSTRAINT_CHARS)
        return refuse(j, "structured.choice", "its choices exceed %d characters together",
                      RL_MAX_CONSTRAINT_CHARS);
      return RL_OK;
    }
  }
  return refuse(j, "structured", "unknown kind %d", (int)r->structured);
}

#define FLOAT_FIELD(name, lo, hi, open, range)                               \
  if (!float_ok(r->name, lo, hi, open))                                      \
    return refuse(&j, #name, "must be a finite number in " range ", got %s", \
                  shortest(r->name, num, sizeof num));

rl_code rl_request_validate(const rl_request* r, char* msg, size_t cap) {
  judge j = {msg, cap};
  char num[32];
  if (msg && cap) msg[0] = '\0';
  if (!r) return refuse(&j, "request", "is NULL");
  if ((r->prompt == NULL) == (r->prompt_ids == NULL))
    return refuse(&j, "prompt", "give exactly one of prompt and prompt_ids");
  if (r->prompt) {
    long chars = utf8_chars(r->prompt);
    if (chars < 0) return refuse(&j, "prompt", "must be valid UTF-8");
    if (chars < 1) return refuse(&j, "prompt", "must be 1 or more characters");
  } else {
    if (r->n_prompt_ids < 1) return refuse(&j, "prompt_ids", "must hold 1 or more token ids");
    for (size_t i = 0; i < r->n_prompt_ids; i++)
      if (r->prompt_ids[i] < 0)
        return refuse(&j, "prompt_ids", "token ids must be >= 0, got %d", r->prompt_ids[i]);
  }
  if (r->has_max_tokens && (r->max_tokens < 0 || r->max_tokens > (int64_t)UINT32_MAX))
    return refuse(&j, "max_tokens", "must be null or an int in [0, 4294967295], got %lld",
                  (long long)r->max_tokens);
  FLOAT_FIELD(temperature, 0.0, FLOAT32_MAX, false, "[0, 3.4028235e+38]")
  FLOAT_FIELD(top_p, 0.0, 1.0, true, "(0, 1]")
  if (r->top_k < -1 || r->top_k > MAX_TOP_K)
    return refuse(&j, "top_k", "must be an int in [-1, 1024], got %d", r->top_k);
  FLOAT_FIELD(min_p, 0.0, 1.0, false, "[0, 1]")
  FLOAT_FIELD(presence_penalty, -2.0, 2.0, false, "[-2, 2]")
  FLOAT_FIELD(frequency_penalty, -2.0, 2.0, false, "[-2, 2]")
  FLOAT_FIELD(repetition_penalty, 0.0, FLOAT32_MAX, true, "(0, 3.4028235e+38]")
  if (r->n_stop_token_ids > RL_MAX_STOP_TOKEN_IDS)
    return refuse(&j, "stop_token_ids", "at most 8 token ids, got %zu", r->n_stop_token_ids);
  if (r->n_stop_token_ids && !r->stop_token_ids)
    return refuse(&j, "stop_token_ids", "is NULL with a count of %zu", r->n_stop_token_ids);
  for (size_t i = 0; i < r->n_stop_token_ids; i++)
    if (r->stop_token_ids[i] < 0)
      return refuse(&j, "stop_token_ids", "token ids must be >= 0, got %d", r->stop_token_ids[i]);
  if (r->has_logprobs && (r->logprobs < 0 || r->logprobs > MAX_LOGPROBS))
    return refuse(&j, "logprobs", "must be null or an int in [0, 20], got %d", r->logprobs);
  if (r->n < 1 || r->n > MAX_N) return refuse(&j, "n", "must be an int in [1, 128], got %d", r->n);
  if (r->priority < -1000 || r->priority > 1000)
    return refuse(&j, "priority", "must be an int in [-1000, 1000], got %d", r->priority);
  if (r->has_timeout_ms && (r->timeout_ms < 1 || r->timeout_ms > MAX_TIMEOUT_MS))
    return refuse(&j, "timeout_ms", "must be null or an int in [1, 86400000], got %lld",
                  (long long)r->timeout_ms);
  return validate_structured(&j, r);
}

/* ------------------------------------------------------------------ codes, local dones */

static const char* const CODE_NAMES[] = {
    "ok",           "bad_request",  "overloaded",    "timeout",   "engine_dead",      "shutdown",
    "duplicate_id", "disconnected", "client_closed", "bad_reply", "invalid_argument", "unknown",
    "wait_timeout", "not_found",    "no_memory",     "socket"};

const char* rl_code_name(rl_code code) {
  size_t i = (size_t)code;
  return i < sizeof CODE_NAMES / sizeof CODE_NAMES[0] ? CODE_NAMES[i] : "unknown";
}

rl_code rl_code_from_name(const char* name) {
  for (size_t i = 1; name && i < sizeof CODE_NAMES / sizeof CODE_NAMES[0]; i++)
    if (strcmp(name, CODE_NAMES[i]) == 0) return (rl_code)i;
  return RL_ERR_UNKNOWN;
}

void rl_local_done(rl_done* d, int64_t id, rl_code code, const char* message,
                   int64_t completion_tokens, double now) {
  memset(d, 0, sizeof *d);
  d->id = id;
  d->finish_reason = "error";
  d->completion_tokens = completion_tokens;
  d->error_code = code;
  d->error_code_str = rl_code_name(code);
  d->error_message = message;
  d->local = true;
  d->queue_ms = d->ttft_ms = d->e2e_ms = -1.0;
  d->recv_time = now;
}

/* ------------------------------------------------------------------ encoding */

static void pack_str(msgpack_packer* pk, const char* s) {
  size_t n = strlen(s);
  msgpack_pack_str(pk, n);
  msgpack_pack_str_body(pk, s, n);
}

static void pack_ids(msgpack_packer* pk, const int32_t* ids, size_t n) {
  msgpack_pack_array(pk, n);
  for (size_t i = 0; i < n; i++) msgpack_pack_int32(pk, ids[i]);
}

/* The structured map (1.8): its one key, and the constraint's value. */
static void pack_structured(msgpack_packer* pk, const rl_request* r) {
  static const char* const keys[] = {"", "json", "regex", "choice", "json_object"};
  msgpack_pack_map(pk, 1);
  pack_str(pk, keys[r->structured]);
  if (r->structured == RL_STRUCTURED_CHOICE) {
    msgpack_pack_array(pk, r->n_choices);
    for (size_t i = 0; i < r->n_choices; i++) pack_str(pk, r->choices[i]);
  } else if (r->structured == RL_STRUCTURED_JSON_OBJECT) {
    msgpack_pack_true(pk);
  } else {
    pack_str(pk, r->structured_text);
  }
}

/* The generate map, fields in the Python client's order (protocol.generate_msg): op, id, the
 * prompt, the sampling fields that differ from their defaults, priority, timeout_ms when set,
 * structured when set. */
rl_code rl_encode_generate(msgpack_sbuffer* buf, int64_t id, const rl_request* r) {
  msgpack_packer pk;
  msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
  bool send[13] = {r->has_max_tokens,
                   r->temperature != 0.0,
                   r->top_p != 1.0,
                   r->top_k != 0,
                   r->min_p != 0.0,
                   r->presence_penalty != 0.0,
                   r->frequency_penalty != 0.0,
                   r->repetition_penalty != 1.0,
                   r->has_seed,
                   r->n_stop_token_ids > 0,
                   r->ignore_eos,
                   r->has_logprobs,
                   r->n != 1};
  /* op, id, prompt, priority */
  size_t fields =
      4u + (r->has_timeout_ms ? 1u : 0u) + (r->structured != RL_STRUCTURED_NONE ? 1u : 0u);
  for (int i = 0; i < 13; i++) fields += send[i];
  msgpack_pack_map(&pk, fields);
  pack_str(&pk, "op");
  pack_str(&pk, "generate");
  pack_str(&pk, "id");
  msgpack_pack_int64(&pk, id);
  if (r->prompt) {
    pack_str(&pk, "prompt");
    pack_str(&pk, r->prompt);
  } else {
    pack_str(&pk, "prompt_ids");
    pack_ids(&pk, r->prompt_ids, r->n_prompt_ids);
  }
  static const char* const names[13] = {"max_tokens",
                                        "temperature",
                                        "top_p",
                                        "top_k",
                                        "min_p",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "repetition_penalty",
                                        "seed",
                                        "stop_token_ids",
                                        "ignore_eos",
                                        "logprobs",
                                        "n"};
  for (int i = 0; i < 13; i++) {
    if (!send[i]) continue;
    pack_str(&pk, names[i]);
    switch (i) {
      case 0:
        msgpack_pack_int64(&pk, r->max_tokens);
        break;
      case 1:
        msgpack_pack_double(&pk, r->temperature);
        break;
      case 2:
        msgpack_pack_double(&pk, r->top_p);
        break;
      case 3:
        msgpack_pack_int32(&pk, r->top_k);
        break;
      case 4:
        msgpack_pack_double(&pk, r->min_p);
        break;
      case 5:
        msgpack_pack_double(&pk, r->presence_penalty);
        break;
      case 6:
        msgpack_pack_double(&pk, r->frequency_penalty);
        break;
      case 7:
        msgpack_pack_double(&pk, r->repetition_penalty);
        break;
      case 8:
        msgpack_pack_uint64(&pk, r->seed);
        break;
      case 9:
        pack_ids(&pk, r->stop_token_ids, r->n_stop_token_ids);
        break;
      case 10:
        msgpack_pack_true(&pk);
        break;
      case 11:
        msgpack_pack_int32(&pk, r->logprobs);
        break;
      default:
        msgpack_pack_int32(&pk, r->n);
        break;
    }
  }
  pack_str(&pk, "priority");
  msgpack_pack_int32(&pk, r->priority);
  if (r->has_timeout_ms) {
    pack_str(&pk, "timeout_ms");
    msgpack_pack_int64(&pk, r->timeout_ms);
  }
  if (r->structured != RL_STRUCTURED_NONE) {
    pack_str(&pk, "structured");
    pack_structured(&pk, r);
  }
  return RL_OK;
}

void rl_encode_abort(msgpack_sbuffer* buf, int64_t id, bool stop, int32_t index) {
  msgpack_packer pk;
  msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, 2 + (stop ? 1u : 0u) + (index >= 0 ? 1u : 0u));
  pack_str(&pk, "op");
  pack_str(&pk, "abort");
  pack_str(&pk, "id");
  msgpack_pack_int64(&pk, id);
  if (stop) {
    pack_str(&pk, "finish_reason");
    pack_str(&pk, "stop");
  }
  if (index >= 0) {
    pack_str(&pk, "index");
    msgpack_pack_int32(&pk, index);
  }
}

void rl_encode_op(msgpack_sbuffer* buf, const char* op) {
  msgpack_packer pk;
  msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, 1);
  pack_str(&pk, "op");
  pack_str(&pk, op);
}

void rl_encode_hello(msgpack_sbuffer* buf, bool batch) {
  msgpack_packer pk;
  msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, 2);
  pack_str(&pk, "op");
  pack_str(&pk, "hello");
  pack_str(&pk, "batch");
  if (batch)
    msgpack_pack_true(&pk);
  else
    msgpack_pack_false(&pk);
}
