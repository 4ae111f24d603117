"""The tpu platform's step budget (torch_tpu/vllm/scheduler.py) and the work
accounting the serving benchmark reports (attention.PaddingStats)."""
import numpy as np

from torch_tpu.vllm.attention import PaddingStats, key_tile
from torch_tpu.vllm.scheduler import step_budget


def test_decoding_caps_a_step_at_twice_its_bucket():
    # 15 decodes and a 128-token prompt: 31 tokens this step (16 of the prompt:
    # two whole 8-row query tiles of the 32-token step), not 143 run as 256.
    assert step_budget(2048, 15, 128) == 31
    assert step_budget(2048, 3, 128) == 32  # never under 32
    assert step_budget(2048, 40, 1000) == 128  # 88 prompt tokens: the 24 past two 32-row tiles stay
    assert step_budget(2048, 10, 100) == 32  # 22: the 6 past two 8-row tiles stay (6 rows of padding else)
    assert step_budget(2048, 60, 1000) == 124  # 68 prompt tokens: the 4 past two 32-row tiles wait


def test_a_burst_of_prompts_keeps_the_whole_budget_rounded_down():
    assert step_budget(2048, 0, 16 * 128) == 2048
    assert step_budget(2048, 0, 1500) == 1024  # the rest next step
    assert step_budget(2048, 0, 100) == 64
    assert step_budget(100, 0, 5000) == 64


def test_nothing_waiting_or_no_room_to_round_down():
    assert step_budget(2048, 16, 0) == 2048
    assert step_budget(2048, 16, 1) == 17  # 16 is no room for the prompt token: padded instead
    assert step_budget(16, 15, 40) == 16


def test_key_tile_follows_the_context():
    assert key_tile(16, 32) == 32  # max_model_len 512: a sixteenth is 32 keys
    assert key_tile(16, 128) == 128  # 2048
    assert key_tile(16, 1024) == 256  # at most 256
    assert key_tile(16, 1) == 16  # a table narrower than the smallest tile
    assert key_tile(128, 4) == 128  # one block when blocks are large


def test_padding_stats_counts_what_paged_attention_reads():
    st = PaddingStats()
    # Two decodes (sequences of 10 and 70 keys) in a 4-row bucket, tile 64
    # (a 1024-token context): 3 (request, tile) items, read 4 per step; 16 token
    # rows run for 2 tokens.
    st.add(np.array([1, 1]), np.array([10, 70]), tokens=16, rows=4, block_size=16, max_blocks=64)
    d = st.as_dict()
    assert d["attention_pairs"] == 80 and d["computed_attention_pairs"] == 4 * 64
    assert d["tokens"] == 2 and d["computed_tokens"] == 16
    # A 100-token prompt after 28 cached tokens: query tiles of 32 (a quarter
    # of the step's 128 tokens) up to keys 60, 92, 124 and 128, 64-key tiles.
    st = PaddingStats()
    st.add(np.array([100]), np.array([128]), tokens=128, rows=1, block_size=16, max_blocks=64)
    d = st.as_dict()
    assert d["attention_pairs"] == 32 * 60 + 32 * 92 + 32 * 124 + 4 * 128
    assert d["computed_attention_pairs"] == 32 * (64 + 128 + 128 + 128)
