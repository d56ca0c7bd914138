// FlashAttention backward for Hopper (sm_90a): TMA producer, two wgmma consumer warpgroups.
//
// The algorithm is bwd_sm80's (reference.backward_tiled): one CTA owns kBlockN keys of one (batch,
// kv head), keeps their dK and dV in registers, and visits, for every query head of the kv head's
// group, the blocks of kBlockM = 64 queries that see them. Everything is computed transposed, keys
// as wgmma's M, so that Pᵀ and dSᵀ come out of the accumulators in the layout of an A operand. Up to
// head dim 128 kBlockN = 128 and each consumer owns 64 keys (as below); at head dim 256 ("split
// head", kSplitHead) dK and dV of 64 keys would not fit one warpgroup's registers, so kBlockN = 64
// and the consumers split the work the other way (after the list). Three warpgroups:
//   warpgroup 0   producer (setmaxnreg down). Thread 0 loads K and V once, then each query tile's
//                 Q and dO (128-byte swizzle, zero fill out of bounds) and its 64 LSE and D =
//                 rowsum(dO ∘ O) values (rank-1 maps over the whole lse and delta arrays: rows past
//                 the sequence read the next ones', which the mask discards; a box starts on a
//                 16-byte boundary, so it holds up to 3 values before the tile's first) by TMA into a
//                 kStages-deep ring, completing on the slot's "full" mbarrier; the consumers'
//                 warps arrive on its "empty" one when done with it. With kDqBuffers > 0 warp 1
//                 adds each tile's dQ, staged in shared memory by the consumers, to the float32 dQ
//                 buffer with one bulk reduction (cp.reduce.async.bulk): the buffer's rows are laid
//                 out as the staging's, each (batch, head)'s contiguous.
//   warpgroups 1, 2  consumers, 64 keys each (setmaxnreg up), per query tile:
//     Sᵀ = K Qᵀ, dPᵀ = V dOᵀ   wgmma SS, both operands K-major (M = 64 keys, N = 64 queries); at
//                              head dim 64 RS, K and V held in registers (kKVInRegisters)
//     Pᵀ = exp2(Sᵀ scale log2 e - LSE log2 e), dSᵀ = Pᵀ ∘ (dPᵀ - D) (∘ (1 - tanh²) with softcap),
//                              on the accumulators; masked elements and tails are 0
//     dV += Pᵀ dO, dK += dSᵀ Q wgmma RS: Pᵀ and dSᵀ packed to 16 bits in registers, dO and Q
//                              MN-major from their tiles (N = head dim, K = 64 queries)
//     dSᵀ to shared memory     both warpgroups' 64 keys side by side: [128 keys][64 queries], the
//                              128-byte swizzle; a named barrier between the two warpgroups
//     dQ = dS K                wgmma SS with both operands MN-major (dS from dSᵀ, K as loaded;
//                              M = 64 queries, N = head dim, K = 128 keys), issued by one warpgroup,
//                              the two taking turns tile by tile, times the softmax scale: staged
//                              in shared memory for the producer's warp 1 to add in one bulk
//                              reduction a tile (kDqBuffers > 0), or
//                              added by the consumer itself with two-float reductions (0).
// Split head (head dim 256): both consumers see the block's 64 keys. Consumer w computes Sᵀ and
// dPᵀ for queries 32 w .. 32 w + 31 of the tile (N = 32), and writes its half of Pᵀ and dSᵀ to
// shared memory ([64 keys][64 queries] each); after the named barrier it holds dV, dK and dQ for
// head-dim columns 128 w .. 128 w + 127: dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ and dSᵀ read from
// shared memory (wgmma SS, K-major A), and dQ = dS K every tile (no turns), both consumers staging
// their columns of the tile's rows for warp 1.
// dSᵀ (split head: dSᵀ and Pᵀ) has two buffers: a warpgroup writes tile t's while the other may
// still run tile t-1's GEMMs.
// dQ's staging has kDqBuffers (tile t uses t % kDqBuffers; "dq_full" when staged, "dq_empty" once
// warp 1's reductions have read it): a consumer stages tile t's after the reductions of tile
// t - kDqBuffers have read theirs.
// dK (times the softmax scale) and dV are written at the end: dense, staged over K's and V's
// tiles (free by then) and stored by TMA; varlen, from the accumulators. Keys past seqlen_k and
// queries past seqlen_q come back from TMA as zeros (dense) or as the next sequence's rows (varlen):
// masked, never stored. Head-dim columns past `headdim` are zero-filled by TMA.
#include "common/masking.cuh"
#include "common/sm90.cuh"

