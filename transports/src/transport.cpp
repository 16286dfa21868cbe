#include "wsync/transports/transport.hpp"

#include <algorithm>
#include <charconv>

namespace wsync {

result<std::string> transport::handle_via_relay(const std::string& /*handle*/,
                                                const std::string& /*relay_address*/) const {
  return make_error(errc::invalid_argument,
                    "transport " + std::string(name()) + " cannot relay updates between consumers");
}

result<std::string> transport::handle_striped(const std::vector<std::string>& /*handles*/) const {
  return make_error(errc::invalid_argument,
                    "transport " + std::string(name()) + " cannot stripe an update over relays");
}

result<std::uint64_t> options_reader::get_uint(const std::string& key, std::uint64_t fallback,
                                               std::uint64_t min, std::uint64_t max) {
  seen_.push_back(key);
  auto it = options_.find(key);
  if (it == options_.end()) return fallback;
  const std::string& text = it->second;
  std::uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) {
    return make_error(
        errc::invalid_argument,
        transport_ + " option " + key + ": expected a non-negative integer, got \"" + text + "\"");
  }
  if (value < min || value > max) {
    return make_error(errc::invalid_argument, transport_ + " option " + key + ": " + text +
                                                  " is outside [" + std::to_string(min) + ", " +
                                                  std::to_string(max) + "]");
  }
  return value;
}

std::string options_reader::get_string(const std::string& key, std::string fallback) {
  seen_.push_back(key);
  auto it = options_.find(key);
  return it == options_.end() ? std::move(fallback) : it->second;
}

result<void> options_reader::finish() const {
  for (const auto& [key, value] : options_) {
    if (std::find(seen_.begin(), seen_.end(), key) == seen_.end()) {
      std::string known;
      for (const auto& k : seen_) known += (known.empty() ? "" : ", ") + k;
      return make_error(errc::invalid_argument,
                        transport_ + " option " + key +
                            ": unknown option (known: " + (known.empty() ? "none" : known) + ")");
    }
  }
  return {};
}

}  // namespace wsync
