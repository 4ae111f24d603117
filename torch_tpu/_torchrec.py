"""TorchRec and FBGEMM on tpu, natively: tpu kernels for the FBGEMM and TorchRec operators that
TorchRec's sharded embedding modules call, registered for PrivateUse1 when the library loads.

FBGEMM registers its operators for the CPU and CUDA only, so on tpu tensors they would run
through the CPU fallback (a copy in and out per call, refused under TORCH_TPU_FALLBACK=error).
Here each is written once over ATen ops that torch_tpu lowers (gathers, scatters, prefix sums,
embedding_bag), so an EmbeddingBagCollection sharded by DistributedModelParallel runs on tpu end
to end:

- the sparse-data ops of the input and output distributions (``permute_{1D,2D}_sparse_data``,
  ``block_bucketize_sparse_features``, the cumsums, ``invert_permute``,
  ``permute_pooled_embs*``, jagged/dense conversions);
- the table-batched embedding (TBE) lookup with its optimizer fused into the backward, which the
  planner's ``fused`` kernel builds (``split_embedding_codegen_lookup_*_function_pt2``): SGD,
  exact Adagrad and exact row-wise Adagrad, checked against FBGEMM's own CPU kernels;
- TorchRec's ``torchrec::embedding_*`` lookups (its ``unfused_tpu`` kernel).

Where a call uses an option written here for no tpu path (variable batch sizes per feature,
gradient clipping, weight decay), the operator raises NotImplementedError
saying which, or, for the sparse-data ops, runs through torch_tpu's CPU fallback: counted in
``torch_tpu.metrics()``, warned once, refused under ``TORCH_TPU_FALLBACK=error``.
Data-dependent output sizes (the permuted values' length) are read from the device once per call,
as FBGEMM's own CUDA kernels do.
"""

from __future__ import annotations

import torch

from . import _C

_KEYS = ("PrivateUse1", "AutogradPrivateUse1")
_libs: list = []  # torch.library handles: kept alive, or the registrations go with them


def _fallback(op: str, why: str, *args, **kwargs):
    """The op through torch_tpu's CPU fallback (counted, warned, refused under =error)."""
    name, _, overload = op.partition(".")
    return _C._cpu_fallback(name, overload, why, *args, **kwargs)


def _register(namespace: str, kernels: dict, keys=_KEYS) -> None:
    lib = torch.library.Library(namespace, "IMPL")
    for name, fn in kernels.items():
        for key in keys:
            # A kernel registered before ours (TorchRec's own Pallas kernels for "TPU", which
            # torchrec.experimental.torch_tpu.pallas.impl registers when imported) is kept.
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", key):
                lib.impl(name, fn, key)
    _libs.append(lib)


# --- jagged and sparse-data ops --------------------------------------------------------------


def complete_cumsum(t: torch.Tensor) -> torch.Tensor:
    """[0, t0, t0+t1, ...] along the last dim (FBGEMM's asynchronous_complete_cumsum)."""
    zero = torch.zeros(*t.shape[:-1], 1, dtype=t.dtype, device=t.device)
    return torch.cat([zero, torch.cumsum(t, -1).to(t.dtype)], -1)


def _exclusive_cumsum(t):
    return complete_cumsum(t)[..., :-1]


def _inclusive_cumsum(t):
    return torch.cumsum(t, -1).to(t.dtype)


def segment_of(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The segment (0-based) each of n positions falls in, given complete offsets [S+1]."""
    pos = torch.arange(n, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets[1:].contiguous(), pos, right=True)


def bucket(n: int) -> int:
    """The size n ids are padded to: a multiple of an eighth of n's power of two (at most 12.5%
    padding, 8 sizes per doubling), so that batches of other sizes reuse the compiled programs
    instead of compiling their own (each id count was a new set of programs)."""
    if n <= 64:
        return 64
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def pad_to(t, size: int):
    """t padded with zeros along dim 0 to `size` rows."""
    if t is None or t.shape[0] >= size:
        return t
    return torch.cat([t, t.new_zeros((size - t.shape[0], *t.shape[1:]))])


def _permute_segments(permute, seg_lengths, values, weights, total):
    """Values (and weights) of segments taken in `permute`'s order; seg_lengths per segment."""
    in_off = complete_cumsum(seg_lengths.long())
    out_len = seg_lengths.long()[permute.long()]
    out_off = complete_cumsum(out_len)
    if total is None:
        total = int(out_off[-1])  # the output's size: one host read, as FBGEMM's CUDA kernel does
    seg = segment_of(out_off, total)
    src = in_off[permute.long()[seg]] + (torch.arange(total, device=values.device) - out_off[seg])
    return values[src], (weights[src] if weights is not None else None)


