/* core.c: a client's state and I/O: its requests in flight (by id), the frames waiting for a
 * connection, the socket and its monitor, and the liveness rules (the Python client's,
 * ipc/client/core.py Liveness). The public calls are in ringleader.c. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void rl_set_error(rl_client* c, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->last_error, sizeof c->last_error, fmt, ap);
  va_end(ap);
}

/* ------------------------------------------------------------------ nodes, table, fifos */

rl_node* rl_node_new(rl_client* c) {
  rl_node* n = c->pool;
  if (n) {
    c->pool = n->next, c->pool_len--;
  } else if ((n = malloc(sizeof *n)) == NULL) {
    return NULL;
  }
  memset(n, 0, sizeof *n);
  zmq_msg_init(&n->msg);
  return n;
}

void rl_node_free(rl_client* c, rl_node* n) {
  zmq_msg_close(&n->msg);
  free(n->message);
  if (c->pool_len < NODE_POOL_MAX) {
    n->next = c->pool, c->pool = n, c->pool_len++;
  } else {
    free(n);
  }
}

static size_t slot_of(const rl_client* c, int64_t id) {
  uint64_t x = (uint64_t)id * 0x9E3779B97F4A7C15ull;
  return (size_t)(x >> 17) & (c->cap - 1);
}

rl_req* rl_find(const rl_client* c, int64_t id) {
  if (!c->cap) return NULL;
  for (size_t i = slot_of(c, id); c->slots[i]; i = (i + 1) & (c->cap - 1))
    if (c->slots[i]->id == id) return c->slots[i];
  return NULL;
}

bool rl_insert(rl_client* c, rl_req* r) {
  if ((c->count + 1) * 2 > c->cap) {
    size_t old = c->cap, cap = old ? old * 2 : 64;
    rl_req** slots = calloc(cap, sizeof *slots);
    if (!slots) return false;
    rl_req** prev = c->slots;
    c->slots = slots, c->cap = cap;
    for (size_t i = 0; i < old; i++) {
      if (!prev[i]) continue;
      size_t j = slot_of(c, prev[i]->id);
      while (slots[j]) j = (j + 1) & (cap - 1);
      slots[j] = prev[i];
    }
    free(prev);
  }
  size_t j = slot_of(c, r->id);
  while (c->slots[j]) j = (j + 1) & (c->cap - 1);
  c->slots[j] = r, c->count++;
  return true;
}

void rl_remove_req(rl_client* c, rl_req* r) { /* backward-shift deletion */
  size_t mask = c->cap - 1, i = slot_of(c, r->id);
  while (c->slots[i] != r) i = (i + 1) & mask;
  c->slots[i] = NULL, c->count--;
  for (size_t j = (i + 1) & mask; c->slots[j]; j = (j + 1) & mask) {
    size_t home = slot_of(c, c->slots[j]->id);
    if (((j - home) & mask) >= ((j - i) & mask))
      c->slots[i] = c->slots[j], c->slots[j] = NULL, i = j;
  }
}

void rl_free_req(rl_client* c, rl_req* r) {
  while (r->head) {
    rl_node* n = r->head;
    r->head = n->next;
    rl_node_free(c, n);
  }
  free(r);
}

bool rl_fifo_push(rl_fifo* f, uint64_t v) {
  if (f->len == f->cap) {
    size_t cap = f->cap ? f->cap * 2 : 8;
    uint64_t* q = malloc(cap * sizeof *q);
    if (!q) return false;
    for (size_t i = 0; i < f->len; i++) q[i] = f->v[(f->head + i) % f->cap];
    free(f->v);
    f->v = q, f->cap = cap, f->head = 0;
  }
  f->v[(f->head + f->len++) % f->cap] = v;
  return true;
}

static bool fifo_pop(rl_fifo* f, uint64_t* v) {
  if (!f->len) return false;
  *v = f->v[f->head], f->head = (f->head + 1) % f->cap, f->len--;
  return true;
}

/* ------------------------------------------------------------------ sending */

void rl_flush_out(rl_client* c) {
  while (c->out_head) {
    /* a hello goes only on a connection the monitor has reported, never into one going away */
    if (c->out_head->hello && !c->connected) return;
    if (zmq_msg_send(&c->out_head->msg, c->sock, ZMQ_DONTWAIT) < 0) return; /* no connection yet */
    rl_node* n = c->out_head;
    if (n->hello) c->hello_state = HELLO_SENT;
    c->out_head = n->next;
    if (!c->out_head) c->out_tail = NULL;
    rl_node_free(c, n);
  }
}

