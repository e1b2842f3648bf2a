"""DFlash2, the seed paper's Muse-Glimmer-30B recipe (docs/dflash.md, "DFlash2"): the
Muse-Glimmer-30B-DFlash2 drafter (5 layers, every one sliding-window, W = 2048, width 6656,
block convolutions, the candidate selector, D-PACE weights with the LK lambda loss) trained on
the verifier's features read from disk, on 8 devices laid out as the seed lays them out: two
data-parallel groups of 4 (`parallel.data=2`, `parallel.seq=4`: the seed's CP 4 / BP 4 on one
axis of 4, DP 2), each training one 1,048,576-token sequence a step under context-sharded
block parallelism (csbp_ring), bf16 weights under AdamW, no activation checkpointing.

  python run.py --config configs/dflash2_muse_1m.py --set mode=plan

`mode=plan` compiles the step (never runs it) with XLA:TPU ahead of time for 8 TPU v5p chips
(`plan.target`; `pip install -r requirements-tpu.txt`, no TPU) under every strategy and prints
each one's per-device peak. experiments/recipe_plans.py compiles this recipe and our variant
of it (one 8-way `seq` axis, f32 master weights, full remat:
`--set parallel.seq=8 parallel.data=1 train.batch_size=1 model.param_dtype=float32
model.remat=full`) and writes the figures docs/dflash.md quotes. It needs no features: the
batch is abstract.

Features from disk (the seed's `target_features: offline`): `drafter.features` names a folder
in the layout of bdlm_jax/data/features.py (tokens, segment ids, protected flags and the
verifier's hidden states, the outputs of its layers 1, 13, 25, 37, 49, of every position,
bf16: 1M x 5 x 6656 x 2 B = 70 GB a sequence), as experiments/dflash_features.py writes it
(that script runs the verifier through this package, so only for a verifier it can import).
The step reads them from the batch (`Batch.context`, each rank its own context rows), the
verifier's layers are neither loaded nor run (`params.py`: the target keeps only the
embedding, final norm and LM head the drafter shares), so nothing of the target's forward is
in the step. To train, point `drafter.target` at the verifier's Hugging Face folder (for that
embedding and head) and `drafter.features` at the folder.

Context pruning as the seed's: each rank keeps only the context rows inside the union of the
anchors' windows, each cut at its document's start (`drafter.kept_context_rows` of its
262,144), before `fc`. The verifier's
`output_multiplier` (0.19612, `model.output_multiplier`) scales its head's logits before the
soft cap everywhere the drafter's losses read them (the CE, p, D-PACE's weights, the LK lambda
and the selector's candidates and unary scores), as the seed's streamed head pass does.

Where this differs from the seed's run: the seed's CP 4 / BP 4 rank runs its own `dual_end`
block placement and transports (here csbp_ring's zigzag and `parallel.draft_transport`),
and its packets are sized per step (here `drafter.kept_context_rows` rows a rank, or for a
batch whose windows reach more, the first doubling that holds them, compiled once more:
docs/dflash.md, context pruning).
"""

from bdlm_jax.config import (Config, DataConfig, DrafterConfig, ModelConfig, ObjectiveConfig,
                             ParallelConfig, PlanConfig, TrainConfig)

# The seed: Turbo-dLLM 0.1.6 (`pip download turbo-dllm==0.1.6 --no-deps`); RECIPE is its
# dllm_parallel/recipes/runs/dflash2-muse-glimmer-30b-1m.yaml (the GitHub repository's
# benchmarks/recipes/dflash2_*.yaml), line numbers of that file. CKPT: the widths are in
# neither the wheel nor the recipe but in the checkpoints' Hugging Face configs (RECIPE lines
# 8-11: incoai/Muse-Glimmer-30B-DFlash2 @ 8336acb8, verifier meta-models/Muse-Glimmer-30B @
# a4e59da5), which the seed loads at run time: 5 layers, all sliding, W 2048, H 6656, I 19968,
# 32 / 8 heads x 128, vocabulary 202,048, fc 33,280 -> 6,656, rope 5e5, conv taps 2 / group
# 16, selector rank 256 / top-K 16, softcap 20 (docs/dflash.md, "The Muse recipe compiled";
# the same numbers as analysis/cost_model/dflash.py's DFLASH2_RECIPES["muse-glimmer-30b"]).

# The verifier (the frozen target): only its width, vocabulary and head matter here (its layers
# are replaced by the features); its depth need only reach layer 49 (RECIPE line 13's
# canonical id 50, see `target_layers`), and its d_ff is unused. Width 6656: the drafter's
# `fc` maps 5 x 6656 = 33,280 -> 6,656 (CKPT).
MUSE_GLIMMER_30B = dict(
    vocab_size=202048,  # CKPT: vocabulary 202,048
    d_model=6656,  # CKPT: H 6656 (and fc 33,280 = 5 target layers x 6656)
    n_layers=50,  # reaches target layer 49 (RECIPE line 13); the verifier's own depth unused
    n_heads=32, n_kv_heads=8, head_dim=128,  # CKPT: 32 / 8 heads x 128
    d_ff=19968,  # CKPT: I 19968 (the drafter's; the verifier's MLPs never run)
    rope_theta=5e5,  # CKPT: rope 5e5
    qk_norm=True, tie_embeddings=False,  # as DFLASH2_RECIPES (the drafter is Qwen3-style)
    # The frozen head's output_multiplier and final_logit_softcapping, which the seed's
    # streamed CE / top-K pass applies in that order, cap * tanh(m * logits / cap)
    # (core/kernels/dflash_linear_topk.py ~126-147, core/models/backbones/dflash/dflash2.py
    # ~596-604; CKPT: 0.19612 and 20).
    output_multiplier=0.19612,
    logit_softcap=20.0)


