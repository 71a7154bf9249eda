// The CPU row attention (pallas_kernels/row_attention.py says why it exists and how it is called; it is built into
// one library with the row matmul, pallas_kernels/cpu_library.py).
//
// For each (sequence b, KV head h, query token t) and each of the G query heads of h (a row): the keys the token
// sees, in position order P = lo .. p (p its position; lo = 0, or p - window + 1 under a sliding window), at cache
// slot P, or, for a tree's node past the committed length L, at slot L + ancestors[b, t, P - L]. Per row:
//     s_P = halving sum over d of rounded products q[d] * k_P[d]   (element i meets i + half, zero-padded to 2^n)
//     m   = max over P of s_P                                     (exact in any order)
//     e_P = exp_c((s_P - m) * scale)                               (the product rounded; exp_c below)
//     l   = left-to-right sum over P of e_P, from 0
//     a   = left-to-right sum over P of rounded products e'_P * v_P, from 0 (e' = e rounded to v's dtype)
//     out = a * (1 / l)                                            (zeros where nothing is visible)
// Every step is an IEEE add, multiply or max on the row's own values, in an order fixed by the positions alone, so
// a row's bits do not depend on T, on the batch, on the cache's capacity, on the thread or on the instruction set:
// the invariance the target needs, by construction, and `row_attention_reference` computes the same bits in
// jax.numpy.
//
// exp_c(x) is Cephes' expf written as plain adds and multiplies: n = x·log2(e) rounded to the nearest integer (ties
// to even: the 1.5·2^23 trick here, jnp.round there), r = (x - n·C1) - n·C2, a degree-5 polynomial in r by Horner
// steps, times 2^n built from its exponent bits; 0 for x < -80 (so that every result is a normal float). Within
// 2 ulp of exp on [-80, 0], where every argument lies (s_P - m ≤ 0).
//
// Speed: one call per layer reads only the keys each token sees (not the capacity), each key once for a token's G
// rows, with no intermediate buffers beyond a row's scores; the units (b, h, t) are shared with XLA's intra-op
// threads when there is enough work. Built with -ffp-contract=off (no FMA contraction).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxspec_cpu;  // the machine's vectors (kWidth, vf, load, store, widen), run_shared

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f;
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
constexpr float kRound = 12582912.0f;  // 1.5·2^23: (t + kRound) - kRound is t rounded to the nearest integer
constexpr float kExpFloor = -80.0f;

// exp_c (above), one value; the compiler vectorizes its loop over a row's keys.
inline float exp_c(float x) {
  const float t = x * kLog2e;
  const float n = (t + kRound) - kRound;  // IEEE adds: without -ffast-math no compiler folds this into t
  float r = x - n * kC1;
  r = r - n * kC2;
  const float z = r * r;
  float y = kP0 * r + kP1;
  y = y * r + kP2;
  y = y * r + kP3;
  y = y * r + kP4;
  y = y * r + kP5;
  y = y * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < kExpFloor ? 0.0f : y * scale;
}

// e rounded to the cache's dtype (bfloat16: to nearest, ties to even), as a float
inline float round_to(float e, const float*) { return e; }
inline float round_to(float e, const uint16_t*) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The halving sum of one vector's lanes: lane i meets lane i + half, down to lane 0.
inline float halving_lanes(vf x) {
#if defined(__AVX512F__)
  x = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
  x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  x = x + __builtin_shufflevector(x, x, 1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#elif defined(__AVX__)
  x = x + __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
  x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 4, 5, 6, 7);
  x = x + __builtin_shufflevector(x, x, 1, 0, 2, 3, 4, 5, 6, 7);
#else
  x = x + __builtin_shufflevector(x, x, 2, 3, 0, 1);
  x = x + __builtin_shufflevector(x, x, 1, 0, 2, 3);
#endif
  return x[0];
}

// A score with D = V·kWidth (V a power of two): V vectors of products, halved vector by vector (d meets d + D/2,
// then d + D/4, ... while whole vectors pair up), then within the last vector.
template <int V, typename KV>
inline float score(const vf* qv, const KV* k) {
  vf x[V];
  for (int c = 0; c < V; ++c) x[c] = qv[c] * load(k + c * kWidth);
  for (int w = V / 2; w >= 1; w /= 2)
    for (int c = 0; c < w; ++c) x[c] = x[c] + x[c + w];
  return halving_lanes(x[0]);
}

