// What jaxspec's CPU kernels (cpu_rows.cc, cpu_attention.cc; built by pallas_kernels/cpu_library.py) share: the
// machine's vectors through GCC/Clang vector extensions (AVX-512, AVX2, SSE or NEON code from one source), exact
// bfloat16 and int8 widening, and running a job's work items on XLA's intra-op threads with the caller's rounding mode.

#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JAXSPEC_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxspec_cpu {

namespace ffi = xla::ffi;

// The machine's vectors: kWidth floats, kRegisters of them.
#if defined(__AVX512F__)
constexpr int kWidth = 16, kRegisters = 32;
#elif defined(__AVX__)
constexpr int kWidth = 8, kRegisters = 16;
#elif defined(__aarch64__)
constexpr int kWidth = 4, kRegisters = 32;  // NEON
#else
constexpr int kWidth = 4, kRegisters = 16;  // SSE
#endif

typedef float vf __attribute__((vector_size(4 * kWidth)));
typedef float vfu __attribute__((vector_size(4 * kWidth), aligned(4)));
typedef uint16_t vhu __attribute__((vector_size(2 * kWidth), aligned(2)));
typedef int8_t vqi __attribute__((vector_size(kWidth), aligned(1)));
typedef uint32_t vw __attribute__((vector_size(4 * kWidth)));
typedef int32_t vi __attribute__((vector_size(4 * kWidth)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// kWidth bfloat16 values (their bits) widened to float32: the same values, their mantissas extended with zeros
inline vf load(const uint16_t* p) {
  const vw bits = __builtin_convertvector(*reinterpret_cast<const vhu*>(p), vw) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// kWidth int8 values converted to float32: exact (every int8 is a float32). GCC 12 compiles the vector extensions'
// int8 -> int32 conversion one lane at a time (a decode 2x slower than from bfloat16 panels), so every instruction
// set jaxspec tiles for sign-extends with its own instructions; the vector extensions remain for any other machine.
inline vf load(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX__)  // AVX without AVX2 (kWidth 8): two SSE4.1 halves
  int32_t lo, hi;
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + 4, sizeof hi);
  return _mm256_cvtepi32_ps(_mm256_set_m128i(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(hi)),
                                             _mm_cvtepi8_epi32(_mm_cvtsi32_si128(lo))));
#elif defined(JAXSPEC_X86) && defined(__SSE4_1__)
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
#elif defined(JAXSPEC_X86) && defined(__SSE2__)  // each byte to the top of a 32-bit lane, then shifted down signed
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i bytes = _mm_cvtsi32_si128(four);
  const __m128i words = _mm_unpacklo_epi8(_mm_setzero_si128(), bytes);  // byte i in the top of 16-bit lane i
  return _mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(_mm_setzero_si128(), words), 24));
#elif defined(__aarch64__)
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
#else
  return __builtin_convertvector(__builtin_convertvector(*reinterpret_cast<const vqi*>(p), vi), vf);
#endif
}
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }

// One value: float32 as it is, bfloat16 bits widened exactly.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The caller's floating-point control word (x86 MXCSR; 0 elsewhere), and a scope that runs with it, so that every
// thread rounds and flushes as the calling XLA thread does.
inline unsigned control_word() {
#ifdef JAXSPEC_X86
  return _mm_getcsr();
#else
  return 0;
#endif
}

class WithControlWord {
 public:
  explicit WithControlWord(unsigned csr) {
#ifdef JAXSPEC_X86
    saved_ = _mm_getcsr();
    _mm_setcsr(csr);
#else
    (void)csr;
#endif
  }
  ~WithControlWord() {
#ifdef JAXSPEC_X86
    _mm_setcsr(saved_);
#endif
  }

 private:
  unsigned saved_ = 0;
};

// Runs a job's `items` work items on the caller and up to `helpers` of XLA's intra-op threads. Job::run(i) does
// item i; items are claimed from a shared counter, so the caller waits only for items a running thread has claimed
// and a helper that never gets a thread cannot stall it. The job is shared by pointer: it outlives the call if a
// helper starts late (and then finds nothing left).
template <typename Job>
struct Shared {
  std::shared_ptr<Job> job;
  int64_t items;
  unsigned csr = control_word();
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void work() {
    WithControlWord scope(csr);
    typename Job::Scratch scratch;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      job->run(i, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename Job>
void run_shared(ffi::ThreadPool& pool, std::shared_ptr<Job> job, int64_t items, int64_t helpers) {
  auto shared = std::make_shared<Shared<Job>>();
  shared->job = std::move(job);
  shared->items = items;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->done.load(std::memory_order_acquire) < items) {
#ifdef JAXSPEC_X86
    _mm_pause();
#endif
  }
}

}  // namespace jaxspec_cpu
