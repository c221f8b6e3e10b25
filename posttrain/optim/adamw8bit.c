/* AdamW's step over one parameter whose moments are stored in 8 bits, block by block: the arithmetic of
 * `posttrain.optim.adamw8bit._update_blocks` (the format is described there) in one pass over each block of
 * 256 values, which stays in the L1 cache, instead of torch's ~20 passes over a chunk.
 *
 * Built once per machine by `posttrain.optim.native` (cc -O3 -march=native -fopenmp -ffp-contract=off: each
 * operation rounds on its own, as in torch's kernels, but for the two multiply-adds torch fuses, written as
 * fmaf) and called through ctypes, which releases the GIL.
 * OpenMP is the libgomp torch already loaded (same soname), so its threads are torch's.
 */
#include <math.h>
#include <stdint.h>

#define BLOCK 256

static inline float clampf(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/* The largest of a block's BLOCK values, all >= 0: 16 lanes kept apart (one vector register), so the loop
 * vectorizes without reordering a reduction; `a > b ? a : b` is what the max instruction computes. */
static inline float block_max(const float *x) {
    float lane[16] = {0.0f};
    for (int i = 0; i < BLOCK; i += 16)
        for (int l = 0; l < 16; ++l) lane[l] = lane[l] > x[i + l] ? lane[l] : x[i + l];
    float top = 0.0f;
    for (int l = 0; l < 16; ++l) top = top > lane[l] ? top : lane[l];
    return top;
}

/* p: n float32 weights; g: their n float32 gradients; qm/qv: blocks * BLOCK codes; sm/sv: blocks scales.
 * Values past n in the last block are read as a zero gradient and their weights are not written.
 * new1 = 1 - beta1 and new2 = 1 - beta2 come from the caller's doubles, as torch's scalars do: 1 - 0.999f in
 * float is 1.3e-5 off 0.001, which moved every block's scale of v by ~3e-6 of itself. */
void adamw8bit_update(float *p, const float *g, int8_t *qm, float *sm, uint8_t *qv, float *sv, int64_t n,
                      int64_t blocks, float new1, float beta2, float new2, float eps, float step_size,
                      float bias2_sqrt, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; ++b) {
        float m[BLOCK], v[BLOCK], r[BLOCK], size[BLOCK], padded[BLOCK];
        const int64_t first = b * BLOCK;
        const int count = n - first < BLOCK ? (int)(n - first) : BLOCK;
        const float *grad = g + first;
        if (count < BLOCK) {  /* the last block, past the parameter's end: a zero gradient */
            for (int i = 0; i < BLOCK; ++i) padded[i] = i < count ? grad[i] : 0.0f;
            grad = padded;
        }
        int8_t *cm = qm + first;
        uint8_t *cv = qv + first;
        const float m_scale = sm[b] * (1.0f / 16129.0f), r_scale = sv[b] * (1.0f / 256.0f);
        for (int i = 0; i < BLOCK; ++i) {
            const float q = (float)cm[i];
            const float old_m = q * fabsf(q) * m_scale;
            m[i] = fmaf(new1, grad[i] - old_m, old_m);     /* torch.lerp (weight below 0.5), fused as torch's */
            const float old_r = ((float)cv[i] + 1.0f) * r_scale;  /* v ** (1/4), read back */
            const float r2 = old_r * old_r;
            v[i] = fmaf(new2 * grad[i], grad[i], r2 * r2 * beta2);  /* addcmul_, fused as torch's */
            r[i] = sqrtf(sqrtf(v[i]));
            size[i] = fabsf(m[i]);
        }
        const float top_r = block_max(r), top_m = block_max(size);
        const float inv_r = top_r > 0.0f ? 256.0f / top_r : 0.0f, inv_m = top_m > 0.0f ? 1.0f / top_m : 0.0f;
        sv[b] = top_r;
        sm[b] = top_m;
        for (int i = 0; i < BLOCK; ++i) {
            cv[i] = (uint8_t)clampf(nearbyintf(r[i] * inv_r) - 1.0f, 0.0f, 255.0f);
            cm[i] = (int8_t)copysignf(nearbyintf(sqrtf(size[i] * inv_m) * 127.0f), m[i]);
        }
        float *w = p + first;
        for (int i = 0; i < count; ++i) w[i] -= m[i] / (sqrtf(v[i]) / bias2_sqrt + eps) * step_size;
    }
}
