// The CPU plugin's attention, layer-norm and GEMM kernels against plain
// double-precision references, and their FFI registration and error path
// through the plugin.
#include "plugins/cpu/host_kernels.h"

#include <gtest/gtest.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "ir/ir.h"
#include "pjrt/xla_ffi.h"

using namespace tpu;

namespace {

struct Case {
  int64_t batch, heads, L, S, E;
  bool causal;
  plugins::cpu::AttentionShape shape() const { return {batch, heads, L, S, E}; }
  int64_t qSize() const { return batch * L * heads * E; }
  int64_t kSize() const { return batch * S * heads * E; }
};

std::vector<float> randomVec(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Softmax attention per (batch, head) in double, in the kernels' layouts
// (q-like [B, L, H, E], k-like [B, S, H, E], logsumexp [B, H, L]); p is [L, S].
void reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               const std::vector<float>& dout, float scale, std::vector<double>& out, std::vector<double>& lse,
               std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv) {
  out.assign(c.qSize(), 0);
  lse.assign(c.batch * c.heads * c.L, 0);
  dq.assign(c.qSize(), 0);
  dk.assign(c.kSize(), 0);
  dv.assign(c.kSize(), 0);
  for (int64_t bb = 0; bb < c.batch; ++bb) {
    for (int64_t h = 0; h < c.heads; ++h) {
      auto qi = [&](int64_t i, int64_t e) { return ((bb * c.L + i) * c.heads + h) * c.E + e; };
      auto ki = [&](int64_t j, int64_t e) { return ((bb * c.S + j) * c.heads + h) * c.E + e; };
      auto Q = [&](int64_t i, int64_t e) { return double(q[qi(i, e)]); };
      auto K = [&](int64_t j, int64_t e) { return double(k[ki(j, e)]); };
      auto V = [&](int64_t j, int64_t e) { return double(v[ki(j, e)]); };
      auto G = [&](int64_t i, int64_t e) { return double(dout[qi(i, e)]); };
      std::vector<double> p(c.L * c.S, 0.0);
      for (int64_t i = 0; i < c.L; ++i) {
        int64_t n = c.causal ? std::min(i + 1, c.S) : c.S;
        double m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t e = 0; e < c.E; ++e) s += Q(i, e) * K(j, e);
          p[i * c.S + j] = s * scale;
          m = std::max(m, s * scale);
        }
        double l = 0;
        for (int64_t j = 0; j < n; ++j) l += (p[i * c.S + j] = std::exp(p[i * c.S + j] - m));
        for (int64_t j = 0; j < n; ++j) p[i * c.S + j] /= l;
        lse[(bb * c.heads + h) * c.L + i] = m + std::log(l);
        for (int64_t e = 0; e < c.E; ++e)
          for (int64_t j = 0; j < n; ++j) out[qi(i, e)] += p[i * c.S + j] * V(j, e);
      }
      for (int64_t i = 0; i < c.L; ++i) {
        double delta = 0;
        for (int64_t e = 0; e < c.E; ++e) delta += G(i, e) * out[qi(i, e)];
        for (int64_t j = 0; j < c.S; ++j) {
          double pij = p[i * c.S + j];
          if (pij == 0) continue;
          double dp = 0;
          for (int64_t e = 0; e < c.E; ++e) dp += G(i, e) * V(j, e);
          double ds = pij * (dp - delta) * scale;
          for (int64_t e = 0; e < c.E; ++e) {
            dv[ki(j, e)] += pij * G(i, e);
            dq[qi(i, e)] += ds * K(j, e);
            dk[ki(j, e)] += ds * Q(i, e);
          }
        }
      }
    }
  }
}

void expectNear(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 2e-5 + 2e-5 * std::abs(want[i])) << what << " at " << i;
}

class AttentionKernel : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionKernel, MatchesTheDoublePrecisionReference) {
  Case c = GetParam();
  float scale = 1.0f / std::sqrt(float(c.E));
  auto q = randomVec(c.qSize(), 1), k = randomVec(c.kSize(), 2), v = randomVec(c.kSize(), 3),
       g = randomVec(c.qSize(), 4);
  std::vector<double> out, lse, dq, dk, dv;
  reference(c, q, k, v, g, scale, out, lse, dq, dk, dv);
  std::vector<float> o(out.size()), l(lse.size()), gq(dq.size()), gk(dk.size()), gv(dv.size());
  plugins::cpu::attentionForward(q.data(), k.data(), v.data(), o.data(), l.data(), c.shape(), scale, c.causal);
  expectNear(o, out, "out");
  expectNear(l, lse, "logsumexp");
  plugins::cpu::attentionBackward(g.data(), q.data(), k.data(), v.data(), o.data(), l.data(), gq.data(), gk.data(),
                                  gv.data(), c.shape(), scale, c.causal);
  expectNear(gq, dq, "dq");
  expectNear(gk, dk, "dk");
  expectNear(gv, dv, "dv");
}

