// CPU kernels for XLA:CPU, as XLA FFI custom calls (jaxinfer.cpu_kernels):
//   JaxinferDecodeAttention  attention of one new token per row over its K/V cache buffer
//   JaxinferPackedMatmul     x @ W with W pre-packed into column panels
// FFI API: xla/ffi/api/ffi.h as shipped in jaxlib (jax.ffi.include_dir()).
//
// Both split their work into units shared by the calling thread and tasks it schedules
// on XLA's intra-op thread pool (SharedWork below).
//
// --- Decode attention ---
// One new query token per row attends over the row's K/V cache buffer:
//   q    f32  [B, K, G, H]  grouped queries (query head k*G + g reads kv head k), pre-scaled
//   k    f32  [B, K, H, S]  keys, positions minor (the jaxinfer KV-cache layout of K)
//   v    f32  [B, K, S, H]  values
//   mask pred [B, S]        true = visible
//   out  f32  [B, K, G, H]  softmax(q.k, masked) . v; all zeros where a row sees nothing
// This is the same computation as jaxinfer.layers.attention_scores -> masked_softmax ->
// attention_output for T = 1 (no soft-cap). It exists because XLA:CPU runs that chain as
// separate fusions that read each K/V buffer at a fraction of the memory bandwidth, one of
// them on a single core (benchmarks/README.md has the figures).
//
// One work unit per (row, kv head); each reads its K and V blocks once, and only the span
// [first visible, last visible] of positions.
//
// --- Packed matmul ---
//   x      f32 [M, I]      M rows (tokens) of I input features
//   packed f32 [P, I, 48]  W [I, O] cut into P = ceil(O / 48) column panels, the last one
//                          zero-padded (jaxinfer.cpu_kernels.pack_weight)
//   out    f32 [M, O]
// (I and O rather than K and N, which name kv heads and query heads in jaxinfer.)
// Each panel is I*48 contiguous floats, so W streams sequentially; an 8 x 48 block of out
// (24 vector accumulators) is computed per pass over a panel, and all row blocks of a panel
// run back to back so the panel is read from memory once and then from cache. This is the
// register-blocked GEMM of Goto and van de Geijn, "Anatomy of high-performance matrix
// multiplication" (ACM TOMS 2008), with the weight panels packed once at load time.
// benchmarks/README.md compares it with XLA:CPU's dots at the model's shapes. Work units
// are (panel, block of up to 64 rows).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 float lanes in GCC/Clang vector extensions (AVX-512 when the build targets it, two
// AVX2 halves otherwise); unaligned loads and stores go through the aligned(4) variant.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return v16{} + x; }

// exp(x) for x <= 0 (positive inputs are clamped to 0, below -87 to -87): x = n ln2 + r
// with a two-part ln2 (Cody and Waite), exp(r) by the degree-6 polynomial of Cephes' expf,
// 2^n built in the exponent bits. Relative error about 1e-7.
inline v16 exp_nonpositive(v16 x) {
  x = x > splat(0.0f) ? splat(0.0f) : x;
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

struct Dims {
  int64_t B, K, G, H, S;
};

// scores[g, s] = sum_h q[g, h] k[h, s] for s in [0, n), GN query heads at a time.
// Rows of k are read front to back, kRows at once, so the block streams sequentially.
template <int GN>
void scores(const float* q, int64_t H, const float* k, int64_t S, float* sc, int64_t ld, int64_t n) {
  constexpr int kRows = 8;
  const int64_t nv = n / kLanes * kLanes;
  for (int g = 0; g < GN; ++g) std::fill(sc + g * ld, sc + g * ld + n, 0.0f);
  int64_t h = 0;
  for (; h + kRows <= H; h += kRows) {
    const float* rows = k + h * S;
    float qh[GN][kRows];
    for (int g = 0; g < GN; ++g)
      for (int r = 0; r < kRows; ++r) qh[g][r] = q[g * H + h + r];
    for (int64_t s = 0; s < nv; s += kLanes) {
      v16 kv[kRows];
      for (int r = 0; r < kRows; ++r) kv[r] = load(rows + r * S + s);
      for (int g = 0; g < GN; ++g) {
        v16 acc = load(sc + g * ld + s);
        for (int r = 0; r < kRows; ++r) acc += qh[g][r] * kv[r];
        store(sc + g * ld + s, acc);
      }
    }
    for (int64_t s = nv; s < n; ++s)
      for (int g = 0; g < GN; ++g)
        for (int r = 0; r < kRows; ++r) sc[g * ld + s] += qh[g][r] * rows[r * S + s];
  }
  for (; h < H; ++h)
    for (int64_t s = 0; s < n; ++s)
      for (int g = 0; g < GN; ++g) sc[g * ld + s] += q[g * H + h] * k[h * S + s];
}

// out[g, :] = sum_s w[g, s] v[s, :] for s in [0, n), 64 columns of v at a time.
template <int GN>
void weighted_values(const float* w, int64_t ld, int64_t n, const float* v, int64_t H, float* out) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= H; c += 4 * kLanes) {
    v16 acc[GN][4] = {};
    for (int64_t s = 0; s < n; ++s) {
      const float* row = v + s * H + c;
      const v16 v0 = load(row), v1 = load(row + 16), v2 = load(row + 32), v3 = load(row + 48);
      for (int g = 0; g < GN; ++g) {
        const float ws = w[g * ld + s];
        acc[g][0] += ws * v0;
        acc[g][1] += ws * v1;
        acc[g][2] += ws * v2;
        acc[g][3] += ws * v3;
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < 4; ++j) store(out + g * H + c + j * kLanes, acc[g][j]);
  }
  for (; c < H; ++c)
    for (int g = 0; g < GN; ++g) {
      float acc = 0.0f;
      for (int64_t s = 0; s < n; ++s) acc += w[g * ld + s] * v[s * H + c];
      out[g * H + c] = acc;
    }
}

