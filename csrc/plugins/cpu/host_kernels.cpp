#include "plugins/cpu/host_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pjrt/xla_ffi.h"

namespace tpu::plugins::cpu {
using namespace xla_ffi;  // NOLINT(google-build-using-namespace): the FFI C structs
namespace {

// ------------------------------------------------------------- threads

// The pool for kernels called outside XLA (the unit tests) or from a plugin
// whose FFI has no thread pool: the calling thread and workers that sleep
// between loops.
class HostPool {
 public:
  static HostPool& get() {
    // Never destroyed: an XLA thread may still call a kernel while the
    // process exits.
    static HostPool* pool = new HostPool();
    return *pool;
  }
  // fn(i) for every i in [0, n), spread over the workers and the caller.
  void parallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> call(call_mu_);  // one parallel loop at a time
    if (workers_.empty() || n < 2) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      fn_ = &fn;
      n_ = n;
      next_ = 0;
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> g(mu_);
    done_.wait(g, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  HostPool() {
    unsigned n = std::thread::hardware_concurrency();
    for (unsigned i = 1; i < std::min(n, 8u); ++i) workers_.emplace_back([this] { loop(); });
  }
  void work() {
    for (int64_t i = next_++; i < n_; i = next_++) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> g(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace

XlaPool xlaPoolOf(const void* ffi_api, void* ctx) {
  XlaPool p;
  auto* api = static_cast<const FfiApi*>(ffi_api);
  if (!api || api->struct_size < offsetof(FfiApi, thread_pool_num_threads) + sizeof(void*) ||
      api->api_version.major_version != 0 || !api->thread_pool_schedule || !api->thread_pool_num_threads)
    return p;
  int64_t n = 0;
  FfiThreadPoolNumThreadsArgs a{sizeof(a), nullptr, ctx, &n};
  if (void* err = api->thread_pool_num_threads(&a)) {
    FfiErrorDestroyArgs d{sizeof(d), nullptr, err};
    api->error_destroy(&d);
    return p;
  }
  p.api = api;
  p.ctx = ctx;
  p.threads = n;
  return p;
}

namespace {

// One parallel loop shared by the caller and its helpers. A helper that
// starts after the last item was claimed touches only this object, which it
// co-owns, never the caller's (by then returned) function.
struct SharedLoop {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  const std::function<void(int64_t)>* fn = nullptr;
  std::mutex mu;
  std::condition_variable finished;  // signalled by whoever completes the last item

  void work() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*fn)(i);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        {
          std::lock_guard<std::mutex> g(mu);  // the caller is waiting or sees done == n
        }
        finished.notify_one();
      }
    }
  }
};

void runHelper(void* data) {
  std::unique_ptr<std::shared_ptr<SharedLoop>> loop(static_cast<std::shared_ptr<SharedLoop>*>(data));
  (*loop)->work();
}

}  // namespace

void parallelFor(const XlaPool& xla, int64_t n, const std::function<void(int64_t)>& fn) {
  if (xla.threads < 2 || n < 2) {
    if (xla.threads == 1 || n < 2) {
      for (int64_t i = 0; i < n; ++i) fn(i);
    } else {
      HostPool::get().parallelFor(n, fn);
    }
    return;
  }
  auto* api = static_cast<const FfiApi*>(xla.api);
  auto loop = std::make_shared<SharedLoop>();
  loop->n = n;
  loop->fn = &fn;
  for (int64_t h = 1; h < std::min(xla.threads, n); ++h) {
    auto data = std::make_unique<std::shared_ptr<SharedLoop>>(loop);
    FfiThreadPoolScheduleArgs a{sizeof(a), nullptr, xla.ctx, runHelper, data.get()};
    if (void* err = api->thread_pool_schedule(&a)) {
      FfiErrorDestroyArgs d{sizeof(d), nullptr, err};
      api->error_destroy(&d);
      break;
    }
    static_cast<void>(data.release());  // the task owns it now
  }
  loop->work();
  // Every item is claimed; the helpers' last ones take microseconds. Spin on
  // them a while, then block: yielding instead would hand this core to the
  // core spinners (SCHED_IDLE), and the kernel's scheduler lets a spinner
  // that gets the core after a yield keep it for a whole time slice
  // (milliseconds), while this program waits.
  auto finished = [&] { return loop->done.load(std::memory_order_acquire) >= n; };
  for (int spins = 0; spins < 4096 && !finished(); ++spins) __builtin_ia32_pause();
  if (!finished()) {
    std::unique_lock<std::mutex> l(loop->mu);
    loop->finished.wait(l, finished);
  }
}

namespace {

// ------------------------------------------------------------- kernels
// Eight-lane vector code for AVX2/FMA (the functions are only registered where
// the CPU has both). Per head, every product is a register-tiled loop (below);
// the softmax works a row at a time over whole blocks of 8 keys.
#define TPU_HOST_SIMD __attribute__((target("avx2,fma")))

// Scores are computed in blocks of 8 keys held in one vector register across
// the head width; rows are padded to whole blocks (SP = S rounded up to 8), so
// no loop has a scalar tail.
constexpr int64_t kBlock = 8;
int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
TPU_HOST_SIMD inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
TPU_HOST_SIMD inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

TPU_HOST_SIMD inline v8f splat8(float x) { return v8f{} + x; }
TPU_HOST_SIMD inline float lanesSum(v8f v) {
  float s = 0;
  for (int u = 0; u < kBlock; ++u) s += v[u];
  return s;
}

// The largest of x[0:n] (-inf for none); a NaN reaches the result through
// the exponentials, as in PyTorch's softmax.
TPU_HOST_SIMD float rowMax(const float* x, int64_t n) {
  v8f m = splat8(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    v8f v = load8(x + j);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int u = 1; u < kBlock; ++u) r = std::max(r, m[u]);
  for (; j < n; ++j) r = std::max(r, x[j]);
  return r;
}

// x's rows (R elements apart) zero-padded to SP -> xt [E, SP]: 8x8 blocks
// transposed in registers, the ragged edges element by element. (With the
// whole transpose as a scalar loop of strided stores, the GPT benchmark's
// attention took 5% longer, forward and backward, on one thread.)
TPU_HOST_SIMD inline void transpose8x8(const float* x, int64_t R, float* xt, int64_t SP) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(x + i * R);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(xt + i * SP, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(xt + (i + 4) * SP, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

TPU_HOST_SIMD void transposePadded(const float* __restrict__ x, float* __restrict__ xt, int64_t rows, int64_t SP,
                                   int64_t E, int64_t R) {
  const int64_t rows8 = rows / 8 * 8, E8 = E / 8 * 8;
  for (int64_t r = 0; r < rows8; r += 8)
    for (int64_t e = 0; e < E8; e += 8) transpose8x8(x + r * R + e, R, xt + e * SP + r, SP);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = r < rows8 ? E8 : 0; e < E; ++e) xt[e * SP + r] = x[r * R + e];
  for (int64_t e = 0; e < E; ++e) std::fill(xt + e * SP + rows, xt + (e + 1) * SP, 0.0f);
}

// e^x for x <= 0 on eight lanes, to within about 2 ulp: Cody-Waite reduction
// by ln 2 and a degree-6 polynomial; x below -87 gives e^-87 (~1e-38).
TPU_HOST_SIMD inline v8f exp8(v8f x) {
  const v8f lo = v8f{} - 87.0f;
  x = x < lo ? lo : x;
  const v8f round_magic = v8f{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v8f n = (x * 1.44269504f + round_magic) - round_magic;
  v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8f p =
      1.0f +
      r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f + r * (8.33333333e-3f + r * 1.38888889e-3f)))));
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return p * (v8f)bits;  // a vector cast reinterprets the bits
}

// s[j] = e^(s[j] - shift) for j < n and 0 for n <= j < 8 nb; returns the sum.
TPU_HOST_SIMD float expRow(float* __restrict__ s, int64_t n, int64_t nb, float shift) {
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8f sh = splat8(shift);
  v8f sum{};
  for (int64_t b = 0; b < nb; ++b) {
    v8f x = exp8(load8(s + b * kBlock) - sh);
    if ((b + 1) * kBlock > n) x = (lane + static_cast<int32_t>(b * kBlock)) < static_cast<int32_t>(n) ? x : v8f{};
    sum += x;
    store8(s + b * kBlock, x);
  }
  return lanesSum(sum);
}

// Per-thread scratch for one head's operands: reused across heads and calls,
// so a head costs no allocation and no zeroing beyond what it reads.
float* scratch(int slot, size_t n) {
  thread_local std::vector<float> buf[4];
  if (buf[slot].size() < n) buf[slot].resize(n);
  return buf[slot].data();
}

// Keys visible from query row i: all, or j <= i (PyTorch's top-left causal mask).
int64_t visible(int64_t i, int64_t S, bool causal) { return causal ? std::min(i + 1, S) : S; }

// ------------------------------------------------------------- tiled products
// Every product of attention, forward and backward, is C = alpha * A B with
// B's rows contiguous and a multiple of 8 wide: a register tile of up to 4
// rows of C by 16 columns keeps 8 independent FMA chains, and each step loads
// one row of B per 8 columns and broadcasts one element of A per row, so the
// loop is FMA-bound rather than load-bound (about 2x the row-at-a-time loops
// it replaced). A is read through strides, so a transposed operand (P^T in
// dV = P^T dO) costs nothing.
struct Strided {
  const float* p;
  int64_t rs, cs;  // element (r, k) at p[r * rs + k * cs]
};

template <int MR, int NR>
TPU_HOST_SIMD void productTile(Strided A, const float* __restrict__ B, int64_t brs, float* __restrict__ C, int64_t crs,
                               int64_t k0, int64_t k1, float alpha) {
  v8f acc[MR][NR] = {};
  for (int64_t k = k0; k < k1; ++k) {
    v8f b[NR];
#pragma GCC unroll 2
    for (int c = 0; c < NR; ++c) b[c] = load8(B + k * brs + c * kBlock);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float a = A.p[r * A.rs + k * A.cs];
#pragma GCC unroll 2
      for (int c = 0; c < NR; ++c) acc[r][c] += a * b[c];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NR; ++c) store8(C + r * crs + c * kBlock, acc[r][c] * alpha);
}

template <int MR>
TPU_HOST_SIMD void productRows(Strided A, const float* B, int64_t brs, float* C, int64_t crs, int64_t N, int64_t k0,
                               int64_t k1, float alpha) {
  int64_t c = 0;
  for (; c + 2 * kBlock <= N; c += 2 * kBlock) productTile<MR, 2>(A, B + c, brs, C + c, crs, k0, k1, alpha);
  if (c < N) productTile<MR, 1>(A, B + c, brs, C + c, crs, k0, k1, alpha);
}

// C[M, cols] = alpha * A[M, k0:k1] B[k0:k1, cols] for each tile of up to 4
// rows starting at i, where span(i, rows) gives {cols, k0, k1} (cols a
// multiple of 8): the causal mask shrinks both with the tile's position.
template <typename Span>
TPU_HOST_SIMD void product(int64_t M, Strided A, const float* B, int64_t brs, float* C, int64_t crs, float alpha,
                           Span span) {
  for (int64_t i = 0; i < M; i += 4) {
    const int64_t rows = std::min<int64_t>(4, M - i);
    auto [cols, k0, k1] = span(i, rows);
    Strided Ai{A.p + i * A.rs, A.rs, A.cs};
    float* Ci = C + i * crs;
    switch (rows) {
      case 4:
        productRows<4>(Ai, B, brs, Ci, crs, cols, k0, k1, alpha);
        break;
      case 3:
        productRows<3>(Ai, B, brs, Ci, crs, cols, k0, k1, alpha);
        break;
      case 2:
        productRows<2>(Ai, B, brs, Ci, crs, cols, k0, k1, alpha);
        break;
      default:
        productRows<1>(Ai, B, brs, Ci, crs, cols, k0, k1, alpha);
        break;
    }
  }
}

struct ProductSpan {
  int64_t cols, k0, k1;
};

// One head's operands: rows R elements apart in the sequence-major layout, or,
// when the head width is not a multiple of 8, zero-padded copies EP wide (the
// tiles need whole vectors of columns); results are copied back.
struct HeadRows {
  const float* p;
  int64_t stride;
  std::vector<float> copy;
  HeadRows(const float* x, int64_t rows, int64_t E, int64_t R, int64_t EP) : p(x), stride(R) {
    if (E == EP) return;
    copy.assign(rows * EP, 0.0f);
    for (int64_t r = 0; r < rows; ++r) std::copy(x + r * R, x + r * R + E, copy.data() + r * EP);
    p = copy.data();
    stride = EP;
  }
};
struct HeadOut {
  float* dst;
  int64_t rows, E, R;
  float* p;
  int64_t stride;
  std::vector<float> copy;
  HeadOut(float* x, int64_t rows_, int64_t E_, int64_t R_, int64_t EP)
      : dst(x), rows(rows_), E(E_), R(R_), p(x), stride(R_) {
    if (E == EP) return;
    copy.assign(rows * EP, 0.0f);
    p = copy.data();
    stride = EP;
  }
  void flush() {
    if (copy.empty()) return;
    for (int64_t r = 0; r < rows; ++r) std::copy(p + r * stride, p + r * stride + E, dst + r * R);
  }
};

// Keys a tile of query rows [i, i + rows) reads, rounded up to whole blocks.
int64_t tileKeys(int64_t i, int64_t rows, int64_t S, bool causal) {
  return blocks(visible(i + rows - 1, S, causal)) * kBlock;
}

// The same for the 4-row tile of L query rows that holds row i: the columns a
// score product wrote in row i.
int64_t rowTileKeys(int64_t i, int64_t L, int64_t S, bool causal) {
  const int64_t first = i - i % 4;
  return tileKeys(first, std::min<int64_t>(4, L - first), S, causal);
}

// Spans of the two product shapes over query-row tiles. Scores (Q K^T, dO V^T):
// the tile's keys as columns, over the head width E. Sums over keys (P V, dS K):
// the padded head width EP as columns, over the tile's keys that exist.
auto scoreSpan(int64_t S, int64_t E, bool causal) {
  return [=](int64_t i, int64_t rows) { return ProductSpan{tileKeys(i, rows, S, causal), 0, E}; };
}
auto keySumSpan(int64_t S, int64_t EP, bool causal) {
  return [=](int64_t i, int64_t rows) { return ProductSpan{EP, 0, std::min(S, tileKeys(i, rows, S, causal))}; };
}

// P = softmax(scale * Q K^T) for one head into p ([L, SP]); row i's entries
// past its visible keys are 0. With lse, P is exp(s - lse) (the backward);
// without, each row is normalised and its logsumexp written to lse_out.
TPU_HOST_SIMD void headProbabilities(const float* Q, int64_t R, const float* kt, float* p, int64_t L, int64_t S,
                                     int64_t SP, int64_t E, float scale, bool causal, const float* lse,
                                     float* lse_out) {
  product(L, Strided{Q, R, 1}, kt, SP, p, SP, scale, scoreSpan(S, E, causal));
  for (int64_t i = 0; i < L; ++i) {
    float* row = p + i * SP;
    const int64_t n = visible(i, S, causal), cols = rowTileKeys(i, L, S, causal);
    if (lse) {
      expRow(row, n, cols / kBlock, lse[i]);
    } else {
      const float m = rowMax(row, n);
      const float l = expRow(row, n, cols / kBlock, m);
      const v8f inv = splat8(1.0f / l);
      for (int64_t j = 0; j < cols; j += kBlock) store8(row + j, load8(row + j) * inv);
      lse_out[i] = m + std::log(l);
    }
    std::fill(row + cols, row + SP, 0.0f);
  }
}

// Elements between one head's consecutive rows in each array (the
// sequence-major layout interleaves the heads; q, k and v may sit in a wider
// packed projection). `o` is the results' and the output gradient's.
struct RowStrides {
  int64_t q, k, v, o;
  int64_t g = o;  // the gradients' (dq, dk, dv): o, or a packed buffer's row
};

// One head, its rows `r` apart.
TPU_HOST_SIMD void forwardHead(const float* Q, const float* K, const float* V, float* O, float* LSE, int64_t L,
                               int64_t S, int64_t E, const RowStrides& r, float scale, bool causal) {
  const int64_t SP = blocks(S) * kBlock, EP = blocks(E) * kBlock;
  float* kt = scratch(0, E * SP);
  float* p = scratch(1, L * SP);
  transposePadded(K, kt, S, SP, E, r.k);
  headProbabilities(Q, r.q, kt, p, L, S, SP, E, scale, causal, nullptr, LSE);
  HeadRows v(V, S, E, r.v, EP);
  HeadOut o(O, L, E, r.o, EP);
  product(L, Strided{p, SP, 1}, v.p, v.stride, o.p, o.stride, 1.0f, keySumSpan(S, EP, causal));
  o.flush();
}

// dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) * scale,
// dQ = dS K, dK = dS^T Q, each a tiled product over the head; under the
// causal mask a key tile starting at j reads query rows i >= j only.
TPU_HOST_SIMD void backwardHead(const float* dO, const float* Q, const float* K, const float* V, const float* O,
                                const float* LSE, float* dQ, float* dK, float* dV, int64_t L, int64_t S, int64_t E,
                                const RowStrides& r, float scale, bool causal) {
  const int64_t SP = blocks(S) * kBlock, EP = blocks(E) * kBlock, R = r.o;
  float *kt = scratch(0, E * SP), *vt = scratch(1, E * SP), *P = scratch(2, L * SP), *dS = scratch(3, L * SP);
  transposePadded(K, kt, S, SP, E, r.k);
  transposePadded(V, vt, S, SP, E, r.v);
  headProbabilities(Q, r.q, kt, P, L, S, SP, E, scale, causal, LSE, nullptr);
  product(L, Strided{dO, R, 1}, vt, SP, dS, SP, 1.0f, scoreSpan(S, E, causal));  // dP
  for (int64_t i = 0; i < L; ++i) {
    v8f dot{};  // dO_i . O_i
    int64_t e = 0;
    for (; e + kBlock <= E; e += kBlock) dot += load8(dO + i * R + e) * load8(O + i * R + e);
    float delta = lanesSum(dot);
    for (; e < E; ++e) delta += dO[i * R + e] * O[i * R + e];
    float* ds = dS + i * SP;
    const float* p = P + i * SP;
    const int64_t cols = rowTileKeys(i, L, S, causal);
    const v8f d = splat8(delta), sc = splat8(scale);
    for (int64_t j = 0; j < cols; j += kBlock) store8(ds + j, load8(p + j) * (load8(ds + j) - d) * sc);
    std::fill(ds + cols, ds + SP, 0.0f);  // as P is
  }
  HeadRows k(K, S, E, r.k, EP), q(Q, L, E, r.q, EP), dout(dO, L, E, R, EP);
  HeadOut dq(dQ, L, E, r.g, EP), dk(dK, S, E, r.g, EP), dv(dV, S, E, r.g, EP);
  product(L, Strided{dS, SP, 1}, k.p, k.stride, dq.p, dq.stride, 1.0f, keySumSpan(S, EP, causal));
  auto keyTile = [&](int64_t j, int64_t) { return ProductSpan{EP, causal ? std::min(j, L) : 0, L}; };
  product(S, Strided{P, 1, SP}, dout.p, dout.stride, dv.p, dv.stride, 1.0f, keyTile);
  product(S, Strided{dS, 1, SP}, q.p, q.stride, dk.p, dk.stride, 1.0f, keyTile);
  dq.flush();
  dk.flush();
  dv.flush();
}

// Layer norm over rows of n, eight lanes at a time: two passes over each row
// for the moments (as exact as the CPU's two-pass form), then the affine
// output; the backward forms the two row sums of the input gradient in one
// pass and accumulates the weight and bias gradients.
TPU_HOST_SIMD void layerNormRow(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                float* __restrict__ y, float* mean, float* rstd, int64_t n, float eps) {
  const int64_t nv = n / kBlock * kBlock, n4 = n / (4 * kBlock) * (4 * kBlock);
  // Four accumulators: one would make each row a chain of dependent adds.
  v8f a0{}, a1{}, a2{}, a3{};
  int64_t j = 0;
  for (; j < n4; j += 4 * kBlock) {
    a0 += load8(x + j);
    a1 += load8(x + j + kBlock);
    a2 += load8(x + j + 2 * kBlock);
    a3 += load8(x + j + 3 * kBlock);
  }
  for (; j < nv; j += kBlock) a0 += load8(x + j);
  float sum = lanesSum((a0 + a1) + (a2 + a3));
  for (j = nv; j < n; ++j) sum += x[j];
  const float m = sum / static_cast<float>(n);
  a0 = a1 = a2 = a3 = v8f{};
  for (j = 0; j < n4; j += 4 * kBlock) {
    v8f d0 = load8(x + j) - m, d1 = load8(x + j + kBlock) - m;
    v8f d2 = load8(x + j + 2 * kBlock) - m, d3 = load8(x + j + 3 * kBlock) - m;
    a0 += d0 * d0;
    a1 += d1 * d1;
    a2 += d2 * d2;
    a3 += d3 * d3;
  }
  for (; j < nv; j += kBlock) {
    v8f d = load8(x + j) - m;
    a0 += d * d;
  }
  float var = lanesSum((a0 + a1) + (a2 + a3));
  for (j = nv; j < n; ++j) var += (x[j] - m) * (x[j] - m);
  const float r = 1.0f / std::sqrt(var / static_cast<float>(n) + eps);
  for (j = 0; j < nv; j += kBlock) store8(y + j, (load8(x + j) - m) * r * load8(w + j) + load8(b + j));
  for (; j < n; ++j) y[j] = (x[j] - m) * r * w[j] + b[j];
  *mean = m;
  *rstd = r;
}

TPU_HOST_SIMD void layerNormBackwardRow(const float* __restrict__ dy, const float* __restrict__ x, float mean,
                                        float rstd, const float* __restrict__ w, float* __restrict__ dx,
                                        float* __restrict__ dw, float* __restrict__ db, int64_t n) {
  const int64_t nv = n / kBlock * kBlock;
  v8f s1{}, s2{};
  for (int64_t j = 0; j < nv; j += kBlock) {
    v8f g = load8(dy + j) * load8(w + j);
    s1 += g;
    s2 += g * ((load8(x + j) - mean) * rstd);
  }
  float a = lanesSum(s1), c = lanesSum(s2);
  for (int64_t j = nv; j < n; ++j) {
    float g = dy[j] * w[j];
    a += g;
    c += g * ((x[j] - mean) * rstd);
  }
  a /= static_cast<float>(n);
  c /= static_cast<float>(n);
  for (int64_t j = 0; j < nv; j += kBlock) {
    v8f g = load8(dy + j), xh = (load8(x + j) - mean) * rstd;
    store8(dx + j, rstd * (g * load8(w + j) - a - xh * c));
    store8(dw + j, load8(dw + j) + g * xh);
    store8(db + j, load8(db + j) + g);
  }
  for (int64_t j = nv; j < n; ++j) {
    float xh = (x[j] - mean) * rstd;
    dx[j] = rstd * (dy[j] * w[j] - a - xh * c);
    dw[j] += dy[j] * xh;
    db[j] += dy[j];
  }
}

// Softmax or log-softmax of one row, in the lowering's formula (ops/nn.cpp):
// shifted by the row's max. A row whose max is infinite takes the scalar loop
// and comes out NaN, as in PyTorch.
void softmaxRowScalar(const float* x, float* y, int64_t n, bool log, float m) {
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += std::exp(x[j] - m);
  const float ls = std::log(s);
  for (int64_t j = 0; j < n; ++j) y[j] = log ? (x[j] - m) - ls : std::exp(x[j] - m) / s;
}

TPU_HOST_SIMD void softmaxRow(const float* __restrict__ x, float* __restrict__ y, int64_t n, bool log) {
  const float m = rowMax(x, n);
  if (!std::isfinite(m)) return softmaxRowScalar(x, y, n, log, m);
  const int64_t nv = n / kBlock * kBlock;
  const v8f mv = splat8(m);
  v8f s0{}, s1{};
  int64_t j = 0;
  if (log) {
    // Two accumulators: the exponentials are independent, the sum is not.
    for (; j + 2 * kBlock <= nv; j += 2 * kBlock) {
      s0 += exp8(load8(x + j) - mv);
      s1 += exp8(load8(x + j + kBlock) - mv);
    }
    for (; j < nv; j += kBlock) s0 += exp8(load8(x + j) - mv);
    float s = lanesSum(s0 + s1);
    for (; j < n; ++j) s += std::exp(x[j] - m);
    const float ls = std::log(s);
    const v8f lv = splat8(ls);
    for (j = 0; j < nv; j += kBlock) store8(y + j, (load8(x + j) - mv) - lv);
    for (; j < n; ++j) y[j] = (x[j] - m) - ls;
    return;
  }
  for (; j < nv; j += kBlock) {
    const v8f e = exp8(load8(x + j) - mv);
    s0 += e;
    store8(y + j, e);
  }
  float s = lanesSum(s0);
  for (; j < n; ++j) {
    y[j] = std::exp(x[j] - m);
    s += y[j];
  }
  const v8f sv = splat8(s);
  for (j = 0; j < nv; j += kBlock) store8(y + j, load8(y + j) / sv);
  for (; j < n; ++j) y[j] /= s;
}

// ------------------------------------------------------------- handlers

// The kernels over XLA's pool (defined below, after the handlers).
void attentionForwardOn(const XlaPool& pool, const float* q, const float* k, const float* v, float* out, float* lse,
                        const AttentionShape& a, float scale, bool causal);
void attentionBackwardOn(const XlaPool& pool, const float* dout, const float* q, const float* k, const float* v,
                         const float* out, const float* lse, float* dq, float* dk, float* dv, const AttentionShape& a,
                         float scale, bool causal, int64_t grad_row = 0);
void layerNormForwardOn(const XlaPool& pool, const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t M, int64_t N, float eps);
void layerNormBackwardOn(const XlaPool& pool, const float* dy, const float* x, const float* mean, const float* rstd,
                         const float* w, float* dx, float* dw, float* db, int64_t M, int64_t N);
void gemmOn(const XlaPool& pool, int64_t threads, const HostBlas& blas, const float* a, const float* b, float* c,
            int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, const GemmTerms& terms);
void softmaxForwardOn(const XlaPool& pool, const float* x, float* y, int64_t M, int64_t N, bool log);

void* ffiError(const FfiCallFrame* f, const std::string& msg) {
  auto* api = static_cast<const FfiApi*>(f->api);
  FfiErrorCreateArgs a{sizeof(FfiErrorCreateArgs), nullptr, msg.c_str(), kErrorInvalidArgument};
  return api->error_create(&a);
}

// Answers XLA's metadata query (the FFI version these layouts follow); true
// when the call was one.
bool metadataQuery(FfiCallFrame* f) {
  for (FfiExtensionBase* e = f->extension_start; e; e = e->next) {
    if (e->type != kFfiExtensionMetadata) continue;
    FfiMetadata* md = reinterpret_cast<FfiMetadataExtension*>(e)->metadata;
    md->api_version.major_version = 0;
    md->api_version.minor_version = kFfiApiMinor;
    md->traits = 0;
    return true;
  }
  return false;
}

FfiBuffer* item(const FfiList& l, int i) { return static_cast<FfiBuffer*>(l.items[i]); }
const float* f32(const FfiList& l, int i) { return static_cast<const float*>(item(l, i)->data); }
float* f32Out(const FfiList& l, int i) { return static_cast<float*>(item(l, i)->data); }

struct AttentionCall {
  AttentionShape shape;
  int64_t q_offset = 0, k_offset = 0, v_offset = 0;
  float scale = 1.0f;
  bool causal = false;
};

int64_t numel(const FfiBuffer* b) {
  int64_t n = 1;
  for (int64_t i = 0; i < b->rank; ++i) n *= b->dims[i];
  return n;
}

// Reads an attention call (the operand and result counts already checked):
// the float32 buffers; B, L, H, E from `like` (the output or its gradient, [B, L, H, E]);
// S and where q, k and v lie from the layout operand, each checked to lie
// inside its buffer; then the scale and the int32 causal flag. `qkv` is the
// index of the q operand. Returns an error message, or "" when `c` is set.
std::string readCall(const FfiCallFrame* f, int n_args, int qkv, const FfiBuffer* like, AttentionCall* c) {
  const int layout_arg = n_args - 3;
  for (int i = 0; i < n_args - 1; ++i)
    if (i != layout_arg && item(f->args, i)->dtype != kDTypeF32)
      return "operand " + std::to_string(i) + " is not float32";
  const FfiBuffer* layout = item(f->args, layout_arg);
  if (layout->dtype != kDTypeS64 || layout->rank != 1 || layout->dims[0] != 7) return "the layout is not int64 [7]";
  if (item(f->args, n_args - 1)->dtype != kDTypeS32) return "the causal flag is not int32";
  if (like->rank != 4) return "the output is not 4-d";
  const auto* l = static_cast<const int64_t*>(layout->data);
  AttentionShape& a = c->shape;
  a.batch = like->dims[0];
  a.L = like->dims[1];
  a.heads = like->dims[2];
  a.E = like->dims[3];
  a.S = l[0];
  a.q_row = l[2];
  a.k_row = l[4];
  a.v_row = l[6];
  c->q_offset = l[1];
  c->k_offset = l[3];
  c->v_offset = l[5];
  const int64_t rows[3] = {a.L, a.S, a.S}, offsets[3] = {l[1], l[3], l[5]}, strides[3] = {l[2], l[4], l[6]};
  for (int i = 0; i < 3; ++i) {
    const int64_t n = a.batch * rows[i];
    if (a.S < 0 || offsets[i] < 0 || strides[i] < a.packedRow() ||
        (n > 0 && offsets[i] + (n - 1) * strides[i] + a.packedRow() > numel(item(f->args, qkv + i))))
      return std::string("the ") + "qkv"[i] + " layout does not fit its buffer";
  }
  const int64_t q_size = a.batch * a.L * a.packedRow(), kv_size = a.batch * a.S * a.packedRow(),
                lse_size = a.batch * a.heads * a.L;
  const bool packed_grads = qkv == 1 && f->rets.size == 1;
  const bool sized =
      qkv == 0 ? numel(item(f->rets, 1)) == lse_size
               : numel(item(f->args, 4)) == q_size && numel(item(f->args, 5)) == lse_size &&
                     (packed_grads || (numel(item(f->rets, 0)) == q_size && numel(item(f->rets, 1)) == kv_size &&
                                       numel(item(f->rets, 2)) == kv_size));
  if (!sized) return "the output, logsumexp or gradient sizes do not match";
  if (packed_grads) {
    // One result for the three gradients: q, k and v must be one buffer's
    // rows, tiled exactly by the three (so every element is written).
    const int64_t n = a.packedRow(), row = a.q_row;
    std::array<int64_t, 3> offs{c->q_offset, c->k_offset, c->v_offset};
    std::sort(offs.begin(), offs.end());
    const bool tiled =
        item(f->args, 1)->data == item(f->args, 2)->data && item(f->args, 1)->data == item(f->args, 3)->data &&
        a.k_row == row && a.v_row == row && row == 3 * n && a.L == a.S && offs == std::array<int64_t, 3>{0, n, 2 * n} &&
        numel(item(f->rets, 0)) == numel(item(f->args, 1)) && numel(item(f->rets, 0)) == a.batch * a.L * row;
    if (!tiled) return "packed gradients need q, k and v to tile one buffer's rows";
  }
  c->scale = *f32(f->args, n_args - 2);
  c->causal = *static_cast<const int32_t*>(item(f->args, n_args - 1)->data) != 0;
  return "";
}

// The shared part of both handlers: the metadata query and other stages
// return at once; a call that does not read as attention is an FFI error
// naming `target`; otherwise `run` computes.
void* handleAttention(FfiCallFrame* f, const char* target, int n_args, int n_rets, int qkv,
                      void (*run)(const FfiList& a, const FfiList& r, const AttentionCall& c, const XlaPool& pool)) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  AttentionCall c;
  if (f->args.size != n_args || f->rets.size != n_rets)
    return ffiError(f, std::string(target) + ": wrong number of operands or results");
  const FfiBuffer* like = qkv == 0 ? item(f->rets, 0) : item(f->args, 0);
  std::string err = readCall(f, n_args, qkv, like, &c);
  if (!err.empty()) return ffiError(f, std::string(target) + ": " + err);
  run(f->args, f->rets, c, xlaPoolOf(f->api, f->ctx));
  return nullptr;
}

