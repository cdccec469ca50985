/* AVX2 (with FMA) definitions for the shared sources, included by bf16_cpu.h where the compiler's flags enable it:
 * the products' rows a block, their input type, the half-tile passes of more rows and their store, and attention's
 * sizes (its keys are read as they lie). */

#define BLOCK 4
typedef float xtype; /* x converted to float32 once a call */

/* more rows than a block go up to HALF_ROWS a pass over a 16-column half of a tile, CHUNK input pairs at a time
 * (arch/avx2.c) */
#define HALF_ROWS 6
#define CHUNK 32 /* input pairs: 4 KB of a tile */
typedef void (*half_fn)(const xtype*, const uint16_t*, int, int, int, float*, const char*, int, int);
INTERNAL extern const half_fn HALVES[HALF_ROWS + 1];

/* 16 sums plus bias, rounded to bf16 (to nearest even, NaN kept, as torch rounds) */
static inline void store16(uint16_t* y, const float* sums, const float* bias) {
    for (int i = 0; i < 16; i += 8) {
        __m256 s = _mm256_loadu_ps(sums + i);
        if (bias)
            s = _mm256_add_ps(s, _mm256_loadu_ps(bias + i));
        _mm_storeu_si128((__m128i*)(y + i), bf16x8(s));
    }
}

#define ATT_ROWS 16 /* query rows (of one key/value head) one pass attends: a group's all, up to 16 */
#define PARTIAL(D) ((size_t)ATT_ROWS * (2 + (D))) /* floats of a part's results: ATT_ROWS rows' most, total, sums */
#define SCRATCH(K, D) ((size_t)ATT_ROWS * 8 * (((K) + 7) / 8) + (size_t)(ATT_ROWS + 8) * (D) + PARTIAL(D))
#define KEY_LAYOUT(K, D) ((size_t)0)  /* the keys are read as they lie */
