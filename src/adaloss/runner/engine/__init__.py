"""The training engine: ``train(cfg) -> metrics`` builds every part from the config and runs the loop;
checkpoints and ``resume=`` (:mod:`adaloss.runner.engine.checkpoint`); divergence and fault injection
(:mod:`adaloss.runner.engine.faults`)."""

from adaloss.runner.engine.checkpoint import CheckpointManager
from adaloss.runner.engine.evaluate import evaluate
from adaloss.runner.engine.faults import TrainingDiverged
from adaloss.runner.engine.optim import MultiStepWithWarmup, WarmupCosine, build_optimizer, build_schedule
from adaloss.runner.engine.trainer import StepCallback, train

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
