"""Small causal LMs made offline for serving tests and benchmarks: a byte-level
BPE tokenizer trained on a few sentences (with a chat template) and a
llama-type or qwen-type (Qwen3) model with random weights, saved in Hugging
Face's format so that both vLLM and transformers load them from a folder."""
import os

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a tiny model for testing",
    "vllm serves models on many devices including tpu and cpu",
    "paged attention stores keys and values in blocks",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 10, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)
    return hf


def make_model(path: str, kind: str = "llama", layers: int = 2, width: int = 128, heads: int = 2,
               kv_heads: int | None = None, head_dim: int = 64, max_len: int = 512, seed: int = 0) -> str:
    """Writes tokenizer + model to `path` (once) and returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    tok = make_tokenizer(path)
    common = dict(
        vocab_size=max(256, len(tok)), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=head_dim, max_position_embeddings=max_len, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, dtype="float32",
    )
    if kind == "llama":
        cfg, cls = LlamaConfig(num_key_value_heads=kv_heads or heads, **common), LlamaForCausalLM
    elif kind == "qwen3":
        # Grouped-query heads by default: 2 query heads per kv head.
        cfg, cls = Qwen3Config(num_key_value_heads=kv_heads or max(1, heads // 2), **common), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # weights large enough that greedy output is not one repeated token
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path
