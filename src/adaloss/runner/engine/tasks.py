"""What differs between classification and detection runs, behind one small interface the loop calls.

The loop in :mod:`adaloss.runner.engine.trainer` is the same for every task: fetch a batch, forward and loss
under the precision context, backward through the loss scaler, step, update. A :class:`Task` supplies the
parts that depend on the data: how a batch moves to the device, the loss, the running training statistics, and
the evaluation metric.

* :class:`ClassificationTask`: cross-entropy, top-1 accuracy (``test_accuracy``, %).
* :class:`DetectionTask`: SSD's multibox loss, VOC2007 11-point mAP at IoU 0.5 (``map``, %, with
  ``ap_per_class``). The module trained (and rewritten by the adaptive scaler) is the detector's
  ``net``; default boxes, loss and post-processing stay on the
  :class:`~adaloss.runner.models.ssd.SSDDetector`.
* :class:`LanguageModelTask`: next-token cross-entropy over every position of ``[B, T]`` token windows;
  validation loss (``val_loss``, nats per token, lower is better) and perplexity (``exp(val_loss)``). With
  ``masking`` (``model=hf_bert``) the masked-LM objective instead (:func:`mask_tokens`).

Every task is built from the ``task`` config group's ``_target_`` (``configs/task/``; each dataset config
selects the one its data calls for, ``task=custom task._target_=my_pkg.MyTask`` plugs in a class of the
user's): :func:`build_task`. A task's ``kind`` names the data it trains on; the config's check
(:mod:`adaloss.runner.engine.config`) refuses a bundled model of another kind before anything is built.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaloss.errors import ConfigError
from adaloss.precision import Precision
from adaloss.runner.data import DatasetInfo, detection_collate
from adaloss.runner.engine.evaluate import evaluate
from adaloss.runner.metrics.voc_map import voc07_map
from adaloss.runner.models import GPT, SSDDetector, build_model
from adaloss.runner.models.ssd import lsuv_init_

__all__ = [
    "ClassificationTask",
    "DetectionTask",
    "Evaluation",
    "LanguageModelTask",
    "Task",
    "build_task",
    "mask_tokens",
    "task_class",
]

#: the label of a position the loss does not count (``F.cross_entropy``'s default ``ignore_index``)
IGNORE = -100
#: the seed of the validation masks: the same masking in every evaluation of every run
VALIDATION_MASKS_SEED = 1234


class Evaluation(dict):
    """An evaluation's numbers: ``value`` (the task's metric, %) plus entries for ``metrics.json``."""

    def __init__(self, value: float, **extra: Any) -> None:
        super().__init__(extra)
        self.value = float(value)


class Task(ABC):
    """Interface of a training task. Subclasses set ``metric`` (the ``metrics.json`` key of the test metric),
    ``log_name`` (its W&B name under ``test/``), ``collate_fn``, for a metric where lower is better
    ``lower_is_better``, and ``kind``, the data they train on (``DatasetInfo.task``: ``classification``,
    ``detection``, ``language_model``; None: any), and implement the three abstract methods.

    :func:`build_task` calls the class with ``model`` and ``device``, and with ``info`` (the dataset's
    ``DatasetInfo``) where ``__init__`` takes it; further arguments come from the ``task`` config."""

    kind: str | None = None
    metric: str
    log_name: str
    collate_fn: Callable[[list[Any]], Any] | None = None
    lower_is_better: bool = False

    @property
    def initial_best(self) -> float:
        """The best value before any evaluation (worse than every real one)."""
        return math.inf if self.lower_is_better else 0.0

    def best(self, previous: float, value: float) -> float:
        """The better of the best so far and a new evaluation's value."""
        return min(previous, value) if self.lower_is_better else max(previous, value)

    def summary(self, value: float, best: float) -> dict[str, float]:
        """The ``metrics.json`` entries of the last and the best evaluation."""
        return {self.metric: value, f"best_{self.metric}": best}

    def log_entries(self, value: float, best: float) -> dict[str, float]:
        """What an evaluation logs to W&B."""
        return {f"test/{self.log_name}": value, f"test/best_{self.log_name}": best}

    def describe(self, value: float, best: float | None = None) -> str:
        """The evaluation in a log line: ``test accuracy 97.50% (best 98.00%)``."""
        text = f"test {self.log_name} {value:.2f}%"
        return text if best is None else f"{text} (best {best:.2f}%)"

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model  # the module to train: the scaler attaches to it, the optimizer steps it
        self.device = device

    def example_inputs(self) -> tuple[Any, ...]:
        """A forward call's positional inputs, for ``scaler.attach`` to capture a model torch.fx cannot trace
        (``torch.export``); ``()``: none (the model must trace with fx)."""
        return ()

    @abstractmethod
    def to_device(self, batch: Any) -> Any:
        """``batch`` (as the loader yields it) on ``self.device``."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, Any]:
        """``(loss, outputs)`` of ``model`` on ``batch`` (called under the precision context)."""

    @abstractmethod
    def evaluate(self, model: nn.Module, loader: Iterable[Any], precision: Precision) -> Evaluation:
        """The test metric over ``loader`` (``Evaluation.value``, %), plus entries for ``metrics.json``."""

    def new_window(self) -> _Window:
        return _Window(self.device, with_accuracy=False)

    def initialize(self, train_set: Any) -> None:
        """Data-dependent initialization of the model before training (none by default)."""
        return None  # an explicit no-op hook; DetectionTask overrides it


class ClassificationTask(Task):
    """Cross-entropy on ``(images [B, C, H, W], labels [B])`` batches; top-1 accuracy."""

    kind = "classification"
    metric = "test_accuracy"
    log_name = "accuracy"

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__(model, device)
        self.criterion = nn.CrossEntropyLoss()

    def to_device(self, batch: Any) -> tuple[Tensor, Tensor]:
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = model(x)  # (B, num_classes)
        return self.criterion(logits, y), logits

    def new_window(self) -> _Window:
        return _Window(self.device, with_accuracy=True)

    def evaluate(self, model: nn.Module, loader: Iterable[Any], precision: Precision) -> Evaluation:
        """Top-1 accuracy (%) over ``loader`` (see :func:`adaloss.runner.engine.evaluate.evaluate`)."""
        return Evaluation(evaluate(model, loader, precision, self.device))


class DetectionTask(Task):
    """SSD on ``(images [B, 3, S, S], [target dict, ...])`` batches (``detection_collate``); VOC07 mAP.

    ``model`` is the :class:`~adaloss.runner.models.ssd.SSDDetector` (kept as ``detector``); ``self.model`` is
    its ``net``. ``info``: the dataset's ``DetectionInfo`` (its class names, its image size). ``init``: the
    data-dependent initialization (``model.init``, read by ``configs/task/detection.yaml``). ``ConfigError``
    for a model that is not an SSD detector or expects another image size than the data's.
    """

    kind = "detection"
    metric = "map"
    log_name = "map"
    collate_fn = staticmethod(detection_collate)

    def __init__(self, model: Any, device: torch.device, info: Any, init: str = "default") -> None:
        if not isinstance(model, SSDDetector):
            raise ConfigError(
                f"dataset {info.name} is a detection dataset and needs an SSD detector (model=ssd512 or "
                f"model=ssd300), not a {type(model).__name__}"
            )
        if model.image_size != info.image_size:
            raise ConfigError(
                f"model.image_size={model.image_size} but the dataset's images are {info.image_size} pixels: "
                "set dataset.image_size to the model's (the detection configs interpolate it)"
            )
        super().__init__(model.net, device)
        self.detector = model.to(device)  # the default boxes move with it
        self.class_names = tuple(getattr(info, "class_names", ())) or None
        self.init = init

    def initialize(self, train_set: Any, images: int = 16) -> None:
        """``model.init=lsuv``: rescale the backbone's convolutions to unit output variance on the first
        ``images`` training samples (:func:`adaloss.runner.models.ssd.lsuv_init_`), the from-scratch start a
        detector without batch norm or pretrained weights needs at small input sizes. Reads the samples by
        index (no loader, so the data order is untouched). Cost: a few forward passes per conv on 16 images.
        """
        if self.init != "lsuv":
            return
        batch = torch.stack([train_set[i][0] for i in range(min(images, len(train_set)))]).to(self.device)
        lsuv_init_(self.detector.net.backbone, batch)

    def to_device(self, batch: Any) -> tuple[Tensor, list[dict[str, Tensor]]]:
        images, targets = batch
        moved = [{k: v.to(self.device, non_blocking=True) for k, v in t.items()} for t in targets]
        return images.to(self.device, non_blocking=True), moved

    def loss(self, model: nn.Module, batch: tuple[Tensor, list[dict[str, Tensor]]]) -> tuple[Tensor, Any]:
        images, targets = batch
        outputs = model(images)  # (cls_logits [B, A, C+1], bbox_regression [B, A, 4])
        return self.detector.loss(outputs, targets).total, outputs

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any], precision: Precision) -> Evaluation:
        """VOC2007 11-point mAP (%) at IoU 0.5 over ``loader``, difficult objects ignored; also
        ``ap_per_class``. The forward pass runs in the training format; post-processing (softmax, NMS) and
        the metric in FP32 / NumPy. Cost: one forward pass over the test set, one NMS per image, host-side
        matching (syncs host and device per batch, for the data-dependent detection counts)."""
        was_training = model.training
        model.eval()
        detections: list[dict[str, Any]] = []
        truths: list[dict[str, Any]] = []
        for batch in loader:
            images, targets = self.to_device(batch)
            with precision.autocast():
                outputs = model(images)
            for det in self.detector.postprocess(outputs):
                detections.append({k: v.cpu() for k, v in det.items()})
            truths.extend({k: v.cpu() for k, v in t.items()} for t in targets)
        model.train(was_training)
        result = voc07_map(detections, truths, self.detector.num_classes, class_names=self.class_names)
        return Evaluation(result["map"], ap_per_class=result["ap_per_class"])


class LanguageModelTask(Task):
    """Next-token prediction on ``(x [B, T], y [B, T])`` token windows (``y`` is ``x`` shifted by one).

    The loss is the cross-entropy of the logits ``[B, T, vocab]`` at every position, averaged over the
    ``B * T`` tokens (nats per token). The evaluation is the same mean over the validation windows:
    ``val_loss``, with ``perplexity = exp(val_loss)``; lower is better, so ``best_val_loss`` is the lowest.

    ``masking`` > 0 (a masked LM's ``model.masking``, ``model=hf_bert``): the masked-LM objective. Each
    window ``x`` is masked (:func:`mask_tokens`: that fraction of its positions, ``[MASK]`` being the token
    after the data's vocabulary), ``y`` is ignored, and the loss and ``val_loss`` are the cross-entropy at
    the masked positions alone. The training masks come from torch's default CPU generator (the run's
    ``seed`` seeds it, a checkpoint holds its state: a resumed run draws the masks it would have drawn),
    the validation masks from a generator seeded with :data:`VALIDATION_MASKS_SEED` at every evaluation,
    so ``val_loss`` is comparable across evaluations and runs.
    """

    kind = "language_model"
    metric = "val_loss"
    log_name = "loss"
    lower_is_better = True

    def __init__(
        self, model: nn.Module, device: torch.device, info: Any = None, masking: float = 0.0
    ) -> None:
        """``ConfigError`` for a GPT whose vocabulary or context is smaller than the data's (``info``), for
        masking with a model whose vocabulary has no token after the data's, and for a masked LM without
        masking."""
        if isinstance(model, GPT) and info is not None:
            c = model.config
            if c.vocab_size < info.vocab_size or c.block_size < info.block_size:
                raise ConfigError(
                    f"model vocab_size={c.vocab_size}, block_size={c.block_size} cannot take dataset "
                    f"{info.name}'s vocabulary of {info.vocab_size} and windows of {info.block_size} tokens: "
                    "raise model.vocab_size and model.block_size or leave them unset (they follow the "
                    "dataset)"
                )
        super().__init__(model, device)
        self.block_size = getattr(info, "block_size", None)
        self.masking = float(masking)
        self.mask_id = getattr(info, "vocab_size", None)
        if not self.masking and type(model).__name__.endswith("ForMaskedLM"):  # transformers' naming
            raise ConfigError(
                f"task.masking=0 trains the masked language model {type(model).__name__} to predict the "
                "next token, which its bidirectional attention sees in the input: leave task.masking to "
                "the model's config (model.masking=0.15)"
            )
        if self.masking:
            vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            if self.mask_id is None or (vocab is not None and vocab <= self.mask_id):
                raise ConfigError(
                    f"task.masking={self.masking} needs a masked language model whose vocabulary has a "
                    f"[MASK] token after the data's {self.mask_id} tokens: use model=hf_bert, or "
                    "task.masking=0 for next-token prediction"
                )

    def example_inputs(self) -> tuple[Tensor, ...]:
        """Two windows of token 0 (a Hugging Face model is captured on them: sizes of 1 would be fixed)."""
        return (torch.zeros(2, self.block_size or 2, dtype=torch.long, device=self.device),)

    def to_device(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The inputs and targets on the device; with masking, the masked inputs and their labels (masks
        drawn on the CPU from torch's default generator). No host sync."""
        return self._prepared(batch, torch.default_generator)

    def _prepared(self, batch: Any, masks: torch.Generator) -> tuple[Tensor, Tensor]:
        x, y = batch
        if self.masking:
            x, y = mask_tokens(x, self.masking, self.mask_id, masks)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean cross-entropy over the counted positions (every one, or the masked ones: labels of
        :data:`IGNORE` do not count). No host sync."""
        x, y = batch
        logits = _logits(model(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE), logits

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable[Any], precision: Precision) -> Evaluation:
        """Mean cross-entropy (nats per counted token) over ``loader``, in eval mode and the training
        format (with masking: the same validation masks every time); ``perplexity`` too. Cost: one forward
        pass over the validation windows, one host sync."""
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        masks = torch.Generator().manual_seed(VALIDATION_MASKS_SEED)
        for batch in loader:
            x, y = self._prepared(batch, masks)
            with precision.autocast():
                logits = _logits(model(x))
            flat = logits.flatten(0, 1).float()
            total += F.cross_entropy(flat, y.flatten(), ignore_index=IGNORE, reduction="sum").double()
            tokens += (y != IGNORE).sum()
        model.train(was_training)
        total_, tokens_ = torch.stack([total, tokens]).tolist()
        loss = total_ / max(tokens_, 1.0)
        return Evaluation(loss, perplexity=_perplexity(loss))

    def summary(self, value: float, best: float) -> dict[str, float]:
        return {
            **super().summary(value, best),
            "perplexity": _perplexity(value),
            "best_perplexity": _perplexity(best),
        }

    def log_entries(self, value: float, best: float) -> dict[str, float]:
        return {
            "val/loss": value,
            "val/best_loss": best,
            "val/perplexity": _perplexity(value),
            "val/best_perplexity": _perplexity(best),
        }

    def describe(self, value: float, best: float | None = None) -> str:
        text = f"val loss {value:.4f} (perplexity {_perplexity(value):.2f})"
        return text if best is None else f"{text}, best {best:.4f}"


def mask_tokens(
    x: Tensor, fraction: float, mask_id: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """BERT's masking of token windows ``x [B, T]`` (ids below ``mask_id``): in each window
    ``max(1, round(fraction * T))`` positions drawn at random are chosen; of those, 80% become
    ``mask_id`` (``[MASK]``), 10% a token drawn uniformly from ``[0, mask_id)`` and 10% stay as they are.
    Returns the masked inputs and the labels: the original token at a chosen position, :data:`IGNORE`
    elsewhere. Every draw comes from ``generator`` (on the CPU, ``x``'s device: pass CPU windows), three
    numbers per position in window order, so a window's masking does not depend on how the windows are
    batched. Cost: a sort of ``B x T`` numbers and a few elementwise ops."""
    size, length = x.shape
    u = torch.rand(size, 3, length, generator=generator, device=x.device)
    chosen_count = max(1, round(fraction * length))
    order = u[:, 0].argsort(dim=1)[:, :chosen_count]
    chosen = torch.zeros(size, length, dtype=torch.bool, device=x.device).scatter_(1, order, True)
    labels = torch.where(chosen, x, torch.full_like(x, IGNORE))
    random = (u[:, 2] * mask_id).long().clamp_(max=mask_id - 1)
    inputs = torch.where(chosen & (u[:, 1] < 0.8), torch.full_like(x, mask_id), x)
    inputs = torch.where(chosen & (u[:, 1] >= 0.8) & (u[:, 1] < 0.9), random, inputs)
    return inputs, labels


def _logits(out: Any) -> Tensor:
    """The logits of a language model's output: the tensor itself, or a transformers output's ``logits``."""
    return out if isinstance(out, Tensor) else out.logits


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


_EXAMPLE = "task=custom task._target_=my_pkg.MyTask"


def task_class(task: Any) -> type[Task]:
    """The class a ``task`` config's ``_target_`` names (imported, not built); ``ConfigError`` if it is not
    a :class:`Task`."""
    from adaloss.runner.utils.targets import config_items, locate_target

    path = config_items(task).get("_target_")
    cls = locate_target("task", path, _EXAMPLE)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(
            f"task._target_={path} is not a subclass of adaloss.runner.engine.tasks.Task: "
            "derive your task from it "
            f"(or from ClassificationTask), e.g. {_EXAMPLE}"
        )
    return cls


def build_task(task: Any, model: Any, info: DatasetInfo, device: torch.device) -> Task:
    """The run's task: ``hydra.utils.instantiate`` of the ``task`` node's ``_target_`` (the dataset's config
    selects it: ``task=detection`` for ``dataset=shapes``), called with the model (of the ``model`` node,
    built for the data, on ``device``), ``device`` and the dataset's ``info`` where its ``__init__`` names
    them. Both nodes are built with :func:`adaloss.runner.utils.targets.build_group` (checked by their schema
    there).

    Raises ``ConfigError`` for a task that does not serve the data (``info.task``, as the dataset's builder
    returned it, against the task's ``kind``), and for a model the task cannot train (the task's
    ``__init__``: a classifier on detection data, a GPT too small for the data's vocabulary or context).
    """
    from adaloss.runner.utils.targets import build_group, config_items

    kind, data_kind = task_class(task).kind, getattr(info, "task", "classification")
    if kind is not None and kind != data_kind:
        raise ConfigError(
            f"dataset {info.name} holds {data_kind} data (its DatasetInfo.task) but "
            f"task={config_items(task).get('name')} trains {kind}: choose task={data_kind} (a dataset of "
            "your own selects no task: add it on the command line)"
        )
    module = build_model(
        model,
        info.num_classes,
        input_shape=info.input_shape if all(info.input_shape) else None,  # text has no image shape
        vocab_size=getattr(info, "vocab_size", None),
        block_size=getattr(info, "block_size", None),
    ).to(device)
    return build_group(
        "task", task, example=_EXAMPLE, fill={"model": module, "device": device, "info": info},
        expect=(
            lambda made: isinstance(made, Task),
            f"returned a {{made}}, not an adaloss.runner.engine.tasks.Task: e.g. {_EXAMPLE}",
        ),
    )  # fmt: skip


class _Window:
    """Running train loss (and accuracy) since the last read, on the device so adding never syncs."""

    def __init__(self, device: torch.device, with_accuracy: bool) -> None:
        self.with_accuracy = with_accuracy
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.long, device=device)
        self._seen = 0  # samples (images)
        self._steps = 0

    def add(self, loss: Tensor, outputs: Any, batch: Any) -> None:
        """Add one step: ``loss`` is the batch mean; accuracy counts ``argmax(outputs) == labels``."""
        if self.with_accuracy:
            y = batch[1]
            n = y.numel()
            self._loss += loss.detach().double() * n
            self._correct += (outputs.detach().argmax(dim=1) == y).sum()
        else:
            n = len(batch[1])
            self._loss += loss.detach().double() * n
        self._seen += n
        self._steps += 1

    @staticmethod
    def combined(states: list[dict[str, Any]]) -> dict[str, Any]:
        """One window's saved state (``object_state``) holding the sums of several ranks' saved windows, for
        a run resumed at another world size: a read of it equals the ranks' all-reduced read."""
        out = dict(states[0])
        for key in ("_loss", "_correct", "_seen"):
            out[key] = sum((s[key] for s in states[1:]), states[0][key])
        return out

    def read(self, reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[float, float | None, int]:
        """``(mean loss, accuracy % or None, samples)`` since the last read, then reset. One host sync.

        ``reduce`` (data-parallel runs): sums a float64 tensor over the ranks in place (an all-reduce every
        rank must call at the same read), so the numbers are those of the global batches; ``None``: this
        process's own.
        """
        sums = torch.stack([self._loss, self._correct.double(), self._loss.new_tensor(float(self._seen))])
        if reduce is not None:
            sums = reduce(sums)
        loss, correct, total = sums.tolist()
        samples = int(round(total))
        seen = max(samples, 1)
        accuracy = 100.0 * correct / seen if self.with_accuracy else None
        result = (loss / seen, accuracy, samples)
        self._loss.zero_()
        self._correct.zero_()
        self._seen = 0
        self._steps = 0
        return result
