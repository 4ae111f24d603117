#include "runtime/plugin.h"

#include <map>

namespace tpu::runtime {
namespace {

// A plugin that adds nothing: the StableHLO lowerings, the plugin's own copies.
class PortableSupport final : public PluginSupport {
 public:
  const char* name() const override { return "portable"; }
};

std::map<std::string, PluginRegistration>& registry() {
  static std::map<std::string, PluginRegistration> r;
  return r;
}

}  // namespace

RegisterPlugin::RegisterPlugin(PluginRegistration registration) {
  std::string platform = registration.platform;
  registry()[platform] = std::move(registration);
}

const PluginRegistration* findPlugin(const std::string& platform) {
  auto it = registry().find(platform);
  return it == registry().end() ? nullptr : &it->second;
}

// Client options are per platform, but the platform PJRT reports is known only
// once a client exists, so the platform is settled before by what the user
// chose: a plugin chosen by name (TORCH_TPU_PLUGIN=tpu|cuda|cpu, or the first
// of them installed) is that platform's plugin. One given as a path is
// recognised from its API table by a registration that can (the CUDA plugin
// by its GPU custom-call extension); failing that, it gets a first client
// with its own defaults, which is created again with its platform's options
// when that platform has any (one more client creation, for paths only).
std::unique_ptr<pjrt::Client> createClient(const std::shared_ptr<pjrt::Api>& api, const pjrt::PluginLocation& location,
                                           const ClientRequest& request) {
  const auto optionsFor = [&request](const PluginRegistration* r) {
    return r && r->client_options ? r->client_options(request) : pjrt::ClientOptions{};
  };
  if (!location.name.empty()) return pjrt::Client::create(api, optionsFor(findPlugin(location.name)));
  for (const auto& [platform, r] : registry())
    if (r.recognizes && r.recognizes(*api)) return pjrt::Client::create(api, optionsFor(&r));
  auto client = pjrt::Client::create(api);
  const PluginRegistration* r = findPlugin(client->platformName());
  if (!r || !r->client_options) return client;
  client.reset();
  return pjrt::Client::create(api, optionsFor(r));
}

std::unique_ptr<PluginSupport> makePluginSupport(const pjrt::Api& api, const pjrt::Client& client) {
  const PluginRegistration* r = findPlugin(client.platformName());
  if (r && r->make_support) return r->make_support(api);
  return std::make_unique<PortableSupport>();
}

}  // namespace tpu::runtime
