"""Train the bundled demo decoder `tensorbus-demo-lm` from text that Python ships.

1. Corpus: `pydoc_data.topics` (the language reference behind `help()`), rendered as
   small chat exchanges, plus every docstring of 80+ characters in the standard
   library's own sources (read with `ast`, never imported: importing stdlib modules
   can have side effects). Nothing is downloaded, so anyone can retrain it.
2. Tokenizer: byte-level BPE trained by `tokenizers` on that corpus (4096 entries,
   three special tokens: end of text and two chat role markers).
3. Model: a small Llama-family decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention,
   tied embeddings), trained with AdamW for a fixed number of steps on one CPU thread.
4. Output: the Hugging Face layout (config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json with a chat template, generation_config.json).

Deterministic: fixed seeds, sorted file order, one thread. The corpus depends on the
Python version (the stdlib's docstrings change between releases); it was built with
CPython 3.11.

    .venv/bin/python scripts/train_demo_lm.py [--out models/tensorbus-demo-lm] [--steps N]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EOS = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}" + USER + "\n{{ m['content'] }}\n"
    "{% else %}" + ASSISTANT + "\n{{ m['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "\n{% endif %}"
)
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo"}


def stdlib_docstrings() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    docs.append(doc)
    return docs


def pydoc_chats() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = topics[name].strip()
        # Long topics are cut at paragraph boundaries into several exchanges.
        paras, chunk = text.split("\n\n"), ""
        for para in paras:
            if len(chunk) + len(para) > 1500 and chunk:
                out.append(f"{USER}\nTell me about {name}.\n{ASSISTANT}\n{chunk.strip()}")
                chunk = ""
            chunk += para + "\n\n"
        if chunk.strip():
            out.append(f"{USER}\nTell me about {name}.\n{ASSISTANT}\n{chunk.strip()}")
    return out


def build_corpus() -> list[str]:
    docs = stdlib_docstrings() + pydoc_chats()
    random.Random(0).shuffle(docs)
    return docs


def train_tokenizer(docs: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS, USER, ASSISTANT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def model_config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )


def token_stream(tok, docs: list[str]) -> list[int]:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return ids


def lr_at(step: int, steps: int, peak: float, warm: int) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model, data, *, steps: int, batch: int, seq: int, lr: float, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0, ema = time.perf_counter(), None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warm=max(1, steps // 20))
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts.tolist()])  # x: [B, S]
        # The model shifts labels itself: position i is scored on token i + 1.
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            el = time.perf_counter() - t0
            print(f"step {step:5d}/{steps} loss {ema:.3f} {el:7.1f}s", flush=True)


def sample_text(model, tok, prompt: str, n: int = 40) -> str:
    import torch

    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, repetition_penalty=1.0)
    return tok.decode(out[0, ids.shape[1] :].tolist())


def save(model, tok, out: Path) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": EOS,
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/tensorbus-demo-lm")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    docs = build_corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs))} characters", flush=True)
    tok = train_tokenizer(docs, args.vocab)
    data = torch.tensor(token_stream(tok, docs), dtype=torch.long)
    print(f"tokens: {len(data)} (vocab {tok.get_vocab_size()})", flush=True)

    model = LlamaForCausalLM(model_config(tok.get_vocab_size()))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params}", flush=True)
    train(model, data, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed)
    chat = f"{USER}\nTell me about lambda.\n{ASSISTANT}\n"
    for prompt in ("The function returns", "This module provides", chat):
        print(repr(prompt), "->", repr(sample_text(model, tok, prompt)), flush=True)
    save(model, tok, Path(args.out))
    print(f"saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
