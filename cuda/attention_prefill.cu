// Prefill attention on the tensor cores: FlashAttention-2-style tiles over the paged KV cache,
// causal, grouped-query, online softmax in fp32.
//
// Sequence i's new tokens are rows query_start[i] .. query_start[i+1]-1 and sit at the end of its
// context: new token j has position context_lens[i] - q_len + j and sees positions 0..itself, read
// through the block table (slot = table[p >> log2(block_size)] * block_size + p % block_size; rows
// of [num_kv_heads, D] bf16), so a cached prefix is attended to like the new tokens.
//
// Grid (num_q_heads, num_seqs, ceil(max_q_len / BLOCK_Q)); query tile = gridDim.z - 1 - blockIdx.z
// so the longest (last) tiles of every sequence start first and the short ones fill the tail.
// Tiles past a sequence's length exit at once. Query head h reads kv head h / group; the heads of
// one group are neighbours in x, so they run together and share the K/V tiles through L2.
//
// A CTA owns BLOCK_Q = 64 query rows of one head: 4 warps x 16 rows (one mma M each). Per warp:
//   Q  (16 x D) lives in registers as D/16 mma A fragments, loaded once from global memory;
//   S  = Q K^T over a tile of BLOCK_K = 64 keys: 8 n-tiles of 16 x 8 fp32 accumulators;
//   P  = exp2(S * scale * log2e - rowmax * scale * log2e) is rounded to bf16 and re-used straight
//        from the accumulator registers as the A fragments of O += P V (the C layout of two
//        neighbouring n-tiles is exactly the A layout of one 16-key chunk);
//   O  (16 x D) fp32 accumulators, rescaled by exp2(old max - new max) per tile.
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, lane (g = lane/4, t = lane%4):
//   A: a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8, k 2t+8..)
//   B: b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g)
//   C: c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// K and V tiles sit in shared memory as [key][D] rows padded by 8 bf16 (16 bytes), so the 8 rows
// of one ldmatrix phase start 16 bytes apart modulo 128: no bank conflicts. K^T's B fragments are
// ldmatrix.x4 of K rows (a K row is a column of K^T, its pairs run along d = k); V's are
// ldmatrix.x4.trans of V rows (the pairs must run along keys = k, across rows).
//
// Pipeline (FlashAttention-2's): one K and one V buffer, each filled by cp.async (16 bytes per
// thread, L2 only; keys past the tile's end are zero-filled, so no NaN of an unused slot reaches P V):
//   wait K[j]; barrier; issue V[j]; S = Q K[j]^T; softmax        (V[j] streams in under S)
//   wait V[j]; barrier; issue K[j+1]; O += P V[j]                (K[j+1] streams in under P V)
// The first barrier also tells every warp's P V[j-1] is done before V[j] overwrites it; the
// second that every warp's S is done before K[j+1] overwrites K[j].
//
// Masking: a key tile reaching past the tile's first query position gets the causal mask
// (key > row position -> -inf); tiles wholly below it need none; tiles past the last row's
// position are never loaded. Every row sees key 0 in the first tile, so its running max is finite
// from then on and a fully masked later tile gives p = 0, alpha = 1. Rows past the sequence's end
// load Q = 0 (finite scores) and are never stored. On a sliding layer (the window kernels) a row
// at position p sees keys p - window + 1 .. p (transformers' sliding window counts p itself):
// tiles before the tile's first row's window are not loaded, keys below a row's window are
// masked, and a row whose keys in the first tiles are all masked keeps max -inf and adds nothing
// (offset 0) until it meets its window.
//
// block_size must be a power of two (EngineConfig enforces it; the launcher checks it).
#include "common.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int BLOCK_Q = WARPS * 16;  // query rows per CTA: 16 per warp, one mma M
constexpr int BLOCK_K = 64;          // keys per K/V tile
constexpr int SMEM_PAD = 8;          // bf16 added to each shared K/V row (16 bytes)