namespace cuflash {

// The launch arguments, one struct passed by value, the tensor maps first; reproduced by
// BWD_SM90_PARAMS in cuflash/kernels/bwd_sm90.py.
struct BwdSm90Params {
  TmaMap q_map, k_map, v_map, do_map;  // dense: rank 4 {dim, heads, seqlen, batch}; varlen: rank 3 {dim, heads, total}
  // Rank 1 over lse (natural log; dense (batch, heads, seqlen_q), varlen (heads, total_q), unit
  // stride along the rows) and delta (rowsum(dout * out), laid out like lse): element
  // b * stride_b + h * stride_h + row.
  TmaMap lse_map, delta_map;
  TmaMap dk_map, dv_map;  // dense only: as k_map and v_map, over dk and dv (the epilogue's TMA stores)
  // float32, zeroed: (batch, heads, seqlen_q) rows (varlen: (heads, total_q)) of dq_accum_stride_s
  // floats (kDqRowBytes / 4: the head dim and the staging's padding), then kBlockM spare rows, so
  // that a tile's 64 rows are one contiguous block of the staging's layout.
  float* dq_accum;
  void* dk;  // varlen only (dense: dk_map and dv_map), with the strides below
  void* dv;
  const int* cu_seqlens_q;  // varlen only
  const int* cu_seqlens_k;
  long long dk_stride_s, dk_stride_h;  // in elements
  long long dv_stride_s, dv_stride_h;
  long long lse_stride_b, lse_stride_h;
  long long delta_stride_b, delta_stride_h;
  long long dq_accum_stride_b, dq_accum_stride_h;  // in floats; batch unused for varlen
  int dq_accum_stride_s;
  int seqlen_q, seqlen_k;  // dense: the lengths; varlen: the maxima (each sequence reads its own)
  int group, headdim, window_left, window_right;
  float scale;             // softmax_scale
  float scale_log2;        // softmax_scale * log2(e), or log2(e) with softcap
  float softcap_exp2_scale;
  float softcap;
};
static_assert(sizeof(BwdSm90Params) == 1216, "BwdSm90Params must match BWD_SM90_PARAMS in cuflash/kernels/bwd_sm90.py");

constexpr int kBwdDsBarrier = 1;  // named barrier: both consumers' dSᵀ are in shared memory

template <typename T, int kHeadDim, int kStages, int kDqBuffers, bool kVarlen, bool kSoftcap>
__global__ void __launch_bounds__(384, 1) bwd_sm90(const __grid_constant__ BwdSm90Params p) {
  constexpr bool kSplitHead = kHeadDim > 128;    // the consumers split the head dim, not the keys
  constexpr int kBlockM = 64;                    // queries per tile
  constexpr int kBlockN = kSplitHead ? 64 : 128;  // keys per CTA
  constexpr int kAtoms = kHeadDim / 64;          // 128-byte swizzle rows across the head dim
  constexpr unsigned kKBytes = kBlockN * kAtoms * 128;  // K, or V
  constexpr unsigned kQBytes = kBlockM * kAtoms * 128;  // Q, or dO, of one slot
  constexpr unsigned kSlotBytes = 2 * kQBytes;          // a slot: Q, then dO
  constexpr unsigned kDsBytes = kBlockN * 128;          // a dSᵀ (or Pᵀ) buffer: kBlockN keys x 64 queries
  constexpr unsigned kTileBufBytes = (kSplitHead ? 2 : 1) * kDsBytes;  // a tile's dSᵀ (then Pᵀ)
  // A slot's LSE box, then D's: kBlockM values from the 16-byte boundary at or before the first,
  // each box on a 128-byte boundary (TMA's rule for shared memory).
  constexpr int kRowsBox = kBlockM + 4;
  constexpr unsigned kRowsBoxBytes = (kRowsBox * 4 + 127) / 128 * 128;
  constexpr unsigned kRowsBytes = 2 * kRowsBoxBytes;
  // dQ's staging rows, padded: a warp's 64-bit stores go out as two half-warps of 4 rows x 8 floats,
  // whose rows then start 8 banks apart and take all 32 banks once. At head dim 256 the 8 floats
  // do not fit beside the rest (one slot); 4 do, at two banks' conflicts per half-warp.
  constexpr int kDqPad = kSplitHead ? 4 : 8;
  constexpr unsigned kDqRowBytes = (kHeadDim + kDqPad) * 4;
  using Split = RegisterSplit<2>;
  constexpr int kSQueries = kSplitHead ? kBlockM / 2 : kBlockM;  // queries (N) of a consumer's Sᵀ and dPᵀ
  constexpr int kDCols = kSplitHead ? kHeadDim / 2 : kHeadDim;   // head-dim columns of its dK, dV, dQ
  constexpr int kDAcc = kDCols / 2;                     // dK, dV, dQ accumulators per thread
  constexpr int kSAcc = kSQueries / 2;                  // Sᵀ, dPᵀ accumulators per thread
  constexpr int kHeadSteps = kHeadDim / 16;             // k16 steps of Sᵀ and dPᵀ
  constexpr int kQuerySteps = kSQueries / 16;           // of the Pᵀ and dSᵀ a consumer computes
  constexpr int kKeySteps = kBlockN / 16;               // of dQ
  constexpr int kConsumerWarps = 8;
  // At head dim 64 a consumer's K and V (64 keys) are register A operands of Sᵀ and dPᵀ, 16 registers
  // each, loaded once: the two GEMMs then read only Q and dO from shared memory every tile.
  constexpr bool kKVInRegisters = !kSplitHead && kHeadDim == 64;
  static_assert(sizeof(T) == 2, "fp16 / bf16");
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "whole swizzle atoms; dK and dV of 64 keys fit the registers up to 128, of half the head dim at 256");
  static_assert(kStages >= 1, "at least one Q/dO slot");
  static_assert(kDqBuffers >= 0 && kDqBuffers <= 2, "dQ staged in one or two buffers, or not at all");
  static_assert(Split::kProducer + 2 * Split::kConsumer <= 65536 / 384 / 8 * 8 * 3, "the CTA's registers");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles start on 1024-byte boundaries (the launch asks for 1 KiB more).
  const unsigned sK = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned sV = sK + kKBytes;
  const unsigned sQ = sV + kKBytes;                 // kStages slots: Q, then dO
  const unsigned sDs = sQ + kStages * kSlotBytes;   // two tiles' dSᵀ (split head: dSᵀ, then Pᵀ)
  const unsigned sRows = sDs + 2 * kTileBufBytes;   // kStages slots: LSE, then D (kRowsBox each)
  const unsigned sDq = sRows + kStages * kRowsBytes;  // kDqBuffers x kBlockM rows of kDqRowBytes
  const unsigned bars = sDq + kDqBuffers * kBlockM * kDqRowBytes;
  const unsigned kv_full = bars;
  auto full = [&](int s) { return bars + 8u * (1 + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + kStages + s); };
  auto dq_full = [&](int buffer) { return bars + 8u * (1 + 2 * kStages + buffer); };
  auto dq_empty = [&](int buffer) { return bars + 8u * (1 + 2 * kStages + kDqBuffers + buffer); };

