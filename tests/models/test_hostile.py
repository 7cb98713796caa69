"""Hostile inputs to the model half (issue 9): bad Engine arguments and token ids, missing,
damaged or truncated checkpoints and undecodable tokenizer/config files. Each case is one
ValueError raised on the host before any compute, whose message names the argument or file."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

import kvpolicies
from kvpolicies.prompt import prompt_policy_of
from models.config import LlamaConfig
from models.engine import Engine, check_token_ids
from models.llama import Llama
from models.loading import check_gguf, check_hf_dir, load_gguf, load_hf, read_json, smollm2_gguf_path
from models.reconstruct import RepeatPrompts
from models.tokenizer import Tokenizer
from tests.refs.registry import REFERENCES

CFG = LlamaConfig(vocab_size=256, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG)


@pytest.fixture
def eng(model):
    return Engine(model, kvpolicies.get("full"), max_len=32)


def untraced(eng: Engine):
    """Nothing was compiled or run: the error came from the host-side checks."""
    assert not eng.traces, eng.traces


# ----------------------------------------------------------------------------------------------
# Engine arguments


@pytest.mark.parametrize("max_len", [0, -3, 2.5, True, "8", None])
def test_max_len_must_be_a_positive_int(model, max_len):
    with pytest.raises(ValueError, match=r"Engine max_len=.*must be an int >= 1"):
        Engine(model, kvpolicies.get("full"), max_len=max_len)


def test_max_len_accepts_numpy_ints(model):
    assert Engine(model, kvpolicies.get("full"), max_len=np.int64(8)).max_len == 8


def test_generate_zero_tokens_is_empty(eng):
    one = eng.generate([1, 2, 3], 0)
    assert one.shape == (0,) and one.dtype == np.int32
    batch = eng.generate(np.ones((2, 3), np.int32), 0)
    assert batch.shape == (2, 0) and batch.dtype == np.int32
    untraced(eng)


@pytest.mark.parametrize("n", [-1, 2.0, None, True])
def test_generate_rejects_bad_n(eng, n):
    with pytest.raises(ValueError, match=r"^n=.*must be an int >= 0"):
        eng.generate([1, 2, 3], n)
    untraced(eng)


@pytest.mark.parametrize("stream", [[], [7], np.zeros((2, 1), np.int32)])
def test_score_needs_two_tokens(eng, stream):
    with pytest.raises(ValueError, match="tokens: score needs a stream of at least 2 tokens"):
        eng.score(stream)
    untraced(eng)


@pytest.mark.parametrize("chunk", [0, -5, 1.5])
def test_chunk_must_be_positive(eng, chunk):
    for call in (lambda: eng.score(np.arange(10), chunk=chunk),
                 lambda: eng.prefill(np.arange(10)[None], chunk=chunk),
                 lambda: eng.generate(np.arange(10), 2, chunk=chunk)):
        with pytest.raises(ValueError, match=rf"chunk={chunk}: must be an int >= 1"):
            call()
    untraced(eng)


def test_empty_prompts_are_rejected(eng):
    with pytest.raises(ValueError, match="prefill needs a prompt of at least 1 token"):
        eng.prefill(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="generate needs a prompt of at least 1 token"):
        eng.generate([], 3)
    with pytest.raises(ValueError, match="empty batch"):
        eng.prefill(np.zeros((0, 4), np.int32))
    with pytest.raises(ValueError, match=r"tokens: expected token ids of shape \[B, T\], got shape \(5,\)"):
        eng.prefill(np.arange(5))
    untraced(eng)


def test_too_long_reports_the_whole_prompt(eng):
    # Chunks of 8 of a 40-token prompt: the message gives 40, not the failing chunk's end (40 > 32).
    with pytest.raises(ValueError, match="prompt of 40 tokens exceeds the engine's max_len=32"):
        eng.prefill(np.zeros((1, 40), np.int32), chunk=8)
    with pytest.raises(ValueError, match=r"prompt of 30 tokens \+ n=5 new tokens = 35 exceeds the engine's max_len=32"):
        eng.generate(np.zeros(30, np.int32), 5, chunk=8)
    with pytest.raises(ValueError, match=r"stream of 40 tokens \(39 fed to the model.*max_len=32"):
        eng.score(np.zeros(40, np.int32), chunk=8)
    with pytest.raises(ValueError, match=r"positions 30..33 \(34 tokens\) exceeds the engine's max_len=32"):
        eng.step(eng.init_cache(1), np.zeros((1, 4), np.int32), 30)
    untraced(eng)
    eng.score(np.zeros(33, np.int32), chunk=8)  # 32 positions fed: exactly max_len is fine


@pytest.mark.parametrize("method", ["prefill", "step", "prompt"])
def test_ragged_batches_are_rejected_where_not_supported(eng, method):
    rows = [[1, 2, 3], [4, 5]]
    call = {"prefill": lambda: eng.prefill(rows), "step": lambda: eng.step(eng.init_cache(2), rows, 0),
            "prompt": lambda: eng.prompt(rows)}[method]
    with pytest.raises(ValueError, match=r"ragged batch \(rows of lengths \[3, 2\]\) is not supported here"):
        call()
    untraced(eng)


def test_ragged_score_and_generate_check_every_row_before_compute(eng):
    with pytest.raises(ValueError, match="return_cache with streams of different lengths"):
        eng.score([[1, 2, 3], [4, 5]], return_cache=True)
    with pytest.raises(ValueError, match="tokens row 1: score needs a stream of at least 2 tokens"):
        eng.score([[1, 2, 3], [4]])
    with pytest.raises(ValueError, match=r"prompt row 1 of 30 tokens \+ n=5 new tokens = 35 exceeds"):
        eng.generate([[1, 2], [0] * 30], 5)
    with pytest.raises(ValueError, match="prompt row 0: token id 300 at position 0 is outside"):
        eng.generate([[300, 2], [1]], 2)
    untraced(eng)


BAD_IDS = [
    (np.array([1, 2, 300, 4, 5]), r"token id 300 at position 2 is outside the vocabulary \[0, 256\)"),
    ([1, -2, 3], r"token id -2 at position 1 is outside the vocabulary \[0, 256\)"),
    (np.array([1.0, 2.5, 3.0]), r"token id 2.5 at position 1 is not an integer"),
    (np.array([1.0, np.nan, 3.0]), r"token id nan at position 1 is not an integer"),
    (np.array([[1, 2], [3, 256]]), r"token id 256 at row 1, position 1 is outside the vocabulary"),
    (np.full((2, 3), 999), r"token id 999 at row 0, position 0 .* \(and 5 more\)"),
    (np.array([2**40, 1]), r"token id 1099511627776 at position 0 is outside"),  # not wrapped by int32
    (np.array([True, False]), r"token ids must be integers, got an array of dtype bool"),
    (["a", "b"], r"token ids must be integers, got an array of dtype <U1"),
]


@pytest.mark.parametrize(("ids", "match"), BAD_IDS)
def test_token_ids_are_checked_on_the_host(eng, ids, match):
    with pytest.raises(ValueError, match="tokens: " + match):
        eng.score(ids)
    with pytest.raises(ValueError, match="prompt: " + match):
        eng.generate(ids, 2)
    untraced(eng)


def test_prefill_and_step_check_ids(eng):
    with pytest.raises(ValueError, match="tokens: token id 256 at row 0, position 1"):
        eng.prefill([[1, 256]])
    with pytest.raises(ValueError, match="tokens: token id -1 at row 0, position 0"):
        eng.step(eng.init_cache(1), [[-1]], 0)
    with pytest.raises(ValueError, match=r"tokens: expected integer ids of shape \[B, T\], got float32"):
        eng.step(eng.init_cache(1), jnp.ones((1, 1)), 0)  # device arrays: dtype and shape only
    with pytest.raises(ValueError, match=r"start=-1: must be an int >= 0"):
        eng.step(eng.init_cache(1), [[1]], -1)
    untraced(eng)


def test_whole_floats_and_lists_give_the_same_results(eng):
    ids = np.random.default_rng(0).integers(0, 256, 12)
    want = eng.score(ids.astype(np.int32), chunk=11)
    np.testing.assert_array_equal(eng.score(ids.astype(np.float64), chunk=11), want)
    np.testing.assert_array_equal(eng.score(ids.tolist(), chunk=11), want)
    np.testing.assert_array_equal(eng.score(ids.astype(np.uint8), chunk=11), want)
    assert eng.generate(ids.astype(np.float32)[:6], 3).tolist() == eng.generate(ids[:6], 3).tolist()


def test_check_token_ids_returns_int32():
    out = check_token_ids([[0, 255]], 256)
    assert out.dtype == np.int32 and out.tolist() == [[0, 255]]
    with pytest.raises(ValueError, match="ids: token id 5 at position 0"):
        check_token_ids([5], 5, name="ids")


# ----------------------------------------------------------------------------------------------
# GGUF files


@pytest.fixture(scope="module")
def smollm2() -> pathlib.Path:
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def partial_copy(src: pathlib.Path, dst: pathlib.Path, size: int) -> pathlib.Path:
    """The first `size` bytes of `src` as far as the header goes, the rest a sparse hole."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(min(size, 4 << 20)))  # the SmolLM2 header is 1.8 MB
        g.truncate(size)
    return dst


