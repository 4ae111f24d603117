#include "distributed/staging.h"

#include <c10/util/ParallelGuard.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "aten/tpu.h"
#include "distributed/common.h"
#include "runtime/views.h"

namespace tpu::distributed::staging {

// ---------------------------------------------------------------- the pool

namespace {
// Payloads up to this size ride in a rank's first message to another; larger
// ones follow it in chunks of kChunk (the next chunk's transfer overlaps the
// reduction of the last; 256 KiB and 4 MiB measured no better).
constexpr size_t kInlineMax = size_t{64} << 10;
constexpr size_t kChunk = size_t{1} << 20;
// all_reduce sends every rank's whole input to every other while that is at
// most this many bytes a rank, and reduces in two rounds above (2 ranks:
// 512 KiB took 0.4-0.5x gloo's time in one round, up to 1.5x in two; from
// 16 MiB on one round was 5-15% slower).
constexpr size_t kDirectMax = size_t{4} << 20;
constexpr size_t kPage = 4096;
// Free bytes the pool keeps; a block let go beyond them is freed at once.
constexpr size_t kMaxCachedBytes = size_t{1} << 30;
}  // namespace

class Pool : public std::enable_shared_from_this<Pool> {
 public:
  // Never destroyed: buffers freed at exit still give their blocks back.
  static const std::shared_ptr<Pool>& get() {
    static const auto* pool = new std::shared_ptr<Pool>(std::make_shared<Pool>());
    return *pool;
  }

  BlockPtr take(size_t bytes) {
    registerRelease();
    const size_t want = std::max(aligned(bytes), kAlign);
    {
      std::lock_guard<std::mutex> g(mu_);
      // The smallest free block that fits, unless it is more than twice the size.
      auto it = free_.lower_bound(want);
      if (it != free_.end() && it->first <= 2 * want + kPage) {
        auto [capacity, data] = *it;
        free_.erase(it);
        stats_.cached_blocks--;
        stats_.cached_bytes -= static_cast<int64_t>(capacity);
        stats_.reuses++;
        stats_.blocks_in_use++;
        return std::make_shared<Block>(shared_from_this(), data, capacity);
      }
      stats_.allocations++;
      stats_.blocks_in_use++;
    }
    const size_t capacity = (want + kPage - 1) / kPage * kPage;
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(kPage, capacity));
    if (!data) {
      std::lock_guard<std::mutex> g(mu_);
      stats_.blocks_in_use--;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, data, "tpu_dist: cannot allocate ", capacity, " bytes of host staging memory");
    return std::make_shared<Block>(shared_from_this(), data, capacity);
  }

  void give(uint8_t* data, size_t capacity) {
    {
      std::lock_guard<std::mutex> g(mu_);
      stats_.blocks_in_use--;
      if (static_cast<size_t>(stats_.cached_bytes) + capacity <= kMaxCachedBytes) {
        free_.emplace(capacity, data);
        stats_.cached_blocks++;
        stats_.cached_bytes += static_cast<int64_t>(capacity);
        return;
      }
    }
    std::free(data);
  }

  void release() {
    std::multimap<size_t, uint8_t*> blocks;
    {
      std::lock_guard<std::mutex> g(mu_);
      blocks.swap(free_);
      stats_.cached_blocks = stats_.cached_bytes = 0;
    }
    for (auto& [capacity, data] : blocks) std::free(data);
  }

  PoolStats stats() {
    std::lock_guard<std::mutex> g(mu_);
    PoolStats s = stats_;
    s.zero_copy_results = zero_copy_results_.load();
    return s;
  }
  void countZeroCopy() { zero_copy_results_++; }

 private:
  // torch.tpu.empty_cache() frees the free blocks; registered once the
  // runtime is up (the pool never starts it).
  void registerRelease() {
    if (registered_.load(std::memory_order_acquire) || !runtime::Runtime::initialized()) return;
    std::lock_guard<std::mutex> g(mu_);
    if (registered_.load()) return;
    runtime::Runtime::get().addCacheRelease([] { releasePool(); });
    registered_.store(true, std::memory_order_release);
  }

