// CPU kernels for XLA:CPU, as XLA FFI custom calls (jaxinfer.kernels.cpu):
//   JaxinferRaggedPagedAttention  a step's ragged segments of query tokens over a paged cache
//   JaxinferRaggedPagedAttentionInt8  the same over an int8 paged cache (codes and scales)
//   JaxinferPackedMatmul     x @ W with W pre-packed into column panels
//   JaxinferArgmaxFirst      each row's first maximum (greedy sampling)
//   JaxinferReadSum          a plain streaming read of a vector (the bench's bandwidth probe)
// FFI API: xla/ffi/api/ffi.h as shipped in jaxlib (jax.ffi.include_dir()). What this
// file shares with quant_kernels.cc (vectors, exp, the thread-pool split) is in common.h.
//
// Each kernel splits its work into units shared by the calling thread and tasks it
// schedules on XLA's intra-op thread pool (parallel_units, common.h). The ragged kernel is
// described where it starts, below.
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

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

// Register blocking, chosen by the instruction set the build targets (kLanes, common.h):
// with AVX-512 (32 registers of 16 floats) a matmul register block is 8 rows x 3 vectors
// (24 accumulators); with AVX2 (16 registers of 8 floats) 4 rows x 3 vectors (12
// accumulators). Either way the block plus the 3 weight vectors and a broadcast fit the
// register file, so nothing spills. kPanel (weight panel width) = 3 vectors; Python reads
// it (jaxinfer_panel_width).
constexpr int kRowBlock = kLanes == 16 ? 8 : 4;
constexpr int kPanelVectors = 3;
constexpr int kPanel = kLanes * kPanelVectors;

// a * b + c rounded once, as an explicit instruction: the compiler's own contraction of
// `c + a * b` may differ between two instantiations of one loop, and so change the bits.
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__) && defined(__AVX__)
  return _mm256_fmadd_ps(a, b, c);
#else
  v16 r;
  for (int j = 0; j < kLanes; ++j) r[j] = __builtin_fmaf(a[j], b[j], c[j]);
  return r;
#endif
}

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

// Horizontal max and sum of the lanes of x.
#if defined(__AVX512F__)
inline float reduce_max(v16 x) { return _mm512_reduce_max_ps(x); }
inline float reduce_add(v16 x) { return _mm512_reduce_add_ps(x); }
#else
inline float reduce_max(v16 x) {
  float m = x[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, x[j]);
  return m;
}

inline float reduce_add(v16 x) {
  float total = 0.0f;
  for (int j = 0; j < kLanes; ++j) total += x[j];
  return total;
}
#endif

// Lane indices 0 .. kLanes - 1.
alignas(64) constexpr int32_t kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline vi16 load_i32(const int32_t* p) {
  vi16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

// --- Flash-style attention blocks (the ragged kernel's) ---
// Per unit of query rows, the unit's queries go over the key blocks they can see with a
// running max, normalizer and output per query row
// (online softmax: Milakov and Gimelshein 2018, arXiv:1805.02867; Dao et al. 2022,
// "FlashAttention", arXiv:2205.14135, Algorithm 1), so scores never exceed one
// [rows, kKeyBlock] block and key blocks no query of the unit sees are never read.
// Both products are register-blocked (kAttnRows query rows x 4 vectors of accumulators):
//   scores [rows, kKeyBlock] = q [rows, H] k [H, kKeyBlock]
//   out    [rows, H]        += p [rows, kKeyBlock] v [kKeyBlock, H]
constexpr int kAttnRows = kLanes == 16 ? 6 : 3;
constexpr int kAttnVectors = 4;
constexpr int64_t kKeyBlock = kAttnVectors * kLanes;

// o[r, c:c+NV vectors] = o[r, c:...] * corr[r] + sum_s p[r, s] v[s, c:...] over the n keys of
// the block, for R rows, each product an explicit fused multiply-add (fmadd); v float32
// values or int8 codes (load_codes).
template <int R, int NV, typename Code>
void block_values(const float* __restrict p, const Code* __restrict v, int64_t H, int64_t n,
                  const float* __restrict corr, float* __restrict o, int64_t c) {
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o + r * H + c + j * kLanes) * corr[r];
  for (int64_t s = 0; s < n; ++s) {
    v16 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load_codes(v + s * H + c + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const v16 ps = splat(p[r * kKeyBlock + s]);
      for (int j = 0; j < NV; ++j) acc[r][j] = fmadd(ps, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) store(o + r * H + c + j * kLanes, acc[r][j]);
}

// All H columns: vector blocks, then the columns past the last whole vector one at a time.
// Every product is an explicit fused multiply-add, so every row's bits are the same whatever
// R (left to the compiler, the contraction of o * corr + p * v into one FMA differs between
// row-block sizes).
template <int R, typename Code>
void block_values_all(const float* p, const Code* v, int64_t H, int64_t n, const float* corr,
                      float* o) {
  int64_t c = 0;
  for (; c + kAttnVectors * kLanes <= H; c += kAttnVectors * kLanes)
    block_values<R, kAttnVectors>(p, v, H, n, corr, o, c);
  switch ((H - c) / kLanes) {
    case 1: block_values<R, 1>(p, v, H, n, corr, o, c); break;
    case 2: block_values<R, 2>(p, v, H, n, corr, o, c); break;
    case 3: block_values<R, 3>(p, v, H, n, corr, o, c); break;
    default: break;
  }
  for (c += (H - c) / kLanes * kLanes; c < H; ++c)  // columns past the last whole vector
    for (int r = 0; r < R; ++r) {
      float acc = o[r * H + c] * corr[r];
      for (int64_t s = 0; s < n; ++s)
        acc = __builtin_fmaf(p[r * kKeyBlock + s], static_cast<float>(v[s * H + c]), acc);
      o[r * H + c] = acc;
    }
}

// Runs F<R>(row offset) over `rows` rows in blocks of kAttnRows, the last block smaller.
template <template <int> class F, typename... Args>
void by_row_block(int64_t rows, Args... args) {
  int64_t r = 0;
  for (; r + kAttnRows <= rows; r += kAttnRows) F<kAttnRows>::run(r, args...);
  switch (rows - r) {
    case 1: F<1>::run(r, args...); break;
    case 2: F<2>::run(r, args...); break;
    case 3: F<3>::run(r, args...); break;
    case 4: F<4 < kAttnRows ? 4 : 1>::run(r, args...); break;
    case 5: F<5 < kAttnRows ? 5 : 1>::run(r, args...); break;
    default: break;
  }
}

template <int R>
struct BlockValues {
  template <typename Code>
  static void run(int64_t r, const float* p, const Code* v, int64_t H, int64_t n,
                  const float* corr, float* o) {
    block_values_all<R>(p + r * kKeyBlock, v, H, n, corr + r, o + r * H);
  }
};

// One key block's step of the online softmax for `rows` query rows whose scores against the
// block's keys s0 + [0, kKeyBlock) are in sc (kKeyBlock apart): row r is query head r % G of
// the token at position p = p0 + r / G, which sees keys [max(0, p - window + 1), p] (window 0:
// [0, p]) among the block's first n. Each row's visible scores become exp(score - new max),
// the rest 0; m (running max), l (running normalizer) and corr (the factor the row's output
// accumulator takes before this block's values are added; 1 for a row that sees none of the
// block) are updated. A row's results depend only on its own scores, position and running
// state, never on the other rows.
void online_softmax_block(float* sc, int64_t rows, int64_t G, int64_t p0, int64_t s0, int64_t n,
                             int64_t window, float* m, float* l, float* corr) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = p0 + r / G;
    const int64_t a = std::max<int64_t>(window ? p - window + 1 : 0, s0) - s0;
    const int64_t z = std::min<int64_t>(p + 1, s0 + n) - s0;  // visible [a, z) of the block
    float* row = sc + r * kKeyBlock;
    if (a >= z) {
      std::fill(row, row + kKeyBlock, 0.0f);
      corr[r] = 1.0f;
      continue;
    }
    // Softmax of the row's visible [a, z) against its running max: one pass for the max,
    // one for exp and sum; a partial row (the diagonal block, the window's edge) masked in
    // registers.
    const bool full = a == 0 && z == kKeyBlock;
    const auto keep = [&](int64_t s) {
      const vi16 key = load_i32(kIota) + static_cast<int32_t>(s);
      return (key >= static_cast<int32_t>(a)) & (key < static_cast<int32_t>(z));
    };
    v16 vm = splat(m[r]);
    for (int64_t s = 0; s < kKeyBlock; s += kLanes) {
      const v16 x = full ? load(row + s) : (keep(s) ? load(row + s) : splat(-3.0e38f));
      vm = x > vm ? x : vm;
    }
    const float mx = reduce_max(vm);
    const float c = std::exp(m[r] - mx);  // 0 on the first block a row sees
    v16 sum = {};
    for (int64_t s = 0; s < kKeyBlock; s += kLanes) {
      v16 e = exp_nonpositive(load(row + s) - mx);
      if (!full) e = keep(s) ? e : splat(0.0f);
      store(row + s, e);
      sum += e;
    }
    const float total = reduce_add(sum);
    l[r] = l[r] * c + total;
    m[r] = mx;
    corr[r] = c;
  }
}

