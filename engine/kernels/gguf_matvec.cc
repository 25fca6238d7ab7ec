// Matrix-vector products for a few float32 rows against weights kept as integer
// groups (engine/quant.py's QWeight: GGUF's Q4_1 and Q8_0 blocks among them), read
// once per call and dequantized in registers.
//
// y[b, n] = sum_k x[b, k] * w[k, n], with w = q * scale + offset per group of G
// inputs (offset only for the 4-bit form). Computed per group as
//   scale[g, n] * (sum_{k in g} x[b, k] * q[k, n]) + offset[g, n] * (sum_{k in g} x[b, k]),
// the same number in exact arithmetic, accumulated in float32.
//
// Two layouts, as the engine stores them:
// - "cols" (axis 0, a dense [K, N] weight), in tiles of 16 output columns so that
//   one tile's bytes are contiguous: q [N/16, K, 16] int8 or [N/16, K/2, 16] uint8
//   (two 4-bit values a byte, the even input in the low nibble), scale/offset
//   [N/16, K/G, 16], N padded to a multiple of 16 (engine/quant.py packs them);
//   vectorized over the tile's columns. The engine's own [K/2, N] order put each
//   row of a tile in another page, and the reads waited on memory.
// - "rows" (axis 1, an embedding [N, K] used as the head): q [N, K] or [N, K/2],
//   scale/offset [N, K/G]; vectorized over 8 inputs of one output row.
// Scales and offsets are float32, or float16 as a GGUF file stores them (widened in
// registers: 17 % fewer bytes a Q4_1 weight than with float32 ones).
// Rows of x are taken four at a time (a weight read serves all four). Output
// columns are split into chunks run on XLA's intra-op thread pool; the calling
// thread takes chunks too, so the call never waits on a pool that is busy.
// Without AVX2 + FMA (or where a size does not fit the 8-wide form) a plain C++
// loop computes the same sums.
//
// With `act8` (4-bit cols weights, groups of at most 32 inputs, a multiple of 4),
// each row of x is first rounded to int8 per group of G inputs (symmetric, the
// group's amax / 127, as llama.cpp's Q8 activations) and a group's sums are integer
// dot products: vpmaddubsw multiplies the unsigned 4-bit values by the signed int8
// inputs two at a time into int16, which hold a group's sums exactly (at most
// 16 x 15 x 127 per lane). Then
//   y[b, n] = sum_g scale[g, n] * dx[b, g] * (sum_{k in g} qx[b, k] * q[k, n])
//             + offset[g, n] * (sum_{k in g} x[b, k]),
// about half the vector instructions of the float form per weight, so it pays
// where several rows share each weight read (decode batches). Elsewhere `act8` is
// ignored. The offset term keeps x's own sums. Where the CPU has VNNI (AVX-VNNI, or
// AVX-512 VNNI with VL: Intel since Ice Lake / Sapphire Rapids, AMD since Zen 4),
// vpdpbusd does a lane's four products and their sum into int32 in one
// instruction: the same integers, half the instructions again.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TB_AVX2 1
#else
#define TB_AVX2 0
#endif

#if TB_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define TB_VNNI 1
#else
#define TB_VNNI 0
#endif

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // output columns per tile of the cols layout

struct Problem {
  const float* x;       // [B, K]
  const uint8_t* q;     // see the layouts above
  const void* scale;   // [N/16, K/G, 16] (cols) or [N, K/G] (rows); float32 or float16
  const void* offset;  // scale's shape and type, or nullptr
  bool half;           // scale and offset are float16
  const float* xsum;    // [B, K/G]: each row's sum over each group
  const float* xe;      // rows, 4-bit: [B, K/2] the even inputs, then the odd ones
  const float* xo;
  const int8_t* xq;  // act8: [B, K] x rounded per group
  const float* xd;   // act8: [B, K/G] each group's step
  float* y;  // [B, N]
  int64_t B, K, N, G, NG;
  int bits;
};

// Scale or offset entry `at` as a float.
inline float sv(const Problem& p, const void* base, int64_t at) {
  if (!p.half) return static_cast<const float*>(base)[at];
  uint16_t h = static_cast<const uint16_t*>(base)[at];
  uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);  // inf, nan
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while (!(m & 0x400)) m <<= 1, ++shift;
    bits = sign | ((113 - shift) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The integer at input k of output n.
inline float qv(const Problem& p, int64_t k, int64_t n, bool cols) {
  const int64_t t = n / kTile, c = n % kTile;
  if (p.bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.q);
    return static_cast<float>(cols ? q[(t * p.K + k) * kTile + c] : q[n * p.K + k]);
  }
  uint8_t byte = cols ? p.q[(t * (p.K / 2) + k / 2) * kTile + c] : p.q[n * (p.K / 2) + k / 2];
  return static_cast<float>((k & 1) ? (byte >> 4) : (byte & 0xF));
}

