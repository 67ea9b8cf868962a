// Quantized CPU kernels for XLA:CPU, as XLA FFI custom calls (jaxinfer.quant_kernels):
//   JaxinferInt8Matmul           x @ W, W int8 codes with a scale per block of rows
//   JaxinferInt8MinMatmul        the same with a min per block too
//   JaxinferQ4Matmul             x @ W, W 4-bit codes with a scale and a min per block of rows;
//                                with int8_activations, x rounded to int8 first (AVX512-VNNI or AVX2)
//   JaxinferBf16Matmul           x @ W, W bfloat16
// FFI API: xla/ffi/api/ffi.h as shipped in jaxlib (jax.ffi.include_dir()). What this
// file shares with cpu_kernels.cc (vectors, exp, the thread-pool split) is in common.h.
//
// --- Quantized matmuls ---
// W [K, N] is packed, like jaxinfer.kernels.cpu.PackedWeight, into P = ceil(N / 48) column
// panels (the last one zero-padded), and cut along K into blocks of `bs` rows; every
// (block, column) has its own scale (and min). jaxinfer/quant.py makes these layouts:
//   int8:  codes s8 [P, K, 48];     w[k, n] = scale[b, n] * codes[k, n] (+ min[b, n])
//   q4:    codes u8 [P, K/2, 48];   byte (i, j) holds rows 2i (low nibble) and 2i+1 (high)
//                                   w[k, n] = scale[b, n] * codes[k, n] + min[b, n]
//   bf16:  codes bf16 [P, K, 48];   w[k, n] = codes[k, n]
//   scale, min: f16 or f32 [P, K / bs, 48];  b = k / bs
// so one kernel covers per-output-channel int8 (bs = K), GGUF Q8_0 / Q5_0 (bs = 32, f16
// scales), Q6_K (bs = 16, f32 scales), Q4_0 / Q4_1 (bs = 32, f16) and Q4_K (bs = 32, f32).
// Activations stay float32 throughout. Below 8 rows (decode at small batch) the codes
// are turned into float32 in registers and never stored: within a block the kernel sums
// x[m, k] * codes[k, n] in float32, then adds
//   scale[b, n] * that + min[b, n] * sum_{k in b} x[m, k],
// which is x @ W up to float32 summation order (register blocks of up to kMaxRows rows x 48
// columns: 4 with AVX-512, 2 with AVX2). From 8 rows on (larger decode batches, prefill)
// each work unit first writes its panel's weights scale * code + min as a float32 tile of
// K x 48 (at most a few hundred KB, in L2, reused by up to 64 rows) and runs
// kTileBlockRows x 48 register blocks over it (8 rows with AVX-512, 2 with AVX2):
// converting codes once per 4 rows made B = 32 and prefill 2-4x slower than float32.
// Panels stream sequentially and all row blocks of a panel run back to back (as in
// cpu_kernels.cc). Every matmul takes a last operand `rows` (int32 scalar): only x's first
// `rows` rows are computed and the others' outputs are zeros (a serving step's padding);
// which of the two paths runs still depends on M alone. bfloat16 codes (no scale) give the
// same bits on both paths and for any number of rows (kOneOrder, below).

#include <chrono>
#include <cstdlib>
#include <iterator>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

// kLanes 4-bit codes, float16 or bfloat16 values to float32 lanes (int8 codes: load_codes,
// common.h). A byte of 4-bit codes holds two: the low nibble, and the high one, which the
// byte's sign extension (widen) keeps in bits 4..7 after the shift.
inline void load_nibbles(const uint8_t* p, v16& lo, v16& hi) {
  const vi16 b = widen(reinterpret_cast<const int8_t*>(p));
  lo = __builtin_convertvector(b & 15, v16);
  hi = __builtin_convertvector((b >> 4) & 15, v16);
}

inline v16 load_bf16(const uint16_t* p) { return bit_cast<v16>(vu16(widen(p)) << 16); }

// GCC 12 lowers __builtin_convertvector from 16-bit floats to scalar code, so the AVX-512 and
// AVX2 (F16C) builds use the conversion instructions.
inline v16 load_codes(const _Float16* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif defined(__AVX2__) && defined(__F16C__)
  return (v16)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  return lanes_of<v16>(p);
#endif
}

// Software prefetch of the weight codes `prefetch_distance` bytes ahead of the read, into
// every cache level (T0). Whether it helps depends on the CPU: on an Intel Xeon the hardware
// prefetcher alone left the code stream latency-bound, on an AMD EPYC it was slower
// (benchmarks/README.md, "Software prefetch of the quantized codes"). So the distance is
// measured, not guessed: jaxinfer_measure_prefetch (below) times a batch-1 q4 matmul at each
// candidate distance, and jaxinfer/kernels/cpu.py sets the winner (or
// JAXINFER_KERNEL_PREFETCH) through jaxinfer_set_prefetch when it loads the library, before
// any kernel runs. 0: off.
int64_t prefetch_distance = 0;

// Prefetches the cache lines of [p, p + bytes) moved `prefetch_distance` bytes ahead.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  if (prefetch_distance == 0) return;
  const char* q = static_cast<const char*>(p) + prefetch_distance;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(q + o, 0, 3);
}

// --- Weight formats: one step of `kStep` rows of a 48-column panel as float vectors ---

constexpr int kPanel = 48;
constexpr int NV = kPanel / kLanes;  // vectors per panel row: 3 (AVX-512) or 6
constexpr int64_t kRowsPerUnit = 64;
// Rows per register block below kTileRows (codes converted in registers) and over a float32
// tile: R x NV accumulators plus the weights in flight must fit the register file (32
// vectors with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
constexpr int kMaxRows = 4;
constexpr int kTileBlockRows = 8;
#else
constexpr int kMaxRows = 2;
constexpr int kTileBlockRows = 2;
#endif

