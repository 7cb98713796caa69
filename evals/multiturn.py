"""A multi-turn conversation over one shared long context (SCBench's multi-turn mode).

Shapes: T context tokens, N turns, n generated tokens per turn.

A context of `length` tokens (chat header, RULER's needle instruction, a Paul Graham haystack with
`turns` needles at random depths) is followed by N turns; turn i asks for the value of needle i
and the model's greedy answer (cut at its first line end or end-of-turn marker) is appended to
the conversation before the next turn, through the chat template (the end of the assistant turn,
then a new user turn and the assistant header). Each answer is scored by RULER's string match
against its needle's value: accuracy per turn, with Wilson intervals, shows whether it falls as
the conversation grows. Beside it, `value_held` (per turn: `value_held_t<i>`): the fraction of the
asked value's context tokens the cache holds while the turn is answered, per layer and kv head,
averaged (`Engine.kept_positions`): 1 for `full`; what a compressor kept of the answer itself.

Modes (`mode`):
  once   the context is prefilled and compressed ONCE (query-agnostic: `Engine.prompt` +
         `compress`); every question and every answer is then appended to that compressed cache
         through the decode policies (the cache lives on across turns, as a server's would);
  every  the conversation is held by the prompt phase and compressed again at every turn with
         the turn's question seen (`extend_prompt` + `compress`, query-aware): the whole history,
         earlier answers included, is re-scored each time (kvpress's re-compression per turn).
A streaming policy (sink, h2o...) has no prompt phase, so its two modes are the same run.

    python -m evals.run model=qwen task=multiturn policy=kvzip budget=0.25 task.mode=once
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from evals import prefills
from evals import retrieval as R
from evals import ruler
from evals.common import Task, TaskContext, TaskResult, lengths_field
from evals.results import latest, load_array, read

MODES = ("once", "every")
DEFAULTS = {"lengths": [2048], "trials": 4, "turns": 4, "gen": 24, "mode": "once", "value_kind": "numbers",
            "haystack": "pg", "order": "depth"}
# the order the turns ask for the needles: `depth` (turn i asks for the i-th shallowest: a turn's
# accuracy mixes its place in the conversation with its needle's depth) or `shuffled` (a random
# order per conversation, the same contexts: turn and depth vary independently)
ORDERS = ("depth", "shuffled")
TURN_ROOM = ruler.QUESTION_ROOM  # the most tokens one turn's question (chat tail included) may take
STOPS = ("\n", "<|", "<end_of_turn>", "</s>")  # an answer ends at the first of these


def check(task: dict) -> dict[str, Any]:
    """The validated config (defaults filled in); unknown keys or bad values raise ValueError."""
    cfg = R.known_task(dict(task), "multiturn", DEFAULTS, ("trials", "turns", "gen"))
    if cfg["mode"] not in MODES:
        raise ValueError(f"task.mode={cfg['mode']!r}: must be one of {list(MODES)}")
    if cfg["order"] not in ORDERS:
        raise ValueError(f"task.order={cfg['order']!r}: must be one of {list(ORDERS)}")
    if cfg["value_kind"] not in ruler.VALUE_KINDS:
        raise ValueError(f"task.value_kind={cfg['value_kind']!r}: must be one of {sorted(ruler.VALUE_KINDS)}")
    if cfg["turns"] > len(ruler.DEPTH_GRID):
        raise ValueError(f"task.turns={cfg['turns']}: at most {len(ruler.DEPTH_GRID)}")
    return cfg


def max_len(cfg: dict[str, Any]) -> int:
    """The longest conversation: the context, then every turn's question and answer."""
    return max(cfg["lengths"]) + cfg["turns"] * (TURN_ROOM + cfg["gen"])


def next_turn(tok: Any, question: str, prefix: str) -> list[int]:
    """Token ids that close an assistant answer and ask the next question: the chat template's
    end of turn, a user turn and the assistant header, then the answer prefix."""
    mark = "\x00ANSWER\x00"
    if R.has_chat_template(tok):
        text = tok.apply_chat_template([{"role": "user", "content": "c"}, {"role": "assistant", "content": mark},
                                        {"role": "user", "content": question}], add_generation_prompt=True)
        tail = text.split(mark, 1)[1]
    else:
        tail = f"\n\n{question}\n"
    return tok.encode(tail + prefix)


def asked(seed: int, length: int, trials: int, turns: int, order: str = "depth") -> np.ndarray:
    """[trials, N] the needle each turn asks for, as its depth rank (0 = the shallowest; needles
    sit at sorted depths): `arange(N)` per trial for `depth`, a seeded permutation per trial for
    `shuffled` (a generator of its own: the contexts do not depend on the order)."""
    if order == "depth":
        return np.tile(np.arange(turns), (trials, 1))
    shuffle = np.random.default_rng([seed, length, 29, turns])
    return np.stack([shuffle.permutation(turns) for _ in range(trials)]) if trials else np.zeros((0, turns), int)


