// FlashAttention-2 backward for sm_80+: mma.sync m16n8k16, ldmatrix, cp.async.
//
// One CTA owns kBlockN keys of one (batch, kv head) and visits, for every query head of the kv
// head's group, the blocks of kBlockM queries that see them (reference.backward_tiled is the same
// algorithm in NumPy). Everything is computed transposed, keys as rows, the warps in kBlockN / 16
// groups of 16 keys; the kSplit = kWarps / (kBlockN / 16) warps of a key group split the work:
//   Sᵀ = K Qᵀ          each warp its kBlockM / kSplit queries; K rows from shared memory (A), Q rows
//                      as the column-major B operand
//   Pᵀ = exp(score - lse)   recomputed; masked elements and tails are 0
//   dPᵀ = V dOᵀ        V rows (A), dO rows (B)
//   dSᵀ = Pᵀ ∘ (dPᵀ - D)  (∘ (1 - tanh²) with softcap)
//   dV += Pᵀ dO        each warp its kHeadDim / kSplit columns, over all kBlockM queries: with one
//   dK += dSᵀ Q        warp per key group (kSplit = 1) and few columns Pᵀ and dSᵀ come straight
//                      from its registers, otherwise through shared memory; dO and Q through
//                      ldmatrix.trans
//   dQ += dS K         dSᵀ through shared memory (read transposed as A), K through ldmatrix.trans;
//                      warps split the queries in 16s and the head dim, and add to a float32 dQ
//                      buffer with atomic reductions (other CTAs add their key blocks; two floats
//                      an instruction on sm_90) — in a fixed order when deterministic (a
//                      semaphore per query block)
// The query blocks' Q, dO, LSE and D load by cp.async, the next block's while one computes (two
// stages).
// dK and dV stay in registers for the whole CTA and are written once, dK times the softmax scale.
// Varlen and deterministic are run-time switches (null cu_seqlens / semaphore pointers): they act
// once per CTA or once per query block, never in the inner loops.
#include "common/masking.cuh"

