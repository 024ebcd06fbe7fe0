/* MaxSim and CLS scores of (query, document) pairs, read straight from the stored records.
 *
 * No Python headers: the library is loaded with ctypes (espn/maxsim_native.py), which
 * releases the GIL for the call. Records are scored where the read left them (the
 * reader's buffer, or the memory reader's copy of the file): nothing is gathered first.
 *
 * Each pair is a small GEMM followed by a column max: the document's n vectors [n, d]
 * against the query's vectors, stored transposed [d, stride]. The document is converted
 * once to fp32 (an int8 vector's scale folded in, so that the product is the similarity);
 * a register tile of ROWS document vectors x 16 query vectors then accumulates in fp32,
 * and its maxima fold into the running best of those 16 columns. The tile is sized for
 * AVX2's 16 registers (12 accumulators, 2 query rows, 1 broadcast): a tile that spills
 * runs several times slower, which the first version of this kernel did on AVX2.
 *
 * Record layouts (espn/store/format.py):
 *   float16: [CLS d_cls x fp16][BOW n x d_bow x fp16]
 *   int8:    [scales (1 + n) x fp16][CLS d_cls x int8][BOW n x d_bow x int8]
 *   residual: [CLS d_cls x fp16][centroid ids n x int32][codes n x d_bow x bits / 8]
 *             (espn/store/residual.py: vector = centroid + the residual its codes name, then
 *             scaled to unit length where the codec says so; codes packed LSB first)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DTYPE_FLOAT16 0
#define DTYPE_INT8 1
#define DTYPE_RESIDUAL 2
#define LANES 16 /* query vectors per column block (the caller pads its stride to this) */
#define ROWS 6   /* document vectors per register tile */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTIVERSION
#endif

/* Everything below the entry point is inlined into it, so each of its clones is compiled
 * for its own instruction set (a call out would run the baseline's code). */
#define INLINE static inline __attribute__((always_inline))

/* 8 fp32 lanes: one AVX2 register (two SSE ones on the baseline). aligned(4): loads and
 * stores may be unaligned. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

INLINE float half_to_float(uint16_t h) {
    _Float16 value;
    memcpy(&value, &h, sizeof value);
    return (float)value;
}

INLINE v8 vmax(v8 a, v8 b) {
    const v8i take_a = a > b;
    return (v8)(((v8i)a & take_a) | ((v8i)b & ~take_a));
}

/* conv[t * d + k] = the document's vector t in fp32 (int8: code x scale_t). The caller zeroes
 * ROWS rows past n: the last tile computes them, and the fold ignores them. */
INLINE void convert_int8(const int8_t *codes, const uint16_t *scales, int64_t n, int64_t d, float *conv) {
    for (int64_t t = 0; t < n; t++) {
        const float scale = half_to_float(scales[t]);
        const int8_t *row = codes + t * d;
        float *out = conv + t * d;
        for (int64_t k = 0; k < d; k++) out[k] = (float)row[k] * scale;
    }
}

INLINE void convert_float16(const _Float16 *values, int64_t n, int64_t d, float *conv) {
    for (int64_t i = 0; i < n * d; i++) conv[i] = (float)values[i];
}

/* The codec of residual records: centroids [n_centroids, d]; table [d * bits / 8, 256, 8 / bits]:
 * for each byte of a vector's codes and each value it may hold, the residuals of the 8 / bits
 * dimensions it packs (espn/store/residual.py, ResidualCodec.byte_table), so a byte decodes
 * with one lookup and one short vector add, not a shift, a mask and a lookup per dimension. */
typedef struct {
    const float *centroids;
    int64_t n_centroids;
    const float *table;
    int bits;
    int normalize;
} residual_codec;

/* One vector: out[k] = centroid[k] + residual of dimension k, for PER dimensions per byte. */
#define DEFINE_DECODE(NAME, PER)                                                                     \
    INLINE void NAME(const float *centroid, const uint8_t *packed, int64_t code_bytes,               \
                     const float *table, float *out) {                                              \
        for (int64_t j = 0; j < code_bytes; j++) {                                                   \
            const float *residual = table + (j * 256 + packed[j]) * PER;                             \
            for (int s = 0; s < PER; s++) out[j * PER + s] = centroid[j * PER + s] + residual[s];   \
        }                                                                                            \
    }
DEFINE_DECODE(decode_2bit, 4)
DEFINE_DECODE(decode_4bit, 2)

/* conv[t * d + k] = the document's vector t decoded (unit length if the codec says so).
 * Returns -1 for an id outside the codec (a damaged record), else 0. */
