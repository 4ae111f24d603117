// The IR's types and the Builder's core: values, params and outputs,
// fingerprints, the dataflow analyses (params read, in-place safety),
// functions and calls, and printing the module. The StableHLO operations
// themselves are in stablehlo_ops.cpp.
#include "ir/ir.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace tpu::ir {

const char* mlirName(DType t) {
  switch (t) {
    case DType::Bool:
      return "i1";
    case DType::U8:
      return "ui8";
    case DType::I8:
      return "i8";
    case DType::I16:
      return "i16";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U16:
      return "ui16";
    case DType::U32:
      return "ui32";
    case DType::U64:
      return "ui64";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    case DType::F32:
      return "f32";
    case DType::F64:
      return "f64";
    case DType::C64:
      return "complex<f32>";
    case DType::C128:
      return "complex<f64>";
  }
  return "?";
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::Bool:
      return "bool";
    case DType::U8:
      return "uint8";
    case DType::I8:
      return "int8";
    case DType::I16:
      return "int16";
    case DType::I32:
      return "int32";
    case DType::I64:
      return "int64";
    case DType::U16:
      return "uint16";
    case DType::U32:
      return "uint32";
    case DType::U64:
      return "uint64";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::C64:
      return "complex64";
    case DType::C128:
      return "complex128";
  }
  return "?";
}

size_t itemSize(DType t) {
  switch (t) {
    case DType::Bool:
    case DType::U8:
    case DType::I8:
      return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32:
      return 4;
    case DType::I64:
    case DType::U64:
    case DType::F64:
    case DType::C64:
      return 8;
    case DType::C128:
      return 16;
  }
  return 0;
}

namespace {
int category(DType t) {  // bool < int < float < complex
  if (t == DType::Bool) return 0;
  if (isInt(t)) return 1;
  if (isFloat(t)) return 2;
  return 3;
}
}  // namespace

DType promote(DType a, DType b) {
  if (a == b) return a;
  int ca = category(a), cb = category(b);
  if (ca == 3 || cb == 3) {
    // complex64 with float64 (or complex128) is complex128, as in PyTorch.
    auto part = [](DType t) { return isComplex(t) ? complexPart(t) : (t == DType::F64 ? DType::F64 : DType::F32); };
    return complexOf(part(a) == DType::F64 || part(b) == DType::F64 ? DType::F64 : DType::F32);
  }
  if (ca != cb) return ca > cb ? a : b;
  if (ca == 2) {
    // float16 + bfloat16 -> float32; otherwise the wider one.
    if ((a == DType::F16 && b == DType::BF16) || (a == DType::BF16 && b == DType::F16)) return DType::F32;
    return itemSize(a) >= itemSize(b) ? a : b;
  }
  // Integers: uint8 with a signed type promotes to the next signed width.
  auto rank = [](DType t) {
    switch (t) {
      case DType::I8:
        return 1;
      case DType::U8:
        return 2;
      case DType::I16:
      case DType::U16:
        return 3;
      case DType::I32:
        return 4;
      case DType::U32:
        return 4;
      case DType::I64:
        return 5;
      case DType::U64:
        return 5;
      default:
        return 0;
    }
  };
  if ((a == DType::U8 && b == DType::I8) || (a == DType::I8 && b == DType::U8)) return DType::I16;
  return rank(a) >= rank(b) ? a : b;
}

