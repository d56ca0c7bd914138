// PTX wrappers for the sm_90a path: mbarriers, TMA loads, bulk reductions, shared-memory matrix
// descriptors, wgmma fences and waits, setmaxnreg and named barriers (one wrapper per instruction;
// the wgmma.mma_async instructions themselves are in wgmma.cuh, generated), and the layout facts
// the sm_90a kernels share. Facts and sources behind each one: shared/notes/hopper.md (sections
// named below).
#pragma once

#include "grid_dependency.cuh"
#include "sm80.cuh"
#include "wgmma.cuh"

namespace cuflash {

// A CUtensorMap as the kernel receives it: 128 opaque bytes, 64-byte aligned, passed by value as a
// __grid_constant__ parameter so TMA reads it from the parameter space.
struct __align__(64) TmaMap {
  unsigned long long bits[16];
};

// ---------------------------------------------------------------- mbarrier (hopper.md section 6)

__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (TMA) and the other threads; follow with
// __syncthreads().
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival for the calling warp, once every lane is done with what the barrier releases (lanes'
// own shared-memory reads or writes before it; after a wgmma wait the warp is converged anyway).
__device__ __forceinline__ void mbarrier_arrive_warp(unsigned bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbarrier_arrive(bar);
}
// Arrive and add `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Spin until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// A copy of x the compiler cannot see through: values derived from it are computed where they are
// used instead of being hoisted (and kept live, or spilled) across a long loop.
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// threadIdx.x read again from its special register: nothing is kept live for it (opaque(tid)
// keeps tid itself live, which ptxas may place in a register the producer gives away).
__device__ __forceinline__ unsigned thread_index_again() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}

// ---------------------------------------------------------------- shared memory by address

__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_shared_b32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v2_f32(unsigned addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(unsigned addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// Four 8 x 8 matrices of 16-bit elements from registers to shared memory, lanes 8i..8i+7 giving
// the row addresses (16 bytes each) of matrix i; register i holds row lane / 4, columns
// 2 (lane % 4) and 2 (lane % 4) + 1 of matrix i (ldmatrix_x4's layout). sm_90.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// Orders this thread's ordinary (generic-proxy) shared-memory accesses before later accesses by the
// async proxy (TMA, wgmma) that another thread's barrier releases.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---------------------------------------------------------------- TMA (hopper.md section 5)

// One box of a rank-1, rank-3 or rank-4 tensor map into shared memory; completes on `bar`
// (transaction bytes: the whole box, zero-filled parts included). Coordinates innermost first, in
// elements; out-of-bounds elements read as zero. Seen on H100: an innermost start that is not
// 16-byte aligned ends the kernel (illegal instruction), and an unswizzled box needs a 128-byte
// aligned destination (misaligned shared address otherwise).
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_1d(unsigned dst, const TmaMap* map, unsigned bar, int c0) {
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap* map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// A box of q, k, v or dout (cuflash/kernels/fwd_sm90.py, tensor_map): columns `col`.. of head `head`
// from token `row` of batch `batch`; varlen maps are rank 3 over the tokens of all sequences (row
// counts from the first, batch is not used), dense ones rank 4.
template <bool kVarlen>
__device__ __forceinline__ void tma_load_tokens(unsigned dst, const TmaMap* map, unsigned bar, int col, int head, int row,
                                                int batch) {
  if constexpr (kVarlen) {
    tma_load_3d(dst, map, bar, col, head, row);
  } else {
    tma_load_4d(dst, map, bar, col, head, row, batch);
  }
}
// The same box into L2 only (no shared memory, no barrier): a hint that a later load will want it.
__device__ __forceinline__ void tma_prefetch_4d(const TmaMap* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(map), "r"(c0),
               "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// One box of a rank-4 tensor map from shared memory (the layout tma_load_4d writes) to global, by
// the issuing thread's bulk async-group (as bulk_reduce_add_f32); elements out of bounds are not
// written. src written by other threads needs their fence_proxy_async_shared() and a barrier first.
__device__ __forceinline__ void tma_store_4d(const TmaMap* map, unsigned src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// dst[i] += src[i] over `bytes` / 4 floats, shared memory to global, by the async proxy: the
// issuing thread's bulk async-group (commit, then wait .read before reusing src, plain wait before
// exit). dst and src 16-byte aligned, bytes a multiple of 16; src written by other threads needs
// their fence_proxy_async_shared() and a barrier first.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk groups have read their sources (all but the newest kPending groups).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// ... and are complete (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---------------------------------------------------------------- wgmma (hopper.md sections 1-3)

// Byte offset of 16-byte chunk `chunk` (0..7) of 128-byte row `row` in a tile of such rows that
// starts on a 1024-byte boundary, in TMA's and wgmma's 128-byte swizzle (chunk c of row r sits at
// c ^ (r % 8)).
__device__ __forceinline__ unsigned sw128_offset(unsigned row, unsigned chunk) {
  return row * 128 + ((chunk ^ (row % 8)) << 4);
}
// Descriptor offset (16-byte units) of k step kk (32 bytes of each row) in a K-major tile of 128-byte
// swizzle atoms of `rows` rows each: 4 steps an atom.
__device__ __forceinline__ unsigned k_major_step(int kk, int rows) {
  return static_cast<unsigned>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4);
}

// Shared-memory matrix descriptor for a 128-byte-swizzled operand (swizzle code 1); lbo and sbo in
// bytes. Only the start address changes when stepping along K, so callers build one descriptor
// per tile and add (bytes >> 4) to it.
__device__ __forceinline__ unsigned long long smem_descriptor_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<unsigned long long>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Before the first wgmma, and between register writes (zeroing or rescaling accumulators,
// writing the A operand) and a wgmma that reads those registers.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The wait and the fence name no registers: without this after a wait the compiler may read
// accumulators before it, and without this before a fence it may write wgmma operands (rescale O,
// pack P) after it (ptxas then injects a fence of its own: note C7519).
template <int kN>
__device__ __forceinline__ void pin_registers(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kN, int kM>
__device__ __forceinline__ void pin_registers(unsigned (&r)[kN][kM]) {
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < kM; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// ---------------------------------------------------------------- warp specialisation (sections 6, 7)

// Register budgets after the split, per consumer count: setmaxnreg moves registers between the
// warpgroups of a CTA, so producer + consumers must fit what the launch gave the CTA
// (__launch_bounds__ rounds 65536 / threads down to a multiple of 8 per thread: 168 at 384
// threads). fwd_sm90 at head dim 256 holds a 64 x 256 fp32 O accumulator (128 registers), bwd_sm90
// dK and dV (128 at head dim 128). The producer's 24 (32 with three consumers) also serve fwd_sm90's
// e4m3 transposing warps (written for it: see their loop).
template <int kConsumers>
struct RegisterSplit;
template <>
struct RegisterSplit<2> {
  static constexpr int kProducer = 24, kConsumer = 240;
};
// (fwd_sm90's one-consumer split variants: a consumer as many as with two)
template <>
struct RegisterSplit<1> {
  static constexpr int kProducer = 24, kConsumer = 240;
};
template <>
struct RegisterSplit<3> {
  static constexpr int kProducer = 32, kConsumer = 160;
};

template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// Named barriers (ids 1..15; 0 is __syncthreads'); `threads` counts waiters and arrivers. bar.sync
// is the aligned form: all blocking participants of a generation execute this same instruction
// (synccheck reports otherwise; barrier.sync would allow different ones, but in fwd_sm90 it also
// cost 2-3.5% where it replaced bar.sync: benchmarks/NOTES-sm90.md, version 34).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace cuflash