// Each format reads vector j (columns j * kLanes ...) of one step: kStep rows of a panel.
// kOneOrder: every output element sums its K products in one order, k = 0, 1, ..., whatever
// the number of rows in its register block or call (see block_sums). bfloat16 codes and
// float32 tiles keep it: a bfloat16 weight's products are then the same in both paths (its
// tile holds the codes exactly), so a row's result does not depend on the rows beside it,
// which the deterministic mode needs (serving/deterministic.py). int8 and q4 sum in another
// order from kTileRows rows on anyway (scales applied per block below it, in the tile above).
template <typename C, int Step, bool OneOrder>
struct CodeFormat {
  using Code = C;
  static constexpr int kStep = Step;
  static constexpr bool kOneOrder = OneOrder;
};

struct Int8Codes : CodeFormat<int8_t, 1, false> {
  static void load_one(const int8_t* p, int j, v16 w[1]) { w[0] = load_codes(p + j * kLanes); }
};

struct Q4Codes : CodeFormat<uint8_t, 2, false> {
  static void load_one(const uint8_t* p, int j, v16 w[2]) { load_nibbles(p + j * kLanes, w[0], w[1]); }
};

struct Bf16Codes : CodeFormat<uint16_t, 1, true> {
  static void load_one(const uint16_t* p, int j, v16 w[1]) { w[0] = load_bf16(p + j * kLanes); }
};

// A panel already turned into float32 (the staging tile of `dequantize_panel`).
struct F32Codes : CodeFormat<float, 1, true> {
  static void load_one(const float* p, int j, v16 w[1]) { w[0] = ::load(p + j * kLanes); }
};

// All NV vectors of one step: w[s][j] = row s, vector j.
template <class Fmt>
inline void load_step(const typename Fmt::Code* p, v16 w[Fmt::kStep][NV]) {
  for (int j = 0; j < NV; ++j) {
    v16 one[Fmt::kStep];
    Fmt::load_one(p, j, one);
    for (int s = 0; s < Fmt::kStep; ++s) w[s][j] = one[s];
  }
}

// load_step of the codes at c, a stream's next step, with the codes prefetch_distance ahead
// asked for.
template <class Fmt>
inline void stream_step(const typename Fmt::Code* c, v16 w[Fmt::kStep][NV]) {
  prefetch_ahead(c, kPanel * sizeof(*c));
  load_step<Fmt>(c, w);
}

template <typename Scale>
inline void load_scales(const Scale* p, v16 s[NV]) {
  for (int j = 0; j < NV; ++j) {
    if constexpr (std::is_same_v<Scale, float>) s[j] = load(p + j * kLanes);
    else s[j] = load_codes(p + j * kLanes);
  }
}

// One panel's blocks, with codes `codes` ([K / kStep, kStep * 48] in Fmt's layout), scales
// and mins ([nb, 48]; min may be null) and x rows K apart; xsum[r * nb + b] = sum of row r's
// x over block b (read only when min is set).
template <typename Scale>
struct PanelArgs {
  const float* x;
  int64_t K, bs, nb;
  const Scale* scale;  // null: no scale (bf16)
  const Scale* min;    // null: no min
  const float* xsum;
  float* out;
  int64_t N, cols;
};

// part[r][j] = sum over one block's rows k of x[r, k] * W[k, vector j's columns] (codes, not
// yet scaled), x rows K apart; returns the codes after the block.
// With AVX-512 a step's NV weight vectors are loaded at once, and one row (decode at batch
// 1) of int8 or q4 codes keeps 2 * kStep independent sums per vector, so its FMAs do not wait
// on each other; formats with kOneOrder keep one sum per vector, as every other row count does.
// With 16 registers (AVX2) that would spill: there the loop takes one weight vector at a
// time and adds it into every row's sum for that vector.
template <class Fmt, int R>
const typename Fmt::Code* block_sums(const float* xb, int64_t K, int64_t bs,
                                     const typename Fmt::Code* c, v16 part[R][NV]) {
  constexpr int S = Fmt::kStep;
#if defined(__AVX512F__)
  if constexpr (R == 1 && !Fmt::kOneOrder) {
    v16 p[2][S][NV] = {};
    int64_t k = 0;
    for (; k + 2 * S <= bs; k += 2 * S, c += 2 * kPanel) {
      prefetch_ahead(c, 2 * kPanel * sizeof(*c));
      for (int u = 0; u < 2; ++u) {
        v16 w[S][NV];
        load_step<Fmt>(c + u * kPanel, w);
        for (int s = 0; s < S; ++s)
          for (int j = 0; j < NV; ++j) p[u][s][j] += xb[k + u * S + s] * w[s][j];
      }
    }
    for (; k < bs; k += S, c += kPanel) {
      v16 w[S][NV];
      load_step<Fmt>(c, w);
      for (int s = 0; s < S; ++s)
        for (int j = 0; j < NV; ++j) p[0][s][j] += xb[k + s] * w[s][j];
    }
    for (int j = 0; j < NV; ++j) {
      part[0][j] = p[0][0][j] + p[1][0][j];
      for (int s = 1; s < S; ++s) part[0][j] += p[0][s][j] + p[1][s][j];
    }
    return c;
  }
  v16 acc[R][NV] = {};
  for (int64_t k = 0; k < bs; k += S, c += kPanel) {  // kPanel codes per step
    v16 w[S][NV];
    stream_step<Fmt>(c, w);
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) {
        const float xr = xb[r * K + k + s];
        for (int j = 0; j < NV; ++j) acc[r][j] += xr * w[s][j];
      }
  }
