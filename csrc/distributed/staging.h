// The staged transport's data path (tpu_dist.cpp runs its collectives here).
//
// Host memory: blocks from a pool, reused across collectives and emptied by
// torch.tpu.empty_cache(). A tpu tensor is read on the host in place where
// the device's memory is host memory (the CPU plugin), else copied into a
// block; a result becomes the tensor's device buffer over the block it was
// computed in, without a copy (PJRT's kMutableZeroCopy), and the block goes
// back to the pool when that buffer is destroyed.
//
// Messages: the collectives run over the host backend's (gloo's)
// point-to-point transport, directly between every pair of ranks, on tags
// kept for them (kTagFirst and up; a user's send/recv must not take those).
// Each rank's first message to another carries its agreement record (the
// collective, dtypes and shapes, common.h) ahead of the payload, or of the
// announcement of a payload sent in chunks, so a mismatch raises on every
// rank without a round trip of its own: a receiver posts a payload's chunks
// only once the record agrees, and on a mismatch takes what the other side
// announced into scratch memory before raising, so no message is left over.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <vector>

#include "runtime/runtime.h"

namespace tpu::distributed::staging {

// ---------------------------------------------------------------- host memory

class Pool;

// A block of host memory (aligned for the plugin to alias it); back to the
// pool when its last holder lets go.
class Block {
 public:
  Block(std::shared_ptr<Pool> pool, uint8_t* data, size_t capacity)
      : pool_(std::move(pool)), data_(data), capacity_(capacity) {}
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  std::shared_ptr<Pool> pool_;
  uint8_t* data_;
  size_t capacity_;
};
using BlockPtr = std::shared_ptr<Block>;

// A block of at least `bytes`, from the pool when one fits.
BlockPtr takeBlock(size_t bytes);

struct PoolStats {
  int64_t cached_blocks = 0;      // free blocks the pool holds
  int64_t cached_bytes = 0;       // their bytes
  int64_t allocations = 0;        // blocks allocated
  int64_t reuses = 0;             // blocks handed out again from the pool
  int64_t blocks_in_use = 0;      // handed out and not back yet (results alive hold theirs)
  int64_t zero_copy_results = 0;  // results made device buffers over their block
};
PoolStats poolStats();
// Frees the free blocks (blocks in use go back to the pool when let go).
void releasePool();

// Offsets of blocks' parts are multiples of this (the plugin aliases aligned data).
constexpr size_t kAlign = 64;
inline size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// A tensor's elements, dense, readable on the host: the device buffer itself
// where the plugin's memory is host memory, else a copy in a block.
class HostInput {
 public:
  explicit HostInput(const at::Tensor& t);
  const uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  at::Tensor host_;
  runtime::BufferPtr buffer_;
  BlockPtr block_;
  const uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

// Makes the bytes at block + offset the value of `dst` (dense, dst's dtype and
// numel): on tpu, a device buffer over the block; on the host, a copy.
void writeResult(const at::Tensor& dst, const BlockPtr& block, size_t offset);

// ---------------------------------------------------------------- collectives

// The group a collective runs in, and the record every rank must agree on.
struct Group {
  c10d::Backend& host;
  int rank;
  int size;
  bool check;  // compare whole records (TORCH_TPU_DIST_CHECK); else payload sizes only
};
struct Call {
  const char* what;
  std::vector<int64_t> record;  // agreementOf(what, tensors)
};

// Raises on every rank unless all agree on `call`: one exchange of records.
void agree(const Group& g, const Call& call);

// `count` elements of `dtype` at `in` reduced over the ranks by `op` (AVG
// divides the sum, integers truncating) into `out` (all ranks get the same).
void allReduce(const Group& g, const Call& call, const uint8_t* in, uint8_t* out, int64_t count, at::ScalarType dtype,
               c10d::ReduceOp::RedOpType op);
// Every rank's `bytes` at `in` into out + rank * stride.
void allGather(const Group& g, const Call& call, const uint8_t* in, size_t bytes, uint8_t* out, size_t stride);
// parts[r] (`count` elements each) reduced over the ranks into `out` for rank r.
void reduceScatter(const Group& g, const Call& call, const std::vector<const uint8_t*>& parts, uint8_t* out,
                   int64_t count, at::ScalarType dtype, c10d::ReduceOp::RedOpType op);
// The root's `bytes` at `in` into `out` on the other ranks.
void broadcast(const Group& g, const Call& call, int root, const uint8_t* in, uint8_t* out, size_t bytes);

}  // namespace tpu::distributed::staging
