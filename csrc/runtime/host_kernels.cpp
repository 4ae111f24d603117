#include "runtime/host_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tpu::runtime {
namespace {

// ------------------------------------------------------------- FFI ABI
// The parts of XLA's FFI C ABI (xla/ffi/api/c_api.h, API 0.1) and PJRT's FFI
// extension (pjrt_c_api_ffi_extension.h) used here. Neither header ships with
// the plugin wheels; the layouts are the documented C structs.
struct FfiExtensionBase {
  size_t struct_size;
  int type;
  FfiExtensionBase* next;
};
constexpr int kFfiExtensionMetadata = 1;
struct FfiApiVersion {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  int major_version;
  int minor_version;
};
struct FfiMetadata {
  size_t struct_size;
  FfiApiVersion api_version;
  uint32_t traits;
};
struct FfiMetadataExtension {
  FfiExtensionBase base;
  FfiMetadata* metadata;
};
struct FfiBuffer {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  int dtype;
  void* data;
  int64_t rank;
  int64_t* dims;
};
struct FfiList {  // XLA_FFI_Args and XLA_FFI_Rets
  size_t struct_size;
  FfiExtensionBase* extension_start;
  int64_t size;
  int* types;
  void** items;
};
struct FfiCallFrame {  // attributes and the future follow; not read here
  size_t struct_size;
  FfiExtensionBase* extension_start;
  const void* api;
  void* ctx;
  int stage;
  FfiList args;
  FfiList rets;
};
struct FfiErrorCreateArgs {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  const char* message;
  int errc;
};
struct FfiApiPrefix {  // XLA_FFI_Api up to XLA_FFI_Error_Create
  size_t struct_size;
  FfiExtensionBase* extension_start;
  FfiApiVersion api_version;
  void* internal_api;
  void* (*error_create)(FfiErrorCreateArgs*);
};
constexpr int kFfiApiMinor = 1;
constexpr int kStageExecute = 3;
constexpr int kDTypeS32 = 4, kDTypeF32 = 11;
constexpr int kErrorInvalidArgument = 3;

struct PjrtFfiRegisterArgs {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;
  const char* platform_name;
  size_t platform_name_size;
  int traits;
};
struct PjrtFfiExtension {
  PJRT_Extension_Base base;
  void* type_id_register;
  void* user_data_add;
  PJRT_Error* (*register_handler)(PjrtFfiRegisterArgs*);
};

// ------------------------------------------------------------- threads

// The kernels split their heads over this pool and the calling XLA thread
// (XLA's own intra-op pool is not reachable through the FFI of this plugin).
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

// ------------------------------------------------------------- kernels
// Plain loops the compiler vectorizes for AVX2/FMA (the functions are only
// registered where the CPU has both). Per head: the scores of one query row
// at a time, over keys vectorized; rows of the outputs over the head width.
#define TPU_HOST_SIMD __attribute__((target("avx2,fma")))

TPU_HOST_SIMD float rowMax(const float* x, int64_t n) {
  float acc[8];
  for (float& a : acc) a = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) acc[u] = std::max(acc[u], x[j + u]);
  float m = acc[0];
  for (int u = 1; u < 8; ++u) m = std::max(m, acc[u]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

TPU_HOST_SIMD float rowSum(const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) acc[u] += x[j + u];
  float s = 0;
  for (float a : acc) s += a;
  for (; j < n; ++j) s += x[j];
  return s;
}

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

// s[j] = scale * q . K[j] for the first nb blocks of keys, from K transposed
// and zero-padded (kt: [E, SP]).
TPU_HOST_SIMD void scoreRow(const float* __restrict__ q, const float* __restrict__ kt, float* __restrict__ s,
                            int64_t nb, int64_t SP, int64_t E, float scale) {
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {  // four independent accumulator chains hide the FMA latency
    v8f a0{}, a1{}, a2{}, a3{};
    const float* col = kt + b * kBlock;
    for (int64_t e = 0; e < E; ++e) {
      float qe = q[e];
      const float* kr = col + e * SP;
      a0 += qe * load8(kr);
      a1 += qe * load8(kr + kBlock);
      a2 += qe * load8(kr + 2 * kBlock);
      a3 += qe * load8(kr + 3 * kBlock);
    }
    store8(s + b * kBlock, a0 * scale);
    store8(s + (b + 1) * kBlock, a1 * scale);
    store8(s + (b + 2) * kBlock, a2 * scale);
    store8(s + (b + 3) * kBlock, a3 * scale);
  }
  for (; b < nb; ++b) {
    v8f acc{};
    const float* col = kt + b * kBlock;
    for (int64_t e = 0; e < E; ++e) acc += q[e] * load8(col + e * SP);
    store8(s + b * kBlock, acc * scale);
  }
}

// x's rows (R elements apart) zero-padded to SP -> xt [E, SP].
TPU_HOST_SIMD void transposePadded(const float* __restrict__ x, float* __restrict__ xt, int64_t rows, int64_t SP,
                                   int64_t E, int64_t R) {
  std::fill(xt, xt + E * SP, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < E; ++e) xt[e * SP + r] = x[r * R + e];
}

// out[e] = sum_i w[i * stride] * X[i, e] over i0 <= i < n (X's rows R elements
// apart), eight columns at a time with four accumulators over i (independent
// FMA chains).
TPU_HOST_SIMD void weightedSum(const float* __restrict__ w, int64_t stride, const float* __restrict__ X,
                               float* __restrict__ out, int64_t i0, int64_t n, int64_t E, int64_t R) {
  int64_t e0 = 0;
  for (; e0 + kBlock <= E; e0 += kBlock) {
    v8f a0{}, a1{}, a2{}, a3{};
    int64_t i = i0;
    for (; i + 4 <= n; i += 4) {
      a0 += w[i * stride] * load8(X + i * R + e0);
      a1 += w[(i + 1) * stride] * load8(X + (i + 1) * R + e0);
      a2 += w[(i + 2) * stride] * load8(X + (i + 2) * R + e0);
      a3 += w[(i + 3) * stride] * load8(X + (i + 3) * R + e0);
    }
    for (; i < n; ++i) a0 += w[i * stride] * load8(X + i * R + e0);
    store8(out + e0, (a0 + a1) + (a2 + a3));
  }
  for (int64_t e = e0; e < E; ++e) {
    float acc = 0;
    for (int64_t i = i0; i < n; ++i) acc += w[i * stride] * X[i * R + e];
    out[e] = acc;
  }
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

// s[j] = e^(s[j] - shift) for the nb blocks; keys past the mask or the end get 0.
TPU_HOST_SIMD void expRow(float* __restrict__ s, int64_t n, int64_t nb, float shift) {
  for (int64_t b = 0; b < nb; ++b) {
    v8f x;
    std::memcpy(&x, s + b * kBlock, sizeof x);
    x = exp8(x - shift);
    std::memcpy(s + b * kBlock, &x, sizeof x);
  }
  for (int64_t j = n; j < nb * kBlock; ++j) s[j] = 0.0f;
}

// Keys visible from query row i: all, or j <= i (PyTorch's top-left causal mask).
int64_t visible(int64_t i, int64_t S, bool causal) { return causal ? std::min(i + 1, S) : S; }

// One head: its rows of Q, K, V and O are R elements apart (the sequence-major
// layout interleaves the heads).
TPU_HOST_SIMD void forwardHead(const float* Q, const float* K, const float* V, float* O, float* LSE, int64_t L,
                               int64_t S, int64_t E, int64_t R, float scale, bool causal) {
  int64_t SP = blocks(S) * kBlock;
  std::vector<float> kt(E * SP), s(SP);
  transposePadded(K, kt.data(), S, SP, E, R);
  for (int64_t i = 0; i < L; ++i) {
    int64_t n = visible(i, S, causal), nb = blocks(n);
    scoreRow(Q + i * R, kt.data(), s.data(), nb, SP, E, scale);
    float m = rowMax(s.data(), n);
    expRow(s.data(), n, nb, m);
    float l = rowSum(s.data(), nb * kBlock);
    float* o = O + i * R;
    weightedSum(s.data(), 1, V, o, 0, n, E, R);
    float inv = 1.0f / l;
    for (int64_t e = 0; e < E; ++e) o[e] *= inv;
    LSE[i] = m + std::log(l);
  }
}

// The whole head's probabilities P and score gradients dS ([L, SP] each) are
// formed row by row first; dV = P^T dO and dK = dS^T Q then accumulate each
// key's row in registers (query rows i >= j only, under the causal mask).
TPU_HOST_SIMD void backwardHead(const float* dO, const float* Q, const float* K, const float* V, const float* O,
                                const float* LSE, float* dQ, float* dK, float* dV, int64_t L, int64_t S, int64_t E,
                                int64_t R, float scale, bool causal) {
  int64_t SP = blocks(S) * kBlock;
  std::vector<float> kt(E * SP), vt(E * SP), P(L * SP), dS(L * SP);
  transposePadded(K, kt.data(), S, SP, E, R);
  transposePadded(V, vt.data(), S, SP, E, R);
  for (int64_t i = 0; i < L; ++i) {
    int64_t n = visible(i, S, causal), nb = blocks(n);
    const float* gi = dO + i * R;
    float* p = P.data() + i * SP;
    float* ds = dS.data() + i * SP;
    std::fill(p + nb * kBlock, p + SP, 0.0f);
    std::fill(ds + nb * kBlock, ds + SP, 0.0f);
    scoreRow(Q + i * R, kt.data(), p, nb, SP, E, scale);
    expRow(p, n, nb, LSE[i]);
    scoreRow(gi, vt.data(), ds, nb, SP, E, 1.0f);  // dp_j = dO_i . V_j
    float delta = 0.0f;                            // dO_i . O_i
    for (int64_t e = 0; e < E; ++e) delta += gi[e] * O[i * R + e];
    for (int64_t j = 0; j < nb * kBlock; ++j) ds[j] = p[j] * (ds[j] - delta) * scale;
    weightedSum(ds, 1, K, dQ + i * R, 0, n, E, R);
  }
  for (int64_t j = 0; j < S; ++j) {
    int64_t i0 = causal ? j : 0;  // rows that see key j
    weightedSum(P.data() + j, SP, dO, dV + j * R, i0, L, E, R);
    weightedSum(dS.data() + j, SP, Q, dK + j * R, i0, L, E, R);
  }
}

// Layer norm over rows of n, eight lanes at a time: two passes over each row
// for the moments (as exact as the CPU's two-pass form), then the affine
// output; the backward forms the two row sums of the input gradient in one
// pass and accumulates the weight and bias gradients.
TPU_HOST_SIMD inline float lanesSum(v8f v) {
  float s = 0;
  for (int u = 0; u < kBlock; ++u) s += v[u];
  return s;
}

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

// ------------------------------------------------------------- handlers

void* ffiError(const FfiCallFrame* f, const std::string& msg) {
  auto* api = static_cast<const FfiApiPrefix*>(f->api);
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
  int64_t batch = 0, heads = 0, L = 0, S = 0, E = 0;
  float scale = 1.0f;
  bool causal = false;
};

// Reads an attention call: the operand and result counts, float32 operands
// then the scale and the int32 causal flag, q-like buffers [B, L, H, E] and
// k-like ones [B, S, H, E]. Returns an error message, or "" when `c` is set.
std::string readCall(const FfiCallFrame* f, int n_args, int n_rets, AttentionCall* c) {
  if (f->args.size != n_args || f->rets.size != n_rets) return "wrong number of operands or results";
  for (int i = 0; i < n_args - 1; ++i)
    if (item(f->args, i)->dtype != kDTypeF32) return "operand " + std::to_string(i) + " is not float32";
  if (item(f->args, n_args - 1)->dtype != kDTypeS32) return "the causal flag is not int32";
  const FfiBuffer* q = item(f->args, n_args == 5 ? 0 : 1);
  const FfiBuffer* k = item(f->args, n_args == 5 ? 1 : 2);
  if (q->rank != 4 || k->rank != 4 || q->dims[0] != k->dims[0] || q->dims[2] != k->dims[2] || q->dims[3] != k->dims[3])
    return "query and key shapes do not match";
  c->batch = q->dims[0];
  c->heads = q->dims[2];
  c->L = q->dims[1];
  c->S = k->dims[1];
  c->E = q->dims[3];
  c->scale = *f32(f->args, n_args - 2);
  c->causal = *static_cast<const int32_t*>(item(f->args, n_args - 1)->data) != 0;
  return "";
}

// The shared part of both handlers: the metadata query and other stages
// return at once; a call that does not read as attention is an FFI error
// naming `target`; otherwise `run` computes.
void* handleAttention(FfiCallFrame* f, const char* target, int n_args, int n_rets,
                      void (*run)(const FfiList& a, const FfiList& r, const AttentionCall& c)) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  AttentionCall c;
  std::string err = readCall(f, n_args, n_rets, &c);
  if (!err.empty()) return ffiError(f, std::string(target) + ": " + err);
  run(f->args, f->rets, c);
  return nullptr;
}

void* attentionForwardHandler(FfiCallFrame* f) {
  return handleAttention(f, kAttentionForward, 5, 2, [](const FfiList& a, const FfiList& r, const AttentionCall& c) {
    attentionForward(f32(a, 0), f32(a, 1), f32(a, 2), f32Out(r, 0), f32Out(r, 1), {c.batch, c.heads, c.L, c.S, c.E},
                     c.scale, c.causal);
  });
}

void* attentionBackwardHandler(FfiCallFrame* f) {
  return handleAttention(f, kAttentionBackward, 8, 3, [](const FfiList& a, const FfiList& r, const AttentionCall& c) {
    attentionBackward(f32(a, 0), f32(a, 1), f32(a, 2), f32(a, 3), f32(a, 4), f32(a, 5), f32Out(r, 0), f32Out(r, 1),
                      f32Out(r, 2), {c.batch, c.heads, c.L, c.S, c.E}, c.scale, c.causal);
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
                      void (*run)(const FfiList& a, const FfiList& r, int64_t M, int64_t N)) {
  if (metadataQuery(f) || f->stage != kStageExecute) return nullptr;
  int64_t M = 0, N = 0;
  std::string err = readLayerNorm(f, n_args, 3, &M, &N);
  if (!err.empty()) return ffiError(f, std::string(target) + ": " + err);
  run(f->args, f->rets, M, N);
  return nullptr;
}

void* layerNormForwardHandler(FfiCallFrame* f) {
  return handleLayerNorm(f, kLayerNormForward, 4, [](const FfiList& a, const FfiList& r, int64_t M, int64_t N) {
    layerNormForward(f32(a, 0), f32(a, 1), f32(a, 2), f32Out(r, 0), f32Out(r, 1), f32Out(r, 2), M, N, *f32(a, 3));
  });
}

void* layerNormBackwardHandler(FfiCallFrame* f) {
  return handleLayerNorm(f, kLayerNormBackward, 5, [](const FfiList& a, const FfiList& r, int64_t M, int64_t N) {
    layerNormBackward(f32(a, 0), f32(a, 1), f32(a, 2), f32(a, 3), f32(a, 4), f32Out(r, 0), f32Out(r, 1), f32Out(r, 2),
                      M, N);
  });
}

}  // namespace

void attentionForward(const float* q, const float* k, const float* v, float* out, float* lse, const AttentionShape& a,
                      float scale, bool causal) {
  const int64_t R = a.heads * a.E;
  HostPool::get().parallelFor(a.batch * a.heads, [&](int64_t bh) {
    int64_t b = bh / a.heads, h = bh % a.heads;
    int64_t qo = b * a.L * R + h * a.E, ko = b * a.S * R + h * a.E;
    forwardHead(q + qo, k + ko, v + ko, out + qo, lse + bh * a.L, a.L, a.S, a.E, R, scale, causal);
  });
}

void attentionBackward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                       const float* lse, float* dq, float* dk, float* dv, const AttentionShape& a, float scale,
                       bool causal) {
  const int64_t R = a.heads * a.E;
  HostPool::get().parallelFor(a.batch * a.heads, [&](int64_t bh) {
    int64_t b = bh / a.heads, h = bh % a.heads;
    int64_t qo = b * a.L * R + h * a.E, ko = b * a.S * R + h * a.E;
    backwardHead(dout + qo, q + qo, k + ko, v + ko, out + qo, lse + bh * a.L, dq + qo, dk + ko, dv + ko, a.L, a.S, a.E,
                 R, scale, causal);
  });
}

// Layer norm runs on the calling thread: a [1024, 64] forward is about
// 20 us, close to what waking a pool worker costs.
void layerNormForward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int64_t M,
                      int64_t N, float eps) {
  for (int64_t i = 0; i < M; ++i) layerNormRow(x + i * N, w, b, y + i * N, mean + i, rstd + i, N, eps);
}

