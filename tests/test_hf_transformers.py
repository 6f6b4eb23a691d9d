"""Hugging Face transformers models under the adaptive scaler: captured with torch.export (fx cannot trace
them), rewritten by the same passes, exact in float64, every Conv1D/Linear a point, counted in ATen.

The models are built from tiny configs (nothing downloaded). Each exactness case attaches on one batch and
runs a second batch of another batch size and length through the same capture (a reuse step)."""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

from adaloss.adaptive import AdaptiveTransformError  # noqa: E402
from adaloss.adaptive.capture import CaptureError  # noqa: E402
from adaloss.errors import ConfigError  # noqa: E402
from adaloss.scalers.adaptive import AdaptiveLossScaler  # noqa: E402
from adaloss.scalers.exactness import check_gradients  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 100
# transformers 5 names gradient_checkpointing_enable() a deprecated alias; the name is kept here
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")


def gpt2(attn: str = "eager", dropout: float = 0.1) -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, attn_implementation=attn,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(attn: str = "sdpa", dropout: float = 0.1) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        attention_dropout=dropout, attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert(attn: str = "eager", dropout: float = 0.1) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, attn_implementation=attn,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def batch(name: str, size: int, length: int, seed: int = 0) -> dict:
    """Token ids, a padding mask (two rows padded at the end) and labels; use_cache=False for the decoders."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    mask = torch.ones(size, length, dtype=torch.long)
    mask[1, length - 2 :] = 0
    mask[-1, 3:] = 0
    if name == "bert":
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (size,), generator=g)}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids, "use_cache": False}


SLOW = pytest.mark.slow
EXACT = [  # the paper's rule too, and the other attention implementation, in the slow tests
    ("gpt2", "eager", ("reference",)),
    ("llama", "sdpa", ("reference",)),
    ("bert", "eager", ("reference",)),
    pytest.param("gpt2", "sdpa", ("reference", "paper"), marks=SLOW, id="gpt2-sdpa-both_rules"),
    pytest.param("llama", "eager", ("reference", "paper"), marks=SLOW, id="llama-eager-both_rules"),
    pytest.param("bert", "sdpa", ("reference", "paper"), marks=SLOW, id="bert-sdpa-both_rules"),
]


@pytest.mark.parametrize(("name", "attn", "rules"), EXACT)
def test_unscaled_gradients_equal_plain_backprop_in_float64(name, attn, rules):
    """A recompute step on (3, 8) and a reuse step on (2, 11) after one attach, dropout in training mode,
    padding masks, Llama's grouped-query attention and tied embeddings: every parameter gradient after
    ``unscale_`` is plain backprop's to float64 rounding, with at least three distinct alphas."""
    torch.manual_seed(0)
    model = MODELS[name](attn)
    assert model.training
    batches = [batch(name, 3, 8), batch(name, 2, 11, seed=1)]
    report = check_gradients(model, batches, lambda out: out.loss * 1e-6, rules=rules)
    assert report.ok, report.format()
    alphas = report.alphas[("reference", "recompute")]
    assert len(set(alphas.values())) >= 3, alphas


