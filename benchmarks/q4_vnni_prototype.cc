// Standalone prototype, not part of jaxinfer: x @ W for 4-bit codes (blocks of 32 rows, a float32
// scale and min per (block, column), as q4) with x rounded to int8 per row and block of 32
// (llama.cpp's Q8_1 scheme), the products by AVX512-VNNI VPDPBUSD. One thread, no prefetch.
// Prints time, GFLOP/s and the relative RMS error against x @ W in float64.
//   g++ -O2 -march=native -std=c++17 -o /tmp/q4_vnni benchmarks/q4_vnni_prototype.cc && /tmp/q4_vnni
// Layout: panels of 48 columns; per panel, per group of 8 rows k0..k0+7: 3 vectors of 64 bytes,
// byte t of lane j: low nibble = code(k0 + t, col j), high nibble = code(k0 + 4 + t, col j).
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

constexpr int kPanel = 48, kV = 3, kBs = 32;

struct Q4 {
  int K, N, P;
  std::vector<uint8_t> codes;   // [P][K/8][3][64]
  std::vector<float> scale, mn; // [P][K/32][48]
};

Q4 make(int K, int N, std::mt19937& g, std::vector<uint8_t>& raw) {  // raw codes [K][N]
  Q4 w{K, N, (N + kPanel - 1) / kPanel};
  std::uniform_int_distribution<int> c(0, 15);
  std::normal_distribution<float> s(0.0f, 0.01f);
  raw.assign(size_t(K) * N, 0);
  for (auto& x : raw) x = c(g);
  w.codes.assign(size_t(w.P) * K / 8 * kV * 64, 0);
  w.scale.assign(size_t(w.P) * K / kBs * kPanel, 0.0f);
  w.mn.assign(size_t(w.P) * K / kBs * kPanel, 0.0f);
  for (int p = 0; p < w.P; ++p)
    for (int k8 = 0; k8 < K / 8; ++k8)
      for (int v = 0; v < kV; ++v)
        for (int j = 0; j < 16; ++j)
          for (int t = 0; t < 4; ++t) {
            const int n = p * kPanel + v * 16 + j;
            if (n >= N) continue;
            const uint8_t lo = raw[size_t(k8 * 8 + t) * N + n], hi = raw[size_t(k8 * 8 + 4 + t) * N + n];
            w.codes[((size_t(p) * (K / 8) + k8) * kV + v) * 64 + j * 4 + t] = lo | (hi << 4);
          }
  for (auto& x : w.scale) x = std::fabs(s(g)) + 1e-4f;
  for (auto& x : w.mn) x = -8.0f * 0.01f + s(g);
  return w;
}

struct Xq { std::vector<int8_t> q; std::vector<float> d, sum; };  // per row per block of 32

Xq quantize(const std::vector<float>& x, int M, int K) {
  Xq r{std::vector<int8_t>(size_t(M) * K), std::vector<float>(size_t(M) * K / kBs), std::vector<float>(size_t(M) * K / kBs)};
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < K / kBs; ++b) {
      float amax = 0;
      for (int i = 0; i < kBs; ++i) amax = std::fmax(amax, std::fabs(x[size_t(m) * K + b * kBs + i]));
      const float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
      int s = 0;
      for (int i = 0; i < kBs; ++i) {
        const int q = (int)std::nearbyint(x[size_t(m) * K + b * kBs + i] * id);
        r.q[size_t(m) * K + b * kBs + i] = (int8_t)q;
        s += q;
      }
      r.d[size_t(m) * (K / kBs) + b] = d;
      r.sum[size_t(m) * (K / kBs) + b] = d * s;
    }
  return r;
}

