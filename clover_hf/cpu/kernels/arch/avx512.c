/* The AVX-512-BF16 build's inner loops: the products' tiles (vdpbf16ps over bf16 pairs), attention's passes over
 * keys laid out for them, and the screen's int8 tiles (VNNI's pair products of int16s). Weights are read 8 KB ahead
 * into L2: more misses in flight than L1 holds. */
#include "../bf16_cpu.h"

#if defined(__AVX512BF16__)

#define READ_AHEAD(p) _mm_prefetch((const char*)(p) + 8192, _MM_HINT_T2)

/* R rows of x against one tile: two 16-column sums per row */
#define TILE(R) \
static void tile##R(const xtype* x, const uint16_t* wt, int pairs, int I, float* sums) { \
    __m512 s0[R], s1[R]; \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { s0[r] = _mm512_setzero_ps(); s1[r] = _mm512_setzero_ps(); } \
    const uint16_t* wp = wt; \
    for (int p = 0; p < pairs; p++, wp += 64) { \
        READ_AHEAD(wp); \
        READ_AHEAD(wp + 32); \
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(wp); \
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(wp + 32); \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { \
            uint32_t pair; \
            memcpy(&pair, x + (size_t)r * I + 2 * p, 4); \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair); \
            s0[r] = _mm512_dpbf16_ps(s0[r], xb, b0); \
            s1[r] = _mm512_dpbf16_ps(s1[r], xb, b1); \
        } \
    } \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) { \
        _mm512_storeu_ps(sums + 32 * r, s0[r]); \
        _mm512_storeu_ps(sums + 32 * r + 16, s1[r]); \
    } \
}
TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14)

/* one row: even and odd pairs summed apart, four chains of additions instead of two */
static void tile1(const xtype* x, const uint16_t* wt, int pairs, int I, float* sums) {
    (void)I;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
    const uint16_t* wp = wt;
    int p = 0;
    for (; p + 1 < pairs; p += 2, wp += 128) {
        READ_AHEAD(wp);
        READ_AHEAD(wp + 32);
        READ_AHEAD(wp + 64);
        READ_AHEAD(wp + 96);
        uint32_t q0, q1;
        memcpy(&q0, x + 2 * p, 4);
        memcpy(&q1, x + 2 * p + 2, 4);
        __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)q0), x1 = (__m512bh)_mm512_set1_epi32((int)q1);
        s0 = _mm512_dpbf16_ps(s0, x0, (__m512bh)_mm512_loadu_si512(wp));
        s1 = _mm512_dpbf16_ps(s1, x0, (__m512bh)_mm512_loadu_si512(wp + 32));
        t0 = _mm512_dpbf16_ps(t0, x1, (__m512bh)_mm512_loadu_si512(wp + 64));
        t1 = _mm512_dpbf16_ps(t1, x1, (__m512bh)_mm512_loadu_si512(wp + 96));
    }
    for (; p < pairs; p++, wp += 64) {
        uint32_t q0;
        memcpy(&q0, x + 2 * p, 4);
        __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)q0);
        s0 = _mm512_dpbf16_ps(s0, x0, (__m512bh)_mm512_loadu_si512(wp));
        s1 = _mm512_dpbf16_ps(s1, x0, (__m512bh)_mm512_loadu_si512(wp + 32));
    }
    _mm512_storeu_ps(sums, _mm512_add_ps(s0, t0));
    _mm512_storeu_ps(sums + 16, _mm512_add_ps(s1, t1));
}

const tile_fn TILES[BLOCK + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8, tile9, tile10,
                                         tile11, tile12, tile13, tile14};

