#include "wsync/sources/safetensors.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <ctime>
#include <fstream>

namespace wsync {
namespace {

std::string write_file(const std::string& header, const std::string& data) {
  char path[] = "/tmp/wsync-safetensors-XXXXXX";
  int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream out(path, std::ios::binary);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

TEST(safetensors, reads_tensors_in_file_order_without_copying) {
  std::string data(16 + 6, '\0');
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i);
  auto path = write_file(R"({"__metadata__":{"format":"pt"},)"
                         R"("b.weight":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
                         R"("a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
                         data);
  auto f = safetensors_file::open(path);
  ASSERT_TRUE(f) << f.error().message;
  const auto& t = (*f)->tensors();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].name, "a.weight");
  EXPECT_EQ(t[0].dtype, dtype::f32);
  EXPECT_EQ(t[0].shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(t[0].nbytes, 16u);
  EXPECT_EQ(t[1].name, "b.weight");
  EXPECT_EQ(t[1].nbytes, 6u);
  EXPECT_EQ(std::memcmp(t[1].data, data.data() + 16, 6), 0);
  ::unlink(path.c_str());
}

// The mapping shows a rewrite as it happens (MAP_PRIVATE keeps only pages this process wrote):
// a publisher asks before and after each version whether the file is the one it mapped.
TEST(safetensors, a_file_rewritten_after_it_was_mapped_is_named_as_changed) {
  const std::string header = R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})";
  auto path = write_file(header, "abcdefgh");
  auto f = safetensors_file::open(path);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_TRUE((*f)->unchanged());
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);  // same size, in place
    io.seekp(static_cast<std::streamoff>(8 + header.size()));
    io << "ABCDEFGH";
  }
  // A rewrite within the same clock tick may keep the old mtime: set one that differs.
  struct timespec later[2] = {{0, UTIME_OMIT}, {::time(nullptr) + 5, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), later, 0), 0);
  auto changed = (*f)->unchanged();
  ASSERT_FALSE(changed);
  EXPECT_EQ(changed.error().code, errc::io_error);
  EXPECT_NE(changed.error().message.find("safetensors " + path + ": changed since the publisher"),
            std::string::npos)
      << changed.error().message;
  ::unlink(path.c_str());
  EXPECT_FALSE((*f)->unchanged());  // gone is not unchanged either
}

TEST(safetensors, a_path_that_is_not_a_regular_file_is_refused_without_blocking) {
  char dir[] = "/tmp/wsync-fifo-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string fifo = std::string(dir) + "/ckpt.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = safetensors_file::open(fifo);  // blocked for a writer before
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("not a regular file"), std::string::npos) << f.error().message;
  ::unlink(fifo.c_str());
  ::rmdir(dir);
}

TEST(safetensors, malformed_files_name_the_tensor_and_field) {
  auto path = write_file(R"({"x":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "z");
  auto f = safetensors_file::open(path);
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("tensor \"x\".dtype"), std::string::npos) << f.error().message;
  ::unlink(path.c_str());
  path = write_file(R"({"x":{"dtype":"U8","shape":[9],"data_offsets":[0,9]}})", "short");
  f = safetensors_file::open(path);
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("data_offsets"), std::string::npos);
  ::unlink(path.c_str());
  EXPECT_FALSE(safetensors_file::open("/nonexistent/file.safetensors"));
}

// A header nested a million deep parses without recursion, but quoting it in an error (dump)
// would not: refused at the parse, naming the depth.
TEST(safetensors, a_header_nested_too_deep_is_refused_not_a_crash) {
  const std::string deep = std::string(1000000, '[') + "1" + std::string(1000000, ']');
  auto path =
      write_file(R"({"x":{"dtype":)" + deep + R"(,"shape":[1],"data_offsets":[0,1]}})", "z");
  auto f = safetensors_file::open(path);
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("nests deeper than 64 levels"), std::string::npos)
      << f.error().message.substr(0, 200);
  ::unlink(path.c_str());
}

// The tensors must tile the data exactly, as the format requires, and name each tensor once.
TEST(safetensors, overlaps_holes_tails_and_repeated_names_are_refused) {
  auto refused = [](const std::string& header, const std::string& data, const std::string& why) {
    auto path = write_file(header, data);
    auto f = safetensors_file::open(path);
    ::unlink(path.c_str());
    ASSERT_FALSE(f) << header;
    EXPECT_NE(f.error().message.find(why), std::string::npos) << f.error().message;
  };
  refused(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
          R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
          std::string(12, 'x'),
          "tensor \"b\".data_offsets: starts at 4, where the tensors before "
          "it end at 8 (they overlap)");
  refused(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
          std::string(12, 'x'), "(a hole)");
  refused(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", std::string(6, 'x'),
          "data: 2 bytes after the last tensor belong to none");
  refused(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
          R"("a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
          std::string(8, 'x'), "tensor \"a\": named twice in the header");
  // Inside an entry the repeated key is not a tensor's name.
  refused(R"({"x":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})",
          std::string(4, 'x'), "key \"dtype\" given twice in one entry of the header (level 2)");
  // Not JSON: where it broke.
  refused(R"({"x":{"dtype":"F32",,}})", std::string(4, 'x'),
          "header is not valid JSON: [json.exception.parse_error.101] parse error at line 1, "
          "column 21: syntax error while parsing object key");
  // An empty tensor may sit anywhere, beside a full one at the same offset.
  auto path = write_file(R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                         R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                         std::string(6, 'x'));
  auto f = safetensors_file::open(path);
  ::unlink(path.c_str());
  ASSERT_TRUE(f) << f.error().message;
}

TEST(safetensors, a_shape_that_disagrees_with_the_bytes_is_refused) {
  // 4 bytes where [2, 2] of F32 needs 16: a reader would run past the tensor.
  auto path = write_file(R"({"x":{"dtype":"F32","shape":[2,2],"data_offsets":[0,4]}})", "abcd");
  auto f = safetensors_file::open(path);
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("tensor \"x\".data_offsets: 4 bytes, but shape [2,2] of F32 "
                                   "needs 16"),
            std::string::npos)
      << f.error().message;
  ::unlink(path.c_str());
  // Dimensions whose product overflows 64 bits.
  path = write_file(R"({"x":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
                    "abcd");
  f = safetensors_file::open(path);
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("needs more than 2^64"), std::string::npos) << f.error().message;
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace wsync
