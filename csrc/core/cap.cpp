#include "cotenant/cap.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/size.h"

namespace cotenant {
namespace {

constexpr const char* kAcceptedForms =
    "write a size (\"6GiB\", \"512MiB\", \"4096\" bytes), a fraction of the device (\"0.5\" or \"50%\"), or "
    "\"none\" for no cap";

std::string trimmed_lower(std::string_view text) {
  std::size_t begin = 0, end = text.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  std::string out(text.substr(begin, end - begin));
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

[[noreturn]] void refuse(std::string_view text, std::string_view why) {
  throw Error(fmt::format("cannot use \"{}\" as a memory cap: {}; {}", text, why, kAcceptedForms));
}

// A plain decimal number ("0.5", ".25", "1.0"), nothing else.
std::optional<double> decimal(const std::string& text) {
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c)) && c != '.') return std::nullopt;
  }
  try {
    std::size_t used = 0;
    const double value = std::stod(text, &used);
    if (used != text.size()) return std::nullopt;
    return value;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

Cap Cap::of_bytes(std::uint64_t bytes) {
  if (bytes == 0) {
    throw Error(
        "a memory cap of 0 bytes would leave the job no device memory; give a positive cap (e.g. \"512MiB\"), "
        "or spill everything to the host with spill_all()");
  }
  if (bytes == kNoCap) throw Error("a memory cap of 2**64-1 bytes is not a cap; to remove the cap use none");
  Cap cap;
  cap.kind_ = Kind::kBytes;
  cap.bytes_ = bytes;
  return cap;
}

Cap Cap::of_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw Error(fmt::format(
        "a memory cap given as a fraction of the device must be in (0, 1], got {}; write e.g. 0.5 for half "
        "the device, or a size such as \"6GiB\"",
        fraction));
  }
  Cap cap;
  cap.kind_ = Kind::kFraction;
  cap.fraction_ = fraction;
  return cap;
}

Cap Cap::parse(std::string_view text) {
  const std::string t = trimmed_lower(text);
  // Empty is refused, not read as no cap: an unset shell variable
  // (`cotenant set-cap job "$CAP"`) must not lift a cap without a word.
  if (t.empty()) refuse(text, "it is empty (write \"none\" for no cap)");
  if (t == "none" || t == "unlimited") return none();
  if (t.front() == '-') refuse(text, "a cap cannot be negative");
  if (t.back() == '%') {
    const std::optional<double> percent = decimal(trimmed_lower(std::string_view(t).substr(0, t.size() - 1)));
    if (!percent) refuse(text, "a percentage must be a number followed by %");
    if (!(*percent > 0.0 && *percent <= 100.0)) refuse(text, "a percentage of the device must be in (0, 100]");
    return of_fraction(*percent / 100.0);
  }
  // A number with a decimal point and no unit is a fraction of the device;
  // "1.5GiB" and "4096" are sizes.
  if (t.find('.') != std::string::npos) {
    if (const std::optional<double> value = decimal(t)) {
      if (!(*value > 0.0 && *value <= 1.0)) {
        refuse(text, "a number with a decimal point is a fraction of the device and must be in (0, 1]; for "
                     "bytes write a whole number or add a unit");
      }
      return of_fraction(*value);
    }
  }
  std::uint64_t bytes = 0;
  try {
    bytes = parse_size(t);
  } catch (const Error&) {
    refuse(text, "it is neither a size, a fraction nor \"none\"");
  }
  if (bytes == 0) refuse(text, "a cap of 0 bytes would leave the job no device memory (to move everything to the host, use spill_all)");
  return of_bytes(bytes);
}

Cap Cap::from_word(std::uint64_t word) { return word == kNoCap ? none() : of_bytes(word); }

std::optional<std::uint64_t> Cap::bytes() const {
  if (kind_ != Kind::kBytes) return std::nullopt;
  return bytes_;
}

std::optional<std::uint64_t> Cap::resolve(std::uint64_t device_total_bytes) const {
  switch (kind_) {
    case Kind::kNone: return std::nullopt;
    case Kind::kBytes: return bytes_;
    case Kind::kFraction:
      if (device_total_bytes == 0) {
        throw Error(fmt::format("the memory cap {} is a fraction of the device, and the device's size is not known "
                                "here; give the cap in bytes (e.g. \"6GiB\")",
                                to_string()));
      }
      if (fraction_ >= 1.0) return std::nullopt;
      return std::max<std::uint64_t>(1, static_cast<std::uint64_t>(fraction_ * static_cast<double>(device_total_bytes)));
  }
  return std::nullopt;
}

std::uint64_t Cap::to_word(std::uint64_t device_total_bytes) const {
  return resolve(device_total_bytes).value_or(kNoCap);
}

std::string Cap::to_string() const {
  switch (kind_) {
    case Kind::kNone: return "none";
    case Kind::kBytes: return format_size(bytes_);
    case Kind::kFraction: return fmt::format("{:g}%", fraction_ * 100.0);
  }
  return "none";
}

std::string Cap::to_text() const {
  switch (kind_) {
    case Kind::kNone: return "none";
    case Kind::kBytes: return std::to_string(bytes_);
    case Kind::kFraction: {
      std::string out = fmt::format("{:.17g}", fraction_);
      if (out.find('.') == std::string::npos) out += ".0";  // "1" would read as one byte
      return out;
    }
  }
  return "none";
}

}  // namespace cotenant