#else
  // q4: a byte's high nibble is taken as 16 * code (byte & 0xF0: one AND where the code needs a
  // shift and an AND) against x / 16, a power-of-two scaling (exact for |x| >= 2^-122), so
  // every product, and so every sum, is the one of code * x.
  constexpr bool kSixteenths = std::is_same_v<Fmt, Q4Codes>;
  v16 acc[R][NV] = {};
  for (int64_t k = 0; k < bs; k += S, c += kPanel) {
    prefetch_ahead(c, kPanel * sizeof(*c));
    float xr[R][S];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < S; ++s) xr[r][s] = xb[r * K + k + s] * (kSixteenths && s ? 0.0625f : 1.0f);
    for (int j = 0; j < NV; ++j) {
      v16 w[S];
      if constexpr (kSixteenths) {
        const vi16 b = widen(reinterpret_cast<const int8_t*>(c) + j * kLanes);
        w[0] = __builtin_convertvector(b & 15, v16);
        w[1] = __builtin_convertvector(b & 0xF0, v16);
      } else {
        Fmt::load_one(c, j, w);
      }
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) acc[r][j] += xr[r][s] * w[s];
    }
  }
#endif
  // The sums stay in `acc`, registers, until here: summed into part[] directly, GCC kept
  // them in memory (part may alias x), a load and a store around every FMA.
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) part[r][j] = acc[r][j];
  return c;
}

// out[0:R, 0:cols] = x[0:R, :] @ W for one panel, register-blocked over R rows x 48 columns.
template <class Fmt, typename Scale, int R>
void quant_panel_block(const PanelArgs<Scale>& a, const typename Fmt::Code* codes) {
  v16 acc[R][NV] = {};
  const typename Fmt::Code* c = codes;
  for (int64_t b = 0; b < a.nb; ++b) {
    v16 part[R][NV];
    c = block_sums<Fmt, R>(a.x + b * a.bs, a.K, a.bs, c, part);
    if (a.scale == nullptr) {
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) acc[r][j] += part[r][j];
      continue;
    }
    v16 sc[NV];
    load_scales(a.scale + b * kPanel, sc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] += part[r][j] * sc[j];
    if (a.min != nullptr) {
      v16 mn[NV];
      load_scales(a.min + b * kPanel, mn);
      for (int r = 0; r < R; ++r) {
        const float xs = a.xsum[r * a.nb + b];
        for (int j = 0; j < NV; ++j) acc[r][j] += xs * mn[j];
      }
    }
  }
  for (int r = 0; r < R; ++r) store_panel_row(a.out + r * a.N, acc[r], a.cols);
}

template <class Fmt, typename Scale, int R>
void quant_panel_rows(int64_t rows, const PanelArgs<Scale>& a, const typename Fmt::Code* codes) {
  if constexpr (R > 1) {
    if (rows < R) return quant_panel_rows<Fmt, Scale, R - 1>(rows, a, codes);
  }
  quant_panel_block<Fmt, Scale, R>(a, codes);
}

// M rows of x, of which the first `rows` are computed (the rest of out is zeros), K inputs,
// N outputs in P panels, nb blocks along K.
struct MatmulShape {
  int64_t M, K, N, P, nb, rows;
};

// tile[k, :] = W[k, panel columns] in float32 for every k: one panel's weights, K x 48.
template <class Fmt, typename Scale>
void dequantize_panel(const typename Fmt::Code* c, const Scale* scale, const Scale* min, int64_t K,
                      int64_t bs, float* tile) {
  constexpr int S = Fmt::kStep;
  for (int64_t k0 = 0; k0 < K; k0 += bs) {
    v16 sc[NV], mn[NV] = {};
    if (scale != nullptr) load_scales(scale + k0 / bs * kPanel, sc);
    if (min != nullptr) load_scales(min + k0 / bs * kPanel, mn);
    for (int64_t k = k0; k < k0 + bs; k += S, c += kPanel) {
      v16 w[S][NV];
      stream_step<Fmt>(c, w);
      for (int s = 0; s < S; ++s)
        for (int j = 0; j < NV; ++j)
          store(tile + (k + s) * kPanel + j * kLanes, scale != nullptr ? w[s][j] * sc[j] + mn[j] : w[s][j]);
    }
  }
}

// Row counts from which a unit first turns its panel into a float32 tile (L2-resident,
// K x 48 floats) and runs kTileBlockRows-row register blocks over it: the codes are
// converted once per 64 rows instead of once per kMaxRows.
constexpr int64_t kTileRows = 8;
// Below kTileRows, consecutive panels go to one work unit: at least kUnitsPerThread units
// per thread and at most about kUnitBytes of weights per unit, so each unit is one long
// sequential read (threads taking alternate panels kept a wide LM head well below the read
// bandwidth; benchmarks/README.md) and the last units still balance the threads.
constexpr int64_t kUnitsPerThread = 8;
constexpr int64_t kUnitBytes = 1 << 20;

