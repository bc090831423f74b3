/* ringleader-c-bench: a closed-loop load generator on the C client, for the project's bench to
 * compare clients side by side.
 *
 *   ringleader-c-bench --address A --requests-file F --concurrency N [--warmup W] [--ignore-eos]
 *       [--temperature T] [--seed S] [--timeout-s X]
 *
 * F: one request per line, "MAX_TOKENS ID ID ID ...". N requests are kept in flight, the next
 * sent from the done of one. Warm-up: requests 0..W-1 of the file first, unmeasured (at most N
 * at once), then every line measured. Request i gets seed S+i when T > 0. Prints one JSON object
 * (see README.md); exit 0 when every request got its done, 1 otherwise, 2 on bad options. Token
 * and done messages come from the library as events whether the server sent them as frames of
 * their own or inside batch frames (1.7); "frames" counts the frames themselves. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "../json_util.h"
#include "../ringleader.h"

typedef struct record {
  size_t index;
  double send_t, done_t;
  double* chunk_t;
  int32_t* chunk_n;
  size_t n_chunks, cap;
  bool done;
  char finish_reason[16];
  char error_code[32];
  char* error_message;
  int64_t completion_tokens;
  double server_queue_ms; /* < 0: absent */
} record;

typedef struct bench {
  rl_client* client;
  int32_t** prompts;
  size_t* prompt_len;
  int64_t* max_tokens;
  size_t n;
  bool ignore_eos, has_temperature;
  double temperature;
  uint64_t seed;
  record* recs; /* of the phase that runs */
  size_t next, end, outstanding;
} bench;

static bench B;

static double mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_s(const struct timeval* tv) {
  return (double)tv->tv_sec + (double)tv->tv_usec * 1e-6;
}

/* One token message: a token frame, or one chunk of a batch frame (its frame's arrival time). */
static void on_token(void* user, const rl_token* t) {
  record* r = user;
  if (r->n_chunks == r->cap) { /* more messages than tokens (a text-only last one): rare */
    size_t cap = r->cap * 2 + 4;
    double* ct = realloc(r->chunk_t, cap * sizeof *ct);
    if (ct) r->chunk_t = ct;
    int32_t* cn = ct ? realloc(r->chunk_n, cap * sizeof *cn) : NULL;
    if (cn) r->chunk_n = cn;
    if (!ct || !cn) return;
    r->cap = cap;
  }
  r->chunk_t[r->n_chunks] = t->recv_time;
  r->chunk_n[r->n_chunks++] = (int32_t)t->n_token_ids;
}

static void send_next(void);

static void on_done(void* user, const rl_done* d) {
  record* r = user;
  r->done = true;
  r->done_t = d->recv_time;
  snprintf(r->finish_reason, sizeof r->finish_reason, "%s", d->finish_reason);
  if (d->error_code != RL_OK) {
    snprintf(r->error_code, sizeof r->error_code, "%s",
             d->error_code_str ? d->error_code_str : rl_code_name(d->error_code));
    if (d->error_message) r->error_message = strdup(d->error_message);
  }
  r->completion_tokens = d->completion_tokens;
  r->server_queue_ms = d->queue_ms;
  B.outstanding--;
  send_next(); /* closed loop: the next request from the done of one */
}

static void send_next(void) {
  while (B.next < B.end) {
    size_t i = B.next++;
    record* r = &B.recs[i];
    rl_request req;
    rl_request_init(&req);
    req.prompt_ids = B.prompts[i], req.n_prompt_ids = B.prompt_len[i];
    req.has_max_tokens = true, req.max_tokens = B.max_tokens[i];
    req.ignore_eos = B.ignore_eos;
    if (B.has_temperature) req.temperature = B.temperature;
    if (req.temperature > 0) req.has_seed = true, req.seed = B.seed + (uint64_t)i;
    rl_callbacks cb = {on_token, on_done, r};
    r->send_t = mono();
    rl_code code = rl_generate(B.client, &req, &cb, NULL);
    if (code == RL_OK) {
      B.outstanding++;
      return;
    }
    r->done = true, r->done_t = r->send_t; /* refused locally: its own done, as it were */
    snprintf(r->finish_reason, sizeof r->finish_reason, "error");
    snprintf(r->error_code, sizeof r->error_code, "%s", rl_code_name(code));
    r->error_message = strdup(rl_client_last_error(B.client));
  }
}

