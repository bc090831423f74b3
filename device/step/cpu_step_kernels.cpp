// The CPU step's per-layer work around the matmuls in fp32, one call each instead of 3-8 torch
// ops: residual add + RMSNorm, silu(gate) * up, RoPE on q and k with k and v stored into their
// KV-cache rows, and the decode rows' attention read in place from the paged cache. Each loop is
// plain C++ the compiler vectorizes for the machine it is built on
// (-march=native). Rounding: products and sums are rounded one at a time (-ffp-contract=off),
// as torch's elementwise ops are; the RMSNorm's sum of squares is accumulated in double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {

// residual[r] = x[r] + delta[r] (x[r] when delta is null); normed[r] = w * residual[r] / rms
void rl_add_rms_norm(const float* x, const float* delta, const float* w, float eps, int64_t rows,
                     int64_t dim, float* residual, float* normed) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* res = residual + r * dim;
    double squares = 0.0;
    if (delta != nullptr) {
      const float* dr = delta + r * dim;
      for (int64_t i = 0; i < dim; ++i) res[i] = xr[i] + dr[i];
    } else if (res != xr) {
      for (int64_t i = 0; i < dim; ++i) res[i] = xr[i];
    }
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < dim; ++i) squares += double(res[i]) * double(res[i]);
    const float inv = 1.0f / std::sqrt(float(squares / double(dim)) + eps);
    float* out = normed + r * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (res[i] * inv);
  }
}

// gate_up [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up
void rl_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
  }
}

// qkv [rows, (H + 2 KV) * D] -> q [rows, H, D] rotated; k rotated and v written to rows
// cache_row[r] of k_cache / v_cache [*, KV, D]. cos/sin [rows, D]; half-split (rotate_half) RoPE.
void rl_rope_store(const float* qkv, const float* cos, const float* sin, const int64_t* cache_row,
                   int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, float* q,
                   float* k_cache, float* v_cache) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = qkv + r * width;
    const float* c = cos + r * dim;
    const float* s = sin + r * dim;
    float* k_out = k_cache + cache_row[r] * kv_heads * dim;
    float* v_out = v_cache + cache_row[r] * kv_heads * dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* x = src + h * dim;
      float* o = h < heads ? q + (r * heads + h) * dim : k_out + (h - heads) * dim;
      for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      for (int64_t i = half; i < dim; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
    }
    const float* v = src + (heads + kv_heads) * dim;
    for (int64_t i = 0; i < kv_heads * dim; ++i) v_out[i] = v[i];
  }
}

}  // extern "C"

namespace {

// exp for x <= 0 (a softmax's shifted scores): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
// 2^f by a degree-6 polynomial (relative error ~2e-7). Plain arithmetic, so the loops using it
// vectorize (libm's expf does not).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += int32_t(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// One (row, kv head): the G query heads sharing it. D fixed at compile time for the usual head
// sizes, so the 64- or 128-wide dot products and updates unroll into a few vector instructions.
template <int D>
void attend_one(const float* qh, int64_t n, const int64_t* pages, const float* k_cache,
                const float* v_cache, int64_t page_size, int64_t kv_heads, int64_t kvh,
                int64_t group, int64_t dim, float scale, float* scores, float* acc, float* out) {
  const int64_t d = D > 0 ? D : dim;
  const int64_t stride = kv_heads * d;
  const int64_t ld = n + 1;  // each head's scores, then their sum
  for (int64_t start = 0, j = 0; start < n; start += page_size, ++j) {
    const int64_t count = std::min(page_size, n - start);
    const float* kp = k_cache + (pages[j] * page_size * kv_heads + kvh) * d;
    for (int64_t off = 0; off < count; ++off) {
      const float* k = kp + off * stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qh + g * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qg[i] * k[i];
        scores[g * ld + start + off] = dot * scale;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * ld;
    float top = s[0];
    for (int64_t pos = 1; pos < n; ++pos) top = std::max(top, s[pos]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t pos = 0; pos < n; ++pos) {
      s[pos] = exp_nonpositive(s[pos] - top);
      total += s[pos];
    }
    s[n] = total;
  }
  for (int64_t i = 0; i < group * d; ++i) acc[i] = 0.0f;
  for (int64_t start = 0, j = 0; start < n; start += page_size, ++j) {  // each v row read once
    const int64_t count = std::min(page_size, n - start);
    const float* vp = v_cache + (pages[j] * page_size * kv_heads + kvh) * d;
    for (int64_t off = 0; off < count; ++off) {
      const float* v = vp + off * stride;
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * ld + start + off];
        float* a = acc + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += w * v[i];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float total = scores[g * ld + n];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] / total;
  }
}

}  // namespace

extern "C" {

// Decode rows' attention over their slot's pages, read in place (no gather): row t (rows[b], or
// b when rows is null) attends causally over positions [0, positions[t]] of slot slot_of[t],
// whose pages block_table[slot, :] names. q [T, H, D]; caches [pages * page_size, KV, D];
// out [T, H, D]. GQA: query head h reads kv head h / (H / KV). Scores scaled by `scale`.
// Parallel over (row, kv head) on the caller's OpenMP team when the reads are long enough.
void rl_decode_attention(const float* q, const int64_t* rows, int64_t n_rows,
                         const int64_t* slot_of, const int64_t* positions,
                         const int64_t* block_table, int64_t table_width, const float* k_cache,
                         const float* v_cache, int64_t page_size, int64_t heads, int64_t kv_heads,
                         int64_t dim, float scale, float* out) {
  const int64_t group = heads / kv_heads;
  int64_t longest = 0;
  for (int64_t b = 0; b < n_rows; ++b)
    longest = std::max(longest, positions[rows ? rows[b] : b] + 1);
  // below ~1/4 M multiply-adds a fork and join of the team costs more than it saves
  const bool parallel = n_rows * kv_heads * longest * group * dim > (1 << 18);
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(group * (longest + 1)));
    std::vector<float> acc(static_cast<size_t>(group * dim));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < n_rows; ++b) {
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
        const int64_t t = rows ? rows[b] : b;
        const int64_t n = positions[t] + 1;
        const int64_t* pages = block_table + slot_of[t] * table_width;
        const float* qh = q + (t * heads + kvh * group) * dim;
        float* o = out + (t * heads + kvh * group) * dim;
        auto run = [&](auto attend) {
          attend(qh, n, pages, k_cache, v_cache, page_size, kv_heads, kvh, group, dim, scale,
                 scores.data(), acc.data(), o);
        };
        if (dim == 64)
          run(attend_one<64>);
        else if (dim == 128)
          run(attend_one<128>);
        else
          run(attend_one<0>);
      }
    }
  }
}

}  // extern "C"
