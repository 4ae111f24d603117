// Units for the PJRT layer and the IR emitter against the CPU plugin.
#include "pjrt/pjrt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "ir/ir.h"
#include "runtime/collectives.h"

using namespace tpu;

namespace {

std::vector<std::string> searchDirs() {
  const char* p = std::getenv("TORCH_TPU_PLUGIN_PATH");
  std::vector<std::string> dirs;
  if (p) dirs.push_back(p);
  return dirs;
}

pjrt::Client& client() {
  static std::unique_ptr<pjrt::Client> c = [] {
    auto api = pjrt::Api::load(pjrt::resolvePluginPath("cpu", searchDirs()));
    return pjrt::Client::create(api, {{{"cpu_device_count", int64_t{2}}, {"asynchronous", true}}, nullptr});
  }();
  return *c;
}

std::vector<float> run(const ir::Builder& b, const std::vector<std::vector<float>>& inputs) {
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  std::vector<std::unique_ptr<pjrt::Buffer>> bufs;
  std::vector<PJRT_Buffer*> raw;
  for (size_t i = 0; i < inputs.size(); ++i) {
    bufs.push_back(client().fromHost(inputs[i].data(), pjrt::ElementType::F32, b.paramTypes()[i].shape, 0));
    raw.push_back(bufs.back()->raw());
  }
  auto outs = exe->execute(raw, client().devices()[0].raw);
  std::vector<float> host(outs[0]->hostBytes() / sizeof(float));
  outs[0]->toHost(host.data(), host.size() * sizeof(float));
  return host;
}

}  // namespace

TEST(Plugin, ResolvesNamedPlugins) {
  EXPECT_NO_THROW(pjrt::resolvePluginPath("cpu", searchDirs()));
  EXPECT_NO_THROW(pjrt::resolvePluginPath("", searchDirs()));
}

TEST(Plugin, MissingPluginSaysWhatToInstall) {
  try {
    pjrt::resolvePluginPath("tpu", {"/nonexistent"});
    FAIL() << "expected PluginError";
  } catch (const pjrt::PluginError& e) {
    EXPECT_NE(std::string(e.what()).find("pip install libtpu"), std::string::npos);
  }
  EXPECT_THROW(pjrt::resolvePluginPath("/no/such/plugin.so", {}), pjrt::PluginError);
  EXPECT_THROW(pjrt::resolvePluginPath("gpu9", {}), pjrt::PluginError);
}

TEST(Plugin, NonPluginLibraryIsRejected) { EXPECT_THROW(pjrt::Api::load("libm.so.6"), pjrt::PluginError); }

TEST(Client, ListsRequestedCpuDevices) {
  EXPECT_EQ(client().devices().size(), 2u);
  EXPECT_EQ(client().platformName(), "cpu");
}

TEST(Client, CpuDevicesHaveGlobalIdsAndOneProcess) {
  for (size_t i = 0; i < client().devices().size(); ++i)
    EXPECT_EQ(client().devices()[i].global_id, static_cast<int>(i));
  EXPECT_EQ(client().globalDeviceCount(), 2);
  EXPECT_FALSE(client().spansProcesses());
}

// The key-value callbacks a multi-process plugin calls, over an in-memory store.
namespace {
struct MemoryStore final : pjrt::KeyValueStore {
  std::map<std::string, std::string> kv;
  bool broken = false;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    auto it = kv.find(key);
    if (it == kv.end())
      throw pjrt::KeyValueTimeout("no '" + key + "' after " + std::to_string(timeout.count()) + " ms");
    return it->second;
  }
  std::optional<std::string> tryGet(const std::string& key) override {
    if (broken) throw std::runtime_error("connection reset by peer");
    auto it = kv.find(key);
    return it == kv.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  void put(const std::string& key, const std::string& value) override { kv[key] = value; }
};

// What the plugin's PJRT_CallbackError returns, as a test can see it.
struct CallbackFailure {
  PJRT_Error_Code code;
  std::string message;
};
thread_local CallbackFailure last_failure;
PJRT_Error* recordFailure(PJRT_Error_Code code, const char* message, size_t size) {
  last_failure = {code, std::string(message, size)};
  return reinterpret_cast<PJRT_Error*>(&last_failure);
}
PJRT_CallbackError record_failure = recordFailure;

template <typename Args>
Args kvArgs(MemoryStore& store, const std::string& key) {
  Args a{};
  a.struct_size = sizeof(Args);
  a.key = key.data();
  a.key_size = key.size();
  a.callback_error = &record_failure;
  a.user_arg = static_cast<pjrt::KeyValueStore*>(&store);
  return a;
}

template <typename Args>
std::string takeValue(Args& a) {
  std::string v(a.value, a.value_size);
  a.value_deleter_callback(a.value);
  return v;
}
}  // namespace

