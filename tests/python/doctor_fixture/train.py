# A fixture for test_doctor.py: one example of every finding kind, each on a line the test names.
# "cuda" in a comment is not a finding.
"""Nor is "cuda" in a docstring."""
import torch
import torch.distributed as dist
import torch.nn as nn
from flash_attn import flash_attn_func  # TPU004
from torch.utils.cpp_extension import load_inline


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1000, 300)  # TPU009
        self.head = nn.Linear(256, 512)


def main():
    device = torch.device("cuda")  # TPU001
    torch.backends.cudnn.benchmark = True  # TPU007
    model = Net().cuda()  # TPU002
    x = torch.randn(4, 1000, device="cuda:0")  # TPU001
    torch.cuda.synchronize()  # TPU003
    torch.cuda.manual_seed(0)  # TPU003
    s = torch.cuda.Stream()  # TPU008
    dist.init_process_group(backend="nccl")  # TPU006
    ext = load_inline("k", cpp_sources="", cuda_sources="__global__ void k() {}")  # TPU005
    return model, x, device, s, ext
