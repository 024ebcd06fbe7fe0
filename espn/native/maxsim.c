/* MaxSim and CLS scores of (query, document) pairs, read straight from the stored records.
 *
 * No Python headers: the library is loaded with ctypes (espn/native_maxsim.py), which
 * releases the GIL for the call. Records are scored where the read left them (the
 * reader's buffer, or the memory reader's copy of the file): nothing is gathered or
 * decoded first. An int8 record is scored as codes times the query, with the vector's
 * scale applied to each similarity (one multiply per similarity, not per element);
 * similarities are accumulated in fp32 and never stored: each document vector's row of
 * similarities lives in registers until it has updated the running maxima.
 *
 * Record layouts (espn/store/format.py):
 *   float16: [CLS d_cls x fp16][BOW n x d_bow x fp16]
 *   int8:    [scales (1 + n) x fp16][CLS d_cls x int8][BOW n x d_bow x int8]
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DTYPE_FLOAT16 0
#define DTYPE_INT8 1
#define LANES 16 /* query vectors per column block: one AVX-512 register of fp32 */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTIVERSION
#endif

/* Everything below the entry point is inlined into it, so each of its clones is compiled
 * for its own instruction set (a call out would run the baseline's code). */
#define INLINE static inline __attribute__((always_inline))

INLINE float half_to_float(uint16_t h) {
    _Float16 value;
    memcpy(&value, &h, sizeof value);
    return (float)value;
}

/* 16 fp32 lanes: one AVX-512 register, two AVX2 ones, four SSE ones, as the clone's target
 * allows. aligned(4): loads and stores may be unaligned. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Convert four document vectors (t .. t + m - 1; the rest zero) to fp32, into conv [4 * d]. A
 * document's vectors are contiguous, so this is one vectorisable loop over m * d elements. */
#define CONVERT4(TYPE)                                                                               \
    {                                                                                                 \
        const TYPE *src = (const TYPE *)vectors + (size_t)t * d;                                      \
        const int64_t count = m * d;                                                                  \
        for (int64_t i = 0; i < count; i++) conv[i] = TO_FLOAT_##TYPE(src[i]);                        \
        for (int64_t i = count; i < 4 * d; i++) conv[i] = 0.0f;                                       \
    }
#define TO_FLOAT_int8_t(x) ((float)(x))
#define TO_FLOAT__Float16(x) ((float)(x))

/* Fold the 16 similarities in ACC of document vector t + V into best[0:16] (offset O). */
#define FOLD(ACC, V, O)                                                                              \
    if ((V) < m) {                                                                                    \
        float tmp[16];                                                                                \
        *(v16 *)tmp = ACC * (scales ? half_to_float(scales[t + (V)]) : 1.0f);                         \
        for (int j = 0; j < 16; j++) best[(O) + j] = tmp[j] > best[(O) + j] ? tmp[j] : best[(O) + j]; \
    }

/* best[0:32] = max over the document's n vectors of scale_t * <v_t, q_j> for 32 query vectors
 * (q transposed: qt[k * stride + j]). A GEMM micro-kernel: four document vectors at a time
 * against two 16-lane columns, eight accumulators in registers, so each load of a query
 * row feeds four FMAs. `block16` is its one-column twin for the last 16 query vectors. */
#define DEFINE_BLOCK32(NAME, TYPE)                                                                \
    INLINE void NAME(const void *vectors, const uint16_t *scales, int64_t n, int64_t d,               \
                     const float *qt, int64_t stride, float *best, float *conv) {                     \
        for (int j = 0; j < 32; j++) best[j] = -INFINITY;                                             \
        for (int64_t t = 0; t < n; t += 4) {                                                          \
            const int64_t m = n - t < 4 ? n - t : 4;                                                  \
            CONVERT4(TYPE)                                                                         \
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};        \
            for (int64_t k = 0; k < d; k++) {                                                         \
                const v16 r0 = *(const v16 *)(qt + k * stride), r1 = *(const v16 *)(qt + k * stride + 16); \
                const float x0 = conv[k], x1 = conv[d + k], x2 = conv[2 * d + k], x3 = conv[3 * d + k]; \
                a0 += x0 * r0; a1 += x1 * r0; a2 += x2 * r0; a3 += x3 * r0;                           \
                b0 += x0 * r1; b1 += x1 * r1; b2 += x2 * r1; b3 += x3 * r1;                           \
            }                                                                                         \
            FOLD(a0, 0, 0) FOLD(a1, 1, 0) FOLD(a2, 2, 0) FOLD(a3, 3, 0)                               \
            FOLD(b0, 0, 16) FOLD(b1, 1, 16) FOLD(b2, 2, 16) FOLD(b3, 3, 16)                           \
        }                                                                                             \
    }

