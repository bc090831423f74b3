/* ringleader.h: a C client of the ringleader wire protocol (docs/protocol.md, revision 1.8).
 *
 * One client is one ZeroMQ DEALER socket (its own ZeroMQ context) connected to a server. Requests
 * are sent with rl_generate() and answered in either of two forms, chosen per request:
 *   - callbacks (rl_callbacks given): rl_client_poll() dispatches on_token / on_done for every
 *     request in flight;
 *   - blocking (no callbacks): rl_next() waits for that request's next chunk or its done; replies
 *     of other requests that arrive meanwhile are buffered (or dispatched, for callback ones).
 * Every request gets exactly one done: the server's, or a local one (codes disconnected,
 * client_closed, bad_reply).
 *
 * On each connection the client first sends {"op": "hello", "batch": true} (1.7) and goes on at
 * once; it reads per-request token/done frames and batch frames alike, a batch expanded into
 * exactly the chunks and dones it means, delivered as token and done events: the same either way.
 *
 * Threads: a client has no thread of its own and no global state. One client is used from one
 * thread at a time (calls on one client must not overlap); different clients are independent.
 * Callbacks run inside rl_client_poll() / rl_next() / rl_ping() / rl_stats() / rl_client_close()
 * and may call rl_generate() and rl_abort(), but not the calls that wait (poll, next, ping,
 * stats) nor rl_client_close().
 *
 * Pointers inside an rl_token / rl_done handed to a callback are valid during the callback only;
 * those in an rl_event returned by rl_next() until the next rl_next() on that client or its close.
 */
#ifndef RINGLEADER_H
#define RINGLEADER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RL_PROTOCOL_VERSION "1.8"
#define RL_DEFAULT_ADDRESS "tcp://127.0.0.1:5555"
#define RL_DEFAULT_CONNECT_TIMEOUT_MS 10000
#define RL_DEFAULT_REPLY_TIMEOUT_MS 30000
#define RL_DEFAULT_MAX_FRAME_BYTES (1u << 20)
#define RL_MAX_STOP_TOKEN_IDS 8
#define RL_MAX_CHOICES 1024 /* strings of an RL_STRUCTURED_CHOICE constraint */
/* characters of a regex, or of all choices together (a schema's: the server judges, once canonical)
 */
#define RL_MAX_CONSTRAINT_CHARS 65536

/* Result of a call, and the error code of a done. */
typedef enum rl_code {
  RL_OK = 0,
  /* the protocol's codes (a done from the server) */
  RL_ERR_BAD_REQUEST,
  RL_ERR_OVERLOADED,
  RL_ERR_TIMEOUT,
  RL_ERR_ENGINE_DEAD,
  RL_ERR_SHUTDOWN,
  RL_ERR_DUPLICATE_ID,
  /* the client's own dones */
  RL_ERR_DISCONNECTED, /* no connection within connect_timeout, lost, or silent for reply_timeout */
  RL_ERR_CLIENT_CLOSED, /* rl_client_close() while in flight */
  RL_ERR_BAD_REPLY,     /* the server sent a malformed done */
  /* local results of calls */
  RL_ERR_INVALID_ARGUMENT, /* refused locally, nothing sent; rl_client_last_error() names it */
  RL_ERR_UNKNOWN,          /* a done with an error code this client does not know */
  RL_ERR_WAIT_TIMEOUT,     /* a wait (rl_next, rl_ping, rl_stats) ran out of its timeout_ms */
  RL_ERR_NOT_FOUND,        /* no such request in flight (or it is not a blocking one) */
  RL_ERR_NO_MEMORY,
  RL_ERR_SOCKET, /* ZeroMQ failed; rl_client_last_error() says how */
} rl_code;

/* "ok", "bad_request", ..., "disconnected", "client_closed", "bad_reply", "invalid_argument",
 * "unknown", "wait_timeout", "not_found", "no_memory", "socket". */
const char* rl_code_name(rl_code code);
/* The code of a protocol / local name; RL_ERR_UNKNOWN for any other. */
rl_code rl_code_from_name(const char* name);

/* ------------------------------------------------------------------ client */

typedef struct rl_client rl_client;

typedef struct rl_options {
  int connect_timeout_ms; /* <= 0: off; default 10000 */
  int reply_timeout_ms;   /* <= 0: off; default 30000 (a keep-alive ping after a third of it) */
  size_t max_frame_bytes; /* refuse a request that encodes larger (default 1 MiB); 0: no limit */
} rl_options;

void rl_options_init(rl_options* options);

/* Opens a client connected to `address` (e.g. "tcp://127.0.0.1:5555"); options NULL: defaults.
 * On failure *out is NULL and err (when given) says why. */
