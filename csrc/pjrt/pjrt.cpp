#include "pjrt/pjrt.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstring>
#include <stdexcept>
#include <utility>

namespace tpu::pjrt {
namespace {

template <typename T>
T makeArgs() {
  T args;
  std::memset(&args, 0, sizeof(T));
  args.struct_size = sizeof(T);
  return args;
}

bool fileExists(const std::string& p) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Where each named plugin lives inside a site-packages folder.
std::vector<std::string> candidatesFor(const std::string& name) {
  if (name == "cpu") return {"xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"};
  if (name == "cuda")
    return {"jax_plugins/xla_cuda13/xla_cuda_plugin.so", "xla_plugins/xla_cuda13_pjrt/xla_gpu_pjrt.so",
            "jax_plugins/xla_cuda12/xla_cuda_plugin.so"};
  if (name == "tpu") return {"libtpu/libtpu.so"};
  return {};
}

std::string installHint(const std::string& name) {
  if (name == "cpu") return "pip install xla-cpu-pjrt";
  if (name == "cuda") return "pip install jax-cuda13-pjrt (and the nvidia CUDA 13 libraries)";
  if (name == "tpu") return "pip install libtpu";
  return "";
}

}  // namespace

PluginLocation locatePlugin(const std::string& name, const std::vector<std::string>& search_dirs) {
  if (name.find('/') != std::string::npos || (name.size() > 3 && name.substr(name.size() - 3) == ".so")) {
    if (!fileExists(name))
      throw PluginError("TORCH_TPU_PLUGIN points to '" + name +
                        "', which does not exist. Set TORCH_TPU_PLUGIN to tpu, cuda, cpu or the path "
                        "of a PJRT plugin .so file.");
    return {name, ""};
  }
  std::vector<std::string> names;
  if (name.empty()) {
    names = {"tpu", "cuda", "cpu"};
  } else if (name == "tpu" || name == "cuda" || name == "cpu") {
    names = {name};
  } else {
    throw PluginError("TORCH_TPU_PLUGIN='" + name +
                      "' is not understood: use tpu, cuda, cpu or the path of a PJRT plugin .so file.");
  }
  for (const auto& n : names) {
    for (const auto& rel : candidatesFor(n)) {
      for (const auto& dir : search_dirs) {
        std::string p = dir + "/" + rel;
        if (fileExists(p)) return {p, n};
      }
    }
  }
  if (!name.empty())
    throw PluginError("The PJRT plugin '" + name + "' was not found. Install it with: " + installHint(name) +
                      " (or set TORCH_TPU_PLUGIN to the path of a plugin .so).");
  throw PluginError(
      "No PJRT plugin was found (looked for tpu, cuda and cpu). Install the CPU plugin with: "
      "pip install xla-cpu-pjrt (or set TORCH_TPU_PLUGIN to the path of a plugin .so).");
}

std::shared_ptr<Api> Api::load(const std::string& path) {
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    throw PluginError("Could not load the PJRT plugin '" + path + "': " + (e ? e : "unknown dlopen error") +
                      ". Reinstall the plugin or set TORCH_TPU_PLUGIN to another one.");
  }
  using GetApiFn = const PJRT_Api* (*)();
  auto get = reinterpret_cast<GetApiFn>(::dlsym(h, "GetPjrtApi"));
  if (!get) {
    ::dlclose(h);
    throw PluginError("'" + path + "' is not a PJRT plugin: it has no GetPjrtApi symbol.");
  }
  std::shared_ptr<Api> api(new Api());
  api->handle_ = h;
  api->path_ = path;
  api->api_ = get();
  if (!api->api_) throw PluginError("GetPjrtApi in '" + path + "' returned no API table.");
  if (api->api_->pjrt_api_version.major_version != PJRT_API_MAJOR)
    throw PluginError("PJRT plugin '" + path + "' has C API major version " +
                      std::to_string(api->api_->pjrt_api_version.major_version) + ", torch_tpu needs " +
                      std::to_string(PJRT_API_MAJOR) + ".");
  auto args = makeArgs<PJRT_Plugin_Initialize_Args>();
  api->check(api->api_->PJRT_Plugin_Initialize(&args), "PJRT_Plugin_Initialize");
  return api;
}

