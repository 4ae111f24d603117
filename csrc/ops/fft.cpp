// Discrete Fourier transforms (_fft_r2c, _fft_c2c, _fft_c2r: every torch.fft
// function and stft end in these) and complex-value construction (complex,
// polar, conj_physical). complex64 only, like the device.
//
// stablehlo.fft transforms the trailing 1-3 dims, and its inverse kinds
// divide by the signal size. So the requested dims are moved last (in the
// order given: the last one is the halved dim of r2c/c2r), more than three
// dims are transformed in groups (the DFT is separable), and the scale is
// fixed up once at the end from PyTorch's normalization mode.
#include <algorithm>
#include <cmath>

#include "ops/common.h"

namespace tpu::ops {
namespace {

constexpr size_t kMaxFftDims = 3;

// One stablehlo.fft over `dims` (at most three), moved to the end and back.
Value fftOver(ir::Builder& b, const Value& v, const std::vector<int64_t>& dims, const char* kind,
              const Shape& lengths) {
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < v.rank(); ++d)
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) perm.push_back(d);
  perm.insert(perm.end(), dims.begin(), dims.end());
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  Value t = b.fft(b.transpose(v, perm), kind, lengths);
  return b.transpose(t, inv);
}

// Complex-to-complex transforms over `dims`, at most three at a time.
Value c2cOver(ir::Builder& b, Value v, const std::vector<int64_t>& dims, bool forward) {
  for (size_t i = 0; i < dims.size(); i += kMaxFftDims) {
    std::vector<int64_t> g(dims.begin() + i, dims.begin() + std::min(dims.size(), i + kMaxFftDims));
    Shape len;
    for (auto d : g) len.push_back(v.shape()[d]);
    v = fftOver(b, v, g, forward ? "FFT" : "IFFT", len);
  }
  return v;
}

// PyTorch's normalization: 0 none, 1 by 1/sqrt(n), 2 by 1/n. `inverse_done`:
// the stablehlo inverse kinds already divided by n.
Value normalize(ir::Builder& b, const Value& v, int64_t mode, double n, bool inverse_done) {
  double f = mode == 0 ? 1.0 : mode == 1 ? 1.0 / std::sqrt(n) : 1.0 / n;
  if (inverse_done) f *= n;
  if (f == 1.0) return v;
  return mul(b, v, full(b, f, v));
}

// The transform dims, wrapped, in the order given.
std::vector<int64_t> fftDims(const Ctx& c, const Value& x) {
  std::vector<int64_t> dims = wrapDims(c.ints(1), x.rank());
  if (dims.empty()) throw ir::Unsupported("fft over no dims");
  return dims;
}

bool anyEmpty(const Shape& s) {
  return std::any_of(s.begin(), s.end(), [](int64_t d) { return d == 0; });
}

// The transforms take float32/float64 signals and complex64/complex128 spectra.
void requireType(const Value& x, bool complex, const char* op) {
  const DType t = x.dtype();
  const bool ok = complex ? ir::isComplex(t) : (t == DType::F32 || t == DType::F64);
  if (!ok) throw ir::Unsupported(std::string(op) + " of " + ir::dtypeName(t));
}

// _fft_r2c(self, dim, normalization, onesided): a forward transform of a
// real signal; onesided keeps the last dim's first n/2+1 bins.
Registrar reg_r2c("_fft_r2c", [](Ctx& c) {
  Value x = c.tensor(0);
  requireType(x, false, "_fft_r2c");
  auto dims = fftDims(c, x);
  bool onesided = c.flag(3);
  int64_t mode = c.i64(2);
  double n = 1;
  for (auto d : dims) n *= static_cast<double>(x.shape()[d]);
  if (c.hasExpected() && (anyEmpty(x.shape()) || anyEmpty(c.expectedAt(0).shape)))
    return std::vector<Value>{c.b.zeros(c.expectedAt(0))};
  Value y;
  if (!onesided) {
    y = c2cOver(c.b, c.b.complex(x, c.b.zeros(x.type)), dims, true);
  } else {
    // RFFT over the last group (it holds the halved dim), FFT over the rest.
    size_t split = dims.size() > kMaxFftDims ? dims.size() - kMaxFftDims : 0;
    std::vector<int64_t> last(dims.begin() + split, dims.end()), rest(dims.begin(), dims.begin() + split);
    Shape len;
    for (auto d : last) len.push_back(x.shape()[d]);
    y = c2cOver(c.b, fftOver(c.b, x, last, "RFFT", len), rest, true);
  }
  return std::vector<Value>{normalize(c.b, y, mode, n, false)};
});

