// The plugin seam's registry (runtime/plugin.h): registrations by platform
// name survive linking, and a client gets its platform's options whether its
// plugin was chosen by name or given as a path.
#include "runtime/plugin.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <variant>

#include "pjrt/pjrt.h"

namespace tpu {
namespace {

std::vector<std::string> searchDirs() {
  std::vector<std::string> dirs;
  if (const char* p = std::getenv("TORCH_TPU_PLUGIN_PATH")) dirs.push_back(p);
  return dirs;
}

TEST(PluginRegistry, CpuAndCudaAreRegisteredByPlatformName) {
  const runtime::PluginRegistration* cpu = runtime::findPlugin("cpu");
  ASSERT_NE(cpu, nullptr);
  EXPECT_TRUE(cpu->client_options && cpu->make_support);
  const runtime::PluginRegistration* cuda = runtime::findPlugin("cuda");
  ASSERT_NE(cuda, nullptr);
  EXPECT_TRUE(cuda->client_options && cuda->recognizes);
  EXPECT_EQ(runtime::findPlugin("no-such-platform"), nullptr);
}

TEST(PluginRegistry, CudaOptionsAskForAGrowingAllocatorAndNoNodesInOneProcess) {
  const pjrt::ClientOptions o = runtime::findPlugin("cuda")->client_options(runtime::ClientRequest{});
  ASSERT_EQ(o.values.size(), 1u);
  EXPECT_EQ(o.values[0].name, "preallocate");
  EXPECT_EQ(std::get<bool>(o.values[0].value), false);
  EXPECT_EQ(o.kv, nullptr);
}

TEST(PluginRegistry, ClientGetsItsPlatformsOptionsByNameAndByPath) {
  const pjrt::PluginLocation by_name = pjrt::locatePlugin("cpu", searchDirs());
  EXPECT_EQ(by_name.name, "cpu");
  auto api = pjrt::Api::load(by_name.path);
  EXPECT_FALSE(runtime::findPlugin("cuda")->recognizes(*api));
  runtime::ClientRequest request;
  request.cpu_devices = 3;  // the plugin's own default is 4
  auto client = runtime::createClient(api, by_name, request);
  EXPECT_EQ(client->platformName(), "cpu");
  EXPECT_EQ(client->devices().size(), 3u);
  const pjrt::PluginLocation by_path = pjrt::locatePlugin(by_name.path, {});
  EXPECT_EQ(by_path.name, "");
  client = runtime::createClient(api, by_path, request);
  EXPECT_EQ(client->devices().size(), 3u);
  EXPECT_STREQ(runtime::makePluginSupport(*api, *client)->name(), "cpu");
}

}  // namespace
}  // namespace tpu