void* attentionForwardHandler(FfiCallFrame* f) {
  return handleAttention(f, kAttentionForward, 6, 2, 0,
                         [](const FfiList& a, const FfiList& r, const AttentionCall& c, const XlaPool& pool) {
                           attentionForwardOn(pool, f32(a, 0) + c.q_offset, f32(a, 1) + c.k_offset,
                                              f32(a, 2) + c.v_offset, f32Out(r, 0), f32Out(r, 1), c.shape, c.scale,
                                              c.causal);
                         });
}

// Three results (dq, dk, dv), or one: the gradients laid out as q, k and v
// lie in their shared buffer (a fused qkv projection's output), so that a
// program concatenating them for the projection's backward writes nothing twice.
void* attentionBackwardHandler(FfiCallFrame* f) {
  return handleAttention(f, kAttentionBackward, 9, f->rets.size == 1 ? 1 : 3, 1,
                         [](const FfiList& a, const FfiList& r, const AttentionCall& c, const XlaPool& pool) {
                           const bool packed = r.size == 1;
                           float* g = f32Out(r, 0);
                           attentionBackwardOn(pool, f32(a, 0), f32(a, 1) + c.q_offset, f32(a, 2) + c.k_offset,
                                               f32(a, 3) + c.v_offset, f32(a, 4), f32(a, 5),
                                               packed ? g + c.q_offset : g, packed ? g + c.k_offset : f32Out(r, 1),
                                               packed ? g + c.v_offset : f32Out(r, 2), c.shape, c.scale, c.causal,
                                               packed ? c.shape.q_row : 0);
                         });
}

