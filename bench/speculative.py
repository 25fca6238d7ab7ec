"""Prompt-lookup speculation on one stream: off against ngram:K, side by side.

The bundled SmolLM2-135M-Instruct, greedy, one stream, `--tokens` new tokens (or
to its end of answer) for two chat prompts: one whose answer copies its prompt
(repeat a list: the lookup finds what comes next) and one whose answer does not (a
short story). For each K (0: off) the same generation is timed `--repeats` times,
the settings interleaved so that the machine's load falls on all alike; each
setting's tokens must equal K=0's (the run fails otherwise). Reported per prompt
and K: tokens/s (median), its ratio to K=0, the draft acceptance rate, tokens per
engine call (verify passes and normal steps together), and tokens per verify pass.

Compiles happen before timing (one warm run per setting). The K values share one
engine (its `spec_k` is set between runs: each K is its own verify program).

    .venv/bin/python -m bench.speculative --ks 0,2,4 --tokens 80 --repeats 2
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ITEMS = ("apples, bread, milk, eggs, butter, cheese, rice, pasta, tomatoes, onions, "
         "garlic, carrots, potatoes, chicken, salmon, yogurt, oranges, bananas, coffee, tea, "
         "sugar, flour, salt, pepper, olive oil, lettuce, spinach, beans, honey, lemons")
PROMPTS = {
    "repeat-list": "Here is my shopping list: " + ITEMS + ". Repeat the whole list back "
                   "to me, one item per line, numbered.",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _generate(eng, prompt: list[int], tokens: int) -> tuple[list[int], float, int]:
    """Greedy tokens of one stream -> (tokens, seconds, engine calls)."""
    from engine.decoder.static import prefill_insert
    from shared.messages import Sampling

    eos = set(eng.eos_token_ids)
    out = [prefill_insert(eng, 0, prompt, Sampling(temperature=0.0), 0)]
    t0, calls = time.perf_counter(), 0
    while len(out) < tokens and out[-1] not in eos:
        pending = eng.step_async()
        out += [int(pending.result()[0])] + pending.more.get(0, [])
        calls += 1
    seconds = time.perf_counter() - t0
    eng.free(0)
    out = out[:tokens]
    if eos & set(out):
        out = out[: next(i for i, t in enumerate(out) if t in eos) + 1]
    return out, seconds, calls


def main(argv=None) -> dict:
    from bench.harness import csv_ints, parser, run_info, write_json

    ap = parser(__doc__)
    ap.add_argument("--ks", type=csv_ints, default=[0, 2, 4], help="draft tokens (0: off)")
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quant", default="none", help="stored weights (gguf: the file's blocks)")
    ap.add_argument("--form", default="auto", help="compute form (kernel: the CPU kernel)")
    args = ap.parse_args(argv)
    from engine import jaxrt
    from engine.chat import ChatTemplate
    from engine.decoder import DecoderEngine
    from shared import catalog

    jaxrt.setup(os.environ.get("JAX_CACHE_DIR") or None)
    model_dir = Path(catalog.bundled_dir(catalog.SMOLLM2))
    eng = DecoderEngine(model_dir, catalog.SMOLLM2, slots=4, max_context=512,
                        prefill_buckets=(128, 256), speculative=max(args.ks),
                        quant=args.quant, quant_form=args.form)  # fmt: skip
    chat = ChatTemplate.from_dir(model_dir)
    doc = {"run": run_info(), "tokens": args.tokens, "quant": args.quant, "form": args.form,
           "cases": []}
    for name, text in PROMPTS.items():
        ids = eng.tokenizer.encode(chat.render([{"role": "user", "content": text}]),
                                   add_special_tokens=False)  # fmt: skip
        runs: dict[int, list[tuple[float, int, int]]] = {k: [] for k in args.ks}
        stats: dict[int, tuple[int, int, int]] = {}
        reference = None
        for rep in range(args.repeats + 1):  # the first round compiles: not timed
            for k in args.ks:
                eng.speculation.k = k
                before = eng.speculation_stats()
                got, seconds, calls = _generate(eng, ids, args.tokens)
                after = eng.speculation_stats()
                if reference is None:
                    reference = got
                if got != reference:
                    raise AssertionError(f"{name}: ngram:{k} changed the tokens")
                if rep:
                    runs[k].append((len(got) / seconds, calls, len(got)))
                    stats[k] = (after.steps - before.steps, after.drafted - before.drafted,
                                after.accepted - before.accepted)
        base = statistics.median(r[0] for r in runs[args.ks[0]])
        for k in args.ks:
            tps = statistics.median(r[0] for r in runs[k])
            steps, drafted, accepted = stats[k]
            _, calls, n = runs[k][-1]
            case = {"prompt": name, "k": k, "prompt_tokens": len(ids), "tokens": n,
                    "tokens_per_s": round(tps, 2), "ratio": round(tps / base, 3),
                    "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                    "tokens_per_call": round((n - 1) / max(calls, 1), 3),
                    "tokens_per_verify": round((accepted + steps) / steps, 3) if steps else 0.0,
                    "verify_passes": steps, "calls": calls}  # fmt: skip
            doc["cases"].append(case)
            print(json.dumps(case), flush=True)
    write_json("speculative.json", doc)
    return doc


if __name__ == "__main__":
    main()
