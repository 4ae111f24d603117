#include "runtime/collectives.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace tpu::runtime {
namespace {

std::string tensorType(ir::DType t, int64_t n) { return "tensor<" + std::to_string(n) + "x" + ir::mlirName(t) + ">"; }
std::string scalarType(ir::DType t) { return std::string("tensor<") + ir::mlirName(t) + ">"; }

bool isFloating(ir::DType t) {
  return t == ir::DType::F16 || t == ir::DType::BF16 || t == ir::DType::F32 || t == ir::DType::F64;
}

const char* combiner(Reduction r, ir::DType t) {
  switch (r) {
    case Reduction::Sum:
    case Reduction::Avg:
      return t == ir::DType::Bool ? "stablehlo.or" : "stablehlo.add";
    case Reduction::Prod:
      return t == ir::DType::Bool ? "stablehlo.and" : "stablehlo.multiply";
    case Reduction::Min:
      return "stablehlo.minimum";
    case Reduction::Max:
      return "stablehlo.maximum";
    case Reduction::BitAnd:
      return "stablehlo.and";
    case Reduction::BitOr:
      return "stablehlo.or";
    case Reduction::BitXor:
      return "stablehlo.xor";
  }
  return "stablehlo.add";
}

// The reduction body every reducing collective carries.
std::string reductionRegion(Reduction r, ir::DType t) {
  const std::string s = scalarType(t);
  return "({\n    ^bb0(%a: " + s + ", %b: " + s + "):\n      %r = \"" + combiner(r, t) + "\"(%a, %b) : (" + s + ", " +
         s + ") -> " + s + "\n      \"stablehlo.return\"(%r) : (" + s + ") -> ()\n    })";
}

std::string replicaGroups(int world) {
  std::string ids;
  for (int r = 0; r < world; ++r) ids += (r ? ", " : "") + std::to_string(r);
  return "replica_groups = dense<[[" + ids + "]]> : tensor<1x" + std::to_string(world) + "xi64>";
}

std::string sliceOp(const std::string& out, const std::string& in, int64_t start, int64_t len, ir::DType t,
                    int64_t in_len) {
  return "    " + out + " = \"stablehlo.slice\"(" + in + ") {start_indices = array<i64: " + std::to_string(start) +
         ">, limit_indices = array<i64: " + std::to_string(start + len) + ">, strides = array<i64: 1>} : (" +
         tensorType(t, in_len) + ") -> " + tensorType(t, len) + "\n";
}

bool isBitwise(Reduction r) { return r == Reduction::BitAnd || r == Reduction::BitOr || r == Reduction::BitXor; }

// The identity of a bitwise reduction: all ones for AND, zero otherwise.
std::string bitwiseIdentity(Reduction r, ir::DType t) {
  const bool ones = r == Reduction::BitAnd;
  if (t == ir::DType::Bool) return ones ? "true" : "false";
  if (!ones) return "0";
  switch (t) {
    case ir::DType::U8:
      return "255";
    case ir::DType::U16:
      return "65535";
    case ir::DType::U32:
      return "4294967295";
    case ir::DType::U64:
      return "18446744073709551615";
    default:
      return "-1";
  }
}

// XLA:CPU's all_reduce takes no bitwise reduction: gather every replica's operand,
// then reduce over replicas on each device. Reduce-scatter keeps this replica's block.
std::string gatheredReduction(const CollectiveSpec& spec, int world, int64_t in_len, const std::string& out_t) {
  const ir::DType t = spec.dtype;
  const std::string in_t = tensorType(t, in_len), s = scalarType(t);
  const std::string stacked =
      "tensor<" + std::to_string(world) + "x" + std::to_string(in_len) + "x" + ir::mlirName(t) + ">";
  std::string body = "    %g = \"stablehlo.all_gather\"(%arg0) {all_gather_dim = 0 : i64, " + replicaGroups(world) +
                     "} : (" + in_t + ") -> " + tensorType(t, world * in_len) + "\n";
  body += "    %s = \"stablehlo.reshape\"(%g) : (" + tensorType(t, world * in_len) + ") -> " + stacked + "\n";
  body += "    %i = \"stablehlo.constant\"() {value = dense<" + bitwiseIdentity(spec.reduce, t) + "> : " + s +
          "} : () -> " + s + "\n";
  const std::string reduced = spec.kind == Collective::ReduceScatter ? "%red" : "%0";
  body += "    " + reduced + " = \"stablehlo.reduce\"(%s, %i) " + reductionRegion(spec.reduce, t) +
          " {dimensions = array<i64: 0>} : (" + stacked + ", " + s + ") -> " + in_t + "\n";
  if (spec.kind == Collective::ReduceScatter) {
    body += "    %id = \"stablehlo.replica_id\"() : () -> tensor<ui32>\n";
    body += "    %id64 = \"stablehlo.convert\"(%id) : (tensor<ui32>) -> tensor<i64>\n";
    body += "    %n = \"stablehlo.constant\"() {value = dense<" + std::to_string(spec.n) +
            "> : tensor<i64>} : () -> tensor<i64>\n";
    body += "    %at = \"stablehlo.multiply\"(%id64, %n) : (tensor<i64>, tensor<i64>) -> tensor<i64>\n";
    body += "    %0 = \"stablehlo.dynamic_slice\"(%red, %at) {slice_sizes = array<i64: " + std::to_string(spec.n) +
            ">} : (" + in_t + ", tensor<i64>) -> " + out_t + "\n";
  }
  return body;
}

// The program's body where XLA runs the collective as asked.
std::string directBody(const CollectiveSpec& spec, int world, const std::string& in_t, const std::string& out_t) {
  std::string body;
  const ir::DType t = spec.dtype;
  const int64_t n = spec.n;
  switch (spec.kind) {
    case Collective::AllReduce:
      body += "    %0 = \"stablehlo.all_reduce\"(%arg0) " + reductionRegion(spec.reduce, t) + " {" +
              replicaGroups(world) + "} : (" + in_t + ") -> " + out_t + "\n";
      break;
    case Collective::ReduceScatter:
      body += "    %0 = \"stablehlo.reduce_scatter\"(%arg0) " + reductionRegion(spec.reduce, t) + " {" +
              replicaGroups(world) + ", scatter_dimension = 0 : i64} : (" + in_t + ") -> " + out_t + "\n";
      break;
    case Collective::AllGather:
      body += "    %0 = \"stablehlo.all_gather\"(%arg0) {all_gather_dim = 0 : i64, " + replicaGroups(world) + "} : (" +
              in_t + ") -> " + out_t + "\n";
      break;
    case Collective::AllToAll:
      body += "    %0 = \"stablehlo.all_to_all\"(%arg0) {concat_dimension = 0 : i64, " + replicaGroups(world) +
              ", split_count = " + std::to_string(world) + " : i64, split_dimension = 0 : i64} : (" + in_t + ") -> " +
              out_t + "\n";
      break;
    case Collective::Broadcast:
      // Gathered, then the root's block: exact for every dtype and value
      // (a sum with zeros from the others would turn -0.0 into 0.0).
      body += "    %g = \"stablehlo.all_gather\"(%arg0) {all_gather_dim = 0 : i64, " + replicaGroups(world) + "} : (" +
              in_t + ") -> " + tensorType(t, world * n) + "\n";
      body += sliceOp("%0", "%g", spec.root * n, n, t, world * n);
      break;
    case Collective::Permute: {
      std::string pairs;
      for (const auto& [s, d] : spec.pairs)
        pairs += std::string(pairs.empty() ? "" : ", ") + "[" + std::to_string(s) + ", " + std::to_string(d) + "]";
      body += "    %0 = \"stablehlo.collective_permute\"(%arg0) {source_target_pairs = dense<[" + pairs +
              "]> : tensor<" + std::to_string(spec.pairs.size()) + "x2xi64>} : (" + in_t + ") -> " + out_t + "\n";
      break;
    }
  }
  return body;
}

}  // namespace

