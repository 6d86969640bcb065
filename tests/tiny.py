"""Tiny random Hugging Face checkpoints (model + byte-level BPE tokenizer) written to disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as hf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ARCHS = {
    "llama": (hf.LlamaConfig, hf.LlamaForCausalLM),
    "mistral": (hf.MistralConfig, hf.MistralForCausalLM),
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM),
    "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIALS = ["<s>", "</s>", "<pad>"]
BOS, EOS = 0, 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny tokenizer for tests.",
    "Once upon a time there was a small language model that decoded one token at a time.",
    "def main():\n    print('hello')\n",
    "<|user|>\nWhat is the capital of France?\n<|assistant|>\nParis.\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ~!@#$%^&*()_+-=[]{};:'\",.<>/?",
]
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def make_tiny_model(
    dir: str | Path,
    arch: str,
    *,
    tied: bool,
    heads: int,
    kv_heads: int,
    dtype: str = "float32",
    llama3_scaling: bool = False,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 320,
    head_dim: int = 16,
    intermediate: int = 96,
    seed: int = 0,
) -> Path:
    """Write a random `arch` checkpoint (safetensors, config.json) and tokenizer files into dir.

    The weights depend only on the sizes and seed, never on dtype: the model is built in float32
    and cast, so a bfloat16 checkpoint holds the rounded weights of the float32 one.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    conf_cls, model_cls = ARCHS[arch]
    theta = 1e6 if arch.startswith("qwen") else 10000.0
    rope = {"rope_type": "default", "rope_theta": theta}
    if llama3_scaling:
        rope = {"rope_type": "llama3", "rope_theta": theta, **LLAMA3_ROPE}
    extra = {"attention_bias": True} if arch == "qwen2" else {}
    conf = conf_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.15,
        tie_word_embeddings=tied,
        rope_parameters=rope,
        bos_token_id=BOS,
        eos_token_id=EOS,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(conf).eval()
    _perturb(model, seed)
    model.to(DTYPES[dtype]).save_pretrained(dir, safe_serialization=True)
    _write_tokenizer(dir, vocab)
    return dir


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases start at 1 and 0; make them random so a transposed or missing one shows."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _write_tokenizer(dir: Path, vocab: int) -> None:
    n = min(vocab, 300)
    if n < 256 + len(SPECIALS):
        raise ValueError(f"vocab {vocab} is too small for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.save(str(dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS],
        "eos_token": SPECIALS[EOS],
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
