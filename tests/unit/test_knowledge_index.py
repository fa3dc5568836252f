"""The folder knowledge base: chunking, BM25 ranking, threshold, bounds,
re-indexing of changed files, hostile queries, its tool and its worker toolkit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetbus.errors import ConfigError
from fleetbus.tools_workers import knowledge
from fleetbus.tools_workers.knowledge import (
    MAX_RESULTS,
    KnowledgeIndex,
    chunk_document,
    knowledge_toolkit,
    knowledge_tools,
)

REFUNDS = """\
# Refunds

Our refund policy is simple and fair.

## Time limits

Customers may ask for a refund within 30 days of delivery.
After that, only store credit is offered.

## Shipping costs

Shipping costs are not refunded, except for damaged parcels.
"""

SECURITY = """\
# Security

## Passwords

Passwords are rotated every 90 days and are at least 14 characters long.

## Badges

Visitors get a paper badge at the front desk.
"""

TRAVEL = """\
# Travel

## Booking

Trains are booked through the travel portal.

## Expenses

Expense reports are filed within 14 days of the trip, with receipts.
"""

OFFICE = "The office opens at 9am.\n\nParking is behind the building, on level -2.\n"


def write_docs(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "refunds.md").write_text(REFUNDS)
    (folder / "security.md").write_text(SECURITY)
    (folder / "handbook").mkdir(exist_ok=True)
    (folder / "handbook" / "travel.md").write_text(TRAVEL)
    (folder / "office.txt").write_text(OFFICE)
    return folder


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return write_docs(tmp_path / "docs")


# -- chunking ------------------------------------------------------------------------------


def test_markdown_is_cut_at_headings_with_the_headings_above_and_the_lines() -> None:
    chunks = chunk_document(REFUNDS)
    assert [(c.heading, c.first_line, c.last_line) for c in chunks] == [
        ("Refunds", 1, 3),
        ("Refunds > Time limits", 5, 8),
        ("Refunds > Shipping costs", 10, 12),
    ]
    assert chunks[1].text.startswith("## Time limits\n\nCustomers may ask")
    lines = REFUNDS.split("\n")
    for chunk in chunks:  # the text is the file's, at the lines it says
        assert chunk.text == "\n".join(lines[chunk.first_line - 1 : chunk.last_line]).strip()


def test_a_fenced_block_is_one_paragraph_and_its_hashes_are_no_headings() -> None:
    text = "# Setup\n\n```sh\n# install\npip install x\n\npip install y\n```\n\nDone.\n"
    chunks = chunk_document(text)
    assert [c.heading for c in chunks] == ["Setup"]
    assert "# install" in chunks[0].text
    assert chunks[0].last_line == 10


def test_passages_are_bounded_and_cut_at_paragraphs_then_lines() -> None:
    paragraphs = [f"Paragraph {i} " + "word " * 30 for i in range(10)]
    text = "# Long\n\n" + "\n\n".join(paragraphs) + "\n\n" + "x" * 500 + "\n"
    chunks = chunk_document(text, max_chars=300)
    assert all(len(c.text) <= 300 for c in chunks)
    assert all(c.heading == "Long" for c in chunks)
    assert sum(c.text.count("Paragraph") for c in chunks) == 10  # nothing lost
    assert sum(len(c.text) for c in chunks if c.text.startswith("x")) == 500
    starts = [c.first_line for c in chunks]
    assert starts == sorted(starts)


def test_plain_text_has_no_headings() -> None:
    chunks = chunk_document("# not a heading\n\nsecond\n", markdown=False)
    assert [(c.heading, c.text) for c in chunks] == [("", "# not a heading\n\nsecond")]


def test_a_heading_with_nothing_under_it_is_no_passage() -> None:
    chunks = chunk_document("# A\n## B\ntext under b\n")
    assert [(c.heading, c.text) for c in chunks] == [("A > B", "## B\ntext under b")]


# -- searching -----------------------------------------------------------------------------


def test_the_passage_that_answers_the_question_comes_first(docs: Path) -> None:
    index = KnowledgeIndex(docs)
    hits = index.search("How many days do customers have to ask for a refund?")
    assert hits[0].source == "refunds.md:5-8 (Refunds > Time limits)"
    assert "within 30 days of delivery" in hits[0].text
    assert (hits[0].path, hits[0].first_line, hits[0].last_line) == ("refunds.md", 5, 8)
    scores = [hit.score for hit in hits]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] > scores[-1] > 0
    parking = index.search("where can I park my car")
    assert parking[0].source == "office.txt:1-3"
    travel = index.search("expense receipts")
    assert travel[0].source == "handbook/travel.md:7-9 (Travel > Expenses)"


def test_stemming_and_case_do_not_matter(docs: Path) -> None:
    index = KnowledgeIndex(docs)
    assert index.search("REFUNDED PARCELS")[0].heading == "Refunds > Shipping costs"
    assert index.search("rotating password")[0].heading == "Security > Passwords"


def test_the_score_threshold_leaves_out_weaker_passages(docs: Path) -> None:
    index = KnowledgeIndex(docs)
    every = index.search("refund days", limit=MAX_RESULTS)
    assert len(every) >= 3
    cut = (every[0].score + every[1].score) / 2
    kept = index.search("refund days", limit=MAX_RESULTS, score_threshold=cut)
    assert [h.source for h in kept] == [every[0].source]
    assert index.search("refund days", score_threshold=every[0].score + 1) == []


def test_results_are_bounded(tmp_path: Path) -> None:
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(30):
        (folder / f"note{i}.txt").write_text(f"widget number {i}\n")
    index = KnowledgeIndex(folder)
    assert len(index.search("widget")) == 5
    assert len(index.search("widget", limit=3)) == 3
    assert len(index.search("widget", limit=1000)) == MAX_RESULTS
    with pytest.raises(ConfigError, match="limit"):
        index.search("widget", limit=0)


@pytest.mark.parametrize(
    "query",
    [
        '"unbalanced',
        "NEAR(refund days",
        "refund AND",
        "* OR -",
        "title:refund",
        "{refund days}",
        "refund^2 ) (",
        "___",
        "'; DROP TABLE chunks; --",
        "\x00\x01",
        "",
        "   ",
        "🙂 réfund",
        "x" * 200_000,
        " ".join(f"w{i}" for i in range(5000)),
    ],
)
def test_any_text_is_a_query(docs: Path, query: str) -> None:
    hits = KnowledgeIndex(docs).search(query)
    assert len(hits) <= 5
    if "refund" in query and "x" * 100 not in query:
        assert hits
        assert all(h.score > 0 for h in hits)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(query=st.text(max_size=200))
def test_generated_queries_never_raise(docs: Path, query: str) -> None:
    hits = KnowledgeIndex(docs, refresh_interval=None).search(query, limit=3)
    assert len(hits) <= 3


def test_a_query_of_common_words_only_is_searched_with_them(docs: Path) -> None:
    hits = KnowledgeIndex(docs).search("the")
    assert hits
    assert all("the" in hit.text.lower().split() for hit in hits)


# -- keeping up with the folder ------------------------------------------------------------


def test_a_changed_file_is_indexed_again_and_a_deleted_one_forgotten(docs: Path) -> None:
    index = KnowledgeIndex(docs, refresh_interval=0)
    assert index.search("store credit")[0].path == "refunds.md"
    assert index.search("kangaroo") == []
    target = docs / "refunds.md"
    target.write_text(REFUNDS.replace("store credit", "a kangaroo plush toy"))
    stamp = target.stat()
    os.utime(target, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    hit = index.search("kangaroo")[0]
    assert (hit.path, hit.heading) == ("refunds.md", "Refunds > Time limits")
    assert "store credit" not in hit.text
    (docs / "new.md").write_text("# Kangaroos\n\nKangaroos hop.\n")
    assert {h.path for h in index.search("kangaroo")} == {"refunds.md", "new.md"}
    target.unlink()
    assert [h.path for h in index.search("kangaroo")] == ["new.md"]
    stats = index.refresh()
    assert (stats.indexed, stats.removed, stats.files) == (0, 0, 4)


def test_it_looks_at_the_folder_no_more_often_than_its_interval(docs: Path) -> None:
    index = KnowledgeIndex(docs, refresh_interval=None)
    assert index.search("kangaroo") == []
    (docs / "new.md").write_text("Kangaroos hop.\n")
    assert index.search("kangaroo") == []  # not looked at again by itself
    assert index.refresh().indexed == 1
    assert index.search("kangaroo")[0].path == "new.md"


def test_hidden_files_symlinks_other_extensions_and_big_files_are_skipped(
    docs: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.md"
    outside.write_text("kangaroo secret\n")
    (docs / "link.md").symlink_to(outside)
    (docs / ".hidden.md").write_text("kangaroo hidden\n")
    (docs / ".git").mkdir()
    (docs / ".git" / "notes.md").write_text("kangaroo git\n")
    (docs / "data.json").write_text('{"kangaroo": 1}\n')
    (docs / "big.txt").write_text("kangaroo " * 200)
    index = KnowledgeIndex(docs, max_file_bytes=1000)
    assert index.search("kangaroo") == []
    stats = index.refresh()
    assert stats.skipped == 0  # already looked at: skipped once, not again
    assert stats.files == 5


def test_an_index_file_keeps_what_is_unchanged_across_restarts(docs: Path, tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    first = KnowledgeIndex(docs, index_path=path)
    assert first.refresh().indexed == 4
    first.close()
    again = KnowledgeIndex(docs, index_path=path)
    stats = again.refresh()
    assert (stats.indexed, stats.files) == (0, 4)
    assert again.search("parking")[0].path == "office.txt"
    other = KnowledgeIndex(docs, index_path=path, chunk_chars=200)  # other settings: anew
    assert other.refresh().indexed == 4


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        KnowledgeIndex(tmp_path / "missing")
    with pytest.raises(ConfigError, match="chunk_chars"):
        KnowledgeIndex(tmp_path, chunk_chars=10)
    with pytest.raises(ConfigError, match="refresh_interval"):
        KnowledgeIndex(tmp_path, refresh_interval=-1)
    (tmp_path / "index.sqlite").write_text("not a database")
    broken = KnowledgeIndex(tmp_path, index_path=tmp_path / "index.sqlite")
    with pytest.raises(ConfigError, match="knowledge index"):
        broken.refresh()


def test_a_folder_that_goes_away_is_a_clear_error(tmp_path: Path) -> None:
    folder = write_docs(tmp_path / "docs")
    index = KnowledgeIndex(folder, refresh_interval=0)
    assert index.search("parking")
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()
    with pytest.raises(ConfigError, match="is gone"):
        index.search("parking")


async def test_retrieve_runs_in_a_thread_and_finds_the_same(docs: Path) -> None:
    index = KnowledgeIndex(docs)
    assert await index.retrieve("parking", 2) == index.search("parking", 2)


# -- the tool and the worker's toolkit -----------------------------------------------------


async def test_the_tool_returns_passages_and_refuses_a_bad_limit(docs: Path) -> None:
    [search] = knowledge_tools(KnowledgeIndex(docs), name="search_docs")
    assert search.name == "search_docs"
    outcome = await search.run({"query": "parking", "limit": 2})
    assert outcome.status == "success"
    assert outcome.content[0]["source"] == "office.txt:1-3"
    assert set(outcome.content[0]) == {
        "text",
        "source",
        "score",
        "path",
        "first_line",
        "last_line",
        "heading",
    }
    too_many = await search.run({"query": "parking", "limit": MAX_RESULTS + 1})
    assert too_many.status == "error"
    assert too_many.error_detail is not None
    assert too_many.error_detail.code == "invalid_parameters"


def test_the_worker_toolkit_comes_from_the_environment(
    docs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(knowledge.KNOWLEDGE_DIR_ENV, raising=False)
    with pytest.raises(ConfigError, match="FLEETBUS_KNOWLEDGE_DIR"):
        knowledge_toolkit()
    with pytest.raises(ConfigError, match="FLEETBUS_KNOWLEDGE_DIR"):
        _ = knowledge.toolkit
    monkeypatch.setenv(knowledge.KNOWLEDGE_DIR_ENV, str(docs))
    monkeypatch.setenv(knowledge.KNOWLEDGE_TOOL_ENV, "handbook_search")
    monkeypatch.delitem(vars(knowledge), "toolkit", raising=False)
    try:
        assert knowledge.toolkit.names == ["handbook_search"]
    finally:
        monkeypatch.delitem(vars(knowledge), "toolkit", raising=False)
