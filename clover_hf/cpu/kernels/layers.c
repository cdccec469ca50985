/* Whole decoder layers in one call (struct layer_args, step_args: bf16_cpu.h), and a KV cache's compaction. */
#include "bf16_cpu.h"

/* rows from which a decoder layer's silu runs on all its threads, a share of the rows each: faster so at a verify
 * forward's few rows; its norms, rotary embedding and residual sum ran slower so (the fork and the rows' moves
 * between cores cost more) */
#define SILU_APART 2

static int decoder_layer(const struct layer_args* a, const struct step_args* st, const uint16_t* x, uint16_t* out) {
    int R = st->B * st->T, D = a->D, hd = a->hd, q_out = a->Hq * hd, qkv_out = (a->Hq + 2 * a->Hk) * hd;
    size_t rows = (size_t)R;
    uint16_t* scratch = malloc(sizeof(uint16_t) * rows * (4 * (size_t)D + qkv_out + 2 * (size_t)q_out
                                                          + (size_t)a->Hk * hd + 3 * (size_t)a->F));
    if (!scratch)
        return 1;
    uint16_t *h = scratch, *qkv = h + rows * D, *q = qkv + rows * qkv_out, *k = q + rows * q_out;
    uint16_t *att = k + rows * a->Hk * hd, *summed = att + rows * q_out, *mixed_in = summed + rows * D;
    uint16_t *gate_up = mixed_in + rows * D, *mixed = gate_up + rows * 2 * a->F, *mlp = mixed + rows * a->F;
    int failed = 0;
    bf16_rms_norm(x, a->norm_in, h, R, D, a->eps);
    failed |= bf16_rows(h, a->qkv, a->qkv_bias, qkv, R, D, qkv_out, a->threads);
    bf16_rope(qkv, qkv_out, qkv + q_out, qkv_out, st->cos, st->sin, q, k, st->B, st->T, a->Hq, a->Hk, hd);
    for (int b = 0; b < st->B; b++)
        for (int g = 0; g < a->Hk; g++)
            for (int t = 0; t < st->T; t++) {
                size_t slot = (size_t)b * a->kv_row + (size_t)g * a->kv_head + (size_t)(st->length + t) * hd;
                memcpy(a->keys + slot, k + (((size_t)b * a->Hk + g) * st->T + t) * hd, sizeof(uint16_t) * hd);
                memcpy(a->values + slot, qkv + ((size_t)b * st->T + t) * qkv_out + q_out + (size_t)(a->Hk + g) * hd,
                       sizeof(uint16_t) * hd);
            }
    failed |= bf16_attention(q, a->keys, a->values, a->kv_row, a->kv_head, st->mask, st->mask_bf16, st->causal, a->layout,
                             a->layout_head, a->laid, att, st->B, a->Hq, a->Hk, st->T, st->length + st->T, hd, a->scale,
                             a->threads);
    failed |= bf16_rows(att, a->o, a->o_bias, h, R, q_out, D, a->threads);
    bf16_add_rms_norm(x, h, summed, a->norm_post, mixed_in, R, D, a->eps);
    failed |= bf16_rows(mixed_in, a->gate_up, a->gate_up_bias, gate_up, R, D, 2 * a->F, a->threads);
    if (a->threads > 1 && R >= SILU_APART) {
        #pragma omp parallel num_threads(a->threads)
        {
            int r0, r1;
            thread_range(R, &r0, &r1);
            silu_mul_rows(gate_up, 2 * a->F, gate_up + a->F, 2 * a->F, mixed, a->F, r0, r1);
        }
    } else {
        silu_mul_rows(gate_up, 2 * a->F, gate_up + a->F, 2 * a->F, mixed, a->F, 0, R);
    }
    failed |= bf16_rows(mixed, a->down, a->down_bias, mlp, R, a->F, D, a->threads);
    for (size_t i = 0; i < rows * D; i++)
        out[i] = float_to_bf16(bf16_to_float(summed[i]) + bf16_to_float(mlp[i]));
    free(scratch);
    return failed != 0;
}

/* The n layers, each the next one's input, from st->x to st->out (all of one hidden size). Returns 1 where memory ran
 * out (then the keys and values past `length` may be written). */
int bf16_layers(const struct layer_args* const* layers, int n, const struct step_args* st) {
    size_t size = (size_t)st->B * st->T * layers[0]->D;
    uint16_t* between = n > 1 ? malloc(sizeof(uint16_t) * size * 2) : NULL;
    if (n > 1 && !between)
        return 1;
    int failed = 0;
    for (int i = 0; i < n && !failed; i++)
        failed = decoder_layer(layers[i], st, i == 0 ? st->x : between + size * ((i - 1) % 2),
                               i == n - 1 ? st->out : between + size * (i % 2));
    free(between);
    return failed;
}

/* A KV cache's compaction in one call: in each of `count` tensors (B, H, slots, slot_bytes / element), whose rows
 * and heads lie batch_bytes[t] and head_bytes[t] apart and whose slots follow one another, slot src[b * moved + i]
 * of row b moves to slot dst + i, i ascending (sources at or after their destinations, as kept tree nodes lie). */
void move_slots(uint8_t* const* bases, const long* batch_bytes, const long* head_bytes, int count, int B, int H,
                long slot_bytes, const int64_t* src, int moved, long dst) {
    for (int t = 0; t < count; t++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                uint8_t* head = bases[t] + b * batch_bytes[t] + h * head_bytes[t];
                for (int i = 0; i < moved; i++)
                    memmove(head + (dst + i) * slot_bytes, head + src[(size_t)b * moved + i] * slot_bytes,
                            (size_t)slot_bytes);
            }
}
