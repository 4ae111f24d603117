"""vLLM attention backend for tpu: paged attention as one native op.

A layer's KV cache is one tensor [num_blocks, num_kv_heads, block_size,
2 * head_size] (vLLM's LBHNC layout: keys in [..., :head_size], values after
them). New keys and values are written with one scatter per step
(`index_put_` on the cache's rows, in place: strict eager donates the
cache's buffer); attention is `torch.ops.tpu.paged_attention`, whose one
lowering (csrc/ops/paged_attention.cpp) gathers each request's blocks and
runs prefill and decode requests of a mixed batch together.

The op is ragged: its program depends on the step's token bucket, its
request bucket (a power of two, at most max_num_seqs) and the block table's
width only, never on the query or sequence lengths, so a serving run has one
program per (token bucket, request bucket), which the worker compiles before
serving.
"""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

import torch_tpu  # noqa: F401  (registers the device and torch.ops.tpu)
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from torch_tpu.vllm.steps import bucket


def request_bucket(num_reqs: int, max_num_reqs: int) -> int:
    """Rows of a step's request metadata (block table, sequence lengths):
    the power of two at or above num_reqs, at most max_num_reqs."""
    return bucket(num_reqs, max_num_reqs)


class TpuAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls():
        return TpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TpuAttentionMetadataBuilder


@dataclass
class TpuAttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1], R bucketed; non-decreasing past the real requests
    seq_lens: torch.Tensor  # [R], 0 past the real requests
    block_table: torch.Tensor  # [R, max blocks per request]
    slot_mapping: torch.Tensor  # [num_tokens], -1 for padding tokens


def grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of the persistent buffer
    that t, a leading slice of it, starts: vLLM slices its buffers to each
    step's counts, and a bucket needs a few rows more. As many as the
    buffer has. vLLM keeps query_start_loc non-decreasing and seq_lens zero
    past the real requests, so padding rows are requests without tokens."""
    elements = t.untyped_storage().nbytes() // t.element_size()
    rows = min(rows, (elements - t.storage_offset()) // t.stride(0))
    return t.as_strided((rows, *t.shape[1:]), t.stride(), t.storage_offset())


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[TpuAttentionMetadata]):
    reorder_batch_threshold = None

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs

    def build(self, common_prefix_len: int, cm: CommonAttentionMetadata, fast_build: bool = False):
        if cm.causal is not True:
            raise NotImplementedError("torch_tpu's vLLM platform: non-causal attention")
        reqs = request_bucket(cm.num_reqs, self.max_num_reqs)
        return TpuAttentionMetadata(
            query_start_loc=grown(cm.query_start_loc, reqs + 1),
            seq_lens=grown(cm.seq_lens, reqs),
            block_table=grown(cm.block_table_tensor, reqs),
            slot_mapping=cm.slot_mapping,
        )


class TpuAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads=None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
        **kwargs,
    ):
        if alibi_slopes is not None:
            raise NotImplementedError("torch_tpu's vLLM platform: ALiBi attention")
        if sinks is not None:
            raise NotImplementedError("torch_tpu's vLLM platform: attention sinks")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"torch_tpu's vLLM platform: {attn_type} attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = int(sliding_window) if sliding_window else -1
        self.logits_soft_cap = float(logits_soft_cap or 0.0)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Writes this step's keys and values into their slots (padding
        tokens, slot -1, go to block 0, vLLM's null block that no request reads)."""
        _, heads, block_size, _ = kv_cache.shape
        tokens = slot_mapping.shape[0]
        slot = slot_mapping.clamp(min=0)
        block, offset = slot // block_size, slot % block_size
        D = self.head_size
        # Rows of the whole cache seen as [blocks * heads * block_size * 2, D]:
        # row 2i is a key, 2i + 1 its value. One index_put_ for both.
        rows = kv_cache.view(-1, D)
        h = torch.arange(heads, device=slot.device, dtype=torch.int64)
        key_rows = (((block[:, None] * heads + h[None, :]) * block_size + offset[:, None]) * 2).reshape(-1)
        new = torch.stack([key[:tokens], value[:tokens]], dim=2).reshape(-1, D).to(kv_cache.dtype)
        rows.index_put_((torch.stack([key_rows, key_rows + 1], dim=1).reshape(-1),), new)

    def forward(
        self,
        layer: AttentionLayer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata: TpuAttentionMetadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("torch_tpu's vLLM platform: fused output quantization")
        if attn_metadata is None:  # the profiling run, without a KV cache
            return output
        md = attn_metadata
        # All of the step's tokens, padding included (the runner pads their
        # count to a bucket): the padding's rows are computed and discarded.
        tokens = query.shape[0]
        out = torch.ops.tpu.paged_attention(
            query.view(tokens, self.num_heads, self.head_size),
            kv_cache,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
        )
        output[:tokens] = out.view(output[:tokens].shape)
        return output


def key_tile(block_size: int, max_blocks: int) -> int:
    """Keys paged_attention reads per loop step (csrc/ops/paged_attention.cpp
    chooses them so: a sixteenth of the block table's width, 32 to 256 keys)."""
    lo = max(1, -(-32 // block_size))
    hi = max(1, 256 // block_size)
    return min(min(max(-(-max_blocks // 16), lo), hi), max_blocks) * block_size


class PaddingStats:
    """Work of the steps run, real and as computed, in token rows (every
    matmul runs the step's token bucket) and in query-key pairs of attention
    (paged_attention's loops read whole key tiles: decodes as (request, tile)
    items, the request bucket's count of them per step; each prefill tile of
    up to 64 queries up to its last token). Keys masked by causality inside a tile
    count as real work; rows and keys past the requests' ends are padding."""

    QUERY_TILE = 64  # paged_attention's kQueryTile (at most a quarter of the step's tokens)

    def __init__(self):
        self.steps = 0
        self.tokens = self.padded_tokens = 0
        self.pairs = self.padded_pairs = 0
        self.decode_pairs = self.decode_padded_pairs = 0  # the decode loop's share

    def add(self, query_lens: np.ndarray, seq_lens: np.ndarray, tokens: int, rows: int, block_size: int,
            max_blocks: int) -> None:
        self.steps += 1
        self.tokens += int(query_lens.sum())
        self.padded_tokens += tokens
        tile = key_tile(block_size, max_blocks)
        decode = query_lens == 1
        if decode.any():
            # (request, tile) items, `rows` at a time (no sliding window counted).
            items = int((-(-seq_lens[decode] // tile)).sum())
            real, computed = int(seq_lens[decode].sum()), -(-items // rows) * rows * tile
            self.pairs += real
            self.padded_pairs += computed
            self.decode_pairs += real
            self.decode_padded_pairs += computed
        c = min(self.QUERY_TILE, max(1, tokens // 4))
        for q, n in zip(query_lens[~decode], seq_lens[~decode]):
            context = int(n - q)
            for start in range(0, int(q), c):
                end = context + min(int(q), start + c)  # keys up to the tile's last token
                self.pairs += min(c, int(q) - start) * end
                self.padded_pairs += c * -(-end // tile) * tile

    def as_dict(self) -> dict:
        return {"steps": self.steps, "tokens": self.tokens, "computed_tokens": self.padded_tokens,
                "matmul_padding": 1 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0,
                "attention_pairs": self.pairs, "computed_attention_pairs": self.padded_pairs,
                "attention_padding": 1 - self.pairs / self.padded_pairs if self.padded_pairs else 0.0,
                "decode_attention_pairs": self.decode_pairs,
                "computed_decode_attention_pairs": self.decode_padded_pairs}
