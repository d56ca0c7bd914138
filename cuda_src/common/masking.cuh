// The contract's masks, softcap and the online-softmax step, shared by the kernels.
// Query i sees key j iff i + offset - left <= j <= i + offset + right, offset = seqlen_k - seqlen_q
// (aligned bottom-right; -1 = unbounded; causal is right = 0). Window bounds reach the kernels
// clamped below 2^31 (cuflash/kernels/fwd_sm80.py, kernel_window), so this int arithmetic is exact.
#pragma once

#include "sm80.cuh"

namespace cuflash {

// The blocks of kBlockN keys that the query rows [m0, m0 + rows) of a tile see.
struct KeyBlocks {
  int n_min, n_max;          // some row sees a key of block n for n_min <= n < n_max (none: n_max <= n_min)
  int n_full_lo, n_full_hi;  // every row sees all of block n for n_full_lo <= n <= n_full_hi: no mask there
};

// m0 may be negative (fwd_sm90 aligns its tiles to the last row): rows outside [0, seqlen_q) see
// nothing.
template <int kBlockN>
__device__ __forceinline__ KeyBlocks key_blocks(int m0, int rows, int seqlen_q, int seqlen_k, int left, int right) {
  const int offset = seqlen_k - seqlen_q;
  const int row_first = max(m0, 0);
  const int row_last = min(m0 + rows, seqlen_q) - 1;
  const int key_lo = left >= 0 ? max(0, row_first + offset - left) : 0;
  const int key_hi = right >= 0 ? min(seqlen_k, row_last + offset + right + 1) : seqlen_k;
  KeyBlocks kb;
  kb.n_min = key_lo / kBlockN;
  kb.n_max = key_hi > key_lo && row_first <= row_last ? (key_hi + kBlockN - 1) / kBlockN : kb.n_min;
  // Below n_full_lo some row's window starts inside the block; above n_full_hi lies the key tail,
  // or some row's window ends inside the block.
  kb.n_full_lo = left >= 0 ? (max(0, row_last + offset - left) + kBlockN - 1) / kBlockN : 0;
  kb.n_full_hi = (right >= 0 ? min(seqlen_k, row_first + offset + right + 1) : seqlen_k) / kBlockN - 1;
  return kb;
}

// The query rows that see some key of [n0, n1): lo <= row < hi (none when hi <= lo). The mirror of
// key_blocks, for kernels that walk keys in the outer loop (the backward).
__device__ __forceinline__ void query_rows(int n0, int n1, int seqlen_q, int seqlen_k, int left, int right, int& lo,
                                           int& hi) {
  const int offset = seqlen_k - seqlen_q;
  lo = right >= 0 ? max(0, n0 - offset - right) : 0;
  hi = left >= 0 ? min(seqlen_q, n1 - 1 - offset + left + 1) : seqlen_q;
}

// Whether every query of [m0, m0 + rows) sees every key of [n0, n0 + cols): no tail, no window edge
// (a tile that needs no mask).
__device__ __forceinline__ bool sees_all(int m0, int rows, int n0, int cols, int seqlen_q, int seqlen_k, int left,
                                         int right) {
  const int offset = seqlen_k - seqlen_q;
  return m0 + rows <= seqlen_q && n0 + cols <= seqlen_k && (left < 0 || n0 >= m0 + rows - 1 + offset - left) &&
         (right < 0 || n0 + cols - 1 <= m0 + offset + right);
}

// The keys row i sees, as columns relative to col0: lo <= column <= hi.
__device__ __forceinline__ void visible_columns(int i, int col0, int seqlen_q, int seqlen_k, int left, int right,
                                                int& lo, int& hi) {
  const int offset = seqlen_k - seqlen_q;
  lo = (left >= 0 ? i + offset - left : 0) - col0;
  hi = (right >= 0 ? min(seqlen_k - 1, i + offset + right) : seqlen_k - 1) - col0;
}

// softcap * tanh(x) for x = s * softmax_scale / softcap, with tanh(x) = 1 - 2 / (exp2(2 log2(e) x) + 1):
// exact at the ends, absolute error ~1e-7 near 0. exp2_scale = 2 * log2(e) * softmax_scale / softcap
// comes premultiplied from the host: one multiply per score.
__device__ __forceinline__ float softcap_score(float s, float exp2_scale, float softcap) {
  const float t = ex2(s * exp2_scale);
  return softcap * (1.f - __fdividef(2.f, t + 1.f));  // t = inf gives 2 / inf = 0
}

// One row's online-softmax step over the kCols scores this thread holds of it (score(c) is a
// reference to column c's; the row's other columns are held by the rest of the quad), in three parts.
// quad_row_max (or quad_row_max_bits): the row's largest raw score of the block.
// online_softmax_max: from that, the new running maximum (kept in the log2 domain, scores times
// scale_log2, so the scale may change from block to block: FP8's per-block descales) and the base of
// the exponentials; returns the factor by which the row's O accumulators and sum must be rescaled.
// online_softmax_row: that, then the exponentials in place and the running sum (kCodes: P's e4m3 codes
// instead, online_softmax_codes, and no sum, with the maximum kept in eighths). The exponentials are
// those of (score - max) + kExpOffset: at most 2^kExpOffset (FP8 puts P in e4m3, whose normal range
// starts at 2^-6: an offset of 8 keeps more of P's small values normal); the offset cancels in O /
// rowsum and row_lse removes it. scale_log2 > 0: the max commutes with the scale.
// kStaleMax > 0 keeps the running maximum until a block's exceeds it by more than kStaleMax (log2
// units): P is then at most 2^(kExpOffset + kStaleMax), and the correction is exactly 1 for most
// blocks of a long row, so a caller may skip the O rescale when no row of the warp moved
// (FlashAttention-4's trick; exact, since O, the sum and the LSE all use the same maximum).
//
// The row's maximum over the quad (its kCols scores a thread), of the scores (T float) or of their
// bits read as signed ints (T int: quad_row_max_bits). The thread's part is taken in kChains
// interleaved chains joined by a tree: one chain over 32 scores is 17 dependent FMNMX deep (the
// exponentials wait for it), four chains are 6. A kernel's choice: where ping-pong already hides the
// chain, the other schedule ptxas makes of the softmax can cost more than the depth saves
// (fwd_sm90.cu, kMaxChains).
__device__ __forceinline__ float score_as(float x, float) { return x; }
__device__ __forceinline__ int score_as(float x, int) { return __float_as_int(x); }
__device__ __forceinline__ float max3(float a, float b, float c) { return fmaxf(a, fmaxf(b, c)); }
__device__ __forceinline__ int max3(int a, int b, int c) { return __vimax3_s32(a, b, c); }  // VIMNMX3 on sm_90

template <typename T, int kCols, int kChains, typename Score>
__device__ __forceinline__ T quad_row_max_of(Score&& score, T lowest) {
  static_assert(kCols % 2 == 0, "scores come in column pairs");
  static_assert(kChains >= 1 && (kChains & (kChains - 1)) == 0 && 2 * kChains <= kCols, "a power of two of chains");
  T chain[kChains];
#pragma unroll
  for (int k = 0; k < kChains; ++k) chain[k] = lowest;
#pragma unroll
  for (int c = 0; c < kCols; c += 2) {
    chain[(c / 2) % kChains] = max3(chain[(c / 2) % kChains], score_as(score(c), T()), score_as(score(c + 1), T()));
  }
#pragma unroll
  for (int width = kChains / 2; width > 0; width /= 2)
#pragma unroll
    for (int k = 0; k < width; ++k) chain[k] = max2(chain[k], chain[k + width]);
  return lanes_max<4>(chain[0]);
}

template <int kCols, int kChains = 1, typename Score>
__device__ __forceinline__ float quad_row_max(Score&& score) {
  return quad_row_max_of<float, kCols, kChains>(score, -infinity());
}

#if __CUDA_ARCH__ >= 900  // (earlier GPUs emulate VIMNMX3)
// quad_row_max on the scores' bit patterns read as signed ints, two scores an instruction: the
// three-input integer maximum (__vimax3_s32, sm_90's VIMNMX3) where fmaxf takes one. Among
// non-negative floats the ints order as the floats do, and every negative float (-0 and -inf
// included) is a negative int. So where the result is >= 0 it is exactly the bits of
// quad_row_max's result (a positive NaN would win here where fmaxf drops it; its row's sum is NaN
// either way); where it is negative, every score of the row was negative and the caller must take
// quad_row_max instead.
template <int kCols, int kChains = 1, typename Score>
__device__ __forceinline__ int quad_row_max_bits(Score&& score) {
  return quad_row_max_of<int, kCols, kChains>(score, -2147483647 - 1);  // (no climits under NVRTC)
}
#endif

// block_max: the row's largest score of this block (quad_row_max's, or quad_row_max_bits' read as a float).
template <int kStaleMax = 0, bool kEighths = false>
__device__ __forceinline__ float online_softmax_max(float block_max, float& row_max, float scale_log2, float& base) {
  float mx = fmaxf(row_max, block_max * scale_log2);
  // (A row's first key makes mx - row_max = inf; a row with none yet, -inf - -inf = NaN: both move.)
  if (kStaleMax > 0 && mx - row_max <= static_cast<float>(kStaleMax)) mx = row_max;
  // kEighths (online_softmax_codes): the maximum rounded up to a multiple of 1/8 (a kept one is one)
  if constexpr (kEighths) mx = ceilf(mx * 8.f) * 0.125f;
  // A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
  base = mx == -infinity() ? 0.f : mx;
  const float correction = ex2(row_max - base);
  row_max = mx;
  return correction;
}

// The exponentials 2^(score * scale_log2 - base) of kCols scores in place, each added to sum.
// kFmaEvery > 0: some of them on the FMA pipe, the rest on the special-function unit: every
// kFmaEvery-th column from the first (ex2_fma<kFmaFactor>), or, kFmaPairs, both columns of every
// kFmaEvery-th pair (2i, 2i + 1) from the first (ex2x2_fma_f16, on the scores less base + kExpOffset,
// times 2^kExpOffset). (fwd_sm80's fused P V calls it a 16-key slice at a time, with
// online_softmax_max's base.)
template <int kCols, int kFmaEvery = 0, bool kFmaFactor = false, bool kFmaPairs = false, int kExpOffset = 0,
          typename Score>
__device__ __forceinline__ void online_softmax_exp(Score&& score, float scale_log2, float base, float& sum) {
  static_assert(kFmaEvery >= 0, "kFmaEvery: 0, or every how many-th column or pair");
  static_assert(!kFmaPairs || kCols % 2 == 0, "whole pairs of columns");
  constexpr int kEvery = kFmaEvery > 0 ? kFmaEvery : 1;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float& x = score(c);
    if (kFmaPairs && kFmaEvery > 0 && c / 2 % kEvery == 0) {
      if (c % 2 == 0) {  // both of the pair, against the row's maximum itself (the finest halves near it)
        const float top = base + kExpOffset;
        const float2 both = ex2x2_fma_f16<kExpOffset>(fmaf(x, scale_log2, -top), fmaf(score(c + 1), scale_log2, -top));
        x = both.x;
        score(c + 1) = both.y;
        sum += both.x + both.y;
      }
      continue;
    }
    if (!kFmaPairs && kFmaEvery > 0 && c % kEvery == 0)
      x = ex2_fma<kFmaFactor>(fmaf(x, scale_log2, -base));
    else
      x = ex2(fmaf(x, scale_log2, -base));
    sum += x;
  }
}

