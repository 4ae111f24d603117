"""Run by test_engine.py in a fresh interpreter: SGLang's offline Engine on
tpu (`sglang.Engine`, its scheduler in a process of its own), greedy.

    python engine_worker.py MODEL SPEC_JSON

SPEC: {"engine": Engine keyword arguments, "prompts": [...], "new": tokens per
request, "prefix": a long text or null}. Prints RESULT {"batch": output ids of
the prompts (one generate call), "prefix": [[output ids, cached tokens]] of
prefix + " one", prefix + " two", prefix + " one" in turn}.
"""
import json
import sys

import sglang as sgl


def main():
    model, spec = sys.argv[1], json.loads(sys.argv[2])
    llm = sgl.Engine(model_path=model, log_level="info", decode_log_interval=4, **spec["engine"])
    try:
        greedy = {"temperature": 0, "max_new_tokens": spec["new"], "ignore_eos": True}
        result = {"batch": [o["output_ids"] for o in llm.generate(spec["prompts"], greedy)], "prefix": []}
        if spec.get("prefix"):
            for suffix in (" one", " two", " one"):
                o = llm.generate(spec["prefix"] + suffix, greedy)
                result["prefix"].append([o["output_ids"], o["meta_info"]["cached_tokens"]])
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
