// Why the small-row kernel (selfspec/csrc/small_gemm.cpp) sums rows 2-16 with float32 FMAs, and why that keeps
// vdpbf16ps's bits: this CPU's rate for each instruction, and the two compared lane by lane on random inputs.
//
//   gcc -O2 -mavx512f -mavx512bf16 -mavx512vl scripts/check_fma_vs_dpbf16.c -o /tmp/check_fma && /tmp/check_fma
//
// Rates: 12 independent accumulators per loop, so each instruction's throughput (not its latency) sets the
// time. Bits: vdpbf16ps(acc, a, b) against fma(a_even, b_even, fma(a_odd, b_odd, acc)) on the same lanes, the
// bf16 halves widened to float32 by a mask and a shift, under MXCSR's DAZ and FTZ (vdpbf16ps's own denormal
// rule); inputs with exponents in the normal range, near the bottom of it, and anywhere including Inf/NaN.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TWELVE(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

static void rates(void) {
  const long n = 50000000;
#define DECLARE(i) __m512 a##i = _mm512_set1_ps(i * 1e-3f);
  TWELVE(DECLARE)
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f813f7f), y = (__m512bh)_mm512_set1_epi32(0x3c013bff);
  const __m512 f = _mm512_set1_ps(1.0001f), g = _mm512_set1_ps(1e-4f);
  double t = now();
  for (long i = 0; i < n; i++) {
#define DP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
    TWELVE(DP)
  }
  const double dp = 12.0 * n / (now() - t) / 1e9;
  t = now();
  for (long i = 0; i < n; i++) {
#define FMA(i) a##i = _mm512_fmadd_ps(f, g, a##i);
    TWELVE(FMA)
  }
  const double fma = 12.0 * n / (now() - t) / 1e9;
  float sink = 0;
#define SUM(i) sink += _mm512_reduce_add_ps(a##i);
  TWELVE(SUM)
  printf("vdpbf16ps zmm: %.2f G/s = %.0f G multiply-adds/s (32 each)\n", dp, dp * 32);
  printf("vfmadd231ps zmm: %.2f G/s = %.0f G multiply-adds/s (16 each)   [%g]\n", fma, fma * 16, sink);
}

static uint32_t state = 12345;
static uint32_t next(void) {
  state ^= state << 13;
  state ^= state >> 17;
  state ^= state << 5;
  return state;
}

static uint16_t random_bf16(int kind) {  // 0: normal magnitudes, 1: near the bottom of the range, 2: any exponent
  const int exponent = kind == 0 ? 100 + next() % 50 : kind == 1 ? next() % 40 : next() % 256;
  return (uint16_t)(((next() & 1) << 15) | (exponent << 7) | (next() & 0x7f));
}

static int is_nan(uint32_t bits) { return ((bits >> 23) & 0xff) == 0xff && (bits & 0x7fffff); }

static void bits(void) {
  const char* kinds[] = {"normal range", "near the bottom", "any exponent"};
  for (int kind = 0; kind < 3; kind++) {
    long lanes = 0, differ = 0, differ_not_nan = 0;
    for (int it = 0; it < 2000000; it++) {
      uint16_t a[32], b[32];
      uint32_t acc[16];
      for (int i = 0; i < 32; i++) a[i] = random_bf16(kind), b[i] = random_bf16(kind);
      for (int i = 0; i < 16; i++) {
        acc[i] = ((uint32_t)random_bf16(kind) << 16) | (next() & 0xffff);
        if (((acc[i] >> 23) & 0xff) == 0) acc[i] = 0;  // an accumulator is never denormal (always flushed)
      }
      __m512i va, vb;
      memcpy(&va, a, 64);
      memcpy(&vb, b, 64);
      const __m512 start = _mm512_castsi512_ps(_mm512_loadu_si512(acc));
      uint32_t hw[16], emulated[16];
      _mm512_storeu_si512(hw, _mm512_castps_si512(_mm512_dpbf16_ps(start, (__m512bh)va, (__m512bh)vb)));
      const unsigned saved = _mm_getcsr();
      _mm_setcsr(saved | 0x8040);  // FTZ | DAZ
      const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
      const __m512 odd_a = _mm512_castsi512_ps(_mm512_and_si512(va, high));
      const __m512 even_a = _mm512_castsi512_ps(_mm512_slli_epi32(va, 16));
      const __m512 odd_b = _mm512_castsi512_ps(_mm512_and_si512(vb, high));
      const __m512 even_b = _mm512_castsi512_ps(_mm512_slli_epi32(vb, 16));
      const __m512 sum = _mm512_fmadd_ps(even_a, even_b, _mm512_fmadd_ps(odd_a, odd_b, start));
      _mm_setcsr(saved);
      _mm512_storeu_si512(emulated, _mm512_castps_si512(sum));
      for (int i = 0; i < 16; i++, lanes++) {
        if (hw[i] == emulated[i]) continue;
        differ++;
        differ_not_nan += !(is_nan(hw[i]) && is_nan(emulated[i]));
      }
    }
    printf("%s: %ld lanes, %ld differ (%ld of them other than a NaN's payload)\n", kinds[kind], lanes, differ,
           differ_not_nan);
  }
}

int main(void) {
  rates();
  bits();
  return 0;
}
