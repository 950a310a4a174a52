"""Build a small random-weight causal LM folder that loads through the real Hugging Face path.

No weights can be downloaded on the build machines, so tests and benchmarks make their own model:
a Llama architecture with random weights and a byte-level BPE tokenizer trained here, offline, on
phrases generated from a word list written for this project. The folder it writes is an ordinary
Hugging Face model folder (``config.json``, ``model.safetensors``, ``tokenizer.json``, a chat
template), so :class:`models.hf_causal.HFCausalLM` loads it exactly as it would load a real model.

Its answers are random text: it exists to exercise loading, batching, padding, stopping, logprobs
and timing, never to answer anyone.

Called by test fixtures (the default ~1M-parameter model, built and loaded in well under 2 s) and by
the batching benchmark (``params_target=50_000_000``).
"""

from __future__ import annotations

import random
from pathlib import Path

#: special tokens, in id order (ids 0..len-1)
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|unk|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)

#: a plain chat template: one ``<|role|>`` line per message, then the assistant's turn
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Words written for this project (generic English and everyday banking vocabulary); the training
# corpus is random sentences over them, so the tokenizer learns merges for common sub-words.
_WORDS = (
    "the a an my your our this that these those it they we you he she i me us them "
    "is are was were be been has have had do does did can could will would should may might must "
    "not no never always often sometimes now today yesterday tomorrow soon later again still "
    "please thanks hello sorry help why how what when where which who whose "
    "card account balance transfer payment money cash fee rate limit pin code phone app online "
    "bank branch loan credit debit savings deposit withdraw withdrawal refund charge statement "
    "open close lock unlock enable disable increase decrease buy sell send receive pay check "
    "new old lost stolen blocked pending failed declined approved expired wrong right same different "
    "week month year day hour minute number amount address name email message letter order "
    "and or but if because so then than with without from into onto over under about after before "
    "to of in on at for by up down out off between through during "
    "want need know think see get make take give find tell ask use work try call change move "
    "travel abroad home office shop store price cost value total small large quick slow "
    "one two three four five ten twenty hundred thousand first second last next "
    "euro dollar pound yen currency exchange country city street house car train ticket"
).split()

_PUNCT = (".", "?", "!", ",")


def _corpus(seed: int, n_sentences: int = 4000) -> list[str]:
    """Random sentences over :data:`_WORDS`, with numbers and punctuation; deterministic per seed."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_sentences):
        n = rng.randint(3, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        if rng.random() < 0.5:
            sentence = sentence.capitalize()
        lines.append(sentence + rng.choice(_PUNCT))
    return lines


def build_tokenizer(vocab_size: int = 1024, *, seed: int = 0):  # -> PreTrainedTokenizerFast
    """Train a byte-level BPE tokenizer offline and wrap it with the chat template.

    Byte-level: every string encodes (no unknown tokens). The vocabulary holds the 256 byte symbols,
    :data:`SPECIAL_TOKENS` and as many merges as the generated corpus supports, up to ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        padding_side="left",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama_params(vocab: int, hidden: int, inter: int, layers: int) -> int:
    """Parameter count of a Llama model with untied embeddings and full (non-grouped) attention."""
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def _shape_for_target(vocab: int, params_target: int) -> tuple[int, int, int]:
    """(hidden, intermediate, layers) whose count is close to ``params_target``, with at most 24 layers."""
    for hidden in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048):
        inter = hidden * 11 // 4
        if _llama_params(vocab, hidden, inter, 24) >= params_target:
            break
    per_layer = _llama_params(vocab, hidden, inter, 1) - _llama_params(vocab, hidden, inter, 0)
    layers = max(1, round((params_target - _llama_params(vocab, hidden, inter, 0)) / per_layer))
    return hidden, inter, layers


def build_tiny_causal_lm(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    layers: int = 4,
    seed: int = 0,
    params_target: int | None = None,
) -> Path:
    """Write a random-weight Llama causal LM and its tokenizer to ``out_dir``; return the folder.

    With ``params_target`` the width and depth are chosen to come close to that many parameters
    (``hidden_size`` and ``layers`` are then ignored); the actual count is in ``config.json`` under
    ``surge_num_parameters``. Weights are drawn from ``seed``, so the same arguments give the same
    model. Nothing is downloaded.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, seed=seed)
    vocab = len(tokenizer)
    if params_target is not None:
        hidden_size, inter, layers = _shape_for_target(vocab, params_target)
    else:
        inter = hidden_size * 2
    heads = max(1, hidden_size // 32)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    model.config.surge_num_parameters = n_params
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
