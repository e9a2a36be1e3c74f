// Shared by csrc/rms_norm.cpp (dispatcher) and its per-ISA kernels (csrc/isa/rms_norm_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace rms_norm_common {

// One row of n values (fp32, or bf16 held as uint16_t when `bf16`), as transformers' Llama / Qwen2
// RMSNorm computes it: in fp32, inv = 1 / sqrt(sum(x^2) / n + eps); t = x * inv, rounded to the
// input's dtype; y = w * t, rounded to it. w holds n values of the same dtype.
using RowFn = void (*)(const void* x, const void* w, void* y, int64_t n, float eps, bool bf16);

#ifdef RAGFAST_ISA_HAVE_avx512
void rms_norm_row_avx512(const void* x, const void* w, void* y, int64_t n, float eps, bool bf16);
#endif

}  // namespace rms_norm_common
}  // namespace ragfast