rl_code rl_client_open(const char* address, const rl_options* options, rl_client** out, char* err,
                       size_t err_cap);

/* Aborts the requests still in flight on the server, ends each locally with code client_closed
 * (on_done for callback requests), closes the socket and frees the client. NULL is a no-op. */
void rl_client_close(rl_client* client);

/* Requests in flight (sent and not yet ended). */
size_t rl_client_in_flight(const rl_client* client);
/* Why the last failing call on this client failed ("" when none). */
const char* rl_client_last_error(const rl_client* client);
/* The message of the latest id-less `error` op the server sent, or NULL. (A 1.6 server's answer
 * to the hello this client sends on connecting is not one: it is taken silently.) */
const char* rl_client_server_error(const rl_client* client);
/* How the server answered the hello of the current connection: 1 it sends batch frames (1.7), 0 it
 * does not (an older server's error, or a refusal), -1 no answer yet. Replies read the same
 * whatever it says: a batch frame is expanded into the token and done events it means. */
int rl_client_batch_frames(const rl_client* client);
/* Frames taken off the socket so far, every kind (a batch frame counts once). */
uint64_t rl_client_frames_received(const rl_client* client);

/* ------------------------------------------------------------------ requests */

/* The output's constraint (protocol 1.8, the generate field `structured`), enforced on the
 * device: a request with one ends with finish_reason "stop" when the output is complete, or
 * "length" when max_tokens cut it short. A server older than 1.8 refuses it (bad_request). */
typedef enum rl_structured_kind {
  RL_STRUCTURED_NONE = 0,    /* no constraint (the default) */
  RL_STRUCTURED_JSON,        /* structured_text: a JSON schema, as its JSON text */
  RL_STRUCTURED_REGEX,       /* structured_text: a regular expression the whole output matches */
  RL_STRUCTURED_CHOICE,      /* choices: the output is exactly one of these strings */
  RL_STRUCTURED_JSON_OBJECT, /* any JSON object */
} rl_structured_kind;

/* A generate request. rl_request_init() sets the protocol's defaults; set the prompt (exactly one
 * of `prompt`, `prompt_ids`) and what you want. Only fields that differ from their defaults are
 * sent. Optional fields (nil on the wire) have a has_* flag. */
typedef struct rl_request {
  const char* prompt;        /* UTF-8 text (NUL-terminated), or NULL; its upper bound
                                is the server's (max_prompt_chars) */
  const int32_t* prompt_ids; /* token ids, or NULL */
  size_t n_prompt_ids;
  bool has_max_tokens;       /* false: the rest of the context (nil) */
  int64_t max_tokens;        /* [0, 4294967295]; 0: nothing generated (protocol 1.10) */
  double temperature;        /* [0, 3.4028235e38]; 0: greedy */
  double top_p;              /* (0, 1] */
  int32_t top_k;             /* [-1, 1024]; 0 or -1: off */
  double min_p;              /* [0, 1] */
  double presence_penalty;   /* [-2, 2] */
  double frequency_penalty;  /* [-2, 2] */
  double repetition_penalty; /* (0, 3.4028235e38] */
  bool has_seed;
  uint64_t seed;
  const int32_t* stop_token_ids; /* at most 8, each >= 0 */
  size_t n_stop_token_ids;
  bool ignore_eos;
  bool has_logprobs;
  int32_t logprobs; /* [0, 20] */
  int32_t n;        /* [1, 128] choices */
  int32_t priority; /* [-1000, 1000] */
  bool has_timeout_ms;
  int64_t timeout_ms; /* [1, 86400000] */
  /* (1.8) the output's constraint, sent as {"json": text}, {"regex": text}, {"choice": [...]} or
   * {"json_object": true}; the server judges what the client cannot (the schema, the pattern) */
  rl_structured_kind structured;
  const char* structured_text; /* JSON, REGEX: NUL-terminated UTF-8, non-empty */
  const char* const* choices;  /* CHOICE: 1..RL_MAX_CHOICES non-empty NUL-terminated UTF-8 */
  size_t n_choices;
} rl_request;

void rl_request_init(rl_request* request);

/* Judges the request as rl_generate() does, without a client: RL_OK, or RL_ERR_INVALID_ARGUMENT
 * with msg (when given) starting with the field's name, e.g. "top_p: must be ...". */
rl_code rl_request_validate(const rl_request* request, char* msg, size_t msg_cap);

/* One logprobs entry of a token (a request with logprobs): the token's and its top alternatives'.
 */
typedef struct rl_logprob {
  double logprob;
  size_t n_top;
  const int32_t* top_ids;
  const double* top_logprobs;
  const char* token; /* the token's text, or NULL (no tokenizer) */
} rl_logprob;

