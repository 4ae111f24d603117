"""SGLang's attention on tpu: paged attention as one native op.

The KV pool (`TpuMHATokenToKVPool`) keeps one tensor per layer in the layout
of `torch.ops.tpu.paged_attention` (csrc/ops/paged_attention.cpp) with blocks
of one token: [slots, kv_heads, 1, 2 * head_dim], keys in [..., :head_dim],
values after them. SGLang's token slots are then the op's block ids, and a
request's row of SGLang's req_to_token table is its block table: the radix
(prefix) cache shares slots between requests with no copy. Slot 0 is SGLang's
padding slot (padded tokens write there; no request reads it).

The backend writes a step's keys and values with one index_put_ per layer
(in place: strict eager donates the cache's buffer) and runs the op over the
step's requests, prefill (extend, with or without a cached prefix) and decode
alike. The op is ragged: its program depends on the token count, the request
count and the block table's width only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc
from sglang.srt.model_executor.forward_batch_info import ForwardMode


class TpuMHATokenToKVPool(MHATokenToKVPool):
    """MHATokenToKVPool with one [slots, heads, 1, 2 * head_dim] tensor per
    layer (`kv_buffer`); k_buffer and v_buffer are views of its halves, for
    SGLang's readers (no writes go through them)."""

    def _create_buffers_normal(self):
        if self.head_dim != self.v_head_dim:
            raise NotImplementedError("torch_tpu's SGLang platform: key and value head sizes differ")
        rows = self.size + self.page_size
        D = self.head_dim
        self.kv_buffer = [
            torch.zeros((rows, self.head_num, 1, 2 * D), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        self.k_buffer = [kv[:, :, 0, :D] for kv in self.kv_buffer]
        self.v_buffer = [kv[:, :, 0, D:] for kv in self.kv_buffer]

    def _create_buffers(self):
        if self.is_quantized_kv_cache or self.post_capture_active or self.use_hnd:
            raise NotImplementedError("torch_tpu's SGLang platform: quantized, HND or post-capture KV caches")
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self._create_buffers_normal()
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        # (SGLang's slot-move pointer tables are for its CUDA kernels: none here.)

    def get_kv_size_bytes(self):
        per_layer = self.kv_buffer[0].numel() * self.kv_buffer[0].element_size()
        return per_layer * self.layer_num // 2, per_layer * self.layer_num // 2

    def layer_cache(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id - self.start_layer]

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        if dcp_kv_mask is not None:
            raise NotImplementedError("torch_tpu's SGLang platform: decode context parallelism")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k = cache_k / k_scale
            if v_scale is not None:
                cache_v = cache_v / v_scale
        write_kv(self.layer_cache(layer_id), loc, cache_k, cache_v)


def write_kv(cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """cache[loc[i], h, 0] = cat(k[i, h], v[i, h]) for the first len(loc)
    tokens, as one index_put_ on the cache's rows."""
    slots, heads, _, two_d = cache.shape
    D = two_d // 2
    n = loc.shape[0]
    rows = cache.view(-1, D)  # row 2 * (slot * heads + h) is a key, the next its value
    h = torch.arange(heads, device=loc.device, dtype=torch.int64)
    key_rows = ((loc.to(torch.int64)[:, None] * heads + h[None, :]) * 2).reshape(-1)
    new = torch.stack([k[:n].reshape(n, heads, D), v[:n].reshape(n, heads, D)], dim=2).reshape(-1, D)
    rows.index_put_((torch.stack([key_rows, key_rows + 1], dim=1).reshape(-1),), new.to(cache.dtype))


class TpuTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """SGLang's token allocator (page size 1), as the out-of-tree allocator
    hook constructs it (with a page_size argument)."""

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort):
        if page_size != 1:
            raise NotImplementedError("torch_tpu's SGLang platform: page size 1 only (--page-size 1)")
        super().__init__(size, dtype, device, kvcache, need_sort)


@dataclass
class TpuAttentionMetadata:
    block_table: torch.Tensor  # [R, max context] int32: each request's slots (req_to_token rows)
    seq_lens: torch.Tensor  # [R] tokens of each request, context + new
    query_start_loc: torch.Tensor  # [R + 1]


class TpuAttnBackend(AttentionBackend):
    """SGLang attention backend "tpu": torch.ops.tpu.paged_attention."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if not isinstance(self.token_to_kv_pool, TpuMHATokenToKVPool):
            raise NotImplementedError(
                f"torch_tpu's SGLang attention needs its own KV pool, got {type(self.token_to_kv_pool).__name__} "
                "(MLA, hybrid and sliding-window pools are not supported)"
            )
        self.forward_metadata: TpuAttentionMetadata | None = None

    # -- metadata -------------------------------------------------------------

    def metadata(self, req_pool_indices, seq_lens, query_lens_cpu) -> TpuAttentionMetadata:
        """The op's metadata for requests with query_lens_cpu new tokens each
        (a host list): the block table is the requests' rows of req_to_token."""
        starts = [0]
        for n in query_lens_cpu:
            starts.append(starts[-1] + int(n))
        return TpuAttentionMetadata(
            block_table=self.req_to_token[req_pool_indices],
            seq_lens=seq_lens,
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(self.device),
        )

    def init_forward_metadata(self, forward_batch):
        fm = forward_batch.forward_mode
        if fm.is_idle():
            self.forward_metadata = None
            return
        if fm.is_decode():
            lens = [1] * forward_batch.batch_size
        elif fm in (ForwardMode.EXTEND, ForwardMode.MIXED):
            lens = forward_batch.extend_seq_lens_cpu
        else:
            raise NotImplementedError(f"torch_tpu's SGLang attention: forward mode {fm}")
        self.forward_metadata = self.metadata(forward_batch.req_pool_indices, forward_batch.seq_lens, lens)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # -- forward --------------------------------------------------------------

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache):
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            raise NotImplementedError("torch_tpu's SGLang attention: decoder self-attention only")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("torch_tpu's SGLang attention: key and value head sizes differ")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        md = self.forward_metadata
        tokens = q.shape[0]
        window = layer.sliding_window_size
        # SGLang's window W lets a query at p see keys p - W .. p; the op's, keys after p - W.
        window = window + 1 if window is not None and window > -1 else -1
        out = torch.ops.tpu.paged_attention(
            q.view(tokens, layer.tp_q_head_num, layer.qk_head_dim),
            self.token_to_kv_pool.layer_cache(layer.layer_id),
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            float(layer.scaling),
            int(window),
            float(layer.logit_cap or 0.0),
        )
        return out.view(tokens, layer.tp_q_head_num * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self):
        return False


def create_tpu_backend(model_runner) -> TpuAttnBackend:
    return TpuAttnBackend(model_runner)