  std::mutex mu_;
  std::multimap<size_t, uint8_t*> free_;  // by capacity
  PoolStats stats_;
  std::atomic<int64_t> zero_copy_results_{0};
  std::atomic<bool> registered_{false};
};

Block::~Block() { pool_->give(data_, capacity_); }

// A block large enough to take chunks has a chunk's bytes to spare (Exchange).
BlockPtr takeBlock(size_t bytes) { return Pool::get()->take(bytes > kInlineMax ? bytes + kChunk : bytes); }
PoolStats poolStats() { return Pool::get()->stats(); }
void releasePool() { Pool::get()->release(); }

// ---------------------------------------------------------------- tensors <-> host

HostInput::HostInput(const at::Tensor& t) : bytes_(static_cast<size_t>(t.numel()) * t.element_size()) {
  if (!onTpu(t)) {
    host_ = t.contiguous();
    data_ = static_cast<const uint8_t*>(host_.const_data_ptr());
    return;
  }
  if (bytes_ == 0) return;
  buffer_ = aten::readTensor(t);
  auto& rt = runtime::Runtime::get();
  if (rt.plugin().readsInPlace()) {
    buffer_->awaitReady();
    runtime::checkPendingIndices(/*finished_only=*/true);
    const void* p = buffer_->unsafePointer();
    if (p && buffer_->onDeviceBytes() == bytes_) {
      data_ = static_cast<const uint8_t*>(p);
      return;
    }
  }
  block_ = takeBlock(bytes_);
  rt.download(*buffer_, block_->data(), bytes_);
  data_ = block_->data();
  buffer_.reset();
}

void writeResult(const at::Tensor& dst, const BlockPtr& block, size_t offset) {
  const size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  TORCH_CHECK(offset + bytes <= block->capacity(), "tpu_dist: a result of ", bytes, " bytes at ", offset,
              " does not fit its staging block of ", block->capacity());
  if (bytes == 0) return;
  uint8_t* data = block->data() + offset;
  if (!onTpu(dst)) {
    dst.copy_(at::from_blob(data, dst.sizes(), dst.options()));
    return;
  }
  auto& rt = runtime::Runtime::get();
  const c10::DeviceIndex device = dst.device().index();
  runtime::BufferPtr buf = rt.client().fromHostZeroCopy(data, runtime::elementType(aten::toIr(dst.scalar_type())),
                                                        {dst.numel()}, device, [block] {});
  Pool::get()->countZeroCopy();
  // Through the device's copy, which takes the buffer as the storage's own
  // where `dst` covers it (no copy) and orders it after pending ops in fused
  // eager. Not an autograd op and no version bump, as NCCL writes outputs.
  aten::copyInto(dst, aten::wrapBuffer(std::move(buf), dst.sizes(), dst.scalar_type(), device));
}

// ---------------------------------------------------------------- messages

