"""TorchTitan on tpu: ``torchrun ... -m torch_tpu.titan <torchtitan.train arguments>``.

TorchTitan (0.3.0 on PyPI) runs unchanged; this entry point only bridges what that release
expects from a newer torch than 2.13: it calls ``torch.distributed.set_timeout`` after the
first step, which torch 2.13 has under the name ``distributed_c10d._set_pg_timeout``. The
alias is added only where the public name is missing. Use ``--module llama3 --config
llama3_debugmodel_varlen_attn --parallelism.spmd_backend partial_dtensor`` (README says why).
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    import torch.distributed as dist

    import torch_tpu  # noqa: F401  (the tpu device and tpu_dist)

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
