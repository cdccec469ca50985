/* AVX-512-BF16 (with VNNI) definitions for the shared sources, included by bf16_cpu.h where the compiler's flags
 * enable it: the products' rows a block, their input type and store, attention's sizes and keys' layout, and
 * 16-wide conversions and e^x. */

/* Rows a pass over a tile computes: 14 rows' 28 sums, 2 weight vectors and a broadcast pair take 31 of the 32
 * registers. Past a block, a tile is read again from L2 for the rest, compute that does not overlap the tile's
 * streaming from memory: so the block is as large as the registers allow (blocks of 8 ran slower from 12 rows up,
 * and alike at 1-8). */
#define BLOCK 14
typedef uint16_t xtype; /* x as given */

/* 16 sums plus bias, rounded to bf16 (to nearest even, as torch rounds) */
static inline void store16(uint16_t* y, const float* sums, const float* bias) {
    __m512 s = _mm512_loadu_ps(sums);
    if (bias)
        s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i*)y, (__m256i)_mm512_cvtneps_pbh(s));
}

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


/* attention lays each head's keys out for its bf16 products (arch/avx512.c) */
#define lay_out_keys transpose_keys