// Runs F<GN> over the G query heads of a kv head in groups of at most 4 (register budget).
template <template <int> class F, typename... Args>
void by_head_group(int64_t G, int64_t stride_first, int64_t stride_last, const float* first,
                   float* last, Args... args) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* a = first + g0 * stride_first;
    float* b = last + g0 * stride_last;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: F<1>::run(a, b, args...); break;
      case 2: F<2>::run(a, b, args...); break;
      case 3: F<3>::run(a, b, args...); break;
      default: F<4>::run(a, b, args...); break;
    }
  }
}

template <int GN>
struct Scores {
  static void run(const float* q, float* sc, int64_t H, const float* k, int64_t S, int64_t ld, int64_t n) {
    scores<GN>(q, H, k, S, sc, ld, n);
  }
};

template <int GN>
struct WeightedValues {
  static void run(const float* w, float* out, int64_t ld, int64_t n, const float* v, int64_t H) {
    weighted_values<GN>(w, ld, n, v, H, out);
  }
};

// Attention of one (row, kv head) unit; scratch holds G + 1 rows of n rounded up to 16.
void attend_unit(const Dims& d, int64_t unit, const float* q, const float* k, const float* v,
                 const bool* mask, float* out, std::vector<float>& scratch) {
  const int64_t G = d.G, H = d.H, S = d.S;
  const bool* visible = mask + (unit / d.K) * S;
  float* o = out + unit * G * H;
  int64_t lo = 0, hi = S;
  while (lo < S && !visible[lo]) ++lo;
  while (hi > lo && !visible[hi - 1]) --hi;
  if (lo == hi) {
    std::fill(o, o + G * H, 0.0f);
    return;
  }
  const int64_t n = hi - lo, ld = (n + kLanes - 1) / kLanes * kLanes;
  scratch.resize((G + 1) * ld);
  float* sc = scratch.data();
  float* keep = sc + G * ld;  // 1 where visible, 0 elsewhere and in the padding
  for (int64_t s = 0; s < ld; ++s) keep[s] = (s < n && visible[lo + s]) ? 1.0f : 0.0f;

  by_head_group<Scores>(G, H, ld, q + unit * G * H, sc, H, k + unit * H * S + lo, S, ld, n);
  for (int64_t g = 0; g < G; ++g) {  // masked softmax in place, over [0, ld)
    float* row = sc + g * ld;
    std::fill(row + n, row + ld, 0.0f);
    v16 mx = splat(-3.0e38f);
    for (int64_t s = 0; s < ld; s += kLanes) {
      const v16 x = load(keep + s) > splat(0.0f) ? load(row + s) : mx;
      mx = x > mx ? x : mx;
    }
    float row_max = mx[0];
    for (int j = 1; j < kLanes; ++j) row_max = std::max(row_max, mx[j]);
    v16 sum = {};
    for (int64_t s = 0; s < ld; s += kLanes) {
      const v16 e = exp_nonpositive(load(row + s) - row_max) * load(keep + s);
      store(row + s, e);
      sum += e;
    }
    float total = 0.0f;
    for (int j = 0; j < kLanes; ++j) total += sum[j];
    const v16 inv = splat(1.0f / total);  // total >= 1: the max itself contributes exp(0)
    for (int64_t s = 0; s < ld; s += kLanes) store(row + s, load(row + s) * inv);
  }
  by_head_group<WeightedValues>(G, ld, H, sc, o, ld, n, v + (unit * S + lo) * H, H);
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
  // Every unit is claimed; wait for the ones other threads are still computing.
  while (shared->finished.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

using Tensor4 = ffi::Buffer<ffi::F32, 4>;
using Mask2 = ffi::Buffer<ffi::PRED, 2>;

ffi::Error DecodeAttention(ffi::ThreadPool pool, Tensor4 q, Tensor4 k, Tensor4 v, Mask2 mask,
                           ffi::Result<Tensor4> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions();
  const Dims d{qd[0], qd[1], qd[2], qd[3], kd[3]};
  if (kd[0] != d.B || kd[1] != d.K || kd[2] != d.H || vd[0] != d.B || vd[1] != d.K ||
      vd[2] != d.S || vd[3] != d.H || md[0] != d.B || md[1] != d.S)
    return ffi::Error::InvalidArgument(
        "decode_attention: expected q [B,K,G,H], k [B,K,H,S], v [B,K,S,H], mask [B,S]");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  parallel_units(pool, d.B * d.K, [=](int64_t unit) {
    thread_local std::vector<float> scratch;
    attend_unit(d, unit, qp, kp, vp, mp, op, scratch);
  });
  return ffi::Error::Success();
}

// --- Packed matmul ---

constexpr int kPanel = 48;        // columns per panel: 3 vectors
constexpr int kRowBlock = 8;      // rows per register block: 8 x 3 = 24 accumulators
constexpr int64_t kRowsPerUnit = 64;

// out[0:R, 0:cols] = x[0:R, :] @ panel, x rows K apart, out rows N apart.
template <int R>
void panel_block(const float* __restrict x, int64_t K, const float* __restrict panel,
                 float* __restrict out, int64_t N, int64_t cols) {
  constexpr int NV = kPanel / kLanes;
  v16 acc[R][NV] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    v16 b[NV];
    for (int j = 0; j < NV; ++j) b[j] = load(w + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += xr * b[j];
    }
  }
  if (cols == kPanel) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) store(out + r * N + j * kLanes, acc[r][j]);
  } else {  // the zero-padded last panel
    for (int r = 0; r < R; ++r) {
      float row[kPanel];
      for (int j = 0; j < NV; ++j) store(row + j * kLanes, acc[r][j]);
      std::memcpy(out + r * N, row, cols * sizeof(float));
    }
  }
}

