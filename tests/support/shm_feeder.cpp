// A shared-memory publisher driven line by line, for scripts that feed an HTTP-driven consumer
// and need slots reused (`wsync publisher --standalone` holds every version in its own slot):
//
//   wsync_shm_feeder LAYOUT SLOTS     LAYOUT: a model layout name or synthetic:<bytes>:<tensors>
//   stdin  "publish V"  -> stdout: version V's manifest, one JSON line (or "error: ...")
//   stdin  "release V"  -> stdout: "released V": version V's slot may be rewritten
//   EOF                 -> releases what it holds, removes its slots and exits
//
// Every version carries the same random bytes; consumers verify them all the same.

#include <cstdio>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "wsync/manifest/codec.hpp"
#include "wsync/sources/layouts.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace {

std::optional<wsync::model_layout> layout_of(const std::string& name) {
  if (name.rfind("synthetic:", 0) == 0) {
    std::uint64_t bytes = 0, tensors = 0;
    if (std::sscanf(name.c_str(), "synthetic:%lu:%lu", &bytes, &tensors) != 2 || tensors == 0) {
      return std::nullopt;
    }
    return wsync::layout_synthetic(bytes, tensors);
  }
  return wsync::layout_find(name);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: wsync_shm_feeder LAYOUT SLOTS\n";
    return 2;
  }
  auto layout = layout_of(argv[1]);
  if (!layout) {
    std::cerr << "wsync_shm_feeder: unknown layout " << argv[1] << "\n";
    return 2;
  }
  std::vector<std::vector<std::uint64_t>> storage;
  std::vector<wsync::tensor_source> sources;
  std::mt19937_64 random(0x9e3779b97f4a7c15ull);
  for (const auto& t : layout->tensors) {
    auto& words = storage.emplace_back((t.nbytes() + 7) / 8);
    for (auto& w : words) w = random();
    sources.push_back(
        {t.name, t.dtype, t.shape, {}, reinterpret_cast<std::byte*>(words.data()), t.nbytes()});
  }
  auto transport = wsync::make_transport("shared-memory", {{"slots", argv[2]}});
  if (!transport) return std::cerr << transport.error().message << "\n", 1;
  auto pt = (*transport)->make_publisher();
  if (!pt) return std::cerr << pt.error().message << "\n", 1;
  wsync::publisher_config cfg;
  cfg.model_id = layout->name;
  cfg.release_when_answered = false;  // the script says when a version's slot is free again
  wsync::weight_publisher publisher(std::move(*pt), "shared-memory", cfg);
  std::map<std::uint64_t, wsync::update_id> held;
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream words(line);
    std::string verb;
    std::uint64_t version = 0;
    words >> verb >> version;
    if (verb == "publish") {
      auto m = publisher.publish(sources, version, {});
      if (!m) {
        std::cout << "error: " << m.error().message << std::endl;
        continue;
      }
      held[version] = m->update_id;
      std::cout << wsync::manifest_to_json(*m) << std::endl;
    } else if (verb == "release" && held.count(version)) {
      (void)publisher.release(held[version]);
      held.erase(version);
      std::cout << "released " << version << std::endl;
    } else {
      std::cout << "error: not understood: " << line << std::endl;
    }
  }
  for (const auto& [version, id] : held) (void)publisher.release(id);
  return 0;
}
