#pragma once
// The error type every wsync module returns across its boundary: a documented code plus a
// message that names the update id, the rank and the field concerned.

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace wsync {

/// Error codes shared by all modules. `in_progress` and `try_again` are not failures: asynchronous
/// transports use them to say "call again".
enum class errc {
  invalid_manifest,       ///< a manifest field is malformed or inconsistent
  version_not_monotonic,  ///< weight_version did not increase
  illegal_transition,     ///< a lifecycle call came in the wrong state
  checksum_mismatch,      ///< tensor bytes differ from the manifest's checksum
  unknown_update,         ///< no update with this id is known here
  unknown_transport,      ///< no transport registered under this name
  invalid_argument,       ///< a caller-supplied value is out of range (options, tensors)
  blocked,                ///< the transport cannot run on this machine; message gives the cause
  timeout,                ///< a bounded wait ran out
  io_error,               ///< an operating-system call failed; message carries errno text
  install_failed,         ///< the install adapter refused the update
  in_progress,            ///< not an error: the operation continues asynchronously
  try_again,              ///< not an error: retry later
};

/// Stable lower-case name of a code, as printed in logs and JSON.
std::string_view errc_name(errc code);

/// An error value: a code and a human-readable message (the exact texts docs/protocol.md lists).
struct error {
  errc code;
  std::string message;
};

/// Either a T or an error. Minimal stand-in for C++23 std::expected.
template <class T>
class [[nodiscard]] result {
 public:
  result(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  result(wsync::error err)
      : v_(std::in_place_index<1>, std::move(err)) {}  // NOLINT: implicit by design

  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }

  T& value() & {
    assert(has_value());
    return std::get<0>(v_);
  }
  const T& value() const& {
    assert(has_value());
    return std::get<0>(v_);
  }
  T&& value() && {
    assert(has_value());
    return std::get<0>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const wsync::error& error() const {
    assert(!has_value());
    return std::get<1>(v_);
  }

 private:
  std::variant<T, wsync::error> v_;
};

/// Success or an error, for operations that produce nothing.
template <>
class [[nodiscard]] result<void> {
 public:
  result() = default;
  result(wsync::error err) : err_(std::move(err)), ok_(false) {}  // NOLINT: implicit by design

  bool has_value() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const wsync::error& error() const {
    assert(!ok_);
    return err_;
  }

 private:
  wsync::error err_{errc::invalid_argument, {}};
  bool ok_ = true;
};

/// Shorthand for building an error result.
inline error make_error(errc code, std::string message) {
  return error{code, std::move(message)};
}

}  // namespace wsync
