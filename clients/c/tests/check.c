/* ringleader-c-check: the test driver of tests/test_c_client.py. Prints one JSON line per event.
 *
 *   ringleader-c-check run --address A [--form callback|blocking] [--connect-timeout-ms MS]
 *       [--reply-timeout-ms MS] [--abort-after K] [--abort-reason R] [--one-by-one PAUSE_MS]
 *       (requests on stdin)
 *   ringleader-c-check invalid --address A FIELD=VALUE...   (a refused request, then a ping)
 *   ringleader-c-check stats --address A
 *   ringleader-c-check unit   (the batch decoder's unit checks, tests/batch_checks.c; no server)
 *
 * A request line: space-separated key=value (ids=1,2,3 max_tokens=8 temperature=0.8 seed=3
 * top_k=5 top_p=0.9 min_p=0.1 ignore_eos=1 stop=7,8 n=2 logprobs=2 priority=1 timeout_ms=500;
 * the constraint (1.8): json_schema=TEXT, regex=TEXT, choice=TEXT (repeated), json_object=1, and
 * for refusals structured_kind=K (the kind alone, no text) and many_choices=N), and text=... last
 * (the rest of the line). run sends them all at once; callback form: served by
 * rl_client_poll; blocking form: read with rl_next, the last request first (the others' replies
 * are buffered meanwhile). --abort-after K aborts request 0 after its K-th token message.
 * --one-by-one (callback form): each request after the done of the one before and a pause of
 * PAUSE_MS spent in rl_client_poll (time for the server to go and come back: a new connection).
 * Every mode with a server ends with a "hello" line (how the server answered the client's hello:
 * batch_frames 1, 0 or -1 for none yet; frames: frames received) and a "server_error" line when an
 * id-less error op came.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../json_util.h"
#include "../ringleader.h"
#include "checks.h"

#define MAX_REQS 64
#define MAX_SPEC_CHOICES 16
#define MAX_MANY_CHOICES 2048

typedef struct {
  rl_request req;
  int32_t ids[512], stop[16];
  char text[1024];
  char structured_text[RL_MAX_CONSTRAINT_CHARS + 64]; /* room for a pattern past the limit */
  char choice_texts[MAX_SPEC_CHOICES][64];
  const char* choices[MAX_SPEC_CHOICES];
  int64_t id;
  int tokens, dones;
} spec;

static const char* many_choices[MAX_MANY_CHOICES]; /* many_choices=N: N times "x" */

static spec specs[MAX_REQS];
static int n_specs, abort_after = -1, one_by_one_pause_ms = -1;
static const char* abort_reason = "abort";
static rl_client* client;

static void parse_ids(const char* s, int32_t* out, size_t cap, size_t* n) {
  *n = 0;
  while (*s && *n < cap) {
    out[(*n)++] = (int32_t)strtol(s, (char**)&s, 10);
    if (*s == ',')
      s++;
    else
      break;
  }
}

static double num(const char* s) {
  if (!strcmp(s, "nan")) return NAN;
  if (!strcmp(s, "inf")) return INFINITY;
  return strtod(s, NULL);
}

/* A constraint's key=value into r (the values are copied: a line's buffer is reused). */
static int set_structured(spec* sp, const char* key, const char* v) {
  rl_request* r = &sp->req;
  if (!strcmp(key, "json_schema") || !strcmp(key, "regex")) {
    r->structured = key[0] == 'j' ? RL_STRUCTURED_JSON : RL_STRUCTURED_REGEX;
    snprintf(sp->structured_text, sizeof sp->structured_text, "%s", v);
    r->structured_text = sp->structured_text;
  } else if (!strcmp(key, "choice")) {
    if (r->n_choices == MAX_SPEC_CHOICES) return -1;
    snprintf(sp->choice_texts[r->n_choices], sizeof sp->choice_texts[0], "%s", v);
    sp->choices[r->n_choices] = sp->choice_texts[r->n_choices];
    r->structured = RL_STRUCTURED_CHOICE, r->choices = sp->choices, r->n_choices++;
  } else if (!strcmp(key, "json_object")) {
    r->structured = RL_STRUCTURED_JSON_OBJECT;
  } else if (!strcmp(key, "structured_kind")) {
    r->structured = (rl_structured_kind)atoi(v);
  } else if (!strcmp(key, "many_choices")) {
    size_t n = strtoul(v, NULL, 10);
    if (n > MAX_MANY_CHOICES) return -1;
    for (size_t i = 0; i < n; i++) many_choices[i] = "x";
    r->structured = RL_STRUCTURED_CHOICE, r->choices = many_choices, r->n_choices = n;
  } else {
    return -1;
  }
  return 0;
}

