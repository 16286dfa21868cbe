#pragma once
// Numbers read from JSON another process wrote (transport handles, file-mmap's lease and state
// files). nlohmann's get<unsigned>() converts a negative number or a float without a check, and
// a float out of range is undefined behaviour (found by fuzz.file_mmap_files): these accept only
// the integers that fit, and throw std::invalid_argument otherwise, so a decoder keeps one catch
// (of std::exception, which json's own errors derive from too).

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace wsync::json_read {

/// `v` as T, when it is an integer T can hold.
template <class T>
T integer(const nlohmann::json& v, const char* field) {
  if (v.is_number_unsigned()) {
    auto n = v.get<std::uint64_t>();
    if (n <= static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return static_cast<T>(n);
  } else if (v.is_number_integer() && std::numeric_limits<T>::is_signed) {
    auto n = v.get<std::int64_t>();
    if (n >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
        n <= static_cast<std::int64_t>(std::numeric_limits<T>::max())) {
      return static_cast<T>(n);
    }
  }
  throw std::invalid_argument(std::string(field) + ": " +
                              v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                              " is not an integer in range");
}

/// j[key] as T; a missing key throws like a wrong value.
template <class T>
T field(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) throw std::invalid_argument(std::string(key) + ": missing");
  return integer<T>(j[key], key);
}

/// j[key] as a list of T.
template <class T>
std::vector<T> list(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || !j[key].is_array()) {
    throw std::invalid_argument(std::string(key) + ": must be a list of integers");
  }
  std::vector<T> out;
  for (const auto& v : j[key]) out.push_back(integer<T>(v, key));
  return out;
}

}  // namespace wsync::json_read