TEST(KeyValueBridge, PutThenGetAndTryGet) {
  MemoryStore store;
  const std::string key = "nccl/clique/0", value("id\0with a zero", 15);
  auto put = kvArgs<PJRT_KeyValuePutCallback_Args>(store, key);
  put.value = value.data();
  put.value_size = value.size();
  ASSERT_EQ(pjrt::kv_bridge::put(&put), nullptr);
  auto get = kvArgs<PJRT_KeyValueGetCallback_Args>(store, key);
  get.timeout_in_ms = 10;
  ASSERT_EQ(pjrt::kv_bridge::get(&get), nullptr);
  EXPECT_EQ(takeValue(get), value);
  auto tried = kvArgs<PJRT_KeyValueTryGetCallback_Args>(store, key);
  ASSERT_EQ(pjrt::kv_bridge::tryGet(&tried), nullptr);
  EXPECT_EQ(takeValue(tried), value);
}

TEST(KeyValueBridge, MissesAndFailuresBecomeCallbackErrors) {
  MemoryStore store;
  auto tried = kvArgs<PJRT_KeyValueTryGetCallback_Args>(store, "absent");
  EXPECT_EQ(pjrt::kv_bridge::tryGet(&tried), reinterpret_cast<PJRT_Error*>(&last_failure));
  EXPECT_EQ(last_failure.code, PJRT_Error_Code_NOT_FOUND);
  EXPECT_NE(last_failure.message.find("absent"), std::string::npos);

  auto get = kvArgs<PJRT_KeyValueGetCallback_Args>(store, "late");
  get.timeout_in_ms = 25;
  EXPECT_NE(pjrt::kv_bridge::get(&get), nullptr);
  EXPECT_EQ(last_failure.code, PJRT_Error_Code_DEADLINE_EXCEEDED);
  EXPECT_NE(last_failure.message.find("25 ms"), std::string::npos);

  store.broken = true;
  auto broken = kvArgs<PJRT_KeyValueTryGetCallback_Args>(store, "any");
  EXPECT_NE(pjrt::kv_bridge::tryGet(&broken), nullptr);
  EXPECT_EQ(last_failure.code, PJRT_Error_Code_UNAVAILABLE);
  EXPECT_NE(last_failure.message.find("connection reset by peer"), std::string::npos);
}

TEST(Client, HostRoundTrip) {
  std::vector<float> x{1, 2, 3, 4, 5, 6};
  auto buf = client().fromHost(x.data(), pjrt::ElementType::F32, {2, 3}, 1);
  EXPECT_EQ(buf->dims(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(buf->elementType(), pjrt::ElementType::F32);
  std::vector<float> y(6);
  buf->toHost(y.data(), y.size() * 4);
  EXPECT_EQ(x, y);
}

TEST(Client, CpuBuffersAreReadableInPlace) {
  // The runtime reads CPU-plugin results at this address instead of asking
  // the plugin for a copy: it must be the dense row-major value.
  std::vector<float> x{1, 2, 3, 4, 5, 6};
  auto buf = client().fromHost(x.data(), pjrt::ElementType::F32, {2, 3}, 0);
  buf->awaitReady();
  const void* p = buf->unsafePointer();
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(buf->onDeviceBytes(), x.size() * 4);
  EXPECT_EQ(std::memcmp(p, x.data(), x.size() * 4), 0);
}

TEST(Compile, ElementwiseProgramRuns) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {2, 3}});
  auto y = b.param({ir::DType::F32, {2, 3}});
  auto s = b.binary("add", x, y);
  auto two = b.constant(2.0, ir::DType::F32, {2, 3});
  b.output(b.binary("multiply", s, two));
  auto out = run(b, {{1, 2, 3, 4, 5, 6}, {1, 1, 1, 1, 1, 1}});
  EXPECT_EQ(out, (std::vector<float>{4, 6, 8, 10, 12, 14}));
}

