"""``torch_tpu._internal``: the module paths other libraries import from Google's TorchTPU
(TorchRec's Pallas kernels and benchmarks, Helion, vLLM's TorchTPU runner), answered by
torch_tpu's own machinery:

- ``pallas``: ``jax_op`` (JAX and Pallas functions as PyTorch ops, through
  ``torch_tpu.kernels``);
- ``sync``: ``synchronize``;
- ``execution_mode``: ``EagerMode``, ``eager_mode``, ``set_eager_mode`` (torch_tpu's modes);
- ``profiler``: ``profile`` and ``xprof_trace_handler`` over ``torch.profiler``;
- ``compile``: importing it registers the ``tpu`` backend of torch.compile;
- ``utils.hardware``: the TPU's name and topology.
"""
