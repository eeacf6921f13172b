/* Routed experts computed on the CPU, straight from host RAM: the hybrid miss path's kernel.
 *
 * A missed expert at decode time is read once from memory and used for a handful of tokens, so
 * the work is a matrix-vector product bound by DRAM bandwidth. torch's CPU GEMM paths are built
 * for large products: for one bf16 row they re-layout the weight on every call and reach a small
 * fraction of the memory bandwidth. This file does the one thing needed: read each weight row
 * once, widen bf16 to fp32 in registers, and accumulate in fp32, over all cores.
 *
 * What it computes is `moe_reference` for the pairs handed in (see kernels/moe_reference.py):
 *   out[t] += w_p * (down[e] @ act(gate_up[e] @ x[t] + gate_up_bias[e]) + down_bias[e])
 * for every pair p = (expert e, token t, routing weight w_p). The gate_up product and the
 * activation stay in fp32; the activation is rounded to the weights' dtype before the down
 * product, as the GPU kernel rounds it before its second GEMM.
 *
 * Built at first use with the system C compiler (kernels/cpu_moe.py) and called through ctypes,
 * which releases the GIL for the call.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)   /* AVX-512 without AVX512-BF16 (Skylake-X to Ice Lake) takes the vector paths too */
#include <immintrin.h>
#endif

enum { W_BF16 = 0, W_FP32 = 1 };
enum { ACT_SWIGLU = 0, ACT_SWIGLU_CLAMPED = 1, ACT_GEGLU_TANH = 2 };
enum { ROWS_PER_TASK = 16 };

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static inline uint32_t f32_bits(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return v.u;
}

static inline float round_bf16(float f) {   /* round to nearest even, as torch's .to(bfloat16) */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) != 0x7f800000u) v.u += 0x7fffu + ((v.u >> 16) & 1u);
    v.u &= 0xffff0000u;
    return v.f;
}

/* The inputs a row is multiplied with are in the weights' dtype: bf16 rows meet bf16 inputs (the
 * hidden state as it arrives, the activation rounded to bf16), whose products are exact in fp32. */
static inline float widen(const void *w, int dtype, size_t i) {
    return dtype == W_BF16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* How far ahead of its reads a weight stream asks for lines (bytes; 0: none), set by
 * `moe_cpu_set_prefetch` (cpu_moe.py sets its PREFETCH_BYTES at load). The rows are read in order,
 * so the hardware prefetchers follow them, but they stop at every 4 KiB page and keep few lines in
 * flight per core: a core waiting on DRAM reads a few GB/s, and 15 of them fall well short of the
 * host's bandwidth. Asking ahead keeps more lines in flight (benchmarks/cpu_experts.py --prefetch
 * sweeps it). */
static int prefetch_bytes = 0;

void moe_cpu_set_prefetch(int bytes) { prefetch_bytes = bytes > 0 ? bytes : 0; }

#define TT 4   /* tokens per tile: their accumulators stay in registers while one row streams by */

#if defined(__AVX512BF16__)
/* bf16 · bf16 with AVX512-BF16: 32 products per instruction, accumulated in fp32, for NT inputs at
 * once (a constant after inlining: no work for a short tile's missing inputs). Each input keeps two
 * chains (the even and the odd 32 values of every 64) to hide the instruction's latency, and the
 * stream asks `prefetch_bytes` ahead, whatever NT is: an expert shared by two tokens of a batch is
 * read as fast as a decode's, and each token's sums are the same as if it were alone. */
static inline __attribute__((always_inline)) void bf16_rows(const uint16_t *r, int K, const uint16_t *const *xs,
                                                            const int NT, float *y, int ldy) {
    __m512 even[TT], odd[TT];
    for (int j = 0; j < NT; j++) even[j] = odd[j] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 64 <= K; k += 64) {
        if (prefetch_bytes) {
            _mm_prefetch((const char *)(r + k) + prefetch_bytes, _MM_HINT_T0);
            _mm_prefetch((const char *)(r + k) + prefetch_bytes + 64, _MM_HINT_T0);
        }
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r + k), w1 = (__m512bh)_mm512_loadu_si512(r + k + 32);
        for (int j = 0; j < NT; j++) {
            even[j] = _mm512_dpbf16_ps(even[j], w0, (__m512bh)_mm512_loadu_si512(xs[j] + k));
            odd[j] = _mm512_dpbf16_ps(odd[j], w1, (__m512bh)_mm512_loadu_si512(xs[j] + k + 32));
        }
    }
    if (k < K) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(r + k);
        for (int j = 0; j < NT; j++)
            even[j] = _mm512_dpbf16_ps(even[j], w0, (__m512bh)_mm512_loadu_si512(xs[j] + k));
    }
    for (int j = 0; j < NT; j++) y[(size_t)j * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(even[j], odd[j]));
}

#define BF16_TILE_K 32   /* whole 32-value loads */
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
/* 8 bf16 values widened to fp32 (a bf16 is an fp32's top half: a shift, exact). */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* bf16 · bf16 on AVX2 (desktop CPUs, and AVX-512 ones without BF16): 8 products a vector, exact in fp32,
 * summed in fp32 for NT inputs at once, each keeping two chains (the even and the odd 8 values of every
 * 16) to hide the FMA's latency; the stream asks `prefetch_bytes` ahead as the AVX512-BF16 form does. */
static inline __attribute__((always_inline)) void bf16_rows(const uint16_t *r, int K, const uint16_t *const *xs,
                                                            const int NT, float *y, int ldy) {
    __m256 even[TT], odd[TT];
    for (int j = 0; j < NT; j++) even[j] = odd[j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        if (prefetch_bytes && (k & 31) == 0) _mm_prefetch((const char *)(r + k) + prefetch_bytes, _MM_HINT_T0);
        const __m256 w0 = bf16x8(r + k), w1 = bf16x8(r + k + 8);
        for (int j = 0; j < NT; j++) {
            even[j] = _mm256_fmadd_ps(w0, bf16x8(xs[j] + k), even[j]);
            odd[j] = _mm256_fmadd_ps(w1, bf16x8(xs[j] + k + 8), odd[j]);
        }
    }
    if (k < K) {
        const __m256 w0 = bf16x8(r + k);
        for (int j = 0; j < NT; j++) even[j] = _mm256_fmadd_ps(w0, bf16x8(xs[j] + k), even[j]);
    }
    for (int j = 0; j < NT; j++) y[(size_t)j * ldy] = hsum256(_mm256_add_ps(even[j], odd[j]));
}

#define BF16_TILE_K 8   /* whole 8-value loads */
#endif

#if defined(BF16_TILE_K)
/* A tile of nt inputs through `bf16_rows` (NT a constant in each copy); 0 where K has a partial load. */
static int bf16_tile(const uint16_t *r, int K, const uint16_t *const *xs, int nt, float *y, int ldy) {
    if (K % BF16_TILE_K) return 0;
    switch (nt) {
    case 1: bf16_rows(r, K, xs, 1, y, ldy); break;
    case 2: bf16_rows(r, K, xs, 2, y, ldy); break;
    case 3: bf16_rows(r, K, xs, 3, y, ldy); break;
    default: bf16_rows(r, K, xs, TT, y, ldy); break;
    }
    return 1;
}
#endif

/* Portable form: each 16-wide piece of the row widened once, multiplied into TT accumulators. */
static void any_tile(const void *w, int dtype, size_t r, int K, const void *const *xs, int nt, float *y, int ldy) {
    enum { VW = 16 };
    const int body = K - K % VW;
    float acc[TT][VW];
    memset(acc, 0, sizeof(acc));
    for (int k = 0; k < body; k += VW) {
        float wf[VW];
#pragma omp simd
        for (int l = 0; l < VW; l++) wf[l] = widen(w, dtype, r + k + l);
        for (int j = 0; j < nt; j++) {
#pragma omp simd
            for (int l = 0; l < VW; l++) acc[j][l] += wf[l] * widen(xs[j], dtype, k + l);
        }
    }
    for (int j = 0; j < nt; j++) {
        float s = 0.f;
        for (int l = 0; l < VW; l++) s += acc[j][l];
        for (int k = body; k < K; k++) s += widen(w, dtype, r + k) * widen(xs[j], dtype, k);
        y[(size_t)j * ldy] = s;
    }
}

/* y[t * ldy] = dot(row, x[tok[t]]) for T inputs of `ldx` elements (tok NULL: x[t]); the row is read
 * from memory once per call. */
static void row_dots(const void *w, int dtype, size_t row, int K, const void *x, int ldx,
                     const int32_t *tok, int T, float *y, int ldy) {
    const size_t esize = dtype == W_BF16 ? 2 : 4;
    for (int t0 = 0; t0 < T; t0 += TT) {
        int nt = T - t0 < TT ? T - t0 : TT;
        const void *xs[TT];
        for (int j = 0; j < TT; j++) {   /* a short tile repeats its last input */
            int t = t0 + (j < nt ? j : nt - 1);
            xs[j] = (const char *)x + (size_t)(tok ? tok[t] : t) * ldx * esize;
        }
#if defined(BF16_TILE_K)
        if (dtype == W_BF16 &&
            bf16_tile((const uint16_t *)w + row * (size_t)K, K, (const uint16_t *const *)xs, nt, y + (size_t)t0 * ldy, ldy))
            continue;
#endif
        any_tile(w, dtype, row * (size_t)K, K, xs, nt, y + (size_t)t0 * ldy, ldy);
    }
}

