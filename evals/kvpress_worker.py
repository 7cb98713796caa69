"""kvpress 0.5.5 itself, as a subprocess of the parity tests and `evals.peer` (run in its own environment).

Run with PYTHONPATH=.venv/kvpress-ref (transformers 5.2.0 + kvpress, see scripts/setup.sh):
    python evals/kvpress_worker.py job.json out.json
    python evals/kvpress_worker.py --serve    (jobs read from stdin, each in a forked child: `serve` below)
job: {"checkpoint": dir | null, "gguf_file": name in that dir | absent, "tiny": {"kind": "llama"|"qwen2", "seed": int, "config": {...}} | null,
      "save_to": dir | null, "context": [ids], "question": [ids], "n_new": int,
      "presses": [[name, ratio, {fields}], ...], "tokenizer": "ascii" | absent (the checkpoint's)}
A "tiny" job builds a random transformers model (biases and norms perturbed) and saves it to
`save_to` first, for our loader. Per press, as kvpress's pipeline runs it: the context prefilled
under `press(model)` into a DynamicCache (ObservedAttentionPress: eager attention, else sdpa),
then the question at positions after the context and greedy tokens, no further compression.
Out: {name@ratio: {"kept": [layer][kv head] positions, "cache_bytes": bytes of the cache's key and value
tensors after the compression, "answer": ids} or {"error": text} (with "kept" and "cache_bytes" when
the press compressed and the question then failed: PyramidKVPress's uneven layers); kept
positions are read by matching each cached key to the uncompressed cache's keys (exact copies).

Multi-sample form (`evals.peer`): job["samples"] = [{"id": str, "context": [ids], "question": [ids],
"presses": [[name, ratio, {fields}], ...]}, ...] (a sample without "presses" takes job["presses"]);
the model loads once; job["every_core_when"]: a file whose existence gives torch every core
(`every_core_once`). Out is then a JSON-lines file, APPENDED one line per (sample, press) as each
finishes: {"sample": id, "press": name, "ratio": r, "n": context length, "answer": ids,
"kept": [layer] base64 of numpy.packbits of the [kv head, n] kept mask} or {..., "error": text}. The
press "full" (ratio 0) is the uncompressed cache. job["prefill"]: "per_press" runs the pipeline
above once per press; "shared" (default) prefills each sample once per attention implementation
and, in a forward hook on every attention module, calls each press's own `forward_hook` with its own
copy of that layer's cache: kvpress compresses a layer after its attention ran, so every layer's
input is the same as in a prefill under the press alone (tests/evals/test_peer.py checks that both
give the same kept positions and answers). KVzipPress compresses after the prefill, in its context
manager's exit: with "shared", one KVzipPress (or KVgradPress) prefill and reconstruction pass per sample and
set of fields, then kvpress's own `compress_post` once per ratio on a copy of the scores it computed
(`run_kvzip`; the scores do not depend on the ratio; the same test checks it against the pipeline).
job["tokenizer_from"] = {"checkpoint": dir, "gguf_file": name}: the tokenizer KVzipPress reads when the
checkpoint has none (a tiny model's).
RestoreKVPress: fields {"restore_model_name": an .npz of kvpolicies.restorekv's format} in place of its hub
download (`restore_press`, PEFT's LoRA forward set by hand: `given_lora`, one arrays file per model); its r
restore slots follow the n context tokens in every layer's cache (positions n..n+r-1 appended to each head's
kept ones, the question at n + r), and the single-job form also returns their values ("restore_values"
[layer][kv head][r][D]).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch
import transformers
from transformers import DynamicCache

import kvpress


def build_tiny(spec: dict, save_to: str):
    torch.manual_seed(spec["seed"])
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[spec["kind"]]
    model = model_cls(cfg_cls(**spec["config"])).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(save_to)
    return save_to


# GGUF checkpoints as transformers loads them, converted once (`converted`)
CONVERTED = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "kvpress-ref" / "converted"


def converted(path: str, gguf: str) -> str:
    """A folder holding what `from_pretrained(path, gguf_file=gguf)` builds (the model dequantized
    to float32 safetensors, its config and tokenizer), made on first use under CONVERTED (keyed by
    the file's name and size) and read from then on: transformers' GGUF import takes 20-60 s a
    load, the folder well under a second. The weights are those tensors exactly and the logits
    equal (`python evals/kvpress_worker.py --check-converted FILE.gguf`); `scripts/setup.sh test`
    converts SmolLM2's."""
    src = pathlib.Path(path) / gguf
    out = CONVERTED / f"{src.stem}-{src.stat().st_size}"
    if not (out / "config.json").is_file():
        kw = {"gguf_file": gguf, "local_files_only": True}
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        model.save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(path, **kw).save_pretrained(tmp)
        try:
            tmp.rename(out)  # another process may have made it meanwhile: theirs is the same
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def check_converted(gguf_path: str) -> None:
    """The converted folder against the GGUF import itself: the same tensors, ids and logits."""
    src = pathlib.Path(gguf_path).resolve()
    folder = converted(str(src.parent), src.name)
    kw = {"gguf_file": src.name, "local_files_only": True}
    a = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ta = transformers.AutoTokenizer.from_pretrained(str(src.parent), **kw)
    tb = transformers.AutoTokenizer.from_pretrained(folder)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), "tensors differ"
    texts = ["The secret passphrase is 'purple elephant 42'.\nQuestion: What is the secret passphrase?",
             "  Isn't it?  \"Yes\" -- 12345, naïve café; <|im_start|>user\n\tdone\n\n"]
    for text in texts:
        for special in (False, True):
            assert ta.encode(text, add_special_tokens=special) == tb.encode(text, add_special_tokens=special), text
    chat = [{"role": "user", "content": texts[0]}]
    assert ta.chat_template == tb.chat_template, "chat templates differ"
    assert (ta.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) ==
            tb.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)), "chat prompts differ"
    assert (ta.bos_token_id, ta.eos_token_id) == (tb.bos_token_id, tb.eos_token_id), "special tokens differ"
    ids = ta(texts[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits), "logits differ"
    print(f"{folder}: the same {len(sa)} tensors, token ids, chat template and logits as {src.name}")


def load(path: str, attn: str, gguf: str | None = None):
    path = converted(path, gguf) if gguf else path
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                             local_files_only=True).eval()


