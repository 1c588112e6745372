"""The README and the reference pages hold together: every docs/ page is linked from the README, every relative
link (file and #anchor, GitHub's heading slugs) resolves, and the README stays short (issue 29)."""

from __future__ import annotations

import glob
import os
import re

import pytest

import draftsmith

ROOT = os.path.dirname(os.path.abspath(draftsmith.__file__))
PAGES = ["README.md", "benchmarks/RESULTS.md", *(f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs"))))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces → hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(rel: str) -> set[str]:
    text = re.sub(r"```.*?```", "", read(rel), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_slugs_follow_github():
    assert slug("On a GPU: `benchmarks/gpu_check.sh`") == "on-a-gpu-benchmarksgpu_checksh"
    assert slug("fp32 linears on oneDNN") == "fp32-linears-on-onednn"
    assert slug("The alignment report: `draftsmith report`") == "the-alignment-report-draftsmith-report"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(read("README.md"))}
    missing = [p for p in PAGES if p.startswith("docs/") and p not in linked]
    assert not missing, f"not linked from the README: {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    bad = []
    for m in LINK.finditer(read(page)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, rel)):
            bad.append(f"{target}: no file {rel}")
        elif anchor and rel.endswith(".md") and anchor not in anchors(rel):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    assert not bad, bad


def missing_tests(text: str) -> list[str]:
    """The test files, globs and folders (``tests/…``) that ``text`` names and the tree lacks."""
    named = sorted(set(re.findall(r"tests/[\w*./-]*\w[\w*./-]*", text)))
    return [m for m in named if not glob.glob(os.path.join(ROOT, m.rstrip(".")))]


def test_the_tests_the_pages_name_exist():
    """The README's guarantees and the rules in docs/ name the tests that hold them: every test file, glob or folder a
    page names is in the tree, so a renamed test cannot leave a guarantee pointing at nothing."""
    assert "`tests/test_files.py`" in read("README.md") and "`tests/test_data_*`" in read("README.md")
    assert {p: missing_tests(read(p)) for p in PAGES if missing_tests(read(p))} == {}
    assert missing_tests("held (`tests/test_data_*`, `tests/test_files.py`, `tests/test_fils.py`, tests/archs/).") == \
        ["tests/test_fils.py"]


def test_the_readme_is_short_and_the_serving_sections_are_written():
    assert len(read("README.md").splitlines()) <= 200
    for page, heading in (("docs/export.md", "## Serving in llama.cpp"), ("docs/prepare.md", "## Regeneration through a server")):
        text = read(page)
        assert heading in text and "(being written)" not in text



def dated_figures(text: str, hashes: bool = True) -> list[str]:
    """What in a page is a measurement's trace rather than a pointer to RESULTS: a date, a ratio and (``hashes``) a
    commit hash. docs/ may name upstream sources at a commit, so it is checked without ``hashes``."""
    commit = r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b" if hashes else ""
    return re.findall(r"\b20\d\d-\d\d(?:-\d\d)?\b|\d(?:\.\d+)?×" + commit, text)


def test_the_readme_and_docs_leave_figures_to_results():
    """Figures live in benchmarks/RESULTS.md, each with its date and commit; the README and docs/ link to its sections."""
    example = "1.09× at e18a67f on 2026-12-03; decoded, 2-core, 8,192 rows, 10–15× slower"
    assert dated_figures(example) == ["1.09×", "e18a67f", "2026-12-03", "5×"]
    assert dated_figures(example, hashes=False) == ["1.09×", "2026-12-03", "5×"]
    assert dated_figures(read("README.md")) == []
    assert [(p, f) for p in PAGES if p.startswith("docs/") for f in dated_figures(read(p), hashes=False)] == []


MEASURED = re.compile(r"\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?[x×](?![\w\d])|(?:τ|\btau) (?:of )?\d+\.\d+"
                      r"|\b[cv](?:\(\d+\))? [=≈] \d+\.\d+|\d+ (?:new )?tok/s")
"""What in a docstring, comment or recipe reads as a measured figure: a ratio, a τ, a draft or verification cost,
a speed."""
NOT_MEASURED = ("about 4× the conversations", "4× the steps", "~5× the memory", "expected 3×{", "above 1×",
                "f\"{r['speedup']:.2f}x\"", "~2.8× the EAGLE-3 head's", "~2.5× the EAGLE-3 head's")
"""Ratios of design, not of a run: a size's multiple, a shape, an arithmetic estimate, a printed format."""


def measured_figures(text: str) -> list[str]:
    return [m.group() for line in text.splitlines() if not any(n in line for n in NOT_MEASURED)
            for m in MEASURED.finditer(line)]


def test_the_code_and_recipes_leave_figures_to_results():
    """Docstrings, comments and recipes name the RESULTS section, never its number, which a rerun would leave stale
    there (two docstrings gave different figures of one measurement)."""
    assert measured_figures("a block costs c = 0.136 and trains 3x faster, 10-15× slower, sim τ 1.10, 49 tok/s;\n"
                            "about 4× the conversations") == ["c = 0.136", "3x", "10-15×", "τ 1.10", "49 tok/s"]
    assert measured_figures("# sim tau 1.15 against 1.10; the model's costs c ≈ 0.07; v(4) ≈ 1.0; 181 against 153 new "
                            "tok/s") == ["tau 1.15", "c ≈ 0.07", "v(4) ≈ 1.0", "153 new tok/s"]
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in ("tests", "benchmarks", "docs") and not d.startswith((".", "_"))]
        for name in files:
            if name.endswith((".py", ".yaml", ".sh", ".toml")) or name == "Makefile":
                rel = os.path.relpath(os.path.join(folder, name), ROOT)
                found += [(rel, f) for f in measured_figures(read(rel))]
    assert found == []


