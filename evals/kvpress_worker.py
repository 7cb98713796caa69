"""kvpress 0.5.5 itself, as a subprocess of the parity tests and `evals.peer` (run in its own environment).

Run with PYTHONPATH=.venv/kvpress-ref (transformers 5.2.0 + kvpress, see scripts/setup.sh):
    python evals/kvpress_worker.py job.json out.json
job: {"checkpoint": dir | null, "gguf_file": name in that dir | absent, "tiny": {"kind": "llama"|"qwen2", "seed": int, "config": {...}} | null,
      "save_to": dir | null, "context": [ids], "question": [ids], "n_new": int,
      "presses": [[name, ratio, {fields}], ...], "tokenizer": "ascii" | absent (the checkpoint's)}
A "tiny" job builds a random transformers model (biases and norms perturbed) and saves it to
`save_to` first, for our loader. Per press, as kvpress's pipeline runs it: the context prefilled
under `press(model)` into a DynamicCache (ObservedAttentionPress: eager attention, else sdpa),
then the question at positions after the context and greedy tokens, no further compression.
Out: {name@ratio: {"kept": [layer][kv head] positions, "answer": ids} or {"error": text}}; kept
positions are read by matching each cached key to the uncompressed cache's keys (exact copies).
"""

from __future__ import annotations

import json
import sys

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


def load(path: str, attn: str, gguf: str | None = None):
    kw = {"gguf_file": gguf, "local_files_only": True} if gguf else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                             **kw).eval()


class AsciiTokenizer:
    """The tiny models' tokenizer (ids = ASCII codes, no chat template) for KVzipPress's repeat
    prompts; `models.tokenizer.ByteTokenizer` would give the same ids to ASCII text."""

    chat_template = None

    def encode(self, text, return_tensors=None, add_special_tokens=False):
        ids = [ord(c) for c in text]
        return torch.tensor([ids]) if return_tensors == "pt" else ids


def use_tokenizer(job: dict) -> None:
    """KVzipPress loads `AutoTokenizer.from_pretrained(model.config.name_or_path)`: the job's
    tokenizer instead (a GGUF file's, or ASCII ids for a tiny model); nothing else changes."""
    from kvpress.presses import kvzip_press

    if job.get("tokenizer") == "ascii":
        tok = AsciiTokenizer()
    else:
        kw = {"gguf_file": job["gguf_file"]} if job.get("gguf_file") else {}
        tok = transformers.AutoTokenizer.from_pretrained(job["checkpoint"], local_files_only=True, **kw)

    class Given:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return tok

    kvzip_press.AutoTokenizer = Given


def make_press(name: str, ratio: float, fields: dict):
    if name == "DuoAttentionPress":  # given a head pattern (kvpress downloads the authors' or scores BookSum)
        scores = np.clip(np.asarray(fields.pop("head_scores"), float), 0, 1)
        sizes = (fields.pop("sink_size", 128), fields.pop("recent_size", 256))

        class GivenPattern(kvpress.DuoAttentionPress):
            @staticmethod
            def load_attention_pattern(model):
                return sizes[0], sizes[1], scores

        return GivenPattern(head_compression_ratio=ratio, **fields)
    if name == "AdaKVPress":
        inner = fields.pop("press", "SnapKVPress")
        return kvpress.AdaKVPress(getattr(kvpress, inner)(compression_ratio=ratio), **fields)
    return getattr(kvpress, name)(compression_ratio=ratio, **fields)


@torch.no_grad()
def run(model, press, ctx, question, n_new, full_keys):
    cache = DynamicCache()
    with press(model):
        model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
    kept = []
    for layer, full in enumerate(full_keys):  # full [K, n, D]
        keys = cache.layers[layer].keys[0]  # [K, m, D]
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
            heads.append(sorted(int(p) for p in pos))
        kept.append(heads)
    n = ctx.shape[1]
    position_ids = torch.arange(n, n + question.shape[1]).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    pid = position_ids[:, -1:] + 1
    for i in range(n_new - 1):
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=pid + i)
        ids.append(int(out.logits[0, -1].argmax()))
    return {"kept": kept, "answer": ids}


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    path = job["checkpoint"] or build_tiny(job["tiny"], job["save_to"])
    if any(name == "KVzipPress" for name, _, _ in job["presses"]):
        use_tokenizer(job)
    ctx = torch.tensor([job["context"]])
    question = torch.tensor([job["question"]])
    models, fulls = {}, {}
    result = {}
    for name, ratio, fields in job["presses"]:
        attn = "eager" if name == "ObservedAttentionPress" else "sdpa"
        if attn not in models:  # the model and its uncompressed cache, once per attention implementation
            models[attn] = load(path, attn, job.get("gguf_file"))
            with torch.no_grad():
                full = DynamicCache()
                models[attn](input_ids=ctx, past_key_values=full, logits_to_keep=1)
            fulls[attn] = [full.layers[i].keys[0] for i in range(len(full.layers))]
        model, full_keys = models[attn], fulls[attn]
        try:
            result[f"{name}@{ratio}"] = run(model, make_press(name, ratio, dict(fields)), ctx, question,
                                            job["n_new"], full_keys)
        except Exception as e:  # kvpress itself failing is a result (the docs quote it)
            result[f"{name}@{ratio}"] = {"error": f"{type(e).__name__}: {e}"}
        for layer in model.model.layers:  # AdaKV leaves its mask on the modules
            if hasattr(layer.self_attn, "masked_key_indices"):
                layer.self_attn.masked_key_indices = None
    json.dump(result, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
