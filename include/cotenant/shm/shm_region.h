// ShmRegion: one POSIX shared-memory object (shm_open + posix_fallocate + mmap),
// owned for the lifetime of the object (RAII).
//
// Names follow POSIX rules: a leading '/', then 1..250 characters from
// [A-Za-z0-9._-] (no further '/'). Segments are created with mode 0660 so the
// processes of one group (the coordinator and its jobs) can share them.
//
// Ownership: the mapping is always released by the destructor; the name is
// unlinked only by unlink() (or when the creator asked for unlink_on_destroy).
// A job's block must outlive the coordinator process, so nothing unlinks by
// default.
//
// Thread safety: the object itself is not synchronized; the mapped bytes are
// shared memory, so whoever reads and writes them defines the protocol
// (atomics or a seqlock, see job_block.h).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace cotenant::shm {

// Gives the shared-memory object behind `fd` its first `bytes` bytes and
// reserves their pages (posix_fallocate), so that touching them later can
// never raise SIGBUS. Throws cotenant::Error naming `name` and the cause
// ("No space left on device" when /dev/shm is full).
void reserve_pages(int fd, std::size_t bytes, const std::string& name);

class ShmRegion {
 public:
  // Creates a new object named `name` of `bytes` bytes, zero-filled, its
  // pages reserved (see reserve_pages). Throws cotenant::Error if the name is
  // invalid, the object already exists or /dev/shm has no room; on error no
  // name is left behind.
  static ShmRegion create(std::string_view name, std::size_t bytes, bool unlink_on_destroy = false);
  // Opens an existing object read-write (or read-only) and maps all of it.
  // Throws cotenant::Error if it does not exist or is smaller than `min_bytes`.
  static ShmRegion open(std::string_view name, std::size_t min_bytes = 0, bool read_only = false);
  // Removes the name (mappings stay valid). Returns false if it did not exist.
  static bool unlink(std::string_view name);
  static bool exists(std::string_view name);
  // Throws cotenant::Error with a sentence if `name` is not a valid name.
  static void validate_name(std::string_view name);

  ShmRegion() = default;
  ~ShmRegion();
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool valid() const { return data_ != nullptr; }
  bool read_only() const { return read_only_; }
  // Unlinks the name now; the mapping stays until destruction.
  void unlink_name();

 private:
  void reset() noexcept;
  std::string name_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  bool read_only_ = false;
  bool unlink_on_destroy_ = false;
};

}  // namespace cotenant::shm