class AsciiTokenizer:
    """The tiny models' tokenizer (ids = ASCII codes, no chat template) for KVzipPress's repeat
    prompts; `models.tokenizer.ByteTokenizer` would give the same ids to ASCII text."""

    chat_template = None

    def encode(self, text, return_tensors=None, add_special_tokens=False):
        ids = [ord(c) for c in text]
        return torch.tensor([ids]) if return_tensors == "pt" else ids


REPEATS = ("KVzipPress", "KVgradPress")  # presses whose repeat prompts read the tokenizer (KVgradPress: a KVzipPress)


def base(name: str) -> str:
    """A row's press without its own fields (evals.peer's "Press+field=value": the fields come in `fields`)."""
    return name.split("+", 1)[0]


def use_tokenizer(job: dict) -> None:
    """KVzipPress loads `AutoTokenizer.from_pretrained(model.config.name_or_path)`: the job's
    tokenizer instead (a GGUF file's, or ASCII ids for a tiny model); nothing else changes."""
    from kvpress.presses import kvzip_press

    if job.get("tokenizer") == "ascii":
        tok = AsciiTokenizer()
    else:  # the checkpoint's, or job["tokenizer_from"] = {"checkpoint": dir, "gguf_file": name} (a tiny model's)
        src = job.get("tokenizer_from") or job
        path = converted(src["checkpoint"], src["gguf_file"]) if src.get("gguf_file") else src["checkpoint"]
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)

    class Given:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return tok

    kvzip_press.AutoTokenizer = Given


# RestoreKVPress's LoRA: our weight names (kvpolicies.restorekv.LORA_MODULES) -> (block, transformers module)
LORA_MODULES = {"wq": ("self_attn", "q_proj"), "wk": ("self_attn", "k_proj"), "wv": ("self_attn", "v_proj"),
                "wo": ("self_attn", "o_proj"), "w_gate": ("mlp", "gate_proj"), "w_up": ("mlp", "up_proj"),
                "w_down": ("mlp", "down_proj")}


def given_lora(model, arrays) -> None:
    """Our LoRA arrays on the model's modules as PEFT's LoRA Linear computes them (peft/tuners/lora/layer.py,
    `Linear.forward`: result + lora_B(lora_A(dropout(x))) * scaling, scaling = lora_alpha / r, dropout 0),
    switched by the methods RestoreKVPress calls (transformers' PeftAdapterMixin needs the `peft` package):
    set_adapter, enable_adapters (on), disable_adapters (off). Installed once per model."""
    if getattr(model, "given_lora_state", None) is not None:
        return
    state = {"on": False}
    alpha = float(arrays["lora_alpha"])
    for key in (k for k in arrays.files if k.startswith("lora_A.")):
        name = key.split(".", 1)[1]
        block, attr = LORA_MODULES[name]
        for layer, mod in enumerate(getattr(blk, block) for blk in model.model.layers):
            lin = getattr(mod, attr)
            a = torch.tensor(arrays[key][layer], dtype=lin.weight.dtype)  # [r, in]
            b = torch.tensor(arrays[f"lora_B.{name}"][layer], dtype=lin.weight.dtype)  # [out, r]

            def forward(x, base=lin.forward, a=a, b=b, scaling=alpha / a.shape[0]):
                out = base(x)
                return out + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling \
                    if state["on"] else out

            lin.forward = forward
    model.set_adapter = lambda name: None
    model.enable_adapters = lambda: state.update(on=True)
    model.disable_adapters = lambda: state.update(on=False)
    model.given_lora_state = state


def restore_press(ratio: float, fields: dict):
    """RestoreKVPress with our arrays (fields["restore_model_name"]: an .npz of kvpolicies.restorekv's format)
    in place of its hub download (`post_init_from_model`): the restore embeddings, the LoRA by `given_lora`."""
    arrays = np.load(fields.pop("restore_model_name"))
    press = kvpress.RestoreKVPress(compression_ratio=ratio, **fields)

    def post_init_from_model(model):
        press.restore_embeddings = torch.tensor(arrays["restore_embeddings"], dtype=model.dtype)
        press.restore_model_name = "given"
        given_lora(model, arrays)
        model.disable_adapters()

    press.post_init_from_model = post_init_from_model
    return press


def make_press(name: str, ratio: float, fields: dict):
    name = base(name)  # evals.peer's "Press+field=value" rows: their fields are in `fields`
    if (press := catalogue_press(name.split(":", 1)[0], ratio, fields)) is not None:  # evals.peer's catalogue rows
        return press
    if ":" in name:  # evals.peer's "Wrapper:Inner": the wrapper, its inner press given in fields["press"]
        name = name.split(":", 1)[0]
    if name == "RestoreKVPress":  # our restore embeddings and LoRA (kvpress downloads the authors')
        return restore_press(ratio, fields)
    if name == "DuoAttentionPress":  # given a head pattern (kvpress downloads the authors' or scores BookSum)
        scores = np.clip(np.asarray(fields.pop("head_scores"), float), 0, 1)
        sizes = (fields.pop("sink_size", 128), fields.pop("recent_size", 256))

        class GivenPattern(kvpress.DuoAttentionPress):
            @staticmethod
            def load_attention_pattern(model):
                return sizes[0], sizes[1], scores

        return GivenPattern(head_compression_ratio=ratio, **fields)
    if "compression_interval" in fields:  # PrefillDecodingPress: `name` on the prefill, DecodingPress(name()) after
        decoding = kvpress.DecodingPress(getattr(kvpress, name)(), compression_interval=fields.pop("compression_interval"),
                                         target_size=fields.pop("target_size"))
        return kvpress.PrefillDecodingPress(prefilling_press=getattr(kvpress, name)(compression_ratio=ratio, **fields),
                                            decoding_press=decoding)
    cls = getattr(kvpress, name)
    if name == "ComposedPress":  # presses: [[name, ratio(, fields)], ...], each built here in turn
        return cls([make_press(p[0], p[1], dict(p[2]) if len(p) > 2 else {}) for p in fields.pop("presses")])
    if "press" in fields or name == "AdaKVPress":  # a wrapper: its own fields, the rest the inner press's (by name)
        own = {f.name for f in dataclasses.fields(cls)} - {"press"}
        wrapper = {k: fields.pop(k) for k in list(fields) if k in own}
        return cls(press=make_press(fields.pop("press", "SnapKVPress"), ratio, fields), **wrapper)
    return cls(compression_ratio=ratio, **fields)


