#include "metrics/exposition.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "httplib.h"

namespace pdserve::metrics {

std::string Sample::Label(const std::string& key) const {
  auto it = labels.find(key);
  return it == labels.end() ? "" : it->second;
}

namespace {

bool ParseValue(absl::string_view text, double* out) {
  if (text == "NaN") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  if (text == "+Inf" || text == "Inf") {
    *out = std::numeric_limits<double>::infinity();
    return true;
  }
  if (text == "-Inf") {
    *out = -std::numeric_limits<double>::infinity();
    return true;
  }
  return absl::SimpleAtod(text, out);
}

absl::Status Bad(int line_no, absl::string_view line, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("exposition line ", line_no, " (", line, "): ", why));
}

}  // namespace

absl::StatusOr<std::vector<Sample>> ParseExposition(absl::string_view text) {
  std::vector<Sample> samples;
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line.front() == '#') continue;
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ' &&
           line[i] != '\t')
      ++i;
    s.name = std::string(line.substr(0, i));
    if (s.name.empty()) return Bad(line_no, line, "no metric name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (true) {
        while (i < line.size() && (line[i] == ' ' || line[i] == ',')) ++i;
        if (i >= line.size()) return Bad(line_no, line, "unterminated labels");
        if (line[i] == '}') {
          ++i;
          break;
        }
        const size_t eq = line.find('=', i);
        if (eq == absl::string_view::npos || eq + 1 >= line.size() ||
            line[eq + 1] != '"') {
          return Bad(line_no, line, "label without =\"value\"");
        }
        std::string key(absl::StripAsciiWhitespace(line.substr(i, eq - i)));
        std::string value;
        size_t j = eq + 2;
        bool closed = false;
        for (; j < line.size(); ++j) {
          const char c = line[j];
          if (c == '\\' && j + 1 < line.size()) {
            const char n = line[++j];
            value.push_back(n == 'n' ? '\n' : n);
          } else if (c == '"') {
            closed = true;
            break;
          } else {
            value.push_back(c);
          }
        }
        if (!closed) return Bad(line_no, line, "unterminated label value");
        s.labels[key] = std::move(value);
        i = j + 1;
      }
    }
    std::vector<absl::string_view> rest = absl::StrSplit(
        line.substr(i), absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (rest.empty()) return Bad(line_no, line, "no value");
    if (!ParseValue(rest[0], &s.value)) return Bad(line_no, line, "bad value");
    samples.push_back(std::move(s));
  }
  return samples;
}

absl::StatusOr<std::string> HttpGet(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos || url.substr(0, scheme) != "http") {
    return absl::InvalidArgumentError(
        absl::StrCat("'", url, "' is not an http:// URL"));
  }
  const size_t slash = url.find('/', scheme + 3);
  httplib::Client client(url.substr(0, slash));
  client.set_connection_timeout(5);
  client.set_read_timeout(10);
  auto res = client.Get(slash == std::string::npos ? "/" : url.substr(slash));
  if (!res) {
    return absl::UnavailableError(
        absl::StrCat("GET ", url, ": ", httplib::to_string(res.error())));
  }
  if (res->status != 200) {
    return absl::UnavailableError(
        absl::StrCat("GET ", url, ": HTTP ", res->status));
  }
  return std::move(res->body);
}

absl::StatusOr<std::vector<Sample>> Scrape(const std::string& url) {
  auto body = HttpGet(url);
  if (!body.ok()) return body.status();
  auto samples = ParseExposition(*body);
  if (!samples.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(url, ": ", samples.status().message()));
  }
  return samples;
}

}  // namespace pdserve::metrics
