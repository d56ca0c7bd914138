// PTX wrappers for the sm_80+ tensor-core path: cp.async, ldmatrix, mma.sync m16n8k16, packing
// fp32 pairs into 16-bit pairs, and the fast exp2. One wrapper per instruction, used by every
// sm_80 kernel family.
#pragma once

#include "types.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1. With valid == false nothing is read and the
// destination is zero-filled (src-size 0), which is how tails and padded head dims are masked.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// The same for one 4-byte word (through L1: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices; thread t supplies the address of row t % 8 of matrix t / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<half_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bfloat16_t>(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                      unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two adjacent n8 tiles from one ldmatrix_x4 of B: b = {b0, b1} of the first tile, then of the second.
template <typename T>
__device__ __forceinline__ void mma_16816_x2(float (&d0)[4], float (&d1)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[4]) {
  mma_16816<T>(d0, a, b[0], b[1]);
  mma_16816<T>(d1, a, b[2], b[3]);
}

// Two fp32 values -> one register of two 16-bit values, lo in the low half (round to nearest).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);

template <>
__device__ __forceinline__ unsigned pack2<half_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <>
__device__ __forceinline__ unsigned pack2<bfloat16_t>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// 16 (8) bytes to global memory in one store (ptr 16- (8-) byte aligned): written as C++, a uint4
// store through a pointer stepped in a loop (fwd_sm90) or with computed offsets (bwd_sm80_dq) came
// out as four 4-byte stores, and combine_splits' uint2 store as two.
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_global_v2(void* ptr, uint2 v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(ptr), "r"(v.x), "r"(v.y) : "memory");
}

// *p += a, *(p + 1) += b in global memory, each atomically (p 8-byte aligned): one vector
// reduction on sm_90 and newer, two scalar ones before. (Four consecutive floats a thread, after a
// lane-pair shuffle, measured no faster on H100 and cost registers.)
__device__ __forceinline__ void atomic_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// A load that later loads and stores of the thread cannot overtake, seeing what a release (or a
// fence before a store) of another CTA published: the wait side of a global-memory semaphore.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 2^x on the special-function unit; ex2(-inf) = 0.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe instead of the special-function unit, for a share of a softmax's exponentials
// (e4m3's: benchmarks/NOTES-fp8.md, session 39): a quadratic's 2^frac(x), p(f) = 1 + f (c1 + c2 f),
// fitted for the least largest relative error on [0, 1) with p(0) = 1: 2.1e-3, below e4m3's
// rounding of P (up to 6%), its mean 2e-5; p stays in [1, 2). Adding 1.5 * 2^23 rounding down
// leaves floor(x) in the sum's low mantissa bits; shifted left by 23 they are floor(x) in the
// exponent field, added to p's bits (one IMAD). kFactor: the sum's bits times 2^23 plus a constant
// are those of 2^floor(x) instead, a factor of p (one more instruction, FMUL): in kernels that also
// take the row maxima as integers (quad_row_max_bits), ptxas serialised the wgmmas with the bits
// added (C7511; NOTES-fp8.md, session 42). x at most 127. The clamp makes x of -127 and below (and
// -inf) exactly 0, as ex2.approx.ftz gives; x in (-127, -126) gives a denormal (0 under ftz) or,
// kFactor, 0. A NaN x gives 0 here (NaN on the unit): a softmax's NaN scores still reach its row sum
// through the other columns. Six FMA-pipe and ALU instructions (seven, kFactor) and a FMNMX against
// one MUFU.EX2.
template <bool kFactor = false>
__device__ __forceinline__ float ex2_fma(float x) {
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23, bits 0x4B400000
  x = fmaxf(x, -127.f);
  const float shifted = __fadd_rd(x, kShift);
  const float f = x - (shifted - kShift);
  const float p = fmaf(fmaf(0.32992116f, f, 0.66596729f), f, 1.f);
  if constexpr (kFactor) {
    return p * __uint_as_float(__float_as_uint(shifted) * (1u << 23) + ((127u - 0x4B400000u) << 23));
  } else {
    return __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
  }
}

