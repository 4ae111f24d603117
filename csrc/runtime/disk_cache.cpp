#include "runtime/disk_cache.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utime.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "ir/ir.h"
#include "runtime/env.h"

namespace tpu::runtime {
namespace {

constexpr char kMagic[8] = {'T', 'T', 'P', 'U', 'X', 'C', '0', '1'};
constexpr size_t kHeader = sizeof(kMagic) + 32 + 8;  // magic, key (hex), payload size
constexpr size_t kTrailer = 8;                       // payload checksum

bool makeDirs(const std::string& path) {
  std::string cur;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  return true;
}

uint64_t checksum(const std::string& s) { return ir::fnv1a(s, 0x9E3779B97F4A7C15ull); }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

DiskCache::DiskCache(std::string dir, int64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {
  if (!dir_.empty() && !makeDirs(dir_)) dir_.clear();  // unusable: run without it
}

std::string DiskCache::defaultDir() {
  if (const char* dir = env::get("TORCH_TPU_CACHE_DIR")) {
    std::string v(dir);
    if (v.empty() || v == "off" || v == "0") return "";
    return v;
  }
  // The system's cache folders (declared in env.cpp as the system's).
  if (const char* xdg = env::get("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/torch_tpu";
  if (const char* home = env::get("HOME"); home && *home) return std::string(home) + "/.cache/torch_tpu";
  return "";
}

int64_t DiskCache::defaultMaxBytes() {
  const char* max = env::get("TORCH_TPU_CACHE_MAX_BYTES");
  if (max && *max) {
    char* end = nullptr;
    long long v = std::strtoll(max, &end, 10);
    if (v > 0) return v;
  }
  return int64_t(2) << 30;
}

std::string DiskCache::key(const std::string& program, const std::string& plugin_identity, const std::string& options) {
  std::string all = plugin_identity;
  all += '\0';
  all += options;
  all += '\0';
  all += program;
  return hex64(ir::fnv1a(all)) + hex64(ir::fnv1a(all, 0x84222325CBF29CE4ull));
}

std::string DiskCache::pathOf(const std::string& key) const { return dir_ + "/" + key + ".xla"; }

std::optional<std::string> DiskCache::load(const std::string& key) {
  if (!enabled()) return std::nullopt;
  std::string path = pathOf(key);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    stats_.misses++;
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) {  // a directory or device in an entry's place: corrupt, and not ours to remove
    stats_.corrupt++;
    stats_.misses++;
    return std::nullopt;
  }
  auto bad = [&]() -> std::optional<std::string> {
    stats_.corrupt++;
    stats_.misses++;
    ::unlink(path.c_str());
    return std::nullopt;
  };
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    stats_.misses++;
    return std::nullopt;
  }
  std::string data;
  try {
    data.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  } catch (const std::exception&) {  // a read error (libstdc++ throws from underflow)
    return bad();
  }
  if (data.size() < kHeader + kTrailer || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0) return bad();
  if (data.compare(sizeof kMagic, 32, key) != 0) return bad();
  uint64_t n;
  std::memcpy(&n, data.data() + sizeof kMagic + 32, 8);
  if (n != data.size() - kHeader - kTrailer) return bad();
  std::string payload = data.substr(kHeader, n);
  uint64_t sum;
  std::memcpy(&sum, data.data() + kHeader + n, 8);
  if (sum != checksum(payload)) return bad();
  stats_.hits++;
  ::utime(path.c_str(), nullptr);  // recently used: evicted last
  return payload;
}

void DiskCache::store(const std::string& key, const std::string& payload) {
  if (!enabled()) return;
  std::string data(kMagic, sizeof kMagic);
  data += key;
  uint64_t n = payload.size();
  data.append(reinterpret_cast<const char*>(&n), 8);
  data += payload;
  uint64_t sum = checksum(payload);
  data.append(reinterpret_cast<const char*>(&sum), 8);
  static std::atomic<int> counter{0};
  std::string tmp = dir_ + "/.tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return;
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!f) {
      ::unlink(tmp.c_str());
      return;
    }
  }
  if (::rename(tmp.c_str(), pathOf(key).c_str()) != 0) {
    ::unlink(tmp.c_str());
    return;
  }
  stats_.writes++;
  noteStored(static_cast<int64_t>(data.size()));
}

void DiskCache::discard(const std::string& key) {
  if (!enabled()) return;
  stats_.corrupt++;
  ::unlink(pathOf(key).c_str());
}

namespace {
struct EntryInfo {
  std::string path;
  int64_t size;
  int64_t mtime;
};
std::vector<EntryInfo> listEntries(const std::string& dir) {
  std::vector<EntryInfo> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 5 || name.substr(name.size() - 4) != ".xla") continue;
    std::string p = dir + "/" + name;
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0)
      out.push_back({p, static_cast<int64_t>(st.st_size), st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec});
  }
  ::closedir(d);
  return out;
}
int64_t totalSize(const std::vector<EntryInfo>& entries) {
  int64_t total = 0;
  for (const auto& e : entries) total += e.size;
  return total;
}
}  // namespace

int64_t DiskCache::sizeOnDisk() const { return totalSize(listEntries(dir_)); }

void DiskCache::noteStored(int64_t bytes) {
  constexpr int kRescanStores = 1000;
  std::lock_guard<std::mutex> g(mu_);
  if (estimated_bytes_ >= 0 && ++stores_since_scan_ < kRescanStores && estimated_bytes_ + bytes <= max_bytes_) {
    estimated_bytes_ += bytes;  // a replaced entry counts twice: errs towards an early scan
    return;
  }
  scanAndEvict();
}

void DiskCache::scanAndEvict() {
  scans_++;
  stores_since_scan_ = 0;
  auto entries = listEntries(dir_);
  int64_t total = totalSize(entries);
  if (total > max_bytes_) {
    const int64_t low_water = max_bytes_ / 10 * 9;
    std::sort(entries.begin(), entries.end(), [](const EntryInfo& a, const EntryInfo& b) { return a.mtime < b.mtime; });
    for (const auto& e : entries) {
      if (total <= low_water) break;
      if (::unlink(e.path.c_str()) == 0) {
        total -= e.size;
        stats_.evicted++;
      }
    }
  }
  estimated_bytes_ = total;
}

}  // namespace tpu::runtime