def get_config() -> Config:
  return Config(
      # RECIPE line 15 `dtype: bf16`: the seed casts the model to bf16 and trains it under
      # torch's fused AdamW (RECIPE line 43; dflash/executor.py ~256), whose moments take the
      # weights' dtype: so bf16 weights here, and optax's AdamW keeps its moments in bf16 too.
      # RECIPE line 38 `activation_checkpointing: false`: no remat. The loss in 1024-row
      # chunks and 512-row attention tiles are how this package streams them (the seed's
      # head pass streams its vocabulary in 16,384-column blocks, RECIPE line 29).
      model=ModelConfig(**MUSE_GLIMMER_30B, param_dtype="bfloat16", compute_dtype="bfloat16",
                        remat="none", attention_chunk=512, logits_chunk=1024),
      drafter=DrafterConfig(
          target="",  # the verifier's Hugging Face folder, for its embedding and LM head
          n_layers=5,  # CKPT: 5 layers
          n_heads=32, n_kv_heads=8, head_dim=128, d_ff=19968,  # CKPT
          # RECIPE line 13 `target_layer_ids: [2, 14, 26, 38, 50]` are the seed's canonical
          # ids, Hugging Face's hidden_states[i] (dflash/model.py ~274-285: a published
          # config's `dflash_config.target_layer_ids` + 1; feature_capture.py ~228-283 hands
          # the capture ids, canonical - 1, to the verifier): the outputs of layers 1, 13, 25,
          # 37, 49, which `drafter.target_layers` names 0-based (hidden_states[i + 1]).
          target_layers="1,13,25,37,49",
          # RECIPE lines 32-33: `target_features: offline`, `target_feature_path:
          # /data/dflash-features` (write ours there with experiments/dflash_features.py).
          features="/data/dflash-features",
          conv_taps=2, conv_group_size=16,  # CKPT: Muse taps 2, group size 16
          window=2048,  # CKPT: every layer sliding, W = 2048
          # ASSUMED: the seed's default, a causal draft block on sliding layers
          # (core/models/backbones/dflash/model.py ~364-366, ~1233-1255: causal unless the
          # drafter's config sets sliding_window_non_causal / is_causal=false /
          # dflash_config.causal=false). Muse's value is in its checkpoint's config, which is
          # in neither the wheel nor the recipe: unverified.
          sliding_causal=True,
          # Context pruning (the seed's ~10.2K rows): 512 locality anchors 16 candidates apart
          # (17 where 16 is not coprime with their count) reach 511 x 16 + 2047 = 10,223 rows
          # (10,734), up to 12,764 where the run wraps to the sequence's start (both zigzag
          # ends are rank 0's); 26 attention chunks of 512 hold that. A batch whose windows
          # reach more (anchors spread by documents or protected tokens) gets a wider step.
          kept_context_rows=13312),
      data=DataConfig(seq_len=1 << 20),  # RECIPE line 14 `seq_len: 1048576`
      objective=ObjectiveConfig(
          name="dflash",  # RECIPE line 17 `dflash_distillation`
          block_size=16,  # RECIPE line 18
          max_anchors=512,  # RECIPE line 19
          anchors="locality",  # RECIPE line 20 `anchor_sampling: locality`
          dflash_loss="dpace",  # RECIPE line 22
          gamma=7.0,  # RECIPE line 23 `decay_gamma`
          dpace_alpha=0.5,  # RECIPE line 24
          lk_loss="lambda", kl_scale=1.0, kl_decay=1.0,  # RECIPE lines 25-27
          selector_loss_alpha=1.0,  # RECIPE line 28
          selector_rank=256, selector_top_k=16,  # CKPT: Muse r = 256, top-K = 16
          # ASSUMED: the drafter's mask_token_id is in its checkpoint's config (the seed reads
          # it there, core/models/backbones/dflash/model.py ~267-271), not in the wheel; the
          # last id keeps any real token out of it.
          mask_token_id=202047),
      # RECIPE line 1: 8 GPUs; lines 40-41: CP 4, BP 4, which the seed runs on one axis of
      # max(CP, BP) = 4 ranks (core/parallel/runtime.py ~988-989, `_local_parallel_size`),
      # the other factor 2 data-parallel (training/token_accounting.py ~24-41).
      parallel=ParallelConfig(strategy="csbp_ring", seq=4, data=2),
      # RECIPE lines 35-37, 43-45: batch 1 a data-parallel rank (2 a step: the seed's global
      # batch is micro batch x accumulation x DP), no accumulation, lr 1e-6, clip 1.0; the seed's
      # defaults (training/run_spec.py ~157-176): Adam eps 1e-5, weight decay 0.01 on every
      # parameter (one parameter group), a constant schedule with no warmup (min_lr_ratio 1),
      # betas (0.9, 0.999). Checkpoints every 100 steps, the last 3 (RECIPE lines 48-49). No
      # held-out evaluation: the features hold training sequences only.
      train=TrainConfig(steps=1000, batch_size=2, grad_accum=1, lr=1e-6, warmup_steps=0,
                        min_lr_ratio=1.0, weight_decay=0.01, decay_vectors=True, b1=0.9,
                        b2=0.999, eps=1e-5, grad_clip=1.0, log_every=1, ckpt_every=100,
                        max_to_keep=3, eval_every=0),
      plan=PlanConfig(target="tpu:v5p:2x2x2"),  # 8 TPU v5p chips, 95.74 GiB each
      seed=2026,  # RECIPE line 6 (`launch.seed`)
  )
