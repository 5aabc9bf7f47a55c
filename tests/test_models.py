"""Model-level rules: TextCNN's max over time ignores padding windows; its embedding lr scale."""
from __future__ import annotations

import torch

from fedfew.models.textcnn import TextCNNBody


def body(mask: bool) -> TextCNNBody:
    torch.manual_seed(0)
    b = TextCNNBody(vocab_size=30, embed_dim=6, kernels=[3, 4, 5], channels=4, dropout=0.0, mask_padding=mask)
    with torch.no_grad():  # biases > 0: a window over padding alone gives relu(bias) > 0
        for conv in b.convs:
            conv.bias.fill_(5.0)
    return b.eval()


def test_masked_features_equal_the_unpadded_text_and_do_not_depend_on_the_batch():
    text = torch.tensor([[7, 3, 9, 12, 4, 8]])  # 6 tokens
    padded = torch.nn.functional.pad(text, (0, 10))  # as in a batch whose longest text has 16
    short = torch.tensor([[5, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # 2 tokens < every kernel
    masked = body(True)
    with torch.no_grad():
        alone = masked(text)
        in_batch = masked(torch.cat([padded, short]))
        # hand rule: the short text keeps only its first window (tokens 5, 6, pad, ...)
        h = masked.embedding(short[:, :5]).transpose(1, 2)
        first_windows = torch.cat([torch.relu(conv(h[:, :, : conv.kernel_size[0]]))[:, :, 0] for conv in masked.convs], 1)
    torch.testing.assert_close(in_batch[0:1], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(in_batch[1:2], first_windows, rtol=0, atol=1e-6)
    # without the mask, padding windows change the features of the same text
    unmasked = body(False)
    with torch.no_grad():
        assert not torch.allclose(unmasked(padded), unmasked(text))


def test_optimizer_choice_reaches_local_training():
    """optim.name=adam: a fresh Adam per local training; its first step moves every parameter
    with a nonzero gradient by lr * sign(grad) (bias-corrected m / sqrt(v) = g / |g|), unlike SGD."""
    import pytest
    from torch import nn

    from fedfew.core.model_set import KModelSet

    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.tensor([0, 1] * 4)
    for name, expected_type in [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD)]:
        module = KModelSet(lambda: nn.Linear(3, 2), K=1, lr=0.01, optimizer=name)
        opt = module.configure_optimizers()
        assert type(opt) is expected_type and opt.param_groups[0]["lr"] == 0.01
        before = [p.detach().clone() for p in module.working.parameters()]
        loss = module.training_step((x, y))
        loss.backward()
        grads = [p.grad.detach().clone() for p in module.working.parameters()]
        opt.step()
        for p, b, g in zip(module.working.parameters(), before, grads):
            expected = -0.01 * (torch.sign(g) if name != "sgd" else g)
            torch.testing.assert_close(p.detach() - b, expected, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="optim.name='rmsprop'"):
        KModelSet(lambda: nn.Linear(3, 2), K=1, optimizer="rmsprop")


def test_embed_lr_scale_is_the_same_function_with_an_m_times_faster_sgd_step_on_word_vectors():
    """embed_lr_scale=m: same initial function (effective table = stored * sqrt(m)); one SGD
    step at lr eta moves the effective word vectors by m * eta * dL/dE, the other weights by
    eta * dL/dW, exactly as a plain layer whose embedding has lr m * eta (param groups)."""
    import pytest

    m, eta = 100.0, 0.1
    tokens = torch.tensor([[7, 3, 9, 12, 4, 8], [5, 6, 2, 1, 0, 0]])
    y = torch.tensor([1, 3])
    torch.manual_seed(1)
    scaled = TextCNNBody(30, 6, [3, 4], 4, 0.0, embed_lr_scale=m)
    torch.manual_seed(1)
    plain = TextCNNBody(30, 6, [3, 4], 4, 0.0)
    assert torch.equal(scaled.embedding.weight[0], torch.zeros(6))  # padding row stays 0
    torch.testing.assert_close(scaled.embedding.weight * m ** 0.5, plain.embedding.weight, rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled(tokens), plain(tokens), rtol=1e-5, atol=1e-6)

    head = torch.nn.Linear(8, 4)
    start = plain.embedding.weight.detach().clone()
    def step(body, groups):
        opt = torch.optim.SGD(groups, lr=eta)
        loss = torch.nn.functional.cross_entropy(head(body(tokens)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    step(scaled, list(scaled.parameters()))
    step(plain, [{"params": [plain.embedding.weight], "lr": m * eta},
                 {"params": [p for n, p in plain.named_parameters() if not n.startswith("embedding")]}])
    assert (plain.embedding.weight - start).abs().max() > 1e-2  # the step did move the word vectors
    torch.testing.assert_close(scaled.embedding.weight * m ** 0.5, plain.embedding.weight, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(scaled.named_parameters(), plain.parameters()):
        if not n.startswith("embedding"):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.manual_seed(1)  # embed_init_std rescales the same N(0, 1) draw (and composes with the lr scale)
    small = TextCNNBody(30, 6, [3, 4], 4, 0.0, embed_lr_scale=m, embed_init_std=0.3)
    torch.testing.assert_close(small.embedding.weight * m ** 0.5, 0.3 * start, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="embed_init_std must be > 0"):
        TextCNNBody(30, 6, [3], 4, 0.0, embed_init_std=-1.0)
    with pytest.raises(ValueError, match="embed_lr_scale must be > 0"):
        TextCNNBody(30, 6, [3], 4, 0.0, embed_lr_scale=0.0)


def test_state_dict_saved_under_another_embed_lr_scale_does_not_load():
    """The stored table is word vectors / sqrt(m): a state dict (through torch.save, as in a
    checkpoint or models.pt) loads into a model with the same m and is refused by another m,
    including an old state dict without the metadata (m = 1) loaded into m = 30."""
    import io

    import pytest

    def saved(m: float):
        buf = io.BytesIO()
        torch.save(TextCNNBody(30, 6, [3], 4, 0.0, embed_lr_scale=m).state_dict(), buf)
        buf.seek(0)
        return torch.load(buf)

    same = TextCNNBody(30, 6, [3], 4, 0.0, embed_lr_scale=30.0)
    state = saved(30.0)
    same.load_state_dict(state)
    assert torch.equal(same.embedding.weight, state["embedding.weight"])
    with pytest.raises(RuntimeError, match=r"saved with model.embed_lr_scale=30, this model has 1"):
        TextCNNBody(30, 6, [3], 4, 0.0).load_state_dict(state)
    old = saved(1.0)
    del old._metadata  # a plain dict of tensors, as from before the option
    TextCNNBody(30, 6, [3], 4, 0.0).load_state_dict(old)
    with pytest.raises(RuntimeError, match=r"saved with model.embed_lr_scale=1, this model has 30"):
        TextCNNBody(30, 6, [3], 4, 0.0, embed_lr_scale=30.0).load_state_dict(old)
