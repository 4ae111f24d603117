// Explicit tpu kernels for what the lowering table cannot express: tensor
// creation, views over shared storage, copies, storage resizing, reading a
// scalar back to the host.
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/native/Resize.h>
#include <ATen/native/ResizeCommon.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include "aten/tpu.h"

namespace tpu::aten {
namespace {

c10::DeviceIndex deviceIndexOf(std::optional<at::Device> device) {
  c10::DeviceIndex d = device && device->has_index() ? device->index() : currentDevice();
  checkDeviceIndex(d);
  return d;
}

void checkDtype(at::ScalarType t) {
  TORCH_CHECK_TYPE(supported(t), "torch_tpu: dtype ", c10::toString(t), " is not supported on tpu (",
                   runtime::Runtime::get().client().platformName(), " supports: ", supportedDtypes(), ").");
}

bool fillsNewMemory() {
  return at::globalContext().deterministicAlgorithms() && at::globalContext().deterministicFillUninitializedMemory();
}

// torch.use_deterministic_algorithms(True) fills new memory with NaN (or the
// integer maximum), as on the CPU and CUDA, so that a read of memory nobody
// wrote gives the same value every run; tpu memory otherwise reads as zeros.
at::Tensor& fillIfDeterministic(at::Tensor& t) {
  if (C10_UNLIKELY(fillsNewMemory()) && t.numel() > 0) at::native::fill_empty_deterministic_(t);
  return t;
}

at::Tensor empty_memory_format(at::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  auto dt = c10::dtype_or_default(dtype);
  checkDtype(dt);
  TORCH_CHECK(!layout || *layout == at::kStrided, "torch_tpu: only strided tensors are supported on tpu");
  c10::DeviceIndex d = deviceIndexOf(device);
  c10::DeviceGuard g(c10::Device(kTpu, d));
  at::Tensor t = at::detail::empty_generic(size, allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dt,
                                           memory_format);
  return fillIfDeterministic(t);
}

at::Tensor empty_strided(at::IntArrayRef size, at::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  auto dt = c10::dtype_or_default(dtype);
  checkDtype(dt);
  c10::DeviceIndex d = deviceIndexOf(device);
  c10::DeviceGuard g(c10::Device(kTpu, d));
  at::Tensor t = at::detail::empty_strided_generic(size, stride, allocator(),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dt);
  return fillIfDeterministic(t);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  for (auto s : sizes) TORCH_CHECK(s >= 0, "Trying to create tensor with negative dimension ", s, ": ", sizes);
  auto* impl = self.unsafeGetTensorImpl();
  // Contiguous strides for the new shape (the memory format's, if given).
  impl->set_sizes_contiguous(sizes);
  if (memory_format && *memory_format != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*memory_format);
  int64_t needed =
      at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), self.storage_offset());
  const auto old_bytes = static_cast<int64_t>(self.storage().nbytes());
  if (needed > old_bytes) {
    resizeStorageBytes(self.storage().unsafeGetStorageImpl(), needed);
    if (C10_UNLIKELY(fillsNewMemory())) at::native::fill_resize_deterministic_(self, old_bytes);
  }
  return self;
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, c10::SymInt storage_offset, c10::SymIntArrayRef size,
                        c10::SymIntArrayRef stride) {
  auto sizes = C10_AS_INTARRAYREF_SLOW(size);
  auto strides = C10_AS_INTARRAYREF_SLOW(stride);
  int64_t off = storage_offset.expect_int();
  TORCH_CHECK(off >= 0, "Tensor: invalid storage offset ", off);
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(source));
  self.unsafeGetTensorImpl()->set_storage_offset(off);
  if (strides.empty())
    self.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  else
    self.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  int64_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(), off);
  if (needed > static_cast<int64_t>(self.storage().nbytes()))
    resizeStorageBytes(self.storage().unsafeGetStorageImpl(), needed);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  std::vector<c10::SymInt> size{c10::SymInt(n)};
  return set_storage(self, std::move(source), 0, size, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  if (self.is_same(src)) return self;
  auto sizes = c10::fromIntArrayRefSlow(src.sizes());
  auto strides = c10::fromIntArrayRefSlow(src.strides());
  return set_storage(self, src.storage(), src.storage_offset(), sizes, strides);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard g(self.device());
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, allocator(), true);
  std::vector<c10::SymInt> size{c10::SymInt(0)};
  return set_storage(self, std::move(storage), 0, size, {});
}

