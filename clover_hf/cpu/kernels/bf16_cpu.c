/* bf16 kernels for decoding on x86 CPUs, built by clover_hf/bf16_kernel.py: transformers' RMSNorm (alone, or with
 * the residual sum before it), rotary embedding and SwiGLU activation in one call each, the attention of a few query
 * tokens, a whole decoder layer of these in one call, a product by int8 weights, greedy acceptance's argmax (also
 * of an lm_head's logits without computing them all), the heads' softmax top-k and a static tree's draft by the heads
 * in one call,
 * and y = x @ w.T (+ bias) for a few rows of bf16 x, each weight byte read once for
 * a block of rows, sums in float32, for one of two instruction sets:
 *   AVX-512-BF16 (-mavx512bf16): vdpbf16ps multiplies pairs of bf16 inputs, fourteen rows a block;
 *   AVX2 with FMA (-mavx2 -mfma): weights widened to float32 in registers (a shift), x converted to float32
 *   once a call, four rows a block; more rows, up to six a pass over half a tile, a chunk of it at a time.
 *
 * The weight is laid out once in 32-column tiles, (O/32, I/2, 32, 2): tile t, input pair p, column c holds
 * w[32t + c, 2p : 2p + 2], so a tile streams through memory in order. O is a multiple of 32, I even.
 *
 * Weights are read ahead with prefetches: a forward streams every weight once. The AVX2 build reads 2 KB ahead
 * into L1 alone (non-temporal): read plainly, the weights would push out of the last-level cache what is read again
 * soon (the KV cache, the draft heads' weights, activations); on the AVX-512-bf16 EPYC (Zen 5), SmolLM2's bf16
 * decoding, alternating call by call, whole-tree steps took 13.7 against 15.5 ms, one-token steps 8.5 against 9.5,
 * with plain prefetches 2 KB ahead gaining a third of that. The AVX-512 build reads 8 KB ahead into L2 (more
 * misses in flight than L1 holds): on the AVX-512-bf16 EPYC of Zen 4, against the non-temporal 2 KB, verify forwards
 * took 9.41 against 9.66 ms at one token and 10.71 against 10.97 at 5-8 (alternating call by call), and Clover's
 * decoding ran 143.6 against 137.7 tokens/s, its one-token steps 98.6 against 97.8 (alternating prompt by prompt,
 * 30 MT-Bench prompts); not measured on Zen 5. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512BF16__)
#define READ_AHEAD(p) _mm_prefetch((const char*)(p) + 8192, _MM_HINT_T2)
#else
#define AHEAD 1024 /* weight elements (2 KB) a non-temporal prefetch reads ahead of the products */
#define READ_AHEAD(p) _mm_prefetch((const char*)(p) + 2 * AHEAD, _MM_HINT_NTA)
#endif

/* 8 float32s rounded to bf16 (to nearest even, NaN kept quiet), as torch rounds: both builds run AVX2 */
static __m128i bf16x8(__m256 f) {
    __m256i b = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 8 bf16 values (in a register, or read at p) widened to float32 */
static inline __m256 bf16x8_widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 bf16x8_in(const uint16_t* p) {
    return bf16x8_widen(_mm_loadu_si128((const __m128i*)p));
}

#if defined(__AVX512BF16__)

/* Rows a pass over a tile computes: 14 rows' 28 sums, 2 weight vectors and a broadcast pair take 31 of the 32
 * registers. Past a block, a tile is read again from L2 for the rest, compute that does not overlap the tile's
 * streaming from memory: SmolLM2's 120 decoder products of 12 / 16 / 24 rows took 7.6 / 9.2 / 12.9 against
 * 8.6 / 10.6 / 14.5 ms with blocks of 8 (AVX-512-bf16 EPYC, Zen 4), 1-8 rows alike. */
#define BLOCK 14
typedef uint16_t xtype; /* x as given */

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

/* 16 sums plus bias, rounded to bf16 (to nearest even, as torch rounds) */
static void store16(uint16_t* y, const float* sums, const float* bias) {
    __m512 s = _mm512_loadu_ps(sums);
    if (bias)
        s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(s));
}

#elif defined(__AVX2__) && defined(__FMA__)

#define BLOCK 4
typedef float xtype; /* x converted to float32 once a call */

/* the two float32 weights of each of 8 columns in one 256-bit load of (column, pair) bf16s */
#define WIDEN(v, even, odd) \
    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); \
    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));

/* R rows against one tile in one pass: each pair's 128 bytes (32 columns) read once, in order, into four 8-column
 * sums a row (a pass a 16-column half, as before, read every other line of the tile twice apart: on the AVX2-only
 * EPYC (Zen 3) the decoder's 210 products took 11.0 / 11.1 / 11.3 / 13.8 / 30.6 against 13.1 / 15.6 / 16.8 / 17.6
 * / 33.3 ms at 1 / 2 / 3 / 4 / 16 rows) */
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

/* More rows than a block are compute-bound: a pass over a 16-column half of a tile takes up to HALF_ROWS rows, whose
 * 12 sums fill the registers beside two weights and an x, and adds each pair's even inputs, then its odd ones (the
 * sums' order of the tiles above, so every row rounds alike whatever the row count). Each tile is read a chunk of
 * CHUNK pairs at a time, by every pass while the chunk is in L1; each pass prefetches its share of the next chunk. On
 * the AVX2-only EPYC (Zen 3) the decoder's 210 products took 8.9 / 12.4 / 14.2 / 32.3 / 85.8 against 9.9 / 12.8 /
 * 16.0 / 37.1 / 95.5 ms at 5 / 7 / 9 / 24 / 64 rows, and SmolLM2's lm_head 1.9 / 2.8 / 3.3 / 7.7 / 21.4 against
 * 2.2 / 2.9 / 3.7 / 9.3 / 23.8. */
#define HALF_ROWS 6
#define CHUNK 32 /* input pairs: 4 KB of a tile */

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
typedef void (*half_fn)(const xtype*, const uint16_t*, int, int, int, float*, const char*, int, int);
static const half_fn HALVES[HALF_ROWS + 1] = {0, half1, half2, half3, half4, half5, half6};

/* 16 sums plus bias, rounded to bf16 (to nearest even, NaN kept, as torch rounds) */
static void store16(uint16_t* y, const float* sums, const float* bias) {
    for (int i = 0; i < 16; i += 8) {
        __m256 s = _mm256_loadu_ps(sums + i);
        if (bias)
            s = _mm256_add_ps(s, _mm256_loadu_ps(bias + i));
        _mm_storeu_si128((__m128i*)(y + i), bf16x8(s));
    }
}

#else
#error "build with -mavx512bf16 (and -mavx512f -mavx512bw -mavx512vl), or with -mavx2 -mfma"
#endif

typedef void (*tile_fn)(const xtype*, const uint16_t*, int, int, float*);
#if BLOCK == 14
static const tile_fn TILES[BLOCK + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8, tile9, tile10,
                                         tile11, tile12, tile13, tile14};
#else
static const tile_fn TILES[BLOCK + 1] = {0, tile1, tile2, tile3, tile4};
#endif

static void store_rows(uint16_t* y, const float* sums, const float* bias, int n, int O, int o) {
    for (int r = 0; r < n; r++) {
        store16(y + (size_t)r * O + o, sums + 32 * r, bias ? bias + o : 0);
        store16(y + (size_t)r * O + o + 16, sums + 32 * r + 16, bias ? bias + o + 16 : 0);
    }
}

#if defined(HALF_ROWS)
/* tiles t0..t1 for R > BLOCK rows, as HALF describes; returns 1 where memory ran out */
static int half_tiles(const xtype* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
                      int t0, int t1) {
    float* sums = malloc(sizeof(float) * (size_t)R * 32);
    if (!sums)
        return 1;
    int pairs = I / 2, blocks = (R + HALF_ROWS - 1) / HALF_ROWS, passes = 2 * blocks;
    for (int t = t0; t < t1; t++) {
        const uint16_t* wt = wb + (size_t)t * pairs * 64;
        for (int p0 = 0; p0 < pairs; p0 += CHUNK) {
            int p1 = p0 + CHUNK < pairs ? p0 + CHUNK : pairs;
            const char* next = (const char*)(wt + (size_t)p1 * 64); /* the tiles lie one after another */
            for (int h = 0, j = 0; h < 2; h++)
                for (int b = 0, r0 = 0; b < blocks; b++, j++) {
                    int n = (R - r0) / (blocks - b);
                    HALVES[n](x + (size_t)r0 * I, wt + 32 * h, p0, p1, I, sums + 32 * r0 + 16 * h, next + 64 * j,
                              64 * passes, (2 * CHUNK - j + passes - 1) / passes);
                    r0 += n;
                }
        }
        store_rows(y, sums, bias, R, O, t * 32);
    }
    free(sums);
    return 0;
}
#endif

/* y's rows for tiles t0..t1; returns 1 where memory ran out */
static int tiles(const xtype* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
                 int t0, int t1) {
#if defined(HALF_ROWS)
    if (R > BLOCK)
        return half_tiles(x, wb, bias, y, R, I, O, t0, t1);
#endif
    float sums[BLOCK * 32];
    int pairs = I / 2;
    for (int t = t0; t < t1; t++) {
        const uint16_t* wt = wb + (size_t)t * pairs * 64;
        int o = t * 32;
        for (int r0 = 0; r0 < R; r0 += BLOCK) {
            int n = R - r0 < BLOCK ? R - r0 : BLOCK;
            TILES[n](x + (size_t)r0 * I, wt, pairs, I, sums);
            store_rows(y + (size_t)r0 * O, sums, bias, n, O, o);
        }
    }
    return 0;
}

/* the contiguous share of `blocks` this OpenMP thread computes (all of them outside a parallel region) */
static void thread_range(int blocks, int* b0, int* b1) {
    int n = omp_get_num_threads(), per = (blocks + n - 1) / n;
    *b0 = omp_get_thread_num() * per;
    *b1 = *b0 + per < blocks ? *b0 + per : blocks;
}

