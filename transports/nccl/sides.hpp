#pragma once
// What the nccl transport's two sides share (transport.cpp makes them): the loop that moves an
// update as slices, and the factories of the publisher (publisher.cpp) and consumer
// (consumer.cpp).

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "nccl/handle.hpp"
#include "nccl/plan.hpp"
#include "wsync/transports/nccl_transport.hpp"

namespace wsync::nccl::detail {

using clock = std::chrono::steady_clock;

/// Where slice `s` of an update is: the bytes a sender broadcasts from (packing them there first
/// if need be), or where a receiver lands them.
using slice_place = std::function<result<std::byte*>(const nccl_plan::slice& s)>;

/// Queues rank 0's broadcasts of the `h.bytes` of an update, in slices of at most
/// h.bucket_bytes, each at place(slice), waiting after every h.buckets of them and at the end.
result<void> broadcast_slices(group_member& member, const nccl_handle::handle& h,
                              clock::time_point deadline, const slice_place& place);

std::unique_ptr<publisher_transport> make_publisher(transport_settings settings,
                                                    std::shared_ptr<group_fabric> fabric,
                                                    std::string group, block header);
std::unique_ptr<consumer_transport> make_consumer(transport_settings settings,
                                                  std::shared_ptr<group_fabric> fabric);

}  // namespace wsync::nccl::detail
