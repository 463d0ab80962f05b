"""What the servers engine says before a push, without `vllm serve` servers: a URL that answers but is not a vLLM
server's (a web server in a thread of this process), and a server whose sequences are shorter than the run's.

Runs in .venv-vllm (the engine imports vLLM); skipped where vLLM is not installed.
"""

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("vllm")

from exgrpo.rollout.servers import (EngineError, ServerPool, learner_signature, model_refusal,  # noqa: E402
                                    server_refusal)

PAGE = "<!DOCTYPE html><html><head><title>Not Found</title></head><body>" + "<p>nothing here</p>" * 200 + "</body>"


def _web_server(status: int):
    """A web server that answers every request with `status` and an HTML page, like a web app at a wrong port."""
    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            body = PAGE.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@contextlib.contextmanager
def _serving(status: int):
    server = _web_server(status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize("status, said", [(404, "refused /get_world_size: HTTP 404: a text/html answer of "),
                                          (200, "answered /get_world_size with a text/html answer of ")])
def test_a_url_that_answers_but_is_not_a_vllm_server_is_said_in_one_line(status, said):
    with _serving(status) as url:
        with pytest.raises(EngineError) as info:
            ServerPool([url], timeout=10)
    message = str(info.value)
    assert said in message and "not a vLLM server's JSON (is the URL that of a server started with `exgrpo " \
        "serve`?)" in message, message
    assert "<html" not in message and len(message) < 400, message


def test_a_url_where_nothing_listens_is_said_in_the_systems_words():
    with _serving(200) as url:
        pass  # the port is free again
    with pytest.raises(EngineError) as info:
        ServerPool([url], timeout=10)
    assert str(info.value) == (f"the vLLM server {url} did not answer /get_world_size: Connection refused (nothing "
                               "listens there: is the server started?)")


def _served(max_model_len: int) -> dict:
    """A server's `/server_info` vLLM config as `exgrpo serve` starts it."""
    return {"weight_transfer_config": {"backend": "exgrpo_gloo"},
            "model_config": {"logprobs_mode": "processed_logprobs", "generation_config": "vllm",
                             "dtype": "torch.float32", "max_model_len": max_model_len}}


def test_a_server_serving_shorter_sequences_than_the_run_needs_is_refused():
    assert server_refusal(_served(128), "exgrpo_gloo", "float32", max_model_len=128) is None
    assert server_refusal(_served(128), "exgrpo_gloo", "float32") is None  # the run takes what the servers serve
    refusal = server_refusal(_served(128), "exgrpo_gloo", "float32", max_model_len=256)
    assert refusal == ("serves sequences of at most 128 tokens (its max_model_len), fewer than the run's "
                       "rollout.max_model_len 256: start it with `exgrpo serve` and the run's config")


def test_a_server_of_another_model_is_refused_before_any_push():
    from exgrpo.models import load_policy

    tiny = learner_signature(load_policy("tiny")[0])
    assert tiny["architectures"] == ["LlamaForCausalLM"]  # built in process: named by its class
    assert model_refusal(tiny, tiny) is None
    other = {**tiny, "vocab_size": tiny["vocab_size"] + 1, "architectures": ["GemmaForCausalLM"]}
    refusal = model_refusal(other, tiny)
    assert refusal.startswith("serves another model than the learner's (architectures ['GemmaForCausalLM'], not "
                              "['LlamaForCausalLM']; vocab_size ") and "start it with `exgrpo serve`" in refusal



def test_a_vllm_release_other_than_the_tested_one_is_refused_when_an_engine_is_built(monkeypatch):
    import exgrpo.rollout

    exgrpo.rollout.require_engine("servers")  # the installed one is the tested one
    monkeypatch.setattr(exgrpo.rollout, "SUPPORTED_VLLM", (0, 99))
    with pytest.raises(EngineError, match=r"rollout.engine servers needs vLLM 0\.99\.x; vllm(-cpu)? 0\.32\.\d+ is "):
        exgrpo.rollout.require_engine("servers")