// The plugin stays loaded for the life of the process: XLA registers
// process-wide state (thread pools, atexit handlers) that must not be unmapped.
Api::~Api() = default;

std::string Api::message(const PJRT_Error* err) const {
  auto args = makeArgs<PJRT_Error_Message_Args>();
  args.error = err;
  api_->PJRT_Error_Message(&args);
  return std::string(args.message, args.message_size);
}

void Api::destroyError(PJRT_Error* err) const {
  if (!err) return;
  auto args = makeArgs<PJRT_Error_Destroy_Args>();
  args.error = err;
  api_->PJRT_Error_Destroy(&args);
}

namespace {
// PJRT's FFI extension (pjrt_c_api_ffi_extension.h, not shipped with the
// plugin wheels): the documented C layout up to the handler registration.
struct FfiRegisterArgs {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;
  const char* platform_name;
  size_t platform_name_size;
  int traits;
};
struct FfiExtension {
  PJRT_Extension_Base base;
  void* type_id_register;
  void* user_data_add;
  PJRT_Error* (*register_handler)(FfiRegisterArgs*);
};
}  // namespace

std::vector<std::pair<std::string, std::string>> Api::attributes() const {
  std::vector<std::pair<std::string, std::string>> out;
  if (!TPU_PJRT_HAS(*this, PJRT_Plugin_Attributes) || !api_->PJRT_Plugin_Attributes) return out;
  auto args = makeArgs<PJRT_Plugin_Attributes_Args>();
  check(api_->PJRT_Plugin_Attributes(&args), "PJRT_Plugin_Attributes");
  for (size_t i = 0; i < args.num_attributes; ++i) {
    const PJRT_NamedValue& v = args.attributes[i];
    std::string text;
    switch (v.type) {
      case PJRT_NamedValue_kString:
        text.assign(v.string_value, v.value_size);
        break;
      case PJRT_NamedValue_kInt64:
        text = std::to_string(v.int64_value);
        break;
      case PJRT_NamedValue_kInt64List:
        for (size_t j = 0; j < v.value_size; ++j) text += (j ? "." : "") + std::to_string(v.int64_array_value[j]);
        break;
      case PJRT_NamedValue_kFloat:
        text = std::to_string(v.float_value);
        break;
      case PJRT_NamedValue_kBool:
        text = v.bool_value ? "true" : "false";
        break;
      default:
        continue;
    }
    out.emplace_back(std::string(v.name, v.name_size), std::move(text));
  }
  return out;
}

void Api::registerFfiHandler(const std::string& target, const std::string& platform, void* handler) const {
  const FfiExtension* ffi = nullptr;
  for (auto* e = api_->extension_start; e; e = e->next)
    if (e->type == PJRT_Extension_Type_FFI && e->struct_size >= sizeof(FfiExtension))
      ffi = reinterpret_cast<const FfiExtension*>(e);
  if (!ffi || !ffi->register_handler)
    throw PluginError("the PJRT plugin '" + path_ + "' has no FFI extension: it cannot take custom-call handlers");
  FfiRegisterArgs a{
      sizeof(FfiRegisterArgs), target.data(), target.size(), handler, platform.data(), platform.size(), 0};
  if (PJRT_Error* err = ffi->register_handler(&a)) {
    std::string msg = message(err);
    destroyError(err);
    throw PluginError("registering the FFI handler '" + target + "' for platform " + platform + ": " + msg);
  }
}

void Api::check(PJRT_Error* err, const char* what) const {
  if (!err) return;
  std::string msg = message(err);
  auto cargs = makeArgs<PJRT_Error_GetCode_Args>();
  cargs.error = err;
  PJRT_Error_Code code = PJRT_Error_Code_UNKNOWN;
  if (api_->PJRT_Error_GetCode(&cargs) == nullptr) code = cargs.code;
  destroyError(err);
  throw Error(std::string(what) + " failed: " + msg, code);
}

