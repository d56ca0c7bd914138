// FP8 quantization for attention inputs (cuflash.quantize_fp8): x (batch, seqlen, nheads, headdim)
// fp16/bf16 -> x8 e4m3 and descale float32 with x ~ x8 * descale, descale = amax / 448 (at least
// the smallest normal float) over each group of rows of a head: the whole head (block == 0,
// descale (batch, nheads)) or blocks of `block` rows (block == 128 from cuflash: descale (batch,
// nheads, nblocks), nblocks = ceil(seqlen / block), one scale per block, the last block possibly
// short). kHadamard first multiplies every row by diag(signs) H / sqrt(headdim) (H the Sylvester
// Hadamard matrix, headdim == kHeadDim a power of two): the semantics are reference.quantize_fp8's.
//
// One CTA per (group, head, batch), writing the group's one descale; one warp per row at a time,
// lane l holding elements [l * kE, l * kE + kE) (kE = kHeadDim / 32). Two passes over the group's
// rows: the first finds the amax (of the transformed rows), the second converts; the rows are
// read twice (the second time mostly from L2) rather than held, so any group length works. The
// transform is the fast Walsh-Hadamard butterfly: strides below kE within a lane's registers, the
// others across lanes with shuffles.
#include "common/types.cuh"

namespace cuflash {

constexpr float kE4m3Max = 448.f;
constexpr float kSmallestNormal = 1.17549435e-38f;  // FLT_MIN, 2^-126

struct QuantizeFp8Params {
  const void* x;
  unsigned char* x8;
  float* descale;
  long long x_stride_b, x_stride_s, x_stride_h;      // elements
  long long x8_stride_b, x8_stride_s, x8_stride_h;   // elements (bytes)
  unsigned long long signs[4];                       // bit j set: element j of a row is negated
  int seqlen, nheads, headdim, block;                // block: rows per scale, 0 for the whole head
};
static_assert(sizeof(QuantizeFp8Params) == 120, "keep in step with cuflash/kernels/quantize_fp8.py");

template <typename T, int kHeadDim, bool kHadamard>
__device__ __forceinline__ void load_row(const QuantizeFp8Params& p, const T* row, int lane, float (&v)[kHeadDim / 32]) {
  constexpr int kE = kHeadDim / 32;
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const int j = lane * kE + e;
    v[e] = j < p.headdim ? to_float(row[j]) : 0.f;
  }
  if constexpr (kHadamard) {
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int j = lane * kE + e;
      if ((p.signs[j / 64] >> (j % 64)) & 1ull) v[e] = -v[e];
    }
#pragma unroll
    for (int s = 1; s < kE; s *= 2) {  // partners in this lane's registers
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        if (e & s) continue;
        const float a = v[e], b = v[e + s];
        v[e] = a + b;
        v[e + s] = a - b;
      }
    }
#pragma unroll
    for (int s = kE; s < kHeadDim; s *= 2) {  // partners in lane ^ (s / kE)
      const bool upper = lane & (s / kE);
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, v[e], s / kE);
        v[e] = upper ? other - v[e] : v[e] + other;
      }
    }
    const float norm = rsqrtf(static_cast<float>(kHeadDim));
#pragma unroll
    for (int e = 0; e < kE; ++e) v[e] *= norm;
  }
}

template <typename T, int kHeadDim, bool kHadamard, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) quantize_fp8(const __grid_constant__ QuantizeFp8Params p) {
  static_assert(kHeadDim % 64 == 0 && (kHeadDim & (kHeadDim - 1)) == 0 && kHeadDim <= 256,
                "a power-of-two head dim of 64 to 256: an even number of elements per lane");
  constexpr int kE = kHeadDim / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int h = blockIdx.y, b = blockIdx.z;
  const int row0 = p.block ? blockIdx.x * p.block : 0;
  const int row1 = p.block ? min(row0 + p.block, p.seqlen) : p.seqlen;
  const T* x = static_cast<const T*>(p.x) + b * p.x_stride_b + h * p.x_stride_h;

  float amax = 0.f;
  for (int r = row0 + warp; r < row1; r += kWarps) {
    float v[kE];
    load_row<T, kHeadDim, kHadamard>(p, x + r * p.x_stride_s, lane, v);
#pragma unroll
    for (int e = 0; e < kE; ++e) amax = fmaxf(amax, fabsf(v[e]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  __shared__ float warp_amax[kWarps];
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
  // At least the smallest normal float: a smaller descale is flushed to zero here (the module is
  // compiled with -ftz), which would turn the division below into inf / NaN.
  const float descale = amax > 0.f ? fmaxf(amax / kE4m3Max, kSmallestNormal) : 1.f;

  unsigned char* x8 = p.x8 + b * p.x8_stride_b + h * p.x8_stride_h;
  const int nblocks = p.block ? (p.seqlen + p.block - 1) / p.block : 1;  // == gridDim.x
  if (threadIdx.x == 0) p.descale[(static_cast<long long>(b) * p.nheads + h) * nblocks + blockIdx.x] = descale;
  for (int r = row0 + warp; r < row1; r += kWarps) {
    float v[kE];
    load_row<T, kHeadDim, kHadamard>(p, x + r * p.x_stride_s, lane, v);
    unsigned char* out = x8 + r * p.x8_stride_s + lane * kE;
    if (lane * kE < p.headdim) {  // a head dim below kHeadDim (a multiple of 8) ends on a lane boundary
#pragma unroll
      for (int e = 0; e < kE; e += 2) {
        // The division, not a multiply by 1/descale: x / descale is what the reference rounds.
        *reinterpret_cast<unsigned short*>(out + e) = e4m3x2(v[e + 1] / descale, v[e] / descale);
      }
    }
  }
}

}  // namespace cuflash
