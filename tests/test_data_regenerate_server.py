"""Regeneration through an OpenAI-compatible server (data.regenerate.method: server), against a real
llama-server on an F32 GGUF of the tiny target (marker ``engine``): the same records as in-process greedy
regeneration, a launched server started and stopped, a SIGKILLed client resuming without re-asking an
answered turn, a dying server stopping the job with its shards kept, a failed request counted, and a
server with another tokenizer refused before any request."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import datasets
import pytest
import yaml

from draftsmith.data.config import RegenerateConfig, ServerConfig
from draftsmith.data.conversations import conversation_features
from draftsmith.data.regenerate import regenerate_conversations, regenerated_records
from draftsmith.data.regenerate_server import _read_journal, request_seed
from draftsmith.engines import llamacpp
from draftsmith.engines.openai_client import CompletionsClient, RequestFailed, ServerDown
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.target import Target, load_target

NEW = 12
USERS = [[f"Question {i}: what do you know about the number {i}?", "Tell me more."] for i in range(8)]


def _messages(turns):
    return [{"role": r, "content": c} for u in turns for r, c in (("user", u), ("assistant", "(original answer)"))]


def _conversations(users):
    return datasets.Dataset.from_list([{"conv_id": f"c{i}", "source": "test", "messages": _messages(t),
                                        "truncated_turns": []} for i, t in enumerate(users)],
                                      features=conversation_features())


def _run(folder, target, server=None, users=USERS, max_length=256, **kw):
    cfg = RegenerateConfig(**{"max_new_tokens": NEW, "batch_size": 4, "shard_size": 4, **kw},
                           **({"method": "server", "server": server} if server else {}))
    report = regenerate_conversations(_conversations(users), str(folder), target, cfg, max_length=max_length,
                                      progress=False)
    return report, list(regenerated_records(str(folder)))


class _Counting:
    """Counts the completion requests a client sends (monkeypatched onto CompletionsClient)."""

    def __init__(self, monkeypatch):
        self.prompts: list[list[int]] = []
        real = CompletionsClient.complete

        def complete(client, prompt, *args, **kwargs):
            self.prompts.append(list(prompt))
            return real(client, prompt, *args, **kwargs)

        monkeypatch.setattr(CompletionsClient, "complete", complete)


# ---------------------------------------------------------------- without a server


def test_server_settings_are_validated_with_one_line_errors():
    with pytest.raises(ConfigError, match="needs data.regenerate.server.url"):
        RegenerateConfig(method="server").validate()
    with pytest.raises(ConfigError, match="a launched server picks its own loopback port"):
        ServerConfig(url="http://x:1", launch="llamacpp").validate()
    with pytest.raises(ConfigError, match="must start with http"):
        ServerConfig(url="localhost:8000").validate()
    with pytest.raises(ConfigError, match="concurrency must be at least 1"):
        ServerConfig(url="http://x:1", concurrency=0).validate()
    RegenerateConfig(method="server", server=ServerConfig(launch="llamacpp")).validate()


@pytest.mark.parametrize("name", ["llama3.1-8b-prepare", "qwen3-8b-prepare", "smollm2-135m-prepare"])
def test_prepare_recipes_switch_to_the_server_method_with_one_override(name):
    from draftsmith.config import CONFIG_DIR, load_recipe

    recipe = load_recipe(name, ["data.regenerate.method=server"])
    assert recipe.data.regenerate.method == "server"
    assert bool(recipe.data.regenerate.server.url) != (recipe.data.regenerate.server.launch == "llamacpp")
    with pytest.raises(ConfigError, match="unknown config key 'data.regenerate.server.slotz'; valid keys here: "
                                          "backoff_s, check_tokenizer, concurrency, flash_attn, gguf_type, launch, model"):
        load_recipe(name, ["data.regenerate.server.slotz=3"])
    if "8b" in name:  # the cluster launch lines, data parallel, pointed at by server.url
        with open(os.path.join(CONFIG_DIR, f"{name}.yaml")) as f:
            header = f.read().split("\ntarget:")[0]
        assert "vllm serve" in header and "--data-parallel-size 8" in header
        assert "python -m sglang.launch_server" in header and "--dp-size 8" in header
        assert "data.regenerate.server.url=" in header


def test_the_gguf_types_of_the_configs_are_those_the_engine_serves():
    from typing import get_args, get_type_hints

    from draftsmith.engines.llamacpp import DRAFT_GGUF_TYPES, NGRAM_METHODS, TARGET_GGUF_TYPES
    from draftsmith.measure.config import EvalConfig

    assert get_args(get_type_hints(ServerConfig)["gguf_type"]) == TARGET_GGUF_TYPES
    hints = get_type_hints(EvalConfig)
    assert get_args(hints["engine_target_type"]) == TARGET_GGUF_TYPES
    assert get_args(hints["engine_draft_type"]) == DRAFT_GGUF_TYPES
    assert get_args(get_args(hints["engine_ngram"])[0]) == NGRAM_METHODS


class _Served:
    """A local OpenAI-compatible server: the n-th POST (from 1) is answered ``reply(n)`` = (HTTP status, a JSON-able
    body or raw bytes); GET /v1/models lists ``served-name``; every other GET is a 404 (so /health proves it up)."""

    def __init__(self, reply):
        import http.server

        self.posts = 0
        self.reply = reply
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                outer.posts += 1
                outer.auth = self.headers["Authorization"]
                self.rfile.read(int(self.headers["Content-Length"]))
                status, body = outer.reply(outer.posts)
                self.answer(status, body if isinstance(body, bytes) else json.dumps(body).encode())

            def do_GET(self):  # noqa: N802
                body = json.dumps({"data": [{"id": "served-name", "owned_by": "vllm"}]}).encode()
                self.answer(200 if self.path == "/v1/models" else 404, body)

            def answer(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


GOOD = {"choices": [{"text": "hi", "finish_reason": "stop", "token_ids": [5, 2]}]}


class _Flaky(_Served):
    """Answers /v1/completions with 503 ``fail`` times, then with a fixed completion."""

    def __init__(self, fail: int):
        super().__init__(lambda n: (200, GOOD) if n > fail else (503, {"error": "busy"}))


def test_transient_errors_are_retried_with_exponential_backoff(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # sent as a bearer token, as the openai package does
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    flaky = _Flaky(fail=2)
    try:
        answer = CompletionsClient(flaky.url, "m", retries=3, backoff_s=0.5).complete([1, 2, 3], 4)
        assert (answer.text, answer.tokens, answer.finish) == ("hi", [5, 2], "stop")
        assert flaky.posts == 3 and waits == [0.5, 1.0] and flaky.auth == "Bearer sk-test"
        flaky.posts, waits[:] = 0, []
        with pytest.raises(RequestFailed, match="http_503"):  # the server is up: a failed request, not a dead server
            CompletionsClient(flaky.url, "m", retries=1, backoff_s=0.5).complete([1], 4)
        assert flaky.posts == 2 and waits == [0.5]
    finally:
        flaky.httpd.shutdown()
        flaky.httpd.server_close()
    with pytest.raises(ServerDown, match=r"stopped answering \(connection: .*after 2 retries"):
        CompletionsClient(flaky.url, "m", retries=2, backoff_s=0.0).complete([1], 4)


@pytest.fixture
def models_built(monkeypatch):
    """The transformers models instantiated during a test (every ``PreTrainedModel.__init__``, whoever calls it)."""
    from transformers import PreTrainedModel

    built: list[str] = []
    real = PreTrainedModel.__init__

    def init(self, *args, **kwargs):
        built.append(type(self).__name__)
        real(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "__init__", init)
    return built


def test_prepare_against_no_server_exits_2_with_one_line(capsys, tmp_path, tiny_target_dir, models_built):
    """... having built no model: the client reads the target's tokenizer, config and fingerprint from its files."""
    from draftsmith.cli import main

    src = tmp_path / "convs.jsonl"
    src.write_text(json.dumps({"id": "q", "messages": _messages(["Hi"])}) + "\n")
    url = f"http://127.0.0.1:{llamacpp.free_port()}"  # nothing listens there
    code = main(["prepare", f"target.name={tiny_target_dir}", "target.dtype=float32", f"data.sources=[{{path: {src}}}]",
                 "data.stages=[regenerate]", f"data.out_dir={tmp_path / 'out'}", "data.regenerate.method=server",
                 f"data.regenerate.server.url={url}", "data.regenerate.server.launch=none", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"draftsmith: error: no server answers at {url}: start it" in err
    assert models_built == []


def test_answers_are_cut_at_the_targets_end_of_turn_and_at_max_new_tokens(tiny_target_dir):
    from draftsmith.data.regenerate_server import _Run
    from draftsmith.engines.openai_client import ServedAnswer

    target = load_target(tiny_target_dir, dtype="float32", device="cpu")
    eos = min(target.eos_token_ids)
    run = _Run(None, "", target, RegenerateConfig(max_new_tokens=4), 256, None, None)
    cut = lambda tokens, finish="stop", text="": run.answer_tokens(ServedAnswer(text, finish, tokens, 0, 0, 0.0))  # noqa: E731
    assert cut([5, 7, eos]) == ([5, 7, eos], "eos")
    assert cut([5, eos, 9]) == ([5, eos], "eos")  # the server ran past the target's end of turn
    assert cut([5, 7]) == ([5, 7, eos], "eos")  # stopped at end-of-turn without listing it
    assert cut([5, 7, 8, 9, 10], "length") == ([5, 7, 8, 9], "length")  # llama-server may overshoot n_predict
    hello = target.tokenizer.encode("Hello there", add_special_tokens=False)
    assert cut(None, "stop", "Hello there") == ([*hello, eos], "eos")  # a text-only server, re-tokenized
    assert cut(None, "length", "Hello there") == (hello, "length")


def test_a_model_name_the_server_does_not_serve_is_refused(tmp_path, tiny_target_dir):
    target = load_target(tiny_target_dir, dtype="float32", device="cpu")
    flaky = _Flaky(fail=0)
    try:
        with pytest.raises(DraftsmithError, match="serves served-name, not 'llama-8b': set data.regenerate.server.model"):
            _run(tmp_path, target, ServerConfig(url=flaky.url, model="llama-8b"))
        assert flaky.posts == 0
    finally:
        flaky.httpd.shutdown()
        flaky.httpd.server_close()


MALFORMED = {  # what a broken or foreign server has answered with HTTP 200
    "ids_not_numbers": {"choices": [{"text": "x", "finish_reason": "stop", "token_ids": ["abc"]}]},
    "negative_ids": {"choices": [{"text": "x", "finish_reason": "stop", "token_ids": [-5]}]},
    "usage_not_a_number": {**GOOD, "usage": {"prompt_tokens": "many"}},
    "text_not_text": {"choices": [{"text": {"a": 1}, "finish_reason": "stop"}]},
    "no_choices": {"choices": []},
    "html": b"<html><body>Bad gateway</body></html>",
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_answer_is_a_failed_request_not_a_crash(body):
    served = _Served(lambda n: (200, body))
    try:
        with pytest.raises(RequestFailed, match="bad_answer|bad_json"):
            CompletionsClient(served.url, "m", retries=0).complete([1, 2], 4)
    finally:
        served.close()


def _read_request(conn) -> bytes:
    """One whole HTTP request (headers and the Content-Length body): a server that answers before reading it all
    and closes makes the kernel reset the connection, and the client sees that instead of the answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class _Raw:
    """A local server that answers every POST with the raw ``payload`` bytes (HTTP or not) and every GET with a 404
    (so /health proves it up): what a broken proxy or a server killed mid-answer sends."""

    def __init__(self, payload: bytes):
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                with conn:
                    request = _read_request(conn)
                    get = request.startswith(b"GET")
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n" if get else payload)
                    conn.shutdown(socket.SHUT_WR)  # closing with the request unread would reset the connection

        threading.Thread(target=serve, daemon=True).start()

    def close(self):
        self.sock.close()


BROKEN_HTTP = {
    "not_http": (b"garbage\r\n\r\n", "bad_http"),
    "cut_off_mid_body": (b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"choices\": [", "bad_http"),
    "nested_too_deep": (b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + b"[" * 100000 + b"]" * 100000,
                        "bad_json"),
}


@pytest.mark.parametrize("payload, reason", BROKEN_HTTP.values(), ids=BROKEN_HTTP.keys())
def test_an_answer_that_is_not_http_or_is_cut_off_is_a_failed_request_not_a_crash(monkeypatch, payload, reason):
    """http.client's errors (a bad status line, an incomplete body) and the JSON parser's RecursionError are no
    OSError nor JSONDecodeError: they escaped the client as tracebacks. Retried, then a counted failure."""
    monkeypatch.setattr(time, "sleep", lambda s: None)
    raw = _Raw(payload)
    try:
        with pytest.raises(RequestFailed, match=f"^{reason}: "):
            CompletionsClient(raw.url, "m", retries=1).complete([1, 2], 4)
    finally:
        raw.close()


@pytest.mark.parametrize("tokens", [["abc"], [-1], [{"piece": "a"}], [1.5]], ids=["text", "negative", "no_id", "float"])
def test_a_tokenize_probe_answered_with_garbage_is_refused_in_one_line(tokens):
    served = _Served(lambda n: (200, {"tokens": tokens}))
    try:
        with pytest.raises(DraftsmithError, match="answered the tokenize probe with something that is not token ids"):
            CompletionsClient(served.url, "m", retries=0).tokenize("hello")
    finally:
        served.close()


def _settings(served, **kw):
    return ServerConfig(url=served.url, model="served-name", check_tokenizer=False, retries=0, backoff_s=0.0, **kw)


FAILING = {**{k: (200, v) for k, v in MALFORMED.items()},
           "out_of_vocabulary": (200, {"choices": [{"text": "", "finish_reason": "stop", "token_ids": [10**9]}]}),
           "empty_without_end_of_turn": (200, {"choices": [{"text": "", "finish_reason": "length", "token_ids": []}]}),
           "http_400": (400, {"error": "bad request"}), "http_500": (500, {"error": "internal"})}


@pytest.mark.parametrize("reply", FAILING.values(), ids=FAILING.keys())
def test_a_server_that_fails_every_request_stops_the_stage_and_a_rerun_asks_again(tmp_path, target, reply):
    """No record is made of an answer that cannot be read or decoded (an id past the target's vocabulary decodes to
    nothing); most requests failed, so the stage exits non-zero saying how many and why; fixed, the same command
    (no --restart) asks every turn and keeps every conversation."""
    broken = _Served(lambda n: reply)
    try:
        with pytest.raises(DraftsmithError, match=r"^8 of 8 requests to the regeneration server failed \(8 (bad_answer|"
                                                  r"bad_json|http_400|http_500); first: test:c\d .*run prepare again"):
            _run(tmp_path, target, _settings(broken))
    finally:
        broken.close()
    fixed = _Served(lambda n: (200, GOOD))
    try:
        report, got = _run(tmp_path, target, _settings(fixed))
    finally:
        fixed.close()
    assert fixed.posts == 16 and report.kept == len(got) == 8 and report.turns == 16
    assert dict(report.finish) == {"eos": 16} and not report.skipped


def test_failed_requests_are_asked_again_by_the_next_run_and_only_they(tmp_path, target):
    """A few failures: the stage ends (exit 0) with them counted; the next run asks exactly those again."""
    users = [[u] for u, _ in USERS]
    some = _Served(lambda n: (500, {"error": "overloaded"}) if n <= 3 else (200, GOOD))
    try:
        report, got = _run(tmp_path, target, _settings(some, concurrency=1), users=users)
    finally:
        some.close()
    assert (report.kept, dict(report.finish), dict(report.failures)) == (5, {"eos": 5, "failed": 3}, {"http_500": 3})
    assert dict(report.skipped) == {"request_failed": 3} and len(got) == 5
    per_answer = report.new_tokens // report.turns
    fixed = _Served(lambda n: (200, GOOD))
    try:
        report, got = _run(tmp_path, target, _settings(fixed, concurrency=1), users=users)
        assert fixed.posts == 3 and report.kept == len(got) == 8 and dict(report.finish) == {"eos": 8}
        # the rate's tokens are the 3 answers asked now, not those the re-opened shard's journal held
        assert (report.run_tokens, report.new_tokens) == (3 * per_answer, 8 * per_answer) and per_answer
        assert "asking again the 3 failed request(s) of 1 shard(s)" in report.note
        report, _ = _run(tmp_path, target, _settings(fixed, concurrency=1), users=users)
        assert report.note == "up to date (reused)" and fixed.posts == 3
    finally:
        fixed.close()
    assert not list(tmp_path.glob("*.partial.jsonl"))  # the journals go once their shards have no failure


def test_a_torn_journal_line_is_dropped_and_the_file_cut_back(tmp_path):
    path = tmp_path / "shard-00000.partial.jsonl"
    whole = json.dumps({"conv": 0, "turn": 0, "finish": "eos", "tokens": [5, 2], "text": "x", "renders_back": True})
    path.write_text(whole + "\n" + '{"conv": 1, "turn": 0, "fin')
    assert list(_read_journal(str(path))) == [(0, 0)]
    assert path.read_text() == whole + "\n"  # the next append starts on a clean line


def test_request_seeds_are_fixed_per_record_and_differ_between_records():
    assert request_seed(7, 3, 1) == request_seed(7, 3, 1)
    assert len({request_seed(s, c, t) for s in range(3) for c in range(50) for t in range(3)}) == 450


def test_as_loaded_needs_a_target_loaded_from_a_gguf(tiny_target_dir):
    from draftsmith.engines.targets import target_gguf

    target = load_target(tiny_target_dir, dtype="float32", device="cpu")
    with pytest.raises(DraftsmithError, match="was not loaded from a GGUF file.*f32, bf16, f16, q8_0"):
        target_gguf(target, "as-loaded")


# ---------------------------------------------------------------- against a real llama-server

engine = pytest.mark.engine


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def gguf(target):
    from draftsmith.engines.targets import cached_target

    return cached_target(target, "f32")  # llama.cpp's own converter, once per fingerprint


@pytest.fixture(scope="module")
def server(gguf):
    with llamacpp.serving(llamacpp.ServerSpec(model=gguf, threads=1, slots=2, ctx=512)) as s:
        yield s


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, target):
    return _run(tmp_path_factory.mktemp("generate"), target)


@pytest.fixture(scope="module")
def served(tmp_path_factory, target, server):
    return _run(tmp_path_factory.mktemp("server"), target, ServerConfig(url=server.url, concurrency=4))


@engine
def test_f32_server_gives_the_records_of_in_process_greedy_regeneration(in_process, served):
    (ref_report, ref), (report, got) = in_process, served
    same = sum(a == b for a, b in zip(ref, got))
    print(f"identical records: {same} of {len(ref)}")
    assert got == ref
    assert (report.turns, report.new_tokens, dict(report.finish)) == (
        ref_report.turns, ref_report.new_tokens, dict(ref_report.finish))
    assert report.turns == 16 and sum(report.render_back.values()) == 16


@engine
def test_a_text_only_server_gives_the_same_records_through_the_targets_tokenizer(tmp_path, target, server, served,
                                                                                 monkeypatch):
    """Servers that return no ids (text only): the answers are re-tokenized with the target's tokenizer."""
    real = CompletionsClient.complete

    def text_only(client, *args, **kwargs):
        answer = real(client, *args, **kwargs)
        answer.tokens = None
        return answer

    monkeypatch.setattr(CompletionsClient, "complete", text_only)
    report, got = _run(tmp_path, target, ServerConfig(url=server.url, concurrency=4))
    same = sum(a == b for a, b in zip(got, served[1]))
    print(f"text-only: identical records {same} of {len(got)}; render back {dict(report.render_back)}")
    assert got == served[1]
    assert dict(report.finish) == dict(served[0].finish)


@engine
def test_sampling_is_seeded_per_record(tmp_path, target, server, served):
    """One request at a time: with several in one batch, llama.cpp's logits may round differently with what shares
    the batch, and a sampled token near a boundary of the seeded draw can change (greedy answers did not, F32)."""
    sampled = ServerConfig(url=server.url, concurrency=1)
    _, first = _run(tmp_path / "a", target, sampled, temperature=1.0, seed=7)
    _, again = _run(tmp_path / "b", target, sampled, temperature=1.0, seed=7)
    _, other = _run(tmp_path / "c", target, sampled, temperature=1.0, seed=8)
    assert first == again
    assert other != first and first != served[1]


@pytest.fixture
def started(monkeypatch):
    """The llama-servers started during a test (Server.start recorded)."""
    servers: list[llamacpp.Server] = []
    real_start = llamacpp.Server.start

    def start(self):
        servers.append(self)
        return real_start(self)

    monkeypatch.setattr(llamacpp.Server, "start", start)
    return servers


def _stopped(server: llamacpp.Server) -> bool:
    try:
        urllib.request.urlopen(f"{server.url}/health", timeout=5)
    except urllib.error.URLError:
        return server.proc.poll() is not None
    return False


@engine
def test_launch_llamacpp_serves_the_targets_gguf_and_stops_it(tmp_path, target, served, started):
    report, got = _run(tmp_path, target, ServerConfig(launch="llamacpp", gguf_type="f32", slots=2, threads=1,
                                                      concurrency=2))
    assert got == served[1]
    assert len(started) == 1 and _stopped(started[0])  # started once, stopped at the end
    assert started[0].spec.args()[:10] == ["-m", started[0].spec.model, "-t", "1", "-tb", "1", "-c", str(2 * (256 + NEW)),
                                           "-np", "2"]


@engine
def test_a_launched_server_is_stopped_on_error_too(tmp_path, target, started):
    tokenizer = _with_an_added_token(target)
    with pytest.raises(DraftsmithError, match="tokenizes differently"):
        _run(tmp_path, Target(target.model, tokenizer, name=target.name, fingerprint=target.fingerprint),
             ServerConfig(launch="llamacpp", gguf_type="f32", slots=1, threads=1))
    assert len(started) == 1 and _stopped(started[0])


def _with_an_added_token(target):
    """The target's tokenizer after a fine-tune added a token that the probe text contains."""
    import copy

    tokenizer = copy.deepcopy(target.tokenizer)
    tokenizer.add_tokens(["café"])
    return tokenizer


@engine
def test_a_server_with_another_tokenizer_is_refused_before_any_request(tmp_path, target, server, monkeypatch):
    """A fine-tune that added a token: the probe's ids differ, and nothing is requested."""
    other = Target(target.model, _with_an_added_token(target), name=target.name, fingerprint=target.fingerprint)
    counting = _Counting(monkeypatch)
    with pytest.raises(DraftsmithError, match=r"tokenizes differently from the target .*probe ids differ from position"):
        _run(tmp_path, other, ServerConfig(url=server.url))
    assert counting.prompts == []


@engine
def test_a_failed_request_is_counted_and_ends_its_conversation(tmp_path, target, gguf, server, monkeypatch):
    """A server whose context (256 tokens) holds the short prompts but not the long ones: HTTP 400, not retried.
    A conversation keeps the answers it had; one that had none is skipped as request_failed; all are counted, and
    the next run, against a server with room for them, asks exactly the failed turns again."""
    long = "Tell me more. " * 60  # ~300 tokens: over the context, within the target's 512 positions
    users = [[u, long] for u, _ in USERS[:3]] + [[u] for u, _ in USERS[3:6]] + [[long]]
    counting = _Counting(monkeypatch)
    with llamacpp.serving(llamacpp.ServerSpec(model=gguf, threads=1, slots=1, ctx=256)) as small:
        report, got = _run(tmp_path, target, ServerConfig(url=small.url, retries=2, backoff_s=0.0), users=users,
                           max_length=2048)
    assert dict(report.finish)["failed"] == 4 and report.turns == 6 and dict(report.failures) == {"http_400": 4}
    assert len(counting.prompts) == 10  # a refused request is not retried
    assert [len(r["messages"]) for r in got] == [2] * 6  # each kept its first answer
    assert dict(report.skipped) == {"request_failed": 1} and report.kept == 6
    assert report.examples["request_failed"] == "test:c6"
    assert re.match(r"test:c[0-6] \(http_400: .*exceeds the available context", report.examples["failed"])  # why
    counting.prompts.clear()
    report, got = _run(tmp_path, target, ServerConfig(url=server.url), users=users, max_length=2048)
    assert len(counting.prompts) == 4 and report.turns == 10 and report.kept == 7 and "failed" not in report.finish


def _recipe(tmp_path, tiny_target_dir, url, out, stages=("regenerate",), **regenerate):
    src = tmp_path / "convs.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"id": f"q{i}", "messages": _messages(t)}) + "\n" for i, t in enumerate(USERS)))
    path = tmp_path / f"{os.path.basename(out)}.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"name": tiny_target_dir, "dtype": "float32", "device": "cpu"},
        "data": {"sources": [{"path": str(src)}], "stages": list(stages), "out_dir": str(out),
                 "render": {"max_length": 256},
                 "regenerate": {"method": "server", "max_new_tokens": 48, "shard_size": 8,
                                "server": {"url": url, "concurrency": 1}, **regenerate}},
        "run_dir": str(tmp_path / "run"),
    }))
    return str(path)


