// The CPU row matmul (pallas_kernels/row_matmul.py says why it exists and how it is called; it is built into one
// library with the row attention, pallas_kernels/cpu_library.py).
//
// y[r, n] = sum over k of x[r, k] * w[k, n], for x [R, K] float32 and w given as panels [P, K, 16]: w's columns
// 16 at a time, each panel's K rows contiguous (`pack_panels`), in float32, in bfloat16 (a weight whose values
// are all bfloat16 values) or in int8 (a weight whose values are all integers in [-128, 127]: an int8-quantized
// target's): each value is widened exactly as it is loaded, so the sums are those of its float32 panels, from half
// or a quarter of the bytes. Every output is one left-to-right chain over k of rounded products, starting from 0:
//     acc = 0;  for k in 0 .. K-1:  acc = acc + (x[r, k] * w[k, n])      (two roundings a step, never an FMA)
// so its bits depend on row r's values and column n's alone: not on R, on where the row sits, on how the columns
// are tiled, on the thread that computes it, or on the instruction set (IEEE adds and multiplies round the same
// everywhere). That is the batch invariance the target needs, by construction, and `row_matmul_reference` in
// jax.numpy computes the same bits.
//
// Speed: the panels are streamed once per call whatever R is (a tile's sums stay in registers: up to 8 rows x 48
// columns with AVX-512, 6 x 16 with AVX2 or NEON, sized to the register file because a tile that spills is several
// times slower; longer inputs loop over row groups while a group of 3 panels stays in cache), so R rows cost about
// what one row costs until the multiplies catch up with memory. Work is split over XLA's intra-op threads by chunks of
// panels, claimed from a shared counter by the caller and the helpers it schedules; the caller waits only for
// chunks a running thread has claimed, so a helper that never gets a thread cannot stall it.
//
// Built with -ffp-contract=off (no FMA contraction) and -march=native where the compiler takes it; GCC/Clang vector
// extensions give AVX-512, AVX2, SSE or NEON code from the same source.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxspec_cpu;  // the machine's vectors (kWidth, kRegisters, vf, load, store), run_shared

constexpr int kLanes = 16;  // columns per panel
constexpr int kSub = kLanes / kWidth;  // vectors per panel row
constexpr int kPanels = 3;             // panels per group: the columns a row group sweeps while they stay in cache
// bfloat16 and int8 panels are read kPrefetch of their rows ahead (1 KB, 512 bytes): measured on a 2-core AVX-512
// CPU, SmolLM2's 151 matmuls of a forward, best of 30 interleaved rounds, 1 / 3 / 8 rows, bfloat16: 11.87 -> 10.94,
// 13.51 -> 12.06, 21.82 -> 20.39 ms; int8: 6.88 -> 6.51, 10.19 -> 9.26, 20.92 -> 20.89 (BENCHMARKS.md, "bfloat16
// panels read ahead", "int8 panels"). float32 panels are not: there the same prefetch cost 4-8% at 1-6 rows (18.04
// -> 19.45 ms at 1 row), the hardware prefetchers already keeping up with one cache line per panel row. A prefetch
// changes no value, so the bits are the same.
constexpr int kPrefetch = 32;
// A register tile of MR rows x tile_panels<MR>() panels holds its sums and the panels' current row in registers,
// two spare (for a row's broadcast value): up to 8 rows x 3 panels with AVX-512, 6 x 1 .. 1 x 3 with AVX2 or NEON.
template <int MR>
constexpr int tile_panels() {
  return std::max(1, std::min(kPanels, (kRegisters - 2) / ((MR + 1) * kSub)));
}
constexpr int kRows = std::min(8, (kRegisters - 2) / kSub - 1);  // rows per register tile (a one-panel tile's most)

// Rows [0, MR) of x (row stride K) times panels p0 .. p0+V-1 → y (row stride N).
template <int MR, int V, typename W>
inline void tile(const float* x, int64_t K, const W* panels, float* y, int64_t N, int64_t p0) {
  constexpr int S = V * kSub;  // vectors of sums per row
  vf acc[MR][S];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < S; ++s) acc[m][s] = vf{};
  const W* w[V];
  for (int v = 0; v < V; ++v) w[v] = panels + (p0 + v) * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    vf wk[S];
    for (int s = 0; s < S; ++s) wk[s] = load(w[s / kSub] + k * kLanes + (s % kSub) * kWidth);
    if constexpr (sizeof(W) <= 2)
      for (int v = 0; v < V; ++v) __builtin_prefetch(w[v] + (k + kPrefetch) * kLanes);  // never faults
    for (int m = 0; m < MR; ++m) {
      const float a = x[m * K + k];
      for (int s = 0; s < S; ++s) acc[m][s] = acc[m][s] + a * wk[s];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < S; ++s) store(y + m * N + p0 * kLanes + s * kWidth, acc[m][s]);
}