void rl_drop_out(rl_client* c) {
  while (c->out_head) {
    rl_node* n = c->out_head;
    c->out_head = n->next;
    rl_node_free(c, n);
  }
  c->out_tail = NULL;
}

/* Puts a hello first in the queue, so that it is the first frame the next connection carries;
 * nothing waits for its answer (the client reads per-request and batch frames alike). */
void rl_queue_hello(rl_client* c) {
  msgpack_sbuffer buf;
  msgpack_sbuffer_init(&buf);
  rl_encode_hello(&buf, true);
  rl_node* n = buf.data ? rl_node_new(c) : NULL;
  c->hello_state = HELLO_NONE;
  if (n && zmq_msg_init_size(&n->msg, buf.size) == 0) {
    memcpy(zmq_msg_data(&n->msg), buf.data, buf.size);
    n->hello = true, n->next = c->out_head;
    c->out_head = n;
    if (!c->out_tail) c->out_tail = n;
    c->hello_state = HELLO_QUEUED, c->batch_frames = false;
  } else if (n) {
    rl_node_free(c, n);
  }
  msgpack_sbuffer_destroy(&buf);
}

/* Sends c->sbuf now, or queues it until there is a connection (ZMQ_IMMEDIATE). */
rl_code rl_send_sbuf(rl_client* c) {
  if (c->out_head) rl_flush_out(c); /* what waits (the hello) goes first */
  if (!c->out_head && zmq_send(c->sock, c->sbuf.data, c->sbuf.size, ZMQ_DONTWAIT) >= 0)
    return RL_OK;
  if (!c->out_head && zmq_errno() != EAGAIN) return (rl_code)rl_fail_errno(c, "send");
  rl_node* n = rl_node_new(c);
  if (!n) return RL_ERR_NO_MEMORY;
  if (zmq_msg_init_size(&n->msg, c->sbuf.size) != 0) {
    rl_node_free(c, n);
    return RL_ERR_NO_MEMORY;
  }
  memcpy(zmq_msg_data(&n->msg), c->sbuf.data, c->sbuf.size);
  if (c->out_tail)
    c->out_tail->next = n;
  else
    c->out_head = n;
  c->out_tail = n;
  return RL_OK;
}

int rl_fail_errno(rl_client* c, const char* what) {
  rl_set_error(c, "%s: %s", what, zmq_strerror(zmq_errno()));
  return RL_ERR_SOCKET;
}

/* ------------------------------------------------------------------ ending work */

static void dispatch_done(rl_client* c, rl_req* r, const rl_done* d) {
  rl_remove_req(c, r);
  c->active--;
  if (r->cb.on_done) {
    c->in_dispatch++;
    r->cb.on_done(r->cb.user, d);
    c->in_dispatch--;
  }
  rl_free_req(c, r);
}

static void buffer_node(rl_req* r, rl_node* n) {
  if (r->tail)
    r->tail->next = n;
  else
    r->head = n;
  r->tail = n;
}

/* Ends every request in flight with a local done and every stats/ping caller (Python's
 * ClientCore.fail_pending); the frames still waiting for a connection are dropped. */
int rl_fail_pending(rl_client* c, rl_code code, const char* message, double now) {
  snprintf(c->fail_msg, sizeof c->fail_msg, "%s", message);
  bool hello_unsent = c->hello_state == HELLO_QUEUED;
  rl_drop_out(c);
  if (hello_unsent && !c->closing) rl_queue_hello(c); /* the connection to come still needs it */
  c->pings.len = c->stats.len = 0;
  c->user_waiters = 0;
  if (c->await_state == AWAIT_PENDING) c->await_state = AWAIT_FAILED;
  size_t n = 0;
  rl_req** ended = c->active ? malloc(c->active * sizeof *ended) : NULL;
  for (size_t i = 0; ended && i < c->cap; i++)
    if (c->slots[i] && !c->slots[i]->finished) ended[n++] = c->slots[i];
  for (size_t i = 0; i < n; i++) {
    rl_req* r = ended[i];
    rl_node* node = r->has_cb ? NULL : rl_node_new(c);
    if (node) {
      node->local = true, node->code = code, node->t = now, node->message = strdup(message);
      buffer_node(r, node);
      r->finished = true, c->active--;
    } else {
      rl_done d;
      rl_local_done(&d, r->id, code, c->fail_msg, r->tokens, now);
      dispatch_done(c, r, &d); /* (a blocking request when out of memory: dropped) */
    }
  }
  free(ended);
  return (int)n;
}