// layer norm forward:  x [M, N], w [N], b [N], eps [] -> y [M, N], mean [M], rstd [M]
// layer norm backward: dy [M, N], x [M, N], mean [M], rstd [M], w [N] -> dx [M, N], dw [N], db [N]
std::string readLayerNorm(const FfiCallFrame* f, int n_args, int n_rets, int64_t* M, int64_t* N) {
  if (f->args.size != n_args || f->rets.size != n_rets) return "wrong number of operands or results";
  for (int i = 0; i < n_args; ++i)
    if (item(f->args, i)->dtype != kDTypeF32) return "operand " + std::to_string(i) + " is not float32";
  const FfiBuffer* x = item(f->args, n_args == 4 ? 0 : 1);
  if (x->rank != 2) return "the input is not 2-d";
  *M = x->dims[0];
  *N = x->dims[1];
  const FfiBuffer* w = item(f->args, n_args == 4 ? 1 : 4);
  if (w->rank != 1 || w->dims[0] != *N) return "the weight does not match the rows";
  return "";
}

// The shared part of both handlers, as handleAttention: the metadata query,
// other stages, and a call that does not read as layer norm (an FFI error
// naming `target`); otherwise `run` computes.
void* handleLayerNorm(FfiCallFrame* f, const char* target, int n_args,
                      void (*run)(const FfiList& a, const FfiList& r, int64_t M, int64_t N, const XlaPool& pool)) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  int64_t M = 0, N = 0;
  std::string err = readLayerNorm(f, n_args, 3, &M, &N);
  if (!err.empty()) return ffiError(f, std::string(target) + ": " + err);
  run(f->args, f->rets, M, N, xlaPoolOf(f->api, f->ctx));
  return nullptr;
}

