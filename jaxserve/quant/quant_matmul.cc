// Quantized matmul on x86 CPUs, registered with XLA through jax.ffi.
//
//   y[o, t] = sum_i W[o, i] x[t, i]       x f32 [T, I], y f32 [O, T], W in 32-element blocks per row:
//   q8_0: W[o, 32 b + j] = scale[o, b] * qs[o, 32 b + j]                    qs s8 [O, I]
//   q4_1: W[o, 32 b + j] = scale[o, b] * nib(o, b, j) + min[o, b]           qs u8 [O, I / 2]
//         byte 16 b + j holds element j (low nibble) and element j + 16 (high nibble) of block b,
//         ggml's Q4_0/Q4_1 order; scale and min are f16 [O, I / 32].
//   q5_0: W[o, 32 b + j] = scale[o, b] * (nib + 16 bit(o, b, j) - 16)        qs u8 [O, 20 I / 32]
//         block b's 20 bytes: the fifth bits as a little-endian uint32 (bit j: element j), then 16 bytes
//         of nibbles in q4_1's order (ggml's Q5_0 block without its scale).
//
// The activations stay float32 (jaxserve/quant/formats.py, D-47): each block is decoded once per tile of
// up to 8 tokens, multiplied by x in float32, and the block's sum scaled; q4_1's min term is
// min * sum(x over the block), with the block sums of x computed once per call. Each output is summed in
// one order whatever T and its place in a tile, so a token's result does not depend on its batch (D-11).
// Rows are split over XLA's intra-op thread pool (ffi::ThreadPool); the calling thread takes chunks too
// and then sleeps on a condition variable until the chunks other threads took are done, so the call never
// spins and never waits on a task that has not started. AVX-512F or AVX2 + FMA + F16C code is chosen at run
// time (__builtin_cpu_supports); elsewhere a scalar loop gives the same sums in another order.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int kTile = 8;            // tokens sharing one decode of a weight block
constexpr int64_t kChunkRows = 32;  // output rows per unit of work on the thread pool

enum class Format { kQ8_0, kQ4_1, kQ5_0 };
constexpr int64_t kQ5_0BlockBytes = 20;

struct Problem {
  Format format;
  const float* x;        // [T, I]
  const float* x_sums;   // [T, I / 32], q4_1 only
  const uint8_t* qs;     // q8_0: [O, I] int8; q4_1: [O, I / 2]; q5_0: [O, 20 I / 32]
  const uint16_t* scale; // f16 [O, I / 32]
  const uint16_t* min;   // f16 [O, I / 32], q4_1 only
  float* y;              // [O, T]; for a dequantize, W itself [O, I]
  int64_t num_tokens, in_features, out_features;
};

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- scalar ---------------------------------------------------------------------------------------

void DecodeBlockScalar(const Problem& p, int64_t o, int64_t b, float w[kBlock]) {
  if (p.format == Format::kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.qs) + o * p.in_features + b * kBlock;
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]);
  } else if (p.format == Format::kQ5_0) {
    const uint8_t* q = p.qs + (o * (p.in_features / kBlock) + b) * kQ5_0BlockBytes;
    uint32_t high;
    std::memcpy(&high, q, sizeof high);
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = static_cast<float>(static_cast<int>(q[4 + j] & 0x0f) + 16 * static_cast<int>((high >> j) & 1) - 16);
      w[j + kBlock / 2] = static_cast<float>(
          static_cast<int>(q[4 + j] >> 4) + 16 * static_cast<int>((high >> (j + kBlock / 2)) & 1) - 16);
    }
  } else {
    const uint8_t* q = p.qs + o * (p.in_features / 2) + b * (kBlock / 2);
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = static_cast<float>(q[j] & 0x0f);
      w[j + kBlock / 2] = static_cast<float>(q[j] >> 4);
    }
  }
}

