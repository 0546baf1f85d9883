"""TensorBoard event files for a run (run.tensorboard = true): the step records' scalars.

Written with torch's `SummaryWriter` (it needs the `tensorboard` package, the `tensorboard` extra:
`pip install slidedp[tensorboard]`) under <run dir>/tensorboard; `tensorboard --logdir runs/` shows
every run side by side. W&B reads the same files (`wandb.tensorboard.patch` or `wandb sync`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# metrics.jsonl key -> TensorBoard tag
SCALARS = {"loss": "train/loss", "eval_loss": "eval/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_s": "perf/tokens_per_s", "step_s": "perf/step_s"}


class TensorBoardError(RuntimeError):
    pass


class EventWriter:
    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TensorBoardError(f"run.tensorboard = true needs the tensorboard package ({e}); "
                                   f"install it with `pip install tensorboard` or set run.tensorboard = false") from None
        self.dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.dir))

    def record(self, record: dict[str, Any]) -> None:
        step = record["step"] + 1  # steps completed, as the progress line counts them
        for key, tag in SCALARS.items():
            if record.get(key) is not None:
                self.writer.add_scalar(tag, record[key], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def check_available() -> str | None:
    """Why event files cannot be written here (None when they can)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return "run.tensorboard = true but the tensorboard package is not installed (pip install tensorboard)"
    return None