TEST(Compile, CompletionEventCallsOnReadyOnce) {
  // The core spinner counts an async launch as finished through onReady.
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {256, 256}});
  b.output(b.dotGeneral(x, x, {}, {}, {1}, {0}, ir::DType::F32));
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  std::vector<float> ones(256 * 256, 1.0f);
  auto in = client().fromHost(ones.data(), pjrt::ElementType::F32, {256, 256}, 0);
  std::shared_ptr<pjrt::Event> done;
  auto outs = exe->execute({in->raw()}, client().devices()[0].raw, &done);
  ASSERT_TRUE(done);
  std::atomic<int> calls{0};
  done->onReady([&calls] { calls++; });
  done->await();
  for (int i = 0; i < 10000 && calls.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::microseconds(100));
  EXPECT_EQ(calls.load(), 1);
  done->onReady([&calls] { calls++; });  // already ready: runs at once
  EXPECT_EQ(calls.load(), 2);
  std::vector<float> host(256 * 256);
  outs[0]->toHost(host.data(), host.size() * sizeof(float));
  EXPECT_EQ(host[0], 256.0f);
}

TEST(Compile, ReduceAndDot) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {2, 3}});
  auto w = b.param({ir::DType::F32, {3, 2}});
  auto d = b.dotGeneral(x, w, {}, {}, {1}, {0}, ir::DType::F32);
  auto zero = b.constant(0.0, ir::DType::F32);
  auto r = b.reduce({d}, {zero}, {1}, [](ir::Builder& bb, const std::vector<ir::Value>& a) {
    return std::vector<ir::Value>{bb.binary("add", a[0], a[1])};
  });
  b.output(r[0]);
  auto out = run(b, {{1, 2, 3, 4, 5, 6}, {1, 0, 0, 1, 1, 1}});
  // rows: [1+3, 2+3] = [4,5] -> 9 ; [4+6, 5+6] = [10, 11] -> 21
  EXPECT_EQ(out, (std::vector<float>{9, 21}));
}

// Sums of a [2, 3, 4] iota over each set of dims: adjacent reduced dims merge
// into one, and with the XLA:CPU tuning a reduction that keeps the minor dim
// reads its operand through a barrier. Values must not change either way.
TEST(Compile, ReduceMergesAdjacentDimsAndKeepsTheResultShape) {
  auto sum = [](ir::Builder& b, const ir::Value& x, std::vector<int64_t> dims) {
    return b.reduce({x}, {b.constant(0.0, ir::DType::F32)}, dims, [](ir::Builder& bb, const std::vector<ir::Value>& a) {
      return std::vector<ir::Value>{bb.binary("add", a[0], a[1])};
    })[0];
  };
  std::vector<float> in(24);
  for (int i = 0; i < 24; ++i) in[i] = static_cast<float>(i);
  auto want = [&](std::vector<int64_t> dims) {
    std::vector<float> out;
    std::vector<int64_t> shape{2, 3, 4}, kept;
    for (int64_t d = 0; d < 3; ++d)
      if (std::find(dims.begin(), dims.end(), d) == dims.end()) kept.push_back(d);
    int64_t n = 1;
    for (auto d : kept) n *= shape[d];
    out.assign(std::max<int64_t>(n, 1), 0.0f);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j)
        for (int64_t k = 0; k < 4; ++k) {
          int64_t idx[3] = {i, j, k}, o = 0;
          for (auto d : kept) o = o * shape[d] + idx[d];
          out[o] += in[(i * 3 + j) * 4 + k];
        }
    return out;
  };
  const bool was_tuned = ir::xlaCpuTuning();  // restored below: later tests read the runtime's setting
  for (bool tuned : {false, true}) {
    ir::setXlaCpuTuning(tuned);
    for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{0, 1}, {1, 2}, {0, 2}, {0, 1, 2}, {0}}) {
      ir::Builder b;
      auto x = b.param({ir::DType::F32, {2, 3, 4}});
      auto r = sum(b, x, dims);
      b.output(b.reshape(r, {r.type.numel()}));
      std::string text = b.emit();
      bool keeps_minor = std::find(dims.begin(), dims.end(), 2) == dims.end();
      EXPECT_EQ(text.find("optimization_barrier") != std::string::npos, tuned && keeps_minor) << text;
      if (dims == std::vector<int64_t>{0, 1}) EXPECT_NE(text.find("tensor<6x4xf32>"), std::string::npos) << text;
      EXPECT_EQ(run(b, {in}), want(dims)) << "dims " << dims.size() << " tuned " << tuned;
    }
  }
  ir::setXlaCpuTuning(was_tuned);
}

