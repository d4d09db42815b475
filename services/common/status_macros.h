// Status propagation helpers. Debian's Abseil (20220623) ships no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so pdserve defines its own once, here.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PDS_STATUS_CONCAT_INNER(a, b) a##b
#define PDS_STATUS_CONCAT(a, b) PDS_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status); returns it from the caller if not OK.
#define PDS_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status pds_status_ = (expr);       \
    if (!pds_status_.ok()) return pds_status_; \
  } while (0)

// `PDS_ASSIGN_OR_RETURN(auto x, MakeX());` declares/assigns lhs from a
// StatusOr, or returns its error from the caller.
#define PDS_ASSIGN_OR_RETURN(lhs, expr)                                      \
  PDS_ASSIGN_OR_RETURN_IMPL(PDS_STATUS_CONCAT(pds_statusor_, __LINE__), lhs, \
                            expr)

#define PDS_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr)     \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
