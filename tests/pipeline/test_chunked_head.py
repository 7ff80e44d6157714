"""Log-probs of a real model through the chunked LM head equal the full-logits path: values,
entropies and the gradient of every parameter (tied embeddings, an untied head with a bias,
LoRA through peft), for temperature 1 and not; models whose logits are not the head of the
decoder's output fall back to the logits path with a reason."""

import copy

import pytest
import torch

from grpo_core.algorithm.update import build_batch, completion_logprobs
from grpo_core.logprobs.model import chunked_head_reason
from grpo_core.training.sft import collate, sft_loss_backward
from grpo_core.training.sft_examples import encode_examples

PROMPTS = [[3, 12, 13, 4], [3, 14, 4], [3, 12, 14, 15, 16, 4]]
COMPLETIONS = [[5, 12, 6, 7, 2], [5, 13, 2], [5, 6, 7, 8, 12, 13, 2]]


def naive_reference(model, batch, temperature):
    """Today's logits path written out: the model's logits, a float64 log-softmax."""
    attn = batch.attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=attn, position_ids=pos).logits
    logits = logits[:, batch.prompt_width - 1 : -1].double() / temperature  # [n, T, V]
    logps = torch.log_softmax(logits, -1)
    real = attn[:, batch.prompt_width :].bool()  # [n, T]
    lp = logps.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * real
    ent = -(logps.exp() * logps).sum(-1) * real
    return lp, ent


def grads_of(model, fn, seed=0):
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    batch = build_batch(PROMPTS, COMPLETIONS, [1.0, -1.0, 0.5], pad_id=0)
    lp, ent = fn(model, batch)
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    w2 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ((lp.double() * w1).sum() + (ent.double() * w2).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach().float(), ent.detach().float(), grads


def assert_paths_agree(model, temperature, expect_chunked=True):
    assert (chunked_head_reason(model) is None) == expect_chunked

    def ours(mode):
        def fn(m, b):
            return completion_logprobs(
                m, b, temperature=temperature, with_entropy=True, lm_head=mode
            )

        return fn

    want = grads_of(model, lambda m, b: naive_reference(m, b, temperature))
    for mode in ("chunked", "logits"):
        got = grads_of(model, ours(mode))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert got[2].keys() == want[2].keys() and got[2]
        for name, g in want[2].items():
            torch.testing.assert_close(got[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tied_embeddings_qwen2(tiny_model, temperature):
    model, _ = tiny_model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_paths_agree(model.float(), temperature)


def test_untied_head_with_bias(tiny_llama):
    model = tiny_llama(vocab_size=40)
    model.lm_head = torch.nn.Linear(16, 40, bias=True)
    assert_paths_agree(model, 0.8)


def test_softcapped_logits_fall_back_to_the_logits_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=1.0,  # tiny logits would hide a large cap
    )
    model = Gemma2ForCausalLM(cfg)
    assert "final_logit_softcapping" in chunked_head_reason(model)
    assert_paths_agree(model, 0.9, expect_chunked=False)


def test_a_head_the_decoder_output_does_not_explain_is_caught_by_the_probe(tiny_llama):
    model = tiny_llama(vocab_size=40)
    inner = model.forward

    def scaled(*a, **kw):  # a model that post-processes logits without saying so
        out = inner(*a, **kw)
        out.logits = out.logits * 2.0
        return out

    model.forward = scaled
    assert "differ" in chunked_head_reason(model)


def test_lora_through_peft(tiny_model):
    peft = pytest.importorskip("peft")
    model, _ = tiny_model
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    lora = peft.get_peft_model(copy.deepcopy(model), cfg)
    for name, p in lora.named_parameters():  # a non-zero adapter, so its gradient is non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert chunked_head_reason(lora) is None
    _, _, grads = grads_of(lora, lambda m, b: completion_logprobs(m, b, with_entropy=True))
    assert grads and all("lora_" in n for n in grads)  # the head and the base stay frozen
    assert_paths_agree(lora, 0.7)


def test_sft_loss_in_token_chunks_equals_the_models_loss(tiny_model):
    from grpo_core.demo.task import make_splits

    model, tok = tiny_model
    rows = make_splits(digits=2, n_sft=6, n_rl=1, n_dev=0, n_eval=1, seed=0).sft
    ids, attn, labels = collate(encode_examples(tok, rows), tok.pad_token_id)
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, attention_mask=attn, labels=labels).loss
    want.backward()
    budget = int(attn.sum(-1).max()) * 2  # chunks of two rows
    for mode, max_tokens in (("chunked", None), ("chunked", budget), ("logits", budget)):
        m = copy.deepcopy(model)
        got = sft_loss_backward(m, ids, attn, labels, max_tokens=max_tokens, lm_head=mode)
        assert got == pytest.approx(float(want.detach()), rel=1e-5)
        for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