void* layerNormForwardHandler(FfiCallFrame* f) {
  return handleLayerNorm(f, kLayerNormForward, 4,
                         [](const FfiList& a, const FfiList& r, int64_t M, int64_t N, const XlaPool& pool) {
                           layerNormForwardOn(pool, f32(a, 0), f32(a, 1), f32(a, 2), f32Out(r, 0), f32Out(r, 1),
                                              f32Out(r, 2), M, N, *f32(a, 3));
                         });
}

void* layerNormBackwardHandler(FfiCallFrame* f) {
  return handleLayerNorm(f, kLayerNormBackward, 5,
                         [](const FfiList& a, const FfiList& r, int64_t M, int64_t N, const XlaPool& pool) {
                           layerNormBackwardOn(pool, f32(a, 0), f32(a, 1), f32(a, 2), f32(a, 3), f32(a, 4),
                                               f32Out(r, 0), f32Out(r, 1), f32Out(r, 2), M, N);
                         });
}

// softmax: x [M, N], log (i32 []) -> y [M, N].
void* softmaxForwardHandler(FfiCallFrame* f) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  std::string err;
  if (f->args.size != 2 || f->rets.size != 1) err = "wrong number of operands or results";
  const FfiBuffer* x = err.empty() ? item(f->args, 0) : nullptr;
  const FfiBuffer* y = err.empty() ? item(f->rets, 0) : nullptr;
  if (err.empty() && (x->dtype != kDTypeF32 || y->dtype != kDTypeF32 || x->rank != 2 || y->rank != 2 ||
                      x->dims[0] != y->dims[0] || x->dims[1] != y->dims[1]))
    err = "the operand and result are not float32 matrices of one shape";
  if (err.empty() && item(f->args, 1)->dtype != kDTypeS32) err = "the log flag is not int32";
  if (!err.empty()) return ffiError(f, std::string(kSoftmaxForward) + ": " + err);
  const bool log = *static_cast<const int32_t*>(item(f->args, 1)->data) != 0;
  softmaxForwardOn(xlaPoolOf(f->api, f->ctx), f32(f->args, 0), f32Out(f->rets, 0), x->dims[0], x->dims[1], log);
  return nullptr;
}

