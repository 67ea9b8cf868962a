// What the kernel sources share (cpu_kernels.cc, quant_kernels.cc): one vector of float
// lanes, its loads (int8 and uint16 lanes widened) and the store of a weight panel's output
// row, the split of work units over XLA's intra-op thread pool, and the FFI binding start
// and buffer types both use. Everything here has internal linkage (an anonymous namespace), so each source gets
// its own copy and the library exports none of it. jaxinfer/kernels/cpu.py keys its build
// on this header as on the sources.
// FFI API: xla/ffi/api/ffi.h as shipped in jaxlib (jax.ffi.include_dir()).

#ifndef JAXINFER_KERNELS_COMMON_H_
#define JAXINFER_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One vector: 16 float lanes with AVX-512, 8 with AVX2 (and the scalar fallback), so that a
// vector is one register either way (a 64-byte vector on AVX2 is two, and GCC keeps arrays
// of them in memory). The instruction set is the one the build targets (-march=native, so
// the CPU's own features).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

// kLanes floats (int32s, uint32s) in GCC/Clang vector extensions; unaligned loads and
// stores go through the aligned(4) variants.
typedef float v16 __attribute__((vector_size(4 * kLanes)));
typedef float v16u __attribute__((vector_size(4 * kLanes), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu16 __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu16u __attribute__((vector_size(4 * kLanes), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline vu16 load_u32(const uint32_t* p) { return *reinterpret_cast<const vu16u*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return v16{} + x; }

template <typename To, typename From>
inline To bit_cast(From x) {
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}

// The vector V of kLanes elements p[0 .. kLanes - 1], each converted on its own (the scalar
// builds' loads).
template <typename V, typename T>
inline V lanes_of(const T* p) {
  V r;
  for (int i = 0; i < kLanes; ++i) r[i] = p[i];
  return r;
}

// kLanes int8s sign-extended, or kLanes uint16s zero-extended, to int32 lanes. GCC 12 lowers
// __builtin_convertvector from 8- and 16-bit lanes to scalar code, so the AVX-512 and AVX2
// builds use the extending loads.
#if defined(__AVX512F__)
inline vi16 widen(const int8_t* p) { return (vi16)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline vi16 widen(const uint16_t* p) { return (vi16)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
inline vi16 widen(const int8_t* p) { return (vi16)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline vi16 widen(const uint16_t* p) { return (vi16)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
#else
template <typename T>
inline vi16 widen(const T* p) {
  return lanes_of<vi16>(p);
}
#endif

// kLanes entries of a K/V pool or weight panel as float32 lanes: float32 as it is, int8
// codes converted.
inline v16 load_codes(const float* p) { return load(p); }
inline v16 load_codes(const int8_t* p) { return __builtin_convertvector(widen(p), v16); }

// out[0:cols] = the first cols lanes of the NV vectors `row` (one output row of a weight panel
// NV vectors wide; cols is less than that for the zero-padded last panel).
template <int NV>
inline void store_panel_row(float* out, const v16 (&row)[NV], int64_t cols) {
  if (cols == NV * kLanes) {
    for (int j = 0; j < NV; ++j) store(out + j * kLanes, row[j]);
    return;
  }
  float full[NV * kLanes];
  for (int j = 0; j < NV; ++j) store(full + j * kLanes, row[j]);
  std::memcpy(out, full, cols * sizeof(float));
}

// Runs unit(i) for i in [0, units) on the calling thread and up to pool.num_threads() - 1
// pool tasks, which claim units from a shared counter. Returns when every unit is done.
// A task that starts late finds nothing left, so the caller never waits on a task that
// has not started (no deadlock when the pool is busy).
template <typename Unit>
void parallel_units(ffi::ThreadPool& pool, int64_t units, Unit unit) {
  struct Shared {
    Shared(Unit unit, int64_t units) : unit(unit), units(units) {}
    Unit unit;
    int64_t units;
    std::atomic<int64_t> next{0}, finished{0};
    void run() {
      for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
        unit(u);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>(unit, units);
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, units - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->run(); });
  shared->run();
  // Every unit is claimed; wait for the ones other threads are still computing: spin
  // briefly, then yield the core, so that a helper the OS preempted mid-unit (a busy
  // machine) gets it back at once instead of after this thread's time slice.
  for (int spins = 0; shared->finished.load(std::memory_order_acquire) < units; ++spins) {
    if (spins < 256) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

// The start of a kernel's FFI binding: XLA's intra-op thread pool (every kernel splits its
// work over it with parallel_units), then operands of the types Args, in order. The rest
// (more operands, attributes, results) chains on: bind_with_pool<A, B>().Ret<C>().
// (Bindings cannot be moved or copied by others than the FFI's own classes, so each step
// hands its result on as a temporary.)
template <typename First, typename... Rest, typename Binding>
auto bind_args(Binding&& b) {
  if constexpr (sizeof...(Rest) == 0)
    return std::move(b).template Arg<First>();
  else
    return bind_args<Rest...>(std::move(b).template Arg<First>());
}
template <typename... Args>
auto bind_with_pool() {
  return bind_args<Args...>(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>());
}

// FFI buffer types both sources bind.
using Matrix2 = ffi::Buffer<ffi::F32, 2>;

// The rows operand of the matmuls: only x's first `rows` rows are computed (a serving
// step's padding follows them), the others' outputs are zeros.
using Rows = ffi::BufferR0<ffi::S32>;

// The rows to compute: the rows operand clamped to [0, M].
inline int64_t valid_rows(Rows& rows, int64_t M) {
  return std::clamp<int64_t>(rows.typed_data()[0], 0, M);
}

// --- RMSNorm prologue of the fused norm + matmul targets ---
// The norm scale operand [I].
using Scale1 = ffi::Buffer<ffi::F32, 1>;

// A row's sum of x[k] * x[k] over k = 0, 1, ..., I - 1 in that order, each square rounded to
// float32 before it is added: kernels.packed.row_sum's loop over the squares XLA computed
// (a multiply-add by 1.0 is an add), so a row's sum depends on that row alone.
inline float sum_of_squares(const float* x, int64_t I) {
  float s = 0.0f;
  for (int64_t k = 0; k < I; ++k) {
    float square = x[k] * x[k];
    asm("" : "+x"(square));  // keeps the square rounded: no multiply-add into s
    s += square;
  }
  return s;
}

// out[k] = (x[k] * r) * scale[k] with r = 1 / sqrt(sum_of_squares / I + eps): the float32
// operations of nn.norm.rms_norm with row_sum, in its order.
inline void rms_norm_row(const float* x, const float* scale, float eps, int64_t I, float* out) {
  const float r = 1.0f / std::sqrt(sum_of_squares(x, I) / static_cast<float>(I) + eps);
  for (int64_t k = 0; k < I; ++k) out[k] = (x[k] * r) * scale[k];
}

// The first n rows of x [n, I] normalised into a new buffer; rows split over the pool
// kNormRows at a time when there are more than that (prefill), else on the calling thread.
constexpr int64_t kNormRows = 16;
inline std::vector<float> rms_norm_rows(ffi::ThreadPool& pool, const float* x, const float* scale,
                                        float eps, int64_t n, int64_t I) {
  std::vector<float> out(n * I);
  float* o = out.data();
  const auto rows = [=](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(x + m * I, scale, eps, I, o + m * I);
  };
  if (n <= kNormRows) {
    rows(0, n);
  } else {
    parallel_units(pool, (n + kNormRows - 1) / kNormRows, [=](int64_t u) {
      rows(u * kNormRows, std::min(n, (u + 1) * kNormRows));
    });
  }
  return out;
}

}  // namespace

#endif  // JAXINFER_KERNELS_COMMON_H_
