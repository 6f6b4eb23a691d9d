"""``transformers.Trainer`` with our scalers (:mod:`adaloss.integrations.hf_trainer`): ``ScalerTrainer.train``
on a tiny GPT-2 (causal LM) and a tiny BERT (masked LM), built from configs, 20 steps with the adaptive
scaler under the FP16 emulation (``fp16=True`` on the CPU: Accelerate's GradScaler slot, filled by ours),
ends bitwise on our own loop's weights and scaler state; a run resumed from the Trainer's checkpoint at step
10 ends on the uninterrupted run's weights and scaler state; the per-layer telemetry is in the Trainer's
logs on its logging steps.

Our own loop is LossScaler's docstring order on the same batches (the Trainer's sequential sampler), with
what the Trainer adds by default: gradient clipping at ``max_grad_norm=1`` after ``unscale_``, and the
model's loss normalized by ``num_items_in_batch`` (the labels the loss counts, as the Trainer computes it).
Dropout is off, so the Trainer's use of the random generators does not enter the comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from adaloss.integrations.hf_trainer import ScalerTrainer  # noqa: E402
from adaloss.precision import Precision  # noqa: E402
from adaloss.scalers import AdaptiveLossScaler, DynamicLossScaler, LossScaler  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB, BATCH, LENGTH, STEPS, LR = 100, 4, 16, 20, 1e-3


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def dataset(kind: str) -> list[dict[str, torch.Tensor]]:
    """STEPS batches of BATCH examples: next-token labels (GPT-2) or 15% of the tokens masked (BERT)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * BATCH):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if kind == "gpt2":
            example["labels"] = ids.clone()
        else:
            masked = torch.rand(LENGTH, generator=g) < 0.15
            masked[0] = True
            example["labels"] = torch.where(masked, ids, -100)
            example["input_ids"] = torch.where(masked, 0, ids)
        out.append(example)
    return out


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "bert": bert}


def adaptive() -> AdaptiveLossScaler:
    return AdaptiveLossScaler(update_every=4, root="adaptive")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The batch and ``num_items_in_batch``, the count the model's loss divides its sum by, as the Trainer
    computes it (transformers 5.24 counts every label, GPT-2's first ones too, which its shifted loss leaves
    out; ``/ 1``: a float tensor, as the Trainer's)."""
    return {**batch, "num_items_in_batch": batch["labels"].ne(-100).sum() / 1}


def our_loop(kind: str, scaler: LossScaler) -> nn.Module:
    model = MODELS[kind]()
    model.config.use_cache = False
    data = dataset(kind)
    batches = [transformers.default_data_collator(data[i : i + BATCH]) for i in range(0, len(data), BATCH)]
    model = scaler.attach(model, **model_inputs(batches[0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    precision = Precision("fp16", "cpu")
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = model(**model_inputs(batch)).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    return model


def trainer_run(
    kind: str, scaler: LossScaler, out: Path, resume: Path | None = None, **args: Any
) -> ScalerTrainer:
    model = MODELS[kind]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    training = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH, fp16=True, use_cpu=True,
        train_sampling_strategy="sequential", logging_steps=5, save_strategy="steps", save_steps=10,
        report_to=[], disable_tqdm=True, **args,
    )  # fmt: skip
    trainer = ScalerTrainer(
        model=model,
        args=training,
        train_dataset=dataset(kind),
        optimizers=(optimizer, schedule),
        scaler=scaler,
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return trainer


def equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def same_state(a: LossScaler, b: LossScaler) -> bool:
    """Equal scaler states, NaN (a branch factor no gradient reached) equal to NaN: their reprs (a float's
    repr is exact)."""
    return repr(a.state_dict()) == repr(b.state_dict())


@pytest.fixture(scope="module", params=["gpt2", pytest.param("bert", marks=pytest.mark.slow)])
def whole(request, tmp_path_factory) -> tuple[str, ScalerTrainer, Path]:
    out = tmp_path_factory.mktemp(request.param)
    return request.param, trainer_run(request.param, adaptive(), out), out


def test_trainer_train_equals_our_loop(whole: tuple[str, ScalerTrainer, Path]) -> None:
    """20 steps of ScalerTrainer.train end on our loop's weights and scaler state, bitwise; the scaler drove
    the model (alphas per layer, some of them apart); telemetry in the logs of steps 5, 10, 15, 20."""
    kind, trainer, _ = whole
    ours = adaptive()
    assert equal(trainer.model, our_loop(kind, ours))
    assert same_state(trainer.loss_scaler, ours)
    assert ours.state_dict()["iteration"] == STEPS and len(set(ours.layer_scales().values())) > 1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [5, 10, 15, 20]
    last = logs[-1]
    assert {k: v for k, v in last.items() if k.startswith("alpha/")} == {
        f"alpha/{layer}": alpha for layer, alpha in ours.layer_scales().items()
    }
    rates = {k: v for k, v in last.items() if k.startswith("underflow_rate/")}
    assert rates and all(0.0 <= v <= 1.0 for v in rates.values()) and "mean_underflow_rate" in last


def test_trainer_resumes_the_scaler_exactly(whole: tuple[str, ScalerTrainer, Path], tmp_path: Path) -> None:
    """A new ScalerTrainer with a new scaler resumes from the uninterrupted run's checkpoint-10 (scaler.pt
    beside the optimizer's state) and ends on its weights and scaler state."""
    kind, trainer, out = whole
    checkpoint = out / "checkpoint-10"
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["iteration"] == 10
    resumed = trainer_run(kind, adaptive(), tmp_path, resume=checkpoint)
    assert equal(resumed.model, trainer.model)
    assert same_state(resumed.loss_scaler, trainer.loss_scaler)


def test_the_dynamic_scaler_under_the_trainer(tmp_path: Path) -> None:
    """The other scalers go through the same slot: the dynamic one ends on our loop's weights too."""
    trainer = trainer_run("gpt2", DynamicLossScaler(init_scale=2.0**16, growth_interval=5), tmp_path)
    ours = DynamicLossScaler(init_scale=2.0**16, growth_interval=5)
    assert equal(trainer.model, our_loop("gpt2", ours))
    assert trainer.loss_scaler.get_scale() == ours.get_scale()


def test_a_grad_scaler_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="Trainer with fp16=True"):
        ScalerTrainer(model=gpt2(), scaler=torch.amp.GradScaler("cpu"))


def test_a_captured_model_takes_the_keywords_of_its_kwargs() -> None:
    """GPT-2's forward takes num_items_in_batch through **kwargs (transformers' loss kwargs): a model
    captured with it runs the rewritten graph when called with it (the call's keywords are matched one by
    one, not as one 'kwargs' argument)."""
    data = dataset("gpt2")
    batch = model_inputs(transformers.default_data_collator(data[:BATCH]))
    model = gpt2()
    model.config.use_cache = False
    scaler = AdaptiveLossScaler()
    model = scaler.attach(model, **batch)
    scaler.scale(model(**batch).loss).backward()
    assert scaler.last_pass == "recompute" and all(p.grad is not None for p in model.parameters())