// Widths that fill the 8-lane blocks and ones that leave a remainder (copied
// into padded rows), up to the 64 the backward takes; row counts that leave
// partial 4-row tiles; more queries than keys and the reverse (the causal
// mask is top-left aligned).
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionKernel,
                         ::testing::Values(Case{2, 3, 64, 64, 16, true}, Case{3, 2, 64, 64, 16, false},
                                           Case{1, 3, 13, 21, 12, true}, Case{3, 1, 21, 13, 12, true},
                                           Case{2, 1, 9, 9, 5, false}, Case{1, 1, 1, 1, 8, true},
                                           Case{1, 2, 11, 11, 64, true}, Case{2, 1, 7, 10, 40, false}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Case& c = i.param;
                           return "b" + std::to_string(c.batch) + "h" + std::to_string(c.heads) + "_L" +
                                  std::to_string(c.L) + "_S" + std::to_string(c.S) + "_E" + std::to_string(c.E) +
                                  (c.causal ? "_causal" : "");
                         });

// [B, L, 3, H, E]: the q, k and v of one packed projection, row stride 3*H*E.
std::vector<float> packRows(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                            const std::vector<float>& v) {
  const int64_t he = c.heads * c.E;
  std::vector<float> qkv(3 * c.qSize());
  for (int64_t r = 0; r < c.batch * c.L; ++r)
    for (int64_t j = 0; j < he; ++j) {
      qkv[r * 3 * he + j] = q[r * he + j];
      qkv[r * 3 * he + he + j] = k[r * he + j];
      qkv[r * 3 * he + 2 * he + j] = v[r * he + j];
    }
  return qkv;
}

// q, k and v read in place from a packed projection give the same bits as
// from separate arrays.
TEST(AttentionKernel, ReadsPackedQkvInPlace) {
  for (bool causal : {true, false}) {
    Case c{2, 3, 40, 40, 12, causal};
    const int64_t he = c.heads * c.E;
    auto q = randomVec(c.qSize(), 21), k = randomVec(c.kSize(), 22), v = randomVec(c.kSize(), 23),
         g = randomVec(c.qSize(), 24);
    auto qkv = packRows(c, q, k, v);
    plugins::cpu::AttentionShape packed = c.shape();
    packed.q_row = packed.k_row = packed.v_row = 3 * he;
    std::vector<float> o1(c.qSize()), o2(c.qSize()), l1(c.batch * c.heads * c.L), l2(l1.size());
    plugins::cpu::attentionForward(q.data(), k.data(), v.data(), o1.data(), l1.data(), c.shape(), 0.3f, causal);
    plugins::cpu::attentionForward(qkv.data(), qkv.data() + he, qkv.data() + 2 * he, o2.data(), l2.data(), packed, 0.3f,
                                   causal);
    EXPECT_EQ(o1, o2);
    EXPECT_EQ(l1, l2);
    std::vector<float> dq1(c.qSize()), dk1(c.kSize()), dv1(c.kSize()), dq2(c.qSize()), dk2(c.kSize()), dv2(c.kSize());
    plugins::cpu::attentionBackward(g.data(), q.data(), k.data(), v.data(), o1.data(), l1.data(), dq1.data(),
                                    dk1.data(), dv1.data(), c.shape(), 0.3f, causal);
    plugins::cpu::attentionBackward(g.data(), qkv.data(), qkv.data() + he, qkv.data() + 2 * he, o1.data(), l1.data(),
                                    dq2.data(), dk2.data(), dv2.data(), packed, 0.3f, causal);
    EXPECT_EQ(dq1, dq2);
    EXPECT_EQ(dk1, dk2);
    EXPECT_EQ(dv1, dv2);
  }
}

// A stand-in host BLAS: the Fortran sgemm's contract (column-major,
// C = alpha op(A) op(B) + beta C) in plain loops, and a per-thread
// thread-count setting, as MKL's is, with counts of what the kernel did.
thread_local int t_threads_local = 0;
std::atomic<int> g_single_threaded_sets{0}, g_restores{0}, g_calls_not_single_threaded{0};

void plainSgemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                const int* ldc) {
  if (t_threads_local != 1) g_calls_not_single_threaded.fetch_add(1);
  for (int j = 0; j < *n; ++j)
    for (int i = 0; i < *m; ++i) {
      double acc = 0;
      for (int l = 0; l < *k; ++l) {
        double x = *ta == 'N' ? a[i + l * *lda] : a[l + i * *lda];
        double y = *tb == 'N' ? b[l + j * *ldb] : b[j + l * *ldb];
        acc += x * y;
      }
      float& out = c[i + j * *ldc];
      out = static_cast<float>(*alpha * acc + (*beta == 0.0f ? 0.0 : *beta * out));
    }
}

int recordThreadsLocal(int n) {
  (n == 1 ? g_single_threaded_sets : g_restores).fetch_add(1);
  const int previous = t_threads_local;
  t_threads_local = n;
  return previous;
}

void usePlainBlas() { plugins::cpu::setHostBlas({plainSgemm, recordThreadsLocal}); }

pjrt::Client& client() {
  static std::unique_ptr<pjrt::Client> c = [] {
    usePlainBlas();  // so that the GEMM kernel is registered too
    std::vector<std::string> dirs;
    if (const char* p = std::getenv("TORCH_TPU_PLUGIN_PATH")) dirs.push_back(p);
    auto api = pjrt::Api::load(pjrt::resolvePluginPath("cpu", dirs));
    EXPECT_TRUE(plugins::cpu::registerHostKernels(*api));
    return pjrt::Client::create(api, {{{"cpu_device_count", int64_t{1}}, {"asynchronous", true}}, nullptr});
  }();
  return *c;
}

