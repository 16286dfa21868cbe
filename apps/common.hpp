#pragma once
// Flags and checks that several subcommands share.

#include <CLI/CLI.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "wsync/actors/node.hpp"

namespace wsync::cli {

/// "a, b, c".
std::string join(const std::vector<std::string>& items);

/// --NAME taking an integer count of milliseconds, from `min_ms` to `max_ms`, into `field`, which
/// keeps its value unless the flag (or the config file) sets it; the help shows that value as
/// the default. `field` must outlive the parse.
CLI::Option* add_milliseconds(CLI::App* cmd, const std::string& name,
                              std::chrono::milliseconds& field, const std::string& help,
                              std::int64_t min_ms = 1,
                              std::int64_t max_ms = std::int64_t{7} * 24 * 3600 * 1000);

/// --node (or $WSYNC_NODE) into `node`, by default this host's name, as the Python ranks name
/// their node: ranks of one host then share a node (its leader, its shared-memory peers) and
/// ranks of different hosts never do, without a flag.
void add_node(CLI::App* cmd, std::string& node, const std::string& help);

/// --token (or $WSYNC_TOKEN), never read from a config file.
void add_token(CLI::App* cmd, std::string& token);

/// --transport NAME and --transport-option KEY=VALUE (repeatable), e.g. ucx with tls=tcp.
void add_transport(CLI::App* cmd, std::string& transport, std::vector<std::string>& settings);

/// --tls-cert / --tls-key / --tls-ca on every subcommand that talks to the cluster.
void add_tls(CLI::App* cmd, tls_settings& tls);

/// KEY=VALUE strings -> transport options; false (with a message) on a malformed one.
bool transport_settings_from(const std::vector<std::string>& items, transport_options& out);

/// --coordinator host:port into `ep` (host and port only), or false after saying why.
bool coordinator_from(const std::string& text, endpoint& ep);

/// False after saying so when there is no cluster token.
bool need_token(const std::string& token);

/// Slurm names ranks its own way; maps it onto the variables the options read (RANK,
/// WORLD_SIZE, LOCAL_RANK), unless a launcher (torchrun, mpirun wrappers) already set them.
void launcher_environment();

}  // namespace wsync::cli