struct GemmCall {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  GemmTerms terms;
};

// gemm: a [M, K] or [K, M], b [K, N] or [N, K], transposes (i32 []), and
// optionally bias [N], alpha [], beta [] -> c [M, N].
std::string readGemm(const FfiCallFrame* f, GemmCall* g) {
  if ((f->args.size != 3 && f->args.size != 6) || f->rets.size != 1) return "wrong number of operands or results";
  const FfiBuffer* a = item(f->args, 0);
  const FfiBuffer* b = item(f->args, 1);
  const FfiBuffer* c = item(f->rets, 0);
  if (a->dtype != kDTypeF32 || b->dtype != kDTypeF32 || c->dtype != kDTypeF32) return "operands are not float32";
  if (item(f->args, 2)->dtype != kDTypeS32) return "the transposes flag is not int32";
  if (a->rank != 2 || b->rank != 2 || c->rank != 2) return "operands are not 2-d";
  const int32_t t = *static_cast<const int32_t*>(item(f->args, 2)->data);
  g->trans_a = (t & 1) != 0;
  g->trans_b = (t & 2) != 0;
  g->M = a->dims[g->trans_a ? 1 : 0];
  g->K = a->dims[g->trans_a ? 0 : 1];
  g->N = b->dims[g->trans_b ? 0 : 1];
  if (b->dims[g->trans_b ? 1 : 0] != g->K) return "the contracted sizes differ";
  if (c->dims[0] != g->M || c->dims[1] != g->N) return "the result shape does not match";
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (g->M * g->K > kMax || g->K * g->N > kMax || g->M * g->N > kMax) return "too large for a 32-bit BLAS";
  if (f->args.size == 6) {
    const FfiBuffer* bias = item(f->args, 3);
    if (bias->dtype != kDTypeF32 || bias->rank != 1 || bias->dims[0] != g->N) return "the bias is not float32 [N]";
    for (int i : {4, 5})
      if (item(f->args, i)->dtype != kDTypeF32 || item(f->args, i)->rank != 0)
        return "alpha or beta is not a float32 scalar";
    g->terms = GemmTerms{*f32(f->args, 4), f32(f->args, 3), *f32(f->args, 5)};
  }
  return "";
}

