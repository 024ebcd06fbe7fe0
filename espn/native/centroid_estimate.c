/* The centroid first stage's estimate for one query (espn/first_stage.py, TokenCentroids):
 * for each query token, the best gain among the probed centroids a document holds a token
 * in, summed over the tokens. The probes of a token come best first, so the first time a
 * token meets a document is its best gain: a per-document stamp (the token's number + 1)
 * skips the rest. One pass over the probed posting lists; no sort, no per-list Python call.
 *
 * offsets[part] [C + 1] int64 and docs[part] [nnz] int32: each segment's postings (CSR).
 * nearest, gains [n_tokens x probe]: the probed centroids and their gains, best first.
 * allowed [n_docs] uint8 or NULL. stamp [n_docs] int32 and totals [n_docs] float64 are
 * zeroed scratch; touched receives the documents met, in the order they were met.
 * Returns how many were met, -1 when `capacity` is too small, -2 for a document number
 * outside [0, n_docs) (a damaged postings file).
 */
#include <stdint.h>

int64_t espn_centroid_estimate(int64_t n_parts, const int64_t *const *offsets, const int32_t *const *docs,
                               int64_t n_centroids, int64_t n_tokens, int64_t probe, const int64_t *nearest,
                               const float *gains, const uint8_t *allowed, int64_t n_docs, int32_t *stamp,
                               double *totals, int64_t *touched, int64_t capacity)
{
    int64_t count = 0;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int32_t mark = (int32_t)(t + 1);
        for (int64_t p = 0; p < probe; p++) {
            const int64_t c = nearest[t * probe + p];
            const double gain = (double)gains[t * probe + p];
            if (c < 0 || c >= n_centroids)
                continue;
            for (int64_t part = 0; part < n_parts; part++) {
                const int32_t *list = docs[part];
                const int64_t stop = offsets[part][c + 1];
                for (int64_t at = offsets[part][c]; at < stop; at++) {
                    const int64_t d = list[at];
                    if (d < 0 || d >= n_docs)
                        return -2;
                    if (stamp[d] == mark || (allowed && !allowed[d]))
                        continue;
                    if (stamp[d] == 0) {
                        if (count >= capacity)
                            return -1;
                        touched[count++] = d;
                    }
                    stamp[d] = mark;
                    totals[d] += gain;
                }
            }
        }
    }
    return count;
}
