"""The pages under docs/ are the repository's own: nothing cites a document that is not in it,
every docs page that is named exists, every relative link of the docs and of the README
resolves, the README reaches every page in one click, and its headline figures are on the
pages it links. Pure file reads."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("bdlm_jax", "experiments", "tests", "configs", "docs", "run.py", "README.md")
# Built from pieces so that this file does not match its own checks.
FORBIDDEN = ("DESIGN" + ".md", "shared" + "/", "notes" + "/")
# docs/<page>.md, also as ./docs/..., but not inside another path (x/docs/..., mydocs/...)
DOCS_PAGE = re.compile(r"(?<![\w.-])(?<!\w/)" + "docs" + r"/([\w-]+\.md)")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _files() -> list[str]:
  """Repository-relative paths of the .py and .md files under ROOTS."""
  out = []
  for root in ROOTS:
    path = os.path.join(REPO, root)
    if os.path.isfile(path):
      out.append(root)
      continue
    for folder, dirs, names in os.walk(path):
      dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
      out += [os.path.relpath(os.path.join(folder, n), REPO) for n in sorted(names)
              if n.endswith((".py", ".md"))]
  return out


FILES = _files()


def _read(rel: str) -> str:
  with open(os.path.join(REPO, rel), encoding="utf-8") as f:
    return f.read()


def _where(text: str, needle: str) -> list[int]:
  return [i + 1 for i, line in enumerate(text.splitlines()) if needle in line]


def _docs_pages() -> set[str]:
  """Repository-relative paths of every page under docs/ (docs/results/ included)."""
  return {rel for rel in FILES if rel.startswith("docs" + os.sep) and rel.endswith(".md")}


def _linked_pages(rel: str) -> set[str]:
  """Repository-relative paths of the pages `rel` links to."""
  return {os.path.normpath(os.path.join(os.path.dirname(rel), t))
          for t in _link_targets(_read(rel))}


def test_the_readme_reaches_every_docs_page_in_one_click():
  missing = sorted(_docs_pages() - _linked_pages("README.md"))
  assert not missing, f"docs pages the README does not link: {missing}"


def _headline_rows() -> list[str]:
  """The rows of the README's table under "## Headline results"."""
  section = _read("README.md").split("## Headline results", 1)[1].split("\n## ", 1)[0]
  return [line for line in section.splitlines() if line.startswith("|")][2:]


def test_the_readmes_headline_figures_are_on_the_pages_it_links():
  """Each decimal figure of a headline row appears on a page that row links: the front page
  quotes its pages, and a page regenerated with other figures shows here."""
  rows = _headline_rows()
  assert len(rows) >= 4, rows
  for row in rows:
    targets = [os.path.normpath(t) for t in _link_targets(row)]
    assert targets, row
    text = "\n".join(_read(t) for t in targets)
    figures = re.findall(r"(?<![\w.])\d+\.\d+(?![\d.]\d)", INLINE_CODE.sub("", row))
    absent = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", text)]
    assert not absent, f"{row.split('|')[1].strip()}: {absent} not in {targets}"


@pytest.mark.parametrize("needle", FORBIDDEN)
def test_nothing_cites_a_document_outside_the_repository(needle):
  hits = [f"{rel}:{line}" for rel in FILES for line in _where(_read(rel), needle)]
  assert not hits, f"{needle!r} is cited (cite a page of docs/ instead): {hits}"


def test_every_named_docs_page_exists():
  missing = sorted({f"{rel}: docs/{name}" for rel in FILES
                    for name in DOCS_PAGE.findall(_read(rel))
                    if not os.path.isfile(os.path.join(REPO, "docs", name))})
  assert not missing, f"docs pages named but absent: {missing}"


def _link_targets(text: str) -> list[str]:
  """Relative link targets of a markdown text, outside code."""
  text = INLINE_CODE.sub("", FENCE.sub("", text))
  targets = []
  for target in LINK.findall(text):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
      continue  # a URL (http:, mailto:, ...) or an anchor of the same page
    targets.append(target.split("#")[0])
  return targets


def test_relative_links_of_docs_and_readme_resolve():
  pages = ["README.md", *sorted(_docs_pages())]
  broken = [f"{rel}: {target}" for rel in pages for target in _link_targets(_read(rel))
            if not os.path.exists(os.path.normpath(
                os.path.join(REPO, os.path.dirname(rel), target)))]
  assert not broken, f"links that resolve to nothing: {broken}"


def test_the_docs_index_lists_every_page():
  index = os.path.join("docs", "README.md")
  missing = sorted(_docs_pages() - {index} - _linked_pages(index))
  assert not missing, f"pages missing from docs/README.md: {missing}"


FIGURES_FROM = re.compile(r"<!-- figures: (\S+) -->")


def _generated_sections() -> list[tuple[str, str, str]]:
  """(page, results file, text) of each section a page marks `<!-- figures: FILE -->`: from
  the mark to the page's next heading."""
  out = []
  for rel in FILES:
    if not rel.endswith(".md"):
      continue
    text = _read(rel)
    for mark in FIGURES_FROM.finditer(text):
      rest = text[mark.end():]
      end = re.search(r"^#{1,6} ", rest, re.M)
      out.append((rel, mark.group(1), rest[:end.start() if end else None]))
  return out


def test_the_figures_of_a_generated_section_are_in_its_results_file():
  """A section that quotes a script's results file marks it, and each decimal figure of its
  prose and tables appears in that file: a regenerated file with other figures shows here."""
  sections = _generated_sections()
  assert {source for _, source, _ in sections} >= {"experiments/results/recipe_plans.md",
                                                   "experiments/results/cost_model.md"}
  for page, source, section in sections:
    results = _read(source)
    prose = INLINE_CODE.sub("", FENCE.sub("", section))
    figures = re.findall(r"(?<![\w.])\d+\.\d+(?![\d.]\d)", prose)
    absent = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", results)]
    assert figures and not absent, f"{page}: {absent} not in {source}"
