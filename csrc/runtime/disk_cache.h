// The persistent tier of the compilation cache: serialized executables on
// disk, keyed by the program text, the plugin's identity and version, and the
// compile options. Writes are atomic (temp file + rename), so processes can
// share a directory; a corrupt, truncated or foreign entry is detected by its
// header and checksum, counted, removed and recompiled. The directory is
// capped in size; the least recently used entries go first, down to 90% of
// the cap. The directory is scanned (a stat per entry) on the first store, when
// this process's running total passes the cap, and every 1000 stores (other
// processes write there too): a scan per store made each compile cost
// O(entries), 0.1 s with 60k entries.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace tpu::runtime {

struct DiskCacheStats {
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> misses{0};
  std::atomic<int64_t> writes{0};
  std::atomic<int64_t> corrupt{0};
  std::atomic<int64_t> evicted{0};
};

class DiskCache {
 public:
  // `dir` empty disables the cache. `max_bytes` caps the directory.
  DiskCache(std::string dir, int64_t max_bytes);

  bool enabled() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  // The key of a program: a 128-bit hash, hex.
  static std::string key(const std::string& program, const std::string& plugin_identity, const std::string& options);

  // The payload stored under `key`, or nothing (missing or invalid: an
  // invalid file is removed and counted as corrupt).
  std::optional<std::string> load(const std::string& key);
  // Stores atomically; failures (read-only or full disk) are ignored.
  void store(const std::string& key, const std::string& payload);
  // Removes an entry whose payload the plugin rejected.
  void discard(const std::string& key);

  DiskCacheStats& stats() { return stats_; }
  int64_t sizeOnDisk() const;
  // Directory scans so far (tests: not one per store).
  int64_t scans() const { return scans_.load(); }

  // TORCH_TPU_CACHE_DIR (default: $XDG_CACHE_HOME or ~/.cache, /torch_tpu);
  // TORCH_TPU_CACHE_DIR="" or "off" disables it.
  static std::string defaultDir();
  // TORCH_TPU_CACHE_MAX_BYTES (default 2 GiB).
  static int64_t defaultMaxBytes();

 private:
  std::string pathOf(const std::string& key) const;
  void noteStored(int64_t bytes);
  void scanAndEvict();  // holds mu_

  std::string dir_;
  int64_t max_bytes_;
  DiskCacheStats stats_;
  std::mutex mu_;
  int64_t estimated_bytes_ = -1;  // at the last scan, plus stores since; -1: not scanned
  int stores_since_scan_ = 0;
  std::atomic<int64_t> scans_{0};
};

}  // namespace tpu::runtime
