// y = x @ W.T for bfloat16 on CPUs with AVX512-BF16, for the few rows of a decoding step or a verify pass.
//
// Why: oneDNN's packed bf16 matmul spends about as long on a 1-row call as on a 3-row one (its call's own
// overhead is large); this kernel streams the weight once per call with every row's accumulators in registers
// (51 us against 134 us for one row of 576 -> 1536 on one Xeon core). One row goes through
// vdpbf16ps. From two rows on the same sums run either through vdpbf16ps or as float32 FMAs over the widened
// weight, whichever the CPU runs faster (the caller chooses: small_gemm.many_row_sums): FMAs retire twice
// vdpbf16ps's multiply-adds per second on an Intel Xeon, half of them on an AMD EPYC (Zen 5). The weight is
// prefetched ahead so that it keeps arriving from DRAM while the rows' sums run.
//
// Bits: each output is accumulated in float32 over K in the order oneDNN's kernel uses on the machines it was
// checked on: K cut into blocks of `k_block` (the last may be shorter), each block summed from zero pair by pair
// (k+1 before k within a pair, as vdpbf16ps does), the block sums added in order, rounded once to bfloat16 (RNE). The
// Python side (selfspec/small_gemm.py) probes each weight against oneDNN and uses this kernel only where the
// bits agree, so switching kernels changes no output. For one k_block every row is computed alike whatever the
// row count; the caller picks the block by row count, as oneDNN's own blocks differ for 1-row calls.
//
// Packed layout (packed_weight): (N / 16, K / 2, 16, 2): 16 output columns x 1 pair of K per 64-byte vector.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {
// Weight bytes are prefetched this many 64-byte vectors ahead in each column block's stream: from DRAM the
// loads alone do not keep the weight arriving while a few rows' FMAs run. All of SmolLM2's matmuls over 5 rows
// against 1 row on a Xeon core, one build each: 1.35x
// without the prefetch, 1.22x at 8, 1.07x at 32, 1.04x at 128. Separate builds' absolute times are not
// comparable on this shared machine, so whether 128 beats 32 on the 1-row time is not settled; 32 stays.
constexpr int64_t kPrefetchAhead = 32;

at::Tensor packed_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "small_gemm: weight must be 2-D bf16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0, "small_gemm: needs out % 32 == 0 and in % 2 == 0");
  return weight.contiguous().view({n / 16, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

struct Problem {
  const uint16_t* x;  // (M, K) rows
  const uint16_t* w;  // packed weight
  uint16_t* y;        // (M, N) rows
  int64_t k, n, k_block;
};

// Rows [0, R) of x against column groups [g0, g1) of NB blocks of 16 columns each: K in blocks of k_block, each
// summed from zero, the block sums added in order, one rounding to bf16. `Sums` adds one pair of K to every
// accumulator (DotBf16, WidenedFma below); each column block's stream is prefetched ahead as it goes.
template <int R, int NB, class Sums>
void rows_times_groups(const Problem& p, const Sums& sums, int64_t g0, int64_t g1) {
  const int64_t pairs = p.k / 2;
  for (int64_t g = g0; g < g1; ++g) {
    __m512 total[NB][R];
    const uint16_t* w = p.w + NB * g * pairs * 32;
    for (int64_t start = 0; start < pairs; start += p.k_block / 2) {
      const int64_t stop = std::min(pairs, start + p.k_block / 2);
      __m512 acc[NB][R];
      for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
      for (int64_t kp = start; kp < stop; ++kp) {
        const uint16_t* cols[NB];  // this pair of K for each block's 16 columns: one 64-byte vector
        for (int b = 0; b < NB; ++b) {
          cols[b] = w + (b * pairs + kp) * 32;
          _mm_prefetch((const char*)(cols[b] + kPrefetchAhead * 32), _MM_HINT_T0);
        }
        sums.template add_pair<R, NB>(p, cols, kp, acc);
      }
      for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) total[b][r] = start == 0 ? acc[b][r] : _mm512_add_ps(total[b][r], acc[b][r]);
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        _mm256_storeu_si256((__m256i*)(p.y + r * p.n + 16 * (NB * g + b)),
                            (__m256i)_mm512_cvtneps_pbh(total[b][r]));
  }
}

// One pair of K by vdpbf16ps: each row's bf16 pair broadcast against each block's 16 column pairs.
struct DotBf16 {
  DotBf16 from_row(int64_t) const { return *this; }  // reads the bf16 rows through p.x, already offset

  template <int R, int NB>
  void add_pair(const Problem& p, const uint16_t* const (&cols)[NB], int64_t kp, __m512 (&acc)[NB][R]) const {
    __m512bh col[NB];
    for (int b = 0; b < NB; ++b) col[b] = (__m512bh)_mm512_loadu_si512(cols[b]);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, p.x + r * p.k + 2 * kp, 4);
      const __m512bh row = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], row, col[b]);
    }
  }
};

