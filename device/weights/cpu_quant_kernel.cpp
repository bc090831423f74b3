// y = x @ W.T on the CPU for GGUF weights kept quantized: int8 activations times 4-bit or 8-bit
// integer weight codes, integer dot products per group of 32, float accumulation across groups.
// Built and loaded by device/weights/cpu_quant_matmul.py, which packs the weights (layout below)
// and picks the instruction set at compile time; this file picks the code path from the
// compiler's predefined macros:
//   __AVX512VNNI__ + __AVX512BW__ : "avx512-vnni", 16 weight rows per tile, _mm512_dpbusd_epi32
//   __AVX2__ + __AVXVNNI__        : "avx2-vnni",   8 rows per tile, _mm256_dpbusd_avx_epi32
//   __AVX2__                      : "avx2",        8 rows per tile, maddubs + madd
//   otherwise                     : "generic",     8 rows per tile, plain C++ loops
//
// Math, per output row n, x row m and group g of 32 along K:
//   W[n, k] = c[n, k] * d[n, g] + o[n, g]       (c integer, d and o float32: exact, see the .py)
//   x[m, k] ~ q[m, k] * e[m, g]                 (q int8 in [-127, 127], e = max|x| / 127)
//   y[m, n] = sum_g  (d * e) * dot(c, q)  +  o * (e * sum(q))
// The integer dot of a group never overflows: Q4 codes are unsigned 0..15, so a maddubs pair is
// at most 2*15*127 = 3810 and an int16 lane summing a group's 8 pairs stays within 30480; Q8
// codes (Q5_x, Q8_0) go through _mm256_sign_epi8 (|c| <= 128, pairs <= 32512) and are widened to
// int32 after every maddubs; the VNNI instructions accumulate in int32 and take the Q8 codes
// biased to unsigned (c + 128, the bias removed with 128 * sum(q) per group, in integers).
//
// Weight layout (packed in Python, one contiguous stream per thread's run of tiles): tiles of R
// rows; per tile, groups in K order; per group one block:
//   d[R], o[R] (float32, or fp16 under FORM_HALF), then the codes in chunks of L bytes per row
//   (L = RL_LANE_BYTES):
//   Q4 form (Q4_0/Q4_1/Q4_K): 16/L chunks of L*R bytes; chunk c, row r, byte i holds
//        code[r][L*c + i] in its low nibble and code[r][16 + L*c + i] in its high nibble
//   Q8 form (Q5_0/Q5_1/Q5_K/Q8_0): 32/L chunks of L*R bytes; chunk j, row r, byte i = code[r][L*j +
//   i]
// The SIMD paths take L = 4: one vector load of a chunk holds 4 consecutive codes of each of the
// R rows, one row per 32-bit lane, so a dot with the 4 activations broadcast to every lane sums
// each row in its own lane, with no horizontal reduction, and the R results are R consecutive
// outputs (one store). The generic path takes whole rows (L = 16 or 32, written 0).
// Block sizes: Q4 24R bytes with float32 d/o, 20R with fp16 ones (cpu_quant_matmul.py picks);
// Q8 40R or 36R.
//
// Choices measured on a 2-core AMD EPYC (family 26) VM, Q4_1 N=3072 K=576, 1 thread, us per call:
// - layout, AVX2, M=1: llama.cpp-like row-major blocks {d, m, 16 B} with a horizontal sum per
//   row 52 us from cache / 56 us from memory, against 33 / 44 for these 8-row interleaved tiles
//   (a standalone test of the two loops alone).
// - fp16 against float32 scales: 13.9 against 15.3 (AVX-512, from cache); lm_head Q8_0 N=49152
//   streamed from memory 829 against 928.
// - register tile of x rows MR: AVX-512 MR=8 against 4: M=16 114 against 97, M=256 1906 against
//   1442 (4 kept). AVX2 with GCC's reassociated add chains (every product spilled): M=256 9044,
//   with the running sums pinned in registers (RL_IN_REGISTER) 3085.
// - software prefetch 512..4096 B ahead: within +-5% on whole decode steps (left out).
//
// Threads: one OpenMP parallel region per call (torch's libgomp, linked by the .py): x's rows
// quantized (by the caller before the region when they are few), then (tile, block of x rows)
// pairs claimed in runs (~8 per thread, so a thread the OS preempts delays only its own run),
// each a contiguous stretch of the weights. Small products run on the calling thread alone.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
// GCC 12's AVX-512 conversions read an intentionally undefined vector: a false
// -Wmaybe-uninitialized
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__FMA__)
#define RL_AVX512 1
#define RL_VNNI 1
#define RL_PATH "avx512-vnni"
#define RL_R 16
#define RL_MR 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RL_AVX2 1
#if defined(__AVXVNNI__)
#define RL_VNNI 1
#define RL_PATH "avx2-vnni"
#else
#define RL_PATH "avx2"
#endif
#define RL_R 8
#define RL_MR 4
#else
#define RL_GENERIC 1
#define RL_LANE_BYTES 0
#define RL_PATH "generic"
#define RL_R 8
#define RL_MR 4
#endif

