/* Native CPU kernels of the sparseforge decode engine (loaded with ctypes by runtime/kernels.py).
 *
 * Decode is memory-bandwidth bound, so every kernel streams each weight row it needs exactly once,
 * accumulates in float32, and parallelises over rows/neurons with OpenMP (per-thread accumulators,
 * no atomics). Rows stored one after another (dense matrices, the screens' tables) are read one whole row after
 * another, a single stream, prefetched SF_STREAM_AHEAD bytes ahead (on some CPUs the hardware prefetcher alone runs
 * too few lines ahead to reach the memory's bandwidth); rows gathered from a list (the sparse MLP's neurons)
 * are read four side by side while the rows SF_MLP_AHEAD entries ahead are prefetched, since no stream exists
 * there to follow. Each
 * choice measured faster than the other on its own kind of rows. Weights are float32, bfloat16, float16 or int8 with one float32 scale per row (a unit's int8
 * down columns also with one scale per output channel, applied once to sf_sparse_mlp's sum);
 * activations are float32, except that a dot product with int8 rows quantizes its input vector first
 * (blocks of 32, one float32 scale each, as llama.cpp's Q8_0) and multiplies in integers: converting every
 * int8 weight to float made the int8 kernels compute-bound at ~17 GB/s where the bandwidth is ~25.
 *
 *   sf_matvec      y[b, r] = scale[r] * dot(W[r, :], x[b, :])          dense rows (attention, lm_head)
 *   sf_predict     ids of neurons whose predictor score fc2(relu(fc1 x)) >= threshold (weights of any dtype; fc2
 *                  transposed, [rank, I], so the hidden units relu zeroed are skipped)
 *   sf_sparse_mlp  y += out_scale * sum_j act(gate_j . x, up_j . x) * down_j over the given slots of
 *                  bundles [S, 3, H] (gate row, up row, down column); a neuron whose gate already
 *                  makes the activation zero skips reading its up row and down column, one whose
 *                  activation is zero skips its down column; counts[0..2] report how many gate rows, up
 *                  rows and down columns were read (so the engine counts the bytes it touched).
 *                  Over tied halves (neuron I/2 + i: neuron i's gate row, minus its up row) it takes the pairs: one
 *                  gate and one up row give both halves, so every neuron is computed from half those rows; a
 *                  resident unit of tied halves holds pair records [I/2, 4, H] (gate row, up row, both halves'
 *                  down columns), each row once, or (the oracle's) the gate rows as a plane ahead of the rest.
 *   sf_mlp_screen  ids of the neurons (of tied halves: the pairs) an int8 copy of the gate (and up) rows cannot prove
 *                  zero, with a rigorous bound on each row's error (runtime/screen.py): sf_sparse_mlp over them equals
 *                  it over every neuron
 *   sf_predict_mlp sf_predict, then sf_sparse_mlp over the predicted neurons' slots, in one call (a hybrid
 *                  engine's CPU part: its units' neurons have fixed slots)
 *   sf_gated_act   the dense mode's activation of one row (gate and up from one stacked matvec)
 *   sf_attention_decode  a whole attention block for one row at one position (norms, qkv, RoPE, KV-cache
 *                  write, GQA attention, o projection, residual).
 *   sf_store_kv    n floats written as the KV cache stores them (float32, or float16 rounded to nearest even)
 *   sf_decode_layers  every layer of one decode step (attention block, then predictor + sparse MLP, or the
 *                  dense MLP) and the final norm in one call, from per-layer argument structs prepared at load.
 *
 * AVX2 + FMA + F16C intrinsics when the compiler targets them, a scalar fallback otherwise; the integer dots use
 * VNNI byte products (AVX512-VNNI with VL, or AVX-VNNI) where the compiler targets them, and int8 rows times a
 * quantized vector take 64 bytes at a time with AVX-512 (BW + VNNI) where it targets that (-DSF_AVX512=0: 32).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SF_AVX2 1
#else
#define SF_AVX2 0
#endif

#if SF_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SF_VNNI 1
#define SF_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif SF_AVX2 && defined(__AVXVNNI__)
#define SF_VNNI 1
#define SF_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define SF_VNNI 0
#endif
/* int8 rows times a quantized vector 64 bytes at a time: AVX-512 byte products (BW + VNNI) where the compiler
 * targets them; -DSF_AVX512=0 keeps the 32-byte path */
#if SF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SF_HAS_AVX512 1
#else
#define SF_HAS_AVX512 0
#endif
#ifndef SF_AVX512
#define SF_AVX512 SF_HAS_AVX512
#endif
#if SF_AVX512 && !SF_HAS_AVX512
#error "SF_AVX512=1 needs a target with AVX-512 F, BW and VNNI"
#endif

#ifndef SF_PREFETCH
#define SF_PREFETCH 1 /* software prefetch of rows ahead while a block is computed (-DSF_PREFETCH=0: none) */
#endif
#ifndef SF_MLP_AHEAD
#define SF_MLP_AHEAD 12 /* the sparse MLP's passes prefetch the rows this many list entries ahead (a multiple of 4: three blocks) */
#endif
#ifndef SF_STREAM_AHEAD
#define SF_STREAM_AHEAD 2048 /* rows read one after another (sf_matvec) prefetch the bytes this far ahead (0: the hardware prefetcher alone) */
#endif
#ifndef SF_PREFETCH_HINT
#define SF_PREFETCH_HINT _MM_HINT_T0 /* where prefetched rows go (-DSF_PREFETCH_HINT=_MM_HINT_T1: the L2 cache) */
#endif
#define SF_INLINE inline __attribute__((always_inline))

enum { SF_F32 = 0, SF_BF16 = 1, SF_F16 = 2, SF_I8 = 3 };
enum { ACT_SILU = 0, ACT_RELU = 1, ACT_DRELU = 2, ACT_SHIFTED_RELU = 3, ACT_FATRELU = 4 };

int sf_has_avx2(void) { return SF_AVX2; }

int sf_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static const int ELEM_SIZE[4] = {4, 2, 2, 1};

static SF_INLINE float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static SF_INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000 | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if SF_AVX2
static SF_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 weights of any dtype -> 8 floats */
static SF_INLINE __m256 load8(const void *w, int64_t i, int dtype) {
    switch (dtype) {
    case SF_F32: return _mm256_loadu_ps((const float *)w + i);
    case SF_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case SF_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    default: {
        __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    }
}
#endif

static SF_INLINE float load1(const void *w, int64_t i, int dtype) {
    switch (dtype) {
    case SF_F32: return ((const float *)w)[i];
    case SF_BF16: return bf16_to_f32(((const uint16_t *)w)[i]);
    case SF_F16: return f16_to_f32(((const uint16_t *)w)[i]);
    default: return (float)((const int8_t *)w)[i];
    }
}

/* dot(w[0:n], x[0:n]) in float32, w of `dtype` (unscaled for int8) */
static SF_INLINE float dot(const void *w, const float *x, int64_t n, int dtype) {
    int64_t i = 0;
    float s = 0.0f;
#if SF_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load8(w, i, dtype), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(w, i + 8, dtype), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8(w, i + 16, dtype), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8(w, i + 24, dtype), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w, i, dtype), _mm256_loadu_ps(x + i), a0);
    s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; i < n; i++) s += load1(w, i, dtype) * x[i];
    return s;
}

/* y[0:n] += a * w[0:n] */
static SF_INLINE void axpy(float a, const void *w, float *y, int64_t n, int dtype) {
    int64_t i = 0;
#if SF_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, load8(w, i, dtype), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * load1(w, i, dtype);
}

#if SF_AVX2
/* the byte `off` of each of the four rows the caller reads next, on its way to the cache (dot4, axpy4, dot4_q8) */
static SF_INLINE void prefetch4(const char *const *next, int64_t off) {
    for (int k = 0; k < 4; k++) _mm_prefetch(next[k] + off, SF_PREFETCH_HINT);
}
#endif

/* out[0..3] = dot(w_j, x) for four rows w_j, j < 4: four independent streams hide memory latency better
 * than one, and x is loaded once for all four. next: the four rows the caller reads after these (or NULL);
 * they are prefetched a cache line per row for every cache line read here, so the next block is on its way
 * while this one is computed. Rows of int8 or 16-bit weights are short (576 bytes for SmolLM2's int8), too
 * short for the hardware prefetcher to ramp up on: without this, streaming int8 rows ran at half the
 * bandwidth of float32 ones. */
static SF_INLINE void dot4(const void *w0, const void *w1, const void *w2, const void *w3, const float *x, int64_t n, int dtype, float *out,
                           const char *const *next) {
    int64_t i = 0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#if SF_AVX2
    const int64_t es = ELEM_SIZE[dtype], line = 64 / es;  /* elements per cache line */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        if (SF_PREFETCH && next && (i & (line - 1)) == 0) prefetch4(next, i * es);
        a0 = _mm256_fmadd_ps(load8(w0, i, dtype), xv, a0);
        a1 = _mm256_fmadd_ps(load8(w1, i, dtype), xv, a1);
        a2 = _mm256_fmadd_ps(load8(w2, i, dtype), xv, a2);
        a3 = _mm256_fmadd_ps(load8(w3, i, dtype), xv, a3);
    }
    s0 = hsum256(a0), s1 = hsum256(a1), s2 = hsum256(a2), s3 = hsum256(a3);
#else
    (void)next;
#endif
    for (; i < n; i++) {
        s0 += load1(w0, i, dtype) * x[i];
        s1 += load1(w1, i, dtype) * x[i];
        s2 += load1(w2, i, dtype) * x[i];
        s3 += load1(w3, i, dtype) * x[i];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* y[0:n] += a[0] w0 + a[1] w1 + a[2] w2 + a[3] w3: four down columns in one pass over y; next: the four
 * rows read after these (or NULL), prefetched as in dot4 */
static SF_INLINE void axpy4(const float *a, const void *w0, const void *w1, const void *w2, const void *w3, float *y, int64_t n, int dtype,
                            const char *const *next) {
    int64_t i = 0;
#if SF_AVX2
    const int64_t es = ELEM_SIZE[dtype], line = 64 / es;
    __m256 v0 = _mm256_set1_ps(a[0]), v1 = _mm256_set1_ps(a[1]), v2 = _mm256_set1_ps(a[2]), v3 = _mm256_set1_ps(a[3]);
    for (; i + 8 <= n; i += 8) {
        if (SF_PREFETCH && next && (i & (line - 1)) == 0) prefetch4(next, i * es);
        __m256 acc = _mm256_fmadd_ps(v0, load8(w0, i, dtype), _mm256_loadu_ps(y + i));
        acc = _mm256_fmadd_ps(v1, load8(w1, i, dtype), acc);
        acc = _mm256_fmadd_ps(v2, load8(w2, i, dtype), acc);
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(v3, load8(w3, i, dtype), acc));
    }
#else
    (void)next;
#endif
    for (; i < n; i++) y[i] += a[0] * load1(w0, i, dtype) + a[1] * load1(w1, i, dtype) + a[2] * load1(w2, i, dtype) + a[3] * load1(w3, i, dtype);
}

