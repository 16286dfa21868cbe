#include "src/process.hpp"

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace wsync::detail {

std::uint64_t process_start_time(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 > text.size()) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  // After "pid (comm) " the state is field 3; starttime is field 22.
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return 0;  // exited, not yet reaped: dead
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(in, text);
    return text;
  }();
  return id;
}

std::uint64_t pid_namespace() {
  static const std::uint64_t inode = [] {
    struct stat st {};
    return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino)
                                                 : std::uint64_t{0};
  }();
  return inode;
}

}  // namespace wsync::detail