TEST(Compile, SortAndGather) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {4}});
  auto sorted = b.sort({x}, 0, true, [](ir::Builder& bb, const std::vector<ir::Value>& a) {
    return std::vector<ir::Value>{bb.compare(a[0], a[1], ir::Cmp::LT)};
  });
  auto idx = b.constantInt(2, ir::DType::I64, {1, 1});
  ir::Builder::GatherDims dn;
  dn.offset_dims = {};
  dn.collapsed_slice_dims = {0};
  dn.start_index_map = {0};
  dn.index_vector_dim = 1;
  auto g = b.gather(sorted[0], idx, dn, {1});
  b.output(g);
  auto out = run(b, {{4, 1, 3, 2}});
  EXPECT_EQ(out, (std::vector<float>{3}));
}

TEST(Compile, ErrorsCarryThePluginMessage) {
  try {
    client().compile("module { this is not mlir }", pjrt::compileOptions(true));
    FAIL() << "expected pjrt::Error";
  } catch (const pjrt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("PJRT_Client_Compile"), std::string::npos);
  }
}

TEST(Compile, SerializeRoundTrip) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {3}});
  b.output(b.unary("negate", x));
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  std::string bytes = exe->serialize();
  ASSERT_FALSE(bytes.empty());
  auto exe2 = client().deserialize(bytes);
  std::vector<float> in{1, 2, 3};
  auto buf = client().fromHost(in.data(), pjrt::ElementType::F32, {3}, 0);
  auto outs = exe2->execute({buf->raw()}, client().devices()[0].raw);
  std::vector<float> o(3);
  outs[0]->toHost(o.data(), 12);
  EXPECT_EQ(o, (std::vector<float>{-1, -2, -3}));
}

// Fused eager calls each op signature's lowering as a private function.
std::shared_ptr<const ir::Function> scaleAndShift(double scale) {
  ir::Builder f;
  auto x = f.param({ir::DType::F32, {2, 3}});
  auto s = f.param({ir::DType::F64, {}});
  auto scaled = f.binary("multiply", x, f.constant(scale, ir::DType::F32, {2, 3}));
  f.output(f.binary("add", scaled, f.broadcastInDim(f.convert(s, ir::DType::F32), {2, 3}, {})));
  f.output(f.reshape(scaled, {6}));
  return f.asFunction();
}

TEST(Compile, CalledFunctionsJoinTheModuleOnce) {
  auto fn = scaleAndShift(2.0);
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {2, 3}});
  auto one = b.constant(1.0, ir::DType::F64);
  auto r1 = b.call(fn, {x, one});
  ASSERT_EQ(r1.size(), 2u);
  auto r2 = b.call(fn, {r1[0], b.constant(-3.0, ir::DType::F64)});  // (2x + 1) * 2 - 3
  b.output(b.binary("add", b.reshape(r2[0], {6}), r1[1]));          // + 2x
  std::string text = b.emit();
  size_t first = text.find("func.func private @" + fn->name);
  ASSERT_NE(first, std::string::npos);
  EXPECT_EQ(text.find("func.func private @" + fn->name, first + 1), std::string::npos);
  EXPECT_EQ(b.opCount(), 2 * fn->op_count + 4);  // the two calls stand for their bodies; 2 constants, reshape, add
  auto out = run(b, {{0, 1, 2, 3, 4, 5}});
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(out[i], (2 * i + 1) * 2 - 3 + 2 * i);
}

TEST(IR, CallsPinTheFunctionBodyInTheFingerprint) {
  auto build = [](double scale) {
    ir::Builder b;
    auto x = b.param({ir::DType::F32, {2, 3}});
    b.output(b.call(scaleAndShift(scale), {x, b.constant(0.0, ir::DType::F64)})[0]);
    return b.fingerprint();
  };
  EXPECT_EQ(build(2.0), build(2.0));
  EXPECT_NE(build(2.0), build(3.0));
}

