"""AR -> BDLM conversion, tiny: a Hugging Face Llama initialises a BDLM that is then
fine-tuned with the block diffusion objective; a 2-core CPU runs it in a few minutes.

  python experiments/make_tiny_hf.py --out runs/tiny_hf --chat-out runs/tiny_chat.jsonl
  python run.py --config configs/convert_tiny.py
  python run.py --config configs/convert_tiny.py --set mode=export \
      --set export.out_dir=runs/convert_tiny_hf                # back to a transformers folder

For a real checkpoint, point `init_from` at its folder and copy its shapes into `model`
(`bdlm_jax.import_hf(path)` returns a Config holding them, with a [MASK] id no text encodes
to and, if it had to add a row for it, the larger vocab_size). The SFT data are chat
records ("12+7=" -> "19") in the plain template with the byte tokenizer; prompts stay clean
and out of the loss, responses are trained with the Fast-dLLM v2 objective (shifted logits,
complementary masks).
"""

from bdlm_jax.config import Config, DataConfig, ModelConfig, ObjectiveConfig, TrainConfig


def get_config() -> Config:
  return Config(
      init_from="runs/tiny_hf",
      model=ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192, rope_theta=10000.0, norm_eps=1e-6,
                        tie_embeddings=True),
      data=DataConfig(source="jsonl", path="runs/tiny_chat.jsonl", format="chat", seq_len=64),
      objective=ObjectiveConfig(name="fast_dllm_v2", block_size=8, mask_token_id=259),
      train=TrainConfig(steps=100, batch_size=8, lr=1e-3, warmup_steps=10, log_every=10,
                        ckpt_every=50),
  )