  const int tid = threadIdx.x;
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int lane = tid % 32;
  const int n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * kBlockN;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, q_row0 = 0, k_row0 = 0;
  if constexpr (kVarlen) {
    q_row0 = p.cu_seqlens_q[b];
    k_row0 = p.cu_seqlens_k[b];
    seqlen_q = p.cu_seqlens_q[b + 1] - q_row0;
    seqlen_k = p.cu_seqlens_k[b + 1] - k_row0;
    if (n0 >= seqlen_k) return;  // a sequence shorter than the grid: the whole CTA leaves
  }
  const int left = p.window_left, right = p.window_right;
  // The tiles: for each query head of the group, the query blocks from the one holding the first
  // query that sees this key block up to the last such query.
  int m_lo, m_hi;
  query_rows(n0, min(n0 + kBlockN, seqlen_k), seqlen_q, seqlen_k, left, right, m_lo, m_hi);
  const int m_first = (m_lo / kBlockM) * kBlockM;
  const int m_count = m_hi > m_lo ? (m_hi - m_first + kBlockM - 1) / kBlockM : 0;
  const int tiles = m_count * p.group;
  auto tile_head = [&](int t) { return h_kv * p.group + t / m_count; };
  auto tile_m0 = [&](int t) { return m_first + (t % m_count) * kBlockM; };
  // This sequence's first row of the float32 dQ buffer.
  float* const dq_rows = p.dq_accum + (kVarlen ? static_cast<long long>(q_row0) * p.dq_accum_stride_s : b * p.dq_accum_stride_b);
  // Where row m0 of query head hq is in lse or delta (given their strides), as the rank-1 maps index it.
  auto row_index = [&](long long stride_b, long long stride_h, int hq, int m0) {
    return static_cast<int>((kVarlen ? q_row0 : b * stride_b) + hq * stride_h + m0);
  };