TEST(IR, CallChecksItsArguments) {
  auto fn = scaleAndShift(2.0);
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {3, 2}});
  EXPECT_THROW(b.call(fn, {x, b.constant(0.0, ir::DType::F64)}), std::invalid_argument);
  EXPECT_THROW(b.call(fn, {x}), std::invalid_argument);
  ir::Builder empty;
  empty.param({ir::DType::F32, {2}});
  EXPECT_THROW(empty.asFunction(), std::invalid_argument);
}

TEST(IR, InPlaceSafeOnlyWhenEveryReaderFeedsTheWrite) {
  ir::Type t{ir::DType::F32, {4}};
  {
    // m' = 0.9 m + g, read nowhere else: m' can be written into m.
    ir::Builder b;
    auto m = b.param(t);
    auto g = b.param(t);
    auto scaled = b.binary("multiply", m, b.constant(0.9, ir::DType::F32, {4}));
    auto next = b.binary("add", scaled, g);
    EXPECT_EQ(b.inPlaceSafe({{0, next}}, {next}), std::vector<bool>{true});
  }
  {
    // w is also read by an op the update does not depend on (a backward
    // matmul's stand-in): XLA would have to copy w first.
    ir::Builder b;
    auto w = b.param(t);
    auto g = b.param(t);
    auto other = b.binary("multiply", b.reshape(w, {2, 2}), b.reshape(g, {2, 2}));
    auto next = b.binary("subtract", w, g);
    EXPECT_EQ(b.inPlaceSafe({{0, next}}, {next, other}), std::vector<bool>{false});
    // The other reader feeding the update makes it safe again.
    auto next2 = b.binary("add", next, b.reshape(other, {4}));
    EXPECT_EQ(b.inPlaceSafe({{0, next2}}, {next2}), std::vector<bool>{true});
  }
  {
    // The param itself (as a reshape) returned beside its new value.
    ir::Builder b;
    auto p = b.param(t);
    auto next = b.binary("add", p, p);
    EXPECT_EQ(b.inPlaceSafe({{0, next}}, {next, b.reshape(p, {2, 2})}), std::vector<bool>{false});
    EXPECT_EQ(b.inPlaceSafe({{0, next}}, {next}), std::vector<bool>{true});
  }
}

namespace {
// A foreach-style op: (w, g, h) -> (w - g, h * 2), over f32[4].
std::shared_ptr<const ir::Function> foreachStyleOp() {
  ir::Type t{ir::DType::F32, {4}};
  ir::Builder f;
  auto w = f.param(t);
  auto g = f.param(t);
  auto h = f.param(t);
  f.output(f.binary("subtract", w, g));
  f.output(f.binary("multiply", h, f.constant(2.0, ir::DType::F32, {4})));
  return f.asFunction();
}
}  // namespace

TEST(IR, InPlaceSafeSeesWhichArgumentsEachResultOfACallReads) {
  // The foreach-style op's first result reads w and g only, so the product
  // below (a backward matmul's stand-in that reads w and feeds h) does not
  // come before the write of w - g.
  ir::Type t{ir::DType::F32, {4}};
  auto fn = foreachStyleOp();
  ir::Builder b;
  auto pw = b.param(t);
  auto px = b.param(t);
  auto back = b.binary("multiply", pw, px);
  auto r = b.call(fn, {pw, px, back});
  EXPECT_EQ(b.inPlaceSafe({{0, r[0]}}, {r[0], r[1]}), std::vector<bool>{false});
  // Without that other reader, the update may be written in place.
  ir::Builder c;
  auto cw = c.param(t);
  auto cx = c.param(t);
  auto r2 = c.call(fn, {cw, cx, c.binary("multiply", cx, cx)});
  EXPECT_EQ(c.inPlaceSafe({{0, r2[0]}}, {r2[0], r2[1]}), std::vector<bool>{true});
}

