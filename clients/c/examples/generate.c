/* ringleader-c-generate: one request, streamed to stdout, like `ringleader generate`.
 *
 *   ringleader-c-generate [--address A] (--prompt TEXT | --prompt-ids 1,2,3 | TEXT)
 *       [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]
 *       [--presence-penalty X] [--frequency-penalty X] [--repetition-penalty X]
 *       [--stop-token-ids 1,2] [--ignore-eos] [--priority P] [--timeout-ms MS]
 *       [--connect-timeout-ms MS] [--reply-timeout-ms MS] [--json]
 *
 * Text prompts stream text, --prompt-ids stream token ids; the end goes to stderr. --json prints
 * every event as one JSON line instead. Exit 0 on success, 1 on an error done (its code named on
 * stderr), 2 on bad options, 130 when interrupted (the request is aborted first). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_util.h"
#include "ringleader.h"

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig) {
  (void)sig;
  interrupted = 1;
}

static int usage(const char* why) {
  if (why) fprintf(stderr, "ringleader-c-generate: %s\n", why);
  fprintf(stderr,
          "usage: ringleader-c-generate [--address A] (--prompt TEXT | --prompt-ids 1,2,3 | TEXT)\n"
          "  [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]\n"
          "  [--presence-penalty X] [--frequency-penalty X] [--repetition-penalty X]\n"
          "  [--stop-token-ids 1,2] [--ignore-eos] [--priority P] [--timeout-ms MS]\n"
          "  [--connect-timeout-ms MS] [--reply-timeout-ms MS] [--json]\n");
  return 2;
}

static bool parse_ll(const char* s, long long lo, long long hi, long long* out) {
  char* end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

static bool parse_double(const char* s, double* out) {
  char* end;
  errno = 0;
  *out = strtod(s, &end);
  return !(errno == ERANGE && *out != 0) && end != s && *end == '\0';
}

/* "1,2,3" -> ids (malloc'd); false on anything else. */
static bool parse_ids(const char* s, int32_t** ids, size_t* n) {
  size_t cap = 1;
  for (const char* p = s; *p; p++) cap += *p == ',';
  *ids = malloc(cap * sizeof **ids);
  *n = 0;
  if (!*ids) return false;
  char* copy = strdup(s);
  if (!copy) return false;
  bool ok = true;
  for (char *save = NULL, *tok = strtok_r(copy, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    long long v;
    if (!parse_ll(tok, 0, INT32_MAX, &v))
      ok = false;
    else
      (*ids)[(*n)++] = (int32_t)v;
  }
  free(copy);
  return ok && *n > 0;
}

/* The done's error code as the server (or this client) named it. */
static const char* code_of(const rl_done* d) {
  return d->error_code_str ? d->error_code_str : rl_code_name(d->error_code);
}

static void print_event(const rl_event* ev, bool json, bool show_ids) {
  if (json && ev->type == RL_EVENT_TOKEN) {
    const rl_token* t = &ev->token;
    printf("{\"event\": \"token\", \"id\": %lld, \"index\": %u, \"token_ids\": [", (long long)t->id,
           t->index);
    for (size_t i = 0; i < t->n_token_ids; i++) printf(i ? ", %d" : "%d", t->token_ids[i]);
    printf("], \"text\": ");
    json_str(stdout, t->text);
    printf("}\n");
  } else if (json) {
    const rl_done* d = &ev->done;
    printf("{\"event\": \"done\", \"id\": %lld, \"finish_reason\": ", (long long)d->id);
    json_str(stdout, d->finish_reason);
    printf(", \"prompt_tokens\": %lld, \"completion_tokens\": %lld, \"error_code\": ",
           (long long)d->prompt_tokens, (long long)d->completion_tokens);
    json_str(stdout, d->error_code == RL_OK ? NULL : code_of(d));
    printf(", \"error_message\": ");
    json_str(stdout, d->error_message);
    printf(", \"local\": %s}\n", d->local ? "true" : "false");
  } else if (ev->type == RL_EVENT_TOKEN) {
    if (show_ids || !ev->token.text) {
      for (size_t i = 0; i < ev->token.n_token_ids; i++) printf("%d ", ev->token.token_ids[i]);
    } else {
      fwrite(ev->token.text, 1, ev->token.text_len, stdout);
    }
  }
  fflush(stdout);
}

int main(int argc, char** argv) {
  const char* address = RL_DEFAULT_ADDRESS;
  rl_request req;
  rl_options opt;
  rl_request_init(&req);
  rl_options_init(&opt);
  int32_t *prompt_ids = NULL, *stop_ids = NULL;
  bool json = false;
  int rc = 2;
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    long long n;
    bool ok = true, takes = true;
    if (!strcmp(a, "--json"))
      json = true, takes = false;
    else if (!strcmp(a, "--ignore-eos"))
      req.ignore_eos = true, takes = false;
    else if (!strcmp(a, "-h") || !strcmp(a, "--help"))
      return usage(NULL) - 2;
    else if (a[0] != '-' || a[1] != '-') {
      if (req.prompt) return usage("give one prompt");
      req.prompt = a, takes = false;
    } else if (!v)
      return usage("an option lacks its value");
    else if (!strcmp(a, "--address"))
      address = v;
    else if (!strcmp(a, "--prompt"))
      req.prompt = v;
    else if (!strcmp(a, "--prompt-ids")) {
      free(prompt_ids);
      ok = parse_ids(v, &prompt_ids, &req.n_prompt_ids), req.prompt_ids = prompt_ids;
    } else if (!strcmp(a, "--stop-token-ids")) {
      free(stop_ids);
      ok = parse_ids(v, &stop_ids, &req.n_stop_token_ids), req.stop_token_ids = stop_ids;
    } else if (!strcmp(a, "--max-tokens")) {
      ok = parse_ll(v, INT64_MIN, INT64_MAX, &n), req.has_max_tokens = true, req.max_tokens = n;
    } else if (!strcmp(a, "--seed")) {
      char* end;
      errno = 0;
      req.seed = strtoull(v, &end, 10), req.has_seed = true;
      ok = !errno && end != v && !*end && v[0] != '-';
    } else if (!strcmp(a, "--top-k")) {
      ok = parse_ll(v, INT32_MIN, INT32_MAX, &n), req.top_k = (int32_t)n;
    } else if (!strcmp(a, "--priority")) {
      ok = parse_ll(v, INT32_MIN, INT32_MAX, &n), req.priority = (int32_t)n;
    } else if (!strcmp(a, "--timeout-ms")) {
      ok = parse_ll(v, INT64_MIN, INT64_MAX, &n), req.has_timeout_ms = true, req.timeout_ms = n;
    } else if (!strcmp(a, "--connect-timeout-ms")) {
      ok = parse_ll(v, INT32_MIN, INT32_MAX, &n), opt.connect_timeout_ms = (int)n;
    } else if (!strcmp(a, "--reply-timeout-ms")) {
      ok = parse_ll(v, INT32_MIN, INT32_MAX, &n), opt.reply_timeout_ms = (int)n;
    } else if (!strcmp(a, "--temperature"))
      ok = parse_double(v, &req.temperature);
    else if (!strcmp(a, "--top-p"))
      ok = parse_double(v, &req.top_p);
    else if (!strcmp(a, "--min-p"))
      ok = parse_double(v, &req.min_p);
    else if (!strcmp(a, "--presence-penalty"))
      ok = parse_double(v, &req.presence_penalty);
    else if (!strcmp(a, "--frequency-penalty"))
      ok = parse_double(v, &req.frequency_penalty);
    else if (!strcmp(a, "--repetition-penalty"))
      ok = parse_double(v, &req.repetition_penalty);
    else {
      fprintf(stderr, "ringleader-c-generate: unknown option %s\n", a);
      return usage(NULL);
    }
    if (!ok) {
      fprintf(stderr, "ringleader-c-generate: %s: bad value %s\n", a, v);
      goto out;
    }
    if (takes) i++;
  }
  char msg[256];
  if (rl_request_validate(&req, msg, sizeof msg) != RL_OK) {
    fprintf(stderr, "ringleader-c-generate: invalid_argument: %s\n", msg);
    goto out;
  }
  rl_client* client;
  if (rl_client_open(address, &opt, &client, msg, sizeof msg) != RL_OK) {
    fprintf(stderr, "ringleader-c-generate: %s\n", msg);
    rc = 1;
    goto out;
  }
  signal(SIGINT, on_sigint);
  int64_t id;
  rl_code code = rl_generate(client, &req, NULL, &id);
  if (code != RL_OK) {
    fprintf(stderr, "ringleader-c-generate: %s: %s\n", rl_code_name(code),
            rl_client_last_error(client));
  } else {
    bool aborted = false;
    rl_event ev;
    for (;;) {
      if (interrupted && !aborted) aborted = true, rl_abort(client, id, NULL, -1);
      code = rl_next(client, id, 200, &ev);
      if (code == RL_ERR_WAIT_TIMEOUT) continue;
      if (code != RL_OK) {
        fprintf(stderr, "ringleader-c-generate: %s: %s\n", rl_code_name(code),
                rl_client_last_error(client));
        break;
      }
      print_event(&ev, json, req.prompt_ids != NULL);
      if (ev.type != RL_EVENT_DONE) continue;
      const rl_done* d = &ev.done;
      if (!json) printf("\n");
      fprintf(stderr, "[%s: %lld prompt + %lld completion tokens]", d->finish_reason,
              (long long)d->prompt_tokens, (long long)d->completion_tokens);
      if (d->error_code != RL_OK)
        fprintf(stderr, " %s: %s", code_of(d), d->error_message ? d->error_message : "");
      fprintf(stderr, "\n");
      rc = aborted ? 130 : d->error_code != RL_OK ? 1 : 0;
      break;
    }
    if (code != RL_OK) rc = 1;
  }
  rl_client_close(client);
out:
  free(prompt_ids);
  free(stop_ids);
  return rc;
}
