#include "iq_tables.h"

#include <array>

namespace pocketmoe::tables {
namespace {

#include "iq_grids.inc"

uint64_t pack_bytes(const int8_t (&v)[8]) {
  uint64_t out = 0;
  for (int j = 0; j < 8; ++j) out |= uint64_t{static_cast<uint8_t>(v[j])} << (8 * j);
  return out;
}

int8_t byte_of(uint64_t row, int j) { return static_cast<int8_t>((row >> (8 * j)) & 0xFF); }

std::array<uint64_t, 4096> make_iq1m() {
  std::array<uint64_t, 4096> t{};
  for (int i = 0; i < 4096; ++i) {
    const int delta = i & 0x800 ? -1 : 1;
    int8_t v[8];
    for (int j = 0; j < 8; ++j) v[j] = static_cast<int8_t>(8 * byte_of(kIq1sGrid[i & 0x7FF], j) + 16 + delta);
    t[i] = pack_bytes(v);
  }
  return t;
}

const std::array<uint64_t, 4096> iq1m = make_iq1m();

}  // namespace

const uint64_t* const kIq2xxs = kIq2xxsGrid;
const uint64_t* const kIq1m = iq1m.data();
const uint64_t* const kIq2xs = kIq2xsGrid;
const uint64_t* const kIq2s = kIq2sGrid;
const uint32_t* const kIq3s = kIq3sGrid;
const uint32_t* const kIq3xxs = kIq3xxsGrid;
const uint64_t* const kIq1Grid = kIq1sGrid;

}  // namespace pocketmoe::tables
