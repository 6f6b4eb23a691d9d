"""The training engine: ``train(cfg) -> metrics`` builds every part from the config and runs the loop."""

from adaloss.engine.evaluate import evaluate
from adaloss.engine.optim import MultiStepWithWarmup, build_optimizer, build_schedule
from adaloss.engine.trainer import train

__all__ = ["MultiStepWithWarmup", "build_optimizer", "build_schedule", "evaluate", "train"]
