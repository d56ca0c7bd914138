// FlashAttention-2 backward for sm_80+: mma.sync m16n8k16, ldmatrix, cp.async.
//
// One CTA owns kBlockN = 16 * kWarps keys of one (batch, kv head) and visits, for every query head
// of the kv head's group, the blocks of kBlockM = 64 queries that see them (reference.backward_tiled
// is the same algorithm in NumPy). Each warp owns 16 of the keys, so everything is computed
// transposed, keys as rows:
//   Sᵀ = K Qᵀ          K rows from shared memory (A), Q rows as the column-major B operand
//   Pᵀ = exp(score - lse)   recomputed; masked elements and tails are 0
//   dV += Pᵀ dO        Pᵀ re-packed from the accumulators as A, dO through ldmatrix.trans
//   dPᵀ = V dOᵀ        V rows (A), dO rows (B)
//   dSᵀ = Pᵀ ∘ (dPᵀ - D)  (∘ (1 - tanh²) with softcap)
//   dK += dSᵀ Q        dSᵀ as A, Q through ldmatrix.trans
//   dQ += dS K         dSᵀ through shared memory (read transposed as A), K through ldmatrix.trans;
//                      warps split the 64 queries (and, with 8 warps, the head dim) and add to a
//                      float32 dQ buffer with atomics (other CTAs add their key blocks)
// dK and dV stay in registers for the whole CTA and are written once, dK times the softmax scale.
#include "common/masking.cuh"

namespace cuflash {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;    // (batch, heads, seqlen_q), natural log, strides below
  const float* delta;  // (batch, heads, seqlen_q), contiguous: rowsum(dout * out)
  float* dq_accum;     // (batch, seqlen_q, heads, kHeadDim) float32, zeroed; dS K * scale lands here
  void* dk;
  void* dv;
  long long q_stride_b, q_stride_s, q_stride_h;  // in elements
  long long k_stride_b, k_stride_s, k_stride_h;
  long long v_stride_b, v_stride_s, v_stride_h;
  long long do_stride_b, do_stride_s, do_stride_h;
  long long dk_stride_b, dk_stride_s, dk_stride_h;
  long long dv_stride_b, dv_stride_s, dv_stride_h;
  long long lse_stride_b, lse_stride_h;
  int seqlen_q, seqlen_k, nheads, group, headdim, window_left, window_right;
  float scale;             // softmax_scale
  float scale_log2;        // softmax_scale * log2(e), or log2(e) with softcap
  float softcap_exp2_scale;
  float softcap;
};
static_assert(sizeof(BwdParams) == 280, "BwdParams must match BWD_PARAMS in cuflash/kernels/bwd_sm80.py");