int64_t Type::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shapeStr(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

void appendInt(std::string& s, int64_t v) {
  char buf[24];
  s.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

// Printed for every operand of every op a graph records: built in place.
std::string Type::str() const {
  std::string s;
  s.reserve(16 + 6 * shape.size());
  s += "tensor<";
  for (auto d : shape) {
    appendInt(s, d);
    s += 'x';
  }
  s += mlirName(dtype);
  s += '>';
  return s;
}

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t hash64(std::string_view s, uint64_t seed) {
  // MurmurHash64A's mixing, eight bytes per step (FNV-1a's byte loop took
  // about a tenth of fused eager's host time hashing every emitted line).
  constexpr uint64_t m = 0xc6a4a7935bd1e995ull;
  constexpr int r = 47;
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = seed ^ (n * m);
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t k;
    std::memcpy(&k, p, 8);
    k *= m;
    k ^= k >> r;
    k *= m;
    h ^= k;
    h *= m;
  }
  if (n > 0) {
    uint64_t k = 0;
    std::memcpy(&k, p, n);
    h ^= k;
    h *= m;
  }
  h ^= h >> r;
  h *= m;
  h ^= h >> r;
  return h;
}

namespace {
void fail(const std::string& m) { throw std::invalid_argument("torch_tpu IR: " + m); }
}  // namespace

Builder::Builder() { blocks_.emplace_back(); }

Value Builder::fresh(const Type& t) {
  Value v;
  v.id = next_id_++;
  v.type = t;
  return v;
}

std::string Builder::ref(const Value& v) const {
  if (v.id < 0) fail("use of an invalid value");
  // Op results are %vN; results of multi-result ops are %gN#i.
  if (!names_.empty())
    if (auto it = names_.find(v.id); it != names_.end()) return it->second;
  std::string r = "%v";
  appendInt(r, v.id);
  return r;
}

void Builder::emitLine(const std::string& s) {
  if (blocks_.size() == 1) mix(s);  // nested regions are part of their parent's line
  blocks_.back().lines.push_back(s);
  ++op_count_;
}

void Builder::mix(const std::string& s) {
  h1_ = hash64(s, h1_);
  h2_ = hash64(s, h2_ ^ 0x9E3779B97F4A7C15ull);
}

std::string Builder::fingerprint() const {
  char buf[80];
  std::snprintf(buf, sizeof buf, "%016llx%016llx:%zu:%zu:%d", static_cast<unsigned long long>(h1_),
                static_cast<unsigned long long>(h2_), params_.size(), outputs_.size(), op_count_);
  return buf;
}

std::string Builder::types(const std::vector<Value>& vs) const {
  std::string s;
  for (size_t i = 0; i < vs.size(); ++i) s += (i ? ", " : "") + vs[i].type.str();
  return s;
}

Value Builder::param(const Type& t) {
  Value v = fresh(t);
  mix("P" + t.str() + std::to_string(v.id));
  params_.push_back(t);
  // Parameters are bound to their SSA names in emit().
  param_ids_.push_back(v.id);
  return v;
}

void Builder::output(const Value& v) {
  mix("O" + ref(v));
  outputs_.push_back(v);
}

void Builder::alias(int param, int output) {
  if (param < 0 || param >= static_cast<int>(params_.size()) || output < 0 ||
      output >= static_cast<int>(outputs_.size()))
    fail("alias of param " + std::to_string(param) + " and output " + std::to_string(output) + " out of range");
  const Type& p = params_[param];
  const Type& o = outputs_[output].type;
  if (p.dtype != o.dtype || p.numel() != o.numel())
    fail("alias of param " + p.str() + " and output " + o.str() + ": not the same dtype and size");
  for (const auto& [ap, ao] : aliases_)
    if (ap == param || ao == output) fail("param or output aliased twice");
  std::string m = "A";
  appendInt(m, param);
  m += ':';
  appendInt(m, output);
  mix(m);
  aliases_.emplace_back(param, output);
}

namespace {
// The key of result r of SSA value N (r = 0 for single-result values).
int64_t ssaKey(int64_t n, int64_t r = 0) { return (n << 20) | r; }

// An SSA reference at s[i] (s[i] == '%'): "%vN" is (N, 0), "%gN#i" is (N, i);
// `len` gets its length. Returns false where s[i] starts none.
bool ssaRef(std::string_view s, size_t i, int64_t& key, size_t& len) {
  if (i + 2 >= s.size() || s[i] != '%' || (s[i + 1] != 'v' && s[i + 1] != 'g')) return false;
  size_t j = i + 2;
  if (j >= s.size() || s[j] < '0' || s[j] > '9') return false;
  int64_t n = 0, r = 0;
  for (; j < s.size() && s[j] >= '0' && s[j] <= '9'; ++j) n = n * 10 + (s[j] - '0');
  if (j + 1 < s.size() && s[j] == '#' && s[j + 1] >= '0' && s[j + 1] <= '9')
    for (++j; j < s.size() && s[j] >= '0' && s[j] <= '9'; ++j) r = r * 10 + (s[j] - '0');
  key = ssaKey(n, r);
  len = j - i;
  return true;
}

// Dataflow read back from printed lines: a node per param and per value a
// line defines ("%gN:k = ..." defines k values). A call of a module's
// function is inlined: its body's values become nodes, its params the call's
// operands, its results the values it returns, so that an in-place question
// about @main sees through calls (a captured program called inside a fused
// graph, the op functions that program calls) as through its own ops.
struct Dataflow {
  using Scope = std::unordered_map<int64_t, int>;  // ssaRef key -> node
  using Functions = std::map<std::string, std::shared_ptr<const Function>>;
  Scope node_of;  // @main's
  std::vector<std::vector<int>> operands;
  std::vector<char> reshape;
  const Functions* functions = nullptr;

  int add(bool is_reshape, std::vector<int> ops) {
    operands.push_back(std::move(ops));
    reshape.push_back(is_reshape);
    return static_cast<int>(operands.size()) - 1;
  }
  // Marks in `seen` the nodes in `stack` and every node they depend on.
  void markAncestors(std::vector<int> stack, std::vector<char>& seen) const {
    while (!stack.empty()) {
      int n = stack.back();
      stack.pop_back();
      if (seen[n]) continue;
      seen[n] = 1;
      for (int m : operands[n]) stack.push_back(m);
    }
  }
  // The nodes `s` refers to in `scope` (references to values defined
  // elsewhere, such as a nested region's own, are skipped).
  static std::vector<int> refsIn(const Scope& scope, std::string_view s) {
    std::vector<int> out;
    int64_t key = 0;
    size_t len = 0;
    for (size_t i = s.find('%'); i != std::string_view::npos; i = s.find('%', i + 1))
      if (ssaRef(s, i, key, len))
        if (auto it = scope.find(key); it != scope.end()) out.push_back(it->second);
    return out;
  }
  std::vector<int> refs(std::string_view s) const { return refsIn(node_of, s); }
  // Adds a line's values to `scope`.
  void addLine(Scope& scope, std::string_view l, int depth) {
    int64_t key = 0;
    size_t len = 0;
    size_t eq = l.find(" = ");
    if (eq == std::string_view::npos || !ssaRef(l, 0, key, len)) return;
    std::string_view rhs = l.substr(eq + 3);
    std::vector<int> ops = refsIn(scope, rhs);
    int64_t count = 1;
    if (len < eq && l[len] == ':')
      count = std::strtoll(std::string(l.substr(len + 1, eq - len - 1)).c_str(), nullptr, 10);
    if (functions && depth < 8 && rhs.rfind("func.call @", 0) == 0) {
      auto f = functions->find(std::string(rhs.substr(11, rhs.find('(') - 11)));
      if (f != functions->end()) {
        std::vector<int> results = inlineBody(f->second->text, ops, depth + 1);
        if (results.size() == static_cast<size_t>(count)) {
          for (int64_t r = 0; r < count; ++r) scope[key | r] = results[r];
          return;
        }
      }
    }
    const bool is_reshape = rhs.rfind("\"stablehlo.reshape\"", 0) == 0;
    for (int64_t r = 0; r < count; ++r) scope[key | r] = add(is_reshape, ops);
  }
  // A printed function's body with `args` for its params: the nodes of the
  // values it returns (empty if the text cannot be read).
  std::vector<int> inlineBody(const std::string& text, const std::vector<int>& args, int depth) {
    std::string_view t(text);
    size_t open = t.find('('), close = t.find(") -> (");
    if (open == std::string_view::npos || close == std::string_view::npos) return {};
    Scope scope;
    int64_t key = 0;
    size_t len = 0, k = 0;
    for (size_t i = t.find('%', open); i < close; i = t.find('%', i + 1))
      if (ssaRef(t, i, key, len)) {
        if (k >= args.size()) return {};
        scope[key] = args[k++];
      }
    if (k != args.size()) return {};
    size_t pos = t.find('\n', close);
    while (pos != std::string_view::npos && pos + 1 < t.size()) {
      size_t end = t.find('\n', pos + 1);
      std::string_view l = t.substr(pos + 1, (end == std::string_view::npos ? t.size() : end) - pos - 1);
      size_t first = l.find_first_not_of(' ');
      if (first != std::string_view::npos) {
        l.remove_prefix(first);
        if (l.rfind("func.return", 0) == 0) return refsIn(scope, l.substr(0, l.find(" : ")));
        addLine(scope, l, depth);
      }
      pos = end;
    }
    return {};
  }
};

// @main's dataflow, read back from its lines: a node per param and per
// value. A region op is one line, its body included, so a value the body
// reads counts as the op's operand. A call is inlined (see Dataflow): a
// foreach update's new parameter depends on that parameter's own gradient,
// not on every gradient in the list.
Dataflow mainDataflow(const std::vector<int>& param_ids, const std::vector<std::string>& lines,
                      const std::map<std::string, std::shared_ptr<const Function>>& functions) {
  Dataflow df;
  df.functions = &functions;
  for (int id : param_ids) df.node_of[ssaKey(id)] = df.add(false, {});
  for (const auto& line : lines) df.addLine(df.node_of, line, 0);
  return df;
}
}  // namespace

std::vector<bool> Builder::paramsRead() const {
  Dataflow df = mainDataflow(param_ids_, blocks_[0].lines, functions_);
  std::vector<char> seen(df.operands.size());
  std::vector<int> results;
  for (const auto& v : outputs_)
    for (int n : df.refs(ref(v))) results.push_back(n);
  df.markAncestors(std::move(results), seen);
  std::vector<bool> read;
  read.reserve(param_ids_.size());
  for (int id : param_ids_) read.push_back(seen[df.node_of.at(ssaKey(id))] != 0);
  return read;
}

std::vector<bool> Builder::inPlaceSafe(const std::vector<std::pair<int, Value>>& pairs,
                                       const std::vector<Value>& results) const {
  Dataflow df = mainDataflow(param_ids_, blocks_[0].lines, functions_);
  size_t count = df.operands.size();
  std::vector<std::vector<int>> users(count);
  for (size_t n = 0; n < count; ++n)
    for (int o : df.operands[n]) users[o].push_back(static_cast<int>(n));
  auto nodeOfValue = [&](const Value& v) {
    std::vector<int> r = df.refs(ref(v));
    return r.empty() ? -1 : r[0];
  };
  std::vector<char> is_output(count);
  for (const auto& v : results)
    if (int n = nodeOfValue(v); n >= 0) is_output[n] = 1;
  const auto& operands = df.operands;
  const auto& reshape = df.reshape;

  std::vector<bool> safe;
  std::vector<char> ancestor(operands.size());
  for (const auto& [param, value] : pairs) {
    int p = df.node_of.at(ssaKey(param_ids_.at(param)));
    int o = nodeOfValue(value);
    bool ok = o >= 0;
    std::fill(ancestor.begin(), ancestor.end(), 0);
    if (ok) df.markAncestors({o}, ancestor);
    // The param's readers: its users, seen through reshapes (a reshape is a
    // view of the same buffer on XLA:CPU). A reshape of it returned as another
    // output would read the buffer after the program.
    std::vector<int> stack{p};
    while (ok && !stack.empty()) {
      int n = stack.back();
      stack.pop_back();
      for (int u : users[n]) {
        if (reshape[u] && u != o) {
          if (is_output[u]) ok = false;
          stack.push_back(u);
        } else if (!ancestor[u]) {
          ok = false;
        }
      }
    }
    if (ok && is_output[p] && p != o) ok = false;
    safe.push_back(ok);
  }
  return safe;
}

// "func.func <visibility> @name(%vN: type, ...) -> (types) {", the body's
// lines, and the return: @main and the called functions print alike.
std::string Builder::signatureText(const std::string& name, bool is_public) const {
  std::string s = std::string("  func.func ") + (is_public ? "public @" : "private @") + name + "(";
  for (size_t i = 0; i < params_.size(); ++i) {
    if (i) s += ", ";
    s += "%v" + std::to_string(param_ids_[i]) + ": " + params_[i].str();
    if (is_public)
      for (const auto& [p, o] : aliases_)
        if (p == static_cast<int>(i)) s += " {tf.aliasing_output = " + std::to_string(o) + " : i32}";
  }
  s += ") -> (" + types(outputs_) + ") {\n";
  for (const auto& l : blocks_[0].lines) {
    s += "    ";
    s += l;
    s += '\n';
  }
  s += "    func.return ";
  for (size_t i = 0; i < outputs_.size(); ++i) s += (i ? ", " : "") + ref(outputs_[i]);
  if (!outputs_.empty()) s += " : " + types(outputs_);
  s += "\n  }\n";
  return s;
}

std::string Builder::emit() const {
  std::string s = "module @torch_tpu";
  if (!participants_.empty())
    s += " attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = " + std::to_string(participants_.size()) +
         " : i32}";
  s += " {\n" + signatureText("main", true);
  for (const auto& [name, f] : functions_) s += f->text;
  return s + "}\n";
}

std::shared_ptr<const Function> Builder::asFunction() const {
  if (outputs_.empty()) fail("a function needs a result");
  if (blocks_.size() != 1) fail("asFunction inside a region");
  auto f = std::make_shared<Function>();
  std::string body = signatureText("@", false);
  char buf[40];
  std::snprintf(buf, sizeof buf, "op_%016llx%016llx", static_cast<unsigned long long>(hash64(body, 1)),
                static_cast<unsigned long long>(hash64(body, 2)));
  f->name = buf;
  f->text = signatureText(f->name, false);
  f->params = params_;
  for (const auto& v : outputs_) f->results.push_back(v.type);
  f->call_types = " : (";
  for (size_t i = 0; i < params_.size(); ++i) f->call_types += (i ? ", " : "") + params_[i].str();
  f->call_types += ") -> (" + types(outputs_) + ")";
  f->op_count = op_count_;
  f->participants = participants_;
  f->collectives = collectives_;
  f->max_channel = max_channel_;
  for (const auto& [name, callee] : functions_) f->callees.push_back(callee);
  return f;
}

std::vector<Value> Builder::call(const std::shared_ptr<const Function>& f, const std::vector<Value>& args) {
  if (blocks_.size() != 1) fail("call inside a region");
  if (args.size() != f->params.size()) fail("call of @" + f->name + " with the wrong number of arguments");
  // Before anything is written: a refused call must leave the program as it was.
  if (!f->participants.empty()) setParticipants(f->participants);
  std::string rhs = "func.call @" + f->name + "(";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].type != f->params[i])
      fail("call of @" + f->name + ": argument " + std::to_string(i) + " is " + args[i].type.str() + ", expected " +
           f->params[i].str());
    if (i) rhs += ", ";
    rhs += ref(args[i]);
  }
  rhs += ')';
  rhs += f->call_types;
  std::vector<Value> results;
  results.reserve(f->results.size());
  for (const Type& t : f->results) results.push_back(fresh(t));
  if (results.size() == 1)
    emitLine(ref(results[0]) + " = " + rhs);
  else
    emitMulti(results, rhs);
  op_count_ += f->op_count - 1;  // count the ops the call stands for
  collectives_ += f->collectives;
  max_channel_ = std::max(max_channel_, f->max_channel);
  functions_.try_emplace(f->name, f);
  for (const auto& c : f->callees) functions_.try_emplace(c->name, c);  // already closed over theirs
  return results;
}

