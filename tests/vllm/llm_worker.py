"""Runs vLLM's offline engine on one model in this process and prints what
the tests compare, as JSON on the last line: greedy tokens per pass,
seeded-sampling tokens, the platform vLLM chose, torch_tpu's metrics.
Usage: python llm_worker.py MODEL JSON_PROMPTS NEW_TOKENS [PASSES [greedy]]
(LLM_WORKER_NEW_LENGTHS=N: first N one-by-one requests of random lengths;
LLM_WORKER_MIXED=N: then N requests of random lengths in concurrent groups.)
("greedy": no sampling runs; vLLM's own CPU backend raises "CPU Generator
does not use offset" for a seeded request whose prompt is prefilled in chunks.)"""
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def programs():
    import torch_tpu

    m = torch_tpu.metrics()
    return m["compiles"] + m["disk_hits"]


def one_by_one_new_lengths(llm, count):
    """Right after the engine's warm-up: `count` requests one after another,
    each a prompt of a random length (1 to 200 tokens, most never seen)
    and 1 to 8 new tokens. The programs compiled (or read from the disk
    cache) before and after."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    before = programs()
    for _ in range(count):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 200))]
        llm.generate([TokensPrompt(prompt_token_ids=ids)],
                     SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True), use_tqdm=False)
    return {"programs_after_warm_up": before, "programs_after_new_lengths": programs()}


def concurrent_groups(llm, count):
    """`count` requests in groups of 1 to 6 submitted together (a batch
    mixes prefills of different lengths, chunked prefills and decodes), each
    a prompt of 1 to 200 random tokens and 1 to 8 new tokens, each group
    greedy or sampled at temperature 1. The programs before and after."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    before, done = programs(), 0
    while done < count:
        k = min(rng.randint(1, 6), count - done)
        temperature = rng.choice([0.0, 1.0])
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(1, 200))])
                   for _ in range(k)]
        params = [SamplingParams(temperature=temperature, max_tokens=rng.randint(1, 8), ignore_eos=True)
                  for _ in range(k)]
        llm.generate(prompts, params, use_tqdm=False)
        done += k
    return {"programs_before_groups": before, "programs_after_groups": programs()}


def step_programs(llm):
    """The runner's step capture: shapes recorded, replays, unrecorded steps."""
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size > 1:
        return None  # the workers are other processes
    return llm.collective_rpc(
        lambda worker: worker.model_runner.step_programs.stats() if worker.model_runner.step_programs else None)[0]


def main():
    model, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    passes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        # Small token budget: long prompts are prefilled in chunks, mixed with decodes.
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        enforce_eager=os.environ.get("LLM_WORKER_EAGER", "0") == "1",
        # LLM_WORKER_TP=2: tensor parallel over two worker processes (tpu:0 and tpu:1, tpu_dist).
        tensor_parallel_size=int(os.environ.get("LLM_WORKER_TP", "1")),
        # vLLM's CPU backend refuses to start unless this fraction of the machine's memory is free.
        **({"gpu_memory_utilization": float(os.environ["LLM_WORKER_MEMORY_FRACTION"])}
           if "LLM_WORKER_MEMORY_FRACTION" in os.environ else {}),
    )
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    on_tpu = current_platform.device_type == "tpu"
    in_process = on_tpu and llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1
    new_lengths = {}
    if in_process:
        import torch_tpu

        new_lengths = {"steps_after_warm_up": step_programs(llm)}
        new_lengths.update(one_by_one_new_lengths(llm, int(os.environ.get("LLM_WORKER_NEW_LENGTHS", "0"))))
        new_lengths.update(concurrent_groups(llm, int(os.environ.get("LLM_WORKER_MIXED", "0"))))
    runs, compiles = [], []
    for _ in range(passes):
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)])
        compiles.append(programs() if in_process else 0)
    sampled, top_k1 = [], []
    greedy_only = len(sys.argv) > 5 and sys.argv[5] == "greedy"
    for _ in range(0 if greedy_only else 2):
        sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=8, seed=1234, ignore_eos=True)
        sampled.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts[:2], sp)])
    if not greedy_only:
        top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=n, ignore_eos=True, seed=7)
        top_k1 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:2], top1)]
    metrics = {}
    if in_process:
        m = torch_tpu.metrics()
        # Programs compiled (or read from the disk cache) by the end of each greedy pass.
        metrics = {"fallbacks": dict(m["fallbacks"]), "programs_after_pass": compiles, "steps": step_programs(llm),
                   **new_lengths}
    kv_blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    print(json.dumps({"platform": current_platform.device_type, "kv_blocks": kv_blocks, "greedy": runs, "sampled": sampled,
                      "top_k1": top_k1, "metrics": metrics}))


if __name__ == "__main__":
    main()
