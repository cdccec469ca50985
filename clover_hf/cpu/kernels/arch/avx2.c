/* The AVX2 build's inner loops: the products' tiles (weights widened to float32 in registers) and half tiles for
 * more rows, attention's passes (float32 dot products, the values weighed in blocks of keys that stay in L1), and the
 * screen's int8 tiles (vpmaddwd over int16 pairs). Weights are read 2 KB ahead into L1 alone (non-temporal): read
 * plainly, a forward's stream of weights would push out of the last-level cache what is read again soon (the KV
 * cache, the draft heads' weights, activations). */
#include "../bf16_cpu.h"

#if !defined(__AVX512BF16__)

#define AHEAD 1024 /* weight elements (2 KB) a non-temporal prefetch reads ahead of the products */
#define READ_AHEAD(p) _mm_prefetch((const char*)(p) + 2 * AHEAD, _MM_HINT_NTA)

/* the two float32 weights of each of 8 columns in one 256-bit load of (column, pair) bf16s */
#define WIDEN(v, even, odd) \
    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); \
    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));

/* R rows against one tile in one pass: each pair's 128 bytes (32 columns) read once, in order, into four 8-column
 * sums a row (a pass a 16-column half read every other line of the tile twice apart, slower at every row count) */
#define TILE(R) \
static void tile##R(const xtype* x, const uint16_t* wt, int pairs, int I, float* sums) { \
    __m256 s[R][4]; \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) s[r][c] = _mm256_setzero_ps(); \
    const uint16_t* wp = wt; \
    for (int p = 0; p < pairs; p++, wp += 64) { \
        READ_AHEAD(wp); \
        READ_AHEAD(wp + 32); \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) { \
            __m256i v = _mm256_loadu_si256((const __m256i*)(wp + 16 * c)); \
            WIDEN(v, e, o) \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) { \
                __m256 xe = _mm256_broadcast_ss(x + (size_t)r * I + 2 * p); \
                __m256 xo = _mm256_broadcast_ss(x + (size_t)r * I + 2 * p + 1); \
                s[r][c] = _mm256_fmadd_ps(xo, o, _mm256_fmadd_ps(xe, e, s[r][c])); \
            } \
        } \
    } \
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) _mm256_storeu_ps(sums + 32 * r + 8 * c, s[r][c]); \
}
TILE(1) TILE(2) TILE(3) TILE(4)

const tile_fn TILES[BLOCK + 1] = {0, tile1, tile2, tile3, tile4};

/* More rows than a block are compute-bound: a pass over a 16-column half of a tile takes up to HALF_ROWS rows, whose
 * 12 sums fill the registers beside two weights and an x, and adds each pair's even inputs, then its odd ones (the
 * sums' order of the tiles above, so every row rounds alike whatever the row count). Each tile is read a chunk of
 * CHUNK pairs at a time, by every pass while the chunk is in L1; each pass prefetches its share of the next chunk:
 * faster than blocks of BLOCK rows over whole tiles at every row count past a block. */

/* the odd inputs' weights of 8 columns as float32: the high halves of their (column, pair) values (two shifts ran
 * faster than a mask, which left a register short at 6 rows) */
#define ODD8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i*)(p)), 16), 16))
#define EVEN8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(p)), 16))

/* R rows' sums (R x 16, 32 floats apart) over pairs p0..p1 of the half tile at wt, continued from `sums` past the
 * first chunk; prefetches n lines `stride` bytes apart from `ahead`, one an iteration */
