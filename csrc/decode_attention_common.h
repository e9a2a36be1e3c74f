// Shared by csrc/decode_attention.cpp (dispatcher) and its per-ISA kernels
// (csrc/isa/decode_attention_<level>.cpp). Plain data and declarations only: see
// csrc/topk_ip_common.h for why nothing inline is shared between levels.
#pragma once
#include <cstdint>

#include "isa_compiled.h"

namespace ragfast {
namespace decode_attention_common {

// One (sequence, key/value head) pair of a decode step: the G query heads that share the key/value
// head, one query token each, against T cached keys. Strides are in elements; the last dimension
// (D) of q, k, v and out is contiguous. mask[t] != 0 marks key t visible (nullptr: all are).
struct Task {
  const void* q;    // G rows of D, q_sh apart
  int64_t q_sh;
  const void* k;    // T rows of D, k_st apart
  int64_t k_st;
  const void* v;    // T rows of D, v_st apart
  int64_t v_st;
  const uint8_t* mask;
  void* out;        // G rows of D, o_sh apart
  int64_t o_sh;
  // The keys and values of the task this thread runs next (same T, D and strides; nullptr: none),
  // asked into L2 while this one computes, so that reading the cache from memory overlaps the
  // arithmetic instead of following it.
  const void* next_k;
  const void* next_v;
  int64_t T, D;
  int G;
  float scale;
  bool bf16;        // q, k, v and out are bf16 (else fp32)
  // The task's own floats, 64-byte aligned, laid out as: the scaled queries [G][Dp], the output
  // sums [G][Dp], the scores [G][Tp], the maxima [G], the softmax sums [G] and 16 widened key rows
  // [16][Dp], with Dp and Tp D and T rounded up to 16: G * (2 * Dp + Tp + 2) + 16 * Dp floats
  // (the amx task lays out its own, within scratch_floats below).
  float* scratch;
};

using TaskFn = void (*)(const Task&);

// Floats of a task's scratch, for either layout (64-byte aligned start).
inline int64_t scratch_floats(int64_t G, int64_t D, int64_t T) {
  const int64_t Dp = (D + 15) / 16 * 16, Tp = (T + 15) / 16 * 16;
  const int64_t avx512 = G * (2 * Dp + Tp + 2) + 16 * Dp;
  const int64_t amx = 16 * Tp + G * Dp + 4 * 256 + 8 * Dp;  // scores, sums, query tiles, tail keys
  return avx512 > amx ? avx512 : amx;
}

#ifdef RAGFAST_ISA_HAVE_avx512
void decode_attention_task_avx512(const Task& a);
#endif
#ifdef RAGFAST_ISA_HAVE_amx
// bf16 only, D a multiple of 32 up to 128, G <= 16 (csrc/isa/decode_attention_amx.cpp).
void decode_attention_task_amx(const Task& a);
#endif

}  // namespace decode_attention_common
}  // namespace ragfast
