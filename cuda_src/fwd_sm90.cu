// FlashAttention forward for Hopper (sm_90a): warp-specialised TMA producer, wgmma consumers,
// persistent over output tiles.
//
// The grid is one CTA per SM. Output tiles are kBlockM = 64 * kConsumers query rows of one (batch, head),
// numbered m-block fastest (a head's row blocks run side by side and share K and V in L2), latest
// row block first (for causal, the longest tiles go first; Tile says where a part-empty tile goes);
// masked variants number them row block major within windows of heads (tile_at). CTA c starts
// with tile c and then takes the next untaken tile from a global counter, so tiles of unequal
// length (causal) balance out as they would under the hardware's own block scheduler. The
// producer draws the indices and publishes each with the tile's Q: written into the Q buffer's
// index slot before its arrival on Q's full barrier (an mbarrier arrival releases, a completed wait
// acquires). A consumer warpgroup thus starts a tile as soon as its Q is there, while the other
// consumers may still be finishing the tile before (with ping-pong the turns run on across tiles;
// without, the consumers start each tile together, kTileBarrier), and nothing makes the producer
// wait for the consumers but its ring's and Q's empty barriers.
// 1 + kConsumers warpgroups:
//   warpgroup 0   producer: gives registers away (setmaxnreg), and one thread issues TMA loads
//                 of each tile's Q and of K and V tiles into a kStages-deep ring, each completing
//                 on a "full" mbarrier; it refills a slot (or Q) when the consumers arrive on its
//                 "empty" one. The ring runs on across tiles, so the next tile's K and V load while
//                 the consumers finish the current one.
//   warpgroups 1..kConsumers  consumers (2, or 3 where the head dim is small, or 1 in split-KV
//                 decode steps, whose few rows one consumer holds): each owns 64 of
//                 the rows and takes registers (setmaxnreg).
//                 S = Q K^T is a wgmma with both operands in shared memory (K-major, 128-byte
//                 swizzle); the online softmax runs on the S accumulators in the log2 domain; P is
//                 packed to 16 bits (e4m3: 8) in registers and O += P V is a wgmma with A from
//                 registers and V MN-major from shared memory (e4m3: V^T K-major, which producer
//                 warps 1..3 transpose from a staging slot, see kTransposeWarps; or, with
//                 kVPreTransposed, which TMA loads from a V^T the launcher wrote beforehand).
// Within a consumer, S(j) and PV(j-1) are issued back to back and the warpgroup waits only for S(j)
// before the softmax, then for PV(j-1) before rescaling O and packing the new P (the P registers
// are read by PV(j-1) until then). ptxas schedules within a basic block: with the second wait at
// the bottom of the loop it hoists the wait up to the first, above the whole softmax of block j
// (only a tail block's mask lies between them, in every overlap row's SASS on sm_90a), so PV(j-1)
// runs beside the other consumers' softmaxes, not this one's (but the packing of P then
// interleaves with the exponentials, and V's slot is released a softmax sooner). Keeping the wait
// below the exponentials (a never-taken branch on their sums, so that ptxas cannot hoist it)
// measured 7-17% slower in e4m3 (benchmarks/NOTES-fp8.md, session 40). kScheduleOverlapPV puts
// the wait, the rescale and the packing at the top of the next iteration instead, where the loop's
// back edge keeps the whole softmax of block j above them: a table choice per row (TILES in
// cuflash/kernels/fwd_sm90.py; benchmarks/NOTES-sm90.md, version 26). Both hold S(j), P(j-1) and O
// in registers at once, which at head dim 256 bounds the key block to 80 (O 128 + S 40 + P 20 of
// 240 registers). The serial schedule (kScheduleSerial) holds at most two of them: PV(j-1) is issued
// in a turn of its own and waited for before S(j) is issued in the next, so P is dead when S is
// written and 128-key blocks fit. The tensor cores stay busy through the other consumers' GEMMs,
// issued in the turns between (ping-pong): a warpgroup waits for its PV(j-1) while another's PV
// runs, and does its softmax while another's S runs, so the GEMMs must outlast a softmax.
// With ping-pong (kConsumerSync) the consumers take turns, round robin, to issue their GEMMs (one
// named barrier each), so one warpgroup's softmax runs while the tensor cores work through
// another's GEMMs; otherwise they start each tile together, or run free.
// Key blocks are walked from last to first, so masked blocks (causal diagonal, key tail) come
// first; fully masked blocks are never loaded. Shared-memory tiles are [head-dim atoms][rows][128
// bytes] (an atom is 64 16-bit or 128 e4m3 elements; e4m3's head dim 64 fills half of one), TMA's
// 128-byte swizzle, exactly what the wgmma descriptors read.
// Rows outside [0, seqlen_q) (a sequence's first tile may start above row 0: Tile) and
// keys beyond seqlen_k come back from TMA as zeros (dense) or belong to a neighbouring sequence
// (varlen); keys are masked, rows are never stored. Head-dim columns beyond `headdim` (kHeadDim
// is padded to a compiled one) are out of bounds for TMA: zeros.
// Each consumer releases Q once its last GEMM of the tile is done (its last S = Q K^T where there is
// one Q buffer, kQReleaseAfterS; with O staged in Q's tile, once O is stored), so the next tile's Q
// loads while it finishes the tile, divides O by the row sums and stores it
// (OStage: through shared memory, then by TMA stores or in 16-byte row chunks, or straight from the
// accumulators); the LSE goes out in natural log. With kQBuffers = 2 (where shared memory has
// room) tiles alternate between two Q buffers, and a tile's Q loads as soon as the producer has
// issued the K/V loads of the tile before.
#include "common/masking.cuh"
#include "common/sm90.cuh"

