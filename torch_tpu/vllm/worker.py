"""vLLM's worker and model runner for tpu: GPUModelRunner on the tpu device
(CPUModelRunner's device-agnostic parts), CPUWorker's memory accounting."""
import dataclasses
import functools
import types
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.block_table import SlotMappingMode
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from torch_tpu.vllm import steps
from torch_tpu.vllm.attention import PaddingStats, bucket, request_bucket
from torch_tpu.vllm.attention import grown
from torch_tpu.vllm.sampler import TpuSampler, grammar_bitmask_on_tpu, host_batch

logger = init_logger("vllm." + __name__)  # vLLM configures the "vllm" loggers only


@contextmanager
def _without_cuda_streams():
    """GPUModelRunner.__init__ makes torch.cuda streams and events (async
    output copies); the runner waits on the device instead (_sync_device)."""

    class _Event:
        def __init__(self, *args, **kwargs) -> None:
            self.record = lambda *a, **k: None
            self.synchronize = lambda: None

    class _Stream:
        def __init__(self, *args, **kwargs) -> None:
            self.wait_stream = lambda *a, **kw: None
            self.device = torch.device("tpu")

    event, stream = torch.Event, torch.cuda.Stream
    try:
        torch.Event, torch.cuda.Stream = _Event, _Stream
        yield
    finally:
        torch.Event, torch.cuda.Stream = event, stream


def _allocate_kv_cache_per_layer(kv_cache_config, device, layout, kernel_block_sizes=None):
    """One typed tensor per layer instead of vLLM's one int8 buffer viewed per
    layer: a write through a reinterpreting view of a shared buffer costs the
    whole buffer on tpu, a write into a whole tensor only what it writes."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, compute_layer_kv_cache_shape_bytes

    caches = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        num_blocks = kv_cache_config.num_blocks_of(tensor)
        for layer in tensor.layers:
            group_id, group = next(
                (i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if layer in g.layer_names
            )
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            kernel_block = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(kernel_block_sizes) else None
            blocks, heads, block_size, row_bytes = compute_layer_kv_cache_shape_bytes(spec, num_blocks, kernel_block)
            item = torch.empty((), dtype=spec.dtype).element_size()
            caches[layer] = torch.zeros((blocks, heads, block_size, row_bytes // item), dtype=spec.dtype, device=device)
    return caches


def _host_sampling_metadata(batch) -> SamplingMetadata:
    """InputBatch._make_sampling_metadata for the tpu sampler: the same
    metadata over the batch's host tensors, with no device copies (vLLM's
    copies each parameter into a slice of a device buffer: a program per
    request count). TpuSampler reads the batch itself (sampler.host_batch)."""
    n = batch.num_reqs
    return SamplingMetadata(
        temperature=None if batch.all_greedy else batch.temperature_cpu_tensor[:n],
        all_greedy=batch.all_greedy,
        all_random=batch.all_random,
        top_p=None if batch.no_top_p else batch.top_p_cpu_tensor[:n],
        top_k=None if batch.no_top_k else batch.top_k_cpu_tensor[:n],
        generators=batch.generators,
        max_num_logprobs=batch.max_num_logprobs,
        no_penalties=batch.no_penalties,
        prompt_token_ids=None,
        frequency_penalties=batch.frequency_penalties_cpu_tensor[:n],
        presence_penalties=batch.presence_penalties_cpu_tensor[:n],
        repetition_penalties=batch.repetition_penalties_cpu_tensor[:n],
        output_token_ids=batch.req_output_token_ids[:n],
        spec_token_ids=batch.spec_token_ids[:n],
        allowed_token_ids_mask=None if batch.no_allowed_token_ids else batch.allowed_token_ids_mask_cpu_tensor[:n],
        bad_words_token_ids=batch.bad_words_token_ids,
        logitsprocs=batch.logitsprocs,
    )


def _tpu_sampling(vllm_config) -> bool:
    """Whether TpuSampler samples (sampler.py): not for speculative decoding,
    custom logits processors, a reasoning budget or processed logprobs, which
    keep vLLM's sampler (their programs compile per request count)."""
    mc = vllm_config.model_config
    return not (vllm_config.speculative_config or mc.logits_processors or vllm_config.reasoning_config
                or mc.logprobs_mode not in ("raw_logprobs", "raw_logits"))


class TpuModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        import vllm.v1.worker.gpu_model_runner as gmr

        self.tpu_sampler = None
        build = gmr.build_logitsprocs
        if _tpu_sampling(vllm_config):
            mc = vllm_config.model_config
            self.tpu_sampler = TpuSampler(mc.logprobs_mode, mc.max_logprobs if mc.max_logprobs >= 0 else 1 << 30)
            # vLLM's logits processors (min-p, logit bias, min tokens) kept on
            # the host: TpuSampler reads their state there.
            gmr.build_logitsprocs = lambda cfg, _device, *args, **kw: build(cfg, torch.device("cpu"), *args, **kw)
            if not hasattr(gmr.apply_grammar_bitmask, "__wrapped__"):
                gmr.apply_grammar_bitmask = functools.wraps(gmr.apply_grammar_bitmask)(
                    grammar_bitmask_on_tpu(gmr.apply_grammar_bitmask))
        try:
            with _without_cuda_streams():
                super().__init__(vllm_config, device)
        finally:
            gmr.build_logitsprocs = build
        self.use_cuda_graph = False
        self._positions_host = torch.zeros(self.max_num_tokens, dtype=torch.int64)
        self.step_programs: steps.StepPrograms | None = None
        self.padding = PaddingStats()  # of the steps served (not the warm-up's)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        CPUModelRunner.load_model(self, load_dummy_weights)
        # A step of each shape is recorded once and replayed after (steps.py);
        # --enforce-eager runs op by op, as on GPUs (no CUDA graphs).
        if steps.enabled() and not self.model_config.enforce_eager and not self.lora_config:
            self.step_programs = steps.record_steps(self.model, lambda: self.kv_caches)

    @property
    def input_batch(self):
        return self.__dict__["_input_batch"]

    @input_batch.setter
    def input_batch(self, batch) -> None:
        # Each InputBatch vLLM makes (at start, again with the KV cache's block sizes).
        if self.tpu_sampler is not None:
            batch._make_sampling_metadata = types.MethodType(_host_sampling_metadata, batch)
        self.__dict__["_input_batch"] = batch

    def _sample(self, logits, spec_decode_metadata):
        if self.tpu_sampler is None or spec_decode_metadata is not None:
            return super()._sample(logits, spec_decode_metadata)
        batch = self.input_batch
        hb = host_batch(batch, logits.shape[0], logits.shape[1])
        for row in np.nonzero(self.discard_request_mask.np[: batch.num_reqs])[0]:
            # A request still prefilling: its token is discarded, and vLLM's
            # _bookkeeping_sync then takes its generator back 4 (CUDA's
            # Philox step). It draws nothing here, so it starts 4 ahead.
            generator = hb.generators.pop(int(row), None)
            if generator is not None:
                generator.set_offset(generator.get_offset() + 4)
        scoring = {batch.req_id_to_index[r]: ids for r, ids in batch.logprob_token_ids.items()
                   if r in batch.req_id_to_index}
        return self.tpu_sampler.sample_batch(logits, hb, scoring or None)

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        """Prompt logprobs from the logits of every token of the step's
        bucket at once (vLLM computes them per request chunk: programs per
        chunk length and per logprob count), cut per request on the host."""
        wanted = {r: k for r, k in self.num_prompt_logprobs.items()
                  if r in num_scheduled_tokens and self.requests[r].prompt_token_ids is not None}
        if self.tpu_sampler is None or not wanted:
            return super()._get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens)
        hidden = grown(hidden_states, bucket(hidden_states.shape[0], self.max_num_tokens))
        targets = np.zeros(hidden.shape[0], dtype=np.int64)
        chunks = {}
        for req_id in wanted:
            request = self.requests[req_id]
            start, prompt = request.num_computed_tokens, request.prompt_token_ids
            remaining = len(prompt) - start - 1
            count, offset = min(num_scheduled_tokens[req_id], remaining), 0
            if count > 0:
                offset = int(self.query_start_loc.np[self.input_batch.req_id_to_index[req_id]])
                targets[offset : offset + count] = prompt[start + 1 : start + 1 + count]
            chunks[req_id] = (start, offset, count, num_scheduled_tokens[req_id] > remaining)
        scores = self.tpu_sampler.scores(self.model.compute_logits(hidden))
        ids, values, ranks = self.tpu_sampler.top_logprobs(scores, torch.from_numpy(targets).to(self.device))
        done = {}
        for req_id, (start, offset, count, last) in chunks.items():
            request, k = self.requests[req_id], wanted[req_id]
            tensors = request.in_progress_prompt_logprobs_cpu
            if tensors is None:
                tensors = LogprobsTensors.empty_cpu(len(request.prompt_token_ids) - 1, k + 1)
                request.in_progress_prompt_logprobs_cpu = tensors
            if count > 0:
                rows = slice(offset, offset + count)
                tensors.logprob_token_ids[start : start + count] = ids[rows, : k + 1]
                tensors.logprobs[start : start + count] = values[rows, : k + 1]
                tensors.selected_token_ranks[start : start + count] = ranks[rows]
            if last:  # the prompt's last chunk
                done[req_id] = tensors
                del self.num_prompt_logprobs[req_id]
                request.in_progress_prompt_logprobs_cpu = None
        return done

    get_model = CPUModelRunner.get_model
    _zero_block_ids = CPUModelRunner._zero_block_ids

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
        import vllm.v1.worker.gpu_model_runner as gmr

        allocate = gmr.allocate_kv_cache
        gmr.allocate_kv_cache = _allocate_kv_cache_per_layer
        try:
            return super().initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes, kv_cache_allocation_context)
        finally:
            gmr.allocate_kv_cache = allocate

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, *args, **kwargs):
        """Pads each step's token count to a power of two (vLLM pads input
        ids, positions and slot mapping to it), so a serving run settles into
        a few program shapes: each new token count compiled new programs."""
        mode, batch, *rest = super()._determine_batch_execution_and_padding(num_tokens, num_reqs, *args, **kwargs)
        padded = bucket(batch.num_tokens, self.max_num_tokens)
        if padded != batch.num_tokens:
            batch = dataclasses.replace(batch, num_tokens=padded)
        return (mode, batch, *rest)

    def _inputs_prepared_on_host(self) -> bool:
        """Whether this step's inputs can be prepared by _prepare_inputs below:
        a plain decoder (no speculative decoding, M-RoPE, prompt embeddings,
        LoRA, decode context parallelism or asynchronous scheduling)."""
        return not (
            self.speculative_config
            or self.uses_mrope
            or self.enable_prompt_embeds
            or self.lora_config
            or self.dcp_world_size > 1
            or self.num_accepted_tokens_event is not None
            or self.input_batch.prev_sampled_token_ids is not None
            or self._pp_recv_work is not None
        )

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        """The step's inputs computed on the host and sent as whole buffers,
        padded to the step's token bucket (input ids, positions and slot
        mappings: one upload each, no program). GPUModelRunner computes
        positions and slot mappings with device ops over the exact token
        count, and on tpu every new count compiled a dozen small programs
        during serving."""
        if not self._inputs_prepared_on_host():
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        tokens = scheduler_output.total_num_scheduled_tokens
        padded = bucket(tokens, self.max_num_tokens)
        rows = request_bucket(num_reqs, self.max_num_reqs)
        # Block tables: the rows attention reads (the request bucket's).
        batch.block_table.commit_block_table(rows)

        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens = self._get_cumsum_and_arange(num_scheduled_tokens, self.query_pos.np)
        self.query_pos.np[tokens:padded] = 0
        positions = batch.num_computed_tokens_cpu[req_indices] + self.query_pos.np[:tokens]

        # Whole buffers: a whole tensor's copy is an upload, a part's a program.
        def send(buf, values, pad):  # values, then pad up to the bucket
            buf.np[:tokens] = values
            buf.np[tokens:padded] = pad
            buf.copy_to_gpu()

        send(self.input_ids, batch.token_ids_cpu[req_indices, positions], 0)
        send(self.req_indices, req_indices, 0)
        self.query_pos.copy_to_gpu()
        self._positions_host[:tokens] = torch.from_numpy(positions)
        self._positions_host[tokens:padded] = 0
        self.positions.copy_(self._positions_host)
        for table in batch.block_table.block_tables:
            if table.slot_mapping_mode == SlotMappingMode.NONE:
                continue
            bs = table.block_size
            blocks = table.block_table.np[req_indices, positions // bs].astype(np.int64)
            send(table.slot_mapping, blocks * bs + positions % bs, -1)

        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.query_start_loc.np[num_reqs + 1 :] = cu_num_tokens[-1]
        self.query_start_loc.copy_to_gpu()

        seq_lens = self.optimistic_seq_lens_cpu
        torch.add(batch.num_computed_tokens_cpu_tensor[:num_reqs], torch.from_numpy(num_scheduled_tokens),
                  out=seq_lens[:num_reqs])
        seq_lens[num_reqs:] = 0
        self.seq_lens.copy_(seq_lens)
        self.num_computed_tokens.copy_(batch.num_computed_tokens_cpu_tensor)
        table = batch.block_table.block_tables[0]
        self.padding.add(num_scheduled_tokens, seq_lens[:num_reqs].numpy(), padded, rows, table.block_size,
                         table.max_num_blocks_per_req)
        self.num_scheduled_tokens.np[:num_reqs] = num_scheduled_tokens
        self.num_scheduled_tokens.np[num_reqs:] = 0
        self.num_scheduled_tokens.copy_to_gpu()
        self._compute_prev_positions(num_reqs)
        # A request whose prompt is not yet all scheduled samples nothing.
        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids], dtype=np.int32)
        self.discard_request_mask.np[:num_reqs] = seq_lens[:num_reqs].numpy() < num_tokens
        self.discard_request_mask.np[num_reqs:] = False
        self.discard_request_mask.copy_to_gpu()
        self.num_accepted_tokens.np.fill(1)
        self.num_accepted_tokens.copy_to_gpu()
        # Each request's last token gives its logits: an upload, no program.
        # For TpuSampler, as many rows as the request bucket (the padding's
        # rows repeat the first token's and are discarded).
        last = (cu_num_tokens - 1).astype(np.int64)
        if self.tpu_sampler is not None:
            last = np.pad(last, (0, request_bucket(num_reqs, self.max_num_reqs) - num_reqs))
        logits_indices = torch.from_numpy(last).to(self.device)
        return logits_indices, None, 1

    def warming_up_model(self) -> None:
        return

    def _sync_device(self) -> None:
        torch.tpu.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()


