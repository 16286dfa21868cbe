#include "ucx/ucx_common.hpp"

#include <charconv>

namespace wsync::ucx_detail {

errc status_code(ucs_status_t st) {
  switch (st) {
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNSUPPORTED:
      return errc::blocked;
    case UCS_ERR_INVALID_PARAM:
      return errc::invalid_argument;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return errc::timeout;
    default:
      return errc::io_error;
  }
}

error status_error(std::string_view call, ucs_status_t st, const std::string& context) {
  errc code = status_code(st);
  call = call.substr(0, call.find('('));
  return make_error(code, std::string(code == errc::blocked ? "blocked: " : "") +
                              "ucx: " + std::string(call) + " failed: " + ucs_status_string(st) +
                              (context.empty() ? "" : " (" + context + ")"));
}

std::string hex_encode(const void* data, std::size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out(n * 2, '0');
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[p[i] >> 4];
    out[2 * i + 1] = digits[p[i] & 15];
  }
  return out;
}

std::optional<std::vector<unsigned char>> hex_decode(const std::string& text) {
  if (text.empty() || text.size() % 2) return std::nullopt;
  std::vector<unsigned char> out(text.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto [end, ec] = std::from_chars(text.data() + 2 * i, text.data() + 2 * i + 2, out[i], 16);
    if (ec != std::errc{} || end != text.data() + 2 * i + 2) return std::nullopt;
  }
  return out;
}

}  // namespace wsync::ucx_detail