Event::~Event() {
  if (!ev_) return;
  auto args = makeArgs<PJRT_Event_Destroy_Args>();
  args.event = ev_;
  api_->destroyError(api_->raw()->PJRT_Event_Destroy(&args));
}

void Event::await(const char* what) const {
  auto args = makeArgs<PJRT_Event_Await_Args>();
  args.event = ev_;
  api_->check(api_->raw()->PJRT_Event_Await(&args), what);
}

bool Event::isReady() const {
  auto args = makeArgs<PJRT_Event_IsReady_Args>();
  args.event = ev_;
  api_->check(api_->raw()->PJRT_Event_IsReady(&args), "PJRT_Event_IsReady");
  return args.is_ready;
}

void Event::onReady(std::function<void()> fn) const {
  struct Call {
    std::shared_ptr<const Api> api;
    std::function<void()> fn;
  };
  auto call = std::make_unique<Call>(Call{api_, std::move(fn)});
  auto args = makeArgs<PJRT_Event_OnReady_Args>();
  args.event = ev_;
  args.user_arg = call.get();
  args.callback = [](PJRT_Error* err, void* arg) {
    std::unique_ptr<Call> c(static_cast<Call*>(arg));
    c->api->destroyError(err);
    c->fn();
  };
  api_->check(api_->raw()->PJRT_Event_OnReady(&args), "PJRT_Event_OnReady");
  call.release();  // the callback owns it now
}

Buffer::~Buffer() {
  if (!buf_) return;
  live_.fetch_sub(1, std::memory_order_relaxed);
  auto args = makeArgs<PJRT_Buffer_Destroy_Args>();
  args.buffer = buf_;
  api_->destroyError(api_->raw()->PJRT_Buffer_Destroy(&args));
}

std::vector<int64_t> Buffer::dims() const {
  auto args = makeArgs<PJRT_Buffer_Dimensions_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_Dimensions(&args), "PJRT_Buffer_Dimensions");
  return std::vector<int64_t>(args.dims, args.dims + args.num_dims);
}

ElementType Buffer::elementType() const {
  auto args = makeArgs<PJRT_Buffer_ElementType_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ElementType(&args), "PJRT_Buffer_ElementType");
  return static_cast<ElementType>(args.type);
}

size_t Buffer::onDeviceBytes() const {
  auto args = makeArgs<PJRT_Buffer_OnDeviceSizeInBytes_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_OnDeviceSizeInBytes(&args), "PJRT_Buffer_OnDeviceSizeInBytes");
  return args.on_device_size_in_bytes;
}

size_t Buffer::hostBytes() const {
  auto args = makeArgs<PJRT_Buffer_ToHostBuffer_Args>();
  args.src = buf_;
  args.dst = nullptr;
  api_->check(api_->raw()->PJRT_Buffer_ToHostBuffer(&args), "PJRT_Buffer_ToHostBuffer");
  return args.dst_size;
}

void Buffer::toHost(void* dst, size_t dst_size) const {
  auto args = makeArgs<PJRT_Buffer_ToHostBuffer_Args>();
  args.src = buf_;
  args.dst = dst;
  args.dst_size = dst_size;
  api_->check(api_->raw()->PJRT_Buffer_ToHostBuffer(&args), "PJRT_Buffer_ToHostBuffer");
  Event ev(api_, args.event);
  ev.await("device-to-host copy");
}

const void* Buffer::unsafePointer() const {
  if (!api_->raw()->PJRT_Buffer_UnsafePointer) return nullptr;
  auto args = makeArgs<PJRT_Buffer_UnsafePointer_Args>();
  args.buffer = buf_;
  if (PJRT_Error* err = api_->raw()->PJRT_Buffer_UnsafePointer(&args)) {
    api_->destroyError(err);
    return nullptr;
  }
  // The C API hands the address over as an integer.
  return reinterpret_cast<const void*>(args.buffer_pointer);  // NOLINT(performance-no-int-to-ptr)
}

void Buffer::awaitReady() const {
  auto args = makeArgs<PJRT_Buffer_ReadyEvent_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ReadyEvent(&args), "PJRT_Buffer_ReadyEvent");
  Event ev(api_, args.event);
  ev.await("device computation");
}

