// The NCCL unique id as vLLM carries it: standard padded base64 (RFC 4648). Pure C++, built and
// tested everywhere.

#include <cstring>

#include "wsync/transports/nccl.hpp"

namespace wsync::nccl {
namespace {

constexpr char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int sextet(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace

std::string unique_id_to_base64(const unique_id& id) {
  std::string out;
  out.reserve((id.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < id.size(); i += 3) {
    const std::size_t left = id.size() - i;
    std::uint32_t v = std::to_integer<std::uint32_t>(id[i]) << 16;
    if (left > 1) v |= std::to_integer<std::uint32_t>(id[i + 1]) << 8;
    if (left > 2) v |= std::to_integer<std::uint32_t>(id[i + 2]);
    out += alphabet[(v >> 18) & 63];
    out += alphabet[(v >> 12) & 63];
    out += left > 1 ? alphabet[(v >> 6) & 63] : '=';
    out += left > 2 ? alphabet[v & 63] : '=';
  }
  return out;
}

result<unique_id> unique_id_from_base64(std::string_view text) {
  auto refuse = [](std::string why) {
    return make_error(errc::invalid_argument, std::move(why));
  };
  if (text.empty() || text.size() % 4 != 0) {
    return refuse("not standard base64 (RFC 4648, padded; the URL-safe alphabet is refused)");
  }
  std::string bytes;
  bytes.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    // '=' only closes the last quartet: "xx==" or "xxx=".
    std::size_t pad = 0;
    if (i + 4 == text.size() && text[i + 3] == '=') pad = text[i + 2] == '=' ? 2 : 1;
    int s[4] = {0, 0, 0, 0};
    for (std::size_t k = 0; k < 4 - pad; ++k) {
      s[k] = sextet(text[i + k]);
      if (s[k] < 0) {
        return refuse("not standard base64 (RFC 4648, padded; the URL-safe alphabet is refused)");
      }
    }
    const std::uint32_t v =
        (static_cast<std::uint32_t>(s[0]) << 18) | (static_cast<std::uint32_t>(s[1]) << 12) |
        (static_cast<std::uint32_t>(s[2]) << 6) | static_cast<std::uint32_t>(s[3]);
    bytes += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) bytes += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) bytes += static_cast<char>(v & 0xff);
  }
  if (bytes.size() != unique_id_bytes) {
    return refuse("decodes to " + std::to_string(bytes.size()) + " bytes; an NCCL unique id has " +
                  std::to_string(unique_id_bytes));
  }
  unique_id id{};
  std::memcpy(id.data(), bytes.data(), id.size());
  return id;
}

}  // namespace wsync::nccl