/* 16 rows of 16 uint32s transposed in registers (row i of the result holds element i of each row) */
static inline void transpose16(__m512i* r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(_mm512_castsi512_ps(r[i]), _mm512_castsi512_ps(r[i + 1]));
        t[i + 1] = _mm512_unpackhi_ps(_mm512_castsi512_ps(r[i]), _mm512_castsi512_ps(r[i + 1]));
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(u[h + i], u[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(u[h + i], u[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
        r[i + 8] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
}

/* The keys of one head (K x D) as blocks of 16 keys, each (D/2 pairs, 16 keys) of bf16 pairs: what vdpbf16ps
 * multiplies against a broadcast pair of query values; keys past K are zero. Blocks b0..b1 alone: threads share a
 * head's. Each block's 16 keys are read as they lie and transposed in registers, 16 pairs at a time (gathering each
 * pair's 16 values ran slower). */
void transpose_keys(const uint16_t* k, uint32_t* kt, int K, int D, int b0, int b1) {
    int pairs = D / 2;
    for (int blk = b0; blk < b1; blk++) {
        int n = K - 16 * blk < 16 ? K - 16 * blk : 16;
        const uint16_t* base = k + (size_t)blk * 16 * D;
        uint32_t* out = kt + (size_t)blk * pairs * 16;
        for (int p0 = 0; p0 < pairs; p0 += 16) {
            int live = pairs - p0 < 16 ? pairs - p0 : 16; /* pairs of these 16 a key has (a head of fewer than 32) */
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < n ? _mm512_maskz_loadu_epi32((__mmask16)((1u << live) - 1u), base + (size_t)i * D + 2 * p0)
                             : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < live; i++)
                _mm512_storeu_si512(out + 16 * (p0 + i), r[i]);
        }
    }
}

/* Attention of up to ATT_ROWS query rows (each D values, `q_at[r]`) over keys k0..k1 of one key/value head (k0 a
 * multiple of 16), short of the division: scores scale * q.k plus the rows' additive mask (`mask_at[r]`, float32 or
 * bf16, or none), from the keys laid out by `transpose_keys` (`kt`, all of the head's); each row's largest score
 * most[r], its sum of e^(score - most) total[r], and the values (v at key 0) weighted by those e^ rounded to bf16,
 * as SDPA's CPU kernel rounds them for its product by the values (n x D floats) in sums. `scores` holds
 * SCRATCH(k1 - k0, D) floats. */
static inline __attribute__((always_inline)) void attend_n(
        const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n, const uint32_t* kt,
        const uint16_t* v, int k0, int k1, int D, float scale, float* scores, float* most, float* total, float* sums) {
    int pairs = D / 2, K = k1 - k0, blocks = (K + 15) / 16, stride = 16 * blocks;
    __m512 scaled = _mm512_set1_ps(scale);
    for (int blk = 0; blk < blocks; blk++) {
        __m512 acc[ATT_ROWS];
        for (int r = 0; r < n; r++)
            acc[r] = _mm512_setzero_ps();
        const uint32_t* kb = kt + (size_t)(k0 / 16 + blk) * pairs * 16;
        for (int p = 0; p < pairs; p++) {
            __m512bh kp = (__m512bh)_mm512_loadu_si512(kb + 16 * p);
            for (int r = 0; r < n; r++) {
                uint32_t pair;
                memcpy(&pair, q_at[r] + 2 * p, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)pair), kp);
            }
        }
        int live = K - 16 * blk < 16 ? K - 16 * blk : 16, at = k0 + 16 * blk;
        __mmask16 m = (__mmask16)((1u << live) - 1u);
        for (int r = 0; r < n; r++) {
            __m512 s = _mm512_mul_ps(acc[r], scaled);
            if (mask_at[r]) {
                s = _mm512_add_ps(s, mask_bf16 ? bf16x16((const uint16_t*)mask_at[r] + at, m)
                                               : _mm512_maskz_loadu_ps(m, (const float*)mask_at[r] + at));
            }
            _mm512_storeu_ps(scores + (size_t)r * stride + 16 * blk, _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), s));
        }
    }
    for (int r = 0; r < n; r++) {
        float* s = scores + (size_t)r * stride;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < stride; j += 16)
            top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        most[r] = _mm512_reduce_max_ps(top);
        __m512 high = _mm512_set1_ps(most[r]), sum = _mm512_setzero_ps();
        uint16_t* weights = (uint16_t*)s; /* the row's e^ rounded to bf16, written over the floats already read */
        for (int j = 0; j < stride; j += 16) {
            __m512 x = _mm512_loadu_ps(s + j);
            __m512 e = exp_neg(_mm512_sub_ps(x, high));
            e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), e, _mm512_setzero_ps());
            sum = _mm512_add_ps(sum, e);
            _mm256_storeu_si256((__m256i*)(weights + j), round16(e));
        }
        total[r] = _mm512_reduce_add_ps(sum);
    }
    /* the values weighed two keys at a time by vdpbf16ps: keys j and j + 1's values interleaved (within each 128-bit
     * lane, so each sum's dimensions come out permuted, put back as they are stored) against the two weights */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    int d = 0;
    for (; d + 32 <= D; d += 32) {
        __m512 lo_acc[ATT_ROWS], hi_acc[ATT_ROWS];
        for (int r = 0; r < n; r++)
            lo_acc[r] = hi_acc[r] = _mm512_setzero_ps();
        for (int j = 0; j < K; j += 2) {
            __m512i a = _mm512_loadu_si512(v + (size_t)(k0 + j) * D + d);
            __m512i b = j + 1 < K ? _mm512_loadu_si512(v + (size_t)(k0 + j + 1) * D + d) : _mm512_setzero_si512();
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int r = 0; r < n; r++) {
                uint32_t pair;
                memcpy(&pair, (const uint16_t*)(scores + (size_t)r * stride) + j, 4);
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                lo_acc[r] = _mm512_dpbf16_ps(lo_acc[r], w, lo);
                hi_acc[r] = _mm512_dpbf16_ps(hi_acc[r], w, hi);
            }
        }
        for (int r = 0; r < n; r++) {
            /* lo holds dims 8l..8l+3 of lane l, hi 8l+4..8l+7: dims 0-15 are lanes 0-1 of both, 16-31 lanes 2-3 */
            _mm512_storeu_ps(sums + (size_t)r * D + d, _mm512_permutex2var_ps(lo_acc[r], first, hi_acc[r]));
            _mm512_storeu_ps(sums + (size_t)r * D + d + 16, _mm512_permutex2var_ps(lo_acc[r], second, hi_acc[r]));
        }
    }
    if (d < D) { /* a last 16 dimensions (a head of 16, 48, 80, ...): both keys' interleaved halves in one vector */
        const __m512i order = _mm512_set_epi32(15, 14, 13, 12, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
        __m512 acc[ATT_ROWS];
        for (int r = 0; r < n; r++)
            acc[r] = _mm512_setzero_ps();
        for (int j = 0; j < K; j += 2) {
            __m256i a = _mm256_loadu_si256((const __m256i*)(v + (size_t)(k0 + j) * D + d));
            __m256i b = j + 1 < K ? _mm256_loadu_si256((const __m256i*)(v + (size_t)(k0 + j + 1) * D + d))
                                  : _mm256_setzero_si256();
            __m512bh both = (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a, b)),
                                                         _mm256_unpackhi_epi16(a, b), 1);
            for (int r = 0; r < n; r++) {
                uint32_t pair;
                memcpy(&pair, (const uint16_t*)(scores + (size_t)r * stride) + j, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)pair), both);
            }
        }
        for (int r = 0; r < n; r++)
            _mm512_storeu_ps(sums + (size_t)r * D + d, _mm512_permutexvar_ps(order, acc[r]));
    }
}

