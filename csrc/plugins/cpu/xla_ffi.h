// The parts of XLA's FFI C ABI (xla/ffi/api/c_api.h, API 0.2) and PJRT's FFI
// extension (pjrt_c_api_ffi_extension.h) that the host kernels use. Neither
// header ships with the plugin wheels; the layouts are the documented C
// structs. No torch headers here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pjrt/pjrt.h"

namespace tpu::plugins::cpu {

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
// XLA_FFI_Api in full up to XLA_FFI_ThreadPool_NumThreads (the API's
// functions in their documented order; older plugins end the struct sooner,
// which struct_size tells).
struct FfiApi {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  FfiApiVersion api_version;
  void* internal_api;
  void* (*error_create)(FfiErrorCreateArgs*);
  void* error_get_message;
  void (*error_destroy)(void* args);
  void* handler_register;
  void* stream_get;
  void* type_id_register;
  void* execution_context_get;
  void* state_set;
  void* state_get;
  void* device_memory_allocate;
  void* device_memory_free;
  void* (*thread_pool_schedule)(void* args);
  void* (*thread_pool_num_threads)(void* args);
};
struct FfiErrorDestroyArgs {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  void* error;
};
struct FfiThreadPoolScheduleArgs {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  void* ctx;
  void (*task)(void* data);
  void* data;
};
struct FfiThreadPoolNumThreadsArgs {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  void* ctx;
  int64_t* num_threads;
};
constexpr int kFfiApiMinor = 1;
constexpr int kStageExecute = 3;
constexpr int kDTypeS32 = 4, kDTypeS64 = 5, kDTypeF32 = 11;
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

}  // namespace tpu::plugins::cpu