#define DEFINE_BLOCK16(NAME, TYPE)                                                                \
    INLINE void NAME(const void *vectors, const uint16_t *scales, int64_t n, int64_t d,               \
                     const float *qt, int64_t stride, float *best, float *conv) {                     \
        for (int j = 0; j < 16; j++) best[j] = -INFINITY;                                             \
        for (int64_t t = 0; t < n; t += 4) {                                                          \
            const int64_t m = n - t < 4 ? n - t : 4;                                                  \
            CONVERT4(TYPE)                                                                         \
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                               \
            for (int64_t k = 0; k < d; k++) {                                                         \
                const v16 r0 = *(const v16 *)(qt + k * stride);                                       \
                a0 += conv[k] * r0; a1 += conv[d + k] * r0; a2 += conv[2 * d + k] * r0;               \
                a3 += conv[3 * d + k] * r0;                                                           \
            }                                                                                         \
            FOLD(a0, 0, 0) FOLD(a1, 1, 0) FOLD(a2, 2, 0) FOLD(a3, 3, 0)                               \
        }                                                                                             \
    }

DEFINE_BLOCK32(block32_i8, int8_t)
DEFINE_BLOCK16(block16_i8, int8_t)
DEFINE_BLOCK32(block32_f16, _Float16)
DEFINE_BLOCK16(block16_f16, _Float16)

/* Raw MaxSim sum of one pair: sum over the valid query vectors of their best similarity. */
INLINE float pair_maxsim(const void *vectors, const uint16_t *scales, int is_int8, int64_t n, int64_t d,
                         const float *qt, int64_t stride, const uint8_t *valid, float *best, float *conv) {
    if (n == 0) return 0.0f; /* a document with no vectors scores 0 */
    for (int64_t c = 0; c < stride;) {
        if (stride - c >= 32) {
            if (is_int8) block32_i8(vectors, scales, n, d, qt + c, stride, best + c, conv);
            else block32_f16(vectors, scales, n, d, qt + c, stride, best + c, conv);
            c += 32;
        } else {
            if (is_int8) block16_i8(vectors, scales, n, d, qt + c, stride, best + c, conv);
            else block16_f16(vectors, scales, n, d, qt + c, stride, best + c, conv);
            c += 16;
        }
    }
    float total = 0.0f;
    for (int64_t j = 0; j < stride; j++)
        if (valid[j]) total += best[j];
    return total;
}

/* Score P pairs.
 *   records     [n] int64: address of each document's record (kept alive by the caller)
 *   n_bow       [n] int64: its BOW vectors
 *   q_cls       [B, d_cls] fp32
 *   q_bow_t     [B, d_bow, stride] fp32: each query's BOW vectors transposed, stride a multiple
 *               of 16, columns past the query's vectors zero
 *   q_valid     [B, stride] uint8: which columns are real (unmasked) query vectors
 *   pair_query, pair_doc [P] int64; out_cls, out_bow [P] fp32 (raw sums: the caller averages)
 *   scratch     [stride + 4 * d_bow] fp32
 * Returns 0, or -1 for an unknown dtype or a stride that is not a multiple of 16. */
MULTIVERSION
int espn_score_pairs(const int64_t *records, const int64_t *n_bow, int64_t d_cls, int64_t d_bow, int dtype,
                     const float *q_cls, const float *q_bow_t, const uint8_t *q_valid, int64_t stride,
                     const int64_t *pair_query, const int64_t *pair_doc, int64_t n_pairs,
                     float *out_cls, float *out_bow, float *scratch) {
    if ((dtype != DTYPE_FLOAT16 && dtype != DTYPE_INT8) || stride <= 0 || stride % LANES) return -1;
    const int is_int8 = dtype == DTYPE_INT8;
    for (int64_t p = 0; p < n_pairs; p++) {
        const int64_t q = pair_query[p], r = pair_doc[p], n = n_bow[r];
        const uint8_t *record = (const uint8_t *)(uintptr_t)records[r];
        const float *qc = q_cls + q * d_cls;
        float dot = 0.0f;
        const void *bow;
        const uint16_t *scales = NULL;
        if (is_int8) {
            const uint16_t *all_scales = (const uint16_t *)record;
            const int8_t *cls = (const int8_t *)(record + 2 * (1 + n));
            for (int64_t k = 0; k < d_cls; k++) dot += (float)cls[k] * qc[k];
            dot *= half_to_float(all_scales[0]);
            scales = all_scales + 1;
            bow = cls + d_cls;
        } else {
            const uint16_t *cls = (const uint16_t *)record;
            for (int64_t k = 0; k < d_cls; k++) dot += half_to_float(cls[k]) * qc[k];
            bow = cls + d_cls;
        }
        out_cls[p] = dot;
        out_bow[p] = pair_maxsim(bow, scales, is_int8, n, d_bow, q_bow_t + q * d_bow * stride, stride,
                                 q_valid + q * stride, scratch, scratch + stride);
    }
    return 0;
}
