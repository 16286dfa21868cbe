#include "wsync/sources/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#include "wsync/manifest/json_bounded.hpp"

namespace wsync {
namespace {

std::optional<dtype> safetensors_dtype(const std::string& s) {
  static const std::pair<const char*, dtype> table[] = {{"F64", dtype::f64},
                                                        {"F32", dtype::f32},
                                                        {"F16", dtype::f16},
                                                        {"BF16", dtype::bf16},
                                                        {"F8_E4M3", dtype::fp8_e4m3},
                                                        {"F8_E5M2", dtype::fp8_e5m2},
                                                        {"I64", dtype::i64},
                                                        {"I32", dtype::i32},
                                                        {"I16", dtype::i16},
                                                        {"I8", dtype::i8},
                                                        {"U8", dtype::u8},
                                                        {"BOOL", dtype::boolean}};
  for (const auto& [name, t] : table) {
    if (s == name) return t;
  }
  return std::nullopt;
}

}  // namespace

result<std::vector<tensor_source>> safetensors_index(std::span<const std::byte> file,
                                                     const std::string& where) {
  auto bad = [&](const std::string& why) {
    return make_error(errc::invalid_argument, "safetensors " + where + ": " + why);
  };
  if (file.size() < 8) return bad("shorter than its 8-byte header length");
  const std::byte* base = file.data();
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | std::to_integer<std::uint64_t>(base[i]);
  if (header_len > file.size() - 8)
    return bad("header length " + std::to_string(header_len) + " exceeds the file");
  // The format's own limit (its reference reader refuses more): a header is names and numbers.
  constexpr std::uint64_t max_header = 100'000'000;
  if (header_len > max_header) {
    return bad("header length " + std::to_string(header_len) + " exceeds the format's " +
               std::to_string(max_header) + " bytes");
  }
  bool too_deep = false;
  std::string twice;
  std::size_t twice_depth = 0;
  const std::string_view text(reinterpret_cast<const char*>(base + 8), header_len);
  auto header = json_parse_bounded(text, &too_deep, &twice, &twice_depth);
  if (too_deep) {
    return bad("header nests deeper than " + std::to_string(json_max_depth) + " levels");
  }
  if (!twice.empty() && twice_depth == 1) {
    return bad("tensor \"" + twice +
               "\": named twice in the header (a reader would keep one and "
               "leave the other's bytes unaccounted for)");
  }
  if (!twice.empty()) {
    return bad("key \"" + twice + "\" given twice in one entry of the header (level " +
               std::to_string(twice_depth) + "): a reader would keep either value");
  }
  if (header.is_discarded()) {
    // Say where: nlohmann's own message has the byte.
    try {
      const auto reparsed = nlohmann::json::parse(text);  // throws: the syntax error
      (void)reparsed;
    } catch (const nlohmann::json::exception& e) {
      return bad(std::string("header is not valid JSON: ") + e.what());
    }
  }
  if (!header.is_object()) return bad("header is not a JSON object");
  const std::byte* data = base + 8 + header_len;
  const std::uint64_t data_len = file.size() - 8 - header_len;
  struct entry {
    std::uint64_t begin;
    tensor_source t;
  };
  std::vector<entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& v = it.value();
    const std::string at = "tensor \"" + it.key() + "\"";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return bad(at + ": needs dtype, shape and data_offsets");
    }
    auto dt =
        v["dtype"].is_string() ? safetensors_dtype(v["dtype"].get<std::string>()) : std::nullopt;
    if (!dt) return bad(at + ".dtype: unsupported " + v["dtype"].dump());
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return bad(at + ".data_offsets: expected [begin, end]");
    }
    auto begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end || end > data_len) return bad(at + ".data_offsets: outside the file");
    tensor_source t;
    t.name = it.key();
    t.dtype = *dt;
    if (!v["shape"].is_array()) return bad(at + ".shape: expected an array");
    std::uint64_t need = dtype_itemsize(*dt);
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > std::uint64_t{INT64_MAX}) {
        return bad(at + ".shape: expected non-negative integers");
      }
      if (__builtin_mul_overflow(need, d.get<std::uint64_t>(), &need)) need = UINT64_MAX;
      t.shape.push_back(d.get<std::int64_t>());
    }
    if (need != end - begin) {
      return bad(at + ".data_offsets: " + std::to_string(end - begin) + " bytes, but shape " +
                 v["shape"].dump() + " of " + v["dtype"].get<std::string>() + " needs " +
                 (need == UINT64_MAX ? std::string("more than 2^64") : std::to_string(need)));
    }
    t.data = data + begin;
    t.nbytes = end - begin;
    entries.push_back({begin, std::move(t)});
  }
  // File order (the JSON object is sorted by name, the data by the writer's order). The tensors
  // must tile the data exactly, as the format requires: no two share a byte (one write would
  // show in both) and no byte is in none (a hole or a tail could carry anything).
  std::sort(entries.begin(), entries.end(), [](const entry& a, const entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.t.nbytes < b.t.nbytes;
  });
  std::uint64_t covered = 0;
  for (const auto& e : entries) {
    if (e.begin != covered) {
      return bad("tensor \"" + e.t.name + "\".data_offsets: starts at " + std::to_string(e.begin) +
                 ", where the tensors before it end at " + std::to_string(covered) +
                 (e.begin < covered ? " (they overlap)" : " (a hole)"));
    }
    covered += e.t.nbytes;
  }
  if (covered != data_len) {
    return bad("data: " + std::to_string(data_len - covered) +
               " bytes after the last tensor belong to none");
  }
  std::vector<tensor_source> tensors;
  for (auto& e : entries) tensors.push_back(std::move(e.t));
  return tensors;
}

safetensors_file::identity safetensors_file::identity_of(const struct ::stat& st) {
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino),
          static_cast<std::uint64_t>(st.st_size), static_cast<std::int64_t>(st.st_mtim.tv_sec),
          static_cast<std::int64_t>(st.st_mtim.tv_nsec)};
}

result<void> safetensors_file::unchanged() const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    return make_error(errc::io_error, "safetensors " + path_ + ": " + std::strerror(errno) +
                                          " (it was mapped when the publisher started)");
  }
  if (identity_of(st) == identity_) return {};
  return make_error(errc::io_error,
                    "safetensors " + path_ +
                        ": changed since the publisher mapped it (another inode, size or "
                        "modification time); a version copied while it was rewritten would mix "
                        "two checkpoints under matching checksums, so publishing stops: start "
                        "the publisher again on the new file");
}

safetensors_file::~safetensors_file() {
  if (map_) ::munmap(map_, size_);
}

result<std::unique_ptr<safetensors_file>> safetensors_file::open(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return make_error(errc::invalid_argument, "safetensors " + path + ": " + why);
  };
  // Not blocking: a FIFO given by mistake would wait for a writer, deaf to a stop signal.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return bad(std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return bad(std::string("fstat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return bad("not a regular file");
  }
  if (st.st_size < 8) {
    ::close(fd);
    return bad("shorter than its 8-byte header length");
  }
  std::unique_ptr<safetensors_file> f(new safetensors_file);
  f->path_ = path;
  f->identity_ = identity_of(st);
  f->size_ = static_cast<std::uint64_t>(st.st_size);
  void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return bad(std::string("mmap: ") + std::strerror(errno));
  f->map_ = p;
  auto tensors = safetensors_index({static_cast<const std::byte*>(p), f->size_}, path);
  if (!tensors) return tensors.error();
  f->tensors_ = std::move(*tensors);
  return f;
}

}  // namespace wsync