def test_the_real_gguf_passes(smollm2):
    meta = check_gguf(smollm2)
    assert meta["general.architecture"] == "llama" and meta["llama.context_length"] == 8192
    assert "tokenizer.ggml.tokens" not in meta  # arrays are left out


@pytest.mark.parametrize("size", [1024, 50_000_000, -1], ids=["1KB", "50MB", "size-1"])
def test_truncated_gguf_names_the_file(smollm2, tmp_path, size):
    full = smollm2.stat().st_size
    size = full - 1 if size < 0 else size
    path = partial_copy(smollm2, tmp_path / "cut.gguf", size)
    pattern = rf"{path} is truncated: {size} bytes, expected at least "
    with pytest.raises(ValueError, match=pattern) as err:
        check_gguf(path)
    if size > 4 << 20:  # past the header: the need is the last tensor's end, the whole file
        assert f"expected at least {full} " in str(err.value)
    with pytest.raises(ValueError, match=pattern):
        load_gguf(path)  # checked before the gguf package can fail with an IndexError
    with pytest.raises(ValueError, match=pattern):
        Tokenizer.from_gguf(path)


def test_missing_or_wrong_gguf(tmp_path):
    missing = tmp_path / "nope.gguf"
    for call in (check_gguf, load_gguf, Tokenizer.from_gguf):
        with pytest.raises(ValueError, match=rf"GGUF file {missing} does not exist"):
            call(missing)
    with pytest.raises(ValueError, match=rf"GGUF file {tmp_path} is a folder"):
        check_gguf(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.gguf is truncated: 0 bytes, expected at least 4"):
        check_gguf(tmp_path / "empty.gguf")
    (tmp_path / "text.gguf").write_text("hello, not a model")
    with pytest.raises(ValueError, match=r"text.gguf is not a GGUF file \(starts with b'hell'"):
        load_gguf(tmp_path / "text.gguf")


def write_gguf(path: pathlib.Path, endianess=gguf.GGUFEndian.LITTLE) -> pathlib.Path:
    """A small GGUF of float32, float16 and Q8_0 tensors (block-quantized sizes)."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_context_length(64)
    w.add_string("general.name", "tiny-check")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "é"])
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.normal(size=(3, 5)).astype(np.float32))
    w.add_tensor("b", rng.normal(size=(7,)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.normal(size=(2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_end_is_the_last_tensors_end(tmp_path, endianess):
    path = write_gguf(tmp_path / "small.gguf", endianess)
    reader = gguf.GGUFReader(str(path))
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert check_gguf(path) == {"general.architecture": "llama", "llama.context_length": 64,
                                "general.name": "tiny-check"}
    data = path.read_bytes()
    (tmp_path / "exact.gguf").write_bytes(data[:end])
    check_gguf(tmp_path / "exact.gguf")  # padding after the last tensor is not needed
    (tmp_path / "cut.gguf").write_bytes(data[:end - 1])
    with pytest.raises(ValueError, match=rf"cut.gguf is truncated: {end - 1} bytes, expected at least {end} "
                                         r"\(tensor 'c' ends"):
        check_gguf(tmp_path / "cut.gguf")


def test_gguf_bad_utf8_names_the_file_and_byte(tmp_path):
    path = write_gguf(tmp_path / "small.gguf")
    data = path.read_bytes()
    at = data.index(b"tiny-check")
    (tmp_path / "bad.gguf").write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ValueError, match=rf"bad.gguf: the GGUF string at byte {at - 8} is not valid UTF-8"):
        check_gguf(tmp_path / "bad.gguf")


# ----------------------------------------------------------------------------------------------
# HF folders


def write_weights(folder: pathlib.Path, name: str = "model.safetensors") -> pathlib.Path:
    save_file({"w": np.ones((4, 4), np.float32)}, str(folder / name))
    return folder / name


def test_hf_folder_missing_empty_or_without_weights(tmp_path):
    missing = tmp_path / "nope"
    for call in (check_hf_dir, load_hf):
        with pytest.raises(ValueError, match=rf"HF checkpoint folder {missing} does not exist"):
            call(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    for call in (check_hf_dir, load_hf):
        with pytest.raises(ValueError, match=rf"{empty} has no config.json"):
            call(empty)
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for call in (check_hf_dir, load_hf):
        with pytest.raises(ValueError, match=rf"{only_config} has no weights: neither model.safetensors nor"):
            call(only_config)


def test_hf_folder_checks_shards_and_truncation(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_weights(tmp_path, "model-00001-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json names 1 shard\(s\) missing from .*model-00002-of-00002"):
        check_hf_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    single = write_weights(tmp_path)
    assert check_hf_dir(tmp_path) == {}
    data = single.read_bytes()
    single.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=rf"{single} is truncated: {len(data) - 1} bytes, expected at least {len(data)}"):
        check_hf_dir(tmp_path)
    single.write_bytes(data[:20])
    with pytest.raises(ValueError, match=rf"{single} is truncated: 20 bytes"):
        load_hf(tmp_path)


@pytest.mark.parametrize(("content", "match"), [
    (b'{"a": "\xff"}', r"config.json is not UTF-8 text: byte 0xff at offset 7"),
    (b'{"a": 1,,}', r"config.json is not valid JSON: .* at line 1 column 9"),
    (b"[1, 2]", r"config.json is not a JSON object"),
])
def test_hf_config_errors_name_the_file(tmp_path, content, match):
    write_weights(tmp_path)
    (tmp_path / "config.json").write_bytes(content)
    for call in (check_hf_dir, load_hf):
        with pytest.raises(ValueError, match=match):
            call(tmp_path)


def write_tokenizer(folder: pathlib.Path) -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    (folder / "tokenizer.json").write_text(tok.to_str())


def test_tokenizer_files_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path} has no tokenizer.json"):
        Tokenizer.from_hf(tmp_path)
    write_tokenizer(tmp_path)
    good = Tokenizer.from_hf(tmp_path)
    assert good.vocab_size == 2
    (tmp_path / "tokenizer_config.json").write_bytes(b'{"chat_template": "\xc3("}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not UTF-8 text: byte 0xc3 at offset 19"):
        Tokenizer.from_hf(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ messages }}\xfe")
    with pytest.raises(ValueError, match=r"chat_template.jinja is not UTF-8 text: byte 0xfe at offset 14"):
        Tokenizer.from_hf(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer.json").write_bytes(b"\x80abc")
    with pytest.raises(ValueError, match=r"tokenizer.json is not UTF-8 text: byte 0x80 at offset 0"):
        Tokenizer.from_hf(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizer the `tokenizers` library can read"):
        Tokenizer.from_hf(tmp_path)


def test_check_hf_dir_with_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    write_weights(tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path} has no tokenizer.json"):
        check_hf_dir(tmp_path, tokenizer=True)
    write_tokenizer(tmp_path)
    assert check_hf_dir(tmp_path, tokenizer=True) == {}
    shutil.copy(tmp_path / "config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xff")
    with pytest.raises(ValueError, match="tokenizer_config.json is not UTF-8"):
        check_hf_dir(tmp_path, tokenizer=True)


def test_read_json_strips_a_bom(tmp_path):
    (tmp_path / "c.json").write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json(tmp_path / "c.json") == {"a": 1}


def test_positions_are_int32_max_len_is_bounded_and_a_stream_runs_at_the_limit(model):
    """Positions are int32: max_len past MAX_LEN (2^31 - 2^16) is one error before anything runs;
    a bounded policy at MAX_LEN runs a chunk whose positions end at MAX_LEN - 1 and keeps the
    last of them (its sink slots stay for positions 0-1, which this stream never fed)."""
    from models.engine import MAX_LEN

    with pytest.raises(ValueError, match="int32"):
        Engine(model, kvpolicies.get("sink", n_sink=2, window=6), max_len=MAX_LEN + 1)
    eng = Engine(model, kvpolicies.get("sink", n_sink=2, window=6), max_len=MAX_LEN)
    toks = np.arange(8, dtype=np.int32)[None]
    logits, cache = eng.step(eng.init_cache(1), toks, MAX_LEN - 8)
    assert np.isfinite(np.asarray(logits)).all()
    for layer in np.asarray(cache[0].pos).reshape(CFG.n_layers, -1):  # the window: the last 6 positions
        assert sorted(p for p in layer.tolist() if p >= 0) == list(range(MAX_LEN - 6, MAX_LEN))
    with pytest.raises(ValueError, match="max_len"):
        eng.step(cache, toks[:, :1], MAX_LEN)


# ----------------------------------------------------------------------------------------------
# A cache knows where it ends and which engine made it (issue 61): every registered policy
# continues a state at its end (prefill(cache=), extend_prompt, feed equal one prefill of the
# whole, to 2e-5 in float32), and a state another engine made is refused by every entry point.

CFG2 = LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32)
IDS = np.random.default_rng(61).integers(1, 256, (1, 20)).astype(np.int32)
REPEAT = RepeatPrompts(first=(5, 6, 7), next=(8, 9), suffix=(10, 11))


def continued(name):
    """The registry's small instance of `name` (tests/refs/registry.py), whose limits 12 tokens
    cross: window, sink and the streaming rules evict, and continuing equals one prefill whatever
    they evict; a policy with a dense prompt phase (h2o, tova, kivi, duo) runs its streaming rule
    (`prompt="stream"`); a prompt compressor is sized to hold the 20 tokens (one prefill compresses
    after all 20, two parts after the first 12: they agree only when nothing is evicted)."""
    pol = REFERENCES[name][0][0] if name in REFERENCES else kvpolicies.get(name)
    fields = {f.name for f in dataclasses.fields(pol)}
    if "prompt" in fields:
        return dataclasses.replace(pol, prompt="stream")
    if prompt_policy_of(pol) != pol and "budget" in fields:
        return dataclasses.replace(pol, budget=400)  # pyramidkv's smallest layer then holds 20 too
    if prompt_policy_of(pol) != pol and "ratio" in fields:
        return dataclasses.replace(pol, ratio=0.0)  # think: no key channel pruned after the prompt
    return pol


@pytest.fixture(scope="module")
def model2():
    return Llama(CFG2)


@pytest.mark.parametrize("name", sorted(kvpolicies.POLICIES))
def test_every_policy_continues_a_state_where_it_ends(model2, name):
    eng = Engine(model2, continued(name), max_len=40, repeat=REPEAT)
    a, b = IDS[:, :12], IDS[:, 12:]
    one = np.asarray(eng.prefill(IDS, chunk=12)[0])  # one prefill of the 20 (steps of 12 and 8: fewer traces)
    _, cache = eng.prefill(a)
    two, cache = eng.prefill(b, cache=cache)
    assert np.asarray(cache.length).tolist() == [20]
    np.testing.assert_allclose(np.asarray(two), one, atol=2e-5, rtol=0)
    s = eng.prompt(a)
    np.testing.assert_allclose(np.asarray(eng.extend_prompt(s, b).logits), one, atol=2e-5, rtol=0)
    fed = eng.feed(eng.compress(s), b)
    assert fed.length == 20
    np.testing.assert_allclose(np.asarray(fed.logits), one, atol=2e-5, rtol=0)


def test_a_state_from_another_engine_is_refused_everywhere(model):
    full, window = Engine(model, kvpolicies.get("full"), 32), Engine(model, kvpolicies.get("window", window=8), 32)
    short = Engine(model, kvpolicies.get("full"), 16)
    ids = IDS[:, :6]
    _, cache = full.prefill(ids)
    state = full.prompt(ids)
    other = "the state was made by another engine"
    for eng, why in ((window, r"layer 0's policy Full\(.*\) there, Window\(.*\) here"),
                     (short, r"max_len=32 there, 16 here")):
        for what, call in (("prefill", lambda: eng.prefill(ids, cache=cache)),
                           ("step", lambda: eng.step(cache, ids[:, :1])),
                           ("extend_prompt", lambda: eng.extend_prompt(state, ids)),
                           ("feed", lambda: eng.feed(state, ids)),
                           ("continue_generate", lambda: eng.continue_generate(state, ids, 2)),
                           ("kept_positions", lambda: eng.kept_positions(state))):
            with pytest.raises(ValueError, match=f"^{what}.*: {other} \\({why}\\)"):
                call()
        untraced(eng)
    # a state prompted by an engine with a smaller max_len: refused, not all-zero ids from NaN logits
    with pytest.raises(ValueError, match=r"continue_generate: .* \(max_len=16 there, 32 here\)"):
        full.continue_generate(short.prompt(ids), ids[:, :1], 4)
    wide = Engine(Llama(CFG2), kvpolicies.get("full"), 32)
    with pytest.raises(ValueError, match=r"step: .* \(a model of n_heads=2 there, 4 here\)"):
        wide.step(cache, ids[:, :1])


def test_a_bare_or_mismatched_cache_is_refused(eng):
    _, cache = eng.prefill(IDS[:, :4])
    with pytest.raises(ValueError, match=r"prefill\(cache=...\): expected the cache an Engine returned .* bare tuple"):
        eng.prefill(IDS[:, :2], cache=tuple(cache))
    with pytest.raises(ValueError, match=r"step: run 0 of the cache is not this engine's"):
        eng.step(tuple(Engine(eng._model, kvpolicies.get("full"), 16).init_cache(1)), IDS[:, :1], 4)
    with pytest.raises(ValueError, match=r"tokens: batch 2 does not match the cache's batch 1"):
        eng.prefill(np.repeat(IDS[:, :2], 2, axis=0), cache=cache)


def test_step_continues_from_the_cache_end_by_default(eng):
    want, _ = eng.prefill(IDS[:, :6], chunk=5)
    _, cache = eng.prefill(IDS[:, :5])
    cache = jax.jit(lambda c: c)(cache)  # the length is a leaf, the maker static: both go through jit
    got, cache = eng.step(cache, IDS[:, 5:6])  # start=None: position 5
    assert np.asarray(cache.length).tolist() == [6]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_kept_positions_checks_the_row(eng):
    state = eng.prompt(IDS[:, :4])
    for row in (5, 1, -1, 0.5):
        with pytest.raises(ValueError, match=rf"^row={row}: (the state has 1 row \(row 0..0\)|must be an int >= 0)"):
            eng.kept_positions(state, row=row)
