/* ringleader.c: the public calls (see ringleader.h); the state and the I/O are in core.c. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------ public: client */

rl_code rl_client_open(const char* address, const rl_options* options, rl_client** out, char* err,
                       size_t err_cap) {
  *out = NULL;
  rl_client* c = calloc(1, sizeof *c);
  if (!c || !address || !(c->address = strdup(address))) {
    if (err && err_cap) snprintf(err, err_cap, "%s", c ? "address: NULL" : "out of memory");
    free(c);
    return c ? RL_ERR_INVALID_ARGUMENT : RL_ERR_NO_MEMORY;
  }
  if (options)
    c->opt = *options;
  else
    rl_options_init(&c->opt);
  c->next_id = 1;
  msgpack_sbuffer_init(&c->sbuf);
  zmq_msg_init(&c->rx);
  int zero = 0, one = 1;
  rl_code code = RL_ERR_SOCKET;
  if (!(c->ctx = zmq_ctx_new()) || !(c->sock = zmq_socket(c->ctx, ZMQ_DEALER)) ||
      zmq_setsockopt(c->sock, ZMQ_RCVHWM, &zero, sizeof zero) || /* a ROUTER drops replies to */
      zmq_setsockopt(c->sock, ZMQ_SNDHWM, &zero, sizeof zero) || /* a full pipe: never fill ours */
      zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero) ||
      zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &one, sizeof one) || /* frames wait in our queue */
      zmq_socket_monitor(c->sock, "inproc://ringleader-monitor", MONITOR_EVENTS) ||
      !(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)) ||
      zmq_connect(c->mon, "inproc://ringleader-monitor")) {
    rl_fail_errno(c, "socket");
  } else if (zmq_connect(c->sock, address) != 0) {
    rl_fail_errno(c, "connect");
    code = RL_ERR_INVALID_ARGUMENT;
  } else {
    c->quiet_since = rl_now();
    rl_queue_hello(c); /* the first frame on the connection: asks for batch frames (1.7) */
    *out = c;
    return RL_OK;
  }
  if (err && err_cap) snprintf(err, err_cap, "%s: %s", address, c->last_error);
  c->closing = true;
  rl_client_close(c);
  return code;
}

void rl_client_close(rl_client* c) {
  if (!c || c->in_dispatch) return; /* not from a callback (see ringleader.h) */
  if (c->sock && !c->closing) {
    c->closing = true;
    rl_flush_out(c);
    for (size_t i = 0; i < c->cap; i++) {
      if (!c->slots[i] || c->slots[i]->finished) continue;
      msgpack_sbuffer_clear(&c->sbuf);
      rl_encode_abort(&c->sbuf, c->slots[i]->id, false, -1);
      if (!c->out_head) zmq_send(c->sock, c->sbuf.data, c->sbuf.size, ZMQ_DONTWAIT);
    }
    rl_fail_pending(c, RL_ERR_CLIENT_CLOSED, "client closed", rl_now());
  }
  rl_drop_out(c);
  for (size_t i = 0; i < c->cap; i++)
    if (c->slots[i]) rl_free_req(c, c->slots[i]);
  free(c->slots);
  if (c->held) rl_node_free(c, c->held);
  while (c->pool) {
    rl_node* n = c->pool;
    c->pool = n->next;
    free(n);
  }
  if (c->sock) {
    int linger = CLOSE_LINGER_MS;
    zmq_socket_monitor(c->sock, NULL, 0);
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(c->sock);
  }
  if (c->mon) {
    int zero = 0;
    zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(c->mon);
  }
  if (c->ctx) zmq_ctx_term(c->ctx);
  zmq_msg_close(&c->rx);
  msgpack_sbuffer_destroy(&c->sbuf);
  rl_scratch_free(&c->cb_scratch);
  rl_scratch_free(&c->next_scratch);
  free(c->pings.v);
  free(c->stats.v);
  free(c->address);
  free(c);
}

size_t rl_client_in_flight(const rl_client* c) {
  return c ? c->active : 0;
}
const char* rl_client_last_error(const rl_client* c) {
  return c ? c->last_error : "";
}
const char* rl_client_server_error(const rl_client* c) {
  return c && c->has_server_error ? c->server_error : NULL;
}
int rl_client_batch_frames(const rl_client* c) {
  if (!c || c->hello_state != HELLO_ANSWERED) return -1;
  return c->batch_frames ? 1 : 0;
}
uint64_t rl_client_frames_received(const rl_client* c) {
  return c ? c->frames_received : 0;
}