// x [M, K] @ W [K, N] -> out [M, N] with W's panels as described at the top of the file.
template <class Fmt, typename Scale>
void quant_matmul(ffi::ThreadPool& pool, const MatmulShape& d, const float* x,
                  const typename Fmt::Code* codes, const Scale* scale, const Scale* min, float* out) {
  const int64_t bs = d.K / d.nb;
  // Only the first d.rows rows are computed; the choice between the two paths below stays
  // with d.M (for int8 and q4 a lone row in the last register block also sums in its own
  // order; bfloat16 sums in one order throughout, see kOneOrder).
  const int64_t M = d.rows;
  std::fill(out + M * d.N, out + d.M * d.N, 0.0f);
  if (M == 0) return;
  std::vector<float> xsum;
  if (min != nullptr && d.M < kTileRows) {  // per-block row sums of x, for the min term
    xsum.assign(M * d.nb, 0.0f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < d.K; ++k) xsum[m * d.nb + k / bs] += x[m * d.K + k];
  }
  const float* xs = xsum.empty() ? nullptr : xsum.data();
  const int64_t panel_codes = d.K * kPanel / (Fmt::kStep == 2 ? 2 : 1);
  const int64_t row_units = (M + kRowsPerUnit - 1) / kRowsPerUnit;
  const auto unit = [=](int64_t u) {
    const int64_t p = u / row_units, m0 = (u % row_units) * kRowsPerUnit;
    const int64_t m1 = std::min(M, m0 + kRowsPerUnit);
    const int64_t cols = std::min<int64_t>(kPanel, d.N - p * kPanel);
    const Scale* ps = scale ? scale + p * d.nb * kPanel : nullptr;
    const Scale* pm = min ? min + p * d.nb * kPanel : nullptr;
    if (d.M >= kTileRows) {
      thread_local std::vector<float> tile;
      tile.resize(d.K * kPanel);
      dequantize_panel<Fmt, Scale>(codes + p * panel_codes, ps, pm, d.K, bs, tile.data());
      for (int64_t m = m0; m < m1; m += kTileBlockRows) {
        const PanelArgs<float> a{x + m * d.K, d.K, d.K, 1, nullptr, nullptr, nullptr,
                                 out + m * d.N + p * kPanel, d.N, cols};
        quant_panel_rows<F32Codes, float, kTileBlockRows>(
            std::min<int64_t>(kTileBlockRows, m1 - m), a, tile.data());
      }
      return;
    }
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const PanelArgs<Scale> a{x + m * d.K, d.K, bs, d.nb, ps, pm, xs ? xs + m * d.nb : nullptr,
                               out + m * d.N + p * kPanel, d.N, cols};
      quant_panel_rows<Fmt, Scale, kMaxRows>(std::min<int64_t>(kMaxRows, m1 - m), a,
                                              codes + p * panel_codes);
    }
  };
  if (d.M >= kTileRows) return parallel_units(pool, d.P * row_units, unit);
  const int64_t panel_bytes = panel_codes * sizeof(typename Fmt::Code) +
                              (scale ? 1 + (min != nullptr) : 0) * d.nb * kPanel * sizeof(Scale);
  const int64_t group = std::max<int64_t>(
      1, std::min(d.P / (kUnitsPerThread * pool.num_threads()), kUnitBytes / panel_bytes));
  parallel_units(pool, (d.P + group - 1) / group, [=](int64_t g) {
    for (int64_t p = g * group; p < std::min(d.P, (g + 1) * group); ++p) unit(p);
  });
}

using Int8Panels = ffi::Buffer<ffi::S8, 3>;
using Q4Panels = ffi::Buffer<ffi::U8, 3>;
using Bf16Panels = ffi::Buffer<ffi::BF16, 3>;

// Checks x [M, K], codes [P, K / step, 48], scale/min [P, nb, 48] (nb dividing K into blocks
// of an even number of rows when step is 2) and out [M, N] with (P - 1) * 48 < N <= P * 48.
ffi::Error check_matmul(const char* name, Matrix2& x, ffi::Span<const int64_t> cd, int step,
                        const ffi::AnyBuffer* scale, const ffi::AnyBuffer* min, Rows& rows,
                        ffi::Result<Matrix2>& out, MatmulShape& d) {
  const auto xd = x.dimensions(), od = out->dimensions();
  d = MatmulShape{xd[0], xd[1], od[1], cd[0], 1, valid_rows(rows, xd[0])};
  bool ok = cd.size() == 3 && cd[1] * step == d.K && cd[2] == kPanel && od[0] == d.M &&
            d.N <= d.P * kPanel && d.N > (d.P - 1) * kPanel;
  if (ok && scale != nullptr) {
    const auto sd = scale->dimensions();
    const auto t = scale->element_type();
    ok = sd.size() == 3 && sd[0] == d.P && sd[2] == kPanel && sd[1] > 0 && d.K % sd[1] == 0 &&
         (d.K / sd[1]) % step == 0 && (t == ffi::DataType::F16 || t == ffi::DataType::F32);
    if (ok) d.nb = sd[1];
    if (ok && min != nullptr) {
      const auto md = min->dimensions();
      ok = min->element_type() == t && md.size() == 3 && md[0] == sd[0] && md[1] == sd[1] &&
           md[2] == sd[2];
    }
  }
  if (!ok)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": expected x [M,K], codes [P,K/step,48], scales "
                                       "f16|f32 [P,K/bs,48], out [M,N], N in ((P-1)*48, P*48]");
  return ffi::Error::Success();
}

template <class Fmt>
void dispatch_scale(ffi::ThreadPool& pool, const MatmulShape& d, const float* x, const void* codes,
                    const ffi::AnyBuffer& scale, const ffi::AnyBuffer* min, float* out) {
  const auto* c = static_cast<const typename Fmt::Code*>(codes);
  if (scale.element_type() == ffi::DataType::F32)
    quant_matmul<Fmt, float>(pool, d, x, c, static_cast<const float*>(scale.untyped_data()),
                             min ? static_cast<const float*>(min->untyped_data()) : nullptr, out);
  else
    quant_matmul<Fmt, _Float16>(pool, d, x, c, static_cast<const _Float16*>(scale.untyped_data()),
                                min ? static_cast<const _Float16*>(min->untyped_data()) : nullptr,
                                out);
}

// The rows the matmul reads: x's own, or with a norm scale [K] x's first d.rows rows
// normalised (common.h, rms_norm_rows) into `normed`. nullptr where the scale's shape is wrong.
const float* matmul_input(ffi::ThreadPool& pool, Matrix2& x, const Scale1* norm, float eps,
                          const MatmulShape& d, std::vector<float>& normed) {
  if (norm == nullptr) return x.typed_data();
  if (norm->dimensions()[0] != d.K) return nullptr;
  normed = rms_norm_rows(pool, x.typed_data(), norm->typed_data(), eps, d.rows, d.K);
  return normed.data();
}

const ffi::Error kBadNorm = ffi::Error::InvalidArgument("matmul_norm: expected scale [K]");