namespace cuflash {

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const float* lse;    // dense (batch, heads, seqlen_q), varlen (heads, total_q); natural log
  const float* delta;  // rowsum(dout * out): dense (batch, heads, seqlen_q), varlen (heads, total_q)
  float* dq_accum;     // (batch·seqlen_q or total_q, heads, kHeadDim) float32, zeroed; dS K * scale lands here
  void* dk;
  void* dv;
  const int* cu_seqlens_q;  // varlen only, else null
  const int* cu_seqlens_k;
  int* dq_semaphore;        // deterministic only, else null: (batch, heads, query blocks), zeroed
  long long q_stride_b, q_stride_s, q_stride_h;  // in elements; batch strides unused for varlen
  long long k_stride_b, k_stride_s, k_stride_h;
  long long v_stride_b, v_stride_s, v_stride_h;
  long long do_stride_b, do_stride_s, do_stride_h;
  long long dk_stride_b, dk_stride_s, dk_stride_h;
  long long dv_stride_b, dv_stride_s, dv_stride_h;
  long long lse_stride_b, lse_stride_h;
  long long delta_stride_b, delta_stride_h;
  int seqlen_q, seqlen_k;  // dense: the lengths; varlen: the maxima (each sequence reads its own)
  int nheads, group, headdim, window_left, window_right;
  float scale;             // softmax_scale
  float scale_log2;        // softmax_scale * log2(e), or log2(e) with softcap
  float softcap_exp2_scale;
  float softcap;
};
static_assert(sizeof(BwdParams) == 320, "BwdParams must match BWD_PARAMS in cuflash/kernels/bwd_sm80.py");

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kWarps, int kStages, bool kSoftcap>
__global__ void __launch_bounds__(32 * kWarps, 1) bwd_sm80(const __grid_constant__ BwdParams p) {
  constexpr int kThreads = 32 * kWarps;
  constexpr int kKeyGroups = kBlockN / 16;
  constexpr int kSplit = kWarps / kKeyGroups;  // warps per 16 keys
  constexpr int kQueriesPerWarp = kBlockM / kSplit;  // of Sᵀ and dPᵀ
  constexpr int kDkTiles = kHeadDim / 8 / kSplit;    // n8 tiles of dK and dV per warp
  // Where dK and dV take 96 registers or more, Sᵀ and dPᵀ are computed 32 queries at a time (each
  // pass packed and stored before the next): both at once, for 64 queries, do not fit beside them.
  constexpr int kPasses = kDkTiles >= 12 && kQueriesPerWarp > 32 ? kQueriesPerWarp / 32 : 1;
  constexpr int kPassQueries = kQueriesPerWarp / kPasses;
  constexpr int kPassTiles = kPassQueries / 8;       // n8 tiles across a pass's queries
  // Pᵀ and dSᵀ feed dV and dK from the registers they are computed in when one warp holds a key
  // group's every column; not where dK and dV already take 96 registers or more (through shared
  // memory they are packed, stored and dead before the dK/dV products).
  constexpr bool kPInRegisters = kSplit == 1 && kDkTiles < 12;
  constexpr int kQueryGroups = kBlockM / 16;         // of dQ
  constexpr int kDqTiles = kHeadDim / 8 / (kWarps / kQueryGroups);  // n8 tiles of dQ per warp
  // dQ's accumulators in chunks of at most 8 n8 tiles (32 registers) beside dK and dV's.
  constexpr int kDqChunk = kDqTiles % 8 == 0 ? 8 : kDqTiles % 6 == 0 ? 6 : kDqTiles % 4 == 0 ? 4 : 2;
  constexpr int kStride = kHeadDim + 8;  // padded shared-memory rows (conflict-free ldmatrix)
  constexpr int kPStride = kBlockM + 8;
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kStageElems = 2 * kBlockM * kStride;  // a Q and a dO tile
  static_assert(kStages == 1 || kStages == 2, "one Q/dO buffer, or two");
  static_assert(sizeof(T) == 2 && kHeadDim % 16 == 0, "fp16 / bf16, k16 steps over the head dim");
  static_assert(kBlockN % 16 == 0 && kWarps % kKeyGroups == 0, "whole warps per 16 keys");
  static_assert(kQueriesPerWarp % 16 == 0 && kDkTiles % 2 == 0, "pairs of n8 tiles per ldmatrix");
  static_assert(kBlockM % 16 == 0 && kWarps % kQueryGroups == 0 && kDqTiles % kDqChunk == 0 && kDqChunk % 2 == 0,
                "dQ: whole warps per 16 queries, pairs of n8 tiles");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kStride;
  T* sQ = sV + kBlockN * kStride;    // per stage: Q, then dO
  T* sDo = sQ + kBlockM * kStride;
  T* sDs = sQ + kStages * kStageElems;  // dSᵀ, [key][query]
  T* sP = sDs + kBlockN * kPStride;  // Pᵀ, [key][query] (kSplit > 1 only)
  // Per stage, the LSE and D of a tile's kBlockM queries.
  float* sRows = reinterpret_cast<float*>(sP + (kPInRegisters ? 0 : kBlockN * kPStride));

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Deterministic runs add to each query block's dQ from the last key block down (causal: the key
  // block on the diagonal, which visits that query block first), one after the other. A CTA then
  // waits only for CTAs of higher key blocks, so those are launched first: a waiting CTA never
  // holds an SM that a CTA it waits for still needs. Otherwise the heaviest (causal: first) key
  // blocks go first.
  const int n_block = p.dq_semaphore ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h_kv = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBlockN;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;
  long long q_row0 = 0, k_row0 = 0;  // varlen: where the sequence's rows start
  if (p.cu_seqlens_q) {
    q_row0 = p.cu_seqlens_q[b];
    k_row0 = p.cu_seqlens_k[b];
    seqlen_q = p.cu_seqlens_q[b + 1] - static_cast<int>(q_row0);
    seqlen_k = p.cu_seqlens_k[b + 1] - static_cast<int>(k_row0);
    if (n0 >= seqlen_k) return;  // a sequence shorter than the grid
  }
  const int left = p.window_left, right = p.window_right;
  const int offset = seqlen_k - seqlen_q;
  const bool varlen = p.cu_seqlens_q != nullptr;
  const T* q = static_cast<const T*>(p.q) + (varlen ? q_row0 * p.q_stride_s : b * p.q_stride_b);
  const T* dout = static_cast<const T*>(p.dout) + (varlen ? q_row0 * p.do_stride_s : b * p.do_stride_b);
  const T* k = static_cast<const T*>(p.k) + (varlen ? k_row0 * p.k_stride_s : b * p.k_stride_b) + h_kv * p.k_stride_h;
  const T* v = static_cast<const T*>(p.v) + (varlen ? k_row0 * p.v_stride_s : b * p.v_stride_b) + h_kv * p.v_stride_h;
  const float* lse = p.lse + (varlen ? q_row0 : b * p.lse_stride_b);
  const float* delta = p.delta + (varlen ? q_row0 : b * p.delta_stride_b);
  const long long dq_row0 = varlen ? q_row0 : static_cast<long long>(b) * seqlen_q;  // rows of dq_accum

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

  float acc_dk[kDkTiles][4], acc_dv[kDkTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDkTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  const int key_row0 = (warp % kKeyGroups) * 16;  // this warp's keys within the block
  const int split = warp / kKeyGroups;
  const int query0 = split * kQueriesPerWarp;     // its queries of Sᵀ
  const int col0 = split * kDkTiles * 8;          // its columns of dK and dV
  // ldmatrix addresses (common/sm80.cuh): A operands K, V rows of this warp; B operands Q, dO rows.
  // V and dO sit a constant distance after K and Q: one address each, the other by offset (fewer
  // live registers next to the dK, dV accumulators).
  constexpr unsigned kVOffset = kBlockN * kStride * 2, kDoOffset = kBlockM * kStride * 2;  // bytes
  const unsigned k_lds = smem_u32(sK + (key_row0 + lane % 16) * kStride + (lane / 16) * 8);
  const unsigned v_lds = k_lds + kVOffset;
  const unsigned q_ldsb = smem_u32(sQ + (query0 + lane % 8 + (lane / 16) * 8) * kStride + ((lane / 8) % 2) * 8);
  const unsigned do_ldsb = q_ldsb + kDoOffset;
  // .trans B operands over (queries x head dim): dO for dV, Q for dK.
  const unsigned q_ldst = smem_u32(sQ + (lane % 8 + ((lane / 8) % 2) * 8) * kStride + col0 + (lane / 16) * 8);
  const unsigned do_ldst = q_ldst + kDoOffset;
  constexpr float kLog2e = 1.4426950408889634f;

  // The tiles this CTA visits: for each query head of the group, the query blocks from the one
  // holding m_lo up to m_hi. A tile's Q, dO, LSE and D load together (cp.async, one group). With
  // two stages the next tile's loads run while this one computes, and a tile needs two barriers (its
  // loads landed and the previous tile's buffers are free; its Pᵀ and dSᵀ are written); with one
  // stage three, as the loads can only start once the previous tile is done.
  const int m_first = (m_lo / kBlockM) * kBlockM;
  const int m_count = m_hi > m_lo ? (m_hi - m_first + kBlockM - 1) / kBlockM : 0;
  const int tiles = m_count * p.group;
  auto tile_head = [&](int t) { return h_kv * p.group + t / m_count; };
  auto tile_m0 = [&](int t) { return m_first + (t % m_count) * kBlockM; };
  auto stage_of = [](int t) { return kStages == 2 ? t % 2 : 0; };
  auto load_tile_inputs = [&](int t) {
    const int hq = tile_head(t), stage = stage_of(t), m0 = tile_m0(t);
    load_tile(sQ + stage * kStageElems, q + hq * p.q_stride_h, p.q_stride_s, m0, kBlockM, seqlen_q);
    load_tile(sDo + stage * kStageElems, dout + hq * p.do_stride_h, p.do_stride_s, m0, kBlockM, seqlen_q);
    if (tid < kBlockM) {  // rows past seqlen_q read as 0
      const int i = m0 + tid;
      const bool valid = i < seqlen_q;
      float* rows = sRows + stage * 2 * kBlockM;
      cp_async_4(smem_u32(rows + tid), valid ? lse + hq * p.lse_stride_h + i : lse, valid);
      cp_async_4(smem_u32(rows + kBlockM + tid), valid ? delta + hq * p.delta_stride_h + i : delta, valid);
    }
    cp_async_commit();
  };
  if (tiles > 0) load_tile_inputs(0);

  for (int t = 0; t < tiles; ++t) {
    const int hq = tile_head(t), m0 = tile_m0(t);
    float* dq_h = p.dq_accum + (dq_row0 * p.nheads + hq) * kHeadDim;
    const unsigned stage = stage_of(t) * kStageElems * 2;  // bytes
    const float* rows = sRows + stage_of(t) * 2 * kBlockM;  // LSE (natural log), then D
    if constexpr (kStages == 1) {
      if (t > 0) {
        __syncthreads();  // the previous tile's Q, dO, LSE and D are no longer read
        load_tile_inputs(t);
      }
    }
    cp_async_wait<0>();  // this tile's inputs (issued a tile ago with two stages)
    __syncthreads();     // ... for every thread; and the previous tile is done (its stage, Pᵀ, dSᵀ)
    if constexpr (kStages == 2) {
      if (t + 1 < tiles) load_tile_inputs(t + 1);
    }

    // A tile in which every query sees every key (no tail, no window edge) skips the mask.
    const bool interior = sees_all(m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k, left, right);
    // Pᵀ and dSᵀ as A operands (16 keys x k16 queries per step), packed once.
    constexpr int kKSteps = kQueriesPerWarp / 16;
    unsigned pa[kKSteps][4], dsa[kKSteps][4];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int qp = query0 + pass * kPassQueries;  // this pass's first query within the tile
      const unsigned qp_bytes = pass * kPassQueries * kStride * 2;
      // Sᵀ (16 keys x the pass's queries) and dPᵀ, from k16 steps over the head dim.
      float s[kPassTiles][4], dp[kPassTiles][4];
#pragma unroll
      for (int mt = 0; mt < kPassTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][e] = dp[mt][e] = 0.f;
      // (one product after the other: interleaved, their fragments outgrow the registers; unrolled
      // further over the head dim, ptxas keeps more fragments in flight than the registers hold:
      // 4 steps spill at head dim 64, the whole head dim from 160 up)
      auto product = [&](float (&acc)[kPassTiles][4], unsigned a_lds, unsigned b_lds) {
#pragma unroll 2
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          unsigned a[4];
          ldmatrix_x4(a, a_lds + ks * 32);
#pragma unroll
          for (int mt2 = 0; mt2 < kPassTiles / 2; ++mt2) {
            unsigned bf[4];
            ldmatrix_x4(bf, b_lds + (mt2 * 16 * kStride + ks * 16) * 2);
            mma_16816_x2<T>(acc[2 * mt2], acc[2 * mt2 + 1], a, bf);
          }
        }
      };
      product(s, k_lds, q_ldsb + stage + qp_bytes);
      product(dp, v_lds, do_ldsb + stage + qp_bytes);

      // Pᵀ and dSᵀ in place: element (key j, query i) of accumulator [mt][e] is
      // j = n0 + key_row0 + lane / 4 + 8 * (e / 2), i = m0 + qp + 8 * mt + 2 * (lane % 4) + e % 2.
      // (called with a constant, inlined: each call site compiles its own loop)
      auto softmax_gradient = [&](bool masked) {
#pragma unroll
        for (int mt = 0; mt < kPassTiles; ++mt) {
          const int il = qp + 8 * mt + 2 * (lane % 4);  // this thread's two queries of the n8 tile
          float2 lse2 = *reinterpret_cast<const float2*>(rows + il);
          lse2.x *= kLog2e;
          lse2.y *= kLog2e;
          const float2 delta2 = *reinterpret_cast<const float2*>(rows + kBlockM + il);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            bool visible = true;
            if (masked) {
              const int j = n0 + key_row0 + lane / 4 + 8 * (e / 2), i = m0 + il + e % 2;
              visible = i < seqlen_q && j < seqlen_k && (left < 0 || j >= i + offset - left) &&
                        (right < 0 || j <= i + offset + right);
            }
            float x = s[mt][e], dtanh = 1.f;
            if constexpr (kSoftcap) {
              x = softcap_score(x, p.softcap_exp2_scale, p.softcap);  // softcap * tanh(.)
              const float t = x / p.softcap;
              dtanh = 1.f - t * t;
            }
            const float pe = visible ? ex2(fmaf(x, p.scale_log2, -(e % 2 ? lse2.y : lse2.x))) : 0.f;
            s[mt][e] = pe;
            dp[mt][e] = pe * (dp[mt][e] - (e % 2 ? delta2.y : delta2.x)) * dtanh;
          }
        }
      };
      if (interior) {
        softmax_gradient(false);
      } else {
        softmax_gradient(true);
      }

      // Packed; dSᵀ (and Pᵀ when it does not stay in registers) to shared memory: each thread's
      // pairs of queries of its two key rows.
#pragma unroll
      for (int kt = 0; kt < kPassTiles / 2; ++kt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int mt = 2 * kt + r / 2, e = 2 * (r % 2), ktg = pass * (kPassTiles / 2) + kt;
          pa[ktg][r] = pack2<T>(s[mt][e], s[mt][e + 1]);
          dsa[ktg][r] = pack2<T>(dp[mt][e], dp[mt][e + 1]);
          const int at = (key_row0 + lane / 4 + 8 * (r % 2)) * kPStride + qp + 16 * kt + 8 * (r / 2) +
                         2 * (lane % 4);
          *reinterpret_cast<unsigned*>(sDs + at) = dsa[ktg][r];
          if constexpr (!kPInRegisters) *reinterpret_cast<unsigned*>(sP + at) = pa[ktg][r];
        }
    }

    // dV += Pᵀ dO and dK += dSᵀ Q over k16 steps of queries, this warp's columns.
    auto accumulate_dk_dv = [&](int kt, const unsigned (&pk)[4], const unsigned (&dsk)[4]) {
#pragma unroll
      for (int dt2 = 0; dt2 < kDkTiles / 2; ++dt2) {
        unsigned bdo[4], bq[4];
        ldmatrix_x4_trans(bdo, do_ldst + stage + (kt * 16 * kStride + dt2 * 16) * 2);
        ldmatrix_x4_trans(bq, q_ldst + stage + (kt * 16 * kStride + dt2 * 16) * 2);
        mma_16816_x2<T>(acc_dv[2 * dt2], acc_dv[2 * dt2 + 1], pk, bdo);
        mma_16816_x2<T>(acc_dk[2 * dt2], acc_dk[2 * dt2 + 1], dsk, bq);
      }
    };
    if constexpr (kPInRegisters) {
#pragma unroll
      for (int kt = 0; kt < kBlockM / 16; ++kt) accumulate_dk_dv(kt, pa[kt], dsa[kt]);
    }
    __syncthreads();  // dSᵀ (and Pᵀ) complete
    if constexpr (!kPInRegisters) {
      const unsigned p_lds = smem_u32(sP + (key_row0 + lane % 16) * kPStride + (lane / 16) * 8);
      constexpr unsigned kDsOffset = kBlockN * kPStride * 2;  // sDs sits right before sP
#pragma unroll
      for (int kt = 0; kt < kBlockM / 16; ++kt) {
        unsigned pk[4], dsk[4];
        ldmatrix_x4(pk, p_lds + kt * 32);
        ldmatrix_x4(dsk, p_lds - kDsOffset + kt * 32);
        accumulate_dk_dv(kt, pk, dsk);
      }
    }

    // dQ (kBlockM queries x head dim) += dS K: warp w takes queries 16 (w % kQueryGroups).. and
    // its part of the head dim, in chunks; A = dS read transposed from dSᵀ, B = K through
    // ldmatrix.trans, k16 steps over the block's keys.
    const int q_row0 = (warp % kQueryGroups) * 16;
    const int dq_col0 = (warp / kQueryGroups) * kDqTiles * 8;
    int* semaphore = nullptr;
    if (p.dq_semaphore) {
      // Deterministic: the key blocks that see this query block add to it one after the other,
      // from the last down (the semaphore counts those done).
      const int blocks_m = (p.seqlen_q + kBlockM - 1) / kBlockM;  // of the longest sequence
      semaphore = p.dq_semaphore + (static_cast<long long>(b) * p.nheads + hq) * blocks_m + m0 / kBlockM;
      if (tid == 0) {
        const int turn = key_blocks<kBlockN>(m0, kBlockM, seqlen_q, seqlen_k, left, right).n_max - 1 - n_block;
        while (ld_acquire_gpu(semaphore) != turn) {
        }
      }
      __syncthreads();
    }
