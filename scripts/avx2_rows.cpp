// An experiment, not part of the package: a float32 matmul for calls of a few rows on AVX2 + FMA, to see how close
// a 3-row call can come to a 1-row call on a CPU where MKL's small calls are slow (scripts/measure_avx2_rows.py).
// Each weight block of 8 outputs is read once per call and every row's 8 sums stay in registers meanwhile.
#include <immintrin.h>
#include <torch/extension.h>

// (out, in) float32 -> (out / 8, in, 8): the 8 outputs of a block side by side for each input index
torch::Tensor pack_rows8(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 8 == 0 && weight.scalar_type() == torch::kFloat32);
  return weight.contiguous().view({weight.size(0) / 8, 8, weight.size(1)}).transpose(1, 2).contiguous();
}

template <int M>
static void block_sums(const float* x, int64_t k, const float* w, float* y, int64_t n) {
  // x: (M, k) rows; w: (k, 8) one block; y: (M, n) at this block's first output
  __m256 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m256 wi = _mm256_loadu_ps(w + 8 * i);
    for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * k + i]), wi, acc[r]);
  }
  for (int r = 0; r < M; ++r) _mm256_storeu_ps(y + r * n, acc[r]);
}

using BlockFn = void (*)(const float*, int64_t, const float*, float*, int64_t);
static const BlockFn kBlocks[] = {nullptr, block_sums<1>, block_sums<2>, block_sums<3>, block_sums<4>,
                                  block_sums<5>, block_sums<6>, block_sums<7>, block_sums<8>, block_sums<9>,
                                  block_sums<10>, block_sums<11>, block_sums<12>};

// x (m, k) float32, packed (n / 8, k, 8) -> (m, n); rows go in chunks of at most 12 (the registers' limit)
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor packed) {
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * 8;
  TORCH_CHECK(packed.size(1) == k && packed.size(2) == 8);
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t row = 0; row < m; row += 12) {
    const int rows = static_cast<int>(std::min<int64_t>(12, m - row));
    for (int64_t b = 0; b < blocks; ++b) kBlocks[rows](xp + row * k, k, wp + b * k * 8, yp + row * n + b * 8, n);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack_rows8", &pack_rows8);
  module.def("linear_rows", &linear_rows);
}
