// User kernels (see kernels.h): the registry and the two lowerings.
#include "ops/kernels.h"

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <unordered_map>

#include "ops/lowering.h"

namespace tpu::ops {
namespace {

std::shared_mutex g_mu;
std::unordered_map<std::string, std::shared_ptr<const Kernel>>& registry() {
  static std::unordered_map<std::string, std::shared_ptr<const Kernel>> r;
  return r;
}

std::string typeList(const std::vector<ir::Type>& ts) {
  std::string s;
  for (size_t i = 0; i < ts.size(); ++i) s += (i ? ", " : "") + ts[i].str();
  return s;
}

// Ops in a body, for the op counts the metrics and the slow-compile log show.
int countOps(const std::string& text) {
  int n = 0;
  for (size_t pos = 0; (pos = text.find("stablehlo.", pos)) != std::string::npos; pos += 10) ++n;
  return std::max(n, 1);
}

std::vector<Value> lowerCall(Ctx& ctx) {
  auto k = findKernel(ctx.str(1));
  return callKernel(ctx.b, *k, ctx.tensors(0));
}

Registrar stablehlo_call("stablehlo_call", lowerCall);
Registrar ffi_call("ffi_call", lowerCall);

std::shared_ptr<Kernel> newKernel(std::string name, std::vector<ir::Type> params, std::vector<ir::Type> results) {
  if (results.empty()) throw std::invalid_argument("kernel '" + name + "' returns nothing");
  auto k = std::make_shared<Kernel>();
  k->name = std::move(name);
  k->params = std::move(params);
  k->results = std::move(results);
  return k;
}

}  // namespace

std::shared_ptr<const Kernel> stablehloKernel(std::string name, std::string entry, std::string funcs,
                                              std::vector<ir::Type> params, std::vector<ir::Type> results) {
  auto k = newKernel(std::move(name), std::move(params), std::move(results));
  auto f = std::make_shared<ir::Function>();
  f->name = std::move(entry);
  f->op_count = countOps(funcs);
  f->text = std::move(funcs);
  if (!f->text.empty() && f->text.back() != '\n') f->text += '\n';
  f->params = k->params;
  f->results = k->results;
  f->call_types = " : (" + typeList(k->params) + ") -> (" + typeList(k->results) + ")";
  k->function = std::move(f);
  return k;
}

std::shared_ptr<const Kernel> ffiKernel(std::string name, std::string target, std::vector<ir::Type> params,
                                        std::vector<ir::Type> results) {
  auto k = newKernel(std::move(name), std::move(params), std::move(results));
  k->ffi_target = std::move(target);
  return k;
}

void registerKernel(const std::string& key, std::shared_ptr<const Kernel> k) {
  std::unique_lock lock(g_mu);
  registry()[key] = std::move(k);
}

void unregisterKernel(const std::string& key) {
  std::unique_lock lock(g_mu);
  registry().erase(key);
}

std::shared_ptr<const Kernel> findKernel(const std::string& key) {
  std::shared_lock lock(g_mu);
  auto it = registry().find(key);
  if (it == registry().end()) throw std::invalid_argument("no torch_tpu kernel is registered under '" + key + "'");
  return it->second;
}

std::vector<Value> callKernel(ir::Builder& b, const Kernel& k, const std::vector<Value>& args) {
  bool match = args.size() == k.params.size();
  for (size_t i = 0; match && i < args.size(); ++i) match = args[i].type == k.params[i];
  if (!match) {
    std::vector<ir::Type> got;
    got.reserve(args.size());
    for (const auto& v : args) got.push_back(v.type);
    throw std::invalid_argument("kernel '" + k.name + "' takes (" + typeList(k.params) + "), called with (" +
                                typeList(got) + ")");
  }
  if (k.function) return b.call(k.function, args);
  return b.customCall(k.ffi_target, args, k.results);
}

}  // namespace tpu::ops