/* ------------------------------------------------------------------ public: requests */

rl_code rl_generate(rl_client* c, const rl_request* request, const rl_callbacks* callbacks,
                    int64_t* id_out) {
  if (id_out) *id_out = 0;
  if (!c) return RL_ERR_INVALID_ARGUMENT;
  if (c->closing) return rl_set_error(c, "client is closing"), RL_ERR_INVALID_ARGUMENT;
  rl_code code = rl_request_validate(request, c->last_error, sizeof c->last_error);
  if (code != RL_OK) return code;
  while (rl_find(c, c->next_id) || c->next_id <= 0)
    c->next_id = c->next_id <= 0 ? 1 : c->next_id + 1;
  int64_t id = c->next_id;
  msgpack_sbuffer_clear(&c->sbuf);
  rl_encode_generate(&c->sbuf, id, request);
  if (c->opt.max_frame_bytes && c->sbuf.size > c->opt.max_frame_bytes) {
    rl_set_error(c, "request encodes to %zu bytes; frame limit is %zu", c->sbuf.size,
                 c->opt.max_frame_bytes);
    return RL_ERR_INVALID_ARGUMENT;
  }
  rl_req* r = calloc(1, sizeof *r);
  if (r) r->id = id;
  if (!r || !rl_insert(c, r)) {
    free(r);
    return rl_set_error(c, "out of memory"), RL_ERR_NO_MEMORY;
  }
  if (callbacks) r->has_cb = true, r->cb = *callbacks;
  if ((code = rl_send_sbuf(c)) != RL_OK) {
    rl_remove_req(c, r);
    free(r);
    return code;
  }
  c->active++, c->next_id++;
  if (id_out) *id_out = id;
  return RL_OK;
}

rl_code rl_abort(rl_client* c, int64_t id, const char* finish_reason, int32_t index) {
  if (!c) return RL_ERR_INVALID_ARGUMENT;
  bool stop = finish_reason && strcmp(finish_reason, "stop") == 0;
  if (finish_reason && !stop && strcmp(finish_reason, "abort") != 0) {
    rl_set_error(c, "finish_reason: must be \"abort\" or \"stop\", got \"%.40s\"", finish_reason);
    return RL_ERR_INVALID_ARGUMENT;
  }
  rl_req* r = rl_find(c, id);
  if (!r || r->finished)
    return rl_set_error(c, "request %lld is not in flight", (long long)id), RL_ERR_NOT_FOUND;
  msgpack_sbuffer_clear(&c->sbuf);
  rl_encode_abort(&c->sbuf, id, stop, index < 0 ? -1 : index);
  return rl_send_sbuf(c);
}

/* Frames wait to be sent, other than a lone hello (which an idle client does not wait for). */
static bool unsent_work(const rl_client* c) {
  return c->out_head && !(c->out_head == c->out_tail && c->out_head->hello);
}

static bool refuse_in_dispatch(rl_client* c, const char* what) {
  if (!c) return true;
  if (!c->in_dispatch) return false;
  rl_set_error(c, "%s: not from a callback", what);
  return true;
}

int rl_client_poll(rl_client* c, int timeout_ms) {
  if (refuse_in_dispatch(c, "rl_client_poll") || c->closing) return -(int)RL_ERR_INVALID_ARGUMENT;
  double deadline = timeout_ms < 0 ? -1.0 : rl_now() + timeout_ms / 1000.0;
  int n = 0;
  for (;;) {
    if (timeout_ms < 0 && !rl_busy(c) && !unsent_work(c)) return n; /* nothing to wait for */
    int got = rl_pump(c, rl_remaining_ms(deadline));
    if (got < 0) return got;
    n += got;
    if (n > 0 || (timeout_ms >= 0 && rl_remaining_ms(deadline) == 0)) return n;
  }
}

static void fill_event(rl_client* c, rl_node* node, int64_t id, rl_event* ev) {
  memset(ev, 0, sizeof *ev);
  if (node->local) {
    ev->type = RL_EVENT_DONE;
    rl_local_done(&ev->done, id, node->code, node->message ? node->message : c->fail_msg, 0,
                  node->t);
    return;
  }
  rl_reply r;
  rl_reply_scan(zmq_msg_data(&node->msg), zmq_msg_size(&node->msg), &r);
  if (r.op == RL_OP_TOKEN && rl_decode_token(&r, &c->next_scratch, &ev->token)) {
    ev->type = RL_EVENT_TOKEN;
    ev->token.recv_time = node->t;
  } else { /* the done (a token was checked on arrival) */
    ev->type = RL_EVENT_DONE;
    ev->done.recv_time = node->t;
    rl_decode_done(&r, &c->next_scratch, &ev->done);
  }
}

