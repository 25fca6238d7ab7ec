"""Tiny sentence encoders built locally (random weights, fixed seed, no download) and
saved by sentence-transformers itself in its module layout: the Hugging Face model at
the root, then 1_Pooling/, optional Dense and Normalize folders, prompts in
config_sentence_transformers.json.

BERT-family models reuse the bundled MiniLM's WordPiece tokenizer; RoBERTa,
XLM-RoBERTa and MPNet get a small byte-level BPE one with fairseq's special-token order
(<s>=0, <pad>=1, </s>=2), so that padding_idx + 1 numbering is exercised as in the
real checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HIDDEN = 32
MAX_SEQ = 48  # sentence-transformers' max_seq_length for every tiny model
# What the family tests encode and score: multilingual, one very short, one long.
TEXTS = [
    "A man is eating food.",
    "Nuclear fusion powers the sun, turning hydrogen into helium.",
    "¿Dónde está la estación de tren?",
    "hi",
    "the quick brown fox jumps over the lazy dog " * 3,
]
PAIRS = [
    ("what powers the sun?", "Nuclear fusion powers the sun, turning hydrogen into helium."),
    ("what powers the sun?", "A man is eating food."),
    ("¿Dónde está la estación de tren?", "the quick brown fox jumps over the lazy dog"),
    ("hi", "hi"),
    ("a longer query about the lazy dog and the quick fox", "dog " * 12),
]
_BPE_TEXT = ["the quick brown fox jumps over the lazy dog", "query: passage: a b c",
             "Nuclear fusion powers the sun", "¿Dónde está la estación de tren?"]  # fmt: skip


def _roberta_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_BPE_TEXT * 20, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    fast = RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(str(out))


def _hf_model(family: str, out: Path, seed: int, num_labels: int = 0):
    """A tiny `family` ("bert" | "roberta" | "xlm-roberta" | "mpnet" | "modernbert")
    model saved to `out`;
    with `num_labels`, its *ForSequenceClassification (a cross-encoder)."""
    import torch
    import transformers as tf
    from transformers import BertConfig, BertTokenizerFast, RobertaConfig, XLMRobertaConfig

    from shared.catalog import ENCODER, bundled_dir

    torch.manual_seed(seed)
    shape = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, initializer_range=0.2)
    if num_labels:
        shape["num_labels"] = num_labels
    if family == "modernbert":
        return _modernbert(out, seed, num_labels)
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta",
              "mpnet": "MPNet"}[family]
    cls_model = getattr(tf, prefix + ("ForSequenceClassification" if num_labels else "Model"))
    if family == "bert":
        model = cls_model(BertConfig(vocab_size=30522, max_position_embeddings=64, **shape))
        BertTokenizerFast.from_pretrained(str(bundled_dir(ENCODER))).save_pretrained(str(out))
    elif family == "mpnet":  # its own vocabulary does not matter: fairseq's special ids do
        cfg = tf.MPNetConfig(vocab_size=400, max_position_embeddings=64 + 2, pad_token_id=1,
                             bos_token_id=0, eos_token_id=2, **shape)
        model = cls_model(cfg)
        _roberta_tokenizer(out)
    else:
        cls_cfg = RobertaConfig if family == "roberta" else XLMRobertaConfig
        cfg = cls_cfg(vocab_size=400, max_position_embeddings=64 + 2, pad_token_id=1,
                      bos_token_id=0, eos_token_id=2, type_vocab_size=1, **shape)
        model = cls_model(cfg)
        _roberta_tokenizer(out)
    model.eval()
    model.save_pretrained(str(out))


# ModernBERT's local window: a token sees +/- 4 tokens in local layers, so most test
# texts (and every pair) are longer than the window.
MODERNBERT_LOCAL_ATTENTION = 8


def _modernbert(out: Path, seed: int, num_labels: int = 0, classifier_pooling: str = "cls",
                **overrides):
    """A tiny ModernBERT as ModernBERT-base is shaped (global attention every third
    layer, global and local RoPE bases, no biases) with 4 layers (global, local,
    local, global), its norm weights perturbed away from 1 so that each counts.
    The bundled WordPiece vocabulary, without token type ids (as ModernBERT's own
    tokenizer: the model takes none)."""
    import torch
    import transformers as tf
    from transformers import BertTokenizerFast

    from shared.catalog import ENCODER, bundled_dir

    torch.manual_seed(seed)
    kw = dict(vocab_size=30522, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, max_position_embeddings=128,
              local_attention=MODERNBERT_LOCAL_ATTENTION, global_attn_every_n_layers=3,
              global_rope_theta=160000.0, local_rope_theta=10000.0, pad_token_id=0,
              cls_token_id=101, sep_token_id=102, bos_token_id=101, eos_token_id=102,
              initializer_range=0.2, classifier_pooling=classifier_pooling) | overrides
    if num_labels:
        kw["num_labels"] = num_labels
    cls_model = tf.ModernBertForSequenceClassification if num_labels else tf.ModernBertModel
    model = cls_model(tf.ModernBertConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
    model.save_pretrained(str(out))
    BertTokenizerFast.from_pretrained(str(bundled_dir(ENCODER)),
                                      model_input_names=["input_ids", "attention_mask"]
                                      ).save_pretrained(str(out))  # fmt: skip
    return model


def build(out_dir: Path, family: str = "bert", pooling: str | tuple[str, ...] = "mean",
          dense: tuple[int, ...] = (), normalize: bool = True,
          prompts: dict[str, str] | None = None, seed: int = 0):
    """Save a tiny sentence-transformers model to `out_dir/st`; return it loaded
    back from disk (`SentenceTransformer(dir)`, the reference the tests compare with).
    `dense`: the out_features of each Dense layer (tanh, as the library's default)."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    hf, st_dir = out_dir / "hf", out_dir / "st"
    _hf_model(family, hf, seed)
    modules = [models.Transformer(str(hf), max_seq_length=MAX_SEQ)]
    modules.append(models.Pooling(HIDDEN, pooling_mode=pooling))
    width = HIDDEN * (1 if isinstance(pooling, str) else len(pooling))
    torch.manual_seed(seed + 1)
    for n in dense:
        modules.append(models.Dense(width, n, activation_function=torch.nn.Tanh()))
        width = n
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, prompts=prompts or {}, device="cpu").save(str(st_dir))
    return SentenceTransformer(str(st_dir), device="cpu")