using Tensor4 = ffi::Buffer<ffi::F32, 4>;
using Vector1i = ffi::Buffer<ffi::S32, 1>;

using Table2 = ffi::Buffer<ffi::S32, 2>;

// --- Ragged paged attention ---
// One scheduler step's T query tokens, flat, in R segments, over a paged cache that already
// holds the step's own K/V (the caller writes them first):
//   q            f32 [T, K, G, H]   the step's queries, pre-scaled (query head k*G + g reads kv head k)
//   k_pages      f32 [P, K, H, ps]  the key pool of one layer (positions minor)
//   v_pages      f32 [P, K, ps, H]  the value pool
//   block_tables s32 [S, M]         slot s's position p is in page block_tables[s, p / ps], offset p % ps
//   seg_slot, seg_start, seg_len, seg_pos  s32 [R]: segment r is tokens [start, start + len) of
//                                    the step, at positions pos .. pos + len - 1 of slot `slot`
//                                    (len 0: unused, its other fields are not read)
//   window       attribute           0, or W: the query at p sees positions [p - W + 1, p], else [0, p]
//   out          f32 [T, K, G, H]   zeros for tokens no segment covers
// Flash-style (above), with units (segment, kv head, block of up to Tq query tokens),
// the unit's query rows copied out of [T, K, G, H] into contiguous scratch. A key block
// (kKeyBlock positions, aligned to absolute positions) spans several pages. Its keys are read
// in place one vector (kLanes positions) at a time when ps is a multiple of kLanes, so that
// each vector lies in one page; otherwise they are gathered into the contiguous
// [H, kKeyBlock] scratch one page run at a time. Its values are read in place one page run at
// a time, the running-max correction applied with the first run only, so the sums are those
// of one contiguous pass whatever the page size. Only pages holding a position that some
// query of the unit sees are read; a value there must be finite (0 x NaN would reach the
// unit's other queries).
//
// Every output row is a function of its own position, q row and the K/V it sees: the key
// blocks are aligned to absolute positions, blocks before a row's first visible key leave
// its state at exactly zero, blocks and keys past its last add exact zeros, and the
// register-blocked products compute each row alone, the same way in every row-block size
// (the values' scalar column tail by explicit FMAs). So a prompt run whole, in chunks or one
// token at a time gives bitwise identical outputs, whatever the page size
// (tests/kernels/test_ragged_attention.py).
// One-token segments (decode) take the same path: reading keys in place, it ran SmolLM2's
// decode shapes as fast as a decode-only paged kernel did; gathering every key block into
// the copy, as ps = 8 still does with AVX-512, about doubled its time there.
//
// --- Ragged paged attention over an int8 pool (JaxinferRaggedPagedAttentionInt8) ---
// The same operands and function on the dequantized K/V of an int8 pool:
//   k_pages      s8  [P, K, H, ps]  key codes;    key = k_scale[page, k, off] * codes[page, k, :, off]
//   v_pages      s8  [P, K, ps, H]  value codes;  value = v_scale[page, k, off] * codes[page, k, off, :]
//   k_scale, v_scale  f32 [P, K, ps]  one scale per token per kv head (jaxinfer/cache/int8.py)
// (operands q, k_pages, v_pages, block_tables, the four segment vectors, k_scale, v_scale).
// The codes are read as the float values are (in place, or gathered for ps = 8 with
// AVX-512), a quarter of the bytes, and turned into float32 in registers (load_codes). As
// the dense int8 decode kernel did, the scales never touch the H-long products: each score
// is (q . codes) * key scale, the scale applied once per key as the block's scores are
// stored, and each softmax weight takes its key's value scale after the running normalizer
// has summed it, so out = sum_s (p_s * value scale_s) codes_s / l. The block's scales are
// copied, those of its visible run only (zeros elsewhere), so a scale nobody sees is never
// read. The kernel keeps every property above, bitwise invariance included: the scales are
// per key and the same in every unit.
struct RaggedDims {
  int64_t T, K, G, H, P, ps, S, M, R, window;
  int64_t Tq;  // query tokens per unit
};

struct Segments {
  const int32_t *slot, *start, *len, *pos;
};

