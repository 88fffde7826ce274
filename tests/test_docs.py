"""The docs cannot drift: every Python snippet of README.md and docs/*.md runs (issue #25).

* Every ```` ```python ```` fenced block is collected from the Markdown. The blocks of one
  page run in order in one fresh namespace (a later block may use names from an earlier
  one), in a fresh working directory, with ``HF_HUB_OFFLINE=1``; all pages run in one
  subprocess (torch and transformers are imported once), under a timeout. A traceback
  points at the page and line of the Markdown.
* A block that cannot run here (it needs a GPU, a downloaded checkpoint, the network)
  carries an HTML comment on the line just before its fence,
  ``<!-- docs-test: skip (the reason) -->``; each such block is reported as a skipped test
  with its reason, never dropped silently.
* Bash blocks are not run, but every ``scripts/*.sh``, ``benchmarks/*.py`` and
  ``examples/*.py`` path they name must exist.
* Every relative link of README.md, docs/*.md and benchmarks/README.md resolves: the file
  exists, and an ``#anchor`` names a heading (GitHub's rule: lowercase, spaces to ``-``,
  punctuation other than ``-`` and ``_`` dropped, ``-1``, ``-2`` for repeats) or an
  ``<a id=...>`` of the target page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose Python snippets run.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Pages whose links are checked.
LINK_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]

#: Seconds for all pages together (about 25 s on 2 idle cores).
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not (ROOT / "README.md").is_file() or not (ROOT / "docs").is_dir(),
    reason="README.md / docs/ not found next to tests/ (tests copied out of the checkout)",
)

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`]*)")
SKIP = re.compile(
    r"^[ \t]*<!--[ \t]*docs-test:[ \t]*skip[ \t]*\((?P<reason>.*\S.*)\)[ \t]*-->[ \t]*$"
)
MARKER = "docs-test:"
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+\1")  # an inline code span


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first code line (the one after the opening fence)
    lang: str
    code: str
    skip: Optional[str]  # the reason given in the Markdown, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line - 1}"


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (indented ones inside lists included)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m["indent"]), m["fence"], m["lang"].lower()
        skip = SKIP.match(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            s = lines[j]
            if s.strip().startswith(fence[0] * len(fence)) and not s.strip().strip(fence[0]):
                break
            # Drop the fence's indentation (a block inside a list item).
            body.append(s[indent:] if s[:indent].strip() == "" else s.lstrip())
            j += 1
        assert j < len(lines), f"{rel(page)}:{i + 1}: unclosed code fence"
        blocks.append(Block(page, i + 2, lang, "\n".join(body) + "\n", skip and skip["reason"]))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in fenced_blocks(page)] if PAGES[0].is_file() else []
PY_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]
RUN_PAGES = sorted({b.page for b in PY_BLOCKS if b.skip is None}, key=PAGES.index)
SKIPPED = [b for b in PY_BLOCKS if b.skip is not None]


# --------------------------------------------------------------------------------------------
# The snippets
# --------------------------------------------------------------------------------------------

#: Runs in a subprocess: argv[1] = JSON [[page, workdir, [[line, code], ...]], ...],
#: argv[2] = result file (rewritten after every page, so a crash leaves the pages before it).
RUNNER = r"""
import json, os, sys, time, traceback
jobs, result_file = json.loads(open(sys.argv[1]).read()), sys.argv[2]
results = {}
for page, workdir, blocks in jobs:
    os.chdir(workdir)
    ns = {"__name__": "__main__"}  # one fresh namespace per page
    t0 = time.perf_counter()
    error = None
    for line, code in blocks:
        try:
            # Padded so that a traceback gives the Markdown line.
            exec(compile("\n" * (line - 1) + code, page, "exec"), ns)
        except BaseException:
            error = f"the block at {page}:{line - 1} failed:\n" + traceback.format_exc()
            break
    results[page] = {"error": error, "seconds": round(time.perf_counter() - t0, 2)}
    with open(result_file, "w") as f:
        json.dump(results, f)
