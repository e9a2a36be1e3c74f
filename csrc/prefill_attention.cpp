// prefill_attention: L new query tokens per sequence against the cached keys/values and their own
// (a prefill pass over a KV cache, causal, with a padding mask).
//
// In a turn of Search-R1 on Qwen2.5-Coder-0.5B (9 rows x 450 new tokens after 1,000 cached, bf16,
// two threads, an Emerald Rapids Xeon) torch's CPU SDPA took 1.9 s of a 4.2-4.8 s prefill: its
// flash kernel with an explicit mask ran at about 0.26 TFLOP/s, against about 1.3 TOP/s for the
// int8 matmuls around it. Each (sequence, key/value head) pair is a task: its values are
// transposed once for all G x L queries, which run 16 at a time (csrc/isa/prefill_attention_amx.cpp
// on tiles, csrc/isa/prefill_attention_avx512bf16.cpp with AVX512-BF16 dot products).
//
// This file holds the portable task (any dtype and size; the oracle's semantics, one query at a
// time), the dispatcher and the binding, which takes addresses (python/ragfast/ops/
// prefill_attention.py checks the tensors and keeps them alive).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "bf16_scalar.h"
#include "isa.h"
#include "prefill_attention_common.h"
#include "registry.h"
#include "threads.h"

namespace py = pybind11;

namespace ragfast {
namespace prefill_attention_detail {

using namespace ragfast::prefill_attention_common;

inline float load(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store(void* p, int64_t i, float f, bool bf16) {
  if (bf16)
    static_cast<uint16_t*>(p)[i] = float_to_bf16(f);
  else
    static_cast<float*>(p)[i] = f;
}

// The portable task: per query, its visible keys' scores, their softmax and the weighted values.
void task_generic(const Task& a) {
  const int64_t T = a.T, L = a.L, D = a.D, off = a.T - a.L;
  float* s = a.scratch;
  float* acc = s + (T + 31) / 32 * 32;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < a.G; ++h) {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t qi = h * a.q_sh + i * a.q_sl, n = off + i + 1;  // keys 0 .. off + i
      float mx = ninf;
      for (int64_t t = 0; t < n; ++t) {
        float x = ninf;
        if (!a.mask || a.mask[t]) {
          x = 0.f;
          for (int64_t d = 0; d < D; ++d) x += load(a.q, qi + d, a.bf16) * load(a.k, t * a.k_st + d, a.bf16);
          x *= a.scale;
          mx = std::max(mx, x);
        }
        s[t] = x;
      }
      float sum = 0.f;
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        if (s[t] == ninf) continue;
        const float e = std::exp(s[t] - mx);
        sum += e;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * load(a.v, t * a.v_st + d, a.bf16);
      }
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no visible key: zeros
      for (int64_t d = 0; d < D; ++d) store(a.out, h * a.o_sh + i * a.o_sl + d, acc[d] * inv, a.bf16);
    }
  }
}

// The task kernel of the ISA level in use (csrc/isa.cpp): on the shapes they take (bf16, D a
// multiple of 32 up to 128) the amx level's tile task, or the avx512bf16 level's dot-product
// task; otherwise the portable one.
TaskFn pick_task(int64_t D, bool bf16) {
  const bool fits = bf16 && D % 32 == 0 && D <= 128;
#ifdef RAGFAST_ISA_HAVE_amx
  if (isa::current() >= isa::kAmx && fits) return &prefill_attention_task_amx;
#endif
#ifdef RAGFAST_ISA_HAVE_avx512bf16
  if (isa::current() >= isa::kAvx512Bf16 && fits) return &prefill_attention_task_avx512bf16;
#endif
  (void)fits;
  return &task_generic;
}

void prefill_attention(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t mask, uintptr_t out, bool bf16, int64_t B,
                       int64_t H, int64_t Hkv, int64_t L, int64_t T, int64_t D, int64_t q_sb, int64_t q_sh,
                       int64_t q_sl, int64_t k_sb, int64_t k_sh, int64_t k_st, int64_t v_sb, int64_t v_sh,
                       int64_t v_st, int64_t m_sb, int64_t o_sb, int64_t o_sh, int64_t o_sl, double scale,
                       int threads) {
  if (B < 0 || H < 1 || Hkv < 1 || L < 1 || T < L || D < 1)
    throw std::invalid_argument("prefill_attention: bad sizes");
  if (H % Hkv) throw std::invalid_argument("prefill_attention: query heads are not a multiple of key/value heads");
  if (B == 0) return;
  const int64_t G = H / Hkv;
  const TaskFn fn = pick_task(D, bf16);
  const size_t width = bf16 ? 2 : 4;
  py::gil_scoped_release release;
  const int64_t tasks = B * Hkv;
  const int team = team_size(threads, tasks);
  run_team(team, [&](int th) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(scratch_floats(T, D)) + 16);
    float* base = scratch.data();
    base += (16 - (reinterpret_cast<uintptr_t>(base) / 4) % 16) % 16;  // 64-byte aligned
    Task a{};
    a.T = T;
    a.L = L;
    a.D = D;
    a.G = int(G);
    a.scale = float(scale);
    a.bf16 = bf16;
    a.q_sh = q_sh;
    a.q_sl = q_sl;
    a.k_st = k_st;
    a.v_st = v_st;
    a.o_sh = o_sh;
    a.o_sl = o_sl;
    a.scratch = base;
    for (int64_t i = tasks * th / team; i < tasks * (th + 1) / team; ++i) {
      const int64_t b = i / Hkv, g = i % Hkv;
      a.q = reinterpret_cast<const char*>(q) + size_t(b * q_sb + g * G * q_sh) * width;
      a.k = reinterpret_cast<const char*>(k) + size_t(b * k_sb + g * k_sh) * width;
      a.v = reinterpret_cast<const char*>(v) + size_t(b * v_sb + g * v_sh) * width;
      a.out = reinterpret_cast<char*>(out) + size_t(b * o_sb + g * G * o_sh) * width;
      a.mask = mask ? reinterpret_cast<const uint8_t*>(mask) + b * m_sb : nullptr;
      fn(a);
    }
  });
}

}  // namespace prefill_attention_detail
}  // namespace ragfast

RAGFAST_REGISTER(prefill_attention, [](py::module_& m) {
  using namespace ragfast::prefill_attention_detail;
  m.def("prefill_attention", &prefill_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("out"), py::arg("bf16"), py::arg("B"), py::arg("H"), py::arg("Hkv"), py::arg("L"), py::arg("T"),
        py::arg("D"), py::arg("q_sb"), py::arg("q_sh"), py::arg("q_sl"), py::arg("k_sb"), py::arg("k_sh"),
        py::arg("k_st"), py::arg("v_sb"), py::arg("v_sh"), py::arg("v_st"), py::arg("m_sb"), py::arg("o_sb"),
        py::arg("o_sh"), py::arg("o_sl"), py::arg("scale"), py::arg("threads") = 0,
        "prefill_attention(q, k, v, mask, out, bf16, B, H, Hkv, L, T, D, strides..., scale, threads=0)\n"
        "out[b, h, i] = softmax(scale * q[b, h, i] . k[b, h // (H / Hkv), t]^T over keys t <= T - L + i with\n"
        "mask[b, t]) . v[b, ...] on raw addresses: L query tokens per row after T - L cached ones, element\n"
        "strides (the head dim contiguous), mask a byte per (row, key) with row stride m_sb (0 address: all\n"
        "visible); fp32 sums, queries with no visible key are 0.\n"
        "Use ragfast.ops.prefill_attention.prefill_attention, which checks the tensors; this does not.");
});
