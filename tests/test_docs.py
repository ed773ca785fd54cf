"""Documentation stays in step with the code."""

from pathlib import Path

from gradsync.config import markdown_table

DOCS = Path(__file__).parent.parent / "docs"


def test_configuration_table_matches_settings():
    text = (DOCS / "configuration.md").read_text()
    table = text.split("<!-- settings-table -->\n")[1].split("\n<!-- /settings-table -->")[0]
    assert table == markdown_table(), "regenerate the table with gradsync.config.markdown_table()"