static float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 to bf16, to nearest even, NaN kept quiet: as torch converts */
static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* a * b + c and c - a * b, eight at a time: fused where the build has FMA (the AVX-512 one is built without) */
#if defined(__FMA__)
#define FMA8(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FNMA8(a, b, c) _mm256_fnmadd_ps(a, b, c)
#else
#define FMA8(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#define FNMA8(a, b, c) _mm256_sub_ps(c, _mm256_mul_ps(a, b))
#endif

/* e^x for x <= 0, float32, eight at a time, as the AVX-512 build's `exp_neg` (2^n put into the exponent's bits):
 * both builds run AVX2 */
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = FNMA8(n, _mm256_set1_ps(0.693145752f), x);
    r = FNMA8(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = FMA8(p, r, _mm256_set1_ps(1.0f / 120));
    p = FMA8(p, r, _mm256_set1_ps(1.0f / 24));
    p = FMA8(p, r, _mm256_set1_ps(1.0f / 6));
    p = FMA8(p, r, _mm256_set1_ps(0.5f));
    p = FMA8(p, r, _mm256_set1_ps(1.0f));
    p = FMA8(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* y = w * bf16(x * rsqrt(mean(x^2) + eps)) for each of R rows of D: transformers' Llama RMSNorm in bf16
 * (sums of squares in float32, sixteen partial sums, so in another order than torch's). */
static void norm_row(const uint16_t* xr, const uint16_t* w, uint16_t* yr, int D, float eps) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16)
        for (int j = 0; j < 16; j++) {
            float v = bf16_to_float(xr[i + j]);
            part[j] += v * v;
        }
    for (; i < D; i++) {
        float v = bf16_to_float(xr[i]);
        part[0] += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < 16; j++)
        sum += part[j];
    float scale = 1.0f / sqrtf(sum / (float)D + eps);
    for (i = 0; i < D; i++) {
        float normed = bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * scale));
        yr[i] = float_to_bf16(bf16_to_float(w[i]) * normed);
    }
}

void bf16_rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* y, int R, int D, float eps) {
    for (int r = 0; r < R; r++)
        norm_row(x + (size_t)r * D, w, y + (size_t)r * D, D, eps);
}

/* sum = bf16(a + b) (as torch adds bf16 tensors) and y = the RMSNorm of sum, as `bf16_rms_norm`: a decoder layer's
 * residual sum and the norm that follows it in one call */
void bf16_add_rms_norm(const uint16_t* a, const uint16_t* b, uint16_t* sum, const uint16_t* w, uint16_t* y, int R,
                       int D, float eps) {
    for (int r = 0; r < R; r++) {
        const uint16_t *ar = a + (size_t)r * D, *br = b + (size_t)r * D;
        uint16_t* sr = sum + (size_t)r * D;
        for (int i = 0; i < D; i++)
            sr[i] = float_to_bf16(bf16_to_float(ar[i]) + bf16_to_float(br[i]));
        norm_row(sr, w, y + (size_t)r * D, D, eps);
    }
}

/* x * cos + rotate_half(x) * sin of one head's D values, each product and the sum rounded to bf16 as torch's
 * bf16 operations round them: bitwise Llama's rotary embedding in bf16 */
static void rotate(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* y, int D) {
    int half = D / 2;
    for (int i = 0; i < D; i++) {
        float turned = i < half ? -bf16_to_float(x[i + half]) : bf16_to_float(x[i - half]);
        float a = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * bf16_to_float(c[i])));
        float b = bf16_to_float(float_to_bf16(turned * bf16_to_float(s[i])));
        y[i] = float_to_bf16(a + b);
    }
}

/* Clover's Attention Decoder's gate, out = h + v * cos(q, k) per head, for R rows of H heads of D values (each row
 * contiguous): cos as F.cosine_similarity takes it (each norm at least eps), in float32, rounded to bf16; then
 * v * cos and the sum rounded to bf16 each, as torch's bf16 operations round them. */
void bf16_cosine_gate(const uint16_t* h, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                      int R, int H, int D, float eps) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < H; j++) {
            size_t at = ((size_t)r * H + j) * D;
            float dot = 0.0f, qq = 0.0f, kk = 0.0f;
            for (int d = 0; d < D; d++) {
                float a = bf16_to_float(q[at + d]), b = bf16_to_float(k[at + d]);
                dot += a * b;
                qq += a * a;
                kk += b * b;
            }
            float nq = sqrtf(qq), nk = sqrtf(kk);
            float gate = bf16_to_float(float_to_bf16(dot / ((nq > eps ? nq : eps) * (nk > eps ? nk : eps))));
            for (int d = 0; d < D; d++) {
                float gated = bf16_to_float(float_to_bf16(bf16_to_float(v[at + d]) * gate));
                out[at + d] = float_to_bf16(bf16_to_float(h[at + d]) + gated);
            }
        }
}

/* A KV cache's compaction in one call: in each of `count` tensors (B, H, slots, slot_bytes / element), whose rows
 * and heads lie batch_bytes[t] and head_bytes[t] apart and whose slots follow one another, slot src[b * moved + i]
 * of row b moves to slot dst + i, i ascending (sources at or after their destinations, as kept tree nodes lie). */
void move_slots(uint8_t* const* bases, const long* batch_bytes, const long* head_bytes, int count, int B, int H,
                long slot_bytes, const int64_t* src, int moved, long dst) {
    for (int t = 0; t < count; t++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                uint8_t* head = bases[t] + b * batch_bytes[t] + h * head_bytes[t];
                for (int i = 0; i < moved; i++)
                    memmove(head + (dst + i) * slot_bytes, head + src[(size_t)b * moved + i] * slot_bytes,
                            (size_t)slot_bytes);
            }
}

/* The rotary embedding of queries (B, T, Hq, D) and keys (B, T, Hk, D), whose token rows are q_row and k_row
 * values apart (heads contiguous within a row), by cos and sin (B, T, D), into qo (B, Hq, T, D) and ko
 * (B, Hk, T, D). */
void bf16_rope(const uint16_t* q, long q_row, const uint16_t* k, long k_row, const uint16_t* cos,
               const uint16_t* sin, uint16_t* qo, uint16_t* ko, int B, int T, int Hq, int Hk, int D) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            const uint16_t *c = cos + bt * D, *s = sin + bt * D;
            for (int h = 0; h < Hq; h++)
                rotate(q + bt * q_row + (size_t)h * D, c, s, qo + (((size_t)b * Hq + h) * T + t) * D, D);
            for (int h = 0; h < Hk; h++)
                rotate(k + bt * k_row + (size_t)h * D, c, s, ko + (((size_t)b * Hk + h) * T + t) * D, D);
        }
}

static int rows_at_once(const uint16_t* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
                        int threads) {
    int blocks = O / 32;
#if defined(__AVX512BF16__)
    const xtype* xs = x;
#else
    float* xs = malloc(sizeof(float) * (size_t)R * I);
    if (!xs)
        return 1;
    for (size_t i = 0; i < (size_t)R * I; i++)
        xs[i] = bf16_to_float(x[i]);
#endif
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        int b0, b1;
        thread_range(blocks, &b0, &b1);
        if (b0 < b1 && tiles(xs, wb, bias, y, R, I, O, b0, b1)) {
            #pragma omp atomic write
            failed = 1;
        }
    }
#if !defined(__AVX512BF16__)
    free(xs);
#endif
    return failed;
}

/* y (R x O) = x (R x I) @ w (O x I)^T (+ bias, float32), bf16 in and out; wb: w tiled as above.
 * The tiles are shared among `threads` OpenMP threads (torch's own pool where the runtime is the same).
 * With AVX2, a prefill's rows go ROW_BLOCK at a time: every tile reads all the rows it is given, and a prefill's
 * (their float32 copy: 9 MB for 1,474 rows of 1,536) then streamed from memory for each; SmolLM2's 210 decoder
 * products of 1,474 rows took 2.0-2.2 against 2.4-3.2 s (AVX2-only EPYC). A multiple of the blocks of rows, so each
 * row's sums add alike. */
#define ROW_BLOCK 192
int bf16_rows(const uint16_t* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
              int threads) {
#if defined(__AVX512BF16__)
    return rows_at_once(x, wb, bias, y, R, I, O, threads);
#else
    int failed = 0;
    for (int r0 = 0; r0 < R && !failed; r0 += ROW_BLOCK)
        failed = rows_at_once(x + (size_t)r0 * I, wb, bias, y + (size_t)r0 * O, R - r0 < ROW_BLOCK ? R - r0 : ROW_BLOCK,
                              I, O, threads);
    return failed;
#endif
}

#if defined(__AVX512BF16__)
#define ATT_ROWS 8 /* query rows (of one key/value head) whose scores one pass computes */
/* uint32s of one head's keys as `attend_part` reads them, and floats of scratch a thread needs */
#define KEY_LAYOUT(K, D) ((size_t)(((K) + 15) / 16) * ((D) / 2) * 16)
#define PART_ALIGN 16 /* keys a part starts at a multiple of: its blocks of the keys' layout */
#define PARTIAL(D) ((size_t)ATT_ROWS * (2 + (D))) /* floats of a part's results: ATT_ROWS rows' most, total, sums */
#define SCRATCH(K, D) ((size_t)ATT_ROWS * 16 * (((K) + 15) / 16) + PARTIAL(D))

/* 16 bf16 values (those of `live`; the others zero) widened to float32 */
static inline __m512 bf16x16(const uint16_t* p, __mmask16 live) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