TEST(AttentionKernel, RunsInsideAnXlaProgram) {
  // Separate q, k, v arrays, then the same read from one packed [B, L, 3*H*E]
  // array through the layout operand, then with the gradients written packed
  // the same way into one result: forward and backward.
  Case c{1, 2, 8, 8, 8, true};
  const int64_t he = c.heads * c.E;
  ir::Type t{ir::DType::F32, {1, c.L, c.heads, c.E}}, lse_t{ir::DType::F32, {1, c.heads, c.L}};
  ir::Type packed_t{ir::DType::F32, {1, c.L, 3 * he}};
  auto hq = randomVec(t.numel(), 5), hk = randomVec(t.numel(), 6), hv = randomVec(t.numel(), 7),
       hg = randomVec(t.numel(), 8);
  auto hqkv = packRows(c, hq, hk, hv);
  std::vector<double> out, lse, dq, dk, dv;
  reference(c, hq, hk, hv, hg, 0.5f, out, lse, dq, dk, dv);
  std::vector<std::vector<float>> packed_inputs_grads;  // dq, dk, dv from packed inputs, three results
  for (int mode : {0, 1, 2}) {
    const bool packed = mode > 0, packed_grads = mode == 2;
    ir::Builder b;
    std::vector<ir::Value> qkv;
    std::vector<int64_t> layout{c.L, 0, he, 0, he, 0, he};
    if (packed) {
      auto p = b.param(packed_t);
      qkv = {p, p, p};
      layout = {c.L, 0, 3 * he, he, 3 * he, 2 * he, 3 * he};
    } else {
      qkv = {b.param(t), b.param(t), b.param(t)};
    }
    auto g = b.param(t);
    auto lay = b.constantInts(layout, ir::DType::I64);
    auto scale = b.constant(0.5, ir::DType::F32), causal = b.constantInt(1, ir::DType::I32);
    auto f = b.customCall(plugins::cpu::kAttentionForward, {qkv[0], qkv[1], qkv[2], lay, scale, causal}, {t, lse_t});
    auto d = b.customCall(plugins::cpu::kAttentionBackward, {g, qkv[0], qkv[1], qkv[2], f[0], f[1], lay, scale, causal},
                          packed_grads ? std::vector<ir::Type>{packed_t} : std::vector<ir::Type>{t, t, t});
    b.output(f[0]);
    for (const auto& r : d) b.output(r);
    auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
    std::vector<std::unique_ptr<pjrt::Buffer>> bufs;
    if (packed) {
      bufs.push_back(client().fromHost(hqkv.data(), pjrt::ElementType::F32, packed_t.shape, 0));
    } else {
      for (auto* h : {&hq, &hk, &hv}) bufs.push_back(client().fromHost(h->data(), pjrt::ElementType::F32, t.shape, 0));
    }
    bufs.push_back(client().fromHost(hg.data(), pjrt::ElementType::F32, t.shape, 0));
    std::vector<PJRT_Buffer*> args;
    for (auto& buf : bufs) args.push_back(buf->raw());
    auto outs = exe->execute(args, client().devices()[0].raw);
    const std::vector<double>* want[4] = {&out, &dq, &dk, &dv};
    std::vector<std::vector<float>> got(4, std::vector<float>(t.numel()));
    outs[0]->toHost(got[0].data(), got[0].size() * sizeof(float));
    if (packed_grads) {
      std::vector<float> all(packed_t.numel());
      outs[1]->toHost(all.data(), all.size() * sizeof(float));
      for (int64_t r = 0; r < c.L; ++r)
        for (int i = 0; i < 3; ++i) std::copy_n(all.data() + r * 3 * he + i * he, he, got[1 + i].data() + r * he);
    } else {
      for (int i = 1; i < 4; ++i) outs[i]->toHost(got[i].data(), got[i].size() * sizeof(float));
    }
    const char* what[3] = {"separate", "packed", "packed gradients"};
    for (int i = 0; i < 4; ++i) expectNear(got[i], *want[i], what[mode]);
    if (mode == 1) packed_inputs_grads.assign(got.begin() + 1, got.end());
    if (mode == 2)
      for (int i = 0; i < 3; ++i) EXPECT_EQ(got[1 + i], packed_inputs_grads[i]) << "gradient " << i;
  }
}

// Runs the one-parameter program `b` (parameter type t) and expects the
// plugin to report the kernel's error `what`.
void expectKernelError(ir::Builder& b, const ir::Type& t, const std::string& what) {
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  std::vector<float> h(t.numel(), 1.0f);
  auto buf = client().fromHost(h.data(), pjrt::ElementType::F32, t.shape, 0);
  try {
    auto outs = exe->execute({buf->raw()}, client().devices()[0].raw);
    outs[0]->toHost(h.data(), h.size() * sizeof(float));
    FAIL() << "expected an error";
  } catch (const pjrt::Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(AttentionKernel, BadOperandsAreAnErrorWithTheTargetName) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {1, 1, 4, 8}};
  auto q = b.param(t);
  // Four operands instead of five.
  auto r = b.customCall(plugins::cpu::kAttentionForward, {q, q, q, b.constant(0.5, ir::DType::F32)},
                        {t, ir::Type{ir::DType::F32, {1, 1, 4}}});
  b.output(r[0]);
  expectKernelError(b, t, "torch_tpu_attention_fwd: wrong number of operands");
}