// Plain loop: output columns [n0, n1), every row.
void scalar(const Problem& p, int64_t n0, int64_t n1, bool cols) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < p.B; ++b) {
      const float* x = p.x + b * p.K;
      float acc = 0.f;
      for (int64_t g = 0; g < p.NG; ++g) {
        float part = 0.f;
        for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k) part += x[k] * qv(p, k, n, cols);
        int64_t at = cols ? ((n / kTile) * p.NG + g) * kTile + n % kTile : n * p.NG + g;
        acc += sv(p, p.scale, at) * part;
        if (p.offset) acc += sv(p, p.offset, at) * p.xsum[b * p.NG + g];
      }
      p.y[b * p.N + n] = acc;
    }
  }
}

#if TB_AVX2
inline __m256 load8_u4(const uint8_t* at, bool high) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  v = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(v);
}

inline __m256 load8_i8(const uint8_t* at) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// Eight scale or offset entries from `at`, as floats.
inline __m256 load8_s(const Problem& p, const void* base, int64_t at) {
#if defined(__F16C__)
  if (p.half)
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + at)));
#else
  if (p.half) {
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = sv(p, base, at + i);
    return _mm256_load_ps(f);
  }
#endif
  return _mm256_loadu_ps(static_cast<const float*>(base) + at);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A tile's 16 columns of BB rows into y.
template <int BB>
inline void store_tile(const Problem& p, int64_t b0, int64_t t, const __m256 (&acc)[BB][2]) {
  const int64_t n = t * kTile, valid = std::min<int64_t>(kTile, p.N - n);
  for (int b = 0; b < BB; ++b) {
    float* y = p.y + (b0 + b) * p.N + n;
    if (valid == kTile) {
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(y + 8 * v, acc[b][v]);
    } else {  // the last tile's padding columns are not outputs
      alignas(32) float out[kTile];
      for (int v = 0; v < 2; ++v) _mm256_store_ps(out + 8 * v, acc[b][v]);
      std::copy(out, out + valid, y);
    }
  }
}

// cols: BB rows from b0, the 16 output columns of tile t.
template <int BB, int BITS>
void cols_tile(const Problem& p, int64_t b0, int64_t t) {
  constexpr int V = 2;
  __m256 acc[BB][V];
  for (int b = 0; b < BB; ++b)
    for (int v = 0; v < V; ++v) acc[b][v] = _mm256_setzero_ps();
  const float* x = p.x + b0 * p.K;
  const uint8_t* tile = p.q + t * (BITS == 4 ? p.K / 2 : p.K) * kTile;
  for (int64_t g = 0; g < p.NG; ++g) {
    __m256 part[BB][V];
    for (int b = 0; b < BB; ++b)
      for (int v = 0; v < V; ++v) part[b][v] = _mm256_setzero_ps();
    const int64_t k0 = g * p.G;
    if (BITS == 4) {
      for (int64_t j = k0 / 2; j < (k0 + p.G) / 2; ++j) {
        const uint8_t* row = tile + j * kTile;
        __m256 lo[V], hi[V];
        for (int v = 0; v < V; ++v) {
          lo[v] = load8_u4(row + 8 * v, false);
          hi[v] = load8_u4(row + 8 * v, true);
        }
        for (int b = 0; b < BB; ++b) {
          __m256 xl = _mm256_broadcast_ss(x + b * p.K + 2 * j);
          __m256 xh = _mm256_broadcast_ss(x + b * p.K + 2 * j + 1);
          for (int v = 0; v < V; ++v) {
            part[b][v] = _mm256_fmadd_ps(lo[v], xl, part[b][v]);
            part[b][v] = _mm256_fmadd_ps(hi[v], xh, part[b][v]);
          }
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + p.G; ++k) {
        const uint8_t* row = tile + k * kTile;
        __m256 w[V];
        for (int v = 0; v < V; ++v) w[v] = load8_i8(row + 8 * v);
        for (int b = 0; b < BB; ++b) {
          __m256 xk = _mm256_broadcast_ss(x + b * p.K + k);
          for (int v = 0; v < V; ++v) part[b][v] = _mm256_fmadd_ps(w[v], xk, part[b][v]);
        }
      }
    }
    const int64_t at = (t * p.NG + g) * kTile;
    for (int v = 0; v < V; ++v) {
      __m256 s = load8_s(p, p.scale, at + 8 * v);
      for (int b = 0; b < BB; ++b) acc[b][v] = _mm256_fmadd_ps(part[b][v], s, acc[b][v]);
      if (p.offset) {
        __m256 o = load8_s(p, p.offset, at + 8 * v);
        for (int b = 0; b < BB; ++b) {
          __m256 xs = _mm256_broadcast_ss(p.xsum + (b0 + b) * p.NG + g);
          acc[b][v] = _mm256_fmadd_ps(o, xs, acc[b][v]);
        }
      }
    }
  }
  store_tile<BB>(p, b0, t, acc);
}

// cols with act8: BB rows from b0, the 16 output columns of tile t (4-bit only).
// Two tile rows a load: inputs 2j..2j+3 of the 16 columns, rearranged so that each
// 32-bit lane holds one column's four inputs (columns 0-3 and 8-11 in `wa`, 4-7 and
// 12-15 in `wb`); four inputs of x broadcast to every lane then give each column's
// dot product over them with vpmaddubsw (pairs into int16, summed over the group)
// and one vpmaddwd at the group's end (the two pairs into int32).
#if TB_VNNI
// Each int32 lane of acc plus the four products of w's unsigned and x's signed bytes.
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_dpbusd_epi32(acc, w, x);
#endif
}
#endif

