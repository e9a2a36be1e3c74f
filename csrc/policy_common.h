// Shared by csrc/policy.cpp (dispatcher) and its per-ISA kernels (csrc/isa/policy_<level>.cpp).
// Plain declarations only: see csrc/topk_ip_common.h for why nothing inline is shared.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace policy_common {

// Micro-tile of the resample-mean product out[k, r] = sum_i D[k, i] * C[r, i] / n: 8 resamples
// (columns of the counts) times 12 rows of D, streamed over i. acc is [kKT][kRB].
constexpr int64_t kRB = 8;
constexpr int64_t kKT = 12;

// csrc/isa/policy_<level>.cpp, compiled with the level (isa_compiled.h says which are)
#ifdef RAGFAST_ISA_HAVE_avx2
void tile_kernel_avx2(const double* CT, const double* DT, int64_t n, int64_t Kp, int64_t k0, double* acc);
#endif
#ifdef RAGFAST_ISA_HAVE_avx512
void tile_kernel_avx512(const double* CT, const double* DT, int64_t n, int64_t Kp, int64_t k0, double* acc);
#endif

}  // namespace policy_common
}  // namespace ragfast