void* gemmHandler(FfiCallFrame* f) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  GemmCall g;
  std::string err = readGemm(f, &g);
  const HostBlas blas = hostBlas();
  if (err.empty() && !blas.available()) err = "no host BLAS is set";
  if (!err.empty()) return ffiError(f, std::string(kGemm) + ": " + err);
  const XlaPool pool = xlaPoolOf(f->api, f->ctx);
  gemmOn(pool, pool.threads, blas, f32(f->args, 0), f32(f->args, 1), f32Out(f->rets, 0), g.M, g.N, g.K, g.trans_a,
         g.trans_b, g.terms);
  return nullptr;
}

}  // namespace

namespace {

void attentionForwardOn(const XlaPool& pool, const float* q, const float* k, const float* v, float* out, float* lse,
                        const AttentionShape& a, float scale, bool causal) {
  const RowStrides r{a.qRow(), a.kRow(), a.vRow(), a.packedRow()};
  parallelFor(pool, a.batch * a.heads, [&](int64_t bh) {
    int64_t b = bh / a.heads, h = bh % a.heads, he = h * a.E;
    int64_t oo = b * a.L * r.o + he;
    forwardHead(q + b * a.L * r.q + he, k + b * a.S * r.k + he, v + b * a.S * r.v + he, out + oo, lse + bh * a.L, a.L,
                a.S, a.E, r, scale, causal);
  });
}

// grad_row: elements between the gradients' rows (0: packed [B, L|S, H, E]).
void attentionBackwardOn(const XlaPool& pool, const float* dout, const float* q, const float* k, const float* v,
                         const float* out, const float* lse, float* dq, float* dk, float* dv, const AttentionShape& a,
                         float scale, bool causal, int64_t grad_row) {
  const RowStrides r{a.qRow(), a.kRow(), a.vRow(), a.packedRow(), grad_row ? grad_row : a.packedRow()};
  parallelFor(pool, a.batch * a.heads, [&](int64_t bh) {
    int64_t b = bh / a.heads, h = bh % a.heads, he = h * a.E;
    int64_t oo = b * a.L * r.o + he, go = b * a.L * r.g + he, gko = b * a.S * r.g + he;
    backwardHead(dout + oo, q + b * a.L * r.q + he, k + b * a.S * r.k + he, v + b * a.S * r.v + he, out + oo,
                 lse + bh * a.L, dq + go, dk + gko, dv + gko, a.L, a.S, a.E, r, scale, causal);
  });
}

// Layer norm splits its rows into blocks of kLayerNormRows. Without XLA's
// pool the blocks run on the calling thread: a [1024, 64] forward is about
// 20 us, close to what waking a HostPool worker costs.
constexpr int64_t kLayerNormRows = 128;

int64_t rowBlocks(int64_t M) { return (M + kLayerNormRows - 1) / kLayerNormRows; }

void forEachRowBlock(const XlaPool& pool, int64_t M, const std::function<void(int64_t)>& block) {
  const int64_t blocks = rowBlocks(M);
  if (pool.threads >= 2) {
    parallelFor(pool, blocks, block);
  } else {
    for (int64_t i = 0; i < blocks; ++i) block(i);
  }
}

// row(i) for every row, in the blocks above (for kernels without cross-row sums).
template <typename Row>
void forEachRow(const XlaPool& pool, int64_t M, const Row& row) {
  forEachRowBlock(pool, M, [&](int64_t blk) {
    for (int64_t i = blk * kLayerNormRows; i < std::min(M, (blk + 1) * kLayerNormRows); ++i) row(i);
  });
}

void layerNormForwardOn(const XlaPool& pool, const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t M, int64_t N, float eps) {
  forEachRow(pool, M, [&](int64_t i) { layerNormRow(x + i * N, w, b, y + i * N, mean + i, rstd + i, N, eps); });
}

// The weight and bias gradients sum over the rows: each block sums its own
// rows, then the blocks are added in order, so the result does not depend on
// which thread ran which block.
void layerNormBackwardOn(const XlaPool& pool, const float* dy, const float* x, const float* mean, const float* rstd,
                         const float* w, float* dx, float* dw, float* db, int64_t M, int64_t N) {
  const int64_t blocks = rowBlocks(M);
  std::vector<float> partial(static_cast<size_t>(2 * blocks * N), 0.0f);
  forEachRowBlock(pool, M, [&](int64_t blk) {
    float* pw = partial.data() + 2 * blk * N;
    for (int64_t i = blk * kLayerNormRows; i < std::min(M, (blk + 1) * kLayerNormRows); ++i)
      layerNormBackwardRow(dy + i * N, x + i * N, mean[i], rstd[i], w, dx + i * N, pw, pw + N, N);
  });
  std::fill(dw, dw + N, 0.0f);
  std::fill(db, db + N, 0.0f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* pw = partial.data() + 2 * blk * N;
    for (int64_t j = 0; j < N; ++j) {
      dw[j] += pw[j];
      db[j] += pw[N + j];
    }
  }
}

void softmaxForwardOn(const XlaPool& pool, const float* x, float* y, int64_t M, int64_t N, bool log) {
  forEachRow(pool, M, [&](int64_t i) { softmaxRow(x + i * N, y + i * N, N, log); });
}

std::mutex g_blas_mu;
HostBlas g_blas;

// The product splits the longer of its result's rows and columns into blocks
// of whole multiples of 16, one or two per thread: a [1024, 192] result runs
// as 4 blocks of 256 rows with 2 threads. The blocks depend on the shape and
// the thread count only, and each element is one BLAS call's, so the bits do
// not depend on which thread ran which block.
struct GemmPlan {
  bool by_rows = true;
  int64_t block = 0, blocks = 0;
};

GemmPlan planGemm(int64_t M, int64_t N, int64_t threads) {
  GemmPlan p;
  p.by_rows = M >= N;
  const int64_t extent = p.by_rows ? M : N;
  threads = std::max<int64_t>(1, threads);
  const int64_t want = threads * std::max<int64_t>(1, std::min<int64_t>(2, extent / (64 * threads)));
  p.block = std::max<int64_t>(16, ((extent + want - 1) / want + 15) / 16 * 16);
  p.blocks = (extent + p.block - 1) / p.block;
  return p;
}

// The block's rows of c set to the bias, which the BLAS then scales by beta:
// true when there is a bias to add.
bool fillBias(float* c, int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const GemmTerms& t) {
  if (!t.bias || t.beta == 0.0f) return false;
  for (int64_t i = m0; i < m1; ++i) std::copy(t.bias + n0, t.bias + n1, c + i * N + n0);
  return true;
}

// Adds beta * bias to every row of the block, after the product. (Filling the
// block with the bias first, for a beta-1 product, cost a memmove per row:
// 0.17 ms of the benchmark GPT's 2.3 ms forward program.)
void addBias(float* c, int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const GemmTerms& t) {
  if (!t.bias || t.beta == 0.0f) return;
  const float beta = t.beta;
  const float* __restrict__ bias = t.bias;
  for (int64_t i = m0; i < m1; ++i) {
    float* __restrict__ row = c + i * N;
    for (int64_t j = n0; j < n1; ++j) row[j] += beta * bias[j];
  }
}

// Rows [m0, m1) and columns [n0, n1) of the row-major c = op(a) op(b), as the
// column-major BLAS sees it: c^T = op(b)^T op(a)^T, single-threaded.
void gemmBlock(const HostBlas& blas, const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K,
               bool trans_a, bool trans_b, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const GemmTerms& t) {
  const int m = static_cast<int>(m1 - m0), n = static_cast<int>(n1 - n0), k = static_cast<int>(K);
  const int lda = static_cast<int>(std::max<int64_t>(1, trans_a ? M : K));
  const int ldb = static_cast<int>(std::max<int64_t>(1, trans_b ? K : N));
  const int ldc = static_cast<int>(std::max<int64_t>(1, N));
  const float* ap = trans_a ? a + m0 : a + m0 * K;
  const float* bp = trans_b ? b + n0 * K : b + n0;
  const char opa = trans_a ? 'T' : 'N', opb = trans_b ? 'T' : 'N';
  const float alpha = t.alpha, zero = 0.0f;
  const int previous = blas.set_threads_local(1);
  blas.sgemm(&opb, &opa, &n, &m, &k, &alpha, bp, &ldb, ap, &lda, &zero, c + m0 * N + n0, &ldc);
  blas.set_threads_local(previous);
  addBias(c, N, m0, m1, n0, n1, t);
}

// `threads`: XLA's pool's, or the blocks' plan without one (the unit tests).
void gemmOn(const XlaPool& pool, int64_t threads, const HostBlas& blas, const float* a, const float* b, float* c,
            int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, const GemmTerms& terms) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty product: beta bias
    if (fillBias(c, N, 0, M, 0, N, terms)) {
      for (int64_t i = 0; i < M * N; ++i) c[i] *= terms.beta;
    } else {
      std::fill(c, c + M * N, 0.0f);
    }
    return;
  }
  const GemmPlan p = planGemm(M, N, threads);
  auto block = [&](int64_t i) {
    const int64_t lo = i * p.block, hi = std::min((i + 1) * p.block, p.by_rows ? M : N);
    if (p.by_rows)
      gemmBlock(blas, a, b, c, M, N, K, trans_a, trans_b, lo, hi, 0, N, terms);
    else
      gemmBlock(blas, a, b, c, M, N, K, trans_a, trans_b, 0, M, lo, hi, terms);
  };
  if (p.blocks > 1 && (pool.threads >= 2 || !pool.api)) {
    parallelFor(pool, p.blocks, block);
  } else {
    for (int64_t i = 0; i < p.blocks; ++i) block(i);
  }
}

}  // namespace