#define HALF(R) \
static void half##R(const xtype* x, const uint16_t* wt, int p0, int p1, int I, float* sums, const char* ahead, \
                    int stride, int n) { \
    __m256 s[R][2]; \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) { \
        s[r][0] = p0 ? _mm256_loadu_ps(sums + 32 * r) : _mm256_setzero_ps(); \
        s[r][1] = p0 ? _mm256_loadu_ps(sums + 32 * r + 8) : _mm256_setzero_ps(); \
    } \
    const uint16_t* wp = wt + (size_t)p0 * 64; \
    for (int p = p0; p < p1; p++, wp += 64) { \
        if (p - p0 < n) \
            _mm_prefetch(ahead + (size_t)(p - p0) * stride, _MM_HINT_NTA); \
        __m256 w0 = EVEN8(wp), w1 = EVEN8(wp + 16); \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) { \
            __m256 xe = _mm256_broadcast_ss(x + (size_t)r * I + 2 * p); \
            s[r][0] = _mm256_fmadd_ps(xe, w0, s[r][0]); \
            s[r][1] = _mm256_fmadd_ps(xe, w1, s[r][1]); \
        } \
        w0 = ODD8(wp), w1 = ODD8(wp + 16); \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) { \
            __m256 xo = _mm256_broadcast_ss(x + (size_t)r * I + 2 * p + 1); \
            s[r][0] = _mm256_fmadd_ps(xo, w0, s[r][0]); \
            s[r][1] = _mm256_fmadd_ps(xo, w1, s[r][1]); \
        } \
    } \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) { \
        _mm256_storeu_ps(sums + 32 * r, s[r][0]); \
        _mm256_storeu_ps(sums + 32 * r + 8, s[r][1]); \
    } \
}
HALF(1) HALF(2) HALF(3) HALF(4) HALF(5) HALF(6)
const half_fn HALVES[HALF_ROWS + 1] = {0, half1, half2, half3, half4, half5, half6};

#define VALUES_AT_ONCE 128 /* keys whose values stay in L1 while each block of 4 rows weighs them */

/* the sums of each of 8 vectors, as one vector */
static inline __m256 sums8(const __m256* a) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* sums (+)= R rows of weights (`stride` apart) times values j0..j1 (each D), 16 columns at a time; R a constant
 * (1-4) where this is inlined, so that its sums stay in registers */