UPSTREAM = re.compile(r"(?:[\w.-]+/[\w.-]+|SpecForge|llama\.cpp|vLLM|SGLang|transformers|speculators)$")
"""A name an issue number may follow when the issue is another project's (ggml-org/llama.cpp issues 25618 …)."""


def project_issues(text: str) -> list[str]:
    """The references to this project's own issues ("issue 9's bar") in ``text``."""
    return [m.group() for m in re.finditer(r"(?i)\bissues? \d+", text)
            if not UPSTREAM.search(text[max(0, m.start() - 40):m.start()].rstrip())]


def test_results_docs_and_benchmarks_speak_of_the_project_not_of_its_issues():
    """RESULTS, its history, docs/ and the benchmark scripts (whose docstrings are their --help) name the bar or the
    lever, not the issue that asked for it: a reader has the repository, not the tracker."""
    assert project_issues("under issue 9's bar; ggml-org/llama.cpp issues 25618 and 27407; SpecForge issue 828; "
                          "Issue 12 asks") == ["issue 9", "Issue 12"]
    bench = os.path.join(ROOT, "benchmarks")
    pages = [*PAGES, "benchmarks/history/2026.md",
             *(f"benchmarks/{n}" for n in sorted(os.listdir(bench)) if n.endswith((".py", ".sh")))]
    assert {p: project_issues(read(p)) for p in pages if project_issues(read(p))} == {}


def first_column(page: str, heading: str) -> list[str]:
    """The names in the first column of the first table under ``heading`` (backticks dropped)."""
    section = read(page).split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("\n|"):].split("\n\n", 1)[0].strip().splitlines()
    return [re.match(r"\| `([^`]+)` \|", row).group(1) for row in table[2:]]  # after the header and its rule


def test_the_reference_tables_hold_every_format_and_family_of_their_homes():
    """docs/export.md's formats and docs/drafters.md's families describe each one at length, so they are written by
    hand; their rows are held against the home (``export.FORMATS``, the drafter registry) so none goes missing."""
    from draftsmith.drafters.registry import specs
    from draftsmith.export import FORMATS, IMPORTS

    assert first_column("docs/export.md", "## Formats") == list(FORMATS)
    assert first_column("docs/export.md", "## Import: `draftsmith import`") == list(IMPORTS)
    families = first_column("docs/drafters.md", "## Families")
    assert sorted(families) == sorted(specs())
    trained = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|.*\| (?!—)[^|]+\|$", read("docs/drafters.md"), re.M)}
    assert trained == {n for n, s in specs().items() if s.trainable}



