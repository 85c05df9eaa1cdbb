// CRC-32C (Castagnoli), the checksum of iSCSI and ext4: checkpoint sections, token files,
// spec agreement across ranks.
#ifndef RACKRUN_BASE_CRC32C_H_
#define RACKRUN_BASE_CRC32C_H_

#include <cstdint>
#include <string_view>

namespace rackrun::base {

// CRC-32C of `data`; `crc` continues a previous value (Crc32c(a + b) ==
// Crc32c(b, Crc32c(a))).
uint32_t Crc32c(std::string_view data, uint32_t crc = 0);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_CRC32C_H_