TEST(IR, InPlaceSafeSeesThroughCallsInsideCalledFunctions) {
  // The foreach-style op called inside another function (a captured program
  // called in fused eager's graph): the update of w reads w and g only,
  // however deep the call.
  ir::Type t{ir::DType::F32, {4}};
  auto inner = foreachStyleOp();
  ir::Builder p;
  auto r = p.call(inner, {p.param(t), p.param(t), p.param(t)});
  p.output(r[0]);
  p.output(r[1]);
  auto program = p.asFunction();
  // The graph calls the program with w, x and a product that reads x (or w
  // too: another reader of w, feeding the other result, keeps w's write apart).
  auto inPlace = [&](bool product_reads_w) {
    ir::Builder c;
    auto cw = c.param(t);
    auto cx = c.param(t);
    auto out = c.call(program, {cw, cx, c.binary("multiply", product_reads_w ? cw : cx, cx)});
    return c.inPlaceSafe({{0, out[0]}}, {out[0], out[1]});
  };
  EXPECT_EQ(inPlace(false), std::vector<bool>{true});
  EXPECT_EQ(inPlace(true), std::vector<bool>{false});
}

TEST(IR, ACalledProgramsChannelsComeAfterTheGraphsOwn) {
  // Two programs recorded apart both number their collectives from 1; called
  // in one graph, the second's are raised past the first's.
  ir::Type t{ir::DType::F32, {4}};
  auto sum = [](ir::Builder& b, const std::vector<ir::Value>& a) {
    return std::vector<ir::Value>{b.binary("add", a[0], a[1])};
  };
  ir::Builder op;  // the collective's own function, as fused eager builds it
  op.setParticipants({0, 1});
  op.output(op.allReduce(op.param(t), {0, 1}, sum, 1));
  auto collective = op.asFunction();
  EXPECT_EQ(collective->max_channel, 1);
  ir::Builder rec;  // the recorded program calling it
  rec.output(rec.call(collective, {rec.param(t)})[0]);
  auto program = rec.asFunction();
  EXPECT_EQ(program->max_channel, 1);
  EXPECT_EQ(ir::withChannelsAfter(program, 0), program);
  auto later = ir::withChannelsAfter(program, 3);
  EXPECT_EQ(ir::withChannelsAfter(program, 3), later);  // memoized
  EXPECT_NE(later->name, program->name);
  EXPECT_EQ(later->max_channel, 4);
  ASSERT_EQ(later->callees.size(), 1u);
  EXPECT_NE(later->callees[0]->text.find("channel_handle<handle = 4,"), std::string::npos);
  EXPECT_NE(later->text.find("func.call @" + later->callees[0]->name + "("), std::string::npos);
  EXPECT_EQ(later->text.find(collective->name + "("), std::string::npos);
  ir::Builder graph;
  auto x = graph.param(t);
  auto y = graph.call(program, {x})[0];
  graph.output(graph.call(ir::withChannelsAfter(program, program->max_channel), {y})[0]);
  const std::string text = graph.emit();
  EXPECT_NE(text.find("channel_handle<handle = 1,"), std::string::npos);
  EXPECT_NE(text.find("channel_handle<handle = 2,"), std::string::npos);
}

TEST(IR, AliasChecksTypesAndPrintsTheAttribute) {
  ir::Builder b;
  auto p = b.param({ir::DType::F32, {4}});
  auto q = b.param({ir::DType::F32, {3}});
  b.output(b.binary("add", p, p));
  b.output(q);
  std::string before = b.fingerprint();
  EXPECT_THROW(b.alias(1, 0), std::invalid_argument);  // 3 elements into 4
  EXPECT_THROW(b.alias(0, 5), std::invalid_argument);
  b.alias(0, 0);
  EXPECT_THROW(b.alias(0, 1), std::invalid_argument);  // param 0 twice
  EXPECT_NE(b.fingerprint(), before);
  EXPECT_NE(b.emit().find("tf.aliasing_output = 0 : i32"), std::string::npos);
}

TEST(Compile, AliasedInputIsDonatedUnlessKept) {
  // out = x + 1 may be written into x's buffer.
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {256}});
  b.output(b.binary("add", x, b.constant(1.0, ir::DType::F32, {256})));
  b.alias(0, 0);
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true));
  std::vector<float> host(256, 2.0f), out(256);
  auto dev = client().devices()[0].raw;
  {
    // Kept: the input stays valid and unchanged.
    auto in = client().fromHost(host.data(), pjrt::ElementType::F32, {256}, 0);
    auto outs = exe->execute({in->raw()}, dev, nullptr, {0});
    outs[0]->toHost(out.data(), out.size() * 4);
    EXPECT_EQ(out, std::vector<float>(256, 3.0f));
    std::vector<float> again(256);
    in->toHost(again.data(), again.size() * 4);
    EXPECT_EQ(again, host);
  }
  {
    // Donated: the output reuses the input's memory; the input is gone.
    auto in = client().fromHost(host.data(), pjrt::ElementType::F32, {256}, 0);
    in->awaitReady();
    const void* addr = in->unsafePointer();
    auto outs = exe->execute({in->raw()}, dev);
    outs[0]->toHost(out.data(), out.size() * 4);
    EXPECT_EQ(out, std::vector<float>(256, 3.0f));
    EXPECT_EQ(outs[0]->unsafePointer(), addr);
    EXPECT_EQ(in->unsafePointer(), nullptr);
  }
}

