/* y = x @ w.T (+ bias) for a few rows of bf16 x, each weight byte read once for a block of rows, sums in float32
 * (the tiles' inner loops: arch/), and the int8 products the heads draft from. */
#include "bf16_cpu.h"

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
 * With AVX2, a prefill's rows go ROW_BLOCK at a time: every tile reads all the rows it is given, and a whole
 * prefill's (their float32 copy, megabytes) would stream from memory for each. A multiple of the blocks of rows, so
 * each row's sums add alike. */
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

/* the largest |xq| for rows of I inputs, so that no int32 sum of I products by int8 weights overflows */
int quantize_most(int I) {
    int most = (int)(2147483647.0 / (127.0 * I));
    return most > 16383 ? 16383 : most;
}

/* x (I bf16s) as int16s: xq = round(x / step), |xq| <= most, step = x's largest magnitude / most (1 where it is 0).
 * Returns step, or -1 (xq not written) where x is not finite. */
float quantize_row(const uint16_t* x, int I, int most, int16_t* xq) {
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

/* int8 products for drafting, where the rows only rank tokens: y (R x O) = x (R x I) @ w.T (+ bias, float32) by int8
 * weights with a float32 scale a row of w (`w_scales`), laid out as the screen's (O/32, I/2, 32, 2), O a multiple of
 * 32, I even. Each row of x goes in as int16s (`quantize_row`, ~14 bits) and its exact int32 sums (`screen_tile`) are
 * scaled, the same in both builds; a row not finite gives NaNs. One pass of int16 pair products: fewer instructions
 * than two passes of byte products (x split in two int8 parts). Returns 1 where memory ran out. */
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