static inline float activate(float g, float u, int act, float alpha, float limit) {
    switch (act) {
    case ACT_SWIGLU_CLAMPED:
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    case ACT_GEGLU_TANH: {
        const float c = 0.7978845608028654f;   /* sqrt(2 / pi) */
        return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g))) * u;
    }
    default:
        return g / (1.f + expf(-g)) * u;
    }
}

/* The team's size, set here and named on each parallel region rather than set process-wide: the
 * OpenMP runtime may be torch's own (same soname), whose intra-op thread count stays as torch set it. */
static int team = 1;

/* Size the team and pin its threads to `cpus` (the caller keeps its own affinity: it is thread 0). */
int moe_cpu_init(int threads, const int32_t *cpus, int ncpus) {
    team = threads > 0 ? threads : 1;
    int pinned = 0;
#pragma omp parallel num_threads(team) reduction(+ : pinned)
    {
        int t = omp_get_thread_num();
        if (t > 0 && ncpus > 0) {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(cpus[(t - 1) % ncpus], &set);
            pinned += sched_setaffinity(0, sizeof(set), &set) == 0;
        }
    }
    return pinned;
}

/* ---- the three phases of a call, over any weight format ---------------------------------------- */

/* How a projection of quantized experts is laid out (kernels/cpu_moe.py: `quant_layout` fills it):
 * the codes' width and meaning, the scales' dtype, and per projection (0: gate_up, 1: down) the
 * columns a scale covers and the scale row of each weight row. Group-quantized formats have one
 * scale row per weight row (sdiv 1). FP8 block scales cover sdiv rows × group columns, gate_up's
 * grid being the gate's (srows / 2 rows) stacked on the up's, so a block never straddles the two
 * (`split`: the up rows' first row, I; 0 where the projection is one grid). */
enum { CODES_TABLE = 0, CODES_FP8 = 1 };       /* code → table[code] (8 bits: the code), or e4m3 bits */
enum { S_BF16 = 0, S_FP32 = 1, S_E8M0 = 2, S_FP16 = 3 };   /* scales: bf16, fp32, e8m0 bytes (2^(e - 127)), fp16 */
typedef struct {
    int32_t bits, codes, sdtype;
    int32_t group[2], rows[2], sdiv[2], split[2], srows[2];
    float table[16];
} QuantLayout;

/* Weights of one call: dense rows (bf16 / fp32), or group-quantized rows (kernels/cpu_moe.py). */
typedef struct {
    int quantized;
    int dtype;                    /* dense: W_BF16 | W_FP32; quantized: the dtype of the experts' biases */
    const void *w[2];             /* dense rows of gate_up (E*2I, H) and down (E*H, I); or packed values */
    const void *scales[2], *qbias[2];
    int bits, group, sdtype;      /* quantized: bits 8/4/2, values per group (the 4-bit bf16 path's), S_* */
    int fp8;                      /* codes are FP8 e4m3 bits */
    int qgroup[2], rows[2], sdiv[2], split[2], srows[2];   /* QuantLayout's, per projection */
    float table[16];              /* quantized, 4 and 2 bits: the value of each code (affine: the code) */
    int affine;                   /* the table is the codes themselves (`affine_codes`) */
    /* Affine 4-bit rows meeting bf16-valued inputs (`fast`): each projection's inputs also as bf16
     * (phase-ordered rows of K) with their per-group sums (rows of K / group), so a row is
     * s * (codes . x) + b * sum(x) per group, the codes . x in bf16 dot products (exact products,
     * fp32 sums). [0]: the hidden rows (given), [1]: the activations (written in phase 2). */
    int fast;
    uint16_t *in_bf16[2];
    float *in_sum[2];
} Weights;

/* Whether the codes' values are the codes themselves (affine formats; not NF4's codebook). */
static int affine_codes(const float *table) {
    for (int i = 0; i < 16; i++)
        if (table[i] != (float)i) return 0;
    return 1;
}

static void quant_weights(Weights *W, const QuantLayout *q) {
    W->quantized = 1;
    W->bits = q->bits;
    W->group = q->group[0];
    W->sdtype = q->sdtype;
    W->fp8 = q->codes == CODES_FP8;
    for (int i = 0; i < 2; i++) {
        W->qgroup[i] = q->group[i];
        W->rows[i] = q->rows[i];
        W->sdiv[i] = q->sdiv[i] > 0 ? q->sdiv[i] : 1;
        W->split[i] = q->split[i];
        W->srows[i] = q->srows[i];
    }
    for (int i = 0; i < 16; i++) W->table[i] = q->table[i];
    W->affine = affine_codes(W->table);
}

/* Inputs of one projection for T tokens: the hidden rows (phase 1) or the pairs' activations (phase
 * 3). Dense: in the weights' dtype, rows of `K` values. Quantized: fp32 and phase-ordered, value
 * j*v + p of a row at p*(K/v) + j for v = 8/bits values per byte, so each unpacked byte's p-th value
 * meets a contiguous input vector. */

/* An IEEE half's value (GGUF's block scales are fp16): every half is exact in fp32. One instruction
 * where the CPU has F16C (every AVX-512 CPU does): a scale and a bias are read per group of 32 values,
 * as often as the group's vector work. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {   /* zero or subnormal: m * 2^-24 */
        v.f = (float)m * 5.9604644775390625e-8f;
        v.u |= sign;
    } else {
        v.u = sign | (e == 31 ? 0x7f800000u : (e + 112u) << 23) | (m << 13);
    }
    return v.f;
#endif
}

static inline float scale_at(const void *p, int sdtype, size_t i) {
    if (sdtype == S_FP16) return f16_to_f32(((const uint16_t *)p)[i]);
    if (sdtype == S_E8M0) {   /* 2^(e - 127): e = 0 is the subnormal 2^-127, e = 255 reads as inf */
        const uint32_t e = ((const uint8_t *)p)[i];
        union { uint32_t u; float f; } v;
        v.u = e ? e << 23 : 0x00400000u;
        return v.f;
    }
    return sdtype == S_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* An FP8 e4m3fn code's value: its exponent and mantissa bits moved into an fp32's (sign to the top,
 * the 4 exponent bits to the exponent's low bits, the 3 mantissa bits to the mantissa's top), which
 * reads as the value times 2^-120; exact for subnormal codes too (denormals are not flushed: no
 * -ffast-math). Codes 0x7f / 0xff are NaN. */
static inline float fp8_e4m3(uint8_t c) {
    union { uint32_t u; float f; } v;
    const uint32_t mag = c & 0x7fu;
    v.u = (mag << 20) | ((uint32_t)(c & 0x80u) << 24);
    return mag == 0x7fu ? NAN : v.f * 0x1p120f;   /* branch-free: the portable loop vectorizes */
}

/* The scale row of weight row `row` (expert-major over the stacked experts) of projection `which`. */
static inline size_t scale_row(const Weights *W, int which, size_t row) {
    const int div = W->sdiv[which];
    if (div == 1) return row;   /* a scale row per weight row (the whole grid has one per row too) */
    const size_t n = (size_t)W->rows[which], e = row / n, r = row % n, split = (size_t)W->split[which];
    const size_t sr = split && r >= split ? (size_t)W->srows[which] / 2 + (r - split) / div : r / div;
    return e * (size_t)W->srows[which] + sr;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The values of the p-th codes of 8 bytes (as 8 int32 lanes) on AVX2: FP8 e4m3 bits (times 2^120 unless
 * `fold` put that in the scale; NaN codes NaN), 8-bit codes, or `bits`-bit codes through the code table
 * (`tlo`, `thi`: two 8-entry lookups where it is not the codes themselves, `affine`). */
static inline __attribute__((always_inline)) __m256 avx2_values(__m256i by, int p, int fp8, int fold, int bits,
                                                                int affine, __m256 tlo, __m256 thi) {
    if (fp8) {
        const __m256i low7 = _mm256_set1_epi32(0x7f), mag = _mm256_and_si256(by, low7);
        __m256 w = _mm256_castsi256_ps(_mm256_or_si256(
            _mm256_slli_epi32(mag, 20), _mm256_slli_epi32(_mm256_and_si256(by, _mm256_set1_epi32(0x80)), 24)));
        if (!fold) w = _mm256_mul_ps(w, _mm256_set1_ps(0x1p120f));
        return _mm256_blendv_ps(w, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, low7)));
    }
    if (bits == 8) return _mm256_cvtepi32_ps(by);
    const __m256i code = _mm256_and_si256(_mm256_srl_epi32(by, _mm_cvtsi32_si128(p * bits)),
                                          _mm256_set1_epi32((1 << bits) - 1));
    if (affine) return _mm256_cvtepi32_ps(code);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, code), _mm256_permutevar8x32_ps(thi, code),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(code, _mm256_set1_epi32(7))));
}
#endif

/* Byte-coded rows in whole groups of a multiple of 32 values: 8-bit affine codes (int8 groups; GGUF
 * Q8_0, Q5_0/1, Q5_K repacked; GPTQ 8-bit) and FP8 e4m3 (block, channel or tensor scales). A group is
 * s * (values . x) + b * sum(x), its products in two chains and its scale and bias applied once; the
 * general loop below served these with the other formats' branches and conversions inside (1.7-2.2x the
 * time on AVX2: BENCHMARKS.md, "Byte-coded rows on the CPU"). The sums are ordered differently from w = value * s + b then w * x: the same within
 * fp32 rounding, as the 4-bit bf16 path. FP8 codes read as value * 2^-120 (`fp8_e4m3`); 2^120 joins
 * the group's scale where that stays finite, else the group's sum (both exact powers of two). */