/* Runs requests 0..count-1 closed-loop at `concurrency`; false when the deadline passed first. */
static bool run_phase(record* recs, size_t count, size_t concurrency, double timeout_s) {
  for (size_t i = 0; i < count; i++) {
    record* r = &recs[i];
    r->index = i, r->server_queue_ms = -1.0;
    r->cap =
        (size_t)(B.max_tokens[i] > 0 ? B.max_tokens[i] : 1) + 2; /* one per token, and the rest */
    r->chunk_t = malloc(r->cap * sizeof *r->chunk_t);
    r->chunk_n = malloc(r->cap * sizeof *r->chunk_n);
    if (!r->chunk_t || !r->chunk_n) r->cap = 0;
  }
  B.recs = recs, B.next = 0, B.end = count, B.outstanding = 0;
  double deadline = timeout_s > 0 ? mono() + timeout_s : -1;
  while (B.next < B.end && B.outstanding < concurrency) send_next();
  while (B.outstanding > 0) {
    int wait = deadline < 0 ? -1 : (int)((deadline - mono()) * 1000) + 1;
    if (deadline >= 0 && wait <= 0) return false;
    rl_client_poll(B.client, wait);
  }
  return true;
}

static int read_requests(const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) return fprintf(stderr, "ringleader-c-bench: %s: %s\n", path, strerror(errno)), -1;
  size_t cap = 0;
  char* line = NULL;
  size_t line_cap = 0;
  while (getline(&line, &line_cap, f) > 0) {
    char* p = line;
    char* end;
    long long m = strtoll(p, &end, 10);
    if (end == p) continue; /* a blank line */
    if (B.n == cap) {
      cap = cap ? cap * 2 : 64;
      B.prompts = realloc(B.prompts, cap * sizeof *B.prompts);
      B.prompt_len = realloc(B.prompt_len, cap * sizeof *B.prompt_len);
      B.max_tokens = realloc(B.max_tokens, cap * sizeof *B.max_tokens);
      if (!B.prompts || !B.prompt_len || !B.max_tokens) return fclose(f), free(line), -1;
    }
    size_t ids = 0;
    for (char* q = end; *q; q++) ids += *q == ' ' || *q == '\t';
    int32_t* prompt = malloc((ids + 1) * sizeof *prompt);
    if (!prompt) return fclose(f), free(line), -1;
    size_t k = 0;
    for (p = end;;) {
      long v = strtol(p, &end, 10);
      if (end == p) break;
      prompt[k++] = (int32_t)v, p = end;
    }
    B.prompts[B.n] = prompt, B.prompt_len[B.n] = k, B.max_tokens[B.n] = m, B.n++;
  }
  free(line);
  fclose(f);
  return 0;
}

static void print_result(const record* recs, size_t concurrency, double wall, double user,
                         double sys, uint64_t frames) {
  printf("{\"client\": \"c\", \"concurrency\": %zu, \"wall_s\": ", concurrency);
  json_num(stdout, wall);
  printf(", \"cpu_user_s\": ");
  json_num(stdout, user);
  printf(", \"cpu_sys_s\": ");
  json_num(stdout, sys);
  printf(", \"frames\": %llu, \"requests\": [", (unsigned long long)frames);
  for (size_t i = 0; i < B.n; i++) {
    const record* r = &recs[i];
    printf("%s{\"index\": %zu, \"prompt_tokens\": %zu, \"max_tokens\": %lld, \"send_t\": ",
           i ? ", " : "", i, B.prompt_len[i], (long long)B.max_tokens[i]);
    json_num(stdout, r->send_t);
    printf(", \"chunk_t\": [");
    for (size_t k = 0; k < r->n_chunks; k++) printf(k ? ", %.9f" : "%.9f", r->chunk_t[k]);
    printf("], \"chunk_n\": [");
    for (size_t k = 0; k < r->n_chunks; k++) printf(k ? ", %d" : "%d", r->chunk_n[k]);
    printf("], \"done_t\": ");
    if (r->done)
      json_num(stdout, r->done_t);
    else
      printf("null");
    printf(", \"finish_reason\": ");
    json_str(stdout, r->done ? r->finish_reason : "error");
    printf(", \"error_code\": ");
    json_str(stdout, r->error_code[0] ? r->error_code
                     : r->done        ? NULL
                     : r->send_t > 0  ? "timeout"
                                      : "not_sent");
    printf(", \"error_message\": ");
    json_str(stdout, r->error_message);
    printf(", \"completion_tokens\": %lld, \"server_queue_ms\": ", (long long)r->completion_tokens);
    if (r->server_queue_ms >= 0)
      json_num(stdout, r->server_queue_ms);
    else
      printf("null");
    printf("}");
  }
  printf("]}\n");
}

