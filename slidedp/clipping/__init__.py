"""Exact gradient clipping that keeps the updates overlapped with the backward.

Speculate, validate, correct (docs/pipeline.md, "Exact clipping without giving up the overlap"):
`schedule` decides, from the partial gradient norm over the chunks in a fixed order, which
chunks are updated at once (speculatively, unclipped) and which wait for the global norm;
`rollback` undoes a speculative AdamW step from the gradient kept for it, so that a step that
must clip (or skip) is corrected exactly to float32 rounding without a backup of the state.
"""

from .schedule import StepNorm, Verdict, clip_coefficient, history_of, norm_order, speculates_after

__all__ = ["StepNorm", "Verdict", "clip_coefficient", "history_of", "norm_order", "speculates_after"]
