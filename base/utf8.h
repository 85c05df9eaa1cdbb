// UTF-8 well-formedness (RFC 3629; the Unicode standard's table 3-7): no overlong forms,
// no surrogates, nothing above U+10FFFF. Used where text enters: job specs, corpora.
#ifndef RACKRUN_BASE_UTF8_H_
#define RACKRUN_BASE_UTF8_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace rackrun::base {

// Length of the well-formed UTF-8 sequence that starts at text[i] (i < text.size()), or 0.
size_t Utf8SequenceAt(std::string_view text, size_t i);
// Offset of the first byte of `text` that is not part of a well-formed sequence, or npos.
size_t FirstInvalidUtf8(std::string_view text);
// `text` with every byte FirstInvalidUtf8 would stop at replaced by U+FFFD.
std::string ReplaceInvalidUtf8(std::string_view text);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_UTF8_H_
