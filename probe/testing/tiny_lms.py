"""A tiny tokenizer and tiny GPT-2, BERT and Llama models with random weights, saved locally with
save_pretrained for the token tests and benchmarks: nothing is downloaded."""

from pathlib import Path

import torch

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "hat",
    "big",
    "red",
    "small",
    "blue",
    "and",
    "then",
    "it",
    "was",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
]
SPECIALS = ["[PAD]", "[UNK]", "[EOS]", "[BOS]"]


def make_tokenizer(dir, specials: bool = False) -> Path:
    """A whitespace WordLevel tokenizer (ids: [PAD]=0 [UNK]=1 [EOS]=2 [BOS]=3, then WORDS) saved with
    save_pretrained into `dir`; `specials=True` makes it wrap each text in [BOS] ... [EOS] the way
    BERT wraps in [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 3), ("[EOS]", 2)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="[EOS]",
        bos_token="[BOS]",
    )
    dir = Path(dir)
    fast.save_pretrained(dir)
    return dir


def tiny_config(kind: str, vocab_size: int):
    """A 2-layer width-32 config of one family: gpt2, bert or llama; pad id 0 and BOS/EOS id 2
    (the [PAD] and [EOS] of make_tokenizer)."""
    from transformers import BertConfig, GPT2Config, LlamaConfig

    eos = 2 if vocab_size > 2 else None
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_layer=2, n_embd=32, n_head=2, n_positions=512,
            bos_token_id=eos, eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
    if kind == "bert":
        return BertConfig(
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=512, pad_token_id=0,
        )  # fmt: skip
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip


TASK_CLASSES = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "llama": "LlamaForCausalLM"}


def make_tiny(kind: str, dir, vocab_size: int = 100) -> Path:
    """A tiny model of `tiny_config(kind)` with its LM head and seeded random weights (the global
    random state untouched), saved with save_pretrained into `dir`."""
    import transformers

    cls = getattr(transformers, TASK_CLASSES[kind])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = cls(tiny_config(kind, vocab_size))
    dir = Path(dir)
    model.save_pretrained(dir)
    return dir


def make_tiny_gpt2(dir, vocab_size: int) -> Path:
    """A 2-layer width-32 GPT2LMHeadModel saved into `dir` (see make_tiny)."""
    return make_tiny("gpt2", dir, vocab_size)
