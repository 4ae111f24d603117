// Precompiled header for the torch-facing sources (the torch headers cost
// tens of seconds per file otherwise).
#pragma once
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <torch/library.h>