namespace {
constexpr std::string_view kHandle = "channel_handle<handle = ";

// `text` with each channel handle raised by `offset` and each call of a
// function in `renamed` (old name -> new) made to the new name.
std::string shiftedText(const std::string& text, int64_t offset,
                        const std::unordered_map<std::string, std::string>& renamed) {
  std::string out;
  out.reserve(text.size() + 64);
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t h = text.find(kHandle, pos);
    const size_t c = renamed.empty() ? std::string::npos : text.find("func.call @", pos);
    const size_t next = std::min(h, c);
    if (next == std::string::npos) break;
    if (next == h) {
      size_t end = h + kHandle.size();
      out.append(text, pos, end - pos);
      int64_t n = 0;
      while (end < text.size() && text[end] >= '0' && text[end] <= '9') n = n * 10 + (text[end++] - '0');
      out += std::to_string(n + offset);
      pos = end;
    } else {
      const size_t name = c + 11, open = text.find('(', name);
      out.append(text, pos, name - pos);
      auto it = renamed.find(text.substr(name, open - name));
      out += it == renamed.end() ? text.substr(name, open - name) : it->second;
      pos = open;
    }
  }
  out.append(text, pos, std::string::npos);
  return out;
}

std::mutex g_shifted_mu;
std::map<std::pair<std::string, int64_t>, std::shared_ptr<const Function>> g_shifted;
}  // namespace