void RowsScalar(const Problem& p, int64_t row_begin, int64_t row_end) {
  const int64_t nb = p.in_features / kBlock;
  std::vector<float> acc(p.num_tokens);
  float w[kBlock];
  for (int64_t o = row_begin; o < row_end; ++o) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      DecodeBlockScalar(p, o, b, w);
      const float d = HalfToFloat(p.scale[o * nb + b]);
      const float m = p.format == Format::kQ4_1 ? HalfToFloat(p.min[o * nb + b]) : 0.0f;
      for (int64_t t = 0; t < p.num_tokens; ++t) {
        const float* xt = p.x + t * p.in_features + b * kBlock;
        float s = 0.0f;
        for (int j = 0; j < kBlock; ++j) s += w[j] * xt[j];
        acc[t] += d * s;
        if (p.format == Format::kQ4_1) acc[t] += m * p.x_sums[t * nb + b];
      }
    }
    for (int64_t t = 0; t < p.num_tokens; ++t) p.y[o * p.num_tokens + t] = acc[t];
  }
}

// ---- AVX2 + FMA + F16C ----------------------------------------------------------------------------

#define JAXSERVE_AVX2 __attribute__((target("avx2,fma,f16c")))
// The block decoders must inline into their callers, so a block's vectors stay in registers: left to GCC,
// a second caller (the dequantize) made it call them out of line, 1.2-1.8x slower tiles.
#define JAXSERVE_INLINE inline __attribute__((always_inline))

JAXSERVE_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Block b of row o as 4 x 8 float32 integers (q, or q4_1's nibbles), unscaled.
JAXSERVE_AVX2 JAXSERVE_INLINE void DecodeBlockAvx2(const Problem& p, int64_t o, int64_t b, __m256 w[4]) {
  if (p.format == Format::kQ8_0) {
    const uint8_t* q = p.qs + o * p.in_features + b * kBlock;
    for (int k = 0; k < 4; ++k) {
      __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k));
      w[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  } else {
    const bool q5 = p.format == Format::kQ5_0;
    const uint8_t* q = q5 ? p.qs + (o * (p.in_features / kBlock) + b) * kQ5_0BlockBytes + 4
                          : p.qs + o * (p.in_features / 2) + b * (kBlock / 2);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    if (q5) {
      // The 32 fifth bits as 32 bytes of 16 or 0: byte j copies byte j / 8 of the bits (each 128-bit lane of
      // the broadcast holds all four), keeps bit j % 8, and becomes 0x10 where it is set. With the nibbles
      // (elements 0-15 in the low lane, 16-31 in the high) that is q5 - 16 as 32 signed bytes.
      uint32_t high;
      std::memcpy(&high, q - 4, sizeof high);
      const __m256i source = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
      const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
      __m256i fifth = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(high)), source);
      fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(fifth, bit), bit), _mm256_set1_epi8(16));
      const __m256i values = _mm256_sub_epi8(_mm256_or_si256(_mm256_set_m128i(hi, lo), fifth), _mm256_set1_epi8(16));
      const __m128i first = _mm256_castsi256_si128(values), second = _mm256_extracti128_si256(values, 1);
      w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first));
      w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8)));
      w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second));
      w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8)));
      return;
    }
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// One output row o against tokens [t0, t0 + NT): each block decoded once for the NT tokens; per token,
// the block's products q x summed in float32, then scaled into the token's 8-lane accumulator, and
// q4_1's min term min * sum(x over the block) added up apart.
template <int NT>
JAXSERVE_AVX2 void RowTileAvx2(const Problem& p, int64_t o, int64_t t0) {
  const int64_t nb = p.in_features / kBlock;
  __m256 acc[NT];
  float min_acc[NT];
  for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); min_acc[t] = 0.0f; }
  const bool has_min = p.format == Format::kQ4_1;
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    DecodeBlockAvx2(p, o, b, w);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(p.scale[o * nb + b]));
    const float m = has_min ? _cvtsh_ss(p.min[o * nb + b]) : 0.0f;
    for (int t = 0; t < NT; ++t) {
      const float* xt = p.x + (t0 + t) * p.in_features + b * kBlock;
      __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
      s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), s);
      s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), s);
      s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), s);
      acc[t] = _mm256_fmadd_ps(d, s, acc[t]);
      if (has_min) min_acc[t] += m * p.x_sums[(t0 + t) * nb + b];
    }
  }
  for (int t = 0; t < NT; ++t) p.y[o * p.num_tokens + t0 + t] = HorizontalSum(acc[t]) + min_acc[t];
}