/* ---- int8 rows times a quantized vector ----
 * quantize_q8: x [n] -> q [n] int8 and d [ceil(n / QK)]: per block of QK (the last may be shorter)
 * d = max|x| / 127, q = round(x * (127 / max|x|)), so |q| <= 127 (maddubs needs |q| < 128). The PyTorch
 * reference (kernels.quantize_activations) computes the same floats. */
/* fmaxf(m, v) for m not NaN (v NaN gives m), without the library call fmaxf compiles to per element; and the
 * quantizers round with rintf, which compiles to one instruction, where lrintf is a library call (it may set
 * errno): the same round-to-nearest-even of values already clamped to the integer range */
static SF_INLINE float max_of(float m, float v) { return v > m ? v : m; }

#define QK 32
static SF_INLINE int64_t q8_blocks(int64_t n) { return (n + QK - 1) / QK; }

static void quantize_q8(const float *x, int64_t n, int8_t *q, float *d) {
    for (int64_t b0 = 0; b0 < n; b0 += QK) {
        int64_t e = b0 + QK < n ? b0 + QK : n;
        float m = 0.0f;
        for (int64_t i = b0; i < e; i++) m = max_of(m, fabsf(x[i]));
        float inv = m > 0.0f ? 127.0f / m : 0.0f;
        d[b0 / QK] = m / 127.0f;
        for (int64_t i = b0; i < e; i++) q[i] = (int8_t)(int32_t)rintf(x[i] * inv);
    }
}

#if SF_AVX2
/* acc += d * (the 32 products w_i q_i summed in 8 lanes of 4): |q| as unsigned times w with q's sign */
static SF_INLINE __m256 q8_block(__m256i aq, __m256i q, const int8_t *w, __m256 d, __m256 acc) {
    __m256i ws = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w), q);
#if SF_VNNI
    __m256i p = SF_DPBUSD(_mm256_setzero_si256(), aq, ws);
#else
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, ws), _mm256_set1_epi16(1));
#endif
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);
}
#endif

#if SF_AVX512
/* x's 64 quantized values at i in the form q8_pair reads: |q|, q's sign bits, and the two blocks' scales */
typedef struct {
    __m512i aq;
    __mmask64 neg;
    __m512 d;
} q8x64;

static SF_INLINE q8x64 q8_load64(const int8_t *q, const float *d, int64_t i) {
    __m512i qv = _mm512_loadu_si512((const void *)(q + i));
    __m256 lo = _mm256_broadcast_ss(d + i / QK), hi = _mm256_broadcast_ss(d + i / QK + 1);
    __m512d dd = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1);
    return (q8x64){_mm512_abs_epi8(qv), _mm512_movepi8_mask(qv), _mm512_castpd_ps(dd)};
}

/* acc += d * (two blocks' products w_i q_i summed in 16 lanes of 4): the same int32 lanes as two q8_block calls
 * (weights in [-127, 127], so negating them is exact) */
static SF_INLINE __m512 q8_pair(q8x64 x, const int8_t *w, __m512 acc) {
    __m512i wv = _mm512_loadu_si512((const void *)w);
    __m512i ws = _mm512_mask_sub_epi8(wv, x.neg, _mm512_setzero_si512(), wv);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x.aq, ws)), x.d, acc);
}
#endif

/* the blocks from `i` on (i a multiple of QK) without SIMD: integer sums per block */
static SF_INLINE float q8_tail(const int8_t *w, const int8_t *q, const float *d, int64_t i, int64_t n) {
    float s = 0.0f;
    for (; i < n; i += QK) {
        int64_t e = i + QK < n ? i + QK : n;
        int32_t t = 0;
        for (int64_t k = i; k < e; k++) t += (int32_t)w[k] * q[k];
        s += d[i / QK] * (float)t;
    }
    return s;
}

/* dot(w, x) for an int8 row w (unscaled) and x quantized as (q, d) */
static SF_INLINE float dot_q8(const int8_t *w, const int8_t *q, const float *d, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if SF_AVX512
    __m512 a512 = _mm512_setzero_ps();
    for (; i + 2 * QK <= n; i += 2 * QK) a512 = q8_pair(q8_load64(q, d, i), w + i, a512);
    s = _mm512_reduce_add_ps(a512);
#endif
#if SF_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + QK <= n; i += QK) {
        __m256i qv = _mm256_loadu_si256((const __m256i *)(q + i));
        acc = q8_block(_mm256_sign_epi8(qv, qv), qv, w + i, _mm256_broadcast_ss(d + i / QK), acc);
    }
    s += hsum256(acc);
#endif
    return s + q8_tail(w, q, d, i, n);
}

/* dot4 for int8 rows and a quantized x; next: prefetched as in dot4 */
static SF_INLINE void dot4_q8(const int8_t *w0, const int8_t *w1, const int8_t *w2, const int8_t *w3, const int8_t *q, const float *d,
                              int64_t n, float *out, const char *const *next) {
    int64_t i = 0;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#if SF_AVX512
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
    for (; i + 2 * QK <= n; i += 2 * QK) {
        if (SF_PREFETCH && next) prefetch4(next, i);
        q8x64 xv = q8_load64(q, d, i);
        b0 = q8_pair(xv, w0 + i, b0), b1 = q8_pair(xv, w1 + i, b1), b2 = q8_pair(xv, w2 + i, b2), b3 = q8_pair(xv, w3 + i, b3);
    }
    s0 = _mm512_reduce_add_ps(b0), s1 = _mm512_reduce_add_ps(b1), s2 = _mm512_reduce_add_ps(b2), s3 = _mm512_reduce_add_ps(b3);
#endif
#if SF_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; i + QK <= n; i += QK) {
        if (SF_PREFETCH && next && (i & 63) == 0) prefetch4(next, i);
        __m256i qv = _mm256_loadu_si256((const __m256i *)(q + i)), aq = _mm256_sign_epi8(qv, qv);
        __m256 dv = _mm256_broadcast_ss(d + i / QK);
        a0 = q8_block(aq, qv, w0 + i, dv, a0);
        a1 = q8_block(aq, qv, w1 + i, dv, a1);
        a2 = q8_block(aq, qv, w2 + i, dv, a2);
        a3 = q8_block(aq, qv, w3 + i, dv, a3);
    }
    s0 += hsum256(a0), s1 += hsum256(a1), s2 += hsum256(a2), s3 += hsum256(a3);
#else
    (void)next;
#endif
    out[0] = s0 + q8_tail(w0, q, d, i, n), out[1] = s1 + q8_tail(w1, q, d, i, n);
    out[2] = s2 + q8_tail(w2, q, d, i, n), out[3] = s3 + q8_tail(w3, q, d, i, n);
}

static SF_INLINE int threads_for(int nthreads, int64_t work) {
    if (nthreads < 1) nthreads = 1;
    return work < 64 ? 1 : nthreads;  /* too little work to pay for waking a team */
}

/* Dot products with x in the form the row dtype needs: int8 rows take x quantized as (q, d) (one row of
 * quantize_q8), other dtypes take x itself. dtype is a compile-time constant in each kernel copy (SF_DISPATCH),
 * so the branch folds away. */
static SF_INLINE float dot_x(const void *w, const float *x, const int8_t *q, const float *d, int64_t n, int dtype) {
    return dtype == SF_I8 ? dot_q8((const int8_t *)w, q, d, n) : dot(w, x, n, dtype);
}

static SF_INLINE void dot4_x(const char *const *r, const float *x, const int8_t *q, const float *d, int64_t n, int dtype, float *out,
                             const char *const *next) {
    if (dtype == SF_I8)
        dot4_q8((const int8_t *)r[0], (const int8_t *)r[1], (const int8_t *)r[2], (const int8_t *)r[3], q, d, n, out, next);
    else
        dot4(r[0], r[1], r[2], r[3], x, n, dtype, out, next);
}

/* y[b * rows + r] = scale[r] * dot(W[r], x[b]) (+ bias[r]) for b < nx. W: [rows, cols] row-major. For int8 W,
 * (q, d) are the nx rows of x quantized: q [nx, cols], d [nx, q8_blocks(cols)]. The rows are shared
 * among the threads of the enclosing parallel region (matvec_impl opens one; sf_predict calls this inside its own);
 * outside a region one thread does them all. Each row is read whole before the next, so a thread's run of rows is
 * one sequential stream, not the four short streams of reading four rows side by side (dot4). */
static SF_INLINE void matvec_rows(const void *W, const float *scales, const float *bias, const int dtype, int64_t rows, int64_t cols,
                                  const float *x, const int8_t *q, const float *d, int64_t nx, float *y) {
    const char *base = (const char *)W;
    int64_t row_bytes = cols * ELEM_SIZE[dtype], nb = q8_blocks(cols);
#pragma omp for schedule(guided)
    for (int64_t r = 0; r < rows; r++) {
        const void *w = base + r * row_bytes;
#if SF_AVX2
        if (SF_PREFETCH && SF_STREAM_AHEAD > 0) {  /* the stream's bytes SF_STREAM_AHEAD on (within W), a line for each line read here */
            const int64_t from = r * row_bytes + SF_STREAM_AHEAD, to = from + row_bytes < rows * row_bytes ? from + row_bytes : rows * row_bytes;
            for (int64_t o = from; o < to; o += 64) _mm_prefetch(base + o, SF_PREFETCH_HINT);
        }
#endif
        float sc = scales ? scales[r] : 1.0f, b = bias ? bias[r] : 0.0f;
        for (int64_t j = 0; j < nx; j++) y[j * rows + r] = sc * dot_x(w, x + j * cols, q + j * cols, d + j * nb, cols, dtype) + b;
    }
}

