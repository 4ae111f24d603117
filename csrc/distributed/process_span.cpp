// The XLA transport across processes: the PJRT client of a plugin that runs
// collectives across processes (the CUDA plugin, how JAX runs NCCL) is created
// knowing this process's rank among torchrun's processes and with the job's
// c10d store as its key-value store. The client is created at the first tpu
// use, which may come before init_process_group, so the store is a client of
// the one torchrun's agent serves at MASTER_ADDR:MASTER_PORT, not the process
// group's.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdlib>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "distributed/tpu_dist.h"
#include "runtime/collectives.h"
#include "runtime/env.h"
#include "runtime/runtime.h"

namespace tpu::distributed {
namespace {

// pjrt::KeyValueStore over a c10d store.
class C10dKeyValueStore final : public pjrt::KeyValueStore {
 public:
  explicit C10dKeyValueStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);
    } catch (const std::exception& e) {
      throw pjrt::KeyValueTimeout("key '" + key + "' did not appear in the c10d store within " +
                                  std::to_string(timeout.count()) + " ms: " + e.what());
    }
    return asString(store_->get(key));
  }

  std::optional<std::string> tryGet(const std::string& key) override {
    if (!store_->check({key})) return std::nullopt;
    return asString(store_->get(key));
  }

  void put(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }

 private:
  static std::string asString(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
  c10::intrusive_ptr<c10d::Store> store_;
};

int envInt(const char* name, int fallback) {
  const char* v = env::get(name);  // torchrun's variables (declared with their owner): read as torchrun writes them
  return v && *v ? std::atoi(v) : fallback;
}

// Whether the job asks the plugin to span processes, and then its span.
// TORCH_TPU_DIST_TRANSPORT: "staged" never; "xla" always (an error where it
// cannot); unset or "auto": under torchrun with more than one process.
std::optional<pjrt::ProcessSpan> spanFromEnvironment() {
  const char* t = env::get("TORCH_TPU_DIST_TRANSPORT");
  const std::string transport = t ? t : "";
  if (transport == "staged") return std::nullopt;
  if (!transport.empty() && transport != "auto" && transport != "xla")
    throw std::invalid_argument("TORCH_TPU_DIST_TRANSPORT must be auto, xla or staged, not '" + transport + "'");
  const int world = envInt("WORLD_SIZE", 1);
  const char* addr = env::get("MASTER_ADDR");
  const char* agent = env::get("TORCHELASTIC_USE_AGENT_STORE");
  const int port = envInt("MASTER_PORT", 0);
  const bool torchrun = agent && std::string(agent) == "True" && addr && *addr && port > 0;
  if (world <= 1 || !torchrun) {
    if (transport == "xla" && world > 1)
      throw std::runtime_error(
          "TORCH_TPU_DIST_TRANSPORT=xla: the plugin's client spans processes only under torchrun (it connects to "
          "the store torchrun's agent serves at MASTER_ADDR:MASTER_PORT); start the job with torchrun");
    return std::nullopt;
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::minutes(5);  // c10d's default store timeout; a get passes the plugin's own
  auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(addr), opts);
  // A restarted job (torchrun --max-restarts) must not read the last attempt's keys.
  const std::string prefix = "torch_tpu/pjrt/" + std::to_string(envInt("TORCHELASTIC_RESTART_COUNT", 0)) + "/";
  pjrt::ProcessSpan span;
  span.process_id = envInt("RANK", 0);
  span.process_count = world;
  span.store = std::make_shared<C10dKeyValueStore>(c10::make_intrusive<c10d::PrefixStore>(prefix, tcp));
  return span;
}

}  // namespace

void registerProcessSpan(pybind11::module& m) {
  runtime::Runtime::setProcessSpan(spanFromEnvironment);
  m.def(
      "_client_spans_processes", [] { return runtime::Runtime::get().client().spansProcesses(); },
      "Whether the plugin's client spans several processes (the XLA transport across processes).");
  m.def(
      "_device_global_id", [](int index) { return runtime::globalDeviceId(index); },
      "The plugin's id of this process's device `index`, unique across the processes of a client.");
  // What the plugin would get: for tests of the bridge on a plugin that never
  // asks for it (the CPU plugin). None where the job does not span processes.
  pybind11::class_<pjrt::KeyValueStore, std::shared_ptr<pjrt::KeyValueStore>>(m, "_PjrtKeyValueStore")
      .def("get", [](pjrt::KeyValueStore& s, const std::string& key,
                     std::chrono::milliseconds timeout) { return pybind11::bytes(s.get(key, timeout)); })
      .def("try_get",
           [](pjrt::KeyValueStore& s, const std::string& key) -> std::optional<pybind11::bytes> {
             auto v = s.tryGet(key);
             if (!v) return std::nullopt;
             return pybind11::bytes(*v);
           })
      .def("put", &pjrt::KeyValueStore::put);
  m.def(
      "_process_span",
      []() -> std::optional<std::tuple<int, int, std::shared_ptr<pjrt::KeyValueStore>>> {
        auto s = spanFromEnvironment();
        if (!s) return std::nullopt;
        return std::make_tuple(s->process_id, s->process_count, s->store);
      },
      "The (process id, process count, key-value store) a multi-process plugin's client is created with.");
}

}  // namespace tpu::distributed
