// Runtime choice of the ISA level the compiled kernels run at.
//
// One build of ragfast._C carries kernels for several levels, each compiled in its own
// translation unit with its own target flags (csrc/isa/). At first use the best level that
// both is compiled in and runs on this CPU is chosen, unless RAGFAST_ISA forces one; a forced
// level the CPU lacks is refused with an error, so no kernel ever meets an illegal instruction.
#pragma once
#include <string>
#include <vector>

#include "isa_levels.h"

namespace ragfast {
namespace isa {

// The levels, spelled once in csrc/isa_levels.h: RAGFAST_ISA_LEVELS(X), X(enumerator, name,
// features, flags).
#define RAGFAST_ISA_ENUM_(e, n, features, flags) e,
enum Level : int { RAGFAST_ISA_LEVELS(RAGFAST_ISA_ENUM_) kNumLevels };
#undef RAGFAST_ISA_ENUM_

// The level's name: "generic", "avx2", ... (csrc/isa_levels.h).
const char* name(int level);
// Whether this build carries the level's kernels.
bool compiled(int level);
// The CPU features the level needs that this CPU lacks (empty: it runs here).
std::vector<std::string> missing(int level);
// The CPU features relevant to the levels that this CPU has, e.g. {"avx2", "fma", ...}.
std::vector<std::string> cpu_features();
// The level ops run at. Resolved at first use from RAGFAST_ISA (unset or "auto": the best
// level compiled in and supported). Throws std::runtime_error, every time, while RAGFAST_ISA
// names an unknown level, one not compiled in, or one this CPU cannot run.
int current();
// Why current() is what it is (or why RAGFAST_ISA is refused).
std::string reason();
// Switch level at runtime (tests, benchmarks). `want` is a level name or "auto". Throws
// std::invalid_argument when it cannot run here. Names are exact: "avx512" is AVX-512
// F/BW/VL/DQ/CD without BF16/VNNI (bf16 and int8 widened to fp32); "avx512vnni" adds VNNI;
// "avx512bf16" adds BF16 and VNNI; "amx" adds the AMX tiles.
int set_current(const std::string& want);

}  // namespace isa
}  // namespace ragfast