template <int D, int TILE_K, bool WINDOWED>
__device__ __forceinline__ void prefill_attention(
    bf16* __restrict__ out, const bf16* __restrict__ q, int q_row_stride,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ block_table_width,
    const int* __restrict__ query_start, const int* __restrict__ context_lens, int block_size,
    int num_kv_heads, int group, float scale, int window) {
    constexpr int ROW = D + SMEM_PAD;                    // shared row stride, bf16
    constexpr int ROW_CHUNKS = D / 8;                    // 16-byte chunks per K/V row
    constexpr int ROWS_PER_PASS = THREADS / ROW_CHUNKS;  // tile rows one pass of the CTA copies
    constexpr int LOADS = TILE_K / ROWS_PER_PASS;       // chunks per thread per tile
    constexpr int DK = D / 16;                           // 16-wide chunks of the head dim
    constexpr int NT = TILE_K / 8;                      // n-tiles of S (8 keys each)
    constexpr int NO = D / 8;                            // n-tiles of O (8 dims each)
    static_assert(THREADS % ROW_CHUNKS == 0 && TILE_K % ROWS_PER_PASS == 0, "tile copy shape");
    __shared__ __align__(128) bf16 k_tile[TILE_K * ROW];
    __shared__ __align__(128) bf16 v_tile[TILE_K * ROW];

    const int head = blockIdx.x, seq = blockIdx.y, kv_head = head / group;
    const int num_q_heads = num_kv_heads * group;
    const int q_begin = query_start[seq];
    const int q_len = query_start[seq + 1] - q_begin;
    const int tile_q0 = (gridDim.z - 1 - blockIdx.z) * BLOCK_Q;
    if (tile_q0 >= q_len) return;  // uniform across the block
    const int first_pos = context_lens[seq] - q_len;
    const int kv_end = first_pos + min(tile_q0 + BLOCK_Q, q_len);  // one past the last row's position
    const int num_tiles = (kv_end + TILE_K - 1) / TILE_K;
    // A sliding layer's window (WINDOWED, window > 0): the tile's first row sees positions from
    // its own - window + 1 on, every later row from later ones, so the key tiles before the one
    // holding that first position are skipped; keys below a row's window are masked (below).
    const bool windowed = WINDOWED && window > 0;
    const int first_tile = windowed ? max(0, first_pos + tile_q0 - window + 1) / TILE_K : 0;
    // the row stride is read from device memory so a captured CUDA graph serves any width
    const int* table = block_tables + (size_t)seq * *block_table_width;
    const int block_shift = __ffs(block_size) - 1;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

    // ---- K/V tile copy: this thread's 16-byte column and its LOADS rows --------------------------
    const int copy_col = (threadIdx.x % ROW_CHUNKS) * 8, copy_row = threadIdx.x / ROW_CHUNKS;
    const size_t kv_row = (size_t)num_kv_heads * D;
    const bf16* k_src = k_cache + (size_t)kv_head * D + copy_col;
    const bf16* v_src = v_cache + (size_t)kv_head * D + copy_col;
    const uint32_t k_dst = smem_addr(k_tile + copy_row * ROW + copy_col);
    const uint32_t v_dst = smem_addr(v_tile + copy_row * ROW + copy_col);
    int slot[LOADS];  // cache slot of each row this thread copies; -1 past kv_end (zero fill)
    auto find_slots = [&](int k0) {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int pos = k0 + copy_row + i * ROWS_PER_PASS;
            slot[i] = pos < kv_end ? table[pos >> block_shift] * block_size + (pos & (block_size - 1)) : -1;
        }
    };
    auto issue_copy = [&](uint32_t dst, const bf16* src) {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const bool valid = slot[i] >= 0;
            cp_async16(dst + i * ROWS_PER_PASS * ROW * 2, src + (valid ? (size_t)slot[i] * kv_row : 0), valid ? 16 : 0);
        }
        cp_async_commit();
    };
    find_slots(first_tile * TILE_K);
    issue_copy(k_dst, k_src);

    // ---- Q fragments: rows r0 = tile_q0 + 16 warp + g and r1 = r0 + 8 of this sequence ------------
    const int r0 = tile_q0 + warp * 16 + g, r1 = r0 + 8;
    const bool ok0 = r0 < q_len, ok1 = r1 < q_len;
    uint32_t qf[DK][4];
    {
        const bf16* q0 = q + (size_t)(q_begin + (ok0 ? r0 : 0)) * q_row_stride + head * D + 2 * t;
        const bf16* q1 = q + (size_t)(q_begin + (ok1 ? r1 : 0)) * q_row_stride + head * D + 2 * t;
        load_q_fragments(qf, q0, q1, ok0, ok1);
    }

    // ldmatrix row addresses of this lane (matrix lane / 8, row lane % 8 of it):
    //   K: matrices (keys +0, d +0) (keys +0, d +8) (keys +8, d +0) (keys +8, d +8)
    //      -> b0, b1 of n-tile 2j and b0, b1 of n-tile 2j+1
    //   V: matrices (keys +0, d +0) (keys +8, d +0) (keys +0, d +8) (keys +8, d +8), transposed
    //      -> b0, b1 of d-tile 2j and b0, b1 of d-tile 2j+1
    const uint32_t k_frag = smem_addr(k_tile + ((lane >> 4) * 8 + (lane & 7)) * ROW + ((lane >> 3) & 1) * 8);
    const uint32_t v_frag = smem_addr(v_tile + (((lane >> 3) & 1) * 8 + (lane & 7)) * ROW + (lane >> 4) * 8);

    const float scale_log2 = scale * 1.4426950408889634f;  // exp(x * scale) = exp2(x * scale_log2)
    const int pos0 = first_pos + r0, pos1 = pos0 + 8;     // positions of this lane's two rows
    const int tile_first_pos = first_pos + tile_q0;
    float o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};  // this lane's share; the 4 lanes of a row add up at the end

    for (int kt = first_tile; kt < num_tiles; ++kt) {
        const int k0 = kt * TILE_K;
        cp_async_wait<0>();
        __syncthreads();  // K[kt] is in; every warp is done with V[kt-1]
        issue_copy(v_dst, v_src);
        if (kt + 1 < num_tiles) find_slots(k0 + TILE_K);

        float s[NT][4];
        score_tile<NT, DK, ROW>(s, qf, k_frag);
        if (k0 + TILE_K - 1 > tile_first_pos) {  // some key of this tile is later than some row
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int key = k0 + 8 * n + 2 * t;
                if (key > pos0) s[n][0] = -INFINITY;
                if (key + 1 > pos0) s[n][1] = -INFINITY;
                if (key > pos1) s[n][2] = -INFINITY;
                if (key + 1 > pos1) s[n][3] = -INFINITY;
            }
        }
        if (windowed && k0 <= kv_end - 1 - window) {   // some key of this tile is below some row's window
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const int key = k0 + 8 * n + 2 * t;
                if (key <= pos0 - window) s[n][0] = -INFINITY;
                if (key + 1 <= pos0 - window) s[n][1] = -INFINITY;
                if (key <= pos1 - window) s[n][2] = -INFINITY;
                if (key + 1 <= pos1 - window) s[n][3] = -INFINITY;
            }
        }

        // online softmax: rows g (r = 0) and g + 8 (r = 1); a row's 64 scores span the 4 lanes of a quad
        float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            new_max[0] = fmaxf(new_max[0], fmaxf(s[n][0], s[n][1]));
            new_max[1] = fmaxf(new_max[1], fmaxf(s[n][2], s[n][3]));
        }
        float alpha[2], offset[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], 1));
            new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], 2));
            // A windowed row may see no key of its first tiles (its max still -inf): it then takes
            // offset 0, so its p are exp2(-inf) = 0 and alpha exp2(-inf) = 0 instead of NaN.
            const float seen_max = WINDOWED && new_max[r] == -INFINITY ? 0.0f : new_max[r];
            alpha[r] = fast_exp2((row_max[r] - seen_max) * scale_log2);  // 0 on the first tile
            offset[r] = seen_max * scale_log2;
            row_max[r] = new_max[r];
            row_sum[r] *= alpha[r];
        }
        rescale_rows(o, alpha);
        uint32_t p[NT / 2][4];   // P as A fragments for P @ V (common.cuh's softmax_to_fragments)
        softmax_to_fragments(s, scale_log2, offset, row_sum, p);

        cp_async_wait<0>();
        __syncthreads();  // V[kt] is in; every warp is done with K[kt]
        if (kt + 1 < num_tiles) issue_copy(k_dst, k_src);
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
#pragma unroll
            for (int c = 0; c < DK; ++c) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, v_frag + (16 * j * ROW + 16 * c) * 2);
                mma_bf16(o[2 * c], p[j][0], p[j][1], p[j][2], p[j][3], b[0], b[1]);
                mma_bf16(o[2 * c + 1], p[j][0], p[j][1], p[j][2], p[j][3], b[2], b[3]);
            }
        }
    }

    // ---- epilogue: O / row sum, bf16 pairs straight from the accumulators -------------------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    const float inv0 = 1.0f / row_sum[0], inv1 = 1.0f / row_sum[1];  // >= 1 (the max's own term)
    const size_t out_row = (size_t)num_q_heads * D;
    bf16* out0 = out + (size_t)(q_begin + r0) * out_row + head * D + 2 * t;
    bf16* out1 = out0 + 8 * out_row;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        if (ok0) *reinterpret_cast<uint32_t*>(out0 + 8 * n) = pack_bf16x2(o[n][0] * inv0, o[n][1] * inv0);
        if (ok1) *reinterpret_cast<uint32_t*>(out1 + 8 * n) = pack_bf16x2(o[n][2] * inv1, o[n][3] * inv1);
    }
}

}  // namespace

