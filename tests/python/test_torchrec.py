"""TorchRec and FBGEMM on tpu (torch_tpu/_torchrec.py), natively (TORCH_TPU_FALLBACK=error):
FBGEMM's sparse-data ops equal its CPU kernels; its table-batched embedding (TBE) with the
optimizer fused into the backward equals the same TBE on the CPU, step after step; TorchRec's
torchrec::embedding_* lookups equal their CPU versions; and a DLRM under DistributedModelParallel,
with the plans TorchRec's planner makes for tpu (table-wise and row-wise, its fused and
unfused_tpu kernels), trains on 2 ranks to the losses of 1 rank and of the CPU."""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")
torchrec = pytest.importorskip("torchrec")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

pytestmark = pytest.mark.mode_dependent
fb = torch.ops.fbgemm
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_workers")


def _to_tpu(a):
    if isinstance(a, list):
        return [_to_tpu(x) for x in a]
    return a.to("tpu") if isinstance(a, torch.Tensor) else a


def same_on_tpu(op, *args, **kwargs):
    """op on the CPU arguments and on their tpu copies: every result equal."""
    ref = op(*args, **kwargs)
    out = op(*[_to_tpu(a) for a in args], **{k: _to_tpu(v) for k, v in kwargs.items()})
    ref, out = (ref, out) if isinstance(ref, (tuple, list)) else ((ref,), (out,))
    assert len(ref) == len(out)
    for r, o in zip(ref, out):
        if r is None:
            assert o is None
        else:
            assert o.device.type == "tpu"
            torch.testing.assert_close(o.cpu(), r)


def jagged(features=3, batch=4, rows=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (features * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g)
    return lengths, values, weights


def test_sparse_data_ops_match_fbgemm_cpu(fallback_error):
    lengths, values, weights = jagged()
    same_on_tpu(fb.asynchronous_complete_cumsum, lengths)
    same_on_tpu(fb.asynchronous_exclusive_cumsum, lengths)
    same_on_tpu(fb.asynchronous_inclusive_cumsum, lengths)
    same_on_tpu(fb.asynchronous_complete_cumsum, lengths.reshape(3, 4))
    perm = torch.tensor([2, 0, 1, 2], dtype=torch.int32)  # a feature may repeat
    same_on_tpu(fb.permute_2D_sparse_data, perm, lengths.reshape(3, 4), values, weights)
    same_on_tpu(fb.permute_2D_sparse_data, perm, lengths.reshape(3, 4), values, None, int(
        lengths.reshape(3, 4)[perm].sum()))
    seg_perm = torch.randperm(12, generator=torch.Generator().manual_seed(3)).int()
    same_on_tpu(fb.permute_1D_sparse_data, seg_perm, lengths, values, weights)
    same_on_tpu(fb.invert_permute, seg_perm)
    same_on_tpu(fb.offsets_range, fb.asynchronous_exclusive_cumsum(lengths), int(lengths.sum()))
    same_on_tpu(fb.lengths_range, lengths)
    same_on_tpu(fb.segment_sum_csr, 2, torch.tensor([0, 1, 3, 6], dtype=torch.int32), torch.rand(12))


@pytest.mark.parametrize("keep_orig_idx", [False, True])
def test_block_bucketize_matches_fbgemm_cpu(keep_orig_idx, fallback_error):
    # Row-wise sharding's input split: 3 features, 4 samples, 2 ranks; ids past the last block too.
    lengths, values, weights = jagged(rows=70)
    block_sizes = torch.tensor([20, 25, 30])
    for sequence in (False, True):
        same_on_tpu(fb.block_bucketize_sparse_features, lengths, values, True, sequence, block_sizes, 2, weights,
                    keep_orig_idx=keep_orig_idx)


def test_pooled_permutes_and_jagged_conversions(fallback_error):
    dims = torch.tensor([0, 4, 12, 14])
    perm = torch.tensor([2, 0, 1])
    inv = fb.invert_permute(perm)
    inv_dims = fb.asynchronous_complete_cumsum((dims[1:] - dims[:-1])[perm])
    pooled = torch.randn(5, 14)
    same_on_tpu(fb.permute_pooled_embs, pooled, dims, perm, inv_dims, inv)
    # Autograd through the permute: the gradient comes back in the input's column order.
    x = pooled.to("tpu").requires_grad_()
    fb.permute_pooled_embs_auto_grad(x, dims.to("tpu"), perm.to("tpu"), inv_dims.to("tpu"), inv.to("tpu")).sum(
        0).mul(torch.arange(14.0, device="tpu")).sum().backward()
    ref = pooled.clone().requires_grad_()
    fb.permute_pooled_embs_auto_grad(ref, dims, perm, inv_dims, inv).sum(0).mul(torch.arange(14.0)).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), ref.grad)
    offsets = torch.tensor([0, 2, 2, 5])
    vals = torch.randn(5, 3)
    same_on_tpu(fb.jagged_2d_to_dense, vals, offsets, 4)
    same_on_tpu(fb.jagged_to_padded_dense, vals, [offsets], [4], 1.5)
    dense = torch.randn(3, 4, 3)
    same_on_tpu(lambda d, o: fb.dense_to_jagged(d, [o])[0], dense, offsets)
    # Their gradients, through FBGEMM's own autograd formulas.
    for fn, x in ((lambda v, o: fb.jagged_to_padded_dense(v, [o], [4]), vals),
                  (lambda v, o: fb.jagged_2d_to_dense(v, o, 4), vals),
                  (lambda d, o: fb.dense_to_jagged(d, [o])[0], dense)):
        grads = []
        for dev in ("cpu", "tpu"):
            leaf = x.detach().clone().to(dev).requires_grad_()
            fn(leaf, offsets.to(dev)).pow(2).sum().backward()
            grads.append(leaf.grad.cpu())
        torch.testing.assert_close(grads[1], grads[0])


