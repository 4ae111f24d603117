"""Runs vLLM's offline engine with every sampling parameter vLLM accepts and
prints, as JSON on the last line, what test_sampling compares: per request
its tokens, sampled logprobs and prompt logprobs, and (on tpu) the programs
compiled or read from the disk cache after the engine's warm-up.
Usage: python sampling_worker.py MODEL"""
import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Parameters whose results do not depend on a random stream: the tpu platform's
# tokens and logprobs are compared with vLLM's CPU backend.
DETERMINISTIC = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.5),
    dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.7),
    dict(temperature=0, logit_bias={5: 30.0, 7: -2.0}),
    dict(temperature=0, min_tokens=6),
    dict(temperature=0, allowed_token_ids=[3, 4, 5, 6, 7, 40]),
    dict(temperature=0, bad_words=["a b", "the"]),
    dict(temperature=0, logprobs=5),
    dict(temperature=0, logprobs=0, prompt_logprobs=3),
    dict(temperature=0.8, top_k=1, logprobs=2),
    dict(temperature=0, stop=["e"], include_stop_str_in_output=True),
    dict(temperature=0, structured_outputs={"regex": "[a-d ]+x"}),
    dict(temperature=0, structured_outputs={"choice": ["yes", "no", "maybe"]}),
]
# And with a random stream: on tpu, equal when repeated with the same seed.
RANDOM = [
    dict(temperature=0.8, seed=11),
    dict(temperature=0.7, top_k=20, top_p=0.8, seed=12),
    dict(temperature=1.0, top_p=0.5, seed=13),
    dict(temperature=1.0, min_p=0.2, seed=14),
    dict(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, seed=15),
    dict(temperature=1.0, logprobs=3, seed=16),
]


def params(kind, max_tokens):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kind = dict(kind)
    if "structured_outputs" in kind:
        kind["structured_outputs"] = StructuredOutputsParams(**kind["structured_outputs"])
    return SamplingParams(max_tokens=max_tokens, **kind)


def result(out):
    o = out.outputs[0]
    logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in (o.logprobs or [])]
    prompt = [None if s is None else {str(t): lp.logprob for t, lp in s.items()}
              for s in (out.prompt_logprobs or [])]
    return {"tokens": list(o.token_ids), "text": o.text, "logprobs": logprobs, "prompt_logprobs": prompt}


def programs():
    import torch_tpu

    m = torch_tpu.metrics()
    return m["compiles"] + m["disk_hits"]


def main():
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              enable_prefix_caching=True, enforce_eager=os.environ.get("SAMPLING_WORKER_EAGER", "0") == "1",
              **({"gpu_memory_utilization": float(os.environ["SAMPLING_WORKER_MEMORY_FRACTION"])}
                 if "SAMPLING_WORKER_MEMORY_FRACTION" in os.environ else {}))
    on_tpu = current_platform.device_type == "tpu"
    before = programs() if on_tpu else 0
    prompts = ["the quick brown fox jumps over the lazy dog", "a b c d e f g", "hello world, hello tpu"]
    # One batch: every deterministic parameter, each request beside the others.
    batch = [(p, k) for k in DETERMINISTIC for p in prompts[:2]]
    deterministic = [result(o) for o in llm.generate([p for p, _ in batch], [params(k, 10) for _, k in batch],
                                                     use_tqdm=False)]
    seeded = []
    # vLLM's CPU backend raises "CPU Generator does not use offset" for a seeded request prefilled in chunks.
    random_too = on_tpu
    for _ in range(2 if random_too else 0):
        seeded.append([result(o)["tokens"] for o in llm.generate(prompts * 2, [params(k, 8) for k in RANDOM[:6]],
                                                                 use_tqdm=False)])
    # A random mix: groups of 1 to 8 requests of random lengths, every parameter.
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    for _ in range(int(os.environ.get("SAMPLING_WORKER_MIX", "6"))):
        group = [rng.choice(DETERMINISTIC + (RANDOM if random_too else [])) for _ in range(rng.randint(1, 8))]
        llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 120))])
                      for _ in group], [params(k, rng.randint(6, 12)) for k in group], use_tqdm=False)
    metrics = {}
    if on_tpu:
        import torch_tpu

        metrics = {"programs_after_warm_up": before, "programs_at_end": programs(),
                   "fallbacks": dict(torch_tpu.metrics()["fallbacks"])}
    print(json.dumps({"platform": current_platform.device_type, "deterministic": deterministic, "seeded": seeded,
                      "metrics": metrics}))


if __name__ == "__main__":
    main()
