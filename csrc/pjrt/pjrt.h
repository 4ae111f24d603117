// RAII wrappers over the PJRT C API. No torch headers here: this layer builds
// and tests on its own (tests/cpp/pjrt_test.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "pjrt_c_api.h"

namespace tpu::pjrt {

// A PJRT call failed; carries the plugin's message and status code.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, PJRT_Error_Code code) : std::runtime_error(what), code_(code) {}
  PJRT_Error_Code code() const { return code_; }

 private:
  PJRT_Error_Code code_;
};

// The plugin could not be found or loaded; the message says what to install.
class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Api;
class Buffer;
class Event;

// Where a plugin is: its shared library, and the name it was chosen by
// (tpu, cuda or cpu; empty when `name` was a path).
struct PluginLocation {
  std::string path;
  std::string name;
};
// Resolves a plugin name (tpu | cuda | cpu | a path) to a shared library.
// `search_dirs` are site-packages style folders to look in. Empty `name`
// means the first available of tpu, cuda, cpu. Throws PluginError.
PluginLocation locatePlugin(const std::string& name, const std::vector<std::string>& search_dirs);
inline std::string resolvePluginPath(const std::string& name, const std::vector<std::string>& search_dirs) {
  return locatePlugin(name, search_dirs).path;
}

// Owns the dlopen'ed plugin and its PJRT_Api table.
class Api {
 public:
  static std::shared_ptr<Api> load(const std::string& path);
  ~Api();
  Api(const Api&) = delete;
  Api& operator=(const Api&) = delete;

  const PJRT_Api* raw() const { return api_; }
  const std::string& path() const { return path_; }
  int majorVersion() const { return api_->pjrt_api_version.major_version; }
  int minorVersion() const { return api_->pjrt_api_version.minor_version; }
  // True when the plugin's function table is long enough to hold `offset`.
  bool has(size_t field_offset) const { return field_offset < api_->struct_size; }

  // Throws Error if `err` is non-null (and frees it). `what` names the call.
  void check(PJRT_Error* err, const char* what) const;
  std::string message(const PJRT_Error* err) const;
  void destroyError(PJRT_Error* err) const;

  // The plugin's attributes (PJRT_Plugin_Attributes) as text: integers in
  // decimal, integer lists joined by '.' ("stablehlo_current_version" ->
  // "1.13.0"); empty when the plugin has none.
  std::vector<std::pair<std::string, std::string>> attributes() const;
  // Registers a typed XLA FFI handler (custom-call api_version 4) under
  // `target` for `platform` ("Host", "CUDA", ...) through the plugin's FFI
  // extension. Throws PluginError when the plugin has no such extension or
  // refuses the handler.
  void registerFfiHandler(const std::string& target, const std::string& platform, void* handler) const;

 private:
  Api() = default;
  void* handle_ = nullptr;
  const PJRT_Api* api_ = nullptr;
  std::string path_;
};

#define TPU_PJRT_HAS(api, field) (api).has(offsetof(PJRT_Api, field))

// An event (transfer done, execution done). Destroyed with the object.
class Event {
 public:
  Event(std::shared_ptr<const Api> api, PJRT_Event* ev) : api_(std::move(api)), ev_(ev) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // Blocks until ready; throws Error with the plugin's message on failure.
  void await(const char* what = "PJRT_Event_Await") const;
  bool isReady() const;
  // Calls `fn` on a plugin thread once the event is ready, failed or not
  // (a failure still reaches whoever awaits the event).
  void onReady(std::function<void()> fn) const;

 private:
  std::shared_ptr<const Api> api_;
  PJRT_Event* ev_;
};

enum class ElementType : int {
  PRED = PJRT_Buffer_Type_PRED,
  S8 = PJRT_Buffer_Type_S8,
  S16 = PJRT_Buffer_Type_S16,
  S32 = PJRT_Buffer_Type_S32,
  S64 = PJRT_Buffer_Type_S64,
  U8 = PJRT_Buffer_Type_U8,
  U16 = PJRT_Buffer_Type_U16,
  U32 = PJRT_Buffer_Type_U32,
  U64 = PJRT_Buffer_Type_U64,
  F16 = PJRT_Buffer_Type_F16,
  F32 = PJRT_Buffer_Type_F32,
  F64 = PJRT_Buffer_Type_F64,
  BF16 = PJRT_Buffer_Type_BF16,
  C64 = PJRT_Buffer_Type_C64,
  C128 = PJRT_Buffer_Type_C128,
};

class Client;