template <int BB>
void cols_tile_a8(const Problem& p, int64_t b0, int64_t t) {
  __m256 acc[BB][2];
  for (int b = 0; b < BB; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  const uint8_t* tile = p.q + t * (p.K / 2) * kTile;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // without VNNI
  for (int64_t g = 0; g < p.NG; ++g) {
    __m256i part[BB][2];
    for (int b = 0; b < BB; ++b) part[b][0] = part[b][1] = _mm256_setzero_si256();
    for (int64_t k = g * p.G; k < (g + 1) * p.G; k += 4) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (k / 2) * kTile));
      v = _mm256_permute4x64_epi64(v, 0xD8);  // halves: columns 0-7, then 8-15, of both rows
      __m256i lo = _mm256_and_si256(v, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      __m256i r0 = _mm256_unpacklo_epi8(lo, hi);  // row j: (k, k+1) per column
      __m256i r1 = _mm256_unpackhi_epi8(lo, hi);  // row j+1: (k+2, k+3)
      __m256i wa = _mm256_unpacklo_epi16(r0, r1);
      __m256i wb = _mm256_unpackhi_epi16(r0, r1);
      for (int b = 0; b < BB; ++b) {
        int32_t four;
        std::memcpy(&four, p.xq + (b0 + b) * p.K + k, 4);
        __m256i xb = _mm256_set1_epi32(four);
#if TB_VNNI
        part[b][0] = dot4(part[b][0], wa, xb);  // int32 lanes
        part[b][1] = dot4(part[b][1], wb, xb);
#else
        part[b][0] = _mm256_add_epi16(part[b][0], _mm256_maddubs_epi16(wa, xb));
        part[b][1] = _mm256_add_epi16(part[b][1], _mm256_maddubs_epi16(wb, xb));
#endif
      }
    }
    const int64_t at = (t * p.NG + g) * kTile;
    __m256 s0 = load8_s(p, p.scale, at), s1 = load8_s(p, p.scale, at + 8);
    __m256 s[2] = {_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)};
    for (int b = 0; b < BB; ++b) {
      __m256 d = _mm256_broadcast_ss(p.xd + (b0 + b) * p.NG + g);
      for (int v = 0; v < 2; ++v) {
#if TB_VNNI
        __m256 dot = _mm256_cvtepi32_ps(part[b][v]);
#else
        __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(part[b][v], ones));
#endif
        acc[b][v] = _mm256_fmadd_ps(_mm256_mul_ps(dot, d), s[v], acc[b][v]);
      }
    }
    if (p.offset) {
      __m256 o0 = load8_s(p, p.offset, at), o1 = load8_s(p, p.offset, at + 8);
      __m256 o[2] = {_mm256_permute2f128_ps(o0, o1, 0x20), _mm256_permute2f128_ps(o0, o1, 0x31)};
      for (int b = 0; b < BB; ++b) {
        __m256 xs = _mm256_broadcast_ss(p.xsum + (b0 + b) * p.NG + g);
        for (int v = 0; v < 2; ++v) acc[b][v] = _mm256_fmadd_ps(o[v], xs, acc[b][v]);
      }
    }
  }
  for (int b = 0; b < BB; ++b) {  // back to columns 0-7, 8-15
    __m256 a = acc[b][0], c = acc[b][1];
    acc[b][0] = _mm256_permute2f128_ps(a, c, 0x20);
    acc[b][1] = _mm256_permute2f128_ps(a, c, 0x31);
  }
  store_tile<BB>(p, b0, t, acc);
}