// One layer's pool as the ragged kernel reads it: Code float (the K/V themselves, no
// scales) or int8_t (codes, with one scale per (page, kv head, offset)).
template <typename Code>
struct PagedKV {
  const Code* k;          // [P, K, H, ps]
  const Code* v;          // [P, K, ps, H]
  const float* k_scale;   // [P, K, ps]; int8 pools only
  const float* v_scale;
  static constexpr bool kScaled = std::is_same_v<Code, int8_t>;
};

template <typename Code>
struct RaggedScratch {
  std::vector<float> q, sc, o, m, l, corr, ones;
  std::vector<Code> kb;   // a gathered key block [H, kKeyBlock]
  std::vector<float> ks, vs;  // a key block's key and value scales [kKeyBlock] (int8 pools)
};

// Where the kAttnVectors vectors of a key block's keys are: the h-th row of vector j (its
// kLanes positions' keys for head dimension h) starts at row[j] + h * stride[j]. For an
// int8 pool, scale holds the block's kKeyBlock key scales (0 where nobody looks).
template <typename Code>
struct KeyVectors {
  const Code* row[kAttnVectors];
  int64_t stride[kAttnVectors];
  const float* scale = nullptr;
};

// A vector of keys nobody sees (stride 0): 64 zero bytes, kLanes zeros of either type.
alignas(64) constexpr float kZeros[16] = {};
template <typename Code>
inline const Code* zero_keys() {
  return reinterpret_cast<const Code*>(kZeros);
}

// sc[r, 0:kKeyBlock] = q[r, :] . k[:, 0:kKeyBlock] for R rows of q (row stride H), with the
// keys' vectors wherever `keys` says: the same products, in the same order, wherever they
// are; int8 codes are converted as they are loaded, and each finished score is multiplied
// by its key's scale.
template <int R, typename Code>
void block_scores_from(const float* __restrict q, int64_t H, const KeyVectors<Code>& keys,
                       float* __restrict sc) {
  v16 acc[R][kAttnVectors] = {};
  const Code* rows[kAttnVectors];
  for (int j = 0; j < kAttnVectors; ++j) rows[j] = keys.row[j];
  for (int64_t h = 0; h < H; ++h) {
    v16 kv[kAttnVectors];
    for (int j = 0; j < kAttnVectors; ++j) {
      kv[j] = load_codes(rows[j]);
      rows[j] += keys.stride[j];
    }
    for (int r = 0; r < R; ++r) {
      const v16 qs = splat(q[r * H + h]);
      for (int j = 0; j < kAttnVectors; ++j) acc[r][j] += qs * kv[j];
    }
  }
  if constexpr (PagedKV<Code>::kScaled)
    for (int j = 0; j < kAttnVectors; ++j) {
      const v16 scale = load(keys.scale + j * kLanes);
      for (int r = 0; r < R; ++r) acc[r][j] *= scale;
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kAttnVectors; ++j) store(sc + r * kKeyBlock + j * kLanes, acc[r][j]);
}

template <int R>
struct BlockScoresFrom {
  template <typename Code>
  static void run(int64_t r, const float* q, int64_t H, const KeyVectors<Code>* keys, float* sc) {
    block_scores_from<R>(q + r * H, H, *keys, sc + r * kKeyBlock);
  }
};

// f(s, n, page, off) for each run of the positions [a, z) that share a page, in order:
// positions s .. s + n - 1 are at offsets off .. off + n - 1 of page `page`.
template <typename F>
inline void page_runs(const int32_t* pages, int64_t ps, int64_t a, int64_t z, F f) {
  for (int64_t s = a; s < z;) {
    const int64_t i = s / ps, off = s - i * ps, n = std::min(z, (i + 1) * ps) - s;
    f(s, n, static_cast<int64_t>(pages[i]), off);
    s += n;
  }
}

// scale[s - s0] for the positions s of [a, z) (a key block from s0) of one kv head's
// scales [P, K, ps], zeros elsewhere in the block's kKeyBlock.
inline void block_scales(const float* scales, const int32_t* pages, int64_t K, int64_t kh,
                         int64_t ps, int64_t s0, int64_t a, int64_t z, float* scale) {
  std::fill(scale, scale + kKeyBlock, 0.0f);
  page_runs(pages, ps, a, z, [&](int64_t s, int64_t n, int64_t page, int64_t off) {
    std::memcpy(scale + (s - s0), scales + (page * K + kh) * ps + off, n * sizeof(float));
  });
}

