// FP8 quantization for attention inputs (cuflash.quantize_fp8): x (batch, seqlen, nheads, headdim)
// fp16/bf16 -> x8 e4m3 and descale float32 with x ~ x8 * descale, descale = amax / 448 (at least
// the smallest normal float) over each group of rows of a head: blocks of kBlockRows rows (descale
// (batch, nheads, nblocks), nblocks = ceil(seqlen / kBlockRows), the last block possibly short) or
// the whole head (descale (batch, nheads)). kBlockRows is reference.FP8_BLOCK (128) or, at head dim
// 128 (k and v of attention_fp8 with kv_block=192, and of attention(..., fp8=True) from 2k keys),
// reference.FP8_WIDE_KEY_BLOCK (192: the FP8 forward's key block there, which 128-row blocks would
// straddle). kHadamard first multiplies every row by
// diag(signs) H / sqrt(headdim) (H the Sylvester Hadamard matrix, headdim == kHeadDim a power of
// two): the semantics are reference.quantize_fp8's.
//
// A CTA takes items_per_cta (block of kBlockRows rows, head) items of one batch entry (blockIdx.y),
// item i being block i / nheads of head i % nheads: the heads of a block next to each other, so
// CTAs running together read whole token rows of x, not one head's slice of rows far apart. A
// thread holds chunks of kChunk consecutive elements (16 bytes of x) of one or two rows of an item
// (Layout), all loaded before any is used. Where shared memory allows (kLoadStaged), a thread's
// chunks of the next item are on their way (cp.async into slots of its own) while it converts these:
// against 16-byte loads straight into registers with the next item prefetched into L2, 0.95-0.96x
// the time (0.94x per head, 0.89x on 192-row blocks; H200, session 52). x is read from memory once
// a launch. The amax is a CTA reduction over the held values, which are then converted from
// registers. The transform is the fast Walsh-Hadamard butterfly: strides within a thread's chunks,
// the others across a row's Layout::kLanes lanes with shuffles. Its factor 1 / sqrt(headdim) joins
// the amax and the quotient instead of multiplying every value: that pass is bound by instruction
// issue.
//
// Scales per head take three launches of the same kernel (QuantizeFp8Params::pass): kHeadAmax
// writes each block's amax to a workspace, kHeadScale (a CTA per head) reduces a head's block
// amaxes to its descale, kHeadConvert converts with it; x is read twice. The second and third are
// launched as programmatic dependents of the one before (quantize_fp8.py), each waiting for it
// just before it reads what that one wrote: the third loads its first item of x meanwhile.
#include "common/grid_dependency.cuh"
#include "common/sm80.cuh"
#include "common/types.cuh"