namespace cuflash {

// The launch arguments, one struct passed by value. The tensor maps (CUtensorMap, 128 bytes,
// 64-byte aligned) come first; the layout is reproduced by FWD_SM90_PARAMS in
// cuflash/kernels/fwd_sm90.py.
struct FwdSm90Params {
  TmaMap q_map, k_map, v_map;  // dense: rank 4 {dim, heads, seqlen, batch}; varlen: rank 3 {dim, heads, total}
                               // (e4m3 kVPreTransposed: v_map over V^T, {keys, dim, heads, batch})
  void* out;
  float* lse;
  const int* cu_seqlens_q;  // varlen only
  const int* cu_seqlens_k;
  // e4m3 only: q, k and v are x8 * descale, one float per (batch, head) or per 128 rows of a head:
  // descale[b * stride_b + h * stride_h + (row / 128) * stride_block] (stride_block 0 per head; q's
  // row >> q_descale_shift in the split variants).
  const float* descale[3];  // q, k, v
  long long o_stride_b, o_stride_s, o_stride_h;  // in elements; batch stride unused for varlen
  long long lse_stride_b, lse_stride_h;
  int descale_stride_b[3], descale_stride_h[3], descale_stride_block[3];
  int seqlen_q, seqlen_k;  // dense: the lengths; varlen: the maxima (each sequence reads its own)
  int group;               // query heads per kv head. Not read (group_div is), but kept: without it the
                           // fields after it move and ptxas re-schedules the e4m3 kernel, -5% at head
                           // dim 128 causal 16k, reproduced twice (benchmarks/NOTES-sm90.md, version 30)
  int headdim;             // the caller's head dim (<= kHeadDim)
  int window_left, window_right;  // -1: unbounded; causal is window_right = 0
  float scale_log2;        // softmax_scale * log2(e), or log2(e) with softcap
  float softcap_exp2_scale;  // 2 * log2(e) * softmax_scale / softcap: tanh's exponent per score
  float softcap;
  int nheads;
  int blocks_m;            // row blocks per (batch, head): ceil(seqlen_q / kBlockM)
  int num_tiles;           // blocks_m * nheads * batch
  int counter_slot;        // which tile counter this launch uses (see tile_counters)
  FastDivisor blocks_m_div, nheads_div, group_div;  // for the tile index's and the kv head's divisions
  // Masked variants: the pairs from window_pair0 on in windows of window_heads (batch, head) pairs
  // (window_tiles tiles), row block major within a window; those before it head by head (tile_at;
  // fwd_sm90.py, tile_window).
  int window_heads, window_tiles;
  FastDivisor window_heads_div, window_tiles_div;
  int window_pair0;
  // kSplitKV: each (batch, head, row block) is num_splits tiles, split s taking key blocks
  // [s * split_blocks, (s + 1) * split_blocks) (tile_at); out and lse are then the float32 partials
  // of (batch, split) pairs, b * num_splits + s in the batch strides. In what was padding before
  // o_map, so that no field moved.
  int num_splits, split_blocks;
  FastDivisor splits_div;
  // e4m3, kSplitKV: q's descale block is row >> q_descale_shift (7: 128 rows; 0: one a row, where a
  // decode step's query heads are the rows of their kv head, kernels.forward.query_heads_as_rows:
  // those calls run the split variants, and the others keep row / 128).
  int q_descale_shift;
  // Dense: out as a rank-4 map {dim, heads, seqlen, batch} of boxes of one 16-bit swizzle row by 64
  // rows, for the epilogue's TMA stores (varlen: unused). Its 64-byte alignment pads the struct;
  // nothing before it moved since.
  TmaMap o_map;
  // Nonzero where the kernels launched just before this one, as a chain of programmatic dependents,
  // write every input it reads (fwd_quantized_sm90): its threads wait for them before reading any.
  int wait_for_inputs;
};
static_assert(sizeof(FwdSm90Params) == 832, "FwdSm90Params must match FWD_SM90_PARAMS in cuflash/kernels/fwd_sm90.py");

// How the consumer warpgroups keep in step: they start each tile together (kSyncTile), take turns
// issuing their GEMMs (kSyncPingPong), or neither (kSyncFree; each still reads its tile from Q's
// slot, and the K/V ring's barriers bound how far apart they drift).
enum ConsumerSync : int { kSyncTile = 0, kSyncPingPong = 1, kSyncFree = 2 };

// Where a consumer issues and waits for P V (the comment at the top of this file): beside the next
// block's S = Q K^T, finished where ptxas puts it (kScheduleOverlap) or after that block's softmax
// (kScheduleOverlapPV); or in a turn of its own, finished before that S is issued (kScheduleSerial).
enum Schedule : int { kScheduleOverlap = 0, kScheduleOverlapPV = 1, kScheduleSerial = 2 };

// Where the epilogue stages O for its TMA stores (or 16-byte row stores): a tile of its own; the V
// slot of the tile's last key block (when shared memory has no room for a tile of its own and the
// slot is as large: 16 bits, kBlockN >= kBlockM; every consumer's last P V must be done before any
// writes there, and the slot is released after the stores; a tile without key blocks stores zeros
// unstaged: its O is zero, and that slot another tile's); Q's tile (when neither fits; Q is then
// released only after the stores, and the next tile's Q loads after the epilogue); or nowhere:
// stored straight from the accumulators, a quad writing 16 contiguous bytes of a row (e4m3 at head
// dim 256, where the 16-bit O is twice Q's size and the V staging slots take the room; and
// kSplitKV's float32 partials, a quad writing 32 bytes).
enum OStage : int { kOStageOwn = 0, kOStageInQ = 1, kOStageDirect = 2, kOStageInV = 3 };

// e4m3 (FP8): both wgmma operands must be K-major, and for O += P V the K dimension is the keys,
// so V is transposed: in shared memory (TMA brings each V block into a staging slot, warps 1..3 of
// the producer warpgroup write it transposed into the V slot the consumers read), or beforehand by
// a kernel of its own into a V^T that TMA loads like K (kVPreTransposed: where V blocks serve
// enough query rows to pay for the extra pass, FP8_TILES in cuflash/kernels/fwd_sm90.py). P's
// columns are permuted on the way (below). Per (batch, head) or per-128-row descales scale the scores
// (q's and k's fold into the softmax scale) and O (v's: O is kept in units of the current
// block's v descale, rescaled with the softmax correction when the block's scale changes).
constexpr int kTransposeWarps = 3;
// P's e4m3 A operand holds, in each group of 16 keys, position 4c + q the key 2c + (q & 1) +
// 8 (q >> 1): the accumulator registers then pack straight into A registers (no shuffles), and
// the transpose (either) stores key 16g + that at position 16g + 4c + q (shared/notes/hopper.md
// section 8).

constexpr int kSchedulerBarrier = 1;  // named barriers 1..3: the ping-pong turn of each consumer
constexpr int kWarpgroupBarrier = 4;  // named barriers 4..6: one consumer's own (O staging, tile start)
constexpr int kTileBarrier = 7;       // without ping-pong, the consumers start each tile together
constexpr int kOInVBarrier = 8;       // kOStageInV: every consumer's last P V is done before O's staging

// The dynamic tile scheduler's counters: {tiles handed out beyond the first gridDim.x, CTAs done}.
// Zero when the module loads; the last CTA of a launch to finish resets its pair to zero, so launches
// on one stream (or replays of one CUDA graph) can share a pair. The host hands successive launches
// successive slots, so concurrent launches on different streams would have to be kTileCounters
// launches apart to collide.
constexpr int kTileCounters = 4096;
__device__ int tile_counters[kTileCounters][2];

// One output tile: where its rows and keys are, and the key blocks its rows can see.
// Tiles are aligned to the sequence's last row: where seqlen_q is not a multiple of kBlockM, the
// part-empty tile is the first, which starts above row 0 (m0 < 0; TMA zero-fills those rows, or,
// varlen, they belong to the sequence before; they are never stored). A tile's warpgroups start
// together, so a tile lasts as long as its busiest warpgroup whatever the others do, and under a
// causal mask the first rows see the fewest keys: the part-empty tile is then the cheapest, where
// aligned to row 0 it would be the most expensive. Measured on H100: head dim 64 causal +1.5% at
// 512, +3% at 1k (three consumers, 192 rows); unmasked, where every tile sees the same keys, -0.5%
// (benchmarks/NOTES-sm90.md, version 35).
struct Tile {
  int m0, h, b;
  int seqlen_q, seqlen_k;
  int q_row0, k_row0;  // varlen: where the sequence starts in the packed tensors
  KeyBlocks kb;        // the key blocks its rows see (none for a tile before its varlen sequence)
  // Whether `row` of this sequence exists (the first tile's rows may lie above row 0).
  __device__ __forceinline__ bool has_row(int row) const {
    return static_cast<unsigned>(row) < static_cast<unsigned>(seqlen_q);
  }
};

// Unmasked, tiles are numbered row block fastest, head by head. Masked (kMasked), where a head's
// row blocks differ in cost (causal: 1 to blocks_m key blocks), the heads from window_pair0 on go
// in windows of window_heads, and within a window the tiles go row block by row block (the latest
// first), head fastest: the tiles the CTAs draw last are then the window's cheapest, so they finish
// together. Head by head, a long tile could be drawn last: the CTAs' finishing times spread by up
// to a tile (a model of the greedy draw: 11-14% over the ideal for causal 512-8k at FA3 sizing,
// 1-3% with windows of a wave's worth of heads; measured +3-8% from 2k, where every head is in a
// window: fwd_sm90.py, TILE_WINDOW_MIN_KEYS). A window's heads run together, as a head's row blocks
// do; below 2k keys, where that holds more K and V than L2 keeps, only the last wave's worth of
// heads goes in a window (the draw's balance is decided by its last tiles).
// kSplitKV (dense): a tile's num_splits parts are consecutive indices, each with its share of the
// key blocks counted from block 0, clamped to the tile's (a part left empty would store O 0 and
// LSE -inf; fwd_sm90.py's split_masked keeps masked parts from that).
template <int kBlockM, int kBlockN, bool kVarlen, bool kMasked, bool kSplitKV>
__device__ __forceinline__ Tile tile_at(const FwdSm90Params& p, int index) {
  Tile t;
  int split = 0;
  if constexpr (kSplitKV) {
    const int whole = fast_div(index, p.splits_div);
    split = index - whole * p.num_splits;
    index = whole;
  }
  int hb, from_last;  // the (batch, head) pair, and the row block counted from the sequence's end
  const int windowed = kMasked ? p.window_pair0 * p.blocks_m : 0;  // the first tile in a window
  if (kMasked && index >= windowed) {
    const int window = fast_div(index - windowed, p.window_tiles_div);
    const int in_window = index - windowed - window * p.window_tiles;
    from_last = fast_div(in_window, p.window_heads_div);
    hb = p.window_pair0 + window * p.window_heads + in_window - from_last * p.window_heads;
  } else {
    hb = fast_div(index, p.blocks_m_div);
    from_last = index - hb * p.blocks_m;
  }
  t.b = fast_div(hb, p.nheads_div);
  t.h = hb - t.b * p.nheads;
  t.seqlen_q = p.seqlen_q;
  t.seqlen_k = p.seqlen_k;
  t.q_row0 = t.k_row0 = 0;
  if constexpr (kVarlen) {
    t.q_row0 = p.cu_seqlens_q[t.b];
    t.k_row0 = p.cu_seqlens_k[t.b];
    t.seqlen_q = p.cu_seqlens_q[t.b + 1] - t.q_row0;
    t.seqlen_k = p.cu_seqlens_k[t.b + 1] - t.k_row0;
  }
  t.m0 = t.seqlen_q - (from_last + 1) * kBlockM;
  t.kb = key_blocks<kBlockN>(t.m0, kBlockM, t.seqlen_q, t.seqlen_k, p.window_left, p.window_right);
  if constexpr (kSplitKV) {
    const int lo = split * p.split_blocks;
    t.kb.n_min = max(t.kb.n_min, lo);
    t.kb.n_max = max(t.kb.n_min, min(t.kb.n_max, lo + p.split_blocks));
  }
  return t;
}

// Softcap, mask (where `masked`: the block straddles a boundary of these rows) and online softmax of
// the first kN keys of a key block in s, the S accumulators of one thread (rows `row` and row + 8,
// columns from col0 on, relative to the sequence); scale: each row's log2-domain score scale.
// Returns each row's O rescale factor in correction. kN is the block's width, or kHalfTop's half.
template <int kN, bool kSoftcap, int kExpOffset, int kStaleMax, int kMaxChains, bool kIntMax, int kFmaEvery,
          bool kFmaPairs, bool kCodes, int kSAcc>
__device__ __forceinline__ void block_softmax(float (&s)[kSAcc], bool masked, int row, int col0, const Tile& t,
                                              int window_left, int window_right, float softcap_exp2_scale,
                                              float softcap, const float (&scale)[2], float (&row_max)[2],
                                              float (&row_sum)[2], float (&correction)[2]) {
  static_assert(kN <= 2 * kSAcc, "kN keys of the block");
  if constexpr (kSoftcap) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) s[i] = softcap_score(s[i], softcap_exp2_scale, softcap);
  }
  if (masked) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      int lo, hi;  // this row's visible keys, relative to this thread's first column of the block
      visible_columns(row + 8 * hf, col0, t.seqlen_q, t.seqlen_k, window_left, window_right, lo, hi);
#pragma unroll
      for (int nt = 0; nt < kN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (nt * 8 + e < lo || nt * 8 + e > hi) s[4 * nt + 2 * hf + e] = -infinity();
        }
    }
  }
  auto row_scores = [&](int hf) { return [&s, hf](int c) -> float& { return s[4 * (c / 2) + 2 * hf + c % 2]; }; };
  float block_max[2];
  if constexpr (kIntMax) {  // both rows' integer maxima, then one warp-uniform test (its branch ends ptxas' block)
    int bits[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) bits[hf] = quad_row_max_bits<kN / 4, kMaxChains>(row_scores(hf));
    const bool all_negative = __any_sync(0xffffffffu, (bits[0] | bits[1]) < 0);  // in some row of the warp
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      block_max[hf] = all_negative ? quad_row_max<kN / 4, kMaxChains>(row_scores(hf)) : __int_as_float(bits[hf]);
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if constexpr (!kIntMax) block_max[hf] = quad_row_max<kN / 4, kMaxChains>(row_scores(hf));
    // kFmaFactor = kIntMax: beside the integer maxima, ex2_fma's bit add made ptxas serialise the wgmmas
    correction[hf] = online_softmax_row<kN / 4, kExpOffset, kStaleMax, kFmaEvery, kIntMax, kFmaPairs, kCodes>(
        row_scores(hf), block_max[hf], row_max[hf], row_sum[hf], scale[hf]);
  }
}

// T: the element type of q, k and v (fp16, bf16 or e4m3); TOut: of O (T, or fp16/bf16 for e4m3).
template <typename T, typename TOut, int kHeadDim, int kConsumers, int kBlockN, int kStages, int kConsumerSync,
          int kSchedule, int kOStage, bool kVarlen, bool kSoftcap, bool kPassBy, bool kMasked,
          bool kVPreTransposed, bool kTensorRowSums, int kQBuffers, bool kSplitKV, int kExpOnFma,
          bool kExpFmaPairs, int kFp8StaleMax, bool kExpCodes>