def test_bounds_check(fallback_error):
    rows = torch.tensor([10, 20])
    offsets = torch.tensor([0, 2, 3, 5, 6])  # 2 features, batch 2
    for mode in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE):
        results = []
        for dev in ("cpu", "tpu"):
            idx = torch.tensor([1, 12, 9, 3, 25, 19], device=dev)
            warning = torch.zeros(1, dtype=torch.long, device=dev)
            fb.bounds_check_indices(rows.to(dev), idx, offsets.to(dev), mode.value, warning)
            results.append((idx.cpu(), warning.cpu()))
        torch.testing.assert_close(results[1][0], results[0][0])
        assert int(results[1][1]) == (2 if mode == BoundsCheckMode.WARNING else 0)
    # FATAL: an id past its table's rows is refused.
    with pytest.raises(RuntimeError, match="outside its table"):
        fb.bounds_check_indices(rows.to("tpu"), torch.tensor([1, 12, 9, 3, 25, 19], device="tpu"),
                                offsets.to("tpu"), BoundsCheckMode.FATAL.value, torch.zeros(1, device="tpu"))


def tbe(optimizer, pooling, feature_table_map, **kw):
    specs = [(30, 8, EmbeddingLocation.HOST, ComputeDevice.CPU), (20, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    torch.manual_seed(0)
    return SplitTableBatchedEmbeddingBagsCodegen(specs, feature_table_map=feature_table_map, optimizer=optimizer,
                                                 learning_rate=0.1, eps=0.01, pooling_mode=pooling, device="cpu", **kw)


# Exact Adagrad variants coalesce a row's gradients before the update ("exact"). FBGEMM's CPU kernel
# updates a table that two features share once per feature, its CUDA kernel once: tpu does as CUDA
# does, so shared tables are compared with SGD, where the two agree.
TBE_CASES = [(opt, pool, [0, 1]) for opt in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                                             EmbOptimType.EXACT_ROWWISE_ADAGRAD)
             for pool in (PoolingMode.SUM, PoolingMode.MEAN)] + [(EmbOptimType.EXACT_SGD, PoolingMode.SUM, [0, 1, 0])]


@pytest.mark.parametrize("optimizer,pooling,ftm", TBE_CASES, ids=lambda v: str(v))
def test_tbe_with_fused_optimizer_matches_cpu(optimizer, pooling, ftm, fallback_error):
    cpu = tbe(optimizer, pooling, ftm)
    tpu = copy.deepcopy(cpu).to("tpu")
    rows, dims, batch = [30, 20], [8, 4], 4
    g = torch.Generator().manual_seed(2)
    weighted = optimizer == EmbOptimType.EXACT_SGD and pooling == PoolingMode.SUM
    for _ in range(3):
        lengths = torch.randint(0, 4, (len(ftm) * batch,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        bound = torch.tensor([rows[t] for t in ftm]).repeat_interleave(batch).repeat_interleave(lengths)
        idx = (torch.rand(int(lengths.sum()), generator=g) * bound).long()
        psw = torch.rand(idx.numel(), generator=g) if weighted else None
        grad = torch.randn(batch, sum(dims[t] for t in ftm), generator=g)
        outs = []
        for m, dev in ((cpu, "cpu"), (tpu, "tpu")):
            kw = {"per_sample_weights": psw.to(dev)} if psw is not None else {}
            out = m(idx.to(dev), offsets.to(dev), **kw)
            out.backward(grad.to(dev))
            outs.append(out.detach().cpu())
        torch.testing.assert_close(outs[1], outs[0])
    for want, got in zip(cpu.split_embedding_weights(), tpu.split_embedding_weights()):
        torch.testing.assert_close(got.cpu(), want)


def test_tbe_refuses_what_it_has_no_kernel_for():
    # Row-wise Adagrad with weight decay: the forward runs, the fused update refuses.
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    specs = [(30, 8, EmbeddingLocation.HOST, ComputeDevice.CPU)]
    m = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1,
                                              weight_decay=0.01, weight_decay_mode=WeightDecayMode.DECOUPLE,
                                              device="cpu").to("tpu")
    out = m(torch.tensor([1, 2, 3], device="tpu"), torch.tensor([0, 1, 3], device="tpu"))
    with pytest.raises(NotImplementedError, match="weight decay"):
        out.sum().backward()


def test_torchrec_unfused_tpu_lookups_match_cpu(fallback_error):
    importlib.import_module("torchrec.experimental.torch_tpu.pallas.ops")  # defines torchrec::embedding_*

    rec = torch.ops.torchrec
    table = torch.randn(30, 16)
    idx = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 2, 5, 8], dtype=torch.int32)
    row_offsets = torch.tensor([0, 10, 10, 20], dtype=torch.int32)
    same_on_tpu(rec.embedding_lookup, idx, table, 16)
    same_on_tpu(rec.embedding_pooled_lookup, idx, table, 2)
    same_on_tpu(rec.embedding_pooled_lookup_offset, idx, offsets, table, 16)
    same_on_tpu(rec.embedding_pooled_batched_lookup_offset, idx, offsets, table, row_offsets, 16)
    grad = torch.randn(4, 16)
    same_on_tpu(rec.embedding_pooled_lookup_offset_backward, grad, idx, offsets, 30, 16)
    same_on_tpu(rec.embedding_pooled_batched_lookup_offset_backward, grad, idx, offsets, row_offsets, 30, 16)
    same_on_tpu(rec.embedding_pooled_lookup_backward, grad, idx, 2, 30, 16)
    same_on_tpu(rec.embedding_lookup_backward, torch.randn(8, 16), idx, 30, 16)
    # Through autograd (TorchRec's registered backward calls the *_backward ops).
    t = table.to("tpu").requires_grad_()
    rec.embedding_pooled_lookup_offset(idx.to("tpu"), offsets.to("tpu"), t, 16).backward(grad.to("tpu"))
    ref = table.clone().requires_grad_()
    rec.embedding_pooled_lookup_offset(idx, offsets, ref, 16).backward(grad)
    torch.testing.assert_close(t.grad.cpu(), ref.grad)


