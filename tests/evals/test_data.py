"""evals.data: the offline long texts. Assumes `bash scripts/fetch_data.sh` has run (CI set-up)."""

import bz2
import lzma
import os
import re
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import rdata

from evals import data

REPO = Path(__file__).resolve().parents[2]


def flat(text: str) -> str:
    """Collapse line breaks and runs of spaces, to look for sentences across printed lines."""
    return re.sub(r"\s+", " ", text)


# The opening words of each novel, a check that every book is whole and correctly labelled.
OPENINGS = {
    "Sense & Sensibility": "The family of Dashwood had long been settled in Sussex.",
    "Pride & Prejudice": "It is a truth universally acknowledged, that a single man in "
    "possession of a good fortune, must be in want of a wife.",
    "Mansfield Park": "About thirty years ago Miss Maria Ward, of Huntingdon,",
    "Emma": "Emma Woodhouse, handsome, clever, and rich,",
    "Northanger Abbey": "No one who had ever seen Catherine Morland in her infancy",
    "Persuasion": "Sir Walter Elliot, of Kellynch Hall, in Somersetshire,",
}


def test_six_novels_in_publication_order_each_opening_with_its_title_and_first_sentence():
    books = data.austen_books()
    assert list(books) == list(OPENINGS)
    for title, text in books.items():
        first_line = text.split("\n", 1)[0]
        assert first_line.upper() == title.upper().replace("&", "AND"), title
        head = flat(text[:3000])
        assert OPENINGS[title] in head, title


def test_pride_and_prejudice_is_the_default_and_is_whole():
    text = data.default_text()
    assert text.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen\n")
    assert "It is a truth universally acknowledged, that a single man in possession\n" in text[:200]
    assert text.endswith("had been the means of uniting them.")
    # janeaustenr 1.0.0 (Debian 1.0.0-1): 13,030 printed lines, 684,767 characters. If a new
    # package version changes this, eval numbers are no longer comparable with old ones.
    assert text.count("\n") + 1 == 13030
    assert len(text) == 684767
    assert "\n\n" in text and "\r" not in text  # paragraph breaks kept, line ends normalised
    assert text == data.load_text("austen:pride") == data.load_text("austen:Pride and Prejudice")


def test_book_lengths_have_the_expected_sizes_and_order():
    sizes = {title: len(text) for title, text in data.austen_books().items()}
    expected = {  # characters, ±3%
        "Sense & Sensibility": 674_000,
        "Pride & Prejudice": 685_000,
        "Mansfield Park": 883_000,
        "Emma": 883_000,
        "Northanger Abbey": 433_000,
        "Persuasion": 467_000,
    }
    for title, n in expected.items():
        assert abs(sizes[title] - n) < 0.03 * n, (title, sizes[title])
    assert 3.9e6 < sum(sizes.values()) < 4.1e6
    assert min(sizes, key=sizes.get) == "Northanger Abbey"


def test_texts_are_cached_in_process():
    assert data.austen_books()["Emma"] is data.austen_books()["Emma"]
    assert data.default_text() is data.default_text()


def test_austen_spec_joins_all_six_books_with_blank_lines():
    books = data.austen_books()
    assert data.load_text("austen") == "\n\n".join(books.values())


@pytest.mark.parametrize("query", ["a", "zzz", ""])
def test_austen_title_that_is_ambiguous_or_unknown_lists_the_titles(query):
    with pytest.raises(ValueError, match=r"Mansfield Park.*Persuasion"):
        data.load_text(f"austen:{query}")


def test_moby_dick_without_gutenberg_boilerplate():
    text = data.load_text("mobydick")
    assert 1.1e6 < len(text) < 1.3e6
    assert "Call me Ishmael." in text[:40_000]
    assert text.endswith("only found another\norphan.")
    assert "\r" not in text and "\ufeff" not in text and "*** START OF" not in text
    assert "Project Gutenberg-tm License" not in text


def test_txt_file_is_read_as_utf8(tmp_path):
    path = tmp_path / "note.txt"
    content = "Ünïcode — line one\n\nline three\n"
    path.write_bytes(content.encode("utf-8"))
    assert data.load_text(str(path)) == content
    assert data.load_text(path) == content


def test_jsonl_joins_text_fields_with_blank_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = ['{"text": "first", "id": 1}', "", '{"text": "sécond\\nline"}', '{"text": ""}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert data.load_text(str(path)) == "first\n\nsécond\nline\n\n"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"title": "no text"}', 'line 2: .*"text"'),
        ('{"text": 3}', 'line 2: .*"text"'),
        ("{oops", "line 2: not valid JSON"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ", " + message):
        data.load_text(str(path))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "absent.txt"))):
        data.load_text(str(tmp_path / "absent.txt"))


@pytest.mark.parametrize("spec", ["wikitext", "pg19", "notes.md", "Austen"])
def test_unknown_spec_lists_the_valid_choices(spec):
    choices = r"'austen'.*'austen:<title substring>'.*'mobydick'.*\.txt.*\.jsonl"
    with pytest.raises(ValueError, match=choices):
        data.load_text(spec)


def test_missing_data_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVP_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    for load in (data.austen_books, data.default_text, lambda: data.load_text("mobydick")):
        with pytest.raises(FileNotFoundError, match="bash scripts/fetch_data.sh"):
            load()


def test_data_dir_defaults_to_repo_data(monkeypatch):
    monkeypatch.delenv("KVP_DATA", raising=False)
    assert data.data_dir() == REPO / "data"


def _record(payload: bytes, compressed: int, kind: bytes) -> bytes:
    """One lazy-load record as R's R_compress1/2/3 write it."""
    header = struct.pack(">I", len(payload))
    if compressed == 1:
        return header + zlib.compress(payload)
    body = {
        b"Z": lambda b: lzma.compress(b, format=lzma.FORMAT_RAW, filters=data._R_LZMA_FILTERS),
        b"2": bz2.compress,
        b"1": zlib.compress,
        b"0": lambda b: b,
    }[kind](payload)
    return header + kind + body


@pytest.mark.parametrize("compressed, kind", [(1, b""), (2, b"2"), (3, b"Z"), (3, b"1"), (3, b"0")])
def test_lazyload_reader_round_trips_every_record_type(tmp_path, compressed, kind):
    """A hand-built lazy-load database (the janeaustenr one only exercises zlib records)."""
    vectors = {"first": np.array(["a", "", "b"]), "second": np.array(["Ünï", "code"])}
    blobs, variables, offset = [], {}, 0
    for name, vector in vectors.items():
        rdata.write_rds(tmp_path / "one.rds", vector, compression=None)
        blob = _record((tmp_path / "one.rds").read_bytes(), compressed, kind)
        variables[name] = np.array([offset, len(blob)], dtype=np.int32)
        blobs.append(blob)
        offset += len(blob)
    stem = tmp_path / "Rdata"
    stem.with_suffix(".rdb").write_bytes(b"".join(blobs))
    rdata.write_rds(
        stem.with_suffix(".rdx"),
        {
            "variables": variables,
            "references": {},
            "compressed": np.array([compressed], dtype=np.int32),
        },
    )
    for name, vector in vectors.items():
        assert data.lazyload_object(stem, name).tolist() == vector.tolist()
    with pytest.raises(KeyError, match="first"):
        data.lazyload_object(stem, "third")


def test_fetch_script_is_idempotent():
    """Data already extracted (by the CI set-up) is not fetched again; stdin is never read."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "fetch_data.sh")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVP_DATA": str(data.data_dir()), "CI": "true"},
    )
    assert result.returncode == 0, result.stderr
    assert "r-cran-janeaustenr already present" in result.stderr