__global__ void __launch_bounds__(128 * (kConsumers + 1), 1) fwd_sm90(const __grid_constant__ FwdSm90Params p) {
  constexpr bool kFp8 = sizeof(T) == 1;
  constexpr bool kOverlapPV = kSchedule == kScheduleOverlapPV, kSerial = kSchedule == kScheduleSerial;
  constexpr int kTurnsPerBlock = kSerial ? 2 : 1;  // ping-pong turns: S and P V together, or one each
  // e4m3 with V as the caller passed it: producer warps 1..3 transpose each block in shared memory.
  // With kVPreTransposed, v_map describes V^T (cuda_src/transpose_v_fp8.cu) and TMA loads it.
  constexpr bool kTranspose = kFp8 && !kVPreTransposed;
  constexpr int kBlockM = 64 * kConsumers;       // query rows per tile
  constexpr int kConsumerWarps = 4 * kConsumers;  // arrivals that release a buffer: one per consumer warp
  // Consumers that do not take turns start each tile together, or run free: a table choice per row
  // (free three consumers measured 3-10% slower in version 31, before a tile's index travelled
  // with its Q; since then +4-7% at head dim 64 up to 1k keys and -2 to -3% beyond: version 41).
  constexpr bool kPingPong = kConsumerSync == kSyncPingPong, kTileSync = kConsumerSync == kSyncTile;
  // One consumer: a decode step's split parts, whose few rows one consumer holds (a second one would
  // only wait for each block and release it: fwd_sm90.py, SPLIT_ONE_CONSUMER_TILES).
  static_assert(kConsumers > 1 || (kSplitKV && !kPingPong), "one consumer: split-KV parts, no turns to take");
  using Split = RegisterSplit<kConsumers>;
  static_assert(Split::kProducer + kConsumers * Split::kConsumer <= 65536 / (128 * (kConsumers + 1)) / 8 * 8 * (kConsumers + 1),
                "the registers the launch gives the CTA");
  constexpr int kAtomElems = 128 / sizeof(T);          // elements in a 128-byte swizzle row
  // Swizzle atoms across the head dim: e4m3's head dim 64 fills half of one (TMA zero-fills the
  // rest, which the GEMMs never read: S = Q K^T steps over the head dim's own bytes only).
  constexpr int kAtoms = (kHeadDim + kAtomElems - 1) / kAtomElems;
  constexpr unsigned kQBytes = kBlockM * kAtoms * 128;
  constexpr unsigned kKBytes = kBlockN * kAtoms * 128;  // a K slot, a 16-bit V slot, an e4m3 staging slot
  // A V slot; e4m3: V^T, kHeadDim rows of kVKeyAtoms 128-key swizzle atoms one after the other (the
  // second of a 160- or 192-key block holds 32 or 64 of them; its TMA box brings 128 keys, the GEMM
  // reads those).
  constexpr int kVKeyAtoms = (kBlockN + 127) / 128;
  // kTensorRowSums (e4m3, calls without the LSE): P V also sums P's rows. Below V^T's kHeadDim rows
  // each atom holds kSumColumns rows of ones, written once, which TMA and the transposing warps
  // never touch: P V's N is kHeadDim + kSumColumns, and the last columns of O are each row's sum
  // of P as rounded to e4m3, the values P V multiplies. That takes the FADD of every score off
  // the consumers (benchmarks/NOTES-fp8.md, session 30); the LSE would carry P's rounding
  // (errors to ~1e-2), so calls that return it sum in fp32 as before. Those columns hold one
  // block's sums at a time: each block's are folded into fp32 registers (tensor_sum) and the
  // columns zeroed. Left to accumulate a whole row the sums came out 24% low at 16k keys (H100,
  // session 40): the e4m3 wgmma's accumulation keeps ~14 bits, and a row's growing sum likely
  // left P's small values below them.
  // At head dim 256 (N would pass 256) the sums take a wgmma of their own, N = kSumColumns, on one
  // tile of ones that every stage shares (kSumsApart).
  static_assert(!kTensorRowSums || (kFp8 && (kHeadDim <= 128 || kHeadDim == 256)),
                "e4m3, N = kHeadDim + 8 within 256 or the sums apart");
  constexpr int kSumColumns = kTensorRowSums ? 8 : 0;
  constexpr bool kSumsApart = kTensorRowSums && kHeadDim + kSumColumns > 256;
  constexpr int kVSumRows = kSumsApart ? 0 : kSumColumns;  // rows of ones below each V^T atom (none when apart)
  // Unmasked, the tile's counter is broadcast from lane 0 again every key block (ptxas drops the
  // shuffle, the value being uniform, but then keeps what follows from it in uniform registers).
  // Where P's sums take the tensor cores and blocks are 192 keys wide, ptxas otherwise held the
  // counter, and the slots, phases and descriptors it gives, in ordinary registers (28 R2UR between
  // the GMMAs of the main loop, 4 with this; NVRTC 12.9 and 13.0 alike). Measured on H100 against
  // the loop without it (benchmarks/NOTES-fp8.md, session 41): there +1%, 16-bit head dim 192 +3.3%
  // at 4k-16k, split-KV decode ±0; but with softcap -1%, masked ±0.7%, e4m3's 128-key rows -4%,
  // 16-bit 128 -1.3%.
  constexpr bool kRebroadcastEachBlock = !kMasked && !kSoftcap && ((kTensorRowSums && kBlockN > 128) || kHeadDim == 192);
  constexpr unsigned kVAtomBytes = (kHeadDim + kVSumRows) * 128;  // e4m3 V^T: one 128-key swizzle atom
  constexpr unsigned kOnesBytes = kSumsApart ? kSumColumns * 128 : 0;  // the tile of ones kSumsApart reads
  constexpr unsigned kVBytes = kFp8 ? kVKeyAtoms * kVAtomBytes : kKBytes;
  constexpr unsigned kVStagingBytes = kTranspose ? kStages * kKBytes : 0;  // V as TMA brings it (e4m3)
  constexpr unsigned kOBytes = kOStage == kOStageOwn ? kBlockM * kHeadDim * sizeof(TOut) : 0;
  // O staged in shared memory goes out by TMA stores that one thread a warpgroup issues (dense: a
  // varlen tile's rows beyond its sequence are the next sequence's, which a box would overwrite).
  // The epilogue was a third of the instructions executed at head dim 256, causal 512, mostly each
  // thread's 16 loads and 16-byte stores with their addresses and row tests
  // (benchmarks/NOTES-sm90.md, version 43).
  constexpr bool kOStoreTma = !kVarlen && kOStage != kOStageDirect;  // (FwdSm90Variant.o_store_tma)
  // With one Q buffer and O staged elsewhere, a warpgroup releases Q as soon as its last S = Q K^T
  // is done, not after its last P V: the next tile's Q then loads during the last softmax and P V,
  // off the tile boundary (where the tensor cores otherwise wait for it). Two Q buffers load the
  // next Q during the whole tile anyway; O staged in Q releases it after the stores.
  constexpr bool kQReleaseAfterS = kQBuffers == 1 && kOStage != kOStageInQ;
  constexpr int kSAcc = kBlockN / 2;     // S accumulators per thread
  constexpr int kOAcc = kHeadDim / 2;    // O accumulators per thread
  constexpr int kQKSteps = kHeadDim * sizeof(T) / 32;  // wgmma k steps of S = Q K^T: 32 bytes each
  constexpr int kPSteps = kBlockN * sizeof(T) / 32;    // and of O += P V
  // FlashAttention-4's stale running maximum (online_softmax_row): a warp skips the O rescale while
  // no row's maximum rose by more than 2^kStaleMax. In 16 bits 2^8, only without ping-pong: measured
  // +1-4% at head dims 64 and 256, but -2 to -5% at 128, where ping-pong already hides the
  // multiplies behind the other warpgroup's GEMMs and the vote lands on the critical path
  // (benchmarks/NOTES-sm90.md, version 20). The serial schedule hides them behind one GEMM only:
  // +0.6-0.9% there at head dim 256 (version 38). In e4m3 (the launcher's choice, kFp8StaleMax:
  // fwd_sm90.py, FP8_STALE_MAX) P's exponent offset drops by the margin (P within 2^8), and a row's
  // largest weight, P of a stale maximum, is then no longer an exact power of two but rounded to
  // e4m3 (up to 6% off). O divided by the sum of the unrounded P carries that: with 2^1 on the
  // per-head 192-key row at head dim 128 (calls that return the LSE, session 41) 1 in 40 of the GPU
  // test's rows led by a few large keys broke its bound, twice plain FP8's error (H200, NOTES-fp8.md,
  // session 47). So only with P's sums on the tensor cores, the sums of P as rounded, where that
  // rounding cancels; and per-head descales (per-128-key ones move O's units every block, so the
  // vote would find a rescale anyway), no ping-pong, not split.
  static_assert(kFp8StaleMax == 0 || (kFp8 && kFp8StaleMax < 8 && kTensorRowSums && !kPingPong && !kSplitKV),
                "a stale maximum in e4m3: P's sums on the tensor cores, no ping-pong, not split");
  constexpr int kStaleMax = kFp8 ? kFp8StaleMax : (!kPingPong || kSerial) ? 8 : 0;
  constexpr int kExpOffset = kFp8 ? 8 - kStaleMax : 0;  // P <= 2^8 in e4m3 (online_softmax_row)
  // Chains of a thread's row maximum (online_softmax_max): four in e4m3 at head dim 256, measured
  // +1-3% from 4k on H100 (-1 to -2% at 2k); one elsewhere (four measured -1 to -3% in 16 bits at
  // head dim 128 and -2 to -7% in e4m3 there; benchmarks/NOTES-fp8.md, session 17).
  constexpr int kMaxChains = kFp8 && kHeadDim == 256 ? 4 : 1;
  // kExpOnFma > 0: every kExpOnFma-th exponential of a thread's row on the FMA pipe (ex2_fma), the
  // rest on the special-function unit (e4m3, where measured to pay: fwd_sm90.py, FP8_EXP_ON_FMA).
  // kExpFmaPairs: every kExpOnFma-th pair of a row's columns instead, both exponentials at once in
  // f16x2 arithmetic (ex2x2_fma_f16, accurate enough for the LSE: FP8_LSE_EXP_PAIRS).
  static_assert(kExpOnFma == 0 || kFp8, "measured only in e4m3 (slower in 16 bits)");
  static_assert(!kExpFmaPairs || kExpOnFma > 0, "kExpFmaPairs says how kExpOnFma's exponentials are taken");
  // kExpCodes (attention_fp8's fast_exp): no exponential at all; P's e4m3 codes straight from the
  // scores, one FFMA and a clamp each (online_softmax_codes, its error there), packed by byte
  // permutes. The sums must be of P as coded: P V's columns of ones (kTensorRowSums).
  static_assert(!kExpCodes || (kFp8 && kTensorRowSums && kExpOnFma == 0),
                "P's codes without exponentials: e4m3, summed on the tensor cores");
  // kIntMax: the row maxima as three-input integer maxima of the scores' bits (quad_row_max_bits,
  // half the instructions of the FMNMX chain, in kMaxChains chains; block_softmax), bitwise the
  // same results (the outputs compared on every row measured). Measured on H200 against the FMNMX
  // chain (NOTES-fp8.md and NOTES-sm90.md, sessions 42-43): 16 bits +0.5-6% (head dim 128 at 4k
  // +6%, 192 +5%), e4m3 with the LSE +5%, head dim 256 +2%. With the FMA pipe's exponentials,
  // ex2_fma must then scale by a factor (ptxas serialises the wgmmas otherwise, C7511), one
  // instruction more each: at head dim 128 +1-7.5% with FP8_EXP_ON_FMA's counts retuned beside it;
  // head dim 64's rows lost 0.5-5.6% at every count tried and keep the FMNMX chain.
  constexpr bool kIntMax = !(kTensorRowSums && kExpOnFma > 0) || kHeadDim == 128;
  // The softmax of a warpgroup's top key block on its first half only where its rows see only that
  // half (half_top): in the variants for masked problems (kMasked: a causal diagonal or a window;
  // the unmasked ones keep their smaller code, which the extra path cost 2-4%), with pass-by (its
  // own blocks are known), 128-key blocks (64-key halves: whole k steps of P V in 16 bits and
  // e4m3), and P packed right after that softmax (no kOverlapPV). benchmarks/NOTES-sm90.md,
  // version 37.
  constexpr bool kHalfTop = kMasked && kPassBy && kBlockN == 128 && !kOverlapPV;
  static_assert(sizeof(TOut) == 2, "O in fp16 / bf16");
  static_assert(kFp8 || sizeof(T) == 2, "fp16 / bf16 / e4m3");
  static_assert((kFp8 ? kHeadDim % 64 : kHeadDim % kAtomElems) == 0 && kHeadDim <= 256,
                "whole swizzle atoms (e4m3: whole k32 steps, N a multiple of 64); wgmma N <= 256");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "k16 steps over keys; wgmma N <= 256");
  // e4m3: 128-key blocks, whose V^T is one 128-key swizzle row and whose k and v descales are one
  // per 128 keys; or, with V^T written beforehand (no transposing warps) and per-head descales (the
  // launcher's choice: blocks of 128 keys would straddle them), wider blocks of whole k32 steps
  // (160 at head dim 64, 192 at 128).
  static_assert(!kFp8 || kBlockN == 128 || (kVPreTransposed && kBlockN % 32 == 0),
                "e4m3: 128-key blocks, or whole k32 steps with V^T written beforehand");
  static_assert(!kFp8 || (!kVarlen && !kSoftcap), "e4m3: dense, no softcap");
  static_assert(kFp8 || !kVPreTransposed, "16-bit V is read MN-major as it is");
  static_assert(kFp8 || kSplitKV ? kOStage == kOStageOwn || kOStage == kOStageDirect : kOStage != kOStageDirect,
                "16-bit O is staged; e4m3's O outsizes Q and its V^T slot");
  // Split-KV: a decode step's few (batch, head) pairs spread over the SMs by their key blocks, each
  // part writing its O (normalised) and LSE as float32 partials that a second kernel merges
  // (cuda_src/combine_splits.cu). Dense; masked for a causal or right-bounded step of a few rows
  // (fwd_sm90.py, split_masked).
  static_assert(!kSplitKV || (!kVarlen && !kTensorRowSums && kOStage == kOStageDirect),
                "split-KV: dense, with the LSE, its float32 partials stored straight");
  static_assert(kOStage != kOStageInV || kBlockN >= kBlockM, "O staged in a V slot fits there");
  static_assert(kStages >= 1, "at least one K/V slot");
  static_assert(kSchedule >= kScheduleOverlap && kSchedule <= kScheduleSerial, "a Schedule");
  static_assert(kConsumerSync >= kSyncTile && kConsumerSync <= kSyncFree, "a ConsumerSync");
  static_assert(kQBuffers == 1 || (kQBuffers == 2 && kOStage != kOStageInQ), "two Q buffers, or one (and O may be staged in it)");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles must start on 1024-byte boundaries: round the base up (the launch asks for 1 KiB more).
  const unsigned sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned sK = sQ + kQBuffers * kQBytes;     // kStages slots
  const unsigned sV = sK + kStages * kKBytes;       // kStages slots (e4m3: V transposed)
  const unsigned sOnes = sV + kStages * kVBytes;  // kSumsApart: kSumColumns rows of 128 ones (1 KiB)
  const unsigned sVStaging = sOnes + kOnesBytes;  // e4m3: kStages slots of V as loaded
  const unsigned sO = kOStage == kOStageInQ ? sQ : sVStaging + kVStagingBytes;  // O staged for 16-byte stores
  const unsigned bars = sVStaging + kVStagingBytes + kOBytes;  // mbarriers, 8 bytes each
  // Q buffer b's: full and empty.
  auto q_full = [&](unsigned b) { return bars + 16u * b; };
  auto q_empty = [&](unsigned b) { return bars + 16u * b + 8u; };
  constexpr int kQBars = 2 * kQBuffers;
  auto k_full = [&](int s) { return bars + 8u * (kQBars + s); };
  auto v_full = [&](int s) { return bars + 8u * (kQBars + kStages + s); };
  auto k_empty = [&](int s) { return bars + 8u * (kQBars + 2 * kStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * (kQBars + 3 * kStages + s); };
  // e4m3 transposed here: the staging slots' barriers (TMA completes on full; the transposing warps
  // release empty).
  auto staging_full = [&](int s) { return bars + 8u * (kQBars + 4 * kStages + s); };
  auto staging_empty = [&](int s) { return bars + 8u * (kQBars + 5 * kStages + s); };
  // Tile indices, one slot per Q buffer: written before the arrival on the buffer's q_full once
  // q_empty says the tile before in that buffer has read its own, read after q_full.
  const unsigned tile_slots = bars + 8u * (kQBars + (kTranspose ? 6 : 4) * kStages);
  // A tile's index from Q buffer b's slot (after q_full): lane 0 reads it, the lane that arrives on
  // q_empty for the warp (racecheck then sees the read ordered before the slot's rewrite; with every
  // lane reading, it reported the rewrite as a race), and broadcasts it, which also tells the
  // compiler the index is warp-uniform.
  auto tile_index = [&](unsigned b) {
    unsigned index = 0;
    if (thread_index_again() % 32 == 0) index = ld_shared_b32(tile_slots + 4 * b);
    return __shfl_sync(0xffffffffu, static_cast<int>(index), 0);
  };
  // Each role counts tiles in the low bits of a loop-state word (the consumers modulo 2 kQBuffers,
  // the producer and the transposing warps modulo 4): the count's Q buffer and that buffer's phase.
  auto q_buffer_of = [](unsigned count) { return count % kQBuffers; };
  auto q_phase_of = [](unsigned count) { return (count / kQBuffers) & 1u; };

  const int tid = threadIdx.x;
  // Broadcast from lane 0 so the compiler knows it is warp-uniform: descriptors derived from it can
  // then live in uniform registers instead of being moved there before every wgmma.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int lane = tid % 32;

  if (tid == 0) {
#pragma unroll
    for (unsigned b = 0; b < kQBuffers; ++b) {
      mbarrier_init(q_full(b), 1);
      mbarrier_init(q_empty(b), kConsumerWarps + (kTranspose ? kTransposeWarps : 0));  // all that read its index
    }
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(k_full(s), 1);
      mbarrier_init(v_full(s), kTranspose ? kTransposeWarps : 1);
      mbarrier_init(k_empty(s), kConsumerWarps);
      mbarrier_init(v_empty(s), kConsumerWarps);
      if constexpr (kTranspose) {
        mbarrier_init(staging_full(s), 1);
        mbarrier_init(staging_empty(s), kTransposeWarps);
      }
    }
    fence_barrier_init();
  }
  if constexpr (kTensorRowSums) {  // the ones (e4m3 1.0 = 0x38) of every V^T atom, for the async proxy
    constexpr unsigned kWords = kSumColumns * 128 / 4, kAtoms = kSumsApart ? 1 : kStages * kVKeyAtoms;
    for (unsigned i = threadIdx.x; i < kAtoms * kWords; i += blockDim.x) {
      const unsigned atom = i / kWords;
      st_shared_b32(kSumsApart ? sOnes + 4 * i
                               : sV + (atom / kVKeyAtoms) * kVBytes + (atom % kVKeyAtoms) * kVAtomBytes +
                                     kHeadDim * 128 + 4 * (i % kWords),
                    0x38383838u);
    }
    fence_proxy_async_shared();
  }
  __syncthreads();
  if constexpr (kFp8) {  // (the setup above may overlap the tail of the chain's last kernel)
    if (p.wait_for_inputs) griddepcontrol_wait();
  }

  // Every tile, the producer writes its index in the next Q buffer's slot (index >= num_tiles
  // tells the consumers to stop) and arrives on q_full (with Q's bytes to wait for, or none when
  // the tile has no key block to load); the consumers arrive on q_empty once they are done with Q,
  // the transposing warps once they have read the index. `it` counts K/V blocks over all of this
  // CTA's tiles (slot it % kStages, phase (it / kStages) & 1); `q_count` counts tiles (Q buffer
  // q_count % kQBuffers, phase (q_count / kQBuffers) & 1).
  if (warpgroup == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<Split::kProducer>();
    // Warp 0: lane 0 issues every load and barrier operation (the warp draws the tile indices). e4m3
    // (kTranspose): warps 1..3 transpose V; otherwise the other producer warps leave.
    if (tid >= 32) {
      if constexpr (kTranspose) {
        // Per tile (its index read from Q's slot like the consumers), every block the producer loads: wait
        // for its staged V and for the consumers to free its V slot, write V^T there, make those
        // ordinary stores visible to wgmma (async proxy), release both slots. A piece is 16 keys
        // (16g..16g+15) x 32 bytes of head dim (d0..d0+31); each warp takes every third unit of
        // four pieces. One ldmatrix.trans of byte pairs gives lane (p = lane / 4, q = lane % 4), in
        // register m, keys 2q and 2q + 1 (+ 8 for m odd) of columns d0 + 16 (m / 2) + 2p and + 1;
        // two byte permutes per register pair make the V^T words of those columns holding keys 2q,
        // 2q + 1, 2q + 8, 2q + 9 (the order P's A operand needs), and one stmatrix writes them at
        // key position 16g + 4q. The stmatrix rows alternate which of the two columns a lane gives
        // (lanes p < 4 the even one in matrices 0 and 2): the 8 rows of each matrix then have 8
        // different swizzle phases, so neither instruction has bank conflicts.
        // The producer's 24 registers (or 32): one word holds the loop state. Bits 0-1: the tile
        // count (q_buffer_of, q_phase_of); bits 2-7: the block count `it` modulo 2
        // kStages (all the slot and its phase need); bits 16 and up: the blocks left in this tile (at
        // most 65,535: fwd_sm90.py refuses longer key sequences for e4m3). Nothing lane-derived is
        // kept live across the warp-role split (ptxas would spill it here): lane values come from
        // %tid.x read again.
        constexpr unsigned kBlockOne = 1u << 16;
        unsigned progress = 0;
        for (;;) {
          const unsigned q_buffer = q_buffer_of(progress);
          mbarrier_wait(q_full(q_buffer), q_phase_of(progress));
          const int index = tile_index(q_buffer);
          mbarrier_arrive_warp(q_empty(q_buffer));
          if (index >= p.num_tiles) break;
          progress = (progress & ~3u) | ((progress + 1) & 3u);
          const Tile t = tile_at<kBlockM, kBlockN, kVarlen, kMasked, kSplitKV>(p, index);
          progress += static_cast<unsigned>(max(t.kb.n_max - t.kb.n_min, 0)) * kBlockOne;
#pragma unroll 1
          for (; progress >= kBlockOne; progress -= kBlockOne) {  // the blocks, as the producer loads them
            const unsigned it = (progress >> 2) & 0x3fu;
            const int slot = it % kStages;
            const unsigned parity = it / kStages;
            progress = (progress & ~0xfcu) | (((it + 1) % (2 * kStages)) << 2);
            mbarrier_wait(staging_full(slot), parity);
            mbarrier_wait(v_empty(slot), parity ^ 1);
            // A unit is 4 pieces, one 32-byte column chunk (d0) and 4 key groups, unrolled so that
            // their addresses are immediates off one base: the transposing warps share their SMSPs
            // with consumer warps, so their instruction count matters more than their latency (two
            // pieces in flight measured slower, benchmarks/NOTES-fp8.md). The lane's addresses are
            // formed per unit from the thread index read again: kept across the loop they would not
            // fit the producer's 24 registers.
            const unsigned staging = sVStaging + slot * kKBytes, transposed = sV + slot * kVBytes;
            constexpr unsigned kUnits = 2 * (kHeadDim / 32);
#pragma unroll 1
            for (unsigned unit = thread_index_again() / 32 - 1; unit < kUnits; unit += kTransposeWarps) {
              const unsigned t_lane = thread_index_again() % 32;
              const unsigned j = t_lane % 8, m = t_lane / 8;  // the row this lane addresses, of matrix m
              const unsigned d0 = 32 * (unit / 2), g0 = 4 * (unit % 2);
              // ldmatrix: matrix m is keys 8 (m % 2) + j of group g, 16-byte column chunk
              // (d0 % 128) / 16 + m / 2 of the V row (even + bit: + is ^), at swizzle phase j.
              const unsigned in = staging + (d0 / 128) * kBlockN * 128 + (16 * g0 + 8 * (m % 2) + j) * 128 +
                                  ((((d0 % 128) / 16 + m / 2) ^ j) << 4);
              // stmatrix: matrix m is V^T rows d0 + 16 (m / 2) + 2j + e, e = (m % 2) ^ (j / 4), at key
              // chunk g and the swizzle phase of that row.
              const unsigned row = 16 * (m / 2) + 2 * j + ((m % 2) ^ (j / 4));
              const unsigned out = transposed + (d0 + row) * 128, phase = (g0 ^ (row % 8)) << 4;
              const unsigned even = (t_lane / 4) < 4 ? 0x6420u : 0x7531u, odd = even ^ 0x1111u;
#pragma unroll
              for (unsigned i = 0; i < 4; ++i) {  // key group g = g0 + i
                unsigned r[4];
                ldmatrix_x4_trans(r, in + i * 16 * 128);
                const unsigned w[4] = {__byte_perm(r[0], r[1], even), __byte_perm(r[0], r[1], odd),
                                       __byte_perm(r[2], r[3], even), __byte_perm(r[2], r[3], odd)};
                stmatrix_x4(out + (phase ^ (i << 4)), w);
              }
            }
            fence_proxy_async_shared();
            __syncwarp();
            if (thread_index_again() % 32 == 0) {
              mbarrier_arrive(v_full(slot));
              mbarrier_arrive(staging_empty(slot));
            }
          }
        }
      }
      return;
    }
    const bool leader = lane == 0;
    int slot = 0;            // it % kStages, kept incrementally: the producer has few registers
    unsigned parity = 0;     // (it / kStages) & 1
    unsigned q_count = 0;  // tiles so far, modulo 4
    // The next Q buffer, once the tile before in it is done with it; and the tile's index published
    // in its slot with the arrival on q_full (whose phase then waits for `q_bytes` of Q; only the leader).
    auto next_q_buffer = [&]() {
      const unsigned q_buffer = q_buffer_of(q_count);
      if (leader) mbarrier_wait(q_empty(q_buffer), q_phase_of(q_count) ^ 1);
      q_count = (q_count + 1) & 3u;
      return q_buffer;
    };
    auto publish = [&](int index, unsigned q_buffer, unsigned q_bytes) {
      st_shared_b32(tile_slots + 4 * q_buffer, static_cast<unsigned>(index));
      mbarrier_arrive_expect_tx(q_full(q_buffer), q_bytes);  // release: the index is seen by q_full's waiters
    };
    auto next_tile = [&]() {
      int next = 0;
      if (leader) next = atomicAdd(tile_counters[p.counter_slot], 1) + gridDim.x;
      return __shfl_sync(0xffffffffu, next, 0);
    };
    for (int index = blockIdx.x;;) {
      const unsigned q_buffer = next_q_buffer();
      if (index >= p.num_tiles) {
        if (leader) publish(index, q_buffer, 0);
        break;
      }
      const Tile t = tile_at<kBlockM, kBlockN, kVarlen, kMasked, kSplitKV>(p, index);
      if (t.kb.n_max <= t.kb.n_min) {
        if (leader) publish(index, q_buffer, 0);
        index = next_tile();
        continue;
      }
      const int h_kv = fast_div(t.h, p.group_div);
      auto load = [&](unsigned dst, const TmaMap* map, unsigned bar, int head, int row, int rows) {
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) {
          tma_load_tokens<kVarlen>(dst + a * rows * 128, map, bar, a * kAtomElems, head, row, t.b);
        }
      };
      // Block n into the next ring slot (only the leader issues; every lane advances the slot).
      auto load_kv = [&](int n) {
        if (leader) {
          mbarrier_wait(k_empty(slot), parity ^ 1);
          mbarrier_arrive_expect_tx(k_full(slot), kKBytes);  // zero-filled bytes count too
          load(sK + slot * kKBytes, &p.k_map, k_full(slot), h_kv, t.k_row0 + n * kBlockN, kBlockN);
          if constexpr (kVPreTransposed) {  // a box of V^T per 128 keys of the block: kHeadDim rows
            // V^T is the output of the pass launched just before, which this kernel may overlap as
            // its programmatic dependent (fwd_sm90.py): Q, K and the first S need only wait for
            // the kernels before the pass, which have completed. Once a tile (a no-op after the
            // first): a flag kept across tiles would not fit the producer's registers. (After
            // attention(fp8=True)'s quantizers every thread has waited at the start.)
            if (n == t.kb.n_max - 1) griddepcontrol_wait();
            mbarrier_wait(v_empty(slot), parity ^ 1);
            mbarrier_arrive_expect_tx(v_full(slot), kVKeyAtoms * kHeadDim * 128);  // (not the ones)
#pragma unroll
            for (int a = 0; a < kVKeyAtoms; ++a) {
              tma_load_4d(sV + slot * kVBytes + a * kVAtomBytes, &p.v_map, v_full(slot), n * kBlockN + a * 128, 0,
                          h_kv, t.b);
            }
          } else {
            // e4m3: into the staging slot, which the transposing warps release.
            const unsigned v_free = kTranspose ? staging_empty(slot) : v_empty(slot);
            const unsigned v_loaded = kTranspose ? staging_full(slot) : v_full(slot);
            mbarrier_wait(v_free, parity ^ 1);
            mbarrier_arrive_expect_tx(v_loaded, kKBytes);
            load((kTranspose ? sVStaging : sV) + slot * kKBytes, &p.v_map, v_loaded, h_kv, t.k_row0 + n * kBlockN,
                 kBlockN);
          }
        }
        if (++slot == kStages) {
          slot = 0;
          parity ^= 1;
        }
      };
      if (leader) {
        publish(index, q_buffer, kQBytes);
        load(sQ + q_buffer * kQBytes, &p.q_map, q_full(q_buffer), t.h, t.q_row0 + t.m0, kBlockM);
      }
      // K/V blocks from last to first.
#pragma unroll 1  // unrolled, this loop no longer fits the producer's 24 registers
      for (int n = t.kb.n_max - 1; n >= t.kb.n_min; --n) load_kv(n);
      index = next_tile();
      // One Q buffer: the next tile's Q loads only once this tile's epilogue is done with it (the
      // consumers' wait for it was 13% of the warp samples at head dim 256, 512 keys). Drawn now
      // (this tile's last K/V load issued), its rows are prefetched into L2 meanwhile: +1.5% there
      // (drawn a tile earlier, the schedule lost its balance: -16% causal; NOTES-sm90.md version
      // 39). Dense only: varlen's sequence bounds would not fit the producer's registers.
      if constexpr (kQBuffers == 1 && !kVarlen) {
        if (leader && index < p.num_tiles) {
          const Tile tn = tile_at<kBlockM, kBlockN, kVarlen, kMasked, kSplitKV>(p, index);
#pragma unroll
          for (int a = 0; a < kAtoms; ++a) tma_prefetch_4d(&p.q_map, a * kAtomElems, tn.h, tn.m0, tn.b);
        }
      }
    }
    // Every CTA has drawn its last index: the last one out resets the pair for the next launch.
    if (leader) {
      int* counter = tile_counters[p.counter_slot];
      __threadfence();  // this CTA's draws are ordered before its "done"
      if (atomicAdd(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
        atomicExch(counter, 0);
        atomicExch(counter + 1, 0);
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<Split::kConsumer>();
  const int wg = warpgroup - 1;                      // which 64 rows of the tile
  const int row_in_wg = 16 * (tid % 128 / 32) + lane / 4;  // this thread's rows: row_in_wg and row_in_wg + 8
  // The float constants (scale, softcap) are read from the parameter space where used (an operand
  // of the instruction itself) rather than copied into registers, which the head-dim-256 tiles lack.
  const int window_left = p.window_left, window_right = p.window_right;
  // Descriptors: K-major Q and K (LBO unused, SBO = 8 rows of 128 bytes); 16-bit V MN-major (LBO =
  // one atom of kBlockN rows, SBO = 8 tokens), e4m3 V^T K-major like K. A k step of S = Q K^T moves
  // 32 bytes within an atom, or to the next atom every 4 steps; a P V step moves 16 tokens (16-bit)
  // or 32 bytes along V^T's rows (e4m3).
  const unsigned long long desc_q = smem_descriptor_sw128(sQ + wg * 64 * 128, 16, 1024);
  const unsigned long long desc_k = smem_descriptor_sw128(sK, 16, 1024);
  const unsigned long long desc_v = smem_descriptor_sw128(sV, kFp8 ? 16 : kBlockN * 128, 1024);
  const unsigned long long desc_ones = smem_descriptor_sw128(sOnes, 16, 1024);  // (kSumsApart)
  // Ping-pong: warpgroup wg issues its GEMMs after syncing on its own turn barrier (with the
  // arrival of warpgroup wg - 1) and then hands the turn to wg + 1. Every consumer has the same
  // number of turns in a tile (blocks + 1: S alone, S beside P V, P V alone; serial, two a block),
  // and the round runs on across tiles: warpgroup 0 takes the first turn of the kernel, and the
  // first turn of each tile once the last warpgroup has taken its last turn of the tile before, so
  // that one's epilogue overlaps the other's GEMMs; at the end warpgroup 0 takes the hand-over
  // still pending.
  auto turn_begin = [&]() {
    if constexpr (kPingPong) named_barrier_sync(kSchedulerBarrier + wg, 256);
  };
  auto turn_end = [&]() {
    if constexpr (kPingPong) named_barrier_arrive(kSchedulerBarrier + (wg + 1) % kConsumers, 256);
  };

  // `it` and the tile count share one register: the count in bit 0 (bits 0-1 with two Q buffers),
  // it above. At head dim 256 with varlen and softcap a separate register spills.
  constexpr unsigned kItShift = kQBuffers == 2 ? 2 : 1, kItStep = 1u << kItShift;
  unsigned progress = 0;
  auto it = [&]() { return static_cast<int>(progress >> kItShift); };
  // This tile's Q buffer (once the count has moved on to the next tile).
  auto q_buffer = [&]() { return kQBuffers == 2 ? (progress & 1u) ^ 1u : 0u; };
  if constexpr (kPingPong) {
    if (wg == kConsumers - 1) named_barrier_arrive(kSchedulerBarrier, 256);  // warpgroup 0 goes first
  }
  int o_pending_slot = -1;  // kOStoreTma, kOStageInV: see the tile's start
  // A staging area that O went out of (Q's tile or a V slot) released by this warp on `bar`, before
  // TMA loads the next Q or V over it. Stored by TMA: the stores' reads are done (their `issuer`
  // waits; the warps' writes were fenced before the stores). Copied out by 16-byte rows: this warp's
  // reads ordered before the async proxy's writes.
  auto release_staging = [&](unsigned bar, bool stored_by_tma, bool issuer) {
    if (!stored_by_tma) {
      fence_proxy_async_shared();
    } else if (issuer) {
      bulk_wait_read<0>();
    }
    mbarrier_arrive_warp(bar);
  };
  for (;;) {
    // A tile starts at a barrier: all the consumers' (kTileSync), else the warpgroup's own. That
    // one orders nothing, but ptxas takes a bar.sync as a point where the warp is converged:
    // without it, it kept the tile's values (slots, phases, descriptors) out of uniform registers,
    // 52-93 R2UR between the GMMAs of the ping-pong variants.
    if constexpr (kTileSync) {
      named_barrier_sync(kTileBarrier, 128 * kConsumers);
    } else {
      named_barrier_sync(kWarpgroupBarrier + wg, 128);
    }
    // Broadcast from lane 0 so the compiler knows the index and the block count, and all they
    // derive (slots, phases, descriptors), are warp-uniform: those values can then live in uniform
    // registers, not in the ones the accumulators need, and need no move to uniform registers before
    // every wgmma (35 to 86 such moves in the loop over key blocks, by head dim, without this).
    progress = __shfl_sync(0xffffffffu, progress, 0);
    const unsigned next_q = q_buffer_of(progress);
    mbarrier_wait(q_full(next_q), q_phase_of(progress));
    const int index = tile_index(next_q);
    if (index >= p.num_tiles) break;
    // kOStageInV with TMA stores: the V slot of the last tile's O, which this warp (its stores'
    // issuer) releases only now, once they have read it; its Q wait above mostly covered that.
    if constexpr (kOStoreTma && kOStage == kOStageInV) {
      if (o_pending_slot >= 0) {
        release_staging(v_empty(o_pending_slot), true, thread_index_again() % 128 == 0);
        o_pending_slot = -1;
      }
    }
    progress = kQBuffers == 2 ? (progress & ~3u) | ((progress + 1) & 3u) : progress ^ 1u;
    const Tile t = tile_at<kBlockM, kBlockN, kVarlen, kMasked, kSplitKV>(p, index);
    if (t.m0 + kBlockM <= 0) {  // a varlen sequence shorter than the longest: nothing to do
      mbarrier_arrive_warp(q_empty(q_buffer()));
      continue;
    }
    if (t.kb.n_max <= t.kb.n_min && kOStage != kOStageInQ) mbarrier_arrive_warp(q_empty(q_buffer()));  // nothing was loaded
    float o[kOAcc + kSumColumns / 2];  // (kTensorRowSums: then this thread's two rows' sums, twice each)
#pragma unroll
    for (int i = 0; i < kOAcc + kSumColumns / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-infinity(), -infinity()};  // log2 domain (online_softmax_row)
    float row_sum[2] = {0.f, 0.f};  // this thread's part of each row's sum
    float tensor_sum[2] = {0.f, 0.f};  // kTensorRowSums: each row's sum of the blocks folded so far
    // e4m3: q's descale of this thread's two rows, and v's of the block O is in units of.
    float q_descale[2] = {1.f, 1.f}, o_descale = 1.f;

    if (t.kb.n_max > t.kb.n_min) {
      // kPassBy: this warpgroup's own blocks. Under a causal or window mask its 64 rows may see fewer
      // keys than the tile's last rows, and rows above row 0 (a sequence's first tile) see
      // none. The blocks above them are passed by without GEMMs (full waited, empty arrived,
      // ping-pong turns taken): the tensor cores the warpgroups share then run useful work only.
      // And the blocks masked element by element are those its own rows see only in part: the
      // tile's diagonal band is kBlockM keys wide, a warpgroup's 64 (head dim 64 causal at 512:
      // three of a head's twenty warpgroup-blocks were masked needlessly; NOTES-sm90.md, version 36).
      int n_top = t.kb.n_max, n_full_lo = t.kb.n_full_lo, n_full_hi = t.kb.n_full_hi;
      if constexpr (kPassBy) {
        const KeyBlocks own = key_blocks<kBlockN>(t.m0 + wg * 64, 64, t.seqlen_q, t.seqlen_k, window_left, window_right);
        // (Broadcast like the tile index: the compiler then keeps it, and the loop bounds, uniform.
        // kSplitKV: a part's blocks may all lie above this warpgroup's keys; it then has none here.)
        const int own_top = kSplitKV ? max(t.kb.n_min, min(own.n_max, t.kb.n_max)) : min(own.n_max, t.kb.n_max);
        n_top = __shfl_sync(0xffffffffu, own.n_max > own.n_min ? own_top : t.kb.n_min, 0);
        n_full_lo = own.n_full_lo;
        n_full_hi = own.n_full_hi;
      }
      // kHalfTop: where the keys this warpgroup's rows see end in the first half of its top block (a
      // causal diagonal whose 64 rows start at a multiple of 128, or a key tail of at most half a
      // block), that block's mask and softmax run on its first half only and its P is zero beyond.
      // (S = Q K^T stays full width: a wgmma of N = 64 beside the N = 128 ones, under this branch,
      // made ptxas serialize every wgmma of the kernel, C7515.)
      bool half_top = false;
      if constexpr (kHalfTop) {
        const int own_last = min(t.m0 + wg * 64 + 64, t.seqlen_q) - 1;
        const int own_end = window_right >= 0
                                ? min(t.seqlen_k, own_last + t.seqlen_k - t.seqlen_q + window_right + 1)
                                : t.seqlen_k;
        half_top = __shfl_sync(0xffffffffu, own_end <= (n_top - 1) * kBlockN + kBlockN / 2, 0);
      }
      float s[kSAcc];
      unsigned pa[kPSteps][4];
      // e4m3: the descale of tensor `which` (q, k, v) for this tile's batch, head `head` and block
      // of 128 rows `block` (FwdSm90Params); k's and v's of key block n (kBlockN is 128, or the
      // descales are per head: their block stride is 0). The kv
      // head is divided out once a tile (it was a division a block), and a block's k and v descales
      // are loaded before its barrier waits, so the loads' latency hides behind them and the GEMMs.
      auto descale = [&](int which, int head, int block) {
        return p.descale[which][t.b * p.descale_stride_b[which] + head * p.descale_stride_h[which] +
                                block * p.descale_stride_block[which]];
      };
      const int h_kv = fast_div(t.h, p.group_div);
      auto kv_descale = [&](int which, int n) { return kFp8 ? descale(which, h_kv, n) : 1.f; };
      if constexpr (kFp8) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = t.m0 + wg * 64 + row_in_wg + 8 * hf;
          if (t.has_row(row)) q_descale[hf] = descale(0, t.h, kSplitKV ? row >> p.q_descale_shift : row / 128);
        }
      }

      auto issue_qk = [&](int slot) {
#pragma unroll
        for (int kk = 0; kk < kQKSteps; ++kk) {
          Wgmma<T, kBlockN>::ss(s, desc_q + q_buffer() * (kQBytes >> 4) + k_major_step(kk, kBlockM),
                                desc_k + slot * (kKBytes >> 4) + k_major_step(kk, kBlockN), kk > 0);
        }
        wgmma_commit();
      };
      auto issue_pv = [&](int slot) {
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          if constexpr (kFp8) {
            // (32-byte k steps within a 128-key atom of V^T, then the next atom)
            constexpr int kAtomSteps = 128 / 32;
            const unsigned step = (kk / kAtomSteps) * (kVAtomBytes >> 4) + (kk % kAtomSteps) * (32 >> 4);
            if constexpr (kSumsApart) {
              Wgmma<T, kHeadDim>::rs(reinterpret_cast<float(&)[kOAcc]>(o), pa[kk],
                                     desc_v + slot * (kVBytes >> 4) + step, 1);
              Wgmma<T, kSumColumns>::rs(reinterpret_cast<float(&)[kSumColumns / 2]>(o[kOAcc]), pa[kk],
                                        desc_ones + (kk % kAtomSteps) * (32 >> 4), 1);
            } else {
              Wgmma<T, kHeadDim + kSumColumns>::rs(o, pa[kk], desc_v + slot * (kVBytes >> 4) + step, 1);
            }
          } else {
            Wgmma<T, kHeadDim>::template rs<1>(o, pa[kk], desc_v + slot * (kVBytes >> 4) + kk * (2048 >> 4), 1);
          }
        }
        wgmma_commit();
      };

      // Softcap, mask and online softmax of block n in s (of its first half: `half`, kHalfTop);
      // returns each row's O rescale factor.
      auto softmax = [&](int n, float k_descale, float (&correction)[2], bool half = false) {
        const float scale[2] = {kFp8 ? p.scale_log2 * q_descale[0] * k_descale : p.scale_log2,
                                kFp8 ? p.scale_log2 * q_descale[1] * k_descale : p.scale_log2};
        const bool masked = n < n_full_lo || n > n_full_hi;  // blocks that straddle a boundary of these rows
        const int row = t.m0 + wg * 64 + row_in_wg, col0 = n * kBlockN + 2 * (lane % 4);
        if constexpr (kHalfTop) {
          if (half) {
            block_softmax<kBlockN / 2, kSoftcap, kExpOffset, kStaleMax, kMaxChains, kIntMax, kExpOnFma, kExpFmaPairs,
                          kExpCodes>(s, masked, row, col0, t, window_left, window_right, p.softcap_exp2_scale,
                                     p.softcap, scale, row_max, row_sum, correction);
            return;
          }
        }
        block_softmax<kBlockN, kSoftcap, kExpOffset, kStaleMax, kMaxChains, kIntMax, kExpOnFma, kExpFmaPairs,
                      kExpCodes>(s, masked, row, col0, t, window_left, window_right, p.softcap_exp2_scale, p.softcap,
                                 scale, row_max, row_sum, correction);
      };
      // P to the A registers of P V. 16 bits: accumulators 8j..8j+7 (columns 16j..16j+15) are those
      // of k16 step j. e4m3: k32 step j takes accumulators 16j..16j+15, four to a register in the
      // order (0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15): rows r, r + 8, r, r + 8,
      // the key order V^T was written in (kTransposeWarps); kExpCodes: their codes' low bytes.
      // With `half` (kHalfTop), P of the block's second half is zero: its softmax did not run there.
      auto pack_p = [&](bool half = false) {
#pragma unroll
        for (int j = 0; j < kPSteps; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (kHalfTop && half && j >= kPSteps / 2) {
              pa[j][r] = 0u;
            } else if constexpr (kFp8) {
              const int a = 16 * j + 8 * (r / 2) + 2 * (r % 2);
              if constexpr (kExpCodes) {
                pa[j][r] = pack4_low_bytes(__float_as_uint(s[a]), __float_as_uint(s[a + 1]),
                                           __float_as_uint(s[a + 4]), __float_as_uint(s[a + 5]));
              } else {
                pa[j][r] = pack4_e4m3(s[a], s[a + 1], s[a + 4], s[a + 5]);
              }
            } else {
              pa[j][r] = pack2<T>(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
            }
          }
      };

      // S(n) = Q K^T is done: K's slot is free, and (kQReleaseAfterS) so is Q after this warpgroup's
      // last S of the tile.
      auto s_done = [&](int slot, int n) {
        mbarrier_arrive_warp(k_empty(slot));
        if (kQReleaseAfterS && n == t.kb.n_min) mbarrier_arrive_warp(q_empty(q_buffer()));
      };

      for (int n = t.kb.n_max - 1; n >= n_top; --n) {  // waiting for full keeps the slots' phases in step
        const int slot = it() % kStages, parity = (it() / kStages) & 1;
        mbarrier_wait(k_full(slot), parity);
        mbarrier_arrive_warp(k_empty(slot));
        mbarrier_wait(v_full(slot), parity);
        if (kOStage != kOStageInV || n > t.kb.n_min) mbarrier_arrive_warp(v_empty(slot));  // (InV: after O's stores)
        progress += kItStep;
#pragma unroll
        for (int turn = 0; turn < kTurnsPerBlock; ++turn) {  // a block's turns, as if it were computed
          turn_begin();
          turn_end();
        }
      }
      if (n_top <= t.kb.n_min) {  // no block for this warpgroup: still one turn more than blocks (serial: none)
        if constexpr (!kSerial) {
          turn_begin();
          turn_end();
        }
        if constexpr (kOStage != kOStageInQ) mbarrier_arrive_warp(q_empty(q_buffer()));
      } else {
        // First block: S and softmax (O is still zero: not rescaled after it, or by its correction, 0).
        const float k_descale_top = kv_descale(1, n_top - 1);
        if constexpr (kFp8) o_descale = kv_descale(2, n_top - 1);
        mbarrier_wait(k_full(it() % kStages), (it() / kStages) & 1);
        turn_begin();
        wgmma_fence();
        issue_qk(it() % kStages);
        turn_end();
        wgmma_wait<0>();
        pin_registers(s);
        s_done(it() % kStages, n_top - 1);
        float correction[2];
        softmax(n_top - 1, k_descale_top, correction, half_top);
        // kTensorRowSums: the factor of the sums folded so far (tensor_sum), the softmax's correction
        // alone (O's also moves it to the block's v descale).
        float sum_correction[2] = {correction[0], correction[1]};
        // The end of P V(n + 1): wait for it and release its V slot (v_slot < 0: none); then
        // (rescale_and_pack) rescale O (when `rescale_o`) and pack block n's P. Both at the bottom of
        // iteration n, or (kOverlapPV) at the top of iteration n - 1 (see the top of this file);
        // serial: the wait before S(n) is issued, the rest after block n's softmax.
        auto pv_done = [&](int v_slot) {
          wgmma_wait<0>();
          pin_registers(o);
          if (v_slot >= 0) mbarrier_arrive_warp(v_empty(v_slot));
        };
        auto rescale_and_pack = [&](bool rescale_o) {
          if (rescale_o) {
#pragma unroll
            for (int j = 0; j < kOAcc; ++j) o[j] *= correction[(j >> 1) & 1];
          }
          if constexpr (kTensorRowSums) {  // the finished block's sums into fp32, the columns from zero
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) tensor_sum[hf] = (tensor_sum[hf] + o[kOAcc + 2 * hf]) * sum_correction[hf];
#pragma unroll
            for (int j = kOAcc; j < kOAcc + kSumColumns / 2; ++j) o[j] = 0.f;
          }
          pack_p();
          pin_registers(o);  // written before the next wgmma's fence, not sunk past it
          pin_registers(pa);
        };
        auto finish_pv = [&](int v_slot, bool rescale_o) {
          pv_done(v_slot);
          rescale_and_pack(rescale_o);
        };
        // O's rescale, warp-uniform: with a stale maximum, skipped while no row of the warp moved.
        // Not after the first block, where O is zero (kOverlapPV multiplies it, by 0: no branch).
        bool rescale = kOverlapPV && kStaleMax == 0;
        int pv_slot = -1;  // kOverlapPV: the V slot of the P V in flight (none before the second block)
        if constexpr (!kOverlapPV) {
          if (half_top) {
            pack_p(true);
          } else {
            pack_p();
          }
        }

        for (int n = n_top - 2; n >= t.kb.n_min; --n) {
          const float k_descale = kv_descale(1, n), v_descale = kv_descale(2, n);
          if constexpr (kOverlapPV) finish_pv(pv_slot, rescale);
          const int prev = it() % kStages, prev_parity = (it() / kStages) & 1;
          progress += kItStep;
          if constexpr (kRebroadcastEachBlock) progress = __shfl_sync(0xffffffffu, progress, 0);
          const int slot = it() % kStages;
          if constexpr (kSerial) {
            mbarrier_wait(v_full(prev), prev_parity);
            turn_begin();
            wgmma_fence();  // O was rescaled and P written by ordinary instructions
            issue_pv(prev);
            turn_end();
            pv_done(prev);  // P is dead before S is written
            mbarrier_wait(k_full(slot), (it() / kStages) & 1);
            turn_begin();
            wgmma_fence();
            issue_qk(slot);
            turn_end();
          } else {
            mbarrier_wait(k_full(slot), (it() / kStages) & 1);
            mbarrier_wait(v_full(prev), prev_parity);
            turn_begin();
            wgmma_fence();  // O was rescaled and P written by ordinary instructions
            issue_qk(slot);
            issue_pv(prev);
            turn_end();
          }
          if constexpr (kOverlapPV) pv_slot = prev;
          wgmma_wait<kSerial ? 0 : 1>();  // S(n) is done; P V of the block before may still run (not serial)
          pin_registers(s);
          s_done(slot, n);
          softmax(n, k_descale, correction);
          sum_correction[0] = correction[0];
          sum_correction[1] = correction[1];
          if constexpr (kFp8) {  // O moves to the units of block n's v descale
            // Exactly 1 when the descale does not change (per-head descales: every block), so that
            // the rounding of a division does not compound over the blocks.
            const float ratio = v_descale == o_descale ? 1.f : __fdividef(o_descale, v_descale);
            correction[0] *= ratio;
            correction[1] *= ratio;
            o_descale = v_descale;
          }
          rescale = kStaleMax == 0 || __any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f);
          if constexpr (kSerial) {
            rescale_and_pack(rescale);
          } else if constexpr (!kOverlapPV) {
            finish_pv(prev, rescale);
          }
        }
        if constexpr (kOverlapPV) finish_pv(pv_slot, rescale);
        const int last = it() % kStages;
        mbarrier_wait(v_full(last), (it() / kStages) & 1);
        progress += kItStep;
        turn_begin();
        wgmma_fence();
        issue_pv(last);
        turn_end();
        wgmma_wait<0>();
        pin_registers(o);
        if constexpr (kOStage != kOStageInV) mbarrier_arrive_warp(v_empty(last));  // (InV: after O's stores)
        if constexpr (kOStage != kOStageInQ && !kQReleaseAfterS) {
          mbarrier_arrive_warp(q_empty(q_buffer()));  // every S = Q K^T of this warpgroup is done: the next Q may load
        }
      }
    }

    // ------------------------------------------------------------------ epilogue
    // O / rowsum (times v's descale, e4m3) in 16 bits into this warpgroup's 64 rows of the staging
    // tile, then out by TMA (kOStoreTma) or in 16-byte row chunks (kOStageInV's tiles without key
    // blocks: zeros, nothing staged); or (kOStageDirect) straight out. The epilogue's
    // addresses are formed here from opaque copies of the thread and tile indices: otherwise the
    // compiler hoists them out of the tile loop and, at head dim 256, spills them across the main loop.
    const int index_again = opaque(index);
    const Tile te = tile_at<kBlockM, kBlockN, kVarlen, kMasked, kSplitKV>(p, index_again);
    const unsigned et = static_cast<unsigned>(opaque(tid));
    const unsigned e_lane = et % 32, e_row = 16 * (et % 128 / 32) + e_lane / 4;
    const int e_wg = static_cast<int>(et / 128) - 1;
    TOut* o_base =
        static_cast<TOut*>(p.out) + (kVarlen ? te.q_row0 * p.o_stride_s : te.b * p.o_stride_b) + te.h * p.o_stride_h;
    // kSplitKV: out and lse are the partials, of (batch, split) pairs as one batch index (the split
    // is the index's remainder: tile_at).
    const int o_batch = kSplitKV ? te.b * p.num_splits + index_again % p.num_splits : te.b;
    float* lse_base = p.lse + (kVarlen ? te.q_row0 : o_batch * p.lse_stride_b) + te.h * p.lse_stride_h;
    // e4m3 calls without the LSE pass none (and kTensorRowSums' sums would not make it).
    const bool write_lse = !kTensorRowSums && (!kFp8 || p.lse != nullptr);
    // kOStageInV: the V slot of the tile's last block, once every consumer's P V has read it.
    const bool in_v = kOStage == kOStageInV && te.kb.n_max > te.kb.n_min;
    const bool zero_tile = kOStage == kOStageInV && !in_v;  // its O is zero, and that slot another tile's
    const int v_last = (it() - 1) % kStages;
    // O / rowsum in 16 bits, packed before the waits below (kOStageInV: for the other consumers' last
    // P V), so that only the stores are left after them; O's registers are free from here on.
    unsigned packed[2][kHeadDim / 8];  // this thread's rows e_row and e_row + 8, columns 8 nt + 2 (e_lane % 4)
    float split_inv[2];                // kSplitKV: O is stored times these in float32 instead
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float total = kTensorRowSums ? tensor_sum[hf] + o[kOAcc + 2 * hf] : lanes_sum<4>(row_sum[hf]);
      const float inv = total > 0.f ? o_descale / total : 0.f;
      if constexpr (kSplitKV) split_inv[hf] = inv;
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) {
        packed[hf][nt] = pack2<TOut>(o[4 * nt + 2 * hf] * inv, o[4 * nt + 2 * hf + 1] * inv);
      }
      const int row = te.m0 + e_wg * 64 + static_cast<int>(e_row) + 8 * hf;
      if (write_lse && e_lane % 4 == 0 && te.has_row(row)) {
        lse_base[row] = row_lse<kExpOffset>(row_max[hf], total);
      }
    }
    if (in_v) named_barrier_sync(kOInVBarrier, 128 * kConsumers);
    // kOStoreTma: one TMA box per 64 columns of this warpgroup's rows, where those start at row 0 or
    // below it (a box that starts above row 0 ended the kernel on H100, illegal instruction, where
    // loads zero-fill; only a sequence's first tile has such rows: it stores as the other kOStage
    // variants do, by 16-byte rows).
    const bool o_tma = kOStoreTma && !zero_tile && te.m0 + e_wg * 64 >= 0;
    const bool o_issuer = et % 128 == 0;  // the thread that issues them
    if constexpr (kOStoreTma && kOStage == kOStageOwn) {  // the last tile's stores have read the staging tile
      if (o_issuer) bulk_wait_read<0>();
      named_barrier_sync(kWarpgroupBarrier + e_wg, 128);
    }
    const unsigned stage = (kOStage == kOStageInV ? sV + v_last * kVBytes : sO) + e_wg * 64 * 128;
    if constexpr (kOStage == kOStageDirect) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = te.m0 + e_wg * 64 + static_cast<int>(e_row) + 8 * hf;