/* 16 float32s rounded to bf16 as `bf16x8` rounds them (to nearest even, NaN kept quiet) */
static inline __m256i round16(__m512 f) {
    __m512i b = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* e^x for x <= 0, float32: n = round(x log2 e), r = x - n ln 2, a degree-6 polynomial of r, times 2^n
 * (within 2 ulp; below -87, about 1e-38 in place of a smaller number or 0) */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

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
 * head's. Each block's 16 keys are read as they lie and transposed in registers, 16 pairs at a time: gathering each
 * pair's 16 values took 14 against 8 us a layer of 3 heads' 400 keys (AVX-512-bf16 EPYC, Zen 4). */
static void transpose_keys(const uint16_t* k, uint32_t* kt, int K, int D, int b0, int b1) {
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
 * them on the stack, a load and a store around each row's products; AVX-512-bf16 EPYC, Zen 4) */
static void attend_part(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n,
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

#define lay_out_keys transpose_keys

#else
#define ATT_ROWS 16 /* query rows (of one key/value head) one pass attends: a group's all, up to 16 */
#define VALUES_AT_ONCE 128 /* keys whose values stay in L1 while each block of 4 rows weighs them */
#define PARTIAL(D) ((size_t)ATT_ROWS * (2 + (D))) /* floats of a part's results: ATT_ROWS rows' most, total, sums */
#define SCRATCH(K, D) ((size_t)ATT_ROWS * 8 * (((K) + 7) / 8) + (size_t)(ATT_ROWS + 8) * (D) + PARTIAL(D))

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
static void attend_part(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n,
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

#define KEY_LAYOUT(K, D) ((size_t)0)  /* the keys are read as they lie */
static void lay_out_keys(const uint16_t* k, uint32_t* kt, int K, int D, int b0, int b1) {
    (void)k, (void)kt, (void)K, (void)D, (void)b0, (void)b1;
}

#endif

/* As `attend_part` over all K keys, each row's weighted values divided by its total into `o_at[r]` (bf16) */
static void attend_rows(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, uint16_t* const* o_at,
                        int n, const uint16_t* k, const uint32_t* kt, const uint16_t* v, int K, int D, float scale,
                        float* scratch) {
    float *most = scratch + SCRATCH(K, D) - PARTIAL(D), *total = most + ATT_ROWS, *sums = total + ATT_ROWS;
    attend_part(q_at, mask_at, mask_bf16, n, k, kt, v, 0, K, D, scale, scratch, most, total, sums);
    for (int r = 0; r < n; r++) {
        __m256 inv = _mm256_set1_ps(1.0f / total[r]);
        for (int d = 0; d < D; d += 8)
            _mm_storeu_si128((__m128i*)(o_at[r] + d), bf16x8(_mm256_mul_ps(_mm256_loadu_ps(sums + (size_t)r * D + d), inv)));
    }
}

#ifndef PART_ALIGN
#define PART_ALIGN 1
#endif
#define PART_KEYS 64 /* keys a part takes at least */

/* out (bf16) for n rows from their parts' results (each PARTIAL(D) floats, `parts` of them): each part's total and
 * sums scaled by e^(its most - the rows' most) and added, the sums divided by the total */
static void merge_parts(const float* partial, int parts, int n, int D, uint16_t* const* o_at) {
    for (int r = 0; r < n; r++) {
        float most = -INFINITY, total = 0.0f;
        for (int p = 0; p < parts; p++) {
            float m = partial[(size_t)p * PARTIAL(D) + r];
            most = m > most ? m : most;
        }
        float out[256] = {0};
        for (int p = 0; p < parts; p++) {
            const float* part = partial + (size_t)p * PARTIAL(D);
            float w = expf(part[r] - most);  /* 0 for a part whose keys are all masked (its total and sums are 0) */
            total += part[ATT_ROWS + r] * w;
            for (int d = 0; d < D; d++)
                out[d] += part[2 * ATT_ROWS + (size_t)r * D + d] * w;
        }
        for (int d = 0; d < D; d++)
            o_at[r][d] = float_to_bf16(out[d] / total);
    }
}

/* out (B, T, H, D) = softmax(scale * q k^T + mask) v for queries q (B, H, T, D) and keys and values k, v
 * (B, G, K, D), each key/value head serving H / G query heads; mask (B, 1, T, K) additive, float32 (mask_bf16 0)
 * or bf16 (1), or NULL (every key seen, or with `causal` query t the keys up to K - T + t). D a multiple of 16, at
 * most 256. A head's keys (values) are K rows of D values one after another; heads lie kv_head values apart and
 * batch rows kv_row apart (views of a larger cache). Causal rows read no key past the last their pass's rows see.
 * Returns 1 where memory ran out. */
int bf16_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, long kv_row, long kv_head,
                   const void* mask, int mask_bf16, int causal, uint32_t* layout, long layout_head, int32_t* laid,
                   uint16_t* out, int B, int H, int G, int T, int K, int D, float scale, int threads) {
    int group = H / G, rows = group * T;
    int chunks = (rows + ATT_ROWS - 1) / ATT_ROWS, parts = 1;
    /* a causal row's mask: the slice of K zeros then K -infinities that starts K - (keys it sees) in */
    float* seen = NULL;
    if (causal) {
        mask = NULL;
        mask_bf16 = 0;
        seen = malloc(sizeof(float) * 2 * (size_t)K);
        if (!seen)
            return 1;
        for (int j = 0; j < 2 * K; j++)
            seen[j] = j < K ? 0.0f : -INFINITY;
    }
    /* fewer heads' rows than twice the threads (one token's 3 key/value heads over 2 threads): their keys split */
    if (!causal && threads > 1 && B * G * chunks < 2 * threads) {
        parts = (2 * threads + B * G * chunks - 1) / (B * G * chunks);
        parts = parts > K / PART_KEYS ? K / PART_KEYS : parts;
        parts = parts < 1 ? 1 : parts;
    }
    int units = (K + PART_ALIGN - 1) / PART_ALIGN; /* a part's keys start at a multiple of PART_ALIGN */
    size_t per_head = KEY_LAYOUT(K, D);
    /* the keys laid out for the products: kept beside the cache (`layout`, `layout_head` words a head), where the keys
     * before *laid (and before this call's T new ones) are laid out already, or made here for this call */
    int kept = layout && per_head, first = 0;
    if (kept) {
        first = (*laid < K - T ? *laid : K - T) / 16;
        per_head = (size_t)layout_head;
    }
    uint32_t* kt = kept ? layout : per_head ? malloc(sizeof(uint32_t) * per_head * B * G) : NULL;
    float* partial = parts > 1 ? malloc(sizeof(float) * PARTIAL(D) * B * G * chunks * parts) : NULL;
    if ((per_head && !kt) || (parts > 1 && !partial)) {
        if (!kept)
            free(kt);
        free(partial);
        free(seen);
        return 1;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        if (per_head) { /* each head's blocks of keys in `split` shares: a share of 3 heads each on 2 threads */
            int blocks = (K + 15) / 16 - first, split = B * G >= 2 * threads ? 1 : (2 * threads + B * G - 1) / (B * G);
            #pragma omp for schedule(static)
            for (int item = 0; item < B * G * split; item++) {
                int bg = item / split, share = item % split;
                lay_out_keys(k + (size_t)(bg / G) * kv_row + (size_t)(bg % G) * kv_head, kt + (size_t)bg * per_head, K, D,
                             first + (int)((long)blocks * share / split), first + (int)((long)blocks * (share + 1) / split));
            }
        }
        float* scores = malloc(sizeof(float) * SCRATCH(PART_ALIGN * ((units + parts - 1) / parts), D));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic)
        for (int item = 0; item < B * G * chunks * parts; item++) {
            if (!scores)
                continue;
            int chunk = item / parts, bg = chunk / chunks, r0 = (chunk % chunks) * ATT_ROWS, b = bg / G, g = bg % G;
            int n = rows - r0 < ATT_ROWS ? rows - r0 : ATT_ROWS;
            const uint16_t* q_at[ATT_ROWS];
            const void* mask_at[ATT_ROWS];
            uint16_t* o_at[ATT_ROWS];
            int seen_most = 0;  /* with `causal`: the most keys a row here sees */
            for (int i = 0; i < n; i++) {
                int h = g * group + (r0 + i) / T, t = (r0 + i) % T;
                q_at[i] = q + (((size_t)b * H + h) * T + t) * D;
                size_t m = ((size_t)b * T + t) * K;
                mask_at[i] = !mask ? 0 : mask_bf16 ? (const void*)((const uint16_t*)mask + m) : (const void*)((const float*)mask + m);
                if (causal) {
                    int keys_seen = K - T + t + 1;
                    mask_at[i] = seen + (K - keys_seen);
                    seen_most = keys_seen > seen_most ? keys_seen : seen_most;
                }
                o_at[i] = out + (((size_t)b * T + t) * H + h) * D;
            }
            const uint16_t *keys = k + (size_t)b * kv_row + (size_t)g * kv_head, *values = v + (size_t)b * kv_row + (size_t)g * kv_head;
            if (parts == 1) {
                attend_rows(q_at, mask_at, mask_bf16, o_at, n, keys, kt ? kt + (size_t)bg * per_head : NULL, values,
                            causal ? seen_most : K, D, scale, scores);
                continue;
            }
            float* results = partial + (size_t)item * PARTIAL(D);
            int part = item % parts, k0 = PART_ALIGN * (int)((long)units * part / parts);
            int k1 = PART_ALIGN * (int)((long)units * (part + 1) / parts);
            attend_part(q_at, mask_at, mask_bf16, n, keys, kt ? kt + (size_t)bg * per_head : NULL, values, k0,
                        k1 < K ? k1 : K, D, scale, scores, results, results + ATT_ROWS, results + 2 * ATT_ROWS);
        }
        if (parts > 1 && !failed) {
            #pragma omp for schedule(static)
            for (int chunk = 0; chunk < B * G * chunks; chunk++) {
                int bg = chunk / chunks, r0 = (chunk % chunks) * ATT_ROWS, b = bg / G, g = bg % G;
                int n = rows - r0 < ATT_ROWS ? rows - r0 : ATT_ROWS;
                uint16_t* o_at[ATT_ROWS];
                for (int i = 0; i < n; i++) {
                    int h = g * group + (r0 + i) / T, t = (r0 + i) % T;
                    o_at[i] = out + (((size_t)b * T + t) * H + h) * D;
                }
                merge_parts(partial + (size_t)chunk * parts * PARTIAL(D), parts, n, D, o_at);
            }
        }
        free(scores);
    }
    if (kept && !failed)
        *laid = K - T;  /* the T new keys' slots may be compacted next: laid out again by the next call */
    if (!kept)
        free(kt);
    free(partial);
    free(seen);
    return failed;
}

/* uint32s of one key/value head's keys laid out for `bf16_attention` over K slots of D values (0: the build reads the
 * keys as they lie) */
long bf16_key_layout(int K, int D) {
    (void)K, (void)D;
    return (long)KEY_LAYOUT(K, D);
}

/* y = x @ w.T (+ bias) by int8 weights, for drafting (`i8_rows`, defined with the screen below) */
int i8_rows(const uint16_t* x, const int8_t* wq, const float* w_scales, const float* bias, uint16_t* y, int R, int I,
            int O, int threads);

/* the first index of the largest of n float32s, a NaN counting as the largest (its first one): as torch's argmax.
 * Two passes, the second over what the first left in cache: torch's took 52 us a row of 49152 logits on the
 * AVX2-only EPYC, one value at a time. */
static int64_t argmax_row(const float* x, int n) {
    int n8 = n & ~31;
    __m256 top[4], nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++)
        top[j] = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n8; i += 32)
        for (int j = 0; j < 4; j++) {
            __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top[j] = _mm256_max_ps(top[j], v);
        }
    float most[8], m = -INFINITY;
    _mm256_storeu_ps(most, _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3])));
    for (int j = 0; j < 8; j++)
        m = most[j] > m ? most[j] : m;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int i = n8; i < n; i++) {
        any_nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (any_nan) {
        for (int i = 0; i < n; i++)
            if (x[i] != x[i])
                return i;
    }
    __m256 want = _mm256_set1_ps(m);
    for (int i = 0; i < n8; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
        if (hit)
            return i + __builtin_ctz(hit);
    }
    for (int i = n8; i < n; i++)
        if (x[i] == m)
            return i;
    return 0; /* every value -inf: the first, as torch */
}

