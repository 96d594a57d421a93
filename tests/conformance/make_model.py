"""Make the conformance lane's tiny model: a random-weight Qwen2 and a BPE tokenizer.

Run by tools/conformance.sh with the conformance virtualenv's Python (``transformers``,
``tokenizers`` and ``torch`` as pinned in tools/conformance-requirements.txt), offline: the
tokenizer is trained here on text this script writes, the weights are drawn from a fixed
seed, nothing comes from a hub. It prints the model's directory; a directory made by the
same recipe (this file and the three pins) is reused.

The shape is Qwen2's, small: 2 layers, hidden 64, 2 attention heads over 1 KV head (head
dim 32, the smallest vLLM's CPU attention takes), a native window
(``max_position_embeddings``) of 32768 like Qwen2.5-7B-Instruct's, so the ``vllm`` role's
ladder for that model applies unchanged, and a RoPE base (``rope_theta``) of 250000, not a
default of any Qwen release, so a YaRN override that drops the model's RoPE settings can be
told from one that carries them. KV cache per token at 16 bits: 2 x 2 layers x 1 head x 32 x
2 bytes = 256 bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

RECIPE = {
    "architecture": "Qwen2ForCausalLM",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32768,
    "rope_theta": 250000.0,
    "vocab_target": 512,
    "seed": 20261204,
}
# ChatML, as the Qwen2.5 models' templates write it (system, user, assistant turns).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    """Plain English lines for the BPE merges: the words the checks send, and more."""
    text = (
        "the card is shared between a language model an image job and a media server "
        "ping hello world agents ask for tools and long contexts the arbiter decides who "
        "holds the memory the proxy waits patiently while the model starts count to ten "
        "one two three four five six seven eight nine ten tell me a story about a robot"
    )
    words = text.split(" ")
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + k) % len(words)] for k in range(12)))
    return lines


def recipe_hash() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for dist in ("transformers", "tokenizers", "torch"):
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:16]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_target"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=RECIPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(RECIPE["seed"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": RECIPE["rope_theta"]},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        dtype="bfloat16",
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    theta = (saved.get("rope_parameters") or {}).get("rope_theta", saved.get("rope_theta"))
    if theta != RECIPE["rope_theta"]:
        raise SystemExit(f"make_model: config.json carries rope_theta {theta!r}, not the recipe's")
    (out / "RECIPE.json").write_text(json.dumps(RECIPE, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="directory of made models")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = args.cache / f"qwen2-tiny-{recipe_hash()}"
    if not (target / "RECIPE.json").exists():
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        build(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        print(f"make_model: made {target}", file=sys.stderr)
    print(target.resolve())


if __name__ == "__main__":
    main()