"""


@pytest.fixture(scope="module")
def snippet_results(tmp_path_factory) -> dict:
    """Run every page's runnable Python blocks (one subprocess, one namespace per page)."""
    tmp = tmp_path_factory.mktemp("docs")
    jobs = []
    for page in RUN_PAGES:
        workdir = tmp / rel(page).replace("/", "_")
        workdir.mkdir()
        code = [[b.line, b.code] for b in PY_BLOCKS if b.page == page and b.skip is None]
        jobs.append([str(page), str(workdir), code])
    job_file, result_file = tmp / "jobs.json", tmp / "results.json"
    job_file.write_text(json.dumps(jobs))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(job_file), str(result_file)],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        died = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        died = f"timed out after {TIMEOUT_S} s"
        output = "".join(
            x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            for x in (e.stdout, e.stderr)
        )
    results = json.loads(result_file.read_text()) if result_file.exists() else {}
    return {"results": results, "died": died, "output": output[-6000:]}


@pytest.mark.parametrize("page", RUN_PAGES, ids=rel)
def test_python_snippets_run(page: Path, snippet_results: dict) -> None:
    r = snippet_results["results"].get(str(page))
    if r is None:
        pytest.fail(
            f"{rel(page)} did not run: the snippet runner {snippet_results['died']}"
            f" (in an earlier page or this one)\n{snippet_results['output']}"
        )
    assert r["error"] is None, f"{r['error']}\n--- output ---\n{snippet_results['output']}"


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.where)
def test_python_snippet_skipped(block: Block) -> None:
    """Each block marked ``docs-test: skip`` in the Markdown, reported with its reason."""
    pytest.skip(f"{block.where}: {block.skip}")


def test_snippets_were_found() -> None:
    assert RUN_PAGES and ROOT / "README.md" in RUN_PAGES
    assert len(PY_BLOCKS) - len(SKIPPED) >= 10, "fewer runnable snippets than expected"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_skip_markers_are_well_formed(page: Path) -> None:
    """A ``docs-test:`` comment is a skip with a reason, on the line just before a Python fence."""
    fences = {b.line - 1 for b in fenced_blocks(page) if b.lang in ("python", "py")}
    for lineno, s in outside_fences(page):
        if MARKER not in CODE_SPAN.sub("", s):
            continue
        assert SKIP.match(s), f"{rel(page)}:{lineno}: not `<!-- docs-test: skip (reason) -->`"
        assert lineno + 1 in fences, (
            f"{rel(page)}:{lineno}: a skip marker not just before ```python"
        )


# --------------------------------------------------------------------------------------------
# Bash blocks: the scripts they name exist
# --------------------------------------------------------------------------------------------

SCRIPT_PATH = re.compile(r"(?<![\w./-])((?:scripts|benchmarks|examples)/[\w./-]+\.(?:sh|py))")
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=lambda b: b.where)
def test_bash_block_paths_exist(block: Block) -> None:
    for path in SCRIPT_PATH.findall(block.code):
        assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"


# --------------------------------------------------------------------------------------------
# Links and anchors
# --------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$")
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (its rendered text: links and code marks dropped)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_fences(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines of ``page`` outside fenced code blocks."""
    inside: set[int] = set()
    for b in fenced_blocks(page):
        inside.update(range(b.line - 1, b.line + b.code.count("\n") + 1))
    lines = page.read_text(encoding="utf-8").splitlines()
    return [(i + 1, s) for i, s in enumerate(lines) if i + 1 not in inside]


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, s in outside_fences(page):
        out.update(HTML_ID.findall(s))
        m = HEADING.match(s)
        if m:
            slug = github_slug(m[1])
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


@pytest.mark.parametrize("page", [p for p in LINK_PAGES if p.is_file()], ids=rel)
def test_links_resolve(page: Path) -> None:
    bad = []
    for lineno, s in outside_fences(page):
        s = CODE_SPAN.sub("", s)  # links inside code spans are text
        for target in LINK.findall(s):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{rel(page)}:{lineno}: {target}: no file {path}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(page)}:{lineno}: {target}: no anchor #{anchor} in {path or 'it'}")
    assert not bad, "\n".join(bad)