/* out[r] = argmax of row r of R rows of n float32s, rows `stride` floats apart */
void argmax_rows(const float* x, long stride, int R, int n, int64_t* out, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && R > 1)
    for (int r = 0; r < R; r++)
        out[r] = argmax_row(x + (size_t)r * stride, n);
}

#define TOP_MOST 64 /* the most a row ranks (bf16_kernel.TOP_MOST) */

/* For each of R rows of n bf16 logits: its k (<= n, <= TOP_MOST) largest, largest first (of equal ones, the first), as indices
 * and softmax probabilities exp(x - max) / sum(exp(x - max)) in float32 (sums in another order than torch's). What
 * the heads draft at each level, in one call: torch's conversion, softmax and topk took ~85 us a level over 8192
 * logits (AVX2-only EPYC). NaN logits are not ranked. */
void top_probs(const uint16_t* x, int R, int n, int k, int64_t* idx, float* probs, int threads) {
    #pragma omp parallel for num_threads(threads) if (threads > 1 && R > 1)
    for (int r = 0; r < R; r++) {
        const uint16_t* xr = x + (size_t)r * n;
        float best[TOP_MOST] = {0};
        int64_t* at = idx + (size_t)r * k;
        int count = 0;
        for (int i = 0; i < n; i++) {
            if (count == k && (i & 7) == 0) { /* whole blocks of 8 with none above the k-th largest, skipped */
                __m256 floor = _mm256_set1_ps(best[k - 1]);
                while (i + 8 <= n && !_mm256_movemask_ps(_mm256_cmp_ps(bf16x8_in(xr + i), floor, _CMP_GT_OQ)))
                    i += 8;
                if (i >= n)
                    break;
            }
            float v = bf16_to_float(xr[i]);
            if (count == k && !(v > best[k - 1]))
                continue;
            if (v != v)
                v = -INFINITY; /* among the first k, ranked last; after them, never taken */
            int j = count < k ? count++ : k - 1;
            for (; j > 0 && v > best[j - 1]; j--) {
                best[j] = best[j - 1];
                at[j] = at[j - 1];
            }
            best[j] = v;
            at[j] = i;
        }
        float top = best[0];
        __m256 most = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = bf16x8_in(xr + i);
            __m256 e = exp_neg8(_mm256_sub_ps(v, most));
            sum = _mm256_add_ps(sum, _mm256_andnot_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), e));
        }
        float part[8], total = 0.0f;
        _mm256_storeu_ps(part, sum);
        for (int j = 0; j < 8; j++)
            total += part[j];
        for (; i < n; i++) {
            float v = bf16_to_float(xr[i]);
            if (v == v)
                total += expf(v - top);
        }
        for (int j = 0; j < k; j++)
            probs[(size_t)r * k + j] = expf(best[j] - top) / total;
    }
}

/* the heap h of k floats, smallest first, after its root was replaced */
static void sift_down(float* h, int k, int i) {
    float v = h[i];
    for (int c = 2 * i + 1; c < k; i = c, c = 2 * i + 1) {
        if (c + 1 < k && h[c + 1] < h[c])
            c++;
        if (!(h[c] < v))
            break;
        h[i] = h[c];
    }
    h[i] = v;
}

/* the k-th largest of n float32s (1 <= k <= n), counting equal values apart as torch.topk ranks them, into *kth;
 * returns 1 (nothing written) where one is a NaN or memory ran out. A heap of the k largest so far, which blocks
 * of 8 with none above its smallest skip. */
static int kth_largest(const float* x, int n, int k, float* kth) {
    float* h = malloc(sizeof(float) * (size_t)k);
    if (!h)
        return 1;
    int i = 0, failed = 0;
    for (; i < k; i++) {
        if (x[i] != x[i])
            failed = 1;
        h[i] = x[i];
    }
    for (int j = k / 2 - 1; j >= 0; j--)
        sift_down(h, k, j);
    for (; i < n && !failed; i++) {
        if ((i & 7) == 0) {
            __m256 floor = _mm256_set1_ps(h[0]);
            for (; i + 8 <= n; i += 8) {
                __m256 v = _mm256_loadu_ps(x + i);
                if (_mm256_movemask_ps(_mm256_cmp_ps(v, floor, _CMP_NLE_UQ)))
                    break; /* a value above the floor, or a NaN: one at a time */
            }
            if (i >= n)
                break;
        }
        if (x[i] != x[i])
            failed = 1;
        else if (x[i] > h[0]) {
            h[0] = x[i];
            sift_down(h, k, 0);
        }
    }
    if (!failed)
        *kth = h[0];
    free(h);
    return failed;
}

/* A top-k warper's cut of R rows of n float32 scores (rows `stride` floats apart; 1 <= k <= n), as transformers'
 * TopKLogitsWarper makes it (a score below its row's k-th largest is removed): each row's k-th largest into kth, and
 * into cols, ascending, every column that some row keeps or that `marked` names (m columns in [0, n), repeats
 * allowed). Returns how many columns, or -1 (cols unwritten) where a score is a NaN, a marked column is out of
 * range or memory ran out. On the
 * AVX2-only EPYC, torch's topk alone took 148 us a row of 49152 scores. */
long top_k_columns(const float* x, long stride, int R, int n, int k, const int64_t* marked, int m, float* kth,
                   int64_t* cols, int threads) {
    int failed = 0;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && R > 1) reduction(|: failed)
    for (int r = 0; r < R; r++)
        failed |= kth_largest(x + (size_t)r * stride, n, k, kth + r);
    uint8_t* kept = failed ? NULL : calloc((size_t)n, 1);
    if (!kept)
        return -1;
    for (int r = 0; r < R; r++) {
        const float* xr = x + (size_t)r * stride;
        __m256 floor = _mm256_set1_ps(kth[r]);
        int i = 0;
        for (; i + 8 <= n; i += 8)
            for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xr + i), floor, _CMP_GE_OQ)); bits;
                 bits &= bits - 1)
                kept[i + __builtin_ctz(bits)] = 1;
        for (; i < n; i++)
            kept[i] |= xr[i] >= kth[r];
    }
    for (int j = 0; j < m; j++) {
        if (marked[j] < 0 || marked[j] >= n) {
            free(kept);
            return -1;
        }
        kept[marked[j]] = 1;
    }
    long count = 0;
    int i = 0;
    for (; i + 32 <= n; i += 32) /* most blocks of 32 keep nothing */
        for (unsigned bits = (unsigned)_mm256_movemask_epi8(_mm256_cmpgt_epi8(
                 _mm256_loadu_si256((const __m256i*)(kept + i)), _mm256_setzero_si256())); bits; bits &= bits - 1)
            cols[count++] = i + __builtin_ctz(bits);
    for (; i < n; i++)
        if (kept[i])
            cols[count++] = i;
    free(kept);
    return count;
}

/* silu(x) = x / (1 + e^-x) in float32, rounded to bf16 as torch's bf16 silu rounds it (e^-x by the C library's expf:
 * a last bit may differ from torch's) */
static float silu_rounded(float x) {
    return bf16_to_float(float_to_bf16(x / (1.0f + expf(-x))));
}

/* out = bf16(bf16(silu(g)) * u) over R rows of n bf16 values, rows of g, u and out `g_row`, `u_row` and n apart:
 * a SwiGLU MLP's act_fn(gate) * up as torch computes it in bf16 (silu x / (1 + e^-x) in float32, rounded, then the
 * product rounded), but for e^-x, within 2 ulp of torch's: in one call, where torch's two ops and the gate's
 * and up's split from their stacked product took ~30 us in a decoder layer (AVX2-only EPYC). */
