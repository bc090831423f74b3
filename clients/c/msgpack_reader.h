/* msgpack_reader.h: a small msgpack reader that checks every length against the bytes that are
 * left, so no claim in a frame (an array of 10^9 elements, a string longer than the frame) can
 * make it read out of bounds or allocate more than the frame justifies. Not installed. */
#ifndef RINGLEADER_MSGPACK_READER_H
#define RINGLEADER_MSGPACK_READER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_CONTAINERS 10000 /* per frame, as the server's decoder (protocol.md "Limits") */

typedef enum {
  MP_NIL,
  MP_BOOL,
  MP_INT,
  MP_UINT,
  MP_FLOAT,
  MP_STR,
  MP_BIN,
  MP_ARRAY,
  MP_MAP,
  MP_EXT
} mp_kind;

typedef struct mp_val {
  mp_kind kind;
  bool b;
  int64_t i;        /* MP_INT */
  uint64_t u;       /* MP_UINT: above INT64_MAX */
  double f;         /* MP_FLOAT */
  const uint8_t* s; /* MP_STR / MP_BIN / MP_EXT payload */
  uint32_t n;       /* payload bytes, or elements (array) / pairs (map) */
} mp_val;

/* One value's header at *pp (with the payload of a str/bin/ext); false: truncated or invalid. */
bool rl_mp_next(const uint8_t** pp, const uint8_t* end, mp_val* v);
/* Skips one whole value; counts its containers into *containers (NULL: no limit). */
bool rl_mp_skip(const uint8_t** pp, const uint8_t* end, size_t* containers);
/* v is the str `lit`. */
bool rl_mp_str_is(const mp_val* v, const char* lit);
bool rl_utf8_valid(const uint8_t* s, size_t n);

#endif /* RINGLEADER_MSGPACK_READER_H */
