"""Tiny decoders built locally from a config (random weights, fixed seed, no download),
saved in the Hugging Face layout with a small byte-level BPE tokenizer
(bench/support/tiny_tokenizer.py, which the benchmarks use too)."""

from __future__ import annotations

import os
from pathlib import Path

from bench.support.tiny_tokenizer import VOCAB, write_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(kind: str, out_dir: Path, positions: int = 128, seed: int = 0, heads: int = 4,
          kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128):
    """Save a tiny `kind` ("gpt2" | "llama") model to out_dir; return the torch model.
    Another `seed` gives other weights (a second version that answers differently).
    The defaults are the engine tests' shapes; `heads`, `kv_heads` (llama), `head_dim`
    and `intermediate` (llama) give other splits (9 query over 3 KV heads as SmolLM2)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=positions, n_embd=heads * head_dim,
                         n_layer=2, n_head=heads,
                         bos_token_id=0, eos_token_id=0, initializer_range=0.1)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=heads * head_dim,
                          intermediate_size=intermediate, num_hidden_layers=2,
                          num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=positions, rope_theta=500.0,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                          initializer_range=0.1)
        model = LlamaForCausalLM(cfg)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir)
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def serve_tiny(kind: str, out_dir: Path, name: str, context: int, slots: int = 4,
               compile_ahead: str = "lazy"):
    """Build a tiny `kind` model in out_dir and a warmed DecoderEngine on it.
    Returns (torch model, engine). `compile_ahead="all"`: every program compiled here, as a worker's background does, rather
    than on the engine thread while the first requests' deadlines run (a busy
    machine takes 4-6 s a program). Compiles go through the session's compilation
    cache (tests/conftest.py)."""
    from engine.decoder import DecoderEngine

    model = build(kind, out_dir, positions=context)
    engine = DecoderEngine(out_dir, name=name, slots=slots, max_context=context,
                           prefill_buckets=(16, 64), compile_ahead=compile_ahead)
    engine.warmup(progress=False)
    return model, engine


def serve_plan(engine, prompts: list[list[int]],
               plan: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """plan: (job, step it starts at, tokens to generate); greedy, each job's prompt
    (`prompts[job]`) into the lowest free slot when it starts, freed when done
    -> job -> its tokens. Streams join and leave the engine's steps as they would
    under a worker."""
    from engine.decoder.static import prefill_insert
    from shared.messages import Sampling

    greedy = Sampling(temperature=0.0)
    got: dict[int, list[int]] = {}
    running: dict[int, tuple[int, int]] = {}  # slot -> (job, length)
    step = 0
    while len(got) < len(plan) or running:
        for job, at, n in plan:
            if at == step:
                slot = next(s for s in range(engine.slots) if s not in running)
                got[job] = [prefill_insert(engine, slot, prompts[job], greedy, 0)]
                running[slot] = (job, n)
        if running:
            tokens = engine.step()
            for slot, (job, n) in list(running.items()):
                got[job].append(int(tokens[slot]))
                if len(got[job]) == n:
                    engine.free(slot)
                    del running[slot]
        step += 1
    return got
