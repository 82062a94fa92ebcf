"""The documentation's links, cited files and wording, and the README's contract with CI.

Every relative link in README.md and docs/**/*.md must name an existing file, and a link with an
anchor (``file.md#section`` or ``#section``) a heading of that file, by GitHub's rule for heading
anchors. Links to other sites (http, https, mailto) are not fetched. Every file of the repository
that README.md or a docs/*.md page cites by path (``posbench/runs/rundir.py``,
``tests/integration/test_adding_a_task.py``) must exist; the examples of the guides, in code
blocks, are files a user writes and are not checked.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and ![alt](target); the target ends at the first space or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered -1, -2, ...; and the explicit ``<a id="...">`` anchors that keep an
    old link to a renamed heading working."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    anchors: set[str] = set(HTML_ANCHOR.findall(text))
    for line in text.splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file (or heading anchor) does not exist."""
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


CITED = re.compile(r"(?<![\w/.\-])((?:posbench|tests|scripts|configs|hydra_plugins|docs|\.ci)/[\w./\-]*[\w/])")
"""A path into the repository's folders, as the pages cite one (in backticks or plain)."""


def missing_cited_files(path: Path) -> list[str]:
    """The repository paths ``path`` cites outside code blocks that exist neither from the
    repository's root nor from the page's folder. A path continued by a placeholder or a pattern
    (``configs/method/<name>.yaml``, ``docs/*.md``, ``{a,b}``) is not one file and is skipped."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    missing = []
    for match in CITED.finditer(text):
        cited = match.group(1).rstrip(".")
        if text[match.end():match.end() + 1] in ("<", "*", "{", "["):
            continue
        if not (ROOT / cited).exists() and not (path.parent / cited).exists():
            missing.append(cited)
    return missing


def count_links(path: Path) -> int:
    return len(LINK.findall(INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))))


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_files_exist(path):
    assert missing_cited_files(path) == []


def test_the_cited_file_checker_catches_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `tests/project/test_docs.py` and scripts/no_such_script.py; `posbench/runs/gone.py`.\n"
                    "Each `configs/method/<name>.yaml`, every `docs/*.md`.\n\n```\n# configs/task/mine.yaml\n```\n")
    assert missing_cited_files(page) == ["scripts/no_such_script.py", "posbench/runs/gone.py"]


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_pages_speak_to_users_not_of_a_tracker(path):
    """The pages describe posbench, not the tracker that planned it (no "issue 27", "the issue's")."""
    hits = [line for line in path.read_text(encoding="utf-8").splitlines() if re.search(r"issues?\b", line)]
    assert hits == []


def test_readme_links_into_the_docs():
    # The README is the front door: it must reach the reference pages (not a vacuous pass).
    assert count_links(ROOT / "README.md") >= 20
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in ("docs/index.md", "docs/configuration.md", "docs/results-schema.md", "docs/protocol.md",
                 "docs/troubleshooting.md", "docs/run-directory.md"):
        assert f"]({page}" in readme, page


def test_link_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n<a id=\"old-name\"></a>\n## Results and `results.json`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Weights & Biases\n\n"
        "[ok](other.md) [ok](other.md#results-and-resultsjson) [ok](other.md#old-name) [ok](#weights--biases)\n"
        "[web](https://x.org/a)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [bad self](#nope)\n"
        "`[not a link](missing-in-code.md)`\n\n```\n[not a link](missing-in-fence.md)\n```\n"
    )
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#nope: no heading #nope in other.md",
        "#nope: no heading #nope in page.md",
    ]


def test_readme_keeps_the_ci_test_command():
    # .ci/run runs the README's test command; both must name the same one.
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "\nbash scripts/test.sh" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_a_front_door():
    # Reference material lives in docs/; the README stays short (at most ~350 lines).
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 360


def test_mkdocs_nav_lists_every_page():
    # Every top-level page of docs/ is reachable from the site's navigation (the results pages in
    # docs/<study>/ are reached through links from those pages).
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    every = list(pages(nav))
    assert sorted({p for p in every if every.count(p) > 1}) == [], "mkdocs.yml nav lists a page twice"
    listed = set(every)
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name not in listed)
    assert missing == [], f"mkdocs.yml nav lacks {missing}"
    assert all((ROOT / "docs" / page).is_file() for page in listed), sorted(listed)


def test_the_readmes_headline_pointer_finds_the_headline_in_a_shipped_run():
    """The README pointed to bands["256-512"] at the top of results.json; it sits in the plain
    entry under eval."""
    import json

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = float(re.search(r"256-512 loss (\d\.\d+)`", readme).group(1))
    pointer = re.search(r'`bands\["256-512"\]` of the plain entry \(`"extension": "none"`\) at length (\d+) in the '
                        r"`eval` list of\s+`results.json`", readme)
    assert pointer is not None
    results = json.loads((ROOT / "docs" / "cpu_quick" / "runs" / "rope-s0" / "results.json").read_text())
    assert "bands" not in results
    (entry,) = [e for e in results["eval"] if e["extension"] == "none" and e["length"] == int(pointer.group(1))]
    assert entry["bands"]["256-512"] == pytest.approx(headline, abs=5e-5)


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_token_cache_is_named_where_a_new_user_reads(page):
    """It was named only in troubleshooting and the data page."""
    text = (ROOT / page).read_text(encoding="utf-8")
    assert "~/.cache/posbench" in text and "POSBENCH_CACHE" in text
