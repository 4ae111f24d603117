"""``torch.tpu.ops``: the sparse embedding ops TorchRec's SparseCore modules call
(``torchrec/experimental/torch_tpu/modules/custom_ops.py`` and ``fused_embedding_modules.py``),
with their meaning written in PyTorch terms and computed by lowered ATen ops on any device.

The sparse input is a list of (embedding id, sample id, gain) entries, COO style, in buffers that
a SparseCore splits into partitions (``row_pointers`` marks where each partition's entries end).
An entry whose ids are out of range (the partitions' padding) or past the last row pointer adds
nothing. In PyTorch terms, with ``S`` the [batch_size, rows] sparse matrix holding each entry's
gain at (sample id, embedding id), summed over repeats::

    sparse_dense_matmul(...)            = S @ table
    sparse_dense_matmul_grad_with_sgd   : table - lr * (S.T @ grad)
    ..._grad_with_adagrad               : acc + g*g;  table - lr * g / (sqrt(acc) + eps)
    ..._grad_with_adam                  : m, v moving averages; table - lr * m / (sqrt(v) + eps)

with ``g = S.T @ grad``. The optimizers update only the rows some entry refers to (a row no
entry names keeps its weights and state, as a SparseCore's row-wise update does); Adam takes no
step count, so it applies no bias correction (fold it into ``lr``). ``max_ids_per_partition``,
``max_unique_ids_per_partition``, ``computation_name`` size and name a SparseCore's buffers and
programs; here they are accepted and not needed.
"""

from __future__ import annotations

import torch

__all__ = [
    "sparse_dense_matmul",
    "sparse_dense_matmul_grad_with_sgd",
    "sparse_dense_matmul_grad_with_adagrad",
    "sparse_dense_matmul_grad_with_adam",
]


def _entries(row_pointers, embedding_ids, sample_ids, gains, rows, batch_size):
    """Entry ids made safe to index with, and each entry's gain (0 for padding)."""
    if not (embedding_ids.shape == sample_ids.shape == gains.shape) or embedding_ids.dim() != 1:
        raise ValueError("torch.tpu.ops: embedding_ids, sample_ids and gains must be 1-d and of one length; got "
                         f"{tuple(embedding_ids.shape)}, {tuple(sample_ids.shape)}, {tuple(gains.shape)}")
    if row_pointers.dim() != 1 or row_pointers.numel() == 0:
        raise ValueError("torch.tpu.ops: row_pointers must be a non-empty 1-d tensor")
    emb, smp = embedding_ids.long(), sample_ids.long()
    pos = torch.arange(emb.numel(), device=emb.device)
    valid = (emb >= 0) & (emb < rows) & (smp >= 0) & (smp < batch_size) & (pos < row_pointers[-1].long())
    zero = torch.zeros_like(emb)
    return torch.where(valid, emb, zero), torch.where(valid, smp, zero), torch.where(
        valid, gains, torch.zeros_like(gains))


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, embedding_table, batch_size,
                        max_ids_per_partition=256, max_unique_ids_per_partition=256):
    """``S @ embedding_table``: each sample's gain-weighted sum of its rows ([batch_size, D])."""
    emb, smp, w = _entries(row_pointers, embedding_ids, sample_ids, gains, embedding_table.shape[0], batch_size)
    rows = embedding_table[emb] * w[:, None].to(embedding_table.dtype)
    out = torch.zeros(batch_size, embedding_table.shape[1], dtype=embedding_table.dtype,
                      device=embedding_table.device)
    return out.index_add_(0, smp, rows)


def _row_grads(row_pointers, embedding_ids, sample_ids, gains, table, grad, batch_size):
    """``S.T @ grad`` in float32 ([rows, D]) and which rows an entry names."""
    if grad.dim() != 2 or grad.shape[1] != table.shape[1]:
        raise ValueError(f"torch.tpu.ops: activations_grad must be [batch, {table.shape[1]}]; got {tuple(grad.shape)}")
    batch = batch_size if batch_size is not None else grad.shape[0]
    emb, smp, w = _entries(row_pointers, embedding_ids, sample_ids, gains, table.shape[0], batch)
    per = grad.float()[smp] * w.float()[:, None]
    g = torch.zeros(table.shape, dtype=torch.float32, device=table.device).index_add_(0, emb, per)
    named = torch.zeros(table.shape[0], dtype=torch.float32, device=table.device)
    named.index_add_(0, emb, (w != 0).float())
    return g, (named > 0)[:, None]


def sparse_dense_matmul_grad_with_sgd(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                      activations_grad, learning_rate, *, device_batch_size=None,
                                      max_ids_per_partition=256, max_unique_ids_per_partition=256,
                                      computation_name=None):
    """The table after one SGD step on ``S.T @ activations_grad``."""
    g, touched = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                            device_batch_size)
    new = embedding_table.float() - torch.as_tensor(learning_rate, device=g.device).float() * g
    return torch.where(touched, new, embedding_table.float()).to(embedding_table.dtype)


def sparse_dense_matmul_grad_with_adagrad(row_pointers, embedding_ids, sample_ids, gains, embedding_table,
                                          accumulator, activations_grad, learning_rate, epsilon, *,
                                          device_batch_size=None, max_ids_per_partition=256,
                                          max_unique_ids_per_partition=256, computation_name=None):
    """(table, accumulator) after one Adagrad step on the rows the entries name."""
    g, touched = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                            device_batch_size)
    acc = accumulator.float() + g * g
    lr = torch.as_tensor(learning_rate, device=g.device).float()
    new = embedding_table.float() - lr * g / (acc.sqrt() + epsilon)
    return (torch.where(touched, new, embedding_table.float()).to(embedding_table.dtype),
            torch.where(touched, acc, accumulator.float()).to(accumulator.dtype))


def sparse_dense_matmul_grad_with_adam(row_pointers, embedding_ids, sample_ids, gains, embedding_table, momentum,
                                       velocity, activations_grad, learning_rate, beta1, beta2, epsilon, *,
                                       device_batch_size=None, max_ids_per_partition=256,
                                       max_unique_ids_per_partition=256, computation_name=None):
    """(table, momentum, velocity) after one Adam step (no bias correction) on the named rows."""
    g, touched = _row_grads(row_pointers, embedding_ids, sample_ids, gains, embedding_table, activations_grad,
                            device_batch_size)
    m = beta1 * momentum.float() + (1 - beta1) * g
    v = beta2 * velocity.float() + (1 - beta2) * g * g
    lr = torch.as_tensor(learning_rate, device=g.device).float()
    new = embedding_table.float() - lr * m / (v.sqrt() + epsilon)
    return (torch.where(touched, new, embedding_table.float()).to(embedding_table.dtype),
            torch.where(touched, m, momentum.float()).to(momentum.dtype),
            torch.where(touched, v, velocity.float()).to(velocity.dtype))