bool Buffer::isReady() const {
  auto args = makeArgs<PJRT_Buffer_ReadyEvent_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ReadyEvent(&args), "PJRT_Buffer_ReadyEvent");
  Event ev(api_, args.event);
  return ev.isReady();
}

PJRT_Device* Buffer::device() const {
  auto args = makeArgs<PJRT_Buffer_Device_Args>();
  args.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_Device(&args), "PJRT_Buffer_Device");
  return args.device;
}

namespace {
// Calls fn(executable) on the PJRT_Executable behind `loaded` (a handle of its
// own, destroyed after), then raises the error fn returned, if any.
template <typename Fn>
void onExecutable(const Api& api, PJRT_LoadedExecutable* loaded, const char* what, Fn fn) {
  auto gargs = makeArgs<PJRT_LoadedExecutable_GetExecutable_Args>();
  gargs.loaded_executable = loaded;
  api.check(api.raw()->PJRT_LoadedExecutable_GetExecutable(&gargs), "PJRT_LoadedExecutable_GetExecutable");
  PJRT_Error* err = fn(gargs.executable);
  auto dargs = makeArgs<PJRT_Executable_Destroy_Args>();
  dargs.executable = gargs.executable;
  api.destroyError(api.raw()->PJRT_Executable_Destroy(&dargs));
  api.check(err, what);
}
}  // namespace

Executable::Executable(std::shared_ptr<const Api> api, PJRT_LoadedExecutable* exe) : api_(std::move(api)), exe_(exe) {
  onExecutable(*api_, exe_, "PJRT_Executable_NumOutputs", [this](PJRT_Executable* e) {
    auto args = makeArgs<PJRT_Executable_NumOutputs_Args>();
    args.executable = e;
    PJRT_Error* err = api_->raw()->PJRT_Executable_NumOutputs(&args);
    if (!err) num_outputs_ = args.num_outputs;
    return err;
  });
}

Executable::~Executable() {
  if (!exe_) return;
  auto args = makeArgs<PJRT_LoadedExecutable_Destroy_Args>();
  args.executable = exe_;
  api_->destroyError(api_->raw()->PJRT_LoadedExecutable_Destroy(&args));
}

std::vector<std::vector<std::unique_ptr<Buffer>>> Executable::launch(const std::vector<PJRT_Buffer*>* lists, size_t n,
                                                                     PJRT_ExecuteOptions& opts, PJRT_Device* device,
                                                                     PJRT_Event** complete) const {
  std::vector<PJRT_Buffer* const*> arg_lists(n);
  std::vector<PJRT_Buffer*> outs(n * num_outputs_, nullptr);
  std::vector<PJRT_Buffer**> out_lists(n);
  for (size_t r = 0; r < n; ++r) {
    arg_lists[r] = lists[r].data();
    out_lists[r] = outs.data() + r * num_outputs_;
  }
  auto eargs = makeArgs<PJRT_LoadedExecutable_Execute_Args>();
  eargs.executable = exe_;
  eargs.options = &opts;
  eargs.argument_lists = arg_lists.data();
  eargs.num_devices = n;
  eargs.num_args = n == 0 ? 0 : lists[0].size();
  eargs.output_lists = out_lists.data();
  eargs.device_complete_events = complete;
  eargs.execute_device = device;
  api_->check(api_->raw()->PJRT_LoadedExecutable_Execute(&eargs), "PJRT_LoadedExecutable_Execute");
  std::vector<std::vector<std::unique_ptr<Buffer>>> result(n);
  for (size_t r = 0; r < n; ++r) {
    result[r].reserve(num_outputs_);
    for (size_t i = 0; i < num_outputs_; ++i) result[r].push_back(std::make_unique<Buffer>(api_, out_lists[r][i]));
  }
  return result;
}

