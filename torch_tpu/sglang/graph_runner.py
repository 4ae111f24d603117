"""SGLang's decode graph runner for tpu: a decode step's model forward as
one replayed program (what CUDA graphs are to SGLang on GPUs).

SGLang asks an out-of-tree platform for its graph runner class
(`get_graph_runner_cls`) and hands it the decode batches it may run
(`can_run_graph`, `execute`). A decode batch of B requests is padded to a
bucket (the power of two at or above B, at most the running-request limit):
its inputs (token ids, positions, slots, request rows) get padding requests
that write slot 0, SGLang's padding slot, and read nothing (sequence length
0, no query tokens: the paged-attention op is ragged). The model's forward
for each bucket is recorded once through fused eager and replayed after
(torch_tpu.vllm.steps.StepPrograms, device-generic: the capture and replay of
torch_tpu._C); every bucket is recorded when the runner is made, before
serving, as SGLang captures its CUDA graphs.

Extend (prefill) batches get the same treatment through the model's inner
decoder (`model.model`, which SGLang's eager runner calls between its
attention planning and its logits processor): their token count is padded to
a power of two and their request count to a bucket, and the decoder's forward
of each (token bucket, request bucket) up to SGLang's prefill chunk (at most
4096 tokens) is recorded before serving too, and replayed after; the logits
processor, the sampler and the padding ops run op by op (their small programs
still compile per exact count at first use).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time

import torch
import torch.nn.functional as F

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context, has_forward_context

from torch_tpu.vllm.steps import StepPrograms, bucket

logger = logging.getLogger(__name__)


def plain_batch(fb: ForwardBatch, mode: ForwardMode, max_bs: int) -> bool:
    """Whether fb is a batch of `mode` these programs run: plain decoder
    requests (no speculative decoding, hidden-state capture, embeddings as
    input, encoder, M-RoPE or LoRA), at most max_bs of them."""
    return bool(
        fb.forward_mode == mode
        and 0 < fb.batch_size <= max_bs
        and fb.capture_hidden_mode == CaptureHiddenMode.NULL
        and fb.spec_info is None
        and fb.input_embeds is None
        and fb.encoder_lens is None
        and getattr(fb, "mrope_positions", None) is None
        and not any(x is not None for x in (getattr(fb, "lora_ids", None) or ()))
    )


def padded_batch(backend, fb: ForwardBatch, input_ids, positions, tokens: int, reqs: int, query_lens: list):
    """fb's copy with `tokens` tokens and `reqs` requests: padding tokens (id 0,
    position 0) write slot 0, SGLang's padding slot; padding requests (request
    row 0, length 0) have no tokens. Sets the backend's attention metadata for
    it; returns (the copy, the step's input tensors)."""
    extra_tokens, extra_reqs = tokens - input_ids.shape[0], reqs - fb.batch_size

    def grow(t, n):  # zeros after t
        return F.pad(t, (0, n)) if n else t

    step = copy.copy(fb)
    step.batch_size = reqs
    step.input_ids = grow(input_ids, extra_tokens)
    step.positions = grow(positions, extra_tokens)
    step.out_cache_loc = grow(fb.out_cache_loc, extra_tokens)
    step.req_pool_indices = grow(fb.req_pool_indices, extra_reqs)
    step.seq_lens = grow(fb.seq_lens, extra_reqs)
    md = backend.metadata(step.req_pool_indices, step.seq_lens, list(query_lens) + [0] * extra_reqs)
    backend.forward_metadata = md
    return step, [step.input_ids, step.positions, step.out_cache_loc, md.block_table, md.seq_lens, md.query_start_loc]


# Extend batches recorded before serving have at most this many tokens (a
# larger batch, with a larger --chunked-prefill-size, records at first use).
_MAX_WARM_EXTEND = 4096


def _prefill_chunk(args) -> int:
    """The most tokens of an extend batch SGLang forms: its prefill chunk (or
    its prefill token limit), at most _MAX_WARM_EXTEND; SGLang may not have
    chosen the chunk yet when the runner is made (None)."""
    for value in (args.chunked_prefill_size, args.max_prefill_tokens):
        if isinstance(value, int) and value > 0:
            return min(value, _MAX_WARM_EXTEND)
    return _MAX_WARM_EXTEND


class DecodePrograms(StepPrograms):
    """StepPrograms whose step inputs are given by the caller: the padded
    batch's tensors and the attention metadata; then the KV caches."""

    def _step_inputs(self, kwargs: dict) -> list[torch.Tensor]:
        return list(kwargs["inputs"]) + list(self.kv_caches())


class TpuGraphRunner:
    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        pool = model_runner.token_to_kv_pool
        self.max_bs = bucket(model_runner.req_to_token_pool.size)
        self.capture_bs = [1 << i for i in range(self.max_bs.bit_length())]
        self.programs = DecodePrograms(model_runner.model, lambda: pool.kv_buffer)
        self.extend_programs = record_extend(model_runner, lambda: pool.kv_buffer, self.max_bs)
        self.bs = None  # the last replay's bucket (SGLang reads it for its logs)
        start = time.perf_counter()
        with torch.no_grad():
            for bs in reversed(self.capture_bs):
                self._warm_up(bs)
        logger.info("torch_tpu: recorded decode steps for batch buckets %s in %.1f s (%s)", self.capture_bs,
                    time.perf_counter() - start, self.programs.stats())
        if self.extend_programs is not None:
            # Extend (prefill) batches too: every (token bucket, request bucket) up
            # to SGLang's prefill chunk, largest first, so that none is recorded
            # in some request's latency.
            limit = bucket(_prefill_chunk(model_runner.server_args))
            top, start = limit, time.perf_counter()
            with torch.no_grad():
                while limit >= 1:
                    for reqs in reversed([b for b in self.capture_bs if b <= limit]):
                        self._warm_up_extend(limit, reqs)
                    limit //= 2
            logger.info("torch_tpu: recorded extend steps up to %d tokens in %.1f s (%s)", top,
                        time.perf_counter() - start, self.extend_programs.stats())

    # -- SGLang's interface -------------------------------------------------------

    def can_run_graph(self, forward_batch: ForwardBatch) -> bool:
        return plain_batch(forward_batch, ForwardMode.DECODE, self.max_bs)

    def execute(self, forward_batch: ForwardBatch, pp_proxy_tensors=None) -> LogitsProcessorOutput:
        if pp_proxy_tensors is not None:
            raise NotImplementedError("torch_tpu's SGLang graph runner: pipeline parallelism")
        bs = forward_batch.batch_size
        padded = bucket(bs, self.max_bs)
        self.bs = padded
        logits = self._run(forward_batch, padded)
        return LogitsProcessorOutput(next_token_logits=logits[:bs] if padded != bs else logits)

    # -- the step ---------------------------------------------------------------

    def _run(self, fb: ForwardBatch, padded: int) -> torch.Tensor:
        step, inputs = padded_batch(self.model_runner.attn_backend, fb, fb.input_ids, fb.positions, padded, padded,
                                    [1] * fb.batch_size)
        model = self.model_runner.model
        return self.programs(lambda: model.forward(step.input_ids, step.positions, step).next_token_logits,
                             {"inputs": inputs})

    def _batch(self, mode: ForwardMode, query_lens: list[int]) -> ForwardBatch:
        """A batch of padding requests (request row 0, writing slot 0) with
        these query lengths."""
        tokens, reqs = sum(query_lens), len(query_lens)
        zeros = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=reqs,
            input_ids=zeros,
            req_pool_indices=torch.zeros(reqs, dtype=torch.int64, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int64).to(self.device),
            out_cache_loc=zeros,
            seq_lens_sum=tokens,
            return_logprob=False,
            positions=zeros,
            spec_algorithm=self.model_runner.spec_algorithm,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            global_forward_mode=mode,
            extend_seq_lens_cpu=list(query_lens) if mode == ForwardMode.EXTEND else None,
        )

    def _warm_up_extend(self, tokens: int, reqs: int) -> None:
        """Records the model's inner decoder for an extend batch of `tokens`
        tokens and `reqs` requests (both buckets)."""
        fb = self._batch(ForwardMode.EXTEND, [tokens - reqs + 1] + [1] * (reqs - 1))
        backend = self.model_runner.attn_backend
        with contextlib.nullcontext() if has_forward_context() else forward_context(ForwardContext(attn_backend=backend)):
            self.model_runner.model.model(fb.input_ids, fb.positions, fb)

    def _warm_up(self, bs: int) -> None:
        """Records the program of bucket bs with a batch of padding requests."""
        fb = self._batch(ForwardMode.DECODE, [1] * bs)
        backend = self.model_runner.attn_backend
        with contextlib.nullcontext() if has_forward_context() else forward_context(ForwardContext(attn_backend=backend)):
            self._run(fb, bs)


