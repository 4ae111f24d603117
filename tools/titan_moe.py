"""A TorchTitan config registry for a Qwen3 mixture-of-experts model small enough to train on a
2-core host: TorchTitan's own `qwen3_moe_debug` recipe (its MoE layers, router, load-balancing
hook, AdamW) with 2 layers of 8 experts (top 2) at width 64 instead of 8 layers of 64 experts at
width 256, and varlen attention (flex attention needs Triton's GPU compiler).

    torchrun ... -m torch_tpu.titan --module titan_moe --config qwen3_moe_tiny \\
        --parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2

(with tools/ on PYTHONPATH; tests/python/test_torchtitan.py runs it with EP 2 against 1 rank)."""

from __future__ import annotations


def qwen3_moe_tiny():
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3 import Qwen3Model, config_registry, model_registry

    config = config_registry.qwen3_moe_debug()
    dim, head_dim, vocab = 64, 16, 2048
    spec = model_registry("debugmodel_moe", attn_backend="varlen")
    spec.model = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim,
                                             moe_hidden_dim=128, num_experts=8, top_k=2, attn_backend="varlen",
                                             moe_comm_backend="standard",
                                             rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0)),
    )
    config.model_spec = spec
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(spec)
    config.training.seq_len = 64
    config.training.disable_cuda_graphs = True
    return config