std::vector<std::unique_ptr<Buffer>> Executable::execute(const std::vector<PJRT_Buffer*>& args, PJRT_Device* device,
                                                         std::shared_ptr<Event>* done, const std::vector<int64_t>& keep,
                                                         int launch_id) const {
  auto opts = makeArgs<PJRT_ExecuteOptions>();
  opts.launch_id = launch_id;
  opts.non_donatable_input_indices = keep.data();
  opts.num_non_donatable_input_indices = keep.size();
  PJRT_Event* complete = nullptr;
  auto outs = launch(&args, 1, opts, device, done ? &complete : nullptr);
  if (done) *done = std::make_shared<Event>(api_, complete);
  return std::move(outs[0]);
}

std::vector<std::vector<std::unique_ptr<Buffer>>> Executable::executeReplicated(
    const std::vector<std::vector<PJRT_Buffer*>>& args) const {
  auto opts = makeArgs<PJRT_ExecuteOptions>();
  return launch(args.data(), args.size(), opts, nullptr, nullptr);
}

std::vector<std::unique_ptr<Buffer>> Executable::executeShard(const std::vector<PJRT_Buffer*>& args,
                                                              PJRT_Device* device, int launch_id) const {
  auto opts = makeArgs<PJRT_ExecuteOptions>();
  opts.launch_id = launch_id;
  return std::move(launch(&args, 1, opts, device, nullptr)[0]);
}

std::string Executable::serialize() const {
  std::string out;
  onExecutable(*api_, exe_, "PJRT_Executable_Serialize", [this, &out](PJRT_Executable* e) {
    auto args = makeArgs<PJRT_Executable_Serialize_Args>();
    args.executable = e;
    PJRT_Error* err = api_->raw()->PJRT_Executable_Serialize(&args);
    if (err) return err;
    out.assign(args.serialized_bytes, args.serialized_bytes_size);
    if (args.serialized_executable_deleter) args.serialized_executable_deleter(args.serialized_executable);
    return err;
  });
  return out;
}

namespace kv_bridge {
namespace {

KeyValueStore& storeOf(void* user_arg) { return *static_cast<KeyValueStore*>(user_arg); }

PJRT_Error* fail(PJRT_CallbackError* error, PJRT_Error_Code code, const std::string& message) {
  return (*error)(code, message.data(), message.size());
}

// The plugin copies the value, then frees it with the deleter handed back.
template <typename Args>
void handBack(Args* args, const std::string& value) {
  char* copy = new char[value.size() + 1];
  std::memcpy(copy, value.data(), value.size());
  copy[value.size()] = '\0';
  args->value = copy;
  args->value_size = value.size();
  args->value_deleter_callback = [](char* v) { delete[] v; };
}

}  // namespace

PJRT_Error* get(PJRT_KeyValueGetCallback_Args* args) {
  const std::string key(args->key, args->key_size);
  try {
    handBack(args, storeOf(args->user_arg).get(key, std::chrono::milliseconds(args->timeout_in_ms)));
    return nullptr;
  } catch (const KeyValueTimeout& e) {
    return fail(args->callback_error, PJRT_Error_Code_DEADLINE_EXCEEDED, e.what());
  } catch (const std::exception& e) {
    return fail(args->callback_error, PJRT_Error_Code_UNAVAILABLE, "key-value get '" + key + "': " + e.what());
  }
}

PJRT_Error* tryGet(PJRT_KeyValueTryGetCallback_Args* args) {
  const std::string key(args->key, args->key_size);
  try {
    std::optional<std::string> v = storeOf(args->user_arg).tryGet(key);
    if (!v) return fail(args->callback_error, PJRT_Error_Code_NOT_FOUND, "key '" + key + "' not found");
    handBack(args, *v);
    return nullptr;
  } catch (const std::exception& e) {
    return fail(args->callback_error, PJRT_Error_Code_UNAVAILABLE, "key-value try-get '" + key + "': " + e.what());
  }
}

PJRT_Error* put(PJRT_KeyValuePutCallback_Args* args) {
  const std::string key(args->key, args->key_size);
  try {
    storeOf(args->user_arg).put(key, std::string(args->value, args->value_size));
    return nullptr;
  } catch (const std::exception& e) {
    return fail(args->callback_error, PJRT_Error_Code_UNAVAILABLE, "key-value put '" + key + "': " + e.what());
  }
}

}  // namespace kv_bridge

