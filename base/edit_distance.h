// The edit distance behind every "did you mean" of the project (unknown spec fields,
// unknown command-line flags).
#ifndef RACKRUN_BASE_EDIT_DISTANCE_H_
#define RACKRUN_BASE_EDIT_DISTANCE_H_

#include <cstddef>
#include <string_view>

namespace rackrun::base {

// Levenshtein distance: the fewest single-character insertions, deletions and
// substitutions that turn `a` into `b`. O(|a| * |b|) time, O(|b|) memory.
size_t EditDistance(std::string_view a, std::string_view b);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_EDIT_DISTANCE_H_