def record_extend(model_runner, kv_caches, max_bs: int) -> DecodePrograms | None:
    """Makes calls of the model's inner decoder on plain extend batches run
    padded and recorded (see the module's doc). The decoder's class is
    swapped for a subclass whose __call__ does it, so isinstance checks hold."""
    decoder = getattr(model_runner.model, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        return None
    programs = DecodePrograms(decoder, kv_caches)
    base = type(decoder)

    def __call__(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None, **kwargs):
        fb = forward_batch
        if (input_embeds is not None or pp_proxy_tensors is not None or kwargs or not isinstance(input_ids, torch.Tensor)
                or fb.extend_seq_lens_cpu is None or not plain_batch(fb, ForwardMode.EXTEND, max_bs)):
            return base.__call__(self, input_ids, positions, forward_batch, input_embeds,
                                 pp_proxy_tensors=pp_proxy_tensors, **kwargs)
        tokens = input_ids.shape[0]
        padded = bucket(tokens)
        step, inputs = padded_batch(model_runner.attn_backend, fb, input_ids, positions, padded,
                                    bucket(fb.batch_size, max_bs), fb.extend_seq_lens_cpu)
        out = programs(lambda: base.__call__(self, step.input_ids, step.positions, step), {"inputs": inputs})
        return out[:tokens] if padded != tokens else out

    decoder.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    return programs
