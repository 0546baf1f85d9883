"""SlideDP: full-parameter fine-tuning from host memory across the GPUs of one machine."""

__version__ = "0.1.0"
