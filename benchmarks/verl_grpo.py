"""GRPO with VeRL's own trainer on a tiny model and a toy task, on tpu or on PyTorch's CPU.

Runs in .venv-verl (scripts/setup_verl.sh). VeRL's ``RayPPOTrainer`` (``main_ppo_v0``'s
``TaskRunner``) with ``algorithm.adv_estimator=grpo`` drives everything: the actor
(FSDP2 over ``tpu_dist``, 2 workers on a local Ray cluster seen as a 2-chip TPU host),
the reference policy (the KL loss), rollouts through torch_tpu's ``hf`` rollout on each
worker's chip, the weight sync into it after each update, and the reward through VeRL's
reward loop calling ``compute_score`` below.

The model is made here, offline: a 2-layer Llama (VeRL's agent loop tokenizes
Qwen models as Qwen chat, which a toy tokenizer is not) with a word-level tokenizer of 8
words. The task: a prompt ``copy k`` asks for the symbol ``k`` (one of 4); the reward is the
share of the 4 response tokens that are ``k``, so the random model starts near 1/8 and has
to learn to copy the prompt's symbol.

    python benchmarks/verl_grpo.py --steps 30                      # tpu, then cpu
    python benchmarks/verl_grpo.py --devices tpu --steps 5 --json out.json

Each step's metrics are VeRL's own (``critic/score/mean`` the reward,
``timing_s/*`` the phases); the summary prints them per device side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
# The local Ray cluster (one Ray sees as a TPU host) is the one the Ray tests start.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "python"))
from ray_local import local_tpu_cluster  # noqa: E402

SYMBOLS = ["a", "b", "c", "d"]
SPECIALS = ["<pad>", "<eos>", "<unk>"]
WORDS = SPECIALS + ["copy"] + SYMBOLS
RESPONSE_LEN = 4
DATA_SOURCE = "torch_tpu_copy"
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"

# The phases the summary reports, VeRL's names (timing_s/<name>).
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The verifiable reward: the share of the first RESPONSE_LEN words that are the asked symbol."""
    words = solution_str.split()[:RESPONSE_LEN]
    return sum(w == ground_truth for w in words) / RESPONSE_LEN


def make_model(path: str, seed: int = 0) -> str:
    """A tiny Llama causal LM and its word-level tokenizer, saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"],
                      bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_data(folder: str, n_train: int = 256, n_val: int = 16, seed: int = 0) -> tuple[str, str]:
    """Parquet files in VeRL's RL dataset layout: chat prompt, data source, ground truth."""
    import random

    import pandas as pd

    rng = random.Random(seed)

    def rows(n, split):
        out = []
        for i in range(n):
            k = rng.choice(SYMBOLS)
            out.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"copy {k}"}],
                        "ability": "copy", "reward_model": {"style": "rule", "ground_truth": k},
                        "extra_info": {"split": split, "index": i}})
        return pd.DataFrame(out)

    os.makedirs(folder, exist_ok=True)
    train, val = os.path.join(folder, "train.parquet"), os.path.join(folder, "val.parquet")
    rows(n_train, "train").to_parquet(train)
    rows(n_val, "val").to_parquet(val)
    return train, val


def overrides(device: str, model: str, train: str, val: str, steps: int, out_dir: str, lr: float,
              batch: int, n: int) -> list[str]:
    """The Hydra overrides of VeRL's ppo_trainer config for this job."""
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={batch}",
        "data.max_prompt_length=8",
        f"data.max_response_length={RESPONSE_LEN}",
        "data.dataloader_num_workers=0",
        "data.seed=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * n // 2}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.use_torch_compile=False",
        # float32 throughout: FSDP's compute dtype (VeRL's default is bfloat16) as the rollout's.
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={FP32}",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={FP32}",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.use_torch_compile=False",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch * n // 2}",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * n // 2}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={HERE}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.device={device}",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.use_v1=False",
        "trainer.logger=[console,file]",
        "trainer.project_name=torch_tpu_verl",
        f"trainer.experiment_name=grpo_{device}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.total_epochs=1000",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={out_dir}/checkpoints",
        "trainer.balance_batch=False",
    ]