ffi::Error int8_matmul(ffi::ThreadPool& pool, Matrix2& x, Int8Panels& codes, ffi::AnyBuffer& scale,
                       ffi::AnyBuffer* min, Rows& rows, ffi::Result<Matrix2>& out,
                       const Scale1* norm, float eps) {
  MatmulShape d;
  if (auto err = check_matmul(min ? "int8_min_matmul" : "int8_matmul", x, codes.dimensions(), 1,
                              &scale, min, rows, out, d);
      !err.success())
    return err;
  std::vector<float> normed;
  const float* xp = matmul_input(pool, x, norm, eps, d, normed);
  if (xp == nullptr) return kBadNorm;
  dispatch_scale<Int8Codes>(pool, d, xp, codes.typed_data(), scale, min, out->typed_data());
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, Matrix2 x, Int8Panels codes,
                      ffi::AnyBuffer scale, Rows rows, ffi::Result<Matrix2> out) {
  return int8_matmul(pool, x, codes, scale, nullptr, rows, out, nullptr, 0.0f);
}

ffi::Error Int8MinMatmul(ffi::ThreadPool pool, Matrix2 x, Int8Panels codes, ffi::AnyBuffer scale,
                         ffi::AnyBuffer min, Rows rows, ffi::Result<Matrix2> out) {
  return int8_matmul(pool, x, codes, scale, &min, rows, out, nullptr, 0.0f);
}

// RMSNorm of x's rows (scale [K], eps), then Int8Matmul or, with min_term, Int8MinMatmul
// (min is then read; without it, it is ignored).
ffi::Error Int8MatmulNorm(ffi::ThreadPool pool, Matrix2 x, Scale1 norm, Int8Panels codes,
                          ffi::AnyBuffer scale, ffi::AnyBuffer min, Rows rows, float eps,
                          bool min_term, ffi::Result<Matrix2> out) {
  return int8_matmul(pool, x, codes, scale, min_term ? &min : nullptr, rows, out, &norm, eps);
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, Matrix2 x, Bf16Panels codes, Rows rows,
                      ffi::Result<Matrix2> out) {
  MatmulShape d;
  if (auto err = check_matmul("bf16_matmul", x, codes.dimensions(), 1, nullptr, nullptr, rows,
                              out, d);
      !err.success())
    return err;
  quant_matmul<Bf16Codes, float>(pool, d, x.typed_data(),
                                 reinterpret_cast<const uint16_t*>(codes.typed_data()), nullptr,
                                 nullptr, out->typed_data());
  return ffi::Error::Success();
}

// --- q4 weights x int8 activations (AVX512-VNNI, or AVX2) ---
// JaxinferQ4Matmul with int8_activations: x @ W for q4 W with x rounded to int8 per row and weight block (the
// scheme of llama.cpp's Q8_1): d[m, b] = max_k |x[m, k]| * float32(1 / 127),
// q[m, k] = round(x[m, k] * (1 / d)) (ties to even; q = 0 where d = 0), then
//   out[m, n] = sum_b d[m, b] * (scale[b, n] * sum_{k in b} q[m, k] codes[k, n]
//                                + min[b, n] * sum_{k in b} q[m, k]),
// which is (d * q) @ W up to float32 summation order. The integer sums run on AVX512-VNNI's
// VPDPBUSD (unsigned codes times signed q, four products a lane), or with AVX2 on VPMADDUBSW
// (two products into an int16 lane, summed over up to 8 groups of 4 rows: at most
// 16 * 15 * 127 = 30480, no overflow) and one VPMADDWD per 32 rows into int32.
// Codes are turned into bytes in registers, 4 rows a 32-bit lane in the order
// (4g, 4g + 2, 4g + 1, 4g + 3), the order q is stored in:
// - AVX512-VBMI: one 64-byte load at row pair 2g holds, for 16 columns, rows 4g, 4g + 1 (pair
//   2g) and, 48 bytes on, rows 4g + 2, 4g + 3; a byte permute puts each column's two pairs in
//   one lane and the nibbles are split in place;
// - AVX2: the 8 bytes of pairs 2g and 2g + 1 are interleaved, widened to a 32-bit lane per
//   column and their nibbles split with a shift and two masks.
// Either way a group of 4 rows of a 48-column panel is 192 bytes. From kTileRows rows a unit
// first writes its panel's bytes as a K x 48 tile, as the float path does.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define JAXINFER_Q4_X8 1
#define JAXINFER_Q4_X8_VNNI 1
using X8Vec = __m512i;
inline X8Vec x8_load(const void* p) { return _mm512_loadu_si512(p); }
inline void x8_store(void* p, X8Vec v) { _mm512_storeu_si512(p, v); }

// q4 bytes of one group of 4 rows for the 16 columns of vector j: p points at row pair 2g.
inline X8Vec unpack_q4_group(const uint8_t* p, int j) {
  static const __m512i pick = [] {
    alignas(64) uint8_t idx[64];
    for (int c = 0; c < 16; ++c) {
      idx[4 * c] = idx[4 * c + 2] = uint8_t(c);
      idx[4 * c + 1] = idx[4 * c + 3] = uint8_t(48 + c);
    }
    return _mm512_load_si512(idx);
  }();
  const __m512i both = _mm512_permutexvar_epi8(pick, _mm512_loadu_si512(p + 16 * j));
  // Bytes 0, 1 keep their low nibble, bytes 2, 3 take their high one.
  const __m512i split = _mm512_ternarylogic_epi32(_mm512_set1_epi32(int32_t(0xFFFF0000u)),
                                                  _mm512_srli_epi32(both, 4), both, 0xCA);
  return _mm512_and_si512(split, _mm512_set1_epi8(15));
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// (AVX-512 without VNNI/VBMI has no path: its 16-lane float vectors do not fit this one.)
#define JAXINFER_Q4_X8 1
using X8Vec = __m256i;
inline X8Vec x8_load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline void x8_store(void* p, X8Vec v) { _mm256_storeu_si256((__m256i*)p, v); }

// q4 bytes of one group of 4 rows for the 8 columns of vector j: p points at row pair 2g.
inline X8Vec unpack_q4_group(const uint8_t* p, int j) {
  const __m128i pairs = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(p + 8 * j)),
                                          _mm_loadl_epi64((const __m128i*)(p + kPanel + 8 * j)));
  const __m256i v = _mm256_cvtepu16_epi32(pairs);  // lane: pair 2g's byte | pair 2g + 1's << 8
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0x0F0F)),
                         _mm256_and_si256(_mm256_slli_epi32(v, 12), _mm256_set1_epi32(0x0F0F0000)));
}
#endif

