// The registry of environment variables: every variable torch_tpu reads is
// declared once in env.cpp (name, type, default, scope, one-line meaning) and
// read through get() here, in C++, and through torch_tpu._env in Python.
// Other programs' variables the package reads (torchrun's, vLLM's, the
// system's) are declared too, with a scope that says whose they are.
// `python -m torch_tpu env` lists them with the values in force, and
// docs/environment.md is generated from the same list (`python -m torch_tpu env
// --markdown`; tests/python/test_env.py holds the two together).
// No torch headers here.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tpu::env {

struct Var {
  const char* name;
  const char* type;     // how the value is read: "0/1", "integer", "bytes", "path", "text", "list"
  const char* dflt;     // the default, as a user would write it ("" when unset means off or none)
  const char* scope;    // who reads it: "runtime", "fused eager", "CPU plugin", "Python", "scripts", ...;
                        // for another program's variable, also whose it is ("distributed (set by torchrun)")
  const char* meaning;  // one line
};

// Every declared variable, in the order docs/environment.md lists them.
const std::vector<Var>& all();
// The declaration of `name`; throws std::logic_error for an undeclared name
// (a read that bypassed the registry is a bug, not a user error).
const Var& find(std::string_view name);

// The variable's value, or nullptr when it is not set.
const char* get(const char* name);
// Set and exactly "1".
bool enabled(const char* name);
// On unless set to "0".
bool notDisabled(const char* name);
// A positive integer, `dflt` when unset; std::invalid_argument naming the
// variable on anything else.
int64_t positiveInt(const char* name, int64_t dflt);
// A size in bytes, with an optional K/M/G suffix; 0 when unset;
// std::invalid_argument on a malformed or non-positive value.
int64_t bytes(const char* name);
// A list separated by `sep` (empty items dropped).
std::vector<std::string> list(const char* name, char sep = ',');

}  // namespace tpu::env
