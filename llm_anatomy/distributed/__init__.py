"""Data-parallel training (DDP, FSDP2), tensor parallel on a (dp, tp) mesh, and their cost model.

    strategies   wrap(model, "ddp" | "fsdp", ...), init_distributed(backend, timeout_s)
    train_step   a few training steps under torchrun (python -m llm_anatomy.distributed.train_step)
    counting     CollectiveCounter (what the process group did), rank_memory (what a rank holds)
    peak         each rank's live storage over a step (settled.spawn_peaks): the measured side of per_rank_peak
    simulate     one rank of 8..1024 with the fake process group and fake tensors
    report       memory_table(): per-rank bytes of a preset, as markdown
    tensor_parallel  build_mesh(dp, tp), parallelize(model, mesh): TP + SP on DTensor, FSDP2 over dp
    mesh_step    a few steps on a (dp, tp) mesh under torchrun; spawn() and simulate() (the fake process group)
    tp_saved     LocalSavedTracer: what each TP rank saves for backward, by its local shards

The predictions are pure Python, in llm_anatomy.calculator.comm (estimate_distributed, re-exported
here, render_distributed), llm_anatomy.calculator.sharding (per_rank_memory, per_rank_peak) and
llm_anatomy.calculator.tensor_parallel (tp_rank_memory, tp_collectives, tp_saved). Importing this package does
not import torch.
"""
from llm_anatomy.calculator.comm import estimate_distributed

__all__ = ["estimate_distributed"]
