/* batch_checks.c: unit checks of the batch frame decoder (batch.c) on hand-made frames, written in
 * a compact notation: {k:v,...} [v,...] "str" word (a str) 12 -3 0.5 ~ (nil) true false. Each check
 * expands a frame and compares what it means, one event per chunk and done, with the expected
 * text; every part also goes through rl_batch_part_frame (the copy the blocking form keeps) and
 * must decode to the same event. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "../json_util.h"
#include "checks.h"

/* ------------------------------------------------------------------ the notation */

/* Items of the container whose body starts at p (just past its bracket): commas at depth 0. */
static uint32_t count_items(const char* p) {
  int depth = 0;
  bool quoted = false, any = false;
  uint32_t commas = 0;
  for (; *p; p++) {
    if (quoted) {
      quoted = *p != '"';
      continue;
    }
    if ((*p == '}' || *p == ']') && depth-- == 0) break;
    if (*p == '{' || *p == '[') depth++;
    if (*p == '"') quoted = true;
    if (*p == ',' && depth == 0) commas++;
    if (!isspace((unsigned char)*p)) any = true;
  }
  return any ? commas + 1 : 0;
}

static void skip_space(const char** sp) {
  while (isspace((unsigned char)**sp)) (*sp)++;
}

static bool pack_value(msgpack_packer* pk, const char** sp);

static bool pack_container(msgpack_packer* pk, const char** sp) {
  bool map = **sp == '{';
  uint32_t n = count_items(++*sp);
  if (map)
    msgpack_pack_map(pk, n);
  else
    msgpack_pack_array(pk, n);
  for (uint32_t i = 0; i < n; i++) {
    if (!pack_value(pk, sp)) return false;
    skip_space(sp);
    if (map && (*(*sp)++ != ':' || !pack_value(pk, sp))) return false;
    skip_space(sp);
    if (**sp == ',') (*sp)++;
  }
  skip_space(sp);
  return *(*sp)++ == (map ? '}' : ']');
}

static bool pack_value(msgpack_packer* pk, const char** sp) {
  skip_space(sp);
  const char* p = *sp;
  if (*p == '{' || *p == '[') return pack_container(pk, sp);
  if (*p == '~') return msgpack_pack_nil(pk), *sp = p + 1, true;
  if (*p == '"') {
    const char* end = strchr(p + 1, '"');
    if (!end) return false;
    msgpack_pack_str(pk, (size_t)(end - p - 1));
    msgpack_pack_str_body(pk, p + 1, (size_t)(end - p - 1));
    return *sp = end + 1, true;
  }
  if (*p == '-' || isdigit((unsigned char)*p)) {
    char* end;
    double x = strtod(p, &end);
    if (memchr(p, '.', (size_t)(end - p)) || memchr(p, 'e', (size_t)(end - p)))
      msgpack_pack_double(pk, x);
    else
      msgpack_pack_int64(pk, strtoll(p, NULL, 10));
    return *sp = end, true;
  }
  size_t n = 0;
  while (isalnum((unsigned char)p[n]) || p[n] == '_') n++;
  if (!n) return false;
  if (n == 4 && !strncmp(p, "true", 4))
    msgpack_pack_true(pk);
  else if (n == 5 && !strncmp(p, "false", 5))
    msgpack_pack_false(pk);
  else
    msgpack_pack_str(pk, n), msgpack_pack_str_body(pk, p, n);
  return *sp = p + n, true;
}

/* ------------------------------------------------------------------ events as text */

typedef struct text_buf {
  char s[2048];
  size_t len;
} text_buf;

static void put(text_buf* b, const char* fmt, ...) {
  if (b->len >= sizeof b->s - 1) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b->s + b->len, sizeof b->s - b->len, fmt, ap);
  va_end(ap);
  if (n > 0) b->len += (size_t)n;
  if (b->len >= sizeof b->s) b->len = sizeof b->s - 1;
}

/* "T<id>[ids]'text'#index!finish_reason lp=<logprob>:<top ids>;..." or "T<id> ignored";
 * "D<id> <finish_reason> ct=<completion tokens> code=<code> local". No id: "-". */