static inline int q8_fits(const Weights *W, int group, int K) {
    return W->bits == 8 && group % 32 == 0 && K % group == 0;
}

/* A group's scale and its sum of products, FP8's 2^120 put where it is exact. */
static inline float q8_scale(const void *sc, int sdtype, size_t i, const int fp8, float *sum_scale) {
    const float s = scale_at(sc, sdtype, i);
    *sum_scale = 1.f;
    if (!fp8) return s;
    if (isfinite(s * 0x1p120f)) return s * 0x1p120f;
    *sum_scale = 0x1p120f;
    return s;
}

/* The vector words of the loops below, one set per instruction set: VQ_W fp32 lanes a vector, and
 * `vq_bytes(p)`: VQ_W bytes from p widened to int32 lanes. */
#define VQ_INLINE static inline __attribute__((always_inline))
#if defined(__AVX512F__)
#define VQ_W 16
typedef __m512 vqf;
typedef __m512i vqi;
VQ_INLINE vqf vq_zero(void) { return _mm512_setzero_ps(); }
VQ_INLINE vqf vq_load(const float *p) { return _mm512_loadu_ps(p); }
VQ_INLINE vqf vq_set1(float v) { return _mm512_set1_ps(v); }
VQ_INLINE vqf vq_add(vqf a, vqf b) { return _mm512_add_ps(a, b); }
VQ_INLINE vqf vq_mul(vqf a, vqf b) { return _mm512_mul_ps(a, b); }
VQ_INLINE vqf vq_fma(vqf a, vqf b, vqf c) { return _mm512_fmadd_ps(a, b, c); }
VQ_INLINE float vq_sum(vqf a) { return _mm512_reduce_add_ps(a); }
VQ_INLINE vqi vq_bytes(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
VQ_INLINE vqf vq_float(vqi a) { return _mm512_cvtepi32_ps(a); }
VQ_INLINE vqf vq_bits(vqi a) { return _mm512_castsi512_ps(a); }
VQ_INLINE vqi vq_and(vqi a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
VQ_INLINE vqi vq_or(vqi a, vqi b) { return _mm512_or_si512(a, b); }
VQ_INLINE vqi vq_shl(vqi a, int n) { return _mm512_slli_epi32(a, n); }
VQ_INLINE vqi vq_shr(vqi a, int n) { return _mm512_srli_epi32(a, n); }
VQ_INLINE vqf vq_nan_where(vqf w, vqi a, int v) { return _mm512_mask_mov_ps(w, _mm512_cmpeq_epi32_mask(a, _mm512_set1_epi32(v)), _mm512_set1_ps(NAN)); }
typedef struct { __m512 all; } vq_table;   /* 16 code values */
VQ_INLINE vq_table vq_table_load(const float *t) { vq_table v = {_mm512_loadu_ps(t)}; return v; }
VQ_INLINE vqf vq_lookup(vqi code, vq_table t) { return _mm512_permutexvar_ps(code, t.all); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VQ_W 8
typedef __m256 vqf;
typedef __m256i vqi;
VQ_INLINE vqf vq_zero(void) { return _mm256_setzero_ps(); }
VQ_INLINE vqf vq_load(const float *p) { return _mm256_loadu_ps(p); }
VQ_INLINE vqf vq_set1(float v) { return _mm256_set1_ps(v); }
VQ_INLINE vqf vq_add(vqf a, vqf b) { return _mm256_add_ps(a, b); }
VQ_INLINE vqf vq_mul(vqf a, vqf b) { return _mm256_mul_ps(a, b); }
VQ_INLINE vqf vq_fma(vqf a, vqf b, vqf c) { return _mm256_fmadd_ps(a, b, c); }
VQ_INLINE float vq_sum(vqf a) { return hsum256(a); }
VQ_INLINE vqi vq_bytes(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
VQ_INLINE vqf vq_float(vqi a) { return _mm256_cvtepi32_ps(a); }
VQ_INLINE vqf vq_bits(vqi a) { return _mm256_castsi256_ps(a); }
VQ_INLINE vqi vq_and(vqi a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
VQ_INLINE vqi vq_or(vqi a, vqi b) { return _mm256_or_si256(a, b); }
VQ_INLINE vqi vq_shl(vqi a, int n) { return _mm256_slli_epi32(a, n); }
VQ_INLINE vqi vq_shr(vqi a, int n) { return _mm256_srli_epi32(a, n); }
VQ_INLINE vqf vq_nan_where(vqf w, vqi a, int v) { return _mm256_blendv_ps(w, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32(v)))); }
typedef struct { __m256 lo, hi; } vq_table;   /* 16 code values, 8 a register */
VQ_INLINE vq_table vq_table_load(const float *t) { vq_table v = {_mm256_loadu_ps(t), _mm256_loadu_ps(t + 8)}; return v; }
VQ_INLINE vqf vq_lookup(vqi code, vq_table t) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, code), _mm256_permutevar8x32_ps(t.hi, code),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(code, _mm256_set1_epi32(7))));
}
#endif

#if defined(VQ_W)
/* VQ_W codes' values: 8-bit affine codes, or FP8 e4m3 bits as value * 2^-120 (NaN codes NaN). */
VQ_INLINE vqf q8_values(const uint8_t *p, const int fp8) {
    const vqi by = vq_bytes(p);
    if (!fp8) return vq_float(by);
    const vqi mag = vq_and(by, 0x7f);
    return vq_nan_where(vq_bits(vq_or(vq_shl(mag, 20), vq_and(vq_shl(by, 24), (int)0x80000000u))), mag, 0x7f);
}

/* Tokens a row meets at once: each token's sums are its own, in the order one token's are (the same
 * bits whatever the tokens beside it), the row's codes unpacked once for all of them. */
#if VQ_W == 16
#define VQ_TOKENS 4
#else
#define VQ_TOKENS 2   /* AVX2's 16 registers hold two tokens' six sums */
#endif