def build_cross_encoder(out_dir: Path, family: str = "bert", num_labels: int = 1, seed: int = 0,
                        classifier_pooling: str = "cls"):
    """Save a tiny cross-encoder (reranker) to `out_dir/ce` with sentence-transformers'
    CrossEncoder; return it loaded back from disk, the reference for `score`.
    `classifier_pooling`: ModernBERT's (cls or mean)."""
    from sentence_transformers import CrossEncoder

    hf, ce_dir = out_dir / "hf", out_dir / "ce"
    if family == "modernbert":
        _modernbert(hf, seed, num_labels, classifier_pooling)
    else:
        _hf_model(family, hf, seed, num_labels=num_labels)
    CrossEncoder(str(hf), max_length=MAX_SEQ, device="cpu").save(str(ce_dir))
    return CrossEncoder(str(ce_dir), device="cpu")


def build_decoder_embedder(out_dir: Path, seed: int = 0):
    """A tiny Qwen3-Embedding-style model saved to `out_dir/st`: a Qwen3 decoder (its
    norm weights perturbed), last-token pooling, Normalize; returned loaded back from
    disk, the reference. Its BPE tokenizer pads on the right with its EOS token."""
    import json

    import torch
    import transformers as tf
    from sentence_transformers import SentenceTransformer, models

    from bench.support.tiny_tokenizer import VOCAB, write_tokenizer

    hf, st_dir = out_dir / "hf", out_dir / "st"
    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=128, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    model = tf.Qwen3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    model.save_pretrained(str(hf))
    write_tokenizer(hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "padding_side": "right",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    modules = [models.Transformer(str(hf), max_seq_length=MAX_SEQ),
               models.Pooling(HIDDEN, pooling_mode="lasttoken"), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(st_dir))
    return SentenceTransformer(str(st_dir), device="cpu")