TEST(AttentionKernel, ALayoutOutsideItsBufferIsAnError) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {1, 4, 2, 8}};
  auto q = b.param(t);
  // k's rows start 8 elements in: its last row runs past the buffer.
  auto lay = b.constantInts({4, 0, 16, 8, 16, 0, 16}, ir::DType::I64);
  auto r = b.customCall(plugins::cpu::kAttentionForward,
                        {q, q, q, lay, b.constant(0.5, ir::DType::F32), b.constantInt(0, ir::DType::I32)},
                        {t, ir::Type{ir::DType::F32, {1, 2, 4}}});
  b.output(r[0]);
  expectKernelError(b, t, "torch_tpu_attention_fwd: the k layout does not fit its buffer");
}

TEST(AttentionKernel, PackedGradientsNeedQkvToTileTheBuffer) {
  // One result for the three gradients, but k's rows start where q's do: the
  // result's last third would be left unwritten, so the call is refused.
  ir::Builder b;
  const int64_t L = 4, H = 2, E = 8, he = H * E;
  ir::Type packed_t{ir::DType::F32, {1, L, 3 * he}};
  auto p = b.param(packed_t);
  auto rows = b.constant(0.5, ir::DType::F32, {1, L, H, E});
  auto lse = b.constant(0.0, ir::DType::F32, {1, H, L});
  auto lay = b.constantInts({L, 0, 3 * he, 0, 3 * he, he, 3 * he}, ir::DType::I64);
  auto r = b.customCall(
      plugins::cpu::kAttentionBackward,
      {rows, p, p, p, rows, lse, lay, b.constant(0.5, ir::DType::F32), b.constantInt(1, ir::DType::I32)}, {packed_t});
  b.output(r[0]);
  expectKernelError(b, packed_t, "torch_tpu_attention_bwd: packed gradients need q, k and v to tile one buffer's rows");
}

// Layer norm over rows of n in double: y, mean, rstd and the gradients.
struct LayerNormRef {
  std::vector<double> y, mean, rstd, dx, dw, db;
};
LayerNormRef layerNormReference(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b,
                                const std::vector<float>& dy, int64_t M, int64_t N, double eps) {
  LayerNormRef r;
  r.y.assign(M * N, 0);
  r.dx.assign(M * N, 0);
  r.dw.assign(N, 0);
  r.db.assign(N, 0);
  for (int64_t i = 0; i < M; ++i) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < N; ++j) m += x[i * N + j];
    m /= N;
    for (int64_t j = 0; j < N; ++j) v += (x[i * N + j] - m) * (x[i * N + j] - m);
    double rs = 1.0 / std::sqrt(v / N + eps);
    r.mean.push_back(m);
    r.rstd.push_back(rs);
    double a = 0, c = 0;
    for (int64_t j = 0; j < N; ++j) {
      double xh = (x[i * N + j] - m) * rs;
      r.y[i * N + j] = xh * w[j] + b[j];
      a += double(dy[i * N + j]) * w[j];
      c += double(dy[i * N + j]) * w[j] * xh;
      r.dw[j] += double(dy[i * N + j]) * xh;
      r.db[j] += dy[i * N + j];
    }
    for (int64_t j = 0; j < N; ++j) {
      double xh = (x[i * N + j] - m) * rs;
      r.dx[i * N + j] = rs * (double(dy[i * N + j]) * w[j] - a / N - xh * c / N);
    }
  }
  return r;
}

// "M<rows>_N<columns>": the test name of a row kernel's shape.
std::string rowsByColumns(const ::testing::TestParamInfo<std::pair<int64_t, int64_t>>& i) {
  return "M" + std::to_string(i.param.first) + "_N" + std::to_string(i.param.second);
}

class LayerNormKernel : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(LayerNormKernel, MatchesTheDoublePrecisionReference) {
  auto [M, N] = GetParam();
  // Rows off zero (mean 3) so that a one-pass variance would show.
  auto x = randomVec(M * N, 1), w = randomVec(N, 2), b = randomVec(N, 3), dy = randomVec(M * N, 4);
  for (auto& v : x) v = 3.0f + 2.0f * v;
  std::vector<float> y(M * N), mean(M), rstd(M), dx(M * N), dw(N), db(N);
  plugins::cpu::layerNormForward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), M, N, 1e-5f);
  plugins::cpu::layerNormBackward(dy.data(), x.data(), mean.data(), rstd.data(), w.data(), dx.data(), dw.data(),
                                  db.data(), M, N);
  LayerNormRef r = layerNormReference(x, w, b, dy, M, N, 1e-5);
  expectNear(y, r.y, "y");
  expectNear(mean, r.mean, "mean");
  expectNear(rstd, r.rstd, "rstd");
  expectNear(dx, r.dx, "dx");
  expectNear(dw, r.dw, "dw");
  expectNear(db, r.db, "db");
}

// Widths that fill whole vectors (and four at a time) and ones with a tail.
INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormKernel,
                         ::testing::Values(std::make_pair<int64_t, int64_t>(64, 64),
                                           std::make_pair<int64_t, int64_t>(5, 13),
                                           std::make_pair<int64_t, int64_t>(3, 40),
                                           std::make_pair<int64_t, int64_t>(1, 8),
                                           // three blocks of rows, the last one short
                                           std::make_pair<int64_t, int64_t>(300, 24)),
                         rowsByColumns);

