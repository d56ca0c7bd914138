// Split-KV's second pass (fwd_sm90.cu, kSplitKV): each part of a row's keys left its O, normalised
// over that part, and its LSE as float32 partials; the row's O is their sum weighted by
// exp(lse_part - lse), with lse the log of the sum of exp(lse_part). One warp a query row: the
// lanes take the parts for the LSE, then 4 columns each (float4 loads) for O. A part whose rows saw
// no key has lse -inf and weight 0; a row no part saw gets out 0 and lse -inf, as the forward's
// contract says.
#include "common/sm80.cuh"

namespace cuflash {

struct CombineSplitsParams {
  const float* o_partial;    // (batch, splits, seqlen_q, nheads, headdim), contiguous
  const float* lse_partial;  // (batch, splits, nheads, seqlen_q), contiguous
  void* out;                 // (batch, seqlen_q, nheads, headdim) of TOut, these strides (elements)
  float* lse;                // (batch, nheads, seqlen_q), rows contiguous; none (null) from e4m3 calls without it
  long long o_stride_b, o_stride_s, o_stride_h;
  long long lse_stride_b, lse_stride_h;
  int splits, seqlen_q, nheads, headdim;  // headdim: a multiple of 8
  int rows;                               // batch * nheads * seqlen_q
};
static_assert(sizeof(CombineSplitsParams) == 96, "CombineSplitsParams must match COMBINE_PARAMS in fwd_sm90.py");

template <typename TOut, int kThreads>
__global__ void __launch_bounds__(kThreads) combine_splits(const __grid_constant__ CombineSplitsParams p) {
  // (b * nheads + h) * seqlen_q + s; the thread index in 64 bits (rows < 2^31: the launcher checks)
  const int row = static_cast<int>((static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const int bh = row / p.seqlen_q, s = row - bh * p.seqlen_q;
  const int b = bh / p.nheads, h = bh - b * p.nheads;
  const long long lse_split = static_cast<long long>(p.nheads) * p.seqlen_q;  // between parts
  const long long o_row = static_cast<long long>(p.nheads) * p.headdim;
  const long long o_split = p.seqlen_q * o_row;
  const float* lse_parts = p.lse_partial + b * p.splits * lse_split + h * p.seqlen_q + s;
  const float* o_parts = p.o_partial + b * p.splits * o_split + s * o_row + h * p.headdim;

  float max_lse = -infinity();
  for (int i = lane; i < p.splits; i += 32) max_lse = fmaxf(max_lse, lse_parts[i * lse_split]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, offset));
  float sum = 0.f;
  if (max_lse != -infinity()) {
    for (int i = lane; i < p.splits; i += 32) sum += __expf(lse_parts[i * lse_split] - max_lse);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float lse = sum > 0.f ? max_lse + __logf(sum) : -infinity();
  if (lane == 0 && p.lse != nullptr) p.lse[b * p.lse_stride_b + h * p.lse_stride_h + s] = lse;

  TOut* out = static_cast<TOut*>(p.out) + b * p.o_stride_b + s * p.o_stride_s + h * p.o_stride_h;
  for (int col = 4 * lane; col < p.headdim; col += 128) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < p.splits; ++i) {
      const float part_lse = lse_parts[i * lse_split];
      if (part_lse == -infinity()) continue;  // (also every part of a row that saw no key)
      const float weight = __expf(part_lse - lse);
      const float4 o = *reinterpret_cast<const float4*>(o_parts + i * o_split + col);
      acc[0] += weight * o.x;
      acc[1] += weight * o.y;
      acc[2] += weight * o.z;
      acc[3] += weight * o.w;
    }
    st_global_v2(out + col, make_uint2(pack2<TOut>(acc[0], acc[1]), pack2<TOut>(acc[2], acc[3])));
  }
}

}  // namespace cuflash
