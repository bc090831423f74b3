/* internal.h: what ringleader.c (the client), core.c (state, I/O), wire.c and batch.c (frames in)
 * and request.c (frames out) share. Not installed. */
#ifndef RINGLEADER_INTERNAL_H
#define RINGLEADER_INTERNAL_H

#include <msgpack.h>
#include <zmq.h>

#include "ringleader.h"

/* The reply ops (protocol.md "Server to client"); RL_OP_NONE: not a reply map at all. */
enum {
  RL_OP_NONE,
  RL_OP_TOKEN,
  RL_OP_DONE,
  RL_OP_STATS,
  RL_OP_PONG,
  RL_OP_ERROR,
  RL_OP_BATCH,
  RL_OP_HELLO
};

/* The top-level reply fields this client reads. */
enum {
  RL_F_OP,
  RL_F_ID,
  RL_F_TOKEN_IDS,
  RL_F_TEXT,
  RL_F_INDEX,
  RL_F_FINISH_REASON,
  RL_F_LOGPROBS,
  RL_F_USAGE,
  RL_F_ERROR,
  RL_F_TIMING,
  RL_F_CHOICES,
  RL_F_MESSAGE,
  RL_F_PROTOCOL,
  RL_F_MODEL_INFO,
  RL_F_ENGINE_DEAD,
  RL_F_IDS,      /* batch: each chunk's request */
  RL_F_N_TOKENS, /* batch: each chunk's count of token ids */
  RL_F_DONE,     /* batch: the done maps */
  RL_F_BATCH,    /* hello: what the server will send */
  RL_F_COUNT
};

/* What a first pass over a frame found: its op, its (int) id, where each known field's value
 * starts. broken: the frame is not one well-formed msgpack map within the limits (truncated,
 * trailing bytes, too many containers); op and id are still set when they came before the break.
 * A chunk of a batch frame is read as a token reply too (batch.c): its fields point into the batch,
 * and bare_ids says field[RL_F_TOKEN_IDS] holds n_bare_ids ids with no array header. */
typedef struct rl_reply {
  int op;
  bool broken;
  bool has_id;
  int64_t id;
  const uint8_t* field[RL_F_COUNT]; /* NULL: absent */
  const uint8_t* end;
  size_t len;
  bool bare_ids;
  uint32_t n_bare_ids;
} rl_reply;

/* Growable buffers a decoded event points into; reused frame after frame (no allocation once
 * they are large enough). */
typedef struct rl_scratch {
  int32_t* ids;
  size_t ids_cap;
  char* chars;
  size_t chars_cap, chars_len;
  rl_logprob* lps;
  size_t lps_cap;
  int32_t* top_ids;
  double* top_lps;
  size_t top_cap, top_lps_cap;
  rl_choice_end* choices;
  size_t choices_cap;
} rl_scratch;

void rl_scratch_free(rl_scratch* s);

void rl_reply_scan(const uint8_t* data, size_t len, rl_reply* reply);
/* A token frame -> *token (pointing into s and static strings); false: malformed, to be ignored. */
bool rl_decode_token(const rl_reply* reply, rl_scratch* s, rl_token* token);
/* A done frame -> *done; a malformed one becomes a local bad_reply done. */
void rl_decode_done(const rl_reply* reply, rl_scratch* s, rl_done* done);
void rl_decode_stats(const rl_reply* reply, rl_stats* stats);
/* An error op's message, copied (clipped) into buf. */
void rl_decode_error_message(const rl_reply* reply, char* buf, size_t cap);
/* A hello answer's `batch`: true only for a bool true. */
bool rl_decode_hello_batch(const rl_reply* reply);

/* Called for each token chunk and done a batch frame means; returns the events it handled. */
typedef int (*rl_batch_part_fn)(void* ctx, const rl_reply* part);
/* Expands a batch frame (protocol 1.7) into what it means: every chunk as a token reply view
 * (op RL_OP_TOKEN, bare_ids), then every done map as a done reply view (op RL_OP_DONE), in order.
 * Returns the sum of fn's results, or -1 (fn never called) when the batch is malformed: a list
 * that is not one entry per chunk, n_tokens not ints >= 0 summing to len(token_ids), a broken
 * frame. A malformed chunk or done inside a well-formed batch is fn's to judge, as for a frame. */