// P's e4m3 codes straight from the scores, for kernels that pack P into e4m3 and sum it on the tensor
// cores (P as rounded): no exponential. A code is 8 * (e + 7) + m for 2^e * (1 + m / 8), so
// round(8 * (y + 7)) is the code of 2^y with its mantissa linear in frac(y) (1 + f for 2^f: up to 6%
// above it, mid-binade) rather than rounded from 2^y, which e4m3 rounds to 2^-4 relative anyway:
// relative to 2^y, a code's error is at most 7.9% (6% for e4m3's rounding), RMS 3.1% (2.65%), up to
// one factor common to all that O / rowsum cancels. One FFMA adds 1.5 * 2^23, so that the sum's
// low mantissa bits hold the rounded code; FMNMX clamps it at 0 (y below -7: 0 where e4m3 would keep
// subnormals below 2^-6, at most 2^-14 of P's largest; masked -inf and NaN: 0). base a multiple of
// 1/8 (online_softmax_max's kEighths), so that 8 * base, and the FFMA's addend, are exact integers
// (exact while |base| < 2^19; beyond, the FFMA's own fmaf(x, scale_log2, -base) has lost as many
// bits). y at most 8 (P's offset with any stale margin): codes 0 to 120. Each score becomes a float
// whose bits' lowest byte is its code (pack4_low_bytes).
template <int kCols, typename Score>
__device__ __forceinline__ void online_softmax_codes(Score&& score, float scale_log2, float base) {
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23
  const float a = 8.f * scale_log2, b = kShift + (56.f - 8.f * base);
#pragma unroll
  for (int c = 0; c < kCols; ++c) score(c) = fmaxf(fmaf(score(c), a, b), kShift);
}

