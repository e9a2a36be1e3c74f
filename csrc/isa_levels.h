// The ISA levels of the compiled kernels, spelled once. Read by the C++ code (csrc/isa.h: the
// enum, names, feature checks) and by CMakeLists.txt (which parses the X(...) lines below: one
// per line, the same shape, to know each level's compiler flags and which csrc/isa/*_<name>.cpp
// files make it; it then writes the list of the levels this build compiles into
// <build>/generated/isa_compiled.h).
//
// X(enumerator, name, "CPU features it needs", "compiler flags of its files"). Ordered: a higher
// level runs everything a lower one does. avx512vnni is AVX-512 with VNNI and without BF16
// (Cascade Lake, Ice Lake); avx512bf16 has both (Sapphire Rapids, Zen 4); amx adds AMX-TILE,
// AMX-BF16 and AMX-INT8 with the OS's permission to use the tile data (Sapphire, Emerald and
// Granite Rapids). A level is compiled in when the compiler accepts its flags; its kernels are
// csrc/isa/topk_ip_<name>.cpp (and csrc/isa/policy_<name>.cpp where it has one).
//
// Adding a level: a line here (its features in RAGFAST_CPU_FEATURES below if new),
// csrc/isa/topk_ip_<name>.cpp, kernels for its new instructions under csrc/topk_ip/, and the
// level in tests/test_topk_ip.py (ALL_LEVELS, the objdump check) and README's level list.
#pragma once

// clang-format off
#define RAGFAST_ISA_LEVELS(X) \
  X(kGeneric, generic, "", "") \
  X(kAvx2, avx2, "avx2 fma f16c", "-mavx2 -mfma -mf16c") \
  X(kAvx512, avx512, "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd", "-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512cd") \
  X(kAvx512Vnni, avx512vnni, "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512vnni", "-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512cd -mavx512vnni") \
  X(kAvx512Bf16, avx512bf16, "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512bf16 avx512vnni", "-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512cd -mavx512bf16 -mavx512vnni") \
  X(kAmx, amx, "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd avx512bf16 avx512vnni amx-tile amx-bf16 amx-int8 amx-os-permission", "-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512cd -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -mamx-int8")
// clang-format on

// The features above that __builtin_cpu_supports knows by these names (csrc/isa.cpp checks the
// others, AMX's cpuid bits and the OS's permission, itself).
#define RAGFAST_CPU_FEATURES(F) \
  F("avx2") F("fma") F("f16c") F("avx512f") F("avx512bw") F("avx512vl") F("avx512dq") F("avx512cd") \
  F("avx512bf16") F("avx512vnni")