/* One key=value into r (text= takes the rest of the line: the caller passes it whole). */
static int set_field(spec* sp, const char* key, const char* v) {
  rl_request* r = &sp->req;
  if (!strcmp(key, "ids"))
    parse_ids(v, sp->ids, 512, &r->n_prompt_ids), r->prompt_ids = sp->ids;
  else if (!strcmp(key, "stop"))
    parse_ids(v, sp->stop, 16, &r->n_stop_token_ids), r->stop_token_ids = sp->stop;
  else if (!strcmp(key, "max_tokens"))
    r->has_max_tokens = true, r->max_tokens = strtoll(v, NULL, 10);
  else if (!strcmp(key, "temperature"))
    r->temperature = num(v);
  else if (!strcmp(key, "top_p"))
    r->top_p = num(v);
  else if (!strcmp(key, "top_k"))
    r->top_k = (int32_t)strtol(v, NULL, 10);
  else if (!strcmp(key, "min_p"))
    r->min_p = num(v);
  else if (!strcmp(key, "presence_penalty"))
    r->presence_penalty = num(v);
  else if (!strcmp(key, "frequency_penalty"))
    r->frequency_penalty = num(v);
  else if (!strcmp(key, "repetition_penalty"))
    r->repetition_penalty = num(v);
  else if (!strcmp(key, "seed"))
    r->has_seed = true, r->seed = strtoull(v, NULL, 10);
  else if (!strcmp(key, "ignore_eos"))
    r->ignore_eos = atoi(v) != 0;
  else if (!strcmp(key, "n"))
    r->n = (int32_t)strtol(v, NULL, 10);
  else if (!strcmp(key, "logprobs"))
    r->has_logprobs = true, r->logprobs = (int32_t)strtol(v, NULL, 10);
  else if (!strcmp(key, "priority"))
    r->priority = (int32_t)strtol(v, NULL, 10);
  else if (!strcmp(key, "timeout_ms"))
    r->has_timeout_ms = true, r->timeout_ms = strtoll(v, NULL, 10);
  else
    return set_structured(sp, key, v);
  return 0;
}

static int parse_line(spec* sp, char* line) {
  rl_request_init(&sp->req);
  line[strcspn(line, "\n")] = '\0';
  char* text = strstr(line, "text=");
  if (text) {
    snprintf(sp->text, sizeof sp->text, "%s", text + 5);
    sp->req.prompt = sp->text;
    *text = '\0';
  }
  for (char *save = NULL, *tok = strtok_r(line, " ", &save); tok;
       tok = strtok_r(NULL, " ", &save)) {
    char* eq = strchr(tok, '=');
    if (!eq) return -1;
    *eq = '\0';
    if (set_field(sp, tok, eq + 1) != 0) return fprintf(stderr, "unknown key %s\n", tok), -1;
  }
  return 0;
}

static void print_token(int i, const rl_token* t) {
  printf("{\"req\": %d, \"id\": %lld, \"event\": \"token\", \"index\": %u, \"token_ids\": [", i,
         (long long)t->id, t->index);
  for (size_t k = 0; k < t->n_token_ids; k++) printf(k ? ", %d" : "%d", t->token_ids[k]);
  printf("], \"text\": ");
  json_str(stdout, t->text);
  printf(", \"finish_reason\": ");
  json_str(stdout, t->finish_reason);
  printf(", \"logprobs\": ");
  if (!t->logprobs) printf("null");
  for (size_t k = 0; t->logprobs && k < t->n_token_ids; k++) { /* [[logprob, [top ids]], ...] */
    printf(k ? ", [" : "[[");
    json_num(stdout, t->logprobs[k].logprob);
    printf(", [");
    for (size_t m = 0; m < t->logprobs[k].n_top; m++)
      printf(m ? ", %d" : "%d", t->logprobs[k].top_ids[m]);
    printf("]]%s", k + 1 == t->n_token_ids ? "]" : "");
  }
  if (t->logprobs && !t->n_token_ids) printf("[]");
  printf(", \"t\": %.6f}\n", t->recv_time);
  fflush(stdout);
}