def summary_misses(text: str) -> list[str]:
    """What RESULTS' summary table (above its first ``## `` section) says that its sections do not: a row per
    section, linking to it, and every bold figure of a row written in the section it links to (its ``###``
    subsections included; white space folded)."""
    head, _, body = text.partition("\n## ")
    parts = re.split(r"^## (.+)$", "## " + body, flags=re.M)
    sections = {slug(parts[i]): " ".join(parts[i + 1].split()) for i in range(1, len(parts), 2)}
    rows = re.findall(r"^\| \[[^\]]+\]\(#([^)]+)\) \|(.*)$", head, re.M)
    misses = [f"no summary row for #{a}" for a in sections if a not in {r for r, _ in rows}]
    for anchor, rest in rows:
        figures = [" ".join(b.split()) for b in re.findall(r"\*\*(.+?)\*\*", rest)]
        if anchor not in sections:
            misses.append(f"#{anchor}: no such section")
        elif not figures:
            misses.append(f"#{anchor}: no bold figure")
        misses += [f"#{anchor}: {f!r} is not in the section" for f in figures if anchor in sections and f not in sections[anchor]]
    return misses


def test_the_results_summary_quotes_its_sections():
    """RESULTS' summary is checked against its sections, so a figure is written once, in its section, and quoted."""
    assert summary_misses(read("benchmarks/RESULTS.md")) == []


def test_a_summary_figure_its_section_lacks_is_found():
    page = ("# R\n\n| benchmark | figure |\n| --- | --- |\n| [demo](#demo) | **1.11×**, **16 min** |\n"
            "| [old](#old) | **2×** |\n\n## demo\n\nran **1.109×**\nin 16\nmin\n\n### sub\n\n## ceiling\n\n**3.95×**\n")
    assert summary_misses(page) == ["no summary row for #ceiling", "#demo: '1.11×' is not in the section",
                                    "#old: no such section"]


def section_misses(text: str) -> list[str]:
    """What a RESULTS section lacks of what each must name: the command that reproduces it (a ``bash`` block, or
    ``python benchmarks/…`` / ``draftsmith …`` / ``make …`` in backticks), the machine, a date and a commit ("at X",
    "code of X" where the run recorded it, "committed in X" where it did not)."""
    _, _, body = text.partition("\n## ")
    parts = re.split(r"^## (.+)$", "## " + body, flags=re.M)
    needs = {"command": r"```bash|`(?:python3? benchmarks/|draftsmith |make )",
             "machine": r"\bVM\b|\bH[12]00\b|\bmachine\b|\bcores\b",
             "date": r"\b20\d\d-\d\d-\d\d\b",
             "commit": r"\b(?:at|committed in|code of) [0-9a-f]{7,40}\b"}
    return [f"{parts[i]}: no {need}" for i in range(1, len(parts), 2) for need, pattern in needs.items()
            if not re.search(pattern, parts[i + 1])]


def test_every_results_section_names_its_command_machine_date_and_commit():
    assert section_misses(read("benchmarks/RESULTS.md")) == []


def test_a_section_without_its_commit_or_machine_is_found():
    page = ("# R\n\n| x |\n\n## a\n\n**2026-12-01, AVX2 VM, at 84656d8**\n\n```bash\npython benchmarks/a.py\n```\n\n"
            "## b\n\n**2026-12-02, quiet**: `python benchmarks/b.py`\n\n## c\n\nran on 2 cores, committed in 53c76e8\n")
    assert section_misses(page) == ["b: no machine", "b: no commit", "c: no command", "c: no date"]


def history_misses(results: str, history: str) -> list[str]:
    """The sections RESULTS sends a reader to in its history (``history, "ceiling"``, the name possibly broken over a
    line) that the history has no ``## `` or ``### `` heading for: a heading is the name, or starts with it followed
    by a space, a comma or a colon."""
    named = {" ".join(m.group(1).split()) for m in re.finditer(r'history[,:]\s+"([^"]+)"', results)}
    headings = re.findall(r"^#{2,3} (.+)$", history, re.M)
    return sorted(n for n in named if not any(h == n or re.match(re.escape(n) + r"[ ,:]", h) for h in headings))


def test_what_results_sends_to_its_history_is_there():
    """Superseded runs leave RESULTS for benchmarks/history/ with a pointer in their place: each pointer names a
    section the history has."""
    assert history_misses(read("benchmarks/RESULTS.md"), read("benchmarks/history/2026.md")) == []


def test_a_pointer_to_a_missing_history_section_is_found():
    results = 'runs before: history, "ceiling". Older: history,\n"data curve"; (history: "c"); history, "tree".'
    history = "# H\n\n## ceiling — the oracle\n\n## cpu_linear — a linear\n\n### data curves, all\n\n## tree\n"
    assert history_misses(results, history) == ["c", "data curve"]


