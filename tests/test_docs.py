"""The design pages under docs/ are the repository's own: nothing cites a document that is not
in it, every docs page that is named exists, and every relative link of the docs and of the
README resolves. Pure file reads."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("bdlm_jax", "experiments", "tests", "configs", "docs", "run.py", "README.md")
# Built from pieces so that this file does not match its own checks.
FORBIDDEN = ("DESIGN" + ".md", "shared" + "/")
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


def test_docs_pages_exist():
  assert os.path.isfile(os.path.join(REPO, "docs", "README.md"))
  pages = [n for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md")]
  assert len(pages) > 1


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
  pages = ["README.md"] + [rel for rel in FILES if rel.startswith("docs" + os.sep)
                           and rel.endswith(".md")]
  broken = [f"{rel}: {target}" for rel in pages for target in _link_targets(_read(rel))
            if not os.path.exists(os.path.normpath(
                os.path.join(REPO, os.path.dirname(rel), target)))]
  assert not broken, f"links that resolve to nothing: {broken}"


def test_the_docs_index_lists_every_page():
  index = _read(os.path.join("docs", "README.md"))
  linked = {os.path.normpath(t) for t in _link_targets(index)}
  pages = {n for n in os.listdir(os.path.join(REPO, "docs"))
           if n.endswith(".md") and n != "README.md"}
  assert pages <= linked, f"pages missing from docs/README.md: {sorted(pages - linked)}"