# -- evals.peer's catalogue: presses whose fields name arrays or that kvpress's constructor does not take ----------


def _f32(a) -> torch.Tensor:
    return torch.tensor(np.asarray(a), dtype=torch.float32)


def _no_download(press):
    """`press` with its `post_init_from_model` (which downloads the authors' arrays) a no-op: they are given."""
    press.post_init_from_model = lambda model: None
    return press


def _kvzap_model(path: str):
    """kvpress's KVzapModel holding a kvzap surrogate file's weights (evals.train_kvzap's format)."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    z = np.load(path)
    mlp = "w1" in z.files
    first = z["w1"] if mlp else z["w"]  # [L, d, hidden or K]
    out = (z["w2"] if mlp else z["w"]).shape[-1]
    zm = KVzapModel(KVzapConfig(input_dim=first.shape[1], output_dim=out, n_modules=first.shape[0],
                                hidden_dim=first.shape[-1] if mlp else None)).eval()
    with torch.no_grad():
        for l, layer in enumerate(zm.layers):
            for lin, wn, bn in ([(layer[0], "w1", "b1"), (layer[2], "w2", "b2")] if mlp else [(layer, "w", "b")]):
                lin.weight.copy_(_f32(z[wn][l].T))
                lin.bias.copy_(_f32(z[bn][l]))
    return zm


def _fastkvzip_gates(path: str) -> list:
    """kvpress's FastKVzipGate modules holding a gate file's weights (kvpolicies.fastkvzip's format)."""
    from kvpress.presses.fastkvzip_press import FastKVzipGate

    z, gates = np.load(path), []
    for l in range(z["q_w"].shape[0]):
        kh, g = z["b"].shape[1:]
        gate = FastKVzipGate(l, z["q_w"].shape[1], kh, g, torch.float32)
        gate.load_state_dict({"q_proj.weight": _f32(z["q_w"][l].T), "q_proj.bias": _f32(z["q_b"][l]),
                              "k_proj.weight": _f32(z["k_w"][l].T), "q_norm.weight": _f32(z["q_norm"][l]),
                              "k_norm.weight": _f32(z["k_norm"][l]), "k_base": _f32(z["k_base"][l][:, None]),
                              "b": _f32(z["b"][l][:, None])})
        gates.append(gate.eval())
    return gates


def catalogue_press(name: str, ratio: float, fields: dict):
    """kvpress's `name` at `ratio` for the `evals.peer` rows (`evals.peer.catalogue_args`) whose fields its
    constructor does not take as they are, or None (make_press's own rules). The hub presses get the arrays
    of the files named (in place of their downloads); ThinKPress's ratio is its compression_ratio,
    key_channel_compression_ratio / 2; SimLayerKVPress and DecodingPress have none (0); FinchPress's window is
    given (no delimiter token); LUKVPress's budget curve is a .npy file."""
    cls = getattr(kvpress, name, None)
    if name == "ThinKPress":
        return cls(key_channel_compression_ratio=fields.pop("key_channel_compression_ratio", 2 * ratio), **fields)
    if name == "SimLayerKVPress":
        return cls(**fields)
    if name == "FinchPress":
        window = fields.pop("window_size")
        press = cls(compression_ratio=ratio, **fields)
        press.window_size = window  # kvpress sets it from a delimiter token between context and question
        return press
    if name == "QFilterPress":
        press = _no_download(cls(compression_ratio=ratio))
        press.q_filters = _f32(np.load(fields.pop("q_filters"))["q_filters"])
        return press
    if name == "ExpectedAttentionStatsPress":
        z = np.load(fields.pop("stats_folder"))
        press = cls(compression_ratio=ratio, **fields)
        press.mu, press.cov = _f32(z["mu"]), _f32(z["cov"])  # set: post_init_from_model loads nothing
        return press
    if name == "KVzapPress":
        path = fields.pop("kvzap_model_name")
        press = _no_download(cls(compression_ratio=ratio, **fields))
        press.kvzap_model = _kvzap_model(path)
        return press
    if name == "FastKVzipPress":
        path = fields.pop("gates")
        press = cls(compression_ratio=ratio, **fields)
        press.gates = _fastkvzip_gates(path)  # set: post_init_from_model loads nothing
        return press
    if name == "LUKVPress":
        curve = np.load(fields.pop("budget_curves"))
        press = cls(compression_ratio=ratio, **fields)
        press._budget_curves = curve  # set: post_init_from_model downloads nothing
        return press
    if name == "DMSPress":
        zap = {k: fields.pop(k) for k in ("model_type", "kvzap_model_name")}
        return cls(press=catalogue_press(fields.pop("press"), 0.0, zap), **fields)
    if name in ("DecodingPress", "CompressionRatioDecodingPress"):
        base = getattr(kvpress, fields.pop("base_press"))()
        if name == "CompressionRatioDecodingPress":
            fields.setdefault("target_compression_ratio", ratio)
        return cls(base_press=base, **fields)
    if name == "PrefillDecodingPress":
        dec = fields.pop("decoding_press")  # [name, ratio, fields]
        return cls(prefilling_press=make_press(fields.pop("prefilling_press"), ratio, fields),
                   decoding_press=catalogue_press(dec[0], dec[1], dict(dec[2])))
    return None


@torch.no_grad()
def run(model, press, ctx, question, n_new, full_keys):
    cache = DynamicCache()
    with press(model):
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
    n, extra = ctx.shape[1], getattr(press, "num_restore_tokens", 0)  # RestoreKVPress: its slots after the context
    kept = []
    for layer, full in enumerate(full_keys):  # full [K, n, D]
        keys = cache.layers[layer].keys[0][:, :cache.layers[layer].keys.shape[2] - extra]  # [K, m, D]
        d = torch.cdist(keys, full, compute_mode="donot_use_mm_for_euclid_dist")  # [K, m, n]
        best = d.argmin(-1)  # [K, m]
        assert float(d.min(-1).values.max()) < 1e-5, "a cached key matches no context key"
        masked = getattr(model.model.layers[layer].self_attn, "masked_key_indices", None)
        heads = []
        for h in range(keys.shape[0]):
            pos = best[h]
            if masked is not None:  # AdaKV: masked slots are not kept
                drop = masked[2][(masked[0] == 0) & (masked[1] == h)]
                pos = pos[~torch.isin(torch.arange(len(pos)), drop)]
            heads.append(sorted(int(p) for p in pos) + list(range(n, n + extra)))  # the restore slots: kept
        kept.append(heads)
    # the bytes kvpress's cache holds after the compression (its key and value tensors, masked slots included)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    # RestoreKVPress: its tokens' values [layer][kv head][token][D] (what the LoRA-adapted pass wrote)
    restored = {"restore_values": [layer.values[0, :, -extra:].tolist() for layer in cache.layers]} if extra else {}
    try:  # the question after the cache's length (kvpress's pipeline: RestoreKVPress's at n + its tokens)
        return {"kept": kept, "cache_bytes": held, **restored,
                "answer": greedy(model, cache, question, n + extra, n_new)}
    except Exception as e:  # noqa: BLE001  kvpress compressed, then failed on the question: both are results
        return {"kept": kept, "cache_bytes": held, "error": f"{type(e).__name__}: {e}"}


class Tracker:
    """The text position of every slot of a kvpress cache, per layer and kv head, through compressions:
    a forward hook after the press's own appends each step's positions (contiguous from 0) and, when
    the press shortened the layer's cache, reorders them by the top-k kvpress took (ScorerPress.compress:
    `scores.topk(n_kept).indices`, the same call on the scores the press's `score` returned)."""

    def __init__(self, scorers):
        self.pos: dict[int, list[list[int]]] = {}
        self.next: dict[int, int] = {}  # per layer: the next token's position
        self.scores: dict[int, torch.Tensor] = {}
        for press in scorers:  # record each score() the presses compute, per layer
            press.score = self._recording(press.score)

    def _recording(self, score):
        def wrapped(module, *args, **kwargs):
            out = score(module, *args, **kwargs)
            self.scores[module.layer_idx] = out
            return out
        return wrapped

    def hook(self, module, args, kwargs, output):
        layer, q = module.layer_idx, kwargs["hidden_states"].shape[1]
        cache = kwargs["past_key_values"].layers[layer]
        heads = self.pos.setdefault(layer, [[] for _ in range(cache.keys.shape[1])])
        start = self.next.get(layer, 0)
        self.next[layer] = start + q
        for h in heads:
            h.extend(range(start, start + q))
        m = cache.keys.shape[2]
        if m < len(heads[0]):  # compressed in this step: kvpress's top-k of the scores it used
            idx = self.scores.pop(layer).topk(m, dim=-1).indices[0]  # [K, m]
            self.pos[layer] = [[h[i] for i in idx[k].tolist()] for k, h in enumerate(heads)]
        assert all(len(h) == m for h in self.pos[layer]), "a cache length the tracker did not follow"
        return output

    def attach(self, model):
        return [layer.self_attn.register_forward_hook(self.hook, with_kwargs=True) for layer in model.model.layers]

    def kept(self) -> list[list[list[int]]]:
        return [[sorted(h) for h in self.pos[i]] for i in sorted(self.pos)]


@torch.no_grad()
def run_decoding(model, press, ctx, question, n_new):
    """kvpress's pipeline for a PrefillDecodingPress: the context prefilled under the press, then the
    question and greedy ids under it again (its decoding press compresses every compression_interval
    steps; no stop at EOS). {"kept": after the prefill, "kept_end": after the last id fed, "answer"}."""
    tracker = Tracker([press.prefilling_press, press.decoding_press.base_press])
    cache = DynamicCache()
    with press(model):
        hooks = tracker.attach(model)  # after the press's hooks: they run after its compression
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
        [h.remove() for h in hooks]
    kept = tracker.kept()
    with press(model):
        hooks = tracker.attach(model)
        answer = greedy(model, cache, question, ctx.shape[1], n_new)
        [h.remove() for h in hooks]
    return {"kept": kept, "kept_end": tracker.kept(), "answer": answer}


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    if "samples" in job:
        return main_samples(job, out_path)
    EOS_STOP[0] = bool(job.get("eos_stop"))
    path = job["checkpoint"] or build_tiny(job["tiny"], job["save_to"])
    if any(base(name) in REPEATS + ("RestoreKVPress",) for name, _, _ in job["presses"]):
        use_tokenizer(job)
    ctx = torch.tensor([job["context"]])
    question = torch.tensor([job["question"]])
    models, fulls = {}, {}
    result = {}
    for name, ratio, fields in job["presses"]:
        attn = "eager" if base(name) == "ObservedAttentionPress" else "sdpa"
        if attn not in models:  # the model and its uncompressed cache, once per attention implementation
            models[attn] = load(path, attn, job.get("gguf_file"))
            with torch.no_grad():
                full = DynamicCache()
                models[attn](input_ids=ctx, past_key_values=full, logits_to_keep=1)
            fulls[attn] = [full.layers[i].keys[0] for i in range(len(full.layers))]
        model, full_keys = models[attn], fulls[attn]
        key = f"{name}@{ratio}" + ("" if "compression_interval" not in fields else
                                   f"/{fields['compression_interval']}/{fields['target_size']}")
        try:
            press = make_press(name, ratio, dict(fields))
            result[key] = (run_decoding(model, press, ctx, question, job["n_new"])
                           if isinstance(press, kvpress.PrefillDecodingPress) else
                           run(model, press, ctx, question, job["n_new"], full_keys))
        except Exception as e:  # kvpress itself failing is a result (the docs quote it)
            result[key] = {"error": f"{type(e).__name__}: {e}"}
        for layer in model.model.layers:  # AdaKV leaves its mask on the modules
            if hasattr(layer.self_attn, "masked_key_indices"):
                layer.self_attn.masked_key_indices = None
    json.dump(result, open(out_path, "w"))


# -- the multi-sample form (evals.peer) ---------------------------------------------------------------


def key_index(full_keys) -> list[list[dict]]:
    """Per layer and kv head, {key bytes: position} of the uncompressed keys [K, n, D]."""
    out = []
    for full in full_keys:
        f = full.numpy()
        out.append([{f[h, t].tobytes(): t for t in range(f.shape[1])} for h in range(f.shape[0])])
    return out


def kept_mask(model, cache, index, n: int, extra: int = 0) -> list[str]:
    """Per layer, base64 of np.packbits of the [kv head, n] mask of the context positions `cache`
    keeps: each cached key is an exact copy of an uncompressed one (`index`, from `key_index`);
    AdaKV's masked slots are not kept; the last `extra` slots (RestoreKVPress's) are not the context's."""
    import numpy as np

    out = []
    for layer, heads in enumerate(index):
        keys = cache.layers[layer].keys[0].numpy()  # [K, m, D]
        keys = keys[:, :keys.shape[1] - extra]
        mask = np.zeros((len(heads), n), bool)  # [K, n]
        masked = getattr(model.model.layers[layer].self_attn, "masked_key_indices", None)
        for h, where in enumerate(heads):
            pos = [where.get(row.tobytes(), -1) for row in keys[h]]
            assert min(pos, default=0) >= 0, "a cached key matches no context key"
            if masked is not None:
                drop = set(masked[2][(masked[0] == 0) & (masked[1] == h)].tolist())
                pos = [t for i, t in enumerate(pos) if i not in drop]
            mask[h, pos] = True
        out.append(base64.b64encode(np.packbits(mask).tobytes()).decode())
    return out


EOS_STOP = [False]  # the job's "eos_stop": `greedy` stops after an end-of-sequence id, as kvpress's pipeline


@torch.no_grad()
def greedy(model, cache, question, n: int, n_new: int, phases: dict | None = None) -> list[int]:
    """The question at positions n.. after the (compressed) context in `cache`, then greedy ids
    (`phases`: the seconds of the question and of the decoding added to it). With EOS_STOP, kvpress's
    pipeline's rule (`generate_answer`): after the first id, an id of the model's generation config's
    eos_token_id ends the answer (that id included)."""
    t0 = time.time()
    position_ids = torch.arange(n, n + question.shape[1]).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    t1 = time.time()
    pid = position_ids[:, -1:] + 1
    stop = model.generation_config.eos_token_id if EOS_STOP[0] else None
    stop = set(stop if isinstance(stop, list) else [] if stop is None else [stop])
    for i in range(n_new - 1):
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=pid + i)
        ids.append(int(out.logits[0, -1].argmax()))
        if ids[-1] in stop:
            break
    if phases is not None:
        phases["question"] = phases.get("question", 0.0) + t1 - t0
        phases["decode"] = phases.get("decode", 0.0) + time.time() - t1
    return ids


