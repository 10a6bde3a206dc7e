// The core's error type. Every message is a sentence a user can act on: what
// happened, with the numbers, and what to do about it.
#pragma once

#include <stdexcept>
#include <string>

namespace cotenant {

// Anything the core refuses: bad input, a misuse of the API.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Neither device memory (under the cap) nor host memory could hold an
// allocation. Python maps it to torch.OutOfMemoryError / MemoryError.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

}  // namespace cotenant
