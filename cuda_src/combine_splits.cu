// Split-KV's second pass (fwd_sm90.cu, kSplitKV): each part of a row's keys left its O, normalised
// over that part, and its LSE as float32 partials; the row's O is their sum weighted by
// exp(lse_part - lse), with lse the log of the sum of exp(lse_part). One warp a query row, 4 columns
// a lane (float4), the parts kChunk at a time: a chunk's LSEs (a lane each) and its O partials are
// copied to shared memory together (cp.async), then merged online (running maximum and sum, the
// accumulators rescaled when the maximum moves), so that a row costs one round trip to memory per
// chunk, not one per part. (One part after another, each part's weight computed before its load,
// this kernel took 4.3-6.4 us a call on H100 at batch 1; now 2.0-2.5.) A part whose rows saw no
// key has lse -inf and weight 0 (its partial O is not used); a row no part saw gets out 0 and lse
// -inf, as the forward's contract says.
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
  constexpr int kChunk = 16;  // parts whose O partials a lane has in flight at once
  __shared__ float4 staged[kThreads / 32][kChunk][32];  // a warp's, a part's, a lane's 4 columns
  __shared__ float staged_lse[kThreads / 32][32];        // a warp's, a part's LSE (a lane each)
  // (b * nheads + h) * seqlen_q + s; the thread index in 64 bits (rows < 2^31: the launcher checks)
  const int row = static_cast<int>((static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (row >= p.rows) return;
  const int bh = row / p.seqlen_q, s = row - bh * p.seqlen_q;
  const int b = bh / p.nheads, h = bh - b * p.nheads;
  const long long lse_split = static_cast<long long>(p.nheads) * p.seqlen_q;  // between parts
  const long long o_row = static_cast<long long>(p.nheads) * p.headdim;
  const long long o_split = p.seqlen_q * o_row;
  const float* lse_parts = p.lse_partial + b * p.splits * lse_split + h * p.seqlen_q + s;
  const float* o_parts = p.o_partial + b * p.splits * o_split + s * o_row + h * p.headdim;

  TOut* out = static_cast<TOut*>(p.out) + b * p.o_stride_b + s * p.o_stride_s + h * p.o_stride_h;
  // (every lane runs every pass, for the shuffles; lanes past the head dim load and store nothing)
  for (int pass = 0; 128 * pass < p.headdim; ++pass) {
    const int col = 128 * pass + 4 * lane;
    const bool in_row = col < p.headdim;
    float row_max = -infinity(), row_sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int base = 0; base < p.splits; base += kChunk) {
      const int parts = min(kChunk, p.splits - base);
      // The chunk's LSEs (a lane each) and O partials (this lane's 4 columns) copied to shared
      // memory, all in flight at once (as loads into registers, the compiler issued each next to
      // its use); zeros past the parts or the row.
      cp_async_4(smem_u32(&staged_lse[warp][lane]), lse_parts + (base + min(lane, parts - 1)) * lse_split, lane < parts);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float* src = o_parts + (base + min(j, parts - 1)) * o_split + min(col, p.headdim - 4);
        cp_async_16(smem_u32(&staged[warp][j][lane]), src, j < parts && in_row);
      }
      cp_async_commit();
      cp_async_wait<0>();  // (each lane reads only the slots it filled)
      const float part_lse = lane < parts ? staged_lse[warp][lane] : -infinity();
      const float new_max = fmaxf(row_max, lanes_max<32>(part_lse));
      // (while no part has seen a key, every weight is 0: subtract 0 instead of -inf, no NaN)
      const float base_max = new_max == -infinity() ? 0.f : new_max;
      const float rescale = __expf(row_max - base_max);  // 0 while row_max is -inf
      const float weight = part_lse == -infinity() ? 0.f : __expf(part_lse - base_max);
      row_sum = row_sum * rescale + lanes_sum<32>(weight);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= rescale;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float w = __shfl_sync(0xffffffffu, weight, j);
        if (j < parts && w != 0.f) {
          const float4 o = staged[warp][j][lane];
          acc[0] = fmaf(w, o.x, acc[0]);
          acc[1] = fmaf(w, o.y, acc[1]);
          acc[2] = fmaf(w, o.z, acc[2]);
          acc[3] = fmaf(w, o.w, acc[3]);
        }
      }
      row_max = new_max;
    }
    const float inv = row_sum > 0.f ? 1.f / row_sum : 0.f;
    if (col == 0 && p.lse != nullptr) {  // lane 0 of the first pass
      p.lse[b * p.lse_stride_b + h * p.lse_stride_h + s] = row_sum > 0.f ? row_max + __logf(row_sum) : -infinity();
    }
    if (in_row) {
      st_global_v2(out + col, make_uint2(pack2<TOut>(acc[0] * inv, acc[1] * inv), pack2<TOut>(acc[2] * inv, acc[3] * inv)));
    }
  }
}

}  // namespace cuflash