namespace cuflash {

constexpr float kE4m3Max = 448.f;
constexpr float kSmallestNormal = 1.17549435e-38f;  // FLT_MIN, 2^-126

// QuantizeFp8Params::pass
constexpr int kBlockScales = 0;  // one launch: descale per block
constexpr int kHeadAmax = 1;     // per head, first launch: block_amax per block
constexpr int kHeadScale = 2;    // per head, second launch (grid (nheads, batch)): descale per head from block_amax
constexpr int kHeadConvert = 3;  // per head, third launch: x8 with the head's descale

struct QuantizeFp8Params {
  const void* x;
  unsigned char* x8;
  float* descale;
  float* block_amax;                                 // per head: (batch, nheads, nblocks) workspace
  long long x_stride_b, x_stride_s, x_stride_h;      // elements
  long long x8_stride_b, x8_stride_s, x8_stride_h;   // elements (bytes)
  unsigned long long signs[4];                       // bit j set: element j of a row is negated
  int seqlen, nheads, headdim, pass;
  int items_per_cta;  // consecutive items a CTA takes (quantize_fp8.py's _items_split)
};
static_assert(sizeof(QuantizeFp8Params) == 136, "keep in step with cuflash/kernels/quantize_fp8.py");

constexpr int kChunk = 8;  // elements of one 16-byte load

// How a thread's chunks of x reach its registers (the template's kLoads; quantize_fp8.py's LOAD_*):
constexpr int kLoadElements = 0;  // element by element (rows not 16-byte aligned)
constexpr int kLoadVectors = 1;   // one 16-byte load a chunk, when the item is taken
constexpr int kLoadStaged = 2;    // through shared memory, copied (cp.async) kStages - 1 items ahead
constexpr int kStages = 2;        // STAGES: items in a CTA's shared memory

// A thread holds kElements elements: kRows rows (kRowStep apart) by kPieces chunks. Chunk c of a
// row's lane l lies at column kChunk (c kLanes + l), so that each load reads kChunk kLanes
// contiguous elements of a row and each store writes whole 32-byte sectors. Without the transform
// a row has 8 lanes: 128 contiguous bytes a load. With it, as few as keep 64 bytes a load (4, 4, 8
// at head dims 64, 128, 256), so that the Hadamard butterfly crosses lanes for 2, 2 or 3 of its
// strides, where 8 elements of each of 4 rows took 3, 4 or 5: the transform's cost was its
// shuffles (H100, session 31, per-128-row scales: 42 / 48 / 56 us -> 42 / 44 / 49 us for a 16k x
// 2048 bf16 tensor; at 64, one row of 32 elements a thread, two lanes a row with 16-byte stores,
// ran 1.8x slower).
constexpr int kElements = 32;
template <int kHeadDim, bool kHadamard>
struct Layout {
  static constexpr int kLanes = !kHadamard ? 8 : kHeadDim / kElements > 4 ? kHeadDim / kElements : 4;
  static constexpr int kPieces = kHeadDim / (kChunk * kLanes);
  static constexpr int kRows = kElements / (kChunk * kPieces);
  static constexpr int kPieceStep = kChunk * kLanes;  // columns between a thread's chunks
  using Values = float[kRows][kPieces][kChunk];
};
__host__ __device__ constexpr int quantize_threads(int block_rows, int head_dim) {
  return block_rows * head_dim / kElements;
}

// The kChunk elements of a chunk's 16 bytes (`raw`) as floats, each pair of 16-bit elements XORed
// first with its word of `negate` (bit 15 flips the lower element's sign, bit 31 the upper's: the
// transform's signs).
template <typename T>
__device__ __forceinline__ void unpack_chunk(uint4 raw, uint4 negate, float (&v)[kChunk]) {
  static_assert(sizeof(T) == 2 && kChunk == 8, "16-bit elements, 16 bytes a chunk");
  const unsigned words[4] = {raw.x ^ negate.x, raw.y ^ negate.y, raw.z ^ negate.z, raw.w ^ negate.w};
  words_as_float<T>(words, v);
}

// A chunk of x at `at` (rows not 16-byte aligned), element by element.
template <typename T>
__device__ __forceinline__ uint4 load_chunk_elements(const T* at) {
  unsigned words[4];
  load_words_elementwise(at, words);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// x / descale rounded as the reference rounds it (not x times 1 / descale), without a division
// per element: with r = RN(1 / descale) and q = RN(x r) within an ulp of the quotient,
// q + RN(x - q descale) r (the remainder exact in an FMA) is RN(x / descale) (Markstein's theorem)
// for a finite descale and |x / descale| <= 448. (-ftz flushes remainders below FLT_MIN, so with a
// descale under about 2^-90 the quotient may be an fp32 ulp off, which changes an e4m3 code only at
// a tie.) An infinite descale (from an infinite x) takes the division itself, for its NaNs and zeros.
template <bool kFiniteDescale>
__device__ __forceinline__ float divide(float x, float descale, float r) {
  if constexpr (kFiniteDescale) {
    const float q = x * r;
    return fmaf(fmaf(-q, descale, x), r, q);
  } else {
    return x / descale;
  }
}

// A thread's chunks (those at columns below headdim, of rows below seqlen) of x / descale to e4m3,
// 8 bytes a chunk at x8 + row x8_stride_s + column (x8 is cuflash's, contiguous, so 8-byte aligned).
// kHadamard: v holds the transform's sums before their factor `norm` (hadamard_norm), and x / descale
// is RN(v RN(norm / descale)), one multiply: within two fp32 ulps of the quotient, so a code differs
// from divide's only for a quotient that close to a boundary between e4m3 codes. (The reference
// transforms in float64, so no fp32 order of operations would give its codes exactly.) Without the
// transform, divide: the reference's rounding exactly. An infinite descale divides, both ways.
template <bool kFiniteDescale, bool kHadamard, typename L>
__device__ __forceinline__ void store_codes(const typename L::Values& v, float descale, float norm,
                                            unsigned char* x8, long long x8_stride_s, int row0, int row_step,
                                            int seqlen, int col0, int headdim) {
  const float r = (kHadamard ? norm : 1.f) / descale;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) {
    const int row = row0 + i * row_step;
    if (row >= seqlen) break;
#pragma unroll
    for (int c = 0; c < L::kPieces; ++c) {
      const int col = col0 + c * L::kPieceStep;
      if (col >= headdim) break;
      float q[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        q[e] = kHadamard && kFiniteDescale ? v[i][c][e] * r : divide<kFiniteDescale>(v[i][c][e], descale, r);
      }
      *reinterpret_cast<uint2*>(x8 + row * x8_stride_s + col) = make_uint2(pack4_e4m3(q[0], q[1], q[2], q[3]),
                                                                          pack4_e4m3(q[4], q[5], q[6], q[7]));
    }
  }
}

// Into L2 only. Unstaged (kLoadVectors, kLoadElements), a quantize_fp8_vt CTA prefetches each next
// item while it converts the one before: the loads of a lone item per CTA left DRAM half idle (H100, ncu).
__device__ __forceinline__ void prefetch_l2(const void* at) { asm volatile("prefetch.global.L2 [%0];" ::"l"(at)); }

// Item `item` of a batch entry: block `block` of head `h`, a thread's first row of it (quantize_fp8_vt: key) row0.
struct Item {
  int block, h, row0;
};
template <int kBlockRows>
__device__ __forceinline__ Item item_at(int item, int nheads, int row_in_block) {
  const int block = item / nheads;
  return {block, item - block * nheads, block * kBlockRows + row_in_block};
}

// The transform's factor 1 / sqrt(kHeadDim), as a float.
template <int kHeadDim>
__device__ __forceinline__ constexpr float hadamard_norm() {
  return kHeadDim == 64 ? 0.125f : kHeadDim == 128 ? 0.0883883476483184405f : 0.0625f;
}

// H on each of the thread's rows, whose signs unpack_chunk applied (diag(signs) H), without the factor
// hadamard_norm (the caller folds it into the amax and the quotient: a multiply an element fewer):
// the butterfly's strides within a chunk (1, 2, 4), between a thread's chunks (the column bits above
// the lanes'), then across the row's lanes, where the upper lane of a pair takes other - v and the
// lower v + other, as one FMA.
template <int kHeadDim>
__device__ __forceinline__ void hadamard_rows(typename Layout<kHeadDim, true>::Values& v, int lane) {
  using L = Layout<kHeadDim, true>;
#pragma unroll
  for (int i = 0; i < L::kRows; ++i) {
#pragma unroll
    for (int c = 0; c < L::kPieces; ++c) {
#pragma unroll
      for (int s = 1; s < kChunk; s *= 2) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          if (e & s) continue;
          const float lo = v[i][c][e], hi = v[i][c][e + s];
          v[i][c][e] = lo + hi;
          v[i][c][e + s] = lo - hi;
        }
      }
    }
#pragma unroll
    for (int s = 1; s < L::kPieces; s *= 2) {
#pragma unroll
      for (int c = 0; c < L::kPieces; ++c) {
        if (c & s) continue;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          const float lo = v[i][c][e], hi = v[i][c + s][e];
          v[i][c][e] = lo + hi;
          v[i][c + s][e] = lo - hi;
        }
      }
    }