static void silu_mul_rows(const uint16_t* g, long g_row, const uint16_t* u, long u_row, uint16_t* out, int n, int r0,
                          int r1) {
    for (int r = r0; r < r1; r++) {
        const uint16_t *gr = g + (size_t)r * g_row, *ur = u + (size_t)r * u_row;
        uint16_t* o = out + (size_t)r * n;
        int i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= n; i += 16) { /* as the 8 below, 16 at a time: 0.6 against 1.3 us a row of 1,536 (Zen 4) */
            __m512 x = bf16x16(gr + i, (__mmask16)0xFFFF);
            __m512 minus = _mm512_sub_ps(_mm512_setzero_ps(), x);
            if (_mm512_cmp_ps_mask(minus, _mm512_set1_ps(87.0f), _CMP_NLE_UQ))
                break;
            __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_neg(minus)));
            s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round16(s)), 16));
            _mm256_storeu_si256((__m256i*)(o + i), round16(_mm512_mul_ps(s, bf16x16(ur + i, (__mmask16)0xFFFF))));
        }
#endif
        for (; i + 8 <= n; i += 8) {
            __m256 x = bf16x8_in(gr + i);
            __m256 minus = _mm256_sub_ps(_mm256_setzero_ps(), x);
            if (_mm256_movemask_ps(_mm256_cmp_ps(minus, _mm256_set1_ps(87.0f), _CMP_NLE_UQ)))
                break; /* e^-x near or past float32's range (or a NaN): these and the rest one at a time */
            __m256 y = bf16x8_in(ur + i);
            __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_neg8(minus)));
            s = bf16x8_widen(bf16x8(s));
            _mm_storeu_si128((__m128i*)(o + i), bf16x8(_mm256_mul_ps(s, y)));
        }
        for (; i < n; i++) {
            float x = bf16_to_float(gr[i]);
            o[i] = float_to_bf16(silu_rounded(x) * bf16_to_float(ur[i]));
        }
    }
}

void bf16_silu_mul(const uint16_t* g, long g_row, const uint16_t* u, long u_row, uint16_t* out, int R, int n) {
    silu_mul_rows(g, g_row, u, u_row, out, n, 0, R);
}

/* Llama-pattern decoder layers (RMSNorm, attention over a KV cache, residual; RMSNorm, SwiGLU MLP, residual) for B
 * rows of T tokens, one after another in one call of the functions above, as the lean decoder layer calls them one
 * by one: in situ each of the ~20 torch ops and calls around them took several times its warm time. A layer's
 * weights as the products take them (the q/k/v and gate/up weights stacked, each tiled); biases float32 or NULL. */
struct layer_args {
    const uint16_t *norm_in, *qkv, *o, *gate_up, *down, *norm_post;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    int D, Hq, Hk, hd, F; /* hidden size, query heads, key/value heads, head size, MLP width */
    float eps, scale;
    int threads;
    /* its cache's stores (B, Hk, slots, hd), batch rows and heads kv_row and kv_head values apart, holding the step's
     * `length` slots: its T new keys and values are written after them */
    uint16_t *keys, *values;
    long kv_row, kv_head;
    /* the keys laid out for attention beside the stores (`layout_head` uint32s a head) and how many slots of them are
     * laid out (`bf16_attention`), or NULL */
    uint32_t* layout;
    long layout_head;
    int32_t* laid;
};

/* what the step's layers share: x and out (B, T, D); cos, sin (B, T, hd); mask (B, 1, T, length + T) additive,
 * float32 (mask_bf16 0) or bf16 (1), or NULL where each token sees every key, or with `causal` the keys up to its own */
struct step_args {
    const uint16_t *x, *cos, *sin;
    uint16_t* out;
    int length;
    const void* mask;
    int mask_bf16, B, T, causal;
};

/* rows from which a decoder layer's silu runs on all its threads, a share of the rows each: at a verify forward's
 * 8-11 rows SmolLM2's took 7.3 against 10.5 us a layer on two threads (in situ, AVX-512-bf16 EPYC, Zen 4); its
 * norms, rotary embedding and residual sum ran slower so (the fork and the rows' moves between cores cost more) */
#define SILU_APART 2

static int decoder_layer(const struct layer_args* a, const struct step_args* st, const uint16_t* x, uint16_t* out) {
    int R = st->B * st->T, D = a->D, hd = a->hd, q_out = a->Hq * hd, qkv_out = (a->Hq + 2 * a->Hk) * hd;
    size_t rows = (size_t)R;
    uint16_t* scratch = malloc(sizeof(uint16_t) * rows * (4 * (size_t)D + qkv_out + 2 * (size_t)q_out
                                                          + (size_t)a->Hk * hd + 3 * (size_t)a->F));
    if (!scratch)
        return 1;
    uint16_t *h = scratch, *qkv = h + rows * D, *q = qkv + rows * qkv_out, *k = q + rows * q_out;
    uint16_t *att = k + rows * a->Hk * hd, *summed = att + rows * q_out, *mixed_in = summed + rows * D;
    uint16_t *gate_up = mixed_in + rows * D, *mixed = gate_up + rows * 2 * a->F, *mlp = mixed + rows * a->F;
    int failed = 0;
    bf16_rms_norm(x, a->norm_in, h, R, D, a->eps);
    failed |= bf16_rows(h, a->qkv, a->qkv_bias, qkv, R, D, qkv_out, a->threads);
    bf16_rope(qkv, qkv_out, qkv + q_out, qkv_out, st->cos, st->sin, q, k, st->B, st->T, a->Hq, a->Hk, hd);
    for (int b = 0; b < st->B; b++)
        for (int g = 0; g < a->Hk; g++)
            for (int t = 0; t < st->T; t++) {
                size_t slot = (size_t)b * a->kv_row + (size_t)g * a->kv_head + (size_t)(st->length + t) * hd;
                memcpy(a->keys + slot, k + (((size_t)b * a->Hk + g) * st->T + t) * hd, sizeof(uint16_t) * hd);
                memcpy(a->values + slot, qkv + ((size_t)b * st->T + t) * qkv_out + q_out + (size_t)(a->Hk + g) * hd,
                       sizeof(uint16_t) * hd);
            }
    failed |= bf16_attention(q, a->keys, a->values, a->kv_row, a->kv_head, st->mask, st->mask_bf16, st->causal, a->layout,
                             a->layout_head, a->laid, att, st->B, a->Hq, a->Hk, st->T, st->length + st->T, hd, a->scale,
                             a->threads);
    failed |= bf16_rows(att, a->o, a->o_bias, h, R, q_out, D, a->threads);
    bf16_add_rms_norm(x, h, summed, a->norm_post, mixed_in, R, D, a->eps);
    failed |= bf16_rows(mixed_in, a->gate_up, a->gate_up_bias, gate_up, R, D, 2 * a->F, a->threads);
    if (a->threads > 1 && R >= SILU_APART) {
        #pragma omp parallel num_threads(a->threads)
        {
            int r0, r1;
            thread_range(R, &r0, &r1);
            silu_mul_rows(gate_up, 2 * a->F, gate_up + a->F, 2 * a->F, mixed, a->F, r0, r1);
        }
    } else {
        silu_mul_rows(gate_up, 2 * a->F, gate_up + a->F, 2 * a->F, mixed, a->F, 0, R);
    }
    failed |= bf16_rows(mixed, a->down, a->down_bias, mlp, R, a->F, D, a->threads);
    for (size_t i = 0; i < rows * D; i++)
        out[i] = float_to_bf16(bf16_to_float(summed[i]) + bf16_to_float(mlp[i]));
    free(scratch);
    return failed != 0;
}

/* The n layers, each the next one's input, from st->x to st->out (all of one hidden size). Returns 1 where memory ran
 * out (then the keys and values past `length` may be written). */
int bf16_layers(const struct layer_args* const* layers, int n, const struct step_args* st) {
    size_t size = (size_t)st->B * st->T * layers[0]->D;
    uint16_t* between = n > 1 ? malloc(sizeof(uint16_t) * size * 2) : NULL;
    if (n > 1 && !between)
        return 1;
    int failed = 0;
    for (int i = 0; i < n && !failed; i++)
        failed = decoder_layer(layers[i], st, i == 0 ? st->x : between + size * ((i - 1) % 2),
                               i == n - 1 ? st->out : between + size * (i % 2));
    free(between);
    return failed;
}

/* Clover's output head, out = norm(s + silu(fc([s; e]) + bias)), for R rows of D (s, e, out contiguous rows; fc tiled,
 * 2D inputs): each step rounded to bf16 as torch's bf16 ops round them (silu as `silu_rounded`). Returns 1 where memory
 * ran out. */
int bf16_output_head(const uint16_t* s, const uint16_t* e, const uint16_t* fc, const float* bias, const uint16_t* w,
                     float eps, uint16_t* out, int R, int D, int threads) {
    uint16_t* scratch = malloc(sizeof(uint16_t) * (size_t)R * 4 * D);
    if (!scratch)
        return 1;
    uint16_t *both = scratch, *y = both + (size_t)R * 2 * D, *sum = y + (size_t)R * D;
    for (int r = 0; r < R; r++) {
        memcpy(both + (size_t)r * 2 * D, s + (size_t)r * D, sizeof(uint16_t) * D);
        memcpy(both + (size_t)r * 2 * D + D, e + (size_t)r * D, sizeof(uint16_t) * D);
    }
    int failed = bf16_rows(both, fc, bias, y, R, 2 * D, D, threads);
    for (size_t i = 0; i < (size_t)R * D; i++)
        sum[i] = float_to_bf16(bf16_to_float(s[i]) + silu_rounded(bf16_to_float(y[i])));
    for (int r = 0; r < R; r++)
        norm_row(sum + (size_t)r * D, w, out + (size_t)r * D, D, eps);
    free(scratch);
    return failed;
}

/* Clover's Attention Decoder, out = h + v(e) * cos(q(norm(h)), k(e)) per head (`bf16_cosine_gate`), for R rows of D:
 * the norm, three products (tiled; biases float32 or NULL) and the gate in one call. Returns 1 where memory ran out. */
