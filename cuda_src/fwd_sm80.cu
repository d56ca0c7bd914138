// FlashAttention-2 forward for sm_80+: mma.sync m16n8k16, ldmatrix, cp.async.
//
// One CTA owns kBlockM query rows of one (batch, head); each of its kWarps warps owns
// kBlockM / kWarps of those rows, so the online softmax never crosses warps. The CTA walks the
// key blocks its rows can see from last to first (fully masked blocks are never visited), with
// K and V tiles in shared memory, padded by 16 bytes a row so ldmatrix is conflict-free:
//
//   S = Q K^T        Q from shared memory (ldmatrix), K as the column-major B operand (ldmatrix)
//   online softmax   on the S accumulators, in the log2 domain (exp2, scale * log2(e) folded in)
//   O += P V         P re-packed from the S accumulators as the A operand, V through ldmatrix.trans
//
// Single-stage (kStages = 1): V[n] is fetched while S[n] is computed and K[n-1] while O += P V[n]
// runs. Two-stage: K[n-1] and V[n-1] land in the other buffer pair during all of block n. O is divided by the
// row sum once, at the end, then staged through shared memory for 16-byte stores; the LSE goes
// out in natural log. Rows beyond seqlen_q, keys beyond seqlen_k and head-dim columns beyond
// `headdim` (kHeadDim is the padded size) are zero-filled on load and never stored.
#include "common/masking.cuh"

namespace cuflash {

// The launch arguments, one struct passed by value (one argument to marshal per launch). 8-byte
// fields first, then 4-byte ones, so the layout is the natural one that the Python side
// (cuflash/kernels/fwd_sm80.py, FWD_PARAMS) reproduces with numpy's align=True.
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  const int* cu_seqlens_q;  // varlen only
  const int* cu_seqlens_k;
  long long q_stride_b, q_stride_s, q_stride_h;  // in elements; batch strides unused for varlen
  long long k_stride_b, k_stride_s, k_stride_h;
  long long v_stride_b, v_stride_s, v_stride_h;
  long long o_stride_b, o_stride_s, o_stride_h;
  long long lse_stride_b, lse_stride_h;
  int seqlen_q, seqlen_k;  // dense: the lengths; varlen: the maxima (each sequence reads its own)
  int group;               // query heads per kv head
  int headdim;             // the caller's head dim (<= kHeadDim; the rest is zero padding)
  int window_left, window_right;  // -1: unbounded; causal is window_right = 0
  float scale_log2;        // softmax_scale * log2(e), or log2(e) with softcap
  float softcap_exp2_scale;  // 2 * log2(e) * softmax_scale / softcap: tanh's exponent per score
  float softcap;
  int reserved;
};
static_assert(sizeof(FwdParams) == 208, "FwdParams must match FWD_PARAMS in cuflash/kernels/fwd_sm80.py");

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kVarlen,
          bool kSoftcap, bool kFusedPV>
