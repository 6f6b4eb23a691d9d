/* Fused CPU kernels for the FP16 emulation (see native.py, which compiles and loads this file).
 *
 * The emulation stores every tensor the way FP16 training would: an FP32 tensor rounded to the nearest FP16
 * value. torch does that as two casts (fp32 -> fp16 -> fp32), two passes and a temporary; these kernels do it
 * in one pass with the F16C conversion instructions (round to nearest, ties to even, subnormals kept,
 * overflow to infinity: the same results as torch's cast, NaN payloads aside). The _stats variant also
 * returns the statistics Algorithm 4 needs from the rounded gradient (sum of squares, min, max), so the
 * adaptive scaler reads each gradient once instead of three times.
 *
 * Plain C with no torch headers: it is compiled by the system's C compiler on first use, and the Python side
 * falls back to torch ops when that is impossible. Single-threaded and with a fixed order of accumulation,
 * so results are deterministic.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))

int adaloss_fast_abi(void) { return 10; }

/* Whether this CPU has the instructions the kernels use (checked once by the loader). */
int adaloss_cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

TARGET static inline __m256 round8(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

TARGET static inline float round1(float v) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

/* y[i] = fp16(x[i] * pre) * post for i < n; y may be x (in place). pre and post are powers of two in
 * practice (a layer's beta, the reciprocal of its alpha), so both products are exact, as the separate
 * torch multiply, cast and divide would be. */
TARGET void adaloss_round_f16(const float *x, float *y, int64_t n, float pre, float post) {
    const __m256 a8 = _mm256_set1_ps(pre), b8 = _mm256_set1_ps(post);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_mul_ps(round8(_mm256_mul_ps(_mm256_loadu_ps(x + i), a8)), b8);
        __m256 b = _mm256_mul_ps(round8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), a8)), b8);
        __m256 c = _mm256_mul_ps(round8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), a8)), b8);
        __m256 d = _mm256_mul_ps(round8(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), a8)), b8);
        _mm256_storeu_ps(y + i, a);
        _mm256_storeu_ps(y + i + 8, b);
        _mm256_storeu_ps(y + i + 16, c);
        _mm256_storeu_ps(y + i + 24, d);
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(round8(_mm256_mul_ps(_mm256_loadu_ps(x + i), a8)), b8));
    for (; i < n; ++i) y[i] = round1(x[i] * pre) * post;
}

/* y[i] = fp16(fp16(x[i]) * scale): a gradient stored in FP16, then multiplied by a layer's beta and stored in
 * FP16 again (Algorithm 3's beta * delta), so a product beyond FP16's range becomes infinity and one below its
 * subnormals loses bits, as in FP16 training. y may be x. */
TARGET void adaloss_round_scaled_f16(const float *x, float *y, int64_t n, float scale) {
    const __m256 s8 = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = round8(_mm256_mul_ps(round8(_mm256_loadu_ps(x + i)), s8));
        __m256 b = round8(_mm256_mul_ps(round8(_mm256_loadu_ps(x + i + 8)), s8));
        _mm256_storeu_ps(y + i, a);
        _mm256_storeu_ps(y + i + 8, b);
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, round8(_mm256_mul_ps(round8(_mm256_loadu_ps(x + i)), s8)));
    for (; i < n; ++i) y[i] = round1(round1(x[i]) * scale);
}

