/* A PJRT plugin that wraps another and times the calls where the device (or
 * the plugin) works, so that a benchmark can take them out of the host's time:
 * program launches, waits on events, host<->device copies, compiles and
 * disk-cache loads. It is a plugin like any other: load it as the runtime's
 * plugin (TORCH_TPU_PLUGIN=/path/libpjrt_timer_cpu.so) and name the real one in
 * PJRT_TIMER_REAL. Any build of torch_tpu, and any other PJRT client, loads it
 * unchanged, so two builds are measured the same way (benchmarks/host_cost.py).
 *
 * The totals are read with pjrt_timer_stats() (ctypes: the same path opens
 * the same loaded library). With PJRT_TIMER_COMPILE_LOG set, each compile
 * appends a line "<nanoseconds> <program bytes>" to that file; with
 * PJRT_TIMER_DUMP_DIR set, each program's text is written there as
 * <n>.mlir, in compile order. Built by
 * benchmarks/host_cost.py:
 *   cc -O2 -shared -fPIC -I<pjrt include> pjrt_timer.c -o libpjrt_timer_cpu.so -ldl
 * ("cpu" in the file name: builds before the plugin seam chose the CPU
 * plugin's client options by looking for it in the path). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pjrt_c_api.h"

enum {
  kLaunchNs, kLaunches,    /* PJRT_LoadedExecutable_Execute */
  kAwaitNs, kAwaits,       /* PJRT_Event_Await */
  kToHostNs, kToHosts,     /* PJRT_Buffer_ToHostBuffer (starting the copy) */
  kFromHostNs, kFromHosts, /* PJRT_Client_BufferFromHostBuffer */
  kCompileNs, kCompiles,   /* PJRT_Client_Compile */
  kCompileBytes,           /* program text handed to compiles */
  kLoadNs, kLoads,         /* PJRT_Executable_DeserializeAndLoad (disk-cache hits) */
  kCpuNs,                  /* the calling threads' CPU time inside all of the above */
  kStats
};

static int64_t g_stats[kStats];
static const PJRT_Api* g_real;
static PJRT_Api g_api;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* This thread's CPU time: what the plugin computed on the caller's thread
 * (XLA:CPU runs small programs inline), not time spent waiting. */
static int64_t cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void add(int which, int64_t v) { __atomic_fetch_add(&g_stats[which], v, __ATOMIC_RELAXED); }

#define TIMED(field, ns, count, Args, extra)          \
  static PJRT_Error* timed_##field(Args* args) {      \
    const int64_t c0 = cpu_ns(), t0 = now_ns();       \
    PJRT_Error* e = g_real->field(args);              \
    add(ns, now_ns() - t0);                           \
    add(kCpuNs, cpu_ns() - c0);                       \
    add(count, 1);                                    \
    extra;                                            \
    return e;                                         \
  }

TIMED(PJRT_LoadedExecutable_Execute, kLaunchNs, kLaunches, PJRT_LoadedExecutable_Execute_Args, (void)0)
TIMED(PJRT_Event_Await, kAwaitNs, kAwaits, PJRT_Event_Await_Args, (void)0)
TIMED(PJRT_Buffer_ToHostBuffer, kToHostNs, kToHosts, PJRT_Buffer_ToHostBuffer_Args, (void)0)
TIMED(PJRT_Client_BufferFromHostBuffer, kFromHostNs, kFromHosts, PJRT_Client_BufferFromHostBuffer_Args, (void)0)
static void log_compile(int64_t t0, const PJRT_Program* program) {
  static const char *path, *dump;
  static int checked, n;
  if (!checked) {
    path = getenv("PJRT_TIMER_COMPILE_LOG");
    dump = getenv("PJRT_TIMER_DUMP_DIR");
    checked = 1;
  }
  FILE* f = path ? fopen(path, "a") : NULL;
  if (f) {
    fprintf(f, "%lld %zu\n", (long long)(now_ns() - t0), program->code_size);
    fclose(f);
  }
  if (dump) {
    char name[4096];
    snprintf(name, sizeof name, "%s/%d.mlir", dump, n++);
    if ((f = fopen(name, "w"))) {
      fwrite(program->code, 1, program->code_size, f);
      fclose(f);
    }
  }
}

TIMED(PJRT_Client_Compile, kCompileNs, kCompiles, PJRT_Client_Compile_Args,
      (add(kCompileBytes, (int64_t)args->program->code_size), log_compile(t0, args->program)))
TIMED(PJRT_Executable_DeserializeAndLoad, kLoadNs, kLoads, PJRT_Executable_DeserializeAndLoad_Args, (void)0)

/* Callgrind's client requests, for benchmarks/host_cost.py --callgrind: count
 * instructions only around the ops measured, one dump per case. No-ops outside
 * valgrind. */
#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define HAVE_CALLGRIND 1
#endif
#endif
int pjrt_timer_callgrind(void) {
#ifdef HAVE_CALLGRIND
  return 1;
#else
  return 0;
#endif
}
void pjrt_timer_callgrind_start(void) {
#ifdef HAVE_CALLGRIND
  CALLGRIND_START_INSTRUMENTATION;
  CALLGRIND_ZERO_STATS;
#endif
}
void pjrt_timer_callgrind_dump(const char* label) {
#ifdef HAVE_CALLGRIND
  CALLGRIND_DUMP_STATS_AT(label);
  CALLGRIND_STOP_INSTRUMENTATION;
#else
  (void)label;
#endif
}

/* Totals since the last reset, in the order of the enum above. */
void pjrt_timer_stats(int64_t* out) {
  for (int i = 0; i < kStats; ++i) out[i] = __atomic_load_n(&g_stats[i], __ATOMIC_RELAXED);
}
void pjrt_timer_reset(void) {
  for (int i = 0; i < kStats; ++i) __atomic_store_n(&g_stats[i], 0, __ATOMIC_RELAXED);
}

const PJRT_Api* GetPjrtApi(void) {
  if (g_real) return &g_api;
  const char* path = getenv("PJRT_TIMER_REAL");
  void* lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
  const PJRT_Api* (*get)(void) = lib ? (const PJRT_Api* (*)(void))dlsym(lib, "GetPjrtApi") : NULL;
  if (!get) {
    fprintf(stderr, "pjrt_timer: cannot load the plugin PJRT_TIMER_REAL names (%s): %s\n", path ? path : "unset",
            dlerror());
    return NULL;
  }
  g_real = get();
  /* The fields both this header and the plugin know; the rest stay zero. */
  size_t n = g_real->struct_size < sizeof(PJRT_Api) ? g_real->struct_size : sizeof(PJRT_Api);
  memcpy(&g_api, g_real, n);
  g_api.struct_size = n;
  g_api.PJRT_LoadedExecutable_Execute = timed_PJRT_LoadedExecutable_Execute;
  g_api.PJRT_Event_Await = timed_PJRT_Event_Await;
  g_api.PJRT_Buffer_ToHostBuffer = timed_PJRT_Buffer_ToHostBuffer;
  g_api.PJRT_Client_BufferFromHostBuffer = timed_PJRT_Client_BufferFromHostBuffer;
  g_api.PJRT_Client_Compile = timed_PJRT_Client_Compile;
  g_api.PJRT_Executable_DeserializeAndLoad = timed_PJRT_Executable_DeserializeAndLoad;
  return &g_api;
}