TEST(Compile, WhileLoopThreadsItsState) {
  // Sum 0..4 into an accumulator: state (i, acc).
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {2}});
  auto i0 = b.constantInt(0, ir::DType::I64);
  auto r = b.whileLoop(
      {i0, x},
      [](ir::Builder& bb, const std::vector<ir::Value>& st) {
        return std::vector<ir::Value>{bb.compare(st[0], bb.constantInt(5, ir::DType::I64), ir::Cmp::LT)};
      },
      [](ir::Builder& bb, const std::vector<ir::Value>& st) {
        auto f = bb.broadcastTo(bb.convert(st[0], ir::DType::F32), {2});
        return std::vector<ir::Value>{bb.binary("add", st[0], bb.constantInt(1, ir::DType::I64)),
                                      bb.binary("add", st[1], f)};
      });
  b.output(r[1]);
  EXPECT_EQ(run(b, {{1, 2}}), (std::vector<float>{11, 12}));
}

TEST(Compile, CholeskyAndTriangularSolve) {
  ir::Builder b;
  auto a = b.param({ir::DType::F32, {2, 2}});
  auto rhs = b.param({ir::DType::F32, {2, 1}});
  auto l = b.cholesky(a, true);
  // L y = rhs, then L^T x = y: x = A^{-1} rhs.
  auto y = b.triangularSolve(l, rhs, true, true, false, false);
  b.output(b.triangularSolve(l, y, true, true, false, true));
  auto out = run(b, {{4, 2, 2, 3}, {2, 1}});
  ASSERT_EQ(out.size(), 2u);
  // A = [[4,2],[2,3]], A^{-1} [2,1] = [0.5, 0]
  EXPECT_NEAR(out[0], 0.5f, 1e-6);
  EXPECT_NEAR(out[1], 0.0f, 1e-6);
}

TEST(Compile, RealFftRoundTrip) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {4}});
  auto spec = b.fft(x, "RFFT", {4});
  EXPECT_EQ(spec.type.str(), "tensor<3xcomplex<f32>>");
  // DC term of [1,2,3,4] is 10; the round trip gives x back.
  auto back = b.fft(b.complex(b.real(spec), b.imag(spec)), "IRFFT", {4});
  b.output(back);
  auto out = run(b, {{1, 2, 3, 4}});
  ASSERT_EQ(out.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], i + 1.0f, 1e-5);
}

TEST(IR, PromotionMatchesPyTorch) {
  using ir::DType;
  EXPECT_EQ(ir::promote(DType::I64, DType::F32), DType::F32);
  EXPECT_EQ(ir::promote(DType::F16, DType::BF16), DType::F32);
  EXPECT_EQ(ir::promote(DType::U8, DType::I8), DType::I16);
  EXPECT_EQ(ir::promote(DType::Bool, DType::I32), DType::I32);
  EXPECT_EQ(ir::promote(DType::BF16, DType::F32), DType::F32);
}

TEST(IR, BroadcastShapes) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {3, 1}});
  auto y = b.broadcastTo(x, {2, 3, 4});
  EXPECT_EQ(y.shape(), (ir::Shape{2, 3, 4}));
  EXPECT_THROW(b.broadcastTo(x, {2, 4, 4}), std::invalid_argument);
}

