// Units for the on-disk tier of the compilation cache.
#include "runtime/disk_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

using tpu::runtime::DiskCache;

namespace {
std::string tempDir() {
  char tmpl[] = "/tmp/tpu_cache_test_XXXXXX";
  return ::mkdtemp(tmpl);
}
}  // namespace

TEST(DiskCache, KeyDependsOnProgramPluginAndOptions) {
  auto k = DiskCache::key("p", "plugin-a", "o");
  EXPECT_EQ(k.size(), 32u);
  EXPECT_EQ(k, DiskCache::key("p", "plugin-a", "o"));
  EXPECT_NE(k, DiskCache::key("q", "plugin-a", "o"));
  EXPECT_NE(k, DiskCache::key("p", "plugin-b", "o"));
  EXPECT_NE(k, DiskCache::key("p", "plugin-a", "x"));
}

TEST(DiskCache, RoundTripAndCorruption) {
  DiskCache c(tempDir(), 1 << 20);
  auto k = DiskCache::key("prog", "id", "opt");
  EXPECT_FALSE(c.load(k).has_value());
  c.store(k, std::string("payload\0bytes", 13));
  auto got = c.load(k);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, std::string("payload\0bytes", 13));
  {  // corrupt one byte of the payload
    std::fstream f(c.dir() + "/" + k + ".xla", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(50);
    f.put('X');
  }
  EXPECT_FALSE(c.load(k).has_value());
  EXPECT_EQ(c.stats().corrupt.load(), 1);
  EXPECT_FALSE(c.load(k).has_value());  // the bad file is gone: a plain miss now
  EXPECT_EQ(c.stats().corrupt.load(), 1);
}

TEST(DiskCache, EvictsOldestBeyondTheCap) {
  DiskCache c(tempDir(), 3000);
  std::string big(1000, 'x');
  for (int i = 0; i < 5; ++i) {
    c.store(DiskCache::key(std::to_string(i), "id", "o"), big);
    ::sleep(i == 0 ? 1 : 0);  // distinct mtime for the first entry
  }
  EXPECT_LE(c.sizeOnDisk(), 3000);
  EXPECT_GE(c.stats().evicted.load(), 2);
  EXPECT_FALSE(c.load(DiskCache::key("0", "id", "o")).has_value());
  EXPECT_TRUE(c.load(DiskCache::key("4", "id", "o")).has_value());
}

TEST(DiskCache, ScansTheDirectoryOnlyOnFirstStoreAndAtTheCap) {
  // One scan, on the first store; then the running total decides.
  DiskCache c(tempDir(), 1 << 20);
  for (int i = 0; i < 50; ++i) c.store(DiskCache::key(std::to_string(i), "id", "o"), std::string(100, 'x'));
  EXPECT_EQ(c.scans(), 1);
  // A small cap: a scan each time the total passes it, evicting down to 90%
  // of it, so that the next stores fit without one.
  DiskCache small(tempDir(), 10000);
  for (int i = 0; i < 40; ++i) small.store(DiskCache::key(std::to_string(i), "id", "o"), std::string(1000, 'x'));
  EXPECT_LE(small.sizeOnDisk(), 10000);
  EXPECT_GE(small.stats().evicted.load(), 30);
  EXPECT_LE(small.scans(), 20);  // about one in two stores at a 90% low-water mark of 9 entries
  EXPECT_TRUE(small.load(DiskCache::key("39", "id", "o")).has_value());
}

TEST(DiskCache, UnwritableDirectoryDisablesTheCache) {
  DiskCache c("/proc/no_such_dir/cache", 1 << 20);
  EXPECT_FALSE(c.enabled());
  c.store("k", "v");  // no effect, no crash
  EXPECT_FALSE(c.load("k").has_value());
}
