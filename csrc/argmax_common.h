// Shared by csrc/argmax.cpp (dispatcher) and its per-ISA kernels (csrc/isa/argmax_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace argmax_common {

// The index of the first largest value of one row of n fp32 (bf16 when `bf16`) values, as
// torch.argmax: equal values (-0 and +0 among them) keep the first; a NaN is larger than
// everything, so a row holding one answers its first NaN. n >= 1.
using RowFn = int64_t (*)(const void* row, int64_t n, bool bf16);

// csrc/isa/argmax_<level>.cpp, compiled with the level (isa_compiled.h says which are)
#ifdef RAGFAST_ISA_HAVE_avx2
int64_t argmax_row_avx2(const void* row, int64_t n, bool bf16);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512
int64_t argmax_row_avx512(const void* row, int64_t n, bool bf16);
#endif

}  // namespace argmax_common
}  // namespace ragfast