static void describe(const rl_reply* part, rl_scratch* s, text_buf* b) {
  b->len = 0, b->s[0] = '\0';
  char id[24] = "-";
  if (part->has_id) snprintf(id, sizeof id, "%lld", (long long)part->id);
  if (part->op == RL_OP_DONE) {
    rl_done d;
    d.recv_time = 0;
    rl_decode_done(part, s, &d);
    put(b, "D%s %s ct=%lld", id, d.finish_reason, (long long)d.completion_tokens);
    if (d.error_code != RL_OK) put(b, " code=%s", rl_code_name(d.error_code));
    if (d.local) put(b, " local");
    return;
  }
  rl_token t;
  if (!rl_decode_token(part, s, &t)) {
    put(b, "T%s ignored", id);
    return;
  }
  put(b, "T%s[", id);
  for (size_t k = 0; k < t.n_token_ids; k++) put(b, k ? ",%d" : "%d", t.token_ids[k]);
  put(b, "]");
  if (t.text) put(b, "'%s'", t.text);
  if (t.index) put(b, "#%u", t.index);
  if (t.finish_reason) put(b, "!%s", t.finish_reason);
  for (size_t k = 0; t.logprobs && k < t.n_token_ids; k++) {
    put(b, k ? ";%g:" : " lp=%g:", t.logprobs[k].logprob);
    for (size_t m = 0; m < t.logprobs[k].n_top; m++)
      put(b, m ? ",%d" : "%d", t.logprobs[k].top_ids[m]);
  }
}

typedef struct expansion {
  text_buf got;
  int events;
  rl_scratch s, again;
} expansion;

static int visit(void* ctx, const rl_reply* part) {
  expansion* x = ctx;
  text_buf first, copied;
  describe(part, &x->s, &first);
  put(&x->got, "%s%s", x->events++ ? " | " : "", first.s);
  if (!part->has_id) return 1; /* the client never keeps a part that is not a request's */
  zmq_msg_t msg;
  zmq_msg_init(&msg);
  if (rl_batch_part_frame(part, &msg)) {
    rl_reply copy;
    rl_reply_scan(zmq_msg_data(&msg), zmq_msg_size(&msg), &copy);
    describe(&copy, &x->again, &copied);
    if (strcmp(first.s, copied.s) != 0) put(&x->got, " (its copy: %s)", copied.s);
  } else {
    put(&x->got, " (no copy)");
  }
  zmq_msg_close(&msg);
  return 1;
}

/* ------------------------------------------------------------------ the checks */

enum { AS_IS, CUT_LAST_BYTE, TRAILING_BYTE };

typedef struct batch_check {
  const char* name;
  const char* frame;
  int tweak;
  const char* want; /* NULL: a malformed batch, which means nothing */
} batch_check;

#define SEVERAL_CHUNKS                                                               \
  "{op:batch, ids:[1,2,1,3], n_tokens:[2,1,0,1], token_ids:[10,11,20,30],"           \
  " text:[\"ab\",~,\"c\",\"\xc3\xa9\"], done:[{op:done, id:2, finish_reason:length," \
  " usage:{prompt_tokens:3, completion_tokens:1}}]}"