#ifndef RL_LANE_BYTES
#define RL_LANE_BYTES 4
#endif

#ifdef RL_VNNI
#define RL_Q8_BIAS 128
#else
#define RL_Q8_BIAS 0
#endif

namespace {

constexpr int R = RL_R;
constexpr int MR = RL_MR;
constexpr int GROUP = 32;
// form bits: FORM_Q8 (else Q4), FORM_HALF (scales d, o as fp16, else float32)
constexpr int FORM_Q8 = 1, FORM_HALF = 2;
constexpr int64_t scale_bytes(int form) {
  return (form & FORM_HALF ? 4 : 8) * R;
}
constexpr int64_t block_bytes(int form) {
  return scale_bytes(form) + (form & FORM_Q8 ? 32 : 16) * R;
}
// below this many multiply-adds a call runs on the calling thread: waking the pool costs more
constexpr int64_t PARALLEL_MIN_MACS = 1 << 17;
constexpr int64_t CHUNKS_PER_THREAD = 8;
constexpr int64_t QUANTIZE_FIRST_MAX = 8192;  // activations quantized by the caller alone

// The activations of one call, quantized: row m's codes at q + m*K, its group values at m*G.
struct XQ {
  const int8_t* q;
  const float* e;     // scale per group
  const float* es;    // e * sum(q) per group
  const int32_t* qb;  // 128 * sum(q) per group (the VNNI bias)
  int64_t K, G;
};

// IEEE half -> float, exact (subnormals, infinities and NaN included), for the generic path.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {
    const float v = (float)man * 5.9604644775390625e-8f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  const uint32_t bits =
      sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// The R scales d and offsets o at the start of a group's block, as floats.
template <int FORM>
inline void load_scales(const uint8_t* b, float* d, float* o) {
  if (FORM & FORM_HALF) {
    uint16_t h[2 * R];
    memcpy(h, b, sizeof(h));
    for (int r = 0; r < R; ++r) d[r] = half_to_float(h[r]), o[r] = half_to_float(h[R + r]);
  } else {
    memcpy(d, b, sizeof(float) * R);
    memcpy(o, b + 4 * R, sizeof(float) * R);
  }
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// One row of x per group of 32: e = max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|).
// Plain loops the compiler vectorizes; every path uses this one function, so every path sees
// the same codes. max|x| is taken on the bit patterns (an integer max: order-preserving for
// non-negative floats, and vectorizable without fast-math); the rounding adds and subtracts
// 1.5 * 2^23, exact round-to-nearest-even for |v| <= 127.5 (built with -ffp-contract=off, so no
// build fuses the multiply into the add and rounds differently).
void quantize_row(const float* x, int64_t K, int8_t* q, float* e, float* es, int32_t* qb) {
  const int64_t G = K / GROUP;
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * GROUP;
    uint32_t amax_bits = 0;
    for (int i = 0; i < GROUP; ++i) {
      uint32_t b;
      memcpy(&b, xg + i, 4);
      b &= 0x7fffffffu;
      amax_bits = b > amax_bits ? b : amax_bits;
    }
    float amax;
    memcpy(&amax, &amax_bits, 4);
    const float d = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    int8_t* qg = q + g * GROUP;
    for (int i = 0; i < GROUP; ++i) {
      float v = xg[i] * id;
      v = (v + 12582912.0f) - 12582912.0f;
      const int32_t c = (int32_t)v;
      qg[i] = (int8_t)c;
      sum += c;
    }
    e[g] = d;
    es[g] = d * (float)sum;
    qb[g] = 128 * sum;
  }
}

// Writes the R outputs of one tile for one x row; the last tile may hold fewer real rows.
inline void store_row(float* y, const float* v, int64_t valid) {
  if (valid >= R) {
    memcpy(y, v, sizeof(float) * R);
  } else {
    memcpy(y, v, sizeof(float) * valid);
  }
}

#if defined(RL_AVX512)

inline __m512i bcast(const int8_t* p) {
  return _mm512_set1_epi32(load_i32(p));
}

template <int FORM>
inline void load_scales(const uint8_t* b, __m512& vd, __m512& vo) {
  if (FORM & FORM_HALF) {
    vd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)b));
    vo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(b + 2 * R)));
  } else {
    vd = _mm512_loadu_ps(b);
    vo = _mm512_loadu_ps(b + 4 * R);
  }
}

