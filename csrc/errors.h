// Error types thrown by the native layer and translated to Python exceptions in bindings.cpp.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace pyshmckpt {

// A failed system call: becomes OSError(errno, "<call>: <strerror>", <segment name>) in Python,
// so callers can match on errno (ENOSPC, ENOENT, EACCES) and see which segment was involved.
class SyscallError : public std::runtime_error {
 public:
  SyscallError(int err, std::string call, std::string name, std::string detail = "")
      : std::runtime_error(call + ": " + detail),
        err_(err),
        call_(std::move(call)),
        name_(std::move(name)),
        detail_(std::move(detail)) {}

  int err() const noexcept { return err_; }
  const std::string& call() const noexcept { return call_; }
  const std::string& name() const noexcept { return name_; }
  const std::string& detail() const noexcept { return detail_; }

 private:
  int err_;
  std::string call_;
  std::string name_;
  std::string detail_;
};

// A CUDA runtime failure: becomes RuntimeError carrying the CUDA error name and string.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments (out-of-bounds offsets, wrong shapes): becomes ValueError.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace pyshmckpt