INLINE int convert_residual(const uint8_t *ids, const uint8_t *codes, int64_t n, int64_t d,
                            const residual_codec *codec, float *conv) {
    const int64_t code_bytes = d * codec->bits / 8;
    for (int64_t t = 0; t < n; t++) {
        int32_t id;
        memcpy(&id, ids + 4 * t, sizeof id);
        if (id < 0 || id >= codec->n_centroids) return -1;
        const float *centroid = codec->centroids + (int64_t)id * d;
        float *out = conv + t * d;
        if (codec->bits == 2) decode_2bit(centroid, codes + t * code_bytes, code_bytes, codec->table, out);
        else decode_4bit(centroid, codes + t * code_bytes, code_bytes, codec->table, out);
        if (codec->normalize) {
            float partial[8] = {0}; /* eight partial sums: a reduction the compiler may vectorize */
            int64_t k = 0;
            for (; k + 8 <= d; k += 8)
                for (int j = 0; j < 8; j++) partial[j] += out[k + j] * out[k + j];
            float norm = 0.0f;
            for (; k < d; k++) norm += out[k] * out[k];
            for (int j = 0; j < 8; j++) norm += partial[j];
            if (norm > 1e-24f) {
                const float inverse = 1.0f / sqrtf(norm);
                for (k = 0; k < d; k++) out[k] *= inverse;
            }
        }
    }
    return 0;
}

/* best[0:16] = max over the n document vectors in conv of <v_t, q_j>, for the 16 query
 * vectors whose transposed rows start at qt (row k at qt + k * stride). */
INLINE void column_block(const float *conv, int64_t n, int64_t d, const float *qt, int64_t stride, float *best) {
    const v8 lowest = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    v8 best0 = lowest, best1 = lowest;
    for (int64_t t = 0; t < n; t += ROWS) {
        const float *x = conv + t * d;
        v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
        v8 a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
        for (int64_t k = 0; k < d; k++) {
            const v8 r0 = *(const v8 *)(qt + k * stride), r1 = *(const v8 *)(qt + k * stride + 8);
            float s = x[k];
            a00 += s * r0; a01 += s * r1;
            s = x[d + k];
            a10 += s * r0; a11 += s * r1;
            s = x[2 * d + k];
            a20 += s * r0; a21 += s * r1;
            s = x[3 * d + k];
            a30 += s * r0; a31 += s * r1;
            s = x[4 * d + k];
            a40 += s * r0; a41 += s * r1;
            s = x[5 * d + k];
            a50 += s * r0; a51 += s * r1;
        }
        const int64_t m = n - t; /* valid rows in this tile: rows past n are padding */
        best0 = vmax(best0, a00); best1 = vmax(best1, a01);
        if (m > 1) { best0 = vmax(best0, a10); best1 = vmax(best1, a11); }
        if (m > 2) { best0 = vmax(best0, a20); best1 = vmax(best1, a21); }
        if (m > 3) { best0 = vmax(best0, a30); best1 = vmax(best1, a31); }
        if (m > 4) { best0 = vmax(best0, a40); best1 = vmax(best1, a41); }
        if (m > 5) { best0 = vmax(best0, a50); best1 = vmax(best1, a51); }
    }
    *(v8 *)best = best0;
    *(v8 *)(best + 8) = best1;
}

/* Raw MaxSim sum of one pair: sum over the valid query vectors of their best similarity. */
INLINE float pair_maxsim(const float *conv, int64_t n, int64_t d, const float *qt, int64_t stride,
                         const uint8_t *valid, float *best) {
    if (n == 0) return 0.0f; /* a document with no vectors scores 0 */
    for (int64_t c = 0; c < stride; c += LANES) column_block(conv, n, d, qt + c, stride, best + c);
    float total = 0.0f;
    for (int64_t j = 0; j < stride; j++)
        if (valid[j]) total += best[j];
    return total;
}

/* Dot product of a stored CLS vector and the query's, in eight partial sums. */
#define DEFINE_CLS_DOT(NAME, TYPE)                                                                  \
    INLINE float NAME(const TYPE *cls, const float *q, int64_t d) {                                  \
        float partial[8] = {0};                                                                      \
        int64_t k = 0;                                                                               \
        for (; k + 8 <= d; k += 8)                                                                   \
            for (int j = 0; j < 8; j++) partial[j] += (float)cls[k + j] * q[k + j];                  \
        float dot = 0.0f;                                                                            \
        for (; k < d; k++) dot += (float)cls[k] * q[k];                                              \
        for (int j = 0; j < 8; j++) dot += partial[j];                                               \
        return dot;                                                                                  \
    }
