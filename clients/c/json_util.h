/* json_util.h: writing JSON strings and numbers (the example and the bench tool print JSON). */
#ifndef RINGLEADER_JSON_UTIL_H
#define RINGLEADER_JSON_UTIL_H

#include <math.h>
#include <stdio.h>

/* s as a JSON string (NULL: null); s is UTF-8, written as is but for what JSON must escape. */
static inline void json_str(FILE* out, const char* s) {
  if (!s) {
    fputs("null", out);
    return;
  }
  fputc('"', out);
  for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
    unsigned char ch = *p;
    if (ch == '"' || ch == '\\') {
      fputc('\\', out);
      fputc(ch, out);
    } else if (ch == '\n') {
      fputs("\\n", out);
    } else if (ch == '\r') {
      fputs("\\r", out);
    } else if (ch == '\t') {
      fputs("\\t", out);
    } else if (ch < 0x20 || ch == 0x7f) {
      fprintf(out, "\\u%04x", ch);
    } else {
      fputc(ch, out);
    }
  }
  fputc('"', out);
}

/* A finite double with enough digits to read back; anything else: null. */
static inline void json_num(FILE* out, double x) {
  if (isfinite(x))
    fprintf(out, "%.17g", x);
  else
    fputs("null", out);
}

#endif /* RINGLEADER_JSON_UTIL_H */
