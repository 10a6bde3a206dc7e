#include "cotenant/host_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <string_view>

namespace cotenant {

namespace fs = std::filesystem;

namespace {

// v1 reports "no limit" as the largest page-aligned signed 64-bit count.
constexpr std::uint64_t kNoLimitAbove = std::uint64_t{1} << 62;

// A small file's text (what one read() gives, at most 16 KiB: meminfo and
// memory.stat fit), or nullopt where it cannot be read. open/read rather than
// a stream: these files are read before each pin.
std::optional<std::string> read_text(const char* path) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text(16 * 1024, '\0');
  std::size_t filled = 0;
  while (filled < text.size()) {
    const ssize_t got = ::read(fd, text.data() + filled, text.size() - filled);
    if (got < 0) {
      ::close(fd);
      return std::nullopt;
    }
    if (got == 0) break;
    filled += static_cast<std::size_t>(got);
  }
  ::close(fd);
  text.resize(filled);
  return text;
}

// The decimal number at the start of `text` (after blanks); nullopt if none.
std::optional<std::uint64_t> parse_number(std::string_view text) {
  const std::size_t at = text.find_first_not_of(" \t");
  if (at == std::string_view::npos) return std::nullopt;
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data() + at, text.data() + text.size(), value);
  if (error != std::errc{} || end == text.data() + at) return std::nullopt;
  return value;
}

// Calls `visit` on each `separator`-delimited piece of `text` until it
// returns true; returns whether one did.
template <class Visit>
bool any_piece(std::string_view text, char separator, Visit visit) {
  for (std::size_t at = 0; at <= text.size();) {
    const std::size_t end = std::min(text.find(separator, at), text.size());
    if (visit(text.substr(at, end - at))) return true;
    at = end + 1;
  }
  return false;
}

// The number a cgroup file holds; nullopt where it is missing, unreadable,
// or says "max" (v2's no limit).
std::optional<std::uint64_t> read_number(const fs::path& file) {
  const std::optional<std::string> text = read_text(file.c_str());
  return text ? parse_number(*text) : std::nullopt;
}

// The value of the line "<key> <value>" (memory.stat) or "<key>: <value>"
// (meminfo) in `text`; nullopt where there is none.
std::optional<std::uint64_t> keyed_value(std::string_view text, std::string_view key) {
  std::optional<std::uint64_t> value;
  any_piece(text, '\n', [&](std::string_view line) {
    if (line.size() <= key.size() || line.compare(0, key.size(), key) != 0 ||
        (line[key.size()] != ' ' && line[key.size()] != ':')) {
      return false;
    }
    value = parse_number(line.substr(key.size() + 1));
    return true;
  });
  return value;
}

struct CgroupFiles {
  const char* limit;
  const char* usage;
  const char* inactive_file;           // in memory.stat
  const char* inactive_file_fallback;  // where the first is missing; may be null
};

