// Runtime ISA level: CPU feature detection (cpuid through __builtin_cpu_supports, which also
// checks that the OS saves the AVX / AVX-512 register state), the OS's permission to use the
// AMX tile data (Linux arch_prctl), and RAGFAST_ISA.
#include "isa.h"
#include "isa_compiled.h"

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ragfast {
namespace isa {
namespace {

#define RAGFAST_ISA_NAME_(e, n, features, flags) #n,
const char* const kNames[kNumLevels] = {RAGFAST_ISA_LEVELS(RAGFAST_ISA_NAME_)};
#undef RAGFAST_ISA_NAME_
#define RAGFAST_ISA_NEEDS_(e, n, features, flags) features,
const char* const kNeeds[kNumLevels] = {RAGFAST_ISA_LEVELS(RAGFAST_ISA_NEEDS_)};
#undef RAGFAST_ISA_NEEDS_

// The feature that stands for the OS's permission to use the AMX tile data (see amx_permission).
const char* const kAmxOs = "amx-os-permission";

#if defined(RAGFAST_X86_LEVELS) && (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define RAGFAST_CPU_X86 1
#include <cpuid.h>
#endif

// Features each level's translation units are compiled for (csrc/isa_levels.h).
std::vector<std::string> needs(int level) {
  std::vector<std::string> v;
  if (level < 0 || level >= kNumLevels) return v;
  std::string f;
  for (const char* c = kNeeds[level];; ++c) {
    if (*c == ' ' || *c == '\0') {
      if (!f.empty()) v.push_back(f);
      f.clear();
      if (*c == '\0') break;
    } else {
      f += *c;
    }
  }
  return v;
}

// Linux hands a process the 8 KB AMX tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16+); a tile instruction without it
// faults. Asked once per process (the permission then covers every thread); "" when granted,
// else why not. RAGFAST_AMX_DENY=1 makes it a refusal, to see (and test) the fallback.
const std::string& amx_permission() {
  static const std::string why = []() -> std::string {
    const char* deny = std::getenv("RAGFAST_AMX_DENY");
    if (deny && *deny && std::string(deny) != "0") return "refused by RAGFAST_AMX_DENY";
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0) return "";
    return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused: ") + std::strerror(errno);
#else
    return "no way to ask this OS for the AMX tile state";
#endif
  }();
  return why;
}

bool has(const std::string& f) {
#ifdef RAGFAST_CPU_X86
  __builtin_cpu_init();
  // __builtin_cpu_supports needs a string literal
#define RAGFAST_CPU_FEATURE_(n) \
  if (f == n) return __builtin_cpu_supports(n);
  RAGFAST_CPU_FEATURES(RAGFAST_CPU_FEATURE_)
#undef RAGFAST_CPU_FEATURE_
  // AMX from cpuid leaf 7 (EDX bits 22, 24, 25): __builtin_cpu_supports names for AMX are
  // newer than the compilers this file must build with (GCC 12, Clang 16)
  if (f == "amx-tile" || f == "amx-bf16" || f == "amx-int8" || f == kAmxOs) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool bf16 = d & (1u << 22), tile = d & (1u << 24), int8 = d & (1u << 25);
    if (f == "amx-tile") return tile;
    if (f == "amx-bf16") return bf16;
    if (f == "amx-int8") return int8;
    // asked only once the CPU has the tiles (elsewhere the request is pointless)
    return tile && bf16 && int8 && amx_permission().empty();
  }
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
    std::string all;
    for (int l = 0; l < kNumLevels; ++l) all += std::string(", ") + kNames[l];
    err = "unknown ISA level '" + want + "' (expected auto" + all + ")";
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
#define RAGFAST_ISA_COMPILED_(e, n) \
  case e: return true;
    RAGFAST_ISA_COMPILED(RAGFAST_ISA_COMPILED_)
#undef RAGFAST_ISA_COMPILED_
    default: return false;
  }
}

std::vector<std::string> missing(int level) {
  std::vector<std::string> m;
  for (const auto& f : needs(level))
    if (has(f)) continue;
    else if (f != kAmxOs) m.push_back(f);
    else if (has("amx-tile") && has("amx-bf16") && has("amx-int8"))  // tiles present, the OS said no
      m.push_back("OS permission for AMX (" + amx_permission() + ")");
  return m;
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> v;
  for (const auto& f : needs(kNumLevels - 1))  // the top level needs every lower level's features
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
