"""Google's TorchTPU runtime for serialized Pallas (Mosaic) kernels, which Inductor's Pallas
code for ``tpu`` and Helion's launcher import. torch_tpu has no such runtime: importing this
module raises an ImportError that says so (Helion then uses its own launcher; Inductor never
generates this code here, since torch.compile on tpu tensors compiles with torch_tpu's backend).
Pallas kernels run on tpu through ``torch_tpu._internal.pallas.jax_op`` or
``torch_tpu.kernels.jax_op``."""

raise ImportError(
    "torch_tpu._internal.pallas.tpu_torch_pallas is Google's TorchTPU runtime for serialized Mosaic kernels on a "
    "TPU; torch_tpu does not have it. Run Pallas kernels through torch_tpu._internal.pallas.jax_op (or "
    "torch_tpu.kernels.jax_op); torch.compile on tpu tensors compiles with torch_tpu's backend.")