template <typename T, int kHeadDim, int kWarps, bool kSoftcap>
__global__ void __launch_bounds__(32 * kWarps, 1) bwd_sm80(const __grid_constant__ BwdParams p) {
  constexpr int kBlockM = 64, kBlockN = 16 * kWarps, kThreads = 32 * kWarps;
  static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps of 16 keys");
  constexpr int kStride = kHeadDim + 8;  // padded shared-memory rows (conflict-free ldmatrix)
  constexpr int kDsStride = kBlockM + 8;
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kMTiles = kBlockM / 8;   // n8 tiles across the 64 queries of Sᵀ
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles across the head dim of dK, dV, dQ
  static_assert(sizeof(T) == 2 && kHeadDim % 16 == 0, "fp16 / bf16, k16 steps over the head dim");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;
  T* sDo = sQ + kBlockM * kStride;
  T* sDs = sDo + kBlockM * kStride;  // dSᵀ, [key][query]
  float* sLse = reinterpret_cast<float*>(sDs + kBlockN * kDsStride);  // log2 domain
  float* sDelta = sLse + kBlockM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBlockN;
  const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  const int left = p.window_left, right = p.window_right;
  const int offset = seqlen_k - seqlen_q;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride_b + h_kv * p.k_stride_h;
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride_b + h_kv * p.v_stride_h;
  const T* dout = static_cast<const T*>(p.dout);

  // Tile loads: consecutive threads take consecutive 16-byte chunks of a row.
  auto load_tile = [&](T* dst, const T* src, long long stride_s, int row0, int rows, int valid_rows) {
    for (int idx = tid; idx < rows * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const bool valid = row0 + r < valid_rows && c < p.headdim;
      cp_async_16(smem_u32(dst + r * kStride + c), valid ? src + (row0 + r) * stride_s + c : src, valid);
    }
  };
  load_tile(sK, k, p.k_stride_s, n0, kBlockN, seqlen_k);
  load_tile(sV, v, p.v_stride_s, n0, kBlockN, seqlen_k);
  cp_async_commit();

  int m_lo, m_hi;  // the query rows that see a key of this block
  query_rows(n0, min(n0 + kBlockN, seqlen_k), seqlen_q, seqlen_k, left, right, m_lo, m_hi);

  float acc_dk[kDTiles][4], acc_dv[kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  const int key_row0 = warp * 16;  // this warp's keys within the block
  // ldmatrix addresses (common/sm80.cuh): A operands K, V rows of this warp; B operands Q, dO rows.
  // V and dO sit a constant distance after K and Q: one address each, the other by offset (fewer
  // live registers next to the dK, dV accumulators).
  constexpr unsigned kVOffset = kBlockN * kStride * 2, kDoOffset = kBlockM * kStride * 2;  // bytes
  const unsigned k_lds = smem_u32(sK + (key_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const unsigned v_lds = k_lds + kVOffset;
  const unsigned q_ldsb = smem_u32(sQ + (lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8);
  const unsigned do_ldsb = q_ldsb + kDoOffset;
  // .trans B operands over (queries x head dim): dO for dV, Q for dK.
  const unsigned q_ldst = smem_u32(sQ + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + (lane / 16) * 8);
  const unsigned do_ldst = q_ldst + kDoOffset;
  constexpr float kLog2e = 1.4426950408889634f;

  if (m_hi > m_lo) {
    for (int hq = h_kv * p.group; hq < (h_kv + 1) * p.group; ++hq) {
      const T* q_h = q + b * p.q_stride_b + hq * p.q_stride_h;
      const T* do_h = dout + b * p.do_stride_b + hq * p.do_stride_h;
      const float* lse_h = p.lse + b * p.lse_stride_b + hq * p.lse_stride_h;
      const float* delta_h = p.delta + (static_cast<long long>(b) * p.nheads + hq) * seqlen_q;
      float* dq_h = p.dq_accum + (static_cast<long long>(b) * seqlen_q * p.nheads + hq) * kHeadDim;
      for (int m0 = (m_lo / kBlockM) * kBlockM; m0 < m_hi; m0 += kBlockM) {
        __syncthreads();  // the previous block's Q, dO, dSᵀ, LSE and D are no longer read
        load_tile(sQ, q_h, p.q_stride_s, m0, kBlockM, seqlen_q);
        load_tile(sDo, do_h, p.do_stride_s, m0, kBlockM, seqlen_q);
        cp_async_commit();
        if (tid < kBlockM) {
          const int i = m0 + tid;
          sLse[tid] = i < seqlen_q ? lse_h[i] * kLog2e : 0.f;
          sDelta[tid] = i < seqlen_q ? delta_h[i] : 0.f;
        }
        cp_async_wait<0>();
        __syncthreads();

        // Sᵀ (16 keys x 64 queries) and dPᵀ, from k16 steps over the head dim.
        float s[kMTiles][4], dp[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][e] = dp[mt][e] = 0.f;
        // (one product after the other: interleaved, their fragments outgrow the registers)
        auto product = [&](float (&acc)[kMTiles][4], unsigned a_lds, unsigned b_lds) {
#pragma unroll
          for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            unsigned a[4];
            ldmatrix_x4(a, a_lds + ks * 32);
#pragma unroll
            for (int mt2 = 0; mt2 < kMTiles / 2; ++mt2) {
              unsigned bf[4];
              ldmatrix_x4(bf, b_lds + (mt2 * 16 * kStride + ks * 16) * 2);
              mma_16816_x2<T>(acc[2 * mt2], acc[2 * mt2 + 1], a, bf);
            }
          }
        };
        product(s, k_lds, q_ldsb);
        product(dp, v_lds, do_ldsb);

        // Pᵀ and dSᵀ in place: element (key j, query i) of accumulator [mt][e] is
        // j = n0 + key_row0 + lane / 4 + 8 * (e / 2), i = m0 + 8 * mt + 2 * (lane % 4) + e % 2.
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = n0 + key_row0 + lane / 4 + 8 * (e / 2);
            const int il = 8 * mt + 2 * (lane % 4) + e % 2;
            const int i = m0 + il;
            const bool visible = i < seqlen_q && j < seqlen_k && (left < 0 || j >= i + offset - left) &&
                                 (right < 0 || j <= i + offset + right);
            float x = s[mt][e], dtanh = 1.f;
            if constexpr (kSoftcap) {
              x = softcap_score(x, p.softcap_exp2_scale, p.softcap);  // softcap * tanh(.)
              const float t = x / p.softcap;
              dtanh = 1.f - t * t;
            }
            const float pe = visible ? ex2(fmaf(x, p.scale_log2, -sLse[il])) : 0.f;
            s[mt][e] = pe;
            dp[mt][e] = pe * (dp[mt][e] - sDelta[il]) * dtanh;
          }

        // Pᵀ and dSᵀ as A operands (16 keys x k16 queries per step), packed once.
        unsigned pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
#pragma unroll
        for (int kt = 0; kt < kBlockM / 16; ++kt) {
          pa[kt][0] = pack2<T>(s[2 * kt][0], s[2 * kt][1]);
          pa[kt][1] = pack2<T>(s[2 * kt][2], s[2 * kt][3]);
          pa[kt][2] = pack2<T>(s[2 * kt + 1][0], s[2 * kt + 1][1]);
          pa[kt][3] = pack2<T>(s[2 * kt + 1][2], s[2 * kt + 1][3]);
          dsa[kt][0] = pack2<T>(dp[2 * kt][0], dp[2 * kt][1]);
          dsa[kt][1] = pack2<T>(dp[2 * kt][2], dp[2 * kt][3]);
          dsa[kt][2] = pack2<T>(dp[2 * kt + 1][0], dp[2 * kt + 1][1]);
          dsa[kt][3] = pack2<T>(dp[2 * kt + 1][2], dp[2 * kt + 1][3]);
        }
        // dSᵀ to shared memory for dQ: each thread's pairs of queries of its two key rows.
#pragma unroll
        for (int kt = 0; kt < kBlockM / 16; ++kt)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int key = key_row0 + lane / 4 + 8 * (r % 2);
            const int query = 16 * kt + 8 * (r / 2) + 2 * (lane % 4);
            *reinterpret_cast<unsigned*>(sDs + key * kDsStride + query) = dsa[kt][r];
          }

        // dV += Pᵀ dO and dK += dSᵀ Q over k16 steps of queries.
#pragma unroll
        for (int kt = 0; kt < kBlockM / 16; ++kt)
#pragma unroll
          for (int dt2 = 0; dt2 < kDTiles / 2; ++dt2) {
            unsigned bdo[4], bq[4];
            ldmatrix_x4_trans(bdo, do_ldst + (kt * 16 * kStride + dt2 * 16) * 2);
            ldmatrix_x4_trans(bq, q_ldst + (kt * 16 * kStride + dt2 * 16) * 2);
            mma_16816_x2<T>(acc_dv[2 * dt2], acc_dv[2 * dt2 + 1], pa[kt], bdo);
            mma_16816_x2<T>(acc_dk[2 * dt2], acc_dk[2 * dt2 + 1], dsa[kt], bq);
          }

        __syncthreads();  // dSᵀ complete
        // dQ (64 queries x head dim) += dS K: warp w takes queries 16 (w % 4).. and, with 8 warps,
        // half of the head dim; A = dS read transposed from dSᵀ, B = K through ldmatrix.trans,
        // k16 steps over the block's keys.
        constexpr int kDqTiles = kDTiles / (kWarps / 4);  // n8 tiles of dQ per warp
        static_assert(kDqTiles % 2 == 0, "pairs of n8 tiles per ldmatrix");
        float acc_dq[kDqTiles][4];
#pragma unroll
        for (int dt = 0; dt < kDqTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[dt][e] = 0.f;
        const int q_row0 = (warp % 4) * 16;
        const int dq_col0 = (warp / 4) * kDqTiles * 8;
#pragma unroll
        for (int kt = 0; kt < kBlockN / 16; ++kt) {
          // A fragment of dS (queries q_row0.., keys 16kt..): from dSᵀ[key][query] with .trans.
          unsigned a[4];
          ldmatrix_x4_trans(a, smem_u32(sDs + (16 * kt + lane % 8 + (lane / 16) * 8) * kDsStride + q_row0 +
                                        ((lane / 8) % 2) * 8));
#pragma unroll
          for (int dt2 = 0; dt2 < kDqTiles / 2; ++dt2) {
            unsigned bk[4];
            ldmatrix_x4_trans(bk, smem_u32(sK + (16 * kt + lane % 8 + ((lane / 8) % 2) * 8) * kStride + dq_col0 +
                                           dt2 * 16 + (lane / 16) * 8));
            mma_16816_x2<T>(acc_dq[2 * dt2], acc_dq[2 * dt2 + 1], a, bk);
          }
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = m0 + q_row0 + lane / 4 + 8 * hf;
          if (i < seqlen_q) {
            float* dq_row = dq_h + static_cast<long long>(i) * p.nheads * kHeadDim + dq_col0 + 2 * (lane % 4);
#pragma unroll
            for (int dt = 0; dt < kDqTiles; ++dt) {
              atomicAdd(dq_row + dt * 8, acc_dq[dt][2 * hf] * p.scale);
              atomicAdd(dq_row + dt * 8 + 1, acc_dq[dt][2 * hf + 1] * p.scale);
            }
          }
        }
      }
    }
  }

  cp_async_wait<0>();  // with no query block to visit, K and V may still be landing: not while we exit
  // dK (times the scale) and dV, this warp's 16 keys.
  T* dk = static_cast<T*>(p.dk) + b * p.dk_stride_b + h_kv * p.dk_stride_h;
  T* dv = static_cast<T*>(p.dv) + b * p.dv_stride_b + h_kv * p.dv_stride_h;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int j = n0 + key_row0 + lane / 4 + 8 * hf;
    if (j >= seqlen_k) continue;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int c = dt * 8 + 2 * (lane % 4);
      if (c < p.headdim) {
        *reinterpret_cast<unsigned*>(dk + j * p.dk_stride_s + c) =
            pack2<T>(acc_dk[dt][2 * hf] * p.scale, acc_dk[dt][2 * hf + 1] * p.scale);
        *reinterpret_cast<unsigned*>(dv + j * p.dv_stride_s + c) = pack2<T>(acc_dv[dt][2 * hf], acc_dv[dt][2 * hf + 1]);
      }
    }
  }
}

// dq = dq_accum in the input dtype: (batch, seqlen_q, heads, kHeadDim) float32 -> strided dq.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_sm80_dq(const float* __restrict__ dq_accum, T* __restrict__ dq, int rows,
                                                   int nheads, int seqlen_q, int headdim, long long dq_stride_b,
                                                   long long dq_stride_s, long long dq_stride_h) {
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;  // one pair of columns
  const long long row = idx / (kHeadDim / 2);
  const int c = static_cast<int>(idx % (kHeadDim / 2)) * 2;
  if (row >= rows || c >= headdim) return;
  const int h = static_cast<int>(row % nheads);
  const long long bs = row / nheads;
  const int s = static_cast<int>(bs % seqlen_q);
  const int b = static_cast<int>(bs / seqlen_q);
  const float* src = dq_accum + row * kHeadDim + c;
  *reinterpret_cast<unsigned*>(dq + b * dq_stride_b + s * dq_stride_s + h * dq_stride_h + c) = pack2<T>(src[0], src[1]);
}

}  // namespace cuflash
