/* y = x @ w.T (+ bias) for a few rows of bf16 x, each weight byte read once for a block of rows, sums in float32
 * (the tiles' inner loops: arch/). */
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