#pragma unroll
    for (int s = 1; s < L::kLanes; s *= 2) {  // partners in lane ^ s of the row's lanes
      const float sign = lane & s ? -1.f : 1.f;
#pragma unroll
      for (int c = 0; c < L::kPieces; ++c) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          const float other = __shfl_xor_sync(0xffffffffu, v[i][c][e], s);
          v[i][c][e] = fmaf(v[i][c][e], sign, other);
        }
      }
    }
  }
}

// The maximum of `value` over the CTA (every thread gets it); warp_amax: kWarps floats of shared
// memory no thread reads or writes between this call and the previous one's reads (see the caller).
template <int kWarps>
__device__ __forceinline__ float cta_max(float value, float* warp_amax) {
  value = lanes_max<32>(value);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = value;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) value = fmaxf(value, warp_amax[w]);
  return value;
}

// amax / 448, but at least the smallest normal float: a smaller descale is flushed to zero here
// (the module is compiled with -ftz), which would turn x / descale into inf / NaN; 1 for amax 0.
__device__ __forceinline__ float descale_of(float amax) {
  return amax > 0.f ? fmaxf(amax / kE4m3Max, kSmallestNormal) : 1.f;
}

// At most 64 registers a thread (1024 / threads CTAs an SM): four CTAs an SM at head dim 64, two at
// 128, whose loads and conversions overlap; 65-73 registers (ptxas's own choice) left one at 128.
// (192-row blocks at 128: 768 threads, one CTA.)
template <typename T, int kBlockRows, int kHeadDim, bool kHadamard, int kLoads>
__global__ void __launch_bounds__(quantize_threads(kBlockRows, kHeadDim),
                                  1024 / quantize_threads(kBlockRows, kHeadDim))
    quantize_fp8(const __grid_constant__ QuantizeFp8Params p) {
  static_assert(kHeadDim % 64 == 0 && (kHeadDim & (kHeadDim - 1)) == 0 && kHeadDim <= 256,
                "a power-of-two head dim of 64 to 256");
  const ChainLink link;  // attention(fp8=True)'s chain of launches (fwd_quantized_sm90); else no-ops
  using L = Layout<kHeadDim, kHadamard>;  // a row stays within a warp
  constexpr int kThreads = quantize_threads(kBlockRows, kHeadDim);
  constexpr int kRowStep = kThreads / L::kLanes;  // rows between a thread's rows
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % L::kLanes, col0 = lane * kChunk;
  const int b = blockIdx.y;
  const int nblocks = p.seqlen / kBlockRows + (p.seqlen % kBlockRows != 0), items = nblocks * p.nheads;
  const int row_in_block = static_cast<int>(threadIdx.x) / L::kLanes;
  const T* x_batch = static_cast<const T*>(p.x) + b * p.x_stride_b + col0;
  __shared__ float warp_amax[2][kWarps];  // by item parity: the next item's writes never meet this one's reads

  if (p.pass == kHeadScale) {  // a CTA per (head blockIdx.x, batch b)
    const long long head = static_cast<long long>(b) * p.nheads + blockIdx.x;
    griddepcontrol_wait();  // kHeadAmax's block_amax
    float amax = 0.f;
    for (int i = threadIdx.x; i < nblocks; i += kThreads) amax = fmaxf(amax, p.block_amax[head * nblocks + i]);
    amax = cta_max<kWarps>(amax, warp_amax[0]);
    if (threadIdx.x == 0) p.descale[head] = descale_of(amax);
    return;
  }

  const float norm = hadamard_norm<kHeadDim>();  // kHadamard's, folded into the amax and the quotient
  // kHadamard: the signs as unpack_chunk's masks, word w (columns 2w and 2w + 1) in sign_words[w]. A
  // negation an element took two instructions (a predicate from the sign bits, a negating add).
  __shared__ __align__(16) unsigned sign_words[kHadamard ? kHeadDim / 2 : 4];
  if constexpr (kHadamard) {
    static_assert(kHeadDim / 2 <= kThreads, "a thread a word");
    const auto sign_bit = [&](int col) { return static_cast<unsigned>(p.signs[col / 64] >> (col % 64)) & 1u; };
    const int w = threadIdx.x;
    if (w < kHeadDim / 2) sign_words[w] = sign_bit(2 * w) << 15 | sign_bit(2 * w + 1) << 31;
    __syncthreads();
  }
  // kLoadStaged: the thread's chunks of each item are copied into slots of its own (staged[stage]
  // [chunk][thread]) kStages - 1 items ahead of the one it converts, and read back once its own
  // cp.async group is complete (no barrier: no thread reads another's slots).
  constexpr int kThreadChunks = L::kRows * L::kPieces;
  extern __shared__ uint4 staged[];
  const int first = blockIdx.x * p.items_per_cta, end = min(first + p.items_per_cta, items);
  const auto stage = [&](int item) {
    if (item < end) {
      const auto [block, h, row0] = item_at<kBlockRows>(item, p.nheads, row_in_block);
      const T* x = x_batch + h * p.x_stride_h;
      const unsigned slots = smem_u32(staged + (item - first) % kStages * kThreadChunks * kThreads + threadIdx.x);
#pragma unroll
      for (int i = 0; i < L::kRows; ++i) {
        const int row = row0 + i * kRowStep;
#pragma unroll
        for (int c = 0; c < L::kPieces; ++c) {
          const bool valid = row < p.seqlen && col0 + c * L::kPieceStep < p.headdim;  // else zeros
          const T* at = valid ? x + row * p.x_stride_s + c * L::kPieceStep : x;
          cp_async_16(slots + (i * L::kPieces + c) * kThreads * sizeof(uint4), at, valid);
        }
      }
    }
    cp_async_commit();  // (an empty group past the last item: the waits count groups)
  };
  if constexpr (kLoads == kLoadStaged) {
    for (int s = 0; s + 1 < kStages; ++s) stage(first + s);
  }
  for (int item = first; item < end; ++item) {
    const int j = item - first;
    const auto [block, h, row0] = item_at<kBlockRows>(item, p.nheads, row_in_block);
    if constexpr (kLoads == kLoadStaged) {
      stage(item + kStages - 1);  // into the slots the thread read the item before from
      cp_async_wait<kStages - 1>();
    }
    const T* x = x_batch + h * p.x_stride_h;
    typename L::Values v;  // a head dim below kHeadDim (a multiple of 8) ends on a chunk boundary
#pragma unroll
    for (int i = 0; i < L::kRows; ++i) {
      const int row = row0 + i * kRowStep;
#pragma unroll
      for (int c = 0; c < L::kPieces; ++c) {
        // chunk c's columns: kChunk (c kLanes + lane) on, words 4 (c kLanes + lane) on
        const uint4 negate = kHadamard ? *reinterpret_cast<const uint4*>(sign_words + 4 * (c * L::kLanes + lane))
                                       : make_uint4(0u, 0u, 0u, 0u);
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);  // past the rows and the head dim: leaves the amax as it
                                                 // is, never stored
        if constexpr (kLoads == kLoadStaged) {
          raw = staged[(j % kStages * kThreadChunks + i * L::kPieces + c) * kThreads + threadIdx.x];
        } else if (row < p.seqlen && col0 + c * L::kPieceStep < p.headdim) {
          const T* at = x + row * p.x_stride_s + c * L::kPieceStep;
          raw = kLoads == kLoadVectors ? *reinterpret_cast<const uint4*>(at) : load_chunk_elements(at);
        }
        unpack_chunk<T>(raw, negate, v[i][c]);
      }
    }
    if constexpr (kHadamard) hadamard_rows<kHeadDim>(v, lane);

    const long long head = static_cast<long long>(b) * p.nheads + h;
    float descale;
    if (p.pass == kHeadConvert) {
      griddepcontrol_wait();  // (a no-op after the first item)
      descale = p.descale[head];  // kHeadScale's
    } else {  // fmaxf skips NaNs: they do not count towards the scale (a NaN stays NaN in x8)
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < L::kRows; ++i) {
#pragma unroll
        for (int c = 0; c < L::kPieces; ++c) {
#pragma unroll
          for (int e = 0; e < kChunk; ++e) amax = fmaxf(amax, fabsf(v[i][c][e]));
        }
      }
      amax = cta_max<kWarps>(amax, warp_amax[j % 2]);
      if constexpr (kHadamard) amax *= norm;  // RN(amax norm): the largest of the rounded RN(v norm)
      if (p.pass == kHeadAmax) {
        if (threadIdx.x == 0) p.block_amax[head * nblocks + block] = amax;
        continue;
      }
      descale = descale_of(amax);
      if (threadIdx.x == 0) p.descale[head * nblocks + block] = descale;
    }
    unsigned char* x8 = p.x8 + b * p.x8_stride_b + h * p.x8_stride_h;
    if (descale < infinity()) {
      store_codes<true, kHadamard, L>(v, descale, norm, x8, p.x8_stride_s, row0, kRowStep, p.seqlen, col0, p.headdim);
    } else {
      store_codes<false, kHadamard, L>(v, descale, norm, x8, p.x8_stride_s, row0, kRowStep, p.seqlen, col0,
                                       p.headdim);
    }
  }
}

