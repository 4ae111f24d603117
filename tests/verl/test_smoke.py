"""The gate's VeRL check, in one process and well under a minute: VeRL finds the plugin
through its entry point and picks the tpu platform, its registries hold the FSDP/FSDP2
engines and the hf rollout for tpu, the jagged-to-padded conversion VeRL's FSDP engine uses
runs on tpu, and one GRPO step runs on tpu with CPU fallback an error: the rollout
generates on tpu, VeRL's GRPO advantage and PPO policy loss train an FSDP2 actor over
tpu_dist, and the updated weights go into the rollout on the device.
The whole loop through VeRL's trainer and Ray is tests/verl/test_grpo.py (slow)."""
import asyncio
import importlib
import importlib.metadata
import sys

import numpy as np
import pytest
import torch

import verl  # loads the verl.plugins entry points
import verl_grpo

import torch_tpu


def test_plugin_is_found_through_its_entry_point():
    eps = [e for e in importlib.metadata.entry_points(group="verl.plugins") if e.name == "torch_tpu"]
    assert [e.value for e in eps] == ["torch_tpu.verl"], eps
    assert verl.__version__ == "0.9.1"
    assert "torch_tpu.verl" in sys.modules  # import verl loaded it
    from verl.plugin.platform import PlatformRegistry, get_platform

    from torch_tpu.verl.platform import PlatformHostCPU, PlatformTPU

    assert PlatformRegistry.get("tpu") is PlatformTPU
    assert PlatformRegistry.get("torch_cpu") is PlatformHostCPU
    platform = get_platform()  # auto-detected: no CUDA, NPU or ROCm here
    assert isinstance(platform, PlatformTPU) and platform.device_name == "tpu", platform
    from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name, get_torch_device

    assert (get_device_name(), get_nccl_backend(), get_resource_name()) == ("tpu", "tpu_dist", "TPU")
    assert get_torch_device() is torch.tpu
    # Ray takes whole chips: VeRL's 1/3-device request becomes one chip per worker.
    assert platform.ray_resource_options(1 / 3) == {"resources": {"TPU": 1}}


def test_engines_and_rollout_are_registered_for_tpu():
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from torch_tpu.verl.rollout import HFReplica, HFRollout

    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is FSDPEngineWithLMHead
        assert EngineRegistry.get_engine_cls("value_model", backend) is FSDPEngineWithValueHead
        for model_type in ("language_model", "value_model"):
            assert "tpu" in EngineRegistry._engines[model_type][backend]
    assert get_rollout_class("hf", "async") is HFRollout
    assert get_rollout_replica_class("hf") is HFReplica
    from torch_tpu.verl import adaptations

    importlib.import_module("verl.single_controller.ray.base")
    importlib.import_module("verl.utils.distributed")
    assert "ResourcePoolManager._check_resource_available" in adaptations.APPLIED


@pytest.fixture
def process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo,tpu:tpu_dist", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fallback_error():
    previous = "error" if torch_tpu._C._fallback_is_error() else "warn"
    torch_tpu.set_fallback("error")
    try:
        yield
    finally:
        torch_tpu.set_fallback(previous)


def _full_state(actor):
    """What VeRL's FSDP engine hands the rollout (get_per_tensor_param): full tensors on the device."""
    from torch.distributed.tensor import DTensor

    for name, p in actor.state_dict().items():
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p)


def _token_logprobs(model, seqs, prompt_len):
    logits = model(input_ids=seqs).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None])[..., 0]