VQ_INLINE void q8_groups(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int fp8,
                         size_t s_at, int G, int group, const float *const *xs, const int nt, float *out) {
    vqf acc[VQ_TOKENS], accb[VQ_TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = accb[t] = vq_zero();
    for (int g = 0; g < G; g++) {
        const uint8_t *qg = q + (size_t)g * group;
        vqf d0[VQ_TOKENS], d1[VQ_TOKENS], x0[VQ_TOKENS], x1[VQ_TOKENS];
        for (int t = 0; t < nt; t++) d0[t] = d1[t] = x0[t] = x1[t] = vq_zero();
        for (int j = 0; j < group; j += 2 * VQ_W) {
            if (prefetch_bytes && ((g * group + j) & 63) == 0) _mm_prefetch((const char *)(qg + j) + prefetch_bytes, _MM_HINT_T0);
            const vqf wa = q8_values(qg + j, fp8), wb = q8_values(qg + j + VQ_W, fp8);
            for (int t = 0; t < nt; t++) {
                const float *xg = xs[t] + (size_t)g * group + j;
                const vqf xa = vq_load(xg), xb = vq_load(xg + VQ_W);
                d0[t] = vq_fma(wa, xa, d0[t]);
                d1[t] = vq_fma(wb, xb, d1[t]);
                if (bi) {
                    x0[t] = vq_add(x0[t], xa);
                    x1[t] = vq_add(x1[t], xb);
                }
            }
        }
        float sum_scale;
        const float s = q8_scale(sc, sdtype, s_at + g, fp8, &sum_scale);
        const float b = bi ? scale_at(bi, sdtype, s_at + g) : 0.f;
        for (int t = 0; t < nt; t++) {
            vqf dot = vq_add(d0[t], d1[t]);
            if (fp8 && sum_scale != 1.f) dot = vq_mul(dot, vq_set1(sum_scale));
            acc[t] = vq_fma(vq_set1(s), dot, acc[t]);
            if (bi) accb[t] = vq_fma(vq_set1(b), vq_add(x0[t], x1[t]), accb[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = vq_sum(vq_add(acc[t], accb[t]));
}
#else
static inline float q8_group_sums(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int fp8,
                                  size_t s_at, int G, int group, const float *x) {
    float acc = 0.f;
    for (int g = 0; g < G; g++) {   /* the values themselves (FP8: fp8_e4m3's), times the scale as stored */
        const uint8_t *qg = q + (size_t)g * group;
        const float *xg = x + (size_t)g * group;
        float dot = 0.f, sum = 0.f;
        if (fp8) {
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < group; j++) dot += fp8_e4m3(qg[j]) * xg[j];
        } else {
#pragma omp simd reduction(+ : dot, sum)
            for (int j = 0; j < group; j++) {
                dot += (float)qg[j] * xg[j];
                sum += xg[j];
            }
        }
        acc += scale_at(sc, sdtype, s_at + g) * dot + (bi ? scale_at(bi, sdtype, s_at + g) * sum : 0.f);
    }
    return acc;
}

#define VQ_TOKENS 1
static inline void q8_groups(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int fp8,
                             size_t s_at, int G, int group, const float *const *xs, const int nt, float *out) {
    for (int t = 0; t < nt; t++) out[t] = q8_group_sums(q, sc, bi, sdtype, fp8, s_at, G, group, xs[t]);
}
#endif

/* `q8_groups` for nt (1 or VQ_TOKENS) tokens, with the codes' kind, the scales' dtype and nt constants
 * in each copy (a scale's read per group is then a load and, for fp16, one conversion). */
#define Q8_CALL(SD, F)                                                                        \
    do {                                                                                    \
        if (nt == VQ_TOKENS) q8_groups(q, sc, bi, SD, F, s_at, G, group, xs, VQ_TOKENS, out); \
        else q8_groups(q, sc, bi, SD, F, s_at, G, group, xs, 1, out);                       \
        return;                                                                             \
    } while (0)

static void q8_row_dot(const Weights *W, int which, size_t row, int K, const float *const *xs, int nt, float *out) {
    const int group = W->qgroup[which], G = K / group;
    const size_t s_at = scale_row(W, which, row) * G;
    const uint8_t *q = (const uint8_t *)W->w[which] + row * (size_t)K;
    const void *sc = W->scales[which], *bi = W->qbias[which];
    if (W->fp8) {
        switch (W->sdtype) {
        case S_BF16: Q8_CALL(S_BF16, 1);
        case S_FP32: Q8_CALL(S_FP32, 1);
        default: Q8_CALL(W->sdtype, 1);
        }
    }
    switch (W->sdtype) {
    case S_FP16: Q8_CALL(S_FP16, 0);
    case S_BF16: Q8_CALL(S_BF16, 0);
    case S_FP32: Q8_CALL(S_FP32, 0);
    default: Q8_CALL(W->sdtype, 0);
    }
}

/* 4-bit rows in groups of a multiple of 32 values with fp32 inputs (CPUs without AVX512-BF16, and inputs
 * that are not bf16 values): affine codes, or codes through the table (NF4's codebook, MXFP4's e2m1 values
 * with e8m0 scales); as `q8_groups`, a byte's low nibble meeting the row's first phase of inputs and its
 * high nibble the second (phase order: value 2j + p at p * K/2 + j). */
static inline int q4_fits(const Weights *W, int group, int K) {
    return W->bits == 4 && !W->fp8 && group % 32 == 0 && K % group == 0;
}

#if defined(VQ_W)
VQ_INLINE void q4_groups(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int affine,
                         const float *table, size_t s_at, int G, int group, const float *const *xs, const int nt,
                         int per, float *out) {
    const vq_table codes = vq_table_load(table);
    vqf acc[VQ_TOKENS], accb[VQ_TOKENS];
    for (int t = 0; t < nt; t++) acc[t] = accb[t] = vq_zero();
    const int gbytes = group / 2;
    for (int g = 0; g < G; g++) {
        const uint8_t *qg = q + (size_t)g * gbytes;
        vqf d0[VQ_TOKENS], d1[VQ_TOKENS], s0[VQ_TOKENS], s1[VQ_TOKENS];
        for (int t = 0; t < nt; t++) d0[t] = d1[t] = s0[t] = s1[t] = vq_zero();
        for (int j = 0; j < gbytes; j += VQ_W) {
            if (prefetch_bytes && ((g * gbytes + j) & 63) == 0) _mm_prefetch((const char *)(qg + j) + prefetch_bytes, _MM_HINT_T0);
            const vqi by = vq_bytes(qg + j);
            const vqi clo = vq_and(by, 0xf), chi = vq_shr(by, 4);
            const vqf lo = affine ? vq_float(clo) : vq_lookup(clo, codes), hi = affine ? vq_float(chi) : vq_lookup(chi, codes);
            for (int t = 0; t < nt; t++) {
                const float *x0 = xs[t] + (size_t)g * gbytes + j;
                const vqf xa = vq_load(x0), xb = vq_load(x0 + per);
                d0[t] = vq_fma(lo, xa, d0[t]);
                d1[t] = vq_fma(hi, xb, d1[t]);
                if (bi) {
                    s0[t] = vq_add(s0[t], xa);
                    s1[t] = vq_add(s1[t], xb);
                }
            }
        }
        const float s = scale_at(sc, sdtype, s_at + g), b = bi ? scale_at(bi, sdtype, s_at + g) : 0.f;
        for (int t = 0; t < nt; t++) {
            acc[t] = vq_fma(vq_set1(s), vq_add(d0[t], d1[t]), acc[t]);
            if (bi) accb[t] = vq_fma(vq_set1(b), vq_add(s0[t], s1[t]), accb[t]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = vq_sum(vq_add(acc[t], accb[t]));
}
#else
static inline float q4_group_sums(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int affine,
                                  const float *table, size_t s_at, int G, int group, const float *x, int per) {
    float acc = 0.f;
    const int gbytes = group / 2;
    for (int g = 0; g < G; g++) {
        const uint8_t *qg = q + (size_t)g * gbytes;
        const float *x0 = x + (size_t)g * gbytes, *x1 = x0 + per;
        float dot = 0.f, sum = 0.f;
#pragma omp simd reduction(+ : dot, sum)
        for (int j = 0; j < gbytes; j++) {
            const float lo = affine ? (float)(qg[j] & 0xf) : table[qg[j] & 0xf], hi = affine ? (float)(qg[j] >> 4) : table[qg[j] >> 4];
            dot += lo * x0[j] + hi * x1[j];
            sum += x0[j] + x1[j];
        }
        acc += scale_at(sc, sdtype, s_at + g) * dot + (bi ? scale_at(bi, sdtype, s_at + g) * sum : 0.f);
    }
    return acc;
}

static inline void q4_groups(const uint8_t *q, const void *sc, const void *bi, const int sdtype, const int affine,
                             const float *table, size_t s_at, int G, int group, const float *const *xs, const int nt,
                             int per, float *out) {
    for (int t = 0; t < nt; t++) out[t] = q4_group_sums(q, sc, bi, sdtype, affine, table, s_at, G, group, xs[t], per);
}
#endif

#define Q4_CALL(SD, A)                                                                                  \
    do {                                                                                                \
        if (nt == VQ_TOKENS) q4_groups(q, sc, bi, SD, A, W->table, s_at, G, group, xs, VQ_TOKENS, K / 2, out); \
        else q4_groups(q, sc, bi, SD, A, W->table, s_at, G, group, xs, 1, K / 2, out);                 \
        return;                                                                                         \
    } while (0)

static void q4_row_dot(const Weights *W, int which, size_t row, int K, const float *const *xs, int nt, float *out) {
    const int group = W->qgroup[which], G = K / group;
    const size_t s_at = scale_row(W, which, row) * G;
    const uint8_t *q = (const uint8_t *)W->w[which] + row * (size_t)(K / 2);
    const void *sc = W->scales[which], *bi = W->qbias[which];
    if (!W->affine) {   /* NF4 (bf16 scales), MXFP4 (e8m0 scales) */
        switch (W->sdtype) {
        case S_E8M0: Q4_CALL(S_E8M0, 0);
        case S_BF16: Q4_CALL(S_BF16, 0);
        default: Q4_CALL(W->sdtype, 0);
        }
    }
    switch (W->sdtype) {
    case S_FP16: Q4_CALL(S_FP16, 1);
    case S_BF16: Q4_CALL(S_BF16, 1);
    case S_FP32: Q4_CALL(S_FP32, 1);
    default: Q4_CALL(W->sdtype, 1);
    }
}

/* One quantized row times one phase-ordered input. */
static float qrow_dot(const Weights *W, int which, size_t row, int K, const float *x) {
    float y;
    if (q8_fits(W, W->qgroup[which], K)) {
        q8_row_dot(W, which, row, K, &x, 1, &y);
        return y;
    }
    if (q4_fits(W, W->qgroup[which], K)) {
        q4_row_dot(W, which, row, K, &x, 1, &y);
        return y;
    }
    const int bits = W->bits, v = 8 / bits, mask = (1 << bits) - 1, per = K / v, group = W->qgroup[which];
    const int G = (K + group - 1) / group;
    const size_t row_bytes = (size_t)K * bits / 8, s_at = scale_row(W, which, row) * G;
    const uint8_t *q = (const uint8_t *)W->w[which] + row * row_bytes;
    const void *sc = W->scales[which], *bi = W->qbias[which];
    float acc = 0.f;
    int g = 0;
#if defined(__AVX512F__)
    const int gbytes = group * bits / 8;
    if (gbytes % 16 == 0) {   /* whole groups, 16 bytes at a time; a ragged last group goes below */
        __m512 vacc = _mm512_setzero_ps();
        const __m512 table = _mm512_loadu_ps(W->table);
        const __m512i vmask = _mm512_set1_epi32(mask), low7 = _mm512_set1_epi32(0x7f), sign = _mm512_set1_epi32(0x80);
        const __m512 two120 = _mm512_set1_ps(0x1p120f), nan = _mm512_set1_ps(NAN);
        for (; g < K / group; g++) {
            const float s1 = scale_at(sc, W->sdtype, s_at + g);
            /* FP8: the codes' bits read as value · 2^-120; 2^120 is folded into the scale where that
             * stays finite (the same product, rounded once either way) */
            const int fold = W->fp8 && isfinite(s1 * 0x1p120f);
            const __m512 s = _mm512_set1_ps(fold ? s1 * 0x1p120f : s1);
            const __m512 b = _mm512_set1_ps(bi ? scale_at(bi, W->sdtype, s_at + g) : 0.f);
            for (int j = g * gbytes; j < (g + 1) * gbytes; j += 16) {
                if (prefetch_bytes && (j & 63) == 0) _mm_prefetch((const char *)(q + j) + prefetch_bytes, _MM_HINT_T0);
                __m512i by = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j)));
                for (int p = 0; p < v; p++) {
                    __m512 w;
                    if (W->fp8) {
                        const __m512i mag = _mm512_and_si512(by, low7);
                        w = _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(mag, 20),
                                                                _mm512_slli_epi32(_mm512_and_si512(by, sign), 24)));
                        if (!fold) w = _mm512_mul_ps(w, two120);
                        w = _mm512_mask_mov_ps(w, _mm512_cmpeq_epi32_mask(mag, low7), nan);
                    } else if (bits == 8) {
                        w = _mm512_cvtepi32_ps(by);
                    } else {
                        __m512i code = _mm512_and_si512(_mm512_srl_epi32(by, _mm_cvtsi32_si128(p * bits)), vmask);
                        w = _mm512_permutexvar_ps(code, table);
                    }
                    vacc = _mm512_fmadd_ps(_mm512_fmadd_ps(w, s, b), _mm512_loadu_ps(x + (size_t)p * per + j), vacc);
                }
            }
        }
        acc = _mm512_reduce_add_ps(vacc);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* The same on AVX2 (desktop CPUs without AVX-512), 8 values a vector, whole groups 8 bytes at a time
     * (16 where the group allows, into two sums: an FMA's latency, not its rate, bounds one sum) */
    const int gbytes = group * bits / 8;
    if (gbytes % 8 == 0) {
        __m256 vacc0 = _mm256_setzero_ps(), vacc1 = _mm256_setzero_ps();
        const __m256 tlo = _mm256_loadu_ps(W->table), thi = _mm256_loadu_ps(W->table + 8);
        const int fp8 = W->fp8, affine = W->affine;
        for (; g < K / group; g++) {
            const float s1 = scale_at(sc, W->sdtype, s_at + g);
            const int fold = fp8 && isfinite(s1 * 0x1p120f);
            const __m256 s = _mm256_set1_ps(fold ? s1 * 0x1p120f : s1);
            const __m256 b = _mm256_set1_ps(bi ? scale_at(bi, W->sdtype, s_at + g) : 0.f);
            int j = g * gbytes;
            const int end = (g + 1) * gbytes;
            for (; j + 16 <= end; j += 16) {
                if (prefetch_bytes && (j & 63) == 0) _mm_prefetch((const char *)(q + j) + prefetch_bytes, _MM_HINT_T0);
                const __m256i by0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
                const __m256i by1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j + 8)));
                for (int p = 0; p < v; p++) {
                    const float *xp = x + (size_t)p * per + j;
                    vacc0 = _mm256_fmadd_ps(_mm256_fmadd_ps(avx2_values(by0, p, fp8, fold, bits, affine, tlo, thi), s, b), _mm256_loadu_ps(xp), vacc0);
                    vacc1 = _mm256_fmadd_ps(_mm256_fmadd_ps(avx2_values(by1, p, fp8, fold, bits, affine, tlo, thi), s, b), _mm256_loadu_ps(xp + 8), vacc1);
                }
            }
            if (j < end) {
                const __m256i by = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
                for (int p = 0; p < v; p++)
                    vacc0 = _mm256_fmadd_ps(_mm256_fmadd_ps(avx2_values(by, p, fp8, fold, bits, affine, tlo, thi), s, b),
                                            _mm256_loadu_ps(x + (size_t)p * per + j), vacc0);
            }
        }
        acc = hsum256(_mm256_add_ps(vacc0, vacc1));
    }
#endif
    for (; g < G; g++) {   /* portable form, and a ragged last group */
        const int s0 = g * group, len = K - s0 < group ? K - s0 : group;
        const float s = scale_at(sc, W->sdtype, s_at + g), b = bi ? scale_at(bi, W->sdtype, s_at + g) : 0.f;
        float dot = 0.f, sum = 0.f;
        if (W->fp8) {   /* a byte a value, v = 1 */
#pragma omp simd reduction(+ : dot)
            for (int i = s0; i < s0 + len; i++) dot += fp8_e4m3(q[i]) * x[i];
            acc += s * dot;
            continue;
        }
        for (int i = s0; i < s0 + len; i++) {
            int code = (q[(size_t)i * bits / 8] >> ((i % v) * bits)) & mask;
            float xi = x[(size_t)(i % v) * per + i / v];
            dot += (bits == 8 ? (float)code : W->table[code]) * xi;
            sum += xi;
        }
        acc += s * dot + b * sum;
    }
    return acc;
}

/* Whether affine 4-bit rows of K values in groups of `group` take `q4_rows_bf16`: whole groups of a
 * multiple of 64 values (a 32-byte load within one group), or groups of 32 read two at a time (Q4_0's
 * and GPTQ's g32; K a multiple of 64). */
static inline int q4_groups_fit(int group, int K) {
    return (group % 64 == 0 && K % group == 0) || (group == 32 && K % 64 == 0);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* One affine 4-bit row (`q4_groups_fit`) times nt tokens' bf16 inputs `xbs[t]` (phase-ordered: the low
 * nibbles' values first, then the high nibbles') with group sums `xss[t]`: the row's codes looked up
 * once for all nt (up to VQ_TOKENS), each token's sums its own, in one token's order. */
VQ_INLINE void q4_rows_bf16(const Weights *W, int which, size_t row, int K, const uint16_t *const *xbs,
                            const float *const *xss, const int nt, float *out) {
    const int per = K / 2, G = K / W->group, gbytes = W->group / 2;
    const uint8_t *q = (const uint8_t *)W->w[which] + row * (size_t)per;
    const void *sc = W->scales[which], *bi = W->qbias[which];
    /* bf16 bits of 0..15: the codes' values, looked up 32 words at a time */
    static const uint16_t codes16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                         0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_loadu_si512(codes16);
    const __m512i low = _mm512_set1_epi16(0x0f);
    __m512 tot[VQ_TOKENS];
    float bias[VQ_TOKENS];
    for (int t = 0; t < nt; t++) {
        tot[t] = _mm512_setzero_ps();
        bias[t] = 0.f;
    }
    if (W->group == 32) {   /* two groups a 32-byte load: a dot product's lanes 0-7 sum the first's bytes, 8-15 the second's */
        for (int g = 0; g < G; g += 2) {
            const int j = g * gbytes;
            if (prefetch_bytes) _mm_prefetch((const char *)(q + j) + prefetch_bytes, _MM_HINT_T0);
            const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + j)));
            const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(words, low), table);
            const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
            const __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale_at(sc, W->sdtype, row * G + g)),
                                                  _mm512_set1_ps(scale_at(sc, W->sdtype, row * G + g + 1)));
            const float b0 = bi ? scale_at(bi, W->sdtype, row * G + g) : 0.f, b1 = bi ? scale_at(bi, W->sdtype, row * G + g + 1) : 0.f;
            for (int t = 0; t < nt; t++) {
                __m512 gacc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xbs[t] + j));
                gacc = _mm512_dpbf16_ps(gacc, (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xbs[t] + per + j));
                tot[t] = _mm512_fmadd_ps(s, gacc, tot[t]);
                if (bi) bias[t] += b0 * xss[t][g] + b1 * xss[t][g + 1];
            }
        }
    } else {
        for (int g = 0; g < G; g++) {
            __m512 gacc[VQ_TOKENS];
            for (int t = 0; t < nt; t++) gacc[t] = _mm512_setzero_ps();
            for (int j = g * gbytes; j < (g + 1) * gbytes; j += 32) {
                if (prefetch_bytes) _mm_prefetch((const char *)(q + j) + prefetch_bytes, _MM_HINT_T0);
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + j)));
                const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(words, low), table);
                const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
                for (int t = 0; t < nt; t++) {
                    gacc[t] = _mm512_dpbf16_ps(gacc[t], (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xbs[t] + j));
                    gacc[t] = _mm512_dpbf16_ps(gacc[t], (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xbs[t] + per + j));
                }
            }
            const float s = scale_at(sc, W->sdtype, row * G + g), b = bi ? scale_at(bi, W->sdtype, row * G + g) : 0.f;
            for (int t = 0; t < nt; t++) {
                tot[t] = _mm512_fmadd_ps(_mm512_set1_ps(s), gacc[t], tot[t]);
                if (bi) bias[t] += b * xss[t][g];
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(tot[t]) + bias[t];
}
#define HAVE_Q4_BF16 1
#endif