namespace {

// Tags of the host backend's point-to-point messages kept for tpu_dist.
enum Tag : int {
  kTagFirst = 0x7A5D0000,  // a rank's first message to another: record, then payload or its announcement
  kTagChunk,               // an announced payload, in chunks
  kTagResult,              // all_reduce's reduced segments, in chunks
};

struct Header {
  int64_t record[kAgreementSlots];
  int64_t send_bytes;    // the payload this rank sends the receiver
  int64_t expect_bytes;  // what it expects from the receiver (the chunks it has posted for it)
};
const size_t kHead = aligned(sizeof(Header));
const size_t kFirstCapacity = kHead + kInlineMax;

size_t chunksOf(size_t bytes) { return (bytes + kChunk - 1) / kChunk; }
// The chunk messages of a payload (none when it rides in the first message).
size_t chunkMessages(size_t bytes) { return bytes > kInlineMax ? chunksOf(bytes) : 0; }
size_t chunkBytes(size_t bytes, size_t c) { return std::min(kChunk, bytes - c * kChunk); }

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

at::Tensor bytesAt(const void* p, size_t n) {
  return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

// Waits for a posted message, once (gloo's wait takes one completion each time
// it is called), and lets it go; a dead rank or a timeout raises, naming the
// collective.
void await(WorkPtr& w, const char* what, int rank) {
  if (!w) return;
  try {
    w->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "tpu_dist: ", what, " failed on rank ", rank, ": ", e.what());
  }
  w.reset();
}

struct Span {
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// One collective's first round between every pair of ranks: a first message
// each way (record, then a payload up to kInlineMax), and a larger payload in
// chunks of kChunk whose receives are posted at once, before the record is
// seen, so that the data flows without waiting for it. A receive may be posted
// for a whole chunk's bytes because a chunk is never larger (the last one may
// be smaller, which is why a block that takes chunks has kChunk to spare).
//
// Sends are posted before receives. gloo writes a send whose receiver already
// waits at once, in the calling thread, holding the pair's lock; its own
// thread then spins on that lock, and on 2 cores shared by 2 ranks that cost
// whole scheduler slices: all_gather of 512 KiB took 0.7-1.0 ms on average
// with receives first (a tenth of the calls 2-4 ms), 0.38-0.42 ms sends first.
class Exchange {
 public:
  // send[p]: what goes to rank p; expect[p]: the bytes rank p sends here;
  // dest[p]: where they go (null: a scratch block). Returns once every first
  // message is in and agrees; raises on every rank otherwise.
  Exchange(const Group& g, const Call& call, const std::vector<Span>& send, const std::vector<size_t>& expect,
           const std::vector<uint8_t*>& dest)
      : g_(g), what_(call.what), from_(g.size), chunks_(g.size) {
    const int n = g.size;
    first_in_ = takeBlock(static_cast<size_t>(n) * kFirstCapacity);
    std::vector<WorkPtr> first(n);
    size_t scratch_bytes = 0;
    for (int p = 0; p < n; ++p)
      if (p != g.rank && chunkMessages(expect[p]) && !dest[p]) scratch_bytes += aligned(expect[p]);
    if (scratch_bytes) scratch_ = takeBlock(scratch_bytes);
    uint8_t* scratch = scratch_ ? scratch_->data() : nullptr;
    size_t out_bytes = 0;
    for (int p = 0; p < n; ++p) out_bytes += p == g.rank ? 0 : aligned(kHead + inlined(send[p].bytes));
    first_out_ = takeBlock(out_bytes);
    uint8_t* at = first_out_->data();
    for (int p = 0; p < n; ++p) {
      if (p == g.rank) continue;
      const size_t inline_bytes = inlined(send[p].bytes);
      Header h{};
      std::copy(call.record.begin(), call.record.end(), h.record);
      h.send_bytes = static_cast<int64_t>(send[p].bytes);
      h.expect_bytes = static_cast<int64_t>(expect[p]);
      std::memcpy(at, &h, sizeof h);
      if (inline_bytes) std::memcpy(at + kHead, send[p].data, inline_bytes);
      post(p, kTagFirst, at, kHead + inline_bytes);
      if (chunkMessages(send[p].bytes)) sendChunks(p, kTagChunk, send[p].data, send[p].bytes);
      at += aligned(kHead + inline_bytes);
    }
    for (int p = 0; p < n; ++p) {
      if (p == g.rank) continue;
      first[p] = recv(p, kTagFirst, firstFrom(p), kFirstCapacity);
      if (chunkMessages(expect[p])) {
        uint8_t* to = dest[p] ? dest[p] : std::exchange(scratch, scratch + aligned(expect[p]));
        from_[p] = to;
        for (size_t c = 0; c < chunksOf(expect[p]); ++c)
          chunks_[p].push_back(recv(p, kTagChunk, to + c * kChunk, kChunk));
      }
    }
    // Every rank's record: a mismatch names them all.
    std::vector<int64_t> all(static_cast<size_t>(n) * kAgreementSlots);
    bool agreed = true;
    for (int p = 0; p < n; ++p) {
      const int64_t* record = call.record.data();
      if (p != g.rank) {
        await(first[p], what_, g.rank);
        const Header& h = header(p);
        record = h.record;
        const bool same_record = std::equal(call.record.begin(), call.record.end(), h.record);
        const bool same_sizes =
            static_cast<size_t>(h.send_bytes) == expect[p] && static_cast<size_t>(h.expect_bytes) == send[p].bytes;
        agreed = agreed && same_sizes && (same_record || !g.check);
      }
      std::copy(record, record + kAgreementSlots, all.begin() + static_cast<ptrdiff_t>(p) * kAgreementSlots);
    }
    if (!agreed) disagree(call, send, expect, all);
    for (int p = 0; p < n; ++p) {
      if (p == g.rank || chunkMessages(expect[p]) || !expect[p]) continue;
      from_[p] = firstFrom(p) + kHead;
      if (dest[p]) from_[p] = static_cast<uint8_t*>(std::memcpy(dest[p], from_[p], expect[p]));
    }
  }

