#pragma once
// A consumer transport that tells its publisher about each release the moment it happens, as a
// prompt control plane would, so the publisher may rewrite the slot at once: what the torn-read
// tests race readers against.

#include <gtest/gtest.h>

#include <memory>

#include "wsync/transports/forwarding.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync::test {

class releasing_transport final : public forwarding_consumer {
 public:
  releasing_transport(std::unique_ptr<consumer_transport> inner, weight_publisher& publisher)
      : forwarding_consumer(std::move(inner)), publisher_(publisher) {}
  void release(const update_id& id) override {
    inner_->release(id);
    EXPECT_TRUE(publisher_.on_released(id, 0));
  }

 private:
  weight_publisher& publisher_;
};

}  // namespace wsync::test