def timed_answer(model, cache, index, ctx, question, n_new, phases: dict) -> dict:
    """{"kept": mask, "answer": ids, "phases": seconds} of a compressed cache (`phases` holds the
    prefill's and the compression's seconds already); {"kept", "error", "phases"} if kvpress raised on the
    question (PyramidKVPress's uneven layers, the masking presses' fake keys at a small head dim)."""
    t0 = time.time()
    n = ctx.shape[1]
    extra = max(0, cache.get_seq_length() - n)  # RestoreKVPress's restore slots after the context (kept, unmasked)
    kept = kept_mask(model, cache, index, n, extra)
    phases["kept"] = time.time() - t0
    try:
        answer = greedy(model, cache, question, n + extra, n_new, phases)
    except Exception as e:  # noqa: BLE001  kvpress compressed, then failed on the question: both are results
        return {"kept": kept, "error": f"{type(e).__name__}: {e}", "phases": {k: round(v, 3) for k, v in phases.items()}}
    return {"kept": kept, "answer": answer, "phases": {k: round(v, 3) for k, v in phases.items()}}


def _set_masks(model, masks) -> None:
    for layer, m in zip(model.model.layers, masks):
        layer.self_attn.masked_key_indices = m


def _copy(cache) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


_REROTATED: dict = {"into": None}  # KeyRerotationPress: where `rerotate_keys` records its kept indices now


