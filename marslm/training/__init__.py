"""Training: ``marslm train``'s recipe and what it is made of.

    config.py       TrainConfig: every option, checked once (no torch: the CLI parses fast)
    recipe.py       train(): setup -> train -> save
    collate.py      examples into padded or packed rows on the block grid
    objective.py    the two-stream batch and the losses (full and exact mode)
    head_loss.py    target-only logits, fused with the cross-entropy
    teacher.py      the starting model's top-k per answer token (soft targets)
    dataset.py      encoding, the content key, the caches
    surgery.py      what trains: the mask token, freezing, LoRA, exact mode's adapter
    trainer.py      the Hugging Face Trainer with the stage's loss, crash-safe
    checkpoints.py  complete checkpoints, partial directories, resuming, the final save

Kept light: importing ``marslm.training.config`` loads no torch.
"""
