// y[M, N] = x[M, K] · w[N, K]ᵀ (+ b): bf16 in and out, fp32 accumulation, for CPUs with AVX2 + FMA
// and no native bf16 GEMM (see cpu_kernels/cpu_linear.py for when it is used and why).
//
// Each block of weight rows is read from memory once for every 8 rows of x, so a forward over
// 2–8 tokens costs about what one token costs; torch's own bf16 path on such CPUs runs one
// matrix-vector product per row of x. Every output row is accumulated in the same order whatever
// M is, so a row's result does not depend on how many rows it was computed with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int kRowsPerPass = 8;
constexpr int64_t kTile = 32;  // weight rows per cache tile (32 × 576 bf16 = 36 KB for SmolLM2)

inline __m256 load_bf16x8(const at::BFloat16* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// R rows of x (fp32, row stride K) against weight rows [n0, n1); writes y[r * N + n] (fp32).
template <int R>
void pass(const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K8 = K - K % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wn = w + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 wv = load_bf16x8(wn + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r]);
      for (int64_t k = K8; k < K; ++k) s += static_cast<float>(wn[k]) * x[r * K + k];
      y[r * N + n] = s;
    }
  }
}

void rows(int R, const float* x, const at::BFloat16* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  switch (R) {
    case 1: pass<1>(x, w, y, K, N, n0, n1); break;
    case 2: pass<2>(x, w, y, K, N, n0, n1); break;
    case 3: pass<3>(x, w, y, K, N, n0, n1); break;
    case 4: pass<4>(x, w, y, K, N, n0, n1); break;
    case 5: pass<5>(x, w, y, K, N, n0, n1); break;
    case 6: pass<6>(x, w, y, K, N, n0, n1); break;
    case 7: pass<7>(x, w, y, K, N, n0, n1); break;
    default: pass<8>(x, w, y, K, N, n0, n1); break;
  }
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.device().is_cpu(),
              "linear: w must be a contiguous bf16 CPU tensor");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  // weight rows split between threads; each thread walks its rows in tiles small enough to stay in
  // cache while every 8 rows of x pass over them
  at::parallel_for(0, N, kTile, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += kTile) {
      const int64_t t1 = std::min(t0 + kTile, n1);
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const int R = static_cast<int>(std::min<int64_t>(kRowsPerPass, M - m));
        rows(R, xp + m * K, wp, yp + m * N, K, N, t0, t1);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return y.to(at::kBFloat16);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "bf16 linear for small row counts (AVX2 + FMA)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
}