/* Whether a projection of K inputs takes `q4_rows_bf16`. */
static inline int q4_fast(const Weights *W, int K) {
#if defined(HAVE_Q4_BF16)
    return W->fast && W->bits == 4 && q4_groups_fit(W->group, K);
#else
    (void)W;
    (void)K;
    return 0;
#endif
}

/* y[t * ldy] = row · x_t for T inputs (tok: which inputs; NULL: the first T). `first`: the index of
 * x's first row among the projection's inputs (where `W->in_bf16` and `W->in_sum` hold them too). */
static void rows_dot(const Weights *W, int which, size_t row, int K, const void *x, int ldx, long first,
                     const int32_t *tok, int T, float *y, int ldy) {
    if (!W->quantized) {
        row_dots(W->w[which], W->dtype, row, K, x, ldx, tok, T, y, ldy);
        return;
    }
#if defined(HAVE_Q4_BF16)
    if (q4_fast(W, K)) {   /* VQ_TOKENS tokens at a time, then one at a time */
        const int G = K / W->group;
        for (int t = 0; t < T;) {
            const int nt = T - t >= VQ_TOKENS ? VQ_TOKENS : 1;
            const uint16_t *xbs[VQ_TOKENS];
            const float *xss[VQ_TOKENS];
            float out[VQ_TOKENS];
            for (int u = 0; u < nt; u++) {
                const size_t i = (size_t)(first + (tok ? tok[t + u] : t + u));
                xbs[u] = W->in_bf16[which] + i * K;
                xss[u] = W->in_sum[which] + i * G;
            }
            if (nt == VQ_TOKENS) q4_rows_bf16(W, which, row, K, xbs, xss, VQ_TOKENS, out);
            else q4_rows_bf16(W, which, row, K, xbs, xss, 1, out);
            for (int u = 0; u < nt; u++) y[(size_t)(t + u) * ldy] = out[u];
            t += nt;
        }
        return;
    }
#endif
    if (q8_fits(W, W->qgroup[which], K) || q4_fits(W, W->qgroup[which], K)) {   /* as above, fp32 inputs */
        void (*dot)(const Weights *, int, size_t, int, const float *const *, int, float *) =
            W->bits == 8 ? q8_row_dot : q4_row_dot;
        for (int t = 0; t < T;) {
            const int nt = T - t >= VQ_TOKENS ? VQ_TOKENS : 1;
            const float *xs[VQ_TOKENS];
            float out[VQ_TOKENS];
            for (int u = 0; u < nt; u++) xs[u] = (const float *)x + (size_t)(tok ? tok[t + u] : t + u) * ldx;
            dot(W, which, row, K, xs, nt, out);
            for (int u = 0; u < nt; u++) y[(size_t)(t + u) * ldy] = out[u];
            t += nt;
        }
        return;
    }
    for (int t = 0; t < T; t++)
        y[(size_t)t * ldy] = qrow_dot(W, which, row, K, (const float *)x + (size_t)(tok ? tok[t] : t) * ldx);
}