/* `attend_n` with n a constant in each case: the rows' sums then stay in registers (with n a variable, GCC kept
 * them on the stack, a load and a store around each row's products) */
void attend_part(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n,
                 const uint16_t* k, const uint32_t* kt, const uint16_t* v, int k0, int k1, int D, float scale,
                 float* scores, float* most, float* total, float* sums) {
    (void)k;
#define ATTEND(N) attend_n(q_at, mask_at, mask_bf16, N, kt, v, k0, k1, D, scale, scores, most, total, sums)
    switch (n) {
    case 1: ATTEND(1); break;
    case 2: ATTEND(2); break;
    case 3: ATTEND(3); break;
    case 4: ATTEND(4); break;
    case 5: ATTEND(5); break;
    case 6: ATTEND(6); break;
    case 7: ATTEND(7); break;
    default: ATTEND(ATT_ROWS);
    }
#undef ATTEND
}

#define SCREEN_ROWS 8
/* int32 sums (R x 32, `sums`) of R <= SCREEN_ROWS rows of int16 x (I apart) by one int8 tile (I/2 pairs of 32
 * columns' two bytes), by VNNI's pair products of int16s */
static inline __attribute__((always_inline)) void screen_block(int R, const int16_t* xq, const int8_t* wt, int pairs,
                                                               int I, int32_t* sums) {
    __m512i s0[SCREEN_ROWS], s1[SCREEN_ROWS];
    for (int r = 0; r < R; r++)
        s0[r] = s1[r] = _mm512_setzero_si512();
    const int8_t* wp = wt;
    for (int p = 0; p < pairs; p++, wp += 64) {
        READ_AHEAD(wp);
        __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)wp));
        __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wp + 32)));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xq + (size_t)r * I + 2 * p, 4);
            __m512i xb = _mm512_set1_epi32(pair);
            s0[r] = _mm512_dpwssd_epi32(s0[r], xb, w0);
            s1[r] = _mm512_dpwssd_epi32(s1[r], xb, w1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_si512(sums + 32 * r, s0[r]);
        _mm512_storeu_si512(sums + 32 * r + 16, s1[r]);
    }
}

/* sums (R x 32) of all R rows by tile wt, SCREEN_ROWS rows a pass over it, each pass's row count a constant */
void screen_tile(const int16_t* xq, const int8_t* wt, int pairs, int I, int R, int32_t* sums) {
    for (int r0 = 0; r0 < R; r0 += SCREEN_ROWS) {
        const int16_t* x = xq + (size_t)r0 * I;
        int32_t* s = sums + 32 * (size_t)r0;
        switch (R - r0 < SCREEN_ROWS ? R - r0 : SCREEN_ROWS) {
        case 1: screen_block(1, x, wt, pairs, I, s); break;
        case 2: screen_block(2, x, wt, pairs, I, s); break;
        case 3: screen_block(3, x, wt, pairs, I, s); break;
        case 4: screen_block(4, x, wt, pairs, I, s); break;
        case 5: screen_block(5, x, wt, pairs, I, s); break;
        case 6: screen_block(6, x, wt, pairs, I, s); break;
        case 7: screen_block(7, x, wt, pairs, I, s); break;
        default: screen_block(8, x, wt, pairs, I, s);
        }
    }
}

#endif
