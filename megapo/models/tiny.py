"""A tiny random-weight model with its own tokenizer, in Hugging Face layout (the command:
megapo/commands/tiny_model.py).

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small built-in corpus
(digits always split one per token, as Qwen's tokenizer does, so arithmetic tasks stay learnable),
and the weights come from transformers' own initialisation with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "question: what is the sum of two numbers? answer: the sum is",
    "mixture of experts models route each token to a few experts",
    "reinforcement learning from verifiable rewards improves reasoning",
    "user assistant system you are a helpful assistant",
    "add subtract multiply divide equals plus minus times",
    "0123456789 + - * / = ( ) . , : ? ! \n",
]


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer of exactly `vocab_size` entries (or fewer merges if the corpus runs out)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )


def tiny_families() -> tuple[str, ...]:
    """The families with a tiny model (Family.tiny), from the one registry."""
    from megapo.models.family import families_where

    return families_where(lambda f: f.tiny is not None)


def _tiny_module(family: str):
    import importlib

    from megapo.models.family import family_named

    return importlib.import_module(family_named(family).tiny)


def build_config(family: str, *, vocab_size: int, hidden: int, layers: int, experts: int, topk: int,
                 heads: int, kv_heads: int, head_dim: int, ffn: int, moe_ffn: int, eos_id: int, pad_id: int,
                 max_positions: int = 512):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    if family not in tiny_families():
        raise ValueError(f"family must be one of {tiny_families()}, got {family!r}")
    return _tiny_module(family).config(common, layers=layers, experts=experts, topk=topk, hidden=hidden,
                                       head_dim=head_dim, ffn=ffn, moe_ffn=moe_ffn)


HEADS = ("lm", "score")  # a causal LM, or a one-label *ForSequenceClassification (a reward model)


def write_tiny_model(out: str | Path, family: str = "qwen3_moe", *, layers: int = 2, experts: int = 8, topk: int = 2,
                     hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, ffn: int = 128,
                     moe_ffn: int = 128, vocab: int = 512, seed: int = 0, init_std: float = 0.02,
                     head: str = "lm") -> Path:
    """Write config.json, model.safetensors and tokenizer files to `out`; return the folder. head="score": the
    family's *ForSequenceClassification with num_labels=1 (score.weight [1, hidden]) instead of its causal LM."""
    import torch

    if family not in tiny_families():
        raise ValueError(f"--family must be one of {', '.join(tiny_families())}, got {family!r}")
    if head not in HEADS:
        raise ValueError(f"--head must be one of {', '.join(HEADS)}, got {head!r}")
    if family != "qwen2" and not 1 <= topk <= experts:
        raise ValueError(f"--topk must be between 1 and --experts ({experts}), got {topk}")
    if vocab < 300:
        raise ValueError(f"--vocab must be >= 300 (256 byte symbols + specials + merges), got {vocab}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab)
    config = build_config(
        family, vocab_size=vocab, hidden=hidden, layers=layers, experts=experts, topk=topk, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, moe_ffn=moe_ffn,
        eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_id=tokenizer.pad_token_id)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = _model_with_head(config, family, head)
    finish = getattr(_tiny_module(family), "finish", None)  # weights transformers initialises to 0 or 1
    if finish is not None:
        finish(model, torch.Generator().manual_seed(seed))
    if head == "lm":
        model.generation_config.do_sample = True
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _model_with_head(config, family: str, head: str):
    """transformers' model of `config` with an LM head or a one-label score head (its AutoModel classes decide
    which families have one)."""
    import torch
    import transformers

    if head == "lm":
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    from megapo.models.family import family_named

    if family_named(family).score_rules is None:
        raise ValueError(f"--head score: family {family!r} has no score head in megapo")
    config.num_labels = 1
    try:
        return transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    except ValueError as err:  # transformers has no *ForSequenceClassification for this model_type
        raise ValueError(f"--head score: transformers {transformers.__version__} has no sequence-classification "
                         f"model for family {family!r} ({err})") from None