#pragma unroll
    for (int chunk = 0; chunk < kDqTiles / kDqChunk; ++chunk) {
      const int c0 = dq_col0 + chunk * kDqChunk * 8;
      float acc_dq[kDqChunk][4];
#pragma unroll
      for (int dt = 0; dt < kDqChunk; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[dt][e] = 0.f;
#pragma unroll
      for (int kt = 0; kt < kBlockN / 16; ++kt) {
        // A fragment of dS (queries q_row0.., keys 16kt..): from dSᵀ[key][query] with .trans.
        unsigned a[4];
        ldmatrix_x4_trans(a, smem_u32(sDs + (16 * kt + lane % 8 + (lane / 16) * 8) * kPStride + q_row0 +
                                      ((lane / 8) % 2) * 8));
#pragma unroll
        for (int dt2 = 0; dt2 < kDqChunk / 2; ++dt2) {
          unsigned bk[4];
          ldmatrix_x4_trans(bk, smem_u32(sK + (16 * kt + lane % 8 + ((lane / 8) % 2) * 8) * kStride + c0 +
                                         dt2 * 16 + (lane / 16) * 8));
          mma_16816_x2<T>(acc_dq[2 * dt2], acc_dq[2 * dt2 + 1], a, bk);
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // rows lane / 4 and lane / 4 + 8 of the 16
        const int i = m0 + q_row0 + lane / 4 + 8 * hf;
        if (i < seqlen_q) {
          float* dq_row = dq_h + static_cast<long long>(i) * p.nheads * kHeadDim + c0 + 2 * (lane % 4);
#pragma unroll
          for (int dt = 0; dt < kDqChunk; ++dt)
            atomic_add_f32x2(dq_row + dt * 8, acc_dq[dt][2 * hf] * p.scale, acc_dq[dt][2 * hf + 1] * p.scale);
        }
      }
    }
    if (semaphore) {  // this block's additions land before the next key block's turn
      __threadfence();
      __syncthreads();
      if (tid == 0) atomicAdd(semaphore, 1);
    }
  }

  cp_async_wait<0>();  // with no query block to visit, K and V may still be landing: not while we exit
  // dK (times the scale) and dV, this warp's 16 keys and columns.
  T* dk = static_cast<T*>(p.dk) + (varlen ? k_row0 * p.dk_stride_s : b * p.dk_stride_b) + h_kv * p.dk_stride_h;
  T* dv = static_cast<T*>(p.dv) + (varlen ? k_row0 * p.dv_stride_s : b * p.dv_stride_b) + h_kv * p.dv_stride_h;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int j = n0 + key_row0 + lane / 4 + 8 * hf;
    if (j >= seqlen_k) continue;
#pragma unroll
    for (int dt = 0; dt < kDkTiles; ++dt) {
      const int c = col0 + dt * 8 + 2 * (lane % 4);
      if (c < p.headdim) {
        *reinterpret_cast<unsigned*>(dk + j * p.dk_stride_s + c) =
            pack2<T>(acc_dk[dt][2 * hf] * p.scale, acc_dk[dt][2 * hf + 1] * p.scale);
        *reinterpret_cast<unsigned*>(dv + j * p.dv_stride_s + c) = pack2<T>(acc_dv[dt][2 * hf], acc_dv[dt][2 * hf + 1]);
      }
    }
  }
}