std::unique_ptr<Client> Client::create(std::shared_ptr<Api> api, const ClientOptions& options) {
  std::unique_ptr<Client> c(new Client());
  c->api_ = std::move(api);
  const PJRT_Api* raw = c->api_->raw();
  std::vector<PJRT_NamedValue> opts;
  opts.reserve(options.values.size());
  for (const NamedOption& o : options.values) {
    PJRT_NamedValue n{};
    n.struct_size = sizeof(PJRT_NamedValue);
    n.name = o.name.c_str();
    n.name_size = o.name.size();
    n.value_size = 1;
    if (const auto* i = std::get_if<int64_t>(&o.value)) {
      n.type = PJRT_NamedValue_kInt64;
      n.int64_value = *i;
    } else {
      n.type = PJRT_NamedValue_kBool;
      n.bool_value = std::get<bool>(o.value);
    }
    opts.push_back(n);
  }
  c->kv_ = options.kv;
  auto args = makeArgs<PJRT_Client_Create_Args>();
  args.create_options = opts.data();
  args.num_options = opts.size();
  if (c->kv_) {
    args.kv_get_callback = kv_bridge::get;
    args.kv_get_user_arg = c->kv_.get();
    args.kv_try_get_callback = kv_bridge::tryGet;
    args.kv_try_get_user_arg = c->kv_.get();
    args.kv_put_callback = kv_bridge::put;
    args.kv_put_user_arg = c->kv_.get();
  }
  c->api_->check(raw->PJRT_Client_Create(&args), "PJRT_Client_Create");
  c->client_ = args.client;

  auto pn = makeArgs<PJRT_Client_PlatformName_Args>();
  pn.client = c->client_;
  c->api_->check(raw->PJRT_Client_PlatformName(&pn), "PJRT_Client_PlatformName");
  c->platform_name_.assign(pn.platform_name, pn.platform_name_size);
  auto pv = makeArgs<PJRT_Client_PlatformVersion_Args>();
  pv.client = c->client_;
  c->api_->check(raw->PJRT_Client_PlatformVersion(&pv), "PJRT_Client_PlatformVersion");
  c->platform_version_.assign(pv.platform_version, pv.platform_version_size);

  auto da = makeArgs<PJRT_Client_AddressableDevices_Args>();
  da.client = c->client_;
  c->api_->check(raw->PJRT_Client_AddressableDevices(&da), "PJRT_Client_AddressableDevices");
  for (size_t i = 0; i < da.num_addressable_devices; ++i) {
    DeviceInfo info;
    info.raw = da.addressable_devices[i];
    info.id = static_cast<int>(i);
    auto gd = makeArgs<PJRT_Device_GetDescription_Args>();
    gd.device = info.raw;
    c->api_->check(raw->PJRT_Device_GetDescription(&gd), "PJRT_Device_GetDescription");
    auto kd = makeArgs<PJRT_DeviceDescription_Kind_Args>();
    kd.device_description = gd.device_description;
    c->api_->check(raw->PJRT_DeviceDescription_Kind(&kd), "PJRT_DeviceDescription_Kind");
    info.kind.assign(kd.device_kind, kd.device_kind_size);
    auto id = makeArgs<PJRT_DeviceDescription_Id_Args>();
    id.device_description = gd.device_description;
    c->api_->check(raw->PJRT_DeviceDescription_Id(&id), "PJRT_DeviceDescription_Id");
    info.global_id = id.id;
    auto ds = makeArgs<PJRT_DeviceDescription_DebugString_Args>();
    ds.device_description = gd.device_description;
    c->api_->check(raw->PJRT_DeviceDescription_DebugString(&ds), "PJRT_DeviceDescription_DebugString");
    info.debug.assign(ds.debug_string, ds.debug_string_size);
    c->devices_.push_back(std::move(info));
  }
  auto all = makeArgs<PJRT_Client_Devices_Args>();
  all.client = c->client_;
  c->api_->check(raw->PJRT_Client_Devices(&all), "PJRT_Client_Devices");
  c->global_device_count_ = static_cast<int>(all.num_devices);
  c->addressable_count_ = static_cast<int>(c->devices_.size());
  return c;
}

