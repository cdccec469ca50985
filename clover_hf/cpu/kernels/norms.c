/* Norms and activations of bf16 rows, each rounded as torch's bf16 operations round: RMSNorm (alone, or with the
 * residual sum before it), rotary embedding, Clover's cosine gate and SwiGLU's silu * up. */
#include "bf16_cpu.h"

/* y = w * bf16(x * rsqrt(mean(x^2) + eps)) for each of R rows of D: transformers' Llama RMSNorm in bf16
 * (sums of squares in float32, sixteen partial sums, so in another order than torch's). */
void norm_row(const uint16_t* xr, const uint16_t* w, uint16_t* yr, int D, float eps) {
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
/* silu(x) = x / (1 + e^-x) in float32, rounded to bf16 as torch's bf16 silu rounds it (e^-x by the C library's expf:
 * a last bit may differ from torch's) */
float silu_rounded(float x) {
    return bf16_to_float(float_to_bf16(x / (1.0f + expf(-x))));
}

/* out = bf16(bf16(silu(g)) * u) over R rows of n bf16 values, rows of g, u and out `g_row`, `u_row` and n apart:
 * a SwiGLU MLP's act_fn(gate) * up as torch computes it in bf16 (silu x / (1 + e^-x) in float32, rounded, then the
 * product rounded), but for e^-x, within 2 ulp of torch's: in one call, where torch ran two ops and the gate's
 * and up's split from their stacked product. */
void silu_mul_rows(const uint16_t* g, long g_row, const uint16_t* u, long u_row, uint16_t* out, int n, int r0,
                   int r1) {
    for (int r = r0; r < r1; r++) {
        const uint16_t *gr = g + (size_t)r * g_row, *ur = u + (size_t)r * u_row;
        uint16_t* o = out + (size_t)r * n;
        int i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= n; i += 16) { /* as the 8 below, 16 at a time: about twice as fast */
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
