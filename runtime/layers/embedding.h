// Token embedding: a [vocab x width] table; forward gathers rows, backward scatters.
#ifndef RACKRUN_RUNTIME_LAYERS_EMBEDDING_H_
#define RACKRUN_RUNTIME_LAYERS_EMBEDDING_H_

#include <cstdint>
#include <string>

#include "runtime/layers/parameter.h"

namespace rackrun::runtime {

template <typename T>
class Embedding {
 public:
  Embedding(int vocab, int width, const std::string& name);

  Parameter<T>& table() { return table_; }

  // out[t] = table[tokens[t]]. Token ids must already be checked against vocab.
  void Forward(const int32_t* tokens, int64_t count, T* out) const;
  // table.grad[tokens[t]] += dout[t]; each channel accumulates in token order.
  void Backward(const int32_t* tokens, int64_t count, const T* dout);

 private:
  int vocab_;
  int width_;
  Parameter<T> table_;
};

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_LAYERS_EMBEDDING_H_