def test_one_grpo_step_on_tpu(tiny_model, process_group, fallback_error):
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss_vanilla
    from verl.workers.config import HFModelConfig, RolloutConfig

    from torch_tpu.verl.rollout import HFRollout

    torch.manual_seed(0)
    tpu = torch.device("tpu", 0)
    rollout = HFRollout(config=RolloutConfig(name="hf", prompt_length=8, response_length=verl_grpo.RESPONSE_LEN,
                                             dtype="float32", tensor_model_parallel_size=1),
                        model_config=HFModelConfig(path=tiny_model))
    assert next(rollout.module.parameters()).device == tpu
    actor = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to(tpu)
    with torch.no_grad():  # a different start than the rollout's, so that the sync shows
        for p in actor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fully_shard(actor, mesh=init_device_mesh("tpu", (1,)))
    opt = torch.optim.AdamW(actor.parameters(), lr=5e-3)

    # Weight sync, trainer to rollout, as VeRL's naive checkpoint engine does it.
    asyncio.run(rollout.update_weights(_full_state(actor), global_steps=0))
    assert rollout.synced_tensors == len(actor.state_dict()) and rollout.weight_version == 0

    # Rollout on tpu: 4 prompts, 4 samples each.
    tok = rollout.model_config.tokenizer
    asks = ["a", "b", "c", "d"]
    n = 4
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"copy {k}"}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for k in asks for _ in range(n)]
    out = rollout.generate_batch(prompts, [verl_grpo.RESPONSE_LEN] * len(prompts), temperature=1.0, top_k=-1,
                                 top_p=1.0, logprobs=True, seed=0)
    assert len(out) == len(prompts)
    for ids, lps, stop in out:
        assert 1 <= len(ids) <= verl_grpo.RESPONSE_LEN and len(lps) == len(ids) and stop in ("length", "completed")
        assert all(lp <= 1e-6 for lp in lps)
    full = [(ids + [tok.pad_token_id] * verl_grpo.RESPONSE_LEN)[:verl_grpo.RESPONSE_LEN] for ids, _, _ in out]
    mask = torch.tensor([[1.0 if j < len(ids) else 0.0 for j in range(verl_grpo.RESPONSE_LEN)] for ids, _, _ in out])
    scores = [verl_grpo.compute_score(verl_grpo.DATA_SOURCE, tok.decode(ids, skip_special_tokens=True), asks[i // n])
              for i, (ids, _, _) in enumerate(out)]
    token_rewards = torch.zeros_like(mask)
    for i, (ids, _, _) in enumerate(out):
        token_rewards[i, len(ids) - 1] = scores[i]

    # VeRL's GRPO advantage (on the CPU, where VeRL's driver computes it).
    adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, index=np.repeat(np.arange(len(asks)), n))

    # One PPO step of the FSDP2 actor on tpu with VeRL's policy loss.
    seqs = torch.tensor([p + r for p, r in zip(prompts, full)], device=tpu)
    prompt_len = len(prompts[0])
    assert all(len(p) == prompt_len for p in prompts)
    rollout_lp = torch.tensor([(lps + [0.0] * verl_grpo.RESPONSE_LEN)[:verl_grpo.RESPONSE_LEN] for _, lps, _ in out])
    with torch.no_grad():
        old_lp = _token_logprobs(actor, seqs, prompt_len)
    # The rollout sampled from the synced weights: its log-probs are the actor's.
    torch.testing.assert_close(rollout_lp * mask, old_lp.cpu() * mask, atol=2e-4, rtol=1e-4)
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0,
                            "global_batch_info": {}})
    lp = _token_logprobs(actor, seqs, prompt_len)
    loss, metrics = compute_policy_loss_vanilla(old_lp, lp, adv.to(tpu), mask.to(tpu), "token-mean", cfg)
    loss.backward()
    grads = [p.grad for p in actor.parameters()]
    assert all(g is not None for g in grads)
    if adv.abs().sum() > 0:  # some group had different rewards: the step moves the policy
        assert sum(g.full_tensor().abs().sum().item() for g in grads) > 0
    opt.step()
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)

    # The updated weights go back into the rollout.
    asyncio.run(rollout.update_weights(_full_state(actor), global_steps=1))
    rollout_state = dict(rollout.module.named_parameters())
    for name, t in _full_state(actor):
        torch.testing.assert_close(rollout_state[name].cpu(), t.cpu(), atol=0, rtol=0)
    assert rollout.weight_version == 1



def test_jagged_padding_is_native(fallback_error):
    """VeRL's FSDP engine pads its jagged micro-batches with torch.nested.to_padded_tensor:
    it runs on tpu (before 8b80213 it was the trainer's one op through the CPU fallback)."""
    assert verl_grpo.jagged_padding_is_native()