/* ------------------------------------------------------------------ liveness */

bool rl_busy(const rl_client* c) {
  return c->active > 0 || c->user_waiters > 0;
}

static void heard(rl_client* c, double now) {
  c->quiet_since = now, c->pinged = false;
}

/* How long a wait may last before the liveness check is due (ms); -1: no limit (idle). */
static int poll_interval_ms(const rl_client* c) {
  int ct = c->opt.connect_timeout_ms, rt = c->opt.reply_timeout_ms;
  if (!rl_busy(c) || (ct <= 0 && rt <= 0)) return -1;
  int least = ct <= 0 ? rt : rt <= 0 ? ct : (ct < rt ? ct : rt);
  int ms = least / 4;
  return ms < 50 ? 50 : ms > 1000 ? 1000 : ms;
}

static int tick(rl_client* c, double now) {
  bool b = rl_busy(c);
  if (b && !c->was_busy) heard(c, now); /* the clock starts when work starts */
  c->was_busy = b;
  if (!b) return 0;
  double quiet = now - c->quiet_since;
  char msg[400];
  if (!c->connected) {
    if (c->opt.connect_timeout_ms <= 0 || quiet * 1000 <= c->opt.connect_timeout_ms) return 0;
    snprintf(msg, sizeof msg, "no connection to the server at %s within %g s", c->address,
             c->opt.connect_timeout_ms / 1000.0);
  } else {
    int rt = c->opt.reply_timeout_ms;
    if (rt <= 0) return 0;
    if (quiet * 1000 <= rt) {
      if (quiet * 1000 > rt / 3.0 && !c->pinged) { /* keep-alive ping */
        c->pinged = true;
        msgpack_sbuffer_clear(&c->sbuf);
        rl_encode_op(&c->sbuf, "ping");
        if (rl_fifo_push(&c->pings, 0) && rl_send_sbuf(c) == RL_OK) rl_flush_out(c);
      }
      return 0;
    }
    snprintf(msg, sizeof msg, "no reply from the server at %s within %g s", c->address,
             rt / 1000.0);
  }
  heard(c, now);
  return rl_fail_pending(c, RL_ERR_DISCONNECTED, msg, now);
}

/* ------------------------------------------------------------------ receiving */

/* A token or done reply for its request: a frame of its own (`whole`, kept as it is by the
 * blocking form) or a part of a batch (whole NULL: kept as the frame it means). Returns the events
 * handled. */
static int on_stream_reply(rl_client* c, const rl_reply* r, zmq_msg_t* whole, double now) {
  rl_req* q = r->has_id ? rl_find(c, r->id) : NULL;
  if (!q || q->finished) return 0; /* not ours, or already ended (locally) */
  rl_token t;
  if (r->op == RL_OP_TOKEN && !rl_decode_token(r, &c->cb_scratch, &t)) return 0; /* ignored */
  if (r->op == RL_OP_TOKEN) q->tokens += (int64_t)t.n_token_ids;
  if (!q->has_cb) { /* blocking form: keep the frame, decode it again in rl_next */
    rl_node* n = rl_node_new(c);
    if (!n) return 0;
    if (whole) {
      zmq_msg_move(&n->msg, whole);
    } else if (!rl_batch_part_frame(r, &n->msg)) {
      rl_node_free(c, n);
      return 0;
    }
    n->t = now;
    buffer_node(q, n);
    if (r->op == RL_OP_DONE) q->finished = true, c->active--;
    return 1;
  }
  if (r->op == RL_OP_TOKEN) {
    t.recv_time = now;
    if (q->cb.on_token) {
      c->in_dispatch++;
      q->cb.on_token(q->cb.user, &t);
      c->in_dispatch--;
    }
  } else {
    rl_done d;
    d.recv_time = now;
    rl_decode_done(r, &c->cb_scratch, &d);
    dispatch_done(c, q, &d);
  }
  return 1;
}

typedef struct batch_ctx {
  rl_client* c;
  double now;
} batch_ctx;

static int on_batch_part(void* ctx, const rl_reply* part) {
  batch_ctx* b = ctx;
  return on_stream_reply(b->c, part, NULL, b->now);
}