// One (segment r, kv head, query tokens [i0, i1) of the segment, query heads [g0, g1) of
// the kv head's group) unit. Each row (token, query head) is computed the same whatever
// the unit's other rows are.
template <typename Code>
void ragged_unit(const RaggedDims& d, const Segments& seg, int64_t r, int64_t kh, int64_t i0,
                 int64_t i1, int64_t g0, int64_t g1, const float* q, const PagedKV<Code>& kv,
                 const int32_t* tables, float* out, RaggedScratch<Code>& w) {
  const Code *kp = kv.k, *vp = kv.v;
  const int64_t K = d.K, G = g1 - g0, H = d.H, ps = d.ps, tokens = i1 - i0, rows = tokens * G;
  const int64_t t0 = seg.start[r] + i0, p0 = seg.pos[r] + i0, p_last = p0 + tokens - 1;
  const int32_t* pages = tables + static_cast<int64_t>(seg.slot[r]) * d.M;
  w.q.resize(rows * H);
  for (int64_t i = 0; i < tokens; ++i)
    std::memcpy(w.q.data() + i * G * H, q + (((t0 + i) * K + kh) * d.G + g0) * H,
                G * H * sizeof(float));
  w.kb.resize(H * kKeyBlock);
  w.sc.resize(rows * kKeyBlock);
  w.o.assign(rows * H, 0.0f);
  w.m.assign(rows, -3.0e38f);
  w.l.assign(rows, 0.0f);
  w.corr.resize(rows);
  w.ones.assign(rows, 1.0f);
  w.ks.resize(kKeyBlock);
  w.vs.resize(kKeyBlock);
  Code* kb = w.kb.data();
  float* sc = w.sc.data();
  // With ps a multiple of kLanes, each vector of a key block lies in one page and is read in
  // place; otherwise the block's keys are gathered into kb [H, kKeyBlock], a run at a time.
  const bool in_place = ps % kLanes == 0;
  const int64_t lo = d.window ? std::max<int64_t>(0, p0 - d.window + 1) : 0;  // keys [lo, p_last]
  for (int64_t s0 = lo / kKeyBlock * kKeyBlock; s0 <= p_last; s0 += kKeyBlock) {
    const int64_t a = std::max(lo, s0), z = std::min(p_last + 1, s0 + kKeyBlock);  // read [a, z)
    KeyVectors<Code> keys;
    for (int j = 0; j < kAttnVectors; ++j) {
      const int64_t s = s0 + j * kLanes;
      if (!in_place) {
        keys.row[j] = kb + j * kLanes;
        keys.stride[j] = kKeyBlock;
      } else if (s + kLanes <= a || s >= z) {  // positions nobody sees (maybe in no page)
        keys.row[j] = zero_keys<Code>();
        keys.stride[j] = 0;
      } else {  // in a page that holds a visible position; the others are masked
        keys.row[j] = kp + (pages[s / ps] * K + kh) * H * ps + s % ps;
        keys.stride[j] = ps;
      }
    }
    if (!in_place) {
      if (a > s0 || z < s0 + kKeyBlock)
        for (int64_t h = 0; h < H; ++h) {  // zero the block's keys that nobody sees
          std::fill(kb + h * kKeyBlock, kb + h * kKeyBlock + (a - s0), Code{});
          std::fill(kb + h * kKeyBlock + (z - s0), kb + (h + 1) * kKeyBlock, Code{});
        }
      page_runs(pages, ps, a, z, [&](int64_t s, int64_t n, int64_t page, int64_t off) {
        const Code* src = kp + (page * K + kh) * H * ps + off;
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(kb + h * kKeyBlock + (s - s0), src + h * ps, n * sizeof(Code));
      });
    }
    if constexpr (PagedKV<Code>::kScaled) {
      block_scales(kv.k_scale, pages, K, kh, ps, s0, a, z, w.ks.data());
      block_scales(kv.v_scale, pages, K, kh, ps, s0, a, z, w.vs.data());
      keys.scale = w.ks.data();
    }
    by_row_block<BlockScoresFrom>(rows, static_cast<const float*>(w.q.data()), H,
                                  static_cast<const KeyVectors<Code>*>(&keys), sc);
    online_softmax_block(sc, rows, G, p0, s0, kKeyBlock, d.window, w.m.data(), w.l.data(),
                         w.corr.data());
    if constexpr (PagedKV<Code>::kScaled)  // each weight takes its key's value scale
      for (int64_t row = 0; row < rows; ++row)
        for (int64_t s = 0; s < kKeyBlock; s += kLanes)
          store(sc + row * kKeyBlock + s, load(sc + row * kKeyBlock + s) * load(w.vs.data() + s));
    const float* corr = w.corr.data();
    page_runs(pages, ps, a, z, [&](int64_t s, int64_t n, int64_t page, int64_t off) {
      by_row_block<BlockValues>(rows, static_cast<const float*>(sc + (s - s0)),
                                     vp + ((page * K + kh) * ps + off) * H, H, n, corr,
                                     w.o.data());
      corr = w.ones.data();  // the block's correction is applied once, with its first run
    });
  }
  for (int64_t i = 0; i < tokens; ++i) {
    float* o_out = out + (((t0 + i) * K + kh) * d.G + g0) * H;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = i * G + g;
      const float inv = w.l[row] > 0.0f ? 1.0f / w.l[row] : 0.0f;
      for (int64_t h = 0; h < H; ++h) o_out[g * H + h] = w.o[row * H + h] * inv;
    }
  }
}

std::string ragged_error(const std::string& what) { return "ragged_paged_attention: " + what; }

// Checks the segments against the contract (header), marking owner[t] = the segment that
// covers token t (-1: none). Returns the first violation's message, empty when none.
std::string check_segments(const RaggedDims& d, const Segments& seg, const int32_t* tables,
                           std::vector<int32_t>& owner) {
  using std::to_string;
  owner.assign(d.T, -1);
  for (int64_t r = 0; r < d.R; ++r) {
    const int64_t start = seg.start[r], len = seg.len[r], pos = seg.pos[r], slot = seg.slot[r];
    const std::string name = "segment " + to_string(r);
    if (len == 0) continue;
    if (len < 0 || start < 0 || start + len > d.T)
      return name + "'s tokens [" + to_string(start) + ", " + to_string(start + len) +
             ") are not within [0, T=" + to_string(d.T) + ")";
    for (int64_t t = start; t < start + len; ++t) {
      if (owner[t] >= 0)
        return "segments " + to_string(owner[t]) + " and " + to_string(r) + " overlap at token " +
               to_string(t);
      owner[t] = static_cast<int32_t>(r);
    }
    if (pos < 0) return name + "'s seg_pos " + to_string(pos) + " is negative";
    if (slot < 0 || slot >= d.S)
      return name + "'s slot " + to_string(slot) + " is not within [0, S=" + to_string(d.S) + ")";
    const int64_t last = pos + len - 1, lo = d.window ? std::max<int64_t>(0, pos - d.window + 1) : 0;
    if (last / d.ps >= d.M)
      return name + "'s position " + to_string(last) + " needs block-table column " +
             to_string(last / d.ps) + ", past M=" + to_string(d.M);
    for (int64_t i = lo / d.ps; i <= last / d.ps; ++i) {
      const int64_t page = tables[slot * d.M + i];
      if (page < 0 || page >= d.P)
        return name + " reads block_tables[" + to_string(slot) + ", " + to_string(i) + "] = " +
               to_string(page) + ", not a page in [0, P=" + to_string(d.P) + ")";
    }
  }
  return "";
}

// The step of d over the pool kv (shapes already checked): the segments' checks, zeros for
// tokens no segment covers, then the (query block, kv head, head share) units.
template <typename Code>
ffi::Error ragged_step(ffi::ThreadPool& pool, RaggedDims d, const Segments& seg,
                       const int32_t* tp, const float* qp, const PagedKV<Code>& kv, float* op) {
  std::vector<int32_t> owner;
  const std::string bad = check_segments(d, seg, tp, owner);
  if (!bad.empty()) return ffi::Error::InvalidArgument(ragged_error(bad));
  const int64_t token_size = d.K * d.G * d.H;
  for (int64_t t = 0; t < d.T; ++t)
    if (owner[t] < 0) std::fill(op + t * token_size, op + (t + 1) * token_size, 0.0f);
  // Query blocks of about 96 rows (tokens x G heads): enough rows to reuse each K/V block,
  // few enough that the unit's scores and output stay in L2. The costliest (rows x keys
  // read) first, so the pool's threads end together.
  d.Tq = std::max<int64_t>(1, 96 / d.G);
  struct Block {
    int64_t r, i0, i1, cost;
  };
  std::vector<Block> blocks;
  for (int64_t r = 0; r < d.R; ++r)
    for (int64_t i0 = 0; i0 < seg.len[r]; i0 += d.Tq) {
      const int64_t i1 = std::min<int64_t>(seg.len[r], i0 + d.Tq), p_last = seg.pos[r] + i1 - 1;
      const int64_t lo = d.window ? std::max<int64_t>(0, seg.pos[r] + i0 - d.window + 1) : 0;
      blocks.push_back(Block{r, i0, i1, (i1 - i0) * (p_last + 1 - lo)});
    }
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const Block& x, const Block& y) { return x.cost > y.cost; });
  const Block* bp = blocks.data();
  // Fewer (block, kv head) units than two per thread (decode of a few rows; one kv head in
  // Gemma 3 270M): each unit takes a share of the group's query heads, so every thread
  // streams the K/V too instead of one thread reading them alone.
  const int64_t units = static_cast<int64_t>(blocks.size()) * d.K;
  const int64_t per_unit = std::clamp<int64_t>(units * d.G / (2 * pool.num_threads()), 1, d.G);
  const int64_t parts = (d.G + per_unit - 1) / per_unit;
  parallel_units(pool, units * parts, [=, &d, &seg, &kv](int64_t u) {
    thread_local RaggedScratch<Code> scratch;
    const Block& b = bp[u / parts / d.K];
    const int64_t g0 = (u % parts) * per_unit, g1 = std::min(d.G, g0 + per_unit);
    ragged_unit(d, seg, b.r, u / parts % d.K, b.i0, b.i1, g0, g1, qp, kv, tp, op, scratch);
  });
  return ffi::Error::Success();
}