static SF_INLINE void matvec_impl(const void *W, const float *scales, const float *bias, const int dtype, int64_t rows, int64_t cols,
                                   const float *x, const int8_t *q, const float *d, int64_t nx, float *y, int nthreads) {
#pragma omp parallel num_threads(threads_for(nthreads, rows))
    matvec_rows(W, scales, bias, dtype, rows, cols, x, q, d, nx, y);
}

/* one copy of each kernel per dtype, so the per-element dtype switch folds away at compile time */
#define SF_DISPATCH(CALL)                                   \
    switch (dtype) {                                        \
    case SF_F32: CALL(SF_F32); break;                       \
    case SF_BF16: CALL(SF_BF16); break;                     \
    case SF_F16: CALL(SF_F16); break;                       \
    default: CALL(SF_I8); break;                            \
    }

/* 0, or -1 when int8 with nx > 1 could not allocate the quantized rows (y untouched then) */
int sf_matvec(const void *W, const float *scales, const float *bias, int dtype, int64_t rows, int64_t cols,
              const float *x, int64_t nx, float *y, int nthreads) {
    int8_t *q = NULL;
    float *d = NULL;
    int64_t nb = q8_blocks(cols);
    int8_t one_q[dtype == SF_I8 && nx == 1 ? cols : 1];  /* one int8 row (decode): on the stack */
    float one_d[dtype == SF_I8 && nx == 1 ? nb : 1];
    if (dtype == SF_I8) {
        q = nx == 1 ? one_q : malloc((size_t)(nx * cols));
        d = nx == 1 ? one_d : malloc(sizeof(float) * (size_t)(nx * nb));
        if (!q || !d) {
            if (nx != 1) free(q), free(d);
            return -1;
        }
        for (int64_t j = 0; j < nx; j++) quantize_q8(x + j * cols, cols, q + j * cols, d + j * nb);
    }
#define SF_MATVEC(DT) matvec_impl(W, scales, bias, DT, rows, cols, x, q, d, nx, y, nthreads)
    SF_DISPATCH(SF_MATVEC)
    if (dtype == SF_I8 && nx != 1) free(q), free(d);
    return 0;
}

/* ---- the greedy token of the lm_head without reading all of it ----
 * One row of sf_matvec's result for float rows, without scales or bias: the same dot (matvec_rows). */
static SF_INLINE float head_row(const void *W, const int dtype, int64_t cols, const float *x, int64_t r) {
    return dot((const char *)W + r * cols * ELEM_SIZE[dtype], x, cols, dtype);
}

/* x [n] -> q [n] int16 with one scale d (x ~ d q, |q| <= 32767); returns a bound on max_j |x_j - d q_j| */
static float quantize_q16(const float *x, int64_t n, int16_t *q, float *d) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) m = max_of(m, fabsf(x[i]));
    float inv = m > 0.0f ? 32767.0f / m : 0.0f;
    *d = m / 32767.0f;
    double err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] * inv;
        v = v > -32767.0f ? v : -32767.0f, v = v < 32767.0f ? v : 32767.0f;  /* NaN -> -32767, as fmaxf then fminf */
        q[i] = (int16_t)(int32_t)rintf(v);
        const double e = fabs((double)x[i] - (double)*d * (double)q[i]);
        err = e > err ? e : err;
    }
    return (float)(err * (1.0 + 1e-6));
}

int sf_has_vnni(void) { return SF_VNNI; }

/* x rounded to int16 (quantize_q16) in the form the integer dots read: q itself, and its bytes for VNNI's
 * unsigned-by-signed byte products, q = 256 hi + lo with lo in [0, 255] and hi in [-128, 127] (|hi| kept apart,
 * as the unsigned operand; hi's sign goes onto the weights, which are in [-127, 127], so negating them is exact) */
typedef struct {
    const int16_t *q;
    const uint8_t *lo, *ahi;
    const int8_t *hi;
} q16x;

/* bytes: 3 n scratch (lo, |hi|, hi), filled only where the dots use VNNI (the other paths read q alone) */
static SF_INLINE q16x split_q16(const int16_t *q, int64_t n, uint8_t *bytes) {
    uint8_t *lo = bytes, *ahi = bytes + n;
    int8_t *hi = (int8_t *)(bytes + 2 * n);
    for (int64_t i = 0; SF_VNNI && i < n; i++) {
        int32_t v = q[i], h = v >> 8;  /* arithmetic shift: floor(v / 256) */
        lo[i] = (uint8_t)(v - 256 * h), hi[i] = (int8_t)h, ahi[i] = (uint8_t)(h < 0 ? -h : h);
    }
    return (q16x){q, lo, ahi, hi};
}


#ifndef SF_AHEAD
#define SF_AHEAD 4 /* scattered rows: the row prefetched while one is read is this many rows later in the list */
#endif

#if SF_AVX2
static SF_INLINE int64_t hsum_epi32(__m256i v) {
    int32_t lanes[8];
    int64_t s = 0;
    _mm256_storeu_si256((__m256i *)lanes, v);
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s;
}
#endif

/* Q . q exactly for one int8 row Q and the int16 vector q, summed in int32 lanes flushed to int64 every 2048
 * columns, so no lane can overflow. With VNNI, 32 columns take one dpbusd per byte of q (Q . lo and Q . hi,
 * recombined as 256 Q . hi + Q . lo): a lane adds at most 32 steps of 4 products below 255 x 127 each. Without it,
 * Q is sign-extended to int16 and pairs are multiplied and added in int32 lanes (madd): a lane adds at most 64 pairs
 * of products below 127 x 32767 each. Either way a fraction of the instructions of converting every weight to float.
 * One row at a time: rows stored one after another are then read as one sequential stream, which the hardware
 * prefetcher follows, not four short streams as reading four rows side by side (dot4) makes.
 * next: a row read after this one (or NULL),
 * prefetched a cache line per 64 columns, for rows that are not stored one after another. */
static SF_INLINE int64_t dot_i8i16(const int8_t *w, const q16x *x, int64_t n, const char *next) {
    int64_t s = 0, i = 0;
#if SF_VNNI
    while (i + 32 <= n) {
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, h0 = l0, h1 = l0;
        const int64_t stop = i + 2048 < n ? i + 2048 : n;
#define SF_STEP(L, H, j)                                                                                                         \
    do {                                                                                                                         \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (j)));                                                      \
        L = SF_DPBUSD(L, _mm256_loadu_si256((const __m256i *)(x->lo + (j))), wv);                                               \
        H = SF_DPBUSD(H, _mm256_loadu_si256((const __m256i *)(x->ahi + (j))), _mm256_sign_epi8(wv, _mm256_loadu_si256((const __m256i *)(x->hi + (j))))); \
    } while (0)
        for (; i + 64 <= stop; i += 64) {
            if (SF_PREFETCH && next) _mm_prefetch(next + i, SF_PREFETCH_HINT);
            SF_STEP(l0, h0, i);
            SF_STEP(l1, h1, i + 32);
        }
        if (i + 32 <= stop) {
            if (SF_PREFETCH && next) _mm_prefetch(next + i, SF_PREFETCH_HINT);
            SF_STEP(l0, h0, i);
            i += 32;
        }
#undef SF_STEP
        /* 256 |h| + |l| < 2^31 per lane (at most 32 steps in each accumulator): one int32 vector, summed in int64 */
        const __m256i v = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(h0, h1), 8), _mm256_add_epi32(l0, l1));
        __m256i w64 = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
        __m128i w2 = _mm_add_epi64(_mm256_castsi256_si128(w64), _mm256_extracti128_si256(w64, 1));
        s += _mm_cvtsi128_si64(w2) + _mm_extract_epi64(w2, 1);
    }
#elif SF_AVX2
    while (i + 16 <= n) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0;
        const int64_t stop = i + 2048 < n ? i + 2048 : n;
        for (; i + 32 <= stop; i += 32) {
            if (SF_PREFETCH && next && (i & 63) == 0) _mm_prefetch(next + i, SF_PREFETCH_HINT);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i))),
                                                        _mm256_loadu_si256((const __m256i *)(x->q + i))));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i + 16))),
                                                        _mm256_loadu_si256((const __m256i *)(x->q + i + 16))));
        }
        if (i + 16 <= stop) {
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + i))),
                                                        _mm256_loadu_si256((const __m256i *)(x->q + i))));
            i += 16;
        }
        s += hsum_epi32(a0) + hsum_epi32(a1);
    }
#else
    (void)next;
#endif
    for (; i < n; i++) s += (int64_t)w[i] * x->q[i];
    return s;
}

/* out[r] = Q_r . q for every row r of Q [rows, n], q = x rounded by quantize_q16 (the screens' integer dots, for
 * tests against an exact recomputation); *d receives q's scale */
void sf_screen_dots(const int8_t *Q, int64_t rows, int64_t n, const float *x, int64_t *out, float *d) {
    int16_t xq[n];
    uint8_t xb[3 * n];
    quantize_q16(x, n, xq, d);
    const q16x xs = split_q16(xq, n, xb);
    for (int64_t r = 0; r < rows; r++) out[r] = dot_i8i16(Q + r * n, &xs, n, NULL);
}

/* a min-heap of the k largest values pushed so far: h[0] is the smallest of them, *n how many it holds (<= k) */
static void keep_largest(float *h, int64_t *n, int64_t k, float v) {
    int64_t i;
    if (*n < k) {
        for (i = (*n)++; i > 0 && h[(i - 1) / 2] > v; i = (i - 1) / 2) h[i] = h[(i - 1) / 2];
    } else if (v > h[0]) {
        for (i = 0;;) {
            int64_t c = 2 * i + 1;
            if (c >= k) break;
            if (c + 1 < k && h[c + 1] < h[c]) c++;
            if (h[c] >= v) break;
            h[i] = h[c], i = c;
        }
    } else {
        return;
    }
    h[i] = v;
}

