// The one parser for memory sizes ("6GiB", "512MiB", "1.5GB", "4096").
// The C++ API, the Python API, the CLI and trace files all go through it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cotenant {

// Parses a size in bytes. Accepts a non-negative integer or decimal number
// followed by an optional unit: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB
// (powers of 1024), or K/M/G/T (taken as binary, as PyTorch and nvidia-smi
// users mean them); case-insensitive, spaces between number and unit allowed.
// Throws cotenant::Error naming the input and the accepted forms otherwise
// (empty, negative, unknown unit, trailing junk, overflow).
std::uint64_t parse_size(std::string_view text);

// "6.00 GiB", "512.00 MiB", "4096 B": for messages and tables.
std::string format_size(std::uint64_t bytes);

}  // namespace cotenant