std::string CollectiveSpec::name() const {
  switch (kind) {
    case Collective::AllReduce:
      return "all_reduce";
    case Collective::AllGather:
      return "all_gather";
    case Collective::ReduceScatter:
      return "reduce_scatter";
    case Collective::AllToAll:
      return "all_to_all";
    case Collective::Broadcast:
      return "broadcast";
    case Collective::Permute:
      return "collective_permute";
  }
  return "collective";
}

std::string collectiveProgram(const CollectiveSpec& spec) {
  const int world = static_cast<int>(spec.participants.size());
  if (world < 1) throw std::invalid_argument("a collective needs at least one participant");
  const ir::DType t = spec.dtype;
  const int64_t n = spec.n;
  const int64_t in_len = spec.kind == Collective::ReduceScatter || spec.kind == Collective::AllToAll ? world * n : n;
  int64_t out_len = n;
  if (spec.kind == Collective::AllGather) out_len = world * n;
  if (spec.kind == Collective::AllToAll) out_len = world * n;
  const std::string in_t = tensorType(t, in_len), out_t = tensorType(t, out_len);
  std::string body;
  std::string result = "%0";
  if (isBitwise(spec.reduce) && (isFloating(t) || ir::isComplex(t)))
    throw std::invalid_argument("a bitwise reduction needs an integer or bool tensor, got " +
                                std::string(ir::dtypeName(t)));
  const bool gathered =
      isBitwise(spec.reduce) && (spec.kind == Collective::AllReduce || spec.kind == Collective::ReduceScatter);
  if (gathered)
    body = gatheredReduction(spec, world, in_len, out_t);
  else
    body = directBody(spec, world, in_t, out_t);
  if (spec.reduce == Reduction::Avg && (spec.kind == Collective::AllReduce || spec.kind == Collective::ReduceScatter)) {
    // NCCL's AVG: the sum divided by the group size (integers truncate).
    const std::string lit = isFloating(t) ? std::to_string(world) + ".0" : std::to_string(world);
    body += "    %c = \"stablehlo.constant\"() {value = dense<" + lit + "> : " + out_t + "} : () -> " + out_t + "\n";
    body += "    %1 = \"stablehlo.divide\"(%0, %c) : (" + out_t + ", " + out_t + ") -> " + out_t + "\n";
    result = "%1";
  }
  return "module @" + spec.name() +
         " attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = " + std::to_string(world) +
         " : i32} {\n  func.func public @main(%arg0: " + in_t + ") -> " + out_t + " {\n" + body +
         "    \"func.return\"(" + result + ") : (" + out_t + ") -> ()\n  }\n}\n";
}

