// Compiled and run by ctest (docs.example_publish_and_install), so this page cannot drift from
// the code. One process: a trainer publishes two versions over shared memory, a rollout worker
// installs each through the rollout executor, and both sides release.

#include <cstdio>
#include <vector>

#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

int main() {
  // 1. Pick a transport by name; unknown names list the known ones.
  auto transport = wsync::make_transport("shared-memory", {{"slots", "2"}});
  if (!transport) return std::fprintf(stderr, "%s\n", transport.error().message.c_str()), 1;

  // 2. Trainer side: a publisher for one model.
  wsync::publisher_config config;
  config.model_id = "demo-model";
  wsync::weight_publisher publisher(*(*transport)->make_publisher(), "shared-memory", config);

  // 3. Rollout side: consumer -> executor -> runtime (which readers use for generation).
  wsync::weight_consumer consumer(*(*transport)->make_consumer(), wsync::consumer_config{});
  wsync::reference_runtime runtime;
  wsync::rollout_executor executor(consumer, runtime, runtime.gate());

  std::vector<float> weight(1024), bias(16);
  std::vector<wsync::tensor_source> tensors = {
      {"layer.weight",
       wsync::dtype::f32,
       {32, 32},
       {},
       reinterpret_cast<const std::byte*>(weight.data()),
       weight.size() * sizeof(float)},
      {"layer.bias",
       wsync::dtype::f32,
       {16},
       {},
       reinterpret_cast<const std::byte*>(bias.data()),
       bias.size() * sizeof(float)},
  };

  for (std::uint64_t version = 1; version <= 2; ++version) {
    weight[0] = static_cast<float>(version);
    // publish: pack, copy + checksum, manifest. Consumer rank 0 is expected to answer.
    auto manifest = publisher.publish(tensors, version, {0});
    if (!manifest) return std::fprintf(stderr, "%s\n", manifest.error().message.c_str()), 1;

    // The manifest travels to the consumer (as JSON over the control plane; here directly).
    auto report = executor.update_weights(*manifest);
    if (!report.acknowledged) {
      return std::fprintf(stderr, "rejected: %s\n", report.failure->message.c_str()), 1;
    }
    // The consumer's answers travel back: ack, and the release of the update it replaced.
    (void)publisher.on_acknowledged(report.id, 0);
    for (const auto& id : report.released) (void)publisher.on_released(id, 0);

    float first = runtime.generate([](const wsync::runtime_weights& w) {
      return *reinterpret_cast<const float*>(w.tensors[0].data);
    });
    std::printf("active version %llu, layer.weight[0] = %.0f\n",
                static_cast<unsigned long long>(runtime.active_version()), first);
  }
  // Shutdown: the consumer gives back the update its active weights still point into.
  for (const auto& id : executor.release_active()) (void)publisher.on_released(id, 0);
  return publisher.held_updates().empty() ? 0 : 1;
}
