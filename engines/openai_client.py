"""One client for every OpenAI-compatible completions server: llama-server here, vLLM and SGLang on clusters.

Plain ``urllib`` (no dependency: the ``openai`` package is only a test extra, and it cannot send the
engine-specific fields below nor read the ids they return).

**The prompt is token ids.** ``/v1/completions`` with ``prompt: [ids]`` — llama-server, vLLM and SGLang
all accept it — so the server evaluates exactly the tokens draftsmith rendered with the target's chat
template (``prepare``'s own rendering): no server-side template or tokenizer touches the prompt, and no BOS
is added. ``/v1/chat/completions`` would re-render the conversation with the *server's* template, and a text
prompt would be re-tokenized by the *server's* tokenizer; either could drift from the ids training sees.

**The answer comes back as ids where the server can say them** (``return_token_ids``: vLLM ≥ 0.10.2 →
``choices[0].token_ids``; ``return_tokens`` + ``verbose``: llama-server → ``__verbose.tokens``), else as
text, which the caller re-tokenizes with the target's tokenizer.

**Sampling is pinned**, not left to server defaults (llama-server's are top-k 40, top-p 0.95, min-p 0.05):
``temperature`` (0 = greedy), ``top_p``, ``top_k: -1`` and ``min_p: 0`` (off in all three engines),
``seed`` per request, ``stop_token_ids`` (vLLM, SGLang; llama-server stops at the GGUF's end-of-generation
tokens), and ``cache_prompt: false`` (llama-server: each prompt is prefilled whole, so an answer does not
depend on which slot served the previous turn). Fields a server does not know are ignored by all three.

**Authentication.** A server started with an API key (``vllm serve --api-key``, ``llama-server --api-key``)
gets ``$OPENAI_API_KEY`` as a bearer token, as the ``openai`` package sends it; the key stays out of configs.

**Failures.** A connection error, a timeout or an HTTP 429/5xx is retried ``retries`` times with exponential
backoff. What still fails raises :class:`RequestFailed` (the caller skips and counts it), and so does
an answer that cannot be read as one (not HTTP or cut off mid-body, not JSON, no ``choices``, ids that are not
non-negative integers, a count that is not a number: ``bad_http`` / ``bad_json`` / ``bad_answer``, the first two
retried; a server can send anything) — unless the server
no longer answers at all (``/health`` unreachable), which raises :class:`ServerDown`: a long job must stop
there with a clear message rather than skip every remaining record.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DraftsmithError

TRANSIENT_HTTP = (408, 429, 500, 502, 503, 504)


class RequestFailed(Exception):
    """One request failed after its retries while the server still answers; ``reason`` is a short slug."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ServerDown(DraftsmithError):
    """The server stopped answering (a request failed after its retries and ``/health`` is unreachable)."""


@dataclass
class ServedAnswer:
    """One completion as the server returned it."""

    text: str
    finish: str
    """The server's finish_reason: ``stop`` (an end-of-generation token or stop string) or ``length``."""
    tokens: list[int] | None
    """The generated ids when the server returns them (the stop token included where it reports it)."""
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    """Client-side wall time of the successful attempt (prefill, decode, HTTP)."""


def _answer(out: Any, prompt_len: int, seconds: float) -> ServedAnswer:
    """A ``/v1/completions`` reply as a :class:`ServedAnswer`; ValueError (or KeyError, TypeError …) when it is not one."""
    choice = out["choices"][0]
    text = choice.get("text")
    if not isinstance(text, str | None):
        raise ValueError(f"choices[0].text is a {type(text).__name__}")
    tokens = choice.get("token_ids")
    if tokens is None:
        tokens = (out.get("__verbose") or {}).get("tokens")
    usage = out.get("usage") or {}
    return ServedAnswer(text=text or "", finish=str(choice.get("finish_reason") or ""),
                        tokens=_ids(tokens) if tokens is not None else None,
                        prompt_tokens=_count(usage.get("prompt_tokens", prompt_len)),
                        completion_tokens=_count(usage.get("completion_tokens", 0)), seconds=seconds)


def _ids(value: Any) -> list[int]:
    """A list of token ids as a server sent it: non-negative integers, else ValueError."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"token ids are not a list of non-negative integers: {str(value)[:80]}")
    return value


def _json(raw: bytes) -> Any:
    """A server's reply body as JSON; JSONDecodeError for anything else (nesting too deep for the parser included)."""
    try:
        return json.loads(raw)
    except RecursionError as e:
        raise json.JSONDecodeError("nested too deeply to parse", raw[:80].decode(errors="replace"), 0) from e


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a token count is not a non-negative integer: {value!r}")
    return value


