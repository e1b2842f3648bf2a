"""Analytical step time and peak memory per sequence strategy, projected to the paper's
settings (16 H200 = 2 nodes x 8, 8B- and 27B-class dense models and a 30B-A3B-class mixture
of experts, 128K-1M tokens), and DFlash drafter training on 8 H100 (one node). A plain model,
not a simulator; `experiments/cost_model.py` runs it. By concern:

  setting     every constant: `Hardware`, `Assumptions`, the scenarios, the models
  work        per plan and rank: the (query, key) pairs split by whose K/V they read (their
              sum per rank is `LayoutPlan.attention_work()`), the bytes the transports send
              (`analysis.step_report.attention_traffic`, per layer kind), FLOPs and parameters
              (`bdlm_jax.metrics`: an MoE computes with its *active* parameters, its memory
              holds the *total*)
  timing      FLOPs at achieved TFLOP/s + an alpha-beta network (NVLink inside a node,
              InfiniBand across); rings timed step by step, all-gathers and an MoE's token
              exchange exposed; a local layer of window W on the transport `window_transport`
              picks; `model.remat=offload`'s host copies, exposed where they outlast a layer
  memory      compiled where experiments/scale_probe.py ran, else assumed; what remat saves
              per layer (`saved_layer_bytes`), on the device or, offloaded, on the host
  projection  every (model, L, B, strategy, scenario), and CSBP's speedup over the baselines;
              remat full against offload, and the strong-scaling sweep over GPU counts
  dflash      the drafter's step over a frozen target
  report      the markdown
"""