static int on_frame(rl_client* c, double now) {
  const uint8_t* data = zmq_msg_data(&c->rx);
  rl_reply r;
  uint64_t serial = 0;
  heard(c, now);
  c->frames_received++;
  rl_reply_scan(data, zmq_msg_size(&c->rx), &r);
  if (r.op == RL_OP_TOKEN || r.op == RL_OP_DONE) return on_stream_reply(c, &r, &c->rx, now);
  if (r.op == RL_OP_BATCH) {
    batch_ctx ctx = {c, now};
    int n = rl_batch_expand(&r, on_batch_part, &ctx);
    return n < 0 ? 0 : n; /* a malformed batch is ignored, as a malformed token frame */
  }
  if (r.op == RL_OP_PONG && fifo_pop(&c->pings, &serial)) {
    if (serial) c->user_waiters--;
    if (serial && serial == c->await_serial) c->await_state = AWAIT_DONE, c->await_t = now;
  } else if (r.op == RL_OP_STATS && fifo_pop(&c->stats, &serial)) {
    c->user_waiters--;
    if (serial == c->await_serial && c->await_stats) {
      rl_stats* st = c->await_stats;
      rl_decode_stats(&r, st);
      st->raw = malloc(r.len ? r.len : 1);
      if (st->raw) memcpy(st->raw, data, r.len), st->raw_len = r.len;
      c->await_state = AWAIT_DONE;
    }
  } else if (r.op == RL_OP_HELLO) {
    c->hello_state = HELLO_ANSWERED, c->batch_frames = rl_decode_hello_batch(&r);
  } else if (r.op == RL_OP_ERROR && !r.has_id && c->hello_state == HELLO_SENT) {
    c->hello_state = HELLO_ANSWERED; /* a 1.6 server's answer (unknown op 'hello'): not news */
  } else if (r.op == RL_OP_ERROR) {
    rl_decode_error_message(&r, c->server_error, sizeof c->server_error);
    c->has_server_error = true;
  }
  return 0;
}

static int drain_socket(rl_client* c) {
  int n = 0;
  while (zmq_msg_recv(&c->rx, c->sock, ZMQ_DONTWAIT) >= 0) n += on_frame(c, rl_now());
  return n;
}

static int drain_monitor(rl_client* c) {
  int n = 0;
  zmq_msg_t m;
  zmq_msg_init(&m);
  while (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) >= 0) {
    uint16_t event = 0;
    uint32_t value = 0;
    if (zmq_msg_size(&m) >= 6) {
      memcpy(&event, zmq_msg_data(&m), 2);
      memcpy(&value, (const char*)zmq_msg_data(&m) + 2, 4);
    }
    while (zmq_msg_more(&m) && zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) >= 0) {
    } /* the endpoint frame */
    double now = rl_now();
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      c->connected = true;
      heard(c, now);
      rl_flush_out(c); /* the hello and what waits behind it */
    } else if (event == ZMQ_EVENT_DISCONNECTED || (event & MONITOR_EVENTS) != 0) {
      char msg[160];
      if (event == ZMQ_EVENT_DISCONNECTED)
        snprintf(msg, sizeof msg, "connection to the server was lost");
      else
        snprintf(msg, sizeof msg, "handshake with the server failed (event %u, %u)", event, value);
      n += drain_socket(c); /* what arrived before the connection went is still news */
      c->connected = false;
      heard(c, now);
      n += rl_fail_pending(c, RL_ERR_DISCONNECTED, msg, now);
      if (c->hello_state != HELLO_QUEUED) rl_queue_hello(c); /* a new connection: hello again */
    }
  }
  zmq_msg_close(&m);
  return n;
}

/* One round: wait up to wait_ms (-1: no limit) for the socket, send what waits, take every
 * frame and monitor event there, then the liveness check. Returns the events handled. */
int rl_pump(rl_client* c, int wait_ms) {
  int interval = poll_interval_ms(c);
  if (interval >= 0 && (wait_ms < 0 || interval < wait_ms)) wait_ms = interval;
  rl_flush_out(c);
  zmq_pollitem_t items[2] = {{c->sock, 0, (short)(ZMQ_POLLIN | (c->out_head ? ZMQ_POLLOUT : 0)), 0},
                             {c->mon, 0, ZMQ_POLLIN, 0}};
  if (zmq_poll(items, 2, wait_ms) < 0 && zmq_errno() != EINTR) return -rl_fail_errno(c, "poll");
  rl_flush_out(c);
  int n = drain_socket(c);
  n += drain_monitor(c);
  return n + tick(c, rl_now());
}

int rl_remaining_ms(double deadline) {
  if (deadline < 0) return -1;
  double left = (deadline - rl_now()) * 1000.0;
  return left <= 0 ? 0 : left > 1e9 ? 1000000000 : (int)left + 1;
}