class CompletionsClient:
    """Requests to one server at ``url`` (``http://host:port``, with or without a trailing ``/v1``)."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 1.0):
        root = url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.model = model
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._auth = f"Bearer {os.environ.get('OPENAI_API_KEY') or 'none'}"  # a server started with --api-key

    # ---- plumbing
    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        req = urllib.request.Request(self.root + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": self._auth})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _json(r.read())

    def healthy(self) -> bool:
        """Whether the server answers HTTP at all (any status: a 404 on ``/health`` still proves it is up)."""
        try:
            with urllib.request.urlopen(self.root + "/health", timeout=10):
                return True
        except urllib.error.HTTPError:
            return True
        except (urllib.error.URLError, OSError, http.client.HTTPException):  # (no HTTP at all: not up)
            return False

    def _with_retries(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        last = ("", "")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            start = time.perf_counter()
            try:
                return self._post(path, body, self.timeout_s), time.perf_counter() - start
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code not in TRANSIENT_HTTP:
                    raise RequestFailed(f"http_{e.code}", detail) from e  # the server refused this request
                last = (f"http_{e.code}", detail)
            except (TimeoutError, socket.timeout) as e:
                last = ("timeout", f"no answer within {self.timeout_s:g} s ({e})")
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = ("timeout" if isinstance(reason, (TimeoutError, socket.timeout)) else "connection", str(reason))
            except http.client.HTTPException as e:  # not HTTP (a bad status line), or an answer cut off mid-body
                last = ("bad_http", f"{type(e).__name__}: {str(e)[:200]}")
            except json.JSONDecodeError as e:
                last = ("bad_json", str(e))
        if not self.healthy():
            raise ServerDown(f"the server at {self.root} stopped answering ({last[0]}: {last[1]}) after "
                             f"{self.retries} retries")
        raise RequestFailed(*last)

    # ---- the API
    def complete(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_token_ids: Sequence[int] = ()) -> ServedAnswer:
        """One completion of the token ids ``prompt`` (module docstring: what is sent and read back)."""
        body = {"model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
                "temperature": float(temperature), "top_p": float(top_p), "top_k": -1, "min_p": 0.0,
                "seed": int(seed), "stream": False, "n": 1,
                "stop_token_ids": [int(t) for t in stop_token_ids], "return_token_ids": True,  # vLLM, SGLang
                "return_tokens": True, "verbose": True, "cache_prompt": False}  # llama-server
        out, seconds = self._with_retries("/v1/completions", body)
        try:  # every field read here: whatever a server sends back is a counted failure, never a crash
            return _answer(out, len(prompt), seconds)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise RequestFailed("bad_answer", f"{e} in {str(out)[:200]}") from e

    def models(self) -> list[dict[str, Any]] | None:
        """The models the server lists at ``/v1/models`` (each with its ``id`` and ``owned_by``), None if it lists none."""
        try:
            req = urllib.request.Request(self.root + "/v1/models", headers={"Authorization": self._auth})
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                data = _json(r.read()).get("data")
        except (urllib.error.URLError, OSError, http.client.HTTPException, json.JSONDecodeError, AttributeError):
            return None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else None

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids of ``text`` (special tokens parsed, no BOS) via ``/tokenize`` (llama-server,
        vLLM), or None when the server has no such endpoint."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False,  # vLLM
                "content": text, "add_special": False, "parse_special": True}  # llama-server
        try:
            out, _ = self._with_retries("/tokenize", body)
        except RequestFailed as e:
            if e.reason in ("http_404", "http_405"):
                return None
            raise DraftsmithError(f"the server at {self.root} could not tokenize the probe ({e})") from e
        tokens = out.get("tokens") if isinstance(out, dict) else None
        if not isinstance(tokens, list):
            return None
        try:  # a server can send anything: the probe then fails in one line, not with a traceback
            return _ids([t["id"] if isinstance(t, dict) else t for t in tokens])
        except (KeyError, TypeError, ValueError) as e:
            raise DraftsmithError(f"the server at {self.root} answered the tokenize probe with something that is not "
                                  f"token ids ({e}): point data.regenerate.server at a server of the target") from e
