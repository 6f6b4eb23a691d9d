/* The FP16 rounding primitive of the CPU emulation (see native.py, which compiles and loads this file).
 *
 * The emulation stores every tensor the way FP16 training would: an FP32 tensor rounded to the nearest FP16
 * value. torch does that as two casts (fp32 -> fp16 -> fp32), two passes and a temporary; this kernel does it
 * in one pass with the F16C conversion instructions (round to nearest, ties to even, subnormals kept,
 * overflow to infinity: the same results as torch's cast, NaN payloads aside). It is a numerics primitive
 * only: no rule of the adaptive method lives here.
 *
 * Plain C with no torch headers: it is compiled by the system's C compiler on first use, and the Python side
 * falls back to torch ops when that is impossible. Single-threaded, so results are deterministic.
 */
#include <immintrin.h>
#include <stdint.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))

int adaloss_fast_abi(void) { return 11; }

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

/* y[i] = fp16(x[i]) stored as float32, for i < n; y may be x (in place). */
TARGET void adaloss_round_f16(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = round8(_mm256_loadu_ps(x + i));
        __m256 b = round8(_mm256_loadu_ps(x + i + 8));
        __m256 c = round8(_mm256_loadu_ps(x + i + 16));
        __m256 d = round8(_mm256_loadu_ps(x + i + 24));
        _mm256_storeu_ps(y + i, a);
        _mm256_storeu_ps(y + i + 8, b);
        _mm256_storeu_ps(y + i + 16, c);
        _mm256_storeu_ps(y + i + 24, d);
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, round8(_mm256_loadu_ps(x + i)));
    for (; i < n; ++i) y[i] = round1(x[i]);
}