TEST(LayerNormKernel, BadOperandsAreAnErrorWithTheTargetName) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {4, 8}};
  auto x = b.param(t);
  // The weight has 4 elements for rows of 8.
  auto w = b.constant(1.0, ir::DType::F32, {4});
  auto r = b.customCall(plugins::cpu::kLayerNormForward, {x, w, w, b.constant(1e-5, ir::DType::F32)},
                        {t, ir::Type{ir::DType::F32, {4}}, ir::Type{ir::DType::F32, {4}}});
  b.output(r[0]);
  expectKernelError(b, t, "torch_tpu_layer_norm_fwd: the weight does not match the rows");
}

TEST(LayerNormKernel, RunsInsideAnXlaProgramWithTheSameBitsAsOnOneThread) {
  // 1000 rows: eight blocks, spread over XLA's threads inside the program.
  const int64_t M = 1000, N = 64;
  ir::Builder b;
  ir::Type t{ir::DType::F32, {M, N}}, rows{ir::DType::F32, {M}}, cols{ir::DType::F32, {N}};
  auto x = b.param(t), dy = b.param(t), w = b.param(cols), bias = b.param(cols);
  auto f =
      b.customCall(plugins::cpu::kLayerNormForward, {x, w, bias, b.constant(1e-5, ir::DType::F32)}, {t, rows, rows});
  auto g = b.customCall(plugins::cpu::kLayerNormBackward, {dy, x, f[1], f[2], w}, {t, cols, cols});
  b.output(f[0]);
  b.output(g[0]);
  b.output(g[1]);
  b.output(g[2]);
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  auto hx = randomVec(M * N, 11), hdy = randomVec(M * N, 12), hw = randomVec(N, 13), hb = randomVec(N, 14);
  std::vector<std::unique_ptr<pjrt::Buffer>> bufs;
  bufs.push_back(client().fromHost(hx.data(), pjrt::ElementType::F32, t.shape, 0));
  bufs.push_back(client().fromHost(hdy.data(), pjrt::ElementType::F32, t.shape, 0));
  bufs.push_back(client().fromHost(hw.data(), pjrt::ElementType::F32, cols.shape, 0));
  bufs.push_back(client().fromHost(hb.data(), pjrt::ElementType::F32, cols.shape, 0));
  auto outs = exe->execute({bufs[0]->raw(), bufs[1]->raw(), bufs[2]->raw(), bufs[3]->raw()}, client().devices()[0].raw);
  std::vector<float> y(M * N), mean(M), rstd(M), dx(M * N), dw(N), db(N);
  plugins::cpu::layerNormForward(hx.data(), hw.data(), hb.data(), y.data(), mean.data(), rstd.data(), M, N, 1e-5f);
  plugins::cpu::layerNormBackward(hdy.data(), hx.data(), mean.data(), rstd.data(), hw.data(), dx.data(), dw.data(),
                                  db.data(), M, N);
  for (auto [i, want] : {std::pair<int, std::vector<float>*>{0, &y}, {1, &dx}, {2, &dw}, {3, &db}}) {
    std::vector<float> got(want->size());
    outs[i]->toHost(got.data(), got.size() * sizeof(float));
    EXPECT_EQ(got, *want) << "output " << i;
  }
}

// ------------------------------------------------- softmax

class SoftmaxKernel : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(SoftmaxKernel, MatchesTheDoublePrecisionReference) {
  auto [M, N] = GetParam();
  auto x = randomVec(M * N, 31);
  for (auto& v : x) v *= 8.0f;  // values far apart, so that the shift by the max matters
  for (bool log : {false, true}) {
    std::vector<float> y(M * N);
    plugins::cpu::softmaxForward(x.data(), y.data(), M, N, log);
    std::vector<double> want(M * N);
    for (int64_t i = 0; i < M; ++i) {
      const float* r = x.data() + i * N;
      double m = *std::max_element(r, r + N), s = 0.0;
      for (int64_t j = 0; j < N; ++j) s += std::exp(double(r[j]) - m);
      for (int64_t j = 0; j < N; ++j)
        want[i * N + j] = log ? double(r[j]) - m - std::log(s) : std::exp(double(r[j]) - m) / s;
    }
    expectNear(y, want, log ? "log_softmax" : "softmax");
  }
}

// Whole vectors, tails, one row, and several blocks of rows with a short last one.
INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxKernel,
                         ::testing::Values(std::make_pair<int64_t, int64_t>(64, 96),
                                           std::make_pair<int64_t, int64_t>(5, 13),
                                           std::make_pair<int64_t, int64_t>(1, 8),
                                           std::make_pair<int64_t, int64_t>(300, 1001)),
                         rowsByColumns);

TEST(SoftmaxKernel, RowsWithAnInfiniteMaxOrANanAreNan) {
  // As PyTorch: +inf gives inf - inf, an all -inf row -inf - -inf, and a NaN
  // reaches every element through the sum. The other rows are untouched.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t N = 12;
  std::vector<float> x(4 * N, 0.5f);
  x[N + 3] = inf;
  std::fill(x.begin() + 2 * N, x.begin() + 3 * N, -inf);
  x[3 * N + 10] = nan;
  for (bool log : {false, true}) {
    std::vector<float> y(4 * N);
    plugins::cpu::softmaxForward(x.data(), y.data(), 4, N, log);
    for (int64_t j = 0; j < N; ++j) EXPECT_NEAR(y[j], log ? -std::log(12.0f) : 1.0f / 12, 1e-6) << j;
    for (int64_t j = N; j < 4 * N; ++j) EXPECT_TRUE(std::isnan(y[j])) << "log " << log << " element " << j;
  }
}