  // Rank p's payload (complete once its chunks have arrived).
  const uint8_t* from(int p) const { return from_[p]; }
  // Waits for chunk c of every rank's payload (nothing for inline ones).
  void awaitChunk(size_t c) {
    for (auto& works : chunks_)
      if (c < works.size()) await(works[c], what_, g_.rank);
  }

  // Sends `bytes` at `data` to rank p in chunks (agreed sizes: no record).
  void sendChunks(int p, int tag, const uint8_t* data, size_t bytes) {
    for (size_t c = 0; c < chunksOf(bytes); ++c) post(p, tag, data + c * kChunk, chunkBytes(bytes, c));
  }
  void recvChunks(int p, int tag, uint8_t* data, size_t bytes, std::vector<WorkPtr>& into) {
    for (size_t c = 0; c < chunksOf(bytes); ++c) into.push_back(recv(p, tag, data + c * kChunk, chunkBytes(bytes, c)));
  }
  // Waits for every message posted: received and sent.
  void finish() {
    for (auto& works : chunks_)
      for (auto& w : works) await(w, what_, g_.rank);
    for (auto& w : sends_) await(w, what_, g_.rank);
  }

 private:
  static size_t inlined(size_t bytes) { return chunkMessages(bytes) ? 0 : bytes; }
  uint8_t* firstFrom(int p) const { return first_in_->data() + static_cast<size_t>(p) * kFirstCapacity; }
  const Header& header(int p) const { return *reinterpret_cast<const Header*>(firstFrom(p)); }

  void post(int p, int tag, const uint8_t* data, size_t bytes) {
    std::vector<at::Tensor> t{bytesAt(data, bytes)};
    sends_.push_back(g_.host.send(t, p, tag));
  }
  WorkPtr recv(int p, int tag, uint8_t* data, size_t bytes) {
    std::vector<at::Tensor> t{bytesAt(data, bytes)};
    return g_.host.recv(t, p, tag);
  }

  // The ranks disagree. Each pair evens out its chunk messages first, so that
  // none is left over for a later collective: a rank takes the chunks a peer
  // sent beyond the receives it posted, and sends a byte for each receive the
  // peer posted beyond the chunks it sent. Then every rank raises.
  [[noreturn]] void disagree(const Call& call, const std::vector<Span>& send, const std::vector<size_t>& expect,
                             const std::vector<int64_t>& all) {
    static const uint8_t filler = 0;
    BlockPtr sink = takeBlock(kChunk);
    for (int p = 0; p < g_.size; ++p) {
      if (p == g_.rank) continue;
      const Header& h = header(p);
      for (size_t c = chunkMessages(expect[p]); c < chunkMessages(h.send_bytes); ++c)
        chunks_[p].push_back(recv(p, kTagChunk, sink->data(), kChunk));
      for (size_t c = chunkMessages(send[p].bytes); c < chunkMessages(h.expect_bytes); ++c)
        post(p, kTagChunk, &filler, 1);
    }
    finish();
    checkAgreement(what_, call.record, all.data(), g_.size);
    TORCH_CHECK(false, "tpu_dist: ", what_, " was called with arguments that differ across ranks (each rank ",
                "sends or expects other sizes: another root, or tensors of other sizes)");
  }