// Kernels: attention_prefill_d{D} over the whole context, attention_prefill_window_d{D} over each
// row's last `window` positions (0: the whole context), a sliding layer's (its own instantiations,
// so the full-context kernels' code has no window in it). head_dim 256 (Gemma 3) takes 32-key
// tiles: 64-key ones would need 2 x 64 x 264 x 2 = 66 KB of static shared memory (48 KB at most);
// with 32 it holds Q's 64 and O's 128 registers a thread and S's 16 in 252, without spills
// (ptxas, nvcc 13.0 sm_90).
#define PREFILL_ATTENTION_KERNEL(D, TILE_K)                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_prefill_d##D(                \
        bf16* out, const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, const int* block_table_width, const int* query_start,           \
        const int* context_lens, int block_size, int num_kv_heads, int group, float scale) {     \
        prefill_attention<D, TILE_K, false>(out, q, q_row_stride, k_cache, v_cache, block_tables, \
                                            block_table_width, query_start, context_lens,         \
                                            block_size, num_kv_heads, group, scale, 0);           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_prefill_window_d##D(         \
        bf16* out, const bf16* q, int q_row_stride, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, const int* block_table_width, const int* query_start,           \
        const int* context_lens, int block_size, int num_kv_heads, int group, float scale,       \
        int window) {                                                                            \
        prefill_attention<D, TILE_K, true>(out, q, q_row_stride, k_cache, v_cache, block_tables, \
                                           block_table_width, query_start, context_lens,          \
                                           block_size, num_kv_heads, group, scale, window);       \
    }
PREFILL_ATTENTION_KERNEL(64, BLOCK_K)
PREFILL_ATTENTION_KERNEL(128, BLOCK_K)
PREFILL_ATTENTION_KERNEL(256, 32)
