// Element types (16-bit, and e4m3 as opaque bytes) and their conversions, written with PTX so that
// no CUDA toolkit header is needed: NVRTC compiles cuflash's sources with nothing on its include
// path but cuda_src/.
#pragma once

namespace cuflash {

// No <cmath> under NVRTC without the toolkit headers: infinity from its bits.
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

// The larger of a and b: fmaxf for floats (a NaN loses to a number), max for ints.
__device__ __forceinline__ float max2(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ int max2(int a, int b) { return max(a, b); }

// The sum, or the maximum (of floats or ints), of x over each aligned group of kLanes lanes (a power
// of two up to 32), every lane of a group getting its group's: a butterfly of shuffles, nearest
// lanes first.
template <int kLanes>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
template <int kLanes, typename T>
__device__ __forceinline__ T lanes_max(T x) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2) x = max2(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

struct half_t { unsigned short bits; };
struct bfloat16_t { unsigned short bits; };
struct e4m3_t { unsigned char bits; };  // float8_e4m3fn

__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

// bf16 is the high half of an fp32: widening is a shift, exact on every arch.
__device__ __forceinline__ float to_float(bfloat16_t x) { return __uint_as_float(static_cast<unsigned>(x.bits) << 16); }

// Two floats to two e4m3 (round to nearest even, saturating to +-448; sm_89+): hi in the high byte.
__device__ __forceinline__ unsigned short e4m3x2(float hi, float lo) {
  unsigned short packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// Four floats to four e4m3 in one register, a in the lowest byte.
__device__ __forceinline__ unsigned pack4_e4m3(float a, float b, float c, float d) {
  return static_cast<unsigned>(e4m3x2(b, a)) | (static_cast<unsigned>(e4m3x2(d, c)) << 16);
}

// The lowest bytes of a, b, c, d (e4m3 codes: online_softmax_codes) in that order from the lowest.
__device__ __forceinline__ unsigned pack4_low_bytes(unsigned a, unsigned b, unsigned c, unsigned d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// n / d for 0 <= n < 2^31 without a division: q = umulhi(n, mul) >> shift with mul = ceil(2^p / d),
// p = 31 + ceil(log2 d), shift = p - 32 (exact over that range; mul = 0 stands for d = 1). The host
// computes the pair (cuflash/kernels/__init__.py, fast_divisor); a runtime integer division costs
// ~20 instructions and an SFU reciprocal on the way.
struct FastDivisor {
  unsigned mul;
  int shift;
};
__device__ __forceinline__ int fast_div(int n, FastDivisor d) {
  return d.mul ? static_cast<int>(__umulhi(static_cast<unsigned>(n), d.mul) >> d.shift) : n;
}

// kWords 32-bit words of 16-bit T pairs (the lower half first) as 2 kWords floats.
template <typename T, int kWords>
__device__ __forceinline__ void words_as_float(const unsigned (&words)[kWords], float (&f)[2 * kWords]) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    f[2 * i] = to_float(T{static_cast<unsigned short>(words[i] & 0xffffu)});
    f[2 * i + 1] = to_float(T{static_cast<unsigned short>(words[i] >> 16)});
  }
}

// 2 kWords consecutive 16-bit elements at p as kWords words, element by element (p need not be
// aligned for a wider load).
template <int kWords, typename T>
__device__ __forceinline__ void load_words_elementwise(const T* p, unsigned (&words)[kWords]) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = p[2 * i].bits | static_cast<unsigned>(p[2 * i + 1].bits) << 16;
}

// Load kN consecutive 16-bit elements as floats with the widest access kN allows: one 16-byte
// load for 8 elements (the caller guarantees 16-byte alignment), element-wise otherwise.
template <int kN, typename T>
__device__ __forceinline__ void load_as_float(const T* __restrict__ p, float (&f)[kN]) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  if constexpr (kN == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned words[4] = {u.x, u.y, u.z, u.w};
    words_as_float<T>(words, f);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) f[i] = to_float(p[i]);
  }
}

}  // namespace cuflash
