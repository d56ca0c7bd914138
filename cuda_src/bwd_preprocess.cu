// Backward preprocess of FlashAttention: delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]
// in fp32. The backward's softmax gradient is dS = P * (dP - delta), so delta is computed once per
// row up front instead of once per key block.
//
// A group of kLanesPerRow lanes (a power of two dividing 32) owns one row: each lane reads kVec
// consecutive elements at a time, the group reduces with shuffles, lane 0 writes. The grid is
// (row blocks, nheads, batch), so no index needs a division; consecutive rows of a block are
// consecutive i, so the delta stores are coalesced. A head dim below kHeadDim (the compiled one,
// a multiple of 32) reads only its own columns.
#include "common/types.cuh"

namespace cuflash {

template <typename T, int kHeadDim, int kVec, int kLanesPerRow, int kThreads>
__global__ void __launch_bounds__(kThreads) bwd_preprocess(
    const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta,
    int seqlen, int nheads, int headdim,
    long long out_stride_b, long long out_stride_s, long long out_stride_h,
    long long dout_stride_b, long long dout_stride_s, long long dout_stride_h) {
  static_assert(kHeadDim % kVec == 0, "head dim must be a multiple of the vector width");
  static_assert(kLanesPerRow >= 1 && kLanesPerRow <= 32 && (kLanesPerRow & (kLanesPerRow - 1)) == 0,
                "a row's lanes are a power-of-two part of one warp");
  static_assert(kThreads % 32 == 0, "whole warps");
  constexpr int kVectorsPerRow = kHeadDim / kVec;
  constexpr int kRowsPerBlock = kThreads / kLanesPerRow;

  const int lane = threadIdx.x % kLanesPerRow;
  const int i = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  // No early return: every lane of the warp takes part in the shuffles below.
  const bool valid = i < seqlen;

  float acc = 0.f;
  if (valid) {
    const T* o = out + b * out_stride_b + i * out_stride_s + h * out_stride_h;
    const T* g = dout + b * dout_stride_b + i * dout_stride_s + h * dout_stride_h;
#pragma unroll
    for (int c = lane; c < kVectorsPerRow; c += kLanesPerRow) {
      if (c * kVec >= headdim) break;
      float fo[kVec], fg[kVec];
      load_as_float<kVec>(o + c * kVec, fo);
      load_as_float<kVec>(g + c * kVec, fg);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc = fmaf(fo[e], fg[e], acc);
    }
  }
  acc = lanes_sum<kLanesPerRow>(acc);
  if (valid && lane == 0) delta[(static_cast<long long>(b) * nheads + h) * seqlen + i] = acc;
}

}  // namespace cuflash