/* bounds of the sampled score fl(fl(y / t) + g) of a row whose value y lies in [a - b, a + b]: exact arithmetic in
 * double widened by 4u (|y| / t + |g|), which covers both float32 roundings (and a division done as a
 * multiplication by 1 / t); g = -inf gives -inf */
static SF_INLINE double score_bound(float a, float b, float g, double t, int upper) {
    if (isinf(g) && g < 0) return -INFINITY;
    double y = upper ? (double)a + b : (double)a - b;
    double slack = 4.0 * 5.9604644775390625e-8 * ((fabs((double)a) + b) / t + fabs((double)g)) + 1e-37;
    return upper ? y / t + g + slack : y / t + g - slack;
}

/* The rows of y = W x (as sf_matvec computes it; W [rows, cols] float32/bfloat16/float16, no scales or bias) that a
 * decode step needs, without reading most of W. Q [rows, cols] is W in int8 with per-row scales qs; x is rounded to
 * int16 with one scale d (error at most e per element), and the screened value qs[r] d (Q[r] . q) is within
 *     radius[r] |x|_1 + qabs[r] e
 * of y[r]: radius bounds the rounding of W to Q plus the float error of both sums, qabs[r] = qs[r] sum_j |Q[r, j]|
 * (runtime/head.py). The candidates are the rows that can matter, under one of three rules:
 *   - greedy (noise NULL, topk 0): rows whose interval reaches the largest lower bound; the argmax is one of them
 *     (its upper bound is at least its value, which is at least every row's lower bound). Returns the argmax,
 *     lowest r on ties.
 *   - sampling by Gumbel-max (noise [rows], temperature t > 0): rows whose upper bound of y / t + noise reaches the
 *     largest lower bound of it (score_bound), which holds the argmax of the noisy scores the same way. Returns -1.
 *   - top-k (topk in 1..SF_HEAD_TOPK): rows whose upper bound reaches the k-th largest lower bound; every row outside
 *     is below at least k rows, so the k largest (and every value tied with the k-th) are among them. Returns -1.
 * Only the candidates' rows of W are read, each with the operations sf_matvec uses (head_row). approx: float [rows],
 * the screened values, with the candidates' exact logits in their places; cand: int64 [rows] receives the
 * candidates (ascending), *ncand their count. */
#define SF_HEAD_TOPK 1024
static SF_INLINE int64_t head_screen_impl(const void *W, const int dtype, int64_t rows, int64_t cols, const int8_t *Q, const float *qs,
                                          const float *radius, const float *qabs, const float *x, const float *noise, double t,
                                          int64_t topk, float *approx, int64_t *cand, int64_t *ncand, int nthreads) {
    double l1d = 0.0;
    for (int64_t i = 0; i < cols; i++) l1d += fabs((double)x[i]);
    const float l1 = (float)(l1d * (1.0 + 1e-6));
    int16_t xq[cols];  /* one row, on the stack as in the other kernels' quantized inputs */
    float d;
    const float e = quantize_q16(x, cols, xq, &d);
    uint8_t xb[3 * cols];
    const q16x xs = split_q16(xq, cols, xb);
    float best_lo = -INFINITY, top[topk > 0 ? topk : 1];  /* greedy: the largest lower bound; top-k: the k largest */
    double best_score = -INFINITY;                          /* sampling: the largest lower bound of the scores */
    int64_t ntop = 0;
#pragma omp parallel num_threads(threads_for(nthreads, rows))
    {
        float lo = -INFINITY, mine[topk > 0 ? topk : 1];
        double score = -INFINITY;
        int64_t nmine = 0;
#pragma omp for schedule(guided) nowait
        for (int64_t r = 0; r < rows; r++) {
            approx[r] = qs[r] * d * (float)dot_i8i16(Q + r * cols, &xs, cols, NULL);
            const float b = radius[r] * l1 + qabs[r] * e;
            if (noise)
                score = fmax(score, score_bound(approx[r], b, noise[r], t, 0));
            else if (topk)
                keep_largest(mine, &nmine, topk, approx[r] - b);
            else
                lo = fmaxf(lo, approx[r] - b);
        }
#pragma omp critical
        {
            best_lo = fmaxf(best_lo, lo), best_score = fmax(best_score, score);
            for (int64_t i = 0; i < nmine; i++) keep_largest(top, &ntop, topk, mine[i]);
        }
    }
    if (topk) best_lo = ntop == topk ? top[0] : -INFINITY;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float b = radius[r] * l1 + qabs[r] * e;
        if (noise ? score_bound(approx[r], b, noise[r], t, 1) >= best_score : approx[r] + b >= best_lo) cand[n++] = r;
    }
    /* the candidates' exact logits: a few rows as a rule (one thread), many for top-k or degenerate inputs (x = 0) */
#pragma omp parallel for schedule(static) num_threads(n > 256 ? (nthreads < 1 ? 1 : nthreads) : 1)
    for (int64_t k = 0; k < n; k++) approx[cand[k]] = head_row(W, dtype, cols, x, cand[k]);
    *ncand = n;
    if (noise || topk) return -1;
    int64_t arg = n ? cand[0] : 0;
    float best = -INFINITY;
    for (int64_t k = 0; k < n; k++)
        if (approx[cand[k]] > best || k == 0) best = approx[cand[k]], arg = cand[k];
    return arg;
}

/* the rows of the lm_head a decode step needs (head_screen_impl): greedy returns the token, the other rules -1;
 * -2 for int8 W (no screen: the head is already int8) or a top-k outside 0..SF_HEAD_TOPK or t <= 0 with noise */
int64_t sf_head_screen(const void *W, int dtype, int64_t rows, int64_t cols, const int8_t *Q, const float *qs, const float *radius,
                       const float *qabs, const float *x, const float *noise, double t, int64_t topk, float *approx, int64_t *cand,
                       int64_t *ncand, int nthreads) {
    if (topk < 0 || topk > SF_HEAD_TOPK || (noise && (topk || !(t > 0.0)))) return -2;
    switch (dtype) {
    case SF_F32: return head_screen_impl(W, SF_F32, rows, cols, Q, qs, radius, qabs, x, noise, t, topk, approx, cand, ncand, nthreads);
    case SF_BF16: return head_screen_impl(W, SF_BF16, rows, cols, Q, qs, radius, qabs, x, noise, t, topk, approx, cand, ncand, nthreads);
    case SF_F16: return head_screen_impl(W, SF_F16, rows, cols, Q, qs, radius, qabs, x, noise, t, topk, approx, cand, ncand, nthreads);
    default: return -2;
    }
}

/* Predictor (no biases): z = relu(fc1 x) [rank], score = s2 * sum over r with z[r] > 0 of z[r] * fc2t[r, :] [I],
 * weights of `dtype` (int8: fc1 with per-row scales s1, fc2t with one scale per neuron s2, applied once to each
 * score; float dtypes: s1 = s2 = NULL); writes the ids with score >= threshold to out (ascending) and returns
 * their count. fc2 comes transposed, [rank, I]: each thread streams long rows over its own range of neurons (one
 * block of 32, cache-line aligned, or more), and the rows of hidden units relu zeroed are not read at all; as
 * [I, rank] its rows were as short as the rank (~128 values) and every one was read (docs/runtime.md "Kernels").
 * One parallel region: fc1's rows, then the list of live units, then the score ranges. scratch: float [rank + I]. */
static SF_INLINE int64_t predict_impl(const void *fc1, const float *s1, const void *fc2t, const float *s2, const int dtype, int64_t rank,
                                      int64_t hidden, int64_t inter, const float *x, float threshold, int64_t *out, float *scratch,
                                      int nthreads) {
    float *z = scratch, *score = scratch + rank;
    int8_t xq[dtype == SF_I8 ? hidden : 1];
    float xd[dtype == SF_I8 ? q8_blocks(hidden) : 1], a[rank + 4];
    int64_t live[rank + 4], nl = 0;
    if (dtype == SF_I8) quantize_q8(x, hidden, xq, xd);
    const int64_t es = ELEM_SIZE[dtype], row_bytes = inter * es;
    const int nt = threads_for(nthreads, inter);
    const int64_t seg = ((inter + nt - 1) / nt + QK - 1) / QK * QK;  /* neurons per thread, whole blocks of 32 */
#pragma omp parallel num_threads(nt)
    {
        matvec_rows(fc1, s1, NULL, dtype, rank, hidden, x, xq, xd, 1, z);
#pragma omp single
        for (int64_t r = 0; r < rank; r++)
            if (z[r] > 0.0f) a[nl] = z[r], live[nl++] = r;
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        int64_t c0 = t * seg, c1 = c0 + seg < inter ? c0 + seg : inter;
        if (c0 < c1) {
            float *y = score + c0;
            const int64_t m = c1 - c0;
            const char *base = (const char *)fc2t + c0 * es, *r[4], *next[4];
            memset(y, 0, sizeof(float) * m);
            int64_t k = 0;
            for (; k + 4 <= nl; k += 4) {
                for (int j = 0; j < 4; j++) r[j] = base + live[k + j] * row_bytes;
                if (k + 8 <= nl)
                    for (int j = 0; j < 4; j++) next[j] = base + live[k + 4 + j] * row_bytes;
                axpy4(a + k, r[0], r[1], r[2], r[3], y, m, dtype, k + 8 <= nl ? next : NULL);
            }
            for (; k < nl; k++) axpy(a[k], base + live[k] * row_bytes, y, m, dtype);
            if (s2)
                for (int64_t i = 0; i < m; i++) y[i] *= s2[c0 + i];
        }
    }
    int64_t n = 0;
    for (int64_t i = 0; i < inter; i++)
        if (score[i] >= threshold) out[n++] = i;
    return n;
}

int64_t sf_predict(const void *fc1, const float *s1, const void *fc2t, const float *s2, int dtype, int64_t rank, int64_t hidden,
                   int64_t inter, const float *x, float threshold, int64_t *out, float *scratch, int nthreads) {
    int64_t n = 0;
#define SF_PREDICT(DT) n = predict_impl(fc1, s1, fc2t, s2, DT, rank, hidden, inter, x, threshold, out, scratch, nthreads)
    SF_DISPATCH(SF_PREDICT)
    return n;
}