// A device buffer. Owns the PJRT_Buffer.
class Buffer {
 public:
  Buffer(std::shared_ptr<const Api> api, PJRT_Buffer* buf) : api_(std::move(api)), buf_(buf) {
    if (buf_) live_.fetch_add(1, std::memory_order_relaxed);
  }
  ~Buffer();
  // Buffers alive in the process: what holds device memory besides tensors
  // (a program's fixed inputs, pending transfers) shows here.
  static int64_t live() { return live_.load(std::memory_order_relaxed); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  PJRT_Buffer* raw() const { return buf_; }
  std::vector<int64_t> dims() const;
  ElementType elementType() const;
  size_t onDeviceBytes() const;
  // Copies to host synchronously. `dst` must hold hostBytes().
  void toHost(void* dst, size_t dst_size) const;
  // The buffer's address as the plugin reports it (PJRT_Buffer_UnsafePointer),
  // or nullptr where the plugin gives none (or the buffer was deleted). Only a
  // plugin whose device memory is host memory makes it readable.
  const void* unsafePointer() const;
  size_t hostBytes() const;
  // Blocks until the buffer's value is computed; throws the producing
  // computation's error if it failed.
  void awaitReady() const;
  bool isReady() const;
  PJRT_Device* device() const;

 private:
  static inline std::atomic<int64_t> live_{0};
  std::shared_ptr<const Api> api_;
  PJRT_Buffer* buf_;
};

// A compiled, loaded executable.
class Executable {
 public:
  Executable(std::shared_ptr<const Api> api, PJRT_LoadedExecutable* exe);
  ~Executable();
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;

  size_t numOutputs() const { return num_outputs_; }
  // Runs asynchronously on `device`; output buffers are returned at once and
  // become ready when the computation finishes.
  // With `done`, also returns an event that fires when the execution ends.
  // `keep`: indices of aliased inputs not to donate (the plugin copies them).
  // `launch_id`: for a multi-replica program, the id every participant's
  // launch of this run passes (0: a single-device run).
  std::vector<std::unique_ptr<Buffer>> execute(const std::vector<PJRT_Buffer*>& args, PJRT_Device* device,
                                               std::shared_ptr<Event>* done = nullptr,
                                               const std::vector<int64_t>& keep = {}, int launch_id = 0) const;
  // Runs one program on several devices at once (a program compiled for
  // args.size() replicas): args[r] are replica r's inputs, on the device the
  // compile options assigned to it; returns each replica's outputs.
  std::vector<std::vector<std::unique_ptr<Buffer>>> executeReplicated(
      const std::vector<std::vector<PJRT_Buffer*>>& args) const;
  // Runs this process's part of a multi-replica program on `device`. Every
  // participant passes the same `launch_id`, which pairs the parts of one run.
  std::vector<std::unique_ptr<Buffer>> executeShard(const std::vector<PJRT_Buffer*>& args, PJRT_Device* device,
                                                    int launch_id) const;
  // Platform-specific bytes; valid only for the same plugin build.
  std::string serialize() const;
  PJRT_LoadedExecutable* raw() const { return exe_; }

 private:
  // The set-up the three share: one PJRT_LoadedExecutable_Execute over `n`
  // argument lists (one per device), outputs sized by the executable, each
  // list's outputs returned. `device`: where a single list runs (null: as the
  // compile options assign); `complete`: n completion events, or null.
  std::vector<std::vector<std::unique_ptr<Buffer>>> launch(const std::vector<PJRT_Buffer*>* lists, size_t n,
                                                           PJRT_ExecuteOptions& opts, PJRT_Device* device,
                                                           PJRT_Event** complete) const;
  std::shared_ptr<const Api> api_;
  PJRT_LoadedExecutable* exe_;
  size_t num_outputs_ = 0;
};

struct DeviceInfo {
  int id = 0;         // index among this process's devices
  int global_id = 0;  // the plugin's id, unique across the processes of a client
  std::string kind;
  std::string debug;
  PJRT_Device* raw = nullptr;
};

struct MemoryStats {
  int64_t bytes_in_use = 0;
  int64_t bytes_limit = -1;  // -1: the plugin does not say
};

// The key-value store the processes of one multi-process client share: the
// plugin exchanges its topology and communicator ids through it at creation
// and at a collective's first run. Called from the plugin's threads.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // The value of `key`, waiting for it up to `timeout`; throws KeyValueTimeout.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // The value of `key`, or nothing if it is not there yet.
  virtual std::optional<std::string> tryGet(const std::string& key) = 0;
  virtual void put(const std::string& key, const std::string& value) = 0;
};

class KeyValueTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// This process's place in a client spanning several processes (one per rank,
// as torchrun starts them).
struct ProcessSpan {
  int process_id = 0;
  int process_count = 1;
  std::shared_ptr<KeyValueStore> store;
};

