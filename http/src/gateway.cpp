#include "wsync/http/gateway.hpp"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

#include "wsync/manifest/log.hpp"

namespace wsync {

struct http_gateway::impl {
  impl(weight_transfer_service& s, http_options o) : service(s), options(std::move(o)) {}
  weight_transfer_service& service;
  http_options options;
  httplib::Server server;
  std::thread thread;
  int listen_fd = -1;  // the socket the server listens on, once bound
};

namespace {

void answer(httplib::Response& res, const http_reply& r) {
  res.status = r.status;
  res.set_content(r.body, "application/json");
}

// The body of a POST, or "" when the client sent none. vLLM's clients and docs POST /pause,
// /resume, /start and /finish bare (curl -X POST sends no Content-Length); httplib would answer
// 400 before routing, so POST routes read their body themselves.
std::string body_of(const httplib::Request& q, const httplib::ContentReader& read) {
  std::string body;
  if (q.has_header("Content-Length") || q.get_header_value("Transfer-Encoding") == "chunked") {
    read([&](const char* data, std::size_t n) {
      body.append(data, n);
      return true;
    });
  }
  return body;
}

using req = const httplib::Request&;
using res = httplib::Response&;
using reader = const httplib::ContentReader&;

// POST routes answer handle(request, body).
template <class Handle>
void post(httplib::Server& server, const char* path, Handle handle) {
  server.Post(path,
              [handle](req q, res r, reader read) { answer(r, handle(q, body_of(q, read))); });
}

// Every surface: wsync's /status, /metrics, /generate and /health.
void add_common_routes(httplib::Server& server, weight_transfer_service& s) {
  post(server, "/generate", [&s](req, const std::string& b) { return s.generate(b); });
  server.Get("/status", [&s](req, res r) { answer(r, s.status()); });
  server.Get("/metrics",
             [&s](req, res r) { r.set_content(s.metrics(), "text/plain; version=0.0.4"); });
  server.Get("/health", [](req, res r) { answer(r, {200, R"({"status":"ok"})"}); });
}

// vLLM's paths and shapes: the four phases, pause and resume, the weight version and checker.
void add_vllm_routes(httplib::Server& server, weight_transfer_service& s) {
  post(server, "/init_weight_transfer_engine",
       [&s](req, const std::string& b) { return s.init(b); });
  post(server, "/start_weight_update", [&s](req, const std::string& b) { return s.start(b); });
  post(server, "/update_weights", [&s](req, const std::string& b) { return s.update(b); });
  post(server, "/finish_weight_update", [&s](req, const std::string& b) { return s.finish(b); });
  post(server, "/pause", [&s](req q, const std::string&) {
    return s.pause(q.has_param("mode") ? q.get_param_value("mode") : "");
  });
  post(server, "/resume", [&s](req, const std::string&) { return s.resume(); });
  server.Get("/is_paused", [&s](req, res r) { answer(r, s.is_paused()); });
  server.Get("/get_world_size", [&s](req q, res r) {
    answer(r, s.world_size(q.has_param("include_dp") ? q.get_param_value("include_dp") : ""));
  });
  post(server, "/update_weight_version",
       [&s](req, const std::string& b) { return s.update_weight_version(b); });
  server.Get("/weight_info", [&s](req, res r) { answer(r, s.weight_info()); });
  post(server, "/weight_checker", [&s](req, const std::string& b) { return s.weight_checker(b); });
}

// SGLang's paths and shapes (sglang.cpp).
void add_sglang_routes(httplib::Server& server, weight_transfer_service& s, bool with_vllm) {
  post(server, "/init_weights_update_group",
       [&s](req, const std::string& b) { return s.sglang_init_group(b); });
  post(server, "/destroy_weights_update_group",
       [&s](req, const std::string& b) { return s.sglang_destroy_group(b); });
  post(server, "/update_weights_from_distributed",
       [&s](req, const std::string& b) { return s.sglang_update(b); });
  post(server, "/pause_generation", [&s](req, const std::string& b) { return s.sglang_pause(b); });
  post(server, "/continue_generation",
       [&s](req, const std::string& b) { return s.sglang_continue(b); });
  for (const char* path : {"/get_weight_version", "/model_info", "/get_model_info"}) {
    server.Get(path, [&s](req, res r) { answer(r, s.sglang_model_info()); });
  }
  if (!with_vllm) {  // one route and shape for both surfaces
    post(server, "/update_weight_version",
         [&s](req, const std::string& b) { return s.update_weight_version(b); });
  }
}

}  // namespace

http_gateway::http_gateway(weight_transfer_service& service, http_options options)
    : impl_(std::make_unique<impl>(service, std::move(options))) {
  auto& server = impl_->server;
  const int threads = impl_->options.threads;
  server.new_task_queue = [threads] {
    return new httplib::ThreadPool(threads);
  };
  server.set_payload_max_length(std::size_t{64} << 20);  // manifests, not tensor bytes
  // Debian's libcpp-httplib listens with a backlog of 5: bursts of clients (vLLM ranks polling
  // /metrics, a test's 32 threads) overflow it and see reset connections. Keep the socket so
  // start() can raise the backlog (listen() again on a listening socket only changes it).
  server.set_socket_options([this](int sock) {
    httplib::default_socket_options(sock);
    impl_->listen_fd = sock;
  });
  if (!impl_->options.token.empty()) {
    const std::string expected = "Bearer " + impl_->options.token;
    server.set_pre_routing_handler([expected](const httplib::Request& q, httplib::Response& r) {
      if (q.get_header_value("Authorization") == expected)
        return httplib::Server::HandlerResponse::Unhandled;
      r.status = 401;
      r.set_header("WWW-Authenticate", "Bearer");
      r.set_content(R"({"error":"authorization: missing or wrong bearer token"})",
                    "application/json");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  server.set_error_handler([](const httplib::Request& q, httplib::Response& r) {
    if (!r.body.empty()) return;  // a route answered with its own error
    std::string why = r.status == 404   ? "path: no route " + q.path
                      : r.status == 405 ? "method: " + q.method + " is not allowed on " + q.path
                                        : "request: HTTP " + std::to_string(r.status);
    r.set_content("{\"error\":\"" + why + "\"}", "application/json");
  });
  const std::string& api = impl_->options.api;
  add_common_routes(server, impl_->service);
  if (api == "vllm" || api == "both") add_vllm_routes(server, impl_->service);
  if (api == "sglang" || api == "both") add_sglang_routes(server, impl_->service, api == "both");
}

http_gateway::~http_gateway() {
  stop();
}

result<std::uint16_t> http_gateway::start() {
  auto& o = impl_->options;
  if (std::find(std::begin(http_api_names), std::end(http_api_names), o.api) ==
      std::end(http_api_names)) {
    return make_error(errc::invalid_argument,
                      "http-api: \"" + o.api + "\" is not one of vllm, sglang, both");
  }
  int port = o.port == 0 ? impl_->server.bind_to_any_port(o.host)
                         : (impl_->server.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port <= 0) {
    return make_error(errc::io_error,
                      "http: cannot listen on " + o.host + ":" + std::to_string(o.port));
  }
  if (impl_->listen_fd >= 0) ::listen(impl_->listen_fd, SOMAXCONN);
  impl_->thread = std::thread([this] { impl_->server.listen_after_bind(); });
  if (!o.port_file.empty()) {
    std::string tmp = o.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), o.port_file.c_str());
  }
  return static_cast<std::uint16_t>(port);
}

void http_gateway::stop() {
  if (!impl_->thread.joinable()) return;
  impl_->server.stop();
  impl_->thread.join();
}

}  // namespace wsync
