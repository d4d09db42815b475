// `--name value` / `--name=value` flags for pdserve's binaries. Each lookup
// consumes its flag, so Check() can name the first flag nobody asked for, and
// the first unparsable number is remembered rather than aborting.
#pragma once

#include <map>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

class CommandLineFlags {
 public:
  // Parses argv[first..]: INVALID_ARGUMENT for a positional argument or a
  // trailing flag without a value.
  [[nodiscard]] absl::Status Parse(int argc, char** argv, int first = 1) {
    for (int i = first; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg.rfind("--", 0) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected argument '", arg, "'"));
      }
      arg = arg.substr(2);
      if (auto eq = arg.find('='); eq != std::string::npos) {
        flags_[arg.substr(0, eq)] = arg.substr(eq + 1);
      } else if (i + 1 < argc) {
        flags_[arg] = argv[++i];
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("flag --", arg, " needs a value"));
      }
    }
    return absl::OkStatus();
  }

  bool Has(const std::string& name) const { return flags_.count(name) != 0; }

  std::string Str(const std::string& name, const std::string& def) {
    auto it = flags_.find(name);
    if (it == flags_.end()) return def;
    std::string value = it->second;
    flags_.erase(it);
    return value;
  }

  template <typename T>
  T Num(const std::string& name, T def) {
    auto it = flags_.find(name);
    if (it == flags_.end()) return def;
    T value{};
    bool ok;
    if constexpr (std::is_floating_point_v<T>) {
      double parsed = 0;
      ok = absl::SimpleAtod(it->second, &parsed);
      value = static_cast<T>(parsed);
    } else {
      ok = absl::SimpleAtoi(it->second, &value);
    }
    if (!ok && error_.ok()) {
      error_ = absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", it->second, "' is not a number"));
    }
    flags_.erase(it);
    return value;
  }

  // The first bad number, or the first flag nobody asked for.
  [[nodiscard]] absl::Status Check() const {
    if (!error_.ok()) return error_;
    if (!flags_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", flags_.begin()->first));
    }
    return absl::OkStatus();
  }

 private:
  std::map<std::string, std::string> flags_;
  absl::Status error_;
};

}  // namespace pdserve
