"""Shared test settings: a pipeline budget that runs in seconds."""

TINY_OVERRIDES = [
    "data.demo.n_sft=64",
    "data.demo.n_rl=128",
    "data.demo.n_dev=8",
    "data.demo.n_eval=16",
    "model.demo={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, intermediate_size: 64}",
    "sft.max_steps=30",
    "sft.batch_size=16",
    "sft.target_accuracy=null",
    "rl.iterations=2",
    "rl.prompts_per_iteration=4",
    "rl.num_generations=4",
    "rl.steps_per_generation=2",
    "rl.max_completion_length=16",
    "rl.eval_every=1",
    "rejection_sampling.num_prompts=8",
    "rejection_sampling.require=[]",
    "rejection_sampling.max_completion_length=16",
    "re_sft.max_steps=3",
    "rl_2={iterations: 1}",
    "eval.max_completion_length=16",
]

# configs/demo-tools.yaml at the same budget (the tool demo: multiplication with the python tool)
TOOL_TINY_OVERRIDES = [
    "data.multiply={n_sft: 64, n_rl: 128, n_dev: 0, n_eval: 8, tools: true}",
    "model.demo={hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
    "intermediate_size: 64, vocabulary: tools}",
    "sft.max_steps=20",
    "sft.batch_size=16",
    "sft.target_accuracy=null",
    "rl.iterations=2",
    "rl.prompts_per_iteration=4",
    "rl.num_generations=4",
    "rl.steps_per_generation=2",
    "rl.eval_every=1",
    "rejection_sampling.num_prompts=4",
    "rejection_sampling.require=[]",
    "re_sft.max_steps=2",
    "rl_2={iterations: 1}",
]
