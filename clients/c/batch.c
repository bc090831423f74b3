/* batch.c: batch frames (protocol 1.7). One frame carries a step's chunks of every stream of this
 * connection and the dones of those that ended; it is expanded into exactly the token and done
 * replies it means, so the rest of the client handles them as it handles token and done frames. */
#include <string.h>

#include "internal.h"
#include "msgpack_reader.h"

/* The optional per-chunk lists (one entry per chunk, nil for none) and their keys in a token. */
#define N_CHUNK_LISTS 4
static const int CHUNK_LISTS[N_CHUNK_LISTS] = {RL_F_TEXT, RL_F_INDEX, RL_F_LOGPROBS,
                                               RL_F_FINISH_REASON};
static const char* const CHUNK_KEYS[N_CHUNK_LISTS] = {"text", "index", "logprobs", "finish_reason"};

/* Where a batch's lists start (their first element; NULL: absent or nil) and their lengths. */
typedef struct batch_lists {
  const uint8_t *ids, *n_tokens, *token_ids, *done;
  uint32_t n_chunks, n_token_ids, n_done;
  const uint8_t* optional[N_CHUNK_LISTS];
} batch_lists;

/* A list field: absent or nil leaves *items NULL; false when it is anything but an array. */
static bool open_list(const rl_reply* r, int field, const uint8_t** items, uint32_t* n) {
  const uint8_t* p = r->field[field];
  mp_val v;
  *items = NULL, *n = 0;
  if (!p) return true;
  if (!rl_mp_next(&p, r->end, &v)) return false;
  if (v.kind == MP_NIL) return true;
  if (v.kind != MP_ARRAY) return false;
  *items = p, *n = v.n;
  return true;
}

/* Checks the batch's shape before anything is handed on, so a malformed one means nothing. */
static bool open_batch(const rl_reply* r, batch_lists* b) {
  uint32_t n;
  memset(b, 0, sizeof *b);
  if (r->broken || !open_list(r, RL_F_IDS, &b->ids, &b->n_chunks) ||
      !open_list(r, RL_F_N_TOKENS, &b->n_tokens, &n) || n != b->n_chunks ||
      !open_list(r, RL_F_TOKEN_IDS, &b->token_ids, &b->n_token_ids) ||
      !open_list(r, RL_F_DONE, &b->done, &b->n_done))
    return false;
  for (int k = 0; k < N_CHUNK_LISTS; k++)
    if (!open_list(r, CHUNK_LISTS[k], &b->optional[k], &n) || (b->optional[k] && n != b->n_chunks))
      return false;
  const uint8_t* p = b->n_tokens;
  uint64_t left = b->n_token_ids; /* n_tokens: ints >= 0 that share out exactly the token ids */
  for (uint32_t i = 0; i < b->n_chunks; i++) {
    mp_val v;
    if (!rl_mp_next(&p, r->end, &v) || v.kind != MP_INT || v.i < 0 || (uint64_t)v.i > left)
      return false;
    left -= (uint64_t)v.i;
  }
  return left == 0;
}

/* Chunk i's view: its id, its n ids (bare, at *tokens) and the non-nil entries of the lists;
 * every cursor moves past chunk i. false: the frame ended early (cannot happen once checked). */
static bool next_chunk(const rl_reply* r, batch_lists* b, rl_reply* chunk) {
  mp_val v;
  memset(chunk, 0, sizeof *chunk);
  chunk->op = RL_OP_TOKEN, chunk->end = r->end, chunk->len = r->len, chunk->bare_ids = true;
  const uint8_t* at = b->ids;
  if (rl_mp_next(&at, r->end, &v) && v.kind == MP_INT) chunk->has_id = true, chunk->id = v.i;
  if (!rl_mp_skip(&b->ids, r->end, NULL) || !rl_mp_next(&b->n_tokens, r->end, &v)) return false;
  chunk->n_bare_ids = (uint32_t)v.i;
  chunk->field[RL_F_TOKEN_IDS] = b->token_ids;
  for (uint32_t j = 0; j < chunk->n_bare_ids; j++)
    if (!rl_mp_skip(&b->token_ids, r->end, NULL)) return false;
  for (int k = 0; k < N_CHUNK_LISTS; k++) {
    if (!b->optional[k]) continue;
    at = b->optional[k];
    if (rl_mp_next(&at, r->end, &v) && v.kind != MP_NIL)
      chunk->field[CHUNK_LISTS[k]] = b->optional[k];
    if (!rl_mp_skip(&b->optional[k], r->end, NULL)) return false;
  }
  return true;
}