int rl_batch_expand(const rl_reply* batch, rl_batch_part_fn fn, void* ctx);
/* A batch part as a frame of its own (a chunk: the token frame it means; a done: its map's bytes),
 * for the blocking form, which keeps frames to decode them in rl_next. false: out of memory. */
bool rl_batch_part_frame(const rl_reply* part, zmq_msg_t* msg);

/* A local done (finish_reason "error") for `code`. */
void rl_local_done(rl_done* done, int64_t id, rl_code code, const char* message,
                   int64_t completion_tokens, double now);

rl_code rl_encode_generate(msgpack_sbuffer* buf, int64_t id, const rl_request* request);
void rl_encode_abort(msgpack_sbuffer* buf, int64_t id, bool stop, int32_t index);
void rl_encode_op(msgpack_sbuffer* buf, const char* op);
void rl_encode_hello(msgpack_sbuffer* buf, bool batch);

double rl_now(void);

/* ------------------------------------------------------------------ the client's state (core.c) */
#define CLOSE_LINGER_MS 200 /* time to flush the aborts close() sends */
#define NODE_POOL_MAX 256
#define MONITOR_EVENTS                                                                             \
  (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | \
   ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

/* A frame waiting for a connection, or a buffered event of a blocking request. */
typedef struct rl_node {
  struct rl_node* next;
  zmq_msg_t msg;
  double t;
  bool local; /* a local done: code and message instead of a frame */
  bool hello; /* an outgoing hello: sending it starts the wait for its answer */
  rl_code code;
  char* message; /* malloc'd */
} rl_node;

typedef struct rl_req {
  int64_t id;
  bool has_cb, finished; /* finished: its done is buffered (blocking form) */
  rl_callbacks cb;
  int64_t tokens; /* received so far (a local done counts them) */
  rl_node *head, *tail;
} rl_req;

typedef struct rl_fifo { /* the stats / ping callers in reply order; serial 0: our keep-alive */
  uint64_t* v;
  size_t head, len, cap;
} rl_fifo;

enum { AWAIT_NONE, AWAIT_PENDING, AWAIT_DONE, AWAIT_FAILED };

/* The hello of the current connection: queued (the first frame it will carry), sent and not yet
 * answered, answered; none only when it could not be queued (out of memory). */
enum { HELLO_NONE, HELLO_QUEUED, HELLO_SENT, HELLO_ANSWERED };

struct rl_client {
  void *ctx, *sock, *mon;
  char* address;
  rl_options opt;
  rl_req** slots; /* open addressing by id */
  size_t cap, count, active;
  int64_t next_id;
  msgpack_sbuffer sbuf;
  zmq_msg_t rx;
  rl_node *out_head, *out_tail, *pool;
  size_t pool_len;
  rl_scratch cb_scratch, next_scratch;
  rl_node* held; /* the node of the event rl_next returned last */
  bool connected, pinged, was_busy, closing;
  double quiet_since;
  rl_fifo pings, stats;
  uint64_t serial, await_serial;
  size_t user_waiters;
  int await_state;
  double await_t;
  rl_stats* await_stats;
  int in_dispatch;
  bool has_server_error;
  int hello_state;
  bool batch_frames; /* the server's answer to our hello: it sends batch frames */
  uint64_t frames_received;
  char last_error[512], server_error[512], fail_msg[512];
};

void rl_set_error(rl_client* c, const char* fmt, ...);
int rl_fail_errno(rl_client* c, const char* what);
rl_node* rl_node_new(rl_client* c);
void rl_node_free(rl_client* c, rl_node* n);
rl_req* rl_find(const rl_client* c, int64_t id);
bool rl_insert(rl_client* c, rl_req* r);
void rl_remove_req(rl_client* c, rl_req* r);
void rl_free_req(rl_client* c, rl_req* r);
bool rl_fifo_push(rl_fifo* f, uint64_t v);
void rl_flush_out(rl_client* c);
void rl_drop_out(rl_client* c);
void rl_queue_hello(rl_client* c);
rl_code rl_send_sbuf(rl_client* c);
int rl_fail_pending(rl_client* c, rl_code code, const char* message, double now);
bool rl_busy(const rl_client* c);
int rl_pump(rl_client* c, int wait_ms);
int rl_remaining_ms(double deadline);

#endif /* RINGLEADER_INTERNAL_H */
