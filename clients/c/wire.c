/* wire.c: reading the server's frames (token, done, stats, error) with the bounded msgpack reader
 * of msgpack_reader.c; batch frames are walked in batch.c. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "msgpack_reader.h"

double rl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char* const FIELD_NAMES[RL_F_COUNT] = {
    "op",          "id",    "token_ids", "text",    "index",   "finish_reason", "logprobs",
    "usage",       "error", "timing",    "choices", "message", "protocol",      "model_info",
    "engine_dead", "ids",   "n_tokens",  "done",    "batch"};

void rl_reply_scan(const uint8_t* data, size_t len, rl_reply* r) {
  memset(r, 0, sizeof *r);
  r->end = data + len, r->len = len;
  const uint8_t* p = data;
  size_t containers = 0;
  r->broken = !rl_mp_skip(&p, r->end, &containers) || p != r->end; /* one map, nothing after it */
  p = data;
  mp_val top, key, v;
  if (!rl_mp_next(&p, r->end, &top) || top.kind != MP_MAP) {
    r->broken = true;
    return;
  }
  for (uint32_t i = 0; i < top.n; i++) {
    if (!rl_mp_next(&p, r->end, &key)) break;
    if (key.kind != MP_STR && !rl_mp_skip(&p, r->end, NULL)) break;
    int f = -1;
    for (int k = 0; key.kind == MP_STR && k < RL_F_COUNT; k++)
      if (rl_mp_str_is(&key, FIELD_NAMES[k])) f = k;
    const uint8_t* at = p;
    if (key.kind == MP_STR && !rl_mp_skip(&p, r->end, NULL)) break;
    if (f < 0) continue;
    r->field[f] = at; /* a repeated key: the last one counts, as in a dict */
  }
  r->op = RL_OP_NONE;
  r->has_id = false;
  const uint8_t* q = r->field[RL_F_OP];
  if (q && rl_mp_next(&q, r->end, &v)) {
    static const char* const ops[] = {"token", "done", "stats", "pong", "error", "batch", "hello"};
    for (int k = 0; k < (int)(sizeof ops / sizeof *ops); k++)
      if (rl_mp_str_is(&v, ops[k])) r->op = RL_OP_TOKEN + k;
  }
  q = r->field[RL_F_ID];
  if (q && rl_mp_next(&q, r->end, &v) && v.kind == MP_INT) r->has_id = true, r->id = v.i;
}

/* ------------------------------------------------------------------ scratch */

static bool grow(void** p, size_t* cap, size_t need, size_t elem) {
  if (need <= *cap) return true;
  size_t n = *cap ? *cap : 64;
  while (n < need) n *= 2;
  void* q = realloc(*p, n * elem);
  if (!q) return false;
  *p = q, *cap = n;
  return true;
}

void rl_scratch_free(rl_scratch* s) {
  free(s->ids), free(s->chars), free(s->lps), free(s->top_ids), free(s->top_lps), free(s->choices);
  memset(s, 0, sizeof *s);
}

/* Room for every string of a frame of `len` bytes, each with its NUL. */
static bool reserve_chars(rl_scratch* s, size_t len) {
  s->chars_len = 0;
  return grow((void**)&s->chars, &s->chars_cap, 2 * len + 16, 1);
}

static const char* keep_str(rl_scratch* s, const mp_val* v) {
  char* out = s->chars + s->chars_len;
  memcpy(out, v->s, v->n);
  out[v->n] = '\0';
  s->chars_len += (size_t)v->n + 1;
  return out;
}

static const char* const FINISH_REASONS[] = {"stop", "length", "abort", "error"};

static const char* finish_reason_of(const mp_val* v) {
  for (int k = 0; k < 4; k++)
    if (rl_mp_str_is(v, FINISH_REASONS[k])) return FINISH_REASONS[k];
  return NULL;
}

static bool as_number(const mp_val* v, double* out) {
  if (v->kind == MP_FLOAT)
    *out = v->f;
  else if (v->kind == MP_INT)
    *out = (double)v->i;
  else if (v->kind == MP_UINT)
    *out = (double)v->u;
  else
    return false;
  return true;
}

static bool as_token_id(const mp_val* v, int32_t* out) {
  if (v->kind != MP_INT || v->i < 0 || v->i > INT32_MAX) return false;
  *out = (int32_t)v->i;
  return true;
}