/* The experts of one call. `experts[u]` (u < n_used) indexes the stacked host tensors; its pairs are
 * `pair_tok[pair_off[u] .. pair_off[u + 1])` with routing weights `pair_w`. `x`: (T, H) inputs as
 * `rows_dot` takes them; `scratch`: (n_pairs, 2I) fp32; `act_buf`: (n_pairs, I) activations, stored
 * as the down projection takes them (dense bf16: bf16 bits; quantized: phase-ordered fp32, rounded
 * to bf16 values when `round_act`); `out`: (T, H) fp32, added to. Dense experts may have biases. */
/* The three phases as thread `tid` of `nth` does its share of each (contiguous ranges of tasks,
 * as OpenMP's static schedule), `bar(bar_arg)` between phases: an OpenMP team or the stream
 * worker's own spinning team. Which thread computes a row never changes a result: each row is one
 * thread's, and the down rows add the experts in a fixed order. */
typedef void (*Barrier)(void *);

static inline void share_of(long n, int tid, int nth, long *lo, long *hi) {
    *lo = n * tid / nth;
    *hi = n * (tid + 1) / nth;
}

static void run_experts_part(int tid, int nth, Barrier bar, void *bar_arg, const Weights *W, const void *gate_up_bias,
                             const void *down_bias, int H, int I, int act, float alpha, float limit, int round_act,
                             int n_used, const int32_t *experts, const int32_t *pair_off, const int32_t *pair_tok,
                             const float *pair_w, const void *x, float *scratch, void *act_buf, float *out,
                             const int32_t *lim) {
    const int two_i = 2 * I;
    const int down_tasks = (H + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int n_pairs = pair_off[n_used];
    const int dense_bf16 = !W->quantized && W->dtype == W_BF16;
    const int v = W->quantized ? 8 / W->bits : 1;
    const size_t esize = dense_bf16 ? 2 : 4;
    long lo, hi;
    /* 1. gate_up rows of every used expert, for all its tokens at once. The tasks cover the rows
     * computed, not the experts' whole height: a shared expert's gate rows [0, keep) and up rows
     * [I, I + keep) only, so every thread's range holds the same bytes (an equal split of the whole
     * height would leave the threads whose range falls past `keep` idle while the others read). */
    long n_tasks = 0;
    for (int u = 0; u < n_used; u++) n_tasks += 2 * (((lim ? lim[u] : I) + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
    share_of(n_tasks, tid, nth, &lo, &hi);
    {
        int u = 0;
        long first = 0;   /* expert u's first task */
        for (long task = lo; task < hi; task++) {
            int keep, per;
            for (;;) {   /* the expert of this task: a shared expert's intermediate rows [0, keep) only */
                keep = lim ? lim[u] : I;
                per = (keep + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
                if (task < first + 2 * per) break;
                first += 2 * per;
                u++;
            }
            const int t = (int)(task - first), half = t / per;   /* half 0: gate rows, 1: up rows */
            const int r0 = half * I + (t % per) * ROWS_PER_TASK;
            const int r1 = r0 + ROWS_PER_TASK < half * I + keep ? r0 + ROWS_PER_TASK : half * I + keep;
            const int p0 = pair_off[u], np = pair_off[u + 1] - p0;
            const size_t base = (size_t)experts[u] * two_i;
            for (int r = r0; r < r1; r++)
                rows_dot(W, 0, base + r, H, x, H, 0, pair_tok + p0, np, scratch + (size_t)p0 * two_i + r, two_i);
        }
    }
    bar(bar_arg);
    /* 2. the activation in fp32, stored as the down product takes it */
    const int fast_down = q4_fast(W, I) && round_act;
    share_of(n_pairs, tid, nth, &lo, &hi);
    for (long p = lo; p < hi; p++) {
        int u = 0;
        while (pair_off[u + 1] <= p) u++;
        const float *h = scratch + (size_t)p * two_i;
        size_t b = (size_t)experts[u] * two_i;
        float *sums = fast_down ? W->in_sum[1] + (size_t)p * (I / W->group) : NULL;
        if (sums) memset(sums, 0, sizeof(float) * (I / W->group));
        const int keep = lim ? lim[u] : I;
        for (int i = 0; i < keep; i++) {
            float g = h[i], up = h[I + i];
            if (gate_up_bias) {
                g += widen(gate_up_bias, W->dtype, b + i);
                up += widen(gate_up_bias, W->dtype, b + I + i);
            }
            float a = activate(g, up, act, alpha, limit);
            if (dense_bf16)
                ((uint16_t *)act_buf)[(size_t)p * I + i] = (uint16_t)(f32_bits(round_bf16(a)) >> 16);
            else
                ((float *)act_buf)[(size_t)p * I + (size_t)(i % v) * (I / v) + i / v] = round_act ? round_bf16(a) : a;
            if (sums) {   /* the same rounded value as bf16, and its group's sum */
                const float r = round_bf16(a);
                W->in_bf16[1][(size_t)p * I + (size_t)(i % v) * (I / v) + i / v] = (uint16_t)(f32_bits(r) >> 16);
                sums[i / W->group] += r;
            }
        }
    }
    bar(bar_arg);
    /* 3. down rows: each thread owns a range of output rows and streams it expert by expert (one
     * contiguous run of each expert's rows), adding the experts to each row in a fixed order
     * (deterministic sums). */
    share_of(down_tasks, tid, nth, &lo, &hi);
    {
        const int r0 = (int)lo * ROWS_PER_TASK, r1 = hi * ROWS_PER_TASK < H ? (int)hi * ROWS_PER_TASK : H;
        float y[64];
        for (int u = 0; u < n_used; u++) {
            int p0 = pair_off[u], np = pair_off[u + 1] - p0;
            size_t base = (size_t)experts[u] * H;
            const int keep = lim ? lim[u] : I;   /* dense only: a shared expert's down rows are cut at keep */
            for (int r = r0; r < r1; r++) {
                for (int c = 0; c < np; c += 64) {
                    int n = np - c < 64 ? np - c : 64;
                    const void *a = (const char *)act_buf + (size_t)(p0 + c) * I * esize;
                    if (keep < I)
                        row_dots((const char *)W->w[1] + (base + r) * (size_t)I * esize, W->dtype, 0, keep, a, I,
                                 NULL, n, y, 1);
                    else
                        rows_dot(W, 1, base + r, I, a, I, p0 + c, NULL, n, y, 1);
                    float bias = down_bias ? widen(down_bias, W->dtype, base + r) : 0.f;
                    for (int j = 0; j < n; j++)
                        out[(size_t)pair_tok[p0 + c + j] * H + r] += pair_w[p0 + c + j] * (y[j] + bias);
                }
            }
        }
    }
}

static void omp_team_barrier(void *unused) {
    (void)unused;
#pragma omp barrier
}

static void run_experts(int threads, const Weights *W, const void *gate_up_bias, const void *down_bias, int H, int I,
                        int act, float alpha, float limit, int round_act, int n_used, const int32_t *experts,
                        const int32_t *pair_off, const int32_t *pair_tok, const float *pair_w, const void *x,
                        float *scratch, void *act_buf, float *out) {
#pragma omp parallel num_threads(threads)
    run_experts_part(omp_get_thread_num(), omp_get_num_threads(), omp_team_barrier, NULL, W, gate_up_bias, down_bias,
                     H, I, act, alpha, limit, round_act, n_used, experts, pair_off, pair_tok, pair_w, x, scratch,
                     act_buf, out, NULL);
}

/* Dense experts: gate_up (E, 2I, H), down (E, H, I) and optional biases (E, 2I) / (E, H) in one dtype;
 * `x` (T, H) and `act_buf` (n_pairs, I) in that dtype. */
void moe_cpu_experts(const void *gate_up, const void *down, const void *gate_up_bias, const void *down_bias,
                     int dtype, int H, int I, int act, float alpha, float limit,
                     int n_used, const int32_t *experts, const int32_t *pair_off, const int32_t *pair_tok,
                     const float *pair_w, const void *x, float *scratch, void *act_buf, float *out) {
    Weights W = {0};
    W.dtype = dtype;
    W.w[0] = gate_up;
    W.w[1] = down;
    run_experts(team, &W, gate_up_bias, down_bias, H, I, act, alpha, limit, 0, n_used, experts, pair_off, pair_tok,
                pair_w, x, scratch, act_buf, out);
}

/* Quantized experts (kernels/cpu_moe.py: which formats): per projection the packed values, the
 * scales and (affine) the quantization's biases, stacked over E experts, laid out as `q` says; the
 * experts' own biases (gpt-oss) in `dtype`, and their activation. `x` (T, H) and `act_buf`
 * (n_pairs, I) phase-ordered fp32. */
void moe_cpu_experts_quant(const void *gu_q, const void *gu_s, const void *gu_b, const void *dn_q,
                           const void *dn_s, const void *dn_b, const QuantLayout *q, const void *gate_up_bias,
                           const void *down_bias, int dtype, int act, float alpha, float limit,
                           int round_act, int H, int I, int n_used, const int32_t *experts,
                           const int32_t *pair_off, const int32_t *pair_tok, const float *pair_w, const float *x,
                           float *scratch, float *act_buf, float *out, int fast, uint16_t *x_bf16, float *x_sum,
                           uint16_t *act_bf16, float *act_sum) {
    Weights W = {0};
    quant_weights(&W, q);
    W.dtype = dtype;
    W.fast = fast && round_act && !W.fp8 && W.affine;   /* bf16-valued inputs only: exact in bf16 */
    W.in_bf16[0] = x_bf16;
    W.in_sum[0] = x_sum;
    W.in_bf16[1] = act_bf16;
    W.in_sum[1] = act_sum;
    W.w[0] = gu_q;
    W.w[1] = dn_q;
    W.scales[0] = gu_s;
    W.scales[1] = dn_s;
    W.qbias[0] = gu_b;
    W.qbias[1] = dn_b;
    run_experts(team, &W, gate_up_bias, down_bias, H, I, act, alpha, limit, round_act, n_used, experts, pair_off,
                pair_tok, pair_w, x, scratch, act_buf, out);
}

/* A quantized linear layer's rows times T inputs: out (T, N) = x (T, K, phase-ordered fp32) times the N rows
 * of K values that `q`'s first projection lays out (packed values, scales, affine offsets), each row meeting
 * the inputs as an expert's row does (`rows_dot`: several at once where its format allows), the rows spread
 * over the team: a decode step's GEMV on the CPU, the weights never dequantized into memory. */
void moe_cpu_qlinear(const void *qw, const void *scales, const void *qbias, const QuantLayout *q, int N, int K,
                     int T, const float *x, float *out) {
    Weights W = {0};
    quant_weights(&W, q);
    W.w[0] = qw;
    W.scales[0] = scales;
    W.qbias[0] = qbias;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int n = 0; n < N; n++) rows_dot(&W, 0, (size_t)n, K, x, K, 0, NULL, T, out + n, N);
}

/* ---- the stream worker: a thread team that serves the CPU's share of every decode step's misses --
 *
 * With the hybrid miss policy a decode step runs on the device as one CUDA graph and never waits
 * for the Python thread. Each MoE layer posts its routing and hidden rows into pinned host memory
 * (`post`: header [seq, tokens], then ids, weights, hidden), the GPU computes its own pairs, and a
 * device-side wait reads back what this team wrote (`result`: header [seq, pairs], then fp32 rows).
 * Thread 0 polls every layer's post for a new sequence number and groups the CPU's pairs; the team
 * computes them; thread 0 publishes the sequence number last. Sequence numbers are counted per
 * layer on the device.
 *
 * Which pairs are the CPU's: those the post names (it writes -1 for a pair the bank serves, from
 * the device's own map, so the bank can change between any two steps without telling the worker);
 * where the post's header gives a take (a one-token call the device splits: take[m] of its m such pairs, from
 * the device's own table) only the first `take` of them in routing order, the device reading the
 * others from host memory. The device's table is the only one: it can change between any two steps. The team stays inside one parallel
 * region and spins between layers (a sleeping OpenMP team costs a wake-up per layer); after 2 ms
 * without a post it naps 20 µs between polls. */

typedef struct {
    const void *gate_up, *down, *gate_up_bias, *down_bias;   /* host stacks (E, 2I, H), (E, H, I) */
    volatile int32_t *post;                                   /* [0] seq, [1] tokens, [2] take (-1: all), [3] cut */
    const int32_t *ids;                                       /* (max_tokens, k) */
    const float *weights;                                     /* (max_tokens, k) */
    const void *hidden;                                       /* (max_tokens, H) in the weights' dtype */
    volatile int32_t *result;                                 /* [0] seq, [1] pairs computed */
    float *out;                                               /* (max_tokens, H) fp32 */
    double *busy_s;                                           /* statistics, added to: compute time */
    int64_t *counts;                                          /* [calls, pairs, experts] */
    /* quantized experts: gate_up / down above are the packed values; per projection scales and
     * (affine) biases, and how they are laid out; gate_up_bias / down_bias: the experts' own biases */
    const void *gate_up_scales, *gate_up_qbias, *down_scales, *down_qbias;
    int32_t quantized;
    QuantLayout q;
} StreamLayer;

typedef struct {
    volatile int count, sense;
    int n;
} SpinBarrier;

typedef struct {
    SpinBarrier *bar;
    int sense;
} SpinArrival;

static void spin_barrier(void *arg) {
    SpinArrival *a = (SpinArrival *)arg;
    a->sense = !a->sense;
    if (__atomic_add_fetch((int *)&a->bar->count, 1, __ATOMIC_ACQ_REL) == a->bar->n) {
        a->bar->count = 0;
        __atomic_store_n((int *)&a->bar->sense, a->sense, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n((int *)&a->bar->sense, __ATOMIC_ACQUIRE) != a->sense) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
    }
}

typedef struct {
    StreamLayer *layers;
    int n_layers, dtype, H, I, k, E, max_tokens, act, threads, ncpus;
    float alpha, limit;
    int32_t *cpus;
    int32_t *last;                                            /* per layer: the last sequence served */
    int32_t *experts, *pair_off, *pair_tok, *pair_lim, *lim;   /* lim: per used expert, its intermediate rows */
    float *pair_w, *scratch, *xq;                             /* xq: quantized layers' phase-ordered inputs */
    uint16_t *xb, *actb;                                      /* affine 4-bit layers: the inputs as bf16 */
    float *xsum, *actsum;                                     /* and their group sums */
    void *act_buf;
    /* the job thread 0 hands the team */
    volatile int gen;
    int job_layer, job_used, job_pairs, job_tokens;
    int32_t job_seq;
    double job_t0;
    SpinBarrier bar;
    volatile int stop;
    pthread_t thread;
} StreamWorker;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void nap(void) {
    struct timespec t = {0, 20000};
    nanosleep(&t, NULL);
}

/* Thread 0: the CPU's pairs of layer L's post, grouped by expert into the worker's arrays. */
static void group_pairs(StreamWorker *w, StreamLayer *L, int T) {
    /* the device's split of this call: -1 = every pair outside the bank; else the first `take` of
     * them, and intermediate rows [0, cut) of the next one (cut > 0) */
    const int take = L->post[2], cut = L->post[3];
    int n = 0, taken = 0;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < w->k; j++) {
            int32_t e = L->ids[t * w->k + j];
            if (e < 0 || e >= w->E) continue;   /* -1: the bank serves it (or unrouted) */
            int lim = w->I;
            if (take >= 0) {
                const int rank = taken++;
                if (rank > take || (rank == take && (cut <= 0 || cut >= w->I))) continue;
                if (rank == take) lim = cut;
            }
            /* insertion by expert, tokens in order within one: the pairs grouped as run_experts takes them */
            int p = n++;
            while (p > 0 && w->experts[p - 1] > e) {
                w->experts[p] = w->experts[p - 1];
                w->pair_tok[p] = w->pair_tok[p - 1];
                w->pair_w[p] = w->pair_w[p - 1];
                w->pair_lim[p] = w->pair_lim[p - 1];
                p--;
            }
            w->experts[p] = e;
            w->pair_tok[p] = t;
            w->pair_w[p] = L->weights[t * w->k + j];
            w->pair_lim[p] = lim;
        }
    int used = 0;
    for (int p = 0; p < n; p++)   /* the sorted expert column → distinct experts and their pair offsets */
        if (p == 0 || w->experts[p] != w->experts[p - 1]) {
            w->pair_off[used] = p;
            w->lim[used] = w->pair_lim[p];   /* a one-token call: one pair per expert */
            w->experts[used++] = w->experts[p];
        }
    w->pair_off[used] = n;
    w->job_used = used;
    w->job_pairs = n;
}

/* Thread 0: answer layer L's post with what the job put into its rows (`job_pairs` pairs). */
static void answer(StreamWorker *w, StreamLayer *L) {
    L->result[1] = w->job_pairs;
    __atomic_store_n((int32_t *)&L->result[0], w->job_seq, __ATOMIC_RELEASE);
    L->busy_s[0] += now_s() - w->job_t0;
    L->counts[0] += 1;
    L->counts[1] += w->job_pairs;
    L->counts[2] += w->job_used;
}

/* Thread 0: wait for the next post (or stop) and set up its job; returns 0 on stop. A post with no
 * pair for the CPU is answered here, without waking the team: every job the team sees ends in a
 * barrier, so thread 0 never hands out a job before every thread has finished the last one (a
 * team thread still on its way out of a job must not see the generation counter move twice). */
static int next_job(StreamWorker *w) {
    double idle_since = -1.0;
    long polls = 0;
    while (!w->stop) {
        for (int l = 0; l < w->n_layers; l++) {
            StreamLayer *L = &w->layers[l];
            int32_t seq = __atomic_load_n((int32_t *)&L->post[0], __ATOMIC_ACQUIRE);
            if (seq == w->last[l]) continue;
            w->last[l] = seq;
            int T = L->post[1];
            T = T < 0 ? 0 : T > w->max_tokens ? w->max_tokens : T;
            w->job_t0 = now_s();
            group_pairs(w, L, T);
            memset(L->out, 0, (size_t)T * w->H * sizeof(float));
            w->job_seq = seq;
            if (!w->job_used) {
                answer(w, L);
                idle_since = -1.0;
                continue;
            }
            if (L->quantized) {   /* value j*v + p of a row at p*(H/v) + j, v = 8/bits */
                const int group = L->q.group[0], v = 8 / L->q.bits, per = w->H / v, G = w->H / group;
                const int fast = w->dtype == W_BF16 && L->q.bits == 4 && L->q.codes == CODES_TABLE &&
                                 q4_groups_fit(group, w->H) && affine_codes(L->q.table);
                for (int t = 0; t < T; t++) {
                    for (int i = 0; i < w->H; i++) {
                        const size_t at = (size_t)t * w->H + (size_t)(i % v) * per + i / v;
                        w->xq[at] = widen(L->hidden, w->dtype, (size_t)t * w->H + i);
                        if (fast) w->xb[at] = ((const uint16_t *)L->hidden)[(size_t)t * w->H + i];
                    }
                    if (fast)
                        for (int g = 0; g < G; g++) {
                            float s = 0.f;
                            for (int i = g * group; i < (g + 1) * group; i++)
                                s += widen(L->hidden, w->dtype, (size_t)t * w->H + i);
                            w->xsum[(size_t)t * G + g] = s;
                        }
                }
            }
            w->job_layer = l;
            w->job_tokens = T;
            return 1;
        }
        cpu_relax();
        if ((++polls & 1023) == 0) {   /* spin through a step's gaps; nap once the engine is idle */
            double t = now_s();
            if (idle_since < 0) idle_since = t;
            else if (t - idle_since > 0.002) nap();
        }
    }
    return 0;
}

static void *stream_main(void *arg) {
    StreamWorker *w = (StreamWorker *)arg;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    if (w->ncpus > 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(w->cpus[0], &set);
        sched_setaffinity(0, sizeof(set), &set);
    }
#pragma omp parallel num_threads(w->threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        if (tid > 0 && w->ncpus > 0) {   /* thread 0 on the first CPU given, the others on the rest */
            cpu_set_t s;
            CPU_ZERO(&s);
            CPU_SET(w->cpus[tid % w->ncpus], &s);
            sched_setaffinity(0, sizeof(s), &s);
        }
        if (tid == 0) w->bar.n = nth;
#pragma omp barrier
        SpinArrival arrival = {&w->bar, 0};
        int seen = 0;
        for (;;) {
            if (tid == 0) {
                int more = next_job(w);
                if (!more) w->job_layer = -1;
                __atomic_store_n((int *)&w->gen, seen + 1, __ATOMIC_RELEASE);
            } else {
                double idle_since = -1.0;
                long polls = 0;
                while (__atomic_load_n((int *)&w->gen, __ATOMIC_ACQUIRE) == seen) {
                    cpu_relax();
                    if ((++polls & 1023) == 0) {
                        double t = now_s();
                        if (idle_since < 0) idle_since = t;
                        else if (t - idle_since > 0.002) nap();
                    }
                }
            }
            seen++;
            if (w->job_layer < 0) break;
            StreamLayer *L = &w->layers[w->job_layer];
            {   /* next_job hands the team only jobs with pairs */
                Weights W = {0};
                W.dtype = w->dtype;
                W.w[0] = L->gate_up;
                W.w[1] = L->down;
                if (L->quantized) {
                    quant_weights(&W, &L->q);
                    W.scales[0] = L->gate_up_scales;
                    W.scales[1] = L->down_scales;
                    W.qbias[0] = L->gate_up_qbias;
                    W.qbias[1] = L->down_qbias;
                    W.fast = w->dtype == W_BF16 && !W.fp8 && W.affine;   /* rows the 4-bit path takes: q4_fast */
                    W.in_bf16[0] = w->xb;
                    W.in_sum[0] = w->xsum;
                    W.in_bf16[1] = w->actb;
                    W.in_sum[1] = w->actsum;
                }
                run_experts_part(tid, nth, spin_barrier, &arrival, &W, L->gate_up_bias, L->down_bias, w->H, w->I,
                                 w->act, w->alpha, w->limit,
                                 L->quantized && w->dtype == W_BF16, w->job_used, w->experts, w->pair_off,
                                 w->pair_tok, w->pair_w, L->quantized ? (const void *)w->xq : L->hidden, w->scratch,
                                 w->act_buf, L->out, L->quantized ? NULL : w->lim);
                spin_barrier(&arrival);
            }
            if (tid == 0) answer(w, L);
        }
    }
    return NULL;
}