static void free_records(record* recs, size_t count) {
  for (size_t i = 0; recs && i < count; i++)
    free(recs[i].chunk_t), free(recs[i].chunk_n), free(recs[i].error_message);
  free(recs);
}

static int usage(const char* why) {
  fprintf(
      stderr,
      "ringleader-c-bench: %s\nusage: ringleader-c-bench --address A --requests-file F "
      "--concurrency N [--warmup W] [--ignore-eos] [--temperature T] [--seed S] [--timeout-s X]\n",
      why);
  return 2;
}

int main(int argc, char** argv) {
  const char *address = NULL, *file = NULL;
  long concurrency = 0, warmup = 0;
  double timeout_s = 0;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    if (!strcmp(a, "--ignore-eos")) {
      B.ignore_eos = true;
      continue;
    }
    if (i + 1 >= argc) return usage("an option lacks its value");
    const char* v = argv[++i];
    if (!strcmp(a, "--address"))
      address = v;
    else if (!strcmp(a, "--requests-file"))
      file = v;
    else if (!strcmp(a, "--concurrency"))
      concurrency = strtol(v, NULL, 10);
    else if (!strcmp(a, "--warmup"))
      warmup = strtol(v, NULL, 10);
    else if (!strcmp(a, "--temperature"))
      B.has_temperature = true, B.temperature = strtod(v, NULL);
    else if (!strcmp(a, "--seed"))
      B.seed = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--timeout-s"))
      timeout_s = strtod(v, NULL);
    else
      return usage("unknown option");
  }
  if (!address || !file || concurrency < 1 || warmup < 0)
    return usage("give --address, --requests-file and --concurrency >= 1");
  if (read_requests(file) != 0) return 1;
  char err[256];
  if (rl_client_open(address, NULL, &B.client, err, sizeof err) != RL_OK) {
    fprintf(stderr, "ringleader-c-bench: %s\n", err);
    return 1;
  }
  static char outbuf[1 << 16];
  setvbuf(stdout, outbuf, _IOFBF, sizeof outbuf);
  size_t n_warm = (size_t)warmup < B.n ? (size_t)warmup : B.n;
  bool ok = true;
  record* warm = n_warm ? calloc(n_warm, sizeof *warm) : NULL; /* kept until the close */
  if (n_warm) {
    size_t conc = (size_t)concurrency < n_warm ? (size_t)concurrency : n_warm;
    ok = warm && run_phase(warm, n_warm, conc, timeout_s);
  }
  record* recs = calloc(B.n ? B.n : 1, sizeof *recs);
  struct rusage ru0, ru1;
  getrusage(RUSAGE_SELF, &ru0);
  double t0 = mono();
  uint64_t frames0 = rl_client_frames_received(B.client);
  if (ok && recs) ok = run_phase(recs, B.n, (size_t)concurrency, timeout_s);
  double wall = mono() - t0;
  uint64_t frames = rl_client_frames_received(B.client) - frames0;
  getrusage(RUSAGE_SELF, &ru1);
  if (recs) {
    print_result(recs, (size_t)concurrency, wall, cpu_s(&ru1.ru_utime) - cpu_s(&ru0.ru_utime),
                 cpu_s(&ru1.ru_stime) - cpu_s(&ru0.ru_stime), frames);
  }
  fflush(stdout);
  for (size_t i = 0; recs && i < B.n; i++) ok = ok && recs[i].done;
  B.end = B.next;            /* nothing more is sent */
  rl_client_close(B.client); /* aborts what is still in flight (a timeout) */
  free_records(warm, n_warm);
  free_records(recs, B.n);
  for (size_t i = 0; i < B.n; i++) free(B.prompts[i]);
  free(B.prompts), free(B.prompt_len), free(B.max_tokens);
  return ok && recs ? 0 : 1;
}