/* Looks up `name` in the map whose header was just read (v->n pairs at *pp); *at = its value. */
static bool map_get(const uint8_t* p, uint32_t n, const uint8_t* end, const char* name,
                    const uint8_t** at) {
  mp_val key;
  *at = NULL;
  for (uint32_t i = 0; i < n; i++) {
    if (!rl_mp_next(&p, end, &key)) return false;
    if (key.kind != MP_STR && !rl_mp_skip(&p, end, NULL)) return false;
    if (rl_mp_str_is(&key, name)) *at = p;
    if (key.kind == MP_STR && !rl_mp_skip(&p, end, NULL)) return false;
  }
  return true;
}

/* The value of `name` in a map (absent: kind MP_NIL, *present false). */
static bool map_val(const uint8_t* p, uint32_t n, const uint8_t* end, const char* name, mp_val* v,
                    bool* present) {
  const uint8_t* at;
  if (!map_get(p, n, end, name, &at)) return false;
  if (present) *present = at != NULL;
  if (!at) {
    memset(v, 0, sizeof *v);
    return true;
  }
  return rl_mp_next(&at, end, v);
}

/* ------------------------------------------------------------------ token */

static bool decode_logprobs(const uint8_t* p, const uint8_t* end, size_t n_ids, rl_scratch* s,
                            size_t frame_len) {
  mp_val arr, e, v, w;
  if (!rl_mp_next(&p, end, &arr) || arr.kind != MP_ARRAY || arr.n != n_ids) return false;
  if (!grow((void**)&s->lps, &s->lps_cap, n_ids + 1, sizeof *s->lps) ||
      !grow((void**)&s->top_ids, &s->top_cap, frame_len + 1, sizeof *s->top_ids) ||
      !grow((void**)&s->top_lps, &s->top_lps_cap, frame_len + 1, sizeof *s->top_lps))
    return false; /* no entry holds more ids than the frame has bytes */
  size_t top_cap = s->top_cap < s->top_lps_cap ? s->top_cap : s->top_lps_cap;
  size_t used = 0;
  for (uint32_t i = 0; i < arr.n; i++) {
    if (!rl_mp_next(&p, end, &e) || e.kind != MP_MAP) return false;
    const uint8_t* body = p;
    rl_logprob* lp = &s->lps[i];
    memset(lp, 0, sizeof *lp);
    bool present;
    if (!map_val(body, e.n, end, "logprob", &v, &present) || !present ||
        !as_number(&v, &lp->logprob))
      return false;
    if (!map_val(body, e.n, end, "token", &v, &present)) return false;
    if (present && v.kind != MP_NIL) {
      if (v.kind != MP_STR || !rl_utf8_valid(v.s, v.n)) return false;
      lp->token = keep_str(s, &v);
    }
    const uint8_t *ids_at, *lps_at, *toks_at;
    if (!map_get(body, e.n, end, "top_ids", &ids_at) || !ids_at ||
        !map_get(body, e.n, end, "top_logprobs", &lps_at) || !lps_at ||
        !map_get(body, e.n, end, "top_tokens", &toks_at))
      return false;
    if (!rl_mp_next(&ids_at, end, &v) || v.kind != MP_ARRAY || !rl_mp_next(&lps_at, end, &w) ||
        w.kind != MP_ARRAY || v.n != w.n || used + v.n > top_cap)
      return false;
    lp->n_top = v.n;
    lp->top_ids = s->top_ids + used;
    lp->top_logprobs = s->top_lps + used;
    for (uint32_t j = 0; j < v.n; j++, used++) {
      mp_val a, b;
      if (!rl_mp_next(&ids_at, end, &a) || !as_token_id(&a, &s->top_ids[used]) ||
          !rl_mp_next(&lps_at, end, &b) || !as_number(&b, &s->top_lps[used]))
        return false;
    }
    if (toks_at) {
      mp_val t;
      if (!rl_mp_next(&toks_at, end, &t) ||
          (t.kind != MP_NIL && (t.kind != MP_ARRAY || t.n != v.n)))
        return false;
    }
    p = body; /* past the entry: its pairs */
    for (uint64_t j = 0; j < 2 * (uint64_t)e.n; j++)
      if (!rl_mp_skip(&p, end, NULL)) return false;
  }
  return true;
}

