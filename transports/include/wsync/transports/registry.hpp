#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/transports/transport.hpp"

namespace wsync {

/// A named transport and how to build it.
struct transport_entry {
  std::string name;
  std::string summary;  ///< one line for --help and error messages
  transport_caps caps;
  std::function<result<std::unique_ptr<transport>>(const transport_options&)> make;
};

/// Name -> transport. Filled explicitly by register_builtin_transports() so nothing depends on
/// static initialisers the linker may drop.
class transport_registry {
 public:
  result<void> add(transport_entry entry);
  const transport_entry* find(std::string_view name) const;
  std::vector<std::string> names() const;
  const std::vector<transport_entry>& entries() const { return entries_; }

  /// Builds a transport; an unknown name is errc::unknown_transport listing the known ones.
  result<std::unique_ptr<transport>> make(std::string_view name,
                                          const transport_options& options) const;

 private:
  std::vector<transport_entry> entries_;
};

/// Adds local-clone, shared-memory and every other transport compiled in.
void register_builtin_transports(transport_registry& registry);

/// The process-wide registry holding the built-in transports.
const transport_registry& builtin_transports();

/// Shorthand: builtin_transports().make(name, options).
result<std::unique_ptr<transport>> make_transport(std::string_view name,
                                                  const transport_options& options = {});

/// True when `name` is a built-in transport (for manifest_validate).
bool transport_known(std::string_view name);

}  // namespace wsync
