// e4m3 V (batch, seqlen, heads, headdim), any token / head / batch strides, to V^T (batch, heads,
// headdim, seqlen_pad), contiguous, for the FP8 forward's pre-transposed path (fwd_sm90.cu,
// kVPreTransposed): its producer then loads V^T blocks with TMA like K, and no warp transposes in
// shared memory. seqlen_pad is seqlen rounded up to 16 (TMA's rows are 16-byte multiples); the keys
// in between are written as zeros (masked in the kernel, but 0 x NaN would not be 0).
// Within each group of 16 keys, position 4c + q holds key 2c + (q & 1) + 8 (q >> 1): the order in
// which the S accumulators pack into P's e4m3 A operand (fwd_sm90.cu, pack_p), so P needs no
// shuffles; the in-kernel transpose writes the same order.
// A thread takes one key group and one 4-byte column of the head dim: 16 word loads (keys) and 4
// 16-byte stores (head-dim rows). Pairs of lanes take neighbouring key groups, so each row a warp
// stores gets 32 contiguous bytes (whole sectors), and the 16 pairs neighbouring columns (64
// contiguous bytes of each key read). Memory-bound: one read and one write of V.
#include "common/sm90.cuh"
#include "common/types.cuh"

namespace cuflash {

struct TransposeVFp8Params {
  const unsigned char* v;
  unsigned char* vt;
  long long v_stride_b, v_stride_s, v_stride_h;  // bytes (e4m3 elements)
  int seqlen, seqlen_pad, nheads, headdim;       // headdim: a multiple of 4
};
static_assert(sizeof(TransposeVFp8Params) == 56, "TransposeVFp8Params must match TRANSPOSE_V_PARAMS in fwd_sm90.py");

template <int kThreads>
__global__ void __launch_bounds__(kThreads) transpose_v_fp8(const __grid_constant__ TransposeVFp8Params p) {
  // The attention kernel, launched as this pass's programmatic dependent, may take SMs as this
  // pass leaves them (its producer waits for the pass to complete before loading V^T).
  griddepcontrol_launch_dependents();
  const int h = blockIdx.y, b = blockIdx.z;
  const int words = p.headdim / 4;
  const int index = blockIdx.x * kThreads + threadIdx.x;
  const int pair = index / 2;
  const int w = pair % words, g = 2 * (pair / words) + index % 2;
  if (16 * g >= p.seqlen_pad) return;
  const unsigned char* src = p.v + b * p.v_stride_b + h * p.v_stride_h + 4 * w;
  unsigned x[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int key = 16 * g + k;
    x[k] = key < p.seqlen ? *reinterpret_cast<const unsigned*>(src + key * p.v_stride_s) : 0u;
  }
  unsigned char* dst = p.vt + ((static_cast<long long>(b) * p.nheads + h) * p.headdim + 4 * w) * p.seqlen_pad + 16 * g;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // head-dim row 4w + i: byte i of every key's word
    const unsigned lo_sel = i | (i + 4) << 4;  // (byte i of a, byte i of b) in the low half
    unsigned out[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const unsigned lo = __byte_perm(x[2 * c], x[2 * c + 1], lo_sel);          // keys 2c, 2c + 1
      const unsigned hi = __byte_perm(x[2 * c + 8], x[2 * c + 9], lo_sel);      // keys 2c + 8, 2c + 9
      out[c] = __byte_perm(lo, hi, 0x5410);
    }
    *reinterpret_cast<uint4*>(dst + static_cast<long long>(i) * p.seqlen_pad) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

}  // namespace cuflash
