import torch

from grpo_core.contracts.text import encode_prompt
from grpo_core.engines.generation import SamplingParams, generate


def _prompts(tok, pairs):
    return [encode_prompt(tok, [{"role": "user", "content": f"{a}+{b}"}]) for a, b in pairs]


def test_logprobs_match_a_full_forward_under_left_padding(tiny_model):
    model, tok = tiny_model
    ids = _prompts(tok, [(1, 2), (123, 4567), (99, 1)])  # different prompt lengths
    samples = generate(
        model,
        ids,
        SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=0),
        pad_token_id=tok.pad_token_id,
        eos_token_ids=tok.eos_token_id,
        progress=False,
    )
    assert len(samples) == 9
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, i) for p in range(3) for i in range(3)
    ]
    for s in samples:
        seq = torch.tensor([ids[s.prompt_index] + s.completion_ids])
        with torch.no_grad():
            logp = model(seq).logits[0].float().log_softmax(-1)
        P = len(ids[s.prompt_index])
        expected = [logp[P - 1 + j, t].item() for j, t in enumerate(s.completion_ids)]
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(expected), atol=1e-4)


def test_finish_reason_and_eos(tiny_model):
    model, tok = tiny_model
    samples = generate(
        model,
        _prompts(tok, [(5, 6)] * 4),
        SamplingParams(n=4, max_new_tokens=6, seed=1),
        pad_token_id=tok.pad_token_id,
        eos_token_ids=tok.eos_token_id,
        progress=False,
    )
    for s in samples:
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in s.completion_ids[:-1]
        else:
            assert len(s.completion_ids) == 6


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(tiny_model):
    model, tok = tiny_model
    ids = _prompts(tok, [(10, 20), (30, 40)])
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_id, progress=False)
    a = generate(model, ids, SamplingParams(n=2, max_new_tokens=8, seed=7), **kw)
    b = generate(model, ids, SamplingParams(n=2, max_new_tokens=8, seed=7), **kw)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    g1 = generate(model, ids, SamplingParams(n=1, temperature=0, max_new_tokens=8), **kw)
    g2 = generate(
        model, ids, SamplingParams(n=1, temperature=0, max_new_tokens=8), batch_size=1, **kw
    )
    assert [s.completion_ids for s in g1] == [s.completion_ids for s in g2]


def test_top_k_one_equals_greedy(tiny_model):
    model, tok = tiny_model
    ids = _prompts(tok, [(10, 20), (3, 4)])
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_id, progress=False)
    g = generate(model, ids, SamplingParams(n=1, temperature=0, max_new_tokens=8), **kw)
    k1 = generate(
        model, ids, SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=8, seed=3), **kw
    )
    assert [s.completion_ids for s in g] == [s.completion_ids for s in k1]
    assert all(abs(lp) < 1e-6 for s in k1 for lp in s.logprobs)  # all mass on one token


def test_finished_rows_leave_the_batch_without_changing_the_others(tiny_model):
    """Rows that stop early are dropped from the batch (and its KV cache); every row's
    completion and log-probs are still those it gets alone in a batch of one."""
    import copy

    model, tok = tiny_model
    model = copy.deepcopy(model)  # noised: the untrained model says one token over and over
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    ids = _prompts(tok, [(1, 2), (123, 4567), (99, 1), (5, 55), (8, 0), (40, 2)])
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=10)
    kw = dict(pad_token_id=tok.pad_token_id, progress=False)
    free = generate(model, ids, greedy, eos_token_ids=tok.eos_token_id, **kw)

    # a stop token that ends two rows or more at different steps before the last
    def first_steps(c):
        return {s.completion_ids.index(c) for s in free if c in s.completion_ids[:-1]}

    eos = next(
        c for c in sorted({c for s in free for c in s.completion_ids}) if len(first_steps(c)) > 1
    )
    batched = generate(model, ids, greedy, eos_token_ids=eos, **kw)
    alone = generate(model, ids, greedy, eos_token_ids=eos, batch_size=1, **kw)
    assert len({len(s.completion_ids) for s in batched}) > 1  # rows did finish at different steps
    for a, b in zip(batched, alone, strict=True):
        assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0
        )