  if (tid == 0) {
    mbarrier_init(kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 1);
      mbarrier_init(empty(s), kConsumerWarps);
    }
#pragma unroll
    for (int buffer = 0; buffer < kDqBuffers; ++buffer) {
      // the warps of both consumers (split head), or of the one whose turn it was
      mbarrier_init(dq_full(buffer), kSplitHead ? 8 : 4);
      mbarrier_init(dq_empty(buffer), 1);  // warp 1, once its reductions have read the staged dQ
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<Split::kProducer>();
    const int warp = tid / 32;
    if (warp == 0 && lane == 0 && tiles > 0) {
      auto load = [&](unsigned dst, const TmaMap* map, unsigned bar, int col, int head, int row) {
        tma_load_tokens<kVarlen>(dst, map, bar, col, head, row, b);
      };
      mbarrier_arrive_expect_tx(kv_full, 2 * kKBytes);
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) {
        load(sK + a * kBlockN * 128, &p.k_map, kv_full, 64 * a, h_kv, k_row0 + n0);
        load(sV + a * kBlockN * 128, &p.v_map, kv_full, 64 * a, h_kv, k_row0 + n0);
      }
#pragma unroll 1
      for (int t = 0; t < tiles; ++t) {
        const int s = t % kStages, hq = tile_head(t), m0 = tile_m0(t);
        // Slot s is free once the consumers released its previous use, tile t - kStages.
        if (t >= kStages) mbarrier_wait(empty(s), (t / kStages - 1) & 1);
        const unsigned slot = sQ + s * kSlotBytes, rows = sRows + s * kRowsBytes;
        mbarrier_arrive_expect_tx(full(s), kSlotBytes + 2 * kRowsBox * 4);  // Q, dO and both boxes' bytes
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) {
          load(slot + a * kBlockM * 128, &p.q_map, full(s), 64 * a, hq, q_row0 + m0);
          load(slot + kQBytes + a * kBlockM * 128, &p.do_map, full(s), 64 * a, hq, q_row0 + m0);
        }
        tma_load_1d(rows, &p.lse_map, full(s), row_index(p.lse_stride_b, p.lse_stride_h, hq, m0) & ~3);
        tma_load_1d(rows + kRowsBoxBytes, &p.delta_map, full(s), row_index(p.delta_stride_b, p.delta_stride_h, hq, m0) & ~3);
      }
    } else if (kDqBuffers > 0 && warp == 1) {
      // The staging rows' padding, added to dq_accum's with the rest: zeros, written once.
      for (int i = lane; i < kDqBuffers * kBlockM * (kDqPad / 2); i += 32) {
        const int row = i / (kDqPad / 2), pair = i % (kDqPad / 2);
        st_shared_v2_f32(sDq + row * kDqRowBytes + 4 * kHeadDim + 8 * pair, 0.f, 0.f);
      }
      fence_proxy_async_shared();  // before this warp's bulk reductions (issued by lane 0) read them
      __syncwarp();
#pragma unroll 1
      for (int t = 0; t < tiles; ++t) {
        const int buffer = t % kDqBuffers, hq = tile_head(t), m0 = tile_m0(t);
        mbarrier_wait(dq_full(buffer), (t / kDqBuffers) & 1);
        // The tile's rows in one reduction: dq_accum's rows are laid out as the staging's. Rows past
        // the sequence add zeros (no key is visible to them) to the next rows or the spare ones.
        if (lane == 0) {
          bulk_reduce_add_f32(dq_rows + hq * p.dq_accum_stride_h + static_cast<long long>(m0) * p.dq_accum_stride_s,
                              sDq + buffer * kBlockM * kDqRowBytes, kBlockM * kDqRowBytes);
          bulk_commit();
          bulk_wait_read<0>();
        }
        mbarrier_arrive_warp(dq_empty(buffer));
      }
      bulk_wait<0>();  // the additions are complete before the kernel ends
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<Split::kConsumer>();
  const int wg = warpgroup - 1;
  const int key_in_wg = 16 * (tid % 128 / 32) + lane / 4;      // this thread's keys: key_in_wg and + 8
  // This consumer's share: the keys of its Sᵀ and dPᵀ from key0 of the block (64 of them), their
  // queries from query0 of the tile (kSQueries), and the head-dim columns of its dK, dV and dQ from
  // col0 (kDCols).
  const int key0 = kSplitHead ? 0 : 64 * wg, query0 = kSplitHead ? kSQueries * wg : 0;
  const int col0 = kSplitHead ? kDCols * wg : 0;
  // Descriptors (128-byte swizzle). K-major: this consumer's K and V rows as A (atoms kBlockN rows
  // apart), Q and dO rows as B (atoms kBlockM rows apart); a k16 step over the head dim moves 32
  // bytes in an atom, or to the next atom every 4 steps; Pᵀ and dSᵀ as A of dV and dK (split head).
  // MN-major (LBO: the next atom across N or M, SBO: 8 rows of 128 bytes): Q and dO (from column
  // col0) as B of dK and dV, dSᵀ as A and K (from col0) as B of dQ; a k16 step is 16 rows, 2048 bytes.
  const unsigned long long desc_k = smem_descriptor_sw128(sK + key0 * 128, 16, 1024);
  const unsigned long long desc_v = smem_descriptor_sw128(sV + key0 * 128, 16, 1024);
  const unsigned long long desc_q = smem_descriptor_sw128(sQ + query0 * 128, 16, 1024);
  const unsigned long long desc_q_mn = smem_descriptor_sw128(sQ + col0 / 64 * kBlockM * 128, kBlockM * 128, 1024);
  const unsigned long long desc_ds = smem_descriptor_sw128(sDs, kDsBytes, 1024);
  const unsigned long long desc_ds_k = smem_descriptor_sw128(sDs, 16, 1024);
  const unsigned long long desc_k_mn = smem_descriptor_sw128(sK + col0 / 64 * kBlockN * 128, kBlockN * 128, 1024);

  float dk[kDAcc], dv[kDAcc];
#pragma unroll
  for (int i = 0; i < kDAcc; ++i) dk[i] = dv[i] = 0.f;
  const int offset = seqlen_k - seqlen_q;
  constexpr float kLog2e = 1.4426950408889634f;
  if (tiles > 0) mbarrier_wait(kv_full, 0);
  unsigned ka[kKVInRegisters ? kHeadSteps : 1][4], va[kKVInRegisters ? kHeadSteps : 1][4];
  if constexpr (kKVInRegisters) {
    // ldmatrix.x4 of k16 step kk: lanes 0-7 give rows 0-7 of the warp's 16 keys at columns 16 kk..,
    // lanes 8-15 rows 8-15, lanes 16-31 the same rows at columns 16 kk + 8.. (the A layout).
    const int row = key0 + 16 * (tid % 128 / 32) + lane % 16;
#pragma unroll
    for (int kk = 0; kk < kHeadSteps; ++kk) {
      ldmatrix_x4(ka[kk], sK + sw128_offset(row, 2 * kk + lane / 16));
      ldmatrix_x4(va[kk], sV + sw128_offset(row, 2 * kk + lane / 16));
    }
  }

#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    const int s = t % kStages, hq = tile_head(t), m0 = tile_m0(t);
    const unsigned slot_q = (s * kSlotBytes) >> 4, slot_do = (s * kSlotBytes + kQBytes) >> 4;  // descriptor units
    mbarrier_wait(full(s), (t / kStages) & 1);

    float st[kSAcc], dpt[kSAcc];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadSteps; ++kk) {
      if constexpr (kKVInRegisters) {
        Wgmma<T, kSQueries>::template rs<0>(st, ka[kk], desc_q + slot_q + k_major_step(kk, kBlockM), kk > 0);
      } else {
        Wgmma<T, kSQueries>::ss(st, desc_k + k_major_step(kk, kBlockN), desc_q + slot_q + k_major_step(kk, kBlockM),
                                kk > 0);
      }
    }