class TpuWorker(CPUWorker):
    """CPUWorker's memory accounting (the KV cache size is given) on a tpu device."""

    def init_device(self):
        import torch_tpu  # noqa: F401

        self.device = torch.device("tpu", self.local_rank if torch.tpu.device_count() > 1 else 0)
        torch.tpu.set_device(self.device)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = TpuModelRunner(self.vllm_config, self.device)

    def _should_warm_up_model(self) -> bool:
        return False

    def compile_or_warm_up_model(self):
        """Compiles before serving every program requests will run, so that
        none compiles in some request's latency. A step's model program
        depends on its token bucket and its request bucket only (attention
        is ragged), so one batch per (token bucket, request bucket) makes them
        all; then the gather of each request's last hidden state and the
        logits (per token bucket and request bucket) and every path of the
        sampler per request bucket (TpuSampler.warm_up)."""
        import time

        times = super().compile_or_warm_up_model()
        runner = self.model_runner
        if not runner.kv_caches:
            return times
        start = time.perf_counter()
        sizes, n = [], 1
        while n < runner.max_num_tokens:
            sizes.append(n)
            n *= 2
        sizes.append(runner.max_num_tokens)
        max_reqs = runner.max_num_reqs
        query_len = runner.uniform_decode_query_len
        shapes = 0
        try:
            # Largest first: the first run is the one Dynamo traces (once, for
            # every size), and a trace at 1 token would specialise that dim to 1.
            for n in reversed(sizes):
                buckets = sorted({request_bucket(r, max_reqs) for r in range(1, min(n, max_reqs) + 1)})
                for rows in reversed(buckets):
                    # Equal requests of q tokens (the last one shorter) fill n.
                    runner.uniform_decode_query_len = q = -(-n // rows)
                    if request_bucket(-(-n // q), max_reqs) != rows:
                        continue  # no uniform batch of n tokens has this bucket
                    recorded = runner.step_programs.captures if runner.step_programs else 0
                    hidden, _ = runner._dummy_run(n, force_attention=True, uniform_decode=True)
                    if runner.step_programs and runner.step_programs.captures == recorded:
                        # The first run also traced the model (Dynamo) and
                        # its recording split: record this shape again.
                        hidden, _ = runner._dummy_run(n, force_attention=True, uniform_decode=True)
                    shapes += 1
                with torch.inference_mode():
                    for rows in buckets:  # each request's last hidden state, gathered
                        hidden[torch.zeros(rows, dtype=torch.int64, device=runner.device)]
                    if runner.tpu_sampler is not None:  # prompt logprobs: every token's
                        scores = runner.tpu_sampler.scores(runner.model.compute_logits(hidden))
                        runner.tpu_sampler.top_logprobs(scores, torch.zeros(n, dtype=torch.int64, device=runner.device))
        finally:
            runner.uniform_decode_query_len = query_len
        paths = 0
        sampler = runner.tpu_sampler
        if sampler is not None:
            generator = torch.Generator(device=runner.device)
            generator.manual_seed(0)
            with torch.inference_mode():
                for rows in sorted({request_bucket(r, max_reqs) for r in range(1, max_reqs + 1)}):
                    logits = runner.model.compute_logits(hidden[torch.zeros(rows, dtype=torch.int64, device=runner.device)])
                    paths += sampler.warm_up(logits, logits.shape[1], rows * runner.max_model_len, generator)
        torch.tpu.synchronize()
        logger.info("torch_tpu: warmed up %d batch shapes in %d token buckets and %d sampling paths in %.1f s",
                    shapes, len(sizes), paths, time.perf_counter() - start)
        return times

    def step_stats(self) -> dict:
        """What the steps served computed, padding included (attention.PaddingStats),
        and the recorded programs' counts: for benchmarks, through vLLM's
        collective_rpc (POST /collective_rpc {"method": "step_stats"} with
        VLLM_SERVER_DEV_MODE=1)."""
        import torch_tpu

        runner = self.model_runner
        stats = runner.padding.as_dict()
        m = torch_tpu.metrics()
        stats["programs"] = m["compiles"] + m["disk_hits"]  # made or read from the disk cache so far
        if runner.step_programs is not None:
            stats["step_programs"] = runner.step_programs.stats()
        return stats

    def _maybe_get_memory_pool_context(self, tag: str):
        # vLLM's sleep-mode allocator is CUDA's: tpu has none.
        return nullcontext()