__global__ void __launch_bounds__(kWarps * 32, 1) fwd_sm80(const __grid_constant__ FwdParams p) {
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  T* __restrict__ out = static_cast<T*>(p.out);
  float* __restrict__ lse = p.lse;
  const int* __restrict__ cu_seqlens_q = p.cu_seqlens_q;
  const int* __restrict__ cu_seqlens_k = p.cu_seqlens_k;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int group = p.group, headdim = p.headdim, window_left = p.window_left, window_right = p.window_right;
  const float scale_log2 = p.scale_log2, softcap_exp2_scale = p.softcap_exp2_scale, softcap = p.softcap;
  const long long q_stride_b = p.q_stride_b, q_stride_s = p.q_stride_s, q_stride_h = p.q_stride_h;
  const long long k_stride_b = p.k_stride_b, k_stride_s = p.k_stride_s, k_stride_h = p.k_stride_h;
  const long long v_stride_b = p.v_stride_b, v_stride_s = p.v_stride_s, v_stride_h = p.v_stride_h;
  const long long o_stride_b = p.o_stride_b, o_stride_s = p.o_stride_s, o_stride_h = p.o_stride_h;
  const long long lse_stride_b = p.lse_stride_b, lse_stride_h = p.lse_stride_h;
  constexpr int kThreads = kWarps * 32;
  constexpr int kRowsPerWarp = kBlockM / kWarps;
  constexpr int kMTiles = kRowsPerWarp / 16;   // m16 tiles per warp
  constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S
  constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of O
  constexpr int kStride = kHeadDim + 8;        // shared-memory row, in elements: +16 bytes of padding
  constexpr int kChunks = kHeadDim / 8;        // 16-byte chunks per row
  static_assert(kRowsPerWarp % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "k16 steps over keys and head dim");
  static_assert(sizeof(T) == 2, "fp16 / bf16");
  static_assert(kStages == 1 || kStages == 2, "one K/V buffer, or two");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kStride;           // kStages buffers of kBlockN rows
  T* sV = sK + kStages * kBlockN * kStride;  // likewise

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (latest, for causal) blocks first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int h_kv = h / group;

  // This sequence's extent and where its rows start.
  long long q_row0 = 0, k_row0 = 0;
  if constexpr (kVarlen) {
    q_row0 = cu_seqlens_q[b];
    k_row0 = cu_seqlens_k[b];
    seqlen_q = cu_seqlens_q[b + 1] - static_cast<int>(q_row0);
    seqlen_k = cu_seqlens_k[b + 1] - static_cast<int>(k_row0);
  }
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen_q) return;  // a varlen sequence shorter than the grid

  const T* q_base = q + (kVarlen ? q_row0 * q_stride_s : b * q_stride_b) + h * q_stride_h;
  const T* k_base = k + (kVarlen ? k_row0 * k_stride_s : b * k_stride_b) + h_kv * k_stride_h;
  const T* v_base = v + (kVarlen ? k_row0 * v_stride_s : b * v_stride_b) + h_kv * v_stride_h;

  const KeyBlocks kb = key_blocks<kBlockN>(m0, kBlockM, seqlen_q, seqlen_k, window_left, window_right);
  const int n_min = kb.n_min, n_max = kb.n_max;

  // Tile loads: consecutive threads take consecutive 16-byte chunks of a row (coalesced). Each
  // thread keeps one chunk column and steps down the tile kRowsPerPass rows at a time, so a tile
  // load costs one pointer and no index arithmetic per chunk. A row's chunks are spread over a
  // power-of-two number of threads; with 12, 20 or 28 chunks (head dims 96, 160, 224) the extra
  // threads sit out.
  constexpr int kChunkThreads = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPerPass = kThreads / kChunkThreads;
  const int tile_row = tid / kChunkThreads;
  const int tile_col = (tid % kChunkThreads) * 8;
  const bool col_valid = tile_col < headdim;
  auto load_tile = [&](T* dst, const T* src, long long stride_s, int row0, int rows, int valid_rows) {
    static_assert(kBlockM % kRowsPerPass == 0 && kBlockN % kRowsPerPass == 0, "whole passes per tile");
    if (tile_col >= kHeadDim) return;
    const T* src_row = src + (row0 + tile_row) * stride_s + tile_col;
    const unsigned dst_row = smem_u32(dst + tile_row * kStride + tile_col);
#pragma unroll
    for (int pass = 0; pass < rows / kRowsPerPass; ++pass) {
      const bool valid = col_valid && row0 + tile_row + pass * kRowsPerPass < valid_rows;
      cp_async_16(dst_row + pass * kRowsPerPass * kStride * 2, valid ? src_row + pass * kRowsPerPass * stride_s : src,
                  valid);
    }
  };

  load_tile(sQ, q_base, q_stride_s, m0, kBlockM, seqlen_q);
  if (n_max > n_min) {
    load_tile(sK, k_base, k_stride_s, (n_max - 1) * kBlockN, kBlockN, seqlen_k);
    if constexpr (kStages == 2) load_tile(sV, v_base, v_stride_s, (n_max - 1) * kBlockN, kBlockN, seqlen_k);
  }
  cp_async_commit();

  float acc_o[kMTiles][kDTiles][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];  // row_sum: this thread's part of the row
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -infinity();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  const int warp_row0 = warp * kRowsPerWarp;  // within the block
  // ldmatrix addresses (see common/sm80.cuh for the thread -> row mapping of each operand)
  const unsigned q_lds = smem_u32(sQ + (warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const unsigned k_lds = smem_u32(sK + (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8);
  const unsigned v_lds = smem_u32(sV + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8);

  // Two schedules. kStages == 1: V[n] is fetched while S = QK^T runs and K[n-1] while PV runs,
  // two barriers a block. kStages == 2: K[n-1] and V[n-1] go into the other buffer pair while all of
  // block n computes, one barrier a block, at twice the K/V shared memory.
  for (int n = n_max - 1; n >= n_min; --n) {
    const int n0 = n * kBlockN;
    const unsigned buffer = kStages == 2 ? ((n_max - 1 - n) & 1) * kBlockN * kStride * 2 : 0;  // bytes
    cp_async_wait<0>();
    __syncthreads();  // this block's tiles (and Q) landed; every warp is done with the buffers reloaded next
    if constexpr (kStages == 2) {
      if (n > n_min) {
        const int other = (n_max - n) & 1;
        load_tile(sK + other * kBlockN * kStride, k_base, k_stride_s, n0 - kBlockN, kBlockN, seqlen_k);
        load_tile(sV + other * kBlockN * kStride, v_base, v_stride_s, n0 - kBlockN, kBlockN, seqlen_k);
        cp_async_commit();
      }
    } else {
      load_tile(sV, v_base, v_stride_s, n0, kBlockN, seqlen_k);
      cp_async_commit();
    }

    // S = Q K^T
    float s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      unsigned a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], q_lds + (mt * 16 * kStride + ks * 16) * 2);
#pragma unroll
      for (int nt2 = 0; nt2 < kNTiles / 2; ++nt2) {
        unsigned bk[4];
        ldmatrix_x4(bk, k_lds + buffer + (nt2 * 16 * kStride + ks * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mma_16816_x2<T>(s[mt][2 * nt2], s[mt][2 * nt2 + 1], a[mt], bk);
      }
    }

    // Softcap before masking: s <- softcap * tanh(s * scale / softcap); scale_log2 is then log2(e).
    if constexpr (kSoftcap) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = softcap_score(s[mt][nt][e], softcap_exp2_scale, softcap);
    }

    // Mask only the blocks that straddle a boundary: the key tail or a window edge.
    if (n < kb.n_full_lo || n > kb.n_full_hi) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          int lo, hi;  // this row's visible keys, relative to this thread's first column of the block
          visible_columns(m0 + warp_row0 + mt * 16 + lane / 4 + hf * 8, n0 + (lane % 4) * 2, seqlen_q, seqlen_k,
                          window_left, window_right, lo, hi);
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (nt * 8 + e < lo || nt * 8 + e > hi) s[mt][nt][hf * 2 + e] = -infinity();
            }
        }
    }

    // Online softmax, per row (a row's 8-column slices are spread over the 4 threads of a quad).
    // kFusedPV: only the maxima and the rescale here; each 16-key slice's exponentials are taken
    // right before its P V MMAs below, so S's registers free as P V runs (on H100 +4-5% at head dim
    // 128, benchmarks/NOTES-sm80.md; where that schedule spills, the variant table turns it off).
    float base[kMTiles][2];  // kFusedPV: each row's exponent base
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        auto score = [&](int c) -> float& { return s[mt][c / 2][hf * 2 + c % 2]; };
        float correction;
        if constexpr (kFusedPV) {
          correction = online_softmax_max(quad_row_max<2 * kNTiles>(score), row_max[mt][hf], scale_log2, base[mt][hf]);
          row_sum[mt][hf] *= correction;
        } else {
          correction = online_softmax_row<2 * kNTiles>(score, quad_row_max<2 * kNTiles>(score), row_max[mt][hf],
                                                     row_sum[mt][hf], scale_log2);
        }
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mt][dt][hf * 2] *= correction;
          acc_o[mt][dt][hf * 2 + 1] *= correction;
        }
      }

    // P in 16 bits: the S accumulators of n8 tiles 2t and 2t+1 are exactly the A fragment of k16
    // step t. Without kFusedPV packed here, all at once (the floats die here, halving what P V keeps
    // live); with it, slice by slice below.
    auto pack_slice = [&](int mt, int kt, unsigned (&pa)[4]) {
      pa[0] = pack2<T>(s[mt][2 * kt][0], s[mt][2 * kt][1]);
      pa[1] = pack2<T>(s[mt][2 * kt][2], s[mt][2 * kt][3]);
      pa[2] = pack2<T>(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
      pa[3] = pack2<T>(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
    };
    unsigned pa_all[kFusedPV ? 1 : kMTiles][kFusedPV ? 1 : kBlockN / 16][4];
    if constexpr (!kFusedPV) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int kt = 0; kt < kBlockN / 16; ++kt) pack_slice(mt, kt, pa_all[mt][kt]);
    }

    if constexpr (kStages == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V[n] landed; every warp is done reading K[n]
      if (n > n_min) {
        load_tile(sK, k_base, k_stride_s, n0 - kBlockN, kBlockN, seqlen_k);
        cp_async_commit();
      }
    }

    // O += P V