// A thread's 8 keys (v[key][column]) of four head-dim columns / descale to e4m3, two columns as one
// 16-byte row each of V^T at dst + column x row_stride, in the forward's key order (word w holds
// keys 2w, 2w + 1, 2w + 8, 2w + 9 of a group of 16): the thread of the group's first 8 keys (`low`)
// stores columns 0 and 1, its partner (lane ^ kPartner, the group's last 8 keys) columns 2 and 3,
// each taking the other's halves of its words through four shuffles (which every lane of the warp
// takes, `store` or not).
template <bool kFiniteDescale, int kPartner>
__device__ __forceinline__ void store_transposed_codes(const float (&v)[8][4], float descale, unsigned char* dst,
                                                       long long row_stride, bool low, bool store) {
  const float r = 1.f / descale;
  unsigned half[4][2];  // column c, keys 4i .. 4i + 3 of the thread's: words 2i (low half) and 2i + 1's halves
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float q[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = divide<kFiniteDescale>(v[k][c], descale, r);
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // keys 4i .. 4i + 3: halfwords for words 2i and 2i + 1
      half[c][i] = static_cast<unsigned>(e4m3x2(q[4 * i + 1], q[4 * i])) |
                   (static_cast<unsigned>(e4m3x2(q[4 * i + 3], q[4 * i + 2])) << 16);
    }
  }
  const int mine = low ? 0 : 2;  // the first of the two columns this thread stores (its partner the others)
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    // (values selected, not arrays: a pointer to either array put both in local memory)
    unsigned lo[2], hi[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const unsigned own = low ? half[c][i] : half[2 + c][i];
      const unsigned other = __shfl_xor_sync(0xffffffffu, low ? half[2 + c][i] : half[c][i], kPartner);
      lo[i] = low ? own : other;
      hi[i] = low ? other : own;
    }
    // word w: keys 2w, 2w + 1 (lo's halfword w) and 2w + 8, 2w + 9 (hi's halfword w)
    if (store) *reinterpret_cast<uint4*>(dst + (mine + c) * row_stride) = make_uint4(
        __byte_perm(lo[0], hi[0], 0x5410), __byte_perm(lo[0], hi[0], 0x7632),
        __byte_perm(lo[1], hi[1], 0x5410), __byte_perm(lo[1], hi[1], 0x7632));
  }
}

