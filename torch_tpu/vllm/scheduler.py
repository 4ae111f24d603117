"""vLLM's scheduler with a token budget per step chosen for tpu's programs.

A step runs its token bucket (a power of two): 15 decodes and a new 128-token
prompt are 143 tokens run as 256, 44% of the step's matmul rows padding. And
a step that prefills whole prompts beside running decodes stalls every one of
them for its whole length: the serving benchmark's inter-token latency p99
was 5x its median. Each step's budget here is therefore:

- while requests decode, at most twice their bucket (never under 32): a step
  that mixes prefill chunks into decoding costs at most about two decode
  steps (stall-free batching: prompts are prefilled in chunks instead);
- rounded down to a power of two when what is waiting overshoots one (the
  rest of a prompt goes to the next step), so a full step pads nothing;
- beside decodes, prompt tokens in whole query tiles of the attention op
  when at most an eighth of a tile is held back for that.

A server's --max-num-batched-tokens stays the ceiling. Steps without running
decodes (a burst of new prompts) keep the whole budget.
"""
from vllm.v1.core.sched.scheduler import Scheduler

from torch_tpu.vllm.attention import bucket

_MIN_MIXED_STEP = 32


def step_budget(budget: int, decodes: int, waiting_tokens: int) -> int:
    """The tokens to schedule this step: `budget` the server's ceiling,
    `decodes` requests decoding (one token each), `waiting_tokens` the
    prompt tokens not yet computed (of running and waiting requests)."""
    if waiting_tokens <= 0:
        return budget
    if decodes:
        budget = min(budget, max(2 * bucket(decodes), _MIN_MIXED_STEP))
    total = min(budget, decodes + waiting_tokens)
    down = 1 << (total.bit_length() - 1)  # the power of two at or below total
    # Rounding down must leave room for prompt tokens beside the decodes.
    total = down if down > decodes else total
    if decodes:
        # Beside decodes, prompt tokens in whole query tiles of paged_attention
        # (at most 64 rows and a quarter of the step's bucket): 17 tokens
        # beside 15 decodes filled three 8-row tiles, the last with one real
        # row. Only a few tokens are held back: each is a matmul row of
        # padding instead.
        tile = min(64, max(1, bucket(total) // 4))
        prefill = total - decodes
        if prefill > tile and prefill % tile <= max(1, tile // 8):
            total -= prefill % tile
    return total


class TpuScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        full = self.max_num_scheduled_tokens
        if not self.scheduler_config.enable_chunked_prefill:
            return super().schedule(*args, **kwargs)
        decodes = waiting = 0
        for request in self.running:
            left = request.num_prompt_tokens - request.num_computed_tokens
            if left > 0:
                waiting += left
            else:
                decodes += 1
        waiting += sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.waiting)
        self.max_num_scheduled_tokens = step_budget(full, decodes, waiting)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = full
