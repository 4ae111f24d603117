#!/usr/bin/env python
"""Model zoo: every (model type, model class) of the installed transformers, on tpu vs the CPU.

For each model type registered in transformers' auto mappings and each model class offered
for it (base model, causal LM, masked LM, sequence classification, ...), the zoo

  1. derives a tiny config from the type's defaults (2 layers, hidden 32, 2 heads, small
     feed-forward and expert counts, vocabulary cut to 99 or just past the largest special
     token; sub-configs of multimodal models shrunk the same way; where the architecture's
     rules refuse that, the tiny widths at the default depth, then wider ones, then the
     default widths at 2 layers: SIZE_LEVELS),
  2. builds the model on the CPU from seed 0 (eval mode, float32; parameters initialised to
     one constant, such as zero MoE routers, get small seeded noise so that top-k has no
     ties) and inputs for its modality (token ids, pixel values, audio waveforms or
     features, bounding boxes, decoder ids, multiple-choice ids), taking the first set of
     candidate inputs the CPU runs,
  3. runs it on the CPU, then a copy of it on tpu in strict eager and again in fused eager,
     and compares every floating-point output with the CPU's within ``ATOL + RTOL * |cpu|``
     elementwise (integer and boolean outputs must be equal); an output beyond that still
     agrees when it is no further from the model's float64 result on the CPU than twice the
     CPU's own float32 result is (deep convolution stacks drift that far on the CPU too),
  4. for causal LMs, runs one training step (loss with labels, backward) in both modes and
     compares the loss and every parameter's gradient with the CPU's the same way.

Each (type, class, mode) ends in one status:

    pass       outputs (and for causal LMs the loss and gradients) agree with the CPU
    mismatch   an output differs beyond the tolerance (the largest difference is recorded)
    error      tpu raised where the CPU ran
    crash      the worker process died or stayed silent past the timeout
    skip       the CPU itself could not build or run the model with the derived config and
               inputs (the reason is recorded); these pairs are outside the denominators

Ops without a lowering run through the CPU fallback; the record lists them (``fallbacks``),
so the report gives both "runs" and "runs natively". Models whose eval forward draws random
numbers (CPU outputs differ between two seeds) are compared on shapes and dtypes only
(``random_forward``).

    python tools/model_zoo.py --shard 0/2 --out /tmp/zoo0.json
    python tools/model_zoo.py --types llama,bert,vit --out /tmp/zoo.json
    python tools/model_zoo.py --report /tmp/zoo0.json /tmp/zoo1.json --md docs/model_zoo.md
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_pool import REPO_ROOT, _git, machine_info, read_list, run_units  # noqa: E402

# Agreement with the CPU for float32 outputs: |tpu - cpu| <= ATOL + RTOL * |cpu| elementwise.
# PyTorch's assert_close default for float32 is rtol 1.3e-6, atol 1e-5 per op; a model chains
# tens of ops (matmuls summing in another order, exp/log/tanh from another math library), so
# the zoo allows about two orders of magnitude more, which is still far below what a wrong
# lowering produces (typically O(1) on these randomly initialised models).
ATOL = 1e-4
RTOL = 1e-3
MODES = ("strict", "fused")
MSG_LIMIT = 400

BATCH = 2
SEQ = 8
DECODER_SEQ = 4
AUDIO_SAMPLES = 4000
TINY = {"hidden": 32, "layers": 2, "heads": 2, "ffn": 64, "vocab": 99, "experts": 4}

# ----------------------------------------------------------------------------------------
# Enumeration
# ----------------------------------------------------------------------------------------


def enumerate_pairs(types=None):
    """[(model_type, class_name, [task, ...])] over transformers' auto model mappings."""
    from transformers.models.auto import modeling_auto

    pairs: dict[tuple[str, str], list[str]] = {}
    for name in sorted(dir(modeling_auto)):
        if not (name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")):
            continue
        task = name[len("MODEL_"):-len("_MAPPING_NAMES")].lower() or "base"
        task = task[len("for_"):] if task.startswith("for_") else task
        task = "base" if task == "mapping" else task
        for model_type, classes in getattr(modeling_auto, name).items():
            if types and model_type not in types:
                continue
            for cls in classes if isinstance(classes, (list, tuple)) else [classes]:
                pairs.setdefault((model_type, cls), []).append(task)
    return [(t, c, sorted(tasks)) for (t, c), tasks in sorted(pairs.items())]


def select_pairs(wanted):
    """The pairs named by "type" (every class of it) or "type:Class" entries; raises
    ValueError for an entry this transformers does not offer."""
    pairs = enumerate_pairs({w.split(":")[0] for w in wanted})
    picked = [p for p in pairs if p[0] in wanted or f"{p[0]}:{p[1]}" in wanted]
    missing = [w for w in wanted if not any(w in (p[0], f"{p[0]}:{p[1]}") for p in picked)]
    if missing:
        raise ValueError(f"not offered by this transformers: {', '.join(missing)}")
    return picked


# ----------------------------------------------------------------------------------------
# Tiny configs
# ----------------------------------------------------------------------------------------

_LAYER_KEYS = {
    "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
    "num_decoder_layers", "num_encoder_layers", "num_blocks", "depth", "encoder_depth",
    "decoder_depth", "num_text_layers", "num_vision_layers", "num_cross_attention_layers",
    "decoder_num_hidden_layers", "num_backbone_layers",
}
_WIDTH_KEYS = {
    "hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "projection_dim",
    "embedding_size", "text_embed_dim", "vision_embed_dim", "decoder_hidden_size",
    "encoder_hidden_size", "word_embed_proj_dim", "d_embed", "output_hidden_size",
    "projection_hidden_size", "proj_dim", "hidden_channels", "codevector_dim",
    "proj_codevector_dim", "classifier_proj_size", "xvector_output_dim", "pooler_output_size",
}
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
    "decoder_attention_heads", "decoder_num_attention_heads", "num_key_value_heads",
    "num_kv_heads", "n_kv_heads", "encoder_num_attention_heads", "linear_num_heads",
    "mamba_n_heads",
}
_FFN_KEYS = {
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_intermediate_size",
    "d_inner", "ffn_hidden_size", "mlp_dim", "dim_feedforward", "encoder_ffn_dim",
}
_HEAD_DIM_KEYS = {"head_dim", "d_kv", "attention_head_size", "d_head", "kv_channels",
                  "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rotary_dim",
                  "linear_head_dim", "mamba_d_head"}