template <int R>
void panel_rows(int64_t rows, const float* x, int64_t K, const float* panel, float* out,
                int64_t N, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1>(rows, x, K, panel, out, N, cols);
  }
  panel_block<R>(x, K, panel, out, N, cols);
}

using Matrix2 = ffi::Buffer<ffi::F32, 2>;
using Panels3 = ffi::Buffer<ffi::F32, 3>;

ffi::Error PackedMatmul(ffi::ThreadPool pool, Matrix2 x, Panels3 packed, ffi::Result<Matrix2> out) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), od = out->dimensions();
  const int64_t M = xd[0], K = xd[1], P = pd[0], N = od[1];
  if (pd[1] != K || pd[2] != kPanel || od[0] != M || N > P * kPanel || N <= (P - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "packed_matmul: expected x [M,K], packed [ceil(N/48),K,48], out [M,N]");
  const float *xp = x.typed_data(), *wp = packed.typed_data();
  float* op = out->typed_data();
  const int64_t row_units = (M + kRowsPerUnit - 1) / kRowsPerUnit;
  // Units panel-major: the row blocks of one panel run next to each other (panel in cache).
  parallel_units(pool, P * row_units, [=](int64_t unit) {
    const int64_t p = unit / row_units, m0 = (unit % row_units) * kRowsPerUnit;
    const int64_t m1 = std::min(M, m0 + kRowsPerUnit), cols = std::min<int64_t>(kPanel, N - p * kPanel);
    const float* panel = wp + p * K * kPanel;
    for (int64_t m = m0; m < m1; m += kRowBlock)
      panel_rows<kRowBlock>(std::min<int64_t>(kRowBlock, m1 - m), xp + m * K, K, panel,
                            op + m * N + p * kPanel, N, cols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Tensor4>()
                                  .Arg<Tensor4>()
                                  .Arg<Tensor4>()
                                  .Arg<Mask2>()
                                  .Ret<Tensor4>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Matrix2>()
                                  .Arg<Panels3>()
                                  .Ret<Matrix2>());