int bf16_attention_decoder(const uint16_t* h, const uint16_t* e, const uint16_t* w, float eps, const uint16_t* q_w,
                           const float* q_b, const uint16_t* k_w, const float* k_b, const uint16_t* v_w,
                           const float* v_b, uint16_t* out, int R, int D, int heads, int threads) {
    uint16_t* scratch = malloc(sizeof(uint16_t) * (size_t)R * 4 * D);
    if (!scratch)
        return 1;
    uint16_t *normed = scratch, *q = normed + (size_t)R * D, *k = q + (size_t)R * D, *v = k + (size_t)R * D;
    bf16_rms_norm(h, w, normed, R, D, eps);
    int failed = bf16_rows(normed, q_w, q_b, q, R, D, D, threads);
    failed |= bf16_rows(e, k_w, k_b, k, R, D, D, threads);
    failed |= bf16_rows(e, v_w, v_b, v, R, D, D, threads);
    bf16_cosine_gate(h, q, k, v, out, R, heads, D / heads, 1e-8f);
    free(scratch);
    return failed != 0;
}

/* What Clover's features for drafting take besides the Augmenting Block's layers: the input Attention Decoder's
 * norm and q/k/v (tiled; biases float32 or NULL) and the Augmenting Block's final norm. */
struct feature_args {
    int D, heads, threads;
    const uint16_t* in_norm;
    float in_eps;
    const uint16_t *q, *k, *v;
    const float *q_bias, *k_bias, *v_bias;
    const uint16_t* out_norm;
    float out_eps;
};

/* The feature the heads draft from, as heads.CloverHeads.features computes it for drafting, in one call: the input
 * Attention Decoder over T new positions (the base's hidden states h and the embeddings e of the tokens after them),
 * the Augmenting Block's n layers over them (each position sees the `length` cached and the new ones up to itself:
 * causal attention; their keys and values written after those cached) and the final norm,
 * of the last position only, into `feature` (D); the rotary embedding's cos and sin at the positions (T) are rows of
 * tables of `table_rows` positions (hd each). The same kernels in the same order, so the same feature, without the
 * torch ops and calls around them (see bf16_kernel.Features). Returns 2 (nothing done) where a
 * position is not in the tables, 1 where memory ran out (then the keys and values past `length` may be written). */
int bf16_features(const struct feature_args* a, const struct layer_args* const* layers, int n, const uint16_t* h,
                  const uint16_t* e, int T, const int64_t* positions, const uint16_t* cos_table,
                  const uint16_t* sin_table, long table_rows, int length, uint16_t* feature) {
    int D = a->D, hd = layers[0]->hd;
    for (int t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= table_rows)
            return 2;
    uint16_t* x = malloc(sizeof(uint16_t) * ((size_t)2 * T * D + (size_t)2 * T * hd));
    if (!x)
        return 1;
    uint16_t *out = x + (size_t)T * D, *cos = out + (size_t)T * D, *sin = cos + (size_t)T * hd;
    for (int t = 0; t < T; t++) {
        memcpy(cos + (size_t)t * hd, cos_table + (size_t)positions[t] * hd, sizeof(uint16_t) * hd);
        memcpy(sin + (size_t)t * hd, sin_table + (size_t)positions[t] * hd, sizeof(uint16_t) * hd);
    }
    int failed = bf16_attention_decoder(h, e, a->in_norm, a->in_eps, a->q, a->q_bias, a->k, a->k_bias, a->v, a->v_bias,
                                        x, T, D, a->heads, a->threads);
    if (!failed) {
        struct step_args st = {x, cos, sin, out, length, NULL, 0, 1, T, T > 1};
        failed = bf16_layers(layers, n, &st);
    }
    if (!failed)
        norm_row(out + (size_t)(T - 1) * D, a->out_norm, feature, D, a->out_eps);
    free(x);
    return failed != 0;
}

/* One depth of a static draft tree (tree.TreeLevel) with the weights its row count multiplies by: the regressive
 * Attention Decoder's q/k/v (tiled; biases float32 or NULL; unused at the first level) and the depth's output head. */
struct draft_level {
    int k, expanded, children, next; /* top-k a row ranks, rows drafted, nodes kept, nodes the next level expands */
    const int64_t *parent_of_expanded, *child_parent, *child_rank, *next_expanded;
    const uint16_t *q, *k_w, *v;
    const float *q_bias, *k_bias, *v_bias;
    const uint16_t *fc, *head_norm;
    const float* fc_bias;
    float head_eps;
};

/* what every level shares: sizes, the regressive Attention Decoder's norm, the int8 draft rows of the lm_head (see
 * i8_rows), which token each draft row stands for (NULL: its own index) and the table that embeds tokens */
struct draft_args {
    int D, heads, rows, threads;
    const uint16_t* reg_norm;
    float reg_eps;
    const int8_t* lm_w;
    const float *lm_scales, *lm_bias;
    const int64_t* token_ids;
    const uint16_t* embedding;
};

/* The heads' draft of a static tree, as heads.CloverHeads.draft runs it level by level, in one call: at each level
 * the states of the rows it expands (through the regressive Attention Decoder after the first), the level's output
 * head, the lm_head's int8 draft rows and their top-k probabilities, the kept children's tokens and the embeddings
 * of those the next level expands. The same kernels in the same order, so the same tokens and probabilities; in
 * situ the ~10 torch ops and calls around them took ~0.3 ms a level (AVX2-only EPYC). `tokens` and `probs` take the
 * children of every level, level after level. Returns 1 where memory ran out. */
int bf16_draft_levels(const struct draft_args* a, const struct draft_level* levels, int n, const uint16_t* feature,
                      int64_t root, int64_t* tokens, float* probs) {
    int D = a->D, most = 1, k_most = 1;
    for (int d = 0; d < n; d++) {
        most = levels[d].expanded > most ? levels[d].expanded : most;
        k_most = levels[d].k > k_most ? levels[d].k : k_most;
    }
    size_t row_block = (size_t)most * D;
    uint16_t* scratch = malloc(sizeof(uint16_t) * (4 * row_block + (size_t)most * a->rows));
    int64_t* top = malloc(sizeof(int64_t) * (size_t)most * k_most);
    float* top_p = malloc(sizeof(float) * (size_t)most * k_most);
    if (!scratch || !top || !top_p) {
        free(scratch), free(top), free(top_p);
        return 1;
    }
    uint16_t *states = scratch, *gathered = states + row_block, *e = gathered + row_block, *out = e + row_block;
    uint16_t* logits = out + row_block;
    memcpy(states, feature, sizeof(uint16_t) * D);
    memcpy(e, a->embedding + (size_t)root * D, sizeof(uint16_t) * D);
    int failed = 0, at = 0;
    for (int d = 0; d < n && !failed; d++) {
        const struct draft_level* L = &levels[d];
        int R = L->expanded;
        if (d > 0) {
            for (int r = 0; r < R; r++)
                memcpy(gathered + (size_t)r * D, states + (size_t)L->parent_of_expanded[r] * D, sizeof(uint16_t) * D);
            failed |= bf16_attention_decoder(gathered, e, a->reg_norm, a->reg_eps, L->q, L->q_bias, L->k_w, L->k_bias,
                                             L->v, L->v_bias, states, R, D, a->heads, a->threads);
        }
        failed |= bf16_output_head(states, e, L->fc, L->fc_bias, L->head_norm, L->head_eps, out, R, D, a->threads);
        failed |= i8_rows(out, a->lm_w, a->lm_scales, a->lm_bias, logits, R, D, a->rows, a->threads);
        top_probs(logits, R, a->rows, L->k, top, top_p, a->threads);
        for (int j = 0; j < L->children; j++) {
            size_t pick = (size_t)L->child_parent[j] * L->k + (size_t)L->child_rank[j];
            tokens[at + j] = a->token_ids ? a->token_ids[top[pick]] : top[pick];
            probs[at + j] = top_p[pick];
        }
        for (int j = 0; j < L->next; j++)
            memcpy(e + (size_t)j * D, a->embedding + (size_t)tokens[at + L->next_expanded[j]] * D, sizeof(uint16_t) * D);
        at += L->children;
    }
    free(scratch), free(top), free(top_p);
    return failed != 0;
}

/* The greedy choice of an lm_head: the first largest of each row of y = x @ w.T (+ bias) as `bf16_rows` computes and
 * rounds it, without computing all of y. An int8 copy of w (a scale per column) screens: x in int16 (a scale per
 * row) times it gives each logit's sum before rounding within a bound (Cauchy-Schwarz over the rounding left in x and
 * in w, plus float32's sums: `screen_row`). Rounding to bf16 keeps order, so only the columns whose upper bound rounds
 * to at least what the row's largest lower bound rounds to can give its largest logit (or tie with it); those are
 * computed by `bf16_rows` from w's own rows, as the whole product computes each column wherever it lies, and the
 * first largest taken. In SmolLM2's verify forwards such columns numbered ~5 a row on average (44 at most over 4 prompts). The
 * screen reads half the bytes of the bf16 product; on AVX2 its int16 products are as many as the bf16 product's
 * float32 ones, so from 4 rows it gains less (on the AVX2-only EPYC, read from memory: 1.3 against 2.1 ms at one row of
 * SmolLM2's lm_head, 2.3 against 2.5 at four). */
#define SCREEN_SHIFT 20 /* float32's rounding of a bound (a few of its 2^-24) allowed as 2^-20 of its magnitude */
#if defined(__AVX512BF16__)
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
#else
#define SCREEN_ROWS 6
#define SCREEN_CHUNK 32 /* input pairs (2 KB) of a tile that every pass over it reads while they stay in L1 */
#define SCREEN_AHEAD 8192 /* bytes the screen reads ahead (2-16 KB timed alike on the AVX2-only EPYC) */
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
 * memory twice). On the AVX2-only EPYC, 8192 rows of 576 took 73 / 179 us (in cache) at 1 / 3 rows, against 104 /
 * 271 us by the two passes of byte products before them (one row by halves had taken 145). */