using Codes4 = ffi::Buffer<ffi::S8, 4>;
using Scales3 = ffi::Buffer<ffi::F32, 3>;

// What both ragged handlers do: check the operands' shapes (those of the scales too, for an
// int8 pool; `expected` is the message when they do not agree) and the window, then run the
// step over the pool k, v (float32 values, or int8 codes with their scales).
template <typename Pages>
ffi::Error ragged_attention(ffi::ThreadPool& pool, Tensor4& q, Pages& k, Pages& v, Table2& tables,
                            Vector1i& seg_slot, Vector1i& seg_start, Vector1i& seg_len,
                            Vector1i& seg_pos, Scales3* k_scale, Scales3* v_scale, int64_t window,
                            ffi::Result<Tensor4>& out, const char* expected) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), td = tables.dimensions();
  const RaggedDims d{qd[0], qd[1], qd[2], qd[3], kd[0], kd[3], td[0], td[1],
                     seg_slot.dimensions()[0], window, 1};
  bool ok = kd[1] == d.K && kd[2] == d.H && vd[0] == d.P && vd[1] == d.K && vd[2] == d.ps &&
            vd[3] == d.H && seg_start.dimensions()[0] == d.R && seg_len.dimensions()[0] == d.R &&
            seg_pos.dimensions()[0] == d.R;
  for (Scales3* scales : {k_scale, v_scale})
    if (scales != nullptr) {
      const auto sd = scales->dimensions();
      ok = ok && sd[0] == d.P && sd[1] == d.K && sd[2] == d.ps;
    }
  if (!ok) return ffi::Error::InvalidArgument(ragged_error(expected));
  if (window < 0) return ffi::Error::InvalidArgument(ragged_error("window must be >= 0"));
  const Segments seg{seg_slot.typed_data(), seg_start.typed_data(), seg_len.typed_data(),
                     seg_pos.typed_data()};
  using Code = std::remove_const_t<std::remove_pointer_t<decltype(k.typed_data())>>;
  const PagedKV<Code> kv{k.typed_data(), v.typed_data(),
                         k_scale != nullptr ? k_scale->typed_data() : nullptr,
                         v_scale != nullptr ? v_scale->typed_data() : nullptr};
  return ragged_step(pool, d, seg, tables.typed_data(), q.typed_data(), kv, out->typed_data());
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, Tensor4 q, Tensor4 k, Tensor4 v,
                                Table2 tables, Vector1i seg_slot, Vector1i seg_start,
                                Vector1i seg_len, Vector1i seg_pos, int64_t window,
                                ffi::Result<Tensor4> out) {
  return ragged_attention(pool, q, k, v, tables, seg_slot, seg_start, seg_len, seg_pos, nullptr,
                          nullptr, window, out,
                          "expected q [T,K,G,H], k_pages [P,K,H,ps], v_pages [P,K,ps,H], "
                          "block_tables [S,M], seg_slot, seg_start, seg_len, seg_pos [R]");
}

ffi::Error RaggedPagedAttentionInt8(ffi::ThreadPool pool, Tensor4 q, Codes4 k, Codes4 v,
                                    Table2 tables, Vector1i seg_slot, Vector1i seg_start,
                                    Vector1i seg_len, Vector1i seg_pos, Scales3 k_scale,
                                    Scales3 v_scale, int64_t window, ffi::Result<Tensor4> out) {
  return ragged_attention(pool, q, k, v, tables, seg_slot, seg_start, seg_len, seg_pos, &k_scale,
                          &v_scale, window, out,
                          "expected q [T,K,G,H], int8 k_pages [P,K,H,ps], int8 v_pages [P,K,ps,H], "
                          "block_tables [S,M], seg_slot, seg_start, seg_len, seg_pos [R], k_scale "
                          "and v_scale [P,K,ps]");
}

// --- Packed matmul ---

constexpr int64_t kRowsPerUnit = 64;

// The weight operand of one panel for 2 input rows (i, i + 1), per panel vector j.
// float32 panels hold one input row per kPanel floats; bfloat16 panels hold two input rows
// interleaved per kPanel uint32 (a pair (W[2i, c], W[2i+1, c]) in each uint32, low half
// first), widened here to float32 by moving each bfloat16 into the high half of a float.
template <typename Stored, int RowsPerStep>
struct PanelFormat {
  using T = Stored;
  static constexpr int kRowsPerStep = RowsPerStep;
};

struct F32Panel : PanelFormat<float, 1> {
  static inline void weights(const float* w, v16 (&b)[kRowsPerStep][kPanelVectors]) {
    for (int j = 0; j < kPanelVectors; ++j) b[0][j] = load(w + j * kLanes);
  }
};

struct Bf16WidenPanel : PanelFormat<uint32_t, 2> {
  static inline void weights(const uint32_t* w, v16 (&b)[kRowsPerStep][kPanelVectors]) {
    for (int j = 0; j < kPanelVectors; ++j) {
      const vu16 pair = load_u32(w + j * kLanes);
      b[0][j] = bit_cast<v16>(pair << 16);
      b[1][j] = bit_cast<v16>(pair & 0xffff0000u);
    }
  }
};

