// Programmatic dependent launch (PTX ISA, griddepcontrol; kernels launched so by
// cuflash/driver.py, DependentLaunch). Both instructions are no-ops in a grid launched without the
// dependency, and compile to nothing below sm_90 (quantize_fp8 also runs on sm_89).
#pragma once

namespace cuflash {

// The kernel after this one in the stream, launched as a programmatic dependent, may start once
// every CTA of this grid has run this or exited (its griddepcontrol.wait still waits for this grid
// to complete). Once per CTA is enough.
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Waits until the grid this one depends on has completed and its memory operations are visible
// (to this thread, and to the TMA loads it issues after).
__device__ __forceinline__ void griddepcontrol_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A link of a chain of kernels each launched as the programmatic dependent of the one before
// (fwd_quantized_sm90: the quantizers of q, k and v, then the attention kernel, which waits for
// them before it reads anything): made at a kernel's start, it lets the next kernel start as this
// grid's CTAs have all started, and it keeps each thread from exiting before the kernel before
// has completed. A grid completes after its predecessor, so the last kernel's wait covers the
// whole chain: a wait covers only the grid one link back, and a link that finished first would
// otherwise leave the one before it still writing.
struct ChainLink {
  __device__ __forceinline__ ChainLink() { griddepcontrol_launch_dependents(); }
  __device__ __forceinline__ ~ChainLink() { griddepcontrol_wait(); }
  ChainLink(const ChainLink&) = delete;
  ChainLink& operator=(const ChainLink&) = delete;
};

}  // namespace cuflash