// The PJRT_Client_Create key-value callbacks over a KeyValueStore (user_arg),
// exposed for tests: a store's exception becomes the callback's error, NOT_FOUND
// for a try-get miss and DEADLINE_EXCEEDED for a get that timed out.
namespace kv_bridge {
PJRT_Error* get(PJRT_KeyValueGetCallback_Args* args);
PJRT_Error* tryGet(PJRT_KeyValueTryGetCallback_Args* args);
PJRT_Error* put(PJRT_KeyValuePutCallback_Args* args);
}  // namespace kv_bridge

// One client creation option (a PJRT_NamedValue; integers are always int64).
struct NamedOption {
  std::string name;
  std::variant<int64_t, bool> value;
};
// What PJRT_Client_Create is given. Plugins reject option names they do not
// know, so the caller passes only those of the plugin's platform
// (runtime/plugin.h asks the platform's PluginSupport registration).
struct ClientOptions {
  std::vector<NamedOption> values;
  // The key-value store of a client spanning processes (its callbacks); null: none.
  std::shared_ptr<KeyValueStore> kv;
};

class Client {
 public:
  static std::unique_ptr<Client> create(std::shared_ptr<Api> api, const ClientOptions& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::shared_ptr<Api>& api() const { return api_; }
  PJRT_Client* raw() const { return client_; }
  const std::string& platformName() const { return platform_name_; }
  const std::string& platformVersion() const { return platform_version_; }
  const std::vector<DeviceInfo>& devices() const { return devices_; }
  // Devices of every process of the client; more than devices() where the
  // client spans processes.
  int globalDeviceCount() const { return global_device_count_; }
  bool spansProcesses() const { return global_device_count_ > addressable_count_; }
  // Keeps the addressable devices at these positions, in this order, as
  // devices 0..n-1 (a process given some of a host's devices). Throws
  // std::out_of_range naming a position the plugin does not have.
  void keepDevices(const std::vector<int>& positions);

  // Compiles MLIR text with the given serialized CompileOptionsProto.
  std::unique_ptr<Executable> compile(const std::string& mlir, const std::string& options) const;
  std::unique_ptr<Executable> deserialize(const std::string& bytes) const;

  // Copies a dense row-major host array to `device`. Waits until the host
  // memory may be reused, so `data` may be freed on return.
  std::unique_ptr<Buffer> fromHost(const void* data, ElementType type, const std::vector<int64_t>& dims,
                                   int device) const;
  // A buffer over `data` itself (PJRT_HostBufferSemantics_kMutableZeroCopy)
  // where the plugin can alias host memory (the CPU plugin, for aligned dense
  // data), else a copy of it. `on_done` runs once the plugin no longer uses
  // `data` (the buffer destroyed, or the copy made), on whichever thread that
  // happens; until then the caller keeps `data` alive and leaves it unchanged.
  // What `on_done` holds is released with it, whether it ran or not.
  std::unique_ptr<Buffer> fromHostZeroCopy(void* data, ElementType type, const std::vector<int64_t>& dims, int device,
                                           std::function<void()> on_done) const;
  MemoryStats memoryStats(int device) const;

 private:
  Client() = default;
  // PJRT_Client_BufferFromHostBuffer called with these; its filled arguments.
  PJRT_Client_BufferFromHostBuffer_Args bufferFromHost(const void* data, ElementType type,
                                                       const std::vector<int64_t>& dims, int device,
                                                       PJRT_HostBufferSemantics semantics) const;
  std::shared_ptr<Api> api_;
  PJRT_Client* client_ = nullptr;
  std::string platform_name_;
  std::string platform_version_;
  std::vector<DeviceInfo> devices_;
  int addressable_count_ = 0;  // before keepDevices
  int global_device_count_ = 0;
  std::shared_ptr<KeyValueStore> kv_;  // the plugin may call back into it at any collective
};

// The serialized xla.CompileOptionsProto for one replica, one partition.
// `portable` sets compile_portable_executable so one executable runs on any
// device of the client.
// Integer overrides of XLA's debug options (env_option_overrides: applied on
// top of the defaults and XLA_FLAGS), e.g. {"xla_cpu_prefer_vector_width", 512}.
using OptionOverrides = std::vector<std::pair<std::string, int64_t>>;
std::string compileOptions(bool portable, const OptionOverrides& overrides = {});
// Options for a program of `device_ids.size()` replicas, replica r on the
// device whose id is device_ids[r] (a collective's participants).
std::string replicatedCompileOptions(const std::vector<int>& device_ids, const OptionOverrides& overrides = {});

size_t elementSize(ElementType t);

}  // namespace tpu::pjrt