void layerNormBackward(const float* dy, const float* x, const float* mean, const float* rstd, const float* w, float* dx,
                       float* dw, float* db, int64_t M, int64_t N) {
  std::fill(dw, dw + N, 0.0f);
  std::fill(db, db + N, 0.0f);
  for (int64_t i = 0; i < M; ++i)
    layerNormBackwardRow(dy + i * N, x + i * N, mean[i], rstd[i], w, dx + i * N, dw, db, N);
}

bool registerHostKernels(const pjrt::Api& api) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;
  const PjrtFfiExtension* ffi = nullptr;
  for (auto* e = api.raw()->extension_start; e; e = e->next)
    if (e->type == PJRT_Extension_Type_FFI && e->struct_size >= sizeof(PjrtFfiExtension))
      ffi = reinterpret_cast<const PjrtFfiExtension*>(e);
  if (!ffi || !ffi->register_handler) return false;
  for (auto [name, fn] : {std::pair<const char*, void* (*)(FfiCallFrame*)>{kAttentionForward, attentionForwardHandler},
                          {kAttentionBackward, attentionBackwardHandler},
                          {kLayerNormForward, layerNormForwardHandler},
                          {kLayerNormBackward, layerNormBackwardHandler}}) {
    PjrtFfiRegisterArgs a{
        sizeof(PjrtFfiRegisterArgs), name, std::strlen(name), reinterpret_cast<void*>(fn), "Host", 4, 0};
    if (PJRT_Error* err = ffi->register_handler(&a)) {
      api.destroyError(err);
      return false;
    }
  }
  return true;
}

}  // namespace tpu::runtime
