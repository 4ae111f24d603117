// The parts of XLA's FFI C ABI (xla/ffi/api/c_api.h, API 0.2) that the host
// kernels and user kernels use (PJRT's FFI extension: pjrt.h). Neither
// header ships with the plugin wheels; the layouts are the documented C
// structs. No torch headers here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pjrt/pjrt.h"

namespace tpu::xla_ffi {

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
struct FfiAttrs {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  int64_t size;
  int* types;
  void** names;
  void** attrs;
};
struct FfiCallFrame {
  size_t struct_size;
  FfiExtensionBase* extension_start;
  const void* api;
  void* ctx;
  int stage;
  FfiList args;
  FfiList rets;
  FfiAttrs attrs;
};
// A handler checks a call frame's struct_size for equality with this (the
// size up to `attrs`, API 0.1 to 0.3).
constexpr size_t kFfiCallFrameSize = offsetof(FfiCallFrame, attrs) + sizeof(FfiAttrs);
static_assert(kFfiCallFrameSize == 168, "XLA_FFI_CallFrame is 168 bytes");
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

}  // namespace tpu::xla_ffi