// view_as_real / view_as_complex share the storage under another dtype;
// reading the new view reinterprets the bytes on the device.
at::Tensor view_as_real(const at::Tensor& self) {
  TORCH_CHECK_TYPE(!self.is_complex() || supported(c10::toRealValueType(self.scalar_type())), "torch_tpu: dtype ",
                   c10::toRealValueType(self.scalar_type()), " is not supported on tpu");
  return at::native::view_as_real(self);
}

at::Tensor view_as_complex(const at::Tensor& self) {
  auto t = self.scalar_type();
  TORCH_CHECK_TYPE((t != at::kFloat && t != at::kDouble && t != at::kHalf) || supported(c10::toComplexType(t)),
                   "torch_tpu: dtype ", c10::toComplexType(t), " is not supported on tpu (", supportedDtypes(), ")");
  return at::native::view_as_complex(self);
}

// torch.equal returns a bool: the comparison runs on the device and one
// byte comes back (istft checks its window this way). Dtypes promote, as
// on the CPU.
bool equal(const at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device() == other.device(), "Cannot compare two tensors on different devices. Got: ", self.device(),
              " and ", other.device());
  if (!self.is_same_size(other)) return false;
  if (self.numel() == 0) return true;
  return at::eq(self, other).all().item<bool>();
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  copyInto(dst, self);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  copyInto(dst, self);
  return dst;
}

at::Tensor& copy_(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  TORCH_CHECK(self.defined() && src.defined(), "copy_: tensors must be defined");
  at::infer_size(self.sizes(), src.sizes());  // raises on a broadcasting mismatch
  TORCH_CHECK(src.dim() <= self.dim() || src.numel() == self.numel(), "copy_: the source of shape ", src.sizes(),
              " cannot be broadcast to ", self.sizes());
  // PyTorch's copy_: a view copied onto itself is a no-op; a destination whose
  // elements share memory, or one partly over its source, is an error.
  if (self.is_same(src) ||
      (self.is_alias_of(src) && self.storage_offset() == src.storage_offset() && self.sizes().equals(src.sizes()) &&
       self.strides().equals(src.strides()) && self.scalar_type() == src.scalar_type() &&
       self.is_conj() == src.is_conj() && self.is_neg() == src.is_neg()))
    return self;
  at::assert_no_internal_overlap(self);
  at::assert_no_partial_overlap(self, src);
  copyInto(self, src);
  return self;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  TORCH_CHECK(self.numel() == 1, "a Tensor with ", self.numel(), " elements cannot be converted to Scalar");
  at::Tensor host = self.to(at::kCPU);
  return host.item();
}

// Whether `param.data = other` may swap a tensor's contents for `other`'s
// (Variable::set_data asks). PyTorch allows it between its built-in dense
// backends (CPU, CUDA, XPU, ...) but not PrivateUse1, so `p.data = p.to("tpu")`
// failed where it works for cuda (FSDP2's _move_states_to_device does it).
// Here tpu counts as one of the dense backends; the rest is PyTorch's rule.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    const c10::DispatchKeySet ks = t.key_set();
    constexpr auto backends = c10::DispatchKeySet({c10::BackendComponent::CPUBit, c10::BackendComponent::CUDABit,
                                                   c10::BackendComponent::MPSBit, c10::BackendComponent::HIPBit,
                                                   c10::BackendComponent::XPUBit, c10::BackendComponent::HPUBit,
                                                   c10::BackendComponent::PrivateUse1Bit});
    return ks.has_any(c10::DispatchKeySet(c10::DispatchKey::Dense)) && ks.has_any(backends);
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) || (dense(self) && dense(from));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("copy_", copy_);
  m.impl("_local_scalar_dense", local_scalar_dense);
  // Views share the storage; these are PyTorch's generic strided views.
  m.impl("view", at::native::view);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", view_as_real);
  m.impl("view_as_complex", view_as_complex);
  m.impl("equal", equal);
}

}  // namespace tpu::aten