/* act(g, u) of model's activation; *skip set when g alone makes it zero (then u is not needed). */
static SF_INLINE int gate_kills(int act, float g, float t) {
    switch (act) {
    case ACT_RELU: case ACT_DRELU: return !(g > 0.0f);
    case ACT_SHIFTED_RELU: case ACT_FATRELU: return !(g > t);
    default: return 0;
    }
}

static SF_INLINE float activation(int act, float g, float u, float t) {
    switch (act) {
    case ACT_SILU: return g / (1.0f + expf(-g)) * u;
    case ACT_RELU: return g * u;
    case ACT_DRELU: return u > 0.0f && g * u > t ? g * u : 0.0f; /* t = 0 unless thresholded (sparseforge threshold) */
    case ACT_SHIFTED_RELU: return (g - t) * u;
    default: return g * u;  /* fatrelu */
    }
}

/* One block of 4 rows: the row at byte offset part_off (0 gate, row_bytes up, 2 row_bytes down) of bundle
 * slots[idx[k]] (slots[k] when idx is NULL) for k in [k0, k0 + 4) of a list of m; a short block repeats its
 * first row (cache hits, weight 0). */
static SF_INLINE void block_rows(const char *base, int64_t bundle_bytes, int64_t part_off, const int64_t *slots, const int64_t *idx, int64_t k0,
                                 int64_t m, const char **rows) {
    int64_t left = m - k0 < 4 ? m - k0 : 4;
    for (int j = 0; j < 4; j++) {
        int64_t k = k0 + (j < left ? j : 0);
        rows[j] = base + slots[idx ? idx[k] : k] * bundle_bytes + part_off;
    }
}

/* What a sparse MLP call's list holds and how its bundles are laid out (sf_sparse_mlp's kind) */
enum {
    MLP_NEURONS = 0,     /* neurons' slots in bundles [S, 3, H] */
    MLP_SLOT_PAIRS = 1,  /* tied pairs in bundles [S, 3, H]: the first halves' slots, `second` the second halves' */
    MLP_PAIRS = 2,       /* tied pairs in pair records [S, 4, H] (gate, up, first half's down, second half's down) */
    MLP_PAIR_HALVES = 3, /* neurons of pair records [half, 4, H]: neuron j < half is pair j's first half, half + j its second */
    MLP_GATE_PLANE = 4,  /* with MLP_PAIRS or MLP_PAIR_HALVES: the records' gate rows lie apart, a plane [half, H] of
                          * them first, then the records [half, 3, H] (up, first half's down, second half's down);
                          * scales likewise, [half] then [half, 3] */
};

/* kind MLP_PAIR_HALVES: neuron ids [n] (distinct, < 2 half) -> the pairs holding them, ascending, into pairs [<= n],
 * with which halves of each are listed (bit 0 the first, bit 1 the second) into want; returns how many pairs.
 * mark: half bytes of scratch. */
static int64_t neuron_pairs(const int64_t *ids, int64_t n, int64_t half, uint8_t *mark, int64_t *pairs, uint8_t *want) {
    memset(mark, 0, (size_t)half);
    for (int64_t i = 0; i < n; i++) mark[ids[i] % half] |= (uint8_t)(ids[i] < half ? 1 : 2);
    int64_t m = 0, j = 0;
    for (; j + 8 <= half; j += 8) {  /* eight marks a word: a neuron store's arena lists few of its many records */
        uint64_t w;
        memcpy(&w, mark + j, 8);
        if (!w) continue;
        for (int64_t k = j; k < j + 8; k++)
            if (mark[k]) pairs[m] = k, want[m++] = mark[k];
    }
    for (; j < half; j++)
        if (mark[j]) pairs[m] = j, want[m++] = mark[j];
    return m;
}

/* y[0:H] += out_scale * sum over slots s of act(g_s, u_s) * down_s, bundles [S, 3, H] of `dtype`,
 * scales [S, 3] (int8 only, else NULL), channels [H] (int8 only, else NULL: a down column is its int8 row times
 * its row scale times these per-channel scales, applied once to the sum). counts[0] += gate rows read, counts[1] += up rows
 * read, counts[2] += neurons that fired (activation != 0, their down columns read).
 *
 * Tied halves (kind != MLP_NEURONS): neuron half + j has neuron j's gate row and scale and minus its up row
 * (runtime/units.py tied_bundles); one gate and one up dot give both halves (the float dot of -u is minus that of
 * u, so each half's activation is the one computed from its own rows), and the fired list is the first halves'
 * then the second halves', each ascending: over every pair that is the order sf_sparse_mlp over all the neurons
 * of untied bundles fires them in, so the sums are the same, bit for bit. The slots are pairs: with their second
 * halves' slots in `second` (MLP_SLOT_PAIRS, a neuron store's cache), or pair records [S, 4, H] with scales [S, 4]
 * (MLP_PAIRS, a resident unit); MLP_PAIR_HALVES lists neurons of pair records (`half` pairs) instead, each
 * computed alone from its pair's rows. With MLP_GATE_PLANE the records' gate rows lie in a plane of their own, so a
 * list of every pair (the oracle) reads them as one stream.
 *
 * Three passes, each over a list known before it starts, so every pass prefetches the rows SF_MLP_AHEAD entries
 * ahead while it computes a block of 4 (one block ahead left a thread waiting on memory: the rows are pieces of
 * scattered bundles, 576 bytes at int8, that the hardware prefetcher does not follow): (1) every slot's gate row;
 * (2) the up rows of the neurons whose gate does not already zero the activation; (3) the down columns of the
 * neurons that fired, accumulated per thread and the threads' sums added to y in thread order (deterministic for a
 * thread count). A single pass that decided up and down per block of 4 waited on memory twice per block. */
static SF_INLINE int sparse_mlp_impl(const void *bundles, const float *scales, const float *channels, const int dtype, int64_t hidden, const int64_t *slots,
                                       int64_t n, const float *x, int act, float threshold, float out_scale, float *y, int64_t *counts,
                                       int kind, int64_t half, const int64_t *second, int nthreads) {
    if (n <= 0) return 0;
    const char *base = (const char *)bundles;
    const int plane = kind & MLP_GATE_PLANE;
    kind &= ~MLP_GATE_PLANE;
    const int tied = kind != MLP_NEURONS;
    /* rows, as indices into bundles: slot s's gate row s * gr, its up row s * rec + up, its down rows the next ones */
    const int64_t rec = kind >= MLP_PAIRS && !plane ? 4 : 3, gr = plane ? 1 : rec, up = plane ? half : 1;
    const int64_t row_bytes = hidden * ELEM_SIZE[dtype], bundle_bytes = rec * row_bytes, per = tied ? 2 : 1;
    const int64_t neurons = kind == MLP_PAIR_HALVES ? n : per * n;
    float *g = malloc(sizeof(float) * (n + 4)), *h = malloc(sizeof(float) * per * (n + 4));
    int64_t *live = malloc(sizeof(int64_t) * (n + 4)), *fired = malloc(sizeof(int64_t) * per * (n + 4));
    int64_t *listed = kind == MLP_PAIR_HALVES ? malloc(sizeof(int64_t) * (n + 4)) : NULL;
    uint8_t *want = kind == MLP_PAIR_HALVES ? malloc((size_t)(n + 4 + half)) : NULL;
    int64_t nl = 0, nf = 0;
    int nt = threads_for(nthreads, neurons);  /* as over all the neurons, so tied and untied split the sums alike */
    float *part = malloc(sizeof(float) * (size_t)(nt * hidden));  /* per-thread sums of down columns */
    if (!g || !h || !live || !fired || !part || (kind == MLP_PAIR_HALVES && (!listed || !want))) {
        free(g), free(h), free(live), free(fired), free(part), free(listed), free(want);
        return -1;
    }
    if (kind == MLP_PAIR_HALVES) n = neuron_pairs(slots, n, half, want + n + 4, listed, want), slots = listed;
    float *h2 = h + n + 4;  /* tied: the second halves' activations, then the fired list's */
    int8_t xq[dtype == SF_I8 ? hidden : 1];  /* int8 rows: x quantized once for both dot passes */
    float xd[dtype == SF_I8 ? q8_blocks(hidden) : 1];
    if (dtype == SF_I8) quantize_q8(x, hidden, xq, xd);
#pragma omp parallel num_threads(nt)
    {
        const char *r[4], *next[4];
#pragma omp for schedule(guided) /* guided: long runs of neighbouring blocks per thread (each block prefetches the next), and on a shared machine a descheduled thread's later, smaller chunks move to the others */
        for (int64_t k0 = 0; k0 < n; k0 += 4) {
            float d[4];
            block_rows(base, gr * row_bytes, 0, slots, NULL, k0, n, r);
            if (k0 + SF_MLP_AHEAD < n) block_rows(base, gr * row_bytes, 0, slots, NULL, k0 + SF_MLP_AHEAD, n, next);
            dot4_x(r, x, xq, xd, hidden, dtype, d, k0 + SF_MLP_AHEAD < n ? next : NULL);
            for (int j = 0; j < 4 && k0 + j < n; j++) g[k0 + j] = scales ? d[j] * scales[gr * slots[k0 + j]] : d[j];
        }
#pragma omp single
        for (int64_t k = 0; k < n; k++)
            if (!gate_kills(act, g[k], threshold)) live[nl++] = k;
#pragma omp for schedule(guided)
        for (int64_t k0 = 0; k0 < nl; k0 += 4) {
            float u[4];
            block_rows(base, bundle_bytes, up * row_bytes, slots, live, k0, nl, r);
            if (k0 + SF_MLP_AHEAD < nl) block_rows(base, bundle_bytes, up * row_bytes, slots, live, k0 + SF_MLP_AHEAD, nl, next);
            dot4_x(r, x, xq, xd, hidden, dtype, u, k0 + SF_MLP_AHEAD < nl ? next : NULL);
            for (int j = 0; j < 4 && k0 + j < nl; j++) {
                const int64_t k = live[k0 + j], wk = want ? want[k] : 3;
                const float *sc = scales ? scales + rec * slots[k] + up : NULL;  /* the up row's scale, then the down rows' */
                const float uk = u[j] * (sc ? sc[0] : 1.0f);
                h[k0 + j] = wk & 1 ? activation(act, g[k], uk, threshold) * out_scale * (sc ? sc[1] : 1.0f) : 0.0f;
                if (tied) h2[k0 + j] = wk & 2 ? activation(act, g[k], -uk, threshold) * out_scale * (sc ? scales[kind == MLP_SLOT_PAIRS ? 3 * second[k] + 2 : rec * slots[k] + up + 2] : 1.0f) : 0.0f;
            }
        }
#pragma omp single
        {
            /* fired: the rows of their down columns (the row after the up row, or for a pair record's second half
             * the one after that), compacted in place (nf <= j); tied: the first halves', then the second halves' */
            for (int64_t j = 0; j < nl; j++)
                if (h[j] != 0.0f) h[nf] = h[j], fired[nf++] = rec * slots[live[j]] + up + 1;
            for (int64_t j = 0; tied && j < nl; j++)
                if (h2[j] != 0.0f) h[nf] = h2[j], fired[nf++] = kind == MLP_SLOT_PAIRS ? 3 * second[live[j]] + 2 : rec * slots[live[j]] + up + 2;
        }
        /* down columns: a fixed share of the fired list per thread (static), each thread's sum in its own row of
         * `part`, the rows added in thread order: the same sums in the same order on every run. With the int8
         * kernels a last-bit difference in y could move an input's int8 rounding in the next layer, and greedy
         * decodes of the same prompt differed from run to run (they did with the guided loop and a critical
         * section here). */
        int t = 0, team = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), team = omp_get_num_threads();
#endif
        float *acc = part + (int64_t)t * hidden;
        memset(acc, 0, sizeof(float) * hidden);
#pragma omp for schedule(static)
        for (int64_t k0 = 0; k0 < nf; k0 += 4) {
            float a[4];
            for (int j = 0; j < 4; j++) a[j] = k0 + j < nf ? h[k0 + j] : 0.0f;
            block_rows(base, row_bytes, 0, fired, NULL, k0, nf, r);
            if (k0 + SF_MLP_AHEAD < nf) block_rows(base, row_bytes, 0, fired, NULL, k0 + SF_MLP_AHEAD, nf, next);
            axpy4(a, r[0], r[1], r[2], r[3], acc, hidden, dtype, k0 + SF_MLP_AHEAD < nf ? next : NULL);
        }
        if (nf > 0) {
#pragma omp for schedule(static)
            for (int64_t k = 0; k < hidden; k++) {
                float sum = part[k];
                for (int u = 1; u < team; u++) sum += part[(int64_t)u * hidden + k];
                y[k] += channels ? sum * channels[k] : sum;
            }
        }
    }
    counts[0] += n, counts[1] += nl, counts[2] += nf;
    free(g), free(h), free(live), free(fired), free(part), free(listed), free(want);
    return 0;
}