#if defined(JAXINFER_Q4_X8)
constexpr bool kHasQ4X8 = true;
constexpr int kX8Vecs = kPanel * 4 / int(sizeof(X8Vec));  // vectors per group of 4 rows

// Reads a group's weight vectors straight from the q4 codes (few rows) ...
struct Q4Bytes {
  const uint8_t* c;
  X8Vec load(int64_t g, int j) const { return unpack_q4_group(c + 2 * g * kPanel, j); }
};
// ... or from a tile of them made by `unpack_q4_panel`.
struct TileBytes {
  const uint8_t* t;  // [K / 4, kX8Vecs, sizeof(X8Vec)]
  X8Vec load(int64_t g, int j) const { return x8_load(t + (kX8Vecs * g + j) * sizeof(X8Vec)); }
};

void unpack_q4_panel(const uint8_t* c, int64_t K, uint8_t* tile) {
  for (int64_t g = 0; g < K / 4; ++g)
    for (int j = 0; j < kX8Vecs; ++j)
      x8_store(tile + (kX8Vecs * g + j) * sizeof(X8Vec), unpack_q4_group(c + 2 * g * kPanel, j));
}

// Stores 16 rounded values of one row in the order of `unpack_q4_group`'s lanes.
inline void store_x8_group_order(const int32_t qi[16], int8_t* q) {
  static constexpr int kOrder[4] = {0, 2, 1, 3};
  for (int i = 0; i < 16; ++i) q[i] = int8_t(qi[i / 4 * 4 + kOrder[i % 4]]);
}

// x rows [m0, m1) to q (int8 [M, K], each group of 4 in the order 0, 2, 1, 3), d and
// qsum = d * sum q ([M, nb]); bs is a multiple of 16.
void quantize_x8(const float* x, int64_t K, int64_t bs, int64_t m0, int64_t m1, int8_t* q,
                 float* d, float* qsum) {
  const int64_t nb = K / bs;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * bs;
      v16 amax = {};
      for (int64_t k = 0; k < bs; k += kLanes) {
        const v16 a = load(xb + k), na = -a;
        amax = amax > a ? amax : a;
        amax = amax > na ? amax : na;
      }
      float top = amax[0];
      for (int i = 1; i < kLanes; ++i) top = std::max(top, amax[i]);
      const float dm = top * (1.0f / 127.0f);  // as XLA computes it
      const v16 inv = splat(dm != 0.0f ? 1.0f / dm : 0.0f);
      int64_t sum = 0;
      for (int64_t k = 0; k < bs; k += 16) {
        alignas(64) int32_t qi[16];
        for (int h = 0; h < 16; h += kLanes) {
          const v16 y = load(xb + k + h) * inv;
#if defined(__AVX512F__)
          _mm512_store_si512(qi + h, _mm512_cvtps_epi32((__m512)y));  // ties to even
#else
          _mm256_store_si256((__m256i*)(qi + h), _mm256_cvtps_epi32((__m256)y));
#endif
        }
        for (int i = 0; i < 16; ++i) sum += qi[i];
        store_x8_group_order(qi, q + m * K + b * bs + k);
      }
      d[m * nb + b] = dm;
      qsum[m * nb + b] = dm * float(sum);
    }
}

struct X8Args {
  const int8_t* q;  // row m0's
  const float* d;
  const float* qsum;
  int64_t K, bs, nb;

  // The quantized x of row r, group g (4 inputs), as one int32 to broadcast.
  int32_t four(int r, int64_t g) const {
    int32_t v;
    std::memcpy(&v, q + r * K + 4 * g, 4);
    return v;
  }
};

// out[0:R, 0:cols] for one panel over R rows of quantized x.
template <class Src, typename Scale, int R>
void x8_panel_block(const X8Args& x, const Src& src, const Scale* scale, const Scale* min,
                    float* out, int64_t N, int64_t cols) {
  v16 acc[R][NV] = {};
#if defined(JAXINFER_Q4_X8_VNNI)
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i dot[R][3];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 3; ++j) dot[r][j] = _mm512_setzero_si512();
    for (int64_t g = b * x.bs / 4; g < (b + 1) * x.bs / 4; ++g) {
      __m512i w[3];
      for (int j = 0; j < 3; ++j) w[j] = src.load(g, j);
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_set1_epi32(x.four(r, g));
        for (int j = 0; j < 3; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], xr);
      }
    }
    v16 sc[NV], mn[NV];
    load_scales(scale + b * kPanel, sc);
    load_scales(min + b * kPanel, mn);
    for (int r = 0; r < R; ++r) {
      const __m512 dr = _mm512_set1_ps(x.d[r * x.nb + b]);
      const __m512 sr = _mm512_set1_ps(x.qsum[r * x.nb + b]);
      for (int j = 0; j < 3; ++j) {
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]),
                                         _mm512_mul_ps(dr, (__m512)sc[j]), (__m512)acc[r][j]);
        acc[r][j] = (v16)_mm512_fmadd_ps(sr, (__m512)mn[j], a);
      }
    }
  }
