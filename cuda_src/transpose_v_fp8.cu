// e4m3 V (batch, seqlen, heads, headdim), any token / head / batch strides, to V^T (batch, heads,
// headdim, seqlen_pad), contiguous, for the FP8 forward's pre-transposed path (fwd_sm90.cu,
// kVPreTransposed): its producer then loads V^T blocks with TMA like K, and no warp transposes in
// shared memory. seqlen_pad is seqlen rounded up to 16 (TMA's rows are 16-byte multiples); the keys
// in between are written as zeros (masked in the kernel, but 0 x NaN would not be 0).
// Within each group of 16 keys, position 4c + q holds key 2c + (q & 1) + 8 (q >> 1): the order in
// which the S accumulators pack into P's e4m3 A operand (fwd_sm90.cu, pack_p), so P needs no
// shuffles; the in-kernel transpose writes the same order.
// Memory-bound: one read and one write of V.
#include "common/grid_dependency.cuh"
#include "common/types.cuh"

namespace cuflash {

struct TransposeVFp8Params {
  const unsigned char* v;
  unsigned char* vt;
  long long v_stride_b, v_stride_s, v_stride_h;  // bytes (e4m3 elements)
  int seqlen, seqlen_pad, nheads, headdim;       // headdim: a multiple of 16
};
static_assert(sizeof(TransposeVFp8Params) == 56, "TransposeVFp8Params must match TRANSPOSE_V_PARAMS in fwd_sm90.py");

// A thread takes one key group and one 16-byte chunk of the head dim (16 dims): 16 vector loads
// (keys) and 16 vector stores (head-dim rows), 256 bytes in flight. kGroupRun lanes take
// neighbouring key groups of one chunk, so each row a warp stores gets 16 kGroupRun contiguous bytes
// and each key row it loads up to 512 / kGroupRun. V is read once: its loads stream past L1.
template <int kThreads, int kGroupRun>
__global__ void __launch_bounds__(kThreads) transpose_v_fp8(const __grid_constant__ TransposeVFp8Params p) {
  // The attention kernel, launched as this pass's programmatic dependent, may take SMs as this
  // pass leaves them (its producer waits for the pass to complete before loading V^T).
  griddepcontrol_launch_dependents();
  const int h = blockIdx.y, b = blockIdx.z;
  const int run = kGroupRun * (p.headdim / 16);  // units of a run of kGroupRun key groups, chunk-major
  const int unit = blockIdx.x * kThreads + threadIdx.x;
  const int g = unit / run * kGroupRun + unit % kGroupRun, chunk = unit % run / kGroupRun;
  if (16 * g >= p.seqlen_pad) return;
  const unsigned char* src = p.v + b * p.v_stride_b + h * p.v_stride_h + 16 * chunk;
  unsigned x[16][4];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int key = 16 * g + k;
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (key < p.seqlen) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                   : "l"(src + key * p.v_stride_s));
    }
    x[k][0] = w.x, x[k][1] = w.y, x[k][2] = w.z, x[k][3] = w.w;
  }
  unsigned char* dst = p.vt + ((static_cast<long long>(b) * p.nheads + h) * p.headdim + 16 * chunk) * p.seqlen_pad + 16 * g;
#pragma unroll
  for (int d = 0; d < 16; ++d) {  // head-dim row 16 chunk + d: byte d % 4 of word d / 4 of every key
    const int word = d / 4;
    const unsigned lo_sel = d % 4 | (d % 4 + 4) << 4;  // (byte of a, byte of b) in the low half
    unsigned out[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const unsigned lo = __byte_perm(x[2 * c][word], x[2 * c + 1][word], lo_sel);      // keys 2c, 2c + 1
      const unsigned hi = __byte_perm(x[2 * c + 8][word], x[2 * c + 9][word], lo_sel);  // keys 2c + 8, 2c + 9
      out[c] = __byte_perm(lo, hi, 0x5410);
    }
    *reinterpret_cast<uint4*>(dst + static_cast<long long>(d) * p.seqlen_pad) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

}  // namespace cuflash