_LORA_RANK_KEYS = {"kv_lora_rank", "q_lora_rank"}  # multi-head latent attention
_EXPERT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_EXPERT_PICK_KEYS = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k",
                     "num_experts_per_token"}
_LIST_WIDTH_KEYS = {"hidden_sizes", "conv_dim", "embed_dims", "dims", "channels",
                    "neck_hidden_sizes", "tdnn_dim"}
_LIST_DEPTH_KEYS = {"depths", "num_layers_per_stage", "layers_per_stage"}
_LIST_HEADS_KEYS = {"num_heads", "num_attention_heads", "heads"}


def _token_ids(d):
    ids = []
    for k, v in d.items():
        if ("token_id" in k or "token_index" in k or k.endswith("_token")) and not isinstance(v, bool):
            if isinstance(v, int):
                ids.append(v)
            elif isinstance(v, (list, tuple)):
                ids.extend(x for x in v if isinstance(x, int))
    return ids


def _mrope_section(rope: dict, d: dict, tiny: dict, sec=(16, 24, 24)) -> dict:
    """Multimodal rotary sections (temporal, height, width) scaled to add up to half the
    tiny head dim's rotary part; modeling code assumes [16, 24, 24] when they are absent."""
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    half = int(tiny["hidden"] // tiny["heads"] * factor) // 2
    sec = rope.get("mrope_section") or list(sec)
    new = [max(1, x * half // sum(sec)) for x in sec]
    new[-1] += half - sum(new)
    return dict(rope, mrope_section=new)


def _shrink(d: dict, tiny: dict, cls=None) -> dict:
    """The keys of a config dict to override for a tiny model (sub-configs recursively).
    Besides the known names, any other size equal to the default hidden size follows the
    hidden size (codebook, projection and adapter widths that must equal it)."""
    TINY = tiny  # noqa: N806
    out = {}
    hidden = next((d[k] for k in ("hidden_size", "d_model", "n_embd") if isinstance(d.get(k), int)
                   and not isinstance(d.get(k), bool)), None)
    has_experts = any(k in d for k in _EXPERT_PICK_KEYS)
    for k, v in d.items():
        if v is None and has_experts and k in _EXPERT_KEYS:  # left unset by the defaults
            out[k] = TINY["experts"]
        elif v is None and has_experts and k in _EXPERT_PICK_KEYS:
            out[k] = 2
        elif v is None and k == "head_dim" and "num_attention_heads" in d:  # code reads it
            out[k] = TINY["hidden"] // TINY["heads"]
        elif v is None and k == "num_key_value_heads" and "num_attention_heads" in d:
            out[k] = TINY["heads"]
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, dict) and "model_type" in v:
            from transformers import CONFIG_MAPPING

            sub_cls = (getattr(cls, "sub_configs", None) or {}).get(k)
            if sub_cls is None or sub_cls.__name__ == "AutoConfig":
                sub_cls = CONFIG_MAPPING[v["model_type"]] if v["model_type"] in CONFIG_MAPPING \
                    else None
            out[k] = {"model_type": v["model_type"], **_shrink(v, tiny, sub_cls)}
        elif isinstance(v, dict) and k in ("rope_parameters", "rope_scaling") and (
                isinstance(v.get("mrope_section"), list) or
                "mrope_section" in getattr(cls, "ignore_keys_at_rope_validation", ())):
            out[k] = _mrope_section(v, d, TINY)
        elif isinstance(v, int):
            if k in _LAYER_KEYS:
                if TINY["layers"] is not None and v > TINY["layers"]:
                    out[k] = TINY["layers"]
            elif (k in _WIDTH_KEYS or k.endswith("_hidden_size")) and v > TINY["hidden"]:
                out[k] = TINY["hidden"]  # text_/audio_/out_hidden_size must match a hidden size
            elif k in _HEAD_KEYS and v > TINY["heads"]:
                out[k] = TINY["heads"]
            elif k in _FFN_KEYS and v > TINY["ffn"]:
                out[k] = TINY["ffn"]
            elif k in _HEAD_DIM_KEYS and v > TINY["hidden"] // TINY["heads"]:
                out[k] = TINY["hidden"] // TINY["heads"]
            elif k in _LORA_RANK_KEYS and v > TINY["hidden"]:
                out[k] = TINY["hidden"]
            elif k in _EXPERT_KEYS and v > TINY["experts"]:
                out[k] = TINY["experts"]
            elif k in _EXPERT_PICK_KEYS and v > 2:
                out[k] = 2
            elif hidden is not None and v == hidden and v > TINY["hidden"] and \
                    "token" not in k and "vocab" not in k and "position" not in k:
                out[k] = TINY["hidden"]
        elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool)
                                               for x in v):
            if k in _LIST_DEPTH_KEYS:
                out[k] = [1] * len(v)
            elif k in _LIST_HEADS_KEYS:
                out[k] = [min(x, TINY["heads"]) for x in v]
            elif k in _LIST_WIDTH_KEYS and max(v) > TINY["hidden"]:
                top = max(v)
                out[k] = [max(8, (x * TINY["hidden"] * 2 // top) // 8 * 8) for x in v]
    for vk in [k for k in d if k.startswith("vocab_size")]:  # also vocab_size_per_layer_input
        if isinstance(d[vk], int) and not isinstance(d[vk], bool) and d[vk] > TINY["vocab"]:
            need = max([TINY["vocab"] - 1] + [i for i in _token_ids(d) if i < d[vk]])
            out[vk] = need + 1
    for exp_k, heads_k, hd_k in (("expand", "num_heads", "head_dim"),
                                 ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        if all(isinstance(d.get(k), int) for k in (exp_k, heads_k, hd_k, "hidden_size")):
            # Mamba-2 blocks: hidden_size * expand == heads * head_dim
            hd = out.get(hd_k, d[hd_k])
            out[heads_k] = max(1, out.get("hidden_size", d["hidden_size"]) * d[exp_k] // hd)
    if "qk_head_dim" in d:  # derived: nope + rope parts
        out["qk_head_dim"] = out.get("qk_nope_head_dim", d.get("qk_nope_head_dim", 0)) + \
            out.get("qk_rope_head_dim", d.get("qk_rope_head_dim", 0))
    if any(k in out for k in _EXPERT_KEYS):  # expert groups must divide the experts
        for k in ("n_group", "topk_group"):
            if isinstance(d.get(k), int) and d[k] > 1:
                out[k] = 1
    # Key/value heads must divide the attention heads.
    for kv in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if kv in out or kv in d:
            heads = out.get("num_attention_heads", d.get("num_attention_heads"))
            cur = out.get(kv, d.get(kv))
            if isinstance(heads, int) and isinstance(cur, int) and heads % cur:
                out[kv] = 1
    return out


# Tried in order until the config validates and the CPU runs the model: the tiny sizes; the
# tiny widths at the default depth (configs that name layer indices, e.g. the backbone stages a
# DPT neck reads); wider ones for architectures with stricter divisibility rules; then the
# default widths with only the depth cut (accepted when the model stays under MAX_PARAMS).
SIZE_LEVELS = (TINY, dict(TINY, layers=None), dict(TINY, hidden=64, heads=4, ffn=128),
               dict(TINY, hidden=128, heads=8, ffn=256), None)
MAX_PARAMS = 60_000_000


def tiny_config(model_type: str, level: int = 0, cls=None):
    """The tiny config of ``model_type`` at a SIZE_LEVELS level; ``cls``: the config class
    when the model class wants another than the type's (Llama4ForCausalLM takes the text
    config of the multimodal llama4 type)."""
    from transformers import CONFIG_MAPPING

    cls = cls or CONFIG_MAPPING[model_type]
    tiny = SIZE_LEVELS[level]
    if tiny is None:
        defaults = cls().to_dict()

        def depth_only(d):
            out = {}
            for k, v in d.items():
                if isinstance(v, dict) and "model_type" in v:
                    out[k] = {"model_type": v["model_type"], **depth_only(v)}
                elif isinstance(v, int) and not isinstance(v, bool) and k in _LAYER_KEYS and \
                        v > TINY["layers"]:
                    out[k] = TINY["layers"]
            return out

        config = cls(**depth_only(defaults))
    else:
        config = cls(**_shrink(cls().to_dict(), tiny, cls))
    for c in (config, getattr(config, "text_config", None)):
        # Sequence classifiers need a pad token to find each row's last token.
        if c is not None and getattr(c, "pad_token_id", None) is None:
            c.pad_token_id = 0
    if getattr(config, "is_encoder_decoder", False) and \
            getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------


def _sub(config, *names):
    for n in names:
        sub = getattr(config, n, None)
        if sub is not None:
            return sub
    return None


def _first_attr(configs, names, default=None):
    for c in configs:
        if c is None:
            continue
        for n in names:
            v = getattr(c, n, None)
            if v is not None and not isinstance(v, bool):
                return v
    return default


def make_inputs(model, config, tasks):
    """Candidate inputs for the model's forward on the CPU, richest first: the zoo uses the
    first the CPU runs (e.g. token ids with pixel values for a dual encoder, then token ids
    alone for a model whose image tokens would have to be placed in the text)."""
    import torch

    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    g = torch.Generator().manual_seed(1)
    text_cfg = _sub(config, "text_config", "decoder") or config
    vision_cfg = _sub(config, "vision_config", "encoder") or config
    vocab = _first_attr([text_cfg, config], ["vocab_size"], TINY["vocab"])
    base = {}

    def ids(*shape):
        return torch.randint(3, max(4, vocab), shape, generator=g)

    def pixels():
        size = _first_attr([vision_cfg, config], ["image_size", "img_size", "input_size"], 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        size = size[-2:] if len(size) >= 2 else (size[0], size[0])
        chans = _first_attr([vision_cfg, config], ["num_channels", "in_channels", "in_chans"], 3)
        frames = _first_attr([vision_cfg, config], ["num_frames"], None)
        shape = (BATCH, chans, *size) if frames is None else (BATCH, frames, chans, *size)
        return torch.randn(shape, generator=g)

    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if main == "input_ids" or ("input_ids" in params and main not in params) or \
            "input_ids" in required:
        shape = (BATCH, 2, SEQ) if "multiple_choice" in tasks else (BATCH, SEQ)
        base["input_ids"] = ids(*shape)
        eos = _first_attr([text_cfg, config], ["eos_token_id"], None)
        if "sequence_classification" in tasks and isinstance(eos, int) and 0 <= eos < vocab:
            base["input_ids"][..., -1] = eos  # encoder-decoder classifiers pool at the eos
        if "attention_mask" in params:
            base["attention_mask"] = torch.ones(shape, dtype=torch.long)
    if main == "pixel_values" or "pixel_values" in required:
        base["pixel_values"] = pixels()
    if "bbox" in params and "input_ids" in base:  # layout models: boxes (x0, y0, x1, y1)
        corners = torch.randint(0, 500, (*base["input_ids"].shape, 2, 2), generator=g)
        base["bbox"] = torch.cat([corners.min(-2).values, corners.max(-2).values + 1], -1)
    audio = []
    if main == "input_values":  # waveforms (batch, samples) or (batch, channels, samples)
        audio = [{"input_values": torch.randn(BATCH, n, generator=g)}
                 for n in (AUDIO_SAMPLES, 4 * AUDIO_SAMPLES)]
        chans = _first_attr([config], ["audio_channels", "num_channels"], 1)
        audio.append({"input_values": torch.randn(BATCH, chans, AUDIO_SAMPLES, generator=g)})
        mels = _first_attr([config], ["num_mel_bins"], None)
        if mels is not None:  # spectrogram transformers: (batch, frames, mel bins)
            frames = _first_attr([config], ["max_length"], 4 * SEQ)
            audio.append({"input_values": torch.randn(BATCH, frames, mels, generator=g)})
    if main == "input_features":
        mels = _first_attr([config], ["num_mel_bins", "feature_size", "input_feat_per_channel"], 80)
        src = _first_attr([config], ["max_source_positions"], None)
        chans = _first_attr([config], ["input_channels"], 1)
        if src is not None:  # whisper-like: (batch, mel bins, 2 * max_source_positions)
            audio.append({"input_features": torch.randn(BATCH, mels, 2 * src, generator=g)})
        audio.append({"input_features": torch.randn(BATCH, 4 * SEQ, mels * chans, generator=g)})
        audio.append({"input_features": torch.randn(BATCH, mels, 4 * SEQ, generator=g)})
    if main not in base and not audio and main != "input_ids":
        raise _Skip(f"no input recipe for main input {main!r}")
    if "decoder_input_ids" in params and (getattr(config, "is_encoder_decoder", False) or
                                          "decoder_input_ids" in required):
        dvocab = _first_attr([_sub(config, "decoder"), config], ["vocab_size"], vocab)
        base["decoder_input_ids"] = torch.randint(3, max(4, dvocab), (BATCH, DECODER_SEQ),
                                                  generator=g)
    if "use_cache" in params:
        base["use_cache"] = False
    candidates = [dict(base, **a) for a in audio] or [base]
    if "pixel_values" in params and "pixel_values" not in base:
        candidates = [dict(c, pixel_values=pixels()) for c in candidates] + candidates
    if "decoder_input_ids" in base:  # some heads derive them from input_ids themselves
        candidates += [{k: v for k, v in c.items() if k != "decoder_input_ids"}
                       for c in candidates]
    return candidates


class _Skip(Exception):
    pass


# ----------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:MSG_LIMIT]


def _flatten(obj, path="out", acc=None):
    import torch

    acc = [] if acc is None else acc
    if isinstance(obj, torch.Tensor):
        acc.append((path, obj))
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for k, v in obj.items():
            _flatten(v, f"{path}.{k}", acc)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{path}[{i}]", acc)
    return acc


def _to(obj, device):
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _wide(t):
    import torch

    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def compare(ref, out, meta_only=False, ref64=None):
    """(None, largest difference) if they agree, else (message, largest difference).

    A float output agrees when |out - ref| <= ATOL + RTOL * |ref| elementwise, or, given
    ``ref64`` (the same model run in float64 on the CPU), when out is no further from the
    float64 result than twice the CPU's own float32 result is (plus ATOL): deep stacks of
    convolutions drift from float64 by more than the elementwise tolerance on the CPU too.
    """
    import torch

    ref_t, out_t = _flatten(ref), _flatten(out)
    if [p for p, _ in ref_t] != [p for p, _ in out_t]:
        return "output structure differs", float("inf")
    wide = dict(_flatten(ref64)) if ref64 is not None else {}
    worst = 0.0
    for (path, r), (_, o) in zip(ref_t, out_t):
        o = o.detach().to("cpu")
        r = r.detach()
        if r.shape != o.shape or r.dtype != o.dtype:
            return f"{path}: {tuple(o.shape)} {o.dtype} vs CPU {tuple(r.shape)} {r.dtype}", worst
        if meta_only or r.numel() == 0:
            continue
        if r.is_floating_point() or r.is_complex():
            r64, o64 = _wide(r), _wide(o)
            both_nan = torch.isnan(r64) & torch.isnan(o64)
            diff = (r64 - o64).abs().masked_fill(both_nan, 0)
            diff = diff.masked_fill(torch.isinf(r64) & (r64 == o64), 0)
            bad = ~(diff <= ATOL + RTOL * r64.abs())
            d = float(diff.nan_to_num(float("inf")).max())
            worst = max(worst, d)
            if not bool(bad.any()):
                continue
            msg = (f"{path}: max |diff| {d:.3g} ({int(bad.sum())}/{r.numel()} elements "
                   f"beyond {ATOL:g} + {RTOL:g}*|cpu|)")
            w = wide.get(path)
            if w is not None and w.shape == r.shape:
                w = _wide(w.detach())
                cpu_err = float((r64 - w).abs().nan_to_num(0).max())
                tpu_err = float((o64 - w).abs().nan_to_num(float("inf")).max())
                if tpu_err <= 2 * cpu_err + ATOL:
                    continue
                msg += f"; from float64: tpu {tpu_err:.3g}, CPU {cpu_err:.3g}"
            return msg, worst
        elif not torch.equal(r, o):
            return f"{path}: {int((r != o).sum())}/{r.numel()} elements differ", worst
    return None, worst


def _float64_run(model, inputs, fn):
    """fn(model, inputs) on a float64 copy of the model on the CPU; None if it cannot."""
    import copy

    import torch

    try:
        m64 = copy.deepcopy(model).double()
        i64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
               for k, v in inputs.items()}
        return fn(m64, i64)
    except Exception:  # noqa: BLE001
        return None


def _seed_all(seed):
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def _fallbacks():
    import torch_tpu

    return dict(torch_tpu.metrics().get("fallbacks", {}))


def _fallback_delta(before, after):
    return sorted(k for k, v in after.items() if v > before.get(k, 0))


def _run_forward(model, inputs, seed=0):
    import torch

    _seed_all(seed)
    with torch.no_grad():
        return model(**inputs)


def _train_step(model, inputs):
    """Loss and gradients in eval mode: dropout would draw different random numbers on tpu."""
    labels = inputs["input_ids"]
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.detach(), "grads": grads}


def _break_ties(model):
    """Adds small seeded noise to parameters initialised to one constant (zero routers,
    unit norms): a zero MoE router scores every expert the same, and which of tied experts
    top-k picks is unspecified (the CPU and CUDA differ), so outputs would not be
    comparable. Trained checkpoints have no such ties."""
    import torch

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    return model


def _param_count(cls, config):
    """Parameters of cls(config), counted on the meta device (None if it cannot build there)."""
    import torch

    try:
        with torch.device("meta"):
            return sum(p.numel() for p in cls(config).parameters())
    except Exception:  # noqa: BLE001
        return None


def _build_on_cpu(model_type, cls_name, tasks):
    """The first (config, inputs) candidate the CPU builds and runs: (model, config, inputs,
    CPU outputs, size level). ``model`` is a copy taken before the CPU forward (some models
    cache tensors in plain attributes on their first forward, which ``.to()`` would not
    move). Raises the first candidate's error when none runs."""
    import copy

    import transformers

    cls = getattr(transformers, cls_name)
    config_cls = getattr(cls, "config_class", None)
    first_error = None
    for level in range(len(SIZE_LEVELS)):
        try:
            config = tiny_config(model_type, level, config_cls)
            n = _param_count(cls, config)
            if n is None and SIZE_LEVELS[level] is None:  # default widths: could be billions
                raise _Skip("cannot count the parameters at the default widths (meta device)")
            if n is not None and n > MAX_PARAMS:  # the host has 24 GiB for two workers
                raise _Skip(f"{n / 1e6:.0f}M parameters at size level {level}")
            _seed_all(0)
            model = _break_ties(cls(config).eval())
            for inputs in make_inputs(model, config, tasks):
                pristine = copy.deepcopy(model)
                try:
                    return pristine, config, inputs, _run_forward(model, inputs), level
                except Exception as e:  # noqa: BLE001
                    first_error = first_error or e
        except Exception as e:  # noqa: BLE001
            first_error = first_error or e
    raise first_error


def run_pair(model_type, cls_name, tasks, modes):
    import copy

    import torch
    import torch_tpu
    import transformers

    rec = {"modes": {}}
    t0 = time.time()
    try:
        model, config, inputs, ref, level = _build_on_cpu(model_type, cls_name, tasks)
        rec["size_level"] = level
        again = _run_forward(copy.deepcopy(model), inputs, seed=1)  # model stays pristine
    except Exception as e:  # noqa: BLE001
        rec["status"] = "skip"
        rec["message"] = "CPU: " + _first_line(e)
        return rec
    meta_only = compare(ref, again)[0] is not None
    rec["random_forward"] = meta_only
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["inputs"] = {k: list(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    train = "causal_lm" in tasks and "input_ids" in inputs
    ref_train = None
    if train:
        try:
            tm = copy.deepcopy(model)
            _seed_all(0)
            ref_train = _train_step(tm, inputs)
            del tm
        except Exception as e:  # noqa: BLE001
            rec["train_skip"] = "CPU: " + _first_line(e)
    rec["cpu_seconds"] = round(time.time() - t0, 3)
    refs64 = {}  # float64 CPU results, computed on the first mismatch
    for mode in modes:
        t1 = time.time()
        m = {}
        before = _fallbacks()
        try:
            torch_tpu.set_mode(mode)
            dev = copy.deepcopy(model).to("tpu")
            dinputs = _to(inputs, "tpu")
            out = _run_forward(dev, dinputs)
            torch_tpu.sync()
            msg, worst = compare(ref, out, meta_only)
            if msg is not None and not meta_only:
                refs64["forward"] = refs64.get("forward") or _float64_run(model, inputs,
                                                                          _run_forward)
                msg, worst = compare(ref, out, meta_only, refs64["forward"])
                m["by_float64"] = msg is None  # agreed through the float64 criterion
            m["max_diff"] = worst
            if msg is None and ref_train is not None:
                _seed_all(0)
                got = _train_step(dev, dinputs)
                torch_tpu.sync()
                tmsg, tworst = compare(ref_train, got)
                if tmsg is not None:
                    refs64["train"] = refs64.get("train") or _float64_run(model, inputs,
                                                                          _train_step)
                    tmsg, tworst = compare(ref_train, got, False, refs64["train"])
                    m["by_float64"] = tmsg is None
                m["train_max_diff"] = tworst
                msg = None if tmsg is None else "training step: " + tmsg
            m["status"] = "pass" if msg is None else "mismatch"
            if msg:
                m["message"] = msg[:MSG_LIMIT]
            del dev, dinputs, out
        except Exception as e:  # noqa: BLE001
            m["status"] = "error"
            m["message"] = _first_line(e)
            tb = traceback.extract_tb(e.__traceback__)
            if tb:
                m["where"] = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}"
        finally:
            torch_tpu.set_mode("strict")
        m["fallbacks"] = _fallback_delta(before, _fallbacks())
        m["seconds"] = round(time.time() - t1, 3)
        rec["modes"][mode] = m
    rec["status"] = "ran"
    return rec


def worker_main(fd_out: int) -> None:
    import faulthandler
    import logging
    import warnings

    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warnings.filterwarnings("ignore")
    out = os.fdopen(fd_out, "w", buffering=1)

    def send(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    import torch

    try:
        import torch_tpu
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import torch_tpu
    import transformers

    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    # "error" (tests claiming native runs) makes an op without a lowering an error.
    torch_tpu.set_fallback(torch_tpu._env.get("TORCH_TPU_FALLBACK", "warn"))
    crash_on = torch_tpu._env.get("TORCH_TPU_ZOO_TEST_CRASH")  # tests of the crash isolation
    send({"type": "ready", "pid": os.getpid(), "torch_tpu": torch_tpu.__file__})
    for line in sys.stdin:
        if not line.strip():
            continue
        unit = json.loads(line)
        print(f"=== {unit['model_type']} {unit['cls']}", file=sys.stderr, flush=True)
        t0 = time.time()
        if unit["model_type"] == crash_on:
            os.abort()
        try:
            result = run_pair(unit["model_type"], unit["cls"], unit["tasks"], unit["modes"])
        except Exception as e:  # noqa: BLE001
            result = {"status": "skip", "message": "harness: " + _first_line(e), "modes": {}}
        result["seconds"] = round(time.time() - t0, 3)
        send({"type": "result", "result": result})


# ----------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------


def unit_key(u):
    return f"{u['model_type']}|{u['cls']}"


def run_zoo(pairs, modes=MODES, timeout=300.0, workers=1, partial_path=None, progress=None,
            snapshot=True, log_dir=None):
    units = [{"model_type": t, "cls": c, "tasks": tasks, "modes": list(modes)}
             for t, c, tasks in pairs]

    def record_of(u, res):
        if res.get("status") == "crash":  # the worker died: every mode of the pair
            res = {"status": "ran", "modes": {m: {"status": "crash", "message": res["message"]}
                                             for m in u["modes"]}, "seconds": res["seconds"]}
        return dict(model_type=u["model_type"], cls=u["cls"], tasks=u["tasks"], key=unit_key(u),
                    **res)

    return run_units(units, os.path.abspath(__file__), unit_key, record_of, workers=workers,
                     timeout=timeout, partial_path=partial_path, snapshot=snapshot,
                     progress=progress, log_dir=log_dir)


def mode_status(rec, mode):
    if rec["status"] == "skip":
        return "skip"
    return rec["modes"].get(mode, {}).get("status", "crash")


def summarize(results, modes=MODES):
    """Figures per mode over the pairs the CPU can run."""
    ran = [r for r in results.values() if r["status"] != "skip"]
    summary = {"pairs": len(results), "cpu_runnable": len(ran),
               "skipped": len(results) - len(ran), "modes": {},
               "by_float64": sum(1 for r in ran for m in r["modes"].values()
                                 if m.get("by_float64") and m.get("status") == "pass"),
               "random_forward": sum(1 for r in ran if r.get("random_forward"))}
    for mode in modes:
        counts = {}
        native = 0
        for r in ran:
            st = mode_status(r, mode)
            counts[st] = counts.get(st, 0) + 1
            if st == "pass" and not r["modes"][mode].get("fallbacks"):
                native += 1
        n = max(1, len(ran))
        runs = counts.get("pass", 0) + counts.get("mismatch", 0)
        summary["modes"][mode] = {
            "counts": counts, "runs_pct": round(100.0 * runs / n, 1),
            "agrees_pct": round(100.0 * counts.get("pass", 0) / n, 1),
            "native_agrees_pct": round(100.0 * native / n, 1), "native_pass": native,
        }
    return summary


def write_markdown(data, path):
    results = data["results"]
    s = summarize(results)
    meta = data["meta"]
    lines = [
        "# Hugging Face model zoo on tpu",
        "",
        f"Generated by `tools/model_zoo.py` on {meta['date']} at commit `{meta['commit'][:10]}`"
        f"{' (dirty)' if meta.get('dirty') else ''}; transformers {meta['transformers']}, "
        f"torch {meta['machine']['torch']}, {meta['machine']['cores']} cores "
        f"({meta['machine']['cpu']}), plugin {meta['machine']['plugin']}; "
        f"{meta['seconds'] / 60:.0f} min of worker time.",
        "",
        "Every (model type, model class) pair in transformers' auto mappings, built from a tiny "
        "config derived from the type's defaults (2 layers, hidden 32, 2 heads), run in eval "
        "mode on the CPU and on tpu (float32). Agreement: every floating-point output within "
        f"`{ATOL:g} + {RTOL:g} * |cpu|` elementwise, or, where the CPU's own float32 result is "
        "further than that from the float64 result, no further from float64 than twice the "
        f"CPU's error ({s['by_float64']} pairs x modes agreed this way); integer and boolean "
        "outputs equal; causal "
        "LMs also compare one training step's loss and every gradient the same way. A pair the "
        "CPU cannot run with the derived config and inputs is skipped (reason below) and is "
        "outside the percentages. \"Runs\" counts pass + mismatch (no error, no crash); "
        "\"natively\" means no op fell back to the CPU.",
        "",
        f"Pairs: {s['pairs']}; the CPU runs {s['cpu_runnable']}; skipped {s['skipped']}.",
        "",
        "| mode | runs (no error/crash) | agrees with the CPU | agrees, natively | pass | "
        "mismatch | error | crash |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, f in s["modes"].items():
        c = f["counts"]
        lines.append(f"| {mode} eager | **{f['runs_pct']}%** | **{f['agrees_pct']}%** | "
                     f"{f['native_agrees_pct']}% | {c.get('pass', 0)} | {c.get('mismatch', 0)} | "
                     f"{c.get('error', 0)} | {c.get('crash', 0)} |")
    lines += ["", "Targets: runs >= 98%, agrees >= 97%, in both modes.", ""]
    fb: dict[str, int] = {}
    for r in results.values():
        for op in r.get("modes", {}).get("strict", {}).get("fallbacks", []) or []:
            fb[op] = fb.get(op, 0) + 1
    if fb:
        lines += ["## Ops that fell back to the CPU (strict eager), by number of pairs", ""]
        lines += [", ".join(f"`{k}` {v}" for k, v in sorted(fb.items(), key=lambda kv: -kv[1]))]
        lines += [""]
    lines += ["## Pairs that did not pass", "",
              "| type | class | mode | status | message |", "| --- | --- | --- | --- | --- |"]
    for key in sorted(results):
        r = results[key]
        for mode in MODES:
            st = mode_status(r, mode)
            if st in ("pass", "skip"):
                continue
            msg = r["modes"].get(mode, {}).get("message", "").replace("|", "\\|")
            lines.append(f"| {r['model_type']} | {r['cls']} | {mode} | {st} | {msg[:200]} |")
    reasons: dict[str, list[str]] = {}
    for r in results.values():
        if r["status"] == "skip":
            reasons.setdefault(r.get("message", "")[:160], []).append(f"{r['model_type']}/{r['cls']}")
    lines += ["", "## Skipped: the CPU cannot run the derived config and inputs", "",
              "| reason | pairs |", "| --- | --- |"]
    for msg, keys in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(keys[:6]) + (f", ... ({len(keys)})" if len(keys) > 6 else "")
        lines.append(f"| {msg.replace('|', chr(92) + '|')} | {shown} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _merge(paths):
    data = {"meta": None, "results": {}}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        data["results"].update(d["results"])
        if data["meta"] is None:
            data["meta"] = dict(d["meta"])
        else:
            data["meta"]["seconds"] += d["meta"]["seconds"]
    return data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--types", help="comma-separated model types (default: all)")
    p.add_argument("--types-file", help="file with a model type or type:Class per line")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th pair from the i-th")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per pair")
    p.add_argument("--out", help="JSON result")
    p.add_argument("--partial", help="JSON-lines file to resume an interrupted run from")
    p.add_argument("--report", nargs="+", help="merge these results and print the summary")
    p.add_argument("--md", help="with --report: write the markdown report here")
    p.add_argument("--list", action="store_true", help="print the pairs and exit")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.worker_fd is not None:
        return worker_main(args.worker_fd)
    if args.report:
        data = _merge(args.report)
        print(json.dumps(summarize(data["results"]), indent=1))
        if args.md:
            write_markdown(data, args.md)
        return 0
    types = set(args.types.split(",")) if args.types else None
    pairs = select_pairs(read_list(args.types_file)) if args.types_file else \
        enumerate_pairs(types)
    i, n = (int(x) for x in args.shard.split("/"))
    pairs = pairs[i::n]
    if args.list:
        for t, c, tasks in pairs:
            print(t, c, ",".join(tasks))
        return 0
    t0 = time.time()

    def progress(rec, done, total):
        if args.quiet:
            return
        if rec["status"] == "skip":
            st = "skip: " + rec.get("message", "")[:100]
        else:
            st = " ".join(f"{m}={v.get('status')}" for m, v in rec["modes"].items())
            msgs = [v.get("message", "") for v in rec["modes"].values() if v.get("message")]
            if msgs:
                st += " | " + msgs[0][:120]
        print(f"[{done}/{total} {time.time() - t0:6.0f}s] {rec['model_type']} {rec['cls']}: {st}",
              flush=True)

    results, digest = run_zoo(pairs, modes=args.modes.split(","), timeout=args.timeout,
                              workers=args.workers, partial_path=args.partial, progress=progress)
    import transformers

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "extension_sha256": digest, "transformers": transformers.__version__,
            "machine": machine_info(), "shard": args.shard, "atol": ATOL, "rtol": RTOL,
            "seconds": round(time.time() - t0, 1)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=0, sort_keys=True)
    print(json.dumps(summarize(results, args.modes.split(",")), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