def _permute_2d(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    lengths2 = lengths.reshape(lengths.shape[0], -1) if lengths.dim() > 1 else lengths.reshape(-1, 1)
    out_lengths = lengths2[permute.long()]
    v, w = _permute_segments(permute, lengths2.sum(1), values, weights, permuted_lengths_sum)
    return out_lengths.reshape(permute.shape[0], *lengths.shape[1:]), v, w


def _permute_1d(permute, lengths, values, weights=None, permuted_lengths_sum=None):
    v, w = _permute_segments(permute, lengths, values, weights, permuted_lengths_sum)
    return lengths[permute.long()], v, w


def _invert_permute(permute):
    out = torch.empty_like(permute)
    return out.scatter_(0, permute.long(), torch.arange(permute.numel(), device=permute.device, dtype=permute.dtype))


def _block_bucketize(lengths, indices, bucketize_pos, sequence, block_sizes, my_size, weights=None,
                     batch_size_per_feature=None, max_B=-1, block_bucketize_pos=None, keep_orig_idx=False,
                     total_num_blocks=None, keep_orig_idx_per_feature=None):
    """Row-wise sharding's split of each feature's ids into `my_size` buckets of `block_sizes`
    rows: bucket p holds ids in [p*bs, (p+1)*bs) renumbered from 0 (ids past the last block go
    to bucket id % my_size, as id // my_size). Output is bucket-major, then feature and sample,
    ids of a sample in their order."""
    if batch_size_per_feature is not None or block_bucketize_pos is not None or total_num_blocks is not None \
            or keep_orig_idx_per_feature is not None:
        return _fallback("fbgemm::block_bucketize_sparse_features", "variable batch sizes or block boundaries",
                         lengths, indices, bucketize_pos, sequence, block_sizes, my_size, weights,
                         batch_size_per_feature, max_B, block_bucketize_pos, keep_orig_idx, total_num_blocks,
                         keep_orig_idx_per_feature)
    dev = indices.device
    n, segs, feats = indices.numel(), lengths.numel(), block_sizes.numel()
    batch = segs // max(feats, 1)
    off = complete_cumsum(lengths.long())
    seg = segment_of(off, n)
    ids = indices.long()
    bs = block_sizes.long()[torch.div(seg, batch, rounding_mode="floor")]
    in_blocks = ids < bs * my_size
    bucket = torch.where(in_blocks, torch.div(ids, bs, rounding_mode="floor"), ids % my_size)
    new_ids = ids if keep_orig_idx else torch.where(in_blocks, ids % bs, torch.div(ids, my_size, rounding_mode="floor"))
    key = bucket * segs + seg
    order = torch.sort(key, stable=True).indices
    new_lengths = torch.zeros(my_size * segs, dtype=lengths.dtype, device=dev)
    new_lengths.index_add_(0, key, torch.ones(n, dtype=lengths.dtype, device=dev))
    pos = (torch.arange(n, device=dev) - off[seg])[order].to(indices.dtype) if bucketize_pos else None
    unbucketize = _invert_permute(order).to(indices.dtype) if sequence else None
    w = weights[order] if weights is not None else None
    return new_lengths, new_ids[order].to(indices.dtype), w, pos, unbucketize


def _permute_columns(pooled, offset_dim_list, permute_list):
    """Column blocks of `pooled` ([B, sum(dims)]) in `permute_list`'s order."""
    dims = (offset_dim_list[1:] - offset_dim_list[:-1]).long()
    perm = permute_list.long()
    out_off = complete_cumsum(dims[perm])
    cols = torch.arange(pooled.shape[1], device=pooled.device)
    block = segment_of(out_off, pooled.shape[1])
    return pooled[:, offset_dim_list.long()[perm[block]] + cols - out_off[block]]


def _permute_pooled_embs(pooled, offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list):
    return _permute_columns(pooled, offset_dim_list, permute_list)


def _jagged_2d_to_dense(values, offsets, max_sequence_length):
    """[B, max_len, D] from jagged rows (values [N, D], offsets [B+1]); zeros past each length."""
    return _jagged_to_padded_dense(values, [offsets], [max_sequence_length], 0.0)


# FBGEMM's jagged <-> padded conversions are PyTorch's own nested-tensor ones (lowered in
# csrc/ops/segments.cpp) where there is one jagged dim.
def _jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    if len(offsets) != 1:
        return _fallback("fbgemm::jagged_to_padded_dense_forward", "more than one jagged dim", values, offsets,
                         max_lengths, padding_value)
    return torch.ops.aten._jagged_to_padded_dense_forward(values, offsets, max_lengths, padding_value)


def _dense_to_jagged_forward(dense, offsets, total_L=None):
    if len(offsets) != 1:
        return _fallback("fbgemm::dense_to_jagged_forward", "more than one jagged dim", dense, offsets, total_L)
    total = int(offsets[0][-1]) if total_L is None else int(total_L)  # the size: one host read
    return torch.ops.aten._padded_dense_to_jagged_forward(dense, offsets, total)


def _jagged_to_padded_dense_backward(grad_output, offsets, total_L):
    return _dense_to_jagged_forward(grad_output, offsets, total_L)


# PyTorch's nested-tensor ops have no derivative: these are registered below autograd, where
# FBGEMM's own autograd formulas (which call them and the backward above) stay in force.
JAGGED_OPS = {
    "jagged_2d_to_dense": _jagged_2d_to_dense,
    "jagged_to_padded_dense_forward": _jagged_to_padded_dense,
    "jagged_to_padded_dense_backward": _jagged_to_padded_dense_backward,
    "dense_to_jagged_forward": _dense_to_jagged_forward,
}


def _segment_sum_csr(batch_size, csr_seg, values):
    seg = segment_of(csr_seg.long() * batch_size, values.numel())
    out = torch.zeros(csr_seg.numel() - 1, dtype=values.dtype, device=values.device)
    return out.index_add_(0, seg, values)


def _offsets_range(offsets, range_size):
    """For each position in [0, range_size), its distance from the start of its segment."""
    pos = torch.arange(range_size, device=offsets.device)
    seg = torch.searchsorted(offsets.long().contiguous(), pos, right=True) - 1
    return (pos - offsets.long()[seg]).to(offsets.dtype)


def _lengths_range(t_in, shape=None):
    total = int(t_in.sum())
    off = complete_cumsum(t_in.long())
    seg = segment_of(off, total)
    out = (torch.arange(total, device=t_in.device) - off[seg]).to(t_in.dtype)
    return out.reshape(shape) if shape else out


def _get_infos_metadata(unused, B, T):
    # Bit widths for FBGEMM's packed (batch, feature) ids: a function of B and T only; the tensor
    # argument is not read, so the CPU kernel runs on an empty CPU tensor.
    return torch.ops.fbgemm.get_infos_metadata(torch.empty(0), B, T)


def _bounds_check_indices(rows_per_table, indices, offsets, bounds_check_mode, warning, weights=None,
                          B_offsets=None, max_B=-1, b_t_map=None, info_B_num_bits=-1, info_B_mask=-1,
                          bounds_check_version=1, prefetch_pipeline=False):
    """FBGEMM's check of ids against their table's rows before a TBE lookup: FATAL raises, WARNING
    and IGNORE replace a bad id by 0 (WARNING counts them in `warning`), NONE does nothing."""
    mode = {4: 2, 5: 1, 6: 0}.get(bounds_check_mode, bounds_check_mode)  # V2_IGNORE, V2_WARNING, V2_FATAL
    if mode == 3 or indices.numel() == 0:
        return
    if B_offsets is not None:
        return _fallback("fbgemm::bounds_check_indices", "variable batch sizes per feature", rows_per_table, indices,
                         offsets, bounds_check_mode, warning, weights, B_offsets, max_B, b_t_map, info_B_num_bits,
                         info_B_mask, bounds_check_version, prefetch_pipeline)
    tables = rows_per_table.numel()
    batch = (offsets.numel() - 1) // tables
    n, size = indices.numel(), bucket(indices.numel())  # computed on the padded ids (see bucket)
    feature = torch.div(segment_of(offsets.long(), size).clamp(max=offsets.numel() - 2), batch, rounding_mode="floor")
    ids = pad_to(indices, size).long()
    real = torch.arange(size, device=ids.device) < offsets[-1]
    bad = ((ids < 0) | (ids >= rows_per_table.long()[feature])) & real
    if mode == 0:
        if bool(bad.any()):
            raise RuntimeError("fbgemm bounds_check_indices: an index is outside its table's rows (BoundsCheckMode.FATAL)")
        return
    if mode == 1:
        warning.add_(bad.sum().to(warning.dtype))
    indices.copy_(torch.where(bad, torch.zeros_like(ids), ids)[:n].to(indices.dtype))


SPARSE_OPS = {
    "bounds_check_indices": _bounds_check_indices,
    "get_infos_metadata": _get_infos_metadata,
    "asynchronous_complete_cumsum": complete_cumsum,
    "asynchronous_exclusive_cumsum": _exclusive_cumsum,
    "asynchronous_inclusive_cumsum": _inclusive_cumsum,
    "permute_2D_sparse_data": _permute_2d,
    "permute_1D_sparse_data": _permute_1d,
    "invert_permute": _invert_permute,
    "block_bucketize_sparse_features": _block_bucketize,
    "permute_pooled_embs": _permute_pooled_embs,
    "permute_pooled_embs_auto_grad": _permute_pooled_embs,
    "permute_pooled_embs_auto_grad_split": _permute_pooled_embs,
    "segment_sum_csr": _segment_sum_csr,
    "offsets_range": _offsets_range,
    "lengths_range": _lengths_range,
}


# --- TorchRec's own lookups (torchrec::embedding_*, its unfused_tpu kernel) -------------------


def _rec_lookup(indices, weights, emb_dim):
    return weights[indices.long()]


def _rec_lookup_backward(grad_out, indices, num_rows, emb_dim):
    return grad_out.new_zeros((num_rows, emb_dim)).index_add_(0, indices.long(), grad_out)


def _rec_pooled_lookup(idx, table, pool):
    b = idx.numel() // pool
    return torch.nn.functional.embedding_bag(idx.reshape(b, pool), table, mode="sum")


def _rec_pooled_lookup_backward(grad_out, idx, pool, num_rows, emb_dim):
    return grad_out.new_zeros((num_rows, emb_dim)).index_add_(0, idx.long(),
                                                             grad_out.repeat_interleave(pool, dim=0))


def _rec_pooled_offset(indices, offsets, weights, emb_dim):
    # TorchRec's offsets are complete ([B+1]); indices past the last offset are padding.
    return torch.nn.functional.embedding_bag(indices, weights, offsets, mode="sum", include_last_offset=True)


def _rec_pooled_offset_backward(grad_out, indices, offsets, num_rows, emb_dim):
    bag = segment_of(offsets.long(), indices.numel())
    valid = bag < offsets.numel() - 1
    rows = grad_out[bag.clamp(max=grad_out.shape[0] - 1)] * valid[:, None]
    return grad_out.new_zeros((num_rows, emb_dim)).index_add_(0, indices.long(), rows)


def _rec_pooled_batched_offset(indices, offsets, weights, row_offsets, emb_dim):
    bag = segment_of(offsets.long(), indices.numel()).clamp(max=offsets.numel() - 2)
    return _rec_pooled_offset(indices.long() + row_offsets.long()[bag], offsets, weights, emb_dim)


def _rec_pooled_batched_offset_backward(grad_out, indices, offsets, row_offsets, num_rows, emb_dim):
    bag = segment_of(offsets.long(), indices.numel()).clamp(max=offsets.numel() - 2)
    return _rec_pooled_offset_backward(grad_out, indices.long() + row_offsets.long()[bag], offsets, num_rows,
                                       emb_dim)


def _rec_permute_pooled_embs_backward(grad_out, offset_dim_list, permute_list):
    dims = (offset_dim_list[1:] - offset_dim_list[:-1]).long()
    inv = _invert_permute(permute_list.long())
    return _permute_columns(grad_out, complete_cumsum(dims[permute_list.long()]), inv)


TORCHREC_OPS = {
    "embedding_lookup": _rec_lookup,
    "embedding_lookup_backward": _rec_lookup_backward,
    "embedding_pooled_lookup": _rec_pooled_lookup,
    "embedding_pooled_lookup_backward": _rec_pooled_lookup_backward,
    "embedding_pooled_lookup_offset": _rec_pooled_offset,
    "embedding_pooled_lookup_offset_backward": _rec_pooled_offset_backward,
    "embedding_pooled_batched_lookup_offset": _rec_pooled_batched_offset,
    "embedding_pooled_batched_lookup_offset_backward": _rec_pooled_batched_offset_backward,
    "permute_pooled_embs": _permute_columns,
    "permute_pooled_embs_backward": _rec_permute_pooled_embs_backward,
}


# --- the table-batched embedding (TBE) with its optimizer fused into the backward ------------
#
# FBGEMM's TBE keeps every table of a group in one flat buffer (`host_weights` off CUDA): feature
# f's table starts at element weights_offsets[f], has rows hash_size_cumsum[f+1] -
# hash_size_cumsum[f] of D_offsets[f+1] - D_offsets[f] columns. The lookup pools each of the
# T * B bags (offsets, feature-major) into its feature's columns of a [B, total_D] output. The
# backward does not return a gradient: it updates the tables (and the optimizer's state) in place.

_SPARSE_DTYPES = {0: torch.float32, 1: torch.float16, 5: torch.bfloat16}
_POOL_SUM, _POOL_MEAN, _POOL_NONE = 0, 1, 2


class _TbeLayout:
    """The host-side facts of one TBE's buffers, read from the device once and kept on its
    D_offsets tensor: per feature its columns, its table's first element, first row (in one
    numbering of all tables' rows) and first optimizer-state element."""

    def __init__(self, D_offsets, weights_offsets, hash_size_cumsum, state_offsets):
        d_off = D_offsets.cpu().tolist()
        self.T = len(d_off) - 1
        dims = [d_off[f + 1] - d_off[f] for f in range(self.T)]
        self.max_D, self.total_D = max(dims), d_off[-1]
        dev = D_offsets.device
        self.f_dim = torch.tensor(dims, dtype=torch.long, device=dev)
        self.f_woff = weights_offsets.long()
        # hash_size_cumsum numbers the rows of all tables in one range (features of one table
        # repeat its first row): a row's number, to find an id's repeats.
        self.f_rowbase = hash_size_cumsum[:-1].long()
        self.f_state = state_offsets.long() if state_offsets is not None else None
        # Output column c comes from feature f(c)'s pooled column j(c).
        out_f = torch.repeat_interleave(torch.arange(self.T), torch.tensor(dims))
        out_j = torch.arange(self.total_D) - torch.tensor(d_off[:-1])[out_f]
        self.out_cols = (out_f * self.max_D + out_j).to(dev)

    @classmethod
    def of(cls, D_offsets, weights_offsets, hash_size_cumsum, state_offsets=None):
        layout = getattr(D_offsets, "_torch_tpu_tbe_layout", None)
        if layout is None:
            layout = cls(D_offsets, weights_offsets, hash_size_cumsum, state_offsets)
            D_offsets._torch_tpu_tbe_layout = layout
        return layout


class _Ids:
    """Where each of the n ids of a lookup lands: its bag, its row (one numbering over all
    tables), its elements in the flat weights ([n, max_D]; the columns past its table's width
    repeat the last real one, so that writes back stay identical) and which columns are real."""

    def __init__(self, layout, indices, offsets):
        n = indices.numel()  # padded (see bucket): the ids past the last offset are not real
        self.bag = segment_of(offsets.long(), n).clamp(max=offsets.numel() - 2)
        feature = torch.div(self.bag, (offsets.numel() - 1) // layout.T, rounding_mode="floor")
        ids = indices.long()
        self.row = layout.f_rowbase[feature] + ids
        self.width = layout.f_dim[feature]  # the columns of each id's table
        dim = self.width[:, None]
        cols = torch.arange(layout.max_D, device=ids.device)[None, :]
        self.valid = (cols < dim) & (torch.arange(n, device=ids.device) < offsets[-1])[:, None]
        self.cols = torch.minimum(cols, dim - 1)
        self.elems = (layout.f_woff[feature] + ids * layout.f_dim[feature])[:, None] + self.cols
        self.state = layout.f_state[feature] + ids if layout.f_state is not None else None


def _tbe_forward(layout, ids, host_weights, offsets, pooling_mode, indice_weights, out_dtype):
    vals = host_weights[ids.elems] * ids.valid
    if pooling_mode == _POOL_NONE:
        return vals.to(out_dtype)
    if indice_weights is not None:
        vals = vals * indice_weights[:, None].to(vals.dtype)
    bags = offsets.numel() - 1
    pooled = torch.zeros(bags, layout.max_D, dtype=vals.dtype, device=vals.device).index_add_(0, ids.bag, vals)
    if pooling_mode == _POOL_MEAN:
        pooled = pooled / (offsets[1:] - offsets[:-1]).clamp(min=1)[:, None].to(pooled.dtype)
    batch = bags // layout.T
    out = pooled.reshape(layout.T, batch, layout.max_D).permute(1, 0, 2).reshape(batch, -1)
    return out[:, layout.out_cols].to(out_dtype)


def _tbe_id_grads(layout, ids, grad, offsets, pooling_mode, indice_weights):
    """Each id's share of the gradient ([n, max_D], float32; zero past its table's width)."""
    grad = grad.float()
    if pooling_mode == _POOL_NONE:
        per = torch.nn.functional.pad(grad, (0, layout.max_D - grad.shape[1]))
    else:
        bags = offsets.numel() - 1
        batch = bags // layout.T
        by_bag = torch.zeros(batch, layout.T * layout.max_D, dtype=grad.dtype, device=grad.device)
        by_bag[:, layout.out_cols] = grad
        by_bag = by_bag.reshape(batch, layout.T, layout.max_D).permute(1, 0, 2).reshape(bags, layout.max_D)
        if pooling_mode == _POOL_MEAN:
            by_bag = by_bag / (offsets[1:] - offsets[:-1]).clamp(min=1)[:, None].to(grad.dtype)
        per = by_bag[ids.bag]
        if indice_weights is not None:
            per = per * indice_weights[:, None].float()
    return per * ids.valid


def _apply_optimizer(name, args, layout, ids, per):
    """The fused update. Work is per id, not per table row: a row's gradient is summed over its
    ids, every id of a row computes the same new row, and the writes back carry identical values."""
    w = args["weights"][0]
    lr = args["learning_rate_tensor"].float()
    opt_f = list(args.get("optim_float") or [])
    if name == "sgd":  # summed over repeats by the scatter-add itself
        w.index_add_(0, ids.elems.flatten(), (-lr * per).flatten().to(w.dtype))
        return
    # Ids of one row share a segment (numbered in sorted order): no buffer the size of the tables.
    rows_sorted, order = torch.sort(ids.row, stable=True)
    starts = torch.ones_like(rows_sorted)
    starts[1:] = rows_sorted[1:] != rows_sorted[:-1]
    segment = torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)
    g = torch.zeros_like(per).index_add_(0, segment, per)[segment]
    # The columns past a table's width address its last real element: they get its value too.
    g_wide = g.gather(1, ids.cols)
    rows = w[ids.elems].float()
    if name == "adagrad":
        m_flat = args["momentum1"][0]
        m = m_flat[ids.elems].float() + g_wide * g_wide
        new = rows - lr * g_wide / (m.sqrt() + opt_f[0])
        m_flat.index_put_((ids.elems.flatten(),), m.flatten().to(m_flat.dtype))
    elif name == "rowwise_adagrad":
        eps, weight_decay = opt_f[0], opt_f[1]
        if weight_decay != 0:
            # FBGEMM's CPU and CUDA kernels disagree on it (a row's decay with repeated ids).
            raise NotImplementedError("torch_tpu: row-wise Adagrad with weight decay has no tpu kernel")
        m_flat = args["momentum1"][0]
        m = m_flat[ids.state].float() + (g * g).sum(1) / ids.width
        new = rows - (lr / (m.sqrt() + eps))[:, None] * g_wide
        m_flat.index_put_((ids.state,), m.to(m_flat.dtype))
    else:
        raise NotImplementedError(f"torch_tpu: the TBE optimizer {name!r} has no tpu kernel (sgd, adagrad and "
                                  "rowwise_adagrad do)")
    w.index_put_((ids.elems.flatten(),), new.flatten().to(w.dtype))


class _TbeLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, name, args):
        layout = _tbe_layout(name, args)
        n = args["indices"].numel()
        size = bucket(n)
        ids = _Ids(layout, pad_to(args["indices"], size), args["offsets"])
        weights = pad_to(args["indice_weights"], size)
        ctx.name, ctx.args, ctx.layout, ctx.ids, ctx.weights, ctx.size = name, args, layout, ids, weights, size
        out_dtype = _SPARSE_DTYPES.get(args["output_dtype"], args["weights"][0].dtype)
        out = _tbe_forward(layout, ids, args["weights"][0], args["offsets"], args["pooling_mode"], weights, out_dtype)
        return out[:n] if args["pooling_mode"] == _POOL_NONE else out

    @staticmethod
    def backward(ctx, grad):
        a = ctx.args
        with torch.no_grad():
            if a["pooling_mode"] == _POOL_NONE:
                grad = pad_to(grad, ctx.size)
            per = _tbe_id_grads(ctx.layout, ctx.ids, grad, a["offsets"], a["pooling_mode"], ctx.weights)
            _apply_optimizer(ctx.name, a, ctx.layout, ctx.ids, per)
        return None, None, None


