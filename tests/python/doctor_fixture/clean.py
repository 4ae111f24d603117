# A fixture for test_doctor.py: code that looks like a kernel, an extension build or a library call
# and is none of them. No finding here.
import json
import pickle

import torch
from torch.utils.cpp_extension import include_paths


def jit(fn):  # the project's own decorator of that name
    return fn


@jit
def step(x):
    return x * 2


def load(path):  # the project's own load
    with open(path) as f:
        return json.load(f)


def main():
    handlers = {(1,): step}
    grid = (1,)
    y = handlers[grid](torch.ones(2))  # a dict indexed with [grid], called
    config = load("config.json")
    with open("cache.pkl", "rb") as f:
        cache = pickle.load(f)
    state = torch.load("model.pt")
    return y, config, cache, state, include_paths()
