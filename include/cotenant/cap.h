// Cap: the one definition of a memory cap, a bound on the bytes of a job's
// memory that live on the device, or none.
//
// Every layer takes a cap through this type: the C++ allocator, the Python
// API (cotenant._core.Cap), the CLI, the environment (COTENANT_MEMORY_CAP)
// and the coordinator. A cap is written as
//   - a number of bytes, or a size string ("6GiB", "512MiB", "4096"): see
//     parse_size();
//   - a fraction of the device's memory: a number in (0, 1] with a decimal
//     point ("0.5") or a percentage ("50%"); it becomes bytes on the device
//     the job runs on (resolve());
//   - "none" (or "unlimited", or an empty string): no cap.
// A cap of 0 bytes (or 0%) is refused: spill_all() moves everything to the
// host, and a job with no device memory at all cannot launch a kernel.
//
// In shared memory and in the allocator's state a resolved cap travels as one
// 64-bit word, kNoCap for none (to_word() / from_word()).
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace cotenant {

// The word that means "no cap" wherever a resolved cap is one integer.
inline constexpr std::uint64_t kNoCap = std::numeric_limits<std::uint64_t>::max();

class Cap {
 public:
  constexpr Cap() = default;  // no cap
  static Cap none() { return Cap(); }
  // Throws cotenant::Error for 0 bytes or kNoCap.
  static Cap of_bytes(std::uint64_t bytes);
  // Throws cotenant::Error outside (0, 1].
  static Cap of_fraction(double fraction);
  // Parses the forms above; throws cotenant::Error naming the input, why it
  // was refused and the accepted forms.
  static Cap parse(std::string_view text);
  // The inverse of to_word(): kNoCap is none, anything else bytes.
  static Cap from_word(std::uint64_t word);

  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_fraction() const { return kind_ == Kind::kFraction; }
  std::optional<std::uint64_t> bytes() const;  // for a byte cap; nullopt otherwise
  double fraction() const { return fraction_; }  // for a fraction cap

  // The cap on a device of `device_total_bytes`: bytes, or nullopt for none.
  // A fraction of 1 is the whole device: no cap.
  std::optional<std::uint64_t> resolve(std::uint64_t device_total_bytes) const;
  // resolve() as one word (kNoCap for none). A fraction needs the device's
  // size: without it (0) to_word() throws.
  std::uint64_t to_word(std::uint64_t device_total_bytes = 0) const;

  // "none", "6.00 GiB", "50%": for messages, tables and the environment
  // (parse(to_string()) gives the same cap, to the byte for byte caps).
  std::string to_string() const;
  // Exact text for the environment and the wire: "none", "6442450944", "0.5".
  std::string to_text() const;

  bool operator==(const Cap& other) const {
    return kind_ == other.kind_ && bytes_ == other.bytes_ && fraction_ == other.fraction_;
  }

 private:
  enum class Kind : std::uint8_t { kNone, kBytes, kFraction };
  Kind kind_ = Kind::kNone;
  std::uint64_t bytes_ = 0;
  double fraction_ = 0.0;
};

}  // namespace cotenant
