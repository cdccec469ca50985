/* y = x @ w.T (+ bias) for a few rows of bf16 x, on CPUs with AVX-512-BF16: sums in float32 by
 * vdpbf16ps, each weight byte read once for up to eight rows. Built and loaded by clover_hf/bf16_kernel.py.
 *
 * The weight is laid out once in 32-column tiles, (ceil(O/32), I/2, 32, 2): tile t, input pair p, column c
 * holds w[32t + c, 2p : 2p + 2], so a tile streams through memory in order. O is a multiple of 32, I even. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MAX_ROWS 8

/* R rows of x against one tile: two 16-column sums per row */
#define TILE(R) \
static void tile##R(const uint16_t* x, const uint16_t* wt, int pairs, int I, __m512* a0, __m512* a1) { \
    __m512 s0[R], s1[R]; \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { s0[r] = _mm512_setzero_ps(); s1[r] = _mm512_setzero_ps(); } \
    const uint16_t* wp = wt; \
    for (int p = 0; p < pairs; p++, wp += 64) { \
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(wp); \
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(wp + 32); \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { \
            uint32_t pair; \
            memcpy(&pair, x + (size_t)r * I + 2 * p, 4); \
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair); \
            s0[r] = _mm512_dpbf16_ps(s0[r], xb, b0); \
            s1[r] = _mm512_dpbf16_ps(s1[r], xb, b1); \
        } \
    } \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { a0[r] = s0[r]; a1[r] = s1[r]; } \
}
TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)

/* one row: even and odd pairs summed apart, four chains of additions instead of two */
static void tile1(const uint16_t* x, const uint16_t* wt, int pairs, int I, __m512* a0, __m512* a1) {
    (void)I;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
    const uint16_t* wp = wt;
    int p = 0;
    for (; p + 1 < pairs; p += 2, wp += 128) {
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
    a0[0] = _mm512_add_ps(s0, t0);
    a1[0] = _mm512_add_ps(s1, t1);
}

typedef void (*tile_fn)(const uint16_t*, const uint16_t*, int, int, __m512*, __m512*);
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6, tile7, tile8};

static void store(uint16_t* y, __m512 sum, __m512 bias) {
    _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, bias)));
}

static void tiles(const uint16_t* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
                  int t0, int t1) {
    __m512 a0[MAX_ROWS], a1[MAX_ROWS];
    int pairs = I / 2;
    for (int t = t0; t < t1; t++) {
        const uint16_t* wt = wb + (size_t)t * pairs * 64;
        int o = t * 32;
        __m512 c0 = bias ? _mm512_loadu_ps(bias + o) : _mm512_setzero_ps();
        __m512 c1 = bias ? _mm512_loadu_ps(bias + o + 16) : _mm512_setzero_ps();
        for (int r0 = 0; r0 < R; r0 += MAX_ROWS) {
            int n = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
            TILES[n](x + (size_t)r0 * I, wt, pairs, I, a0, a1);
            for (int r = 0; r < n; r++) {
                uint16_t* yr = y + (size_t)(r0 + r) * O + o;
                store(yr, a0[r], c0);
                store(yr + 16, a1[r], c1);
            }
        }
    }
}

/* y (R x O) = x (R x I) @ w (O x I)^T (+ bias, float32), bf16 in and out; wb: w tiled as above.
 * The tiles are shared among `threads` OpenMP threads (torch's own pool where the runtime is the same). */
void bf16_rows(const uint16_t* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
               int threads) {
    int blocks = O / 32;
    if (threads <= 1 || blocks < 2) {
        tiles(x, wb, bias, y, R, I, O, 0, blocks);
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int per = (blocks + n - 1) / n;
        int b0 = t * per, b1 = b0 + per < blocks ? b0 + per : blocks;
        if (b0 < b1)
            tiles(x, wb, bias, y, R, I, O, b0, b1);
    }
}