// The overrides travel as CompileOptionsProto.env_option_overrides: the plugin
// applies a known debug option and names an unknown one in its error, so a
// mis-encoded override could not pass silently.
TEST(Compile, OptionOverridesReachXla) {
  ir::Builder b;
  auto x = b.param({ir::DType::F32, {40}});
  b.output(b.unary("exponential", x));
  auto exe = client().compile(b.emit(), pjrt::compileOptions(true, {{"xla_cpu_prefer_vector_width", 512}}));
  std::vector<float> in(40);
  for (size_t i = 0; i < in.size(); ++i) in[i] = 0.1f * static_cast<float>(i) - 2.0f;
  auto buf = client().fromHost(in.data(), pjrt::ElementType::F32, {40}, 0);
  auto outs = exe->execute({buf->raw()}, client().devices()[0].raw);
  std::vector<float> got(40);
  outs[0]->toHost(got.data(), got.size() * sizeof(float));
  for (size_t i = 0; i < in.size(); ++i) EXPECT_NEAR(got[i], std::exp(in[i]), 1e-6 * std::exp(in[i])) << i;
  try {
    client().compile(b.emit(), pjrt::compileOptions(true, {{"xla_no_such_debug_option", 1}}));
    FAIL() << "expected pjrt::Error";
  } catch (const pjrt::Error& e) {
    EXPECT_NE(std::string(e.what()).find("xla_no_such_debug_option"), std::string::npos) << e.what();
  }
}

// Collective programs (runtime/collectives.h) over the client's 2 devices, one launch.
namespace {
std::vector<std::vector<int64_t>> runTwoReplicas(const runtime::CollectiveSpec& spec,
                                                 const std::vector<std::vector<int64_t>>& inputs, int64_t out_len) {
  auto exe = client().compile(runtime::collectiveProgram(spec), pjrt::replicatedCompileOptions({0, 1}));
  std::vector<std::unique_ptr<pjrt::Buffer>> bufs;
  std::vector<std::vector<PJRT_Buffer*>> args;
  for (int r = 0; r < 2; ++r) {
    bufs.push_back(
        client().fromHost(inputs[r].data(), pjrt::ElementType::S64, {static_cast<int64_t>(inputs[r].size())}, r));
    args.push_back({bufs.back()->raw()});
  }
  auto outs = exe->executeReplicated(args);
  std::vector<std::vector<int64_t>> result;
  for (auto& o : outs) {
    std::vector<int64_t> host(out_len);
    o.at(0)->toHost(host.data(), host.size() * sizeof(int64_t));
    result.push_back(host);
  }
  return result;
}
}  // namespace

TEST(Collectives, AllReduceGatherAndBitwiseOverTwoDevices) {
  runtime::CollectiveSpec spec;
  spec.dtype = ir::DType::I64;
  spec.n = 3;
  spec.participants = {0, 1};
  const std::vector<std::vector<int64_t>> in = {{1, 6, 12}, {2, 3, 10}};
  auto sum = runTwoReplicas(spec, in, 3);
  EXPECT_EQ(sum[0], (std::vector<int64_t>{3, 9, 22}));
  EXPECT_EQ(sum[1], sum[0]);
  spec.reduce = runtime::Reduction::Avg;  // integers truncate, as NCCL's AVG
  EXPECT_EQ(runTwoReplicas(spec, in, 3)[1], (std::vector<int64_t>{1, 4, 11}));
  spec.reduce = runtime::Reduction::BitAnd;  // gathered, then reduced on each device
  EXPECT_EQ(runTwoReplicas(spec, in, 3)[0], (std::vector<int64_t>{0, 2, 8}));
  spec.reduce = runtime::Reduction::BitXor;
  EXPECT_EQ(runTwoReplicas(spec, in, 3)[1], (std::vector<int64_t>{3, 5, 6}));
  spec.kind = runtime::Collective::AllGather;
  spec.reduce = runtime::Reduction::Sum;
  EXPECT_EQ(runTwoReplicas(spec, in, 6)[1], (std::vector<int64_t>{1, 6, 12, 2, 3, 10}));
  spec.kind = runtime::Collective::Broadcast;
  spec.root = 1;
  EXPECT_EQ(runTwoReplicas(spec, in, 3)[0], in[1]);
}

TEST(Collectives, BitwiseReductionOfFloatsIsRefused) {
  runtime::CollectiveSpec spec;
  spec.dtype = ir::DType::F32;
  spec.n = 2;
  spec.participants = {0, 1};
  spec.reduce = runtime::Reduction::BitOr;
  EXPECT_THROW(runtime::collectiveProgram(spec), std::invalid_argument);
  spec.participants.clear();
  spec.reduce = runtime::Reduction::Sum;
  EXPECT_THROW(runtime::collectiveProgram(spec), std::invalid_argument);
}
