"""bench/RESULTS.md says where things stand and notebook 06 reads it: every table the notebook asks for is a current
table (under its ``<!-- current: name -->`` marker, once), the file stays short enough to read, the history sits in
bench/JOURNAL.md in date order with no current table of its own, and each entry RESULTS.md names is there."""

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
JOURNAL = ROOT / "bench" / "JOURNAL.md"
NOTEBOOK = ROOT / "notebooks" / "06_open_questions.ipynb"
MARKER = re.compile(r"^<!-- current: ([\w-]+) -->$", re.M)


def _table_after(text: str, name: str) -> list[str]:
    """The table lines right after the marker of `name` (the notebook's reading of it)."""
    after = text.split(f"<!-- current: {name} -->\n", 1)[1].splitlines()
    return after[:next((i for i, line in enumerate(after) if not line.startswith("|")), len(after))]


def test_every_table_notebook_06_reads_is_a_current_table():
    source = "\n".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    asked = set(re.findall(r'recorded(?:_rows)?\("([^"]+)"\)', source))
    assert asked, "notebook 06 reads no recorded table"
    current = set(MARKER.findall(RESULTS.read_text()))
    assert asked <= current, f"notebook 06 asks for tables bench/RESULTS.md does not mark: {sorted(asked - current)}"


def test_each_marker_is_unique_and_heads_a_table_with_rows():
    text = RESULTS.read_text()
    names = MARKER.findall(text)
    assert len(names) >= 10 and len(names) == len(set(names))
    for name in names:
        table = _table_after(text, name)
        assert len(table) >= 3 and re.fullmatch(r"\|(---\|)+", table[1]), name
        assert all(line.count("|") == table[0].count("|") for line in table), f"{name}: ragged table"


def test_results_is_a_page_and_the_journal_holds_no_current_table():
    lines = RESULTS.read_text().splitlines()
    assert len(lines) < 400, "bench/RESULTS.md is over issue 32's 400 lines: move superseded tables to JOURNAL.md"
    assert max(map(len, lines)) <= 300
    assert not MARKER.search(JOURNAL.read_text())


def test_journal_entries_are_in_date_order_and_every_name_results_cites_is_one():
    journal = JOURNAL.read_text()
    stamps = re.findall(r"^## (\d{4}-\d\d-\d\d \d\d:\d\d) · ", journal, re.M)
    assert len(stamps) >= 10 and stamps == sorted(stamps)
    headings = re.findall(r"^## .*$", journal, re.M)
    text = " ".join(RESULTS.read_text().split())
    cited = [q.removeprefix("... ") for part in re.findall(r"Journal: (.*?)(?:(?<!\.)\.(?!\.)(?: |$)|$)", text)
             for q in re.findall(r'"([^"]+)"', part)]
    assert len(cited) >= 10
    assert [q for q in cited if not any(q in h for h in headings)] == []