def by_depth(score: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Scores [..., N] per turn -> per needle depth rank [..., N] (`ranks`: `asked`, same shape)."""
    out = np.zeros_like(score)
    np.put_along_axis(out, ranks, score, axis=-1)
    return out


def samples(tok: Any, hay: ruler.Haystack, length: int, trials: int, seed: int, turns: int, value_kind: str,
            order: str = "depth") -> list[tuple[np.ndarray, list[tuple[np.ndarray, str]]]]:
    """Per trial: the context ids (`length` tokens, ending where the first question begins) and
    per turn (question ids, reference value). The contexts do not depend on `order` (its
    permutations come from a generator of their own)."""
    rng = np.random.default_rng([seed, length, 17, turns, 1 if value_kind == "uuid" else 0])
    order_of = asked(seed, length, trials, turns, order)
    plural, one = ruler.VALUE_KINDS[value_kind]
    instruction = ruler.NIAH_INSTRUCTION.format(kind=plural)
    out = []
    for trial in range(trials):
        keys = ruler.word_keys(rng, turns)
        values = ruler.needle_values(rng, turns, value_kind)
        at = list(np.sort(rng.choice(ruler.DEPTH_GRID, turns, replace=False)))
        head, _ = R.frame(tok, instruction, "", "")
        qs = []
        for i, n in enumerate(order_of[trial]):
            k, v = keys[n], values[n]
            q = ruler.NIAH_QUESTION_ONE.format(kind_one=one, query=k)
            prefix = ruler.NIAH_PREFIX_ONE.format(kind_one=one, query=k)
            ids = R.frame(tok, instruction, q, prefix)[1] if i == 0 else next_turn(tok, q, prefix)
            if len(ids) > TURN_ROOM:
                raise ValueError(f"a turn's question takes {len(ids)} tokens > {TURN_ROOM}")
            qs.append((np.asarray(ids, np.int32), v))
        needles = [tok.encode(" " + ruler.NIAH_NEEDLE.format(kind=plural, key=k, value=v)) for k, v in zip(keys, values)]
        off = int(rng.choice(hay.starts))
        p = R.build_prompt(head, [], hay.ids[off:], hay.ends[off:], length, needles, at, values[0])
        out.append((np.asarray(p.tokens, np.int32), qs))
    return out


def cut_answer(text: str) -> str:
    """The answer up to its first line end or end-of-turn marker."""
    ends = [i for i in (text.find(s) for s in STOPS) if i >= 0]
    return text[:min(ends)] if ends else text


def append(engine, state, ids: np.ndarray):
    """A compressed state with `ids` [T] fed through the decode policies (the state stays usable)."""
    return engine.feed(state, ids[None], chunk=ids.size)


def value_positions(pieces: list[str], value: str) -> np.ndarray:
    """The positions of the tokens (`pieces`: each token's decoded text) that spell the first
    occurrence of `value` in their joined text (empty when it does not occur)."""
    ends = np.cumsum([len(p) for p in pieces])
    at = "".join(pieces).find(value)
    if at < 0:
        return np.zeros(0, np.int64)
    return np.nonzero((ends - np.array([len(p) for p in pieces]) < at + len(value)) & (ends > at))[0]


def held_fraction(engine, state, positions: np.ndarray) -> float:
    """The fraction of `positions` a state holds, averaged over layers and kv heads
    (`Engine.kept_positions`, batch row 0); NaN for no positions."""
    if positions.size == 0:
        return float("nan")
    return float(np.mean([np.isin(positions, h).mean() for layer in engine.kept_positions(state) for h in layer]))


def conversation(engine, tok: Any, context: np.ndarray, turns: list[tuple[np.ndarray, str]], gen: int, mode: str,
                 chunk: int) -> tuple[list[str], list[int], list[float]]:
    """Each turn's decoded answer, the cache length it was answered at, and the fraction of its
    reference value's context tokens the cache held while it answered (`held_fraction`: per layer
    and kv head, averaged; NaN when the value is not in the context)."""
    state = prefills.prompted(engine, context[None], chunk)
    if mode == "once":
        state = engine.compress(state)
    pieces = [tok.decode([int(i)]) for i in context]
    texts, at, held = [], [], []
    for q, ref in turns:
        if mode == "once":
            state = append(engine, state, q)
            answering = state
        else:
            state = engine.extend_prompt(state, q[None], chunk)
            answering = engine.compress(state)
        ids = engine.continue_generate(answering, [], gen)
        held.append(held_fraction(engine, answering, value_positions(pieces, ref)))
        at.append(state.length)
        text = ruler.ids_text(tok, ids[0])
        texts.append(text)
        said = np.asarray(tok.encode(cut_answer(text)), np.int32)  # the answer as the next turn sees it
        if said.size:
            state = append(engine, state, said) if mode == "once" else engine.extend_prompt(state, said[None], chunk)
    return texts, at, held


def per_turn_and_depth(score: np.ndarray, ranks: np.ndarray) -> dict[str, float]:
    """accuracy_t<i> / ci_low_t<i> / ci_high_t<i> per turn i, and accuracy_d<j> (with its
    interval) per needle depth rank j (0 = the shallowest), from scores [..., N] and `asked`'s
    ranks of the same shape: with `order=depth` the two are the same numbers."""
    out: dict[str, float] = {}
    for tag, sc in (("t", score), ("d", by_depth(score, ranks))):
        for i in range(score.shape[-1]):
            rec = ruler.accuracy_record(sc[..., i].ravel())
            out |= {f"accuracy_{tag}{i}": rec["accuracy"], f"ci_low_{tag}{i}": rec["ci_low"],
                    f"ci_high_{tag}{i}": rec["ci_high"]}
    return out


def depth_table(rows: list[dict]) -> str:
    """A markdown table of multi-turn rows (`evals.results.read`): accuracy per turn and per needle
    depth rank, recomputed from each row's saved scores and its task's seed and order (runs
    made before `accuracy_d<j>` was recorded too), and per turn the mean fraction of the asked
    value's tokens the cache held (its saved `value_held` array; blank for rows without one)."""
    lines = []
    for r in rows:
        task = r["config"]["task"]
        if task.get("name") != "multiturn":
            continue
        sc = load_array(r, "score")  # [lengths, trials, turns]
        ranks = np.stack([asked(r["config"]["seed"], n, task["trials"], task["turns"], task.get("order", "depth"))
                          for n in task["lengths"]])
        m = per_turn_and_depth(sc, ranks)
        nt = task["turns"]
        if not lines:
            head = [f"turn {i}" for i in range(nt)] + [f"depth {j}" for j in range(nt)]
            lines = ["| policy | mode | order | " + " | ".join(head) + " | value held, per turn |",
                     "|---|---|---|" + "---:|" * (2 * nt) + "---|"]
        cells = [f"{m[f'accuracy_{k}{i}']:.2f}" for k in "td" for i in range(nt)]
        held = ""
        if "value_held" in r.get("arrays", {}):
            per_turn = load_array(r, "value_held").reshape(-1, nt).mean(axis=0)  # [lengths * trials, turns]
            held = " / ".join(f"{h:.2f}" for h in per_turn)
        lines.append(f"| {r['policy']['name']} | {task.get('mode', 'once')} | {task.get('order', 'depth')} | "
                     + " | ".join(cells) + f" | {held} |")
    return "\n".join(lines)


def references(row: dict) -> list[list[list[str]]]:
    """[length][trial][turn] the values a saved row's turns asked for, rebuilt from its config
    (its model's tokenizer, the haystack, the seed and order: `samples`)."""
    from evals import zoo

    cfg, task = row["config"], check(row["config"]["task"])
    if task["haystack"] == "text":
        raise ValueError("answers: a run with task.haystack=text (rebuilding its prompts needs its data)")
    tok = zoo.load_tokenizer(cfg["model"])
    hay = ruler.haystack(tok, task["haystack"], None, max(task["lengths"]) + TURN_ROOM)
    return [[[v for _, v in turns] for _, turns in samples(tok, hay, n, task["trials"], cfg["seed"], task["turns"],
                                                           task["value_kind"], task["order"])]
            for n in task["lengths"]]


def echoes(answer: str, earlier: list[str], n: int = 4) -> bool:
    """Whether `answer` ends with the last `n` characters of an earlier answer (a wrong answer
    finishing a number the conversation already said)."""
    tail = answer.rstrip(". ")[-n:]
    return len(tail) == n and any(a.rstrip(". ").endswith(tail) for a in earlier)


def answers_table(rows: list[dict]) -> str:
    """Per multi-turn row and conversation: each turn's answer (cut), whether it is right, and the
    fraction of its value's tokens the cache held (`value_held`, for rows that saved it); a wrong
    answer that ends like an earlier answer of its conversation (`echoes`) is marked "echo"."""
    lines = []
    for r in rows:
        if r["config"]["task"].get("name") != "multiturn":
            continue
        refs, outs = references(r), load_array(r, "outputs")  # [lengths, trials, turns]
        held = load_array(r, "value_held") if "value_held" in r.get("arrays", {}) else None
        nt = outs.shape[-1]
        lines += [f"\n{r['policy']['name']}, mode {r['config']['task'].get('mode', 'once')}:\n",
                  "| length | trial | " + " | ".join(f"turn {i}" for i in range(nt)) + " |", "|---|---|" + "---|" * nt]
        for li, n in enumerate(r["config"]["task"]["lengths"]):
            for t in range(outs.shape[1]):
                said = [cut_answer(str(a)).strip() for a in outs[li, t]]
                cells = []
                for i in range(nt):
                    ok = ruler.string_match_all(str(outs[li, t, i]), [refs[li][t][i]]) == 1
                    mark = "right" if ok else ("wrong, echo" if echoes(said[i], said[:i]) else "wrong")
                    kept = "" if held is None else f", held {float(held[li, t, i]):.2f}"
                    cells.append(f"{said[i][:16]} ({refs[li][t][i]}: {mark}{kept})")
                lines.append(f"| {n} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines).strip()


def main(argv: list[str] | None = None) -> None:
    """`python -m evals.multiturn RESULTS...`: accuracy per turn and per needle depth rank of
    the multi-turn rows in the results files (depth 0 = the shallowest needle); with --answers,
    each conversation's answers beside the values asked."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m evals.multiturn", description=main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("results", nargs="+", help="results .jsonl files of task=multiturn runs")
    ap.add_argument("--answers", action="store_true", help="print every answer beside its reference value "
                    "(rebuilt from the run's tokenizer and seed), right or wrong, and the value's tokens held")
    args = ap.parse_args(argv)
    try:
        rows = latest(read(args.results))
        print(answers_table(rows) if args.answers else depth_table(rows))
    except FileNotFoundError as e:
        ap.error(str(e))


def run(ctx: TaskContext) -> TaskResult:
    """grid: one cell per (length, turn) with accuracy, Wilson interval and trials; metrics:
    accuracy overall and accuracy_t<i> (ci_low_t<i>, ci_high_t<i>) per turn; arrays `score`
    [lengths, trials, turns] and the decoded `outputs`."""
    cfg = check(ctx.task)
    tok, hay = ruler.task_haystack(ctx, cfg, max(cfg["lengths"]) + TURN_ROOM)
    engine = ctx.engine(max_len(cfg))
    nt = cfg["turns"]
    grid, scores, helds, outputs = [], [], [], []
    for n in cfg["lengths"]:
        sc = np.zeros((cfg["trials"], nt))
        hf = np.zeros((cfg["trials"], nt))
        outs = np.empty((cfg["trials"], nt), object)
        for t, (context, turns) in enumerate(tqdm(samples(tok, hay, n, cfg["trials"], ctx.seed, nt, cfg["value_kind"],
                                                          cfg["order"]),
                                                  desc="multiturn", disable=not ctx.progress, leave=False)):
            texts, _, hf[t] = conversation(engine, tok, context, turns, cfg["gen"], cfg["mode"], ctx.chunk)
            for i, (text, (_, ref)) in enumerate(zip(texts, turns)):
                outs[t, i] = text
                sc[t, i] = ruler.string_match_all(text, [ref])
        for i in range(nt):
            grid.append({"length": n, "turn": i, "mode": cfg["mode"], "value_held": float(np.mean(hf[:, i]))}
                        | ruler.accuracy_record(sc[:, i]))
        scores.append(sc)
        helds.append(hf)
        outputs.append(outs.astype(str))
    all_sc = np.stack(scores)  # [lengths, trials, turns]
    metrics = {k: v for k, v in ruler.accuracy_record(all_sc.ravel()).items() if k != "trials"}
    metrics |= per_turn_and_depth(all_sc, np.stack([asked(ctx.seed, n, cfg["trials"], nt, cfg["order"])
                                                    for n in cfg["lengths"]]))
    all_held = np.stack(helds)  # [lengths, trials, turns]
    metrics |= {"value_held": float(all_held.mean())} | {f"value_held_t{i}": float(all_held[..., i].mean())
                                                        for i in range(nt)}
    metrics |= ruler.work(engine) | {"contexts": len(cfg["lengths"]) * cfg["trials"]}
    return TaskResult(metrics=metrics, grid=grid, arrays={"score": all_sc.astype(np.float32),
                                                          "value_held": all_held.astype(np.float32),
                                                          "outputs": np.stack(outputs)})


if __name__ == "__main__":
    main()


def extent(task: dict) -> tuple[str, int, int, int]:
    """(field, context tokens, tokens after them: every turn's question and answer, batch 1)."""
    t = check(task)
    return lengths_field(task), max_len(t) - t["gen"], t["gen"], 1


# `order` came after the first rows were keyed: at depth they keep their keys
TASK = Task(run=run, check=check, extent=extent, later_keys={"order": "depth"})