// One row tile of NT tokens (1..kTile), by NT: what the vector paths' loops call.
using RowTileFn = void (*)(const Problem&, int64_t, int64_t);

template <template <int> class Tile>
struct RowTiles {
  static constexpr RowTileFn kByTokens[kTile + 1] = {nullptr,         &Tile<1>::Run, &Tile<2>::Run, &Tile<3>::Run, &Tile<4>::Run,
                                                     &Tile<5>::Run,   &Tile<6>::Run, &Tile<7>::Run, &Tile<8>::Run};
};

// Rows [row_begin, row_end) in tiles of kTile tokens and one tile for the rest.
template <template <int> class Tile>
void RowsTiled(const Problem& p, int64_t row_begin, int64_t row_end) {
  static_assert(kTile == 8, "RowTiles lists tiles of 1..8 tokens");
  for (int64_t o = row_begin; o < row_end; ++o) {
    int64_t t0 = 0;
    for (; t0 + kTile <= p.num_tokens; t0 += kTile) RowTiles<Tile>::kByTokens[kTile](p, o, t0);
    if (t0 < p.num_tokens) RowTiles<Tile>::kByTokens[p.num_tokens - t0](p, o, t0);
  }
}

template <int NT>
struct Avx2Tile {
  static void Run(const Problem& p, int64_t o, int64_t t0) { RowTileAvx2<NT>(p, o, t0); }
};

// ---- AVX-512F ----------------------------------------------------------------------------------------
// The AVX2 path's sums, 16 lanes wide: a block is two vectors of 16, so each token costs two FMAs per block
// instead of four (fewer instructions; on CPUs that split 512-bit operations in two, the same arithmetic).

#define JAXSERVE_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// Block b of row o as 2 x 16 float32 integers (q, q4_1's nibbles, or q5_0's q5 - 16), unscaled.
JAXSERVE_AVX512 JAXSERVE_INLINE void DecodeBlockAvx512(const Problem& p, int64_t o, int64_t b, __m512 w[2]) {
  if (p.format == Format::kQ8_0) {
    const uint8_t* q = p.qs + o * p.in_features + b * kBlock;
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    return;
  }
  if (p.format == Format::kQ5_0) {  // the AVX2 decode's 32 signed bytes, widened 16 at a time
    __m256 halves[4];
    DecodeBlockAvx2(p, o, b, halves);
    for (int k = 0; k < 2; ++k) {  // two 8-lane halves into one 16-lane vector (AVX-512F's 64-bit insert)
      w[k] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(halves[2 * k])),
                                                 _mm256_castps_pd(halves[2 * k + 1]), 1));
    }
    return;
  }
  const uint8_t* q = p.qs + o * (p.in_features / 2) + b * (kBlock / 2);
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0f);
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask)));
}

template <int NT>
JAXSERVE_AVX512 void RowTileAvx512(const Problem& p, int64_t o, int64_t t0) {
  const int64_t nb = p.in_features / kBlock;
  __m512 acc[NT];
  float min_acc[NT];
  for (int t = 0; t < NT; ++t) { acc[t] = _mm512_setzero_ps(); min_acc[t] = 0.0f; }
  const bool has_min = p.format == Format::kQ4_1;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w[2];
    DecodeBlockAvx512(p, o, b, w);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(p.scale[o * nb + b]));
    const float m = has_min ? _cvtsh_ss(p.min[o * nb + b]) : 0.0f;
    for (int t = 0; t < NT; ++t) {
      const float* xt = p.x + (t0 + t) * p.in_features + b * kBlock;
      const __m512 s = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xt + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xt)));
      acc[t] = _mm512_fmadd_ps(d, s, acc[t]);
      if (has_min) min_acc[t] += m * p.x_sums[(t0 + t) * nb + b];
    }
  }
  for (int t = 0; t < NT; ++t) p.y[o * p.num_tokens + t0 + t] = _mm512_reduce_add_ps(acc[t]) + min_acc[t];
}