@engine
def test_prepare_through_a_server_builds_no_model_and_writes_the_records_of_a_loaded_target(
        tmp_path, tiny_target_dir, server, served, models_built):
    """The regenerate stage of `prepare` (method server) reads the target's files only, and writes the records the
    same job writes with the whole target loaded (``served``); the features stage of the same prepare builds the
    model, once, when it starts."""
    from draftsmith.config import load_recipe
    from draftsmith.data import run_prepare

    out = tmp_path / "out"
    settings = {"max_new_tokens": NEW, "shard_size": 4, "server": {"url": server.url, "concurrency": 4}}
    run_prepare(load_recipe(_recipe(tmp_path, tiny_target_dir, server.url, out, **settings)), progress=False)
    assert models_built == []
    got = list(regenerated_records(str(out / "regenerate")))
    assert [(r["messages"], r["truncated_turns"]) for r in got] == [
        (r["messages"], r["truncated_turns"]) for r in served[1]]

    run_prepare(load_recipe(_recipe(tmp_path, tiny_target_dir, server.url, out, ("regenerate", "tokenize", "features"),
                                    **settings)), progress=False)
    assert models_built == ["LlamaForCausalLM", "LlamaModel"]  # regenerate reused, then features: one model, once


@engine
def test_a_killed_client_resumes_without_requesting_an_answered_turn(tmp_path, tiny_target_dir, server, monkeypatch):
    """A real SIGKILL to `draftsmith prepare` mid-shard (one shard of 8 conversations); the re-run requests
    exactly the turns its journal does not hold, and writes the records of an uninterrupted run."""
    from draftsmith.config import load_recipe
    from draftsmith.data import run_prepare

    killed = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "prepare", "--config",
                             _recipe(tmp_path, tiny_target_dir, server.url, killed)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = killed / "regenerate"

    def journal():  # shard-00000-<digest of its input records>.partial.jsonl
        found = sorted(folder.glob("shard-00000*.partial.jsonl")) if folder.exists() else []
        return found[0] if found else None

    deadline = time.time() + 240
    while not (journal() is not None and journal().read_text().count("\n") >= 5):
        assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    path = journal()
    answered = len(_read_journal(str(path)))
    print(f"killed with {answered} of 16 turns answered")
    assert answered >= 5 and not (killed / "regenerate" / "manifest.json").exists()

    counting = _Counting(monkeypatch)
    run_prepare(load_recipe(_recipe(tmp_path, tiny_target_dir, server.url, killed)), progress=False)
    records = list(regenerated_records(str(killed / "regenerate")))
    turns = sum(len(r["messages"]) // 2 for r in records)
    assert len(counting.prompts) == turns - answered == 16 - answered
    assert not path.exists() and journal() is None

    clean = tmp_path / "clean"
    run_prepare(load_recipe(_recipe(tmp_path, tiny_target_dir, server.url, clean)), progress=False)
    assert records == list(regenerated_records(str(clean / "regenerate")))


@engine
def test_a_killed_demo_prepare_through_a_launched_server_resumes_without_re_asking(tmp_path, tiny_target_dir,
                                                                                   monkeypatch, started):
    """The demo's prepare with ``--regenerate server`` (its overrides: a llama-server launched on the target's
    GGUF; F32 here, so that batched slots cannot round a near-tie differently between the runs compared), on the
    tiny target, SIGKILLed once a shard is committed and answers of the next are journaled (its
    llama-server dies with it); run again, it launches another server, requests no journaled turn again, and
    writes the shards of an unkilled run."""
    from draftsmith.config import load_recipe
    from draftsmith.data import run_prepare
    from draftsmith.demo import STAGE_RECIPES, DemoSize, demo_stages
    from draftsmith.target import load_target_files

    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "messages": _messages([f"Question {i}: tell me about {i}.",
                                                                             "And more?"])}) + "\n" for i in range(32)))
    size = DemoSize(conversations=32, regenerate=True, answer_tokens=48, max_length=256, dtype="float32",
                    regenerate_method="server")

    def overrides(out):  # the demo's, on the tiny target and these conversations; 2 slots on 1 thread (a shared CPU)
        return [*demo_stages(str(out), size)["prepare"], f"target.name={tiny_target_dir}",
                f"data.sources=[{{path: {src}}}]", "data.stages=[regenerate]", "data.regenerate.shard_size=8",
                "data.regenerate.server.slots=2", "data.regenerate.server.concurrency=2",
                "data.regenerate.server.threads=1", "data.regenerate.server.gguf_type=f32"]

    recipe = load_recipe(STAGE_RECIPES["prepare"], overrides(tmp_path / "killed"))
    r = recipe.data.regenerate
    assert (r.method, r.server.launch, r.server.gguf_type, r.max_turns) == ("server", "llamacpp", "f32", 1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.cli", "prepare", "--config", STAGE_RECIPES["prepare"],
                             *overrides(tmp_path / "killed")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = tmp_path / "killed" / "prepare" / "data" / "regenerate"

    def journaled() -> dict[tuple[int, int, int], dict]:  # (shard, conversation, turn) → entry
        return {(int(p.name[6:11]), *k): e for p in folder.glob("shard-*.partial.jsonl")
                for k, e in _read_journal(str(p)).items()} if folder.exists() else {}

    deadline = time.time() + 300
    while not ((folder / "shard-00000.json").exists() and len(journaled()) >= 2):
        assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    answered = journaled()
    committed = sorted(int(p.name[6:11]) for p in folder.glob("shard-?????.json"))
    print(f"killed with shards {committed} committed and {len(answered)} turns journaled")
    assert committed and answered and not (folder / "manifest.json").exists()
    assert not {s for s, _, _ in answered} & set(committed)

    counting = _Counting(monkeypatch)
    run_prepare(recipe, progress=False)
    assert len(started) == 1  # a fresh server: the killed one's port is not part of the job
    records = list(regenerated_records(str(folder)))
    assert len(records) == 32 and all(len(r["messages"]) == 2 for r in records)  # max_turns 1: first answers
    target = load_target_files(tiny_target_dir)
    prompt = {(s, i): tuple(target.render_chat(records[8 * s + i]["messages"][:1])) for s in range(4) for i in range(8)}
    asked = [tuple(p) for p in counting.prompts]
    assert not set(asked) & {prompt[s, i] for s, i, _ in answered}  # no journaled turn requested again
    assert sorted(asked) == sorted(prompt[s, i] for s in range(4) for i in range(8)
                                   if s not in committed and (s, i, 0) not in answered)

    clean = load_recipe(STAGE_RECIPES["prepare"], overrides(tmp_path / "clean"))
    run_prepare(clean, progress=False)
    assert records == list(regenerated_records(str(tmp_path / "clean" / "prepare" / "data" / "regenerate")))


@engine
def test_a_server_that_dies_mid_run_stops_the_job_and_keeps_its_shards(tmp_path, target, gguf, server):
    folder = tmp_path / "job"
    with llamacpp.serving(llamacpp.ServerSpec(model=gguf, threads=1, slots=1, ctx=512)) as dying:
        def kill_after_first_shard():
            deadline = time.time() + 120
            while not (folder / "shard-00000.json").exists() and time.time() < deadline:
                time.sleep(0.005)
            dying.proc.kill()  # the llama-server this test started, by its PID

        killer = threading.Thread(target=kill_after_first_shard)
        killer.start()
        with pytest.raises(DraftsmithError, match=r"stopped answering .*finished shards .* are kept .* resume") as e:
            _run(folder, target, ServerConfig(url=dying.url, concurrency=1, retries=1, backoff_s=0.0))
        killer.join()
    print(e.value)
    assert (folder / "shard-00000.jsonl").exists() and not (folder / "shard-00001.jsonl").exists()
    report, got = _run(folder, target, ServerConfig(url=server.url, concurrency=1))  # another server, same model
    assert report.note == "resuming: 1 finished shard(s) kept"
    assert len(got) == 8 and report.turns == 16


@engine
@pytest.mark.e2e
def test_the_real_target_served_from_its_ggufs(tmp_path, smollm2, mtbench_first_turns, monkeypatch):
    """SmolLM2: its shipped Q4_1 GGUF passes the tokenizer probe, its real answers render back to their ids, and
    an F32 GGUF converted from it answers as the fp32 target does in-process (the measured share is printed).
    One sequence at a time on both sides: batched rows (left padding here, shared batches there) round
    differently, and a near-tie can then flip a greedy token (5 of 6 once with batch 4 vs 2 slots)."""
    users = [[t] for t in mtbench_first_turns[:6]]
    _, ref = _run(tmp_path / "generate", smollm2, users=users, max_length=1024, max_new_tokens=24, batch_size=1)
    rows = {}
    for kind in ("as-loaded", "f32"):
        report, rows[kind] = _run(tmp_path / kind, smollm2, ServerConfig(launch="llamacpp", gguf_type=kind, slots=1,
                                                                          threads=1, concurrency=1),
                                  users=users, max_length=1024, max_new_tokens=24)
        assert dict(report.render_back) == {"ok": 6}, kind
        print(f"{kind}: {sum(a == b for a, b in zip(rows[kind], ref))} of 6 answers = in-process fp32 greedy")
    assert rows["f32"] == ref