template <int kCols, int kExpOffset = 0, int kStaleMax = 0, int kFmaEvery = 0, bool kFmaFactor = false,
          bool kFmaPairs = false, bool kCodes = false, typename Score>
__device__ __forceinline__ float online_softmax_row(Score&& score, float block_max, float& row_max, float& row_sum,
                                                    float scale_log2) {
  float m;
  const float correction = online_softmax_max<kStaleMax, kCodes>(block_max, row_max, scale_log2, m);
  if constexpr (kCodes) {  // (no row sum: the caller's tensor cores sum P)
    online_softmax_codes<kCols>(score, scale_log2, m - kExpOffset);
    return correction;
  }
  float sum = 0.f;
  online_softmax_exp<kCols, kFmaEvery, kFmaFactor, kFmaPairs, kExpOffset>(score, scale_log2, m - kExpOffset, sum);
  row_sum = row_sum * correction + sum;
  return correction;
}

// The end of a row: the quad of threads holding it adds up its partial sums (lanes_sum<4>); the
// row's LSE in natural log from its running maximum (log2 domain), the total and the exponent offset
// online_softmax_row used (-inf for a row that saw no key).
template <int kExpOffset = 0>
__device__ __forceinline__ float row_lse(float row_max, float total) {
  constexpr float kLn2 = 0.6931471805599453f;
  return total > 0.f ? (row_max - kExpOffset + __log2f(total)) * kLn2 : -infinity();
}

}  // namespace cuflash
