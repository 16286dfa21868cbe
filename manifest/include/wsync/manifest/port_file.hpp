#pragma once
// The port file a listening wsync process writes for its launcher (--port-file,
// --http-port-file): what the coordinator and the HTTP gateway share.

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

namespace wsync {

/// Removes a port file an earlier run left, before listening: a launcher that finds one must
/// be reading this run's port, not connecting to a dead one (or to whoever took it since).
inline void port_file_clear(const std::string& path) {
  if (!path.empty()) std::remove(path.c_str());
}

/// Writes `port` to `path` under a temporary name and renames it, so a launcher never reads half
/// a number. Empty on success, else why not (the process should not run unseen: its launcher
/// would wait for the file for good).
inline std::string port_file_write(const std::string& path, unsigned port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    out.flush();
    if (!out) return "cannot write " + tmp + ": " + std::strerror(errno);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return "cannot rename " + tmp + " to " + path + ": " + why;
  }
  return {};
}

}  // namespace wsync