def _recording_rerotation() -> None:
    """KeyRerotationPress re-rotates the kept keys to their new places, so they match no uncompressed key: record
    the indices its `rerotate_keys` receives instead (per layer, per kv head), into `_REROTATED["into"]`."""
    from kvpress.presses.key_rerotation_press import KeyRerotationPress

    if getattr(KeyRerotationPress.rerotate_keys, "recording", False):
        return
    real = KeyRerotationPress.rerotate_keys

    def recording(module, indices, keys):
        if _REROTATED["into"] is not None:
            _REROTATED["into"][module.layer_idx] = indices[0].tolist()  # [K, m]
        return real(module, indices, keys)

    recording.recording = True
    KeyRerotationPress.rerotate_keys = staticmethod(recording)


def rerotated_answer(model, cache, kept: dict, ctx, question, n_new, phases: dict) -> dict:
    """`timed_answer` of a KeyRerotationPress cache: its kept positions as recorded (`_recording_rerotation`),
    and the question at the compressed length, as kvpress's pipeline places it for this press."""
    n = ctx.shape[1]
    mask = [_mask([sorted(h) for h in kept[i]], n) for i in range(len(kept))]
    try:
        answer = greedy(model, cache, question, cache.get_seq_length(), n_new, phases)
    except Exception as e:  # noqa: BLE001
        return {"kept": mask, "error": f"{type(e).__name__}: {e}", "phases": {k: round(v, 3) for k, v in phases.items()}}
    return {"kept": mask, "answer": answer, "phases": {k: round(v, 3) for k, v in phases.items()}}