template <typename KV>
struct Job {
  const float* q;          // [B, T, Hq, D]
  const KV* k;             // [B, H, S, D]
  const KV* v;             // [B, H, S, D]
  const int32_t* lengths;  // [B]
  const int32_t* pos;      // [B, T]
  const int32_t* anc;      // [B, T, A] or null (no tree)
  float* out;              // [B, T, Hq, D]
  int64_t B, T, Hq, H, S, D, A, G, Dp;
  float scale;
  int64_t window;  // 0: none
  struct Scratch {  // a thread's buffers: a row's scores, the scalar path's products, the token's key slots
    std::vector<float> scores, buf;
    std::vector<int64_t> slots;
  };

  int64_t slot(int64_t b, int64_t t, int64_t P, int64_t L) const {
    if (anc == nullptr || P < L) return P;
    return L + anc[(b * T + t) * A + (P - L)];
  }

  // Work item u: token t of sequence b against KV head h, u = (b·H + h)·T + t.
  void run(int64_t u, Scratch& scratch) const {
    std::vector<float>& scores = scratch.scores;
    std::vector<int64_t>& slots = scratch.slots;
    const int64_t t = u % T, h = (u / T) % H, b = u / (T * H);
    const int64_t p = pos[b * T + t], L = lengths[b];
    float* o = out + ((b * T + t) * Hq + h * G) * D;
    // the last position seen: the token's own, within the cache (a chain) or within its ancestors (a tree)
    const int64_t hi = std::min<int64_t>(p, anc == nullptr ? S - 1 : L + A - 1);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
    if (p < 0 || hi < lo) {
      std::memset(o, 0, sizeof(float) * G * D);
      return;
    }
    const int64_t n = hi - lo + 1;
    slots.resize(n);
    for (int64_t i = 0; i < n; ++i) slots[i] = std::clamp<int64_t>(slot(b, t, lo + i, L), 0, S - 1);
    const float* qb = q + ((b * T + t) * Hq + h * G) * D;
    const KV* kb = k + (b * H + h) * S * D;
    const KV* vb = v + (b * H + h) * S * D;
    switch (D == Dp ? D / kWidth : 0) {  // whole vectors: the fast path; else the same operations one by one
      case 1: rows<1>(qb, kb, vb, slots.data(), n, o, scores); break;
      case 2: rows<2>(qb, kb, vb, slots.data(), n, o, scores); break;
      case 4: rows<4>(qb, kb, vb, slots.data(), n, o, scores); break;
      case 8: rows<8>(qb, kb, vb, slots.data(), n, o, scores); break;
      case 16: rows<16>(qb, kb, vb, slots.data(), n, o, scores); break;
      case 32: rows<32>(qb, kb, vb, slots.data(), n, o, scores); break;
      default: rows_scalar(qb, kb, vb, slots.data(), n, o, scores, scratch.buf); break;
    }
  }

  // The softmax of a row's scores sg[0 .. n): exp_c of each minus their max, times the scale; → their sum l.
  float softmax(float* sg, int64_t n) const {
    float m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
    for (int64_t i = 0; i < n; ++i) sg[i] = exp_c((sg[i] - m) * scale);
    float l = 0.0f;
    for (int64_t i = 0; i < n; ++i) l = l + sg[i];
    return l;
  }

  template <int V>
  void rows(const float* qb, const KV* kb, const KV* vb, const int64_t* slots, int64_t n, float* o,
            std::vector<float>& scores) const {
    scores.resize(n);
    float* sg = scores.data();
    for (int64_t g = 0; g < G; ++g) {
      vf qv[V];
      for (int c = 0; c < V; ++c) qv[c] = load(qb + g * D + c * kWidth);
      for (int64_t i = 0; i < n; ++i) sg[i] = score<V>(qv, kb + slots[i] * D);
      const float l = softmax(sg, n);
      vf a[V];
      for (int c = 0; c < V; ++c) a[c] = vf{};
      for (int64_t i = 0; i < n; ++i) {
        const float e = round_to(sg[i], vb);
        const KV* vp = vb + slots[i] * D;
        for (int c = 0; c < V; ++c) a[c] = a[c] + e * load(vp + c * kWidth);
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int c = 0; c < V; ++c) store(o + g * D + c * kWidth, a[c] * inv);
    }
  }