// x rows [m0, m0 + NM) times one tile of 16 weight rows. Two integer sums per x row (low and
// high nibbles, or even and odd chunks) halve the dpbusd dependency chains.
template <int FORM, int NM>
void tile(const uint8_t* wt, const XQ& X, int64_t m0, float* y, int64_t N, int64_t valid) {
  constexpr bool q8 = FORM & FORM_Q8;
  __m512 ad[NM], ao[NM];
  for (int mm = 0; mm < NM; ++mm) ad[mm] = ao[mm] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int8_t* xrow = X.q + m0 * X.K;
  for (int64_t g = 0; g < X.G; ++g) {
    const uint8_t* b = wt + g * block_bytes(FORM);
    const uint8_t* codes = b + scale_bytes(FORM);
    const int8_t* xg = xrow + g * GROUP;
    __m512i acc[NM], acc2[NM];
    for (int mm = 0; mm < NM; ++mm) acc[mm] = acc2[mm] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      if (q8) {  // codes stored + 128 (unsigned); chunks 2c and 2c + 1
        lo = _mm512_loadu_si512(codes + 2 * c * 4 * R);
        hi = _mm512_loadu_si512(codes + (2 * c + 1) * 4 * R);
      } else {
        const __m512i v = _mm512_loadu_si512(codes + c * 4 * R);
        lo = _mm512_and_si512(v, nib);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int mm = 0; mm < NM; ++mm) {
        const int8_t* xq = xg + mm * X.K;
        acc[mm] = _mm512_dpbusd_epi32(acc[mm], lo, bcast(xq + (q8 ? 8 * c : 4 * c)));
        acc2[mm] = _mm512_dpbusd_epi32(acc2[mm], hi, bcast(xq + (q8 ? 8 * c + 4 : 16 + 4 * c)));
      }
    }
    __m512 vd, vo;
    load_scales<FORM>(b, vd, vo);
    for (int mm = 0; mm < NM; ++mm) {
      const int64_t gi = (m0 + mm) * X.G + g;
      __m512i dot = _mm512_add_epi32(acc[mm], acc2[mm]);
      if (q8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(X.qb[gi]));
      const __m512 s = _mm512_mul_ps(vd, _mm512_set1_ps(X.e[gi]));
      ad[mm] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, ad[mm]);
      ao[mm] = _mm512_fmadd_ps(vo, _mm512_set1_ps(X.es[gi]), ao[mm]);
    }
  }
  for (int mm = 0; mm < NM; ++mm) {
    alignas(64) float out[R];
    _mm512_store_ps(out, _mm512_add_ps(ad[mm], ao[mm]));
    store_row(y + (m0 + mm) * N, out, valid);
  }
}

#elif defined(RL_AVX2)

inline __m256i bcast(const int8_t* p) {
  return _mm256_set1_epi32(load_i32(p));
}

// GCC reassociates a chain of integer vector adds into a tree, computes every product first and
// spills them all (measured: 3x slower at MR = 4); an empty asm keeps each running sum in a
// register where it stands.
#if defined(__GNUC__)
#define RL_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define RL_IN_REGISTER(v) (void)0
#endif

template <int FORM>
inline void load_scales(const uint8_t* b, __m256& vd, __m256& vo) {
  if (FORM & FORM_HALF) {
    vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)b));
    vo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(b + 2 * R)));
  } else {
    vd = _mm256_loadu_ps((const float*)b);
    vo = _mm256_loadu_ps((const float*)(b + 4 * R));
  }
}