#else
  // AVX2: the panel's 6 vectors in two halves of 3 (R x 3 int16 sums in registers), each over
  // the whole K; the float sums `acc` are updated once per 32 rows.
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    const int j0 = 3 * half;
    for (int64_t b = 0; b < x.nb; ++b) {
      v16 sc[NV], mn[NV];
      load_scales(scale + b * kPanel, sc);
      load_scales(min + b * kPanel, mn);
      const int64_t g_end = (b + 1) * x.bs / 4;
      for (int64_t g0 = b * x.bs / 4; g0 < g_end; g0 += 8) {  // int16 sums over 32 rows at most
        __m256i dot[R][3];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 3; ++j) dot[r][j] = _mm256_setzero_si256();
        for (int64_t g = g0; g < std::min(g_end, g0 + 8); ++g) {
          __m256i w[3];
          for (int j = 0; j < 3; ++j) w[j] = src.load(g, j0 + j);
          for (int r = 0; r < R; ++r) {
            const __m256i xr = _mm256_set1_epi32(x.four(r, g));
            for (int j = 0; j < 3; ++j)
              dot[r][j] = _mm256_add_epi16(dot[r][j], _mm256_maddubs_epi16(w[j], xr));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256 dr = _mm256_set1_ps(x.d[r * x.nb + b]);
          for (int j = j0; j < j0 + 3; ++j) {
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r][j - j0], ones));
            acc[r][j] = (v16)_mm256_fmadd_ps(s, _mm256_mul_ps(dr, (__m256)sc[j]), (__m256)acc[r][j]);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 sr = _mm256_set1_ps(x.qsum[r * x.nb + b]);
        for (int j = j0; j < j0 + 3; ++j)
          acc[r][j] = (v16)_mm256_fmadd_ps(sr, (__m256)mn[j], (__m256)acc[r][j]);
      }
    }
  }
#endif
  for (int r = 0; r < R; ++r) store_panel_row(out + r * N, acc[r], cols);
}

template <class Src, typename Scale, int R>
void x8_panel_rows(int64_t rows, const X8Args& x, const Src& src, const Scale* scale,
                   const Scale* min, float* out, int64_t N, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return x8_panel_rows<Src, Scale, R - 1>(rows, x, src, scale, min, out, N, cols);
  }
  x8_panel_block<Src, Scale, R>(x, src, scale, min, out, N, cols);
}

constexpr int kX8Rows = 4;  // rows per register block: 4 x 3 integer sums (of 32 or 16 vectors)
constexpr int64_t kX8QuantRows = 16;  // rows of x per quantization unit

template <typename Scale>
void q4_x8_matmul(ffi::ThreadPool& pool, const MatmulShape& d, const float* x,
                  const uint8_t* codes, const Scale* scale, const Scale* min, float* out) {
  const int64_t bs = d.K / d.nb, M = d.rows;
  std::fill(out + M * d.N, out + d.M * d.N, 0.0f);
  if (M == 0) return;
  std::vector<int8_t> q(M * d.K);
  std::vector<float> xd(M * d.nb), qsum(M * d.nb);
  parallel_units(pool, (M + kX8QuantRows - 1) / kX8QuantRows, [&](int64_t u) {
    quantize_x8(x, d.K, bs, u * kX8QuantRows, std::min(M, (u + 1) * kX8QuantRows), q.data(),
                xd.data(), qsum.data());
  });
  const int64_t panel_codes = d.K * kPanel / 2;
  const int64_t row_units = (M + kRowsPerUnit - 1) / kRowsPerUnit;
  const auto rows_of = [&](int64_t p, int64_t m0, int64_t m1, const auto& src) {
    const int64_t cols = std::min<int64_t>(kPanel, d.N - p * kPanel);
    for (int64_t m = m0; m < m1; m += kX8Rows) {
      const X8Args a{q.data() + m * d.K, xd.data() + m * d.nb, qsum.data() + m * d.nb, d.K, bs,
                     d.nb};
      x8_panel_rows<std::decay_t<decltype(src)>, Scale, kX8Rows>(
          std::min<int64_t>(kX8Rows, m1 - m), a, src, scale + p * d.nb * kPanel,
          min + p * d.nb * kPanel, out + m * d.N + p * kPanel, d.N, cols);
    }
  };
  if (d.M >= kTileRows) {
    return parallel_units(pool, d.P * row_units, [&](int64_t u) {
      const int64_t p = u / row_units, m0 = (u % row_units) * kRowsPerUnit;
      thread_local std::vector<uint8_t> tile;
      tile.resize(d.K * kPanel);
      unpack_q4_panel(codes + p * panel_codes, d.K, tile.data());
      rows_of(p, m0, std::min(M, m0 + kRowsPerUnit), TileBytes{tile.data()});
    });
  }
  const int64_t panel_bytes = panel_codes + 2 * d.nb * kPanel * sizeof(Scale);
  const int64_t group = std::max<int64_t>(
      1, std::min(d.P / (kUnitsPerThread * pool.num_threads()), kUnitBytes / panel_bytes));
  parallel_units(pool, (d.P + group - 1) / group, [&](int64_t g) {
    for (int64_t p = g * group; p < std::min(d.P, (g + 1) * group); ++p)
      rows_of(p, 0, M, Q4Bytes{codes + p * panel_codes});
  });
}
#else
constexpr bool kHasQ4X8 = false;
#endif  // JAXINFER_Q4_X8

// int8_activations: the path above (an error where it is not built), else float32 x.
ffi::Error q4_matmul(ffi::ThreadPool& pool, Matrix2& x, Q4Panels& codes, ffi::AnyBuffer& scale,
                     ffi::AnyBuffer& min, Rows& rows, ffi::Result<Matrix2>& out,
                     bool int8_activations, const Scale1* norm, float eps) {
  MatmulShape d;
  if (auto err = check_matmul("q4_matmul", x, codes.dimensions(), 2, &scale, &min, rows, out,
                              d);
      !err.success())
    return err;
  if (int8_activations && !kHasQ4X8)
    return ffi::Error::InvalidArgument("q4_matmul: int8 activations need AVX512-VNNI/BW/VBMI or AVX2");
  if (int8_activations && (d.K / d.nb) % 16 != 0)
    return ffi::Error::InvalidArgument("q4_matmul: int8 activations need a block size that 16 divides");
  std::vector<float> normed;
  const float* xp = matmul_input(pool, x, norm, eps, d, normed);
  if (xp == nullptr) return kBadNorm;
  if (!int8_activations) {
    dispatch_scale<Q4Codes>(pool, d, xp, codes.typed_data(), scale, &min, out->typed_data());
    return ffi::Error::Success();
  }
#if defined(JAXINFER_Q4_X8)
  if (scale.element_type() == ffi::DataType::F32)
    q4_x8_matmul<float>(pool, d, xp, codes.typed_data(),
                        static_cast<const float*>(scale.untyped_data()),
                        static_cast<const float*>(min.untyped_data()), out->typed_data());
  else
    q4_x8_matmul<_Float16>(pool, d, xp, codes.typed_data(),
                           static_cast<const _Float16*>(scale.untyped_data()),
                           static_cast<const _Float16*>(min.untyped_data()), out->typed_data());
#endif
  return ffi::Error::Success();
}

