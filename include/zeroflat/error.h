// Exception hierarchy of zeroflat: every failure the library reports is a zeroflat::Error.
#pragma once

#include <stdexcept>
#include <string>

namespace zeroflat {

// Root of all zeroflat exceptions. what() says what was expected, what was found, and where
// (which parameter, rank or step).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed a value outside the documented domain. Nothing was touched.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A device or host allocation failed.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// The request is valid but this build or this device cannot serve it.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// The system refused a resource zeroflat needs that is not device memory: a host thread (a
// process or memory limit), a file descriptor. Whatever had been started was stopped first.
class ResourceExhausted : public Error {
 public:
  using Error::Error;
};

// A collective failed or timed out, or a peer rank disappeared.
class CommError : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside zeroflat: a bug, please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace zeroflat