// The bits of the half equal to v, an integer in [1, 2048) (exact there).
__host__ __device__ constexpr unsigned half_bits_of(unsigned v) {
  unsigned e = 0;
  while (v >> (e + 1)) ++e;
  return ((e + 15) << 10) | ((v << (10 - e)) & 0x3FFu);
}
static_assert(half_bits_of(1) == 0x3C00u && half_bits_of(23) == 0x4DC0u && half_bits_of(1559) == 0x6617u, "");

// 2^(x + kScale) of two floats at once on the FMA pipe, in f16x2 arithmetic, for a share of an e4m3
// softmax's exponentials, whose P is rounded to three mantissa bits next: thirteen instructions a
// pair where ex2_fma takes seven or eight a value. x is rounded to a half (most finely near 0, where
// P is largest: callers pass x <= 0 and put P's offset in kScale), then x = n + f with n = round(x)
// from adding 1536 + 15 + kScale (the sum's low mantissa bits then hold n + 15 + kScale, 2^(n +
// kScale)'s exponent field) and f in [-1/2, 1/2] exactly; 2^f from a cubic fitted in half arithmetic
// on the halves f can be (largest relative error 5.5e-4, mean 3e-5), times 2^(n + kScale) built
// from those bits; then both to float. Rounding x to a half adds up to ln 2 * 2^-11 |x| (1.4e-3 for
// x in (-8, -4]). x is clamped at -(15 + kScale) first, so that the field never goes negative: -inf
// and NaN give 0, and so does every x below -(14.5 + kScale), whose results would lie below fp16's
// normal range (e4m3 flushes far above it). x + kScale at most 15. The results go back to float, not
// on as f16x2: f16x2 values in the S accumulators, or P packed to e4m3 from them, made ptxas
// serialise the wgmmas of fwd_sm90 (C7511, NVRTC 12.9). One asm block: ptxas schedules its
// instructions among the caller's as it would separate ones.
template <int kScale>
__device__ __forceinline__ float2 ex2x2_fma_f16(float x_lo, float x_hi) {
  static_assert(kScale >= 0 && kScale <= 15, "2^kScale * P within fp16's range; the exponent field within 5 bits");
  constexpr unsigned kPair = 0x10001u;  // the same half in both
  constexpr unsigned kBias = 15 + kScale;
  constexpr unsigned kMagic = half_bits_of(1536 + kBias) * kPair;  // its binade has a unit step
  constexpr unsigned kLowest = (0x8000u | half_bits_of(kBias)) * kPair;  // -kBias
  float lo, hi;
  asm("{\n"
      ".reg .b32 x, m, f, p, e;\n"
      ".reg .f16 l, h;\n"
      "cvt.rn.f16x2.f32 x, %3, %2;\n"
      "max.f16x2 x, x, %4;\n"
      "add.rn.f16x2 m, x, %5;\n"  // n + kBias in m's low mantissa bits
      "sub.rn.f16x2 f, m, %5;\n"  // n
      "sub.rn.f16x2 f, x, f;\n"   // x - n, exactly
      "fma.rn.f16x2 p, %6, f, %7;\n"
      "fma.rn.f16x2 p, p, f, %8;\n"
      "fma.rn.f16x2 p, p, f, %9;\n"
      "shl.b32 e, m, 10;\n"  // the field into each half's exponent: 2^(n + kScale)
      "and.b32 e, e, 0x7C007C00;\n"
      "mul.rn.f16x2 p, p, e;\n"
      "mov.b32 {l, h}, p;\n"
      "cvt.f32.f16 %0, l;\n"
      "cvt.f32.f16 %1, h;\n"
      "}"
      : "=f"(lo), "=f"(hi)
      : "f"(x_lo), "f"(x_hi), "r"(kLowest), "r"(kMagic),
        // the cubic's coefficients (of f^3, f^2, f, 1): 0.05517578125, 0.2423095703125, 0.693359375, 1
        "r"(0x2B10u * kPair), "r"(0x33C1u * kPair), "r"(0x398Cu * kPair), "r"(0x3C00u * kPair));
  return make_float2(lo, hi);
}

}  // namespace cuflash