// One pair of K by float32 FMAs over the weight widened from bf16: on an Intel Xeon core vdpbf16ps retires 1.1 G a
// second (36 G multiply-adds) and vfmadd231ps 5.1 G (81 G), so from two rows on,
// where the multiply-adds and not the weight's bytes set the time, this runs the same sums about twice as fast.
// Same bits: a product of two bf16 is exact in float32, so each FMA rounds once, as each half of vdpbf16ps does
// (k + 1 first); vdpbf16ps treats denormal inputs as zero and flushes denormal results, which the caller matches
// with MXCSR's DAZ and FTZ (FlushDenormals). `xf` holds the rows widened to float32.
struct WidenedFma {
  const float* xf;
  WidenedFma from_row(int64_t offset) const { return {xf + offset}; }  // the widened rows from that element on

  template <int R, int NB>
  void add_pair(const Problem& p, const uint16_t* const (&cols)[NB], int64_t kp, __m512 (&acc)[NB][R]) const {
    const __m512i high_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    __m512 odd[NB], even[NB];  // weight k + 1 and k of 16 columns, as float32
    for (int b = 0; b < NB; ++b) {
      const __m512i raw = _mm512_loadu_si512(cols[b]);
      odd[b] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
      even[b] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x_odd = _mm512_set1_ps(xf[r * p.k + 2 * kp + 1]);
      const __m512 x_even = _mm512_set1_ps(xf[r * p.k + 2 * kp]);
      for (int b = 0; b < NB; ++b)
        acc[b][r] = _mm512_fmadd_ps(even[b], x_even, _mm512_fmadd_ps(odd[b], x_odd, acc[b][r]));
    }
  }
};

// Denormal inputs read as zero and denormal results flushed, as vdpbf16ps does, for this thread while in scope.
struct FlushDenormals {
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
};

template <class Sums, int NB, int... R>
constexpr auto row_table(std::integer_sequence<int, R...>) {
  using Kernel = void (*)(const Problem&, const Sums&, int64_t, int64_t);
  return std::array<Kernel, sizeof...(R)>{rows_times_groups<R + 1, NB, Sums>...};
}

constexpr int kWideRows = 3;   // 2-3 rows: 4 column blocks a group (12 accumulators, 8 widened weights)
constexpr int kNarrowRows = 12;  // otherwise 2 blocks a group and up to 12 rows (24 accumulators)

// Rows of p, all m of them, by `Sums`: every chunk of up to kNarrowRows rows over one column group while that
// group's weights are in cache, groups split across threads.
template <class Sums>
void many_rows(const Problem& p, int64_t m, const Sums& sums) {
  static const auto wide_table = row_table<Sums, 4>(std::make_integer_sequence<int, kWideRows>{});
  static const auto narrow_table = row_table<Sums, 2>(std::make_integer_sequence<int, kNarrowRows>{});
  const bool wide = m <= kWideRows && p.n % 64 == 0;
  const int64_t groups = wide ? p.n / 64 : p.n / 32;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    FlushDenormals flush;  // a no-op for vdpbf16ps, which flushes on its own; the FMAs' denormal rule
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r0 = 0; r0 < m; r0 += kNarrowRows) {
        Problem part = p;
        part.x += r0 * p.k;
        part.y += r0 * p.n;
        const int64_t r = std::min<int64_t>(kNarrowRows, m - r0);
        const auto kernel = wide ? wide_table[r - 1] : narrow_table[r - 1];
        kernel(part, sums.from_row(r0 * p.k), g, g + 1);
      }
  });
}

// Rows as float32 for WidenedFma: bf16 -> float32 is a shift into the high half; done here, a torch conversion
// costs 10 us a call in dispatch alone.
std::vector<float> widened_rows(const uint16_t* x, int64_t count) {
  std::vector<float> widened(count);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = uint32_t(x[i]) << 16;
    std::memcpy(&widened[i], &bits, 4);
  }
  return widened;
}

// `widened_fma` picks the sums of calls of 2 rows or more: which of the two is faster depends on the CPU
// (small_gemm.py's many_row_sums measures it); both give the same bits.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t k_block, bool widened_fma) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "small_gemm: bf16 only");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && packed.dim() == 4, "small_gemm: CPU tensors");
  const int64_t k = x.size(-1), n = packed.size(0) * 16;
  TORCH_CHECK(packed.size(1) * 2 == k && k_block >= 2 && k_block % 2 == 0, "small_gemm: shapes do not match");
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  Problem p{reinterpret_cast<const uint16_t*>(rows.data_ptr()), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
            reinterpret_cast<uint16_t*>(y.data_ptr()), k, n, k_block};
  if (m == 1 && n % 64 == 0) {  // one row: the weight's bytes set the time, vdpbf16ps keeps up
    at::parallel_for(0, n / 64, 4, [&](int64_t g0, int64_t g1) { rows_times_groups<1, 4>(p, DotBf16{}, g0, g1); });
  } else if (widened_fma) {
    const std::vector<float> xf = widened_rows(p.x, m * k);
    many_rows(p, m, WidenedFma{xf.data()});
  } else {
    many_rows(p, m, DotBf16{});
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(selfspec_small_gemm, m) {
  m.def("packed_weight(Tensor weight) -> Tensor", &packed_weight);
  m.def("linear(Tensor x, Tensor packed, int k_block, bool widened_fma) -> Tensor", &linear);
}