/* The dense MLP's activation for one row: h[i] = act(g[i], u[i]) with gate_up = [g (n values); u (n values)]
 * (the dense mode's gate_up matvec output); zero where the gate alone zeroes it. Returns how many h[i] != 0. */
int64_t sf_gated_act(const float *gate_up, int64_t n, int act, float threshold, float *h) {
    int64_t fired = 0;
    for (int64_t i = 0; i < n; i++) {
        float g = gate_up[i], u = gate_up[n + i];
        h[i] = gate_kills(act, g, threshold) ? 0.0f : activation(act, g, u, threshold);
        fired += h[i] != 0.0f;
    }
    return fired;
}

/* sparse_mlp_impl for the given dtype and kind (MLP_NEURONS ..., with MLP_GATE_PLANE or'ed in; half: how many pair
 * records for MLP_PAIR_HALVES or MLP_GATE_PLANE, else unused; second: MLP_SLOT_PAIRS's second halves' slots, else
 * NULL); 0, or -1 when its scratch lists (4 x n entries, 6 x n tied) could not be allocated (nothing is added to y then) */
int sf_sparse_mlp(const void *bundles, const float *scales, const float *channels, int dtype, int64_t hidden, const int64_t *slots, int64_t n,
                  int kind, int64_t half, const int64_t *second, const float *x, int act, float threshold, float out_scale, float *y,
                  int64_t *counts, int nthreads) {
    int rc = 0;
#define SF_SPARSE_MLP(DT) rc = sparse_mlp_impl(bundles, scales, channels, DT, hidden, slots, n, x, act, threshold, out_scale, y, counts, kind, half, second, nthreads)
    SF_DISPATCH(SF_SPARSE_MLP)
    return rc;
}

static double seconds_now(void);

/* n ascending pair ids (< half) of a pair predictor -> the 2n ascending neurons they stand for: each pair j is
 * neurons j and half + j (ids must hold 2n) */
static int64_t pair_neurons(int64_t *ids, int64_t n, int64_t half) {
    for (int64_t i = 0; i < n; i++) ids[n + i] = ids[i] + half;
    return 2 * n;
}

/* sf_predict's ids mapped through slot_of ([inter]: the slot of each neuron in bundles, < 0 for one computed
 * elsewhere, as a hybrid engine's device neurons are), then sf_sparse_mlp over those slots: one call per layer, so
 * nothing runs between the predictor and the MLP. inter: the predictor's outputs; pairs: they score pairs of tied
 * halves, inter of them, each standing for neurons j and inter + j (slot_of then has 2 inter entries). ids: [2 inter
 * if pairs, else inter] scratch; *predictor_seconds += the predictor's time (with the slot mapping). Returns the number
 * of neurons computed, or -1 when sf_sparse_mlp could not allocate.
 * paired (with pairs): the unit's halves are tied halves wherever both have slots (runtime/units.py MLPUnit.pairs); a
 * predicted pair whose halves both have slots is computed from its one gate and one up row (sf_sparse_mlp with the
 * second halves' slots), a half whose other half has no slot here alone.
 * half > 0: bundles are `half` pair records [half, 4, H] (runtime/units.py pair_records) of whole pairs and slot_of
 * names halves as sf_sparse_mlp's MLP_PAIR_HALVES lists them (s the first half of record s, half + s its second);
 * paired is then 0, and predicted pairs are computed a record at a time (MLP_PAIRS). */
int64_t sf_predict_mlp(const void *fc1, const float *s1, const void *fc2t, const float *s2, int p_dtype, int64_t rank, int64_t inter,
                       int pairs, const float *resid, float p_threshold, const int64_t *slot_of, int64_t *ids, float *p_scratch,
                       const void *bundles, const float *scales, const float *channels, int dtype, int64_t hidden, const float *x, int act,
                       float threshold, float out_scale, float *y, int64_t *counts, int paired, int64_t half, double *predictor_seconds, int nthreads) {
    double t0 = seconds_now();
    int64_t n = sf_predict(fc1, s1, fc2t, s2, p_dtype, rank, hidden, inter, resid, p_threshold, ids, p_scratch, nthreads), m = 0;
    if (pairs && paired) {  /* first halves' slots over ids[0..], second halves' from ids[inter], lone halves' from the end down (m + nl <= n <= inter) */
        int64_t *second = ids + inter, *end = ids + 2 * inter, nl = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t a = slot_of[ids[i]], b = slot_of[inter + ids[i]];
            if (a >= 0 && b >= 0) {
                ids[m] = a, second[m++] = b;
            } else if (a >= 0 || b >= 0) {
                *--end = a >= 0 ? a : b;
                nl++;
            }
        }
        for (int64_t i = 0; i < nl / 2; i++) {  /* the lone halves back in the predictor's order */
            const int64_t t = end[i];
            end[i] = end[nl - 1 - i], end[nl - 1 - i] = t;
        }
        *predictor_seconds += seconds_now() - t0;
        int rc = sf_sparse_mlp(bundles, scales, channels, dtype, hidden, ids, m, MLP_SLOT_PAIRS, 0, second, x, act, threshold, out_scale, y, counts, nthreads);
        if (!rc) rc = sf_sparse_mlp(bundles, scales, channels, dtype, hidden, end, nl, MLP_NEURONS, 0, NULL, x, act, threshold, out_scale, y, counts, nthreads);
        return rc ? -1 : 2 * m + nl;
    }
    const int records = pairs && half;  /* pair records of whole pairs: a predicted pair's first half names its record */
    if (pairs && !records) n = pair_neurons(ids, n, inter);
    for (int64_t i = 0; i < n; i++)
        if (slot_of[ids[i]] >= 0) ids[m++] = slot_of[ids[i]];
    *predictor_seconds += seconds_now() - t0;
    const int kind = records ? MLP_PAIRS : half ? MLP_PAIR_HALVES : MLP_NEURONS;
    int rc = sf_sparse_mlp(bundles, scales, channels, dtype, hidden, ids, m, kind, half, NULL, x, act, threshold, out_scale, y, counts, nthreads);
    return rc ? -1 : records ? 2 * m : m;
}

/* ---- the neurons of a ReLU-family MLP that an int8 screen cannot prove zero (runtime/screen.py) ----
 * Per screened matrix (gate, and for dReLU up) of a unit: Q [inter, hidden] int8 with row scales s, radius r and
 * norm n (float32 [inter], rounded up at load) such that for any float evaluation g of w . x (w the row the sparse
 * kernel reads, x float32)
 *     g <= s d (Q . q) + r |x|_2 + n |x - d q|_2
 * where x is rounded to int16 with one scale d (quantize_q16) and Q . q is summed exactly in integers. A neuron is
 * proven zero when that bound makes its gate kill the activation (gate_kills) or, for dReLU with up tables, makes
 * up <= 0 or, with a threshold t > 0, bounds the product: relu(g) relu(u) <= G U <= t with G, U the gate and up bounds
 * (float rounding is monotone, so fl(g u) <= t too). The sparse kernel would compute such a neuron as zero. ids (int64 [inter]) receives the other neurons, ascending;
 * returns their count; *up_rows += the up rows screened (those of the neurons the gate did not prove zero). scratch:
 * rows doubles and rows bytes of working space (the gate bounds, the keep flags), so a step allocates nothing.
 * tied (dReLU): the unit's neurons are tied halves (train/tied.py), neuron rows + i with the gate row of neuron i and
 * minus its up row, rows = inter / 2; the gate tables hold the first rows only, the up tables are not read, and ids
 * receives the pairs whose shared gate row the screen cannot prove <= 0 (ascending, < rows): the sparse kernel then
 * computes each from its one gate and one up row (sf_sparse_mlp's tied), which tells which half, if either, fires. */