// dq = dq_accum in the input dtype: float32 (strides accum_stride_b, _s, _h: bwd_sm80's (batch,
// seqlen_q, heads, kHeadDim), bwd_sm90's tile-contiguous rows) -> dq (16-byte aligned rows, the
// head dim a multiple of 8). kLanes threads cover a row, 8 columns each: two 16-byte loads, one
// 16-byte store (the first version, a thread per 2 columns with 64-bit index divisions, ran at 2.2
// TB/s on H100 against cuDNN's conversion's 2.7). The grid is (row blocks, heads, batch): a block's
// rows are consecutive rows of one (batch, head), contiguous in bwd_sm90's layout.
template <typename T, int kHeadDim, int kLanes>
__global__ void __launch_bounds__(256) bwd_sm80_dq(const float* __restrict__ dq_accum, T* __restrict__ dq, int seqlen_q,
                                                   int headdim, long long accum_stride_b, long long accum_stride_s,
                                                   long long accum_stride_h, long long dq_stride_b, long long dq_stride_s,
                                                   long long dq_stride_h) {
  static_assert(kLanes * 8 >= kHeadDim && kLanes <= 32 && 256 % kLanes == 0, "a row's lanes divide the block");
  constexpr int kRows = 256 / kLanes;
  const int s = blockIdx.x * kRows + threadIdx.x / kLanes, c = threadIdx.x % kLanes * 8;
  const int h = blockIdx.y, b = blockIdx.z;
  if (s >= seqlen_q || c >= headdim) return;
  const float* src = dq_accum + b * accum_stride_b + s * accum_stride_s + h * accum_stride_h + c;
  const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
  st_global_v4(dq + b * dq_stride_b + s * dq_stride_s + h * dq_stride_h + c,
               make_uint4(pack2<T>(lo.x, lo.y), pack2<T>(lo.z, lo.w), pack2<T>(hi.x, hi.y), pack2<T>(hi.z, hi.w)));
}

}  // namespace cuflash
