// Kernels the CPU plugin runs as XLA FFI custom calls, for ops XLA:CPU
// compiles into slow code. Attention is the one: XLA:CPU runs a batched dot
// as one small GEMM per batch element (64 for a 4-head, 16-sequence batch),
// which made attention the largest cost of a small GPT step. Other plugins
// (TPU, GPU) keep the portable StableHLO lowering. No torch headers here.
#pragma once

#include <cstdint>
#include <functional>

#include "pjrt/pjrt.h"
#include "plugins/cpu/custom_calls.h"

namespace tpu::plugins::cpu {

// The custom-call targets and their operands: custom_calls.h.

// A host BLAS for the GEMM kernel: XLA:CPU's dots (Eigen's packing, then
// oneDNN's kernel) took 3.8 ms for the 27 products of a small GPT training
// step that MKL, as torch calls it, did in 2.8 ms. `sgemm` is the Fortran
// interface (column-major, 32-bit sizes); `set_threads_local` makes the
// calling thread's BLAS calls single-threaded and returns the previous
// setting (MKL's mkl_set_num_threads_local), since the kernel splits the
// product over XLA's own threads. No torch here: the CPU plugin's support
// finds MKL in the process (torch bundles it) when the runtime starts.
struct HostBlas {
  using Sgemm = void (*)(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                         const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                         const float* beta, float* c, const int* ldc);
  using SetThreadsLocal = int (*)(int);
  Sgemm sgemm = nullptr;
  SetThreadsLocal set_threads_local = nullptr;
  bool available() const { return sgemm && set_threads_local; }
};
void setHostBlas(const HostBlas& blas);
HostBlas hostBlas();

// XLA's intra-op thread pool, which runs the program that called a kernel,
// as the call's FFI API offers it (XLA_FFI_ThreadPool_Schedule and
// _NumThreads). Its workers spin between tasks while a program runs, so a
// helper scheduled there starts within microseconds. A HostPool worker has to
// be woken first: on this kind of VM that took hundreds of microseconds, and
// the woken worker often queued behind the caller on the caller's CPU while
// the other CPU idled (sched traces of the compiled GPT step).
struct XlaPool {
  const void* api = nullptr;  // the XLA_FFI_Api of the call
  void* ctx = nullptr;        // the call's XLA_FFI_ExecutionContext
  int64_t threads = 0;        // 0: the plugin's FFI has no thread pool
};
XlaPool xlaPoolOf(const void* ffi_api, void* ctx);

// fn(i) for every i in [0, n), spread over the calling thread and helpers
// scheduled on `pool` when it has two threads or more, else over the
// runtime's own HostPool. A helper refused by XLA, or one that starts after
// the caller has run every item, does nothing. Deterministic as long as
// fn(i) for different i write disjoint outputs.
void parallelFor(const XlaPool& pool, int64_t n, const std::function<void(int64_t)>& fn);

// Registers the kernels with a plugin whose platform is the host CPU. False
// when the plugin has no FFI extension, refuses the registration, or this
// CPU lacks AVX2/FMA: the lowerings then use their StableHLO form. The GEMM
// kernel is registered only when a host BLAS is set.
bool registerHostKernels(const pjrt::Api& api);

struct AttentionShape {
  int64_t batch = 0, heads = 0, L = 0, S = 0, E = 0;  // queries L, keys S, head width E
  // Row strides of q, k and v in elements (0: H*E, the [B, L, H, E] layout).
  // Results are always [B, L|S, H, E].
  int64_t q_row = 0, k_row = 0, v_row = 0;
  int64_t packedRow() const { return heads * E; }
  int64_t qRow() const { return q_row ? q_row : packedRow(); }
  int64_t kRow() const { return k_row ? k_row : packedRow(); }
  int64_t vRow() const { return v_row ? v_row : packedRow(); }
};

// The kernels themselves, on plain arrays (for the unit tests), in the
// layouts above.
void attentionForward(const float* q, const float* k, const float* v, float* out, float* lse, const AttentionShape& a,
                      float scale, bool causal);
void attentionBackward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                       const float* lse, float* dq, float* dk, float* dv, const AttentionShape& a, float scale,
                       bool causal);

void layerNormForward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int64_t M,
                      int64_t N, float eps);
// The optional terms of the GEMM kernel: c = alpha op(a) op(b) + beta bias.
struct GemmTerms {
  float alpha = 1.0f;
  const float* bias = nullptr;  // [N], added to every row
  float beta = 0.0f;
};
// c = op(a) op(b) (with `terms`) through the host BLAS (which must be set),
// in the row or column blocks the kernel uses with `threads` threads.
void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
          int64_t threads = 1, const GemmTerms& terms = {});

void layerNormBackward(const float* dy, const float* x, const float* mean, const float* rstd, const float* w, float* dx,
                       float* dw, float* db, int64_t M, int64_t N);

void softmaxForward(const float* x, float* y, int64_t M, int64_t N, bool log);

}  // namespace tpu::plugins::cpu
