#include "wsync/http/gateway.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <strings.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "wsync/manifest/log.hpp"
#include "wsync/manifest/port_file.hpp"

namespace wsync {

constexpr std::size_t max_body_bytes = std::size_t{64} << 20;  // manifests, not tensor bytes

namespace {
// A connection as a key: its two ends' addresses and ports, as httplib writes them in
// Request::local_addr, local_port, remote_addr and remote_port.
std::string connection_key(const std::string& local, int local_port, const std::string& peer,
                           int peer_port) {
  return local + "#" + std::to_string(local_port) + "#" + peer + "#" + std::to_string(peer_port);
}
}  // namespace

struct http_gateway::impl {
  impl(weight_transfer_service& s, http_options o) : service(s), options(std::move(o)) {}
  weight_transfer_service& service;
  http_options options;
  httplib::Server server;
  std::thread thread;
  int listen_fd = -1;                  // the socket the server listens on, once bound
  std::set<std::string> post_paths;    // the routes that read their body themselves (capped)
  std::set<std::string> sglang_paths;  // SGLang's routes: errors as {"success": false, ...}
  std::atomic<int> generating{0};      // /generate calls being served
  std::atomic<bool> listen_ended{false};
  sockaddr_storage listen_address{};  // once listening
  // The connections whose request was read whole and is being answered (connection_key): stop()
  // leaves them to finish.
  std::mutex answering_mutex;
  std::multiset<std::string> answering;

  static std::string key_of(const httplib::Request& q) {
    return connection_key(q.local_addr, q.local_port, q.remote_addr, q.remote_port);
  }
  void answering_add(const httplib::Request& q) {
    std::lock_guard lock(answering_mutex);
    answering.insert(key_of(q));
  }
  void answering_remove(const httplib::Request& q) {
    std::lock_guard lock(answering_mutex);
    if (auto it = answering.find(key_of(q)); it != answering.end()) answering.erase(it);
  }
};

namespace {

void answer(httplib::Response& res, const http_reply& r) {
  res.status = r.status;
  res.set_content(r.body, "application/json");
}

// {"error": why} as JSON, whatever `why` holds (a path a client sent may hold quotes).
std::string error_json(const std::string& why) {
  return nlohmann::json{{"error", why}}.dump(-1, ' ', false,
                                             nlohmann::json::error_handler_t::replace);
}

// "Bearer <token>", the scheme in any case (RFC 7235), the token compared in time that does
// not depend on where it first differs.
bool bearer_matches(const std::string& header, const std::string& token) {
  constexpr std::string_view scheme = "bearer ";
  if (header.size() != scheme.size() + token.size()) return false;
  for (std::size_t i = 0; i < scheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != scheme[i]) return false;
  }
  unsigned char diff = 0;
  for (std::size_t i = 0; i < token.size(); ++i) {
    diff |= static_cast<unsigned char>(header[scheme.size() + i] ^ token[i]);
  }
  return diff == 0;
}

// Whether listening socket `fd` is bound to a loopback address (127/8, ::1, or 127/8 mapped into
// IPv6): what the host resolved to, not how it was spelled.
bool loopback_only(int fd) {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  if (fd < 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) return false;
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
  }
  if (a.ss_family != AF_INET6) return false;
  const auto& b = reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr.s6_addr;
  if (std::memcmp(b, in6addr_loopback.s6_addr, 16) == 0) return true;
  constexpr unsigned char v4_mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(b, v4_mapped, 12) == 0 && b[12] == 127;
}

// An address as httplib writes it (numeric host) and its port; false when it has none.
bool address_of(const sockaddr_storage& a, socklen_t n, std::string& host, int& port) {
  char h[NI_MAXHOST] = {};
  char serv[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&a), n, h, sizeof h, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  host = h;
  port = std::atoi(serv);
  return true;
}