@torch.no_grad()
def run_shared(model, presses, ctx, question, n_new):
    """{(name, ratio): result} for every press of one attention implementation from ONE prefill of
    `ctx`: a hook on each attention module gives every press its own copy of the layer's
    uncompressed keys and values and calls the press's forward_hook on it (what `press(model)`
    registers), keeping AdaKV's per-module mask per press; then each press's cache answers."""
    lm = model.model
    slots = []
    for name, ratio, fields in presses:
        press = None if name == "full" else make_press(name, ratio, dict(fields))
        if press is not None:
            press.post_init_from_model(model)
        slots.append({"key": (name, ratio), "press": press, "cache": DynamicCache(), "masks": [None] * len(lm.layers),
                      "error": None, "compress": 0.0,
                      "rerotated": {} if type(press).__name__ == "KeyRerotationPress" else None})
    if any(s["rerotated"] is not None for s in slots):
        _recording_rerotation()

    def hook(module, args, kwargs, output):
        i = module.layer_idx
        full = kwargs["past_key_values"].layers[i]
        for s in slots:
            if s["press"] is None or s["error"] is not None:
                continue
            t0 = time.time()
            s["cache"].update(full.keys.clone(), full.values.clone(), i)
            try:
                _REROTATED["into"] = s["rerotated"]
                s["press"].forward_hook(module, args, {**kwargs, "past_key_values": s["cache"]}, output)
            except Exception as e:  # noqa: BLE001  (kvpress failing is a result)
                s["error"] = f"{type(e).__name__}: {e}"
            finally:
                _REROTATED["into"] = None
            s["compress"] += time.time() - t0
            s["masks"][i] = getattr(module, "masked_key_indices", None)
            module.masked_key_indices = None
        return output

    hooks = []
    for layer in lm.layers:
        layer.self_attn.rotary_emb = lm.rotary_emb  # as press(model) sets it
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    full = DynamicCache()
    t0 = time.time()
    try:
        model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    prefill = (time.time() - t0 - sum(s["compress"] for s in slots)) / len(slots)  # one prefill, shared out
    index = key_index([full.layers[i].keys[0] for i in range(len(full.layers))])
    out = {}
    for s in slots:
        if s["error"] is not None:
            out[s["key"]] = {"error": s["error"]}
            continue
        cache = _copy(full) if s["press"] is None else s["cache"]
        try:
            _set_masks(model, s["masks"])
            ph = {"prefill": prefill, "compress": s["compress"]}
            out[s["key"]] = (timed_answer(model, cache, index, ctx, question, n_new, ph) if s["rerotated"] is None
                             else rerotated_answer(model, cache, s["rerotated"], ctx, question, n_new, ph))
        except Exception as e:  # noqa: BLE001  (e.g. PyramidKV's uneven layers: the question's mask)
            out[s["key"]] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            _set_masks(model, [None] * len(lm.layers))
    return out


@torch.no_grad()
def run_per_press(model, presses, ctx, question, n_new):
    """{(name, ratio): result}, each press in its own prefill under `press(model)` (the pipeline)."""
    out = {}
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
    index = key_index([full.layers[i].keys[0] for i in range(len(full.layers))])
    for name, ratio, fields in presses:
        def compressed(name=name, ratio=ratio, fields=fields):
            if name == "full":
                return _copy(full)
            cache = DynamicCache()
            with make_press(name, ratio, dict(fields))(model):
                model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
            return cache

        out[(name, ratio)] = answered(model, compressed, index, ctx, question, n_new)
    return out


def answered(model, compressed, index, ctx, question, n_new) -> dict:
    """{"kept": mask, "answer": ids} of the cache `compressed()` returns (a press's masks, if any,
    set on the modules), or {"error": text} if kvpress raised (a result: the docs quote it); the
    modules' masks cleared after."""
    try:
        t0 = time.time()
        cache = compressed()  # the press's prefill and compression, not told apart
        return timed_answer(model, cache, index, ctx, question, n_new, {"prefill": time.time() - t0})
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        _set_masks(model, [None] * len(model.model.layers))


