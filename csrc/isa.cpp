// Runtime ISA level: CPU feature detection (cpuid through __builtin_cpu_supports, which also
// checks that the OS saves the AVX / AVX-512 register state) and RAGFAST_ISA.
#include "isa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace ragfast {
namespace isa {
namespace {

const char* const kNames[kNumLevels] = {"generic", "avx2", "avx512", "avx512vnni", "avx512bf16"};

#if defined(RAGFAST_X86_LEVELS) && (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define RAGFAST_CPU_X86 1
#endif

// Features each level's translation unit is compiled for (see CMakeLists.txt).
std::vector<std::string> needs(int level) {
  switch (level) {
    case kAvx2: return {"avx2", "fma", "f16c"};
    case kAvx512: return {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"};
    case kAvx512Vnni:
      return {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512vnni"};
    case kAvx512Bf16:
      return {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512bf16",
              "avx512vnni"};
    default: return {};
  }
}

bool has(const std::string& f) {
#ifdef RAGFAST_CPU_X86
  __builtin_cpu_init();
  // __builtin_cpu_supports needs a string literal
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512cd") return __builtin_cpu_supports("avx512cd");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  if (f == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
#else
  (void)f;
#endif
  return false;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

bool runs(int level) { return compiled(level) && missing(level).empty(); }

int best() {
  for (int l = kNumLevels - 1; l > 0; --l)
    if (runs(l)) return l;
  return kGeneric;
}

std::vector<std::string> runnable() {
  std::vector<std::string> v;
  for (int l = 0; l < kNumLevels; ++l)
    if (runs(l)) v.push_back(kNames[l]);
  return v;
}

// Resolve a requested level name; on failure `err` says why.
int resolve(const std::string& want, std::string& err) {
  if (want.empty() || want == "auto") return best();
  int level = -1;
  for (int l = 0; l < kNumLevels; ++l)
    if (want == kNames[l]) level = l;
  if (level < 0) {
    err = "unknown ISA level '" + want + "' (expected auto, generic, avx2, avx512, avx512vnni or avx512bf16)";
    return -1;
  }
  if (!compiled(level)) {
    err = "ISA level '" + want + "' is not compiled into this build (x86-64 levels need an x86-64 build)";
    return -1;
  }
  const auto miss = missing(level);
  if (!miss.empty()) {
    err = "ISA level '" + want + "' cannot run on this CPU: it lacks " + join(miss) + " (levels that run here: " +
          join(runnable()) + ")";
    return -1;
  }
  return level;
}

std::mutex g_mu;
bool g_resolved = false;
std::atomic<int> g_level{-1};
std::string g_reason;

void resolve_env() {  // caller holds g_mu
  if (g_resolved) return;
  const char* env = std::getenv("RAGFAST_ISA");
  const std::string want = env ? env : "";
  std::string err;
  const int level = resolve(want, err);
  if (level < 0) {
    g_reason = "RAGFAST_ISA=" + want + " refused: " + err;
    g_level = -1;
  } else if (want.empty() || want == "auto") {
    g_reason = std::string("auto: the best level compiled in that this CPU supports (cpu: ") + join(cpu_features()) +
               ")";
    g_level = level;
  } else {
    g_reason = "forced by RAGFAST_ISA=" + want;
    g_level = level;
  }
  g_resolved = true;
}

}  // namespace

const char* name(int level) { return level >= 0 && level < kNumLevels ? kNames[level] : "?"; }

bool compiled(int level) {
  switch (level) {
    case kGeneric: return true;
#ifdef RAGFAST_X86_LEVELS
    case kAvx2: return true;
    case kAvx512: return true;
#ifdef RAGFAST_HAVE_AVX512VNNI
    case kAvx512Vnni: return true;
#endif
#ifdef RAGFAST_HAVE_AVX512BF16
    case kAvx512Bf16: return true;
#endif
#endif
    default: return false;
  }
}

std::vector<std::string> missing(int level) {
  std::vector<std::string> m;
  for (const auto& f : needs(level))
    if (!has(f)) m.push_back(f);
  return m;
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> v;
  for (const auto& f : needs(kAvx512Bf16))
    if (has(f)) v.push_back(f);
  return v;
}

int current() {
  int l = g_level.load(std::memory_order_acquire);
  if (l >= 0) return l;
  std::lock_guard<std::mutex> lock(g_mu);
  resolve_env();
  if (g_level < 0) throw std::runtime_error(g_reason);
  return g_level;
}

std::string reason() {
  std::lock_guard<std::mutex> lock(g_mu);
  resolve_env();
  return g_reason;
}

int set_current(const std::string& want) {
  std::string err;
  const int level = resolve(want, err);
  if (level < 0) throw std::invalid_argument(err);
  std::lock_guard<std::mutex> lock(g_mu);
  g_resolved = true;
  g_reason = want == "auto" ? "auto (set at runtime)" : "set at runtime: " + want;
  g_level = level;
  return level;
}

}  // namespace isa
}  // namespace ragfast