def _tbe_layout(name, args):
    aux_tensor = args["aux_tensor"]
    if aux_tensor[0] is not None:  # B_offsets: variable batch sizes per feature
        raise NotImplementedError("torch_tpu: TBE lookups with variable batch sizes per feature (VBE) have no tpu "
                                  "kernel")
    aux_bool = args["aux_bool"]
    if len(aux_bool) > 4 and aux_bool[4]:
        raise NotImplementedError("torch_tpu: TBE gradient clipping has no tpu kernel")
    w = args["weights"]
    if len(w) != 3:
        raise NotImplementedError("torch_tpu: the TBE's weights are not in host memory layout")
    state = args["momentum1"][2] if name == "rowwise_adagrad" else None
    return _TbeLayout.of(args["D_offsets"], w[2], args["hash_size_cumsum"], state)


def _tbe_kernel(name, op):
    arg_names = [a.name for a in op._schema.arguments]

    def kernel(*args, **kwargs):
        bound = dict(zip(arg_names, args))
        bound.update(kwargs)
        return _TbeLookup.apply(bound["placeholder_autograd_tensor"], name, bound)

    return kernel


TBE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def register() -> None:
    """Registers the tpu kernels (once FBGEMM's operators are defined)."""
    _register("fbgemm", {n: f for n, f in SPARSE_OPS.items() if _defined("fbgemm", n)})
    _register("fbgemm", {n: f for n, f in JAGGED_OPS.items() if _defined("fbgemm", n)}, keys=("PrivateUse1",))
    tbe = {}
    for name in TBE_OPTIMIZERS:
        op_name = f"split_embedding_codegen_lookup_{name}_function_pt2"
        if _defined("fbgemm", op_name):
            tbe[op_name] = _tbe_kernel(name, getattr(torch.ops.fbgemm, op_name).default)
    _register("fbgemm", tbe, keys=("AutogradPrivateUse1",))


def register_torchrec_ops(_module=None) -> None:
    """Registers torchrec::embedding_* (defined by torchrec.experimental.torch_tpu.pallas.ops)."""
    _register("torchrec", {n: f for n, f in TORCHREC_OPS.items() if _defined("torchrec", n)}, keys=("PrivateUse1",))


def _defined(namespace: str, name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
        return True
    except RuntimeError:
        return False


def install() -> None:
    from . import _import_hooks

    _import_hooks.when_imported("fbgemm_gpu", lambda _module: register())
    _import_hooks.when_imported("torchrec.experimental.torch_tpu.pallas.ops", register_torchrec_ops)
