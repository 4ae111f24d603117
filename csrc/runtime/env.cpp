#include "runtime/env.h"

#include <cstdlib>
#include <stdexcept>

namespace tpu::env {

const std::vector<Var>& all() {
  static const std::vector<Var> vars = {
      // Which plugin and devices.
      {"TORCH_TPU_PLUGIN", "text", "", "runtime",
       "`tpu`, `cuda`, `cpu` or a path to a PJRT plugin `.so`; unset: the first of tpu, cuda, cpu that is installed"},
      {"TORCH_TPU_PLUGIN_PATH", "path", "", "runtime", "more folders (`:`-separated) to search for named plugins"},
      {"TORCH_TPU_CPU_DEVICES", "integer", "1", "runtime",
       "how many devices the CPU plugin exposes, to test multi-device code on one host"},
      {"TPU_VISIBLE_DEVICES", "list", "", "runtime",
       "device positions (comma-separated) this process uses, as tpu:0, tpu:1, ... (Ray, transformers and vLLM's "
       "launchers set it); an empty value leaves none"},
      {"TPU_VISIBLE_CHIPS", "list", "", "runtime",
       "as `TPU_VISIBLE_DEVICES` where that is unset; on a TPU libtpu applies it itself"},
      {"TORCH_TPU_MEMORY_LIMIT", "bytes", "", "runtime",
       "device memory limit (bytes, or with K/M/G); unset: what the plugin reports, else host RAM"},
      // Modes.
      {"TPU_LAUNCH_BLOCKING", "0/1", "0", "Python", "1: debug eager (every launch waited for, errors at their op)"},
      {"TORCH_TPU_LAUNCH_BLOCKING", "0/1", "0", "Python", "the same as `TPU_LAUNCH_BLOCKING` (Google's TorchTPU name)"},
      {"TORCH_TPU_DEFER_AND_FUSE", "0/1", "0", "fused eager", "1: fused eager (ops deferred into graphs)"},
      {"TORCH_TPU_FUSE_MAX_OPS", "integer", "1000", "fused eager", "ops a pending graph holds before it runs"},
      {"TORCH_TPU_DONATE", "0/1", "1", "runtime",
       "0: never donate an overwritten array's buffer to the program that overwrites it (every mode)"},
      {"TORCH_TPU_DONATE_MIN_BYTES", "integer", "1048576", "runtime",
       "strict and fused eager donate only buffers of at least this many bytes (compiled graphs: any)"},
      {"TORCH_TPU_DEBUG_CAPTURE", "0/1", "", "torch.compile", "set: print why a compiled graph cannot be replayed"},
      // Fallback and lowerings.
      {"TORCH_TPU_FALLBACK", "text", "warn", "runtime",
       "`error`: an op without a tpu lowering raises instead of running on the CPU"},
      {"TORCH_TPU_DISABLE_LOWERINGS", "list", "", "runtime",
       "ATen ops (base names, comma-separated) sent to the CPU fallback, to bisect a suspected wrong lowering"},
      // Compilation cache and diagnostics.
      {"TORCH_TPU_CACHE_DIR", "path", "~/.cache/torch_tpu", "runtime",
       "the on-disk compilation cache; `off` or `0` turns it off"},
      {"TORCH_TPU_CACHE_MAX_BYTES", "integer", "2147483648", "runtime", "size bound of the on-disk cache"},
      {"TORCH_TPU_LOG_RECOMPILES", "0/1", "0", "runtime", "1: print the reason of every compile"},
      {"TORCH_TPU_METRICS_FILE", "path", "", "runtime",
       "at exit, a process that used the device writes torch_tpu.metrics() there as JSON (`{rank}` in the path: "
       "torchrun's RANK), to read a job's counters from outside"},
      {"TORCH_TPU_MAX_PROGRAMS", "integer", "2048", "runtime",
       "compiled programs kept loaded; past it the least recently run are unloaded and loaded again (from the "
       "disk cache) when they run next"},
      {"TORCH_TPU_SLOW_COMPILE_S", "seconds", "20", "runtime",
       "a compile running longer than this is named on stderr (the program, its op count and size), again at each "
       "multiple, and its time when done; 0: never"},
      {"TORCH_TPU_COLLECTIVES_IN_PROGRAM", "0/1", "1", "distributed",
       "0: a compiled step's functional collectives over a group of ranks as threads (local_group) run as "
       "tpu_dist calls between the step's programs, as over processes, instead of inside them"},
      {"TORCH_TPU_DIST_CHECK", "0/1", "1", "distributed",
       "0: tpu_dist compares only the sizes of the data ranks exchange, not that all ranks pass the same "
       "collective, dtypes and shapes (records carried in the collective's first messages)"},
      {"TORCH_TPU_DIST_TRANSPORT", "text", "auto", "distributed",
       "`staged`: tpu_dist copies through the host even where the plugin's client could span torchrun's processes "
       "(the CUDA plugin); `xla`: an error where it cannot"},
      {"XLA_FLAGS", "text", "", "XLA",
       "XLA's own flags; part of the compilation cache key (a vector width set here wins)"},
      {"LIBTPU_INIT_ARGS", "text", "", "XLA", "libtpu's own flags; part of the compilation cache key"},
      // The CPU plugin's accelerations (csrc/plugins/cpu, docs/cpu_plugin.md).
      {"TORCH_TPU_HOST_KERNELS", "0/1", "1", "CPU plugin",
       "0: float32 attention, layer norm, softmax and products compile from StableHLO instead of host kernels"},
      {"TORCH_TPU_HOST_GEMM", "0/1", "1", "CPU plugin",
       "0: float32 matrix products stay XLA dots instead of the GEMM kernel on MKL"},
      {"TORCH_TPU_HOST_READS", "0/1", "1", "CPU plugin",
       "0: copy results to the host through the plugin instead of reading its host-memory buffers in place"},
      {"TORCH_TPU_MALLOC_TUNING", "0/1", "1", "CPU plugin",
       "0: leave glibc malloc at its defaults (applies to the whole process)"},
      {"TORCH_TPU_CPU_VECTOR_WIDTH", "integer", "512 with AVX-512", "CPU plugin",
       "vector width XLA:CPU compiles for: 128, 256 or 512"},
      {"TORCH_TPU_CPU_SPIN_US", "integer", "2000", "CPU plugin",
       "microseconds the core spinners keep spinning after the last program; 0 turns them off"},
      // Integrations.
      {"TORCH_TPU_ACCELERATE", "0/1", "1", "Python", "0: leave Hugging Face Accelerate's device choice alone"},
      // Serving with vLLM (torch_tpu/vllm, docs/serving.md).
      {"VLLM_TORCH_TPU", "0/1", "1", "vLLM plugin",
       "0: the plugin declines, and vLLM stays on its own CPU backend (as `VLLM_TARGET_DEVICE=cpu` does)"},
      {"VLLM_TPU_KVCACHE_SPACE", "number", "1", "vLLM plugin",
       "the KV cache's size in GiB; unset: `VLLM_CPU_KVCACHE_SPACE`, else 1"},
      {"VLLM_TPU_COMPILE", "0/1", "1", "vLLM plugin",
       "0: each serving step runs op by op instead of as one graph compiled by torch_tpu's backend"},
      {"VLLM_TPU_CAPTURE_STEPS", "0/1", "1", "vLLM plugin",
       "0: the compiled graph runs through the dispatcher each step instead of replaying its recorded program"},
      // Scripts and tests.
      {"TORCH_TPU_VENV", "path", ".venv", "scripts", "the virtual environment scripts/setup.sh creates and uses"},
      {"TORCH_TPU_BUILD_DIR", "path", "build", "scripts",
       "the CMake build folder `pip install` (setup.py) builds the extension in"},
      {"TORCH_TPU_TEST_FUSED", "0/1", "1", "scripts", "0: scripts/test.sh skips its pass in fused eager"},
      {"TORCH_TPU_TEST_VLLM", "0/1", "1", "scripts",
       "0: scripts/test.sh skips the vLLM serving and routing tests (and their set-up, scripts/setup_routing.sh)"},
      {"TORCH_TPU_TEST_SGLANG", "0/1", "1", "scripts",
       "0: scripts/test.sh skips the SGLang serving tests (and their set-up, scripts/setup_sglang.sh)"},
      {"TORCH_TPU_TEST_VERL", "0/1", "1", "scripts",
       "0: scripts/test.sh skips the VeRL tests (and their set-up, scripts/setup_verl.sh)"},
      {"TORCH_TPU_TEST_WORKERS", "integer", "2", "scripts",
       "pytest worker processes scripts/test.sh runs each pass in (pytest-xdist); 1: one process"},
      {"TORCH_TPU_TEST_TORCH211", "0/1", "1", "scripts",
       "0: scripts/test.sh skips the build against torch 2.11 (scripts/check_torch211.sh)"},
      {"TORCH_TPU_VLLM_VENV", "path", ".venv-vllm", "scripts",
       "the serving environment (vLLM and torch_tpu) scripts/setup_vllm.sh creates and uses"},
      {"TORCH_TPU_ZOO_TEST_CRASH", "text", "", "tests",
       "model zoo tests only: the architecture whose worker crashes on purpose"},
      // Other programs' variables, read as those programs define them (the scope
      // says whose): declared so that every read goes through the registry.
      {"VLLM_CPU_KVCACHE_SPACE", "number", "", "vLLM plugin (vLLM's own)",
       "vLLM's CPU backend's KV cache size in GiB; the plugin's where `VLLM_TPU_KVCACHE_SPACE` is unset"},
      {"WORLD_SIZE", "integer", "1", "distributed (set by torchrun)",
       "the job's process count: above 1 under torchrun, the plugin's client may span the processes"},
      {"RANK", "integer", "0", "distributed (set by torchrun)",
       "this process's rank: its process id in a client that spans processes"},
      {"LOCAL_RANK", "integer", "0", "distributed (set by torchrun)",
       "this process's rank on its host: a process that sees several devices starts on tpu:LOCAL_RANK"},
      {"MASTER_ADDR", "text", "", "distributed (set by torchrun)",
       "host of the store torchrun's agent serves, where the processes of a spanning client meet"},
      {"MASTER_PORT", "integer", "", "distributed (set by torchrun)", "port of that store"},
      {"TORCHELASTIC_USE_AGENT_STORE", "text", "", "distributed (set by torchrun)",
       "`True`: the job runs under torchrun's agent, whose store a spanning client uses"},
      {"TORCHELASTIC_RESTART_COUNT", "integer", "0", "distributed (set by torchrun)",
       "the restart attempt: a restarted job's client does not read the last attempt's keys"},
      {"TPU_ACCELERATOR_TYPE", "text", "", "tests (Ray's)",
       "a TPU host's type (`v6e-8`): Ray's TPU detection reads it; tests/python/ray_local.py sets it for a local "
       "cluster"},
      {"TPU_TOPOLOGY", "text", "", "tests (Ray's)", "a TPU slice's chip layout (`2x4`), read by Ray's TPU detection"},
      {"TPU_NAME", "text", "", "tests (Ray's)", "a TPU slice's name, read by Ray's TPU detection"},
      {"TPU_WORKER_ID", "integer", "", "tests (Ray's)", "a host's index in its TPU slice, read by Ray's TPU detection"},
      {"TPU_WORKER_HOSTNAMES", "list", "", "tests (Ray's)", "a TPU slice's hosts, read by Ray's TPU detection"},
      {"XDG_CACHE_HOME", "path", "", "runtime (the system's)",
       "where `TORCH_TPU_CACHE_DIR` is unset, the on-disk cache is `$XDG_CACHE_HOME/torch_tpu`"},
      {"HOME", "path", "", "runtime (the system's)",
       "where neither is set, the on-disk cache is `$HOME/.cache/torch_tpu`"},
  };
  return vars;
}

const Var& find(std::string_view name) {
  for (const Var& v : all())
    if (name == v.name) return v;
  throw std::logic_error("torch_tpu internal: the environment variable " + std::string(name) +
                         " is not declared in runtime/env.cpp");
}

const char* get(const char* name) {
  find(name);
  return std::getenv(name);
}

bool enabled(const char* name) {
  const char* v = get(name);
  return v && std::string(v) == "1";
}

bool notDisabled(const char* name) {
  const char* v = get(name);
  return !(v && std::string(v) == "0");
}

int64_t positiveInt(const char* name, int64_t dflt) {
  const char* v = get(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*end || x <= 0) throw std::invalid_argument(std::string(name) + "='" + v + "' must be a positive integer");
  return x;
}

int64_t bytes(const char* name) {
  const char* v = get(name);
  if (!v || !*v) return 0;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  int64_t mult = 1;
  if (*end == 'K' || *end == 'k') mult = int64_t{1} << 10;
  if (*end == 'M' || *end == 'm') mult = int64_t{1} << 20;
  if (*end == 'G' || *end == 'g') mult = int64_t{1} << 30;
  if (x <= 0) throw std::invalid_argument(std::string(name) + "='" + v + "' must be a positive size");
  return static_cast<int64_t>(x * static_cast<double>(mult));
}

std::vector<std::string> list(const char* name, char sep) {
  std::vector<std::string> out;
  const char* v = get(name);
  if (!v) return out;
  const std::string s(v);
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(sep, start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace tpu::env