static void screen_tile(const int16_t* xq, const int8_t* wt, int pairs, int I, int R, int32_t* sums) {
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

#if defined(__AVX512BF16__)
/* sums (R x 32) of all R rows by tile wt, SCREEN_ROWS rows a pass over it, each pass's row count a constant */
static void screen_tile(const int16_t* xq, const int8_t* wt, int pairs, int I, int R, int32_t* sums) {
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

/* the largest |xq| for rows of I inputs, so that no int32 sum of I products by int8 weights overflows */
static int quantize_most(int I) {
    int most = (int)(2147483647.0 / (127.0 * I));
    return most > 16383 ? 16383 : most;
}

/* x (I bf16s) as int16s: xq = round(x / step), |xq| <= most, step = x's largest magnitude / most (1 where it is 0).
 * Returns step, or -1 (xq not written) where x is not finite. */
static float quantize_row(const uint16_t* x, int I, int most, int16_t* xq) {
    float top = 0.0f;
    for (int i = 0; i < I; i++) {
        float v = fabsf(bf16_to_float(x[i]));
        if (!(v < INFINITY))
            return -1.0f;
        top = v > top ? v : top;
    }
    float step = top > 0.0f ? top / (float)most : 1.0f;
    for (int i = 0; i < I; i++) {
        long q = lrintf(bf16_to_float(x[i]) / step);
        xq[i] = (int16_t)(q > most ? most : q < -most ? -most : q);
    }
    return step;
}

/* Row x quantized (`quantize_row`) and the coefficients of its bound: every column c's exact sum x . w_c lies within
 * coef[0] * resid[c] + coef[1] * norms[c] of step * scale_c * (xq . q_c), where resid[c] >= |w_c - scale_c q_c| and
 * norms[c] >= |w_c| (Euclidean norms): with d = x - step xq, x . w - (step xq) . (scale q) = x . (w - scale q) +
 * d . (scale q), and |scale q| <= |w| + resid. coef[1] also holds float32's error in summing I products in order, at
 * most I 2^-24 / (1 - I 2^-24) |x| |w|. Returns 0 where x is not finite. */
static int screen_row(const uint16_t* x, int I, int most, int16_t* xq, float* step, float* coef) {
    float s = quantize_row(x, I, most, xq);
    if (s < 0.0f)
        return 0;
    double xx = 0.0, dd = 0.0;
    for (int i = 0; i < I; i++) {
        double v = bf16_to_float(x[i]), d = v - (double)s * xq[i];
        xx += v * v;
        dd += d * d;
    }
    double eps = ldexp((double)I, -24), gamma = eps / (1.0 - eps), xn = sqrt(xx), dn = sqrt(dd);
    *step = s;
    coef[0] = (float)((xn + dn) * (1.0 + 1e-5));
    coef[1] = (float)((dn + gamma * xn) * (1.0 + 1e-5));
    return 1;
}

/* The columns of y = x @ w.T (+ bias) (R x O; x bf16 (R x I), w bf16 (O x I, rows one after another)) that may hold
 * one of some row's k largest logits, as `bf16_rows` computes and rounds y from w tiled, and those columns of y. wq:
 * w as int8 in tiles (O/32, I/2, 32, 2), column c being round(w_c / scales[c]); resid and norms as `screen_row` takes
 * them; bias float32 or NULL. At least k columns of each row's lower bounds reach its k-th largest lower bound, so
 * its k-th largest logit rounds to that bound's rounding or above, and so does the upper bound of every column that
 * may reach it: those columns are taken. Into *cols (ascending) and *y (R x 32 * *tiles bf16, a row's columns in
 * cols' order) their count *chosen, for the caller to free. counts (NULL or R ints): how many columns each row took.
 * Returns 1 where memory ran out, 2 where x is not finite (nothing chosen). */
static int screen_columns(const uint16_t* x, int R, const int8_t* wq, const float* scales, const float* resid,
                          const float* norms, const float* bias, const uint16_t* w, int I, int O, int k,
                          int32_t* counts, int threads, int** cols_out, uint16_t** y_out, int* tiles_out,
                          int* chosen_out) {
    int pairs = I / 2, blocks = O / 32, most = quantize_most(I);
    threads = threads > 0 ? threads : 1;
    int16_t* xq = malloc(sizeof(int16_t) * (size_t)R * I);
    float* per_row = malloc(sizeof(float) * (size_t)R * (4 + threads));
    float* hi = malloc(sizeof(float) * (size_t)R * O);
    float* lo_all = k > 1 ? malloc(sizeof(float) * (size_t)R * O) : NULL;  /* every lower bound, to rank them */
    uint8_t* pick = calloc((size_t)O, 1);
    if (!xq || !per_row || !hi || !pick || (k > 1 && !lo_all)) {
        free(xq), free(per_row), free(hi), free(lo_all), free(pick);
        return 1;
    }
    float *step = per_row, *coef = step + R, *floors = coef + 2 * (size_t)R, *lows = floors + R;
    /* lows: each thread's largest lower bounds; floors: each row's k-th largest lower bound */
    int status = most < 1 ? 2 : 0;
    for (int r = 0; r < R && !status; r++)
        if (!screen_row(x + (size_t)r * I, I, most, xq + (size_t)r * I, step + r, coef + 2 * r))
            status = 2;
    for (int i = 0; i < R * threads; i++)
        lows[i] = -INFINITY;
    if (counts)
        memset(counts, 0, sizeof(int32_t) * (size_t)R);
    #pragma omp parallel num_threads(threads) if (!status && threads > 1 && blocks > 1)
    {
        int b0, b1, me = omp_get_thread_num();
        thread_range(blocks, &b0, &b1);
        int32_t* sums = malloc(sizeof(int32_t) * 32 * (size_t)R);
        float* low = lows + (size_t)me * R;
        if (!sums) {
            #pragma omp atomic write
            status = 1;
        }
        for (int t = b0; t < b1 && sums && !status; t++) {
            screen_tile(xq, wq + (size_t)t * pairs * 64, pairs, I, R, sums);
            for (int r = 0; r < R; r++) {
                float* h = hi + (size_t)r * O + 32 * t;
                __m256 st = _mm256_set1_ps(step[r]), ca = _mm256_set1_ps(coef[2 * r]), cb = _mm256_set1_ps(coef[2 * r + 1]);
                __m256 sign = _mm256_set1_ps(-0.0f), shift = _mm256_set1_ps(1.0f / (1 << SCREEN_SHIFT)), lo8 = _mm256_set1_ps(-INFINITY);
                for (int j = 0; j < 32; j += 8) {
                    int c = 32 * t + j;
                    __m256 b = bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps();
                    __m256 a = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(sums + 32 * r + j))), st),
                                             _mm256_loadu_ps(scales + c));
                    a = _mm256_add_ps(a, b);
                    /* the bound, 1e-4 over for its own float32 rounding, plus that of a (within 1e-6 of |a| + |b|) */
                    __m256 e = _mm256_add_ps(_mm256_mul_ps(ca, _mm256_loadu_ps(resid + c)),
                                             _mm256_mul_ps(cb, _mm256_loadu_ps(norms + c)));
                    __m256 mag = _mm256_add_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b));
                    e = _mm256_add_ps(_mm256_mul_ps(e, _mm256_set1_ps(1.0001f)),
                                      _mm256_add_ps(_mm256_mul_ps(mag, _mm256_set1_ps(1e-6f)), _mm256_set1_ps(1e-30f)));
                    __m256 lo = _mm256_sub_ps(a, e), up = _mm256_add_ps(a, e);
                    lo = _mm256_sub_ps(lo, _mm256_mul_ps(_mm256_andnot_ps(sign, lo), shift));
                    up = _mm256_add_ps(up, _mm256_mul_ps(_mm256_andnot_ps(sign, up), shift));
                    lo8 = _mm256_max_ps(lo8, lo);
                    if (lo_all)
                        _mm256_storeu_ps(lo_all + (size_t)r * O + c, lo);
                    _mm256_storeu_ps(h + j, bf16x8_widen(bf16x8(up)));  /* no logit under it rounds above this */
                }
                float l[8];
                _mm256_storeu_ps(l, lo8);
                for (int j = 0; j < 8; j++)
                    low[r] = l[j] > low[r] ? l[j] : low[r];
            }
        }
        #pragma omp barrier
        #pragma omp for
        for (int r = 0; r < R; r++) {
            float m = -INFINITY;
            if (status)
                continue;
            if (lo_all) {
                if (kth_largest(lo_all + (size_t)r * O, O, k, &m)) {
                    #pragma omp atomic write
                    status = 1;
                }
            } else {
                for (int i = 0; i < omp_get_num_threads(); i++)
                    m = lows[(size_t)i * R + r] > m ? lows[(size_t)i * R + r] : m;
            }
            floors[r] = bf16_to_float(float_to_bf16(m));  /* the k-th largest logit rounds to this or above */
        }
        for (int r = 0; r < R && sums && !status; r++) {
            int n = 0;
            for (int c = 32 * b0; c < 32 * b1; c++)
                if (hi[(size_t)r * O + c] >= floors[r]) {
                    pick[c] = 1;
                    n++;
                }
            if (counts) {
                #pragma omp atomic
                counts[r] += n;
            }
        }
        free(sums);
    }
    free(hi), free(lo_all);
    int chosen = 0;
    for (int c = 0; c < O && !status; c++)
        chosen += pick[c];
    /* the columns any row may take, from w's rows into tiles of their own, computed for all R rows as the product of
     * R rows computes them, each column alike wherever it lies in a tile */
    int nt = (chosen + 31) / 32;
    int* cols = status ? NULL : malloc(sizeof(int) * (size_t)(chosen ? chosen : 1));
    uint16_t* mini = status ? NULL : calloc((size_t)(nt ? nt : 1) * pairs * 64, sizeof(uint16_t));
    float* mini_bias = status || !bias ? NULL : calloc((size_t)(nt ? nt : 1) * 32, sizeof(float));
    uint16_t* y = status ? NULL : malloc(sizeof(uint16_t) * (size_t)R * (nt ? nt : 1) * 32);
    if (!status && (!cols || !mini || (bias && !mini_bias) || !y))
        status = 1;
    if (!status) {
        for (int c = 0, j = 0; c < O; c++) {
            if (!pick[c])
                continue;
            uint32_t* into = (uint32_t*)(mini + (size_t)(j / 32) * pairs * 64) + j % 32;
            const uint32_t* row = (const uint32_t*)(w + (size_t)c * I);  /* I even: a row's pairs are whole */
            for (int p = 0; p < pairs; p++)
                into[(size_t)p * 32] = row[p];
            if (bias)
                mini_bias[j] = bias[c];
            cols[j++] = c;
        }
        status = bf16_rows(x, mini, mini_bias, y, R, I, 32 * nt, 1);  /* the lm_head's own product, on few columns */
    }
    free(xq), free(per_row), free(pick), free(mini), free(mini_bias);
    if (status) {
        free(cols), free(y);
        return status;
    }
    *cols_out = cols, *y_out = y, *tiles_out = nt, *chosen_out = chosen;
    return 0;
}