static const batch_check CHECKS[] = {
    {"several_chunks_text_nil_and_present_then_a_done", SEVERAL_CHUNKS, AS_IS,
     "T1[10,11]'ab' | T2[20] | T1[]'c' | T3[30]'\xc3\xa9' | D2 length ct=1"},
    {"choices_finish_reasons_and_logprobs",
     "{op:batch, ids:[5,5,6], n_tokens:[1,1,2], token_ids:[7,8,9,9], index:[~,1,~],"
     " finish_reason:[~,stop,~], logprobs:[~,[{logprob:-0.5, top_ids:[8,3],"
     " top_logprobs:[-0.5,-1.5]}],~]}",
     AS_IS, "T5[7] | T5[8]#1!stop lp=-0.5:8,3 | T6[9,9]"},
    {"dones_only_with_an_error",
     "{op:batch, ids:[], n_tokens:[], token_ids:[], done:[{op:done, id:4, finish_reason:stop,"
     " usage:{prompt_tokens:1, completion_tokens:2}}, {op:done, id:6, finish_reason:error,"
     " error:{code:overloaded, message:busy}}]}",
     AS_IS, "D4 stop ct=2 | D6 error ct=0 code=overloaded"},
    {"dones_only_without_lists", "{op:batch, done:[{op:done, id:9, finish_reason:abort}]}", AS_IS,
     "D9 abort ct=0"},
    {"nil_lists_are_absent", "{op:batch, ids:[1], n_tokens:[1], token_ids:[2], text:~, done:~}",
     AS_IS, "T1[2]"},
    {"empty_batch", "{op:batch}", AS_IS, ""},
    {"text_tails_without_token_ids", "{op:batch, ids:[1,2], n_tokens:[0,0], text:[\"x\",~]}", AS_IS,
     "T1[]'x' | T2[]"},
    {"done_entries_judged_one_by_one",
     "{op:batch, ids:[1], n_tokens:[1], token_ids:[4], done:[{op:done, id:1, finish_reason:length,"
     " usage:{prompt_tokens:\"x\"}}, 5, {op:token, id:1, token_ids:[3]},"
     " {op:done, id:2, finish_reason:length}]}",
     AS_IS, "T1[4] | D1 error ct=0 code=bad_reply local | D2 length ct=0"},
    {"malformed_chunks_ignored_one_by_one",
     "{op:batch, ids:[1,2,3,\"x\"], n_tokens:[1,1,1,0], token_ids:[4,-1,6], text:[\"a\",~,5,~]}",
     AS_IS, "T1[4]'a' | T2 ignored | T3 ignored | T-[]"},
    {"logprobs_not_one_per_id_ignored",
     "{op:batch, ids:[1,1], n_tokens:[2,1], token_ids:[1,2,3], logprobs:[[{logprob:0, top_ids:[],"
     " top_logprobs:[]}], [{logprob:-1, top_ids:[3], top_logprobs:[-1]}]]}",
     AS_IS, "T1 ignored | T1[3] lp=-1:3"},
    /* malformed batches: nothing at all */
    {"text_list_shorter_than_chunks",
     "{op:batch, ids:[1,2,3], n_tokens:[1,1,1], token_ids:[1,2,3], text:[\"a\",\"b\"]}", AS_IS,
     NULL},
    {"index_list_longer_than_chunks",
     "{op:batch, ids:[1], n_tokens:[1], token_ids:[1], index:[0,1]}", AS_IS, NULL},
    {"n_tokens_list_shorter_than_ids", "{op:batch, ids:[1,2], n_tokens:[2], token_ids:[1,2]}",
     AS_IS, NULL},
    {"n_tokens_sum_above_token_ids", "{op:batch, ids:[1,2], n_tokens:[2,1], token_ids:[1,2]}",
     AS_IS, NULL},
    {"n_tokens_sum_below_token_ids", "{op:batch, ids:[1,2], n_tokens:[1,0], token_ids:[1,2]}",
     AS_IS, NULL},
    {"n_tokens_negative", "{op:batch, ids:[1,2], n_tokens:[3,-1], token_ids:[1,2]}", AS_IS, NULL},
    {"n_tokens_huge", "{op:batch, ids:[1], n_tokens:[4294967297], token_ids:[1]}", AS_IS, NULL},
    {"n_tokens_not_ints", "{op:batch, ids:[1], n_tokens:[\"1\"], token_ids:[1]}", AS_IS, NULL},
    {"token_ids_missing", "{op:batch, ids:[1], n_tokens:[1]}", AS_IS, NULL},
    {"ids_not_a_list", "{op:batch, ids:1, n_tokens:[1], token_ids:[1]}", AS_IS, NULL},
    {"logprobs_not_a_list", "{op:batch, ids:[1], n_tokens:[1], token_ids:[1], logprobs:\"x\"}",
     AS_IS, NULL},
    {"done_not_a_list", "{op:batch, ids:[1], n_tokens:[1], token_ids:[1], done:{op:done, id:1}}",
     AS_IS, NULL},
    {"truncated", SEVERAL_CHUNKS, CUT_LAST_BYTE, NULL},
    {"trailing_bytes", SEVERAL_CHUNKS, TRAILING_BYTE, NULL},
};

static bool run_check(const batch_check* c) {
  msgpack_sbuffer buf;
  msgpack_packer pk;
  msgpack_sbuffer_init(&buf);
  msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
  const char* p = c->frame;
  bool packed = pack_value(&pk, &p);
  if (c->tweak == TRAILING_BYTE) msgpack_pack_nil(&pk);
  size_t len = buf.size - (c->tweak == CUT_LAST_BYTE ? 1 : 0);
  expansion x;
  memset(&x, 0, sizeof x);
  rl_reply r;
  rl_reply_scan((const uint8_t*)buf.data, len, &r);
  int handled = packed && r.op == RL_OP_BATCH ? rl_batch_expand(&r, visit, &x) : -2;
  bool ok = c->want ? handled == x.events && strcmp(x.got.s, c->want) == 0
                    : handled == -1 && x.events == 0;
  printf("{\"check\": ");
  json_str(stdout, c->name);
  printf(", \"ok\": %s, \"got\": ", ok ? "true" : "false");
  json_str(stdout, handled == -1 ? "(malformed)" : handled == -2 ? "(not a batch frame)" : x.got.s);
  printf(", \"want\": ");
  json_str(stdout, c->want ? c->want : "(malformed)");
  printf("}\n");
  rl_scratch_free(&x.s);
  rl_scratch_free(&x.again);
  msgpack_sbuffer_destroy(&buf);
  return ok;
}

int run_batch_checks(void) {
  int failed = 0;
  for (size_t i = 0; i < sizeof CHECKS / sizeof *CHECKS; i++) failed += !run_check(&CHECKS[i]);
  fflush(stdout);
  return failed;
}
