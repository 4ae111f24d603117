"""device_map="auto" over 2 tpu devices, the CPU and disk (run by test_huggingface.py with
TORCH_TPU_CPU_DEVICES=2 and TORCH_TPU_MEMORY_LIMIT=250K). Prints "ok ..." lines."""

import gc
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torch_tpu  # noqa: F401

folder = sys.argv[1]
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(f"{folder}/model")
ref = LlamaForCausalLM.from_pretrained(f"{folder}/model")
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    want = ref(ids).logits

from accelerate.utils import get_max_memory  # noqa: E402

found = get_max_memory()
assert sorted(k for k in found if isinstance(k, int)) == [0, 1] and "cpu" in found, found
assert found[0] <= 250 * 1024, found

# The limit lets each device hold about one layer: the rest goes to the CPU.
m = LlamaForCausalLM.from_pretrained(f"{folder}/model", device_map="auto")
placed = set(m.hf_device_map.values())
assert {0, 1, "cpu"} <= placed, m.hf_device_map
with torch.no_grad():
    got = m(ids.to("tpu:0")).logits
torch.testing.assert_close(got.cpu(), want)
out = m.generate(ids.to("tpu:0"), max_new_tokens=4, do_sample=False)
assert out.shape == (1, 9) and torch.equal(out.cpu(), ref.generate(ids, max_new_tokens=4, do_sample=False)), out
print("ok tpu:0, tpu:1 and cpu", m.hf_device_map)

# A small CPU budget spills to disk.
del m
gc.collect()  # accelerate's hooks and the model refer to each other
m = LlamaForCausalLM.from_pretrained(f"{folder}/model", device_map="auto", offload_folder=f"{folder}/offload",
                                     max_memory={0: "250KB", 1: "250KB", "cpu": "200KB"})
assert "disk" in set(m.hf_device_map.values()), m.hf_device_map
with torch.no_grad():
    torch.testing.assert_close(m(ids.to("tpu:0")).logits.cpu(), want)
print("ok disk", m.hf_device_map)

# An unknown device is refused as accelerate refuses it.
del m
gc.collect()  # accelerate's hooks and the model refer to each other
try:
    LlamaForCausalLM.from_pretrained(f"{folder}/model", device_map="auto", max_memory={5: "1MB", "cpu": "1GB"})
    raise AssertionError("device 5 was accepted")
except ValueError as e:
    assert "tpu devices are [0, 1]" in str(e), e
print("ok unknown device")
