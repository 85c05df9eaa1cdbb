// The bridge between std::string_view and absl::string_view. Debian 12's Abseil
// (20220623) is built with its own string_view type, not an alias of std::string_view, so
// code that hands a std::string_view to absl::StrCat or absl::StrSplit (or an Abseil view
// to a std:: API) converts it; these two functions are the one way to. No copy: the view
// keeps pointing at the caller's characters.
#ifndef RACKRUN_BASE_STRING_VIEW_H_
#define RACKRUN_BASE_STRING_VIEW_H_

#include <string_view>

#include "absl/strings/string_view.h"

namespace rackrun::base {

inline absl::string_view AsAbsl(std::string_view s) { return {s.data(), s.size()}; }
inline std::string_view AsStd(absl::string_view s) { return {s.data(), s.size()}; }

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_STRING_VIEW_H_