// Rows [0, MR) times the v ≤ kPanels panels from p, in tiles as wide as the registers allow.
template <int MR, typename W>
inline void row_group(const float* x, int64_t K, const W* panels, float* y, int64_t N, int64_t p, int v) {
  constexpr int T = tile_panels<MR>();
  for (; v >= T; v -= T, p += T) tile<MR, T>(x, K, panels, y, N, p);
  if (v == 2) tile<MR, 2>(x, K, panels, y, N, p);
  else if (v == 1) tile<MR, 1>(x, K, panels, y, N, p);
}

// Every row of x times panels [pa, pb): panel groups outside, row groups inside (a group's panels stay in cache).
template <typename W>
void panel_range(const float* x, int64_t R, int64_t K, const W* panels, float* y, int64_t N, int64_t pa,
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
        default: row_group<kRows>(xr, K, panels, yr, N, p, v); break;
      }
    }
  }
}

// The work of one call: chunk c is panels [c·chunk, (c + 1)·chunk) for every row (`run_shared` runs the chunks).
template <typename W>
struct Job {
  struct Scratch {};
  const float* x;
  int64_t R, K;
  const W* panels;
  float* y;
  int64_t N, P, chunk;

  void run(int64_t c, Scratch&) const { panel_range(x, R, K, panels, y, N, c * chunk, std::min(P, (c + 1) * chunk)); }
};

// Split into chunks of whole panel groups (kPanels), about 4 per thread, none under ~64 KB of weights.
int64_t chunk_panels(int64_t P, int64_t K, int threads, int64_t weight_bytes) {
  const int64_t min_panels = std::max<int64_t>(1, (64 * 1024) / (K * kLanes * weight_bytes));
  int64_t chunk = std::max<int64_t>(min_panels, (P + 4 * threads - 1) / (4 * threads));
  return (chunk + kPanels - 1) / kPanels * kPanels;
}

// The panels' element type in C++ for their FFI dtype: bfloat16 panels as their bits, widened by `load`.
template <ffi::DataType D>
struct PanelType;
template <>
struct PanelType<ffi::F32> { using type = float; };
template <>
struct PanelType<ffi::BF16> { using type = uint16_t; };
template <>
struct PanelType<ffi::S8> { using type = int8_t; };

template <ffi::DataType D>
ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<D> panels,
                     ffi::ResultBuffer<ffi::F32> y) {
  using W = typename PanelType<D>::type;
  const auto xd = x.dimensions();
  const auto wd = panels.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kLanes || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("row_matmul expects x [R, K] and panels [P, K, 16]");
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data();
  job->R = xd[0];
  job->K = xd[1];
  job->panels = reinterpret_cast<const W*>(panels.untyped_data());
  job->y = y->typed_data();
  job->P = wd[0];
  job->N = wd[0] * kLanes;
  if (job->R == 0 || job->P == 0) return ffi::Error::Success();
  if (job->K == 0) {
    std::memset(job->y, 0, sizeof(float) * job->R * job->N);
    return ffi::Error::Success();
  }
  const int threads = std::max<int64_t>(1, pool.num_threads());
  job->chunk = chunk_panels(job->P, job->K, threads, sizeof(W));
  const int64_t chunks = (job->P + job->chunk - 1) / job->chunk;
  run_shared(pool, job, chunks, std::min<int64_t>(threads, chunks) - 1);
  return ffi::Error::Success();
}

}  // namespace

// One handler per panel dtype (`row_matmul.SUFFIXES`, `cpu_library.TARGETS`): x float32 [R, K], panels [P, K, 16].
#define JAXSPEC_ROW_MATMUL(symbol, D)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, RowMatmul<D>,                                                   \
                                ffi::Ffi::Bind()                                                        \
                                    .Ctx<ffi::ThreadPool>()                                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                       \
                                    .Arg<ffi::Buffer<D>>()                                              \
                                    .Ret<ffi::Buffer<ffi::F32>>())

JAXSPEC_ROW_MATMUL(JaxspecRowMatmul, ffi::F32);
JAXSPEC_ROW_MATMUL(JaxspecRowMatmulBF16, ffi::BF16);
JAXSPEC_ROW_MATMUL(JaxspecRowMatmulS8, ffi::S8);
