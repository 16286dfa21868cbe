#include "wsync/manifest/json_writer.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

namespace wsync {
namespace {

using json = nlohmann::json;

// A double written by real() reads back as the same double, and as a float: a whole number
// keeps its ".0", so a reader never takes a duration for an integer.
void expect_real_round_trip(double v) {
  json_writer w;
  w.real(v);
  const auto text = w.take();
  auto back = json::parse(text);
  ASSERT_TRUE(back.is_number_float()) << text;
  EXPECT_EQ(back.get<double>(), v) << text;
}

TEST(json_writer, doubles_read_back_exactly_and_as_floats) {
  for (double v : {0.0, -0.0, 1.0, -2.0, 0.0123, 1e-05, 123456.789, 1e300, 5e-324, 0.1 + 0.2,
                   std::numeric_limits<double>::max(), 4503599627370496.0}) {
    SCOPED_TRACE(v);
    expect_real_round_trip(v);
  }
  json_writer w;
  w.open('[').real(std::nan("")).real(std::numeric_limits<double>::infinity()).close(']');
  EXPECT_EQ(w.take(), "[null,null]");  // as nlohmann writes what JSON cannot say
}

// The same text as nlohmann's dump() on the doubles a duration or a rate takes, and around
// the edges where the layout changes.
TEST(json_writer, doubles_are_laid_out_as_nlohmann_lays_them_out) {
  for (double v : {0.0, -0.0, 1.0, 0.0123, 0.0001, 0.00009999, 1e-05, 100000.0, 123456.789,
                   999999999999999.9, 1e15, 1e16, 2.5e-07, 0.001508391, 5e-324, 1e300}) {
    json_writer w;
    w.real(v);
    EXPECT_EQ(w.take(), json(v).dump()) << v;
  }
}

RC_GTEST_PROP(json_writer, any_double_reads_back_exactly, (double v)) {
  RC_PRE(std::isfinite(v));
  json_writer w;
  w.real(v);
  auto back = json::parse(w.take());
  RC_ASSERT(back.is_number_float());
  RC_ASSERT(back.get<double>() == v);
}

// Objects, arrays, booleans, integers and any bytes as text: what nlohmann reads back is what
// was written (text as nlohmann's dump() has it: escapes, invalid UTF-8 replaced).
RC_GTEST_PROP(json_writer, writes_what_a_json_reader_reads_back,
              (const std::string& a, const std::string& b, std::int64_t n, bool flag)) {
  json_writer w;
  w.open('{');
  w.key("a").text(a);
  w.key("list").open('[').number(n).boolean(flag).open('{').close('}').open('[').close(']');
  w.close(']');
  w.key("b").text(b);
  w.close('}');
  auto back = json::parse(w.take());
  auto same = [](const std::string& s) {
    return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace));
  };
  RC_ASSERT(back["a"] == same(a));
  RC_ASSERT(back["b"] == same(b));
  RC_ASSERT(back["list"] == json::array({n, flag, json::object(), json::array()}));
}

}  // namespace
}  // namespace wsync