POINTER = re.compile(r'(RESULTS(?:\.md)?|history(?:/2026\.md)?)[,:]?\s+\(?("[^"\n]+"(?:(?:,|\s+and)\s+"[^"\n]+")*)')
"""A pointer to a section of RESULTS or of its history: ``RESULTS.md, "ceiling"``, ``[RESULTS "tree"](…)``,
``history/2026.md, "demo", "The pipeline in native bf16"`` (a subsection of "demo"), ``RESULTS.md, "levers" and
"EAGLE-3.1 norms"`` (two sections)."""


def headings(page: str) -> list[tuple[str, str]]:
    """Each ``## `` and ``### `` heading of a Markdown text (code blocks left out), with the ``## `` it stands under."""
    out, top = [], ""
    for hashes, title in re.findall(r"^(#{2,3}) (.+)$", re.sub(r"```.*?```", "", page, flags=re.S), re.M):
        top = title if hashes == "##" else top
        out.append((title, top if hashes == "###" else ""))
    return out


def pointer_misses(text: str, results: str, history: str) -> list[str]:
    """The pointers of ``text`` (lines joined, comment marks dropped) whose sections RESULTS or its history lacks: a
    name matches a heading that is the name or starts with it and a space, comma or colon; a name after a comma is a
    ``### `` under the ``## `` the first one names, or a ``## `` of its own (a list of sections)."""
    def named(name: str, title: str) -> bool:
        return title == name or bool(re.match(re.escape(name) + r"[ ,:]", title))

    misses = []
    for m in POINTER.finditer(re.sub(r"\s*\n\s*(?:#+\s)?", " ", text)):
        page = headings(results if m.group(1).startswith("RESULTS") else history)
        for group in re.split(r"\s+and\s+", m.group(2)):
            first, *subs = re.findall(r'"([^"]+)"', group)
            tops = [t for t, parent in page if named(first, t)]
            if not tops:
                misses.append(f"{m.group(1)}: {first!r}")
            misses += [f"{m.group(1)}: {first!r}, {s!r}" for s in subs
                       if not any(named(s, t) and (not parent or named(first, parent)) for t, parent in page)]
    return misses


def test_what_the_tree_sends_to_results_and_its_history_is_there():
    """Docstrings, comments, recipes, tests and pages name RESULTS' or its history's section, never its figure: each
    section they name is there (superseded runs move to the history, and a pointer left behind names the section it
    went to). RESULTS' history is past text, left as it was written."""
    results, history = read("benchmarks/RESULTS.md"), read("benchmarks/history/2026.md")
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), ROOT)
            if (name.endswith((".py", ".yaml", ".sh", ".toml", ".md")) or name == "Makefile") and \
                    rel not in ("benchmarks/history/2026.md", "tests/test_docs.py"):
                found.update({rel: m for m in [pointer_misses(read(rel), results, history)] if m})
    assert found == {}


def test_a_pointer_to_a_missing_section_or_subsection_is_found():
    results = "# R\n\n## demo\n\n### sub\n\n## ceiling\n\n## gemma-3\n\n### EAGLE-3.1 norms\n"
    history = "# H\n\n## demo — the main job\n\n### The pipeline in native bf16: more data\n\n## train\n"
    text = ('(benchmarks/RESULTS.md, "demo") [RESULTS "tree"](x) # RESULTS.md,\n    # "ceiling" and "EAGLE-3.1 norms"\n'
            'history/2026.md, "demo", "The pipeline in native bf16"; history/2026.md, "train", "The pipeline"; '
            'RESULTS.md, "demo", "ceiling"')
    assert pointer_misses(text, results, history) == ["RESULTS: 'tree'", "history/2026.md: 'train', 'The pipeline'"]


def test_the_layout_table_has_a_row_for_every_folder_of_the_package():
    """docs/conventions.md's Layout table is where a newcomer looks a folder up: every package folder has its row
    (``engines/``, every layer's home of the engine constants, had none)."""
    table = read("docs/conventions.md").split("\n## Layout\n", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+)/`", " ".join(line.split(" | ")[0] for line in table.splitlines())))
    folders = {n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))}
    assert sorted(folders - named) == []
