#include "ucx/refusal.hpp"

#include <gtest/gtest.h>

namespace wsync::ucx_detail {
namespace {

// A refusal's code comes from the network: what a source sends passes, anything else (a number
// outside the codes, a "not an error" code) is an io_error rather than a retry or a success.
TEST(ucx_refusal, only_the_codes_a_source_sends_are_taken) {
  for (errc c : {errc::unknown_update, errc::invalid_argument, errc::checksum_mismatch,
                 errc::try_again, errc::timeout}) {
    EXPECT_EQ(refusal_code(static_cast<std::uint32_t>(c)), c);
  }
  EXPECT_EQ(refusal_code(static_cast<std::uint32_t>(errc::in_progress)), errc::io_error);
  EXPECT_EQ(refusal_code(99), errc::io_error);
  EXPECT_EQ(refusal_code(0xffffffffu), errc::io_error);
}

}  // namespace
}  // namespace wsync::ucx_detail
