"""vLLM's Platform for the tpu device (PyTorch's PrivateUse1)."""
import os
from typing import TYPE_CHECKING

import torch

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum
from vllm.utils.mem_constants import GiB_bytes

from torch_tpu import _env

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class TpuPlatform(CpuPlatform):
    """CpuPlatform's host-side behaviour (an explicit KV cache size) with the
    tpu device, tpu_dist between workers. Out of tree (OOT): vLLM's custom ops take
    their forward_native path (torch ops, which run on tpu) and none of its
    CPU-only C++ kernels."""

    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    # As TorchTPU's own platform declares them: the c10d backend of the tpu
    # device (torch_tpu.distributed), Ray's resource name for TPU chips, the
    # variable that picks a process's chips, and torch.compile's tpu backend
    # for vLLM's small compiled helpers.
    dist_backend: str = "tpu_dist"
    ray_device_key: str = "TPU"
    device_control_env_var: str = "TPU_VISIBLE_CHIPS"
    simple_compile_backend: str = "tpu"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float32, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "tpu"

    @classmethod
    def import_kernels(cls) -> None:
        import torch_tpu  # noqa: F401  (registers the device)

        super().import_kernels()  # vllm._C's CPU ops: used only on host tensors

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("torch_tpu's vLLM platform: MLA and sparse attention")
        return "torch_tpu.vllm.attention.TpuAttentionBackend"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention stays one custom op (vllm::unified_attention_with_output)
        # in the graph Dynamo traces; its tpu kernel is the backend's forward.
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        # torch.distributed over the device group (tpu_dist): CpuCommunicator
        # would take its shared-memory path, which reads host tensors.
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.tpu.memory_allocated(device))

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size:
            cache_config.block_size = 16
        if cache_config.kv_cache_memory_bytes is None:
            # As the CPU platform: the KV cache's size is asked, not measured
            # (VLLM_TPU_KVCACHE_SPACE GiB, default 1).
            gib = float(_env.get("VLLM_TPU_KVCACHE_SPACE", _env.get("VLLM_CPU_KVCACHE_SPACE", "1")))
            cache_config.kv_cache_memory_bytes = int(gib * GiB_bytes)

        sc = vllm_config.scheduler_config
        sc.async_scheduling = False
        if sc.scheduler_cls is None:  # vLLM's own scheduler, a budget per step for tpu
            sc.scheduler_cls = "torch_tpu.vllm.scheduler.TpuScheduler"
        pc = vllm_config.parallel_config
        if pc.worker_cls == "auto":
            pc.worker_cls = "torch_tpu.vllm.worker.TpuWorker"
        pc.enable_dbo = False

        cc = vllm_config.compilation_config
        cc.cudagraph_capture_sizes = []
        cc.cudagraph_mode = CUDAGraphMode.NONE
        if cc.mode != CompilationMode.NONE and _env.get("VLLM_TPU_COMPILE", "1") == "1":
            # The model as one graph traced once by Dynamo and compiled by
            # torch_tpu's backend: a step is a replayed program per token
            # bucket instead of hundreds of op launches. --enforce-eager (or
            # VLLM_TPU_COMPILE=0) runs op by op. vLLM's AOT cache stores
            # Inductor's output, so it is off.
            cc.mode = CompilationMode.DYNAMO_TRACE_ONCE
            cc.backend = "tpu"
            os.environ["VLLM_USE_AOT_COMPILE"] = "0"
        else:
            cc.mode = CompilationMode.NONE

        if vllm_config.device_config.device_type != "tpu":
            raise ValueError(f"torch_tpu's vLLM platform runs on device 'tpu', not {vllm_config.device_config.device_type!r}")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # Triton kernels do not run on tpu, installed or not.
        from vllm.triton_utils.dispatcher import register_kernels

        from torch_tpu.vllm import kernels

        register_kernels(
            {"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": kernels.compute_slot_mapping}
        )
