// Fuzz target: the request bodies and query values of the HTTP surfaces (vLLM's four phases,
// pause and world size; SGLang's group, update, pause and version calls; the weight checker),
// called in order on a fresh standalone rank. Input: the texts separated by NUL, in the order of
// `calls` below. Every answer is a JSON object with a status the surface documents; nothing
// throws.
//
// The rank is initialised over local-clone before the fuzzed calls, so no fuzzed body can make
// it open a transport (a file-mmap dir, a UCX worker) on this machine.

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/manifest/log.hpp"

namespace {

using service = wsync::weight_transfer_service;
using call = wsync::http_reply (*)(service&, std::string_view);

const call calls[] = {
    [](service& s, std::string_view b) { return s.init(b); },
    [](service& s, std::string_view b) { return s.start(b); },
    [](service& s, std::string_view b) { return s.update(b); },
    [](service& s, std::string_view b) { return s.finish(b); },
    [](service& s, std::string_view q) { return s.pause(q); },
    [](service& s, std::string_view) { return s.resume(); },
    [](service& s, std::string_view q) { return s.world_size(q); },
    [](service& s, std::string_view b) { return s.sglang_init_group(b); },
    [](service& s, std::string_view b) { return s.sglang_update(b); },
    [](service& s, std::string_view b) { return s.sglang_pause(b); },
    [](service& s, std::string_view b) { return s.sglang_continue(b); },
    [](service& s, std::string_view b) { return s.sglang_destroy_group(b); },
    [](service& s, std::string_view b) { return s.update_weight_version(b); },
    [](service& s, std::string_view b) { return s.weight_checker(b); },
};

void check(const wsync::http_reply& r) {
  auto j = nlohmann::json::parse(r.body, nullptr, false);
  wsync::fuzz::expect(j.is_object(), "every answer is a JSON object");
  wsync::fuzz::expect(r.status == 200 || r.status == 400 || r.status == 409 || r.status == 500,
                      "every status is 200, 400, 409 or 500");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool quiet = [] {
    wsync::log_set_level(wsync::log_level::error);
    return true;
  }();
  (void)quiet;
  service s(wsync::weight_transfer_config{});
  auto ready = s.init(R"({"init_info": {"transport": "local-clone"}})");
  wsync::fuzz::expect(ready.status == 200, "a rank initialises over local-clone");
  auto parts = wsync::fuzz::split(wsync::fuzz::text(data, size), '\0');
  for (std::size_t i = 0; i < parts.size() && i < std::size(calls); ++i) {
    check(calls[i](s, parts[i]));
  }
  check(s.status());
  check(s.is_paused());
  check(s.sglang_model_info());
  check(s.weight_info());
  return 0;
}
