#pragma once
// Several nodes on one machine: one network namespace per node, each joined by a veth pair to a
// bridge in a router namespace, each node's link rate-limited both ways with tc (tbf), so the
// network, not the two CPU cores, bounds a transfer between nodes. Root only.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"

namespace wsync {

class emulated_cluster {
 public:
  /// The interface every node reaches the others through (UCX_NET_DEVICES).
  static constexpr const char* device = "wsync0";

  /// Sets up `nodes` nodes whose links carry `rate_mbit` Mbit/s each way. Fails with `blocked`
  /// when not root or iproute2 is missing; anything half built is torn down again.
  static result<std::unique_ptr<emulated_cluster>> create(unsigned nodes, std::uint64_t rate_mbit);

  /// Deletes every namespace, and with them the veths, bridge and qdiscs.
  ~emulated_cluster();
  emulated_cluster(const emulated_cluster&) = delete;
  emulated_cluster& operator=(const emulated_cluster&) = delete;

  unsigned nodes() const { return nodes_; }
  /// Node i's address on the emulated network (10.99.0.i+1).
  std::string address(unsigned node) const;
  /// Moves the calling process into node i's namespace; call in a child before it starts
  /// threads (setns applies to the calling thread only).
  result<void> enter(unsigned node) const;

  /// Removes namespaces left by runs whose process is gone (killed before tearing down).
  static std::vector<std::string> sweep();
  /// Whether this machine lets us create and enter a network namespace; errc::blocked with the
  /// command that failed and what it said when not (a container's root often cannot).
  static result<void> probe();

 private:
  emulated_cluster(std::string prefix, unsigned nodes)
      : prefix_(std::move(prefix)), nodes_(nodes) {}
  std::string ns(unsigned node) const;
  std::string router() const { return prefix_ + "-r"; }

  std::string prefix_;
  unsigned nodes_;
  bool built_ = false;
};

}  // namespace wsync