int rl_batch_expand(const rl_reply* r, rl_batch_part_fn fn, void* ctx) {
  batch_lists b;
  if (!open_batch(r, &b)) return -1;
  int handled = 0;
  rl_reply part;
  for (uint32_t i = 0; i < b.n_chunks; i++) {
    if (!next_chunk(r, &b, &part)) return handled;
    handled += fn(ctx, &part);
  }
  const uint8_t* p = b.done;
  for (uint32_t i = 0; i < b.n_done; i++) {
    const uint8_t* start = p;
    if (!rl_mp_skip(&p, r->end, NULL)) return handled;
    rl_reply_scan(start, (size_t)(p - start), &part);
    if (part.op == RL_OP_DONE) handled += fn(ctx, &part); /* anything else there means nothing */
  }
  return handled;
}

/* ------------------------------------------------------------------ parts as frames */

static uint8_t* put_key(uint8_t* w, const char* key) { /* a fixstr: every key here is < 32 bytes */
  size_t n = strlen(key);
  *w++ = (uint8_t)(0xa0 | n);
  memcpy(w, key, n);
  return w + n;
}

static uint8_t* put_be(uint8_t* w, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; i--) *w++ = (uint8_t)(v >> (8 * i));
  return w;
}

/* The end of the value at p (the frame was checked whole: it is there). */
static const uint8_t* value_end(const uint8_t* p, const uint8_t* end) {
  return rl_mp_skip(&p, end, NULL) ? p : end;
}

static bool init_copy(zmq_msg_t* msg, const uint8_t* data, size_t len) {
  zmq_msg_close(msg);
  if (zmq_msg_init_size(msg, len) != 0) return zmq_msg_init(msg), false;
  memcpy(zmq_msg_data(msg), data, len);
  return true;
}

bool rl_batch_part_frame(const rl_reply* part, zmq_msg_t* msg) {
  if (!part->bare_ids) return init_copy(msg, part->end - part->len, part->len); /* a done map */
  const uint8_t* ids = part->field[RL_F_TOKEN_IDS];
  const uint8_t* ids_end = ids;
  for (uint32_t j = 0; ids && j < part->n_bare_ids; j++) ids_end = value_end(ids_end, part->end);
  size_t ids_bytes = ids ? (size_t)(ids_end - ids) : 0; /* no token_ids at all: none */
  /* {"op": "token", "id": int64, "token_ids": array32 + the ids, then the lists' entries} */
  size_t size = 1 + 3 + 6 + 3 + 9 + 10 + 5 + ids_bytes;
  uint32_t pairs = 3;
  for (int k = 0; k < N_CHUNK_LISTS; k++) {
    const uint8_t* at = part->field[CHUNK_LISTS[k]];
    if (at) pairs++, size += 1 + strlen(CHUNK_KEYS[k]) + (size_t)(value_end(at, part->end) - at);
  }
  zmq_msg_close(msg);
  if (zmq_msg_init_size(msg, size) != 0) return zmq_msg_init(msg), false;
  uint8_t* w = zmq_msg_data(msg);
  *w++ = (uint8_t)(0x80 | pairs);
  w = put_key(put_key(w, "op"), "token");
  w = put_key(w, "id");
  *w++ = 0xd3; /* int64 */
  w = put_be(w, (uint64_t)part->id, 8);
  w = put_key(w, "token_ids");
  *w++ = 0xdd; /* array32 */
  w = put_be(w, part->n_bare_ids, 4);
  if (ids_bytes) memcpy(w, ids, ids_bytes), w += ids_bytes;
  for (int k = 0; k < N_CHUNK_LISTS; k++) {
    const uint8_t* at = part->field[CHUNK_LISTS[k]];
    if (!at) continue;
    size_t n = (size_t)(value_end(at, part->end) - at);
    w = put_key(w, CHUNK_KEYS[k]);
    memcpy(w, at, n), w += n;
  }
  return true;
}