// V (batch, seqlen, nheads, headdim) to e4m3 V^T (batch, nheads, headdim, seqlen_pad) with one
// descale per block of kBlockRows keys (reference.quantize_fp8 with that block, then V^T as
// transpose_v_fp8.cu writes it: seqlen_pad = x8_stride_s, seqlen rounded up to 16, the keys in
// between zeros; within each group of 16 keys, position 4c + q holds key 2c + (q & 1) + 8 (q >> 1),
// the order in which the FP8 forward packs P). attention(..., fp8=True) quantizes V straight into
// the layout the pre-transposed FP8 forward loads, with no pass over V8 in between. Items as
// quantize_fp8's (kBlockScales only); x8_stride_b and x8_stride_h are V^T's, x8_stride_s a head-dim
// row's. A warp takes 32 keys (two groups of 16) by 32 head-dim columns: lane = 8 slot + c, a
// thread 8 keys (slot's) of four neighbouring columns (an 8-byte load a key: the 8 lanes of a slot
// read 64 contiguous bytes of each key), and stores two rows of its group's 16 keys (16 bytes),
// next to those of the neighbouring group (slot ^ 2): whole 32-byte sectors. kLoads as
// quantize_fp8's, but kLoadStaged copies an item's rows whole, in 16-byte chunks (a warp's 512
// contiguous bytes where rows are dense), which the CTA's threads read after a barrier: against
// loads straight into registers, 0.85x the time at head dim 256, 0.99x at 128 (H200, ncu, session
// 52; 8-byte copies of each thread's own keys took 1.2x as long).
template <typename T, int kBlockRows, int kHeadDim, int kLoads>
__global__ void __launch_bounds__(quantize_threads(kBlockRows, kHeadDim),
                                  1024 / quantize_threads(kBlockRows, kHeadDim))
    quantize_fp8_vt(const __grid_constant__ QuantizeFp8Params p) {
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256 && sizeof(T) == 2, "16-bit V, head dim 64 to 256");
  const ChainLink link;  // attention(fp8=True)'s chain of launches (fwd_quantized_sm90)
  static_assert(kBlockRows % 32 == 0, "a warp's 32 keys lie in one block");
  constexpr int kThreads = quantize_threads(kBlockRows, kHeadDim);
  constexpr int kWarps = kThreads / 32;
  constexpr int kKeys = 8;                        // a thread's keys: half a group of 16
  constexpr int kColumnWarps = kHeadDim / 32;     // warps across the head dim
  static_assert(kWarps == kColumnWarps * kBlockRows / 32, "a CTA covers a block of keys by the head dim");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, slot = lane / 8;
  const int col = 32 * (warp % kColumnWarps) + 4 * (lane % 8);
  const int first_key = 32 * (warp / kColumnWarps) + kKeys * slot;  // in the block
  const int group_key = first_key & ~15;                            // the group's first
  const bool low = (slot & 1) == 0;
  const int b = blockIdx.y;
  const int nblocks = p.seqlen / kBlockRows + (p.seqlen % kBlockRows != 0), items = nblocks * p.nheads;
  const int seqlen_pad = static_cast<int>(p.x8_stride_s);
  const bool live = col < p.headdim;  // a head dim below kHeadDim is a multiple of 8
  const T* x_rows = static_cast<const T*>(p.x) + b * p.x_stride_b;
  const T* x_batch = x_rows + col;
  __shared__ float warp_amax[2][kWarps];  // by item parity, as in quantize_fp8

  // kLoadStaged: chunk c (16 bytes) of the item's key k at staged_rows[stage][k][c ^ swap(k)]: the
  // 64-byte halves of every other 8 keys' rows swapped, so that a warp's reads of a key each (four
  // keys 8 apart, 64 bytes each) take two wavefronts, the fewest for 256 bytes.
  constexpr int kRowChunks = kHeadDim / kChunk, kItemChunks = kBlockRows * kRowChunks;
  static_assert(kItemChunks % kThreads == 0 && kRowChunks >= 8, "whole rows of 8 chunks or more");
  const auto swap = [](int key) { return (key & 8) >> 1; };
  extern __shared__ uint4 staged_rows[];
  const int first = blockIdx.x * p.items_per_cta, end = min(first + p.items_per_cta, items);
  const auto stage = [&](int item) {
    if (item < end) {
      const auto [block, h, key0] = item_at<kBlockRows>(item, p.nheads, 0);
      const T* x = x_rows + h * p.x_stride_h;
      uint4* rows = staged_rows + (item - first) % kStages * kItemChunks;
#pragma unroll
      for (int i = threadIdx.x; i < kItemChunks; i += kThreads) {
        const int key = i / kRowChunks, chunk = i % kRowChunks;
        const bool valid = key0 + key < p.seqlen && chunk * kChunk < p.headdim;  // else zeros
        const T* at = valid ? x + (key0 + key) * p.x_stride_s + chunk * kChunk : x;
        cp_async_16(smem_u32(rows + key * kRowChunks + (chunk ^ swap(key))), at, valid);
      }
    }
    cp_async_commit();
  };
  if constexpr (kLoads == kLoadStaged) {
    for (int s = 0; s + 1 < kStages; ++s) stage(first + s);
  }
  for (int item = first; item < end; ++item) {
    const int j = item - first;
    const auto [block, h, key0] = item_at<kBlockRows>(item, p.nheads, first_key);
    if constexpr (kLoads == kLoadStaged) {
      stage(item + kStages - 1);  // over the item before's rows, which every thread read before its cta_max
      cp_async_wait<kStages - 1>();
      __syncthreads();  // every thread's chunks of this item
    }
    const T* at = x_batch + h * p.x_stride_h + key0 * p.x_stride_s;  // key k's, stepped (not multiplied)
    float v[kKeys][4];  // zeros past the keys and the head dim: they leave the amax as it is; a padding key's code is 0
#pragma unroll
    for (int k = 0; k < kKeys; ++k, at += p.x_stride_s) {
      unsigned words[2] = {0u, 0u};  // columns col .. col + 3
      if constexpr (kLoads == kLoadStaged) {
        const int key = first_key + k;
        const uint4* row = staged_rows + j % kStages * kItemChunks + key * kRowChunks;
        const uint2 pair = reinterpret_cast<const uint2*>(row + ((col / kChunk) ^ swap(key)))[col % kChunk / 4];
        words[0] = pair.x, words[1] = pair.y;
      } else if (live && key0 + k < p.seqlen) {
        if constexpr (kLoads == kLoadVectors) {  // col: a multiple of 4, so 8 bytes
          const uint2 pair = *reinterpret_cast<const uint2*>(at);
          words[0] = pair.x, words[1] = pair.y;
        } else {
          load_words_elementwise(at, words);
        }
      }
      words_as_float<T>(words, v[k]);
    }
    // Unstaged, a slot's 64 bytes of a key lie in one line: lane c of the slot prefetches key c's.
    if (kLoads != kLoadStaged && item + 1 < end) {
      const Item next = item_at<kBlockRows>(item + 1, p.nheads, first_key);
      const int key = next.row0 + lane % 8;
      if (live && key < p.seqlen) prefetch_l2(x_batch + next.h * p.x_stride_h + key * p.x_stride_s);
    }
    float amax = 0.f;  // fmaxf skips NaNs, as in quantize_fp8
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) amax = fmaxf(amax, fabsf(v[k][c]));
    }
    amax = cta_max<kWarps>(amax, warp_amax[j % 2]);
    const float descale = descale_of(amax);
    const long long head = static_cast<long long>(b) * p.nheads + h;
    if (threadIdx.x == 0) p.descale[head * nblocks + block] = descale;
    const int group0 = block * kBlockRows + group_key;
    const bool store = live && group0 < seqlen_pad;  // (the partners agree)
    unsigned char* dst = p.x8 + b * p.x8_stride_b + h * p.x8_stride_h + col * p.x8_stride_s + group0;
    if (descale < infinity()) {
      store_transposed_codes<true, 8>(v, descale, dst, p.x8_stride_s, low, store);
    } else {
      store_transposed_codes<false, 8>(v, descale, dst, p.x8_stride_s, low, store);
    }
  }
}

}  // namespace cuflash
