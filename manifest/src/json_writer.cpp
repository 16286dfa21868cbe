#include "wsync/manifest/json_writer.hpp"

#include <cmath>
#include <nlohmann/json.hpp>

namespace wsync {
namespace {

// Printable ASCII without quote or backslash: copied as it is.
bool plain(std::string_view v) {
  for (unsigned char c : v) {
    if (c < 0x20 || c >= 0x7f || c == '"' || c == '\\') return false;
  }
  return true;
}

}  // namespace

void json_writer::string(std::string_view v) {
  if (plain(v)) {
    out_ += '"';
    out_ += v;
    out_ += '"';
    return;
  }
  // Escapes, and invalid UTF-8 replaced: nlohmann's rules, from nlohmann.
  using json = nlohmann::json;
  out_ += json(std::string(v)).dump(-1, ' ', false, json::error_handler_t::replace);
}

json_writer& json_writer::real(double v) {
  separate();
  if (!std::isfinite(v)) {
    out_ += "null";
    return *this;
  }
  // nlohmann's layout of the shortest digits: fixed from 1e-4 up to 1e15, else an exponent.
  const double a = std::fabs(v);
  const auto format =
      a == 0 || (a >= 1e-4 && a < 1e15) ? std::chars_format::fixed : std::chars_format::scientific;
  char buf[64];  // fixed below 1e15 and above 1e-4: at most 17 digits, a sign and a point
  const auto end = std::to_chars(buf, buf + sizeof buf, v, format).ptr;
  out_.append(buf, end);
  if (std::string_view(buf, static_cast<std::size_t>(end - buf)).find_first_of(".e") ==
      std::string_view::npos) {
    out_ += ".0";
  }
  return *this;
}

}  // namespace wsync
