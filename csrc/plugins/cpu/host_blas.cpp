// The CPU plugin's GEMM kernel runs on a host BLAS (host_kernels.h).
// PyTorch's x86 CPU build bundles MKL into libtorch_cpu, which this extension
// links. Python loads extensions with RTLD_LOCAL, so MKL's symbols are not
// global: they are looked up in that library's own handle. Where it has no
// MKL (other builds, other CPUs), products stay XLA dots.
#include <dlfcn.h>

#include "plugins/cpu/cpu_plugin.h"
#include "plugins/cpu/host_kernels.h"

namespace tpu::plugins::cpu {

bool useTorchBlas() {
  void* lib = dlopen("libtorch_cpu.so", RTLD_NOLOAD | RTLD_LAZY);
  if (!lib) return false;
  HostBlas blas;
  blas.sgemm = reinterpret_cast<HostBlas::Sgemm>(dlsym(lib, "sgemm_"));
  // The C entry point (mkl_service.h maps mkl_set_num_threads_local to it);
  // the lower-case symbol is the Fortran one, which takes a pointer.
  blas.set_threads_local = reinterpret_cast<HostBlas::SetThreadsLocal>(dlsym(lib, "MKL_Set_Num_Threads_Local"));
  dlclose(lib);  // the NOLOAD handle only counted a reference; the library stays
  if (!blas.available()) return false;
  setHostBlas(blas);
  return true;
}

}  // namespace tpu::plugins::cpu
