// The AMX tile set-up shared by sglite's tile kernels (quant_amx.h's GEMM, amx_attention.h's
// attention), spliced by sglite.kernels.cpu_build.read_source. Needs <immintrin.h> and a build
// with -mamx-tile (or -march=native on an AMX CPU).
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

namespace sglite_tiles {

// Linux keeps the tile state off until the process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA), once per process; true when granted (later calls: the first answer).
inline bool granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every kernel's layout: tiles 0..7 of 16 rows x 64 bytes (C: 16 x 16 float32; A: 16 rows x 32
// bf16; B: 16 pair-rows x 16 columns). Per thread: call before a share's first tile op and
// _tile_release() after its last.
inline void configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
}

}  // namespace sglite_tiles