// out[m0:m0+R, panel p] over all K.
template <int R>
void block(const Q4& w, int p, const Xq& x, int m0, float* out) {
  const int K = w.K, B = K / kBs;
  __m512 acc[R][kV];
  for (int r = 0; r < R; ++r) for (int v = 0; v < kV; ++v) acc[r][v] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const uint8_t* c = w.codes.data() + size_t(p) * (K / 8) * kV * 64;
  for (int b = 0; b < B; ++b) {
    __m512i ai[R][kV];
    for (int r = 0; r < R; ++r) for (int v = 0; v < kV; ++v) ai[r][v] = _mm512_setzero_si512();
    for (int g = 0; g < 4; ++g) {
      const int k0 = b * kBs + g * 8;
      for (int v = 0; v < kV; ++v) {
        const __m512i raw = _mm512_loadu_si512(c + ((size_t)(k0 / 8) * kV + v) * 64);
        const __m512i lo = _mm512_and_si512(raw, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(x.q.data() + size_t(m0 + r) * K + k0);
          ai[r][v] = _mm512_dpbusd_epi32(ai[r][v], lo, _mm512_set1_epi32(xr[0]));
          ai[r][v] = _mm512_dpbusd_epi32(ai[r][v], hi, _mm512_set1_epi32(xr[1]));
        }
      }
    }
    const float* sc = w.scale.data() + (size_t(p) * B + b) * kPanel;
    const float* mn = w.mn.data() + (size_t(p) * B + b) * kPanel;
    for (int v = 0; v < kV; ++v) {
      const __m512 s = _mm512_loadu_ps(sc + v * 16), mv = _mm512_loadu_ps(mn + v * 16);
      for (int r = 0; r < R; ++r) {
        const size_t rb = size_t(m0 + r) * B + b;
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][v]), _mm512_mul_ps(s, _mm512_set1_ps(x.d[rb])), acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sum[rb]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) _mm512_storeu_ps(out + size_t(m0 + r) * w.P * kPanel + p * kPanel + v * 16, acc[r][v]);
}

void matmul(const Q4& w, const Xq& x, int M, float* out) {
  for (int p = 0; p < w.P; ++p) {
    int m = 0;
    for (; m + 4 <= M; m += 4) block<4>(w, p, x, m, out);
    for (; m < M; ++m) block<1>(w, p, x, m, out);
  }
}

// x @ W in double from the float32 activations and the dequantized codes (the error reference).
void reference(const Q4& w, const std::vector<uint8_t>& raw, const std::vector<float>& x, int M,
               std::vector<double>& out) {
  const int K = w.K, N = w.N, B = K / kBs;
  out.assign(size_t(M) * N, 0.0);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k)
      for (int n = 0; n < N; ++n) {
        const size_t sb = (size_t(n / kPanel) * B + k / kBs) * kPanel + n % kPanel;
        out[size_t(m) * N + n] += double(x[size_t(m) * K + k]) * (double(w.scale[sb]) * raw[size_t(k) * N + n] + w.mn[sb]);
      }
}

int main(int argc, char** argv) {
  std::mt19937 g(0);
  for (auto [K, N] : {std::pair{576, 3072}, std::pair{1536, 576}}) {
    std::vector<uint8_t> raw;
    Q4 w = make(K, N, g, raw);
    for (int M : {1, 8, 16, 64, 384}) {
      std::vector<float> x(size_t(M) * K);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (auto& v : x) v = d(g);
      std::vector<float> o1(size_t(M) * w.P * kPanel);
      double best1 = 1e9;
      for (int rep = 0; rep < 30; ++rep) {
        auto t0 = std::chrono::steady_clock::now();
        Xq xq = quantize(x, M, K);
        matmul(w, xq, M, o1.data());
        auto t1 = std::chrono::steady_clock::now();
        best1 = std::min(best1, std::chrono::duration<double>(t1 - t0).count());
      }
      std::vector<double> ref;
      reference(w, raw, x, std::min(M, 16), ref);
      double num = 0, den = 0;   // relative RMS error against the float64 product (first 16 rows)
      for (int m = 0; m < std::min(M, 16); ++m)
        for (int n = 0; n < N; ++n) {
          const double e = o1[size_t(m) * w.P * kPanel + n] - ref[size_t(m) * N + n];
          num += e * e; den += ref[size_t(m) * N + n] * ref[size_t(m) * N + n];
        }
      const double fl = 2.0 * M * K * N / 1e9;
      std::printf("K %4d N %4d M %3d: %.3f ms, %.0f GFLOP/s on one thread (x quantized per call included), "
                  "relative RMS error %.2e\n", K, N, M, best1 * 1e3, fl / best1, std::sqrt(num / den));
    }
  }
}
