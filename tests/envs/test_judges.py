"""The LLM judge client against a stub OpenAI-compatible server on 127.0.0.1 (and only there)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sao_jax.envs.base import Prompt
from sao_jax.envs.judges import LLMJudge, JudgeError, Verdict, parse_verdict
from sao_jax.envs.style_shift import StyleSchedule, StyleShiftEnv


def completion(content: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}).encode()


class StubServer:
    """Answers POSTs from a script of (status, body, delay_s); the last entry repeats. Records requests."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body)})
                status, reply, delay_s = stub.script[min(len(stub.requests), len(stub.script)) - 1]
                time.sleep(delay_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def judge_for(server, **kwargs):
    sleeps = []
    kwargs = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.5, "sleep": sleeps.append, **kwargs}
    return LLMJudge(server.base_url, "judge-model", **kwargs), sleeps


def test_parses_a_json_verdict_and_sends_an_openai_chat_request(monkeypatch):
    monkeypatch.setenv("SAO_TEST_JUDGE_KEY", "sk-test-123")
    with StubServer([(200, completion('Sure. {"quality": 1, "style": 1}'), 0)]) as server:
        judge, sleeps = judge_for(server, api_key_env="SAO_TEST_JUDGE_KEY")
        verdict = judge.judge("nya~ hello cat <3", topics=("cat",), target_style="cute")
    assert verdict == Verdict(1, 1) and verdict.reward == 1.0 and sleeps == []
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer sk-test-123"
    assert request["body"]["model"] == "judge-model"
    user = request["body"]["messages"][-1]["content"]
    assert "nya~ hello cat <3" in user and "cute" in user and "cat" in user


def test_parses_a_plain_text_verdict():
    with StubServer([(200, completion("Quality: 1, style: 0"), 0)]) as server:
        verdict = judge_for(server)[0].judge("behold cat", topics=("cat",), target_style="cute")
    assert verdict == Verdict(1, 0) and verdict.reward == 0.0


@pytest.mark.parametrize("status", [500, 429])  # a server error, a rate limit
def test_retries_after_a_server_error_or_rate_limit_with_backoff(status):
    with StubServer([(status, b"oops", 0), (200, completion('{"quality": 1, "style": 1}'), 0)]) as server:
        judge, sleeps = judge_for(server)
        assert judge.judge("hail thou cat", topics=("cat",), target_style="classical") == Verdict(1, 1)
    assert len(server.requests) == 2 and sleeps == [0.5]


def test_gives_up_after_the_retries_with_exponential_backoff_and_names_the_url():
    with StubServer([(503, b"busy", 0)]) as server:
        judge, sleeps = judge_for(server, max_retries=3)
        with pytest.raises(JudgeError, match=rf"{server.base_url}/chat/completions.*4 attempts.*HTTP 503"):
            judge.judge("x cat", topics=("cat",), target_style="cute")
    assert len(server.requests) == 4 and sleeps == [0.5, 1.0, 2.0]


def test_a_timeout_becomes_a_clear_error():
    with StubServer([(200, completion('{"quality": 1, "style": 1}'), 1.0)]) as server:
        judge, _ = judge_for(server, timeout_s=0.2, max_retries=1)
        started = time.monotonic()
        with pytest.raises(JudgeError, match=rf"{server.base_url}/chat/completions.*timed out"):
            judge.judge("x cat", topics=("cat",), target_style="cute")
    assert time.monotonic() - started < 1.5 and len(server.requests) == 2


def test_an_unreachable_endpoint_is_a_clear_error():
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = LLMJudge(f"http://127.0.0.1:{port}/v1", "m", timeout_s=1.0, max_retries=1, sleep=lambda s: None)
    with pytest.raises(JudgeError, match=rf"127.0.0.1:{port}/v1/chat/completions unreachable after 2 attempts"):
        judge.judge("x cat", topics=("cat",), target_style="cute")


def test_a_client_error_is_not_retried():
    with StubServer([(401, b'{"error": "bad key"}', 0)]) as server:
        judge, sleeps = judge_for(server)
        with pytest.raises(JudgeError, match="refused the request: HTTP 401"):
            judge.judge("x cat", topics=("cat",), target_style="cute")
    assert len(server.requests) == 1 and sleeps == []


@pytest.mark.parametrize("body", [completion("I like it a lot!"), completion('{"quality": "yes", "style": 2}'),
                                  b"<html>gateway</html>", b'{"choices": []}'])
def test_a_malformed_reply_counts_as_zero(body):
    with StubServer([(200, body, 0)]) as server:
        verdict = judge_for(server)[0].judge("nya~ cat", topics=("cat",), target_style="cute")
    assert verdict == Verdict(0, 0) and "malformed" in verdict.detail and len(server.requests) == 1


@pytest.mark.parametrize("content, verdict", [
    ('{"quality": 0, "style": 1}', Verdict(0, 1)),
    ('```json\n{"style": 1, "quality": 1}\n```', Verdict(1, 1)),
    ('{"quality": true, "style": false}', Verdict(1, 0)),
    ("quality=1 style=1", Verdict(1, 1)),
    ('{"quality": 1.0, "style": 1}', Verdict(1, 1)),
    ('{"quality": 0.5, "style": 1}', Verdict(0, 0)),
    ("quality: 10, style: 1", Verdict(0, 0)),
    ("quality: 1", Verdict(0, 0)),
])
def test_parse_verdict(content, verdict):
    assert parse_verdict(content) == verdict


def test_missing_api_key_and_bad_url_are_reported_at_construction(monkeypatch):
    monkeypatch.delenv("SAO_TEST_ABSENT_KEY", raising=False)
    with pytest.raises(ValueError, match="SAO_TEST_ABSENT_KEY"):
        LLMJudge("http://127.0.0.1:1/v1", "m", api_key_env="SAO_TEST_ABSENT_KEY")
    with pytest.raises(ValueError, match="base_url"):
        LLMJudge("127.0.0.1:1/v1", "m")


def test_style_shift_env_with_the_llm_judge():
    prompt = Prompt(id=1, text="Greet cat:\n", answer="", difficulty=1, metadata={"topics": ("cat",)})
    with StubServer([(200, completion('{"quality": 1, "style": 1}'), 0)]) as server:
        env = StyleShiftEnv(schedule=StyleSchedule(((0, "classical"),)), judge=judge_for(server)[0])
        env.reset(prompt)
        result = env.step("hail, thou fair cat.\n")
    assert result.reward == 1.0 and result.info["target_style"] == "classical"
    assert "classical" in server.requests[0]["body"]["messages"][-1]["content"]


def test_a_garbled_http_status_line_is_retried_then_a_judge_error():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def answer_garbage():
            for _ in range(2):
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"NOT-HTTP garbage\r\n\r\n")

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        judge = LLMJudge(f"http://127.0.0.1:{port}/v1", "m", timeout_s=2.0, max_retries=1, sleep=lambda s: None)
        with pytest.raises(JudgeError, match="unreachable after 2 attempts: BadStatusLine"):
            judge.judge("x cat", topics=("cat",), target_style="cute")
        thread.join(timeout=2.0)


def test_negative_retries_are_refused_at_construction():
    with pytest.raises(ValueError, match="max_retries >= 0"):
        LLMJudge("http://127.0.0.1:1/v1", "m", max_retries=-1)
    assert LLMJudge("http://127.0.0.1:1/v1", "m", max_retries=0).max_retries == 0