static void free_worker(StreamWorker *w) {
    free(w->layers); free(w->last); free(w->cpus); free(w->experts); free(w->pair_off); free(w->pair_tok);
    free(w->pair_lim); free(w->lim);
    free(w->pair_w); free(w->scratch); free(w->xq); free(w->xb); free(w->xsum); free(w->actb); free(w->actsum);
    free(w->act_buf); free(w);
}

/* Start a worker over `layers` (copied); `last_seq` gives each layer's sequence number already
 * served (the posts' current values). Returns the handle, or NULL when no thread could start. */
void *moe_stream_start(const StreamLayer *layers, const int32_t *last_seq, int n_layers,
                       int dtype, int H, int I, int k, int E, int max_tokens, int act, float alpha, float limit,
                       int threads, const int32_t *cpus, int ncpus) {
    StreamWorker *w = calloc(1, sizeof(StreamWorker));
    if (!w) return NULL;
    size_t pairs = (size_t)max_tokens * k;
    w->layers = malloc(sizeof(StreamLayer) * n_layers);
    w->last = malloc(sizeof(int32_t) * n_layers);
    w->cpus = malloc(sizeof(int32_t) * (ncpus > 0 ? ncpus : 1));
    w->experts = malloc(sizeof(int32_t) * pairs);
    w->pair_off = malloc(sizeof(int32_t) * (pairs + 1));
    w->pair_tok = malloc(sizeof(int32_t) * pairs);
    w->pair_w = malloc(sizeof(float) * pairs);
    w->pair_lim = malloc(sizeof(int32_t) * pairs);
    w->lim = malloc(sizeof(int32_t) * pairs);
    w->scratch = malloc(sizeof(float) * pairs * 2 * I);
    w->act_buf = malloc(sizeof(float) * pairs * I);
    w->xq = malloc(sizeof(float) * (size_t)max_tokens * H);
    w->xb = malloc(sizeof(uint16_t) * (size_t)max_tokens * H);
    w->xsum = malloc(sizeof(float) * (size_t)max_tokens * H);
    w->actb = malloc(sizeof(uint16_t) * pairs * I);
    w->actsum = malloc(sizeof(float) * pairs * I);
    if (!w->layers || !w->last || !w->cpus || !w->experts || !w->pair_off || !w->pair_tok || !w->pair_w ||
        !w->pair_lim || !w->lim ||
        !w->scratch || !w->act_buf || !w->xq || !w->xb || !w->xsum || !w->actb || !w->actsum) {
        free_worker(w);
        return NULL;
    }
    memcpy(w->layers, layers, sizeof(StreamLayer) * n_layers);
    memcpy(w->last, last_seq, sizeof(int32_t) * n_layers);
    if (ncpus > 0) memcpy(w->cpus, cpus, sizeof(int32_t) * ncpus);
    w->n_layers = n_layers;
    w->dtype = dtype;
    w->H = H;
    w->I = I;
    w->k = k;
    w->E = E;
    w->max_tokens = max_tokens;
    w->act = act;
    w->alpha = alpha;
    w->limit = limit;
    w->threads = threads > 0 ? threads : 1;
    w->ncpus = ncpus;
    if (pthread_create(&w->thread, NULL, stream_main, w) != 0) {
        free_worker(w);
        return NULL;
    }
    return w;
}