// out[0:R, 0:cols] = x[0:R, :] @ panel over I inputs; x rows I apart, out rows O apart.
// The panel's rows are read once per block, front to back, kPanel columns at a time.
// `prefetch` (the unit's first block, which reads the panel from memory) issues software
// prefetches a few rows ahead: the hardware prefetcher alone left the weight stream
// latency-bound (benchmarks/README.md).
constexpr int kPrefetchSteps = 8;
template <typename Panel, int R>
void panel_block(const float* __restrict x, int64_t I, const typename Panel::T* __restrict panel,
                 float* __restrict out, int64_t O, int64_t cols, bool prefetch) {
  constexpr int S = Panel::kRowsPerStep;
  constexpr int kPanelBytes = kPanel * sizeof(typename Panel::T);
  v16 acc[R][kPanelVectors] = {};
  const int64_t steps = I / S;
  for (int64_t i = 0; i < steps; ++i) {
    if (prefetch)  // the panel comes from memory: ask for the rows kPrefetchSteps ahead
      for (int line = 0; line < kPanelBytes; line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(panel + (i + kPrefetchSteps) * kPanel) + line);
    v16 b[S][kPanelVectors];
    Panel::weights(panel + i * kPanel, b);
    for (int e = 0; e < S; ++e)
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * I + i * S + e];
        for (int j = 0; j < kPanelVectors; ++j) acc[r][j] += xr * b[e][j];
      }
  }
  if (I % S) {  // bfloat16 panels with an odd I: the last pair's second row is zero padding
    v16 b[S][kPanelVectors];
    Panel::weights(panel + steps * kPanel, b);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * I + I - 1];
      for (int j = 0; j < kPanelVectors; ++j) acc[r][j] += xr * b[0][j];
    }
  }
  for (int r = 0; r < R; ++r) store_panel_row(out + r * O, acc[r], cols);
}

template <typename Panel, int R>
void panel_rows(int64_t rows, const float* x, int64_t I, const typename Panel::T* panel, float* out,
                int64_t O, int64_t cols, bool prefetch) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<Panel, R - 1>(rows, x, I, panel, out, O, cols, prefetch);
  }
  panel_block<Panel, R>(x, I, panel, out, O, cols, prefetch);
}

// Bytes of x rows a unit keeps in L2 while the panels pass over them (row-block order: half
// of a 1 MB L2), and what counts as fitting in L3 (half of a 32 MB L3; Zen 4 and recent Xeons
// have at least that). Fixed, not read from the CPU: VMs report the host's cache sizes
// (this one's sysconf says 320 MB of L3, lscpu 32 MB).
constexpr int64_t kRowBlockBytes = 512 << 10;
constexpr int64_t kCachedBytes = 16 << 20;

// Work units for M rows of x (x_row_bytes each) and P panels (weight_bytes in all).
// Panel-major by default: units are (panel, block of up to kRowsPerUnit rows), the row blocks
// of one panel next to each other, so the panel is read from memory once, then from cache.
// That re-reads all of x once per panel, from memory once x outgrows L3 (a batch of long
// prompts: 16,384 rows of 576 floats are 38 MB). There, while the weight fits in L3, units
// are row-block-major instead: (block of about kRowBlockBytes of x rows, panel), every panel
// passing over a block that stays in L2, and each weight panel re-read from L3 per block.
// Prefill B=8 T=2048 (SmolLM2, this 2-core Zen 4): 28.3 / 28.2 s -> 25.9 / 26.7 s.
template <typename Unit>
void parallel_panels(ffi::ThreadPool& pool, int64_t M, int64_t P, int64_t x_row_bytes,
                     int64_t weight_bytes, Unit unit) {
  const int64_t block = std::max<int64_t>(
      kRowsPerUnit, kRowBlockBytes / std::max<int64_t>(x_row_bytes, 1) / kRowBlock * kRowBlock);
  if (M * x_row_bytes > kCachedBytes && weight_bytes <= kCachedBytes) {
    const int64_t row_units = (M + block - 1) / block;
    parallel_units(pool, row_units * P, [=](int64_t u) {
      const int64_t m0 = (u / P) * block;
      unit(u % P, m0, std::min(M, m0 + block));
    });
    return;
  }
  const int64_t row_units = (M + kRowsPerUnit - 1) / kRowsPerUnit;
  parallel_units(pool, P * row_units, [=](int64_t u) {
    const int64_t m0 = (u % row_units) * kRowsPerUnit;
    unit(u / row_units, m0, std::min(M, m0 + kRowsPerUnit));
  });
}

template <typename Panel>
void packed_matmul(ffi::ThreadPool& pool, const float* x, const typename Panel::T* w, float* out,
                   int64_t M, int64_t I, int64_t O, int64_t P, int64_t panel_rows_stored) {
  parallel_panels(pool, M, P, I * sizeof(float), P * panel_rows_stored * kPanel * sizeof(typename Panel::T),
                  [=](int64_t p, int64_t m0, int64_t m1) {
    const int64_t cols = std::min<int64_t>(kPanel, O - p * kPanel);
    const typename Panel::T* panel = w + p * panel_rows_stored * kPanel;
    for (int64_t m = m0; m < m1; m += kRowBlock)
      panel_rows<Panel, kRowBlock>(std::min<int64_t>(kRowBlock, m1 - m), x + m * I, I, panel,
                                   out + m * O + p * kPanel, O, cols, m == m0);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 dot products (AVX512-BF16 VDPBF16PS): x is rounded to bfloat16 pairs, and each
// instruction adds x[2i] W[2i, c] + x[2i+1] W[2i+1, c] to 16 float32 accumulators.
constexpr bool kHasBf16Dot = true;

template <int R>
void dot_block(const uint32_t* __restrict xp, int64_t I2, const uint32_t* __restrict panel,
               float* __restrict out, int64_t O, int64_t cols) {
  v16 acc[R][kPanelVectors] = {};
  for (int64_t i = 0; i < I2; ++i) {
    __m512bh b[kPanelVectors];
    for (int j = 0; j < kPanelVectors; ++j)
      b[j] = (__m512bh)_mm512_loadu_si512(panel + i * kPanel + j * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * I2 + i]));
      for (int j = 0; j < kPanelVectors; ++j)
        acc[r][j] = (v16)_mm512_dpbf16_ps((__m512)acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r) store_panel_row(out + r * O, acc[r], cols);
}

template <int R>
void dot_rows(int64_t rows, const uint32_t* xp, int64_t I2, const uint32_t* panel, float* out,
              int64_t O, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return dot_rows<R - 1>(rows, xp, I2, panel, out, O, cols);
  }
  dot_block<R>(xp, I2, panel, out, O, cols);
}

// Round float32 to bfloat16 (to nearest even; NaN stays NaN).
inline uint32_t to_bf16(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

void bf16_dot_matmul(ffi::ThreadPool& pool, const float* x, const uint32_t* w, float* out,
                     int64_t M, int64_t I, int64_t O, int64_t P) {
  const int64_t I2 = (I + 1) / 2;
  std::vector<uint32_t> xp(M * I2);  // x as bfloat16 pairs, zero past I
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I2; ++i) {
      const uint32_t lo = to_bf16(x[m * I + 2 * i]);
      const uint32_t hi = 2 * i + 1 < I ? to_bf16(x[m * I + 2 * i + 1]) : 0u;
      xp[m * I2 + i] = lo | (hi << 16);
    }
  const uint32_t* xs = xp.data();
  parallel_panels(pool, M, P, I2 * sizeof(uint32_t), P * I2 * kPanel * sizeof(uint32_t),
                  [=](int64_t p, int64_t m0, int64_t m1) {
    const int64_t cols = std::min<int64_t>(kPanel, O - p * kPanel);
    for (int64_t m = m0; m < m1; m += kRowBlock)
      dot_rows<kRowBlock>(std::min<int64_t>(kRowBlock, m1 - m), xs + m * I2, I2,
                          w + p * I2 * kPanel, out + m * O + p * kPanel, O, cols);
  });
}
#else
constexpr bool kHasBf16Dot = false;
#endif

using Panels3 = ffi::Buffer<ffi::F32, 3>;
using Bf16Panels3 = ffi::Buffer<ffi::BF16, 3>;

// valid_rows (common.h), with the other rows of out [M, O] zeroed.
inline int64_t computed_rows(Rows& rows, float* out, int64_t M, int64_t O) {
  const int64_t n = valid_rows(rows, M);
  std::fill(out + n * O, out + M * O, 0.0f);
  return n;
}

ffi::Error check_packed(Matrix2& x, Panels3& packed, ffi::Result<Matrix2>& out) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), od = out->dimensions();
  const int64_t M = xd[0], I = xd[1], P = pd[0], O = od[1];
  if (pd[1] != I || pd[2] != kPanel || od[0] != M || O > P * kPanel || O <= (P - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "packed_matmul: expected x [M,I], packed [ceil(O/panel),I,panel], out [M,O]");
  return ffi::Error::Success();
}