void Client::keepDevices(const std::vector<int>& positions) {
  std::vector<DeviceInfo> kept;
  for (int p : positions) {
    if (p < 0 || p >= static_cast<int>(devices_.size()))
      throw std::out_of_range("device " + std::to_string(p) + " does not exist (the plugin has " +
                              std::to_string(devices_.size()) + ")");
    kept.push_back(devices_[p]);
    kept.back().id = static_cast<int>(kept.size()) - 1;
  }
  devices_ = std::move(kept);
}

Client::~Client() {
  if (!client_) return;
  auto args = makeArgs<PJRT_Client_Destroy_Args>();
  args.client = client_;
  api_->destroyError(api_->raw()->PJRT_Client_Destroy(&args));
}

std::unique_ptr<Executable> Client::compile(const std::string& mlir, const std::string& options) const {
  auto prog = makeArgs<PJRT_Program>();
  prog.code = const_cast<char*>(mlir.data());
  prog.code_size = mlir.size();
  static const char kFormat[] = "mlir";
  prog.format = kFormat;
  prog.format_size = sizeof(kFormat) - 1;
  auto args = makeArgs<PJRT_Client_Compile_Args>();
  args.client = client_;
  args.program = &prog;
  args.compile_options = options.data();
  args.compile_options_size = options.size();
  api_->check(api_->raw()->PJRT_Client_Compile(&args), "PJRT_Client_Compile");
  return std::make_unique<Executable>(api_, args.executable);
}

std::unique_ptr<Executable> Client::deserialize(const std::string& bytes) const {
  auto args = makeArgs<PJRT_Executable_DeserializeAndLoad_Args>();
  args.client = client_;
  args.serialized_executable = bytes.data();
  args.serialized_executable_size = bytes.size();
  api_->check(api_->raw()->PJRT_Executable_DeserializeAndLoad(&args), "PJRT_Executable_DeserializeAndLoad");
  return std::make_unique<Executable>(api_, args.loaded_executable);
}

PJRT_Client_BufferFromHostBuffer_Args Client::bufferFromHost(const void* data, ElementType type,
                                                             const std::vector<int64_t>& dims, int device,
                                                             PJRT_HostBufferSemantics semantics) const {
  auto args = makeArgs<PJRT_Client_BufferFromHostBuffer_Args>();
  args.client = client_;
  args.data = data;
  args.type = static_cast<PJRT_Buffer_Type>(type);
  args.dims = dims.data();
  args.num_dims = dims.size();
  args.host_buffer_semantics = semantics;
  args.device = devices_.at(device).raw;
  api_->check(api_->raw()->PJRT_Client_BufferFromHostBuffer(&args), "PJRT_Client_BufferFromHostBuffer");
  return args;
}

std::unique_ptr<Buffer> Client::fromHost(const void* data, ElementType type, const std::vector<int64_t>& dims,
                                         int device) const {
  auto args = bufferFromHost(data, type, dims, device, PJRT_HostBufferSemantics_kImmutableOnlyDuringCall);
  auto buf = std::make_unique<Buffer>(api_, args.buffer);
  Event done(api_, args.done_with_host_buffer);
  done.await("host-to-device copy");
  return buf;
}

std::unique_ptr<Buffer> Client::fromHostZeroCopy(void* data, ElementType type, const std::vector<int64_t>& dims,
                                                 int device, std::function<void()> on_done) const {
  auto args = bufferFromHost(data, type, dims, device, PJRT_HostBufferSemantics_kMutableZeroCopy);
  auto buf = std::make_unique<Buffer>(api_, args.buffer);
  if (!args.done_with_host_buffer) {
    // No word of when the plugin lets go of `data`: a copy instead.
    buf = fromHost(data, type, dims, device);
    on_done();
    return buf;
  }
  Event(api_, args.done_with_host_buffer).onReady(std::move(on_done));
  return buf;
}

