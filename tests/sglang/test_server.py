"""SGLang's OpenAI server (`python -m sglang.launch_server`) on tpu, with
TORCH_TPU_FALLBACK=error: its native /generate gives Hugging Face's greedy
tokens; concurrent streams of /v1/completions and /v1/chat/completions each
equal their result alone; bad requests get SGLang's own errors (raised in
its request validation and tokenizer manager, before any device work: the
same on every platform) and the server keeps serving."""
import os
import threading

import pytest

from conftest import ENGINE_ARGS, PROMPTS, TPU_ENV, hf_greedy

pytest.importorskip("sglang", reason="SGLang's environment: scripts/setup_sglang.sh")

from sglang_serving import sglang_server  # noqa: E402  (benchmarks/)
from vllm_server import request, stream  # noqa: E402

NEW = 16
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang_server") / "server.log"
    args = ["--served-model-name", "tiny"]
    for key, value in ENGINE_ARGS.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    try:
        with sglang_server(models["llama"], args, dict(os.environ, **TPU_ENV), str(log)) as (port, proc):
            yield {"port": port, "proc": proc, "model": models["llama"]}
    except RuntimeError as e:
        pytest.fail(str(e))


def post(port, path, body):
    return request(port, "POST", path, body, timeout=300)


def stream_text(port, path, body) -> str:
    """The text of a streamed response: its events' pieces joined."""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in stream(port, path, body) for c in e["choices"])


def completion(prompt):
    return {"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}


def chat(prompt):
    return {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True}


def test_generate_equals_hugging_face(server):
    ref = hf_greedy(server["model"], PROMPTS, NEW)
    status, out = post(server["port"], "/generate",
                       {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
    assert status == 200, out
    assert [o["output_ids"] for o in out] == ref


def test_concurrent_streams_equal_alone(server):
    port = server["port"]
    requests = [("/v1/completions", completion(p)) for p in PROMPTS] + [("/v1/chat/completions", chat(p)) for p in PROMPTS]
    alone = []
    for path, body in requests:
        status, out = post(port, path, body)
        assert status == 200, out
        c = out["choices"][0]
        alone.append(c["text"] if "text" in c else c["message"]["content"])
    got = [None] * len(requests)
    errors = []

    def run(i):
        try:
            got[i] = stream_text(port, *requests[i])
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == alone


BAD = [
    # (path, body, status, what the error message says)
    ("/v1/completions", dict(completion("hello"), max_tokens=-1), 400, "max_tokens must be positive"),
    ("/v1/completions", completion("hello world " * 200), 400, "longer than the model's context length"),
    ("/v1/completions", dict(completion("hello"), max_tokens=300), 400, "maximum context length"),
    ("/v1/completions", dict(completion("hello"), temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", dict(chat("hello"), max_tokens=-5), 400, "max_new_tokens must be at least 0"),
]


@pytest.mark.parametrize("path,body,status,message", BAD, ids=["negative_max_tokens", "prompt_too_long",
                                                               "beyond_context", "temperature_not_a_number",
                                                               "chat_negative_max_tokens"])
def test_bad_request_gets_sglang_error_and_server_keeps_serving(server, path, body, status, message):
    got, out = post(server["port"], path, body)
    assert got == status, out
    assert out["object"] == "error" and out["code"] == status, out
    assert message in out["message"], out
    # SGLang does not check the model name: any name is served (as on every platform).
    ok, out = post(server["port"], "/v1/completions", dict(completion("hello"), model="no-such-model"))
    assert ok == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert server["proc"].poll() is None