  const Group& g_;
  const char* what_;
  // Blocks before the messages: the messages (which point into them) go first.
  BlockPtr first_in_, first_out_, scratch_;
  std::vector<const uint8_t*> from_;
  std::vector<std::vector<WorkPtr>> chunks_;  // by rank: its payload's chunks
  std::vector<WorkPtr> sends_;
};

// ---------------------------------------------------------------- reductions

at::Tensor elements(const void* p, int64_t count, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), {count}, at::TensorOptions().dtype(dtype));
}

// out = a op b.
void combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, c10d::ReduceOp::RedOpType op) {
  using R = c10d::ReduceOp;
  using Fn = at::Tensor& (*)(at::Tensor&, const at::Tensor&, const at::Tensor&);
  static const std::map<R::RedOpType, Fn> table{
      {R::PRODUCT, static_cast<Fn>(&at::mul_out)},    {R::MIN, static_cast<Fn>(&at::minimum_out)},
      {R::MAX, static_cast<Fn>(&at::maximum_out)},    {R::BAND, static_cast<Fn>(&at::bitwise_and_out)},
      {R::BOR, static_cast<Fn>(&at::bitwise_or_out)}, {R::BXOR, static_cast<Fn>(&at::bitwise_xor_out)}};
  if (op == R::SUM || op == R::AVG || op == R::PREMUL_SUM) {  // PREMUL_SUM's inputs came scaled
    at::add_out(out, a, b);
    return;
  }
  auto it = table.find(op);
  TORCH_CHECK(it != table.end(), "tpu_dist: reduce op ", static_cast<int>(op), " is not supported");
  it->second(out, a, b);
}

// out = source(0) op source(1) op ... in rank order (every rank that reduces the
// same values gets the same bits); AVG then divides, integers truncating.
template <typename Source>
void reduceInOrder(uint8_t* out, const Source& source, int n, int64_t count, at::ScalarType dtype,
                   c10d::ReduceOp::RedOpType op) {
  if (count == 0) return;
  // One thread: the others' cores run the transport (and, on one host, the
  // other ranks); OpenMP workers spinning there stalled it for milliseconds.
  c10::ParallelGuard serial(true);
  at::Tensor o = elements(out, count, dtype);
  if (n == 1)
    o.copy_(elements(source(0), count, dtype));
  else
    combine(o, elements(source(0), count, dtype), elements(source(1), count, dtype), op);
  for (int r = 2; r < n; ++r) combine(o, o, elements(source(r), count, dtype), op);
  if (op == c10d::ReduceOp::AVG) {
    if (at::isIntegralType(dtype, /*includeBool=*/false))
      o.div_(n, "trunc");
    else
      o.div_(n);
  }
}

// Reduces, chunk by chunk as the chunks arrive, every rank's `bytes` (this
// rank's at `mine`, the others' from `ex`) into `out`; after(offset, bytes)
// runs for each chunk reduced.
template <typename After>
void reduceChunks(Exchange& ex, const Group& g, const uint8_t* mine, uint8_t* out, size_t bytes, at::ScalarType dtype,
                  c10d::ReduceOp::RedOpType op, const After& after) {
  const size_t es = c10::elementSize(dtype);
  for (size_t c = 0; c < std::max<size_t>(1, chunksOf(bytes)); ++c) {
    ex.awaitChunk(c);
    const size_t off = c * kChunk, len = std::min(kChunk, bytes - std::min(bytes, off));
    auto source = [&](int r) { return (r == g.rank ? mine : ex.from(r)) + off; };
    reduceInOrder(out + off, source, g.size, static_cast<int64_t>(len / es), dtype, op);
    if (len) after(off, len);
  }
}