// x rows [m0, m0 + NM) times one tile of 8 weight rows. One float accumulator per x row (d and
// o terms into the same one) keeps MR = 4 within the 16 ymm registers.
template <int FORM, int NM>
void tile(const uint8_t* wt, const XQ& X, int64_t m0, float* y, int64_t N, int64_t valid) {
  constexpr bool q8 = FORM & FORM_Q8;
  __m256 acc_f[NM];
  for (int mm = 0; mm < NM; ++mm) acc_f[mm] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const int8_t* xrow = X.q + m0 * X.K;
  for (int64_t g = 0; g < X.G; ++g) {
    const uint8_t* b = wt + g * block_bytes(FORM);
    const uint8_t* codes = b + scale_bytes(FORM);
    const int8_t* xg = xrow + g * GROUP;
    __m256i acc[NM];
    for (int mm = 0; mm < NM; ++mm) acc[mm] = _mm256_setzero_si256();
    if (!q8) {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + c * 4 * R));
        const __m256i lo = _mm256_and_si256(v, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int mm = 0; mm < NM; ++mm) {
          const int8_t* xq = xg + mm * X.K;
#ifdef RL_VNNI
          acc[mm] = _mm256_dpbusd_avx_epi32(acc[mm], lo, bcast(xq + 4 * c));
          acc[mm] = _mm256_dpbusd_avx_epi32(acc[mm], hi, bcast(xq + 16 + 4 * c));
#else
          // int16 sums: 16 pairs of at most 15 * 127 * 2 = 3810 each stay below 32767
          acc[mm] = _mm256_add_epi16(acc[mm], _mm256_maddubs_epi16(lo, bcast(xq + 4 * c)));
          acc[mm] = _mm256_add_epi16(acc[mm], _mm256_maddubs_epi16(hi, bcast(xq + 16 + 4 * c)));
          RL_IN_REGISTER(acc[mm]);
#endif
        }
      }
#ifndef RL_VNNI
      for (int mm = 0; mm < NM; ++mm) acc[mm] = _mm256_madd_epi16(acc[mm], _mm256_set1_epi16(1));
#endif
    } else {
#ifdef RL_VNNI
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + j * 4 * R));  // c + 128
        for (int mm = 0; mm < NM; ++mm)
          acc[mm] = _mm256_dpbusd_avx_epi32(acc[mm], v, bcast(xg + mm * X.K + 4 * j));
      }
#else
      // x row outer: the chunks are reloaded from L1 per row, but only a handful of
      // registers stay live (chunk-outer order made GCC spill every product)
      for (int mm = 0; mm < NM; ++mm) {
        const int8_t* xq = xg + mm * X.K;
        for (int j = 0; j < 8; j += 2) {
          const __m256i v0 = _mm256_loadu_si256((const __m256i*)(codes + j * 4 * R));
          const __m256i v1 = _mm256_loadu_si256((const __m256i*)(codes + (j + 1) * 4 * R));
          // |c| * (q with c's sign): pairs of at most 128 * 127 * 2 = 32512, no saturation
          const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(v0, v0),
                                                  _mm256_sign_epi8(bcast(xq + 4 * j), v0));
          const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(v1, v1),
                                                  _mm256_sign_epi8(bcast(xq + 4 * j + 4), v1));
          const __m256i ones = _mm256_set1_epi16(1);
          acc[mm] = _mm256_add_epi32(
              acc[mm], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
          RL_IN_REGISTER(acc[mm]);
        }
      }
#endif
    }
    __m256 vd, vo;
    load_scales<FORM>(b, vd, vo);
    for (int mm = 0; mm < NM; ++mm) {
      const int64_t gi = (m0 + mm) * X.G + g;
      __m256i dot = acc[mm];
#ifdef RL_VNNI
      if (q8) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(X.qb[gi]));
#endif
      const __m256 s = _mm256_mul_ps(vd, _mm256_set1_ps(X.e[gi]));
      acc_f[mm] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc_f[mm]);
      acc_f[mm] = _mm256_fmadd_ps(vo, _mm256_set1_ps(X.es[gi]), acc_f[mm]);
    }
  }
  for (int mm = 0; mm < NM; ++mm) {
    alignas(32) float out[R];
    _mm256_store_ps(out, acc_f[mm]);
    store_row(y + (m0 + mm) * N, out, valid);
  }
}

#else  // generic: plain loops (what runs on Arm and on x86 without AVX2)

// The generic build takes each row's codes of a group contiguous (RL_LANE_BYTES 0: one chunk
// of a whole row), so every dot is a plain loop over 16 or 32 bytes that compilers vectorize
// (widening multiplies and a sum; Arm's sdot/udot where enabled).
inline int32_t dot_q8(const int8_t* b, const int8_t* xq);

