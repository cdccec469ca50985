/* Weights laid out once for the kernels: the lm_head's int8 copy that the screen reads (select.c). */
#include "bf16_cpu.h"

static float float_up(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

/* What `bf16_screen_argmax` reads beside w (O x I bf16): w in int8 tiles (O/32, I/2, 32, 2), column c being
 * round(w_c / scales[c]) with scales[c] = max |w_c| / 127 in float32, and the Euclidean norms of w_c - scales[c] q_c
 * (resid) and of w_c (norms), rounded up, 8 weights at a time (a few times faster than one at a time: this is part
 * of a first call). Returns 0 where a weight is not finite (then nothing is usable). */
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