template <int NT>
struct Avx512Tile {
  static void Run(const Problem& p, int64_t o, int64_t t0) { RowTileAvx512<NT>(p, o, t0); }
};

// ---- dequantize: W as float32 [O, I] ---------------------------------------------------------------------
// For large T, where XLA's float32 GEMM beats any tile here (D-47): each block decoded once, as
// `formats.dequantize` computes it (q * scale, then + min for q4_1; no fused multiply-add), so the values
// equal the XLA path's bit for bit.

void DequantizeRowsScalar(const Problem& p, int64_t row_begin, int64_t row_end) {
  const int64_t nb = p.in_features / kBlock;
  for (int64_t o = row_begin; o < row_end; ++o) {
    for (int64_t b = 0; b < nb; ++b) {
      float w[kBlock];
      DecodeBlockScalar(p, o, b, w);
      const float d = HalfToFloat(p.scale[o * nb + b]);
      const float m = p.format == Format::kQ4_1 ? HalfToFloat(p.min[o * nb + b]) : 0.0f;
      float* out = p.y + o * p.in_features + b * kBlock;
      // q5_0's scalar decode gives q5 - 16 and q8_0's q: both scaled alone, like q4_1's nibbles before + min
      for (int j = 0; j < kBlock; ++j) out[j] = p.format == Format::kQ4_1 ? w[j] * d + m : w[j] * d;
    }
  }
}

JAXSERVE_AVX2 void DequantizeRowsAvx2(const Problem& p, int64_t row_begin, int64_t row_end) {
  const int64_t nb = p.in_features / kBlock;
  const bool has_min = p.format == Format::kQ4_1;
  for (int64_t o = row_begin; o < row_end; ++o) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      DecodeBlockAvx2(p, o, b, w);
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(p.scale[o * nb + b]));
      const __m256 m = _mm256_set1_ps(has_min ? _cvtsh_ss(p.min[o * nb + b]) : 0.0f);
      float* out = p.y + o * p.in_features + b * kBlock;
      for (int k = 0; k < 4; ++k) {
        const __m256 v = _mm256_mul_ps(w[k], d);
        _mm256_storeu_ps(out + 8 * k, has_min ? _mm256_add_ps(v, m) : v);
      }
    }
  }
}

JAXSERVE_AVX512 void DequantizeRowsAvx512(const Problem& p, int64_t row_begin, int64_t row_end) {
  const int64_t nb = p.in_features / kBlock;
  const bool has_min = p.format == Format::kQ4_1;
  for (int64_t o = row_begin; o < row_end; ++o) {
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w[2];
      DecodeBlockAvx512(p, o, b, w);
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(p.scale[o * nb + b]));
      const __m512 m = _mm512_set1_ps(has_min ? _cvtsh_ss(p.min[o * nb + b]) : 0.0f);
      float* out = p.y + o * p.in_features + b * kBlock;
      for (int k = 0; k < 2; ++k) {
        const __m512 v = _mm512_mul_ps(w[k], d);
        _mm512_storeu_ps(out + 16 * k, has_min ? _mm512_add_ps(v, m) : v);
      }
    }
  }
}

// ---- the path, chosen once ------------------------------------------------------------------------------
// The widest the CPU has (__builtin_cpu_supports), unless JAXSERVE_CPU_KERNEL names a narrower one: "avx2" or
// "scalar" (how the tests check every path on a machine that has AVX-512).

