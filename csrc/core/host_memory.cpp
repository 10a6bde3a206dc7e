#include "cotenant/host_memory.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace cotenant {

namespace fs = std::filesystem;

namespace {

// v1 reports "no limit" as the largest page-aligned signed 64-bit count.
constexpr std::uint64_t kNoLimitAbove = std::uint64_t{1} << 62;

std::optional<std::uint64_t> read_number(const fs::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word) || word.empty() || word.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;  // missing, unreadable, or "max" (v2's no limit)
  }
  try {
    return std::stoull(word);
  } catch (...) {
    return std::nullopt;
  }
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
  std::ifstream in(stat);
  std::string key;
  std::uint64_t value = 0;
  std::optional<std::uint64_t> primary, fallback;
  while (in >> key >> value) {
    if (key == files.inactive_file) primary = value;
    else if (files.inactive_file_fallback && key == files.inactive_file_fallback) fallback = value;
  }
  return primary ? *primary : fallback.value_or(0);
}

// `path` without trailing separators ("/a/b/" -> "/a/b"), normalized.
fs::path clean(const fs::path& path) {
  std::string text = path.lexically_normal().native();
  while (text.size() > 1 && text.back() == '/') text.pop_back();
  return text;
}

// The least room over the cgroup `cgroup` mounted under `top_dir` and its
// ancestors up to `top_dir` itself (a container's cgroup namespace shows
// its own cgroup there).
std::optional<std::size_t> least_room(const fs::path& top_dir, const std::string& cgroup, const CgroupFiles& files) {
  const fs::path top = clean(top_dir);
  fs::path leaf = clean(top / fs::path(cgroup).relative_path());
  std::error_code error;
  const bool inside = leaf.native().rfind(top.native(), 0) == 0;
  if (!inside || !fs::is_directory(leaf, error)) leaf = top;  // a path of another cgroup namespace than the mount's
  std::optional<std::size_t> least;
  for (fs::path dir = leaf;; dir = dir.parent_path()) {
    const std::optional<std::uint64_t> limit = read_number(dir / files.limit);
    if (limit && *limit < kNoLimitAbove) {
      if (const std::optional<std::uint64_t> usage = read_number(dir / files.usage)) {
        const std::uint64_t inactive = std::min(*usage, read_inactive_file(dir / "memory.stat", files));
        const std::uint64_t working_set = *usage - inactive;
        const std::size_t room = working_set >= *limit ? 0 : static_cast<std::size_t>(*limit - working_set);
        least = least ? std::min(*least, room) : room;
      }
    }
    if (dir.native().size() <= top.native().size() || dir == dir.parent_path()) break;
  }
  return least;
}

}  // namespace

std::optional<std::size_t> read_mem_available(const char* path) {
  std::ifstream meminfo(path);
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    std::size_t value = 0;
    std::string unit;
    if (!(fields >> value)) return std::nullopt;
    fields >> unit;
    return unit == "kB" ? value * 1024 : value;
  }
  return std::nullopt;
}

std::optional<std::size_t> read_cgroup_memory_room(const std::string& proc_cgroup, const std::string& cgroup_root) {
  // Lines are "hierarchy-id:controllers:path": "0::/path" for v2, and for v1
  // one per hierarchy, the memory controller's naming "memory" among its
  // comma-separated controllers. A v1 memory line wins (hybrid systems).
  std::ifstream in(proc_cgroup);
  std::string line;
  std::optional<std::string> v1_path, v2_path;
  while (std::getline(in, line)) {
    const std::size_t first = line.find(':');
    const std::size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (controllers.empty() && line.compare(0, first, "0") == 0) {
      v2_path = path;
      continue;
    }
    std::istringstream names(controllers);
    for (std::string name; std::getline(names, name, ',');) {
      if (name == "memory") v1_path = path;
    }
  }
  if (v1_path) return least_room(fs::path(cgroup_root) / "memory", *v1_path, kV1);
  if (v2_path) return least_room(fs::path(cgroup_root), *v2_path, kV2);
  return std::nullopt;
}

std::optional<std::size_t> read_host_available() {
  const std::optional<std::size_t> node = read_mem_available();
  const std::optional<std::size_t> cgroup = read_cgroup_memory_room();
  if (node && cgroup) return std::min(*node, *cgroup);
  return node ? node : cgroup;
}

}  // namespace cotenant
