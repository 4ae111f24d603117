"""The transformers Trainer on tpu, as users launch it: ``torchrun --nproc-per-node N
trainer_ddp.py``. Accelerate's own state classes pick tpu_dist and DDP; every rank prints its
step losses and a checksum of the trained weights. The global batch is 4 examples whatever N
is, in order, so 2 ranks and 1 train on the same data."""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import torch_tpu
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch_tpu.set_fallback("error")
world = int(os.environ.get("WORLD_SIZE", "1"))
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
model = LlamaForCausalLM(config)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 64, (16, 12), generator=g)
dataset = [{"input_ids": ids[i], "labels": ids[i]} for i in range(16)]
output = tempfile.TemporaryDirectory()  # removed at exit
args = TrainingArguments(
    output_dir=output.name,
    per_device_train_batch_size=4 // world,
    max_steps=3,
    learning_rate=1e-2,
    optim="sgd",
    train_sampling_strategy="sequential",
    report_to=[],
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    use_cpu=False,
)
trainer = Trainer(model=model, args=args, train_dataset=dataset)
state = trainer.accelerator.state
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
weights = sum(float(p.detach().double().sum().cpu()) for p in model.parameters())
print("RESULT " + json.dumps({
    "rank": int(os.environ.get("RANK", "0")), "world": world, "losses": losses, "weights": weights,
    "distributed": str(state.distributed_type), "backend": state.backend,
    "device": str(trainer.accelerator.device), "group": dist.get_world_size() if dist.is_initialized() else 1,
    "ddp": type(trainer.model_wrapped).__name__,
}), flush=True)
output.cleanup()
sys.exit(0)