/* A token message: the newly generated ids of one choice, in order. */
typedef struct rl_token {
  int64_t id;
  uint32_t index; /* the choice (0 unless n > 1) */
  const int32_t* token_ids;
  size_t n_token_ids; /* may be 0 (held-back text, or a choice's last message) */
  const char* text;   /* NUL-terminated UTF-8 these ids add, or NULL (no tokenizer) */
  size_t text_len;
  const char* finish_reason;  /* the last message of a choice of a request with n > 1, or NULL */
  const rl_logprob* logprobs; /* one per token id when the request asked, else NULL */
  double recv_time;           /* CLOCK_MONOTONIC seconds when the frame was taken off the socket */
} rl_token;

typedef struct rl_choice_end {
  uint32_t index;
  const char* finish_reason;
  int64_t completion_tokens;
} rl_choice_end;

/* The end of a request: exactly one per request. */
typedef struct rl_done {
  int64_t id;
  const char* finish_reason; /* "stop", "length", "abort" or "error" */
  int64_t prompt_tokens;
  int64_t completion_tokens;  /* every choice's together */
  rl_code error_code;         /* RL_OK unless finish_reason is "error" */
  const char* error_code_str; /* the code as sent ("timeout", ...), or NULL */
  const char* error_message;  /* or NULL */
  bool local;                 /* made by this client (disconnected, client_closed, bad_reply) */
  double queue_ms, ttft_ms, e2e_ms; /* the server's timing; < 0 when absent */
  const rl_choice_end* choices;     /* n > 1: how each choice ended, else NULL */
  size_t n_choices;
  double recv_time; /* CLOCK_MONOTONIC seconds (a local done: when it was made) */
} rl_done;

typedef struct rl_callbacks {
  void (*on_token)(void* user, const rl_token* token); /* may be NULL */
  void (*on_done)(void* user, const rl_done* done);    /* may be NULL */
  void* user;
} rl_callbacks;

/* Sends a generate request; the client assigns its id (*id_out, unique per client). callbacks
 * NULL: the blocking form, read it with rl_next(). A refused request (RL_ERR_INVALID_ARGUMENT,
 * rl_client_last_error() names the field) is never sent and gets no done. */
rl_code rl_generate(rl_client* client, const rl_request* request, const rl_callbacks* callbacks,
                    int64_t* id_out);

/* Asks the server to stop request `id`; its done still comes (normally with finish_reason
 * "abort"). finish_reason NULL or "abort", or "stop" (the done says stop). index < 0: every
 * choice; else only that choice of a request with n > 1. RL_ERR_NOT_FOUND: not in flight. */
rl_code rl_abort(rl_client* client, int64_t id, const char* finish_reason, int32_t index);

/* Waits up to timeout_ms (< 0: while anything is outstanding; 0: no wait) until something
 * happens, and handles every reply there: callbacks run, replies of blocking requests are
 * buffered, the liveness rules are kept. Returns how many token/done events it handled (0: none
 * within timeout_ms, or nothing outstanding), or -RL_ERR_INVALID_ARGUMENT from a callback. */
int rl_client_poll(rl_client* client, int timeout_ms);

typedef enum rl_event_type { RL_EVENT_TOKEN = 1, RL_EVENT_DONE = 2 } rl_event_type;

typedef struct rl_event {
  rl_event_type type;
  rl_token token; /* type RL_EVENT_TOKEN */
  rl_done done;   /* type RL_EVENT_DONE: the request is over, its id forgotten */
} rl_event;

/* Blocking form: the next chunk or the done of request `id` (one sent without callbacks), waiting
 * up to timeout_ms (< 0: until it comes; the liveness rules bound that wait). Callback requests
 * are served meanwhile. RL_ERR_WAIT_TIMEOUT: nothing yet; RL_ERR_NOT_FOUND: no such request. */
rl_code rl_next(rl_client* client, int64_t id, int timeout_ms, rl_event* event);

/* Round trip to the server (seconds). RL_ERR_DISCONNECTED when the liveness rules give up. */
rl_code rl_ping(rl_client* client, int timeout_ms, double* rtt_s);

typedef struct rl_stats {
  char protocol[16];   /* "1.8"; "" when the server does not say (older than 1.4) */
  int64_t vocab_size;  /* model_info.vocab_size, -1 when absent */
  int64_t max_context; /* model_info.max_context, -1 when absent */
  bool engine_dead;    /* engine_dead is not nil */
  uint8_t* raw;        /* the whole stats frame (msgpack), malloc'd: free with rl_stats_free */
  size_t raw_len;
} rl_stats;

rl_code rl_stats_get(rl_client* client, int timeout_ms, rl_stats* stats);
void rl_stats_free(rl_stats* stats);

#ifdef __cplusplus
}
#endif

#endif /* RINGLEADER_H */
