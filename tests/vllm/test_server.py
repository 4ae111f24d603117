"""vLLM's OpenAI server on tpu: /v1/completions and /v1/chat/completions,
streamed or not, give Hugging Face's greedy tokens; 32 concurrent streams
each equal their sequential result; bad requests get vLLM's errors and the
server keeps serving. The engine runs in vLLM's own engine process, the
model compiled (torch.compile, backend "tpu"), with TORCH_TPU_FALLBACK=error."""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from conftest import PROMPTS, hf_greedy
from vllm_server import free_port, request, serving, stream

NEW = 16


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, TORCH_TPU_FALLBACK="error")
    # The README's command: vLLM's `vllm serve` (through torch_tpu.vllm's shim).
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8"]
    try:
        with serving(models["llama"], args, env, str(log), start_timeout=300) as (port, proc):
            yield {"port": port, "proc": proc, "log": log, "model": models["llama"]}
    except RuntimeError as e:
        pytest.fail(str(e))


def completion(prompt, n=NEW, **extra):
    return {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def streamed_tokens(events):
    return [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]


def test_completions_equal_hugging_face(server):
    ref = hf_greedy(server["model"], PROMPTS, NEW)
    status, out = request(server["port"], "POST", "/v1/completions", completion(PROMPTS))
    assert status == 200, out
    got = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert got == ref
    events = stream(server["port"], "/v1/completions", completion(PROMPTS[2]))
    assert streamed_tokens(events) == ref[2]
    assert "".join(c["text"] for e in events for c in e["choices"]) == out["choices"][2]["text"]


def test_chat_completions_equal_hugging_face(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server["model"])
    messages = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = hf_greedy(server["model"], [text], NEW)[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    status, out = request(server["port"], "POST", "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == ref
    events = stream(server["port"], "/v1/chat/completions", body)
    assert streamed_tokens(events) == ref
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == \
        out["choices"][0]["message"]["content"]


def test_32_concurrent_streams_equal_sequential(server):
    bodies = [completion(PROMPTS[i % len(PROMPTS)], n=4 + i % 9) for i in range(32)]
    sequential = {}
    for b in bodies:
        key = (b["prompt"], b["max_tokens"])
        if key not in sequential:
            status, out = request(server["port"], "POST", "/v1/completions", b)
            assert status == 200, out
            sequential[key] = out["choices"][0]["token_ids"]
    results, errors = [None] * 32, []

    def run(i):
        try:
            results[i] = streamed_tokens(stream(server["port"], "/v1/completions", bodies[i]))
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(f"{i}: {e!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    for b, got in zip(bodies, results):
        assert got == sequential[(b["prompt"], b["max_tokens"])]


def test_bad_requests_get_vllm_errors_and_the_server_keeps_serving(server):
    port = server["port"]
    # A prompt longer than the context: 400, as vLLM answers on any platform.
    status, out = request(port, "POST", "/v1/completions", completion("hello world " * 200))
    assert status == 400, out
    assert "context" in json.dumps(out).lower() or "length" in json.dumps(out).lower()
    # A model the server does not serve: 404.
    status, out = request(port, "POST", "/v1/completions", dict(completion("hello"), model="no-such-model"))
    assert status == 404, out
    # A client that goes away in the middle of a stream.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(dict(completion("tiny", n=200), stream=True)),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.fp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    # Still serving, with the same answers.
    ref = hf_greedy(server["model"], ["tiny"], 8)[0]
    status, out = request(port, "POST", "/v1/completions", completion("tiny", n=8))
    assert status == 200 and out["choices"][0]["token_ids"] == ref
    assert server["proc"].poll() is None
    status, out = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in out["data"]] == ["tiny"]


@pytest.mark.slow  # a second server start: the full tier
def test_an_unknown_model_path_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    p = subprocess.run([sys.executable, "-m", "torch_tpu.vllm", "serve", missing, "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode != 0
    assert "no-such-model" in p.stdout + p.stderr
