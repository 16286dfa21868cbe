#include "wsync/manifest/result.hpp"

namespace wsync {

std::string_view errc_name(errc code) {
  switch (code) {
    case errc::invalid_manifest:
      return "invalid_manifest";
    case errc::version_not_monotonic:
      return "version_not_monotonic";
    case errc::illegal_transition:
      return "illegal_transition";
    case errc::checksum_mismatch:
      return "checksum_mismatch";
    case errc::unknown_update:
      return "unknown_update";
    case errc::unknown_transport:
      return "unknown_transport";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::blocked:
      return "blocked";
    case errc::timeout:
      return "timeout";
    case errc::io_error:
      return "io_error";
    case errc::install_failed:
      return "install_failed";
    case errc::in_progress:
      return "in_progress";
    case errc::try_again:
      return "try_again";
  }
  return "unknown";
}

}  // namespace wsync