TEST(SoftmaxKernel, BadOperandsAreAnErrorWithTheTargetName) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {4, 8}};
  auto x = b.param(t);
  // The flag is a float.
  auto r = b.customCall(plugins::cpu::kSoftmaxForward, {x, b.constant(1.0, ir::DType::F32)}, {t});
  b.output(r[0]);
  expectKernelError(b, t, "torch_tpu_softmax_fwd: the log flag is not int32");
}

TEST(SoftmaxKernel, RunsInsideAnXlaProgramWithTheSameBitsAsOnOneThread) {
  const int64_t M = 1000, N = 96;  // eight blocks of rows over XLA's threads
  ir::Builder b;
  ir::Type t{ir::DType::F32, {M, N}};
  auto x = b.param(t);
  b.output(b.customCall(plugins::cpu::kSoftmaxForward, {x, b.constantInt(1, ir::DType::I32)}, {t})[0]);
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  auto hx = randomVec(M * N, 32);
  auto in = client().fromHost(hx.data(), pjrt::ElementType::F32, t.shape, 0);
  auto outs = exe->execute({in->raw()}, client().devices()[0].raw);
  std::vector<float> want(M * N), got(M * N);
  plugins::cpu::softmaxForward(hx.data(), want.data(), M, N, true);
  outs[0]->toHost(got.data(), got.size() * sizeof(float));
  EXPECT_EQ(got, want);
}

// ------------------------------------------------- GEMM

// Row-major c = op(a) op(b) in double; a is [M, K] ([K, M] transposed), b
// [K, N] ([N, K] transposed).
std::vector<double> productReference(const std::vector<float>& a, const std::vector<float>& b, int64_t M, int64_t N,
                                     int64_t K, bool ta, bool tb) {
  std::vector<double> c(M * N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t l = 0; l < K; ++l)
        c[i * N + j] += double(ta ? a[l * M + i] : a[i * K + l]) * double(tb ? b[j * K + l] : b[l * N + j]);
  return c;
}

struct GemmCase {
  int64_t M, N, K;
};

class GemmKernel : public ::testing::TestWithParam<GemmCase> {};

// Every transpose combination, split into row blocks (M >= N) or column
// blocks, on one thread and on three.
TEST_P(GemmKernel, MatchesTheReferenceForEveryTransposeAndSplit) {
  usePlainBlas();
  const GemmCase g = GetParam();
  auto a = randomVec(g.M * g.K, 21), b = randomVec(g.K * g.N, 22);
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    auto want = productReference(a, b, g.M, g.N, g.K, ta, tb);
    for (int64_t threads : {1, 3}) {
      std::vector<float> c(g.M * g.N, 123.0f);
      plugins::cpu::gemm(a.data(), b.data(), c.data(), g.M, g.N, g.K, ta, tb, threads);
      expectNear(
          c, want,
          ("ta " + std::to_string(ta) + " tb " + std::to_string(tb) + " threads " + std::to_string(threads)).c_str());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmKernel,
                         ::testing::Values(GemmCase{300, 37, 19}, GemmCase{37, 300, 19}, GemmCase{129, 17, 64},
                                           GemmCase{1, 1, 1}, GemmCase{64, 64, 0}, GemmCase{1000, 200, 8}),
                         [](const ::testing::TestParamInfo<GemmCase>& i) {
                           return "M" + std::to_string(i.param.M) + "_N" + std::to_string(i.param.N) + "_K" +
                                  std::to_string(i.param.K);
                         });

// alpha op(a) op(b) + beta bias, every transpose and split; beta 0 ignores
// a NaN bias, and an empty product leaves beta bias.
TEST(GemmKernel, AddsTheBiasRowAsTheProductIsWritten) {
  usePlainBlas();
  for (const GemmCase& g : {GemmCase{300, 37, 19}, GemmCase{37, 300, 19}, GemmCase{5, 7, 0}}) {
    auto a = randomVec(g.M * g.K, 41), b = randomVec(g.K * g.N, 42), bias = randomVec(g.N, 43);
    std::vector<float> nan_bias(g.N, std::nanf(""));
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      auto product = productReference(a, b, g.M, g.N, g.K, ta, tb);
      for (int64_t threads : {1, 3}) {
        std::vector<double> want(product.size()), scaled(product.size());
        for (size_t i = 0; i < want.size(); ++i) {
          want[i] = 2.0 * product[i] + 0.5 * bias[i % g.N];
          scaled[i] = 2.0 * product[i];
        }
        std::vector<float> c(g.M * g.N, 123.0f);
        plugins::cpu::gemm(a.data(), b.data(), c.data(), g.M, g.N, g.K, ta, tb, threads, {2.0f, bias.data(), 0.5f});
        expectNear(c, want, "alpha 2, beta 0.5");
        std::fill(c.begin(), c.end(), 123.0f);
        plugins::cpu::gemm(a.data(), b.data(), c.data(), g.M, g.N, g.K, ta, tb, threads, {2.0f, nan_bias.data(), 0.0f});
        expectNear(c, scaled, "beta 0, a NaN bias");
      }
    }
  }
}

