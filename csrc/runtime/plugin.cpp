#include "runtime/plugin.h"

#include "plugins/cpu/cpu_plugin.h"

namespace tpu::runtime {
namespace {
// A plugin that adds nothing: the StableHLO lowerings, the plugin's own copies.
class PortableSupport final : public PluginSupport {
 public:
  const char* name() const override { return "portable"; }
};
}  // namespace

std::unique_ptr<PluginSupport> makePluginSupport(const pjrt::Api& api, const pjrt::Client& client) {
  if (client.platformName() == "cpu") return plugins::cpu::makeSupport(api);
  return std::make_unique<PortableSupport>();
}

}  // namespace tpu::runtime