std::vector<Span> same(int n, const uint8_t* data, size_t bytes) { return std::vector<Span>(n, Span{data, bytes}); }

}  // namespace

// ---------------------------------------------------------------- collectives

void agree(const Group& g, const Call& call) {
  if (!g.check || g.size == 1) return;
  Exchange ex(g, call, same(g.size, nullptr, 0), std::vector<size_t>(g.size, 0), std::vector<uint8_t*>(g.size));
  ex.finish();
}

void allReduce(const Group& g, const Call& call, const uint8_t* in, uint8_t* out, int64_t count, at::ScalarType dtype,
               c10d::ReduceOp::RedOpType op) {
  const size_t es = c10::elementSize(dtype), bytes = static_cast<size_t>(count) * es;
  const int n = g.size;
  if (static_cast<size_t>(n - 1) * bytes <= kDirectMax) {
    // Every rank sends its whole input to every other and reduces all of them
    // in rank order, chunk by chunk as they arrive: one round instead of two in
    // a row (for 2 ranks, no more bytes than the two rounds send).
    Exchange ex(g, call, same(n, in, bytes), std::vector<size_t>(n, bytes), std::vector<uint8_t*>(n));
    reduceChunks(ex, g, in, out, bytes, dtype, op, [](size_t, size_t) {});
    ex.finish();
    return;
  }
  // Rank r reduces segment r of everyone's input and sends the result to the
  // others, each chunk as soon as it is reduced.
  const int64_t seg = (count + n - 1) / n;
  auto start = [&](int r) { return static_cast<size_t>(std::min(count, r * seg)) * es; };
  auto length = [&](int r) { return start(r + 1) - start(r); };
  std::vector<Span> send(n);
  for (int p = 0; p < n; ++p) send[p] = {in + start(p), length(p)};
  Exchange ex(g, call, send, std::vector<size_t>(n, length(g.rank)), std::vector<uint8_t*>(n));
  std::vector<WorkPtr> results;
  for (int p = 0; p < n; ++p)
    if (p != g.rank) ex.recvChunks(p, kTagResult, out + start(p), length(p), results);
  uint8_t* mine = out + start(g.rank);
  reduceChunks(ex, g, in + start(g.rank), mine, length(g.rank), dtype, op, [&](size_t off, size_t len) {
    for (int p = 0; p < n; ++p)
      if (p != g.rank) ex.sendChunks(p, kTagResult, mine + off, len);
  });
  for (auto& w : results) await(w, call.what, g.rank);
  ex.finish();
}

void allGather(const Group& g, const Call& call, const uint8_t* in, size_t bytes, uint8_t* out, size_t stride) {
  std::vector<uint8_t*> dest(g.size);
  for (int p = 0; p < g.size; ++p) dest[p] = out + static_cast<size_t>(p) * stride;
  if (bytes) std::memcpy(dest[g.rank], in, bytes);
  Exchange ex(g, call, same(g.size, in, bytes), std::vector<size_t>(g.size, bytes), dest);
  ex.finish();
}

void reduceScatter(const Group& g, const Call& call, const std::vector<const uint8_t*>& parts, uint8_t* out,
                   int64_t count, at::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  std::vector<Span> send(g.size);
  for (int p = 0; p < g.size; ++p) send[p] = {parts[p], bytes};
  Exchange ex(g, call, send, std::vector<size_t>(g.size, bytes), std::vector<uint8_t*>(g.size));
  reduceChunks(ex, g, parts[g.rank], out, bytes, dtype, op, [](size_t, size_t) {});
  ex.finish();
}

void broadcast(const Group& g, const Call& call, int root, const uint8_t* in, uint8_t* out, size_t bytes) {
  std::vector<Span> send(g.size);
  std::vector<size_t> expect(g.size, 0);
  std::vector<uint8_t*> dest(g.size);
  if (g.rank == root)
    send = same(g.size, in, bytes);
  else
    expect[root] = bytes, dest[root] = out;
  Exchange ex(g, call, send, expect, dest);
  ex.finish();
}

}  // namespace tpu::distributed::staging
