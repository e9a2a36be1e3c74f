// Shared by csrc/prefill_attention.cpp (dispatcher) and its per-ISA kernels
// (csrc/isa/prefill_attention_<level>.cpp). Plain data and declarations only: see
// csrc/topk_ip_common.h for why nothing inline is shared between levels.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace prefill_attention_common {

// One (sequence, key/value head) pair of a prefill pass: the G query heads that share the key/value
// head, L new query tokens each, against T keys (the cached ones, then the L new ones). Query i
// sits at key position T - L + i and sees key t when t <= T - L + i and mask[t] != 0 (causal,
// after the cache; mask nullptr: no padding). Strides are in elements; the last dimension (D) of
// q, k, v and out is contiguous.
struct Task {
  const void* q;  // query (h, i) at h * q_sh + i * q_sl
  int64_t q_sh, q_sl;
  const void* k;  // T rows of D, k_st apart
  int64_t k_st;
  const void* v;  // T rows of D, v_st apart
  int64_t v_st;
  const uint8_t* mask;
  void* out;  // output (h, i) at h * o_sh + i * o_sl
  int64_t o_sh, o_sl;
  int64_t T, L, D;
  int G;
  float scale;
  bool bf16;  // q, k, v and out are bf16 (else fp32)
  float* scratch;  // scratch_floats(T, D) floats, 64-byte aligned
};

using TaskFn = void (*)(const Task&);

// Floats of a task's scratch for either layout (64-byte aligned start): the portable task keeps
// one query's scores; the amx task a block of 16 queries' scores [Tp][16], their exponentials as
// bf16 pairs [Tp / 2][16][2], the values transposed [D][Tp] bf16, the output sums [D][16], the
// queries' tiles (4 KB) and 16 zero-padded key rows; Tp is T rounded up to 32.
inline int64_t scratch_floats(int64_t T, int64_t D) {
  const int64_t Tp = (T + 31) / 32 * 32;
  const int64_t generic = Tp + D;
  const int64_t amx = 16 * Tp + 8 * Tp + D * Tp / 2 + 16 * D + 1024 + 8 * D;
  return generic > amx ? generic : amx;
}

#ifdef RAGFAST_ISA_HAVE_avx512bf16
// bf16 only, D a multiple of 32 up to 128 (csrc/isa/prefill_attention_avx512bf16.cpp); its
// scratch is the amx task's without the tail rows, the values as key pairs in place of V^T.
void prefill_attention_task_avx512bf16(const Task& a);
#endif
#ifdef RAGFAST_ISA_HAVE_amx
// bf16 only, D a multiple of 32 up to 128 (csrc/isa/prefill_attention_amx.cpp).
void prefill_attention_task_amx(const Task& a);
#endif

}  // namespace prefill_attention_common
}  // namespace ragfast
