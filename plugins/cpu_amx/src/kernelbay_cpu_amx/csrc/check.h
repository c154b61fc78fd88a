// Checks that fail with a message, raised in Python as RuntimeError.
//
// Not TORCH_CHECK: a c10::Error made inside this extension records a C++ stack trace, and
// with torch 2.11's CUDA wheels and the system GCC 13 (Ubuntu 24.04) that crashed the process
// (SIGSEGV) even when the error was caught inside the extension. A std::runtime_error crosses
// pybind11 to Python on every setup seen.
#pragma once

#include <sstream>
#include <stdexcept>

namespace kb_cpu_amx {

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

}  // namespace kb_cpu_amx

#define KB_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) ::kb_cpu_amx::fail(__VA_ARGS__);            \
  } while (false)