/* Sum of squares (in double), min and max of 8 lanes, NaN-propagating. */
TARGET static inline void acc8(__m256 v, __m256d *s0, __m256d *s1, __m256 *lo, __m256 *hi, __m256 *nan) {
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    *s0 = _mm256_fmadd_pd(a, a, *s0);
    *s1 = _mm256_fmadd_pd(b, b, *s1);
    *lo = _mm256_min_ps(*lo, v);
    *hi = _mm256_max_ps(*hi, v);
    *nan = _mm256_or_ps(*nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* Shared by the two stats kernels: optionally rounds (do_round) and writes y, and fills
 * out[0] = ||v||_2 (accumulated in double), out[1] = |min v|, out[2] = |max v| (the three numbers Algorithm 4
 * divides by), all NaN if any element is NaN; v is y when rounding, else x. */
TARGET static inline void stats_impl(const float *x, float *y, int64_t n, float *out, int do_round) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), s2 = _mm256_setzero_pd(), s3 = _mm256_setzero_pd();
    __m256 lo0 = _mm256_set1_ps(INFINITY), lo1 = lo0, hi0 = _mm256_set1_ps(-INFINITY), hi1 = hi0;
    __m256 nan0 = _mm256_setzero_ps(), nan1 = nan0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        if (do_round) {
            a = round8(a);
            b = round8(b);
            _mm256_storeu_ps(y + i, a);
            _mm256_storeu_ps(y + i + 8, b);
        }
        acc8(a, &s0, &s1, &lo0, &hi0, &nan0);
        acc8(b, &s2, &s3, &lo1, &hi1, &nan1);
    }
    double sum = 0.0;
    float lo = INFINITY, hi = -INFINITY;
    int has_nan = 0;
    {
        double buf[4];
        float fl[8], fh[8], fn[8];
        _mm256_storeu_pd(buf, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
        sum = (buf[0] + buf[1]) + (buf[2] + buf[3]);
        _mm256_storeu_ps(fl, _mm256_min_ps(lo0, lo1));
        _mm256_storeu_ps(fh, _mm256_max_ps(hi0, hi1));
        _mm256_storeu_ps(fn, _mm256_or_ps(nan0, nan1));
        for (int k = 0; k < 8; ++k) {
            if (fl[k] < lo) lo = fl[k];
            if (fh[k] > hi) hi = fh[k];
            if (fn[k] != 0.0f) has_nan = 1; /* all-ones bits read as a NaN float: != 0 is true */
        }
    }
    for (; i < n; ++i) {
        float v = do_round ? round1(x[i]) : x[i];
        if (do_round) y[i] = v;
        if (v != v) has_nan = 1;
        sum += (double)v * (double)v;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    if (has_nan) {
        out[0] = out[1] = out[2] = NAN;
    } else {
        out[0] = (float)sqrt(sum);
        out[1] = fabsf(lo);
        out[2] = fabsf(hi);
    }
}

/* Algorithm 4's last step (section 3.2.3), the same float32 operations as ScaleRule.beta in
 * adaptive/rules.py: q = |f / s| for the rule's 5-vectors f = [factors[0..2], scale_cap, accum_cap] and
 * s = [||g||, max|g|, max|g|, 1, alpha_in] (max|g| the larger of stats[1], stats[2]: |min g|, |max g|), an
 * infinite or NaN q read as 1, then
 *   reference (flags bit 1 set):  beta = min(max(q0, 1), q1, q2, q3, q4);
 *   paper (flags bit 1 clear):    beta = min(max(min(q0, q1, q2), 1), q3, q4), without the max(., 1) when
 *                                 flags bit 0 (allow_below_one) is set;
 * rounded down to a power of two (exponent bits kept, mantissa cleared: a subnormal becomes 0). */
static inline float sane(float q) {
    q = fabsf(q);
    return (q != q || q == INFINITY) ? 1.0f : q;
}

static float beta_from(const float *factors, const float *stats, int flags, float scale_cap, float accum_cap,
                       float alpha_in) {
    /* stats hold |min| and |max| of the gradient: the overflow bound divides by the larger one */
    float peak = stats[1] > stats[2] ? stats[1] : stats[2];
    if (stats[1] != stats[1] || stats[2] != stats[2]) peak = NAN;
    float q[5];
    q[0] = sane(factors[0] / stats[0]);
    q[1] = sane(factors[1] / peak);
    q[2] = sane(factors[2] / peak);
    q[3] = sane(scale_cap / 1.0f);
    q[4] = sane(accum_cap / alpha_in);
    float b;
    if (flags & 2) {
        b = q[0] < 1.0f ? 1.0f : q[0];
        for (int k = 1; k < 5; ++k)
            if (q[k] < b) b = q[k];
    } else {
        b = q[0];
        if (q[1] < b) b = q[1];
        if (q[2] < b) b = q[2];
        if (!(flags & 1) && b < 1.0f) b = 1.0f;
        if (q[3] < b) b = q[3];
        if (q[4] < b) b = q[4];
    }
    union { float f; uint32_t u; } bits = {b};
    bits.u &= 0x7F800000u;
    return bits.f;
}

/* beta from precomputed statistics (see beta_from); also written to beta[0]. */
float adaloss_beta(const float *factors, const float *stats, int flags, float scale_cap, float accum_cap,
                   float alpha_in, float *beta) {
    beta[0] = beta_from(factors, stats, flags, scale_cap, accum_cap, alpha_in);
    return beta[0];
}

/* One pass over a gradient for Algorithm 4. Reads x[0:n]; if do_round, writes fp16(x) to y (which may be x)
 * and takes the statistics of the rounded values. Writes stats[0:3] = [||v||, |min v|, |max v|]. */
TARGET void adaloss_grad_stats(const float *x, float *y, int64_t n, int do_round, float *stats) {
    stats_impl(x, y, n, stats, do_round);
}

/* max |x| over x[0:n] (NaN if any element is NaN; 0 for n == 0): Algorithm 5's statistic of a branch input. */
TARGET float adaloss_max_abs(const float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m0 = _mm256_setzero_ps(), m1 = m0, nan0 = m0, nan1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        __m256 b = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
        nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        nan1 = _mm256_or_ps(nan1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    }
    float m[8], fn[8], out = 0.0f;
    int has_nan = 0;
    _mm256_storeu_ps(m, _mm256_max_ps(m0, m1));
    _mm256_storeu_ps(fn, _mm256_or_ps(nan0, nan1));
    for (int k = 0; k < 8; ++k) {
        if (m[k] > out) out = m[k];
        if (fn[k] != 0.0f) has_nan = 1;
    }
    for (; i < n; ++i) {
        float v = fabsf(x[i]);
        if (v != v) has_nan = 1;
        if (v > out) out = v;
    }
    return has_nan ? NAN : out;
}

/* The weight part of Algorithm 4 for `count` layers at once (see weight_factors in adaptive/rules.py): for
 * layer i with weight ptrs[i][0:ns[i]], out[3i] = a[i] / ||W||_2 and out[3i+1] = out[3i+2] = b[i] / max|W|,
 * with the float32 divisions of the torch path (the norm accumulated in double). */
TARGET void adaloss_weight_factors(const float *const *ptrs, const int64_t *ns, const float *a, const float *b,
                                   int64_t count, float *out) {
    for (int64_t i = 0; i < count; ++i) {
        float st[3];
        stats_impl(ptrs[i], 0, ns[i], st, 0);
        float max_abs = st[1] > st[2] ? st[1] : st[2];
        if (st[1] != st[1]) max_abs = st[1]; /* NaN */
        out[3 * i] = a[i] / st[0];
        out[3 * i + 1] = out[3 * i + 2] = b[i] / max_abs;
    }
}
