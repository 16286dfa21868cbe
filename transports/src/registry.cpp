#include "wsync/transports/registry.hpp"

#include "cuda/gpu_transports.hpp"
#include "file_mmap/file_mmap.hpp"
#include "local_clone/local_clone.hpp"
#include "shared_memory/shared_memory.hpp"
#if WSYNC_HAVE_UCX
#include "ucx/ucx.hpp"
#endif

namespace wsync {

result<void> transport_registry::add(transport_entry entry) {
  if (find(entry.name)) {
    return make_error(errc::invalid_argument,
                      "transport \"" + entry.name + "\" is already registered");
  }
  entries_.push_back(std::move(entry));
  return {};
}

const transport_entry* transport_registry::find(std::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

std::vector<std::string> transport_registry::names() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.name);
  return out;
}

result<std::unique_ptr<transport>> transport_registry::make(
    std::string_view name, const transport_options& options) const {
  if (const auto* e = find(name)) return e->make(options);
  std::string known;
  for (const auto& e : entries_) known += (known.empty() ? "" : ", ") + e.name;
  return make_error(errc::unknown_transport,
                    "unknown transport \"" + std::string(name) + "\" (known: " + known + ")");
}

void register_builtin_transports(transport_registry& registry) {
  // One line per transport; adding a transport means adding its folder and a line here.
  (void)registry.add(local_clone_entry());
  (void)registry.add(shared_memory_entry());
  (void)registry.add(file_mmap_entry());
#if WSYNC_HAVE_UCX
  (void)registry.add(ucx_entry());
#endif
  for (auto& e : gpu_transport_entries()) (void)registry.add(std::move(e));
}

const transport_registry& builtin_transports() {
  static const transport_registry registry = [] {
    transport_registry r;
    register_builtin_transports(r);
    return r;
  }();
  return registry;
}

result<std::unique_ptr<transport>> make_transport(std::string_view name,
                                                  const transport_options& options) {
  return builtin_transports().make(name, options);
}

bool transport_known(std::string_view name) {
  return builtin_transports().find(name) != nullptr;
}

}  // namespace wsync