/* gate_kills for every float gate value g <= hi (compared in double: no rounding of hi) */
static SF_INLINE int bound_kills(int act, double hi, float t) {
    switch (act) {
    case ACT_RELU: case ACT_DRELU: return hi <= 0.0;
    case ACT_SHIFTED_RELU: case ACT_FATRELU: return hi <= (double)t;
    default: return 0;
    }
}

/* the upper bound of a screened row's float dot product from its exact integer dot o (the comment above) */
static SF_INLINE double row_bound(double o, float s, float r, float nrm, double d, double xl2, double dl2) {
    double a = (double)s * d * o, b = (double)r * xl2 + (double)nrm * dl2;
    return a + b + 1e-9 * (fabs(a) + b);  /* the double products' rounding, generously */
}

/* the keep flag of the up pass for one gate survivor: its up bound hi against 0, and with a product threshold t > 0
 * the product with the gate bound g (> 0 here), rounded up */
static SF_INLINE char up_keep(double g, double hi, int product, float t) {
    return (char)!(hi <= 0.0 || (product && g * hi * (1.0 + 1e-9) <= (double)t));
}

int64_t sf_mlp_screen(const int8_t *gq, const float *gs, const float *gr, const float *gn, const int8_t *uq, const float *us, const float *ur,
                      const float *un, int64_t inter, int64_t hidden, const float *x, int act, float t, int64_t *ids, int64_t *up_rows,
                      double *scratch, int tied, int nthreads) {
    if (inter <= 0) return 0;
    tied = tied && act == ACT_DRELU;
    if (tied) uq = NULL;
    const int64_t rows = tied ? inter / 2 : inter;
    const int product = uq != NULL && act == ACT_DRELU && t > 0.0f;
    int16_t xq[hidden];
    uint8_t xb[3 * hidden];
    float df;
    quantize_q16(x, hidden, xq, &df);
    const q16x xs = split_q16(xq, hidden, xb);
    double ss = 0.0, ds = 0.0, d = df;
    for (int64_t i = 0; i < hidden; i++) {
        double e = (double)x[i] - d * xq[i];
        ss += (double)x[i] * x[i], ds += e * e;
    }
    const double xl2 = sqrt(ss) * (1.0 + 1e-9), dl2 = sqrt(ds) * (1.0 + 1e-9);
    double *ghi = scratch;                 /* [rows]: the gate bound of each gate survivor */
    char *keep = (char *)(scratch + rows); /* [rows]: the neuron (or tied pair) is kept */
    int64_t screened = 0;
    /* one region per unit: each thread screens a fixed run of gate rows, then the up rows of its own survivors
     * (listed in its run of ids, which it owns until the region ends), so no thread waits between the passes.
     * Reading every up row of a run in order instead, where many survive, was no faster in a decode step. */
#pragma omp parallel num_threads(threads_for(nthreads, rows)) reduction(+ : screened)
    {
        int me = 0, team = 1;
#ifdef _OPENMP
        me = omp_get_thread_num(), team = omp_get_num_threads();
#endif
        const int64_t a = rows * me / team, b = rows * (me + 1) / team;
        int64_t *mine = ids + a, n = 0;
        for (int64_t i = a; i < b; i++) {  /* one stream of rows: the dot prefetches the row SF_STREAM_AHEAD bytes on (within the run), as sf_matvec */
            const char *next = SF_STREAM_AHEAD > 0 && (i + 1) * hidden + SF_STREAM_AHEAD <= b * hidden ? (const char *)gq + i * hidden + SF_STREAM_AHEAD : NULL;
            const double hi = row_bound((double)dot_i8i16(gq + i * hidden, &xs, hidden, next), gs[i], gr[i], gn[i], d, xl2, dl2);
            keep[i] = (char)!bound_kills(act, hi, t);  /* NaN keeps the neuron */
            ghi[i] = hi, mine[n] = i, n += keep[i];  /* branch-free: about half the rows survive, unpredictably */
        }
        if (!uq) n = 0;
        for (int64_t k = 0; k < n; k++) {  /* the survivors' up rows, each prefetched SF_AHEAD rows ahead */
            const int64_t i = mine[k];
            const char *next = k + SF_AHEAD < n ? (const char *)(uq + mine[k + SF_AHEAD] * hidden) : NULL;
            const double hi = row_bound((double)dot_i8i16(uq + i * hidden, &xs, hidden, next), us[i], ur[i], un[i], d, xl2, dl2);
            keep[i] = up_keep(ghi[i], hi, product, t);
        }
        screened += n;
    }
    *up_rows += screened;
    int64_t m = 0;
    for (int64_t i = 0; i < rows; i++) ids[m] = i, m += keep[i];  /* branch-free, as the survivors above */
    return m;
}

#if SF_AVX2
/* e^x for eight of the softmax's shifted scores (x <= 0): Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial in r, times 2^n), within 1 ulp of expf on [-87.33, 0], 0 below it (where e^x leaves the normal floats);
 * NaN stays NaN. The library's expf takes a call per score. */
static SF_INLINE __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    static const float c[5] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    for (int i = 0; i < 5; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_or_ps(nan, _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e))));
}
#endif

/* sc[0:n] = e^(sc - mx) (mx >= every sc), returning their sum */
static SF_INLINE float softmax_exps(float *sc, int64_t n, float mx) {
    int64_t s = 0;
    float sum = 0.0f;
#if SF_AVX2
    __m256 vm = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    for (; s + 8 <= n; s += 8) {
        __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sc + s), vm));
        _mm256_storeu_ps(sc + s, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum256(acc);
#endif
    for (; s < n; s++) sum += (sc[s] = expf(sc[s] - mx));
    return sum;
}

/* One query head over n cached positions (k, v: [n, hd] rows of kv dtype, float32 or float16): o[0:hd] =
 * softmax(scale * (q . k_s)) weighted sum of v_s; sc: n floats of scratch. Four positions at a time where AVX2 is
 * built and hd is a multiple of 8: four independent dot chains with one horizontal reduction for the four, and o
 * loaded and stored once per four values (one position at a time, each dot's reduction and o's loads and stores
 * cost more than its multiply-adds); o is divided by the exponentials' sum once at the end. kvd is a constant at
 * each call, so each cache dtype gets its own loop. */
static SF_INLINE void attend_head(const float *q, const void *k, const void *v, int kvd, int64_t n, int64_t hd, float scale, float *sc,
                                  float *o) {
    const int64_t row = hd * ELEM_SIZE[kvd];  /* bytes per cached position */
    const char *kb = (const char *)k, *vb = (const char *)v;
    int64_t s = 0;
#if SF_AVX2
    if (hd % 8 == 0)
        for (; s + 4 <= n; s += 4) {
            const char *k0 = kb + s * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int64_t j = 0; j < hd; j += 8) {
                const __m256 qj = _mm256_loadu_ps(q + j);
                a0 = _mm256_fmadd_ps(load8(k0, j, kvd), qj, a0);
                a1 = _mm256_fmadd_ps(load8(k1, j, kvd), qj, a1);
                a2 = _mm256_fmadd_ps(load8(k2, j, kvd), qj, a2);
                a3 = _mm256_fmadd_ps(load8(k3, j, kvd), qj, a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  /* lanes: the halves' sums */
            _mm_storeu_ps(sc + s, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_set1_ps(scale)));
        }
#endif
    for (; s < n; s++) sc[s] = dot(kb + s * row, q, hd, kvd) * scale;
    float mx = -INFINITY;
    for (s = 0; s < n; s++) mx = sc[s] > mx ? sc[s] : mx;
    const float inv = 1.0f / softmax_exps(sc, n, mx);
    memset(o, 0, sizeof(float) * hd);
    s = 0;
#if SF_AVX2
    if (hd % 8 == 0)
        for (; s + 4 <= n; s += 4) {
            const char *v0 = vb + s * row, *v1 = v0 + row, *v2 = v1 + row, *v3 = v2 + row;
            const __m256 w0 = _mm256_set1_ps(sc[s]), w1 = _mm256_set1_ps(sc[s + 1]), w2 = _mm256_set1_ps(sc[s + 2]), w3 = _mm256_set1_ps(sc[s + 3]);
            for (int64_t j = 0; j < hd; j += 8) {
                __m256 oj = _mm256_fmadd_ps(w0, load8(v0, j, kvd), _mm256_loadu_ps(o + j));
                oj = _mm256_fmadd_ps(w1, load8(v1, j, kvd), oj);
                oj = _mm256_fmadd_ps(w2, load8(v2, j, kvd), oj);
                _mm256_storeu_ps(o + j, _mm256_fmadd_ps(w3, load8(v3, j, kvd), oj));
            }
        }
#endif
    for (; s < n; s++) axpy(sc[s], vb + s * row, o, hd, kvd);
    for (int64_t j = 0; j < hd; j++) o[j] *= inv;
}

/* float32 -> float16, rounded to nearest even (as torch's .half()); overflow to infinity, NaN stays NaN */
static SF_INLINE uint16_t f32_to_f16(float f) {
#if SF_AVX2
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0));  /* inf, NaN */
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);                                  /* rounds past 65504 */
    if (a < 0x38800000) {                                                                    /* below 2^-14: subnormal or 0 */
        if (a < 0x33000000) return (uint16_t)sign;                                           /* below half the least subnormal */
        const uint32_t e = a >> 23, man = (a & 0x7fffff) | 0x800000, shift = 126 - e;        /* value = man 2^(e - 150) */
        uint32_t h = man >> shift;  /* in units of 2^-24, the least subnormal */
        const uint32_t rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        h += rest > half || (rest == half && (h & 1));
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10)), rest = a & 0x1fff;  /* rebias 127 -> 15 */
    h += rest > 0x1000 || (rest == 0x1000 && (h & 1));
    return (uint16_t)(sign | h);
#endif
}