enum class Path { kScalar, kAvx2, kAvx512 };

Path ChoosePath() {
  const char* asked = std::getenv("JAXSERVE_CPU_KERNEL");
  const bool scalar = asked && std::strcmp(asked, "scalar") == 0, avx2_only = asked && std::strcmp(asked, "avx2") == 0;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (scalar || !avx2) return Path::kScalar;
  return __builtin_cpu_supports("avx512f") && !avx2_only ? Path::kAvx512 : Path::kAvx2;
}

void Rows(const Problem& p, int64_t row_begin, int64_t row_end) {
  static const Path path = ChoosePath();
  switch (path) {
    case Path::kAvx512: RowsTiled<Avx512Tile>(p, row_begin, row_end); break;
    case Path::kAvx2: RowsTiled<Avx2Tile>(p, row_begin, row_end); break;
    default: RowsScalar(p, row_begin, row_end); break;
  }
}

void DequantizeRows(const Problem& p, int64_t row_begin, int64_t row_end) {
  static const Path path = ChoosePath();
  switch (path) {
    case Path::kAvx512: DequantizeRowsAvx512(p, row_begin, row_end); break;
    case Path::kAvx2: DequantizeRowsAvx2(p, row_begin, row_end); break;
    default: DequantizeRowsScalar(p, row_begin, row_end); break;
  }
}

using RowsFn = void (*)(const Problem&, int64_t, int64_t);

}  // namespace

// Which path Rows takes here: 0 scalar, 1 AVX2, 2 AVX-512 (cpu_kernel.kernel_path reads it for the log line).
extern "C" int JaxserveQuantMatmulPath() { return static_cast<int>(ChoosePath()); }

namespace {

// ---- the thread pool ------------------------------------------------------------------------------

struct Work {
  Problem problem;
  RowsFn rows;  // Rows (the matmul) or DequantizeRows
  int64_t num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void RunChunks() {
    int64_t finished = 0;
    for (int64_t c; (c = next.fetch_add(1)) < num_chunks; ++finished) {
      const int64_t begin = c * kChunkRows;
      rows(problem, begin, std::min(begin + kChunkRows, problem.out_features));
    }
    if (finished > 0 && done.fetch_add(finished) + finished == num_chunks) {
      std::lock_guard<std::mutex> lock(mu);
      all_done.notify_all();
    }
  }
};

void RunOnPool(const Problem& problem, RowsFn rows, ffi::ThreadPool& pool) {
  auto work = std::make_shared<Work>();
  work->problem = problem;
  work->rows = rows;
  work->num_chunks = (problem.out_features + kChunkRows - 1) / kChunkRows;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work] { work->RunChunks(); });
  }
  work->RunChunks();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == work->num_chunks; });
}

// The problem's weight fields, shapes checked: W [out_features, in_features] in `format` (qs, scale, min).
template <typename QsBuffer>
ffi::Error WeightProblem(Format format, int64_t in_features, QsBuffer qs, ffi::Buffer<ffi::F16> scale,
                         const uint16_t* min, Problem& p) {
  const auto qs_dims = qs.dimensions();
  if (qs_dims.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: qs must be [O, packed I]");
  p.format = format;
  p.in_features = in_features;
  p.out_features = qs_dims[0];
  const int64_t packed = format == Format::kQ8_0   ? in_features
                         : format == Format::kQ5_0 ? in_features / kBlock * kQ5_0BlockBytes
                                                   : in_features / 2;
  if (in_features % kBlock != 0 || qs_dims[1] != packed ||
      scale.element_count() != p.out_features * (in_features / kBlock)) {
    return ffi::Error::InvalidArgument("quant_matmul: shapes of x (or W), qs and scale do not agree");
  }
  p.qs = reinterpret_cast<const uint8_t*>(qs.typed_data());
  p.scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  p.min = min;
  return ffi::Error::Success();
}

// y [O, T] = W x for x [T, I].
template <typename QsBuffer>
ffi::Error Run(Format format, ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, QsBuffer qs,
               ffi::Buffer<ffi::F16> scale, const uint16_t* min, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be [T, I]");
  Problem p;
  if (ffi::Error e = WeightProblem(format, x_dims[1], qs, scale, min, p); e.failure()) return e;
  p.num_tokens = x_dims[0];
  p.x = x.typed_data();
  p.y = y->typed_data();
  std::vector<float> x_sums;
  if (format == Format::kQ4_1) {
    const int64_t nb = p.in_features / kBlock;
    x_sums.resize(p.num_tokens * nb);
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) s += p.x[t * p.in_features + b * kBlock + j];
        x_sums[t * nb + b] = s;
      }
    }
    p.x_sums = x_sums.data();
  }
  if (p.num_tokens == 0 || p.out_features == 0) return ffi::Error::Success();
  RunOnPool(p, Rows, pool);
  return ffi::Error::Success();
}

