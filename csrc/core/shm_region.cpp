#include "cotenant/shm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "cotenant/errors.h"

namespace cotenant::shm {
namespace {

constexpr mode_t kMode = 0660;
constexpr std::size_t kMaxNameChars = 250;  // after the '/'; NAME_MAX is 255

std::string errno_text(int error) { return std::string(std::strerror(error)); }

void* map_fd(int fd, std::size_t bytes, bool read_only, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, read_only ? PROT_READ : (PROT_READ | PROT_WRITE), MAP_SHARED,
                      fd, 0);
  if (data == MAP_FAILED) {
    int error = errno;
    throw Error("could not map shared memory '" + name + "' (" + std::to_string(bytes) +
                " bytes): " + errno_text(error));
  }
  return data;
}

}  // namespace

void reserve_pages(int fd, std::size_t bytes, const std::string& name) {
  // ftruncate alone makes a sparse object: on a full /dev/shm the first touch
  // of a missing page kills the process with SIGBUS. posix_fallocate takes
  // the pages now, so a full /dev/shm is an error here instead.
  int error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (error == 0) return;
  std::string text = "could not reserve " + std::to_string(bytes) + " bytes of shared memory for '" +
                     name + "': " + errno_text(error);
  if (error == ENOSPC) {
    text += " (/dev/shm is full: free space there, e.g. remove stale cotenant-* objects, or enlarge it)";
  }
  throw Error(text);
}

void ShmRegion::validate_name(std::string_view name) {
  bool ok = name.size() >= 2 && name.size() <= kMaxNameChars + 1 && name[0] == '/';
  for (std::size_t i = 1; ok && i < name.size(); ++i) {
    char c = name[i];
    ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
  }
  if (!ok) {
    throw Error("'" + std::string(name) +
                "' is not a valid shared-memory name: use '/' followed by 1 to 250 characters "
                "from A-Z, a-z, 0-9, '.', '_' and '-'");
  }
}

ShmRegion ShmRegion::create(std::string_view name, std::size_t bytes, bool unlink_on_destroy) {
  validate_name(name);
  if (bytes == 0) throw Error("a shared-memory region needs at least 1 byte");
  std::string n(name);
  int fd = ::shm_open(n.c_str(), O_RDWR | O_CREAT | O_EXCL, kMode);
  if (fd < 0) {
    int error = errno;
    if (error == EEXIST) {
      throw Error("shared memory '" + n +
                  "' already exists: another process owns it, or a stale one is left; remove "
                  "/dev/shm" + n + " if no process uses it");
    }
    throw Error("could not create shared memory '" + n + "': " + errno_text(error));
  }
  // shm_open applies the umask; set the mode the group needs explicitly.
  (void)::fchmod(fd, kMode);
  try {
    reserve_pages(fd, bytes, n);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(n.c_str());
    throw;
  }
  void* data = nullptr;
  try {
    data = map_fd(fd, bytes, false, n);
  } catch (...) {
    ::close(fd);
    ::shm_unlink(n.c_str());
    throw;
  }
  ::close(fd);  // the mapping keeps the object alive
  ShmRegion region;
  region.name_ = std::move(n);
  region.data_ = data;
  region.size_ = bytes;
  region.unlink_on_destroy_ = unlink_on_destroy;
  return region;
}

ShmRegion ShmRegion::open(std::string_view name, std::size_t min_bytes, bool read_only) {
  validate_name(name);
  std::string n(name);
  int fd = ::shm_open(n.c_str(), read_only ? O_RDONLY : O_RDWR, 0);
  if (fd < 0) {
    int error = errno;
    throw Error("could not open shared memory '" + n + "': " + errno_text(error) +
                (error == ENOENT ? " (the process that creates it has not started or has exited)"
                                 : ""));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    int error = errno;
    ::close(fd);
    throw Error("could not inspect shared memory '" + n + "': " + errno_text(error));
  }
  auto bytes = static_cast<std::size_t>(info.st_size);
  if (bytes == 0 || bytes < min_bytes) {
    ::close(fd);
    throw Error("shared memory '" + n + "' holds " + std::to_string(bytes) + " bytes, fewer than the " +
                std::to_string(min_bytes) +
                " expected: it was made by another version of cotenant or is still being created");
  }
  void* data = nullptr;
  try {
    data = map_fd(fd, bytes, read_only, n);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  ShmRegion region;
  region.name_ = std::move(n);
  region.data_ = data;
  region.size_ = bytes;
  region.read_only_ = read_only;
  return region;
}

bool ShmRegion::unlink(std::string_view name) {
  validate_name(name);
  std::string n(name);
  if (::shm_unlink(n.c_str()) == 0) return true;
  int error = errno;
  if (error == ENOENT) return false;
  throw Error("could not remove shared memory '" + n + "': " + errno_text(error));
}

bool ShmRegion::exists(std::string_view name) {
  validate_name(name);
  std::string n(name);
  int fd = ::shm_open(n.c_str(), O_RDONLY, 0);
  if (fd >= 0) {
    ::close(fd);
    return true;
  }
  return errno != ENOENT;  // EACCES: it exists, we just may not read it
}

ShmRegion::~ShmRegion() { reset(); }

ShmRegion::ShmRegion(ShmRegion&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      read_only_(other.read_only_),
      unlink_on_destroy_(std::exchange(other.unlink_on_destroy_, false)) {}

ShmRegion& ShmRegion::operator=(ShmRegion&& other) noexcept {
  if (this != &other) {
    reset();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    read_only_ = other.read_only_;
    unlink_on_destroy_ = std::exchange(other.unlink_on_destroy_, false);
  }
  return *this;
}

void ShmRegion::unlink_name() {
  if (!name_.empty()) ::shm_unlink(name_.c_str());
  unlink_on_destroy_ = false;
}

void ShmRegion::reset() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (unlink_on_destroy_ && !name_.empty()) ::shm_unlink(name_.c_str());
  data_ = nullptr;
  size_ = 0;
  unlink_on_destroy_ = false;
}

}  // namespace cotenant::shm