#pragma unroll
    for (int kk = 0; kk < kHeadSteps; ++kk) {
      if constexpr (kKVInRegisters) {
        Wgmma<T, kSQueries>::template rs<0>(dpt, va[kk], desc_q + slot_do + k_major_step(kk, kBlockM), kk > 0);
      } else {
        Wgmma<T, kSQueries>::ss(dpt, desc_v + k_major_step(kk, kBlockN), desc_q + slot_do + k_major_step(kk, kBlockM),
                                kk > 0);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(st);
    pin_registers(dpt);

    // Pᵀ and dSᵀ in place: accumulator 4 nt + 2 hf + e holds key j = n0 + key0 + key_in_wg + 8 hf,
    // query i = m0 + query0 + 8 nt + 2 (lane % 4) + e.
    // This tile's first LSE and D values in their boxes (which start on 16-byte boundaries).
    const unsigned lse_rows = sRows + s * kRowsBytes + 4 * (row_index(p.lse_stride_b, p.lse_stride_h, hq, m0) & 3);
    const unsigned delta_rows =
        sRows + s * kRowsBytes + kRowsBoxBytes + 4 * (row_index(p.delta_stride_b, p.delta_stride_h, hq, m0) & 3);
    const bool interior = sees_all(m0, kBlockM, n0, kBlockN, seqlen_q, seqlen_k, left, right);
    // (called with a constant, inlined: each call site compiles its own loop)
    auto softmax_gradient = [&](bool masked) {
#pragma unroll
      for (int nt = 0; nt < kSQueries / 8; ++nt) {
        const int il = query0 + 8 * nt + 2 * (lane % 4);
        const float lse2[2] = {__uint_as_float(ld_shared_b32(lse_rows + 4 * il)) * kLog2e,
                               __uint_as_float(ld_shared_b32(lse_rows + 4 * il + 4)) * kLog2e};
        const float delta2[2] = {__uint_as_float(ld_shared_b32(delta_rows + 4 * il)),
                                 __uint_as_float(ld_shared_b32(delta_rows + 4 * il + 4))};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int idx = 4 * nt + r, e = r % 2;
          bool visible = true;
          if (masked) {
            const int j = n0 + key0 + key_in_wg + 8 * (r / 2), i = m0 + il + e;
            visible = i < seqlen_q && j < seqlen_k && (left < 0 || j >= i + offset - left) &&
                      (right < 0 || j <= i + offset + right);
          }
          // (bwd_sm80's element-wise code, kept written out in both: shared as a function it cost
          // bwd_sm80 at head dim 128, which uses all 255 registers, a spill)
          float x = st[idx], dtanh = 1.f;
          if constexpr (kSoftcap) {
            x = softcap_score(x, p.softcap_exp2_scale, p.softcap);  // softcap * tanh(.)
            const float th = x / p.softcap;
            dtanh = 1.f - th * th;
          }
          const float pe = visible ? ex2(fmaf(x, p.scale_log2, -lse2[e])) : 0.f;
          st[idx] = pe;
          dpt[idx] = pe * (dpt[idx] - delta2[e]) * dtanh;
        }
      }
    };
    if (interior) {
      softmax_gradient(false);
    } else {
      softmax_gradient(true);
    }

    // Packed as A operands (k16 step kk: accumulators 8 kk .. 8 kk + 7, queries query0 + 16 kk ..);
    // dSᵀ (split head: and Pᵀ) also into this tile's buffer, row = key, 128-byte swizzle.
    unsigned pa[kQuerySteps][4], dsa[kQuerySteps][4];
    const unsigned ds_buf = sDs + (t % 2) * kTileBufBytes, pt_buf = ds_buf + kDsBytes;
#pragma unroll
    for (int kk = 0; kk < kQuerySteps; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[kk][r] = pack2<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
        dsa[kk][r] = pack2<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
        const int row = key0 + key_in_wg + 8 * (r % 2), chunk = query0 / 8 + 2 * kk + r / 2;  // 16-byte chunk = 8 queries
        st_shared_b32(ds_buf + sw128_offset(row, chunk) + (lane % 4) * 4, dsa[kk][r]);
        if constexpr (kSplitHead) st_shared_b32(pt_buf + sw128_offset(row, chunk) + (lane % 4) * 4, pa[kk][r]);
      }
    // dQ of this tile (times the scale) into the float32 buffer. Rows 16 (warp) + lane / 4 (+ 8) of the
    // tile (key_in_wg is also this thread's query row), two columns per store or reduction.
    auto add_dq = [&](const float (&dq)[kDAcc]) {
      if constexpr (kDqBuffers > 0) {
        // Staged once warp 1 has read what tile t - kDqBuffers staged in the same buffer.
        const int buffer = t % kDqBuffers;
        if (t >= kDqBuffers) mbarrier_wait(dq_empty(buffer), (t / kDqBuffers - 1) & 1);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const unsigned row = sDq + (buffer * kBlockM + key_in_wg + 8 * hf) * kDqRowBytes + 4 * col0 + 8 * (lane % 4);
#pragma unroll
          for (int nt = 0; nt < kDCols / 8; ++nt) {
            st_shared_v2_f32(row + 32 * nt, dq[4 * nt + 2 * hf] * p.scale, dq[4 * nt + 2 * hf + 1] * p.scale);
          }
        }
        fence_proxy_async_shared();  // before the async proxy (warp 1's bulk reductions) reads them
        mbarrier_arrive_warp(dq_full(buffer));
      } else {
        float* dq_head = dq_rows + hq * p.dq_accum_stride_h;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = m0 + key_in_wg + 8 * hf;
          if (i < seqlen_q) {
            float* dq_row = dq_head + static_cast<long long>(i) * p.dq_accum_stride_s + col0 + 2 * (lane % 4);
#pragma unroll
            for (int nt = 0; nt < kDCols / 8; ++nt) {
              if (col0 + 8 * nt < p.headdim) {
                atomic_add_f32x2(dq_row + 8 * nt, dq[4 * nt + 2 * hf] * p.scale, dq[4 * nt + 2 * hf + 1] * p.scale);
              }
            }
          }
        }
      }
    };
    const unsigned long long tile_ds = desc_ds + (((t % 2) * kTileBufBytes) >> 4);
    if constexpr (kSplitHead) {
      // Both halves of Pᵀ and dSᵀ in shared memory, then this consumer's columns of dV, dK and dQ.
      fence_proxy_async_shared();  // this thread's stores, before both consumers' wgmmas read them
      named_barrier_sync(kBwdDsBarrier, 256);
      const unsigned long long tile_pt = desc_ds_k + ((pt_buf - sDs) >> 4), tile_dst = desc_ds_k + ((ds_buf - sDs) >> 4);
      float dq[kDAcc];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        Wgmma<T, kDCols>::template ss<0, 1>(dv, tile_pt + k_major_step(kk, kBlockN),
                                            desc_q_mn + slot_do + ((kk * 2048) >> 4), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        Wgmma<T, kDCols>::template ss<0, 1>(dk, tile_dst + k_major_step(kk, kBlockN),
                                            desc_q_mn + slot_q + ((kk * 2048) >> 4), 1);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
        Wgmma<T, kDCols>::template ss<1, 1>(dq, tile_ds + ((kk * 2048) >> 4), desc_k_mn + ((kk * 2048) >> 4), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // dV and dK done: the slot's Q and dO are free
      pin_registers(dk);
      pin_registers(dv);
      mbarrier_arrive_warp(empty(s));
      wgmma_wait<0>();
      pin_registers(dq);
      add_dq(dq);
    } else {
      wgmma_fence();  // Pᵀ and dSᵀ were written by ordinary instructions
#pragma unroll
      for (int kk = 0; kk < kQuerySteps; ++kk) {
        Wgmma<T, kDCols>::template rs<1>(dv, pa[kk], desc_q_mn + slot_do + ((kk * 2048) >> 4), 1);
      }
#pragma unroll
      for (int kk = 0; kk < kQuerySteps; ++kk) {
        Wgmma<T, kDCols>::template rs<1>(dk, dsa[kk], desc_q_mn + slot_q + ((kk * 2048) >> 4), 1);
      }
      wgmma_commit();
      fence_proxy_async_shared();  // this thread's dSᵀ stores, before the other warpgroup's dQ reads them
      named_barrier_sync(kBwdDsBarrier, 256);
      // dV and dK done: the slot's Q and dO are free, and so are the A registers (Pᵀ, dSᵀ), for dQ's
      // accumulators.
      wgmma_wait<0>();
      pin_registers(dk);
      pin_registers(dv);
      mbarrier_arrive_warp(empty(s));
      if (wg == t % 2) {  // the warpgroups take turns with dQ
        float dq[kDAcc];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) {
          Wgmma<T, kDCols>::template ss<1, 1>(dq, tile_ds + ((kk * 2048) >> 4), desc_k_mn + ((kk * 2048) >> 4), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(dq);
        add_dq(dq);
      }
    }
  }

  // dK (times the scale) and dV of this thread's keys: accumulator 4 nt + 2 hf + e holds key
  // key0 + key_in_wg + 8 hf, column col0 + 8 nt + 2 (lane % 4) + e.
  if constexpr (kVarlen) {
    // Straight from the accumulators (a TMA box would spill into the next sequence's keys).
    T* dk_out = static_cast<T*>(p.dk) + k_row0 * p.dk_stride_s + h_kv * p.dk_stride_h;
    T* dv_out = static_cast<T*>(p.dv) + k_row0 * p.dv_stride_s + h_kv * p.dv_stride_h;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int j = n0 + key0 + key_in_wg + 8 * hf;
      if (j >= seqlen_k) continue;
#pragma unroll
      for (int nt = 0; nt < kDCols / 8; ++nt) {
        const int c = col0 + 8 * nt + 2 * (lane % 4);
        if (c < p.headdim) {
          *reinterpret_cast<unsigned*>(dk_out + j * p.dk_stride_s + c) =
              pack2<T>(dk[4 * nt + 2 * hf] * p.scale, dk[4 * nt + 2 * hf + 1] * p.scale);
          *reinterpret_cast<unsigned*>(dv_out + j * p.dv_stride_s + c) = pack2<T>(dv[4 * nt + 2 * hf], dv[4 * nt + 2 * hf + 1]);
        }
      }
    }
  } else {
    // Staged over K and V in their own layout, then stored by TMA in whole 128-byte rows (keys past
    // seqlen_k and columns past headdim are not written). Stored from the accumulators, a warp's
    // store covers 8 keys x 16 bytes: that epilogue took 4-7 us a CTA on H100, a sixth of a CTA's
    // time at 1k queries. K and V are free once both consumers are past the last tile (its dQ GEMM
    // reads K).
    named_barrier_sync(kBwdDsBarrier, 256);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = key0 + key_in_wg + 8 * hf;
#pragma unroll
      for (int nt = 0; nt < kDCols / 8; ++nt) {
        const int c = col0 + 8 * nt;  // this thread's 4 bytes are 4 (lane % 4) into the 16-byte chunk of c
        const unsigned at = (c / 64) * kBlockN * 128 + sw128_offset(row, c % 64 / 8) + 4 * (lane % 4);
        st_shared_b32(sK + at, pack2<T>(dk[4 * nt + 2 * hf] * p.scale, dk[4 * nt + 2 * hf + 1] * p.scale));
        st_shared_b32(sV + at, pack2<T>(dv[4 * nt + 2 * hf], dv[4 * nt + 2 * hf + 1]));
      }
    }
    fence_proxy_async_shared();  // before the async proxy (the TMA stores) reads them
    named_barrier_sync(kBwdDsBarrier, 256);
    if (tid == 128) {
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) {
        tma_store_4d(&p.dk_map, sK + a * kBlockN * 128, 64 * a, h_kv, n0, b);
        tma_store_4d(&p.dv_map, sV + a * kBlockN * 128, 64 * a, h_kv, n0, b);
      }
      bulk_commit();
      bulk_wait_read<0>();  // the CTA's shared memory stays until the stores have read it
    }
  }
}

}  // namespace cuflash
