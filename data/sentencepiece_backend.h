// The SentencePiece library, kept in a link namespace of its own.
//
// Debian's libsentencepiece.so.0 (0.1.97) carries its own copy of protobuf-lite and exports
// its symbols: linked into a binary that also links libprotobuf (the runtime, the CLI), the
// two copies bind to each other and the process crashes while starting; RTLD_DEEPBIND does
// not help (the library then writes to libstdc++'s own, never constructed std::cerr). And its
// headers declare `namespace absl { using std::string_view; }`, which clashes with Debian's
// Abseil. So sentencepiece_backend.cc (no Abseil header) is a module of its own
// (rackrun_sentencepiece) that sentencepiece_library.cc loads at first use with
// dlmopen(LM_ID_NEWLM): the library, its libstdc++ and its libc live in a namespace apart.
// Nothing allocated on one side is freed on the other, so the module speaks C: callers pass
// buffers, the module hands out opaque handles. These are its entry points.
#ifndef RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_
#define RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_

#include <stddef.h>
#include <stdint.h>

extern "C" {

// A model from the bytes of a .model file; null with `error` (NUL-terminated, at most
// `error_cap` bytes) when the library refuses them. Freed with rackrun_spm_free.
typedef void* (*RackrunSpmLoad)(const char* model, size_t size, char* error, size_t error_cap);
typedef void (*RackrunSpmFree)(void* handle);
// pieces, bos, eos, pad, unk (-1: none) into out[0..4].
typedef void (*RackrunSpmInfo)(void* handle, int32_t* out);
// The ids of `text` into ids[0..cap): returns how many there are (more than `cap`: call
// again with room for them), or -1 with `error`. Thread-safe.
typedef int64_t (*RackrunSpmEncode)(void* handle, const char* text, size_t size, int32_t* ids,
                                    int64_t cap, char* error, size_t error_cap);
// The text of ids[0..n) into text[0..cap), the same way.
typedef int64_t (*RackrunSpmDecode)(void* handle, const int32_t* ids, int64_t n, char* text,
                                    int64_t cap, char* error, size_t error_cap);
// Trains a model with the library's flag string (no --input) over the sentences `next`
// gives (1: *text, *size hold one; 0: no more); returns the serialized model as a handle
// (copy it out with rackrun_spm_bytes, free it with rackrun_spm_free_bytes), or null with
// `error`.
typedef void* (*RackrunSpmTrain)(const char* args, size_t args_size,
                                 int (*next)(void* context, const char** text, size_t* size),
                                 void* context, char* error, size_t error_cap);
typedef int64_t (*RackrunSpmBytes)(void* model, char* out, int64_t cap);
typedef void (*RackrunSpmFreeBytes)(void* model);

}  // extern "C"

#endif  // RACKRUN_DATA_SENTENCEPIECE_BACKEND_H_
