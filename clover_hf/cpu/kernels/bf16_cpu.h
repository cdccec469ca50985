/* The CPU kernel's shared header: the types, conversions and helpers every family of ops uses, the instruction set's
 * own definitions (arch/avx512.h or arch/avx2.h, chosen by the compiler's flags), the structs the decoder layers take
 * and the functions one source calls in another (INTERNAL ones stay out of the library's exported symbols).
 *
 * The sources, built together by clover_hf/cpu/kernel_library.py into one shared library per instruction set:
 *   products.c    y = x @ w.T (+ bias) for a few rows of bf16 x by tiled bf16 weights
 *   repack.c      the lm_head's int8 copy that the screen reads
 *   norms.c       RMSNorm (alone, or with the residual sum before it), rotary embedding, SwiGLU's silu * up and
 *                 Clover's cosine gate
 *   attention.c   the attention of a few query tokens over a KV cache, and the keys' layout beside it
 *   layers.c      whole decoder layers in one call, and a KV cache's compaction
 *   select.c      greedy acceptance's argmax, the heads' softmax top-k, a top-k warper's cut, and the lm_head's
 *                 screen (its argmax and top-k without computing all its logits)
 *   arch/         each instruction set's inner loops: the products' tiles, attention's passes, the screen's tiles
 * for one of two instruction sets:
 *   AVX-512-BF16 (-mavx512bf16): vdpbf16ps multiplies pairs of bf16 inputs, fourteen rows a block;
 *   AVX2 with FMA (-mavx2 -mfma): weights widened to float32 in registers (a shift), x converted to float32
 *   once a call, four rows a block; more rows, up to six a pass over half a tile, a chunk of it at a time.
 *
 * The weight is laid out once in 32-column tiles, (O/32, I/2, 32, 2): tile t, input pair p, column c holds
 * w[32t + c, 2p : 2p + 2], so a tile streams through memory in order. O is a multiple of 32, I even. */
#ifndef CLOVER_BF16_CPU_H
#define CLOVER_BF16_CPU_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* a function one source defines and another calls: kept out of the library's exported symbols */
#define INTERNAL __attribute__((visibility("hidden")))

/* 8 float32s rounded to bf16 (to nearest even, NaN kept quiet), as torch rounds: both builds run AVX2 */
static inline __m128i bf16x8(__m256 f) {
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

/* the contiguous share of `blocks` this OpenMP thread computes (all of them outside a parallel region) */
static inline void thread_range(int blocks, int* b0, int* b1) {
    int n = omp_get_num_threads(), per = (blocks + n - 1) / n;
    *b0 = omp_get_thread_num() * per;
    *b1 = *b0 + per < blocks ? *b0 + per : blocks;
}

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 to bf16, to nearest even, NaN kept quiet: as torch converts */
static inline uint16_t float_to_bf16(float f) {
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

#if defined(__AVX512BF16__)
#include "arch/avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "arch/avx2.h"
#else
#error "build with -mavx512bf16 (and -mavx512f -mavx512bw -mavx512vl), or with -mavx2 -mfma"
#endif

typedef void (*tile_fn)(const xtype*, const uint16_t*, int, int, float*);
/* each row count's product of up to BLOCK rows by one tile (the instruction set's: arch/) */
INTERNAL extern const tile_fn TILES[BLOCK + 1];

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

/* products.c */
int bf16_rows(const uint16_t* x, const uint16_t* wb, const float* bias, uint16_t* y, int R, int I, int O,
              int threads);

/* norms.c */
INTERNAL void norm_row(const uint16_t* xr, const uint16_t* w, uint16_t* yr, int D, float eps);
void bf16_rms_norm(const uint16_t* x, const uint16_t* w, uint16_t* y, int R, int D, float eps);
void bf16_add_rms_norm(const uint16_t* a, const uint16_t* b, uint16_t* sum, const uint16_t* w, uint16_t* y, int R,
                       int D, float eps);
void bf16_rope(const uint16_t* q, long q_row, const uint16_t* k, long k_row, const uint16_t* cos,
               const uint16_t* sin, uint16_t* qo, uint16_t* ko, int B, int T, int Hq, int Hk, int D);
void bf16_cosine_gate(const uint16_t* h, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                      int R, int H, int D, float eps);
INTERNAL float silu_rounded(float x);
INTERNAL void silu_mul_rows(const uint16_t* g, long g_row, const uint16_t* u, long u_row, uint16_t* out, int n,
                            int r0, int r1);

/* attention.c, and its passes (arch/) */
int bf16_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, long kv_row, long kv_head,
                   const void* mask, int mask_bf16, int causal, uint32_t* layout, long layout_head, int32_t* laid,
                   uint16_t* out, int B, int H, int G, int T, int K, int D, float scale, int threads);
INTERNAL void attend_part(const uint16_t* const* q_at, const void* const* mask_at, int mask_bf16, int n,
                          const uint16_t* k, const uint32_t* kt, const uint16_t* v, int k0, int k1, int D,
                          float scale, float* scratch, float* most, float* total, float* sums);
INTERNAL void lay_out_keys(const uint16_t* k, uint32_t* kt, int K, int D, int b0, int b1);

/* layers.c */
int bf16_layers(const struct layer_args* const* layers, int n, const struct step_args* st);

/* select.c, and the screen's tiles (arch/) */
void top_probs(const uint16_t* x, int R, int n, int k, int64_t* idx, float* probs, int threads);
INTERNAL int kth_largest(const float* x, int n, int k, float* kth);
INTERNAL void screen_tile(const int16_t* xq, const int8_t* wt, int pairs, int I, int R, int32_t* sums);

#endif