static inline __attribute__((always_inline)) void weigh_block(int R, const float* weights, int stride, float* sums,
                                                              const uint16_t* v, int j0, int j1, int D) {
    for (int d = 0; d < D; d += 16) {
        __m256 acc[4][2];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                acc[r][h] = j0 ? _mm256_loadu_ps(sums + (size_t)r * D + d + 8 * h) : _mm256_setzero_ps();
        for (int j = j0; j < j1; j++) {
            __m256 v0 = bf16x8_in(v + (size_t)j * D + d), v1 = bf16x8_in(v + (size_t)j * D + d + 8);
            for (int r = 0; r < R; r++) {
                __m256 w = _mm256_broadcast_ss(weights + (size_t)r * stride + j);
                acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(sums + (size_t)r * D + d + 8 * h, acc[r][h]);
    }
}

/* sums (n x D) = n rows of weights times the K values, in blocks of keys that stay in L1 while every 4 rows read them
 * (a pass over all keys per column block read each value from memory again) */
static void weigh_values(const float* weights, int stride, float* sums, int n, const uint16_t* v, int K, int D) {
    for (int j0 = 0; j0 < K; j0 += VALUES_AT_ONCE) {
        int j1 = j0 + VALUES_AT_ONCE < K ? j0 + VALUES_AT_ONCE : K;
        for (int r0 = 0; r0 < n; r0 += 4) {
            const float* w = weights + (size_t)r0 * stride;
            float* o = sums + (size_t)r0 * D;
            switch (n - r0 < 4 ? n - r0 : 4) {
            case 1: weigh_block(1, w, stride, o, v, j0, j1, D); break;
            case 2: weigh_block(2, w, stride, o, v, j0, j1, D); break;
            case 3: weigh_block(3, w, stride, o, v, j0, j1, D); break;
            default: weigh_block(4, w, stride, o, v, j0, j1, D);
            }
        }
    }
}

/* Attention of n <= ATT_ROWS query rows (`q_at[r]`) over keys and values k0..k1 of one head (k, v at key 0; each
 * row's mask `mask_at[r]` too), short of the division: each row's largest score most[r], its sum of e^(score - most)
 * total[r], and the values weighted by those e^ (n x D floats) in sums. AVX2 has no bf16 products: queries and each
 * block of 8 keys are widened to float32 once (the keys into `scratch`), each score a float32 dot product. `scratch`
 * holds SCRATCH(k1 - k0, D) floats. */
void attend_part(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n,
                 const uint16_t* k, const uint32_t* kt, const uint16_t* v, int k0, int k1, int D, float scale,
                 float* scratch, float* most, float* total, float* sums) {
    (void)kt;
    int K = k1 - k0, blocks = (K + 7) / 8, stride = 8 * blocks;
    float *scores = scratch, *qf = scores + (size_t)ATT_ROWS * stride, *kf = qf + (size_t)ATT_ROWS * D;
    for (int r = 0; r < n; r++)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(qf + (size_t)r * D + d, bf16x8_in(q_at[r] + d));
    __m256 scaled = _mm256_set1_ps(scale), lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int blk = 0; blk < blocks; blk++) {
        int live = K - 8 * blk < 8 ? K - 8 * blk : 8, at = k0 + 8 * blk;
        for (int j = 0; j < live; j++)
            for (int d = 0; d < D; d += 8)
                _mm256_storeu_ps(kf + (size_t)j * D + d, bf16x8_in(k + (size_t)(at + j) * D + d));
        if (live < 8)  /* a last block's missing keys are zeros: each row's 8 sums then stay in registers */
            memset(kf + (size_t)live * D, 0, sizeof(float) * (size_t)(8 - live) * D);
        __m256 dead = _mm256_cmp_ps(lanes, _mm256_set1_ps((float)live), _CMP_GE_OQ);
        for (int r = 0; r < n; r++) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qf + (size_t)r * D + d);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + (size_t)j * D + d), acc[j]);
            }
            __m256 s = _mm256_mul_ps(sums8(acc), scaled);
            if (mask_at[r] && live == 8) {
                s = _mm256_add_ps(s, mask_bf16 ? bf16x8_in((const uint16_t*)mask_at[r] + at)
                                               : _mm256_loadu_ps((const float*)mask_at[r] + at));
            } else if (mask_at[r]) {
                float m[8] = {0};
                for (int j = 0; j < live; j++)
                    m[j] = mask_bf16 ? bf16_to_float(((const uint16_t*)mask_at[r])[at + j])
                                     : ((const float*)mask_at[r])[at + j];
                s = _mm256_add_ps(s, _mm256_loadu_ps(m));
            }
            _mm256_storeu_ps(scores + (size_t)r * stride + 8 * blk, _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), dead));
        }
    }
    for (int r = 0; r < n; r++) {
        float* s = scores + (size_t)r * stride;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < stride; j += 8)
            top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
        float t[8], sum = 0.0f;
        _mm256_storeu_ps(t, top8);
        most[r] = t[0];
        for (int j = 1; j < 8; j++)
            most[r] = t[j] > most[r] ? t[j] : most[r];
        __m256 top = _mm256_set1_ps(most[r]), all = _mm256_setzero_ps();
        for (int j = 0; j < stride; j += 8) {
            __m256 x = _mm256_loadu_ps(s + j);
            __m256 e = _mm256_blendv_ps(exp_neg8(_mm256_sub_ps(x, top)), _mm256_setzero_ps(),
                                        _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
            _mm256_storeu_ps(s + j, bf16x8_widen(bf16x8(e)));  /* the weight rounded to bf16, as the AVX-512 build's */
            all = _mm256_add_ps(all, e);
        }
        _mm256_storeu_ps(t, all);
        for (int j = 0; j < 8; j++)
            sum += t[j];
        total[r] = sum;
    }
    weigh_values(scores, stride, sums, n, v + (size_t)k0 * D, K, D);
}
void lay_out_keys(const uint16_t* k, uint32_t* kt, int K, int D, int b0, int b1) {
    (void)k, (void)kt, (void)K, (void)D, (void)b0, (void)b1;
}

#define SCREEN_ROWS 6
#define SCREEN_CHUNK 32 /* input pairs (2 KB) of a tile that every pass over it reads while they stay in L1 */
#define SCREEN_AHEAD 8192 /* bytes the screen reads ahead (2-16 KB timed alike) */
/* as above by AVX2's vpmaddwd over pairs p0..p1, a 16-column half (h) of the tile a pass, continuing the sums at
 * sums[32 r + 16 h + j]; the first pass over a chunk reads the next one ahead */
