// Catch2 v2 (Debian's catch2 package) test runner entry point.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
