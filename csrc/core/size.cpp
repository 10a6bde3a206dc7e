#include "cotenant/size.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <string>

#include "cotenant/errors.h"

namespace cotenant {
namespace {

constexpr const char* kAcceptedForms =
    "write a non-negative number of bytes with an optional unit, e.g. \"4096\", "
    "\"512MiB\", \"6GiB\", \"1.5GB\" (units: B, KB/MB/GB/TB = powers of 1000, "
    "KiB/MiB/GiB/TiB or K/M/G/T = powers of 1024)";

[[noreturn]] void reject(std::string_view text, std::string_view why) {
  throw Error(fmt::format("cannot read \"{}\" as a memory size: {}; {}", text, why, kAcceptedForms));
}

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Bytes per unit, or 0 for an unknown unit.
long double unit_multiplier(const std::string& unit) {
  constexpr long double kKi = 1024.0L, kK = 1000.0L;
  if (unit.empty() || unit == "b") return 1.0L;
  if (unit == "k" || unit == "kib") return kKi;
  if (unit == "m" || unit == "mib") return kKi * kKi;
  if (unit == "g" || unit == "gib") return kKi * kKi * kKi;
  if (unit == "t" || unit == "tib") return kKi * kKi * kKi * kKi;
  if (unit == "kb") return kK;
  if (unit == "mb") return kK * kK;
  if (unit == "gb") return kK * kK * kK;
  if (unit == "tb") return kK * kK * kK * kK;
  return 0.0L;
}

}  // namespace

std::uint64_t parse_size(std::string_view text) {
  std::size_t i = 0;
  auto skip_spaces = [&] {
    while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  };
  skip_spaces();
  if (i == text.size()) reject(text, "it is empty");
  if (text[i] == '-') reject(text, "a size cannot be negative");
  if (text[i] == '+') ++i;

  const std::size_t number_start = i;
  std::size_t digits = 0;
  bool seen_point = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || (text[i] == '.' && !seen_point))) {
    if (text[i] == '.') seen_point = true; else ++digits;
    ++i;
  }
  if (digits == 0) reject(text, "it does not start with a number");
  const long double number = std::stold(std::string(text.substr(number_start, i - number_start)));

  skip_spaces();
  const std::size_t unit_start = i;
  while (i < text.size() && std::isalpha(static_cast<unsigned char>(text[i]))) ++i;
  const std::string unit = lower(text.substr(unit_start, i - unit_start));
  skip_spaces();
  if (i != text.size()) reject(text, fmt::format("unexpected \"{}\" after the size", text.substr(i)));

  const long double multiplier = unit_multiplier(unit);
  if (multiplier == 0.0L) reject(text, fmt::format("\"{}\" is not a unit", text.substr(unit_start, unit.size())));
  const long double bytes = number * multiplier;
  if (bytes >= 18446744073709551615.0L) reject(text, "it is too large");
  if (bytes != std::floor(bytes)) reject(text, "it is not a whole number of bytes");
  return static_cast<std::uint64_t>(bytes);
}

std::string format_size(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double value = static_cast<double>(bytes) / 1024.0;
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace cotenant
