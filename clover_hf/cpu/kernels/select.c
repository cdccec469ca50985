/* What a decoding step selects from logits: greedy acceptance's argmax, the heads' softmax top-k, a top-k warper's
 * cut, and the lm_head's screen (its argmax and top-k without computing all its logits; the screen's tiles: arch/). */
#include "bf16_cpu.h"

/* the first index of the largest of n float32s, a NaN counting as the largest (its first one): as torch's argmax.
 * Two passes, the second over what the first left in cache (torch's reads one value at a time). */
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

#define TOP_MOST 64 /* the most a row ranks (clover_hf/cpu/kernel_selection.py's TOP_MOST) */

/* For each of R rows of n bf16 logits: its k (<= n, <= TOP_MOST) largest, largest first (of equal ones, the first),
 * as indices and softmax probabilities exp(x - max) / sum(exp(x - max)) in float32 (sums in another order than
 * torch's). What the heads draft at each level, in one call where torch ran a conversion, softmax and topk. NaN
 * logits are not ranked. */
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
int kth_largest(const float* x, int n, int k, float* kth) {
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
 * range or memory ran out. */
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

/* The greedy choice of an lm_head: the first largest of each row of y = x @ w.T (+ bias) as `bf16_rows` computes and
 * rounds it, without computing all of y. An int8 copy of w (a scale per column) screens: x in int16 (a scale per
 * row) times it gives each logit's sum before rounding within a bound (Cauchy-Schwarz over the rounding left in x and
 * in w, plus float32's sums: `screen_row`). Rounding to bf16 keeps order, so only the columns whose upper bound rounds
 * to at least what the row's largest lower bound rounds to can give its largest logit (or tie with it); those are
 * computed by `bf16_rows` from w's own rows, as the whole product computes each column wherever it lies, and the
 * first largest taken. Such columns are few (a handful a row in a trained model's verify forwards). The screen reads
 * half the bytes of the bf16 product; on AVX2 its int16 products are as many as the bf16 product's float32 ones, so
 * from 4 rows it gains less. */
#define SCREEN_SHIFT 20 /* float32's rounding of a bound (a few of its 2^-24) allowed as 2^-20 of its magnitude */

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