static void print_done(int i, const rl_done* d) {
  printf("{\"req\": %d, \"id\": %lld, \"event\": \"done\", \"finish_reason\": ", i,
         (long long)d->id);
  json_str(stdout, d->finish_reason);
  printf(", \"error_code\": ");
  json_str(stdout, d->error_code == RL_OK ? NULL : rl_code_name(d->error_code));
  printf(", \"error_code_str\": ");
  json_str(stdout, d->error_code_str);
  printf(", \"error_message\": ");
  json_str(stdout, d->error_message);
  printf(
      ", \"prompt_tokens\": %lld, \"completion_tokens\": %lld, \"local\": %s, \"n_choices\": %zu, "
      "\"queue_ms\": ",
      (long long)d->prompt_tokens, (long long)d->completion_tokens, d->local ? "true" : "false",
      d->n_choices);
  json_num(stdout, d->queue_ms < 0 ? NAN : d->queue_ms);
  printf(", \"t\": %.6f}\n", d->recv_time);
  fflush(stdout);
}

static void on_token(void* user, const rl_token* t) {
  spec* sp = user;
  int i = (int)(sp - specs);
  print_token(i, t);
  if (++sp->tokens == abort_after && i == 0) {
    rl_code code = rl_abort(client, sp->id, abort_reason, -1);
    printf("{\"req\": 0, \"event\": \"abort_sent\", \"code\": \"%s\"}\n", rl_code_name(code));
  }
}

static void on_done(void* user, const rl_done* d) {
  spec* sp = user;
  sp->dones++;
  print_done((int)(sp - specs), d);
}

static int run(bool blocking) {
  char line[4096];
  while (n_specs < MAX_REQS && fgets(line, sizeof line, stdin)) {
    if (line[0] == '\n') continue;
    if (parse_line(&specs[n_specs], line) != 0) return 2;
    n_specs++;
  }
  for (int i = 0; i < n_specs; i++) {
    if (one_by_one_pause_ms >= 0 && i > 0) {
      while (rl_client_in_flight(client) > 0) rl_client_poll(client, -1);
      rl_client_poll(client, one_by_one_pause_ms); /* only monitor events can come: it waits */
    }
    rl_callbacks cb = {on_token, on_done, &specs[i]};
    rl_code code = rl_generate(client, &specs[i].req, blocking ? NULL : &cb, &specs[i].id);
    if (code != RL_OK) {
      printf("{\"req\": %d, \"event\": \"refused\", \"code\": \"%s\", \"message\": ", i,
             rl_code_name(code));
      json_str(stdout, rl_client_last_error(client));
      printf("}\n");
      specs[i].dones = 1;
    }
  }
  if (!blocking) {
    while (rl_client_in_flight(client) > 0) rl_client_poll(client, -1);
  } else {
    for (int i = n_specs - 1; i >= 0; i--) {
      rl_event ev;
      while (!specs[i].dones) {
        rl_code code = rl_next(client, specs[i].id, -1, &ev);
        if (code != RL_OK) return fprintf(stderr, "rl_next: %s\n", rl_code_name(code)), 1;
        if (ev.type == RL_EVENT_TOKEN)
          on_token(&specs[i], &ev.token);
        else
          on_done(&specs[i], &ev.done);
      }
      rl_event again;
      if (rl_next(client, specs[i].id, 0, &again) != RL_ERR_NOT_FOUND) return 1; /* id forgotten */
    }
  }
  rl_client_poll(client, 300); /* nothing more may come for them */
  for (int i = 0; i < n_specs; i++)
    if (specs[i].dones != 1) return fprintf(stderr, "request %d: %d dones\n", i, specs[i].dones), 1;
  return 0;
}