// PackedMatmul of x's valid rows, RMS-normed first (common.h, rms_norm_rows) with scale [I]
// and eps when scale is given: what PackedMatmul and PackedMatmulNorm share.
ffi::Error packed_matmul_rows(ffi::ThreadPool& pool, Matrix2& x, const Scale1* scale, float eps,
                              Panels3& packed, Rows& rows, ffi::Result<Matrix2>& out) {
  if (auto err = check_packed(x, packed, out); !err.success()) return err;
  const int64_t M = x.dimensions()[0], I = x.dimensions()[1], O = out->dimensions()[1];
  if (scale != nullptr && scale->dimensions()[0] != I)
    return ffi::Error::InvalidArgument("packed_matmul_norm: expected scale [I]");
  const int64_t n = computed_rows(rows, out->typed_data(), M, O);
  if (n == 0) return ffi::Error::Success();
  std::vector<float> normed;
  const float* in = x.typed_data();
  if (scale != nullptr) {
    normed = rms_norm_rows(pool, in, scale->typed_data(), eps, n, I);
    in = normed.data();
  }
  packed_matmul<F32Panel>(pool, in, packed.typed_data(), out->typed_data(), n, I, O,
                          packed.dimensions()[0], I);
  return ffi::Error::Success();
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, Matrix2 x, Panels3 packed, Rows rows,
                        ffi::Result<Matrix2> out) {
  return packed_matmul_rows(pool, x, nullptr, 0.0f, packed, rows, out);
}

// RMSNorm of x's rows with scale [I] and eps, then PackedMatmul.
ffi::Error PackedMatmulNorm(ffi::ThreadPool pool, Matrix2 x, Scale1 scale, Panels3 packed,
                            Rows rows, float eps, ffi::Result<Matrix2> out) {
  return packed_matmul_rows(pool, x, &scale, eps, packed, rows, out);
}

// bfloat16 panels [P, ceil(I/2), 2 * kPanel]: element (p, i, 2c + e) = W[2i + e, p*kPanel + c].
// dot = 1 uses VDPBF16PS (x rounded to bfloat16), dot = 0 widens W to float32 (x as is).
ffi::Error PackedMatmulBf16(ffi::ThreadPool pool, Matrix2 x, Bf16Panels3 packed, Rows rows,
                            int32_t dot, ffi::Result<Matrix2> out) {
  const auto xd = x.dimensions(), pd = packed.dimensions(), od = out->dimensions();
  const int64_t M = xd[0], I = xd[1], P = pd[0], O = od[1];
  if (pd[1] != (I + 1) / 2 || pd[2] != 2 * kPanel || od[0] != M || O > P * kPanel ||
      O <= (P - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "packed_matmul: expected x [M,I], bfloat16 packed [ceil(O/panel),ceil(I/2),2*panel], "
        "out [M,O]");
  const auto* w = reinterpret_cast<const uint32_t*>(packed.untyped_data());
  const int64_t n = computed_rows(rows, out->typed_data(), M, O);
  if (dot) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (n > 0) bf16_dot_matmul(pool, x.typed_data(), w, out->typed_data(), n, I, O, P);
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("packed_matmul: this build has no AVX512-BF16 dot product");
#endif
  }
  if (n > 0)
    packed_matmul<Bf16WidenPanel>(pool, x.typed_data(), w, out->typed_data(), n, I, O, P,
                                  (I + 1) / 2);
  return ffi::Error::Success();
}

// --- Memory read probe ---
// Sum of every element of x, read once front to back in chunks split over the pool, with
// 8 vector accumulators per chunk so the adds do not bound the loop: a plain streaming
// read, the bench's second bandwidth probe beside XLA's reductions.
using Vector1 = ffi::Buffer<ffi::F32, 1>;
using Scalar0 = ffi::Buffer<ffi::F32, 0>;

ffi::Error ReadSum(ffi::ThreadPool pool, Vector1 x, ffi::Result<Scalar0> out) {
  const int64_t n = x.dimensions()[0];
  constexpr int64_t kChunk = 1 << 18;  // floats (1 MiB) per work unit
  const int64_t units = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(units);
  const float* xp = x.typed_data();
  double* sums = partial.data();
  parallel_units(pool, units, [=](int64_t u) {
    const int64_t a = u * kChunk, b = std::min(n, a + kChunk);
    v16 acc[8] = {};
    int64_t i = a;
    for (; i + 8 * kLanes <= b; i += 8 * kLanes)
      for (int j = 0; j < 8; ++j) acc[j] += load(xp + i + j * kLanes);
    float total = 0.0f;
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < kLanes; ++l) total += acc[j][l];
    for (; i < b; ++i) total += xp[i];
    sums[u] = total;
  });
  double total = 0.0;
  for (double s : partial) total += s;
  *out->typed_data() = static_cast<float>(total);
  return ffi::Error::Success();
}

