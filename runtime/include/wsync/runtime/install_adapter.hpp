#pragma once
// How imported tensors get into a runtime. Installing is two steps so that a failure can never
// leave readers on a half-installed model: stage (may fail, changes nothing readers see), then
// activate (under the exclusive side of the generation gate, cannot fail).

#include <span>

#include "wsync/manifest/result.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync {

class install_adapter {
 public:
  virtual ~install_adapter() = default;

  /// Prepares one update — all its shards, one per publisher rank, together holding every
  /// tensor of the model at one version — for activation: checks it fits the model and copies
  /// or indexes its tensors. On failure nothing readers see has changed and the adapter holds
  /// nothing of it. The shards' views stay valid at least until activate() or discard()
  /// returns, and longer when references_import() is true (then until the next activation).
  /// Shards come ordered by source rank; the update is named by the first one's update_id.
  virtual result<void> stage(std::span<const imported_update* const> shards) = 0;

  /// Switches readers to the staged update `id`. Runs under the exclusive side of the gate.
  virtual void activate(const update_id& id) noexcept = 0;

  /// Forgets a staged update that will not be activated.
  virtual void discard(const update_id& id) noexcept = 0;

  /// True when the active weights point into the imported memory, so the import must be held
  /// until the next activation; false when stage() copied everything.
  virtual bool references_import() const = 0;

  /// Forgets active weights that point into imported memory: the imports are about to be
  /// released (at shutdown), and a reader that comes later must find no weights rather than
  /// memory given back. True when it did (readers then see no version); false when its weights
  /// stay readable (its own copy, or memory it keeps alive itself). Runs under the exclusive
  /// side of the gate, only when references_import() is true. A later stage() still checks the
  /// update against the model's architecture.
  virtual bool deactivate() noexcept { return false; }
};

}  // namespace wsync
