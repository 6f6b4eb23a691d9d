"""The training engine: ``train(cfg) -> metrics`` builds every part from the config and runs the loop;
checkpoints and ``resume=`` (:mod:`adaloss.engine.checkpoint`); divergence and fault injection
(:mod:`adaloss.engine.faults`)."""

from adaloss.engine.checkpoint import CheckpointManager
from adaloss.engine.evaluate import evaluate
from adaloss.engine.faults import TrainingDiverged
from adaloss.engine.optim import MultiStepWithWarmup, WarmupCosine, build_optimizer, build_schedule
from adaloss.engine.trainer import StepCallback, train

__all__ = [
    "CheckpointManager",
    "MultiStepWithWarmup",
    "WarmupCosine",
    "StepCallback",
    "TrainingDiverged",
    "build_optimizer",
    "build_schedule",
    "evaluate",
    "train",
]