def run(device: str, steps: int, workdir: str, lr: float = 5e-3, batch: int = 8, n: int = 8,
        fallback: str | None = None) -> list[dict]:
    """One VeRL GRPO job; returns its per-step metrics (VeRL's file logger's lines)."""
    from hydra import compose, initialize_config_dir

    import verl.trainer.main_ppo as main_ppo
    from verl.trainer.main_ppo_v0 import TaskRunner

    model = make_model(os.path.join(workdir, "model"))
    train, val = make_data(os.path.join(workdir, "data"))
    metrics_file = os.path.join(workdir, f"metrics_{device}.jsonl")
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer",
                      overrides=overrides(device, model, train, val, steps, workdir, lr, batch, n))
    worker_env = {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VERL_PLATFORM": "tpu" if device == "tpu" else "torch_cpu",
        "VERL_FILE_LOGGER_PATH": metrics_file,
        "VERL_LOGGING_LEVEL": "WARN",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    if fallback:
        worker_env["TORCH_TPU_FALLBACK"] = fallback
    # The driver process picks the platform the same way its workers do.
    saved = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)
    try:
        with local_tpu_cluster(chips=2 if device == "tpu" else 0, num_cpus=16, worker_env=worker_env,
                               object_store_mb=300):
            main_ppo.run_ppo(cfg, task_runner_class=TaskRunner)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with open(metrics_file) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [dict(line["data"], step=line["step"]) for line in lines]


def jagged_padding_is_native() -> bool:
    """Whether tpu lowers what VeRL's FSDP engine pads its jagged micro-batches with
    (torch.nested.to_padded_tensor: aten::_jagged_to_padded_dense_forward; lowered at 8b80213;
    before, the trainer's workers ran that one op through the CPU fallback)."""
    import torch

    import torch_tpu

    previous = "error" if torch_tpu._C._fallback_is_error() else "warn"
    torch_tpu.set_fallback("error")
    try:
        values = torch.arange(5, device="tpu")
        offsets = torch.tensor([0, 2, 5], device="tpu")
        nt = torch.nested.nested_tensor_from_jagged(values, offsets)
        torch.nested.to_padded_tensor(nt, padding=0, output_size=(2, 3))
        return True
    except RuntimeError as e:
        if "no tpu lowering" not in str(e):
            raise
        return False
    finally:
        torch_tpu.set_fallback(previous)


def reward_curve(metrics: list[dict]) -> list[float]:
    return [m["critic/score/mean"] for m in metrics]


def phase_table(metrics: list[dict], skip: int = 2) -> dict:
    """Median seconds per phase over the steps after the first `skip` (their compiles)."""
    rows = metrics[skip:] or metrics
    return {p: statistics.median(m.get(f"timing_s/{p}", 0.0) for m in rows) for p in PHASES}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="tpu,cpu", help="comma-separated: tpu, cpu (default: both)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--fallback", default="error",
                    help="TORCH_TPU_FALLBACK for the tpu run's workers (default error: every op on tpu; warn allows the CPU)")
    ap.add_argument("--json", default=None, help="write the per-step metrics and the summary here")
    args = ap.parse_args(argv)
    # Ray hands the script's folder to its workers' sys.path, where benchmarks/kernels.py would
    # stand in for the `kernels` package transformers probes for.
    here = os.path.dirname(HERE)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    results = {}
    for device in args.devices.split(","):
        workdir = tempfile.mkdtemp(prefix=f"verl_{device}_")
        t0 = time.perf_counter()
        try:
            metrics = run(device, args.steps, workdir, lr=args.lr, fallback=args.fallback if device == "tpu" else None)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        results[device] = {"wall_s": time.perf_counter() - t0, "metrics": metrics,
                           "reward": reward_curve(metrics), "phases_s": phase_table(metrics)}
    print(f"\n{'phase (median s/step)':<24}" + "".join(f"{d:>10}" for d in results))
    for p in PHASES:
        print(f"{p:<24}" + "".join(f"{results[d]['phases_s'][p]:>10.3f}" for d in results))
    for d, r in results.items():
        print(f"{d}: reward by step {[round(x, 3) for x in r['reward']]}; whole run {r['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