#pragma unroll
        for (int nt = 0; nt < kHeadDim / 8; ++nt) {
          const int col = 8 * nt + 2 * static_cast<int>(e_lane % 4);
          if (te.has_row(row) && col < p.headdim) {  // the head dim is even: col + 1 is in too
            if constexpr (kSplitKV) {
              float* partial = static_cast<float*>(p.out) + o_batch * p.o_stride_b + te.h * p.o_stride_h;
              *reinterpret_cast<float2*>(partial + row * p.o_stride_s + col) =
                  make_float2(o[4 * nt + 2 * hf] * split_inv[hf], o[4 * nt + 2 * hf + 1] * split_inv[hf]);
            } else {
              *reinterpret_cast<unsigned*>(o_base + row * p.o_stride_s + col) = packed[hf][nt];
            }
          }
        }
      }
    } else if (!zero_tile) {
      // Into this warpgroup's 64 rows of the staging tile (Q's swizzled layout: the 8 rows a warp
      // writes at once land in 8 different 16-byte bank groups, and TMA reads it as it writes Q).
      // Chunk c of row r sits at r * 128 + ((c ^ r % 8) << 4), and rows e_row and e_row + 8 share
      // r % 8: one address per chunk, XORed once, serves both rows and every atom as immediates
      // (ptxas formed each of the 64 addresses anew, ~12 instructions a store at head dim 256).
      const unsigned row_chunk0 = stage + sw128_offset(e_row, 0) + (e_lane % 4) * 4;
#pragma unroll
      for (unsigned c = 0; c < 8; ++c) {
        const unsigned chunk = row_chunk0 ^ (c << 4);
#pragma unroll
        for (int a = 0; a < kHeadDim / 64; ++a)
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            st_shared_b32(chunk + a * kBlockM * 128 + hf * 8 * 128, packed[hf][8 * a + c]);
          }
      }
    }
    if (o_tma) {
      fence_proxy_async_shared();  // the staging writes, before the async proxy reads them
      named_barrier_sync(kWarpgroupBarrier + e_wg, 128);
      if (o_issuer) {
#pragma unroll
        for (int a = 0; a < kHeadDim / 64; ++a) {  // 16-bit swizzle rows of 64 columns
          tma_store_4d(&p.o_map, stage + a * kBlockM * 128, 64 * a, te.h, te.m0 + e_wg * 64, te.b);
        }
        bulk_commit();
      }
    } else if constexpr (kOStage != kOStageDirect) {
      named_barrier_sync(kWarpgroupBarrier + e_wg, 128);
      // Each thread keeps one 16-byte chunk column c of the rows and steps down them kRowsPerPass at
      // a time, so a chunk costs a bounds test, a load and a store: with the row and column derived
      // from a running index (signed divisions and swizzle arithmetic), it was ~40 instructions.
      // A row's kChunks are spread over a power-of-two number of threads (head dim 192: 24 of 32).
      constexpr unsigned kChunks = kHeadDim / 8;  // 16-byte chunks per row
      constexpr unsigned kChunkThreads = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
      constexpr unsigned kRowsPerPass = 128 / kChunkThreads;
      const unsigned c = et % kChunkThreads;
      const unsigned r0 = et % 128 / kChunkThreads;
      const int row0 = te.m0 + e_wg * 64 + static_cast<int>(r0);
      if (c < kChunks && static_cast<int>(c * 8) < p.headdim) {
        TOut* dst = o_base + row0 * p.o_stride_s + c * 8;
        const unsigned src = stage + (c / 8) * kBlockM * 128;
#pragma unroll
        for (unsigned i = 0; i < 64 / kRowsPerPass; ++i) {
          const unsigned r = r0 + i * kRowsPerPass;
          if (te.has_row(row0 + static_cast<int>(i * kRowsPerPass))) {
            st_global_v4(dst + i * kRowsPerPass * p.o_stride_s,
                         zero_tile ? make_uint4(0u, 0u, 0u, 0u) : ld_shared_v4(src + sw128_offset(r, c % 8)));
          }
        }
      }
    }
    // Before TMA writes the next Q (kOStageInQ) or V (in_v) over the staged O.
    if constexpr (kOStage == kOStageInQ) {
      release_staging(q_empty(0), o_tma, o_issuer);
    } else if (in_v) {
      // The warp that issued TMA stores from the slot arrives at the next tile's start: waiting
      // here for their reads held its warpgroup at that tile's barrier (7% of the warp samples at
      // head dim 256, causal 512; NOTES-sm90.md, version 44).
      if (o_tma && et % 128 < 32) {
        o_pending_slot = v_last;
      } else {
        release_staging(v_empty(v_last), o_tma, o_issuer);
      }
    } else if constexpr (kOStage == kOStageOwn && !kOStoreTma) {
      named_barrier_sync(kWarpgroupBarrier + e_wg, 128);  // reads done before the next tile's writes
    }
  }
  if constexpr (kOStoreTma) {
    if (tid % 128 == 0) bulk_wait<0>();  // this warpgroup's stores are done before the CTA ends
  }
  if constexpr (kPingPong) {
    if (wg == 0) turn_begin();  // the hand-over after the last tile (or, with none, the first)
  }
}

}  // namespace cuflash
