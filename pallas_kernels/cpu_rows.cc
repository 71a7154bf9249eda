// The CPU row matmul (pallas_kernels/row_matmul.py says why it exists and how it is built and called).
//
// y[r, n] = sum over k of x[r, k] * w[k, n], for x [R, K] float32 and w given as panels [P, K, 16]: w's columns
// 16 at a time, each panel's K rows contiguous (`pack_panels`). Every output is one left-to-right chain over k of
// rounded products, starting from 0:
//     acc = 0;  for k in 0 .. K-1:  acc = acc + (x[r, k] * w[k, n])      (two roundings a step, never an FMA)
// so its bits depend on row r's values and column n's alone: not on R, on where the row sits, on how the columns
// are tiled, on the thread that computes it, or on the instruction set (IEEE adds and multiplies round the same
// everywhere). That is the batch invariance the target needs, by construction, and `row_matmul_reference` in
// jax.numpy computes the same bits.
//
// Speed: the panels are streamed once per call whatever R is (a tile holds up to 8 rows x 48 columns of sums in
// registers; longer inputs loop over row groups while a panel group stays in cache), so R rows cost about what one
// row costs until the multiplies catch up with memory. Work is split over XLA's intra-op threads by chunks of
// panels, claimed from a shared counter by the caller and the helpers it schedules; the caller waits only for
// chunks a running thread has claimed, so a helper that never gets a thread cannot stall it.
//
// Built with -ffp-contract=off (no FMA contraction) and -march=native where the compiler takes it; GCC/Clang vector
// extensions give AVX-512, AVX2, SSE or NEON code from the same source.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

constexpr int kLanes = 16;    // columns per panel
constexpr int kPanels = 3;    // panels per register tile
constexpr int kRows = 8;      // rows per register tile

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// Rows [0, MR) of x (row stride K) times panels p0 .. p0+V-1 → y (row stride N).
template <int MR, int V>
inline void tile(const float* x, int64_t K, const float* panels, float* y, int64_t N, int64_t p0) {
  v16 acc[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = v16{};
  const float* w[V];
  for (int v = 0; v < V; ++v) w[v] = panels + (p0 + v) * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    v16 wk[V];
    for (int v = 0; v < V; ++v) wk[v] = load(w[v] + k * kLanes);
    for (int m = 0; m < MR; ++m) {
      const float s = x[m * K + k];
      for (int v = 0; v < V; ++v) acc[m][v] = acc[m][v] + s * wk[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) store(y + m * N + (p0 + v) * kLanes, acc[m][v]);
}

template <int MR>
inline void row_group(const float* x, int64_t K, const float* panels, float* y, int64_t N, int64_t p, int v) {
  if (v == kPanels) tile<MR, kPanels>(x, K, panels, y, N, p);
  else if (v == 2) tile<MR, 2>(x, K, panels, y, N, p);
  else tile<MR, 1>(x, K, panels, y, N, p);
}

// Every row of x times panels [pa, pb): panel groups outside, row groups inside (a group's panels stay in cache).
void panel_range(const float* x, int64_t R, int64_t K, const float* panels, float* y, int64_t N, int64_t pa,
                 int64_t pb) {
  for (int64_t p = pa; p < pb; p += kPanels) {
    const int v = static_cast<int>(std::min<int64_t>(kPanels, pb - p));
    for (int64_t r = 0; r < R; r += kRows) {
      const float* xr = x + r * K;
      float* yr = y + r * N;
      switch (std::min<int64_t>(kRows, R - r)) {
        case 1: row_group<1>(xr, K, panels, yr, N, p, v); break;
        case 2: row_group<2>(xr, K, panels, yr, N, p, v); break;
        case 3: row_group<3>(xr, K, panels, yr, N, p, v); break;
        case 4: row_group<4>(xr, K, panels, yr, N, p, v); break;
        case 5: row_group<5>(xr, K, panels, yr, N, p, v); break;
        case 6: row_group<6>(xr, K, panels, yr, N, p, v); break;
        case 7: row_group<7>(xr, K, panels, yr, N, p, v); break;
        default: row_group<8>(xr, K, panels, yr, N, p, v); break;
      }
    }
  }
}

// The work of one call, shared with the helpers by pointer: it outlives the call if a helper starts late.
struct Job {
  const float* x;
  int64_t R, K;
  const float* panels;
  float* y;
  int64_t N, P, chunk, chunks;
  unsigned csr;  // the caller's floating-point control word (x86 MXCSR): every thread rounds and flushes alike
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
#ifdef JAXSPEC_X86
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(csr);
#endif
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      panel_range(x, R, K, panels, y, N, c * chunk, std::min(P, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
#ifdef JAXSPEC_X86
    _mm_setcsr(saved);
#endif
  }
};

// Split into chunks of whole register tiles, about 4 per thread, none under ~64 KB of weights.
int64_t chunk_panels(int64_t P, int64_t K, int threads) {
  const int64_t min_panels = std::max<int64_t>(1, (64 * 1024) / (K * kLanes * 4));
  int64_t chunk = std::max<int64_t>(min_panels, (P + 4 * threads - 1) / (4 * threads));
  return (chunk + kPanels - 1) / kPanels * kPanels;
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = panels.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kLanes || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("row_matmul expects x [R, K] and panels [P, K, 16]");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->R = xd[0];
  job->K = xd[1];
  job->panels = panels.typed_data();
  job->y = y->typed_data();
  job->P = wd[0];
  job->N = wd[0] * kLanes;
#ifdef JAXSPEC_X86
  job->csr = _mm_getcsr();
#else
  job->csr = 0;
#endif
  if (job->R == 0 || job->P == 0) return ffi::Error::Success();
  if (job->K == 0) {
    std::memset(job->y, 0, sizeof(float) * job->R * job->N);
    return ffi::Error::Success();
  }
  const int threads = std::max<int64_t>(1, pool.num_threads());
  job->chunk = chunk_panels(job->P, job->K, threads);
  job->chunks = (job->P + job->chunk - 1) / job->chunk;
  const int64_t helpers = std::min<int64_t>(threads, job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) {
#ifdef JAXSPEC_X86
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
