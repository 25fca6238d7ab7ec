// Paged attention on the CPU: each query reads its sequence's K/V blocks in place,
// through its block table, up to its own position (engine/decoder/attention.py).
//
// out[n, h, :] = sum_t softmax_t(s[n, h, t]) * v[t], over the keys t a query sees:
//   start[n] <= t <= positions[n], start = positions - window + 1 with a sliding
//   window, else 0; s = (q . k) * scale, then tanh(s / softcap) * softcap when the
//   model caps its logits (Gemma 2).
// Key t of query n lives in block tables[rows[n], t / BLOCK] at offset t % BLOCK of
// the pool [KV, NUM_BLOCKS, BLOCK, D]; query head h reads KV head h / (H / KV).
//
// A query at position -1 (a prefill chunk's padding) reads nothing; its output is 0.
//
// One kernel serves the three callers: a decode step (one query per row, each row
// its own table), a prefill chunk (T queries of one sequence, one table, each at its
// own position: causal within the chunk because the chunk's K/V are written before
// it attends) and a speculative verify pass (a decode step of one sequence's rows).
// What a step reads is what its rows hold, not a padded window: the decode program
// has no window axis and the prefill program no context axis.
//
// Work is split into items of (tile, KV head), a tile being up to kTile consecutive
// queries of the same table row; a tile reads each key block once for all its
// queries and all the query heads of that KV head. Softmax is online (running max and
// sum per query, rescaled per block), accumulated in float32 in a fixed order over
// the keys: a query's result does not depend on which other queries share its call.
// Items run on XLA's intra-op thread pool and on the calling thread.
// Caches in float32, bfloat16 or float16 are read as they are stored.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 8;  // queries of one row read a key block together

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000 | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400));
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | ((man & 0x3ff) << 13);
    }
  } else {
    u = sign | (exp + 127 - 15) << 23 | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

enum class Kind { F32, BF16, F16 };

// `count` half-precision values of a cache, from `index`, as float32 into `out`.
inline void read_row(const void* base, int64_t index, int64_t count, Kind kind, float* out) {
  const uint16_t* p = static_cast<const uint16_t*>(base) + index;
  if (kind == Kind::BF16)
    for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_f32(p[i]);
  else
    for (int64_t i = 0; i < count; ++i) out[i] = f16_to_f32(p[i]);
}

struct Problem {
  const float* q;  // [N, H, D]
  const void* k;   // [KV, NB, BS, D]
  const void* v;
  const int32_t* tables;  // [R, NW]
  const int32_t* rows;    // [N]
  const int32_t* positions;  // [N]
  float* out;  // [N, H, D]
  Kind kind;
  int64_t N, H, KV, G, D, NB, BS, R, NW;
  float scale, softcap;
  int64_t window;
};

// A thread's working memory, kept between items and calls: a decode step runs
// (rows x KV heads) items per layer, too many for fresh allocations each.
struct Scratch {
  std::vector<float> qs, acc, m, l, kb, vb, s;
  std::vector<int64_t> lo, hi;
};

// One tile [n0, n1) of queries (one table row) against KV head `kv`.
void tile(const Problem& p, int64_t n0, int64_t n1, int64_t kv) {
  const int64_t G = p.G, D = p.D, BS = p.BS, Q = (n1 - n0) * G;
  const int32_t* table = p.tables + static_cast<int64_t>(p.rows[n0]) * p.NW;
  const int64_t limit = p.NW * BS - 1;  // the last key the table can name
  thread_local Scratch w;
  w.qs.resize(Q * D), w.acc.assign(Q * D, 0.f), w.m.assign(Q, -INFINITY), w.l.assign(Q, 0.f);
  w.s.resize(BS), w.lo.resize(n1 - n0), w.hi.resize(n1 - n0);
  if (p.kind != Kind::F32) w.kb.resize(BS * D), w.vb.resize(BS * D);  // f32 is read in place
  std::vector<float>&qs = w.qs, &acc = w.acc, &m = w.m, &l = w.l, &kb = w.kb, &vb = w.vb, &s = w.s;
  std::vector<int64_t>&lo = w.lo, &hi = w.hi;
  int64_t first = limit, last = -1;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t pos = std::min<int64_t>(p.positions[n], limit);
    lo[n - n0] = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    hi[n - n0] = pos;
    first = std::min(first, lo[n - n0]);
    last = std::max(last, pos);
    for (int64_t g = 0; g < G; ++g) {
      const float* src = p.q + (n * p.H + kv * G + g) * D;
      float* dst = qs.data() + ((n - n0) * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.scale;
    }
  }
  const int64_t cache_kv = kv * p.NB * BS * D;
  for (int64_t b = first / BS; last >= 0 && b <= last / BS; ++b) {
    int64_t block = table[b];
    block = block < 0 || block >= p.NB ? 0 : block;  // a bad table reads, never faults
    const int64_t at = cache_kv + block * BS * D;
    const float *kbase = kb.data(), *vbase = vb.data();
    if (p.kind == Kind::F32) {  // read where it lies
      kbase = static_cast<const float*>(p.k) + at, vbase = static_cast<const float*>(p.v) + at;
    } else {
      read_row(p.k, at, BS * D, p.kind, kb.data());
      read_row(p.v, at, BS * D, p.kind, vb.data());
    }
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t i = qi / G;
      const int64_t t0 = std::max(b * BS, lo[i]), t1 = std::min(b * BS + BS - 1, hi[i]);
      if (t0 > t1) continue;
      const float* qv = qs.data() + qi * D;
      float top = -INFINITY;
      for (int64_t t = t0; t <= t1; ++t) {
        const float* kr = kbase + (t - b * BS) * D;
        v8 a0 = {}, a1 = {};
        int64_t d = 0;
        for (; d + 16 <= D; d += 16) {
          a0 += load8(qv + d) * load8(kr + d);
          a1 += load8(qv + d + 8) * load8(kr + d + 8);
        }
        for (; d + 8 <= D; d += 8) a0 += load8(qv + d) * load8(kr + d);
        float dot = hsum8(a0 + a1);
        for (; d < D; ++d) dot += qv[d] * kr[d];
        if (p.softcap > 0.f) dot = std::tanh(dot / p.softcap) * p.softcap;
        s[t - t0] = dot;
        top = std::max(top, dot);
      }
      float* o = acc.data() + qi * D;
      const float mnew = std::max(m[qi], top);
      if (m[qi] != mnew) {
        const float c = m[qi] == -INFINITY ? 0.f : std::exp(m[qi] - mnew);
        l[qi] *= c;
        for (int64_t d = 0; d < D; ++d) o[d] *= c;
        m[qi] = mnew;
      }
      float sum = 0.f;
      for (int64_t t = t0; t <= t1; ++t) {
        const float w = std::exp(s[t - t0] - mnew);
        sum += w;
        const float* vr = vbase + (t - b * BS) * D;
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) store8(o + d, load8(o + d) + w * load8(vr + d));
        for (; d < D; ++d) o[d] += w * vr[d];
      }
      l[qi] += sum;
    }
  }
  for (int64_t qi = 0; qi < Q; ++qi) {
    const int64_t n = n0 + qi / G, h = kv * G + qi % G;
    const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
    float* dst = p.out + (n * p.H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[qi * D + d] * inv;
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> positions,
                          ffi::ResultBuffer<ffi::F32> out, float scale, float softcap,
                          int64_t window) {
  auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument(
        "paged_attention: q [N, H, D], caches [KV, NB, BLOCK, D], tables [R, NW]");
  if (k.element_type() != v.element_type() || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("paged_attention: k and v differ");
  for (size_t i = 0; i < 4; ++i)
    if (kd[i] != v.dimensions()[i])
      return ffi::Error::InvalidArgument("paged_attention: k and v differ in shape");
  Problem p;
  switch (k.element_type()) {
    case ffi::DataType::F32: p.kind = Kind::F32; break;
    case ffi::DataType::BF16: p.kind = Kind::BF16; break;
    case ffi::DataType::F16: p.kind = Kind::F16; break;
    default: return ffi::Error::InvalidArgument("paged_attention: caches are f32, bf16 or f16");
  }
  p.N = qd[0], p.H = qd[1], p.D = qd[2];
  p.KV = kd[0], p.NB = kd[1], p.BS = kd[2];
  p.R = td[0], p.NW = td[1];
  if (kd[3] != p.D || p.KV <= 0 || p.H % p.KV || p.BS <= 0 || p.NW <= 0)
    return ffi::Error::InvalidArgument("paged_attention: head counts or sizes disagree");
  if (rows.element_count() != p.N || positions.element_count() != p.N ||
      out->element_count() != p.N * p.H * p.D)
    return ffi::Error::InvalidArgument("paged_attention: rows, positions or out disagree with q");
  p.G = p.H / p.KV;
  p.q = q.typed_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.tables = tables.typed_data(), p.rows = rows.typed_data();
  p.positions = positions.typed_data(), p.out = out->typed_data();
  p.scale = scale, p.softcap = softcap, p.window = window;
  for (int64_t n = 0; n < p.N; ++n)
    if (p.rows[n] < 0 || p.rows[n] >= p.R)
      return ffi::Error::InvalidArgument("paged_attention: a row names no table");
  // Tiles: runs of up to kTile consecutive queries on the same table row.
  std::vector<int64_t> starts;
  for (int64_t n = 0; n < p.N; ++n)
    if (n == 0 || p.rows[n] != p.rows[n - 1] || n - starts.back() == kTile) starts.push_back(n);
  starts.push_back(p.N);
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
  tensorbus::parallel(pool, tiles * p.KV, [&](int64_t i) {
    const int64_t t = i / p.KV;
    tile(p, starts[t], starts[t + 1], i % p.KV);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TensorbusPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window"));
