#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "cotenant/errors.h"
#include "cotenant/shm/shm_region.h"

using cotenant::shm::ShmRegion;

namespace {
std::string unique_name(const char* what) {
  return "/cotenant-test-" + std::string(what) + "-" + std::to_string(::getpid());
}
}  // namespace

TEST_CASE("created_region_is_zeroed_and_shared_with_an_opener", "[shm]") {
  auto name = unique_name("shared");
  auto created = ShmRegion::create(name, 4096, /*unlink_on_destroy=*/true);
  REQUIRE(created.size() == 4096);
  CHECK(static_cast<unsigned char*>(created.data())[100] == 0);
  auto opened = ShmRegion::open(name, 4096);
  std::memcpy(created.data(), "hello", 6);
  CHECK(std::string(static_cast<const char*>(opened.data())) == "hello");
}

TEST_CASE("create_refuses_an_existing_name", "[shm]") {
  auto name = unique_name("exclusive");
  auto first = ShmRegion::create(name, 64, true);
  CHECK_THROWS_AS(ShmRegion::create(name, 64), cotenant::Error);
}

TEST_CASE("region_is_created_with_group_read_write_mode", "[shm]") {
  auto name = unique_name("mode");
  auto region = ShmRegion::create(name, 64, true);
  struct stat info {};
  REQUIRE(::stat(("/dev/shm" + name).c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0660);
}

TEST_CASE("invalid_names_are_refused_with_a_sentence", "[shm]") {
  CHECK_THROWS_WITH(ShmRegion::validate_name("no-slash"), Catch::Contains("not a valid shared-memory name"));
  CHECK_THROWS_AS(ShmRegion::validate_name("/a/b"), cotenant::Error);
  CHECK_THROWS_AS(ShmRegion::validate_name("/"), cotenant::Error);
  CHECK_THROWS_AS(ShmRegion::validate_name("/" + std::string(300, 'x')), cotenant::Error);
  CHECK_NOTHROW(ShmRegion::validate_name("/cotenant-job.1_a"));
}

TEST_CASE("opening_a_missing_or_short_region_fails", "[shm]") {
  auto name = unique_name("missing");
  CHECK_THROWS_AS(ShmRegion::open(name), cotenant::Error);
  auto region = ShmRegion::create(name, 64, true);
  CHECK_THROWS_WITH(ShmRegion::open(name, 128), Catch::Contains("fewer than"));
}

TEST_CASE("unlink_removes_the_name_but_keeps_mappings", "[shm]") {
  auto name = unique_name("unlink");
  auto region = ShmRegion::create(name, 64);
  static_cast<char*>(region.data())[0] = 'x';
  CHECK(ShmRegion::exists(name));
  CHECK(ShmRegion::unlink(name));
  CHECK_FALSE(ShmRegion::exists(name));
  CHECK(static_cast<char*>(region.data())[0] == 'x');
  CHECK_FALSE(ShmRegion::unlink(name));
}

TEST_CASE("moved_region_owns_the_mapping", "[shm]") {
  auto name = unique_name("move");
  auto a = ShmRegion::create(name, 64, true);
  void* data = a.data();
  ShmRegion b = std::move(a);
  CHECK_FALSE(a.valid());
  CHECK(b.data() == data);
}