/* n floats -> the cache row at dst of dtype kvd (float32 or float16) */
static void store_kv(void *dst, const float *src, int64_t n, int kvd) {
    if (kvd == SF_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    int64_t i = 0;
#if SF_AVX2
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = f32_to_f16(src[i]);
}

/* store_kv for callers outside (the tests hold its rounding to torch's on exact ties) */
void sf_store_kv(void *dst, const float *src, int64_t n, int kv_dtype) { store_kv(dst, src, n, kv_dtype); }

static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
    double ss = 0.0;  /* the mean of squares in double: one value per row, cheap, and close to torch's */
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static void rope(float *v, const float *cos, const float *sin, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One decoder layer's attention block for one row at position `pos` (0-based), in place:
 *   xn = rms_norm(x) * in_norm; q, k, v = split(qkv_w xn + qkv_b); q/k head norms (Qwen3); RoPE;
 *   k, v -> cache[:, pos]; attention of each query head over positions [max(0, pos + 1 - window), pos] of
 *   its kv head (GQA); x += o_w attn + o_b; out = rms_norm(x) * post_norm (the MLP's input).
 * k_cache, v_cache: [kv_heads, context, hd] of this layer and row, float32 (kv_dtype SF_F32) or float16 (SF_F16: keys
 * and values rounded as they are written, attended in float32). scratch: float [H + (nh + 2 kvh) hd + nh hd +
 * nh (pos + 1)]. window 0 = none. */
void sf_attention_decode(float *x, float *out, const float *in_norm, const float *post_norm, float eps, int64_t hidden,
                         const void *qkv_w, const float *qkv_s, const float *qkv_b, const void *o_w, const float *o_s,
                         const float *o_b, int dtype, const float *q_norm, const float *k_norm, const float *cos,
                         const float *sin, void *k_cache, void *v_cache, int kv_dtype, int64_t context, int64_t pos, int64_t window,
                         int64_t nh, int64_t kvh, int64_t hd, float *scratch, int nthreads) {
    float *xn = scratch, *qkv = xn + hidden, *att = qkv + (nh + 2 * kvh) * hd, *scores = att + nh * hd;
    rms_norm(x, in_norm, eps, hidden, xn);
    sf_matvec(qkv_w, qkv_s, qkv_b, dtype, (nh + 2 * kvh) * hd, hidden, xn, 1, qkv, nthreads);
    float *q = qkv, *k = qkv + nh * hd, *v = k + kvh * hd;
    for (int64_t h = 0; h < nh + kvh; h++) {  /* query heads then key heads */
        float *head = qkv + h * hd;
        const float *norm = h < nh ? q_norm : k_norm;
        if (norm) rms_norm(head, norm, eps, hd, head);
        rope(head, cos, sin, hd);
    }
    const int64_t es = ELEM_SIZE[kv_dtype];
    for (int64_t h = 0; h < kvh; h++) {
        store_kv((char *)k_cache + (h * context + pos) * hd * es, k + h * hd, hd, kv_dtype);
        store_kv((char *)v_cache + (h * context + pos) * hd * es, v + h * hd, hd, kv_dtype);
    }
    const int64_t first = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0, n = pos + 1 - first, group = nh / kvh;
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for schedule(static) num_threads(threads_for(nthreads, n * nh))
    for (int64_t h = 0; h < nh; h++) {
        const int64_t kv = ((h / group) * context + first) * hd * es;
        const char *kh = (const char *)k_cache + kv, *vh = (const char *)v_cache + kv;
        if (kv_dtype == SF_F16)
            attend_head(q + h * hd, kh, vh, SF_F16, n, hd, scale, scores + h * n, att + h * hd);
        else
            attend_head(q + h * hd, kh, vh, SF_F32, n, hd, scale, scores + h * n, att + h * hd);
    }
    sf_matvec(o_w, o_s, o_b, dtype, hidden, nh * hd, att, 1, xn, nthreads);
    for (int64_t i = 0; i < hidden; i++) x[i] += xn[i];
    rms_norm(x, post_norm, eps, hidden, out);
}

/* out = rms_norm(x) * w for one row (the final norm before lm_head). */
void sf_rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) { rms_norm(x, w, eps, n, out); }

/* ---- one decode step's layers in one call ----
 * The per-layer arguments of a fully resident, single-unit model (runtime/decode.py builds them once at load,
 * as ctypes.Structure SfLayer with these fields in this order). Per layer: the attention block, then the MLP
 * added into x: dense (gate_up != NULL: sf_matvec gate_up, sf_gated_act, sf_matvec down with x as the bias) or
 * the sparse kernel over `ids` (fc1 != NULL: the predictor's ids first, from the residual after attention; sg_q !=
 * NULL: the screen's ids first, from the MLP input; else `ids` holds every neuron). Calling this once per token instead of two or three ctypes calls per layer from
 * Python took 0.3-0.6 ms off every token, 0.5 ms of an int8 token's 5.2 (docs/runtime.md "Kernels: one call per token"). */
typedef struct {
    const float *in_norm, *post_norm;
    const void *qkv_w;
    const float *qkv_s, *qkv_b;
    const void *o_w;
    const float *o_s, *o_b, *q_norm, *k_norm;
    int64_t attn_dtype, window;
    const void *gate_up;
    const float *gate_up_s;
    const void *down;
    const float *down_s;
    int64_t gate_up_dtype, down_dtype;
    float *gu, *h;
    const void *fc1;
    const float *s1;
    const void *fc2t;
    const float *s2;
    int64_t p_dtype, rank;
    float *p_scratch;
    int64_t *ids;
    const void *bundles;
    const float *b_scales, *channels;
    int64_t b_dtype, inter, act;
    float p_threshold, act_threshold;
    const int8_t *sg_q;  /* the exact screen (sf_mlp_screen) when not NULL and fc1 is NULL: gate, then up (NULL: none) */
    const float *sg_s, *sg_r, *sg_n;
    const int8_t *su_q;
    const float *su_s, *su_r, *su_n;
    double *sg_scratch; /* the screen's gate bounds and flags (UnitScreen.scratch) */
    int64_t sg_tied;    /* the screen's tables are of tied halves: it lists pairs (sf_mlp_screen) */
    int64_t b_kind;     /* sf_sparse_mlp's kind for these bundles and ids; MLP_PAIRS (pair records, a pair at a time): every
                         * pair (ids 0..), or the predicted or screened pairs */
    int64_t p_pairs;    /* the predictor scores pairs of tied halves (inter / 2 outputs; pair j: neurons j and inter / 2 + j) */
} sf_layer;

static double seconds_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Every layer of one decode step for one row at position pos, then out = rms_norm(x) * final_norm (the lm_head's
 * input). k_cache, v_cache: layer 0's [kv_heads, context, hd] of this row (kv_dtype: as sf_attention_decode), layer i at
 * + i * layer_stride elements.
 * counts[0..2]: the sparse kernel's gate rows, up rows and down columns read (added to); stats[0] += neurons computed by the
 * sparse kernel, stats[1] += neurons the dense activation fired, stats[2] += up rows the screen read; seconds[0..2] +=
 * wall time in attention blocks, predictors or screens, and MLPs. Returns 0, or -1 when the sparse kernel could not allocate its lists (x is then partly
 * updated: the step must be discarded). */
int sf_decode_layers(const sf_layer *layers, int64_t n_layers, float *x, float *xn, const float *final_norm, float *out, float eps,
                     int64_t hidden, const float *cos, const float *sin, void *k_cache, void *v_cache, int kv_dtype, int64_t layer_stride,
                     int64_t context, int64_t pos, int64_t nh, int64_t kvh, int64_t hd, float *scratch, int64_t *counts, int64_t *stats,
                     double *seconds, int nthreads) {
    for (int64_t i = 0; i < n_layers; i++) {
        const sf_layer *L = layers + i;
        double t0 = seconds_now();
        sf_attention_decode(x, xn, L->in_norm, L->post_norm, eps, hidden, L->qkv_w, L->qkv_s, L->qkv_b, L->o_w, L->o_s, L->o_b,
                            (int)L->attn_dtype, L->q_norm, L->k_norm, cos, sin, (char *)k_cache + i * layer_stride * ELEM_SIZE[kv_dtype],
                            (char *)v_cache + i * layer_stride * ELEM_SIZE[kv_dtype], kv_dtype, context, pos, L->window, nh, kvh, hd, scratch, nthreads);
        double t1 = seconds_now(), t2 = t1;
        if (L->gate_up) {
            sf_matvec(L->gate_up, L->gate_up_s, NULL, (int)L->gate_up_dtype, 2 * L->inter, hidden, xn, 1, L->gu, nthreads);
            stats[1] += sf_gated_act(L->gu, L->inter, (int)L->act, L->act_threshold, L->h);
            sf_matvec(L->down, L->down_s, x, (int)L->down_dtype, hidden, L->inter, L->h, 1, x, nthreads);
        } else {
            int64_t n = L->inter;
            const int pairs = (L->b_kind & ~MLP_GATE_PLANE) == MLP_PAIRS;
            if (L->fc1) {
                n = sf_predict(L->fc1, L->s1, L->fc2t, L->s2, (int)L->p_dtype, L->rank, hidden, L->p_pairs ? L->inter / 2 : L->inter, x,
                               L->p_threshold, L->ids, L->p_scratch, nthreads);
                if (L->p_pairs && !pairs) n = pair_neurons(L->ids, n, L->inter / 2);  /* halves not tied in memory: each one */
                t2 = seconds_now();
            } else if (L->sg_q) {
                n = sf_mlp_screen(L->sg_q, L->sg_s, L->sg_r, L->sg_n, L->su_q, L->su_s, L->su_r, L->su_n, L->inter, hidden, xn, (int)L->act,
                                  L->act_threshold, L->ids, stats + 2, L->sg_scratch, (int)L->sg_tied, nthreads);  /* tied: pairs */
                t2 = seconds_now();
            }
            /* tied: the predicted or screened pairs (n of them), or every pair (ids 0 .. inter/2 - 1) */
            const int64_t count = pairs && !L->fc1 && !L->sg_q ? n / 2 : n;
            if (sf_sparse_mlp(L->bundles, L->b_scales, L->channels, (int)L->b_dtype, hidden, L->ids, count, (int)L->b_kind, L->inter / 2, NULL, xn,
                              (int)L->act, L->act_threshold, 1.0f, x, counts, nthreads))
                return -1;
            stats[0] += pairs ? 2 * count : n;
        }
        double t3 = seconds_now();
        seconds[0] += t1 - t0, seconds[1] += t2 - t1, seconds[2] += t3 - t2;
    }
    rms_norm(x, final_norm, eps, hidden, out);
    return 0;
}