DEFINE_CLS_DOT(cls_dot_int8, int8_t)
DEFINE_CLS_DOT(cls_dot_float16, _Float16)

/* Score P pairs.
 *   records     [n] int64: address of each document's record (kept alive by the caller)
 *   n_bow       [n] int64: its BOW vectors
 *   q_cls       [B, d_cls] fp32
 *   q_bow_t     [B, d_bow, stride] fp32: each query's BOW vectors transposed, stride a multiple
 *               of 16, columns past the query's vectors zero
 *   q_valid     [B, stride] uint8: which columns are real (unmasked) query vectors
 *   pair_query, pair_doc [P] int64; out_cls, out_bow [P] fp32 (raw sums: the caller averages)
 *   scratch     [stride + (max n_bow of the pairs' documents + ROWS) * d_bow] fp32
 *   centroids, n_centroids, table, bits, normalize: the codec of residual records (else unused)
 * Returns 0; -1 for an unknown dtype, a stride that is not a multiple of 16 or a codec that does
 * not fit; -2 for a residual record naming a centroid outside the codec. */
MULTIVERSION
int espn_score_pairs(const int64_t *records, const int64_t *n_bow, int64_t d_cls, int64_t d_bow, int dtype,
                     const float *q_cls, const float *q_bow_t, const uint8_t *q_valid, int64_t stride,
                     const int64_t *pair_query, const int64_t *pair_doc, int64_t n_pairs,
                     float *out_cls, float *out_bow, float *scratch,
                     const float *centroids, int64_t n_centroids, const float *table, int bits, int normalize) {
    if ((dtype != DTYPE_FLOAT16 && dtype != DTYPE_INT8 && dtype != DTYPE_RESIDUAL) || stride <= 0 || stride % LANES)
        return -1;
    const residual_codec codec = {centroids, n_centroids, table, bits, normalize};
    if (dtype == DTYPE_RESIDUAL &&
        (centroids == NULL || table == NULL || n_centroids <= 0 || (bits != 2 && bits != 4) || (d_bow * bits) % 8))
        return -1;
    float *best = scratch, *conv = scratch + stride;
    int64_t converted = -1; /* the document now in conv: pairs of one document are often adjacent */
    for (int64_t p = 0; p < n_pairs; p++) {
        const int64_t q = pair_query[p], r = pair_doc[p], n = n_bow[r];
        const uint8_t *record = (const uint8_t *)(uintptr_t)records[r];
        const float *qc = q_cls + q * d_cls;
        const void *bow;
        const uint16_t *scales = NULL; /* the BOW vectors' scales (int8 records only) */
        if (dtype == DTYPE_RESIDUAL) {
            const _Float16 *cls = (const _Float16 *)record;
            out_cls[p] = cls_dot_float16(cls, qc, d_cls);
            if (converted != r) {
                const uint8_t *ids = record + 2 * d_cls;
                if (convert_residual(ids, ids + 4 * n, n, d_bow, &codec, conv) != 0) return -2;
                memset(conv + n * d_bow, 0, sizeof(float) * ROWS * d_bow);
                converted = r;
            }
            out_bow[p] = pair_maxsim(conv, n, d_bow, q_bow_t + q * d_bow * stride, stride, q_valid + q * stride, best);
            continue;
        }
        if (dtype == DTYPE_INT8) {
            const uint16_t *all_scales = (const uint16_t *)record;
            const int8_t *cls = (const int8_t *)(record + 2 * (1 + n));
            out_cls[p] = cls_dot_int8(cls, qc, d_cls) * half_to_float(all_scales[0]);
            scales = all_scales + 1;
            bow = cls + d_cls;
        } else {
            const _Float16 *cls = (const _Float16 *)record;
            out_cls[p] = cls_dot_float16(cls, qc, d_cls);
            bow = cls + d_cls;
        }
        if (converted != r) {
            if (scales != NULL) convert_int8((const int8_t *)bow, scales, n, d_bow, conv);
            else convert_float16((const _Float16 *)bow, n, d_bow, conv);
            memset(conv + n * d_bow, 0, sizeof(float) * ROWS * d_bow);
            converted = r;
        }
        out_bow[p] = pair_maxsim(conv, n, d_bow, q_bow_t + q * d_bow * stride, stride, q_valid + q * stride, best);
    }
    return 0;
}
