"""vLLM's worker and model runner for tpu: GPUModelRunner on the tpu device
(CPUModelRunner's device-agnostic parts), CPUWorker's memory accounting."""
import dataclasses
from contextlib import contextmanager, nullcontext

import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

from torch_tpu.vllm.attention import bucket

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


class TpuModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        with _without_cuda_streams():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False

    load_model = CPUModelRunner.load_model
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
        """Runs the model once per token bucket (and once per decode batch
        size up to max_num_seqs) before serving, so that requests find their
        programs compiled: a first use of a bucket during serving cost a
        compile in the request's latency."""
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
        # Largest first: the first run is the one Dynamo traces (once, for
        # every size), and a trace at 1 token would specialise that dim to 1.
        for n in reversed(sizes):
            runner._dummy_run(n, force_attention=True)
            if n <= runner.max_num_reqs:
                runner._dummy_run(n, force_attention=True, uniform_decode=True)
        torch.tpu.synchronize()
        logger.info("torch_tpu: warmed up %d token buckets in %.1f s", len(sizes), time.perf_counter() - start)
        return times

    def _maybe_get_memory_pool_context(self, tag: str):
        # vLLM's sleep-mode allocator is CUDA's: tpu has none.
        return nullcontext()