rl_code rl_next(rl_client* c, int64_t id, int timeout_ms, rl_event* ev) {
  if (refuse_in_dispatch(c, "rl_next") || !ev || c->closing) return RL_ERR_INVALID_ARGUMENT;
  if (c->held) rl_node_free(c, c->held), c->held = NULL;
  rl_req* r = rl_find(c, id);
  if (!r || r->has_cb) {
    rl_set_error(c, "request %lld is not a blocking request in flight", (long long)id);
    return RL_ERR_NOT_FOUND;
  }
  double deadline = timeout_ms < 0 ? -1.0 : rl_now() + timeout_ms / 1000.0;
  while (!r->head) {
    if (timeout_ms >= 0 && rl_remaining_ms(deadline) == 0) {
      rl_set_error(c, "request %lld: nothing within %d ms", (long long)id, timeout_ms);
      return RL_ERR_WAIT_TIMEOUT;
    }
    int got = rl_pump(c, rl_remaining_ms(deadline));
    if (got < 0) return (rl_code)-got;
  }
  rl_node* node = r->head;
  r->head = node->next;
  if (!r->head) r->tail = NULL;
  node->next = NULL;
  c->held = node;
  fill_event(c, node, id, ev);
  if (ev->type == RL_EVENT_DONE) {
    if (node->local) ev->done.completion_tokens = r->tokens;
    rl_remove_req(c, r);
    rl_free_req(c, r);
  }
  return RL_OK;
}

/* Waits for the stats/pong of serial c->await_serial. */
static rl_code await_reply(rl_client* c, int timeout_ms, const char* what) {
  double deadline = timeout_ms < 0 ? -1.0 : rl_now() + timeout_ms / 1000.0;
  while (c->await_state == AWAIT_PENDING) {
    if (timeout_ms >= 0 && rl_remaining_ms(deadline) == 0) break;
    int got = rl_pump(c, rl_remaining_ms(deadline));
    if (got < 0) return c->await_serial = 0, c->await_stats = NULL, (rl_code)-got;
  }
  int state = c->await_state;
  c->await_serial = 0, c->await_stats = NULL, c->await_state = AWAIT_NONE;
  if (state == AWAIT_DONE) return RL_OK;
  if (state == AWAIT_FAILED)
    return rl_set_error(c, "%s: %s", what, c->fail_msg), RL_ERR_DISCONNECTED;
  rl_set_error(c, "%s: no reply from the server within %d ms", what, timeout_ms);
  return RL_ERR_WAIT_TIMEOUT; /* its reply, when it comes, is taken and dropped */
}

static rl_code start_wait(rl_client* c, rl_fifo* f, const char* op) {
  if (refuse_in_dispatch(c, op) || c->closing) return RL_ERR_INVALID_ARGUMENT;
  uint64_t serial = ++c->serial;
  if (!rl_fifo_push(f, serial)) return RL_ERR_NO_MEMORY;
  c->user_waiters++;
  msgpack_sbuffer_clear(&c->sbuf);
  rl_encode_op(&c->sbuf, op);
  rl_code code = rl_send_sbuf(c);
  if (code != RL_OK) {
    f->len--, c->user_waiters--;
    return code;
  }
  c->await_serial = serial, c->await_state = AWAIT_PENDING;
  return RL_OK;
}

rl_code rl_ping(rl_client* c, int timeout_ms, double* rtt_s) {
  double sent = rl_now();
  rl_code code = start_wait(c, &c->pings, "ping");
  if (code == RL_OK && (code = await_reply(c, timeout_ms, "ping")) == RL_OK && rtt_s)
    *rtt_s = c->await_t - sent;
  return code;
}

rl_code rl_stats_get(rl_client* c, int timeout_ms, rl_stats* stats) {
  if (!stats) return RL_ERR_INVALID_ARGUMENT;
  memset(stats, 0, sizeof *stats);
  rl_code code = start_wait(c, &c->stats, "stats");
  if (code != RL_OK) return code;
  c->await_stats = stats;
  code = await_reply(c, timeout_ms, "stats");
  if (code == RL_OK && !stats->raw) return rl_set_error(c, "out of memory"), RL_ERR_NO_MEMORY;
  return code;
}

void rl_stats_free(rl_stats* stats) {
  if (!stats) return;
  free(stats->raw);
  stats->raw = NULL, stats->raw_len = 0;
}
