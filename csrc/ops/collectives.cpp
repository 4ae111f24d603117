// Collectives inside a program: the lowerings of tpu::replica_* (the ops a
// compiled step's functional collectives become when every rank of the group
// drives a device of this process; distributed/in_program.cpp). Each is one
// StableHLO collective among its group (global device ids) of the program's
// replicas; the replicas (the rank's world: replica r on replicas[r]) become
// the program's device assignment; the last argument is the collective's
// channel (its place among the step's collectives, the same on every rank). Work along dim 0, as c10d's
// tensor collectives do.
#include "ops/common.h"

namespace tpu::ops {
namespace {

using ir::Builder;

std::vector<int> idsOf(Ctx& c, size_t i) {
  std::vector<int> ids;
  for (int64_t id : c.ints(i)) ids.push_back(static_cast<int>(id));
  return ids;
}

// The reduction's combiner; AVG is the sum divided afterwards.
Builder::BodyFn combiner(const std::string& reduce, DType t) {
  const char* op = nullptr;
  if (reduce == "sum" || reduce == "avg") op = t == DType::Bool ? "or" : "add";
  if (reduce == "product") op = t == DType::Bool ? "and" : "multiply";
  if (reduce == "min") op = "minimum";
  if (reduce == "max") op = "maximum";
  if (!op) throw ir::Unsupported("replica collective: reduction '" + reduce + "'");
  return [op](Builder& b, const std::vector<Value>& a) { return std::vector<Value>{b.binary(op, a[0], a[1])}; };
}

Value averaged(Builder& b, const Value& v, const std::string& reduce, int64_t n) {
  if (reduce != "avg") return v;
  // NCCL's AVG: the sum over the group size (integers truncate).
  return b.binary("divide", v, b.constant(static_cast<double>(n), v.dtype(), v.shape()));
}

// Arguments: the tensor, [the reduction], the group, the program's replicas, the channel.
// The reductions: all_reduce, or reduce_scatter along dim 0.
std::vector<Value> replicaReduction(Ctx& c, bool scatter) {
  const Value x = c.tensor(0);
  const std::string reduce = c.str(1);
  const std::vector<int> group = idsOf(c, 2);
  c.b.setParticipants(idsOf(c, 3));
  const auto combine = combiner(reduce, x.dtype());
  const Value r =
      scatter ? c.b.reduceScatter(x, group, 0, combine, c.i64(4)) : c.b.allReduce(x, group, combine, c.i64(4));
  return {averaged(c.b, r, reduce, static_cast<int64_t>(group.size()))};
}

std::vector<Value> replicaAllReduce(Ctx& c) { return replicaReduction(c, false); }
std::vector<Value> replicaReduceScatter(Ctx& c) { return replicaReduction(c, true); }

std::vector<Value> replicaAllGather(Ctx& c) {
  const Value x = c.tensor(0);
  const std::vector<int> group = idsOf(c, 1);
  c.b.setParticipants(idsOf(c, 2));
  return {c.b.allGather(x.rank() == 0 ? c.b.reshape(x, {1}) : x, group, 0, c.i64(3))};
}

std::vector<Value> replicaAllToAll(Ctx& c) {
  const Value x = c.tensor(0);
  const std::vector<int> group = idsOf(c, 1);
  c.b.setParticipants(idsOf(c, 2));
  return {c.b.allToAll(x, group, 0, 0, c.i64(3))};
}

const Registrar kAllReduce("replica_all_reduce", replicaAllReduce);
const Registrar kAllGather("replica_all_gather", replicaAllGather);
const Registrar kReduceScatter("replica_reduce_scatter", replicaReduceScatter);
const Registrar kAllToAll("replica_all_to_all", replicaAllToAll);

}  // namespace
}  // namespace tpu::ops