std::shared_ptr<const Function> withChannelsAfter(const std::shared_ptr<const Function>& f, int64_t offset) {
  if (offset == 0 || f->max_channel == 0) return f;
  {
    std::lock_guard<std::mutex> g(g_shifted_mu);
    auto it = g_shifted.find({f->name, offset});
    if (it != g_shifted.end()) return it->second;
  }
  auto out = std::make_shared<Function>(*f);
  std::unordered_map<std::string, std::string> renamed;
  for (auto& c : out->callees) {
    auto shifted = withChannelsAfter(c, offset);
    if (shifted != c) renamed.emplace(c->name, shifted->name);
    c = shifted;
  }
  out->name = f->name + "_c" + std::to_string(offset);
  // The definition's own name, then its body.
  std::string text = f->text;
  const std::string def = "@" + f->name + "(";
  if (size_t at = text.find(def); at != std::string::npos) text.replace(at, def.size(), "@" + out->name + "(");
  out->text = shiftedText(text, offset, renamed);
  out->max_channel = f->max_channel + offset;
  std::lock_guard<std::mutex> g(g_shifted_mu);
  if (g_shifted.size() >= 4096) g_shifted.clear();
  return g_shifted.emplace(std::make_pair(f->name, offset), std::move(out)).first->second;
}

}  // namespace tpu::ir
