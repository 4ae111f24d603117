"""torch versions of the Triton kernels vLLM's model runner calls (vLLM
registers replacements for a platform without Triton): plain ops, so they
run on tpu like any other."""
import torch

from torch_tpu.vllm.attention import bucket, grown


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [>= num_tokens] int64
    block_table: torch.Tensor,  # [max_num_reqs, max_blocks] int32
    block_table_stride: int,
    slot_mapping: torch.Tensor,  # [max_num_tokens] int64
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """slot_mapping[t] = the KV cache slot of token t (block * block_size +
    offset), PAD_ID past num_tokens. Computed over a power-of-two count of
    tokens (its tail is PAD_ID too), so its programs see a few shapes."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("torch_tpu's vLLM platform: context parallelism")
    dev = slot_mapping.device
    n = bucket(num_tokens, max_num_tokens)
    num_reqs = query_start_loc.shape[0] - 1
    qsl = grown(query_start_loc, bucket(num_reqs) + 1)  # padded requests have no tokens
    t = torch.arange(n, device=dev, dtype=torch.int64)
    real = t < num_tokens
    ends = qsl[1:].to(torch.int64)
    req = (t[:, None] >= ends[None, :]).sum(-1).clamp_(max=max(num_reqs - 1, 0))
    # Positions past num_tokens are stale: read block 0's column for them.
    pos = torch.where(real, grown(positions, n).to(torch.int64), 0)
    bs = KV_CACHE_BLOCK_SIZE
    blk = block_table[req, pos // bs].to(torch.int64)
    slot_mapping[:n] = torch.where(real, blk * bs + pos % bs, PAD_ID)
    if max_num_tokens > n:
        slot_mapping[n:max_num_tokens] = PAD_ID
