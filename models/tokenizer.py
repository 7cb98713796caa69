"""Tokenizers (and chat templates) rebuilt from GGUF metadata or an HF tokenizer.json: byte-level
BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Qwen2) and SentencePiece BPE with byte fallback
(`"llama"`: Gemma 3), and `ByteTokenizer` (token = UTF-8 byte), the tiny random test model's."""

from __future__ import annotations

import datetime
import json
import pathlib
import warnings
import weakref
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes for the `tokenizer.ggml.pre` names whose vocabularies were not trained with GPT-2's
# split. Every other name gets ByteLevel's built-in GPT-2 regex, which is what transformers does too.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_SPLIT_NAMES = {"default", "gpt2", "gpt-2", "smollm"}


def _byte_level_spelling(token: str, alphabet: frozenset[str]) -> str:
    """A vocabulary entry in the byte-level alphabet; llama.cpp sometimes stores raw text instead."""
    if set(token) <= alphabet:
        return token
    as_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in as_bytes.pre_tokenize_str(token))


def _render_environment() -> Any:
    """A sandboxed Jinja environment configured the way transformers renders chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; chat templates want plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids and chat template a model needs.

    `from_gguf` reproduces transformers' conversion of a GGUF vocabulary, gpt2-type (byte-level
    BPE) or llama-type for Gemma (SentencePiece BPE; `AutoTokenizer.from_pretrained(folder,
    gguf_file=...)`) id for id.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, unk_id: int | None = None, chat_template: str | None = None):
        self.backend = backend
        self._ids = {"bos": bos_id, "eos": eos_id, "pad": pad_id, "unk": unk_id}
        self._chat_template = chat_template
        self._compiled: Any = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: str | pathlib.Path | Any, *, isolate_digits: bool = False) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` metadata: byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
        or SentencePiece BPE with byte fallback (`"llama"`, as Gemma's files have it).

        `isolate_digits=True` first splits every numeric character off on its own, as llama.cpp's
        "smollm" pre-tokenizer and SmolLM2's original tokenizer.json do; the default (False) matches
        transformers, which (in our checks) differs from them only on a space before a non-ASCII numeral (" ½").
        `source` is a path, a `models.files.GGUFFile` or a `gguf.GGUFReader` (see `load_gguf`).
        """
        from models.files import GGUFFile, gguf_field, open_gguf

        reader = open_gguf(source)  # a path is checked first: missing, unreadable or truncated
        path = reader.filename if isinstance(reader, GGUFFile) else getattr(reader.data, "filename", source)

        def field(key: str, default: Any = None) -> Any:
            return gguf_field(reader, key, default)

        kind = field("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_sentencepiece(field, path)
        if kind != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={kind!r} in {path}: supported are 'gpt2' (byte-level BPE) "
                             "and 'llama' (SentencePiece BPE)")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges: list[str] = field("tokenizer.ggml.merges", [])
        token_types: list[int] = field("tokenizer.ggml.token_type", [])
        pre = field("tokenizer.ggml.pre", "default")

        alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
        # Later duplicates win, as in a dict comprehension over the token list.
        vocab = {_byte_level_spelling(t, alphabet): i for i, t in enumerate(tokens)}
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=[tuple(m.split(" ")) for m in merges],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if pre in _PRE_SPLITS:
            split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated")
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        else:
            if pre not in _GPT2_SPLIT_NAMES:
                warnings.warn(
                    f"tokenizer.ggml.pre={pre!r} has no known split regex; using GPT-2's (as transformers does), "
                    "which may tokenize differently from llama.cpp",
                    stacklevel=2,
                )
            backend.pre_tokenizer = byte_level
        if isolate_digits:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
            )
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>, ...) are matched whole and are special; user-defined ones are
        # matched whole but decoded like text. A control token spelled outside the byte alphabet is a
        # llama.cpp mislabel: adding it would create a new id past the model's vocabulary.
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ttype in zip(tokens, token_types) if ttype == _CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ttype in zip(tokens, token_types) if ttype == _USER_DEFINED and t in vocab
        ]
        backend.add_tokens(user)

        bos_id, eos_id = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
        add_bos = field("tokenizer.ggml.add_bos_token", False) and bos_id is not None
        add_eos = field("tokenizer.ggml.add_eos_token", False) and eos_id is not None
        backend.post_processor = _bos_eos_processor(
            tokens[bos_id] if add_bos else None, bos_id, tokens[eos_id] if add_eos else None, eos_id
        )
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=field("tokenizer.ggml.padding_token_id"),
            unk_id=field("tokenizer.ggml.unknown_token_id"),
            chat_template=field("tokenizer.chat_template"),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, field: Any, path: Any) -> Tokenizer:
        """SentencePiece BPE with byte fallback ("▁" marks a space), as Gemma's GGUF stores it.

        The file has no merges: BPE's merge order is rebuilt from the vocabulary, every split of a
        token into two tokens ranked by the merged token's place in the file (Gemma's scores do not
        follow its merge order, its token order does), then longer left part first, as transformers'
        GGUF import does. A token made only of spaces is stored as spaces; it is respelled with "▁".
        """
        if field("tokenizer.ggml.add_space_prefix", False):
            raise ValueError(f"{path}: tokenizer.ggml.add_space_prefix=true (Llama-2 style) is not supported")
        raw: list[str] = field("tokenizer.ggml.tokens")
        token_types: list[int] = field("tokenizer.ggml.token_type", [])
        tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in raw]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []  # (rank of the merged token, -len(left), id of left, left, right)
        for i, t in enumerate(tokens):
            for cut in range(1, len(t)):
                left, right = t[:cut], t[cut:]
                if left in vocab and right in vocab:
                    merges.append((vocab[t], -cut, vocab[left], left, right))
        merges.sort()
        unk_id = field("tokenizer.ggml.unknown_token_id")
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], dropout=None,
                       unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True, byte_fallback=True)
        )
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
        )
        bos_id, eos_id = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
        add_bos = field("tokenizer.ggml.add_bos_token", True) and bos_id is not None  # llama.cpp's default
        add_eos = field("tokenizer.ggml.add_eos_token", False) and eos_id is not None
        backend.post_processor = _bos_eos_processor(
            tokens[bos_id] if add_bos else None, bos_id, tokens[eos_id] if add_eos else None, eos_id
        )
        return cls(backend, bos_id=bos_id, eos_id=eos_id, pad_id=field("tokenizer.ggml.padding_token_id"),
                   unk_id=unk_id, chat_template=field("tokenizer.chat_template"))

    @classmethod
    def from_hf(cls, folder: str | pathlib.Path) -> Tokenizer:
        """Build from an HF folder: `tokenizer.json`, plus ids and chat template from its configs."""
        from models.files import read_json, read_text

        folder = pathlib.Path(folder)
        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {folder} does not exist or is not a folder")
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{folder} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_str(read_text(path))
        except Exception as e:  # the Rust side raises a bare Exception with serde's message
            if isinstance(e, ValueError) and str(path) in str(e):
                raise
            raise ValueError(f"{path} is not a tokenizer the `tokenizers` library can read: {e}") from None

        def read(name: str) -> dict[str, Any]:
            p = folder / name
            if not p.exists():
                return {}
            content = read_json(p)
            if not isinstance(content, dict):
                raise ValueError(f"{p} is not a JSON object")
            return content

        tok_cfg, model_cfg = read("tokenizer_config.json"), read("config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (folder / "chat_template.jinja").exists():
            template = read_text(folder / "chat_template.jinja")

        def token_id(name: str) -> int | None:
            token = tok_cfg.get(f"{name}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if token is not None and backend.token_to_id(token) is not None:
                return backend.token_to_id(token)
            fallback = model_cfg.get(f"{name}_token_id")
            return fallback[0] if isinstance(fallback, list) else fallback

        return cls(backend, bos_id=token_id("bos"), eos_id=token_id("eos"), pad_id=token_id("pad"),
                   unk_id=token_id("unk"), chat_template=template)

    # -- use ----------------------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (49152 for SmolLM2)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any) -> str:
        """Text of `ids` (special tokens kept, as transformers' `decode` does by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does (tokenize=False)."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _render_environment().from_string(self._chat_template)
        special = {
            f"{name}_token": self.backend.id_to_token(i) for name, i in self._ids.items() if i is not None
        }
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**special, **extra}
        )


class ByteTokenizer:
    """Token = UTF-8 byte (vocab 256), no special tokens and no chat template: the tokenizer of
    the tiny random Llama (`model=tiny_random` in `python -m evals.run`)."""

    bos_id = None
    eos_id = None
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _bos_eos_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> Any:
    """What `add_special_tokens=True` adds: the BOS / EOS the file asks for (none for SmolLM2)."""
    def side(type_id: int, body: str) -> list[str]:
        return [f"{bos}:{type_id}"] * (bos is not None) + [body] + [f"{eos}:{type_id}"] * (eos is not None)

    single = side(0, "$A:0")
    pair = single + side(1, "$B:1")
    special = {t: i for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None}
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(special.items()))


_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the tokenizer it was loaded with


def attach(model: Any, tok: Any) -> Any:
    """Remember that `model` reads `tok`'s ids (the loaders call this; `tokenizer_of` reads it,
    e.g. the Engine for kvzip's repeat prompts); returns the model."""
    if tok is not None:
        _OF[model] = tok
    return model


def tokenizer_of(model: Any) -> Any:
    """The tokenizer `model` was loaded with (`attach`), or None."""
    try:
        return _OF.get(model)
    except TypeError:  # not weak-referenceable: nothing attached
        return None