// The nibbles widened to int8 first: then the dot is the plain int8 x int8 pattern compilers
// turn into their dot-product instructions (Arm sdot) rather than a mixed-sign one.
inline int32_t dot_q4(const uint8_t* b, const int8_t* xq) {
  int8_t w[32];
  for (int i = 0; i < 16; ++i) w[i] = (int8_t)(b[i] & 15), w[16 + i] = (int8_t)(b[i] >> 4);
  return dot_q8(w, xq);
}

inline int32_t dot_q8(const int8_t* b, const int8_t* xq) {
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += (int32_t)b[i] * xq[i];
  return s;
}

template <int FORM, int NM>
void tile(const uint8_t* wt, const XQ& X, int64_t m0, float* y, int64_t N, int64_t valid) {
  constexpr bool q8 = FORM & FORM_Q8;
  constexpr int row_bytes = q8 ? 32 : 16;
  float ad[NM][R] = {}, ao[NM][R] = {};
  for (int64_t g = 0; g < X.G; ++g) {
    const uint8_t* b = wt + g * block_bytes(FORM);
    float d[R], o[R];
    load_scales<FORM>(b, d, o);
    const uint8_t* codes = b + scale_bytes(FORM);
    for (int mm = 0; mm < NM; ++mm) {
      const int64_t gi = (m0 + mm) * X.G + g;
      const int8_t* xq = X.q + (m0 + mm) * X.K + g * GROUP;
      const float e = X.e[gi], es = X.es[gi];
      for (int r = 0; r < R; ++r) {
        const int32_t dot = q8 ? dot_q8((const int8_t*)codes + r * row_bytes, xq)
                               : dot_q4(codes + r * row_bytes, xq);
        ad[mm][r] += (d[r] * e) * (float)dot;
        ao[mm][r] += o[r] * es;
      }
    }
  }
  for (int mm = 0; mm < NM; ++mm) {
    float out[R];
    for (int r = 0; r < R; ++r) out[r] = ad[mm][r] + ao[mm][r];
    store_row(y + (m0 + mm) * N, out, valid);
  }
}

#endif

// The last nm < MR rows of a block, as one register tile of exactly nm rows.
template <int FORM, int NM>
inline void tile_rest(int64_t nm, const uint8_t* wt, const XQ& X, int64_t m0, float* y, int64_t N,
                      int64_t valid) {
  if constexpr (NM > 0) {
    if (nm == NM)
      tile<FORM, NM>(wt, X, m0, y, N, valid);
    else
      tile_rest<FORM, NM - 1>(nm, wt, X, m0, y, N, valid);
  }
}

// x rows [m0, m0 + nm) times one tile: register tiles of MR x rows, then the rest.
template <int FORM>
void run_block(const uint8_t* wt, const XQ& X, int64_t m0, int64_t nm, float* y, int64_t N,
               int64_t valid) {
  int64_t m = m0;
  for (; m + MR <= m0 + nm; m += MR) tile<FORM, MR>(wt, X, m, y, N, valid);
  tile_rest<FORM, MR - 1>(m0 + nm - m, wt, X, m, y, N, valid);
}

// All (tile, block of x rows) pairs of one call, claimed in runs by the team's threads.
template <int FORM>
void run_tiles(const uint8_t* w, const XQ& X, int64_t N, int64_t M, int64_t T, int64_t n_mblocks,
               int64_t m_block, int64_t chunk, float* y) {
  const int64_t tile_bytes = X.G * block_bytes(FORM);
#pragma omp for schedule(dynamic, chunk) collapse(2)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t mb = 0; mb < n_mblocks; ++mb) {
      const int64_t m0 = mb * m_block, nm = std::min(m_block, M - m0);
      const int64_t valid = std::min<int64_t>(R, N - t * R);
      run_block<FORM>(w + t * tile_bytes, X, m0, nm, y + t * R, N, valid);
    }
  }
}

// The calling thread's scratch for the quantized activations, grown as needed and kept.
struct Scratch {
  std::vector<int64_t> words;  // 8-byte aligned storage
  void* get(size_t bytes) {
    size_t n = (bytes + 7) / 8 + 8;
    if (words.size() < n) words.assign(n, 0);
    return words.data();
  }
};
thread_local Scratch tls_scratch;
thread_local int tls_last_threads = 0;

// Rows of x per block of the parallel split: a whole number of register tiles, so only the last
// block of a tile has a remainder.
constexpr int64_t M_BLOCK = 4 * MR;

}  // namespace

