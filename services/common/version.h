// pdserve's release version, reported by the router's GET /version and by
// every binary's --version-style output. Bumped by hand at a release.
#pragma once

namespace pdserve {

inline constexpr char kPdserveVersion[] = "0.5.0";

}  // namespace pdserve