// --- Argmax ---
//   x   f32 [B, V]
//   out s32 [B]    the lowest index of row b's maximum (jnp.argmax's result); NaNs are
//                  skipped, and a row of -inf (or all NaN) gives 0
// One pass: each lane keeps its largest value and that value's first index (a later
// element replaces it only when strictly larger); the lanes are then merged, ties going
// to the lower index. Units are (row, chunk of kArgmaxChunk columns), merged in chunk
// order, so the result does not depend on which thread ran which chunk. XLA:CPU ran
// jaxinfer.sampling.argmax_first's max, select and min as three single-threaded passes
// (benchmarks/README.md).
constexpr int64_t kArgmaxChunk = 1 << 16;

struct ArgmaxPart {
  float value;
  int64_t index;
};

// The first maximum of x[a, b): (-inf, a) when nothing there is larger than -inf. Four
// independent (value, index) vectors, so consecutive compares do not wait on each other.
ArgmaxPart argmax_span(const float* x, int64_t a, int64_t b) {
  constexpr int kAcc = 4;
  v16 best[kAcc];
  vi16 at[kAcc];
  for (int j = 0; j < kAcc; ++j) {
    best[j] = splat(-INFINITY);
    at[j] = vi16{} + static_cast<int32_t>(a);
  }
  const vi16 lane = load_i32(kIota);
  int64_t i = a;
  for (; i + kAcc * kLanes <= b; i += kAcc * kLanes)
    for (int j = 0; j < kAcc; ++j) {
      const v16 v = load(x + i + j * kLanes);
      const vi16 gt = v > best[j];
      best[j] = gt ? v : best[j];
      at[j] = gt ? lane + static_cast<int32_t>(i + j * kLanes) : at[j];
    }
  ArgmaxPart part{-INFINITY, a};
  for (int j = 0; j < kAcc; ++j)
    for (int l = 0; l < kLanes; ++l)
      if (best[j][l] > part.value || (best[j][l] == part.value && at[j][l] < part.index))
        part = ArgmaxPart{best[j][l], at[j][l]};
  for (; i < b; ++i)
    if (x[i] > part.value) part = ArgmaxPart{x[i], i};
  return part;
}

ffi::Error ArgmaxFirst(ffi::ThreadPool pool, Matrix2 x, ffi::Result<Vector1i> out) {
  const int64_t B = x.dimensions()[0], V = x.dimensions()[1];
  if (out->dimensions()[0] != B)
    return ffi::Error::InvalidArgument("argmax_first: expected x [B, V] and out [B]");
  if (V >= (int64_t(1) << 31))
    return ffi::Error::InvalidArgument("argmax_first: V must be below 2**31");
  const int64_t chunks = std::max<int64_t>(1, (V + kArgmaxChunk - 1) / kArgmaxChunk);
  std::vector<ArgmaxPart> parts(B * chunks);
  const float* xp = x.typed_data();
  ArgmaxPart* pp = parts.data();
  parallel_units(pool, B * chunks, [=](int64_t u) {
    const int64_t row = u / chunks, c = u % chunks;
    const int64_t a = c * kArgmaxChunk, b = std::min(V, a + kArgmaxChunk);
    pp[u] = argmax_span(xp + row * V, a, b);
  });
  int32_t* op = out->typed_data();
  for (int64_t row = 0; row < B; ++row) {
    ArgmaxPart best{-INFINITY, 0};
    for (int64_t c = 0; c < chunks; ++c)
      if (pp[row * chunks + c].value > best.value) best = pp[row * chunks + c];
    op[row] = static_cast<int32_t>(best.index);
  }
  return ffi::Error::Success();
}

}  // namespace

// --- Plain C entry points (ctypes): the build's blocking, and probes that a fresh process
// runs before the engine relies on an instruction set (a CPU or VM that reports a feature
// it does not run dies there with SIGILL, not in the engine). ---

extern "C" int jaxinfer_panel_width() { return kPanel; }
extern "C" int jaxinfer_row_block() { return kRowBlock; }
extern "C" int jaxinfer_vector_lanes() { return kLanes; }
extern "C" int jaxinfer_has_bf16_dot() { return kHasBf16Dot ? 1 : 0; }

// Runs the float32 paths this build was compiled for (the packed matmul's register block
// and the vector exp) on a small case with a known answer; 1 when all are right.
extern "C" int jaxinfer_self_test() {
  float x[kRowBlock * 2], out[kRowBlock * kPanel], w[2 * kPanel];
  for (int i = 0; i < kRowBlock * 2; ++i) x[i] = static_cast<float>(i + 1);
  for (int i = 0; i < 2 * kPanel; ++i) w[i] = static_cast<float>(i % 5);
  panel_block<F32Panel, kRowBlock>(x, 2, w, out, kPanel, kPanel, false);
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < kPanel; ++c)
      if (out[r * kPanel + c] != x[2 * r] * w[c] + x[2 * r + 1] * w[kPanel + c]) return 0;
  const v16 e = exp_nonpositive(splat(-1.0f));
  return (e[0] > 0.3678794f && e[0] < 0.3678795f) ? 1 : 0;
}

// Runs one VDPBF16PS; 1 when it gives the right answer, 0 when this build has no such path.
extern "C" int jaxinfer_probe_bf16_dot() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x40003f80);  // bfloat16 pair (1.0, 2.0)
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x40403f80);  // (1.0, 3.0)
  float out[16];
  _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_set1_ps(0.5f), a, b));
  return out[0] == 7.5f && out[15] == 7.5f ? 1 : 0;
#else
  return 0;
#endif
}

// The ragged kernels' operands up to the segments: q, the pool's keys and values (Pages),
// block_tables and the four segment vectors.
template <typename Pages>
auto bind_ragged() {
  return bind_with_pool<Tensor4, Pages, Pages, Table2, Vector1i, Vector1i, Vector1i, Vector1i>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferRaggedPagedAttention, RaggedPagedAttention,
                              bind_ragged<Tensor4>().Attr<int64_t>("window").Ret<Tensor4>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferRaggedPagedAttentionInt8, RaggedPagedAttentionInt8,
                              bind_ragged<Codes4>()
                                  .Arg<Scales3>()
                                  .Arg<Scales3>()
                                  .Attr<int64_t>("window")
                                  .Ret<Tensor4>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmul, PackedMatmul,
                              (bind_with_pool<Matrix2, Panels3, Rows>().Ret<Matrix2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmulNorm, PackedMatmulNorm,
                              (bind_with_pool<Matrix2, Scale1, Panels3, Rows>()
                                   .Attr<float>("eps")
                                   .Ret<Matrix2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPackedMatmulBf16, PackedMatmulBf16,
                              (bind_with_pool<Matrix2, Bf16Panels3, Rows>()
                                   .Attr<int32_t>("dot")
                                   .Ret<Matrix2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferArgmaxFirst, ArgmaxFirst,
                              bind_with_pool<Matrix2>().Ret<Vector1i>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferReadSum, ReadSum, bind_with_pool<Vector1>().Ret<Scalar0>());
