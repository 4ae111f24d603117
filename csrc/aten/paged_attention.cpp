// The PyTorch side of paged attention (ops/paged_attention.cpp): its schema
// and meta kernel (the result is shaped as the query). Its tpu kernel is the
// boxed dispatcher's, as for every lowered op; the vLLM plugin
// (torch_tpu/vllm) calls it.
#include <torch/library.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

// The arguments are checked where the op is lowered (ops/paged_attention.cpp).
at::Tensor pagedAttentionMeta(const at::Tensor& query, const at::Tensor& /*kv_cache*/,
                              const at::Tensor& /*block_table*/, const at::Tensor& /*seq_lens*/,
                              const at::Tensor& /*query_start_loc*/, double /*scale*/, int64_t /*sliding_window*/,
                              double /*soft_cap*/) {
  return at::empty_like(query);
}

}  // namespace
}  // namespace tpu::aten

TORCH_LIBRARY_FRAGMENT(tpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int sliding_window=-1, float soft_cap=0.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(tpu, Meta, m) { m.impl("paged_attention", &tpu::aten::pagedAttentionMeta); }
