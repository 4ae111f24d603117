"""torch_tpu's SGLang platform without an engine (the gate's test): SGLang
resolves it from the entry point; its attention backend, over its KV pool,
equals attention computed on the CPU for an extend batch with a cached
prefix (as the radix cache gives) beside a decode request, grouped-query
heads, with TORCH_TPU_FALLBACK=error; the decode graph runner's buckets."""
import types

import pytest

pytest.importorskip("sglang", reason="SGLang's environment: scripts/setup_sglang.sh")

import torch  # noqa: E402


def test_sglang_resolves_the_tpu_platform():
    from sglang.srt.platforms import current_platform
    from sglang.srt.utils.common import get_device

    assert type(current_platform).__module__ == "torch_tpu.sglang.platform"
    assert current_platform.is_out_of_tree() and current_platform.device_type == "tpu"
    assert get_device() == "tpu"
    assert current_platform.get_torch_distributed_backend_str() == "tpu_dist"
    assert current_platform.get_default_attention_backend() == "tpu"
    current_platform.init_backend()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert "tpu" in ATTENTION_BACKENDS


def reference(q, k, v, scale):
    """Causal attention of q [n, Hq, D] (the last n of len(k) positions) over k, v [len, Hk, D]."""
    n, hq, _ = q.shape
    total, hk, _ = k.shape
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos = torch.arange(total - n, total)[:, None]
    scores = scores.masked_fill(torch.arange(total)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_attention_backend_equals_cpu_attention():
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from torch_tpu.sglang.attention import TpuAttnBackend, TpuMHATokenToKVPool

    torch.manual_seed(0)
    hq, hk, d, slots = 4, 2, 16, 64
    pool = TpuMHATokenToKVPool(slots, page_size=1, dtype=torch.float32, head_num=hk, head_dim=d, layer_num=1,
                               device="tpu", enable_memory_saver=False)
    # Request 0: 5 tokens already cached (slots 10..14, a shared prefix) and 3 new ones;
    # request 1: 6 tokens cached, one new (decode). req_to_token rows 1 and 2.
    lens = [(5, 3), (6, 1)]
    slots_of = [list(range(10, 18)), [30, 31, 32, 33, 34, 35, 40]]
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    for r, s in enumerate(slots_of):
        req_to_token[r + 1, : len(s)] = torch.tensor(s, dtype=torch.int32)
    keys = [torch.randn(len(s), hk, d) for s in slots_of]
    values = [torch.randn(len(s), hk, d) for s in slots_of]
    runner = types.SimpleNamespace(device="tpu", token_to_kv_pool=pool,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token.to("tpu")))
    backend = TpuAttnBackend(runner)
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=hq, tp_k_head_num=hk, qk_head_dim=d, v_head_dim=d,
                                  scaling=d ** -0.5, sliding_window_size=-1, logit_cap=0.0, is_cross_attention=False,
                                  attn_type=AttentionType.DECODER)
    # The cached prefixes: written as an earlier step would have.
    cached_loc = torch.tensor([s for (c, _), ss in zip(lens, slots_of) for s in ss[:c]])
    pool.set_kv_buffer(layer, cached_loc.to("tpu"),
                       torch.cat([k[:c] for (c, _), k in zip(lens, keys)]).to("tpu"),
                       torch.cat([v[:c] for (c, _), v in zip(lens, values)]).to("tpu"))
    # This step: the new tokens of both requests.
    new_loc = torch.tensor([s for (c, n), ss in zip(lens, slots_of) for s in ss[c:c + n]])
    q = [torch.randn(n, hq, d) for _, n in lens]
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=2, out_cache_loc=new_loc.to("tpu"),
        req_pool_indices=torch.tensor([1, 2]).to("tpu"), seq_lens=torch.tensor([c + n for c, n in lens]).to("tpu"),
        extend_seq_lens_cpu=[n for _, n in lens])
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(
        torch.cat(q).reshape(-1, hq * d).to("tpu"),
        torch.cat([k[c:] for (c, _), k in zip(lens, keys)]).to("tpu"),
        torch.cat([v[c:] for (c, _), v in zip(lens, values)]).to("tpu"), layer, fb)
    expected = torch.cat([reference(qi, k, v, d ** -0.5) for qi, k, v in zip(q, keys, values)])
    torch.testing.assert_close(out.cpu().view(-1, hq, d), expected, rtol=1e-4, atol=1e-4)
    # The pool's key and value views read what was written.
    torch.testing.assert_close(pool.get_key_buffer(0)[torch.tensor(slots_of[1])].cpu(), keys[1])
    torch.testing.assert_close(pool.get_value_buffer(0)[torch.tensor(slots_of[0])].cpu(), values[0])


def test_graph_runner_buckets():
    from torch_tpu.sglang.graph_runner import bucket

    assert [bucket(n, 16) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, 16]