  void rows_scalar(const float* qb, const KV* kb, const KV* vb, const int64_t* slots, int64_t n, float* o,
                   std::vector<float>& scores, std::vector<float>& buf) const {
    scores.resize(n);
    buf.assign(Dp, 0.0f);
    float* sg = scores.data();
    float* x = buf.data();
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qb + g * D;
      for (int64_t i = 0; i < n; ++i) {
        const KV* kp = kb + slots[i] * D;
        for (int64_t d = 0; d < D; ++d) x[d] = qg[d] * widen(kp[d]);
        for (int64_t d = D; d < Dp; ++d) x[d] = 0.0f;
        for (int64_t w = Dp / 2; w >= 1; w /= 2)
          for (int64_t j = 0; j < w; ++j) x[j] = x[j] + x[j + w];
        sg[i] = x[0];
      }
      const float l = softmax(sg, n);
      float* a = o + g * D;
      std::memset(a, 0, sizeof(float) * D);
      for (int64_t i = 0; i < n; ++i) {
        const float e = round_to(sg[i], vb);
        const KV* vp = vb + slots[i] * D;
        for (int64_t d = 0; d < D; ++d) a[d] = a[d] + e * widen(vp[d]);
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) a[d] = a[d] * inv;
    }
  }

};

template <typename KV, typename Cache>
ffi::Error RowAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, Cache k, Cache v, ffi::Buffer<ffi::S32> lengths,
                        ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> ancestors,
                        ffi::ResultBuffer<ffi::F32> out, float scale, int64_t window, bool tree) {
  const auto qd = q.dimensions(), kd = k.dimensions(), ad = ancestors.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || ad.size() != 3 || kd[0] != qd[0] || kd[3] != qd[3] || kd[1] == 0 ||
      qd[2] % kd[1] != 0)
    return ffi::Error::InvalidArgument("row_attention expects q [B, T, Hq, D], caches [B, H, S, D] (H | Hq), "
                                       "ancestors [B, T, A]");
  auto job = std::make_shared<Job<KV>>();
  job->q = q.typed_data();
  job->k = reinterpret_cast<const KV*>(k.untyped_data());
  job->v = reinterpret_cast<const KV*>(v.untyped_data());
  job->lengths = lengths.typed_data();
  job->pos = positions.typed_data();
  job->anc = tree ? ancestors.typed_data() : nullptr;
  job->out = out->typed_data();
  job->B = qd[0], job->T = qd[1], job->Hq = qd[2], job->D = qd[3];
  job->H = kd[1], job->S = kd[2], job->A = ad[2];
  job->G = job->Hq / job->H;
  int64_t dp = 1;
  while (dp < job->D) dp *= 2;
  job->Dp = dp;
  job->scale = scale;
  job->window = window;
  const int64_t units = job->B * job->H * job->T;
  if (units == 0 || job->D == 0) return ffi::Error::Success();
  if (job->S == 0) {
    std::memset(job->out, 0, sizeof(float) * job->B * job->T * job->Hq * job->D);
    return ffi::Error::Success();
  }
  // helpers only where there is work enough for a thread's start (~a few µs): rows x capacity x D products at most
  const int64_t work = units * job->G * job->S * job->D;
  const int threads = std::max<int64_t>(1, pool.num_threads());
  run_shared(pool, job, units, work < (int64_t{1} << 18) ? 0 : std::min<int64_t>(threads, units) - 1);
  return ffi::Error::Success();
}

ffi::Error RowAttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> ancestors, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int64_t window, bool tree) {
  return RowAttention<float>(pool, q, k, v, lengths, positions, ancestors, out, scale, window, tree);
}

ffi::Error RowAttentionBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::BF16> k,
                            ffi::Buffer<ffi::BF16> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> ancestors, ffi::ResultBuffer<ffi::F32> out, float scale,
                            int64_t window, bool tree) {
  return RowAttention<uint16_t>(pool, q, k, v, lengths, positions, ancestors, out, scale, window, tree);
}

}  // namespace

#define JAXSPEC_ROW_ATTENTION_BINDING(CACHE)     \
  ffi::Ffi::Bind()                               \
      .Ctx<ffi::ThreadPool>()                    \
      .Arg<ffi::Buffer<ffi::F32>>()              \
      .Arg<ffi::Buffer<CACHE>>()                 \
      .Arg<ffi::Buffer<CACHE>>()                 \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Arg<ffi::Buffer<ffi::S32>>()              \
      .Ret<ffi::Buffer<ffi::F32>>()              \
      .Attr<float>("scale")                      \
      .Attr<int64_t>("window")                   \
      .Attr<bool>("tree")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecRowAttention, RowAttentionF32, JAXSPEC_ROW_ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecRowAttentionBF16, RowAttentionBF16, JAXSPEC_ROW_ATTENTION_BINDING(ffi::BF16));
