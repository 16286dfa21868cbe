#include "wsync/sources/shard.hpp"

#include <charconv>
#include <cstdio>
#include <cstring>
#include <new>

#include "wsync/manifest/validate.hpp"

namespace wsync {
namespace {

bool falls_to(std::size_t i, const shard_spec& spec) {
  return static_cast<std::int32_t>(i % static_cast<std::size_t>(spec.ranks)) == spec.rank;
}

error no_tensor(const char* what, const shard_spec& spec) {
  return make_error(errc::invalid_argument, std::string(what) + ": no tensor falls to rank " +
                                                std::to_string(spec.rank) + " of " +
                                                std::to_string(spec.ranks));
}

}  // namespace

void pattern_fill(std::byte* p, std::uint64_t n, std::uint64_t& state) {
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    std::memcpy(p + i, &state, 8);
  }
  for (; i < n; ++i) p[i] = std::byte(i);
}

result<model_layout> layout_parse(const std::string& text) {
  if (text.rfind("synthetic:", 0) == 0) {
    // Decimal digits only, each field whole (sscanf took "-1" as 2^64-1 and ignored a tail), and
    // within what one manifest may carry: the layout is allocated and filled before any manifest
    // check would refuse it.
    const manifest_limits limits;
    std::uint64_t bytes = 0, count = 0;
    const char* p = text.data() + 10;
    const char* end = text.data() + text.size();
    auto number = [&](std::uint64_t& out, char stop) {
      if (p == end || *p < '0' || *p > '9') return false;
      auto [next, ec] = std::from_chars(p, end, out);
      if (ec != std::errc() || (next != end && *next != stop) || (next == end && stop != 0)) {
        return false;
      }
      p = next == end ? end : next + 1;
      return true;
    };
    if (!number(bytes, ':') || !number(count, 0)) {
      return make_error(errc::invalid_argument,
                        "layout: expected synthetic:<bytes>:<tensors> (decimal), got " + text);
    }
    if (bytes == 0 || bytes > limits.max_total_bytes || count == 0 || count > limits.max_tensors) {
      return make_error(errc::invalid_argument, "layout: " + text + ": bytes must be 1.." +
                                                    std::to_string(limits.max_total_bytes) +
                                                    " and tensors 1.." +
                                                    std::to_string(limits.max_tensors));
    }
    return layout_synthetic(bytes, count);
  }
  auto layout = layout_find(text);
  if (!layout) return make_error(errc::invalid_argument, "layout: unknown \"" + text + "\"");
  return std::move(*layout);
}

std::string shard_model_id(const shard_spec& spec) {
  return spec.safetensors.empty() ? spec.layout : std::string("safetensors");
}

result<shard_tensors> shard_load(const shard_spec& spec) {
  if (spec.ranks < 1 || spec.rank < 0 || spec.rank >= spec.ranks) {
    return make_error(errc::invalid_argument, "rank " + std::to_string(spec.rank) +
                                                  " is not one of " + std::to_string(spec.ranks) +
                                                  " publisher ranks");
  }
  shard_tensors s;
  if (!spec.safetensors.empty()) {
    // Every rank maps the file and publishes its own share of the tensors, zero-copy.
    auto file = safetensors_file::open(spec.safetensors);
    if (!file) {
      return make_error(file.error().code, file.error().message + " (publisher rank " +
                                               std::to_string(spec.rank) + ")");
    }
    const auto& all = (*file)->tensors();
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (falls_to(i, spec)) s.tensors.push_back(all[i]);
    }
    s.file = std::move(*file);
    if (s.tensors.empty()) return no_tensor("safetensors", spec);
    return s;
  }
  auto layout = layout_parse(spec.layout);
  if (!layout) {
    return make_error(layout.error().code, layout.error().message + " (publisher rank " +
                                               std::to_string(spec.rank) + ")");
  }
  std::uint64_t state = 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(spec.rank);
  try {
    for (std::size_t i = 0; i < layout->tensors.size(); ++i) {
      if (!falls_to(i, spec)) continue;
      const auto& t = layout->tensors[i];
      auto& b = s.storage.emplace_back(t.nbytes());
      pattern_fill(b.data(), b.size(), state);
      s.tensors.push_back({t.name, t.dtype, t.shape, {}, b.data(), b.size()});
    }
  } catch (const std::bad_alloc&) {
    return make_error(errc::invalid_argument,
                      "layout: " + spec.layout + ": this rank's share of its " +
                          std::to_string(layout->bytes()) +
                          " bytes does not fit in memory (rank=" + std::to_string(spec.rank) + ")");
  }
  if (s.tensors.empty()) return no_tensor("layout", spec);
  return s;
}

result<void> shard_unchanged(const shard_tensors& shard, std::int32_t rank, std::uint64_t version,
                             bool published) {
  if (!shard.file) return {};
  if (auto ok = shard.file->unchanged(); !ok) {
    const std::string v = std::to_string(version);
    return make_error(
        ok.error().code,
        "publisher rank " + std::to_string(rank) + ": " + ok.error().message +
            (published ? " (while version " + v + " was published: it may mix two checkpoints)"
                       : " (before version " + v + ")"));
  }
  return {};
}

}  // namespace wsync
