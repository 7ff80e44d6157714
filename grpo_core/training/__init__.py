"""Training machinery shared by SFT and the RL update: the train state, optimizer and schedule,
precision, checkpoints and policy ids, LoRA, offload, and the data-parallel strategies (DDP,
FSDP2)."""
