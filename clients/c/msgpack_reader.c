/* msgpack_reader.c: the bounded msgpack reader (see msgpack_reader.h). */
#include "msgpack_reader.h"

#include <string.h>

static uint64_t be(const uint8_t* p, int k) {
  uint64_t v = 0;
  for (int i = 0; i < k; i++) v = (v << 8) | p[i];
  return v;
}

bool rl_mp_next(const uint8_t** pp, const uint8_t* end, mp_val* v) {
  const uint8_t* p = *pp;
  if (p >= end) return false;
  uint8_t c = *p++;
  int lenbytes = 0, fixed = -1; /* payload: a length of lenbytes, or `fixed` bytes */
  memset(v, 0, sizeof *v);
  if (c <= 0x7f || c >= 0xe0) {
    v->kind = MP_INT;
    v->i = c <= 0x7f ? c : (int64_t)(int8_t)c;
  } else if (c <= 0x8f) {
    v->kind = MP_MAP, v->n = c & 0x0fu;
  } else if (c <= 0x9f) {
    v->kind = MP_ARRAY, v->n = c & 0x0fu;
  } else if (c <= 0xbf) {
    v->kind = MP_STR, fixed = c & 0x1f;
  } else {
    static const uint8_t sizes[] = {1, 2, 4, 8};
    size_t avail = (size_t)(end - p);
    switch (c) {
      case 0xc0:
        v->kind = MP_NIL;
        break;
      case 0xc2:
      case 0xc3:
        v->kind = MP_BOOL, v->b = c == 0xc3;
        break;
      case 0xc4:
      case 0xc5:
      case 0xc6:
        v->kind = MP_BIN, lenbytes = sizes[c - 0xc4];
        break;
      case 0xc7:
      case 0xc8:
      case 0xc9:
        v->kind = MP_EXT, lenbytes = sizes[c - 0xc7];
        break;
      case 0xd9:
      case 0xda:
      case 0xdb:
        v->kind = MP_STR, lenbytes = sizes[c - 0xd9];
        break;
      case 0xd4:
      case 0xd5:
      case 0xd6:
      case 0xd7:
      case 0xd8:
        v->kind = MP_EXT, fixed = 1 + (1 << (c - 0xd4)); /* type byte + data */
        break;
      case 0xca:
      case 0xcb: {
        int k = c == 0xca ? 4 : 8;
        if (avail < (size_t)k) return false;
        uint64_t bits = be(p, k);
        if (k == 4) {
          uint32_t b32 = (uint32_t)bits;
          float f;
          memcpy(&f, &b32, sizeof f);
          v->f = (double)f;
        } else {
          memcpy(&v->f, &bits, sizeof v->f);
        }
        v->kind = MP_FLOAT, p += k;
        break;
      }
      case 0xcc:
      case 0xcd:
      case 0xce:
      case 0xcf:
      case 0xd0:
      case 0xd1:
      case 0xd2:
      case 0xd3: {
        int k = sizes[(c - 0xcc) & 3];
        if (avail < (size_t)k) return false;
        uint64_t raw = be(p, k);
        p += k;
        if (c >= 0xd0) { /* signed: sign-extend from k bytes */
          int shift = 64 - 8 * k;
          v->kind = MP_INT, v->i = shift ? (int64_t)(raw << shift) >> shift : (int64_t)raw;
        } else if (raw > (uint64_t)INT64_MAX) {
          v->kind = MP_UINT, v->u = raw;
        } else {
          v->kind = MP_INT, v->i = (int64_t)raw;
        }
        break;
      }
      case 0xdc:
      case 0xdd:
      case 0xde:
      case 0xdf: {
        int k = (c & 1) ? 4 : 2;
        if (avail < (size_t)k) return false;
        v->kind = c <= 0xdd ? MP_ARRAY : MP_MAP, v->n = (uint32_t)be(p, k), p += k;
        break;
      }
      default:
        return false; /* 0xc1 */
    }
  }
  uint64_t payload = fixed >= 0 ? (uint64_t)fixed : 0;
  if (lenbytes) {
    if ((size_t)(end - p) < (size_t)lenbytes) return false;
    payload = be(p, lenbytes) + (v->kind == MP_EXT), p += lenbytes; /* ext: its type byte too */
  }
  if (v->kind == MP_STR || v->kind == MP_BIN || v->kind == MP_EXT) {
    if (payload > (uint64_t)(end - p)) return false;
    v->s = p, v->n = (uint32_t)payload, p += payload;
  }
  if ((v->kind == MP_ARRAY || v->kind == MP_MAP) && (uint64_t)v->n > (uint64_t)(end - p))
    return false; /* every element takes a byte at least */
  *pp = p;
  return true;
}

bool rl_mp_skip(const uint8_t** pp, const uint8_t* end, size_t* containers) {
  uint64_t pending = 1;
  mp_val v;
  while (pending) {
    if (!rl_mp_next(pp, end, &v)) return false;
    pending--;
    if (v.kind == MP_ARRAY || v.kind == MP_MAP) {
      pending += v.kind == MP_MAP ? 2 * (uint64_t)v.n : v.n;
      if (containers && ++*containers > MAX_CONTAINERS) return false;
      if (pending > (uint64_t)(end - *pp)) return false;
    }
  }
  return true;
}

bool rl_mp_str_is(const mp_val* v, const char* lit) {
  size_t n = strlen(lit);
  return v->kind == MP_STR && v->n == n && memcmp(v->s, lit, n) == 0;
}

bool rl_utf8_valid(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t k;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf)
      k = 1, cp = c & 0x1fu;
    else if (c >= 0xe0 && c <= 0xef)
      k = 2, cp = c & 0x0fu;
    else if (c >= 0xf0 && c <= 0xf4)
      k = 3, cp = c & 0x07u;
    else
      return false;
    if (n - i <= k) return false;
    for (size_t j = 1; j <= k; j++) {
      if ((s[i + j] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (s[i + j] & 0x3fu);
    }
    if ((k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff))
      return false;
    i += k + 1;
  }
  return true;
}