MemoryStats Client::memoryStats(int device) const {
  MemoryStats s;
  if (!TPU_PJRT_HAS(*api_, PJRT_Device_MemoryStats)) return s;
  auto args = makeArgs<PJRT_Device_MemoryStats_Args>();
  args.device = devices_.at(device).raw;
  PJRT_Error* err = api_->raw()->PJRT_Device_MemoryStats(&args);
  if (err) {  // UNIMPLEMENTED on some plugins (the CPU one): no figures.
    api_->destroyError(err);
    return s;
  }
  s.bytes_in_use = args.bytes_in_use;
  if (args.bytes_limit_is_set) s.bytes_limit = args.bytes_limit;
  return s;
}

namespace {
// Protobuf wire format: a varint field key is (field << 3) | wire type.
constexpr uint64_t kWireVarint = 0, kWireBytes = 2;
uint64_t fieldKey(uint64_t field, uint64_t wire) { return (field << 3U) | wire; }

void putVarint(std::string& out, uint64_t v) {
  constexpr uint64_t kLow7 = 0x7fU, kMore = 0x80U;
  while (v >= kMore) {
    out += static_cast<char>((v & kLow7) | kMore);
    v >>= 7U;
  }
  out += static_cast<char>(v);
}
void putInt(std::string& out, uint64_t field, uint64_t value) {
  putVarint(out, fieldKey(field, kWireVarint));
  putVarint(out, value);
}
void putBytes(std::string& out, uint64_t field, const std::string& bytes) {
  putVarint(out, fieldKey(field, kWireBytes));
  putVarint(out, bytes.size());
  out += bytes;
}
}  // namespace

std::string compileOptions(bool portable, const OptionOverrides& overrides) {
  // CompileOptionsProto{ compile_portable_executable(4)=true,
  //   executable_build_options(3){ num_replicas(4)=1, num_partitions(5)=1 },
  //   env_option_overrides(7): map entries {key(1), value(2): OptionOverrideProto{int_field(3)}} }
  std::string out;
  if (portable) out += std::string("\x20\x01", 2);
  out += std::string("\x1a\x04\x20\x01\x28\x01", 6);
  for (const auto& [name, value] : overrides) {
    std::string override_value;
    putInt(override_value, 3, static_cast<uint64_t>(value));
    std::string entry;
    putBytes(entry, 1, name);
    putBytes(entry, 2, override_value);
    putBytes(out, 7, entry);
  }
  return out;
}

std::string replicatedCompileOptions(const std::vector<int>& device_ids, const OptionOverrides& overrides) {
  // executable_build_options(3){ num_replicas(4)=n, num_partitions(5)=1,
  //   device_assignment(9): DeviceAssignmentProto{ replica_count(1)=n, computation_count(2)=1,
  //     computation_devices(3){ replica_device_ids(1): packed ids } } }
  const auto n = static_cast<uint64_t>(device_ids.size());
  std::string ids;
  for (int id : device_ids) putVarint(ids, static_cast<uint64_t>(id));
  std::string computation;
  putBytes(computation, 1, ids);
  std::string assignment;
  putInt(assignment, 1, n);
  putInt(assignment, 2, 1);
  putBytes(assignment, 3, computation);
  std::string build;
  putInt(build, 4, n);
  putInt(build, 5, 1);
  putBytes(build, 9, assignment);
  // The overrides as compileOptions writes them, after a non-portable head.
  std::string out = compileOptions(/*portable=*/false, overrides);
  const std::string single("\x1a\x04\x20\x01\x28\x01", 6);
  out.replace(out.find(single), single.size(), "");
  std::string head;
  putBytes(head, 3, build);
  return head + out;
}

size_t elementSize(ElementType t) {
  switch (t) {
    case ElementType::PRED:
    case ElementType::S8:
    case ElementType::U8:
      return 1;
    case ElementType::S16:
    case ElementType::U16:
    case ElementType::F16:
    case ElementType::BF16:
      return 2;
    case ElementType::S32:
    case ElementType::U32:
    case ElementType::F32:
      return 4;
    case ElementType::S64:
    case ElementType::U64:
    case ElementType::F64:
    case ElementType::C64:
      return 8;
    case ElementType::C128:
      return 16;
  }
  return 0;
}

}  // namespace tpu::pjrt
