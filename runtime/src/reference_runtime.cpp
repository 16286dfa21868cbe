#include "wsync/runtime/reference_runtime.hpp"

#include <algorithm>
#include <cstring>

#include "wsync/transports/gpu.hpp"

namespace wsync {
namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

result<void> reference_runtime::stage(std::span<const imported_update* const> shards) {
  std::lock_guard lock(stage_mutex_);
  if (shards.empty()) return make_error(errc::install_failed, "install failed: no shards");
  std::vector<tensor_view> views;  // every tensor of the update, shard after shard
  for (const auto* shard : shards)
    views.insert(views.end(), shard->tensors.begin(), shard->tensors.end());
  const auto& m = shards.front()->manifest;
  auto context = update_context(m);
  // The model's architecture is fixed by the first install; later updates must match it, as a
  // real engine's parameters would.
  const auto& current = active_->weights.tensors.empty() ? architecture_ : active_->weights.tensors;
  if (!current.empty()) {
    if (current.size() != views.size()) {
      return make_error(errc::install_failed,
                        "install failed: tensors: update has " + std::to_string(views.size()) +
                            " tensors, the model has " + std::to_string(current.size()) + " (" +
                            context + ")");
    }
    for (std::size_t i = 0; i < current.size(); ++i) {
      const auto& d = *views[i].descriptor;
      if (d.name != current[i].name || d.shape != current[i].shape || d.dtype != current[i].dtype) {
        return make_error(errc::install_failed,
                          "install failed: tensors[" + std::to_string(i) + "] \"" + d.name + "\" " +
                              std::string(dtype_name(d.dtype)) + shape_text(d.shape) +
                              " does not match the model's \"" + current[i].name + "\" " +
                              std::string(dtype_name(current[i].dtype)) +
                              shape_text(current[i].shape) + " (" + context + ")");
      }
    }
  }
  // This runtime's readers work on the host: tensors on a device are copied in, whatever the
  // install mode.
  const bool shards_on_host =
      std::all_of(shards.begin(), shards.end(), [](const auto* s) { return s->memory.host(); });
  const bool copy = mode_ == install_mode::copy || !shards_on_host;
  auto set = spare_ ? std::move(spare_) : std::make_unique<buffer_set>();
  set->weights.weight_version = m.weight_version;
  set->weights.id = m.update_id;
  set->weights.tensors.resize(views.size());
  set->copied = copy;
  if (copy) {
    set->storage.resize(views.size());
  } else {
    std::vector<std::vector<std::byte>>().swap(set->storage);  // a whole host copy, unused
  }
  for (std::size_t i = 0; i < views.size(); ++i) {
    const auto& view = views[i];
    auto& t = set->weights.tensors[i];
    t.name = view.descriptor->name;
    t.dtype = view.descriptor->dtype;
    t.shape = view.descriptor->shape;
    t.nbytes = view.descriptor->nbytes;
    if (copy) {
      // The inactive buffer is private to this thread until activate(): readers never see it.
      auto& storage = set->storage[i];
      storage.resize(t.nbytes);
      if (shards_on_host) {
        std::memcpy(storage.data(), view.data, t.nbytes);
      } else if (auto ok = gpu::copy_to_host(storage.data(), view.data, t.nbytes); !ok) {
        return make_error(errc::install_failed, "install failed: tensors[" + std::to_string(i) +
                                                    "] \"" + t.name + "\": " + ok.error().message +
                                                    " (" + context + ")");
      }
      t.data = storage.data();
    } else {
      t.data = view.data;
    }
  }
  staged_ = std::move(set);
  return {};
}

void reference_runtime::activate(const update_id& id) noexcept {
  std::lock_guard lock(stage_mutex_);
  if (!staged_ || staged_->weights.id != id) return;
  std::swap(active_, staged_);
  spare_ = std::move(staged_);  // the previous buffers, reused by the next stage()
  architecture_.clear();
}

void reference_runtime::discard(const update_id& id) noexcept {
  std::lock_guard lock(stage_mutex_);
  if (staged_ && staged_->weights.id == id) spare_ = std::move(staged_);
}

bool reference_runtime::deactivate() noexcept {
  std::lock_guard lock(stage_mutex_);
  if (active_->copied) return false;  // the runtime's own buffers: still valid
  architecture_ = std::move(active_->weights.tensors);
  active_->weights.tensors.clear();
  active_->weights.id.clear();
  active_->weights.weight_version = 0;
  return true;
}

std::uint64_t reference_runtime::active_version() {
  return generate([](const runtime_weights& w) { return w.weight_version; });
}

}  // namespace wsync
