/* The attention of a few query tokens over a KV cache (its passes over one key/value head: arch/), split among
 * threads where a head's rows would leave one idle, and the keys' layout kept beside the cache. */
#include "bf16_cpu.h"

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