TEST(GemmKernel, WithoutAHostBlasIsAnError) {
  plugins::cpu::setHostBlas({});
  std::vector<float> a(4, 1.0f), c(4);
  EXPECT_THROW(plugins::cpu::gemm(a.data(), a.data(), c.data(), 2, 2, 2, false, false), std::runtime_error);
  usePlainBlas();
}

TEST(GemmKernel, RunsInsideAnXlaProgramSingleThreadedPerCall) {
  // Both operands transposed; 512 rows: blocks over XLA's threads.
  const int64_t M = 512, N = 48, K = 40;
  ir::Builder b;
  ir::Type ta{ir::DType::F32, {K, M}}, tb{ir::DType::F32, {N, K}};
  auto x = b.param(ta), y = b.param(tb);
  b.output(b.customCall(plugins::cpu::kGemm, {x, y, b.constantInt(3, ir::DType::I32)},
                        {ir::Type{ir::DType::F32, {M, N}}})[0]);
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  auto ha = randomVec(M * K, 31), hb = randomVec(N * K, 32);
  auto ba = client().fromHost(ha.data(), pjrt::ElementType::F32, ta.shape, 0);
  auto bb = client().fromHost(hb.data(), pjrt::ElementType::F32, tb.shape, 0);
  const int sets = g_single_threaded_sets.load(), restores = g_restores.load();
  const int unsafe = g_calls_not_single_threaded.load();
  auto outs = exe->execute({ba->raw(), bb->raw()}, client().devices()[0].raw);
  std::vector<float> got(M * N);
  outs[0]->toHost(got.data(), got.size() * sizeof(float));
  expectNear(got, productReference(ha, hb, M, N, K, true, true), "c");
  // Every block's BLAS call ran single-threaded on its thread, and each block
  // put that thread's setting back (to 0, which no block set).
  EXPECT_GE(g_single_threaded_sets.load() - sets, 2);
  EXPECT_EQ(g_restores.load() - restores, g_single_threaded_sets.load() - sets);
  EXPECT_EQ(g_calls_not_single_threaded.load(), unsafe);
}

TEST(GemmKernel, BadOperandsAreAnErrorWithTheTargetName) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {4, 8}};
  auto x = b.param(t);
  // [4, 8] @ [4, 8]: the contracted sizes differ.
  b.output(b.customCall(plugins::cpu::kGemm, {x, x, b.constantInt(0, ir::DType::I32)},
                        {ir::Type{ir::DType::F32, {4, 8}}})[0]);
  expectKernelError(b, t, "torch_tpu_gemm: the contracted sizes differ");
}

TEST(GemmKernel, ABiasOfTheWrongSizeIsAnError) {
  ir::Builder b;
  ir::Type t{ir::DType::F32, {8, 8}};
  auto x = b.param(t);
  auto bias = b.constant(1.0, ir::DType::F32, {4});  // N is 8
  auto one = b.constant(1.0, ir::DType::F32);
  b.output(b.customCall(plugins::cpu::kGemm, {x, x, b.constantInt(0, ir::DType::I32), bias, one, one},
                        {ir::Type{ir::DType::F32, {8, 8}}})[0]);
  expectKernelError(b, t, "torch_tpu_gemm: the bias is not float32 [N]");
}

// ------------------------------------------------- XLA's intra-op pool

// A stand-in for the FFI API of a plugin: NumThreads answers `threads`,
// Schedule runs a task on a new thread, queues it, or refuses it. The call's
// context pointer is the FakeFfi itself.
struct FakeFfi {
  enum class Schedule { kThread, kQueue, kRefuse };
  xla_ffi::FfiApi api{};
  int64_t threads = 2;
  bool refuse_threads = false;
  Schedule schedule = Schedule::kThread;
  std::vector<std::thread> running;
  std::vector<std::pair<void (*)(void*), void*>> queued;
  int scheduled = 0;
  static inline int errors_destroyed = 0;
  static inline int error_token = 0;

  FakeFfi() {
    api.struct_size = sizeof(api);
    api.error_destroy = [](void*) { ++errors_destroyed; };
    api.thread_pool_num_threads = [](void* a) -> void* {
      auto* args = static_cast<xla_ffi::FfiThreadPoolNumThreadsArgs*>(a);
      auto* self = static_cast<FakeFfi*>(args->ctx);
      if (self->refuse_threads) return &error_token;
      *args->num_threads = self->threads;
      return nullptr;
    };
    api.thread_pool_schedule = [](void* a) -> void* {
      auto* args = static_cast<xla_ffi::FfiThreadPoolScheduleArgs*>(a);
      auto* self = static_cast<FakeFfi*>(args->ctx);
      if (self->schedule == Schedule::kRefuse) return &error_token;
      ++self->scheduled;
      if (self->schedule == Schedule::kThread) {
        self->running.emplace_back(args->task, args->data);
      } else {
        self->queued.emplace_back(args->task, args->data);
      }
      return nullptr;
    };
  }
  ~FakeFfi() {
    for (auto& t : running) t.join();
  }
  plugins::cpu::XlaPool pool() { return plugins::cpu::xlaPoolOf(&api, this); }
};

