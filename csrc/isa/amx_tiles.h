// The AMX tile configuration of the amx level's kernels, which use every tile at its full size
// (csrc/isa/topk_ip_amx.cpp, w8a8_amx.cpp, decode_attention_amx.cpp; only files compiled with the
// amx level's flags may include this). In an anonymous namespace, as csrc/isa/avx512_vec.h.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace ragfast {
namespace amx_tiles {
namespace {

// The LDTILECFG operand: palette 1, per tile its bytes per row and its rows.
struct alignas(64) TileCfg {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles 16 rows x 64 bytes. A thread configures before its first tile instruction and
// releases (_tile_release) after its last.
inline void configure_16x64() {
  TileCfg cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
}  // namespace amx_tiles
}  // namespace ragfast
