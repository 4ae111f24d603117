# A fixture for test_doctor.py that runs: CUDA-only as written, on any device after --fix.
import json
import sys

import torch

torch.manual_seed(0)
w = torch.randn(8, 8).cuda()  # TPU002
x = torch.randn(4, 8).to("cuda")  # TPU001
y = torch.tanh(x @ w).sum(0)
if x.device.type == "cuda":  # TPU001
    y = y * 2
torch.cuda.synchronize()  # TPU003
json.dump({"device": str(y.device), "y": y.cpu().tolist()}, sys.stdout)
