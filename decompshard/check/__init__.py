"""`decompshard check`: prove `enable()` where users run it.

`sweep.py` runs every derived op's OpInfo samples as real DTensors on simulated meshes
(random placements, forward and backward) with decompshard and with torch's own fallback,
case by case (the engine is `verify/dtensor_case.py`); `model.py` runs one training step of a
user's model sharded as given and names the first op that diverges from one device, and
(`run_training_step`) one training step of a model-zoo model (`zoo.py`: transformers,
torchvision and timm models from tiny configs) on the usual shardings, run case by case
in worker processes by `zoo_run.py`; `command.py` is the CLI.
"""

from decompshard.check.sweep import check_op, check_ops, plan_cases, summarize

__all__ = ["check_op", "check_ops", "plan_cases", "summarize"]
