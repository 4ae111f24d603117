"""torch versions of the Triton kernels vLLM's model runner calls (vLLM
registers replacements for a platform without Triton): plain ops, so they
run on tpu like any other."""
import torch


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
    offset), PAD_ID past num_tokens."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("torch_tpu's vLLM platform: context parallelism")
    dev = slot_mapping.device
    num_reqs = query_start_loc.shape[0] - 1
    t = torch.arange(num_tokens, device=dev, dtype=torch.int64)
    ends = query_start_loc[1:].to(torch.int64)
    req = (t[:, None] >= ends[None, :]).sum(-1).clamp_(max=max(num_reqs - 1, 0))
    pos = positions[:num_tokens].to(torch.int64)
    bs = KV_CACHE_BLOCK_SIZE
    blk = block_table[req, pos // bs].to(torch.int64)
    slot_mapping[:num_tokens] = blk * bs + pos % bs
    if max_num_tokens > num_tokens:
        slot_mapping[num_tokens:max_num_tokens] = PAD_ID