void attentionForward(const float* q, const float* k, const float* v, float* out, float* lse, const AttentionShape& a,
                      float scale, bool causal) {
  attentionForwardOn(XlaPool{}, q, k, v, out, lse, a, scale, causal);
}

void attentionBackward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                       const float* lse, float* dq, float* dk, float* dv, const AttentionShape& a, float scale,
                       bool causal) {
  attentionBackwardOn(XlaPool{}, dout, q, k, v, out, lse, dq, dk, dv, a, scale, causal);
}

void setHostBlas(const HostBlas& blas) {
  std::lock_guard<std::mutex> g(g_blas_mu);
  g_blas = blas;
}

HostBlas hostBlas() {
  std::lock_guard<std::mutex> g(g_blas_mu);
  return g_blas;
}

void gemm(const float* a, const float* b, float* c, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
          int64_t threads, const GemmTerms& terms) {
  const HostBlas blas = hostBlas();
  if (!blas.available()) throw std::runtime_error("torch_tpu: gemm without a host BLAS");
  gemmOn(XlaPool{}, threads, blas, a, b, c, M, N, K, trans_a, trans_b, terms);
}

void layerNormForward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int64_t M,
                      int64_t N, float eps) {
  layerNormForwardOn(XlaPool{}, x, w, b, y, mean, rstd, M, N, eps);
}