static int invalid(int argc, char** argv) {
  spec* sp = &specs[0];
  rl_request_init(&sp->req);
  sp->ids[0] = 1, sp->req.prompt_ids = sp->ids, sp->req.n_prompt_ids = 1;
  for (int i = 0; i < argc; i++) {
    char* eq = strchr(argv[i], '=');
    if (!eq) return 2;
    *eq = '\0';
    if (!strcmp(argv[i], "text"))
      sp->req.prompt = eq + 1; /* with the ids: both */
    else if (set_field(sp, argv[i], eq + 1) != 0)
      return 2;
  }
  int64_t id = -1;
  rl_code code = rl_generate(client, &sp->req, NULL, &id);
  printf(
      "{\"event\": \"refused\", \"code\": \"%s\", \"id\": %lld, \"in_flight\": %zu, \"message\": ",
      rl_code_name(code), (long long)id, rl_client_in_flight(client));
  json_str(stdout, rl_client_last_error(client));
  printf("}\n");
  double rtt = 0;
  code = rl_ping(client, 5000, &rtt);
  printf("{\"event\": \"ping\", \"code\": \"%s\", \"rtt\": %.6f}\n", rl_code_name(code), rtt);
  return 0;
}

static int stats(void) {
  rl_stats st;
  rl_code code = rl_stats_get(client, 5000, &st);
  printf("{\"event\": \"stats\", \"code\": \"%s\", \"protocol\": ", rl_code_name(code));
  json_str(stdout, code == RL_OK ? st.protocol : NULL);
  printf(", \"vocab_size\": %lld, \"max_context\": %lld, \"raw_len\": %zu}\n",
         code == RL_OK ? (long long)st.vocab_size : -1,
         code == RL_OK ? (long long)st.max_context : -1, code == RL_OK ? st.raw_len : 0);
  rl_stats_free(&st);
  double rtt = 0;
  code = rl_ping(client, 5000, &rtt);
  printf("{\"event\": \"ping\", \"code\": \"%s\", \"rtt\": %.6f}\n", rl_code_name(code), rtt);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const char* mode = argv[1];
  if (!strcmp(mode, "unit")) return run_batch_checks() ? 1 : 0;
  const char* address = RL_DEFAULT_ADDRESS;
  bool blocking = false;
  rl_options opt;
  rl_options_init(&opt);
  int i = 2;
  for (; i + 1 < argc && !strncmp(argv[i], "--", 2); i += 2) {
    const char *a = argv[i], *v = argv[i + 1];
    if (!strcmp(a, "--address"))
      address = v;
    else if (!strcmp(a, "--form"))
      blocking = !strcmp(v, "blocking");
    else if (!strcmp(a, "--connect-timeout-ms"))
      opt.connect_timeout_ms = atoi(v);
    else if (!strcmp(a, "--reply-timeout-ms"))
      opt.reply_timeout_ms = atoi(v);
    else if (!strcmp(a, "--abort-after"))
      abort_after = atoi(v);
    else if (!strcmp(a, "--abort-reason"))
      abort_reason = v;
    else if (!strcmp(a, "--one-by-one"))
      one_by_one_pause_ms = atoi(v);
    else
      return fprintf(stderr, "unknown option %s\n", a), 2;
  }
  char err[256];
  if (rl_client_open(address, &opt, &client, err, sizeof err) != RL_OK)
    return fprintf(stderr, "open: %s\n", err), 1;
  int rc = 2;
  if (!strcmp(mode, "run"))
    rc = run(blocking);
  else if (!strcmp(mode, "invalid"))
    rc = invalid(argc - i, argv + i);
  else if (!strcmp(mode, "stats"))
    rc = stats();
  printf("{\"event\": \"hello\", \"batch_frames\": %d, \"frames\": %llu}\n",
         rl_client_batch_frames(client), (unsigned long long)rl_client_frames_received(client));
  const char* server_error = rl_client_server_error(client);
  if (server_error) {
    printf("{\"event\": \"server_error\", \"message\": ");
    json_str(stdout, server_error);
    printf("}\n");
  }
  rl_client_close(client);
  return rc;
}