// rows: BB rows from b0, output n.
template <int BB, int BITS>
void rows_one(const Problem& p, int64_t b0, int64_t n) {
  __m256 acc[BB];
  float off[BB];
  for (int b = 0; b < BB; ++b) acc[b] = _mm256_setzero_ps(), off[b] = 0.f;
  const int64_t half = p.K / 2;
  for (int64_t g = 0; g < p.NG; ++g) {
    __m256 part[BB];
    for (int b = 0; b < BB; ++b) part[b] = _mm256_setzero_ps();
    if (BITS == 4) {
      const uint8_t* q = p.q + n * half;
      for (int64_t j = g * p.G / 2; j < (g + 1) * p.G / 2; j += 8) {
        __m256 lo = load8_u4(q + j, false), hi = load8_u4(q + j, true);
        for (int b = 0; b < BB; ++b) {
          part[b] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(p.xe + (b0 + b) * half + j), part[b]);
          part[b] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(p.xo + (b0 + b) * half + j), part[b]);
        }
      }
    } else {
      const uint8_t* q = p.q + n * p.K;
      for (int64_t k = g * p.G; k < (g + 1) * p.G; k += 8) {
        __m256 w = load8_i8(q + k);
        for (int b = 0; b < BB; ++b)
          part[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p.x + (b0 + b) * p.K + k), part[b]);
      }
    }
    __m256 s = _mm256_set1_ps(sv(p, p.scale, n * p.NG + g));
    for (int b = 0; b < BB; ++b) acc[b] = _mm256_fmadd_ps(part[b], s, acc[b]);
    if (p.offset)
      for (int b = 0; b < BB; ++b)
        off[b] += sv(p, p.offset, n * p.NG + g) * p.xsum[(b0 + b) * p.NG + g];
  }
  for (int b = 0; b < BB; ++b) p.y[(b0 + b) * p.N + n] = hsum(acc[b]) + off[b];
}

template <int BB, int BITS>
void cols_rows(const Problem& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t t = n0 / kTile; t * kTile < n1; ++t) {
    if (BITS == 4 && p.xq)
      cols_tile_a8<BB>(p, b0, t);
    else
      cols_tile<BB, BITS>(p, b0, t);
  }
}

template <int BB, int BITS>
void rows_rows(const Problem& p, int64_t b0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) rows_one<BB, BITS>(p, b0, n);
}

template <int BITS>
void simd(const Problem& p, int64_t n0, int64_t n1, bool cols) {
  for (int64_t b0 = 0; b0 < p.B; b0 += 4) {
    switch (std::min<int64_t>(4, p.B - b0)) {
#define TB_CASE(BB) \
  case BB:          \
    cols ? cols_rows<BB, BITS>(p, b0, n0, n1) : rows_rows<BB, BITS>(p, b0, n0, n1); break;
      TB_CASE(1) TB_CASE(2) TB_CASE(3) TB_CASE(4)
#undef TB_CASE
    }
  }
}
#endif  // TB_AVX2

void compute(const Problem& p, int64_t n0, int64_t n1, bool cols) {
#if TB_AVX2
  // rows need whole 8-wide steps inside a group (16 inputs for 4-bit)
  bool fits = cols || p.G % (p.bits == 4 ? 16 : 8) == 0;
  if (fits) {
    p.bits == 4 ? simd<4>(p, n0, n1, cols) : simd<8>(p, n0, n1, cols);
    return;
  }
#endif
  scalar(p, n0, n1, cols);
}

