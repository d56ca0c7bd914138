// Overlap probe: how much one warpgroup's e4m3 wgmma and another warpgroup's ALU or SFU work slow
// each other on one SM (benchmarks/probes/overlap.py runs it; benchmarks/NOTES-fp8.md, session 29).
// A CTA of two warpgroups per SM, each given a role; a GEMM role repeats its loop `iters_gemm`
// times, the others `iters_other` times, and each warpgroup's first thread records the cycles its
// loop took.
//   gemm_ss: the wgmmas of S = Q K^T at head dim 128 with 192-key blocks, as fwd_sm90 issues them
//            (4 x m64n192k32, both operands in shared memory), then a wait: one block's S per
//            iteration (the kernel issues P V's beside them before it waits).
//   gemm_rs: those of O += P V likewise (6 x m64n128k32, P from registers).
//   softmax: 96 scores a thread per iteration, as a block's softmax treats them: FFMA (scale and
//            maximum), MUFU.EX2, FADD (the row sums: two chains, one a row, as a thread holds two rows).
//   mufu, ffma, fmnmx, fadd: 96 independent chains a thread, one instruction each per iteration
//            (an `asm volatile`, and loop-carried so that ptxas cannot hoist it): y = 2^-y, or fma,
//            max or add with constants.
#include "common/sm80.cuh"
#include "common/sm90.cuh"
#include "common/wgmma.cuh"

using namespace cuflash;

enum Role : int { kIdle, kGemmSS, kGemmRS, kSoftmax, kMufu, kFfma, kFmnmx, kFadd };
constexpr int kScores = 96;  // a thread's S accumulators of a 64 x 192 block

__device__ __forceinline__ float gemm_ss(int iters, unsigned long long desc_q, unsigned long long desc_k) {
  float s[kScores];
#pragma unroll
  for (int i = 0; i < kScores; ++i) s[i] = 0.f;
  for (int it = 0; it < iters; ++it) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      Wgmma<e4m3_t, 192>::ss(s, desc_q + k_major_step(kk, 64), desc_k + k_major_step(kk, 192), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(s);
  }
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < kScores; ++i) r += s[i];
  return r;
}

__device__ __forceinline__ float gemm_rs(int iters, unsigned long long desc_vt, unsigned p_source) {
  float o[64];
  unsigned pa[6][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  // P from shared memory (e4m3 0.5 in every byte), so that the compiler cannot rebuild it from
  // constants every iteration: no instruction writes it in the loop.
#pragma unroll
  for (int j = 0; j < 6; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[j][r] = ld_shared_b32(p_source + 4 * (4 * j + r));
  for (int it = 0; it < iters; ++it) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 6; ++kk) {  // 32-byte k steps within V^T's 128-key atom, then the next atom
      Wgmma<e4m3_t, 128>::rs(o, pa[kk], desc_vt + k_major_step(kk, 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(o);
  }
  float r = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) r += o[i];
  return r;
}

__device__ __forceinline__ float softmax(int iters) {
  float x[kScores], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int c = 0; c < kScores; ++c) x[c] = 0.01f * static_cast<float>((threadIdx.x + c) % 37);
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kScores; ++c) {
      x[c] = ex2(fmaf(x[c], -1.f, -1.f));  // 2^(-x - 1): in (0, 1/2] for x >= 0
      sum[c % 2] += x[c];
    }
  }
  return sum[0] + sum[1];
}

template <Role kRole>
__device__ __forceinline__ float chains(int iters) {
  float y[kScores];
#pragma unroll
  for (int c = 0; c < kScores; ++c) y[c] = 0.01f * static_cast<float>((threadIdx.x + c) % 37);
  const float a = 0.5f, b = 0.25f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kScores; ++c) {
      if constexpr (kRole == kMufu) {  // y = 2^-y: stays in [1/2, 1]; the negation folds into MUFU's operand
        asm volatile("{\n.reg .f32 t;\nneg.f32 t, %0;\nex2.approx.ftz.f32 %0, t;\n}" : "+f"(y[c]));
      }
      if constexpr (kRole == kFfma) asm volatile("fma.rn.ftz.f32 %0, %0, %1, %2;" : "+f"(y[c]) : "f"(a), "f"(b));
      if constexpr (kRole == kFmnmx) asm volatile("max.ftz.f32 %0, %0, %1;" : "+f"(y[c]) : "f"(b));
      if constexpr (kRole == kFadd) asm volatile("add.ftz.f32 %0, %0, %1;" : "+f"(y[c]) : "f"(b));
    }
  }
  float r = 0.f;
#pragma unroll
  for (int c = 0; c < kScores; ++c) r += y[c];
  return r;
}

// Shared memory: Q (64 rows), K (192 rows) and V^T (128 rows of 256 keys, two 128-byte atoms), all
// e4m3 0.5, 1024-byte aligned for the 128-byte swizzle.
constexpr unsigned kSharedBytes = (64 + 192 + 2 * 128) * 128 + 1024;

extern "C" __global__ void __launch_bounds__(256, 1)
    overlap_probe(int role0, int role1, int iters_gemm, int iters_other, float* sink, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned base = (static_cast<unsigned>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
  for (unsigned i = threadIdx.x; i < (kSharedBytes - 1024) / 4; i += blockDim.x) st_shared_b32(base + 4 * i, 0x30303030u);
  fence_proxy_async_shared();  // the generic-proxy writes before the wgmmas' async-proxy reads
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const int role = wg == 0 ? role0 : role1;
  const unsigned long long desc_q = smem_descriptor_sw128(base, 16, 1024);
  const unsigned long long desc_k = smem_descriptor_sw128(base + 64 * 128, 16, 1024);
  const unsigned long long desc_vt = smem_descriptor_sw128(base + (64 + 192) * 128, 16, 1024);
  const long long t0 = clock64();
  float r = 0.f;
  switch (role) {
    case kGemmSS: r = gemm_ss(iters_gemm, desc_q, desc_k); break;
    case kGemmRS: r = gemm_rs(iters_gemm, desc_vt, base); break;
    case kSoftmax: r = softmax(iters_other); break;
    case kMufu: r = chains<kMufu>(iters_other); break;
    case kFfma: r = chains<kFfma>(iters_other); break;
    case kFmnmx: r = chains<kFmnmx>(iters_other); break;
    case kFadd: r = chains<kFadd>(iters_other); break;
    default: break;
  }
  const long long t1 = clock64();
  if (r == 12345.f) sink[threadIdx.x] = r;  // (never: keeps the work live)
  if (threadIdx.x % 128 == 0) cycles[2 * blockIdx.x + wg] = t1 - t0;
}