@torch.no_grad()
def run_kvzip(model, presses, ctx, question, n_new):
    """{(name, ratio): result} of KVzipPress (or KVgradPress: its pass takes gradients, then calls the same
    `compress_post`) at several ratios from one prefill and reconstruction pass per press and set of fields: the pass under `press(model)` of the first ratio, with its
    `compress_post` (the step that reads the ratio) replaced by keeping a copy of the scores
    `score_val` it computed; then, per ratio, kvpress's own `compress_post` on a copy of those
    scores (it masks each layer's pruned slots, `masked_key_indices`) and the answer from a copy
    of the cache. Equal to kvpress's pipeline per ratio: the prefill and the pass do not read the
    ratio, and the cache the pass leaves is the context's (the repeat inputs are cut off)."""
    out = {}
    by_fields: dict[str, list] = {}
    for name, ratio, fields in presses:
        assert base(name) in REPEATS, name
        by_fields.setdefault(json.dumps([name, fields], sort_keys=True), []).append((name, ratio, fields))
    for group in by_fields.values():
        cache, scores = DynamicCache(), []
        try:
            first = make_press(*group[0][:2], dict(group[0][2]))
            first.compress_post = lambda model, p=first: scores.append(p.score_val.clone())
            with first(model):
                model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
            index = key_index([cache.layers[i].keys[0] for i in range(len(cache.layers))])
        except Exception as e:  # noqa: BLE001  (kvpress failing is a result)
            out |= {(name, ratio): {"error": f"{type(e).__name__}: {e}"} for name, ratio, _ in group}
            continue
        for name, ratio, fields in group:
            def compressed(name=name, ratio=ratio, fields=fields):
                press = make_press(name, ratio, dict(fields))
                press.score_val = scores[0].clone()
                press.compress_post(model)  # sets each module's masked_key_indices
                return _copy(cache)

            out[(name, ratio)] = answered(model, compressed, index, ctx, question, n_new)
    return out


# evals.peer's rows that `run_own` reads back: a channel press, the decoding presses, and FastKVzipPress (it
# compresses in its context manager's exit, after the prefill, as KVzipPress)
OWN = ("ThinKPress", "DecodingPress", "CompressionRatioDecodingPress", "PrefillDecodingPress", "FastKVzipPress")


def _mask(heads: list, n: int) -> str:
    """base64 of np.packbits of the [kv head, n] mask of the positions < n in `heads` ([kv head] positions)."""
    mask = np.zeros((len(heads), n), bool)
    for h, pos in enumerate(heads):
        pos = [t for t in pos if t < n]
        mask[h, pos] = True
    return base64.b64encode(np.packbits(mask).tobytes()).decode()


def channels_kept(cache, full_keys, n: int) -> tuple[list[str], list[str]]:
    """A channel press's cache (kvpress's ThinKPress zeroes the pruned key channels of every cached key): per
    layer, (the [kv head, n] kept-token mask, each cached key matched to an uncompressed key over its head's
    kept channels, bit for bit; the [kv head, D] kept-channel mask: the channels not zero in every key)."""
    kept, chans = [], []
    for layer, full in enumerate(full_keys):  # full [K, n, D]
        keys = cache.layers[layer].keys[0].numpy()  # [K, m, D]
        f = full.numpy()
        on = ~(keys == 0).all(axis=1)  # [K, D]
        heads = []
        for h in range(keys.shape[0]):
            where = {f[h, t, on[h]].tobytes(): t for t in range(f.shape[1])}
            pos = [where.get(row[on[h]].tobytes(), -1) for row in keys[h]]
            assert min(pos, default=0) >= 0, "a cached key matches no context key over its kept channels"
            heads.append(pos)
        kept.append(_mask(heads, n))
        chans.append(base64.b64encode(np.packbits(on).tobytes()).decode())
    return kept, chans


@torch.no_grad()
def run_own(model, presses, ctx, question, n_new):
    """{(name, ratio): result} of the presses `evals.peer` reads back their own way, each through kvpress's
    pipeline: ThinKPress (the context prefilled under the press; "kept" every token it holds, "channels" each
    head's kept key channels, `channels_kept`), the decoding presses (the context prefilled, under the press
    for PrefillDecodingPress only, then the question and the greedy ids under it; `Tracker` follows every slot
    through the compressions: "kept" is the context positions held after the last id fed, "kept_prefill" those
    after the prefill), FastKVzipPress (its compression in its context manager's exit; masked slots not kept).
    Each result also has "cache_bytes", its key and value tensors' bytes after the compression (after the
    decoding for a decoding press)."""
    full = DynamicCache()
    model(input_ids=ctx, past_key_values=full, logits_to_keep=1)
    full_keys = [full.layers[i].keys[0] for i in range(len(full.layers))]
    index = key_index(full_keys)
    n, out = ctx.shape[1], {}
    for name, ratio, fields in presses:
        t0 = time.time()
        try:
            press = make_press(name, ratio, dict(fields))
            cache = DynamicCache()
            if isinstance(press, (kvpress.DecodingPress, kvpress.PrefillDecodingPress)):
                pre = isinstance(press, kvpress.PrefillDecodingPress)
                dec = press.decoding_press if pre else press
                tracker = Tracker([p for p in (press.prefilling_press if pre else None, dec.base_press) if p is not None])
                with press(model) if pre else contextlib.nullcontext():  # the pipeline's prefill
                    hooks = tracker.attach(model)  # after the press's hooks: they run after its compression
                    model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
                    [h.remove() for h in hooks]
                phases = {"prefill": time.time() - t0}
                after = tracker.kept()
                with press(model):
                    hooks = tracker.attach(model)
                    answer = greedy(model, cache, question, n, n_new, phases)
                    [h.remove() for h in hooks]
                res = {"kept": [_mask(h, n) for h in tracker.kept()], "kept_prefill": [_mask(h, n) for h in after],
                       "answer": answer}
            elif isinstance(press, kvpress.ThinKPress):
                with press(model):
                    model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
                phases = {"prefill": time.time() - t0}
                t1 = time.time()
                kept, chans = channels_kept(cache, full_keys, n)
                phases["kept"] = time.time() - t1
                held = sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)
                res = {"kept": kept, "channels": chans, "cache_bytes": held,
                       "answer": greedy(model, cache, question, n, n_new, phases)}
            else:  # FastKVzipPress
                with press(model):
                    model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
                held = sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)
                res = timed_answer(model, cache, index, ctx, question, n_new, {"prefill": time.time() - t0})
                res["cache_bytes"] = held
            if "cache_bytes" not in res:
                res["cache_bytes"] = sum(x.keys.nbytes + x.values.nbytes for x in cache.layers)
            res["phases"] = {k: round(v, 3) for k, v in (res.get("phases") or phases).items()}
            out[(name, ratio)] = res
        except Exception as e:  # noqa: BLE001  (kvpress failing is a result)
            out[(name, ratio)] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            _set_masks(model, [None] * len(model.model.layers))
    return out


