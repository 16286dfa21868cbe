#include "local_clone/local_clone.hpp"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace wsync {
namespace {

using buffer = std::vector<std::byte>;

// Reuses buffers so repeated updates copy into memory that is already faulted in.
class buffer_pool {
 public:
  buffer take(std::uint64_t nbytes) {
    std::lock_guard lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity() >= nbytes) {
        buffer b = std::move(*it);
        free_.erase(it);
        b.resize(nbytes);
        return b;
      }
    }
    return buffer(nbytes);
  }
  void give(std::vector<buffer> buffers) {
    std::lock_guard lock(mutex_);
    for (auto& b : buffers) {
      if (free_.size() < max_free) free_.push_back(std::move(b));
    }
  }

 private:
  static constexpr std::size_t max_free = 64;
  std::mutex mutex_;
  std::vector<buffer> free_;
};

// What publishers of one local_clone_transport exposed, by update id.
struct store {
  std::mutex mutex;
  std::unordered_map<update_id, std::vector<buffer>> exposed;
  std::string instance;  // "<pid>:<n>", checked on import
};

std::string instance_name() {
  static std::atomic<unsigned> counter{0};
  return std::to_string(::getpid()) + ":" + std::to_string(counter++);
}

class local_publisher final : public publisher_transport {
 public:
  explicit local_publisher(std::shared_ptr<store> s) : store_(std::move(s)) {}

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds) override {
    std::vector<buffer> bufs;
    for (auto n : sizes) bufs.push_back(pool_.take(n));
    std::vector<std::span<std::byte>> spans;
    for (auto& b : bufs) spans.emplace_back(b.data(), b.size());
    std::lock_guard lock(store_->mutex);
    if (!store_->exposed.emplace(id, std::move(bufs)).second) {
      return make_error(errc::invalid_argument,
                        "local-clone: update_id " + id + " acquired twice (field update_id)");
    }
    return spans;
  }

  result<std::string> expose(const update_id& id) override {
    return "local-clone:" + store_->instance + ":" + id;
  }

  void release(const update_id& id) override {
    std::vector<buffer> bufs;
    {
      std::lock_guard lock(store_->mutex);
      auto it = store_->exposed.find(id);
      if (it == store_->exposed.end()) return;
      bufs = std::move(it->second);
      store_->exposed.erase(it);
    }
    pool_.give(std::move(bufs));
  }

 private:
  std::shared_ptr<store> store_;
  buffer_pool pool_;
};

class local_consumer final : public consumer_transport {
 public:
  explicit local_consumer(std::shared_ptr<store> s) : store_(std::move(s)) {}

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    std::string expect = "local-clone:" + store_->instance + ":" + m.update_id;
    if (m.transport_handle != expect) {
      return make_error(errc::blocked,
                        "blocked: local-clone handle \"" + m.transport_handle +
                            "\" comes from another process or transport instance; local-clone "
                            "works only inside one process (field transport_handle, " +
                            update_context(m) + ")");
    }
    std::vector<buffer> copies;
    {
      std::lock_guard lock(store_->mutex);
      auto it = store_->exposed.find(m.update_id);
      if (it == store_->exposed.end()) {
        return make_error(errc::unknown_update, "unknown update_id: " + m.update_id +
                                                    " is not exposed by local-clone (" +
                                                    update_context(m) + ")");
      }
      if (it->second.size() != m.segments.size()) {
        return make_error(errc::invalid_manifest,
                          "invalid manifest: segments: " + std::to_string(m.segments.size()) +
                              " segments but the publisher exposed " +
                              std::to_string(it->second.size()) + " (" + update_context(m) + ")");
      }
      for (std::size_t i = 0; i < m.segments.size(); ++i) {
        const auto& src = it->second[i];
        if (src.size() != m.segments[i].nbytes) {
          return make_error(errc::invalid_manifest,
                            "invalid manifest: segments[" + std::to_string(i) +
                                "].nbytes: differs from the exposed segment (" + update_context(m) +
                                ")");
        }
        buffer b = pool_.take(src.size());
        std::memcpy(b.data(), src.data(), src.size());
        copies.push_back(std::move(b));
      }
    }
    std::vector<std::span<const std::byte>> spans;
    for (auto& b : copies) spans.emplace_back(b.data(), b.size());
    std::lock_guard lock(mutex_);
    held_[m.update_id] = std::move(copies);
    return spans;
  }

  void release(const update_id& id) override {
    std::vector<buffer> bufs;
    {
      std::lock_guard lock(mutex_);
      auto it = held_.find(id);
      if (it == held_.end()) return;
      bufs = std::move(it->second);
      held_.erase(it);
    }
    pool_.give(std::move(bufs));
  }

 private:
  std::shared_ptr<store> store_;
  buffer_pool pool_;
  std::mutex mutex_;
  std::unordered_map<update_id, std::vector<buffer>> held_;
};

constexpr transport_caps local_caps{.cpu_memory = true,
                                    .gpu_memory = false,
                                    .cross_process = false,
                                    .cross_node = false,
                                    .zero_copy_import = false};

class local_clone_transport final : public transport {
 public:
  local_clone_transport() : store_(std::make_shared<store>()) {
    store_->instance = instance_name();
  }
  std::string_view name() const override { return "local-clone"; }
  transport_caps caps() const override { return local_caps; }
  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    return std::unique_ptr<publisher_transport>(std::make_unique<local_publisher>(store_));
  }
  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return std::unique_ptr<consumer_transport>(std::make_unique<local_consumer>(store_));
  }

 private:
  std::shared_ptr<store> store_;
};

}  // namespace

transport_entry local_clone_entry() {
  return {"local-clone", "one process; the consumer copies every segment", local_caps,
          [](const transport_options& options) -> result<std::unique_ptr<transport>> {
            options_reader reader("local-clone", options);
            if (auto ok = reader.finish(); !ok) return ok.error();
            return std::unique_ptr<transport>(std::make_unique<local_clone_transport>());
          }};
}

}  // namespace wsync