/* out[r]: the argmax of row r of y (R x O) = x @ w.T (+ bias) as `bf16_rows` computes y from w tiled: its first
 * largest, among the columns `screen_columns` takes for k = 1 (arguments as it takes them). Returns 1 where memory ran
 * out, 2 where x is not finite (nothing chosen). */
int bf16_screen_argmax(const uint16_t* x, int R, const int8_t* wq, const float* scales, const float* resid,
                       const float* norms, const float* bias, const uint16_t* w, int I, int O, int64_t* out,
                       int32_t* counts, int threads) {
    int *cols, nt, chosen;
    uint16_t* y;
    int status = screen_columns(x, R, wq, scales, resid, norms, bias, w, I, O, 1, counts, threads, &cols, &y, &nt,
                                &chosen);
    if (status)
        return status;
    for (int r = 0; r < R; r++) {
        int64_t best = -1;
        float top = -INFINITY;
        for (int j = 0; j < chosen; j++) {
            float v = bf16_to_float(y[(size_t)r * 32 * nt + j]);
            if (best < 0 || v > top) {
                top = v;
                best = cols[j];
            }
        }
        out[r] = best;
    }
    free(cols), free(y);
    return 0;
}

/* The columns that may hold one of some row's k largest logits of y = x @ w.T (+ bias) (`screen_columns`, arguments
 * as it takes them; 1 <= k <= O) into cols (ascending, at most `room`) and their logits into values (R x that many,
 * float32, as `bf16_rows` rounds them). Returns how many columns, -1 where memory ran out, -2 where x is not finite,
 * -3 where they are more than `room` (nothing written). */
long bf16_screen_top_k(const uint16_t* x, int R, const int8_t* wq, const float* scales, const float* resid,
                       const float* norms, const float* bias, const uint16_t* w, int I, int O, int k, int64_t* cols,
                       float* values, long room, int32_t* counts, int threads) {
    int *taken, nt, chosen;
    uint16_t* y;
    int status = screen_columns(x, R, wq, scales, resid, norms, bias, w, I, O, k, counts, threads, &taken, &y, &nt,
                                &chosen);
    if (status)
        return -status;
    if (chosen > room) {
        free(taken), free(y);
        return -3;
    }
    for (int j = 0; j < chosen; j++)
        cols[j] = taken[j];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < chosen; j++)
            values[(size_t)r * chosen + j] = bf16_to_float(y[(size_t)r * 32 * nt + j]);
    free(taken), free(y);
    return chosen;
}

/* int8 products for drafting, where the rows only rank tokens: y (R x O) = x (R x I) @ w.T (+ bias, float32) by int8
 * weights with a float32 scale a row of w (`w_scales`), laid out as the screen's (O/32, I/2, 32, 2), O a multiple of
 * 32, I even. Each row of x goes in as int16s (`quantize_row`, ~14 bits) and its exact int32 sums (`screen_tile`) are
 * scaled, the same in both builds; a row not finite gives NaNs. One pass of int16 pair products took ~40% fewer
 * instructions than the two passes of byte products (x split in two int8 parts) it replaced on AVX2. Returns 1 where
 * memory ran out. */
__attribute__((optimize("fp-contract=off")))  /* each build rounds the products and the bias's sum apart alike */
int i8_rows(const uint16_t* x, const int8_t* wq, const float* w_scales, const float* bias, uint16_t* y, int R, int I,
            int O, int threads) {
    int pairs = I / 2, blocks = O / 32, most = quantize_most(I), failed = 0;
    int16_t* xq = malloc(sizeof(int16_t) * (size_t)R * I);
    float* steps = malloc(sizeof(float) * (size_t)R);
    if (!xq || !steps) {
        free(xq), free(steps);
        return 1;
    }
    for (int r = 0; r < R; r++) {
        steps[r] = quantize_row(x + (size_t)r * I, I, most, xq + (size_t)r * I);
        if (steps[r] < 0.0f)
            memset(xq + (size_t)r * I, 0, sizeof(int16_t) * (size_t)I);
    }
    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        int b0, b1;
        thread_range(blocks, &b0, &b1);
        int32_t* sums = malloc(sizeof(int32_t) * 32 * (size_t)R);
        if (!sums) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int t = b0; t < b1 && sums; t++) {
            screen_tile(xq, wq + (size_t)t * pairs * 64, pairs, I, R, sums);
            for (int r = 0; r < R; r++) {
                __m256 step = _mm256_set1_ps(steps[r]), nan = _mm256_set1_ps(steps[r] < 0.0f ? NAN : 0.0f);
                for (int j = 0; j < 32; j += 8) {
                    int c = 32 * t + j;
                    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
                        (const __m256i*)(sums + 32 * r + j))), step), _mm256_loadu_ps(w_scales + c));
                    if (bias)
                        v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
                    _mm_storeu_si128((__m128i*)(y + (size_t)r * O + c), bf16x8(_mm256_add_ps(v, nan)));
                }
            }
        }
        free(sums);
    }
    free(xq), free(steps);
    return failed;
}

static float float_up(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* What `bf16_screen_argmax` reads beside w (O x I bf16): w in int8 tiles (O/32, I/2, 32, 2), column c being
 * round(w_c / scales[c]) with scales[c] = max |w_c| / 127 in float32, and the Euclidean norms of w_c - scales[c] q_c
 * (resid) and of w_c (norms), rounded up, 8 weights at a time: SmolLM2's lm_head took 23-29 ms on 2 threads against
 * 66-82 one weight at a time (AVX2-only EPYC), part of a first call. Returns 0 where a weight is not finite (then
 * nothing is usable). */
int screen_prepare(const uint16_t* w, int I, int O, int8_t* wq, float* scales, float* resid, float* norms, int threads) {
    int pairs = I / 2, finite = 1, whole = I & ~7;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int c = 0; c < O; c++) {
        const uint16_t* row = w + (size_t)c * I;
        __m256 sign = _mm256_set1_ps(-0.0f), top8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
        for (int i = 0; i < whole; i += 8) {
            __m256 v = _mm256_andnot_ps(sign, bf16x8_in(row + i));
            bad8 = _mm256_or_ps(bad8, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ));  /* inf or NaN */
            top8 = _mm256_max_ps(top8, v);
        }
        float t[8], top = 0.0f;
        _mm256_storeu_ps(t, top8);
        int bad = _mm256_movemask_ps(bad8) != 0;
        for (int j = 0; j < 8; j++)
            top = t[j] > top ? t[j] : top;
        for (int i = whole; i < I; i++) {
            float v = fabsf(bf16_to_float(row[i]));
            bad |= !(v < INFINITY);
            top = v > top ? v : top;
        }
        if (bad) {
            #pragma omp atomic write
            finite = 0;
        }
        float s = top / 127.0f;
        s = s < 1.17549435e-38f ? 1.17549435e-38f : s;
        /* q = round(w / s) as w times 1 / s rounds it (any rounding serves: resid is that of the q taken); w - s q in
         * float64, where s q is exact */
        float inv = 1.0f / s;
        __m256 inv8 = _mm256_set1_ps(inv), most = _mm256_set1_ps(127.0f), least = _mm256_set1_ps(-127.0f);
        __m256d s4 = _mm256_set1_pd(s), rr4 = _mm256_setzero_pd(), ww4 = _mm256_setzero_pd();
        int8_t* tile = wq + (size_t)(c / 32) * pairs * 64 + 2 * (c % 32);
        for (int i = 0; i < whole; i += 8) {
            __m256 v = bf16x8_in(row + i);
            __m256 q = _mm256_round_ps(_mm256_mul_ps(v, inv8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_min_ps(_mm256_max_ps(q, least), most);
            int32_t qi[8];
            _mm256_storeu_si256((__m256i*)qi, _mm256_cvtps_epi32(q));
            for (int k = 0; k < 8; k++)
                tile[(size_t)((i + k) / 2) * 64 + k % 2] = (int8_t)qi[k];
            for (int h = 0; h < 2; h++) {
                __m256d vd = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(v, 1) : _mm256_castps256_ps128(v));
                __m256d qd = _mm256_cvtps_pd(h ? _mm256_extractf128_ps(q, 1) : _mm256_castps256_ps128(q));
                __m256d r = _mm256_sub_pd(vd, _mm256_mul_pd(s4, qd));
                rr4 = _mm256_add_pd(rr4, _mm256_mul_pd(r, r));
                ww4 = _mm256_add_pd(ww4, _mm256_mul_pd(vd, vd));
            }
        }
        double r4[4], w4[4], rr = 0.0, ww = 0.0;
        _mm256_storeu_pd(r4, rr4);
        _mm256_storeu_pd(w4, ww4);
        for (int j = 0; j < 4; j++)
            rr += r4[j], ww += w4[j];
        for (int i = whole; i < I; i++) {
            double v = bf16_to_float(row[i]), q = nearbyint(v * inv);
            q = q > 127.0 ? 127.0 : q < -127.0 ? -127.0 : q;
            tile[(size_t)(i / 2) * 64 + i % 2] = (int8_t)q;
            rr += (v - (double)s * q) * (v - (double)s * q);
            ww += v * v;
        }
        scales[c] = s;
        resid[c] = float_up(sqrt(rr));
        norms[c] = float_up(sqrt(ww));
    }
    return finite;
}