// _fft_c2c(self, dim, normalization, forward).
Registrar reg_c2c("_fft_c2c", [](Ctx& c) {
  Value x = c.tensor(0);
  requireType(x, true, "_fft_c2c");
  if (c.ints(1).empty()) return std::vector<Value>{x};  // fftn(dim=()): the identity
  auto dims = fftDims(c, x);
  bool forward = c.flag(3);
  double n = 1;
  for (auto d : dims) n *= static_cast<double>(x.shape()[d]);
  if (anyEmpty(x.shape())) return std::vector<Value>{c.b.zeros(x.type)};
  Value y = c2cOver(c.b, x, dims, forward);
  return std::vector<Value>{normalize(c.b, y, c.i64(2), n, !forward)};
});

// _fft_c2r(self, dim, normalization, last_dim_size): the inverse of a
// onesided r2c; the last dim holds the first last_dim_size/2+1 bins.
Registrar reg_c2r("_fft_c2r", [](Ctx& c) {
  Value x = c.tensor(0);
  requireType(x, true, "_fft_c2r");
  auto dims = fftDims(c, x);
  int64_t last_size = c.i64(3);
  if (last_size <= 0) throw ir::Unsupported("_fft_c2r of an empty signal");
  if (c.hasExpected() && (anyEmpty(x.shape()) || anyEmpty(c.expectedAt(0).shape)))
    return std::vector<Value>{c.b.zeros(c.expectedAt(0))};
  // Fit the halved dim to n/2+1 bins (PyTorch trims or zero-pads likewise).
  int64_t ld = dims.back(), bins = last_size / 2 + 1, have = x.shape()[ld];
  if (have > bins) {
    Shape start(x.rank(), 0), limit = x.shape(), strides(x.rank(), 1);
    limit[ld] = bins;
    x = c.b.slice(x, start, limit, strides);
  } else if (have < bins) {
    Shape lo(x.rank(), 0), hi(x.rank(), 0), interior(x.rank(), 0);
    hi[ld] = bins - have;
    x = c.b.pad(x, c.b.constant(0.0, x.dtype()), lo, hi, interior);
  }
  size_t split = dims.size() > kMaxFftDims ? dims.size() - kMaxFftDims : 0;
  std::vector<int64_t> last(dims.begin() + split, dims.end()), rest(dims.begin(), dims.begin() + split);
  double n = 1;
  Shape len;
  for (auto d : dims) n *= static_cast<double>(d == ld ? last_size : x.shape()[d]);
  for (auto d : last) len.push_back(d == ld ? last_size : x.shape()[d]);
  Value y = fftOver(c.b, c2cOver(c.b, x, rest, false), last, "IRFFT", len);
  return std::vector<Value>{normalize(c.b, y, c.i64(2), n, true)};
});

// complex(real, imag) and polar(abs, angle): float32 (float64) pairs to
// complex64 (complex128).
std::vector<Value> complexPair(Ctx& c, bool polar) {
  DType t = resultType(c, {0, 1});
  if (t != DType::F32 && t != DType::F64) throw ir::Unsupported(std::string(c.op()) + " of " + ir::dtypeName(t));
  auto vs = broadcastAll(c.b, {c.tensor(0), c.tensor(1)});
  Value re = vs[0], im = vs[1];
  if (polar) {
    re = mul(c.b, vs[0], c.b.unary("cosine", vs[1]));
    im = mul(c.b, vs[0], c.b.unary("sine", vs[1]));
  }
  return {c.b.complex(re, im)};
}
Registrar reg_complex("complex", [](Ctx& c) { return complexPair(c, false); });
Registrar reg_polar("polar", [](Ctx& c) { return complexPair(c, true); });

// conj_physical: the conjugate in memory (conj() is a lazy view).
std::vector<Value> conjPhysical(Ctx& c) {
  Value x = c.tensor(0);
  if (!ir::isComplex(x.dtype())) return {x};
  return {c.b.complex(c.b.real(x), c.b.unary("negate", c.b.imag(x)))};
}
Registrar reg_conj_physical("conj_physical", conjPhysical);
Registrar reg_conj_physical_impl("_conj_physical", conjPhysical);

}  // namespace
}  // namespace tpu::ops
