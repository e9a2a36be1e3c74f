// Shared by csrc/silu_mul.cpp (dispatcher) and its per-ISA kernels (csrc/isa/silu_mul_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace silu_mul_common {

// y[i] = silu(g[i]) * u[i] for one row of n values (fp32, or bf16 held as uint16_t when `bf16`), as
// torch computes act(gate) * up in the dtype: silu(g) = g / (1 + e^-g) in fp32, rounded to the
// dtype, times u, rounded again.
using RowFn = void (*)(const void* g, const void* u, void* y, int64_t n, bool bf16);

#ifdef RAGFAST_ISA_HAVE_avx512
void silu_mul_row_avx512(const void* g, const void* u, void* y, int64_t n, bool bf16);
#endif

}  // namespace silu_mul_common
}  // namespace ragfast