def group_of(name: str, shared: bool = True) -> tuple[str, str]:
    """(attention implementation, how: "shared" | "pipeline" | "kvzip") a press runs with:
    ObservedAttentionPress needs the attention weights (eager); KVzipPress compresses after the
    prefill, in its own context manager's exit (a second pass reconstructing the context), so it
    never runs in a shared prefill's forward hook: with `shared`, its ratios share one pass
    (`run_kvzip`), else kvpress's pipeline per press (`run_per_press`). KVComposePress (the same, its
    pass the context itself) runs kvpress's pipeline per press, on the eager model: it prefills with
    eager attention, whose keys the kept positions are matched against."""
    name = base(name)
    if name in REPEATS:  # KVgradPress: KVzipPress's pass (with its gradients), its compress_post alike
        return "sdpa", "kvzip" if shared else "pipeline"
    if name == "KVComposePress":  # compresses in its context manager's exit too, after an eager prefill and pass
        return "eager", "pipeline"
    if name == "RestoreKVPress":  # kvzip's pass, then its restore pass (its LoRA): the pipeline, per press
        return "sdpa", "pipeline"
    if name.split(":", 1)[0] in OWN:  # read back their own way, each through kvpress's pipeline (`run_own`)
        return "sdpa", "own"
    return ("eager" if name == "ObservedAttentionPress" else "sdpa"), "shared" if shared else "pipeline"


def every_core_once(flag: str | None) -> None:
    """torch's threads become every core's once the file `flag` exists (`evals.peer` writes it when
    its own side is done: the worker started with half of them, beside it); checked between items."""
    if flag and torch.get_num_threads() != (os.cpu_count() or 1) and os.path.exists(flag):
        torch.set_num_threads(os.cpu_count() or 1)


def main_samples(job: dict, out_path: str) -> None:
    """The multi-sample form: every sample's presses, one JSON line appended per (sample, press)."""
    EOS_STOP[0] = bool(job.get("eos_stop"))
    path = job["checkpoint"] or build_tiny(job["tiny"], job["save_to"])
    shared = job.get("prefill", "shared") == "shared"
    if any(base(p[0]) in REPEATS + ("RestoreKVPress",) for s in job["samples"] for p in s.get("presses", job.get("presses", []))):
        use_tokenizer(job)
    models = {}
    with open(out_path, "a", encoding="utf-8") as f:
        for sample in job["samples"]:
            ctx = torch.tensor([sample["context"]])
            question = torch.tensor([sample["question"]])
            presses = sample.get("presses", job.get("presses"))
            for attn, how in dict.fromkeys(group_of(p[0], shared) for p in presses):
                group = [p for p in presses if group_of(p[0], shared) == (attn, how)]
                if attn not in models:
                    models[attn] = load(path, attn, job.get("gguf_file"))
                every_core_once(job.get("every_core_when"))
                t0 = time.time()
                run_group = {"shared": run_shared, "pipeline": run_per_press, "kvzip": run_kvzip, "own": run_own}[how]
                res = run_group(models[attn], group, ctx, question, job["n_new"])
                secs = round((time.time() - t0) / len(res), 2)  # the group's time, shared out
                for (name, ratio), r in res.items():
                    line = {"sample": sample["id"], "press": name, "ratio": ratio, "n": ctx.shape[1],
                            "seconds": secs} | r
                    f.write(json.dumps(line) + "\n")
                    f.flush()


# -- the loop mode (the tests' one worker per pytest process) ------------------------------------------


def serve() -> None:
    """`python evals/kvpress_worker.py --serve`: jobs from stdin, one JSON line each, {"argv": [...],
    "script": Python source | null, "stdout": file, "stderr": file}; each runs in a child forked from
    this process, which has imported torch, transformers and kvpress once (about 4 s a process), so a job costs
    what it computes. The child starts from this process's state as it was after the imports (no
    job sees another's: a job may patch kvpress's classes or seed torch), its stdin /dev/null, its
    stdout and stderr appended to the files named, and runs what a process of its own would:
    `python evals/kvpress_worker.py ARGV...` (script null: the single-job form above) or
    `python -c SCRIPT ARGV...`. Answers one JSON line per job, {"rc": the child's exit status}.
    Ends at the end of stdin. Nothing in a job is computed here, so no thread pool (torch's,
    OpenMP's, the tokenizers') exists when a child is forked."""
    import traceback

    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "AutoModelForCausalLM", "AutoTokenizer"):
        getattr(transformers, name)  # transformers' lazy modules, imported once here
    here = str(pathlib.Path(__file__).resolve().parent)
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    os.dup2(os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
                if job.get("script") is None:  # as `python evals/kvpress_worker.py ARGV`
                    sys.argv, sys.path[0] = [__file__, *job["argv"]], here
                    main(*sys.argv[1:3])
                else:  # as `python -c SCRIPT ARGV` (its `import kvpress_worker` runs this file again, as there)
                    sys.argv, sys.path[0] = ["-c", *job["argv"]], ""
                    del sys.modules["kvpress_worker"]
                    code = compile(job["script"], "<string>", "exec")
                    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException as e:  # noqa: BLE001  the traceback a process of its own would print
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1] in ("--convert", "--check-converted"):  # scripts/setup.sh test; the check above
        src = pathlib.Path(sys.argv[2]).resolve()
        print(converted(str(src.parent), src.name)) if sys.argv[1] == "--convert" else check_converted(sys.argv[2])
    elif sys.argv[1] == "--serve":
        import kvpress_worker  # this file as the module a job's script imports (sys.path[0] is evals/)

        kvpress_worker.serve()
    else:
        main(*sys.argv[1:3])