// w [O, I] = W in float32.
template <typename QsBuffer>
ffi::Error RunDequantize(Format format, ffi::ThreadPool pool, QsBuffer qs, ffi::Buffer<ffi::F16> scale,
                         const uint16_t* min, ffi::ResultBuffer<ffi::F32> w) {
  const auto w_dims = w->dimensions();
  if (w_dims.size() != 2) return ffi::Error::InvalidArgument("dequantize: W must be [O, I]");
  Problem p;
  if (ffi::Error e = WeightProblem(format, w_dims[1], qs, scale, min, p); e.failure()) return e;
  if (p.out_features != w_dims[0]) return ffi::Error::InvalidArgument("dequantize: W and qs differ in rows");
  p.y = w->typed_data();
  if (p.out_features == 0) return ffi::Error::Success();
  RunOnPool(p, DequantizeRows, pool);
  return ffi::Error::Success();
}

ffi::Error Q8_0Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> qs,
                    ffi::Buffer<ffi::F16> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Run(Format::kQ8_0, pool, x, qs, scale, nullptr, y);
}

ffi::Error Q4_1Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                    ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> min, ffi::ResultBuffer<ffi::F32> y) {
  if (min.element_count() != scale.element_count()) {
    return ffi::Error::InvalidArgument("quant_matmul: min and scale must have one shape");
  }
  return Run(Format::kQ4_1, pool, x, qs, scale,
             reinterpret_cast<const uint16_t*>(min.typed_data()), y);
}

ffi::Error Q5_0Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                    ffi::Buffer<ffi::F16> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Run(Format::kQ5_0, pool, x, qs, scale, nullptr, y);
}

ffi::Error DequantizeQ8_0Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> qs, ffi::Buffer<ffi::F16> scale,
                              ffi::ResultBuffer<ffi::F32> w) {
  return RunDequantize(Format::kQ8_0, pool, qs, scale, nullptr, w);
}

ffi::Error DequantizeQ4_1Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F16> scale,
                              ffi::Buffer<ffi::F16> min, ffi::ResultBuffer<ffi::F32> w) {
  if (min.element_count() != scale.element_count()) {
    return ffi::Error::InvalidArgument("dequantize: min and scale must have one shape");
  }
  return RunDequantize(Format::kQ4_1, pool, qs, scale, reinterpret_cast<const uint16_t*>(min.typed_data()), w);
}

ffi::Error DequantizeQ5_0Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> qs, ffi::Buffer<ffi::F16> scale,
                              ffi::ResultBuffer<ffi::F32> w) {
  return RunDequantize(Format::kQ5_0, pool, qs, scale, nullptr, w);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulQ5_0, Q5_0Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulQ8_0, Q8_0Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmulQ4_1, Q4_1Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDequantizeQ8_0, DequantizeQ8_0Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDequantizeQ4_1, DequantizeQ4_1Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDequantizeQ5_0, DequantizeQ5_0Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