extern "C" {

const char* rl_cq_path() {
  return RL_PATH;
}
int rl_cq_tile_rows() {
  return R;
}
int rl_cq_q8_bias() {
  return RL_Q8_BIAS;
}
int rl_cq_lane_bytes() {
  return RL_LANE_BYTES;
}
// Whether fp16 scales cost nothing here (a vector conversion); the generic path converts each
// in scalar code and takes float32 ones unless asked.
int rl_cq_half_scales_fast() {
  return RL_LANE_BYTES != 0;
}

// The threads a parallel region started here gets (torch.set_num_threads on this thread sets it).
int rl_cq_probe_threads() {
  int n = 0;
#pragma omp parallel
  {
#pragma omp single
    n = omp_get_num_threads();
  }
  return n;
}

// The threads the calling thread's last rl_cq_matmul ran on.
int rl_cq_last_threads() {
  return tls_last_threads;
}

// x [M, K] float32 -> q [M, K] int8, e [M, K/32] (scales), es [M, K/32] (scale * sum of codes):
// the activation quantization of rl_cq_matmul, for tests. 0, or -1 when K is not a multiple of 32.
int rl_cq_quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* e, float* es) {
  if (K <= 0 || K % GROUP) return -1;
  const int64_t G = K / GROUP;
  std::vector<int32_t> qb(G);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, q + m * K, e + m * G, es + m * G, qb.data());
  return 0;
}

// One packed weight, as the Python side keeps it (4 arguments a call instead of 7: ~0.3 us less).
struct Weight {
  const uint8_t* w;
  int64_t form, N, K;
};

// y [M, N] = x [M, K] @ W.T for W packed as described above (form: FORM_Q8 | FORM_HALF bits).
// 0 on success; -1: K not a positive multiple of 32; -2: bad form; -3: bad N or M.
int rl_cq_matmul(const Weight* weight, const float* x, int64_t M, float* y) {
  const uint8_t* w = weight->w;
  const int64_t form = weight->form, N = weight->N, K = weight->K;
  if (K <= 0 || K % GROUP) return -1;
  if (form < 0 || form > (FORM_Q8 | FORM_HALF)) return -2;
  if (N <= 0 || M < 0) return -3;
  if (M == 0) return 0;
  const int64_t G = K / GROUP;
  const int64_t T = (N + R - 1) / R;
  const size_t q_bytes = (size_t)((M * K + 63) / 64 * 64);
  uint8_t* base = (uint8_t*)tls_scratch.get(q_bytes + (size_t)(M * G) * 12);
  int8_t* q = (int8_t*)base;
  float* e = (float*)(base + q_bytes);
  float* es = e + M * G;
  int32_t* qb = (int32_t*)(es + M * G);
  const XQ X{q, e, es, qb, K, G};
  const int64_t n_mblocks = (M + M_BLOCK - 1) / M_BLOCK;
  const bool parallel = N * K * M >= PARALLEL_MIN_MACS;
  // about CHUNKS_PER_THREAD claims per thread: a thread the OS preempts (2 busy cores) holds
  // up only its own small share, the others claim the rest
  const int64_t items = T * n_mblocks;
  const int64_t chunk = std::max<int64_t>(1, items / (CHUNKS_PER_THREAD * omp_get_max_threads()));
  // a few rows are quantized here, before the team starts (no barrier in the region)
  const bool quantize_first = M * K <= QUANTIZE_FIRST_MAX;
  if (quantize_first) {
    for (int64_t m = 0; m < M; ++m)
      quantize_row(x + m * K, K, q + m * K, e + m * G, es + m * G, qb + m * G);
  }
  int used = 1;
#pragma omp parallel if (parallel)
  {
#pragma omp master
    used = omp_get_num_threads();
    if (!quantize_first) {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < M; ++m)
        quantize_row(x + m * K, K, q + m * K, e + m * G, es + m * G, qb + m * G);
      // implicit barrier: every row is quantized before any tile reads it
    }
    switch (form) {
      case 0:
        run_tiles<0>(w, X, N, M, T, n_mblocks, M_BLOCK, chunk, y);
        break;
      case 1:
        run_tiles<1>(w, X, N, M, T, n_mblocks, M_BLOCK, chunk, y);
        break;
      case 2:
        run_tiles<2>(w, X, N, M, T, n_mblocks, M_BLOCK, chunk, y);
        break;
      default:
        run_tiles<3>(w, X, N, M, T, n_mblocks, M_BLOCK, chunk, y);
        break;
    }
  }
  tls_last_threads = used;
  return 0;
}

}  // extern "C"