bool rl_decode_token(const rl_reply* r, rl_scratch* s, rl_token* t) {
  memset(t, 0, sizeof *t);
  t->id = r->id;
  if (r->broken || !reserve_chars(s, r->len)) return false;
  mp_val v;
  const uint8_t* p = r->field[RL_F_TOKEN_IDS];
  if (p) {
    uint32_t n = r->n_bare_ids; /* a batch chunk's ids: no array header of their own */
    if (!r->bare_ids) {
      if (!rl_mp_next(&p, r->end, &v) || v.kind != MP_ARRAY) return false;
      n = v.n;
    }
    if (!grow((void**)&s->ids, &s->ids_cap, (size_t)n + 1, sizeof *s->ids)) return false;
    for (uint32_t i = 0; i < n; i++) {
      mp_val e;
      if (!rl_mp_next(&p, r->end, &e) || !as_token_id(&e, &s->ids[i])) return false;
    }
    t->n_token_ids = n;
  }
  t->token_ids = s->ids;
  if ((p = r->field[RL_F_TEXT]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v)) return false;
    if (v.kind != MP_NIL) {
      if (v.kind != MP_STR || !rl_utf8_valid(v.s, v.n)) return false;
      t->text = keep_str(s, &v), t->text_len = v.n;
    }
  }
  if ((p = r->field[RL_F_INDEX]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v) || v.kind != MP_INT || v.i < 0 || v.i > INT32_MAX) return false;
    t->index = (uint32_t)v.i;
  }
  if ((p = r->field[RL_F_FINISH_REASON]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v)) return false;
    if (v.kind != MP_NIL && (t->finish_reason = finish_reason_of(&v)) == NULL) return false;
  }
  if ((p = r->field[RL_F_LOGPROBS]) != NULL) {
    const uint8_t* q = p;
    if (!rl_mp_next(&q, r->end, &v)) return false;
    if (v.kind != MP_NIL) {
      if (!decode_logprobs(p, r->end, t->n_token_ids, s, r->len)) return false;
      t->logprobs = s->lps;
    }
  }
  return true;
}

/* ------------------------------------------------------------------ done */

/* A usage / choice count: absent 0, else an int >= 0. */
static bool count_of(const uint8_t* p, uint32_t n, const uint8_t* end, const char* name,
                     int64_t* out) {
  mp_val v;
  bool present;
  if (!map_val(p, n, end, name, &v, &present)) return false;
  if (!present) return *out = 0, true;
  if (v.kind != MP_INT || v.i < 0) return false;
  *out = v.i;
  return true;
}

/* A str-or-nil field of a map, copied; absent or nil: NULL. */
static bool opt_str(const uint8_t* p, uint32_t n, const uint8_t* end, const char* name,
                    rl_scratch* s, const char** out) {
  mp_val v;
  *out = NULL;
  if (!map_val(p, n, end, name, &v, NULL)) return false;
  if (v.kind == MP_NIL) return true;
  if (v.kind != MP_STR || !rl_utf8_valid(v.s, v.n)) return false;
  *out = keep_str(s, &v);
  return true;
}

static bool decode_choices(const uint8_t* p, const uint8_t* end, rl_scratch* s, rl_done* d) {
  mp_val arr, e, v;
  if (!rl_mp_next(&p, end, &arr)) return false;
  if (arr.kind == MP_NIL) return true;
  if (arr.kind != MP_ARRAY) return false;
  if (!grow((void**)&s->choices, &s->choices_cap, (size_t)arr.n + 1, sizeof *s->choices))
    return false;
  for (uint32_t i = 0; i < arr.n; i++) {
    rl_choice_end* c = &s->choices[i];
    if (!rl_mp_next(&p, end, &e) || e.kind != MP_MAP) return false;
    bool present;
    if (!map_val(p, e.n, end, "index", &v, &present) || v.kind != MP_INT || v.i < 0 ||
        v.i > INT32_MAX)
      return false;
    c->index = (uint32_t)v.i;
    if (!opt_str(p, e.n, end, "finish_reason", s, &c->finish_reason) || !c->finish_reason ||
        !count_of(p, e.n, end, "completion_tokens", &c->completion_tokens))
      return false;
    if (!map_val(p, e.n, end, "completion_tokens", &v, &present) || !present) return false;
    for (uint64_t j = 0; j < 2 * (uint64_t)e.n; j++)
      if (!rl_mp_skip(&p, end, NULL)) return false;
  }
  d->choices = s->choices, d->n_choices = arr.n;
  return true;
}