std::shared_ptr<pjrt::Executable> collectiveExecutable(const CollectiveSpec& spec) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<pjrt::Executable>> cache;
  Runtime& rt = Runtime::get();
  const std::vector<int>& ids = spec.participants;
  std::string text = collectiveProgram(spec);
  std::string key = text;
  for (int id : ids) key += "," + std::to_string(id);
  if (auto hit = cachedProgram(mu, cache, key)) return hit;
  auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<pjrt::Executable> exe;
  try {
    exe = rt.client().compile(text, pjrt::replicatedCompileOptions(ids, rt.optionOverrides()));
  } catch (const pjrt::Error& e) {
    throw std::runtime_error("torch_tpu: compiling the " + spec.name() + " collective over " +
                             std::to_string(ids.size()) + " devices failed: " + e.what());
  }
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  metrics().countCompile(spec.name(), ns);
  std::lock_guard<std::mutex> g(mu);
  return cache.emplace(std::move(key), std::move(exe)).first->second;
}

namespace {
void count(const CollectiveSpec& spec, int64_t replicas) {
  const int world = static_cast<int>(spec.participants.size());
  const int64_t in_len =
      spec.kind == Collective::ReduceScatter || spec.kind == Collective::AllToAll ? world * spec.n : spec.n;
  metrics().dist_xla_collectives++;
  metrics().dist_xla_bytes += replicas * in_len * static_cast<int64_t>(ir::itemSize(spec.dtype));
  metrics().executions++;
}
}  // namespace

std::vector<BufferPtr> runCollective(const CollectiveSpec& spec, const std::vector<BufferPtr>& inputs) {
  if (inputs.size() != spec.participants.size())
    throw std::invalid_argument("runCollective: one input per participant");
  auto exe = collectiveExecutable(spec);
  std::vector<std::vector<PJRT_Buffer*>> args;
  for (const auto& b : inputs) args.push_back({b->raw()});
  auto outs = exe->executeReplicated(args);
  count(spec, static_cast<int64_t>(inputs.size()));
  if (Runtime::get().plugin().collectivesOneAtATime())
    for (auto& o : outs) o.at(0)->awaitReady();
  std::vector<BufferPtr> result;
  for (auto& o : outs) result.push_back(BufferPtr(std::move(o.at(0))));
  return result;
}

BufferPtr runCollectiveShard(const CollectiveSpec& spec, const BufferPtr& input, int device, int launch_id) {
  auto exe = collectiveExecutable(spec);
  auto outs = exe->executeShard({input->raw()}, Runtime::get().device(device), launch_id);
  count(spec, 1);
  if (Runtime::get().plugin().collectivesOneAtATime()) outs.at(0)->awaitReady();
  return BufferPtr(std::move(outs.at(0)));
}

