// Cap: the one parser and type for memory caps.
#include <catch2/catch.hpp>

#include <string>

#include "cotenant/cap.h"
#include "cotenant/errors.h"

using namespace cotenant;

namespace {
constexpr std::uint64_t kGiB = 1ull << 30;
}

TEST_CASE("a_cap_is_a_size_a_fraction_of_the_device_or_none", "[cap_type]") {
  CHECK(Cap::parse("6GiB").bytes() == 6 * kGiB);
  CHECK(Cap::parse(" 4096 ").bytes() == 4096u);
  CHECK(Cap::parse("1.5GiB").bytes() == 3 * kGiB / 2);  // a unit makes it a size
  CHECK(Cap::parse("none").is_none());
  CHECK(Cap::parse("Unlimited").is_none());
  CHECK_THROWS_WITH(Cap::parse(" "), Catch::Contains("it is empty (write \"none\" for no cap)"));
  const Cap half = Cap::parse("0.5");
  CHECK(half.is_fraction());
  CHECK(half.resolve(8 * kGiB) == 4 * kGiB);
  CHECK(Cap::parse("25%").resolve(8 * kGiB) == 2 * kGiB);
  CHECK_FALSE(Cap::parse("1.0").resolve(8 * kGiB).has_value());  // the whole device: no cap
  CHECK_FALSE(Cap::none().resolve(8 * kGiB).has_value());
}

TEST_CASE("the_word_form_round_trips_and_none_is_kNoCap", "[cap_type]") {
  CHECK(Cap::none().to_word() == kNoCap);
  CHECK(Cap::from_word(kNoCap).is_none());
  CHECK(Cap::from_word(123).bytes() == 123u);
  CHECK(Cap::of_bytes(123).to_word() == 123u);
  CHECK(Cap::parse("0.5").to_word(1000) == 500u);
  CHECK_THROWS_WITH(Cap::parse("0.5").to_word(), Catch::Contains("give the cap in bytes"));
}

TEST_CASE("the_text_form_parses_back_to_the_same_cap", "[cap_type]") {
  for (const char* text : {"none", "6GiB", "0.5", "12.5%", "1", "0.125"}) {
    const Cap cap = Cap::parse(text);
    CHECK(Cap::parse(cap.to_text()) == cap);
  }
  CHECK(Cap::parse("0.5").to_string() == "50%");
  CHECK(Cap::parse("6GiB").to_string() == "6.00 GiB");
}

TEST_CASE("bad_caps_are_refused_with_the_reason_and_the_accepted_forms", "[cap_type]") {
  CHECK_THROWS_WITH(Cap::parse("6 apples"), Catch::Contains("\"6 apples\"") && Catch::Contains("\"none\""));
  CHECK_THROWS_WITH(Cap::parse("-1GiB"), Catch::Contains("cannot be negative"));
  CHECK_THROWS_WITH(Cap::parse("0"), Catch::Contains("0 bytes"));
  CHECK_THROWS_WITH(Cap::parse("1.5"), Catch::Contains("(0, 1]"));
  CHECK_THROWS_WITH(Cap::parse("150%"), Catch::Contains("(0, 100]"));
  CHECK_THROWS_WITH(Cap::parse("0%"), Catch::Contains("(0, 100]"));
  CHECK_THROWS_WITH(Cap::of_bytes(0), Catch::Contains("spill_all"));
  CHECK_THROWS_AS(Cap::of_fraction(0.0), Error);
}
