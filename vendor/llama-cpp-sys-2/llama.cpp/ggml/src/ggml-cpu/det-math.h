#pragma once

// EdgeSplit: the float functions of the CPU kernels computed by their double versions and
// rounded to float. glibc's and musl's expf, sinf, cosf, tanhf and logf give other bits for
// many arguments (musl's come from other sources), so the same model, prompt and kernels
// computed other answers under the two C libraries; their double functions, rounded to
// float, agreed on every argument tried (patches/README.md).

#include <math.h>

static inline float ggml_det_expf(float x)   { return (float) exp((double) x); }
static inline float ggml_det_expm1f(float x) { return (float) expm1((double) x); }
static inline float ggml_det_logf(float x)   { return (float) log((double) x); }
static inline float ggml_det_log1pf(float x) { return (float) log1p((double) x); }
static inline float ggml_det_log2f(float x)  { return (float) log2((double) x); }
static inline float ggml_det_exp2f(float x)  { return (float) exp2((double) x); }
static inline float ggml_det_powf(float x, float y) { return (float) pow((double) x, (double) y); }
static inline float ggml_det_sinf(float x)   { return (float) sin((double) x); }
static inline float ggml_det_cosf(float x)   { return (float) cos((double) x); }
static inline float ggml_det_tanhf(float x)  { return (float) tanh((double) x); }
static inline float ggml_det_erff(float x)   { return (float) erf((double) x); }