#pragma unroll
    for (int kt = 0; kt < kBlockN / 16; ++kt) {
      unsigned pa[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (kFusedPV) {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {  // the row's 4 columns of n8 tiles 2kt and 2kt+1
            online_softmax_exp<4>([&](int c) -> float& { return s[mt][2 * kt + c / 2][hf * 2 + c % 2]; }, scale_log2,
                                  base[mt][hf], row_sum[mt][hf]);
          }
          pack_slice(mt, kt, pa[mt]);
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[mt][r] = pa_all[mt][kt][r];
        }
      }
#pragma unroll
      for (int dt2 = 0; dt2 < kDTiles / 2; ++dt2) {
        unsigned bv[4];
        ldmatrix_x4_trans(bv, v_lds + buffer + (kt * 16 * kStride + dt2 * 16) * 2);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) mma_16816_x2<T>(acc_o[mt][2 * dt2], acc_o[mt][2 * dt2 + 1], pa[mt], bv);
      }
    }
  }

  // Output addresses are formed only now, so they hold no registers through the main loop
  // (a varlen sequence's start is read again from cu_seqlens_q).
  const long long o_row0 = kVarlen ? cu_seqlens_q[b] : 0;
  T* o_base = out + (kVarlen ? o_row0 * o_stride_s : b * o_stride_b) + h * o_stride_h;
  float* lse_base = lse + (kVarlen ? o_row0 : b * lse_stride_b) + h * lse_stride_h;
  // With no key block to visit, the Q load (spread over all warps) may still be landing in the
  // rows this warp is about to overwrite.
  if (n_max <= n_min) {
    cp_async_wait<0>();
    __syncthreads();
  }
  __syncwarp();  // every lane's last ldmatrix of these Q rows is done before any lane overwrites them
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float total = lanes_sum<4>(row_sum[mt][hf]);
      const float inv = total > 0.f ? 1.f / total : 0.f;
      const int r = warp_row0 + mt * 16 + lane / 4 + hf * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const unsigned packed = pack2<T>(acc_o[mt][dt][hf * 2] * inv, acc_o[mt][dt][hf * 2 + 1] * inv);
        *reinterpret_cast<unsigned*>(sQ + r * kStride + dt * 8 + (lane % 4) * 2) = packed;
      }
      if (lane % 4 == 0 && m0 + r < seqlen_q) {
        lse_base[m0 + r] = row_lse(row_max[mt][hf], total);
      }
    }
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < kRowsPerWarp * kChunks; idx += 32) {
    const int r = warp_row0 + idx / kChunks, c = idx % kChunks;
    if (m0 + r < seqlen_q && c * 8 < headdim) {
      *reinterpret_cast<uint4*>(o_base + (m0 + r) * o_stride_s + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + r * kStride + c * 8);
    }
  }
}

}  // namespace cuflash
