#include <catch2/catch.hpp>

#include "cotenant/errors.h"
#include "cotenant/size.h"

using cotenant::parse_size;

TEST_CASE("parse_size_reads_binary_decimal_and_plain_byte_counts", "[size]") {
  CHECK(parse_size("4096") == 4096);
  CHECK(parse_size("512MiB") == 512ull << 20);
  CHECK(parse_size("6GiB") == 6ull << 30);
  CHECK(parse_size("6gib") == 6ull << 30);
  CHECK(parse_size("6 GiB") == 6ull << 30);
  CHECK(parse_size("6G") == 6ull << 30);
  CHECK(parse_size("1.5GB") == 1500000000ull);
  CHECK(parse_size("2KB") == 2000);
  CHECK(parse_size("1.5KiB") == 1536);
  CHECK(parse_size("  7B ") == 7);
  CHECK(parse_size("1TiB") == 1ull << 40);
  CHECK(parse_size("0") == 0);
}

TEST_CASE("parse_size_rejects_malformed_input_with_a_message_naming_it", "[size]") {
  for (const char* bad : {"6 GB?", "-1", "", "   ", "abc", "GiB", "6XB", "1.5B", "1e3", "6GiB6", "99999999999TiB"}) {
    INFO("input: \"" << bad << "\"");
    try {
      parse_size(bad);
      FAIL("accepted a malformed size");
    } catch (const cotenant::Error& e) {
      const std::string message = e.what();
      CHECK(message.find(std::string("\"") + bad + "\"") != std::string::npos);
      CHECK(message.find("6GiB") != std::string::npos);  // shows an accepted form
    }
  }
}

TEST_CASE("format_size_picks_the_largest_binary_unit", "[size]") {
  CHECK(cotenant::format_size(512) == "512 B");
  CHECK(cotenant::format_size(6ull << 30) == "6.00 GiB");
  CHECK(cotenant::format_size(1536) == "1.50 KiB");
}
