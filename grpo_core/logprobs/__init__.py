"""Per-token log-probs and entropies: from logits (``tokens.py``), from hidden states through the
LM head in chunks (``lm_head.py``, ``model.py``), of a batch's completions (``batch.py``), and
where the update's old log-probs come from (``old.py``)."""
