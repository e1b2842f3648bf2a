"""A tiny random Hugging Face Llama (or Qwen3) folder, the stand-in for a hub checkpoint in
AR -> BDLM conversion runs on machines without a hub download (configs/convert_tiny.py),
and a chat JSONL of arithmetic questions for its SFT data.

  python experiments/make_tiny_hf.py --out runs/tiny_hf --chat-out runs/tiny_chat.jsonl
  python experiments/make_tiny_hf.py --out runs/tiny_qwen3_hf --model-type qwen3

Needs torch and transformers. The shapes match configs/convert_tiny.py; the vocabulary is
the byte tokenizer's (256 bytes + BOS, EOS, PAD, MASK = 259).
"""

import argparse
import json
import os

import torch
import transformers

SHAPES = dict(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=192, rope_theta=10000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
              pad_token_id=258)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}


def write_chat(path: str, n_records: int, seed: int) -> None:
  """{"messages": [user "a+b=", assistant "c"]} records: the conversations that
  `data.source=arithmetic` with `data.format=chat` trains on, written out."""
  from bdlm_jax.data.chat import ArithmeticChatSource
  source = ArithmeticChatSource(seed, "train", template="plain")
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    for i in range(n_records):
      f.write(json.dumps(dict(messages=source.messages(i))) + "\n")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="runs/tiny_hf", help="folder to write")
  parser.add_argument("--model-type", choices=sorted(CONFIGS), default="llama")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chat-out", default="", help="also write an SFT chat JSONL here")
  parser.add_argument("--chat-records", type=int, default=5000)
  args = parser.parse_args()
  if args.chat_out:
    write_chat(args.chat_out, args.chat_records, args.seed)
    print(f"wrote {args.chat_records} chat records to {args.chat_out}")
  torch.manual_seed(args.seed)
  model = transformers.AutoModelForCausalLM.from_config(CONFIGS[args.model_type](**SHAPES))
  model.save_pretrained(args.out)
  n = sum(p.numel() for p in model.parameters())
  print(f"wrote a random {args.model_type} with {n} parameters to {args.out}")


if __name__ == "__main__":
  main()