static inline __attribute__((always_inline)) void screen_half(int R, const int16_t* xq, const int8_t* wt, int p0, int p1,
                                                              int I, int h, int ahead, int32_t* sums) {
    __m256i s[SCREEN_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 2; k++)
            s[r][k] = _mm256_loadu_si256((const __m256i*)(sums + 32 * r + 16 * h + 8 * k));
    const int8_t* wp = wt + (size_t)p0 * 64 + 32 * h;
    for (int p = p0; p < p1; p++, wp += 64) {
        if (ahead)
            _mm_prefetch((const char*)wp + SCREEN_AHEAD, _MM_HINT_NTA);
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wp));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16)));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xq + (size_t)r * I + 2 * p, 4);
            __m256i xb = _mm256_set1_epi32(pair);
            s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(xb, w0));
            s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(xb, w1));
        }
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 2; k++)
            _mm256_storeu_si256((__m256i*)(sums + 32 * r + 16 * h + 8 * k), s[r][k]);
}

static inline __attribute__((always_inline)) void screen_rows(int R, const int16_t* xq, const int8_t* wt, int p0,
                                                              int p1, int I, int h, int ahead, int32_t* sums) {
    switch (R) {
    case 1: screen_half(1, xq, wt, p0, p1, I, h, ahead, sums); break;
    case 2: screen_half(2, xq, wt, p0, p1, I, h, ahead, sums); break;
    case 3: screen_half(3, xq, wt, p0, p1, I, h, ahead, sums); break;
    case 4: screen_half(4, xq, wt, p0, p1, I, h, ahead, sums); break;
    case 5: screen_half(5, xq, wt, p0, p1, I, h, ahead, sums); break;
    default: screen_half(6, xq, wt, p0, p1, I, h, ahead, sums);
    }
}

/* one or two rows (R) by all 32 columns of the tile in one pass: their 8 sums fit the registers beside the weights */
static inline __attribute__((always_inline)) void screen_whole(int R, const int16_t* xq, const int8_t* wt, int pairs,
                                                               int I, int32_t* sums) {
    __m256i s[2][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++)
            s[r][k] = _mm256_setzero_si256();
    const int8_t* wp = wt;
    for (int p = 0; p < pairs; p++, wp += 64) {
        _mm_prefetch((const char*)wp + SCREEN_AHEAD, _MM_HINT_NTA);
        __m256i w[4];
        for (int k = 0; k < 4; k++)
            w[k] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16 * k)));
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, xq + (size_t)r * I + 2 * p, 4);
            __m256i xb = _mm256_set1_epi32(pair);
            for (int k = 0; k < 4; k++)
                s[r][k] = _mm256_add_epi32(s[r][k], _mm256_madd_epi16(xb, w[k]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++)
            _mm256_storeu_si256((__m256i*)(sums + 32 * r + 8 * k), s[r][k]);
}

/* sums (R x 32) of all R rows by tile wt: up to two rows in one pass over it; more a chunk of its pairs at a time,
 * read by a pass per half and block of rows while it stays in L1 (a pass per half over the whole tile read it from
 * memory twice; one row by halves ran slower than in one pass). */
void screen_tile(const int16_t* xq, const int8_t* wt, int pairs, int I, int R, int32_t* sums) {
    if (R <= 2) {
        if (R == 1)
            screen_whole(1, xq, wt, pairs, I, sums);
        else
            screen_whole(2, xq, wt, pairs, I, sums);
        return;
    }
    memset(sums, 0, sizeof(int32_t) * 32 * (size_t)R);
    for (int p0 = 0; p0 < pairs; p0 += SCREEN_CHUNK) {
        int p1 = p0 + SCREEN_CHUNK < pairs ? p0 + SCREEN_CHUNK : pairs;
        for (int h = 0; h < 2; h++)
            for (int r0 = 0; r0 < R; r0 += SCREEN_ROWS)
                screen_rows(R - r0 < SCREEN_ROWS ? R - r0 : SCREEN_ROWS, xq + (size_t)r0 * I, wt, p0, p1, I, h,
                            h == 0 && r0 == 0, sums + 32 * (size_t)r0);
    }
}

#endif