ffi::Error Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                  ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                  ffi::ResultBuffer<ffi::F32> y, int64_t bits, int64_t group, int64_t axis,
                  bool has_offset, bool act8) {
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("gguf_matvec: x must be 2-d");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("gguf_matvec: bits must be 4 or 8");
  auto qtype = q.element_type();
  if ((bits == 8 && qtype != ffi::DataType::S8) || (bits == 4 && qtype != ffi::DataType::U8))
    return ffi::Error::InvalidArgument("gguf_matvec: q must be int8 (8 bits) or uint8 (4 bits)");
  bool cols = axis == 0;
  auto yd = y->dimensions();
  if (yd.size() != 2 || (cols && (qd.size() != 3 || qd[2] != kTile)) || (!cols && qd.size() != 2))
    return ffi::Error::InvalidArgument("gguf_matvec: q must be [N/16, K, 16] (axis 0) or [N, K]");
  Problem p;
  p.B = xd[0], p.K = xd[1], p.G = group, p.bits = static_cast<int>(bits);
  p.N = yd[1];
  int64_t qk = qd[1] * (bits == 4 ? 2 : 1);
  if (cols ? (p.N + kTile - 1) / kTile != qd[0] : p.N != qd[0])
    return ffi::Error::InvalidArgument("gguf_matvec: q's shape disagrees with y's");
  if (group <= 0 || p.K % group || qk != p.K || (bits == 4 && group % 2))
    return ffi::Error::InvalidArgument("gguf_matvec: q, group and x's length disagree");
  p.NG = p.K / group;
  bool scale_ok = cols ? sd.size() == 3 && sd[0] == qd[0] && sd[1] == p.NG && sd[2] == kTile
                       : sd.size() == 2 && sd[0] == p.N && sd[1] == p.NG;
  if (!scale_ok)
    return ffi::Error::InvalidArgument("gguf_matvec: scale's shape disagrees with q's");
  p.x = x.typed_data(), p.q = static_cast<const uint8_t*>(q.untyped_data());
  auto stype = scale.element_type();
  if ((stype != ffi::DataType::F32 && stype != ffi::DataType::F16) ||
      (has_offset && offset.element_type() != stype))
    return ffi::Error::InvalidArgument("gguf_matvec: scale and offset must be float32 or float16");
  p.half = stype == ffi::DataType::F16;
  p.scale = scale.untyped_data(), p.offset = has_offset ? offset.untyped_data() : nullptr;
  p.y = y->typed_data();
  if (has_offset && offset.element_count() != scale.element_count())
    return ffi::Error::InvalidArgument("gguf_matvec: offset's shape disagrees with scale's");
  std::vector<float> xsum(p.B * p.NG, 0.f);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t g = 0; g < p.NG; ++g)
      for (int64_t k = g * p.G; k < (g + 1) * p.G; ++k) xsum[b * p.NG + g] += p.x[b * p.K + k];
  p.xsum = xsum.data();
  p.xq = nullptr, p.xd = nullptr;
  std::vector<int8_t> xint;
  std::vector<float> xstep, xr;
  if (act8 && cols && bits == 4 && p.G % 4 == 0 && p.G <= 32) {
    xint.resize(p.B * p.K), xstep.resize(p.B * p.NG);
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t g = 0; g < p.NG; ++g) {
        const float* x = p.x + b * p.K + g * p.G;
        float amax = 0.f;
        for (int64_t i = 0; i < p.G; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        xstep[b * p.NG + g] = d;
        for (int64_t i = 0; i < p.G; ++i)
          xint[b * p.K + g * p.G + i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
      }
#if TB_AVX2
    p.xq = xint.data(), p.xd = xstep.data();
#else  // the plain loop: the same rounded inputs as floats
    xr.resize(p.B * p.K);
    for (int64_t i = 0; i < p.B * p.K; ++i) xr[i] = xint[i] * xstep[i / p.G];
    p.x = xr.data();
#endif
  }
  std::vector<float> xeo;
  if (!cols && bits == 4) {  // the even and the odd inputs apart, for 8-wide loads
    xeo.resize(p.B * p.K);
    const int64_t half = p.K / 2;
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t j = 0; j < half; ++j) {
        xeo[b * half + j] = p.x[b * p.K + 2 * j];
        xeo[p.B * half + b * half + j] = p.x[b * p.K + 2 * j + 1];
      }
    p.xe = xeo.data(), p.xo = xeo.data() + p.B * half;
  }
  // Chunks of whole cache lines of output columns (cols) or rows of outputs (rows).
  const int64_t unit = cols ? 4 * kTile : 256;
  const int64_t chunks = std::max<int64_t>(1, (p.N + unit - 1) / unit);
  tensorbus::parallel(pool, chunks, [&](int64_t i) {
    compute(p, i * unit, std::min(p.N, (i + 1) * unit), cols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TensorbusGgufMatvec, Matvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("axis")
                                  .Attr<bool>("has_offset")
                                  .Attr<bool>("act8"));

extern "C" int tensorbus_kernel_has_avx2() { return TB_AVX2; }
extern "C" int tensorbus_kernel_has_vnni() { return TB_VNNI; }