int globalDeviceId(int index) { return Runtime::get().client().devices().at(index).global_id; }

namespace {

std::string participantsKey(const std::vector<int>& ids) {
  std::string key;
  for (int id : ids) key += std::to_string(id) + ",";
  return key;
}

std::mutex g_launch_mu;
std::map<std::pair<std::string, int>, int64_t> g_launches;  // (participants, device) -> runs so far
std::map<int, std::shared_ptr<pjrt::Event>> g_last_launch;  // device -> its last multi-replica run

// One meeting point per participant list: each device's arrivals so far, and
// what each came for, by arrival number.
struct Meeting {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, int64_t> arrivals;  // global device id -> arrivals
  std::map<int64_t, std::map<int, std::string>> what;
};
std::mutex g_meetings_mu;
std::map<std::string, std::shared_ptr<Meeting>> g_meetings;

void plainWait(const std::function<void()>& block) { block(); }
std::atomic<BlockingWait> g_blocking_wait{plainWait};

}  // namespace

int nextProgramLaunch(const std::vector<int>& participants, int device) {
  std::lock_guard<std::mutex> g(g_launch_mu);
  const int64_t k = ++g_launches[{participantsKey(participants), device}];
  // Bit 30 set: tpu_dist's collectives use ids below it. Even and never 0.
  return static_cast<int>(0x40000000 | ((k * 2) & 0x3ffffffe));
}

void noteProgramLaunch(int device, std::shared_ptr<pjrt::Event> done) {
  std::lock_guard<std::mutex> g(g_launch_mu);
  g_last_launch[device] = std::move(done);
}

void setBlockingWait(BlockingWait wait) { g_blocking_wait.store(wait ? wait : plainWait); }

void blocking(const std::function<void()>& block) { g_blocking_wait.load()(block); }

void arriveTogether(const std::vector<int>& participants, int device, const std::string& what,
                    std::chrono::milliseconds timeout) {
  std::shared_ptr<pjrt::Event> last;
  {
    std::lock_guard<std::mutex> g(g_launch_mu);
    if (auto it = g_last_launch.find(device); it != g_last_launch.end()) last = std::move(it->second);
    g_last_launch.erase(device);
  }
  std::shared_ptr<Meeting> m;
  {
    std::lock_guard<std::mutex> g(g_meetings_mu);
    auto& slot = g_meetings[participantsKey(participants)];
    if (!slot) slot = std::make_shared<Meeting>();
    m = slot;
  }
  const int self = globalDeviceId(device);
  std::string error;
  bool forget = false;
  g_blocking_wait.load()([&] {
    if (last) last->await("the last run of a program with collectives");
    std::unique_lock<std::mutex> lk(m->mu);
    const int64_t k = ++m->arrivals[self];
    m->what[k][self] = what;
    m->cv.notify_all();
    auto all_here = [&] {
      for (int id : participants)
        if (m->arrivals[id] < k) return false;
      return true;
    };
    if (!m->cv.wait_for(lk, timeout, all_here)) {
      std::string missing;
      for (int id : participants)
        if (m->arrivals[id] < k) missing += (missing.empty() ? "" : ", ") + std::to_string(id);
      error = "torch_tpu: devices " + missing + " did not reach " + what + " within " +
              std::to_string(timeout.count()) + " ms (device " + std::to_string(self) + " waited there)";
      forget = true;
      return;
    }
    const auto& seen = m->what[k];
    for (const auto& [id, w] : seen)
      if (w != what) {
        error = "torch_tpu: the ranks of a compiled step disagree: device " + std::to_string(self) + " is at " + what +
                ", device " + std::to_string(id) + " at " + w;
        break;
      }
    // Everyone has left arrival k - 2 (they all came to k - 1).
    m->what.erase(m->what.begin(), m->what.lower_bound(k - 1));
  });
  if (forget) {
    // The group is broken: whoever meets over these devices next starts afresh.
    const std::string key = participantsKey(participants);
    {
      std::lock_guard<std::mutex> g(g_meetings_mu);
      if (auto it = g_meetings.find(key); it != g_meetings.end() && it->second == m) g_meetings.erase(it);
    }
    std::lock_guard<std::mutex> g(g_launch_mu);
    for (auto it = g_launches.begin(); it != g_launches.end();)
      it = it->first.first == key ? g_launches.erase(it) : std::next(it);
  }
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace tpu::runtime
