// The varlen calls' cu_seqlens checked on the GPU, on the caller's stream, before the attention
// kernel that reads them: a host copy of their values would synchronise every call and cannot be
// taken while a CUDA graph is being captured, and under jax.jit the values are unknown on the
// host. The rules and the messages are reference.check_cu_seqlens' (the host arrays' check): start
// at 0, non-decreasing, end at the packed length, no sequence longer than max_seqlen (the kernels'
// grids cover max_seqlen rows: a longer sequence would be cut short). A bad array stops the program
// with a device-side assertion after printing which rule it broke (the CUDA context is then lost, as
// after PyTorch's own device-side assertions); the attention kernel queued behind never runs.
//
// One block: the threads stride over the sequences, the first decreasing step and the longest
// sequence of each array gathered in shared memory; thread 0 reports. printf passes its arguments
// through a local buffer (this kernel's stack frame, on the error path only).

namespace cuflash {

struct CuSeqlensRules {
  const int* cu;       // batch + 1 prefix sums
  const char* name;    // "cu_seqlens_q"
  const char* max_name;
  int total;           // the packed length: rows of q (or k)
  int max_seqlen;
};

// Thread 0: false after printing the first rule `r` breaks (in reference.check_cu_seqlens' order).
__device__ bool report_broken_rule(const char* op, const CuSeqlensRules& r, int batch, int first_decrease,
                                   int longest) {
  if (r.cu[0] != 0) {
    printf("cuflash.%s: %s must start at 0; got %d\n", op, r.name, r.cu[0]);
  } else if (first_decrease < batch) {
    const int i = first_decrease;
    printf("cuflash.%s: %s must be non-decreasing; %s[%d] = %d < %s[%d] = %d\n", op, r.name, r.name, i + 1,
           r.cu[i + 1], r.name, i, r.cu[i]);
  } else if (r.cu[batch] != r.total) {
    printf("cuflash.%s: %s[-1] = %d must equal the packed length %d\n", op, r.name, r.cu[batch], r.total);
  } else if (longest > r.max_seqlen) {
    printf("cuflash.%s: %s = %d is smaller than the longest sequence in %s (%d)\n", op, r.max_name, r.max_seqlen,
           r.name, longest);
  } else {
    return true;
  }
  return false;
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) check_cu_seqlens(const int* __restrict__ cu_seqlens_q,
                                                             const int* __restrict__ cu_seqlens_k, int batch,
                                                             int total_q, int total_k, int max_seqlen_q,
                                                             int max_seqlen_k, bool backward) {
  const CuSeqlensRules rules[2] = {{cu_seqlens_q, "cu_seqlens_q", "max_seqlen_q", total_q, max_seqlen_q},
                                   {cu_seqlens_k, "cu_seqlens_k", "max_seqlen_k", total_k, max_seqlen_k}};
  __shared__ int first_decrease[2], longest[2];
  if (threadIdx.x < 2) {
    first_decrease[threadIdx.x] = batch;  // none
    longest[threadIdx.x] = 0;
  }
  __syncthreads();
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    for (int i = threadIdx.x; i < batch; i += kThreads) {
      const long long length = static_cast<long long>(rules[a].cu[i + 1]) - rules[a].cu[i];
      if (length < 0) {
        atomicMin(&first_decrease[a], i);
      } else {
        atomicMax(&longest[a], static_cast<int>(min(length, 0x7fffffffLL)));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const char* op = backward ? "attention_varlen_backward" : "attention_varlen";
    bool valid = true;
#pragma unroll
    for (int a = 0; a < 2 && valid; ++a) valid = report_broken_rule(op, rules[a], batch, first_decrease[a], longest[a]);
    if (!valid) __assertfail("cu_seqlens are valid (cuflash's message above says which rule they break)",
                             "cuflash/cuda_src/check_cu_seqlens.cu", __LINE__, op, 1);
  }
}

}  // namespace cuflash