// Whether `local` (an accepted socket's address) is on the listening address `listen`: the same
// family and port, and the same address unless the listener's is a wildcard.
bool on_listener(const sockaddr_storage& local, const sockaddr_storage& listen) {
  if (local.ss_family != listen.ss_family) return false;
  if (local.ss_family == AF_INET) {
    const auto& l = reinterpret_cast<const sockaddr_in&>(local);
    const auto& w = reinterpret_cast<const sockaddr_in&>(listen);
    return l.sin_port == w.sin_port &&
           (w.sin_addr.s_addr == htonl(INADDR_ANY) || l.sin_addr.s_addr == w.sin_addr.s_addr);
  }
  if (local.ss_family == AF_INET6) {
    const auto& l = reinterpret_cast<const sockaddr_in6&>(local);
    const auto& w = reinterpret_cast<const sockaddr_in6&>(listen);
    return l.sin6_port == w.sin6_port &&
           (std::memcmp(&w.sin6_addr, &in6addr_any, sizeof w.sin6_addr) == 0 ||
            std::memcmp(&l.sin6_addr, &w.sin6_addr, sizeof w.sin6_addr) == 0);
  }
  return false;
}

// Shuts down the connections this server accepted on `listen` whose request has not been read
// whole (those in `answering` are being answered, and are left to finish). httplib gives a
// client 5 s per read, however many reads it takes, so one that sends a byte every few seconds
// would keep a pool thread, and stop() waiting on it, for good. /proc/self/fd lists the
// process's descriptors; each is duplicated before it is looked at, so a descriptor closed and
// reused meanwhile is judged as what it now is, and only TCP streams on the listening address
// are touched. shutdown() ends the read that holds the thread.
void shut_unanswered(const sockaddr_storage& listen, const std::multiset<std::string>& answering) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return;
  while (const dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
    const int s = ::fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
    if (s < 0) continue;
    int type = 0, protocol = 0, listening = 1;
    socklen_t len = sizeof type;
    sockaddr_storage local{}, peer{};
    socklen_t n = sizeof local, m = sizeof peer;
    const bool ours =
        ::getsockopt(s, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM &&
        (len = sizeof protocol, ::getsockopt(s, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) == 0) &&
        protocol == IPPROTO_TCP &&
        (len = sizeof listening,
         ::getsockopt(s, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0) &&
        listening == 0 && ::getsockname(s, reinterpret_cast<sockaddr*>(&local), &n) == 0 &&
        on_listener(local, listen) && ::getpeername(s, reinterpret_cast<sockaddr*>(&peer), &m) == 0;
    std::string local_host, peer_host;
    int local_port = 0, peer_port = 0;
    if (ours && address_of(local, n, local_host, local_port) &&
        address_of(peer, m, peer_host, peer_port) &&
        answering.count(connection_key(local_host, local_port, peer_host, peer_port)) == 0) {
      ::shutdown(s, SHUT_RDWR);
    }
    ::close(s);
  }
  ::closedir(dir);
}

// Whether httplib reads the body as chunked: it compares the header without regard to case.
bool chunked(const httplib::Request& q) {
  return ::strcasecmp(q.get_header_value("Transfer-Encoding").c_str(), "chunked") == 0;
}

// The body of a POST, "" when the client sent none, or nullopt when it could not be read whole
// or passed max_body_bytes. vLLM's clients and docs POST /pause, /resume, /start and /finish
// bare (curl -X POST sends no Content-Length); httplib would answer 400 before routing, so POST
// routes read their body themselves. httplib's own limit does not hold for a chunked body: ours
// does.
std::optional<std::string> body_of(const httplib::Request& q, const httplib::ContentReader& read) {
  std::string body;
  if (q.has_header("Content-Length") || chunked(q)) {
    const bool whole = read([&](const char* data, std::size_t n) {
      if (n > max_body_bytes - body.size()) return false;
      body.append(data, n);
      return true;
    });
    if (!whole) return std::nullopt;
  }
  return body;
}

std::string unread_text(const httplib::Request& q) {
  return "request: the body of POST " + q.path + " could not be read whole, or it exceeds " +
         std::to_string(max_body_bytes >> 20) + " MiB";
}

http_reply unread_body(const httplib::Request& q) {
  return {413, error_json(unread_text(q) + "; nothing was done")};
}

using req = const httplib::Request&;
using res = httplib::Response&;
using reader = const httplib::ContentReader&;

// Whether errors on `path` take SGLang's shape: its routes, and every path when only SGLang's
// surface is served.
bool sglang_shaped(const http_gateway::impl& g, const std::string& path) {
  return g.options.api == "sglang" || g.sglang_paths.count(path) != 0;
}

// SGLang's error body: {"success": false, "message": why}.
std::string sglang_error_json(const std::string& why) {
  return nlohmann::json{{"success", false}, {"message", why}}.dump(
      -1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// An error reply in the shape of `path`'s surface: {"error": why}, or SGLang's.
std::string error_body(const http_gateway::impl& g, const std::string& path,
                       const std::string& why) {
  return sglang_shaped(g, path) ? sglang_error_json(why) : error_json(why);
}

// An error a shared handler answered as {"error": ...}, in SGLang's shape.
http_reply sglang_shape(http_reply r) {
  if (r.status < 400) return r;
  auto j = nlohmann::json::parse(r.body, nullptr, false);
  if (!j.is_object() || j.contains("success") || !j.contains("error")) return r;
  return {r.status, sglang_error_json(j["error"].is_string() ? j["error"].get<std::string>()
                                                             : j["error"].dump())};
}

// POST routes answer handle(request, body); a body not read whole is answered 413 unhandled.
// `sglang`: one of SGLang's routes, whose errors take its shape.
template <class Handle>
void post(http_gateway::impl& g, const char* path, Handle handle, bool sglang = false) {
  g.post_paths.insert(path);
  if (sglang) g.sglang_paths.insert(path);
  g.server.Post(path, [&g, handle](req q, res r, reader read) {
    auto body = body_of(q, read);
    // An update's unread body is the service's to answer: in NCCL mode the trainer's
    // broadcasts for it must not wait for the next call.
    if (body) g.answering_add(q);
    auto reply = body                          ? handle(q, *body)
                 : q.path == "/update_weights" ? g.service.update_unread(413, unread_text(q))
                                               : unread_body(q);
    answer(r, sglang_shaped(g, q.path) ? sglang_shape(std::move(reply)) : std::move(reply));
  });
}

// How many /generate calls may run at once: each one held by a pause keeps a pool thread, and
// /resume must still find one.
int generation_limit(int threads) {
  return threads - std::clamp(threads / 2, 1, 8);  // threads >= 2 (start() checks)
}

// Every surface: wsync's /status, /metrics, /generate and /health.
void add_common_routes(http_gateway::impl& g) {
  auto& s = g.service;
  const int limit = generation_limit(g.options.threads);
  post(g, "/generate", [&s, &g, limit](req, const std::string& b) -> http_reply {
    struct counted {
      std::atomic<int>& n;
      ~counted() { n.fetch_sub(1); }
    } in_flight{g.generating};
    if (g.generating.fetch_add(1) >= limit) {
      return {503, error_json("generate: " + std::to_string(limit) +
                              " generations are being served, the most this server takes (the "
                              "rest of its threads answer control calls such as /resume)")};
    }
    return s.generate(b);
  });
  auto& server = g.server;
  server.Get("/status", [&s](req, res r) { answer(r, s.status()); });
  server.Get("/metrics",
             [&s](req, res r) { r.set_content(s.metrics(), "text/plain; version=0.0.4"); });
  server.Get("/health", [](req, res r) { answer(r, {200, R"({"status":"ok"})"}); });
}

// vLLM's paths and shapes: the four phases, pause and resume, the weight version and checker.
void add_vllm_routes(http_gateway::impl& g) {
  auto& s = g.service;
  auto& server = g.server;
  post(g, "/init_weight_transfer_engine", [&s](req, const std::string& b) { return s.init(b); });
  post(g, "/start_weight_update", [&s](req, const std::string& b) { return s.start(b); });
  post(g, "/update_weights", [&s](req, const std::string& b) { return s.update(b); });
  post(g, "/finish_weight_update", [&s](req, const std::string& b) { return s.finish(b); });
  post(g, "/pause", [&s](req q, const std::string&) {
    // vLLM's older form: ?wait_for_inflight_requests=true means what mode=wait means.
    if (!q.has_param("mode") && q.has_param("wait_for_inflight_requests")) {
      const auto text = q.get_param_value("wait_for_inflight_requests");
      const auto wait = query_flag(text);
      if (!wait) {
        return http_reply{
            400, error_json("wait_for_inflight_requests: \"" + text + "\" is not a boolean")};
      }
      if (*wait) return s.pause("wait");
    }
    return s.pause(q.has_param("mode") ? q.get_param_value("mode") : "abort");
  });
  post(g, "/resume", [&s](req, const std::string&) { return s.resume(); });
  server.Get("/is_paused", [&s](req, res r) { answer(r, s.is_paused()); });
  server.Get("/get_world_size", [&s](req q, res r) {
    answer(r, s.world_size(q.has_param("include_dp") ? q.get_param_value("include_dp") : "true"));
  });
  post(g, "/update_weight_version",
       [&s](req, const std::string& b) { return s.update_weight_version(b); });
  server.Get("/weight_info", [&s](req, res r) { answer(r, s.weight_info()); });
  post(g, "/weight_checker", [&s](req, const std::string& b) { return s.weight_checker(b); });
}

// SGLang's paths and shapes (sglang.cpp).
void add_sglang_routes(http_gateway::impl& g, bool with_vllm) {
  auto& s = g.service;
  constexpr bool sglang = true;
  post(
      g, "/init_weights_update_group",
      [&s](req, const std::string& b) { return s.sglang_init_group(b); }, sglang);
  post(
      g, "/destroy_weights_update_group",
      [&s](req, const std::string& b) { return s.sglang_destroy_group(b); }, sglang);
  post(
      g, "/update_weights_from_distributed",
      [&s](req, const std::string& b) { return s.sglang_update(b); }, sglang);
  post(
      g, "/pause_generation", [&s](req, const std::string& b) { return s.sglang_pause(b); },
      sglang);
  post(
      g, "/continue_generation", [&s](req, const std::string& b) { return s.sglang_continue(b); },
      sglang);
  for (const char* path : {"/get_weight_version", "/model_info", "/get_model_info"}) {
    g.sglang_paths.insert(path);
    g.server.Get(path, [&s](req, res r) { answer(r, s.sglang_model_info()); });
  }
  if (!with_vllm) {  // one route for both surfaces: SGLang's shape when only SGLang's is served
    post(g, "/update_weight_version",
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
  server.set_payload_max_length(max_body_bytes);
  // One request per connection: a reply sent before its body was read (401, 411, 413, 415)
  // leaves the rest of that body unread, and a kept-alive connection would read it as the next
  // request. A control surface loses nothing by closing.
  server.set_keep_alive_max_count(1);
  // Debian's libcpp-httplib listens with a backlog of 5: bursts of clients (vLLM ranks polling
  // /metrics, a test's 32 threads) overflow it and see reset connections. Keep the socket so
  // start() can raise the backlog (listen() again on a listening socket only changes it).
  server.set_socket_options([this](int sock) {
    httplib::default_socket_options(sock);
    impl_->listen_fd = sock;
  });
  // Before httplib reads a body: the bearer token, then chunked bodies, which httplib would read
  // without a limit anywhere but on the POST routes (they read, and cap, their own).
  const std::string token = impl_->options.token;
  server.set_pre_routing_handler([this, token](const httplib::Request& q, httplib::Response& r) {
    if (!token.empty() && !bearer_matches(q.get_header_value("Authorization"), token)) {
      r.status = 401;
      r.set_header("WWW-Authenticate", "Bearer");
      r.set_content(error_body(*impl_, q.path, "authorization: missing or wrong bearer token"),
                    "application/json");
      return httplib::Server::HandlerResponse::Handled;
    }
    const bool post_route = q.method == "POST" && impl_->post_paths.count(q.path) != 0;
    auto refuse = [&](int status, const std::string& why) {
      if (post_route && q.path == "/update_weights") {
        // The service's to answer: in NCCL mode the trainer broadcasts for this call all the
        // same, and those broadcasts must not wait for the next one.
        answer(r, impl_->service.update_unread(status, why));
      } else {
        r.status = status;
        r.set_content(error_body(*impl_, q.path, why), "application/json");
      }
      return httplib::Server::HandlerResponse::Handled;
    };
    // httplib would inflate a compressed body with no limit but the compressed length, and
    // reads "gzip, chunked" as no body at all, leaving it to be read as the next request.
    if (const auto coding = q.get_header_value("Content-Encoding");
        !coding.empty() && ::strcasecmp(coding.c_str(), "identity") != 0) {
      return refuse(415, "request: Content-Encoding \"" + coding.substr(0, 64) +
                             "\" is not accepted; send the body uncompressed");
    }
    if (const auto transfer = q.get_header_value("Transfer-Encoding");
        !transfer.empty() && !chunked(q)) {
      return refuse(501, "request: Transfer-Encoding \"" + transfer.substr(0, 64) +
                             "\" is not supported; send Content-Length or chunked");
    }
    if (chunked(q) && !post_route) {
      return refuse(411, "request: a chunked body is read only by the POST routes; " + q.method +
                             " " + q.path + " takes none");
    }
    // Every route but the POST ones is a GET: anything else has no route, and is refused
    // before httplib reads a body it may carry (with or without a length; GET and HEAD bodies
    // httplib never reads).
    if (!post_route && q.method != "GET" && q.method != "HEAD") {
      return refuse(404, "path: no route " + q.path);
    }
    // Read whole unless a POST route reads a body next (post() marks it once read).
    if (!post_route) impl_->answering_add(q);
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Called once a reply is written: the connection is no longer being answered.
  server.set_logger(
      [this](const httplib::Request& q, const httplib::Response&) { impl_->answering_remove(q); });
  server.set_error_handler([this](const httplib::Request& q, httplib::Response& r) {
    if (!r.body.empty()) return;  // a route answered with its own error
    // httplib answers a route called with another method 404 as well.
    std::string why =
        r.status == 404 ? "path: no route " + q.path : "request: HTTP " + std::to_string(r.status);
    r.set_content(error_body(*impl_, q.path, why), "application/json");
  });
  const std::string& api = impl_->options.api;
  add_common_routes(*impl_);
  if (api == "vllm" || api == "both") add_vllm_routes(*impl_);
  if (api == "sglang" || api == "both") add_sglang_routes(*impl_, api == "both");
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
  if (o.threads < 2) {
    return make_error(errc::invalid_argument,
                      "http: threads " + std::to_string(o.threads) +
                          ": at least 2, so that a control call such as /resume always finds one "
                          "a generation does not hold");
  }
  port_file_clear(o.port_file);
  int port = o.port == 0 ? impl_->server.bind_to_any_port(o.host)
                         : (impl_->server.bind_to_port(o.host, o.port) ? o.port : -1);
  if (port <= 0) {
    return make_error(errc::io_error,
                      "http: cannot listen on " + o.host + ":" + std::to_string(o.port));
  }
  if (impl_->listen_fd >= 0) ::listen(impl_->listen_fd, SOMAXCONN);
  if (!loopback_only(impl_->listen_fd) && o.token.empty()) {
    log_warn("http: listening on " + o.host + ":" + std::to_string(port) +
             " without a token: whoever reaches it can replace this rank's weights; set "
             "--http-token (or WSYNC_HTTP_TOKEN)");
  }
  if (socklen_t n = sizeof impl_->listen_address;
      impl_->listen_fd < 0 ||
      ::getsockname(impl_->listen_fd, reinterpret_cast<sockaddr*>(&impl_->listen_address), &n) !=
          0) {
    impl_->listen_address = {};  // stop() then shuts no connection: it waits, as before
  }
  impl_->thread = std::thread([this] {
    impl_->server.listen_after_bind();
    impl_->listen_ended = true;
  });
  // httplib's stop() does nothing until the listen loop runs: a stop() that came first would
  // leave the loop serving and its join waiting for good.
  while (!impl_->server.is_running() && !impl_->listen_ended) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!o.port_file.empty()) {
    if (auto why = port_file_write(o.port_file, static_cast<unsigned>(port)); !why.empty()) {
      stop();
      return make_error(errc::io_error, "http: --http-port-file: " + why);
    }
  }
  return static_cast<std::uint16_t>(port);
}

void http_gateway::stop() {
  if (!impl_->thread.joinable()) return;
  impl_->server.stop();
  // Requests in flight get two seconds; then the connections whose request is still being
  // sent are shut down, so that a client sending a byte now and then cannot hold the stop.
  // Those being answered finish (the service's waits end at stop_waiting).
  const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!impl_->listen_ended && std::chrono::steady_clock::now() < grace) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  while (!impl_->listen_ended) {
    std::multiset<std::string> answering;
    {
      std::lock_guard lock(impl_->answering_mutex);
      answering = impl_->answering;
    }
    shut_unanswered(impl_->listen_address, answering);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  impl_->thread.join();
  port_file_clear(impl_->options.port_file);  // the port is no one's now
}

}  // namespace wsync