def test_embedding_bag_collection_matches_cpu(fallback_error):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"])
              for i in range(3)]
    cpu = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    tpu = copy.deepcopy(cpu).to("tpu")
    lengths, values, weights = jagged()
    outs = []
    for m, dev in ((cpu, "cpu"), (tpu, "tpu")):
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values.to(dev), lengths=lengths.to(dev))
        out = m(kjt)
        out.values().pow(2).sum().backward()
        outs.append((out.values().detach().cpu(), [p.grad.cpu() for p in m.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for got, want in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(got, want)


def _torchrun(nproc, out, *configs):
    env = {**os.environ, "TORCH_TPU_CPU_DEVICES": "2", "TORCH_TPU_FALLBACK": "error", "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_TPU_DEFER_AND_FUSE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(WORKERS, "torchrec_dlrm.py"), str(out), *configs]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
def test_dlrm_model_parallel_two_ranks_equals_one_rank_and_cpu(tmp_path):
    """DistributedModelParallel over 2 processes (tpu:0 and tpu:1 for ranks 0 and 1), with the
    planner's plan for each sharding type and kernel, against 1 process and against the CPU."""
    two = _torchrun(2, tmp_path / "two.json", "tpu:table_wise:fused", "tpu:row_wise:fused",
                    "tpu:table_wise:unfused_tpu", "tpu:row_wise:unfused_tpu", "cpu:table_wise:fused")
    one = _torchrun(1, tmp_path / "one.json", "tpu:table_wise:fused", "cpu:table_wise:fused")
    want = one["cpu:table_wise:fused"]["losses"]
    assert want[-1] < want[0]
    runs = [(f"2 ranks, {k}", k, v) for k, v in two.items()]
    runs.append(("1 rank, tpu", "tpu:table_wise:fused", one["tpu:table_wise:fused"]))
    for label, config, run in runs:
        assert run["fallbacks"] == {}, label
        _, sharding, kernel = config.split(":")
        assert run["plan"] == [[sharding, kernel]], label
        torch.testing.assert_close(run["losses"], want, rtol=1e-5, atol=1e-5, msg=lambda m, n=label: f"{n}: {m}")


def _coo(batch=4, rows=12, n=10, seed=0):
    """SparseCore-style entries with padding: two out-of-range ids and an entry past the pointer."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randint(0, rows, (n,), generator=g, dtype=torch.int32)
    smp = torch.randint(0, batch, (n,), generator=g, dtype=torch.int32)
    gains = torch.rand(n, generator=g)
    emb[3], smp[6] = 2**31 - 1, 2**31 - 1
    row_pointers = torch.tensor([4, n - 1], dtype=torch.int32)
    S = torch.zeros(batch, rows)
    for k in range(n - 1):
        if k not in (3, 6):
            S[smp[k], emb[k]] += gains[k]
    return row_pointers, emb, smp, gains, S


def test_sparse_dense_matmul_and_its_optimizers(fallback_error):
    ops = torch.tpu.ops
    rp, emb, smp, gains, S = _coo()
    table, grad = torch.randn(12, 8), torch.randn(4, 8)
    t = [x.to("tpu") for x in (rp, emb, smp, gains)]
    out = ops.sparse_dense_matmul(*t, table.to("tpu"), 4)
    torch.testing.assert_close(out.cpu(), S @ table)
    g = S.T @ grad
    named = (S != 0).any(0)[:, None]
    new = ops.sparse_dense_matmul_grad_with_sgd(*t, table.to("tpu"), grad.to("tpu"), torch.tensor(0.1, device="tpu"),
                                                device_batch_size=4)
    torch.testing.assert_close(new.cpu(), table - 0.1 * g)
    acc = torch.rand(12, 8)
    new, new_acc = ops.sparse_dense_matmul_grad_with_adagrad(*t, table.to("tpu"), acc.to("tpu"), grad.to("tpu"), 0.1,
                                                             1e-8, device_batch_size=4)
    want_acc = torch.where(named, acc + g * g, acc)
    torch.testing.assert_close(new_acc.cpu(), want_acc)
    torch.testing.assert_close(new.cpu(), torch.where(named, table - 0.1 * g / (want_acc.sqrt() + 1e-8), table))
    m, v = torch.rand(12, 8), torch.rand(12, 8)
    new, m2, v2 = ops.sparse_dense_matmul_grad_with_adam(*t, table.to("tpu"), m.to("tpu"), v.to("tpu"),
                                                         grad.to("tpu"), 0.1, 0.9, 0.99, 1e-8, device_batch_size=4)
    want_m, want_v = torch.where(named, 0.9 * m + 0.1 * g, m), torch.where(named, 0.99 * v + 0.01 * g * g, v)
    torch.testing.assert_close(m2.cpu(), want_m)
    torch.testing.assert_close(v2.cpu(), want_v)
    torch.testing.assert_close(new.cpu(), torch.where(named, table - 0.1 * want_m / (want_v.sqrt() + 1e-8), table))
    with pytest.raises(ValueError, match="one length"):
        ops.sparse_dense_matmul(t[0], t[1], t[2][:3], t[3], table.to("tpu"), 4)


def test_torchrec_sparsecore_custom_op_trains_through_autograd(fallback_error):
    """TorchRec's torchrec_torch_tpu::sparse_dense_matmul_sgd_fwd (its SparseCore EBC's op):
    forward through torch.tpu.ops, backward updates the table in place."""
    custom_ops = importlib.import_module("torchrec.experimental.torch_tpu.modules.custom_ops")
    rp, emb, smp, gains, S = _coo()
    table, grad = torch.randn(12, 8), torch.randn(4, 8)
    tt = table.to("tpu").requires_grad_()
    out = custom_ops.sparse_dense_matmul_sgd_fwd(*[x.to("tpu") for x in (rp, emb, smp, gains)], tt,
                                                 torch.tensor(0.1, device="tpu"), 4)
    out.backward(grad.to("tpu"))
    torch.testing.assert_close(out.detach().cpu(), S @ table)
    torch.testing.assert_close(tt.detach().cpu(), table - 0.1 * (S.T @ grad))


def test_a_case_with_no_tpu_path_goes_through_the_counted_fallback():
    """block_bucketize_sparse_features with variable batch sizes per feature: the CPU fallback,
    counted in metrics() under "warn", refused under "error"."""
    import torch_tpu

    lengths, values, _ = jagged(features=2, batch=3)
    args = (lengths, values, False, False, torch.tensor([30, 30]), 2, None, torch.tensor([3, 3]), 3)
    want = fb.block_bucketize_sparse_features(*args)
    targs = [_to_tpu(a) for a in args]
    torch_tpu.reset_metrics()
    previous = "error" if torch_tpu._C._fallback_is_error() else "warn"
    try:
        torch_tpu.set_fallback("warn")
        with pytest.warns(UserWarning, match="block_bucketize"):
            got = fb.block_bucketize_sparse_features(*targs)
        assert torch_tpu.metrics()["fallbacks"].get("fbgemm::block_bucketize_sparse_features") == 1
        torch.testing.assert_close(got[0].cpu(), want[0])
        torch.testing.assert_close(got[1].cpu(), want[1])
        torch_tpu.set_fallback("error")
        with pytest.raises(RuntimeError, match="variable batch sizes"):
            fb.block_bucketize_sparse_features(*targs)
    finally:
        torch_tpu.set_fallback(previous)


def test_a_new_id_count_reuses_the_tbe_programs(fallback_error):
    """Ids are padded to a bucket (torch_tpu._torchrec.bucket): a batch with another number of ids
    in the same bucket needs only the padding's programs (before: about 40 per new count)."""
    import torch_tpu
    from torch_tpu._torchrec import bucket

    assert bucket(100) == bucket(103) == 104 and bucket(10) == 64 and bucket(1000) == 1024
    m = tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, [0, 1]).to("tpu")
    g = torch.Generator().manual_seed(5)

    def step(n):
        offsets = torch.linspace(0, n, 9).long()  # 2 features x batch 4
        idx = torch.randint(0, 20, (n,), generator=g)
        m(idx.to("tpu"), offsets.to("tpu")).sum().backward()
        torch.tpu.synchronize()

    # Programs looked up and not found in memory (compiled, or read from the disk cache an earlier
    # run left): what a new id count costs.
    with torch_tpu.mode("strict"):
        step(100)
        before = torch_tpu.metrics()["cache_misses"]
        step(103)
        assert torch_tpu.metrics()["cache_misses"] - before <= 3
