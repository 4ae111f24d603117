"""One thread runs eager tpu ops (a data prefetcher: .to("tpu"), arithmetic, .item(), a
conj resolved on the device) while the main thread makes the first calls of
torch.compile(backend="tpu") functions. Prints "ok" when both finish and the prefetcher's
results equal the same computation run alone, bitwise."""

import sys
import threading

import torch

import torch_tpu


def step(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(128, 32, generator=g).to("tpu")
    y = (x * 2 + 1).tanh().sum(0)
    c = torch.complex(x[:2, :2], x[:2, :2]).conj() * 1j
    return y.cpu(), c.cpu(), (x @ x.T).trace().item()


def run(steps, out):
    for i in range(steps):
        out.append(step(i))


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    results = []
    t = threading.Thread(target=run, args=(steps, results), daemon=True)
    t.start()
    for i in range(3):
        m = torch.nn.Sequential(torch.nn.Linear(16 + i, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).to("tpu")
        f = torch.compile(m, backend="tpu")
        for _ in range(2):
            f(torch.randn(4, 16 + i, device="tpu")).sum().backward()
    t.join(120)
    assert not t.is_alive(), "the eager thread hung"
    alone = []
    run(steps, alone)
    assert len(results) == steps
    # In strict mode the eager thread's ops stay strict while the other thread records:
    # bitwise what they give alone. In fused mode they run strict during a recording and
    # fused otherwise, so only close.
    strict = torch_tpu.get_mode() == "strict"
    for (a, b, c), (d, e, f_) in zip(results, alone):
        if strict:
            assert torch.equal(a, d) and torch.equal(b, e) and c == f_, "the eager thread's results differ"
        else:
            torch.testing.assert_close((a, b, torch.tensor(c)), (d, e, torch.tensor(f_)))
    print("ok")