static void timing_of(const uint8_t* p, const uint8_t* end, rl_done* d) {
  mp_val m, v;
  if (!p || !rl_mp_next(&p, end, &m) || m.kind != MP_MAP) return;
  const char* names[] = {"queue_ms", "ttft_ms", "e2e_ms"};
  double* outs[] = {&d->queue_ms, &d->ttft_ms, &d->e2e_ms};
  for (int k = 0; k < 3; k++) {
    double x;
    if (map_val(p, m.n, end, names[k], &v, NULL) && as_number(&v, &x) && isfinite(x)) *outs[k] = x;
  }
}

static bool decode_done(const rl_reply* r, rl_scratch* s, rl_done* d) {
  mp_val v;
  const uint8_t* p;
  if (r->broken || !reserve_chars(s, r->len)) return false;
  d->finish_reason = "error";
  if ((p = r->field[RL_F_FINISH_REASON]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v) || (d->finish_reason = finish_reason_of(&v)) == NULL)
      return false;
  }
  if ((p = r->field[RL_F_USAGE]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v) || (v.kind != MP_NIL && v.kind != MP_MAP)) return false;
    if (v.kind == MP_MAP && (!count_of(p, v.n, r->end, "prompt_tokens", &d->prompt_tokens) ||
                             !count_of(p, v.n, r->end, "completion_tokens", &d->completion_tokens)))
      return false;
  }
  if ((p = r->field[RL_F_ERROR]) != NULL) {
    if (!rl_mp_next(&p, r->end, &v) || (v.kind != MP_NIL && v.kind != MP_MAP)) return false;
    if (v.kind == MP_MAP && (!opt_str(p, v.n, r->end, "code", s, &d->error_code_str) ||
                             !opt_str(p, v.n, r->end, "message", s, &d->error_message)))
      return false;
  }
  if (strcmp(d->finish_reason, "error") == 0) {
    d->error_code = d->error_code_str ? rl_code_from_name(d->error_code_str) : RL_ERR_UNKNOWN;
  }
  timing_of(r->field[RL_F_TIMING], r->end, d);
  if ((p = r->field[RL_F_CHOICES]) != NULL && !decode_choices(p, r->end, s, d)) return false;
  return true;
}

void rl_decode_done(const rl_reply* r, rl_scratch* s, rl_done* d) {
  double t = d->recv_time;
  memset(d, 0, sizeof *d);
  d->id = r->id;
  d->queue_ms = d->ttft_ms = d->e2e_ms = -1.0;
  d->recv_time = t;
  if (!decode_done(r, s, d))
    rl_local_done(d, r->id, RL_ERR_BAD_REPLY, "malformed done message from the server", 0, t);
}

/* ------------------------------------------------------------------ stats, error */

void rl_decode_stats(const rl_reply* r, rl_stats* st) {
  mp_val v, w;
  const uint8_t* p;
  st->protocol[0] = '\0';
  st->vocab_size = st->max_context = -1;
  st->engine_dead = false;
  if ((p = r->field[RL_F_PROTOCOL]) && rl_mp_next(&p, r->end, &v) && v.kind == MP_STR &&
      v.n < sizeof st->protocol && rl_utf8_valid(v.s, v.n)) {
    memcpy(st->protocol, v.s, v.n);
    st->protocol[v.n] = '\0';
  }
  if ((p = r->field[RL_F_ENGINE_DEAD]) && rl_mp_next(&p, r->end, &v))
    st->engine_dead = v.kind != MP_NIL;
  if ((p = r->field[RL_F_MODEL_INFO]) && rl_mp_next(&p, r->end, &v) && v.kind == MP_MAP) {
    if (map_val(p, v.n, r->end, "vocab_size", &w, NULL) && w.kind == MP_INT) st->vocab_size = w.i;
    if (map_val(p, v.n, r->end, "max_context", &w, NULL) && w.kind == MP_INT) st->max_context = w.i;
  }
}

void rl_decode_error_message(const rl_reply* r, char* buf, size_t cap) {
  mp_val v;
  const uint8_t* p = r->field[RL_F_MESSAGE];
  snprintf(buf, cap, "(no message)");
  if (p && rl_mp_next(&p, r->end, &v) && v.kind == MP_STR && rl_utf8_valid(v.s, v.n)) {
    size_t n = v.n < cap - 1 ? v.n : cap - 1;
    memcpy(buf, v.s, n);
    buf[n] = '\0';
  }
}

bool rl_decode_hello_batch(const rl_reply* r) {
  mp_val v;
  const uint8_t* p = r->field[RL_F_BATCH];
  return p && rl_mp_next(&p, r->end, &v) && v.kind == MP_BOOL && v.b;
}