void layerNormBackward(const float* dy, const float* x, const float* mean, const float* rstd, const float* w, float* dx,
                       float* dw, float* db, int64_t M, int64_t N) {
  layerNormBackwardOn(XlaPool{}, dy, x, mean, rstd, w, dx, dw, db, M, N);
}

void softmaxForward(const float* x, float* y, int64_t M, int64_t N, bool log) {
  softmaxForwardOn(XlaPool{}, x, y, M, N, log);
}

bool registerHostKernels(const pjrt::Api& api) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
  std::vector<std::pair<const char*, void* (*)(FfiCallFrame*)>> handlers{{kAttentionForward, attentionForwardHandler},
                                                                         {kAttentionBackward, attentionBackwardHandler},
                                                                         {kLayerNormForward, layerNormForwardHandler},
                                                                         {kLayerNormBackward, layerNormBackwardHandler},
                                                                         {kSoftmaxForward, softmaxForwardHandler}};
  if (hostBlas().available()) handlers.emplace_back(kGemm, gemmHandler);
  try {
    for (auto [name, fn] : handlers) api.registerFfiHandler(name, "Host", reinterpret_cast<void*>(fn));
  } catch (const pjrt::PluginError&) {
    return false;  // no FFI extension, or a refusal: the StableHLO forms run
  }
  return true;
}

}  // namespace tpu::plugins::cpu