// Runs parallelFor over n items and returns how many times each item ran.
std::vector<int> countRuns(const plugins::cpu::XlaPool& pool, int64_t n) {
  std::vector<std::atomic<int>> runs(n);
  plugins::cpu::parallelFor(pool, n, [&](int64_t i) { runs[i].fetch_add(1); });
  std::vector<int> out;
  for (auto& r : runs) out.push_back(r.load());
  return out;
}

TEST(XlaPool, ReadsTheThreadCountFromTheCallsApi) {
  FakeFfi fake;
  fake.threads = 3;
  EXPECT_EQ(fake.pool().threads, 3);
}

TEST(XlaPool, AnFfiWithoutAThreadPoolGivesNone) {
  FakeFfi fake;
  // An older plugin's API table ends before the thread-pool functions.
  fake.api.struct_size = offsetof(xla_ffi::FfiApi, thread_pool_schedule);
  EXPECT_EQ(fake.pool().threads, 0);
  EXPECT_EQ(plugins::cpu::xlaPoolOf(nullptr, nullptr).threads, 0);
  // A plugin that has the functions but no pool for this call answers with an error.
  FakeFfi refusing;
  refusing.refuse_threads = true;
  int destroyed = FakeFfi::errors_destroyed;
  EXPECT_EQ(refusing.pool().threads, 0);
  EXPECT_EQ(FakeFfi::errors_destroyed, destroyed + 1);
  // Without XLA's pool every item still runs once (on HostPool).
  EXPECT_EQ(countRuns(refusing.pool(), 100), std::vector<int>(100, 1));
}

TEST(XlaPool, EveryItemRunsOnceOnTheCallerAndItsHelpers) {
  FakeFfi fake;
  fake.threads = 4;
  // Items slow enough that the helpers get some of them.
  std::vector<std::atomic<int>> runs(64);
  std::mutex mu;
  std::set<std::thread::id> ran_on;
  {
    auto pool = fake.pool();
    plugins::cpu::parallelFor(pool, 64, [&](int64_t i) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      runs[i].fetch_add(1);
      std::lock_guard<std::mutex> g(mu);
      ran_on.insert(std::this_thread::get_id());
    });
  }
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  EXPECT_EQ(fake.scheduled, 3);  // threads - 1 helpers
  EXPECT_GT(ran_on.size(), 1u);
  // Fewer items than threads: no more helpers than items - 1.
  FakeFfi few;
  few.threads = 8;
  EXPECT_EQ(countRuns(few.pool(), 2), std::vector<int>(2, 1));
  EXPECT_EQ(few.scheduled, 1);
}

double threadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The caller of a loop whose last item a helper still runs blocks until it
// is done: it neither burns its core spinning nor yields it (a yield can hand
// the core to a core spinner for a whole time slice).
TEST(XlaPool, TheCallerSleepsWhileAHelperFinishesALongItem) {
  FakeFfi fake;
  auto pool = fake.pool();
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> helper_started{false};
  std::vector<std::atomic<int>> runs(2);
  double cpu_after_own_item = 0;
  std::chrono::steady_clock::time_point wall_after_own_item;
  plugins::cpu::parallelFor(pool, 2, [&](int64_t i) {
    runs[i].fetch_add(1);
    if (std::this_thread::get_id() != caller) {
      helper_started = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(60));
      return;
    }
    // The caller's item waits until the helper holds the other one.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!helper_started && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    cpu_after_own_item = threadCpuSeconds();
    wall_after_own_item = std::chrono::steady_clock::now();
  });
  ASSERT_TRUE(helper_started.load());
  const double cpu = threadCpuSeconds() - cpu_after_own_item;
  const auto wall = std::chrono::steady_clock::now() - wall_after_own_item;
  EXPECT_EQ(runs[0].load(), 1);
  EXPECT_EQ(runs[1].load(), 1);
  EXPECT_GE(wall, std::chrono::milliseconds(40));  // it did wait for the helper
  EXPECT_LT(cpu, 0.02);                            // ... mostly asleep (spinning would be ~0.06 s)
}

TEST(XlaPool, RefusedHelpersLeaveEveryItemToTheCaller) {
  FakeFfi fake;
  auto pool = fake.pool();
  fake.schedule = FakeFfi::Schedule::kRefuse;
  int destroyed = FakeFfi::errors_destroyed;
  std::set<std::thread::id> ran_on;
  plugins::cpu::parallelFor(pool, 50, [&](int64_t) { ran_on.insert(std::this_thread::get_id()); });
  EXPECT_EQ(ran_on, std::set<std::thread::id>{std::this_thread::get_id()});
  EXPECT_EQ(FakeFfi::errors_destroyed, destroyed + 1);
}

TEST(XlaPool, AHelperThatStartsAfterTheLoopEndedDoesNothing) {
  FakeFfi fake;
  auto pool = fake.pool();
  fake.schedule = FakeFfi::Schedule::kQueue;
  std::vector<int> runs(40, 0);
  int calls = 0;
  {
    std::function<void(int64_t)> fn = [&](int64_t i) {
      ++runs[i];
      ++calls;
    };
    plugins::cpu::parallelFor(pool, 40, fn);
  }  // the loop's function is gone
  ASSERT_EQ(fake.queued.size(), 1u);
  fake.queued[0].first(fake.queued[0].second);  // must not call it
  EXPECT_EQ(calls, 40);
  EXPECT_EQ(runs, std::vector<int>(40, 1));
}

}  // namespace
