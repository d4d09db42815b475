// Debian's Abseil is built with ABSL_OPTION_USE_STD_STRING_VIEW=0, so
// absl::string_view is a distinct type: absl::StrCat and flat_hash_map's
// heterogeneous lookup do not accept std::string_view. This bridges the two
// without copying.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace pdserve::model {

inline absl::string_view ToAbsl(std::string_view text) {
  return absl::string_view(text.data(), text.size());
}

}  // namespace pdserve::model
