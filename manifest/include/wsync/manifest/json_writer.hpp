#pragma once
// JSON written straight into one string, for the texts on every update's path (the manifest,
// the coordinator's outcome): building a nlohmann document first cost milliseconds for a
// model's 290 tensors or a thousand ranks. Keys come out in the order written; text as
// nlohmann's dump() writes it (escapes, invalid UTF-8 replaced by U+FFFD), integers exactly,
// doubles in their shortest round-trip digits laid out as nlohmann lays them out (fixed from
// 1e-4 to 1e15, else with an exponent; ".0" on whole numbers, so a reader still sees a float;
// not finite: null).

#include <charconv>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace wsync {

class json_writer {
 public:
  explicit json_writer(std::size_t reserve = 256) { out_.reserve(reserve); }

  json_writer& key(std::string_view k) {
    separate();
    string(k);
    out_ += ':';
    fresh_ = true;  // the value that follows needs no comma
    return *this;
  }
  json_writer& text(std::string_view v) {
    separate();
    string(v);
    return *this;
  }
  template <class Int>
  json_writer& number(Int v) {
    separate();
    char buf[24];
    out_.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);  // 24 digits always fit
    return *this;
  }
  template <class Int>
  json_writer& numbers(const std::vector<Int>& vs) {
    open('[');
    for (auto v : vs) number(v);
    return close(']');
  }
  json_writer& real(double v);
  json_writer& boolean(bool v) {
    separate();
    out_ += v ? "true" : "false";
    return *this;
  }
  json_writer& open(char bracket) {
    separate();
    out_ += bracket;
    fresh_ = true;
    return *this;
  }
  json_writer& close(char bracket) {
    out_ += bracket;
    fresh_ = false;
    return *this;
  }
  std::string take() { return std::move(out_); }

 private:
  void string(std::string_view v);
  void separate() {
    if (!fresh_) out_ += ',';
    fresh_ = false;
  }

  std::string out_;
  bool fresh_ = true;
};

}  // namespace wsync