def _gemm_layers(model: torch.nn.Module) -> list[str]:
    """The model's Linear and Conv1D modules (GPT-2's projections: addmm with an [in, out] weight)."""
    kinds = (torch.nn.Linear, transformers.pytorch_utils.Conv1D)
    return [path for path, m in model.named_modules() if isinstance(m, kinds)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_conv1d_and_linear_gets_a_point_counted_in_aten(name):
    """One weight point per Linear/Conv1D module, named after it (the tied LM head included), and in a
    forward pass of another shape every ATen GEMM with a parameter operand runs inside a point."""
    torch.manual_seed(0)
    model = MODELS[name]()
    layers = _gemm_layers(model)
    scaler = AdaptiveLossScaler()
    scaler.attach(model, **batch(name, 3, 8))
    weight_points = [p.name for p in scaler.state.gemms if p.kind == "layer"]
    assert sorted(weight_points) == sorted(layers)
    coverage = scaler.coverage(**batch(name, 2, 5, seed=2))
    assert len(coverage.calls) == len(layers), coverage
    assert not coverage.outside, coverage
    assert coverage.every_gemm_weight_has_a_point, coverage
    weights = {p.name: p.weight for p in coverage.points if p.kind == "layer"}
    assert all(weights[layer] is not None for layer in layers), weights  # read from the rewritten graph


def test_dropout_follows_train_and_eval():
    """Export fixes dropout's training flag; the captured model follows ``train()`` / ``eval()``: GPT-2's
    dropout modules, and the attention dropout it passes to scaled_dot_product_attention (``dropout_p``)."""
    torch.manual_seed(0)
    model = gpt2("sdpa", dropout=0.5)
    inputs = batch("gpt2", 3, 8)
    plain_eval = model.eval()(**inputs).logits
    model.train()
    attached = AdaptiveLossScaler().attach(model, **inputs)
    attached.eval()
    torch.testing.assert_close(attached(**inputs).logits, plain_eval, rtol=0, atol=0)
    attached.train()
    assert not torch.equal(attached(**inputs).logits, attached(**inputs).logits)


def test_emulated_fp16_forward_is_the_plain_models_bit_for_bit():
    """The FP16 emulation classifies the captured graph's ATen ops as it does torch's functions
    (``aten.layer_norm.default`` is ``layer_norm``: computed in FP32), so the forward passes agree exactly."""
    from adaloss.precision import Precision

    torch.manual_seed(0)
    model = gpt2(dropout=0.0).eval()
    inputs = batch("gpt2", 3, 8)
    precision = Precision("fp16", "cpu")
    with precision.autocast():
        plain = model(**inputs).logits
    attached = AdaptiveLossScaler().attach(copy.deepcopy(model), **inputs)
    with precision.autocast():
        torch.testing.assert_close(attached(**inputs).logits, plain, rtol=0, atol=0)


def test_the_model_keeps_its_class_state_dict_generate_and_save():
    torch.manual_seed(0)
    model = gpt2()
    keys = list(model.state_dict())
    inputs = batch("gpt2", 3, 8)
    scaler = AdaptiveLossScaler()
    attached = scaler.attach(model, **inputs)
    assert attached is model and type(attached) is transformers.GPT2LMHeadModel
    assert list(attached.state_dict()) == keys
    ids, rest = inputs["input_ids"], {k: v for k, v in inputs.items() if k != "input_ids"}
    scaler.scale(attached(ids, **rest).loss).backward()  # the captured call, positional or by name
    assert all(p.grad is not None for p in attached.parameters())
    one = torch.randint(1, VOCAB, (1, 1))  # batch size and length 1, after a capture on (3, 8)
    out = attached(input_ids=one, attention_mask=torch.ones_like(one), labels=one, use_cache=False)
    assert out.logits.shape == (1, 1, VOCAB)
    attached.eval()
    with torch.no_grad():  # another call (generate's cache): the model's own forward, same values
        out = attached.generate(
            inputs["input_ids"][:1, :3], max_new_tokens=3, do_sample=False, pad_token_id=0
        )
    assert out.shape == (1, 6)
    with tempfile.TemporaryDirectory() as folder:
        attached.save_pretrained(folder)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    attached.train()
    with pytest.raises(CaptureError, match=r"captured for a call with \(attention_mask, input_ids"):
        attached(inputs["input_ids"])  # gradients recorded, not the captured call: refused by name


def test_root_adaptive_keeps_the_output_class():
    """``root="adaptive"`` probes the model's outputs; a transformers output stays a ModelOutput."""
    torch.manual_seed(0)
    scaler = AdaptiveLossScaler(root="adaptive")
    inputs = batch("gpt2", 3, 8)
    model = scaler.attach(gpt2(), **inputs)
    out = model(**inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    scaler.scale(out.loss).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_untraceable_models_get_one_line_that_says_what_to_do():
    with pytest.raises(AdaptiveTransformError, match=r"give attach\(\) example inputs"):
        AdaptiveLossScaler().attach(gpt2())
    ids = batch("gpt2", 2, 4)["input_ids"]
    with pytest.raises(AdaptiveTransformError, match="pass use_cache=False"):
        AdaptiveLossScaler().attach(gpt2(), input_ids=ids)


@pytest.mark.slow  # a fresh interpreter importing torch: 10 s on the shared machine
def test_import_adaloss_does_not_import_transformers():
    code = "import sys, adaloss, adaloss.adaptive, adaloss.scalers.adaptive\n"
    code += "assert 'transformers' not in sys.modules, 'import adaloss imported transformers'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------- the runner

HF_RUN = (
    "dataset=pystdlib",
    "scaler=adaptive",
    "dataset.block_size=16",
    "dataset.val_windows=16",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=16",
    "trainer.max_steps=3",
    "trainer.eval_every=3",
    "telemetry.every=3",
)


RUN_LAYERS = {
    "hf_gpt2": "transformer.h.0.attn.c_attn",
    "hf_llama": "model.layers.0.self_attn.q_proj",
    "hf_bert": "bert.encoder.layer.0.attention.self.query",
}


@pytest.mark.parametrize("model", ["hf_gpt2", pytest.param("hf_llama", marks=pytest.mark.slow), "hf_bert"])
def test_a_short_run_trains_with_telemetry_named_after_the_transformers_modules(make_full_cfg, model):
    """``python train.py model=hf_gpt2 dataset=pystdlib scaler=adaptive``: the bundled config, the vocabulary
    and context of the data, emulated FP16, the per-layer telemetry and scales under the modules' names.
    ``model=hf_bert``: BertForMaskedLM with the data's vocabulary plus [MASK], trained as a masked LM."""
    from adaloss.runner.engine import train

    metrics = train(make_full_cfg(f"model={model}", *HF_RUN))
    assert metrics["steps"] == 3 and not metrics["diverged"] and metrics["val_loss"] < 6.0
    layer = RUN_LAYERS[model]
    assert layer in metrics["underflow_rate"] and layer in metrics["loss_scale"], metrics["loss_scale"]


def test_bert_masking_is_seeded_and_follows_bert():
    """``mask_tokens``: the same generator seed gives the same masking, another seed another, and a window's
    masking does not depend on how the windows are batched; 15% of the positions of every window are
    chosen, of those about 80% [MASK], 10% a random data token and 10% unchanged; labels elsewhere -100."""
    from adaloss.runner.engine.tasks import IGNORE, mask_tokens

    x = torch.randint(0, 256, (256, 64), generator=torch.Generator().manual_seed(0))

    def masked(seed: int, sizes: tuple[int, ...] = (256,)) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        parts = [mask_tokens(part, 0.15, 256, g) for part in x.split(list(sizes))]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    inputs, labels = masked(1)
    assert all(torch.equal(a, b) for a, b in zip(masked(1, (100, 156)), (inputs, labels), strict=True))
    assert not torch.equal(masked(2)[1], labels)
    chosen = labels != IGNORE
    assert (chosen.sum(1) == round(0.15 * 64)).all()
    assert torch.equal(labels[chosen], x[chosen]) and torch.equal(inputs[~chosen], x[~chosen])
    n = int(chosen.sum())
    as_mask = int((inputs[chosen] == 256).sum()) / n
    kept = int((inputs[chosen] == x[chosen]).sum()) / n  # random tokens equal to the original included
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and int(inputs.max()) == 256, (as_mask, kept)


class _Copier(torch.nn.Module):
    """Logits that predict each input token at its own position (confidently): loss ~0 where the input is
    the label, large at [MASK]."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 20.0 * torch.nn.functional.one_hot(ids, self.vocab).double()


def test_the_masked_loss_counts_only_the_masked_positions():
    """The task's loss is the cross-entropy at the masked positions alone (a loss over every position
    would be about 15% of it here: the copying model is right wherever nothing was masked), and the
    validation loss uses the same masking at every evaluation, whatever the batch size."""
    from adaloss.precision import Precision
    from adaloss.runner.data.text import TextInfo
    from adaloss.runner.engine.tasks import LanguageModelTask, mask_tokens

    info = TextInfo("text", 256, 0, 0, 10, 10, vocab_size=256, block_size=32)
    model = _Copier(257)
    task = LanguageModelTask(model, torch.device("cpu"), info, masking=0.15)
    windows = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (windows[:, :-1], windows[:, 1:])
    torch.manual_seed(3)  # the training masks: torch's default generator (the run's seed, checkpointed)
    loss, _ = task.loss(model, task.to_device(batch))
    inputs, labels = mask_tokens(batch[0], 0.15, 256, torch.Generator().manual_seed(3))
    logits = model(inputs).flatten(0, 1)
    chosen = labels.flatten() != -100
    expected = torch.nn.functional.cross_entropy(logits[chosen], labels.flatten()[chosen])
    torch.testing.assert_close(loss, expected)
    assert expected > 5.0  # [MASK] positions cost 20 nats, the others nothing
    precision = Precision("fp32", "cpu")
    values = [task.evaluate(model, [batch], precision).value for _ in range(2)]
    smaller = list(zip(batch[0].split(3), batch[1].split(3), strict=True))
    values.append(task.evaluate(model, smaller, precision).value)
    assert values[0] == values[1] and abs(values[2] - values[0]) < 1e-9, values
    with pytest.raises(ConfigError, match="needs a masked language model.*use model=hf_bert"):
        LanguageModelTask(gpt2(), torch.device("cpu"), info, masking=0.15)
    bert_mlm = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=257, hidden_size=8,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))  # fmt: skip
    with pytest.raises(ConfigError, match=r"task.masking=0 trains the masked language model BertForMaskedLM"):
        LanguageModelTask(bert_mlm, torch.device("cpu"), info)


def test_the_runner_says_what_is_missing(monkeypatch):
    from adaloss.errors import ConfigError
    from adaloss.runner.models import build_model

    with pytest.raises(ConfigError, match="neither a bundled transformers config .*gpt2_tiny.json"):
        build_model({"name": "hf_gpt2", "config": "gpt3.json"}, vocab_size=256, block_size=16)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ConfigError, match=r"transformers is not installed: pip install 'adaloss\[hf\]'"):
        build_model({"name": "hf_gpt2"}, vocab_size=256, block_size=16)


# ----------------------------------------------------------------- checkpointing, encoder-decoder (slow)


def _checkpointed_gradients(model, batches, seed=0, rule="reference") -> tuple[list, dict]:
    """Per step (a recompute on the first batch, reuses on the others, one attach): the checks of the
    gradients after ``unscale_`` of a float64 copy of ``model`` with gradient checkpointing on against
    plain backprop of a float64 copy without it, and the alphas of the recompute step."""
    from adaloss.scalers.exactness import _cast, _gradients, _grads, compare

    reference, noisy = copy.deepcopy(model).double(), copy.deepcopy(model).float()
    scaler = AdaptiveLossScaler(update_every=len(batches), rule=rule)
    checked = copy.deepcopy(reference)
    checked.gradient_checkpointing_enable()
    attached = scaler.attach(checked, **_cast(batches[0], torch.float64))
    optimizer = torch.optim.SGD(attached.parameters(), lr=0.0)
    checks, alphas = [], {}
    for inputs in batches:
        _gradients(reference, _cast(inputs, torch.float64), _scaled_down, seed)
        _gradients(noisy, _cast(inputs, torch.float32), lambda o: _scaled_down(o).float(), seed)
        _gradients(attached, _cast(inputs, torch.float64), _scaled_down, seed, scaler.scale)
        assert attached.forward.checkpointed is not None  # the checkpointed graph ran
        scaler.unscale_(optimizer)
        checks += compare(_grads(reference), _grads(noisy), _grads(attached))
        alphas = alphas or scaler.layer_scales()
        scaler.step(optimizer)
        scaler.update()
    return checks, alphas


def _scaled_down(out) -> torch.Tensor:
    return out.loss * 1e-6


@pytest.mark.parametrize("name", ["gpt2", "llama", pytest.param("bert", marks=SLOW)])
def test_gradient_checkpointing_is_exact_with_dropout_replayed(name):
    """With ``gradient_checkpointing_enable()`` the captured model recomputes each layer in the backward
    pass; its gradients after ``unscale_`` equal plain backprop's (no checkpointing, not captured) in
    float64, dropout on, on a recompute step on (3, 8) and a reuse step on (2, 11) after one attach, with
    at least three distinct alphas. The recompute must replay the dropout masks of the forward pass (a
    checkpoint without ``preserve_rng_state`` fails here) and run the rewritten ops again."""
    torch.manual_seed(0)
    model = MODELS[name](dropout=0.2)
    checks, alphas = _checkpointed_gradients(model, [batch(name, 3, 8), batch(name, 2, 11, seed=1)])
    assert all(check.ok for check in checks), [str(c) for c in checks if not c.ok]
    assert len(set(alphas.values())) >= 3, alphas


def _kept_bytes(model, inputs) -> int:
    """Bytes of activations the forward pass keeps for the backward pass: the tensors autograd saves
    (outside checkpointed blocks) and the inputs of the checkpointed blocks (checkpoint keeps them),
    each storage counted once, parameters and their views not counted. No autograd node may hold
    operands outside its saved tensors (those would escape both the count and the checkpoint)."""
    from adaloss.adaptive.checkpointing import CheckpointedBlock

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    split = model.forward.checkpointed if hasattr(model.forward, "checkpointed") else None
    blocks = [m for m in split.modules() if isinstance(m, CheckpointedBlock)] if split is not None else []
    hooks = [b.register_forward_pre_hook(lambda _, args: [keep(a) for a in args] and None) for b in blocks]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(**inputs)
    for hook in hooks:
        hook.remove()
    assert not _held_operands(out.loss.grad_fn)
    return sum(kept.values())


def _held_operands(node) -> list[str]:
    """The autograd nodes (a product's beta operands) that hold tensors as Python attributes rather than
    saved tensors, which saved-tensor hooks and checkpointing do not see."""
    held, seen, stack = [], set(), [node]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        operands = getattr(node, "operands", None)
        if operands is not None and any(getattr(operands, n) is not None for n in operands._TENSORS):
            held.append(type(operands).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return held


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_gradient_checkpointing_saves_the_layers_activations(name):
    """What the captured model keeps for the backward pass (saved tensors, checkpoint's block inputs) is
    less than 60% of what it keeps without checkpointing; the same model with the checkpoint's wrapping
    dropped (export traces through transformers' checkpoint) keeps as much as without."""
    torch.manual_seed(0)
    model = MODELS[name](dropout=0.0)
    inputs = batch(name, 4, 32)
    scaler = AdaptiveLossScaler()
    attached = scaler.attach(model, **inputs)
    plain = _kept_bytes(attached, inputs)
    attached.gradient_checkpointing_enable()  # after attach: followed on the next call
    checkpointed = _kept_bytes(attached, inputs)
    assert attached.forward.checkpointed is not None
    assert checkpointed < 0.6 * plain, (checkpointed, plain)
    print(f"{name}: {plain} bytes kept without checkpointing, {checkpointed} with")


def test_checkpointing_follows_enable_and_disable_after_attach():
    """Toggling checkpointing after ``attach()`` takes effect on the next call (the layers' flags are read
    on each call, as transformers' layers read them): gradients stay equal and the kept bytes follow, and
    ``every_n_layers=2`` checkpoints one layer of two. Reentrant checkpointing is refused by name."""
    torch.manual_seed(0)
    model = gpt2(dropout=0.0)
    inputs = batch("gpt2", 4, 32)
    scaler = AdaptiveLossScaler()
    attached = scaler.attach(model, **inputs)
    grads = []
    for enable in (False, True, False):
        if enable:
            attached.gradient_checkpointing_enable()
        else:
            attached.gradient_checkpointing_disable()
        kept = _kept_bytes(attached, inputs)
        attached.zero_grad()
        scaler.scale(attached(**inputs).loss).backward()
        grads.append([p.grad.clone() for p in attached.parameters()])
        grads[-1].append(kept)
    assert grads[1][-1] < 0.6 * grads[0][-1] and grads[2][-1] == grads[0][-1]
    for a, b in zip(grads[0][:-1], grads[1][:-1], strict=True):
        torch.testing.assert_close(a, b)
    attached.activation_checkpointing_enable(every_n_layers=2)  # the first of the two layers only
    assert grads[1][-1] < _kept_bytes(attached, inputs) < grads[0][-1]
    attached.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match=r"use_reentrant given.*'use_reentrant': False"):
        attached(**inputs)
    attached.forward.checkpointed = None  # a graph whose nodes do not name their modules:
    for node in attached.forward.gm.graph.nodes:
        node.meta.pop("nn_module_stack", None)
    with pytest.raises(ConfigError, match=r"none of the layers transformer.h.0, .*gradient_checkpointing_"):
        attached(**inputs)


def test_the_recompute_rounds_as_the_emulated_forward_pass_did():
    """Emulated FP16 around the forward pass only (as the runner does): the checkpointed layers recompute
    in the backward pass, outside the emulation's context, and must round as the forward pass did; the
    gradients then equal those of the same captured model without checkpointing, bit for bit."""
    from adaloss.precision import Precision

    torch.manual_seed(0)
    model = gpt2(dropout=0.1)
    inputs = batch("gpt2", 3, 8)
    precision = Precision("fp16", "cpu")
    grads = []
    for checkpointed in (False, True):
        scaler = AdaptiveLossScaler()
        attached = scaler.attach(copy.deepcopy(model), **inputs)
        if checkpointed:
            attached.gradient_checkpointing_enable()
        torch.manual_seed(1)
        with precision.autocast():
            loss = attached(**inputs).loss
        scaler.scale(loss).backward()
        assert (attached.forward.checkpointed is not None) == checkpointed
        grads.append({n: p.grad for n, p in attached.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


def test_every_conv1d_and_linear_gets_a_point_with_checkpointing_on():
    """Checkpointing on before ``attach()``: one weight point per Linear/Conv1D, and a checkpointed
    training step's backward pass reaches every point (each has a scale after a recompute step)."""
    torch.manual_seed(0)
    model = llama()
    model.gradient_checkpointing_enable()
    layers = _gemm_layers(model)
    inputs = batch("llama", 3, 8)
    scaler = AdaptiveLossScaler()
    attached = scaler.attach(model, **inputs)
    assert sorted(p.name for p in scaler.state.gemms if p.kind == "layer") == sorted(layers)
    scaler.scale(attached(**inputs).loss * 1e-6).backward()
    assert attached.forward.checkpointed is not None
    scales = scaler.layer_scales()
    assert all(layer in scales for layer in layers), sorted(scales)


@pytest.mark.slow
def test_t5_encoder_decoder_is_exact():
    """T5 shifts the labels right into the decoder's input in place (``new_zeros``, a slice, ``copy_``):
    integer tensors, which carry no gradient, so the rewrite leaves such writes as they are."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)

    def seq2seq(size: int, length: int) -> dict:
        ids = torch.randint(1, VOCAB, (size, length), generator=g)
        labels = torch.randint(1, VOCAB, (size, length - 2), generator=g)
        return {"input_ids": ids, "labels": labels, "use_cache": False}

    report = check_gradients(model, [seq2seq(3, 8), seq2seq(2, 11)], lambda out: out.loss * 1e-6)
    assert report.ok, report.format()
    alphas = report.alphas[("reference", "recompute")]
    assert len(alphas) == 39 and len(set(alphas.values())) >= 3, alphas


def test_a_resumed_bert_run_draws_the_masks_it_would_have_drawn(make_full_cfg, tmp_path):
    """The training masks come from torch's default generator, whose state the checkpoint holds: resumed
    at step 2, a masked-LM run ends bitwise on the weights of the uninterrupted one (a generator of the
    task's own, not in the checkpoint, would mask steps 3 and 4 otherwise)."""
    from adaloss.runner.engine import train
    from test_checkpoint import _assert_bitwise_equal, _weights

    run = ("model=hf_bert", *HF_RUN[:-3], "trainer.max_steps=4", "trainer.eval_every=4")
    run += ("trainer.checkpoint_every=2", "trainer.save_final=true", "telemetry.every=4")
    train(make_full_cfg(*run))
    first = _weights(tmp_path / "model.pt")
    (tmp_path / "model.pt").unlink()
    (tmp_path / "metrics.json").unlink()
    train(make_full_cfg(*run, f"resume={tmp_path / 'checkpoints' / 'step_2.pt'}"))
    _assert_bitwise_equal(first, _weights(tmp_path / "model.pt"))
