// The CPU plugin's GEMM kernel runs on a host BLAS (runtime/host_kernels.h).
// PyTorch's x86 CPU build bundles MKL into libtorch_cpu, which this extension
// links. Python loads extensions with RTLD_LOCAL, so MKL's symbols are not
// global: they are looked up in that library's own handle. Where it has no
// MKL (other builds, other CPUs), products stay XLA dots.
#include <dlfcn.h>

#include "aten/tpu.h"
#include "runtime/host_kernels.h"

namespace tpu::aten {

bool useTorchBlas() {
  void* lib = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_LAZY);
  if (!lib) return false;
  runtime::HostBlas blas;
  blas.sgemm = reinterpret_cast<runtime::HostBlas::Sgemm>(dlsym(lib, "sgemm_"));
  // The C entry point (mkl_service.h maps mkl_set_num_threads_local to it);
  // the lower-case symbol is the Fortran one, which takes a pointer.
  blas.set_threads_local =
      reinterpret_cast<runtime::HostBlas::SetThreadsLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local"));
  dlclose(lib);  // the NOLOAD handle only counted a reference; the library stays
  if (!blas.available()) return false;
  runtime::setHostBlas(blas);
  return true;
}

}  // namespace tpu::aten