constexpr CgroupFiles kV2{"memory.max", "memory.current", "inactive_file", nullptr};
constexpr CgroupFiles kV1{"memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "inactive_file"};

// Inactive file pages from a memory.stat file; 0 where it names none.
std::uint64_t read_inactive_file(const fs::path& stat, const CgroupFiles& files) {
  const std::optional<std::string> text = read_text(stat.c_str());
  if (!text) return 0;
  if (const std::optional<std::uint64_t> value = keyed_value(*text, files.inactive_file)) return *value;
  if (files.inactive_file_fallback) return keyed_value(*text, files.inactive_file_fallback).value_or(0);
  return 0;
}

// `path` without trailing separators ("/a/b/" -> "/a/b"), normalized.
fs::path clean(const fs::path& path) {
  std::string text = path.lexically_normal().native();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

// Each cgroup with a limit from `cgroup` (a path under the mount `top_dir`)
// up to `top_dir` itself, own first. A path the mount does not show is read
// as the mount's root where it is this process's (a container's cgroup
// namespace shows its own cgroup there) and as unknown where it is another's.
std::vector<CgroupRoom> rooms_on_the_way_up(const fs::path& top_dir, const std::string& cgroup,
                                            const CgroupFiles& files, CgroupOf whose) {
  const fs::path top = clean(top_dir);
  fs::path leaf = clean(top / fs::path(cgroup).relative_path());
  std::error_code error;
  const bool inside = leaf.native().rfind(top.native(), 0) == 0;
  std::vector<CgroupRoom> rooms;
  if (!inside || !fs::is_directory(leaf, error)) {
    if (whose == CgroupOf::another_process) return rooms;
    leaf = top;
  }
  for (fs::path dir = leaf;; dir = dir.parent_path()) {
    const std::optional<std::uint64_t> limit = read_number(dir / files.limit);
    if (limit && *limit < kNoLimitAbove) {
      if (const std::optional<std::uint64_t> usage = read_number(dir / files.usage)) {
        const std::uint64_t inactive = std::min(*usage, read_inactive_file(dir / "memory.stat", files));
        const std::uint64_t working_set = *usage - inactive;
        const std::size_t room = working_set >= *limit ? 0 : static_cast<std::size_t>(*limit - working_set);
        const fs::path below_top = dir.lexically_relative(top);
        rooms.push_back({below_top == "." ? "/" : "/" + below_top.native(), room});
      }
    }
    if (dir.native().size() <= top.native().size() || dir == dir.parent_path()) break;
  }
  return rooms;
}

}  // namespace

std::optional<std::size_t> read_mem_available(const char* path) {
  const std::optional<std::string> text = read_text(path);
  if (!text) return std::nullopt;
  const std::optional<std::uint64_t> kib = keyed_value(*text, "MemAvailable");
  if (!kib) return std::nullopt;
  return static_cast<std::size_t>(*kib) * 1024;  // meminfo counts in kB (KiB)
}

std::vector<CgroupRoom> read_cgroup_memory_rooms(const std::string& proc_cgroup, const std::string& cgroup_root,
                                                 CgroupOf whose) {
  // Lines are "hierarchy-id:controllers:path": "0::/path" for v2, and for v1
  // one per hierarchy, the memory controller's naming "memory" among its
  // comma-separated controllers. A v1 memory line wins (hybrid systems).
  const std::optional<std::string> text = read_text(proc_cgroup.c_str());
  if (!text) return {};
  std::optional<std::string_view> v1_path, v2_path;
  any_piece(*text, '\n', [&](std::string_view line) {
    const std::size_t first = line.find(':');
    const std::size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) return false;
    const std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = line.substr(second + 1);
    if (controllers.empty() && line.substr(0, first) == "0") {
      v2_path = path;
    } else if (any_piece(controllers, ',', [](std::string_view name) { return name == "memory"; })) {
      v1_path = path;
    }
    return false;
  });
  if (v1_path) return rooms_on_the_way_up(fs::path(cgroup_root) / "memory", std::string(*v1_path), kV1, whose);
  if (v2_path) return rooms_on_the_way_up(fs::path(cgroup_root), std::string(*v2_path), kV2, whose);
  return {};
}

std::optional<std::size_t> read_cgroup_memory_room(const std::string& proc_cgroup, const std::string& cgroup_root) {
  std::optional<std::size_t> least;
  for (const CgroupRoom& cgroup : read_cgroup_memory_rooms(proc_cgroup, cgroup_root, CgroupOf::this_process)) {
    least = least ? std::min(*least, cgroup.room_bytes) : cgroup.room_bytes;
  }
  return least;
}

std::optional<std::size_t> read_host_available() {
  const std::optional<std::size_t> node = read_mem_available();
  const std::optional<std::size_t> cgroup = read_cgroup_memory_room();
  if (node && cgroup) return std::min(*node, *cgroup);
  return node ? node : cgroup;
}

}  // namespace cotenant
