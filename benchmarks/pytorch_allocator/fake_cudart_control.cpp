// The fake CUDA runtime's control API with C linkage, for a Python process
// that loads the fake as its libcudart.so.N (snapshot_over_fake.py, through
// ctypes): configure the device before torch touches it, and read what the
// fake counted. Built into the fake libcudart only.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include "fake_cuda.h"

extern "C" {

// fake_cuda_reset's flags.
constexpr int kGarbageInNewPages = 1;  // new pages hold 0xA5 bytes: the driver does not promise zeros
constexpr int kNoHostVmm = 2;          // the device cannot map host pages (cotenant's pinned fallback mode)

// Waits for every stream and forgets all state, as fake_cuda::reset does,
// with a device of `device_capacity` bytes, a host that pins at most
// `host_capacity` bytes, and the `flags` above.
void fake_cuda_reset(std::uint64_t device_capacity, int flags, std::uint64_t host_capacity) {
  fake_cuda::Config config;
  config.device_capacity = device_capacity;
  config.host_capacity = host_capacity;
  config.garbage_in_new_pages = (flags & kGarbageInNewPages) != 0;
  config.host_vmm = (flags & kNoHostVmm) == 0;
  fake_cuda::reset(config);
}

// Each queued copy sleeps this long on its stream before it runs (fake_cuda::set_delay).
void fake_cuda_set_delay_us(std::uint64_t microseconds) {
  fake_cuda::set_delay(std::chrono::microseconds(microseconds));
}

// Queued work waits until some caller waits for work (fake_cuda::hold_streams).
void fake_cuda_hold_streams() { fake_cuda::hold_streams(); }

std::uint64_t fake_cuda_calls(const char* entry) { return fake_cuda::calls(entry); }

// Every entry called since the reset, one "name count" line each, written
// to `out` (NUL-terminated) when `size` is large enough; returns the size
// the text needs, NUL included.
std::uint64_t fake_cuda_call_table(char* out, std::uint64_t size) {
  std::string text;
  for (const auto& [entry, count] : fake_cuda::all_calls()) text += entry + " " + std::to_string(count) + "\n";
  if (out != nullptr && size > text.size()) std::memcpy(out, text.c_str(), text.size() + 1);
  return text.size() + 1;
}

std::uint64_t fake_cuda_device_bytes_created() { return fake_cuda::device_bytes_created(); }

std::uint64_t fake_cuda_violation_count() { return fake_cuda::violations().count; }

// Copies violation `index` (0-based, in order) into `out` (NUL-terminated,
// cut to `size` - 1 bytes); returns the message's full length, or -1 when
// there is no such violation.
std::int64_t fake_cuda_violation(std::uint64_t index, char* out, std::uint64_t size) {
  const fake_cuda::Violations v = fake_cuda::violations();
  if (index >= v.messages.size()) return -1;
  const std::string& message = v.messages[index];
  if (size > 0) {
    const std::size_t n = std::min<std::size_t>(message.size(), size - 1);
    std::memcpy(out, message.data(), n);
    out[n] = '\0';
  }
  return static_cast<std::int64_t>(message.size());
}

}  // extern "C"
