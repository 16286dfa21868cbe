#include "wsync/bench/rank_process.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

#include "wsync/bench/timing.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

bool write_all(int fd, const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n, clock_type::time_point deadline,
              const volatile sig_atomic_t* interrupted) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR && !(interrupted && *interrupted)) continue;
    if (r <= 0) return false;
    ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= static_cast<std::size_t>(got);
  }
  return true;
}

}  // namespace

bool channel_send(int fd, const json& j) {
  std::string text = j.dump();
  std::uint32_t len = static_cast<std::uint32_t>(text.size());
  return write_all(fd, &len, sizeof len) && write_all(fd, text.data(), text.size());
}

std::optional<json> channel_receive(int fd, std::chrono::milliseconds timeout,
                                    const volatile sig_atomic_t* interrupted) {
  auto deadline = clock_type::now() + timeout;
  std::uint32_t len = 0;
  if (!read_all(fd, &len, sizeof len, deadline, interrupted)) return std::nullopt;
  std::string text(len, '\0');
  if (!read_all(fd, text.data(), len, deadline, interrupted)) return std::nullopt;
  auto j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// --- the consumer side: a reference runtime behind the rollout executor ----------------------

bench_consumer::bench_consumer(std::unique_ptr<consumer_transport> t, bool verify,
                               std::int32_t rank)
    : consumer_(std::move(t), consumer_config{rank, 2}),
      executor_(consumer_, runtime_, runtime_.gate(), executor_config{verify}) {}

json bench_consumer::handle(const weight_update_manifest& m, double decode_s) {
  auto r = executor_.update_weights(m);
  double ack_sent = now_s();
  json timings = {{"import", r.timings.import},   {"verify", r.timings.verify},
                  {"install", r.timings.install}, {"ack", r.timings.ack},
                  {"release", r.timings.release}, {"decode", decode_s}};
  return {{"type", "report"},
          {"update_id", r.id},
          {"acknowledged", r.acknowledged},
          {"reason", r.failure ? r.failure->message : ""},
          {"released", r.released},
          {"released_self", r.released_self},
          {"active_weight_version", runtime_.active_version()},
          {"ack_sent_s", ack_sent},
          {"timings", timings}};
}

[[noreturn]] void bench_consumer_process(int fd, bool verify, const std::string& transport_name,
                                         const transport_options& options, std::int32_t rank) {
  int code = 0;
  // An exception must end this process here: it must not unwind into the parent's code, which
  // this forked copy of the stack would then run on (printing rows, stopping "its" consumer).
  try {
    auto t = make_transport(transport_name, options);
    auto c = t ? (*t)->make_consumer() : result<std::unique_ptr<consumer_transport>>(t.error());
    if (!c) {
      channel_send(fd, {{"type", "error"}, {"reason", c.error().message}});
      ::_exit(1);
    }
    channel_send(fd, {{"type", "ready"}, {"relay_address", (*c)->relay_address()}});
    bench_consumer side(std::move(*c), verify, rank);
    // Idle between updates for as long as the parent likes; it stops us or closes the socket.
    while (auto msg = channel_receive(fd, std::chrono::hours(24))) {
      if ((*msg)["type"] == "update") {
        auto t0 = now_s();
        auto m = manifest_from_json((*msg)["manifest"].get<std::string>());
        double decode_s = now_s() - t0;
        if (!m) {
          channel_send(
              fd, {{"type", "report"}, {"acknowledged", false}, {"reason", m.error().message}});
          continue;
        }
        if (!channel_send(fd, side.handle(*m, decode_s))) break;
      } else if ((*msg)["type"] == "stop") {
        channel_send(fd, {{"type", "released"}, {"update_ids", side.shutdown()}});
        break;
      }
    }
  } catch (const std::exception& e) {
    channel_send(fd, {{"type", "error"}, {"reason", std::string("consumer: ") + e.what()}});
    code = 1;
  } catch (...) {
    code = 1;
  }
  ::close(fd);
  ::_exit(code);
}

}  // namespace wsync