ffi::Error Q4Matmul(ffi::ThreadPool pool, Matrix2 x, Q4Panels codes, ffi::AnyBuffer scale,
                    ffi::AnyBuffer min, Rows rows, ffi::Result<Matrix2> out,
                    bool int8_activations) {
  return q4_matmul(pool, x, codes, scale, min, rows, out, int8_activations, nullptr, 0.0f);
}

// RMSNorm of x's rows (norm [K], eps), then Q4Matmul.
ffi::Error Q4MatmulNorm(ffi::ThreadPool pool, Matrix2 x, Scale1 norm, Q4Panels codes,
                        ffi::AnyBuffer scale, ffi::AnyBuffer min, Rows rows, float eps,
                        bool int8_activations, ffi::Result<Matrix2> out) {
  return q4_matmul(pool, x, codes, scale, min, rows, out, int8_activations, &norm, eps);
}

// The norm matmuls' binding (Q4MatmulNorm, Int8MatmulNorm): x, the norm scale [K], the
// codes, scale, min and rows operands, then the attributes eps and the bool `flag`.
template <typename Panels>
auto bind_norm_matmul(const char* flag) {
  return bind_with_pool<Matrix2, Scale1, Panels, ffi::AnyBuffer, ffi::AnyBuffer, Rows>()
      .template Attr<float>("eps")
      .template Attr<bool>(flag)
      .template Ret<Matrix2>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8Matmul, Int8Matmul,
                              (bind_with_pool<Matrix2, Int8Panels, ffi::AnyBuffer, Rows>()
                                   .Ret<Matrix2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxinferInt8MinMatmul, Int8MinMatmul,
    (bind_with_pool<Matrix2, Int8Panels, ffi::AnyBuffer, ffi::AnyBuffer, Rows>().Ret<Matrix2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ4Matmul, Q4Matmul,
                              (bind_with_pool<Matrix2, Q4Panels, ffi::AnyBuffer, ffi::AnyBuffer, Rows>()
                                   .Ret<Matrix2>()
                                   .Attr<bool>("int8_activations")));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ4MatmulNorm, Q4MatmulNorm,
                              bind_norm_matmul<Q4Panels>("int8_activations"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8MatmulNorm, Int8MatmulNorm,
                              bind_norm_matmul<Int8Panels>("min_term"));

extern "C" int jaxinfer_has_q4_x8() { return kHasQ4X8 ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferBf16Matmul, Bf16Matmul,
                              (bind_with_pool<Matrix2, Bf16Panels, Rows>().Ret<Matrix2>()));

// --- The prefetch distance, measured ---
// Batch-1 q4 decode (float32 activations, float16 scales and mins, blocks of 32) over a
// 64 MiB weight, more than a last-level cache holds, in contiguous runs of panels over
// `threads` threads, as quant_matmul splits a decode step's matmul; each candidate distance
// timed 5 times, interleaved with the others after one warm-up pass, best of 5. Returns the
// fastest distance in bytes, or 0 (off) unless it beats no prefetch by 3% or more.
extern "C" long long jaxinfer_measure_prefetch(int threads) {
  constexpr int64_t K = 4096, kBlock = 32, kCandidates[] = {0, 1024, 2048, 4096};
  constexpr int64_t panel_codes = K / 2 * kPanel, nb = K / kBlock;
  const int64_t P = (int64_t{64} << 20) / panel_codes;
  const int64_t T = std::max(1, threads);
  std::vector<uint8_t> codes(P * panel_codes, 0x5a);
  std::vector<_Float16> scale(P * nb * kPanel, _Float16(0.5f)), min(P * nb * kPanel, _Float16(-1.0f));
  std::vector<float> x(K, 0.01f), xsum(nb, 0.01f * kBlock), out(P * kPanel);
  const auto pass = [&](int64_t t) {
    for (int64_t p = P * t / T; p < P * (t + 1) / T; ++p) {
      const PanelArgs<_Float16> a{x.data(), K, kBlock, nb, scale.data() + p * nb * kPanel,
                                  min.data() + p * nb * kPanel, xsum.data(),
                                  out.data() + p * kPanel, P * kPanel, kPanel};
      quant_panel_block<Q4Codes, _Float16, 1>(a, codes.data() + p * panel_codes);
    }
  };
  double best[std::size(kCandidates)];
  std::fill(std::begin(best), std::end(best), 1e30);
  for (int rep = 0; rep < 6; ++rep)
    for (size_t i = 0; i < std::size(kCandidates); ++i) {
      prefetch_distance = kCandidates[i];
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> helpers;
      for (int64_t t = 1; t < T; ++t) helpers.emplace_back(pass, t);
      pass(0);
      for (auto& h : helpers) h.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) best[i] = std::min(best[i], s);  // rep 0 warms the pages and caches
    }
  size_t fastest = 0;
  for (size_t i = 1; i < std::size(kCandidates); ++i)
    if (best[i] < best[fastest]) fastest = i;
  prefetch_distance = 0;
  return best[fastest] <= best[0] * 0.97 ? kCandidates[fastest] : 0;
}

extern "C" void jaxinfer_set_prefetch(long long bytes) {
  prefetch_distance = std::max<long long>(0, bytes);
}