/* Stop a worker: it finishes the job in hand. Returns 0, or -1 when it has not stopped within
 * `timeout_s` (its team is stuck); the worker is then left running, its memory kept, so that a
 * caller shutting down is told instead of waiting forever. */
int moe_stream_stop(void *handle, double timeout_s) {
    StreamWorker *w = (StreamWorker *)handle;
    if (!w) return 0;
    w->stop = 1;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout_s;
    if (pthread_timedjoin_np(w->thread, NULL, &until) != 0) return -1;
    free_worker(w);
    return 0;
}

/* Wait until layer `l`'s result carries `seq` (the CPU side of a device-side wait: eager calls on
 * the CPU). Returns 0, or -1 after `timeout_s`. Called through ctypes, which releases the GIL. */
int moe_stream_wait(const volatile int32_t *result, int32_t seq, double timeout_s) {
    double t0 = now_s();
    long polls = 0;
    while (__atomic_load_n((const int32_t *)&result[0], __ATOMIC_ACQUIRE) != seq) {
        cpu_relax();
        if ((++polls & 1023) == 0 && now_s() - t0 > timeout_s) return -1;
    }
    return 0;
}

/* Publish `seq` in a post's header after the writes before it (the CPU side of a device-side post). */
void moe_stream_publish(volatile int32_t *header, int32_t seq) {
    __atomic_store_n((int32_t *)&header[0], seq, __ATOMIC_RELEASE);
}
