"""Write a random-weight Llama of a chosen size, with the default model's tokenizer, as an HF directory.

    python -m benchmarks.random_llama DIR [--size 1b] [--dtype bfloat16]

For speed and memory measurements of models larger than the embedded one without downloading
anything: the weights are random (outputs are noise, but the shapes, FLOPs and bytes are those of
a real model), the tokenizer is SmolLM2's, read from the embedded GGUF.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

# Llama shapes (TinyLlama-1.1B / Llama-3.2-1B-like) over SmolLM2's 49152-token vocabulary.
SIZES = {
    "1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    ),
    "3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8
    ),
}


def save_random_llama(path: str, size: str = "1b", dtype: str = "bfloat16", seed: int = 0) -> str:
    import transformers

    from services.common.default_model import default_model_path

    directory, name = os.path.split(default_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--size", default="1b", choices=sorted(SIZES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    save_random_llama(args.path, args.size, args.dtype)
    print(f"wrote a random {args.size} Llama to {args.path}")


if __name__ == "__main__":
    main()
