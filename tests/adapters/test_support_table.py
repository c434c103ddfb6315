"""The support and catalog tables of docs/families.md are exactly what the suites check (rendered from their
expected outcomes)."""

from __future__ import annotations

import catalog_table
import support_table
from families import CONFIGS
from helpers import REPO_ROOT

FAMILIES_PAGE = REPO_ROOT / "docs" / "families.md"


def test_families_page_holds_the_rendered_support_table() -> None:
    page = FAMILIES_PAGE.read_text()
    assert support_table.render() in page, (
        "docs/families.md's support table differs from the suites' expected outcomes: paste the output of "
        "`.venv/bin/python tests/support/support_table.py` into docs/families.md")


def test_families_page_holds_the_rendered_catalog_table() -> None:
    """The catalog table (every causal LM of transformers; hybrid families' state layers and snapshot sizes,
    measured on their tiny models) is the one ``catalog_table.render()`` gives."""
    page = FAMILIES_PAGE.read_text()
    assert catalog_table.render() in page, (
        "docs/families.md's catalog table differs from the catalog: paste the output of "
        "`.venv/bin/python tests/support/catalog_table.py` into docs/families.md")


def test_every_family_has_an_outcome_on_every_path() -> None:
    cells = support_table.cells()
    paths = {path for _, path in cells}
    missing = sorted((family, path) for family in CONFIGS for path in paths if (family, path) not in cells)
    assert not missing, f"families without an expected outcome: {missing}"
